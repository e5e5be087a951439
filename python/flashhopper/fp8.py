"""FP8 (e4m3) attention forward: quantization, the V^T layout, validation and the kernel launch.

    from flashhopper import flash_attn_fp8_func, quantize_kv
    out = flash_attn_fp8_func(q, k, v, causal=True)     # bf16/fp16 in, quantized here, bf16 out
    kv = quantize_kv(k, v)                               # or: quantize K/V once (a KV cache) ...
    out = kv.attend(q)                                   # ... and attend with bf16 queries

The contract with the CUDA side is docs/fp8.md: descales ``x ~ float(x_fp8) * scale`` per (batch, head,
block of tokens), optional random-sign Hadamard transform of Q and K rows (incoherent processing), V
given to the kernel transposed with its keys permuted (or row-major, like K, to the kernels of a build that
transposes V in the kernel: ``kernel_v_transposed``). CPU tensors (and "head"/"tensor" scales, which
the quantization kernel does not produce) go through the torch math of ``reference_fp8``; on a GPU the
attention itself never falls back to the emulation: no compiled fp8 kernel is an error.
Forward only: nothing here is differentiable.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Literal, NamedTuple, overload

import torch

from . import _device, _ext, ops, validation
from .validation import Shapes

FP8_DTYPE = torch.float8_e4m3fn
INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
HEADDIMS: tuple[int, ...] = (64, 128, 256)
GRANULARITIES: tuple[str, ...] = ("block", "head", "tensor")
# A consumer warpgroup owns 64 query rows and applies one Q scale to them.
Q_BLOCK = 64
# K/V scale block when there is no kernel table to take block_n from.
DEFAULT_KV_BLOCK = 128
# The quantization kernel holds a whole block in one CTA (docs/fp8.md), a thread per 64 elements of a row.
QUANT_BLOCK_MULTIPLE = 16
QUANT_WARP_ELEMENTS = 32 * 64  # the kernel runs whole warps of 64-element row chunks: 32 tokens at headdim 64
QUANT_MAX_BLOCK_ELEMENTS = 32768  # cpp/common/quantize_fp8.h: at most 512 threads x 64 elements
# "Tokens per scale" handed to the kernel for one scale per head (any value > every seqlen).
NO_BLOCK = 1 << 30
# V^T: within each aligned group of 16 keys, position l holds key VT_ORDER[l] (docs/fp8.md).
VT_GROUP = 16
VT_ORDER: tuple[int, ...] = tuple(8 * ((p % 4) // 2) + 2 * (p // 4) + (p % 2) for p in range(VT_GROUP))

_local = threading.local()  # one reusable FwdParams / QuantParams per thread, as in ops.py
_signs_cache: dict[tuple[int, int, int], torch.Tensor] = {}  # (device, headdim, seed) -> signs there


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def nblocks(seqlen: int, block_size: int | None) -> int:
    """Scale blocks of a sequence: ceil(seqlen / block_size), 1 for one scale per head (None)."""
    return 1 if block_size is None else -(-seqlen // block_size)


def hadamard_signs(headdim: int, seed: int = 0) -> torch.Tensor:
    """The ±1 vector (float32, CPU) of the random-sign Hadamard transform for ``seed`` (docs/fp8.md)."""
    _check_int("headdim", headdim, minimum=1)
    _check_int("seed", seed)
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (headdim,), generator=g) * 2 - 1).to(torch.float32)


class FP8Tensor(NamedTuple):
    """An e4m3 tensor with its float32 descales: ``x ~ float(data) * scale`` (docs/fp8.md).

    data: torch.float8_e4m3fn, (batch, seqlen, nheads, headdim); or, when ``transposed``, the V^T layout
      (batch, nheads, headdim, round_up(seqlen, 16)) with keys permuted in groups of 16 and zero padding.
    scale: float32 (batch, nheads, nblocks), or any shape broadcastable to it (e.g. (1, 1, 1) for one
      scale per tensor); token t of head h uses scale[b, h, t // block_size].
    block_size: tokens per scale; None for one scale per head (nblocks 1).
    hadamard_seed: seed of the Hadamard signs applied to the rows (``hadamard_signs``); None: none.
      Q and K must carry the same one; V never has one.
    transposed: data is in the V^T layout.
    seqlen: the true number of tokens (the V^T layout is padded).
    Fp8 data quantized elsewhere can be wrapped directly, e.g.
    ``FP8Tensor(data, scale, block_size=None, hadamard_seed=None, transposed=False, seqlen=data.shape[1])``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block_size: int | None
    hadamard_seed: int | None
    transposed: bool
    seqlen: int

    @property
    def batch(self) -> int:
        return self.data.shape[0]

    @property
    def nheads(self) -> int:
        return self.data.shape[1 if self.transposed else 2]

    @property
    def headdim(self) -> int:
        return self.data.shape[2 if self.transposed else 3]

    @property
    def nblocks(self) -> int:
        return nblocks(self.seqlen, self.block_size)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def scales(self) -> torch.Tensor:
        """``scale`` broadcast to (batch, nheads, nblocks) (a view: stride 0 where broadcast)."""
        return self.scale.expand(self.batch, self.nheads, self.nblocks)

    def dequantize(self) -> torch.Tensor:
        """float32 (batch, seqlen, nheads, headdim), untransposed; the Hadamard transform stays applied."""
        from . import reference_fp8
        return reference_fp8.dequantize(self)


class QuantizedKV(NamedTuple):
    """K and V quantized once (``quantize_kv``), for attention with bf16/fp16 queries."""

    k: FP8Tensor
    v: FP8Tensor  # in the layout the kernel reads: V^T, or row-major where it transposes V (kernel_v_transposed)

    def attend(self, q: torch.Tensor | FP8Tensor, softmax_scale: float | None = None,
               causal: bool = False) -> torch.Tensor:
        """``flash_attn_fp8_func(q, k, v, softmax_scale, causal)``: q is quantized with K's Hadamard seed."""
        return flash_attn_fp8_func(q, self.k, self.v, softmax_scale, causal)


# --- validation ---

def _check_int(name: str, x: Any, minimum: int | None = None) -> None:
    if isinstance(x, bool) or not isinstance(x, int):  # bool is an int subclass; True is a bug here
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")


def _check_headdim(name: str, d: int) -> None:
    if d not in HEADDIMS:
        raise ValueError(f"{name} head dim {d} is not supported by the fp8 path "
                         f"(supported: {', '.join(map(str, HEADDIMS))})")


def check_input(name: str, x: Any) -> None:
    """A tensor to be quantized: bf16/fp16 (batch, seqlen, nheads, headdim), last dim contiguous."""
    validation.check_tensor(name, x)
    if x.dtype == FP8_DTYPE:
        raise TypeError(f"{name} is a float8_e4m3fn tensor without its scales; wrap it in "
                        "FP8Tensor(data, scale, block_size, hadamard_seed, transposed, seqlen)")
    validation.check_dtype(name, x, INPUT_DTYPES)
    validation.check_rank(name, x)
    _check_headdim(name, x.shape[-1])
    validation.check_last_dim_contiguous(name, x)


def check_fp8_tensor(name: str, t: Any) -> None:
    """Every field of an FP8Tensor, and that they agree with one another."""
    if not isinstance(t, FP8Tensor):
        raise TypeError(f"{name} must be an FP8Tensor, got {type(t).__name__}")
    validation.check_tensor(f"{name}.data", t.data)
    if t.data.dtype != FP8_DTYPE:
        raise TypeError(f"{name}.data has dtype {t.data.dtype}; fp8 data must be torch.float8_e4m3fn")
    if not isinstance(t.transposed, bool):
        raise TypeError(f"{name}.transposed must be a bool, got {type(t.transposed).__name__}")
    layout = "(batch, nheads, headdim, seqlen_pad)" if t.transposed else "(batch, seqlen, nheads, headdim)"
    if t.data.dim() != 4:
        raise ValueError(f"{name}.data must have 4 dimensions {layout}, got shape {tuple(t.data.shape)}")
    _check_int(f"{name}.seqlen", t.seqlen, minimum=0)
    if t.block_size is not None:
        _check_int(f"{name}.block_size", t.block_size, minimum=1)
    if t.hadamard_seed is not None:
        _check_int(f"{name}.hadamard_seed", t.hadamard_seed)
    tokens = t.data.shape[3] if t.transposed else t.data.shape[1]
    want = round_up(t.seqlen, VT_GROUP) if t.transposed else t.seqlen
    if tokens != want:
        pad = f" (transposed data is padded to round_up(seqlen, {VT_GROUP}) = {want})" if t.transposed else ""
        raise ValueError(f"{name}.data {layout} has shape {tuple(t.data.shape)}, which does not hold "
                         f"seqlen {t.seqlen} tokens{pad}")
    _check_headdim(name, t.headdim)
    validation.check_tensor(f"{name}.scale", t.scale)
    if t.scale.dtype != torch.float32:
        raise TypeError(f"{name}.scale has dtype {t.scale.dtype}; descales are float32")
    if t.scale.device != t.data.device:
        raise ValueError(f"{name}.scale is on {t.scale.device} but {name}.data is on {t.data.device}")
    target = (t.batch, t.nheads, t.nblocks)
    if t.scale.dim() != 3 or any(n not in (1, m) for n, m in zip(t.scale.shape, target)):
        blocks = ("1 (block_size None)" if t.block_size is None
                  else f"ceil(seqlen / block_size) = ceil({t.seqlen} / {t.block_size}) = {t.nblocks}")
        raise ValueError(f"{name}.scale has shape {tuple(t.scale.shape)}; it must be (batch, nheads, nblocks) = "
                         f"{target} or broadcastable to it, with nblocks = {blocks}")


def check_quant_block_size(block_size: Any, headdim: int, kernel: bool) -> None:
    """The block size of "block" granularity: any positive int in torch, the kernel's limits for the kernel."""
    if block_size is None:
        raise ValueError("block_size must be an int for granularity 'block' "
                         "(granularity 'head' or 'tensor' takes none)")
    _check_int("block_size", block_size, minimum=1)
    limit = QUANT_MAX_BLOCK_ELEMENTS // headdim
    if kernel and (block_size % QUANT_BLOCK_MULTIPLE or block_size * headdim % QUANT_WARP_ELEMENTS
                   or block_size > limit):
        raise ValueError(f"block_size {block_size}: the quantization kernel needs a multiple of "
                         f"{max(QUANT_BLOCK_MULTIPLE, QUANT_WARP_ELEMENTS // headdim)} with block_size * headdim <= "
                         f"{QUANT_MAX_BLOCK_ELEMENTS} (headdim {headdim}: at most {limit}); kernel=False quantizes "
                         "in torch with any block size")


_Q_WHY = f"the fp8 kernel applies one Q scale per {Q_BLOCK} query rows"


def _check_aligned(name: str, block_size: int | None, unit: int, why: str) -> None:
    if block_size is not None and block_size % unit:
        raise ValueError(f"{name} {block_size}: {why}, so it must be a multiple of {unit} "
                         "(or None: one scale per head)")


def check_tile_alignment(q8: FP8Tensor, k8: FP8Tensor, v8: FP8Tensor, tiles: tuple[int, int]) -> None:
    """Scale blocks against the kernel's tiles (docs/fp8.md): Q % 64, K and V % block_n."""
    _check_aligned("q.block_size", q8.block_size, Q_BLOCK, _Q_WHY)
    for name, t in (("k", k8), ("v", v8)):
        _check_aligned(f"{name}.block_size", t.block_size, tiles[1],
                       f"the fp8 kernel for head dim {t.headdim} applies one {name.upper()} scale per block of "
                       f"{tiles[1]} keys")


def _logical_shape(x: torch.Tensor | FP8Tensor) -> tuple[int, int, int, int]:
    """(batch, seqlen, nheads, headdim) of a tensor to quantize or of a (validated) FP8Tensor."""
    if isinstance(x, FP8Tensor):
        return x.batch, x.seqlen, x.nheads, x.headdim
    b, s, h, d = x.shape
    return b, s, h, d


def _check_shapes(q: torch.Tensor | FP8Tensor, k: torch.Tensor | FP8Tensor, v: torch.Tensor | FP8Tensor) -> Shapes:
    b, sq, hq, d = _logical_shape(q)
    kb, sk, hkv, kd = _logical_shape(k)
    vshape = _logical_shape(v)
    if kb != b:
        raise ValueError(f"k batch size {kb} does not match q batch size {b}")
    if kd != d:
        raise ValueError(f"k head dim {kd} does not match q head dim {d}")
    if vshape != (kb, sk, hkv, kd):
        raise ValueError(f"v (batch, seqlen, nheads, headdim) {vshape} must equal k's {(kb, sk, hkv, kd)}")
    if (hkv == 0 and hq != 0) or (hkv > 0 and hq % hkv != 0):
        raise ValueError(f"q nheads {hq} must be a multiple of k/v nheads {hkv} (grouped-query attention)")
    return Shapes(b, sq, sk, hq, hkv, d)


def _check_same_device(q: torch.Tensor | FP8Tensor, k: torch.Tensor | FP8Tensor, v: torch.Tensor | FP8Tensor) -> None:
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; q, k and v must share one device")


def check_fp8_inputs(q8: Any, k8: Any, v8: Any, tiles: tuple[int, int] | None = None,
                     v_transposed: bool = True) -> Shapes:
    """Checks of quantized q, k, v for attention, v in the V^T layout (``v_transposed``, what the reference
    and the default kernels read) or else row-major (``kernel_v_transposed`` says which one a kernel takes);
    ``tiles`` (block_m, block_n) of the kernel that will run adds its block alignment."""
    for name, t in (("q", q8), ("k", k8), ("v", v8)):
        check_fp8_tensor(name, t)
    for name, t in (("q", q8), ("k", k8)):
        if t.transposed:
            raise ValueError(f"{name} must be in the (batch, seqlen, nheads, headdim) layout; only v is transposed")
    if v_transposed and not v8.transposed:
        raise ValueError("v must be in the V^T layout (transposed=True); fp8.to_vt converts")
    if not v_transposed and v8.transposed:
        raise ValueError(f"v must be in the (batch, seqlen, nheads, headdim) layout (transposed=False): this build's "
                         f"fp8 kernel for head dim {v8.headdim} transposes V itself "
                         "(FLASHHOPPER_FP8_V_TRANSPOSE_IN_KERNEL); fp8.from_vt converts")
    _check_same_device(q8, k8, v8)
    shapes = _check_shapes(q8, k8, v8)
    if q8.hadamard_seed != k8.hadamard_seed:
        raise ValueError(f"k.hadamard_seed {k8.hadamard_seed} does not match q.hadamard_seed {q8.hadamard_seed}: "
                         "QK^T is preserved only when Q and K are transformed with the same signs")
    if v8.hadamard_seed is not None:
        raise ValueError(f"v.hadamard_seed must be None (V is never Hadamard-transformed), got {v8.hadamard_seed}")
    if tiles is not None:
        check_tile_alignment(q8, k8, v8, tiles)
    return shapes


# --- V^T ---

def vt_key_index(seqlen_pad: int, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 (seqlen_pad,): the key stored at each position of the V^T layout."""
    order = torch.tensor(VT_ORDER, device=device)
    return (order + torch.arange(0, seqlen_pad, VT_GROUP, device=device)[:, None]).reshape(-1)


def to_vt(v: FP8Tensor) -> FP8Tensor:
    """fp8 V in (batch, seqlen, nheads, headdim) -> the kernel's V^T layout: (batch, nheads, headdim,
    round_up(seqlen, 16)), keys permuted in groups of 16, zero padding; scales unchanged. Already
    transposed: returned as is."""
    check_fp8_tensor("v", v)
    if v.transposed:
        return v
    b, s, h, d = v.data.shape
    sp = round_up(s, VT_GROUP)
    raw = v.data.view(torch.uint8)  # fp8 0.0 is byte 0; uint8 has every indexing op on every device
    padded = raw.new_zeros((b, sp, h, d))
    padded[:, :s] = raw
    vt = padded[:, vt_key_index(sp, raw.device)].permute(0, 2, 3, 1).contiguous()
    return v._replace(data=vt.view(FP8_DTYPE), transposed=True)


def from_vt(v: FP8Tensor) -> FP8Tensor:
    """The inverse of ``to_vt``: fp8 V^T (permuted keys, padding) -> (batch, seqlen, nheads, headdim),
    contiguous; scales unchanged. Not transposed: returned as is."""
    check_fp8_tensor("v", v)
    if not v.transposed:
        return v
    b, h, d, sp = v.data.shape
    raw = v.data.view(torch.uint8)
    x = raw.new_empty((b, sp, h, d))
    x[:, vt_key_index(sp, raw.device)] = raw.permute(0, 3, 1, 2)
    return v._replace(data=x[:, : v.seqlen].contiguous().view(FP8_DTYPE), transposed=False)


def kernel_v_transposed(headdim: int) -> bool:
    """Whether this build's fp8 forward kernel for ``headdim`` reads V as V^T (docs/fp8.md; the default, and
    always without the extension) or row-major like K, transposing it in the kernel (a build with
    FLASHHOPPER_FP8_V_TRANSPOSE_IN_KERNEL: head dims 64 and 128; ``_C.fp8_v_transposed_in_kernel``)."""
    if not _ext.has_extension():
        return True
    in_kernel = getattr(_ext.extension(), "fp8_v_transposed_in_kernel", None)  # absent from older builds
    return in_kernel is None or not in_kernel(headdim)


def to_kernel_layout(v: FP8Tensor, transposed: bool) -> FP8Tensor:
    """v in the V^T layout (``transposed``) or row-major: ``to_vt`` / ``from_vt`` (a copy) when it is not."""
    return to_vt(v) if transposed else from_vt(v)


def _vt_strides(vt: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, dim) strides of a (batch, nheads, headdim, seqlen_pad) tensor, size-1 dims packed
    (their strides are arbitrary; see validation.kernel_strides)."""
    b, h, d, _ = vt.shape
    sb, sh, sd, _ = vt.stride()
    if h == 1:
        sh = d * sd
    if b == 1:
        sb = h * sh
    return sb, sh, sd


