"""The torch ops ``flashhopper::fwd`` and ``flashhopper::bwd`` and the launch of the compiled kernels.

Each op (defined through ``_op.define``) has a fake (meta) implementation, so torch.compile traces
it as one opaque node (no graph break). They trust their shape-level inputs (``flash_attn_func``
validated them); the memory-layout checks need real data pointers, so they run here, right before
the launch. ``fwd``'s autograd formula (registered at the bottom) calls ``bwd`` with the backend
that ran the forward, so a compiled forward + backward is two ops in the joint graph.

The kernel is the build's entry for the call's KernelKey (dispatch.kernel_key); the launchers take
empty inputs themselves (they return the CTAs launched, 0 for an empty grid), so nothing here
special-cases them.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import _ext, _launch, _op, dispatch, reference, validation
from ._plans import Launch
from .dropout import Dropout, from_rng_state
from .dispatch import ARCH
from .kernel_key import mask_of, window_of

_BACKEND_OF_ARCH: dict[int, str] = {a: b for b, a in ARCH.items()}


def window_edges(causal: bool, window: tuple[int, int] | None, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(window_left, window_right) as the params take them, -1 unbounded: (-1, -1) unless the mask is
    "window" (only those kernels read them). With causal the right edge is min(right, 0), i.e. 0 (a
    right edge is -1 or >= 0). An edge that reaches past every key is as good as unbounded and is
    capped at seqlen_q + seqlen_k, so that the kernels' 32-bit edge arithmetic cannot overflow."""
    if window is None or mask_of(causal, window) != "window":
        return -1, -1
    left, right = window
    if causal:
        right = 0
    cap = seqlen_q + seqlen_k
    return (left if left < 0 else min(left, cap)), (right if right < 0 else min(right, cap))


def dropout_on(dropout_p: float, dropout_rng: torch.Tensor | None) -> bool:
    """Whether a call drops scores: p > 0 with its (seed, offset) state (flash_attn_func draws one then)."""
    return dropout_p > 0 and dropout_rng is not None


def fill_dropout(p: Any, dropout_p: float, dropout_rng: torch.Tensor | None) -> None:
    on = dropout_on(dropout_p, dropout_rng)
    p.dropout_threshold = Dropout(dropout_p, 0, 0).threshold() if on else 0
    p.dropout_rng = dropout_rng.data_ptr() if on else 0  # type: ignore[union-attr]


def reference_dropout(dropout_p: float, dropout_rng: torch.Tensor | None) -> Dropout | None:
    return from_rng_state(dropout_p, dropout_rng) if dropout_on(dropout_p, dropout_rng) else None  # type: ignore[arg-type]


def fill_params(p: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                softmax_scale: float, edges: tuple[int, int] = (-1, -1), counter: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None, dropout_p: float = 0.0, dropout_rng: torch.Tensor | None = None) -> Any:
    """Write pointers, strides (in elements), sizes, window edges (window_edges), softcap, sinks and dropout of
    these tensors into a ``_C.FwdParams``; ``counter`` is the address of the tile counter (0: none)."""
    b, sq, hq, d = q.shape
    p.q_ptr, p.k_ptr, p.v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
    p.o_ptr, p.lse_ptr, p.tile_counter = out.data_ptr(), lse.data_ptr(), counter
    _launch.fill_strides(p, q=q, k=k, v=v, o=out)
    p.batch, p.seqlen_q, p.seqlen_k = b, sq, k.shape[1]
    p.nheads_q, p.nheads_kv, p.headdim, p.headdim_v = hq, k.shape[2], d, v.shape[3]
    p.softmax_scale = softmax_scale
    p.window_left, p.window_right = edges
    p.softcap, p.sinks_ptr = softcap, (0 if sinks is None else sinks.data_ptr())
    fill_dropout(p, dropout_p, dropout_rng)
    return p


