"""Input checks of the fp8 path, on top of the shared ones (flashhopper.validation, whose shape and
device checks take FP8Tensors as they take tensors: FP8Tensor.shape is the logical shape). Like those,
each raises TypeError/ValueError starting with the argument's name. Shape-level checks run while
torch.compile traces; ``check_vt_layout`` reads a data pointer and runs at the launch.
"""
from __future__ import annotations

from typing import Any

import torch

from .. import validation
from ..validation import Shapes
from .format import FP8_DTYPE, FP8Tensor, check_fp8_tensor, check_headdim, check_int, vt_strides

INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
# A consumer warpgroup owns 64 query rows and applies one Q scale to them.
Q_BLOCK = 64
# The quantization kernel holds a whole block in one CTA (docs/fp8.md), a thread per 64 elements of a row.
QUANT_BLOCK_MULTIPLE = 16
QUANT_WARP_ELEMENTS = 32 * 64  # the kernel runs whole warps of 64-element row chunks: 32 tokens at headdim 64
QUANT_MAX_BLOCK_ELEMENTS = 32768  # cpp/common/quantize_fp8.h: at most 512 threads x 64 elements


def check_input(name: str, x: Any) -> None:
    """A tensor to be quantized: bf16/fp16 (batch, seqlen, nheads, headdim), last dim contiguous."""
    validation.check_tensor(name, x)
    if x.dtype == FP8_DTYPE:
        raise TypeError(f"{name} is a float8_e4m3fn tensor without its scales; wrap it in "
                        "FP8Tensor(data, scale, block_size, hadamard_seed, transposed, seqlen)")
    validation.check_dtype(name, x, INPUT_DTYPES)
    validation.check_rank(name, x)
    check_headdim(name, x.shape[-1])
    validation.check_last_dim_contiguous(name, x)


def check_packed_input(name: str, x: Any) -> None:
    """A packed batch to be quantized: bf16/fp16 (total, nheads, headdim), last dim contiguous."""
    validation.check_tensor(name, x)
    if x.dtype == FP8_DTYPE:
        raise TypeError(f"{name} is a float8_e4m3fn tensor without its scales; quantize_fp8(..., cu_seqlens=...) "
                        "makes a PackedFP8Tensor")
    validation.check_dtype(name, x, INPUT_DTYPES)
    if x.dim() != 3:
        raise ValueError(f"{name} must have 3 dimensions (total_tokens, nheads, headdim) in a packed batch, "
                         f"got shape {tuple(x.shape)}")
    check_headdim(name, x.shape[-1])
    validation.check_last_dim_contiguous(name, x)


def check_input_alignment(name: str, x: torch.Tensor) -> None:
    """An input (``check_input`` passed) the quantization kernel will read: its 16-byte loads need the data
    and every batch, row and head step on a 16-byte boundary. Checked before anything is quantized, to name
    the argument (the launch checks the real pointer, as "x"); from metadata (``validation.kernel_layout_ok``:
    the storage itself is assumed aligned, as the caching allocator's is), so fake tensors pass through too.
    Not while torch.compile traces: dynamo cannot read a storage offset (a graph break); the launch's check
    runs all the same."""
    if torch.compiler.is_compiling():
        return
    # The usual case, cheaply (host time): contiguous with head dim 64/128/256, every stride is aligned.
    if x.is_contiguous() and x.storage_offset() * x.element_size() % validation.TMA_ALIGN_BYTES == 0:
        return
    if not validation.kernel_layout_ok(x):
        raise ValueError(f"{name} is not laid out for the quantization kernel's 16-byte loads (storage offset "
                         f"{x.storage_offset()}, strides {tuple(x.stride())} of {x.element_size()}-byte elements): "
                         "its start and its batch, row and head strides must be nonzero multiples of 16 bytes; "
                         "call .clone()")


def quant_kernel_takes(block_size: int, headdim: int) -> bool:
    """Whether the quantization kernel takes this block size (cpp/common/quantize_fp8.h)."""
    return (block_size % QUANT_BLOCK_MULTIPLE == 0 and block_size * headdim % QUANT_WARP_ELEMENTS == 0
            and block_size * headdim <= QUANT_MAX_BLOCK_ELEMENTS)


def check_quant_block_size(block_size: Any, headdim: int, kernel: bool) -> None:
    """The block size of "block" granularity: any positive int in torch, the kernel's limits for the kernel."""
    if block_size is None:
        raise ValueError("block_size must be an int for granularity 'block' "
                         "(granularity 'head' or 'tensor' takes none)")
    check_int("block_size", block_size, minimum=1)
    if kernel and not quant_kernel_takes(block_size, headdim):
        limit = QUANT_MAX_BLOCK_ELEMENTS // headdim
        raise ValueError(f"block_size {block_size}: the quantization kernel needs a multiple of "
                         f"{max(QUANT_BLOCK_MULTIPLE, QUANT_WARP_ELEMENTS // headdim)} with block_size * headdim <= "
                         f"{QUANT_MAX_BLOCK_ELEMENTS} (headdim {headdim}: at most {limit}); kernel=False quantizes "
                         "in torch with any block size")


Q_WHY = f"the fp8 kernel applies one Q scale per {Q_BLOCK} query rows"


def kv_why(headdim: int, block_n: int, short_n: int = 0) -> str:
    short = f" (of {short_n} keys in its short-key tile)" if short_n else ""
    return f"the fp8 kernel for head dim {headdim} applies one K and V scale per block of {block_n} keys{short}"