def _check_vt_layout(name: str, vt: torch.Tensor) -> None:
    validation.check_last_dim_contiguous(name, vt)
    if vt.data_ptr() % validation.TMA_ALIGN_BYTES:
        raise ValueError(f"{name} data pointer {vt.data_ptr():#x} is not {validation.TMA_ALIGN_BYTES}-byte aligned; "
                         "call .contiguous()")
    for what, stride in zip(("batch", "head", "dim"), _vt_strides(vt)):
        if stride == 0 or stride % validation.TMA_ALIGN_BYTES:  # 1-byte elements: strides are bytes
            raise ValueError(f"{name} (V^T) {what} stride {stride} must be a nonzero multiple of "
                             f"{validation.TMA_ALIGN_BYTES} bytes; call .contiguous()")


# --- quantization ---

def default_kv_block_size(headdim: int, causal: bool | None = None) -> int:
    """K/V scale block: the fp8 kernel's block_n (causal None: a block that suits both the causal and the
    non-causal kernel when the quantization kernel allows one, else the non-causal one's); 128 without
    a kernel table."""
    kinds = (False, True) if causal is None else (causal,)
    ns = [t[1] for t in (_ext.fp8_kernel_tiles(headdim, c) for c in kinds) if t is not None]
    if not ns:
        return DEFAULT_KV_BLOCK
    n = math.lcm(*ns)
    if n % QUANT_BLOCK_MULTIPLE or n * headdim % QUANT_WARP_ELEMENTS or n * headdim > QUANT_MAX_BLOCK_ELEMENTS:
        n = ns[0]
    return n


