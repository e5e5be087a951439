"""Quantization to e4m3 with float32 descales (docs/fp8.md): ``quantize_fp8`` and the K/V block size the
fp8 kernel wants, ``default_kv_block_size``."""
from __future__ import annotations

import math
from typing import Any, overload

import torch

from .. import _autocast, _ext, _plans, reference_fp8, validation
from . import ops
from .format import GRANULARITIES, FP8Tensor, check_int, check_seed, seed_int64
from .packed import PackedFP8Tensor
from .validation import check_input, check_packed_input, check_quant_block_size, quant_kernel_takes

# K/V scale block when there is no kernel table to take block_n from.
DEFAULT_KV_BLOCK = 128


def default_kv_block_size(headdim: int, causal: bool | None = None, seqlen_k: int | None = None) -> int:
    """K/V scale block: the fp8 kernel's block_n (causal None: a block that suits both the causal and the
    non-causal kernel when the quantization kernel allows one, else the non-causal one's); 128 without
    a kernel table. ``seqlen_k``: the keys of the padded call the blocks are for; where it is within reach of the
    kernels' short-key tile (``ops.short_keys``), that tile's block_n, so that the call runs it."""
    kinds = (False, True) if causal is None else (causal,)
    if seqlen_k is not None:
        shorts = [ops.short_keys(headdim, c) for c in kinds]
        if shorts and all(t is not None and seqlen_k <= t[1] for t in shorts):
            n = math.lcm(*(t[0] for t in shorts if t is not None))
            if quant_kernel_takes(n, headdim):
                return n
    ns = [t[1] for t in (ops.kernel_tiles(headdim, c) for c in kinds) if t is not None]
    if not ns:
        return DEFAULT_KV_BLOCK
    n = math.lcm(*ns)
    return n if quant_kernel_takes(n, headdim) else ns[0]


def use_quant_kernel(x: torch.Tensor, granularity: str = "block", kernel: bool | None = None) -> bool:
    """Whether quantize_fp8(x, granularity=granularity, kernel=kernel) runs the quantization kernel; ValueError
    when kernel=True and it cannot."""
    available = (x.is_cuda and granularity == "block" and ops.has_quant_kernel()
                 and not ops.device_problem(x.device.index))
    if kernel is None:
        return available
    if not kernel or available:
        return kernel
    if not x.is_cuda:
        why = f"x is on {x.device}; the quantization kernel needs a CUDA tensor"
    elif ops.device_problem(x.device.index):
        why = f"x is on {ops.device_problem(x.device.index)}"
    elif granularity != "block":
        why = f"the quantization kernel makes 'block' scales only, not {granularity!r}"
    else:
        err = _ext.extension_error()
        why = ("this build has no fp8 quantization kernel; rebuild with FLASHHOPPER_ARCHS=90 and "
               "FLASHHOPPER_DTYPES including e4m3")
        why += f" (the compiled extension did not import: {err})" if err else ""
    raise ValueError(f"kernel=True: {why}")


@overload
def quantize_fp8(x: torch.Tensor, block_size: int | None = ..., hadamard: bool = ..., seed: int = ...,
                 granularity: str = ..., transpose: bool = ..., *, kernel: bool | None = ...,
                 cu_seqlens: None = ...) -> FP8Tensor: ...


@overload
def quantize_fp8(x: torch.Tensor, block_size: int | None = ..., hadamard: bool = ..., seed: int = ...,
                 granularity: str = ..., transpose: bool = ..., *, kernel: bool | None = ...,
                 cu_seqlens: torch.Tensor) -> PackedFP8Tensor: ...


def quantize_fp8(x: torch.Tensor, block_size: int | None = 128, hadamard: bool = True, seed: int = 0,
                 granularity: str = "block", transpose: bool = False, *, kernel: bool | None = None,
                 cu_seqlens: torch.Tensor | None = None) -> FP8Tensor | PackedFP8Tensor:
    """Quantize bf16/fp16 ``x`` (batch, seqlen, nheads, headdim), headdim 64/128/256, to e4m3 (docs/fp8.md).

    granularity: "block" (one scale per ``block_size`` tokens of a (batch, head)), "head" (one per
    (batch, head)) or "tensor" (one in all); block_size is ignored for the last two.
    hadamard: first transform each row with the random-sign Hadamard matrix of ``seed`` (a 64-bit int;
    for Q and K, which must share the seed; never for V). transpose: write V^T, the layout the kernel
    reads V in. kernel: None uses the quantization kernel where it applies (CUDA, "block", compiled),
    else the torch math of ``reference_fp8.quantize_ref``; True requires the kernel, False forces torch.
    The kernel needs block_size a multiple of 16 with block_size * headdim <= 32768.
    "block" quantization goes through the op ``flashhopper::quantize_fp8`` (the kernel on CUDA, the
    reference on CPU); kernel=False on CUDA and "head"/"tensor" call reference_fp8 directly.
    Under ``torch.autocast("cuda")`` a float32, float16 or bfloat16 x on CUDA is cast to the autocast
    dtype first and quantized from it, as SDPA takes its inputs in that dtype (CPU tensors: never cast).

    cu_seqlens (int32 (batch + 1,) on x's device): x is a packed batch (total, nheads, headdim) as in
    flash_attn_varlen_func, and each sequence is quantized in blocks aligned with its first token; returns a
    PackedFP8Tensor (fp8/packed.py: scales (nheads, total // block_size + batch), V^T (nheads, headdim,
    nblocks * block_size) with ``transpose``). "block" granularity only.
    """
    key = None
    if type(x) is torch.Tensor and cu_seqlens is None and _plans.direct():
        key = (_plans.meta(x), _plans.scalars(block_size, hadamard, seed, granularity, transpose, kernel))
        launch = _PLANS.get(key)  # a configuration that passed everything below before (_plans)
        ptrs = None if launch is None else _plans.pointers(x)
        if ptrs is not None:
            data, scale = ops.empty_quantized(x, block_size, transpose)  # type: ignore[arg-type]
            launch.quantize(ptrs[0], data.data_ptr(), scale.data_ptr())
            return FP8Tensor(data, scale, block_size, seed if hadamard else None, transpose, x.shape[1])
    with torch.no_grad():  # nothing here is differentiable (x may require grad)
        return _quantize(x, block_size, hadamard, seed, granularity, transpose, kernel, cu_seqlens, key)


