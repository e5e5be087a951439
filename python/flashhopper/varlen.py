"""Packed batches (flash-attn's varlen layout): ``flash_attn_varlen_func``, its ops ``flashhopper::varlen_fwd`` and
``flashhopper::varlen_bwd`` (the forward's derivative).

Sequences of different lengths are packed along one token dimension: q (total_q, nheads_q, headdim), k and v
(total_k, nheads_kv, headdim); sequence b owns the rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q (of which
the first seqused_q[b] are used, when given) and likewise of k and v, and attends within itself only. The
kernels read cu_seqlens on the device: no host synchronization, and a workspace whose size depends on the
batch alone, so a call is CUDA-graph capturable. The ops have fake implementations (torch.compile).
"""
from __future__ import annotations

import os
from typing import Any, Literal, NamedTuple, Optional, overload

import torch

from . import _autocast, _ext, _launch, _op, _plans, dispatch, reference, validation
from .dispatch import ARCH, score_mod_of
from .dropout import from_rng_state, keep_mask, new_rng_state
from .kernel_key import mask_of, normalize_window, window_of
from .ops import (dropout_on, fill_bwd_params, fill_dropout, reference_dropout, register_no_double_backward,
                  window_edges)

# Opt-in checks that read cu_seqlens / seqused on the host (a synchronization per call): for debugging.
DEBUG_ENV = "FLASHHOPPER_DEBUG_VARLEN"


def check_values_here(cu_seqlens: torch.Tensor) -> bool:
    """Whether a call reads cu_seqlens / seqused on the host (validation.check_varlen_values): always for CPU
    tensors, where that costs no synchronization (the reference copies them anyway) and bad values would
    silently give garbage, except while torch.compile traces (symbolic values); on the device, on request."""
    return os.environ.get(DEBUG_ENV) == "1" or (cu_seqlens.device.type == "cpu"
                                                and not torch.compiler.is_compiling())


def _empty_outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    return out, lse


def _varlen_kernel(mode: str, q: torch.Tensor, v: torch.Tensor, causal: bool, window: tuple[int, int] | None,
                   softcap: float, arch: int, dropout: bool = False) -> Any:
    backend = next(b for b, a in ARCH.items() if a == arch)
    key = dispatch._key(backend, q.dtype, q.shape[2], mask_of(causal, window), "", score_mod_of(softcap), v.shape[2],
                        dropout=dropout, varlen=True)
    return dispatch.require_kernel(mode, key)


class VarlenLaunch(NamedTuple):
    """A prepared packed-batch forward (as _plans.Launch for the padded one): ``params`` filled from the tensors'
    metadata, never written after (``_C.fwd_varlen_with`` copies it), the kernel ``index``, the ``arch``, the
    ``batch`` (the Hopper workspace's size) and the device."""

    params: Any
    index: int
    arch: int
    batch: int
    device: torch.device

    def fwd(self, q: int, k: int, v: int, out: int, lse: int, sinks: int, cu_seqlens_q: int, cu_seqlens_k: int,
            seqused_q: int, seqused_k: int) -> int:
        """Launch on these addresses (``data_ptr()``s of contiguous int32 cu_seqlens / seqused; 0: none); returns
        the CTAs launched."""
        C = _ext.extension()
        stream = _launch.stream(self.device)
        # Hopper: any contents (the prepare kernel writes it before the forward reads it), sized by the batch alone;
        # freed after the launch, which the caching allocator orders on this stream. The Ampere kernels need none.
        workspace, counter = 0, 0
        if self.arch == 90:
            ws = torch.empty(int(C.varlen_workspace_bytes(self.batch)), dtype=torch.uint8, device=self.device)
            workspace, counter = ws.data_ptr(), _launch.tile_counter(self.device, stream).data_ptr()
        return int(C.fwd_varlen_with(self.params, self.index, stream, q, k, v, out, lse, counter, sinks, cu_seqlens_q,
                                     cu_seqlens_k, seqused_q, seqused_k, workspace))