def _use_quant_kernel(x: torch.Tensor, granularity: str, kernel: bool | None) -> bool:
    available = x.is_cuda and granularity == "block" and _ext.has_fp8_quantize()
    if kernel is None:
        return available
    if not kernel or available:
        return kernel
    if not x.is_cuda:
        why = f"x is on {x.device}; the quantization kernel needs a CUDA tensor"
    elif granularity != "block":
        why = f"the quantization kernel makes 'block' scales only, not {granularity!r}"
    else:
        err = _ext.extension_error()
        why = ("this build has no fp8 quantization kernel; rebuild with FLASHHOPPER_ARCHS=90 and "
               "FLASHHOPPER_DTYPES including e4m3")
        why += f" (the compiled extension did not import: {err})" if err else ""
    raise ValueError(f"kernel=True: {why}")


def _device_signs(device: torch.device, headdim: int, seed: int) -> torch.Tensor:
    # Cached and never freed: a launch reads them asynchronously, and they are headdim floats.
    key = (device.index if device.index is not None else torch.cuda.current_device(), headdim, seed)
    signs = _signs_cache.get(key)
    if signs is None:
        signs = _signs_cache[key] = hadamard_signs(headdim, seed).to(torch.device("cuda", key[0]))
    return signs


def fill_quant_params(p: Any, c_dtype: Any, x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor,
                      block_size: int, signs: torch.Tensor | None, transpose: bool) -> Any:
    """Write pointers, strides (in elements) and sizes into a ``_C.QuantParams`` (docs/fp8.md)."""
    b, s, h, d = x.shape
    p.x_ptr, p.out_ptr, p.scale_ptr = x.data_ptr(), out.data_ptr(), scale.data_ptr()
    p.signs_ptr = 0 if signs is None else signs.data_ptr()
    p.x_batch_stride, p.x_row_stride, p.x_head_stride = validation.kernel_strides(x)
    if transpose:
        p.out_batch_stride, p.out_head_stride, p.out_dim_stride = _vt_strides(out)
        p.out_row_stride = 1  # unused: V^T's keys are contiguous
    else:
        p.out_batch_stride, p.out_row_stride, p.out_head_stride = validation.kernel_strides(out)
        p.out_dim_stride = 1
    p.scale_batch_stride, p.scale_head_stride, p.scale_block_stride = scale.stride()
    p.batch, p.seqlen, p.nheads, p.headdim = b, s, h, d
    p.block_size = block_size
    p.transpose = transpose
    p.dtype = c_dtype
    p.device = x.device.index if x.is_cuda else 0
    return p