def check_aligned(name: str, block_size: int | None, unit: int, why: str, other: int = 0) -> None:
    """block_size a multiple of ``unit`` (or of ``other`` where nonzero: a second tile that reads it)."""
    if block_size is not None and block_size % unit and not (other and block_size % other == 0):
        units = f"{unit} or {other}" if other else f"{unit}"
        raise ValueError(f"{name} {block_size}: {why}, so it must be a multiple of {units} "
                         "(or None: one scale per head)")


def check_tile_alignment(q8: FP8Tensor, k8: FP8Tensor, v8: FP8Tensor, tiles: tuple[int, int],
                         short_n: int = 0) -> None:
    """Scale blocks against the kernel's tiles (docs/fp8.md): Q % 64, K and V % block_n (or % ``short_n``, the
    block_n of a short-key tile beside it, where nonzero; the same one for K and V)."""
    check_aligned("q.block_size", q8.block_size, Q_BLOCK, Q_WHY)
    for name, t in (("k", k8), ("v", v8)):
        check_aligned(f"{name}.block_size", t.block_size, tiles[1], kv_why(t.headdim, tiles[1], short_n), short_n)
    if short_n and not any(all(kv_tile_fits(t.block_size, n) for t in (k8, v8)) for n in (tiles[1], short_n)):
        raise ValueError(f"k.block_size {k8.block_size} and v.block_size {v8.block_size}: "
                         f"{kv_why(k8.headdim, tiles[1], short_n)}, so both must be multiples of the same one")


def kv_tile_fits(block_size: int | None, block_n: int) -> bool:
    return block_size is None or block_size % block_n == 0


def check_not_transposed(name: str, t: FP8Tensor) -> None:
    if t.transposed:
        raise ValueError(f"{name} must be in the (batch, seqlen, nheads, headdim) layout; only v is transposed")


def check_qk_seeds(q_seed: int | None, k_seed: int | None) -> None:
    """Q and K rotated with the same signs: QK^T is preserved only then."""
    if q_seed != k_seed:
        raise ValueError(f"k.hadamard_seed {k_seed} does not match q.hadamard_seed {q_seed}: "
                         "QK^T is preserved only when Q and K are transformed with the same signs")


def check_v_seed(v_seed: int | None) -> None:
    if v_seed is not None:
        raise ValueError(f"v.hadamard_seed must be None (V is never Hadamard-transformed), got {v_seed}")


def qk_seed(q: Any, k: Any, v: Any, hadamard: bool, seed: int, quantized: type) -> int | None:
    """The Hadamard seed Q and K are quantized with when some of q, k, v already are (instances of ``quantized``:
    FP8Tensor or PackedFP8Tensor): pre-quantized Q and K must share theirs and V have none, and a pre-quantized
    k (else q) decides, so that bf16 queries can attend to a quantized K/V; else ``seed`` when ``hadamard``."""
    if isinstance(q, quantized) and isinstance(k, quantized):
        check_qk_seeds(q.hadamard_seed, k.hadamard_seed)
    if isinstance(v, quantized):
        check_v_seed(v.hadamard_seed)
    if isinstance(k, quantized):
        return k.hadamard_seed
    if isinstance(q, quantized):
        return q.hadamard_seed
    return seed if hadamard else None


def check_fp8_inputs(q8: Any, k8: Any, v8: Any, tiles: tuple[int, int] | None = None, short_n: int = 0) -> Shapes:
    """Checks of quantized q, k, v for attention, v in the V^T layout the kernels and the reference read
    (``to_vt`` converts); ``tiles`` (block_m, block_n) of the kernel that will run adds its block alignment
    (``short_n``: check_tile_alignment's)."""
    for name, t in (("q", q8), ("k", k8), ("v", v8)):
        check_fp8_tensor(name, t)
    check_not_transposed("q", q8)
    check_not_transposed("k", k8)
    if not v8.transposed:
        raise ValueError("v must be in the V^T layout (transposed=True); fp8.to_vt converts")
    validation.check_same_device(q8, k8, v8)  # type: ignore[arg-type]  # FP8Tensor has .device
    shapes = validation.check_shapes(q8, k8, v8)  # type: ignore[arg-type]  # FP8Tensor has .shape
    check_qk_seeds(q8.hadamard_seed, k8.hadamard_seed)
    check_v_seed(v8.hadamard_seed)
    if tiles is not None:
        check_tile_alignment(q8, k8, v8, tiles, short_n)
    return shapes


def check_vt_layout(name: str, vt: torch.Tensor) -> None:
    """V^T data as TMA loads it: keys contiguous, 16-byte aligned pointer and (batch, head, dim) strides."""
    if vt.numel() == 0:
        return  # the kernel reads no V (and an empty tensor's strides are arbitrary)
    validation.check_last_dim_contiguous(name, vt)
    if vt.data_ptr() % validation.TMA_ALIGN_BYTES:
        raise ValueError(f"{name} data pointer {vt.data_ptr():#x} is not {validation.TMA_ALIGN_BYTES}-byte aligned; "
                         "call .clone() (.contiguous() keeps a contiguous view where it is)")
    for what, stride in zip(("batch", "head", "dim"), vt_strides(vt)):
        if stride == 0 or stride % validation.TMA_ALIGN_BYTES:  # 1-byte elements: strides are bytes
            raise ValueError(f"{name} (V^T) {what} stride {stride} must be a nonzero multiple of "
                             f"{validation.TMA_ALIGN_BYTES} bytes; call .contiguous()")