def varlen_fwd_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, out: torch.Tensor, softmax_scale: float, causal: bool,
                      window: tuple[int, int] | None, softcap: float, arch: int, dropout_p: float = 0.0,
                      dropout_rng: torch.Tensor | None = None) -> VarlenLaunch:
    """The VarlenLaunch of a packed forward like this one: its kernel (or ValueError saying what to rebuild with)
    and its params from these tensors' metadata; the pointers are each launch's. Checks nothing else."""
    entry = _varlen_kernel("fwd", q, v, causal, window, softcap, arch, dropout_on(dropout_p, dropout_rng))
    p = _ext.extension().FwdParams()
    _launch.fill_strides(p, q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), o=out.unsqueeze(0))
    batch = cu_seqlens_q.shape[0] - 1
    p.batch, p.seqlen_q, p.seqlen_k = batch, max_seqlen_q, max_seqlen_k
    p.total_q, p.total_k = q.shape[0], k.shape[0]
    p.nheads_q, p.nheads_kv, p.headdim, p.headdim_v = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    p.softmax_scale = softmax_scale
    p.window_left, p.window_right = window_edges(causal, window, max_seqlen_q, max_seqlen_k)
    p.softcap = softcap
    fill_dropout(p, dropout_p, dropout_rng)
    _launch.fill_device(p, q)
    p.max_smem_bytes = 0
    return VarlenLaunch(p, entry.index, arch, batch, q.device)


def _ptr(x: torch.Tensor | None) -> int:
    return 0 if x is None else x.data_ptr()


def _launch_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
                       max_seqlen_q: int, max_seqlen_k: int, out: torch.Tensor, lse: torch.Tensor,
                       softmax_scale: float, causal: bool, window: tuple[int, int] | None, softcap: float,
                       sinks: torch.Tensor | None, arch: int, dropout_p: float = 0.0,
                       dropout_rng: torch.Tensor | None = None) -> int:
    launch = varlen_fwd_launch(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, out, softmax_scale, causal, window,
                               softcap, arch, dropout_p, dropout_rng)
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        validation.check_kernel_layout(name, x.unsqueeze(0))
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    seqused_q = None if seqused_q is None else seqused_q.contiguous()
    seqused_k = None if seqused_k is None else seqused_k.contiguous()
    if sinks is not None and not sinks.is_contiguous():
        sinks = sinks.contiguous()
    return launch.fwd(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), _ptr(sinks),
                      cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), _ptr(seqused_q), _ptr(seqused_k))


def varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, seqused_q: Optional[torch.Tensor],  # noqa: UP045
               seqused_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,  # noqa: UP045
               softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
               sinks: Optional[torch.Tensor], deterministic: bool,  # noqa: UP045
               backend: str, dropout_p: float = 0.0,
               dropout_rng: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: UP045
    """Packed-batch attention forward: (out (total_q, nheads_q, headdim_v) like q, lse float32 (nheads_q,
    total_q)); rows in no sequence's used range are left unwritten. Arguments as flash_attn_varlen_func's,
    validated; ``backend`` resolved ("sm90", "sm80" or "reference"); ``deterministic`` is the backward's;
    ``dropout_p`` > 0 with ``dropout_rng`` (int64 (seed, offset) on q's device) as ops.fwd's, sequence b drawing
    as batch entry b (flashhopper.dropout)."""
    out, lse = _empty_outputs(q, v)
    window = window_of(window_left, window_right)
    if backend == "reference":
        dtype = torch.float64 if (not q.is_cuda or q.dtype == torch.float64) else torch.float32
        ref_out, ref_lse = reference.attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                                          seqused_q=seqused_q, seqused_k=seqused_k, window=window,
                                                          softcap=softcap, sinks=sinks,
                                                          dropout=reference_dropout(dropout_p, dropout_rng),
                                                          dtype=dtype)
        out.copy_(ref_out)
        lse.copy_(ref_lse)
    elif backend in ARCH:
        _launch_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                           out, lse, softmax_scale, causal, window, softcap, sinks, ARCH[backend], dropout_p,
                           dropout_rng)
    else:
        raise ValueError(f"backend must be one of {', '.join(map(repr, dispatch.BACKENDS))}, got {backend!r}")
    return out, lse


varlen_fwd_op = _op.define("varlen_fwd", varlen_fwd, autocast=("q", "k", "v"))


@torch.library.register_fake("flashhopper::varlen_fwd")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
      seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], max_seqlen_q: int,  # noqa: UP045
      max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
      sinks: Optional[torch.Tensor], deterministic: bool, backend: str, dropout_p: float = 0.0,  # noqa: UP045
      dropout_rng: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: UP045
    return _empty_outputs(q, v)


# --- backward ---