def fwd_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               softmax_scale: float, causal: bool, window: tuple[int, int] | None, arch: int, variant: str = "",
               max_smem_bytes: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
               dropout_p: float = 0.0, dropout_rng: torch.Tensor | None = None) -> Launch:
    """The Launch (_plans) of a forward like this one: its kernel, or ValueError saying what to rebuild with, and
    its params, filled from these tensors' metadata (the pointers are each launch's). Checks nothing else."""
    key = dispatch.kernel_key(_BACKEND_OF_ARCH[arch], q.dtype, q.shape[3], causal, window, variant, softcap,
                              v.shape[3], dropout_on(dropout_p, dropout_rng))
    entry = dispatch.require_kernel("fwd", key)
    p = fill_params(_ext.extension().FwdParams(), q, k, v, out, lse, softmax_scale,
                    window_edges(causal, window, q.shape[1], k.shape[1]), 0, softcap, sinks, dropout_p, dropout_rng)
    _launch.fill_device(p, q)
    p.max_smem_bytes = max_smem_bytes
    # Masks with a right edge schedule tiles dynamically from a counter; MaskKind none needs none.
    return Launch(p, entry.index, key.mask != "none", q.device)


def _launch_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                softmax_scale: float, causal: bool, window: tuple[int, int] | None, arch: int, variant: str = "",
                max_smem_bytes: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                dropout_p: float = 0.0, dropout_rng: torch.Tensor | None = None) -> int:
    if sinks is not None and not sinks.is_contiguous():
        sinks = sinks.contiguous()
    launch = fwd_launch(q, k, v, out, lse, softmax_scale, causal, window, arch, variant, max_smem_bytes, softcap, sinks,
                        dropout_p, dropout_rng)
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        validation.check_kernel_layout(name, x)
    rng = dropout_rng.data_ptr() if dropout_on(dropout_p, dropout_rng) else 0  # type: ignore[union-attr]
    # _C.fwd_with switches to the launch's device and back.
    return launch.fwd(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                      0 if sinks is None else sinks.data_ptr(), rng)


def fwd_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             softmax_scale: float, causal: bool, arch: int, *, window: tuple[int, int] | None = None,
             variant: str = "", max_smem_bytes: int = 0, softcap: float = 0.0,
             sinks: torch.Tensor | None = None, dropout_p: float = 0.0, dropout_rng: torch.Tensor | None = None) -> int:
    """Run the arch-``arch`` (90 or 80) forward kernel, writing into caller-provided ``out`` (like q)
    and ``lse`` (float32, contiguous (batch, nheads_q, seqlen_q)). ``window``: flash-attn's (left,
    right), -1 unbounded (with causal, the right edge is 0); ``variant``: a named kernel variant of the
    build ("" = production); ``softcap``, ``sinks`` as in flash_attn_func; ``dropout_p`` with ``dropout_rng``
    (flashhopper.dropout.new_rng_state) drops scores as flashhopper.dropout defines. Checks everything first;
    tests use it to poison the outputs before a run.
    ``max_smem_bytes`` as in bwd_into (sm80 tiles). Returns the CTAs launched (0: an empty grid, e.g.
    batch or seqlen_q 0; with seqlen_k 0 the kernel still runs and writes out = 0, lse = -inf or the sink)."""
    shapes, _ = validation.check_inputs(q, k, v, softmax_scale, causal)
    window = validation.check_window(window)
    softcap = validation.check_softcap(softcap)
    validation.check_sinks(sinks, q)
    dropout_p = validation.check_dropout_p(dropout_p)
    if dropout_rng is not None:
        validation.check_dropout_rng(dropout_rng, q)
    validation.check_variant(variant)
    validation.check_arch(arch, tuple(ARCH.values()))
    if not q.is_cuda:
        raise ValueError(f"q is on {q.device}; the flashhopper kernels need CUDA tensors")
    validation.check_kernel_dtype("q", q.dtype)
    validation.check_kernel_headdim(shapes.headdim, shapes.headdim_v)
    validation.check_outputs(q, out, lse, v)
    validation.check_max_smem_bytes(max_smem_bytes)
    return _launch_fwd(q, k, v, out, lse, softmax_scale, causal, window, arch, variant, max_smem_bytes, softcap,
                       sinks, dropout_p, dropout_rng)


