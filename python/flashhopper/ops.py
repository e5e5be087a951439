"""The torch op ``flashhopper::fwd`` and the launch of the compiled kernels.

The op is a ``torch.library.custom_op`` with a fake (meta) implementation, so torch.compile traces
it as one opaque node (no graph break). It trusts its shape-level inputs (``flash_attn_func``
validated them); the memory-layout checks need real data pointers, so they run here, right before
the launch. No autograd formula is registered: the backward is not written yet, and torch then
refuses to differentiate through the op instead of returning wrong gradients.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from . import _device, _ext, reference, validation
from .dispatch import ARCH

_local = threading.local()  # one reusable FwdParams per thread: every field is rewritten per call
_c_dtypes: dict[torch.dtype, Any] = {}
_tile_counters: dict[tuple[int, int], torch.Tensor] = {}


def _c_dtype(dtype: torch.dtype) -> Any:
    if not _c_dtypes:
        C = _ext.extension()
        _c_dtypes.update({torch.float16: C.DType.float16, torch.bfloat16: C.DType.bfloat16})
    try:
        return _c_dtypes[dtype]
    except KeyError:
        validation.check_kernel_dtype("q", dtype)
        raise


def tile_counter(index: int, stream: int) -> torch.Tensor:
    """The int32 counter causal kernels take tiles from: zeroed once, left at zero by every launch,
    one per (device, stream) so that launches on two streams never share one."""
    c = _tile_counters.get((index, stream))
    if c is None:
        c = _tile_counters[(index, stream)] = torch.zeros(1, dtype=torch.int32, device=torch.device("cuda", index))
    return c


def fill_params(p: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, softmax_scale: float, causal: bool, counter: int = 0) -> Any:
    """Write pointers, strides (in elements) and sizes of these tensors into a ``_C.FwdParams``;
    ``counter`` is the address of the tile counter (causal kernels need one)."""
    b, sq, hq, d = q.shape
    p.q_ptr, p.k_ptr, p.v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
    p.o_ptr, p.lse_ptr, p.tile_counter = out.data_ptr(), lse.data_ptr(), counter
    p.q_batch_stride, p.q_row_stride, p.q_head_stride = validation.kernel_strides(q)
    p.k_batch_stride, p.k_row_stride, p.k_head_stride = validation.kernel_strides(k)
    p.v_batch_stride, p.v_row_stride, p.v_head_stride = validation.kernel_strides(v)
    p.o_batch_stride, p.o_row_stride, p.o_head_stride = validation.kernel_strides(out)
    p.batch, p.seqlen_q, p.seqlen_k = b, sq, k.shape[1]
    p.nheads_q, p.nheads_kv, p.headdim = hq, k.shape[2], d
    p.softmax_scale = softmax_scale
    p.causal = causal
    p.dtype = _c_dtype(q.dtype)
    if q.is_cuda:
        p.device = q.device.index
        p.num_sms = _device.device_info(q.device.index).num_sms
    return p


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
            softmax_scale: float, causal: bool, arch: int) -> None:
    if out.numel() == 0:  # batch, seqlen_q or nheads 0: nothing to compute
        return
    if k.shape[1] == 0:  # no keys at all: every row is a row with no key
        out.zero_()
        lse.fill_(float("-inf"))
        return
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        validation.check_kernel_layout(name, x)
    C = _ext.extension()
    p = getattr(_local, "params", None)
    if p is None:
        p = _local.params = C.FwdParams()
    index = q.device.index
    stream = torch.cuda.current_stream(index).cuda_stream
    counter = tile_counter(index, stream).data_ptr() if causal else 0
    fill_params(p, q, k, v, out, lse, softmax_scale, causal, counter)
    C.fwd(p, arch, stream)  # switches to p.device for the launch and back


def fwd_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             softmax_scale: float, causal: bool, arch: int) -> None:
    """Run the arch-``arch`` (90 or 80) forward kernel, writing into caller-provided ``out`` (like q)
    and ``lse`` (float32, contiguous (batch, nheads_q, seqlen_q)). Checks everything first; tests use
    it to poison the outputs before a run."""
    shapes, _ = validation.check_inputs(q, k, v, softmax_scale, causal)
    if not q.is_cuda:
        raise ValueError(f"q is on {q.device}; the flashhopper kernels need CUDA tensors")
    validation.check_kernel_dtype("q", q.dtype)
    validation.check_kernel_headdim(shapes.headdim)
    validation.check_outputs(q, out, lse)
    _launch(q, k, v, out, lse, softmax_scale, causal, arch)


def _reference_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    softmax_scale: float, causal: bool) -> None:
    # float64 where it is cheap (CPU) or asked for; float32 on the GPU, where float64 is slow.
    dtype = torch.float64 if (not q.is_cuda or q.dtype == torch.float64) else torch.float32
    ref_out, ref_lse = reference.attention_ref(q, k, v, softmax_scale, causal, dtype=dtype)
    out.copy_(ref_out)
    lse.copy_(ref_lse)


def _empty_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, sq, hq, d = q.shape
    # Always contiguous, in the real and the fake implementation alike, so compiled graphs see the
    # strides they will get.
    out = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.custom_op("flashhopper::fwd", mutates_args=())
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
        backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward: (out like q, lse float32 (batch, nheads_q, seqlen_q)). ``backend`` is one
    of "sm90", "sm80", "reference" (already resolved; see dispatch.select_backend)."""
    out, lse = _empty_outputs(q)
    if backend == "reference":
        _reference_into(q, k, v, out, lse, softmax_scale, causal)
    elif backend in ARCH:
        _launch(q, k, v, out, lse, softmax_scale, causal, ARCH[backend])
    else:
        raise ValueError(f"backend must be one of 'sm90', 'sm80', 'reference', got {backend!r}")
    return out, lse


@fwd.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
      backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _empty_outputs(q)
