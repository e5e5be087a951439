"""FLOP counts by the FlashAttention convention, the one source of truth for TFLOPS numbers.

Forward: two matmuls (QK^T and PV) of 2*seqlen_q*seqlen_k*headdim FLOPs each per head, i.e.
4*b*h*sq*sk*d, halved for causal (as FA2/FA3 report it, whatever the exact masked count). Backward
counts as 2.5x the forward (five matmuls instead of two). A local window (flash-attn's window_size)
counts the (query, key) pairs it visits exactly, as FA3's benchmark does: a window's work is its width,
not the sequence's.
"""
from __future__ import annotations

from typing import Literal

Mode = Literal["fwd", "bwd", "fwd_bwd"]
_MODE_FACTOR: dict[str, float] = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int] | None) -> int:
    """(query row, key) pairs that take part: row i sees keys j with i + d - left <= j <= i + d + right,
    0 <= j < seqlen_k, d = seqlen_k - seqlen_q (-1: unbounded; causal: right = 0)."""
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    diag = seqlen_k - seqlen_q
    total = 0
    for i in range(seqlen_q):
        lo = 0 if left < 0 else max(0, i + diag - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, i + diag + right)
        total += max(0, hi - lo + 1)
    return total


def attention_flops(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, headdim: int,
                    causal: bool = False, mode: Mode = "fwd", window: tuple[int, int] | None = None,
                    headdim_v: int | None = None) -> float:
    """FLOPs of one attention call; ``nheads`` is the number of query heads. 2 * (headdim + headdim_v)
    per score (QK^T and PV; headdim_v defaults to headdim: the FA convention's 4 * headdim). With
    ``window`` (not (-1, -1)), per visited pair (visible_pairs) instead of the causal convention."""
    if mode not in _MODE_FACTOR:
        raise ValueError(f"mode must be one of {sorted(_MODE_FACTOR)}, got {mode!r}")
    per_score = 2.0 * (headdim + (headdim if headdim_v is None else headdim_v))
    if window is not None and tuple(window) != (-1, -1):
        fwd = batch * nheads * visible_pairs(seqlen_q, seqlen_k, causal, window) * per_score
        return fwd * _MODE_FACTOR[mode]
    fwd = batch * nheads * seqlen_q * seqlen_k * per_score
    if causal:
        fwd /= 2
    return fwd * _MODE_FACTOR[mode]


def tflops(flops: float, ms: float) -> float:
    """Throughput in TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    if ms <= 0:
        raise ValueError(f"ms must be positive, got {ms}")
    return flops / (ms * 1e-3) / 1e12