def _reference_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    softmax_scale: float, causal: bool, window: tuple[int, int] | None, softcap: float,
                    sinks: torch.Tensor | None, dropout: Dropout | None = None) -> None:
    # float64 where it is cheap (CPU) or asked for; float32 on the GPU, where float64 is slow.
    dtype = torch.float64 if (not q.is_cuda or q.dtype == torch.float64) else torch.float32
    ref_out, ref_lse = reference.attention_ref(q, k, v, softmax_scale, causal, window=window, softcap=softcap,
                                               sinks=sinks, dropout=dropout, dtype=dtype)
    out.copy_(ref_out)
    lse.copy_(ref_lse)


def empty_outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, sq, hq, _ = q.shape
    # Always contiguous, in the real and the fake implementation alike, so compiled graphs see the
    # strides they will get. out has v's head dim.
    out = q.new_empty((b, sq, hq, v.shape[3]))  # (new_empty: a third less host time than torch.empty)
    lse = q.new_empty((b, hq, sq), dtype=torch.float32)
    return out, lse


def _unknown_backend(backend: str) -> ValueError:
    return ValueError(f"backend must be one of {', '.join(map(repr, dispatch.BACKENDS))}, got {backend!r}")


def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, window_left: int,
        window_right: int, softcap: float, sinks: Optional[torch.Tensor], deterministic: bool,  # noqa: UP045
        backend: str, dropout_p: float = 0.0,
        dropout_rng: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: UP045
    """Attention forward: (out like q with v's head dim, lse float32 (batch, nheads_q, seqlen_q)). ``window_left``,
    ``window_right``: flash-attn's local window, -1 unbounded ((-1, -1): none); ``softcap`` (0: off) and
    ``sinks`` (float32 (nheads_q,) or None) as in flash_attn_func. ``backend`` is one of
    "sm90", "sm80", "reference" (already resolved; see dispatch.select_backend). ``deterministic``
    does not change the forward (it is deterministic anyway); autograd keeps it for the backward.
    ``dropout_p`` > 0 with ``dropout_rng`` (int64 (seed, offset) on q's device) drops scores of P
    (flashhopper.dropout); the backward takes the same two."""
    out, lse = empty_outputs(q, v)
    window = window_of(window_left, window_right)
    if backend == "reference":
        _reference_into(q, k, v, out, lse, softmax_scale, causal, window, softcap, sinks,
                        reference_dropout(dropout_p, dropout_rng))
    elif backend in ARCH:
        _launch_fwd(q, k, v, out, lse, softmax_scale, causal, window, ARCH[backend], softcap=softcap, sinks=sinks,
                    dropout_p=dropout_p, dropout_rng=dropout_rng)
    else:
        raise _unknown_backend(backend)
    return out, lse


# Under CUDA autocast q, k and v run in the autocast dtype, as SDPA's do.
fwd_op = _op.define("fwd", fwd, autocast=("q", "k", "v"))


@torch.library.register_fake("flashhopper::fwd")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, window_left: int,
      window_right: int, softcap: float, sinks: Optional[torch.Tensor], deterministic: bool,  # noqa: UP045
      backend: str, dropout_p: float = 0.0,
      dropout_rng: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: UP045
    return empty_outputs(q, v)


# --- backward ---

def fill_bwd_params(p: Any, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None, dq: torch.Tensor,
                    dk: torch.Tensor, dv: torch.Tensor, softmax_scale: float, deterministic: bool,
                    edges: tuple[int, int] = (-1, -1), workspace: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None, dsinks_rows: torch.Tensor | None = None,
                    dropout_p: float = 0.0, dropout_rng: torch.Tensor | None = None) -> Any:
    """Write pointers, strides (in elements), sizes, window edges, softcap and dropout of these tensors into a
    ``_C.BwdParams``; ``dlse`` None is a null pointer (no gradient w.r.t. lse), ``workspace`` the
    scratch address; with ``sinks``, ``dsinks_rows`` (float32 (batch, nheads_q, seqlen_q)) receives each
    row's share of the sinks' gradient."""
    b, sq, hq, d = q.shape
    p.q_ptr, p.k_ptr, p.v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
    p.o_ptr, p.do_ptr, p.lse_ptr = out.data_ptr(), dout.data_ptr(), lse.data_ptr()
    p.dlse_ptr = 0 if dlse is None else dlse.data_ptr()
    p.dq_ptr, p.dk_ptr, p.dv_ptr = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    p.workspace = workspace
    _launch.fill_strides(p, q=q, k=k, v=v, o=out, do=dout, dq=dq, dk=dk, dv=dv)
    p.batch, p.seqlen_q, p.seqlen_k = b, sq, k.shape[1]
    p.nheads_q, p.nheads_kv, p.headdim, p.headdim_v = hq, k.shape[2], d, v.shape[3]
    p.softmax_scale = softmax_scale
    p.window_left, p.window_right = edges
    p.deterministic = deterministic
    p.softcap = softcap
    p.sinks_ptr = 0 if sinks is None else sinks.data_ptr()
    p.dsinks_rows_ptr = 0 if dsinks_rows is None else dsinks_rows.data_ptr()
    fill_dropout(p, dropout_p, dropout_rng)
    return p