def _launch_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
                       max_seqlen_q: int, max_seqlen_k: int, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                       softmax_scale: float, causal: bool, window: tuple[int, int] | None, softcap: float,
                       sinks: torch.Tensor | None, dsinks_rows: torch.Tensor | None, deterministic: bool,
                       arch: int, dropout_p: float = 0.0, dropout_rng: torch.Tensor | None = None) -> int:
    """The arch-``arch`` packed-batch backward into dq, dk, dv (each like its input, kernel strides); lse, dlse and
    dsinks_rows (with sinks: each row's share of d(sinks)) float32 (nheads_q, total_q) contiguous."""
    entry = _varlen_kernel("bwd", q, v, causal, window, softcap, arch, dropout_on(dropout_p, dropout_rng))
    views = {name: x.unsqueeze(0) for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout),
                                                  ("dq", dq), ("dk", dk), ("dv", dv))}
    for name, x in views.items():
        validation.check_kernel_layout(name, x)
    for name, x in (("lse", lse), ("dlse", dlse), ("dsinks_rows", dsinks_rows)):
        if x is not None and (x.shape != (q.shape[1], q.shape[0]) or x.dtype != torch.float32 or not x.is_contiguous()):
            raise ValueError(f"{name} must be float32 contiguous of shape {(q.shape[1], q.shape[0])}, got "
                             f"{tuple(x.shape)} {x.dtype}")
    if sinks is not None and not sinks.is_contiguous():
        sinks = sinks.contiguous()
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    seqused_q = None if seqused_q is None else seqused_q.contiguous()
    seqused_k = None if seqused_k is None else seqused_k.contiguous()
    C = _ext.extension()
    p = fill_bwd_params(_launch.params("BwdParams"), views["dout"], views["q"], views["k"], views["v"], views["out"],
                        lse, dlse, views["dq"], views["dk"], views["dv"], softmax_scale, deterministic,
                        window_edges(causal, window, max_seqlen_q, max_seqlen_k), 0, softcap, sinks, dsinks_rows,
                        dropout_p, dropout_rng)
    p.batch, p.seqlen_q, p.seqlen_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
    p.total_q, p.total_k = q.shape[0], k.shape[0]
    p.cu_seqlens_q, p.cu_seqlens_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
    p.seqused_q = 0 if seqused_q is None else seqused_q.data_ptr()
    p.seqused_k = 0 if seqused_k is None else seqused_k.data_ptr()
    _launch.fill_device(p, q)
    p.max_smem_bytes = 0
    # Scratch as in the padded backward (ops._launch_bwd), sized by the batch and the total tokens alone.
    workspace = torch.empty(C.bwd_workspace_bytes(p, entry.index), dtype=torch.uint8, device=q.device)
    p.workspace = workspace.data_ptr()
    return int(C.bwd(p, entry.index, _launch.stream(q.device)))


def _empty_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_q: torch.Tensor | None,
                 seqused_k: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Rows past a slot's seqused get no gradient from the kernels: zeros there (a memset) keep autograd exact.
    def make(x: torch.Tensor, zero: bool) -> torch.Tensor:
        return (torch.zeros if zero else torch.empty)(x.shape, dtype=x.dtype, device=x.device)
    return make(q, seqused_q is not None), make(k, seqused_k is not None), make(v, seqused_k is not None)


