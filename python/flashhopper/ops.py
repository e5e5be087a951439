"""The torch ops ``flashhopper::fwd`` and ``flashhopper::bwd`` and the launch of the compiled kernels.

Each op is a ``torch.library.custom_op`` with a fake (meta) implementation, so torch.compile traces
it as one opaque node (no graph break). They trust their shape-level inputs (``flash_attn_func``
validated them); the memory-layout checks need real data pointers, so they run here, right before
the launch. ``fwd``'s autograd formula (registered at the bottom) calls ``bwd`` with the backend
that ran the forward, so a compiled forward + backward is two ops in the joint graph.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from . import _device, _ext, reference, validation
from .dispatch import ARCH

_local = threading.local()  # one reusable FwdParams / BwdParams per thread: every field is rewritten per call
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


def _fill_strides(p: Any, **tensors: torch.Tensor) -> None:
    """p.<name>_batch_stride / _row_stride / _head_stride (in elements) of each named tensor."""
    for name, x in tensors.items():
        for what, stride in zip(("batch", "row", "head"), validation.kernel_strides(x)):
            setattr(p, f"{name}_{what}_stride", stride)


def fill_params(p: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, softmax_scale: float, causal: bool, counter: int = 0) -> Any:
    """Write pointers, strides (in elements) and sizes of these tensors into a ``_C.FwdParams``;
    ``counter`` is the address of the tile counter (causal kernels need one)."""
    b, sq, hq, d = q.shape
    p.q_ptr, p.k_ptr, p.v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
    p.o_ptr, p.lse_ptr, p.tile_counter = out.data_ptr(), lse.data_ptr(), counter
    _fill_strides(p, q=q, k=k, v=v, o=out)
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
            softmax_scale: float, causal: bool, arch: int, max_smem_bytes: int = 0) -> None:
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
    p.max_smem_bytes = max_smem_bytes
    C.fwd(p, arch, stream)  # switches to p.device for the launch and back


def _check_max_smem_bytes(max_smem_bytes: int) -> None:
    if not isinstance(max_smem_bytes, int) or isinstance(max_smem_bytes, bool) or max_smem_bytes < 0:
        raise ValueError(f"max_smem_bytes must be a non-negative int, got {max_smem_bytes!r}")


def fwd_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             softmax_scale: float, causal: bool, arch: int, *, max_smem_bytes: int = 0) -> None:
    """Run the arch-``arch`` (90 or 80) forward kernel, writing into caller-provided ``out`` (like q)
    and ``lse`` (float32, contiguous (batch, nheads_q, seqlen_q)). Checks everything first; tests use
    it to poison the outputs before a run. ``max_smem_bytes`` as in bwd_into (sm80 tiles)."""
    shapes, _ = validation.check_inputs(q, k, v, softmax_scale, causal)
    if not q.is_cuda:
        raise ValueError(f"q is on {q.device}; the flashhopper kernels need CUDA tensors")
    validation.check_kernel_dtype("q", q.dtype)
    validation.check_kernel_headdim(shapes.headdim)
    validation.check_outputs(q, out, lse)
    _check_max_smem_bytes(max_smem_bytes)
    _launch(q, k, v, out, lse, softmax_scale, causal, arch, max_smem_bytes)


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
        deterministic: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward: (out like q, lse float32 (batch, nheads_q, seqlen_q)). ``backend`` is one
    of "sm90", "sm80", "reference" (already resolved; see dispatch.select_backend). ``deterministic``
    does not change the forward (it is deterministic anyway); autograd keeps it for the backward."""
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
      deterministic: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _empty_outputs(q)


# --- backward ---

def fill_bwd_params(p: Any, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None, dq: torch.Tensor,
                    dk: torch.Tensor, dv: torch.Tensor, softmax_scale: float, causal: bool,
                    deterministic: bool, workspace: int = 0) -> Any:
    """Write pointers, strides (in elements) and sizes of these tensors into a ``_C.BwdParams``;
    ``dlse`` None is a null pointer (no gradient w.r.t. lse), ``workspace`` the scratch address."""
    b, sq, hq, d = q.shape
    p.q_ptr, p.k_ptr, p.v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
    p.o_ptr, p.do_ptr, p.lse_ptr = out.data_ptr(), dout.data_ptr(), lse.data_ptr()
    p.dlse_ptr = 0 if dlse is None else dlse.data_ptr()
    p.dq_ptr, p.dk_ptr, p.dv_ptr = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    p.workspace = workspace
    _fill_strides(p, q=q, k=k, v=v, o=out, do=dout, dq=dq, dk=dk, dv=dv)
    p.batch, p.seqlen_q, p.seqlen_k = b, sq, k.shape[1]
    p.nheads_q, p.nheads_kv, p.headdim = hq, k.shape[2], d
    p.softmax_scale = softmax_scale
    p.causal = causal
    p.deterministic = deterministic
    p.dtype = _c_dtype(q.dtype)
    if q.is_cuda:
        p.device = q.device.index
        p.num_sms = _device.device_info(q.device.index).num_sms
    return p