def _quantize_kernel(x: torch.Tensor, block_size: int, seed: int | None, transpose: bool) -> FP8Tensor:
    validation.check_alignment("x", x)  # 16-byte loads
    b, s, h, d = x.shape
    shape = (b, h, d, round_up(s, VT_GROUP)) if transpose else (b, s, h, d)
    out = torch.empty(shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((b, h, nblocks(s, block_size)), dtype=torch.float32, device=x.device)
    if x.numel() > 0:
        C = _ext.extension()
        p = getattr(_local, "quant_params", None)
        if p is None:
            p = _local.quant_params = C.QuantParams()
        signs = None if seed is None else _device_signs(x.device, d, seed)
        fill_quant_params(p, ops._c_dtype(x.dtype), x, out, scale, block_size, signs, transpose)
        C.quantize_fp8(p, torch.cuda.current_stream(x.device.index).cuda_stream)
    return FP8Tensor(out, scale, block_size, seed, transpose, s)


@torch.no_grad()
def quantize_fp8(x: torch.Tensor, block_size: int | None = 128, hadamard: bool = True, seed: int = 0,
                 granularity: str = "block", transpose: bool = False, *, kernel: bool | None = None) -> FP8Tensor:
    """Quantize bf16/fp16 ``x`` (batch, seqlen, nheads, headdim), headdim 64/128/256, to e4m3 (docs/fp8.md).

    granularity: "block" (one scale per ``block_size`` tokens of a (batch, head)), "head" (one per
    (batch, head)) or "tensor" (one in all); block_size is ignored for the last two.
    hadamard: first transform each row with the random-sign Hadamard matrix of ``seed`` (for Q and K,
    which must share the seed; never for V). transpose: write V^T, the layout the kernel reads V in.
    kernel: None uses the quantization kernel where it applies (CUDA, "block", compiled), else the
    torch math of ``reference_fp8.quantize_ref``; True requires the kernel, False forces torch. The
    kernel needs block_size a multiple of 16 with block_size * headdim <= 32768.
    """
    check_input("x", x)
    validation.check_flag("hadamard", hadamard)
    validation.check_flag("transpose", transpose)
    _check_int("seed", seed)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(map(repr, GRANULARITIES))}, got {granularity!r}")
    if kernel is not None:
        validation.check_flag("kernel", kernel)
    use_kernel = _use_quant_kernel(x, granularity, kernel)
    if granularity == "block":
        check_quant_block_size(block_size, x.shape[-1], use_kernel)
    hadamard_seed = seed if hadamard else None
    if use_kernel:
        return _quantize_kernel(x, block_size, hadamard_seed, transpose)  # type: ignore[arg-type]
    from . import reference_fp8
    return reference_fp8.quantize_ref(x, block_size if granularity == "block" else None, granularity,
                                      hadamard_seed, transpose)