def _launch_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, dlse: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor,
                dv: torch.Tensor, softmax_scale: float, causal: bool, window: tuple[int, int] | None,
                deterministic: bool, arch: int, variant: str = "", max_smem_bytes: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None, dsinks_rows: torch.Tensor | None = None,
                dropout_p: float = 0.0, dropout_rng: torch.Tensor | None = None) -> int:
    key = dispatch.kernel_key(_BACKEND_OF_ARCH[arch], q.dtype, q.shape[3], causal, window, variant, softcap,
                              v.shape[3], dropout_on(dropout_p, dropout_rng))
    entry = dispatch.require_kernel("bwd", key)
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
        validation.check_kernel_layout(name, x)
    validation.check_lse("lse", lse, q)
    if dlse is not None:
        validation.check_lse("dlse", dlse, q)
    C = _ext.extension()
    if sinks is not None and not sinks.is_contiguous():
        sinks = sinks.contiguous()
    p = fill_bwd_params(_launch.params("BwdParams"), dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale,
                        deterministic, window_edges(causal, window, q.shape[1], k.shape[1]), 0, softcap,
                        sinks, dsinks_rows, dropout_p, dropout_rng)
    _launch.fill_device(p, q)
    p.max_smem_bytes = max_smem_bytes
    # Scratch (the fp32 dQ accumulator, per-row statistics, semaphores), fresh per call: two launches
    # must never share it. Allocated and freed on the stream the kernels run on, so the caching
    # allocator hands it to no one else before they finish; its blocks are 512-byte aligned. Every
    # configuration needs some (the dQ postprocess's ticket at least), empty inputs included.
    workspace = torch.empty(C.bwd_workspace_bytes(p, entry.index), dtype=torch.uint8, device=q.device)
    p.workspace = workspace.data_ptr()
    # Preprocess, main kernel, postprocess; switches to p.device and back. Returns the main kernel's CTAs.
    return int(C.bwd(p, entry.index, _launch.stream(q.device)))


def bwd_into(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, softmax_scale: float,
             causal: bool, deterministic: bool, arch: int, dlse: torch.Tensor | None = None, *,
             window: tuple[int, int] | None = None, variant: str = "", max_smem_bytes: int = 0,
             softcap: float = 0.0, sinks: torch.Tensor | None = None, dsinks_rows: torch.Tensor | None = None,
             dropout_p: float = 0.0, dropout_rng: torch.Tensor | None = None) -> int:
    """Run the arch-``arch`` (90 or 80) backward, writing into caller-provided ``dq``, ``dk``, ``dv``
    (each like its input; any valid kernel strides). ``out`` and ``lse`` are the forward's (see
    fwd_into), ``dout`` the gradient w.r.t. out, ``dlse`` (optional, float32 like lse) the gradient
    w.r.t. lse; ``window``, ``variant``, ``softcap``, ``sinks`` and dropout as in fwd_into; with sinks,
    ``dsinks_rows`` (float32, contiguous (batch, nheads_q, seqlen_q)) receives each row's share of the
    sinks' gradient (sum it over batch and rows). Checks everything first; tests use it to
    poison the gradients before a run. ``max_smem_bytes`` (sm80 only; 0 = the device's limit) picks
    the sm80 tiles as on a GPU with that much shared memory per block: tests run the 99 KB tiles of
    sm_86/sm_89 with it. Returns the main kernel's CTAs (0: no key block or an empty batch; with
    seqlen_k 0 the dQ postprocess still writes dq = 0)."""
    shapes, _ = validation.check_inputs(q, k, v, softmax_scale, causal)
    validation.check_flag("deterministic", deterministic)
    window = validation.check_window(window)
    validation.check_variant(variant)
    validation.check_arch(arch, tuple(ARCH.values()))
    if not q.is_cuda:
        raise ValueError(f"q is on {q.device}; the flashhopper kernels need CUDA tensors")
    validation.check_kernel_dtype("q", q.dtype)
    validation.check_kernel_headdim(shapes.headdim, shapes.headdim_v)
    validation.check_outputs(q, out, lse, v)
    validation.check_dout(dout, out)
    if dlse is not None:
        validation.check_lse("dlse", dlse, q)
    validation.check_grads(q, k, v, dq, dk, dv)
    validation.check_max_smem_bytes(max_smem_bytes)
    softcap = validation.check_softcap(softcap)
    validation.check_sinks(sinks, q)
    if (sinks is None) != (dsinks_rows is None):
        raise ValueError("dsinks_rows must be given exactly when sinks is")
    if dsinks_rows is not None:
        validation.check_lse("dsinks_rows", dsinks_rows, q)
    dropout_p = validation.check_dropout_p(dropout_p)
    if dropout_rng is not None:
        validation.check_dropout_rng(dropout_rng, q)
    return _launch_bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, causal, window, deterministic,
                       arch, variant, max_smem_bytes, softcap, sinks, dsinks_rows, dropout_p, dropout_rng)