def _launch_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, dlse: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor,
                dv: torch.Tensor, softmax_scale: float, causal: bool, deterministic: bool, arch: int,
                max_smem_bytes: int = 0) -> None:
    if q.numel() == 0 or k.numel() == 0:
        # No query rows (or no keys, or no heads): every gradient is an empty sum, 0. zero_ on the
        # empty ones is a no-op; the others (dk, dv without queries; dq without keys) are real.
        for g in (dq, dk, dv):
            g.zero_()
        return
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
        validation.check_kernel_layout(name, x)
    validation.check_lse("lse", lse, q)
    if dlse is not None:
        validation.check_lse("dlse", dlse, q)
    C = _ext.extension()
    p = getattr(_local, "bwd_params", None)
    if p is None:
        p = _local.bwd_params = C.BwdParams()
    fill_bwd_params(p, dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, causal, deterministic)
    p.max_smem_bytes = max_smem_bytes
    # Scratch (the fp32 dQ accumulator, per-row statistics, semaphores), fresh per call: two launches
    # must never share it. Allocated and freed on the stream the kernels run on, so the caching
    # allocator hands it to no one else before they finish; its blocks are 512-byte aligned.
    nbytes = C.bwd_workspace_bytes(p, arch)
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=q.device) if nbytes > 0 else None
    p.workspace = 0 if workspace is None else workspace.data_ptr()
    stream = torch.cuda.current_stream(q.device.index).cuda_stream
    C.bwd(p, arch, stream)  # preprocess, main kernel, postprocess; switches to p.device and back


def bwd_into(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, softmax_scale: float,
             causal: bool, deterministic: bool, arch: int, dlse: torch.Tensor | None = None, *,
             max_smem_bytes: int = 0) -> None:
    """Run the arch-``arch`` (90 or 80) backward, writing into caller-provided ``dq``, ``dk``, ``dv``
    (each like its input; any valid kernel strides). ``out`` and ``lse`` are the forward's (see
    fwd_into), ``dout`` the gradient w.r.t. out, ``dlse`` (optional, float32 like lse) the gradient
    w.r.t. lse. Checks everything first; tests use it to poison the gradients before a run.
    ``max_smem_bytes`` (sm80 only; 0 = the device's limit) picks the sm80 tiles as on a GPU with that
    much shared memory per block: tests run the 99 KB tiles of sm_86/sm_89 with it."""
    shapes, _ = validation.check_inputs(q, k, v, softmax_scale, causal)
    validation.check_flag("deterministic", deterministic)
    if not q.is_cuda:
        raise ValueError(f"q is on {q.device}; the flashhopper kernels need CUDA tensors")
    validation.check_kernel_dtype("q", q.dtype)
    validation.check_kernel_headdim(shapes.headdim)
    validation.check_outputs(q, out, lse)
    validation.check_dout(dout, out)
    if dlse is not None:
        validation.check_lse("dlse", dlse, q)
    validation.check_grads(q, k, v, dq, dk, dv)
    _check_max_smem_bytes(max_smem_bytes)
    _launch_bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, causal, deterministic, arch,
                max_smem_bytes)


def _reference_bwd_into(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, dlse: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor,
                        dv: torch.Tensor, softmax_scale: float, causal: bool) -> None:
    # As _reference_into: float64 on CPU (or for float64 inputs), float32 on the GPU.
    dtype = torch.float64 if (not q.is_cuda or q.dtype == torch.float64) else torch.float32
    grads = reference.attention_bwd_ref(dout, q, k, v, out, lse, softmax_scale, causal, dlse, dtype=dtype)
    for g, ref in zip((dq, dk, dv), grads):
        g.copy_(ref)


def _empty_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Contiguous whatever the inputs' strides (packed qkv views included), in the real and the fake
    # implementation alike.
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))  # type: ignore[return-value]


# Optional[...], not "| None": the op's schema is inferred from these annotations.
@torch.library.custom_op("flashhopper::bwd", mutates_args=())
def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, dlse: Optional[torch.Tensor], softmax_scale: float, causal: bool,  # noqa: UP045
        deterministic: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: (dq, dk, dv), each like its input, contiguous. ``out`` and ``lse`` are the
    forward's outputs, ``dout`` the gradient w.r.t. out, ``dlse`` the gradient w.r.t. lse or None.
    ``deterministic``: bitwise-identical gradients from run to run (kernels; the reference always is)."""
    dq, dk, dv = _empty_grads(q, k, v)
    if backend == "reference":
        _reference_bwd_into(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, causal)
    elif backend in ARCH:
        _launch_bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, causal, deterministic, ARCH[backend])
    else:
        raise ValueError(f"backend must be one of 'sm90', 'sm80', 'reference', got {backend!r}")
    return dq, dk, dv


@bwd.register_fake
def _(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
      lse: torch.Tensor, dlse: Optional[torch.Tensor], softmax_scale: float, causal: bool,  # noqa: UP045
      deterministic: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _empty_grads(q, k, v)


# --- autograd: fwd's derivative is bwd ---

def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, softmax_scale, causal, deterministic, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.backend = softmax_scale, causal, deterministic, backend
    # An unused output's gradient arrives as None instead of a tensor of zeros: an unused lse (the
    # usual case) then costs the kernel nothing (dlse_ptr = 0) and no memory.
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:
    nones = (None,) * 4  # softmax_scale, causal, deterministic, backend
    if dout is None and dlse is None:
        return (None, None, None, *nones)
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    elif ctx.backend != "reference" and not validation.kernel_layout_ok(dout):
        # Autograd hands over whatever the next op produced, e.g. out.sum()'s stride-0 ones; the
        # kernels need TMA-compatible memory. (A fresh copy: .contiguous() keeps a misaligned offset.)
        dout = dout.clone(memory_format=torch.contiguous_format)
    if dlse is not None:
        dlse = dlse.contiguous()  # the kernels read it densely, like lse (lse.sum() gives stride 0)
    dq, dk, dv = torch.ops.flashhopper.bwd.default(dout, q, k, v, out, lse, dlse, ctx.softmax_scale, ctx.causal,
                                                   ctx.deterministic, ctx.backend)
    return (dq, dk, dv, *nones)


torch.library.register_autograd("flashhopper::fwd", _backward, setup_context=_setup_context)
