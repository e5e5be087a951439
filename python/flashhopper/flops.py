"""FLOP counts by the FlashAttention convention, the one source of truth for TFLOPS numbers.

Forward: two matmuls (QK^T and PV) of 2*seqlen_q*seqlen_k*headdim FLOPs each per head, i.e.
4*b*h*sq*sk*d, halved for causal (as FA2/FA3 report it, whatever the exact masked count). Backward
counts as 2.5x the forward (five matmuls instead of two).
"""
from __future__ import annotations

from typing import Literal

Mode = Literal["fwd", "bwd", "fwd_bwd"]
_MODE_FACTOR: dict[str, float] = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def attention_flops(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, headdim: int,
                    causal: bool = False, mode: Mode = "fwd") -> float:
    """FLOPs of one attention call; ``nheads`` is the number of query heads."""
    if mode not in _MODE_FACTOR:
        raise ValueError(f"mode must be one of {sorted(_MODE_FACTOR)}, got {mode!r}")
    fwd = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim
    if causal:
        fwd /= 2
    return fwd * _MODE_FACTOR[mode]


def tflops(flops: float, ms: float) -> float:
    """Throughput in TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    if ms <= 0:
        raise ValueError(f"ms must be positive, got {ms}")
    return flops / (ms * 1e-3) / 1e12