def quantize_kv(k: torch.Tensor, v: torch.Tensor, block_size: int | None = None, hadamard: bool = True,
                seed: int = 0, *, causal: bool | None = None) -> QuantizedKV:
    """Quantize K (Hadamard signs of ``seed`` when ``hadamard``) and V (as V^T, or row-major for a kernel
    that transposes V itself: ``kernel_v_transposed``) once, e.g. a KV cache.

    block_size None: the fp8 kernel's block_n for this head dim (``default_kv_block_size``; pass
    ``causal`` when the causal and non-causal kernels' block_n have no common block that the
    quantization kernel allows), 128 without a kernel table.
    """
    check_input("k", k)
    check_input("v", v)
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    if causal is not None:
        validation.check_flag("causal", causal)
    if block_size is None:
        block_size = default_kv_block_size(k.shape[-1], causal)
    transpose = not k.is_cuda or kernel_v_transposed(k.shape[-1])  # the layout the fp8 kernel reads V in
    return QuantizedKV(quantize_fp8(k, block_size, hadamard, seed),
                       quantize_fp8(v, block_size, hadamard=False, transpose=transpose))


# --- attention ---

def _require_fp8_kernel(device: torch.device, headdim: int, causal: bool) -> tuple[int, int]:
    """(block_m, block_n) of the fp8 kernel that runs on ``device``, or ValueError saying what to rebuild."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    info = _device.device_info(index)
    where = f"cuda:{index} ({info.name}, compute capability {info.capability[0]}.{info.capability[1]})"
    if info.capability != (9, 0):
        raise ValueError(f"q is on {where}; the fp8 kernels run on compute capability 9.0 (Hopper) only "
                         "(CPU tensors run the reference emulation)")
    tiles = _ext.fp8_kernel_tiles(headdim, causal)
    if tiles is None:
        err = _ext.extension_error()
        raise ValueError(f"q: this build has no fp8 (float8_e4m3fn) forward kernel for head dim {headdim} "
                         f"{'causal' if causal else 'non-causal'}; rebuild with FLASHHOPPER_ARCHS=90, "
                         f"FLASHHOPPER_DTYPES including e4m3 (e.g. 'bf16;e4m3') and FLASHHOPPER_HDIMS including "
                         f"{headdim}" + (f"; the compiled extension did not import: {err}" if err else ""))
    return tiles


def _kernel_tiles(device: torch.device, headdim: int, causal: bool) -> tuple[int, int] | None:
    """The tiles of the kernel that will run, None for the reference emulation (non-CUDA devices)."""
    return _require_fp8_kernel(device, headdim, causal) if device.type == "cuda" else None


def fill_fp8_params(p: Any, fp8_dtype: Any, q8: FP8Tensor, k8: FP8Tensor, v8: FP8Tensor, out: torch.Tensor,
                    lse: torch.Tensor, softmax_scale: float, causal: bool, counter: int = 0) -> Any:
    """Write pointers, strides (in elements) and sizes into a ``_C.FwdParams`` for the fp8 forward
    (docs/fp8.md); ``counter`` is the address of the tile counter (causal kernels need one). V^T or
    row-major V as v8 is; the stride its layout does not use is set to 1, which the launcher refuses if
    the kernel reads the other layout."""
    b, sq, hq, d = q8.data.shape
    p.q_ptr, p.k_ptr, p.v_ptr = q8.data.data_ptr(), k8.data.data_ptr(), v8.data.data_ptr()
    p.o_ptr, p.lse_ptr, p.tile_counter = out.data_ptr(), lse.data_ptr(), counter
    ops._fill_strides(p, q=q8.data, k=k8.data, o=out)
    if v8.transposed:
        p.v_batch_stride, p.v_head_stride, p.v_dim_stride = _vt_strides(v8.data)
        p.v_row_stride = 1  # unused by V^T kernels (docs/fp8.md): V^T's keys are contiguous
    else:
        ops._fill_strides(p, v=v8.data)
        p.v_dim_stride = 1  # unused by the kernels that transpose V themselves
    p.batch, p.seqlen_q, p.seqlen_k = b, q8.seqlen, k8.seqlen
    p.nheads_q, p.nheads_kv, p.headdim = hq, k8.nheads, d
    p.softmax_scale = softmax_scale
    p.causal = causal
    p.dtype = fp8_dtype
    for name, t in (("q", q8), ("k", k8), ("v", v8)):
        scales = t.scales()  # stride 0 along broadcast dims: the kernel reads the same scale there
        setattr(p, f"{name}_scale_ptr", scales.data_ptr())
        for what, stride in zip(("batch", "head", "block"), scales.stride()):
            setattr(p, f"{name}_scale_{what}_stride", stride)
        block = NO_BLOCK if t.block_size is None or t.block_size >= NO_BLOCK else t.block_size
        setattr(p, f"{name}_scale_block", block)
    if q8.data.is_cuda:
        p.device = q8.data.device.index
        p.num_sms = _device.device_info(q8.data.device.index).num_sms
    return p


def _launch_fp8(q8: FP8Tensor, k8: FP8Tensor, v8: FP8Tensor, out: torch.Tensor, lse: torch.Tensor,
                softmax_scale: float, causal: bool) -> None:
    if out.numel() == 0:  # batch, seqlen_q or nheads 0: nothing to compute
        return
    if k8.seqlen == 0:  # no keys: every row is a row with no key
        out.zero_()
        lse.fill_(float("-inf"))
        return
    for name, x in (("q", q8.data), ("k", k8.data), ("out", out)):
        validation.check_kernel_layout(name, x)
    if v8.transposed:
        _check_vt_layout("v", v8.data)
    else:
        validation.check_kernel_layout("v", v8.data)
    C = _ext.extension()
    p = getattr(_local, "fwd_params", None)
    if p is None:
        p = _local.fwd_params = C.FwdParams()
    index = q8.data.device.index
    stream = torch.cuda.current_stream(index).cuda_stream
    counter = ops.tile_counter(index, stream).data_ptr() if causal else 0
    fill_fp8_params(p, C.DType.float8_e4m3fn, q8, k8, v8, out, lse, softmax_scale, causal, counter)
    C.fwd(p, 90, stream)


def _softmax_scale(softmax_scale: Any, headdim: int) -> float:
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else validation.check_softmax_scale(softmax_scale)


def fwd_fp8_into(q8: FP8Tensor, k8: FP8Tensor, v8: FP8Tensor, out: torch.Tensor, lse: torch.Tensor,
                 softmax_scale: float | None, causal: bool) -> None:
    """Run the fp8 forward kernel, writing into caller-provided ``out`` (bfloat16 (batch, seqlen_q,
    nheads_q, headdim)) and ``lse`` (float32, contiguous (batch, nheads_q, seqlen_q)); v8 in either layout,
    brought by a copy to the one this build's kernel reads (``kernel_v_transposed``: V^T unless the build
    transposes V in the kernel) when it is not in it. Checks everything first; tests use it to poison the
    outputs before a run."""
    validation.check_flag("causal", causal)
    check_fp8_tensor("q", q8)
    if q8.device.type != "cuda":
        raise ValueError(f"q is on {q8.device}; the fp8 kernels need CUDA tensors")
    tiles = _require_fp8_kernel(q8.device, q8.headdim, causal)
    v_transposed = kernel_v_transposed(q8.headdim)
    if isinstance(v8, FP8Tensor) and isinstance(v8.transposed, bool) and v8.transposed != v_transposed:
        v8 = to_kernel_layout(v8, v_transposed)
    shapes = check_fp8_inputs(q8, k8, v8, tiles, v_transposed)
    scale = _softmax_scale(softmax_scale, shapes.headdim)
    validation.check_tensor("out", out)
    want = (shapes.batch, shapes.seqlen_q, shapes.nheads_q, shapes.headdim)
    if tuple(out.shape) != want or out.dtype != torch.bfloat16 or out.device != q8.device:
        raise ValueError(f"out must be bfloat16 of shape {want} on {q8.device}, "
                         f"got {tuple(out.shape)} {out.dtype} {out.device}")
    validation.check_lse("lse", lse, q8.data)
    _launch_fp8(q8, k8, v8, out, lse, scale, causal)


@overload
def flash_attn_fp8_func(q: torch.Tensor | FP8Tensor, k: torch.Tensor | FP8Tensor, v: torch.Tensor | FP8Tensor,
                        softmax_scale: float | None = ..., causal: bool = ..., return_lse: Literal[False] = ...,
                        hadamard: bool = ..., seed: int = ..., q_block_size: int | None = ...,
                        kv_block_size: int | None = ...) -> torch.Tensor: ...


@overload
def flash_attn_fp8_func(q: torch.Tensor | FP8Tensor, k: torch.Tensor | FP8Tensor, v: torch.Tensor | FP8Tensor,
                        softmax_scale: float | None = ..., causal: bool = ..., *, return_lse: Literal[True],
                        hadamard: bool = ..., seed: int = ..., q_block_size: int | None = ...,
                        kv_block_size: int | None = ...) -> tuple[torch.Tensor, torch.Tensor]: ...


@torch.no_grad()
def flash_attn_fp8_func(q: torch.Tensor | FP8Tensor, k: torch.Tensor | FP8Tensor, v: torch.Tensor | FP8Tensor,
                        softmax_scale: float | None = None, causal: bool = False, return_lse: bool = False,
                        hadamard: bool = True, seed: int = 0, q_block_size: int | None = None,
                        kv_block_size: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with fp8 (e4m3) Q, K, V; flash-attn layout, forward only.

    Each of q (batch, seqlen_q, nheads_q, headdim), k, v (batch, seqlen_k, nheads_kv, headdim) is a
    bf16/fp16 tensor, quantized here, or an FP8Tensor (``quantize_fp8``; v may be in either layout: it is
    copied to the one the kernel reads, ``kernel_v_transposed``, when it is not in it).
    Quantized here: Q in blocks of ``q_block_size`` (default 64) tokens, K and V of ``kv_block_size``
    (default the kernel's block_n); Q and K with the Hadamard signs of ``seed`` when ``hadamard``. When
    k (or q) is an FP8Tensor, the other is quantized with its hadamard_seed instead, so that bf16
    queries can attend to a pre-quantized K/V; two FP8Tensors must carry the same seed.
    softmax_scale defaults to 1/sqrt(headdim); causal is bottom-right aligned, as in flash_attn_func.

    CUDA tensors run the fp8 kernel (ValueError when this build has none for the configuration); CPU
    tensors run ``reference_fp8.attention_fp8_ref``. Returns out (bfloat16 (batch, seqlen_q, nheads_q,
    headdim)), or (out, lse) with lse float32 (batch, nheads_q, seqlen_q), natural log.
    """
    validation.check_flag("causal", causal)
    validation.check_flag("return_lse", return_lse)
    validation.check_flag("hadamard", hadamard)
    _check_int("seed", seed)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, FP8Tensor):
            check_fp8_tensor(name, x)
        else:
            check_input(name, x)
    for name, t in (("q", q), ("k", k)):
        if isinstance(t, FP8Tensor) and t.transposed:
            raise ValueError(f"{name} must be in the (batch, seqlen, nheads, headdim) layout; only v is transposed")
    _check_same_device(q, k, v)
    shapes = _check_shapes(q, k, v)  # before any quantization work
    scale = _softmax_scale(softmax_scale, shapes.headdim)
    tiles = _kernel_tiles(q.device, shapes.headdim, causal)

    # Block sizes for what is quantized here.
    for name, bs, given in (("q_block_size", q_block_size, (q,)), ("kv_block_size", kv_block_size, (k, v))):
        if bs is None:
            continue
        _check_int(name, bs, minimum=1)
        if all(isinstance(x, FP8Tensor) for x in given):
            raise ValueError(f"{name} sets the block size of tensors quantized here, but "
                             f"{'q is' if name == 'q_block_size' else 'k and v are'} already FP8Tensor")
    q_bs = Q_BLOCK if q_block_size is None else q_block_size
    kv_bs = default_kv_block_size(shapes.headdim, causal) if kv_block_size is None else kv_block_size
    if tiles is not None:  # fail before quantizing anything
        if not isinstance(q, FP8Tensor):
            _check_aligned("q_block_size", q_bs, Q_BLOCK, _Q_WHY)
        if not (isinstance(k, FP8Tensor) and isinstance(v, FP8Tensor)):
            _check_aligned("kv_block_size", kv_bs, tiles[1], f"the fp8 kernel for head dim {shapes.headdim} applies "
                           f"one K and V scale per block of {tiles[1]} keys")

    # Q and K must share their Hadamard signs; a pre-quantized one decides.
    if isinstance(q, FP8Tensor) and isinstance(k, FP8Tensor) and q.hadamard_seed != k.hadamard_seed:
        raise ValueError(f"k.hadamard_seed {k.hadamard_seed} does not match q.hadamard_seed {q.hadamard_seed}: "
                         "QK^T is preserved only when Q and K are transformed with the same signs")
    if isinstance(v, FP8Tensor) and v.hadamard_seed is not None:
        raise ValueError(f"v.hadamard_seed must be None (V is never Hadamard-transformed), got {v.hadamard_seed}")
    if isinstance(k, FP8Tensor):
        qk_seed = k.hadamard_seed
    elif isinstance(q, FP8Tensor):
        qk_seed = q.hadamard_seed
    else:
        qk_seed = seed if hadamard else None

    def quantize(x: torch.Tensor | FP8Tensor, block: int, seed_: int | None, transpose: bool = False) -> FP8Tensor:
        if isinstance(x, FP8Tensor):
            return x
        return quantize_fp8(x, block, seed_ is not None, 0 if seed_ is None else seed_, transpose=transpose)

    # V^T for the reference (CPU) and the default kernels; row-major for a kernel that transposes V itself.
    v_transposed = tiles is None or kernel_v_transposed(shapes.headdim)
    q8 = quantize(q, q_bs, qk_seed)
    k8 = quantize(k, kv_bs, qk_seed)
    v8 = to_kernel_layout(v, v_transposed) if isinstance(v, FP8Tensor) else quantize(v, kv_bs, None, v_transposed)
    check_fp8_inputs(q8, k8, v8, tiles, v_transposed)

    if tiles is not None:
        out = torch.empty((shapes.batch, shapes.seqlen_q, shapes.nheads_q, shapes.headdim), dtype=torch.bfloat16,
                          device=q8.device)
        lse = torch.empty((shapes.batch, shapes.nheads_q, shapes.seqlen_q), dtype=torch.float32, device=q8.device)
        _launch_fp8(q8, k8, v8, out, lse, scale, causal)
    else:
        from . import reference_fp8
        out32, lse = reference_fp8.attention_fp8_ref(q8, k8, v8, scale, causal)
        out = out32.to(torch.bfloat16, memory_format=torch.contiguous_format)
    return (out, lse) if return_lse else out
