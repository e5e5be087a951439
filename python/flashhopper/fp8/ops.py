"""The fp8 kernels: their entries in the build's table, their launches, and the torch ops
``flashhopper::quantize_fp8`` and ``flashhopper::fwd_fp8`` that run them.

Each op (defined through ``_op.define``) has a fake implementation, so torch.compile traces it as
one opaque node. Their CUDA implementation launches the kernel; their CPU implementation is the
reference emulation (reference_fp8), so that the CPU path is the same graph as the GPU one. They
trust their shape-level inputs (flash_attn_fp8_func / quantize_fp8 validated them); the checks that
need data pointers run here, right before the launch. Nothing on the way copies host to device or
synchronizes: both ops can be captured in a CUDA graph, on the first call too.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from .. import _device, _ext, _launch, _op, reference_fp8, validation
from .._plans import Launch
from ..kernel_key import KernelKey, mask_of
from .format import FP8_DTYPE, VT_GROUP, FP8Tensor, nblocks, round_up, vt_strides
from .packed import PackedFP8Tensor
from .validation import check_vt_layout

# "Tokens per scale" handed to the kernel for one scale per head (any value > every seqlen).
NO_BLOCK = 1 << 30


# Cached: asked several times a call, and a key's construction validates its fields (host time).
@functools.lru_cache(maxsize=64)
def kernel_key(headdim: int, causal: bool) -> KernelKey:
    """The feature key of the fp8 forward kernel: Hopper, e4m3, the same head dim for QK and V."""
    return KernelKey(90, "float8_e4m3fn", headdim, headdim, mask_of(causal))


# A build-table lookup, constant for a process: torch.compile takes its result as a constant
# instead of tracing into the extension (as dispatch.py does).
@torch.compiler.assume_constant_result
def kernel_tiles(headdim: int, causal: bool) -> tuple[int, int] | None:
    """(block_m, block_n) of this build's fp8 forward kernel for (headdim, causal), None without one."""
    entry = _ext.kernel("fwd", kernel_key(headdim, causal))
    return None if entry is None else (entry.block_m, entry.block_n)


@torch.compiler.assume_constant_result
def short_keys(headdim: int, causal: bool) -> tuple[int, int] | None:
    """(block_n, most keys) of the short-key tile beside this build's padded fp8 forward kernel for (headdim,
    causal): padded calls of at most that many keys whose K/V scale blocks it reads run it (and calls whose blocks
    only it reads); None without one (cpp/sm90/launch_fwd.h: use_short_keys)."""
    entry = _ext.kernel("fwd", kernel_key(headdim, causal))
    return None if entry is None or entry.block_n_short <= 0 else (entry.block_n_short, entry.short_keys_max)


# Returns the message rather than raising: a ValueError raised inside an assume_constant_result function
# surfaces as an internal dynamo error (dispatch.py does the same).
@torch.compiler.assume_constant_result
def device_problem(index: int) -> str:
    """Empty when cuda:index runs the fp8 kernels (sm_90a code, quantization included), else what it is."""
    info = _device.device_info(index)
    if info.capability == (9, 0):
        return ""
    return (f"cuda:{index} ({info.name}, compute capability {info.capability[0]}.{info.capability[1]}); "
            "the fp8 kernels run on compute capability 9.0 (Hopper) only")


@torch.compiler.assume_constant_result
def has_quant_kernel() -> bool:
    """Whether this build has the fp8 quantization kernel (``_C.quantize_fp8``)."""
    return _ext.has_fp8_quantize()


def missing_kernel(headdim: int, causal: bool) -> str:
    """Why there is no fp8 forward kernel for (headdim, causal), with what to rebuild with."""
    err = _ext.extension_error()
    return (f"this build has no fp8 (float8_e4m3fn) forward kernel for head dim {headdim} "
            f"{'causal' if causal else 'non-causal'}; rebuild with FLASHHOPPER_ARCHS=90, FLASHHOPPER_DTYPES "
            f"including e4m3 (e.g. 'bf16;e4m3') and FLASHHOPPER_HDIMS including {headdim}"
            + (f"; the compiled extension did not import: {err}" if err else ""))


# --- attention ---

