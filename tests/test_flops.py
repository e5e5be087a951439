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
