"""The public entry point: validation -> dispatch -> op."""
from __future__ import annotations

from typing import Any, Literal, overload

import torch

from . import _autocast, _plans, ops  # ops: registers the ops flashhopper::fwd / bwd and fwd's autograd
from .dispatch import ARCH, require_bwd_kernel, resolve_backend
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
    key = _call_key(q, k, v, softmax_scale, causal, return_lse, backend, deterministic, window_size, softcap, sinks,
                    dropout_p, generator, return_dropout_mask)
    if key is not None:  # a configuration that passed everything below before: launch it straight (_plans)
        launch = _PLANS.get(key)
        ptrs = None if launch is None or _plans.needs_grad(q, k, v, sinks) else _plans.pointers(q, k, v)
        if ptrs is not None:
            out, lse = ops.empty_outputs(q, v)
            launch.fwd(*ptrs, out.data_ptr(), lse.data_ptr(), 0 if sinks is None else sinks.data_ptr())
            return (out, lse) if return_lse else out
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
        if key is not None and name in ARCH and q.is_cuda and (sinks is None or sinks.is_contiguous()):
            _PLANS.put(key, ops.fwd_launch(q, k, v, out, lse, scale, causal, window, ARCH[name], softcap=softcap,
                                           sinks=sinks))
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


# flash_attn_func's configurations that took the full path once (_plans): call key -> Launch.
_PLANS = _plans.Plans()


def _call_key(q: Any, k: Any, v: Any, softmax_scale: Any, causal: Any, return_lse: Any, backend: Any,
              deterministic: Any, window_size: Any, softcap: Any, sinks: Any, dropout_p: Any, generator: Any,
              return_dropout_mask: Any) -> tuple[Any, ...] | None:
    """flash_attn_func's call key for the fast path: every argument its validation and dispatch read (_plans);
    None for a call that must take the full path (dropout draws a seed per call; see _plans.direct)."""
    if (type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor
            or (sinks is not None and type(sinks) is not torch.Tensor)
            or type(dropout_p) not in (float, int) or dropout_p != 0 or generator is not None
            or return_dropout_mask is not False or type(window_size) is not tuple or not _plans.direct()):
        return None
    return (_plans.meta(q), _plans.meta(k), _plans.meta(v), None if sinks is None else _plans.meta(sinks),
            _plans.scalars(softmax_scale, causal, return_lse, backend, deterministic, softcap, dropout_p, *window_size))