def _scale_fields(p: Any, name: str, t: FP8Tensor) -> None:
    scales = t.scales()  # stride 0 along broadcast dims: the kernel reads the same scale there
    setattr(p, f"{name}_scale_ptr", scales.data_ptr())
    for what, stride in zip(("batch", "head", "block"), scales.stride()):
        setattr(p, f"{name}_scale_{what}_stride", stride)
    block = NO_BLOCK if t.block_size is None or t.block_size >= NO_BLOCK else t.block_size
    setattr(p, f"{name}_scale_block", block)


def fill_fwd_params(p: Any, q8: FP8Tensor, k8: FP8Tensor, v8: FP8Tensor, out: torch.Tensor, lse: torch.Tensor,
                    softmax_scale: float, counter: int = 0) -> Any:
    """Write every field of a ``_C.FwdParams`` for the fp8 forward (docs/fp8.md): pointers, strides (in
    elements), sizes, descales; v8 is V^T. ``counter``: the address of the tile counter (causal kernels)."""
    b, _, hq, d = q8.data.shape
    p.q_ptr, p.k_ptr, p.v_ptr = q8.data.data_ptr(), k8.data.data_ptr(), v8.data.data_ptr()
    p.o_ptr, p.lse_ptr, p.tile_counter = out.data_ptr(), lse.data_ptr(), counter
    _launch.fill_strides(p, q=q8.data, k=k8.data, o=out)
    p.v_batch_stride, p.v_head_stride, p.v_dim_stride = vt_strides(v8.data)
    p.v_row_stride = 0  # unused by the fp8 kernels: V^T's keys are contiguous
    p.batch, p.seqlen_q, p.seqlen_k = b, q8.seqlen, k8.seqlen
    p.nheads_q, p.nheads_kv, p.headdim, p.headdim_v = hq, k8.nheads, d, d
    p.softmax_scale = softmax_scale
    p.window_left = p.window_right = -1
    p.softcap, p.sinks_ptr = 0.0, 0  # the params object is shared with the 16-bit forward
    p.max_smem_bytes = 0
    for name, t in (("q", q8), ("k", k8), ("v", v8)):
        _scale_fields(p, name, t)
    _launch.fill_device(p, out)
    return p


def fwd_launch(q8: FP8Tensor, k8: FP8Tensor, v8: FP8Tensor, out: torch.Tensor, lse: torch.Tensor,
               softmax_scale: float, causal: bool) -> Launch:
    """The Launch (_plans) of an fp8 forward like this one (v8 is V^T): its kernel, or ValueError, and its params
    from these tensors' metadata. Checks nothing else."""
    entry = _ext.kernel("fwd", kernel_key(q8.headdim, causal))
    if entry is None:  # reached only by calling the op directly: flash_attn_fp8_func checked before
        raise ValueError(f"q: {missing_kernel(q8.headdim, causal)}")
    p = fill_fwd_params(_ext.extension().FwdParams(), q8, k8, v8, out, lse, softmax_scale)
    return Launch(p, entry.index, causal, out.device)  # causal kernels take tiles from a counter


def launch_fwd(q8: FP8Tensor, k8: FP8Tensor, v8: FP8Tensor, out: torch.Tensor, lse: torch.Tensor,
               softmax_scale: float, causal: bool) -> int:
    """Check the memory layouts and launch the fp8 forward into ``out`` (bf16) and ``lse``; v8 is V^T.
    Returns the CTAs launched (0: an empty grid; without keys the kernel runs and writes O = 0,
    LSE = -inf)."""
    for name, x in (("q", q8.data), ("k", k8.data), ("out", out)):
        validation.check_kernel_layout(name, x)
    check_vt_layout("v", v8.data)
    launch = fwd_launch(q8, k8, v8, out, lse, softmax_scale, causal)
    return launch.fwd(q8.data.data_ptr(), k8.data.data_ptr(), v8.data.data_ptr(), out.data_ptr(), lse.data_ptr(),
                      q_scale=q8.scale.data_ptr(), k_scale=k8.scale.data_ptr(), v_scale=v8.scale.data_ptr())


