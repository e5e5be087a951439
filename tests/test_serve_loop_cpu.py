"""bench/serve_loop.py's bookkeeping on the CPU (the reference paths): prompts prefilled through the packed call and
written into pages by append_kvcache, decode steps with sequences finishing and joining, the float32 check. The CUDA
pieces it times with (events, streams) are stood in for; its kernels and graphs run on the device only."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


class _Event:
    def __init__(self, **_: object) -> None:
        self.t = 0.0

    def record(self, *_: object) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: _Event) -> float:
        return (other.t - self.t) * 1e3


class _Stream:
    def wait_stream(self, *_: object) -> None:
        pass


@pytest.fixture
def serve_loop(monkeypatch: pytest.MonkeyPatch) -> object:
    for name, value in (("Event", _Event), ("Stream", _Stream), ("current_stream", lambda *_: _Stream()),
                        ("stream", lambda _: contextlib.nullcontext()), ("synchronize", lambda *_: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    spec = importlib.util.spec_from_file_location("serve_loop", ROOT / "bench" / "serve_loop.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "serve_loop", module)  # (its dataclass looks its module up)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    module.DEVICE = "cpu"
    return module


@pytest.mark.parametrize("kind, limit", [("bf16", 1e-2), ("fp8", 0.3)])  # fp8: e4m3's error with outlier channels
def test_loop_on_the_reference(serve_loop: object, kind: str, limit: float) -> None:
    args = argparse.Namespace(pages=0, page_size=16, heads_q=8, heads_kv=2, headdim=64, max_batch=4, steps=30, seed=0,
                              prompt_lens=(16, 80), gen_lens=(4, 20), cache_dtype=kind, no_graph=True,
                              hadamard_seed=None, check_every=10, check_slots=4, json=None)
    row = serve_loop.run(args, kind, False)  # type: ignore[attr-defined]
    assert row["finished"] > 0 and row["decode_tokens"] == 30 * 4  # slots freed and refilled, every slot decoding
    assert row["rel_err"] < limit and row["prefill_xcheck"] < limit  # the pages hold what the prefill wrote