def _reference_bwd_into(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, dlse: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor,
                        dv: torch.Tensor, softmax_scale: float, causal: bool, window: tuple[int, int] | None,
                        softcap: float, sinks: torch.Tensor | None, dsinks: torch.Tensor,
                        dropout: Dropout | None = None) -> None:
    # As _reference_into: float64 on CPU (or for float64 inputs), float32 on the GPU.
    dtype = torch.float64 if (not q.is_cuda or q.dtype == torch.float64) else torch.float32
    grads = reference.attention_bwd_ref(dout, q, k, v, out, lse, softmax_scale, causal, dlse, window=window,
                                        softcap=softcap, dropout=dropout, dtype=dtype)
    for g, ref in zip((dq, dk, dv), grads):
        g.copy_(ref)
    if sinks is not None:
        dsinks.copy_(reference.sinks_grad_ref(dout, out, lse, sinks, dlse, dtype=dtype))


def _empty_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Contiguous whatever the inputs' strides (packed qkv views included), in the real and the fake
    # implementation alike.
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))  # type: ignore[return-value]


def _empty_dsinks(q: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    # (nheads_q,) float32 with sinks; without, an empty placeholder (an op returns a fixed tuple).
    return torch.empty((q.shape[2] if sinks is not None else 0,), dtype=torch.float32, device=q.device)


# Optional[...], not "| None": the op's schema is inferred from these annotations.
def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, dlse: Optional[torch.Tensor], softmax_scale: float, causal: bool,  # noqa: UP045
        window_left: int, window_right: int, softcap: float, sinks: Optional[torch.Tensor],  # noqa: UP045
        deterministic: bool, backend: str, dropout_p: float = 0.0,
        dropout_rng: Optional[torch.Tensor] = None,  # noqa: UP045
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: (dq, dk, dv, dsinks), dq/dk/dv each like its input, contiguous; dsinks the
    gradient w.r.t. ``sinks`` (float32 (nheads_q,)), empty without sinks. ``out`` and ``lse`` are the
    forward's outputs, ``dout`` the gradient w.r.t. out, ``dlse`` the gradient w.r.t. lse or None;
    mask, softcap, sinks and dropout (the forward's p and state) as in fwd. ``deterministic``: bitwise-identical gradients from run to run
    (kernels; the reference always is; dsinks is a fixed-order sum either way)."""
    dq, dk, dv = _empty_grads(q, k, v)
    dsinks = _empty_dsinks(q, sinks)
    window = window_of(window_left, window_right)
    if backend == "reference":
        _reference_bwd_into(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, causal, window, softcap,
                            sinks, dsinks, reference_dropout(dropout_p, dropout_rng))
    elif backend in ARCH:
        # Each row's share of d(sinks) from the preprocess kernel, summed here in a fixed order.
        rows = None if sinks is None else torch.empty_like(lse)
        _launch_bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, causal, window, deterministic,
                    ARCH[backend], softcap=softcap, sinks=sinks, dsinks_rows=rows, dropout_p=dropout_p,
                    dropout_rng=dropout_rng)
        if rows is not None:
            torch.sum(rows, dim=(0, 2), out=dsinks)
    else:
        raise _unknown_backend(backend)
    return dq, dk, dv, dsinks


# Nothing cast, as for SDPA's backward ops (autocast does not list them): its inputs are the forward's, in
# the dtypes the forward ran in, and lse/dlse are float32. A backward() called inside an autocast region
# reaches the kernel (autograd runs it with the caller's autocast state): the op then runs as is, below
# autocast, so the reference's float32 matmuls stay float32 there too.
bwd_op = _op.define("bwd", bwd, autocast=())


@torch.library.register_fake("flashhopper::bwd")
def _(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
      lse: torch.Tensor, dlse: Optional[torch.Tensor], softmax_scale: float, causal: bool,  # noqa: UP045
      window_left: int, window_right: int, softcap: float, sinks: Optional[torch.Tensor],  # noqa: UP045
      deterministic: bool, backend: str, dropout_p: float = 0.0,
      dropout_rng: Optional[torch.Tensor] = None,  # noqa: UP045
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (*_empty_grads(q, k, v), _empty_dsinks(q, sinks))


# --- autograd: fwd's derivative is bwd ---

def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, k, v, softmax_scale, causal, window_left, window_right, softcap, sinks, deterministic, backend,
     *dropout) = inputs
    out, lse = output
    dropout_p, dropout_rng = dropout
    ctx.save_for_backward(q, k, v, out, lse, sinks, dropout_rng)
    ctx.dropout_p = dropout_p
    ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.backend = softmax_scale, causal, deterministic, backend
    ctx.window = (window_left, window_right)
    ctx.softcap = softcap
    # An unused output's gradient arrives as None instead of a tensor of zeros: an unused lse (the
    # usual case) then costs the kernel nothing (dlse_ptr = 0) and no memory.
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:
    # fwd's inputs: q, k, v, softmax_scale, causal, window_left, window_right, softcap, sinks, deterministic, backend,
    # dropout_p, dropout_rng
    def grads(dq: Any, dk: Any, dv: Any, dsinks: Any) -> tuple[Any, ...]:
        return (dq, dk, dv, None, None, None, None, None, dsinks, None, None, None, None)

    if dout is None and dlse is None:
        return grads(None, None, None, None)
    q, k, v, out, lse, sinks, dropout_rng = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    elif ctx.backend != "reference" and not validation.kernel_layout_ok(dout):
        # Autograd hands over whatever the next op produced, e.g. out.sum()'s stride-0 ones; the
        # kernels need TMA-compatible memory. (A fresh copy: .contiguous() keeps a misaligned offset.)
        dout = dout.clone(memory_format=torch.contiguous_format)
    if dlse is not None:
        dlse = dlse.contiguous()  # the kernels read it densely, like lse (lse.sum() gives stride 0)
    # lse holds the sinks already: the kernels need them only for their own gradient.
    sinks = sinks if ctx.needs_input_grad[8] else None
    dq, dk, dv, dsinks = torch.ops.flashhopper.bwd.default(dout, q, k, v, out, lse, dlse, ctx.softmax_scale,
                                                           ctx.causal, *ctx.window, ctx.softcap, sinks,
                                                           ctx.deterministic, ctx.backend, ctx.dropout_p, dropout_rng)
    return grads(dq, dk, dv, dsinks if sinks is not None else None)


torch.library.register_autograd("flashhopper::fwd", _backward, setup_context=_setup_context)


def register_no_double_backward(op: str) -> None:
    """A backward op has no derivative: a second derivative (create_graph=True, then backward again) must
    fail loudly, never be silently zero."""
    def refuse(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        raise RuntimeError(f"flashhopper.{op} is not differentiable: gradients of the attention gradients "
                           "(double backward) are not supported")

    torch.library.register_autograd(f"flashhopper::{op}", refuse, setup_context=lambda ctx, inputs, output: None)


register_no_double_backward("bwd")