def _fp8_tensors(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                 v_t: torch.Tensor, v_scale: torch.Tensor, q_block: int | None, k_block: int | None,
                 v_block: int | None) -> tuple[FP8Tensor, FP8Tensor, FP8Tensor]:
    # The signs do not matter to attention (only that Q and K share them, checked before): no seed.
    sk = k.shape[1]
    return (FP8Tensor(q, q_scale, q_block, None, False, q.shape[1]), FP8Tensor(k, k_scale, k_block, None, False, sk),
            FP8Tensor(v_t, v_scale, v_block, None, True, sk))


def empty_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, sq, hq, d = q.shape
    return q.new_empty((b, sq, hq, d), dtype=torch.bfloat16), q.new_empty((b, hq, sq), dtype=torch.float32)


# Optional[...], not "| None": the op's schema is inferred from these annotations.
def fwd(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v_t: torch.Tensor,
        v_scale: torch.Tensor, q_block: Optional[int], k_block: Optional[int], v_block: Optional[int],  # noqa: UP045
        softmax_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 attention forward (docs/fp8.md): (out bfloat16 (batch, seqlen_q, nheads_q, headdim), lse float32
    (batch, nheads_q, seqlen_q)). q (batch, seqlen_q, nheads_q, headdim), k (batch, seqlen_k, nheads_kv,
    headdim) and v_t (V^T: batch, nheads_kv, headdim, round_up(seqlen_k, 16)) are e4m3; each scale is float32
    broadcastable to (batch, nheads, nblocks) of its tensor, with *_block tokens per scale (None: one per
    head). The FP8Tensor fields flattened, since an op takes tensors and scalars only."""
    out, lse = empty_outputs(q)
    launch_fwd(*_fp8_tensors(q, q_scale, k, k_scale, v_t, v_scale, q_block, k_block, v_block), out, lse,
               softmax_scale, causal)
    return out, lse


def _fwd_cpu(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v_t: torch.Tensor,
      v_scale: torch.Tensor, q_block: Optional[int], k_block: Optional[int], v_block: Optional[int],  # noqa: UP045
      softmax_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q8, k8, v8 = _fp8_tensors(q, q_scale, k, k_scale, v_t, v_scale, q_block, k_block, v_block)
    out, lse = reference_fp8.attention_fp8_ref(q8, k8, v8, softmax_scale, causal)
    return out.to(torch.bfloat16, memory_format=torch.contiguous_format), lse.contiguous()


# Nothing cast under autocast: q, k, v_t are e4m3 and the scales float32 descales (the activations were
# cast before their quantization, by quantize_fp8's op).
fwd_op = _op.define("fwd_fp8", fwd, _fwd_cpu, autocast=())


@torch.library.register_fake("flashhopper::fwd_fp8")
def _(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v_t: torch.Tensor,
      v_scale: torch.Tensor, q_block: Optional[int], k_block: Optional[int], v_block: Optional[int],  # noqa: UP045
      softmax_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return empty_outputs(q)


# --- quantization ---

def fill_quant_params(p: Any, x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, block_size: int,
                      hadamard_seed: int | None, transpose: bool) -> Any:
    """Write every field of a ``_C.QuantParams`` (docs/fp8.md); ``hadamard_seed`` a signed int64 or None."""
    b, s, h, d = x.shape
    p.x_ptr, p.out_ptr, p.scale_ptr = x.data_ptr(), out.data_ptr(), scale.data_ptr()
    p.hadamard = hadamard_seed is not None
    p.hadamard_seed = 0 if hadamard_seed is None else hadamard_seed
    _launch.fill_strides(p, x=x)
    if transpose:
        p.out_batch_stride, p.out_head_stride, p.out_dim_stride = vt_strides(out)
        p.out_row_stride = 0  # unused: V^T's keys are contiguous
    else:
        _launch.fill_strides(p, out=out)
        p.out_dim_stride = 0  # unused by the row-major output
    p.scale_batch_stride, p.scale_head_stride, p.scale_block_stride = scale.stride()
    p.batch, p.seqlen, p.nheads, p.headdim = b, s, h, d
    p.block_size = block_size
    p.transpose = transpose
    p.cu_seqlens = 0  # a padded batch (the params object is this thread's, shared with packed launches)
    p.dtype = _launch.c_dtype(x.dtype)
    _launch.fill_device(p, x)
    return p


def quantize_launch(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, block_size: int,
                    hadamard_seed: int | None, transpose: bool) -> Launch:
    """The Launch (_plans) of a quantization like this one: params from these tensors' metadata."""
    p = fill_quant_params(_ext.extension().QuantParams(), x, out, scale, block_size, hadamard_seed, transpose)
    return Launch(p, -1, False, x.device)


def launch_quantize(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, block_size: int,
                    hadamard_seed: int | None, transpose: bool) -> int:
    """Check x's memory layout and launch the quantization kernel; the CTAs launched (0: nothing to do)."""
    validation.check_alignment("x", x)  # 16-byte loads
    launch = quantize_launch(x, out, scale, block_size, hadamard_seed, transpose)
    return launch.quantize(x.data_ptr(), out.data_ptr(), scale.data_ptr())


def empty_quantized(x: torch.Tensor, block_size: int, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The (data, scale) the quantization of x fills, contiguous (the real and the fake op alike)."""
    b, s, h, d = x.shape
    shape = (b, h, d, round_up(s, VT_GROUP)) if transpose else (b, s, h, d)
    return (torch.empty(shape, dtype=FP8_DTYPE, device=x.device),
            torch.empty((b, h, nblocks(s, block_size)), dtype=torch.float32, device=x.device))


def quantize(x: torch.Tensor, block_size: int, hadamard_seed: Optional[int],  # noqa: UP045
             transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize bf16/fp16 x (batch, seqlen, nheads, headdim) to e4m3 with one float32 descale per
    ``block_size`` tokens of a (batch, head) (docs/fp8.md): (data, scale (batch, nheads, nblocks)). Rows
    Hadamard-transformed with the signs of ``hadamard_seed`` (a signed int64; None: no transform); data
    as V^T (batch, nheads, headdim, round_up(seqlen, 16)) when ``transpose``, else like x, contiguous."""
    data, scale = empty_quantized(x, block_size, transpose)
    launch_quantize(x, data, scale, block_size, hadamard_seed, transpose)
    return data, scale


def _quantize_cpu(x: torch.Tensor, block_size: int, hadamard_seed: Optional[int],  # noqa: UP045
      transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t = reference_fp8.quantize_ref(x, block_size, "block", hadamard_seed, transpose)
    return t.data, t.scale


# Under CUDA autocast x is quantized from the autocast dtype.
quantize_op = _op.define("quantize_fp8", quantize, _quantize_cpu, autocast=("x",))


@torch.library.register_fake("flashhopper::quantize_fp8")
def _(x: torch.Tensor, block_size: int, hadamard_seed: Optional[int],  # noqa: UP045
      transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return empty_quantized(x, block_size, transpose)


# --- packed batches (fp8/packed.py) ---

@functools.lru_cache(maxsize=64)
def varlen_kernel_key(headdim: int, causal: bool) -> KernelKey:
    """The feature key of the packed-batch fp8 forward kernel."""
    return KernelKey(90, "float8_e4m3fn", headdim, headdim, mask_of(causal), varlen=True)


@torch.compiler.assume_constant_result
def varlen_kernel_tiles(headdim: int, causal: bool) -> tuple[int, int] | None:
    """(block_m, block_n) of this build's packed-batch fp8 forward kernel, None without one."""
    entry = _ext.kernel("fwd", varlen_kernel_key(headdim, causal))
    return None if entry is None else (entry.block_m, entry.block_n)


def missing_varlen_kernel(headdim: int, causal: bool) -> str:
    return missing_kernel(headdim, causal).replace("forward kernel", "packed-batch (varlen) forward kernel", 1) + (
        "; FLASHHOPPER_VARLEN must include 'on'")


def empty_quantized_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
                           transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The (data, scale) the quantization of packed x (total, nheads, headdim) fills, contiguous (fp8/packed.py):
    data like x or V^T (nheads, headdim, nblocks * block_size); scale (nheads, nblocks)."""
    total, h, d = x.shape
    n = total // block_size + (cu_seqlens.shape[0] - 1)
    shape = (h, d, n * block_size) if transpose else (total, h, d)
    return (torch.empty(shape, dtype=FP8_DTYPE, device=x.device),
            torch.empty((h, n), dtype=torch.float32, device=x.device))


def quantize_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
                    hadamard_seed: Optional[int], transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: UP045
    """Quantize packed bf16/fp16 x (total, nheads, headdim), each sequence in blocks of ``block_size`` from its
    first token (fp8/packed.py): (data, scale). Blocks of no sequence get scale 1 (and zero V^T keys); rows of no
    sequence are left unwritten."""
    data, scale = empty_quantized_packed(x, cu_seqlens, block_size, transpose)
    if x.shape[0] == 0:  # no rows: nothing for the kernel, every block empty
        scale.fill_(1.0)
        data.zero_()
        return data, scale
    validation.check_alignment("x", x.unsqueeze(0))
    p = fill_quant_params(_launch.params("QuantParams"), x.unsqueeze(0), data.unsqueeze(0), scale.unsqueeze(0),
                          block_size, hadamard_seed, transpose)
    # One block mode for all sequences: no batch slices (fill_quant_params set them for a batch of one).
    p.batch, p.cu_seqlens = cu_seqlens.shape[0] - 1, cu_seqlens.contiguous().data_ptr()
    p.x_batch_stride = p.out_batch_stride = p.scale_batch_stride = 0
    _ext.extension().quantize_fp8(p, _launch.stream(x.device))
    return data, scale


def _quantize_varlen_cpu(x: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
                         hadamard_seed: Optional[int], transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: UP045
    t = reference_fp8.quantize_varlen_ref(x, cu_seqlens, block_size, hadamard_seed, transpose)
    return t.data, t.scale


quantize_varlen_op = _op.define("varlen_quantize_fp8", quantize_varlen, _quantize_varlen_cpu, autocast=("x",))


@torch.library.register_fake("flashhopper::varlen_quantize_fp8")
def _(x: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int, hadamard_seed: Optional[int],  # noqa: UP045
      transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return empty_quantized_packed(x, cu_seqlens, block_size, transpose)


def _packed_tensors(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                    v_t: torch.Tensor, v_scale: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                    q_block: int, k_block: int, v_block: int
                    ) -> tuple[PackedFP8Tensor, PackedFP8Tensor, PackedFP8Tensor]:
    tq, tk = q.shape[0], k.shape[0]
    return (PackedFP8Tensor(q, q_scale, q_block, None, False, cu_seqlens_q, tq),
            PackedFP8Tensor(k, k_scale, k_block, None, False, cu_seqlens_k, tk),
            PackedFP8Tensor(v_t, v_scale, v_block, None, True, cu_seqlens_k, tk))


def _empty_varlen_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total, hq, d = q.shape
    return (torch.empty((total, hq, d), dtype=torch.bfloat16, device=q.device),
            torch.empty((hq, total), dtype=torch.float32, device=q.device))


def launch_varlen_fwd(q8: PackedFP8Tensor, k8: PackedFP8Tensor, v8: PackedFP8Tensor, seqused_q: torch.Tensor | None,
                      seqused_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, out: torch.Tensor,
                      lse: torch.Tensor, softmax_scale: float, causal: bool) -> int:
    """Check the memory layouts and launch the packed-batch fp8 forward into ``out`` (bf16 (total_q, nheads_q,
    headdim)) and ``lse`` (float32 (nheads_q, total_q)); v8 is V^T. Returns the CTAs launched."""
    q4, k4, o4, vt4 = q8.data.unsqueeze(0), k8.data.unsqueeze(0), out.unsqueeze(0), v8.data.unsqueeze(0)
    for name, x in (("q", q4), ("k", k4), ("out", o4)):
        validation.check_kernel_layout(name, x)
    check_vt_layout("v", vt4)
    entry = _ext.kernel("fwd", varlen_kernel_key(q8.headdim, causal))
    if entry is None:
        raise ValueError(f"q: {missing_varlen_kernel(q8.headdim, causal)}")
    batch = q8.batch
    stream = _launch.stream(out.device)
    workspace = torch.empty(int(_ext.extension().varlen_workspace_bytes(batch)), dtype=torch.uint8, device=out.device)
    p = _launch.params("FwdParams")
    p.q_ptr, p.k_ptr, p.v_ptr = q8.data.data_ptr(), k8.data.data_ptr(), v8.data.data_ptr()
    p.o_ptr, p.lse_ptr = out.data_ptr(), lse.data_ptr()
    _launch.fill_strides(p, q=q4, k=k4, o=o4)
    _, p.v_head_stride, p.v_dim_stride = vt_strides(vt4)
    p.v_row_stride = 0
    p.batch, p.seqlen_q, p.seqlen_k = batch, max_seqlen_q, max_seqlen_k
    p.total_q, p.total_k = q8.total, k8.total
    p.nheads_q, p.nheads_kv, p.headdim, p.headdim_v = q8.nheads, k8.nheads, q8.headdim, q8.headdim
    p.softmax_scale = softmax_scale
    p.window_left, p.window_right = (-1, 0) if causal else (-1, -1)
    p.softcap, p.sinks_ptr = 0.0, 0
    p.dropout_threshold, p.dropout_rng = 0, 0
    for name, t in (("q", q8), ("k", k8), ("v", v8)):
        setattr(p, f"{name}_scale_ptr", t.scale.data_ptr())
        setattr(p, f"{name}_scale_batch_stride", 0)
        setattr(p, f"{name}_scale_head_stride", t.scale.stride(0))
        setattr(p, f"{name}_scale_block_stride", t.scale.stride(1))
        setattr(p, f"{name}_scale_block", t.block_size)
    cu_q, cu_k = q8.cu_seqlens.contiguous(), k8.cu_seqlens.contiguous()
    p.cu_seqlens_q, p.cu_seqlens_k = cu_q.data_ptr(), cu_k.data_ptr()
    p.seqused_q = 0 if seqused_q is None else seqused_q.contiguous().data_ptr()
    p.seqused_k = 0 if seqused_k is None else seqused_k.contiguous().data_ptr()
    p.varlen_workspace = workspace.data_ptr()
    p.tile_counter = _launch.tile_counter(out.device, stream).data_ptr()
    p.max_smem_bytes = 0
    _launch.fill_device(p, out)
    return int(_ext.extension().fwd(p, entry.index, stream))


def varlen_fwd(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v_t: torch.Tensor,
               v_scale: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
               seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],  # noqa: UP045
               max_seqlen_q: int, max_seqlen_k: int, q_block: int, k_block: int, v_block: int,
               softmax_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed-batch fp8 attention forward (fp8/packed.py): (out bfloat16 (total_q, nheads_q, headdim), lse float32
    (nheads_q, total_q)); rows of no sequence's used range are left unwritten. The PackedFP8Tensor fields of q, k
    and V^T flattened, as validated by flash_attn_varlen_fp8_func."""
    out, lse = _empty_varlen_outputs(q)
    q8, k8, v8 = _packed_tensors(q, q_scale, k, k_scale, v_t, v_scale, cu_seqlens_q, cu_seqlens_k, q_block, k_block,
                                 v_block)
    launch_varlen_fwd(q8, k8, v8, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, out, lse, softmax_scale, causal)
    return out, lse


def _varlen_fwd_cpu(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                    v_t: torch.Tensor, v_scale: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                    seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],  # noqa: UP045
                    max_seqlen_q: int, max_seqlen_k: int, q_block: int, k_block: int, v_block: int,
                    softmax_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q8, k8, v8 = _packed_tensors(q, q_scale, k, k_scale, v_t, v_scale, cu_seqlens_q, cu_seqlens_k, q_block, k_block,
                                 v_block)
    out, lse = reference_fp8.attention_varlen_fp8_ref(q8, k8, v8, softmax_scale, causal, seqused_q=seqused_q,
                                                      seqused_k=seqused_k)
    return out.to(torch.bfloat16), lse


varlen_fwd_op = _op.define("varlen_fwd_fp8", varlen_fwd, _varlen_fwd_cpu, autocast=())


@torch.library.register_fake("flashhopper::varlen_fwd_fp8")
def _(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v_t: torch.Tensor,
      v_scale: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
      seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],  # noqa: UP045
      max_seqlen_q: int, max_seqlen_k: int, q_block: int, k_block: int, v_block: int,
      softmax_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _empty_varlen_outputs(q)
