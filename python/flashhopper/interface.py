"""The public entry point: validation -> dispatch -> op."""
from __future__ import annotations

from typing import Literal, overload

import torch

from . import _autocast, ops  # noqa: F401  (ops: registers the ops flashhopper::fwd / bwd and fwd's autograd)
from .dispatch import require_bwd_kernel, resolve_backend
from .dropout import from_rng_state, keep_mask, new_rng_state
from .kernel_key import normalize_window
from .validation import (check_dropout_p, check_flag, check_generator, check_inputs, check_sinks, check_softcap,
                         check_window_size)


@overload
def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = ...,
                    causal: bool = ..., return_lse: Literal[False] = ..., backend: str | None = ...,
                    deterministic: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                    sinks: torch.Tensor | None = ..., dropout_p: float = ..., generator: torch.Generator | None = ...,
                    return_dropout_mask: Literal[False] = ...) -> torch.Tensor: ...


@overload
def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = ...,
                    causal: bool = ..., *, return_lse: Literal[True], backend: str | None = ...,
                    deterministic: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                    sinks: torch.Tensor | None = ..., dropout_p: float = ..., generator: torch.Generator | None = ...,
                    return_dropout_mask: Literal[False] = ...) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = ...,
                    causal: bool = ..., return_lse: bool = ..., backend: str | None = ...,
                    deterministic: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                    sinks: torch.Tensor | None = ..., dropout_p: float = ..., generator: torch.Generator | None = ...,
                    *, return_dropout_mask: Literal[True]) -> tuple[torch.Tensor, ...]: ...


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                    causal: bool = False, return_lse: bool = False, backend: str | None = None,
                    deterministic: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    sinks: torch.Tensor | None = None, dropout_p: float = 0.0, generator: torch.Generator | None = None,
                    return_dropout_mask: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Exact softmax attention, flash-attn layout, differentiable.

    q: (batch, seqlen_q, nheads_q, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), with
    nheads_q a multiple of nheads_kv (grouped-query attention); v may have a head dim of its own (the
    kernels: Q/K 192 with V 128, Q/K 128 with V 64), which out then has. softmax_scale defaults to
    1/sqrt(headdim). causal masks bottom-right aligned: row i sees key j iff j <= i + seqlen_k - seqlen_q;
    a row that sees no key gets zeros (and lse -inf, or its sink with sinks).
    backend: None picks the fastest compiled kernel for the device (CPU tensors use the reference);
    "sm90", "sm80" or "reference" force one, raising ValueError if it cannot run.

    Model variants, as in flash-attn:
    - window_size=(left, right): local (sliding-window) attention, row i sees key j iff
      i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, -1 = unbounded on that
      side; with causal the right edge is 0. Key blocks outside the window are skipped, so the time
      follows the window, not the sequence. (-1, -1) is plain attention.
    - softcap=c > 0 (Gemma 2): the scaled scores s become c * tanh(s / c) before the softmax.
    - sinks: float32 tensor (nheads_q,) of learnable sink logits (gpt-oss): each row's softmax
      denominator gets exp(sink) added with no value, out = sum_j exp(s_j) v_j / (exp(sink) + sum_j
      exp(s_j)); lse includes it. Differentiable: sinks.grad comes from the same backward.
    - dropout_p > 0 (training; pass 0 in eval, as with flash-attn): each probability of P is dropped
      with probability dropout_p (rounded to a multiple of 1/256) after the softmax and the kept ones
      scaled by 1 / keep probability, fused into the kernels (flashhopper.dropout defines which: a
      Philox counter of (seed, offset) and the score's position). The (seed, offset) are drawn on q's
      device from ``generator`` (None: the device's default generator, so torch.manual_seed makes a run
      repeatable) by a device op, as torch's own random ops draw (CUDA graph replays included); the
      backward regenerates the same mask.
      lse is not affected by dropout. return_dropout_mask=True appends the bool keep mask (batch,
      nheads_q, seqlen_q, seqlen_k), computed from the definition (for tests: memory of the full
      matrix, and a host read of the seed).

    Returns out (like q, with v's head dim), or (out, lse) with lse float32 (batch, nheads_q, seqlen_q), natural log;
    with return_dropout_mask, the keep mask after them.

    Gradients: autograd (and torch.compile) differentiates through it, w.r.t. q, k, v (and sinks),
    through out and lse alike, with the backward kernel of the same backend (dk/dv of a kv head sum
    over its query-head group). deterministic=True makes those gradients bitwise identical from run to
    run (at some speed cost); the forward is deterministic either way. When grad mode is on and q, k or v
    requires grad, a kernel backend without a compiled backward for this configuration raises
    ValueError here, before the forward runs (saying what to rebuild with).

    Autocast, as for SDPA: under ``torch.autocast("cuda")``, q, k and v on CUDA that are float32,
    float16 or bfloat16 are cast to the autocast dtype first, so the kernel of that dtype runs and out
    comes back in it (lse and sinks stay float32); the cast is differentiable, so a float32 leaf gets a
    float32 gradient. float64 and CPU tensors are left as they are (CUDA autocast does not apply to them).
    """
    if _autocast.enabled():  # the dtype picks the kernel: cast before validation and dispatch
        q, k, v = _autocast.cast(q, k, v)
    shapes, scale = check_inputs(q, k, v, softmax_scale, causal)
    check_flag("return_lse", return_lse)
    check_flag("deterministic", deterministic)
    window = check_window_size(window_size)
    softcap = check_softcap(softcap)
    check_sinks(sinks, q)
    dropout_p = check_dropout_p(dropout_p)
    check_generator(generator, q)
    check_flag("return_dropout_mask", return_dropout_mask)
    causal, window = normalize_window(causal, window)
    dropout = dropout_p > 0
    name = resolve_backend(q, shapes.headdim, q.dtype, causal, backend, window=window, softcap=softcap,
                           headdim_v=shapes.headdim_v, dropout=dropout)
    require_bwd_kernel(name, q, k, v, shapes.headdim, causal, window=window, sinks=sinks, softcap=softcap,
                       dropout=dropout)
    left, right = (-1, -1) if window is None else window
    if not dropout:  # the op's schema defaults: no dropout arguments on the common path
        out, lse = torch.ops.flashhopper.fwd.default(q, k, v, scale, causal, left, right, softcap, sinks,
                                                     deterministic, name)
        rng = None
    else:
        rng = new_rng_state(q.device, generator)
        out, lse = torch.ops.flashhopper.fwd.default(q, k, v, scale, causal, left, right, softcap, sinks,
                                                     deterministic, name, dropout_p, rng)
    result = (out, lse) if return_lse else (out,)
    if return_dropout_mask:
        b, sq, hq, _ = q.shape
        mask = (keep_mask(from_rng_state(dropout_p, rng), b, hq, sq, k.shape[1], q.device) if rng is not None
                else torch.ones((b, hq, sq, k.shape[1]), dtype=torch.bool, device=q.device))
        result = (*result, mask)
    return result if len(result) > 1 else result[0]