def _quantize(x: torch.Tensor, block_size: int | None, hadamard: bool, seed: int, granularity: str, transpose: bool,
              kernel: bool | None, cu_seqlens: torch.Tensor | None,
              key: tuple[Any, ...] | None) -> FP8Tensor | PackedFP8Tensor:
    """quantize_fp8's full path; ``key``: the call key under which a kernel call's Launch is kept (None: none)."""
    if _autocast.enabled():
        (x,) = _autocast.cast(x)
    if cu_seqlens is not None:
        return _quantize_packed(x, block_size, hadamard, seed, granularity, transpose, kernel, cu_seqlens)
    check_input("x", x)
    validation.check_flag("hadamard", hadamard)
    validation.check_flag("transpose", transpose)
    check_seed("seed", seed)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(map(repr, GRANULARITIES))}, got {granularity!r}")
    if kernel is not None:
        validation.check_flag("kernel", kernel)
    use_kernel = use_quant_kernel(x, granularity, kernel)
    if granularity == "block":
        check_quant_block_size(block_size, x.shape[-1], use_kernel)
    elif block_size is not None:  # ignored, but an argument of the wrong type is a bug all the same
        check_int("block_size", block_size, minimum=1)
    hadamard_seed = seed if hadamard else None
    if use_kernel or (granularity == "block" and x.device.type == "cpu"):
        seed64 = None if hadamard_seed is None else seed_int64(hadamard_seed)
        data, scale = torch.ops.flashhopper.quantize_fp8.default(x, block_size, seed64, transpose)
        if key is not None and use_kernel:
            _PLANS.put(key, ops.quantize_launch(x, data, scale, block_size, seed64, transpose))  # type: ignore[arg-type]
        return FP8Tensor(data, scale, block_size, hadamard_seed, transpose, x.shape[1])
    return reference_fp8.quantize_ref(x, block_size if granularity == "block" else None, granularity,
                                      hadamard_seed, transpose)


# quantize_fp8's kernel configurations that took the full path once (_plans): call key -> Launch.
_PLANS = _plans.Plans()


def _quantize_packed(x: torch.Tensor, block_size: int | None, hadamard: bool, seed: int, granularity: str,
                     transpose: bool, kernel: bool | None, cu_seqlens: torch.Tensor) -> PackedFP8Tensor:
    """quantize_fp8 of a packed batch (validated here, autocast already applied)."""
    check_packed_input("x", x)
    validation.check_cu_seqlens("cu_seqlens", cu_seqlens, x.device)
    validation.check_flag("hadamard", hadamard)
    validation.check_flag("transpose", transpose)
    check_seed("seed", seed)
    if granularity != "block":
        raise ValueError(f"granularity {granularity!r}: a packed batch (cu_seqlens) is quantized in blocks per "
                         "sequence only ('block')")
    if kernel is not None:
        validation.check_flag("kernel", kernel)
    use_kernel = use_quant_kernel(x, granularity, kernel)
    check_quant_block_size(block_size, x.shape[-1], use_kernel)
    assert block_size is not None  # (checked above)
    hadamard_seed = seed if hadamard else None
    if use_kernel or x.device.type == "cpu":
        data, scale = torch.ops.flashhopper.varlen_quantize_fp8.default(
            x, cu_seqlens, block_size, None if hadamard_seed is None else seed_int64(hadamard_seed), transpose)
        return PackedFP8Tensor(data, scale, block_size, hadamard_seed, transpose, cu_seqlens, x.shape[0])
    return reference_fp8.quantize_varlen_ref(x, cu_seqlens, block_size, hadamard_seed, transpose)