def _empty_dsinks(q: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    return torch.empty((q.shape[1] if sinks is not None else 0,), dtype=torch.float32, device=q.device)


def varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor,  # noqa: UP045
               cu_seqlens_k: torch.Tensor, seqused_q: Optional[torch.Tensor],  # noqa: UP045
               seqused_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,  # noqa: UP045
               softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
               sinks: Optional[torch.Tensor], deterministic: bool,  # noqa: UP045
               backend: str, dropout_p: float = 0.0, dropout_rng: Optional[torch.Tensor] = None,  # noqa: UP045
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed-batch attention backward: (dq, dk, dv, dsinks), each gradient like its input (contiguous), dsinks
    float32 (nheads_q,) (empty without sinks). ``out`` and ``lse`` are varlen_fwd's, ``dout`` the gradient w.r.t.
    out, ``dlse`` w.r.t. lse or None; the rest (dropout: the forward's p and state) as varlen_fwd's. Rows of no
    sequence: zero gradients past a slot's seqused; past cu_seqlens[-1], as in flash-attn, unwritten (the kernels;
    the reference writes zeros)."""
    dq, dk, dv = _empty_grads(q, k, v, seqused_q, seqused_k)
    dsinks = _empty_dsinks(q, sinks)
    window = window_of(window_left, window_right)
    if backend == "reference":
        # The explicit formula per sequence, in float64 on the CPU (float32 on the GPU).
        dtype = torch.float64 if (not q.is_cuda or q.dtype == torch.float64) else torch.float32
        ref = reference.attention_varlen_bwd_ref(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                                                 causal, dlse, seqused_q=seqused_q, seqused_k=seqused_k,
                                                 window=window, softcap=softcap, sinks=sinks,
                                                 dropout=reference_dropout(dropout_p, dropout_rng), dtype=dtype)
        for g, r in zip((dq, dk, dv), ref):
            g.copy_(r)
        if sinks is not None:
            dsinks.copy_(ref[3])
    elif backend in ARCH:
        # Each row's share of d(sinks) from the preprocess kernel (zeros on rows of no sequence), summed here.
        rows = None if sinks is None else torch.zeros_like(lse)
        _launch_varlen_bwd(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                           max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window, softcap, sinks,
                           rows, deterministic, ARCH[backend], dropout_p, dropout_rng)
        if rows is not None:
            torch.sum(rows, dim=1, out=dsinks)
    else:
        raise ValueError(f"backend must be one of {', '.join(map(repr, dispatch.BACKENDS))}, got {backend!r}")
    return dq, dk, dv, dsinks


# Nothing cast (as ops.bwd): the forward's inputs in the dtypes it ran in.
varlen_bwd_op = _op.define("varlen_bwd", varlen_bwd, autocast=())


@torch.library.register_fake("flashhopper::varlen_bwd")
def _(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
      dlse: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,  # noqa: UP045
      seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], max_seqlen_q: int,  # noqa: UP045
      max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
      sinks: Optional[torch.Tensor], deterministic: bool, backend: str, dropout_p: float = 0.0,  # noqa: UP045
      dropout_rng: Optional[torch.Tensor] = None,  # noqa: UP045
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (*_empty_grads(q, k, v, seqused_q, seqused_k), _empty_dsinks(q, sinks))


# --- autograd: varlen_fwd's derivative is varlen_bwd ---

_FWD_INPUTS = 19  # q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
#                   softmax_scale, causal, window_left, window_right, softcap, sinks, deterministic, backend,
#                   dropout_p, dropout_rng


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, scale, causal, left, right, softcap, sinks, deterministic,
     backend, dropout_p, dropout_rng) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used_q, used_k, sinks, dropout_rng)
    ctx.args = (max_q, max_k, scale, causal, left, right, softcap)
    ctx.dropout_p = dropout_p
    ctx.deterministic, ctx.backend = deterministic, backend
    ctx.set_materialize_grads(False)  # an unused lse costs nothing (as ops._setup_context)


def _backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:
    def grads(dq: Any, dk: Any, dv: Any, dsinks: Any) -> tuple[Any, ...]:
        return (dq, dk, dv, *([None] * 11), dsinks, None, None, None, None)

    if dout is None and dlse is None:
        return grads(None, None, None, None)
    q, k, v, out, lse, cu_q, cu_k, used_q, used_k, sinks, dropout_rng = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    elif ctx.backend != "reference" and not validation.kernel_layout_ok(dout.unsqueeze(0)):
        dout = dout.clone(memory_format=torch.contiguous_format)  # TMA-compatible memory (see ops._backward)
    if dlse is not None:
        dlse = dlse.contiguous()
    sinks = sinks if ctx.needs_input_grad[14] else None  # lse holds them: only their own gradient needs them
    dq, dk, dv, dsinks = torch.ops.flashhopper.varlen_bwd.default(dout, q, k, v, out, lse, dlse, cu_q, cu_k, used_q,
                                                                  used_k, *ctx.args, sinks, ctx.deterministic,
                                                                  ctx.backend, ctx.dropout_p, dropout_rng)
    return grads(dq, dk, dv, dsinks if sinks is not None else None)


torch.library.register_autograd("flashhopper::varlen_fwd", _backward, setup_context=_setup_context)


register_no_double_backward("varlen_bwd")


@overload
def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float | None = ..., causal: bool = ...,
                           seqused_q: torch.Tensor | None = ..., seqused_k: torch.Tensor | None = ...,
                           return_lse: Literal[False] = ..., deterministic: bool = ..., backend: str | None = ...,
                           window_size: tuple[int, int] = ..., softcap: float = ...,
                           sinks: torch.Tensor | None = ..., dropout_p: float = ...,
                           generator: torch.Generator | None = ...,
                           return_dropout_mask: Literal[False] = ...) -> torch.Tensor: ...


@overload
def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float | None = ..., causal: bool = ...,
                           seqused_q: torch.Tensor | None = ..., seqused_k: torch.Tensor | None = ..., *,
                           return_lse: Literal[True], deterministic: bool = ..., backend: str | None = ...,
                           window_size: tuple[int, int] = ..., softcap: float = ...,
                           sinks: torch.Tensor | None = ..., dropout_p: float = ...,
                           generator: torch.Generator | None = ...,
                           return_dropout_mask: Literal[False] = ...) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float | None = ..., causal: bool = ...,
                           seqused_q: torch.Tensor | None = ..., seqused_k: torch.Tensor | None = ...,
                           return_lse: bool = ..., deterministic: bool = ..., backend: str | None = ...,
                           window_size: tuple[int, int] = ..., softcap: float = ...,
                           sinks: torch.Tensor | None = ..., dropout_p: float = ...,
                           generator: torch.Generator | None = ..., *,
                           return_dropout_mask: Literal[True]) -> tuple[torch.Tensor, ...]: ...


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float | None = None, causal: bool = False,
                           seqused_q: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
                           return_lse: bool = False, deterministic: bool = False, backend: str | None = None,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           sinks: torch.Tensor | None = None, dropout_p: float = 0.0,
                           generator: torch.Generator | None = None,
                           return_dropout_mask: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Exact attention over a packed batch of sequences of different lengths (flash-attn's varlen call).

    q: (total_q, nheads_q, headdim); k, v: (total_k, nheads_kv, headdim) (grouped-query attention as in
    flash_attn_func); cu_seqlens_q / cu_seqlens_k: int32 (batch + 1,) on q's device, sequence b owning rows
    [cu_seqlens[b], cu_seqlens[b + 1]); seqused_q / seqused_k: optional int32 (batch,), the tokens of each
    slot in use (the rest of the slot is ignored); max_seqlen_q / max_seqlen_k: Python ints, the longest
    sequence (flash-attn's arguments; the kernels bound their work by cu_seqlens on the device). Each
    sequence attends within itself only, causal bottom-right aligned per sequence; window_size, softcap,
    sinks, dropout_p and generator as in flash_attn_func (dropout: sequence b draws as batch entry b of
    flashhopper.dropout's definition, its rows and keys counted from its own first token).

    Returns out (total_q, nheads_q, headdim_v) like q, or (out, lse) with lse float32 (nheads_q, total_q);
    rows in no sequence's used range (past seqused, or past cu_seqlens_q[-1]) are left unwritten.
    return_dropout_mask=True appends the bool keep mask (batch, nheads_q, max_seqlen_q, max_seqlen_k),
    sequence b's in [b, :, :its queries, :its keys] (all True with dropout_p = 0), for tests.

    No host synchronization: cu_seqlens and seqused stay on the device, and checks that would need their
    values (non-decreasing, within the tensors, within max_seqlen) run on CUDA tensors only with the environment
    variable FLASHHOPPER_DEBUG_VARLEN=1; on CPU tensors they always run (max_seqlen_q must be at least the
    longest sequence: the Ampere kernels' grid follows it, and the backward's on both families). CPU tensors (or
    backend='reference') run the per-sequence reference, differentiable through torch's autograd. The kernels'
    derivative is the packed-batch backward (Hopper sm90, Ampere sm80): gradients w.r.t. q, k, v and sinks, bitwise
    reproducible with ``deterministic=True``. Gradients of rows past a slot's seqused are 0; of rows past
    cu_seqlens[-1], as in flash-attn, left unwritten."""
    if _autocast.enabled():
        q, k, v = _autocast.cast(q, k, v)
    key = _call_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, seqused_q,
                    seqused_k, return_lse, deterministic, backend, window_size, softcap, sinks, dropout_p, generator,
                    return_dropout_mask)
    if key is not None:  # a configuration that passed everything below before: launch it straight (_plans)
        launch = _PLANS.get(key)
        ptrs = None if launch is None or _plans.needs_grad(q, k, v, sinks) else _plans.pointers(q, k, v)
        if ptrs is not None:
            out, lse = _empty_outputs(q, v)
            launch.fwd(*ptrs, out.data_ptr(), lse.data_ptr(), _ptr(sinks), cu_seqlens_q.data_ptr(),
                       cu_seqlens_k.data_ptr(), _ptr(seqused_q), _ptr(seqused_k))
            return (out, lse) if return_lse else out
    shapes, scale = validation.check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   seqused_q, seqused_k, softmax_scale, causal)
    validation.check_flag("return_lse", return_lse)
    validation.check_flag("deterministic", deterministic)
    window = validation.check_window_size(window_size)
    softcap = validation.check_softcap(softcap)
    validation.check_sinks(sinks, q.unsqueeze(0))
    dropout_p = validation.check_dropout_p(dropout_p)
    validation.check_generator(generator, q)
    validation.check_flag("return_dropout_mask", return_dropout_mask)
    causal, window = normalize_window(causal, window)
    dropout = dropout_p > 0
    if check_values_here(cu_seqlens_q):
        validation.check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                       seqused_k)
    name = dispatch.resolve_backend(q, shapes.headdim, q.dtype, causal, backend, window=window, softcap=softcap,
                                    headdim_v=shapes.headdim_v, dropout=dropout, varlen=True)
    rng = new_rng_state(q.device, generator) if dropout else None
    if name == "reference":  # differentiable through torch's own ops
        dtype = torch.float64 if (not q.is_cuda or q.dtype == torch.float64) else torch.float32
        out, lse = reference.attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal,
                                                  seqused_q=seqused_q, seqused_k=seqused_k, window=window,
                                                  softcap=softcap, sinks=sinks,
                                                  dropout=None if rng is None else from_rng_state(dropout_p, rng),
                                                  dtype=dtype)
        out, lse = out.to(q.dtype), lse.float()
    else:
        dispatch.require_bwd_kernel(name, q, k, v, shapes.headdim, causal, window=window, sinks=sinks, softcap=softcap,
                                    dropout=dropout, varlen=True)
        left, right = (-1, -1) if window is None else window
        extra = () if rng is None else (dropout_p, rng)  # the op's schema defaults: none on the common path
        out, lse = varlen_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                 max_seqlen_k, scale, causal, left, right, softcap, sinks, deterministic, name, *extra)
        if key is not None and rng is None and name in ARCH and q.is_cuda:
            _PLANS.put(key, varlen_fwd_launch(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, out, scale, causal,
                                              window, softcap, ARCH[name]))
    result = (out, lse) if return_lse else (out,)
    if return_dropout_mask:
        batch, hq = cu_seqlens_q.shape[0] - 1, q.shape[1]
        mask = (keep_mask(from_rng_state(dropout_p, rng), batch, hq, max_seqlen_q, max_seqlen_k, q.device)
                if rng is not None else
                torch.ones((batch, hq, max_seqlen_q, max_seqlen_k), dtype=torch.bool, device=q.device))
        result = (*result, mask)
    return result if len(result) > 1 else result[0]


