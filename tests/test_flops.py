"""FLOP counts by the FlashAttention convention."""
from __future__ import annotations

import pytest

from flashhopper.flops import attention_flops, tflops


def test_forward() -> None:
    # Two matmuls of 2*s*s*d FLOPs per head: QK^T and PV.
    assert attention_flops(2, 1024, 1024, 16, 128) == 2 * 16 * 2 * (2 * 1024 * 1024 * 128)
    assert attention_flops(1, 100, 300, 1, 64) == 4 * 100 * 300 * 64


def test_causal_halves_and_backward_is_two_and_a_half() -> None:
    full = attention_flops(4, 4096, 4096, 32, 64)
    assert attention_flops(4, 4096, 4096, 32, 64, causal=True) == full / 2
    assert attention_flops(4, 4096, 4096, 32, 64, mode="bwd") == 2.5 * full
    assert attention_flops(4, 4096, 4096, 32, 64, causal=True, mode="fwd_bwd") == 3.5 * full / 2


def test_tflops() -> None:
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert tflops(attention_flops(1, 16384, 16384, 16, 128), 10.0) == pytest.approx(
        4 * 16 * 16384**2 * 128 / 1e-2 / 1e12)
    with pytest.raises(ValueError):
        tflops(1.0, 0.0)
    with pytest.raises(ValueError):
        attention_flops(1, 1, 1, 1, 1, mode="backward")  # type: ignore[arg-type]


@pytest.mark.parametrize(("sq", "sk", "causal", "window"), [(300, 300, True, (64, -1)), (100, 37, False, (5, 3)),
                                                           (37, 100, True, (0, -1)), (50, 50, False, (-1, 4))])
def test_window_counts_visible_pairs(sq: int, sk: int, causal: bool, window: tuple[int, int]) -> None:
    from flashhopper.reference import visible

    pairs = int(visible(sq, sk, causal, window=window).sum())
    assert attention_flops(2, sq, sk, 3, 64, causal, window=window) == 4.0 * 2 * 3 * pairs * 64
    assert attention_flops(2, sq, sk, 3, 64, causal, "bwd", window) == 2.5 * 4.0 * 2 * 3 * pairs * 64
    assert attention_flops(1, 8, 8, 1, 16, True, window=(-1, -1)) == attention_flops(1, 8, 8, 1, 16, True)
