"""bench/bench_varlen.py's pure helpers on the CPU: the padding overhead its mixed rows report for cuDNN SDPA's
batch padded to the longest document."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_varlen", ROOT / "bench" / "bench_varlen.py")
bench_varlen = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(bench_varlen)  # type: ignore[union-attr]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_padding_overhead(causal: bool, mode: str) -> None:
    # Padded to 256: 2 x 256^2 scores against 128^2 + 256^2 real ones (the ratio is the same for every
    # head count, head dim, mask and mode: the FLOP convention scales them all alike).
    got = bench_varlen.padding_overhead([128, 256], 16, 128, causal, mode)
    assert got["padded_tokens"] == 512 and got["real_tokens"] == 384
    assert got["padded_flops_ratio"] == pytest.approx(2 * 256**2 / (128**2 + 256**2))


def test_no_padding_costs_nothing() -> None:
    got = bench_varlen.padding_overhead([300] * 4, 8, 64, True)
    assert got == {"padded_tokens": 1200, "real_tokens": 1200, "padded_flops_ratio": 1.0}