# flash_attn_varlen_func's configurations that took the full path once (_plans): call key -> VarlenLaunch.
_PLANS = _plans.Plans()


def _call_key(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any,
              softmax_scale: Any, causal: Any, seqused_q: Any, seqused_k: Any, return_lse: Any, deterministic: Any,
              backend: Any, window_size: Any, softcap: Any, sinks: Any, dropout_p: Any, generator: Any,
              return_dropout_mask: Any) -> tuple[Any, ...] | None:
    """flash_attn_varlen_func's call key for the fast path (as interface._call_key): every argument validation and
    dispatch read. None for a call that must take the full path: dropout (a seed per call), the debug checks of
    cu_seqlens' values (FLASHHOPPER_DEBUG_VARLEN), index tensors the launch would have to copy (not contiguous:
    the key holds strides, so such a call never stores a plan either), see also _plans.direct."""
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    optional = (seqused_q, seqused_k, sinks)
    if (any(type(x) is not torch.Tensor for x in tensors)
            or any(x is not None and (type(x) is not torch.Tensor or not x.is_contiguous()) for x in optional)
            or not (cu_seqlens_q.is_contiguous() and cu_seqlens_k.is_contiguous())
            or type(dropout_p) not in (float, int) or dropout_p != 0 or generator is not None
            or return_dropout_mask is not False or type(window_size) is not tuple
            or os.environ.get(DEBUG_ENV) == "1" or not _plans.direct()):
        return None
    return (*map(_plans.meta, tensors), *(None if x is None else _plans.meta(x) for x in optional),
            _plans.scalars(max_seqlen_q, max_seqlen_k, softmax_scale, causal, return_lse, deterministic, backend,
                           softcap, dropout_p, *window_size))
