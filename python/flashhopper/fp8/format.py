"""The fp8 (e4m3) data of docs/fp8.md: FP8Tensor (e4m3 data and float32 descales) and its invariants,
the Hadamard signs a seed names, and V^T, the layout the kernels read V in. Plain torch: no kernel,
no reference math (reference_fp8 builds on this module, never the other way round).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import validation
from ..kernel_key import FP8_HEADDIMS

FP8_DTYPE = torch.float8_e4m3fn
HEADDIMS: tuple[int, ...] = FP8_HEADDIMS
GRANULARITIES: tuple[str, ...] = ("block", "head", "tensor")
# V^T: within each aligned group of 16 keys, position l holds key VT_ORDER[l] (docs/fp8.md).
VT_GROUP = 16


def _vt_key_in_group(lane: Any) -> Any:
    """The key at position ``lane`` (an int or a tensor of them) of a group of 16 in V^T (docs/fp8.md)."""
    return 8 * ((lane % 4) // 2) + 2 * (lane // 4) + lane % 2


VT_ORDER: tuple[int, ...] = tuple(_vt_key_in_group(p) for p in range(VT_GROUP))
# Hadamard seeds are taken as 64 bits (two's complement): the range torch.Generator accepted before.
SEED_MIN, SEED_END = -(1 << 63), 1 << 64
_U32 = 0xFFFFFFFF


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def nblocks(seqlen: int, block_size: int | None) -> int:
    """Scale blocks of a sequence: ceil(seqlen / block_size), 1 for one scale per head (None)."""
    return 1 if block_size is None else -(-seqlen // block_size)


def check_int(name: str, x: Any, minimum: int | None = None) -> None:
    if isinstance(x, bool) or not isinstance(x, int):  # bool is an int subclass; True is a bug here
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")


def check_seed(name: str, seed: Any) -> None:
    check_int(name, seed)
    if not SEED_MIN <= seed < SEED_END:
        raise ValueError(f"{name} must be in [-2**63, 2**64) (a 64-bit seed), got {seed}")


# --- Hadamard signs ---

def _mix32(x: int) -> int:
    """cpp/common/hadamard_signs.h's hash_mix32, on Python ints kept to 32 bits."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _U32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _U32
    x ^= x >> 16
    return x


def hadamard_sign_key(seed: int) -> int:
    """The 32-bit key of a seed's signs: mix(lo32(s) ^ mix(hi32(s) ^ 0x85ebca6b)), s the seed's 64 bits."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return _mix32((s & _U32) ^ _mix32((s >> 32) ^ 0x85EBCA6B))


def hadamard_signs(headdim: int, seed: int = 0) -> torch.Tensor:
    """The ±1 vector (float32, CPU) of the random-sign Hadamard transform for ``seed`` (docs/fp8.md): sign
    i is -1 iff bit 0 of mix(key ^ (i * 0x9e3779b9 mod 2^32)) is set. The quantization kernel computes the
    same signs from the seed itself. headdim: a power of two, the size of a Hadamard transform."""
    check_int("headdim", headdim, minimum=1)
    if headdim & (headdim - 1):
        raise ValueError(f"headdim must be a power of two (the size of a Hadamard transform), got {headdim}")
    check_seed("seed", seed)
    key = hadamard_sign_key(seed)
    return torch.tensor([-1.0 if _mix32(key ^ ((i * 0x9E3779B9) & _U32)) & 1 else 1.0 for i in range(headdim)],
                        dtype=torch.float32)


def seed_int64(seed: int) -> int:
    """The seed's 64 bits as a signed int64 (what torch op schemas and QuantParams.hadamard_seed take)."""
    return ((seed - SEED_MIN) & 0xFFFFFFFFFFFFFFFF) + SEED_MIN


# --- FP8Tensor ---

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
    def shape(self) -> torch.Size:
        """(batch, seqlen, nheads, headdim) of the tensor it stands for, whatever the layout of data (so
        that the shape checks of the bf16 path take it as they take a tensor)."""
        return torch.Size((self.batch, self.seqlen, self.nheads, self.headdim))

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
        return dequantize(self)


def check_headdim(name: str, d: int) -> None:
    if d not in HEADDIMS:
        raise ValueError(f"{name} head dim {d} is not supported by the fp8 path "
                         f"(supported: {', '.join(map(str, HEADDIMS))})")


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
    check_int(f"{name}.seqlen", t.seqlen, minimum=0)
    if t.block_size is not None:
        check_int(f"{name}.block_size", t.block_size, minimum=1)
    if t.hadamard_seed is not None:
        check_seed(f"{name}.hadamard_seed", t.hadamard_seed)
    tokens = t.data.shape[3] if t.transposed else t.data.shape[1]
    want = round_up(t.seqlen, VT_GROUP) if t.transposed else t.seqlen
    if tokens != want:
        pad = f" (transposed data is padded to round_up(seqlen, {VT_GROUP}) = {want})" if t.transposed else ""
        raise ValueError(f"{name}.data {layout} has shape {tuple(t.data.shape)}, which does not hold "
                         f"seqlen {t.seqlen} tokens{pad}")
    check_headdim(name, t.headdim)
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
    # The kernels index a row's scale blocks in 32 bits (launch_fwd.h checks the same bound).
    stride = abs(t.scales().stride(2))
    reach = (t.seqlen // t.block_size + 1) if t.block_size is not None else 1
    if reach * stride > 2**31 - 1:
        raise ValueError(f"{name}.scale's block stride {stride} times {reach} blocks reaches past 2**31 elements; "
                         f"the kernels index a row's scales in 32 bits: pass a (more) contiguous scale tensor")


def token_scales(t: FP8Tensor) -> torch.Tensor:
    """float32 (batch, seqlen, nheads): the descale of every token."""
    block = torch.arange(t.seqlen, device=t.data.device)
    block = block // t.block_size if t.block_size is not None else torch.zeros_like(block)
    return t.scales()[:, :, block].transpose(1, 2)


def dequantize(t: FP8Tensor) -> torch.Tensor:
    """float32 (batch, seqlen, nheads, headdim): data * scale, V^T brought back to the token layout
    (permutation and padding undone). The Hadamard transform, if any, stays applied."""
    check_fp8_tensor("t", t)
    data = t.data.float()
    if t.transposed:
        b, h, d, sp = data.shape
        x = torch.empty((b, sp, h, d), dtype=torch.float32, device=data.device)
        x[:, vt_key_index(sp, data.device)] = data.permute(0, 3, 1, 2)
        data = x[:, : t.seqlen]
    return data * token_scales(t)[..., None]


# --- V^T ---

def vt_key_index(seqlen_pad: int, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 (seqlen_pad,): the key stored at each position of the V^T layout. Arithmetic on an arange made
    on ``device``: no host-to-device copy, which a CUDA-graph capture would refuse."""
    pos = torch.arange(seqlen_pad, device=device)
    lane = pos % VT_GROUP
    return pos - lane + _vt_key_in_group(lane)


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
    return FP8Tensor(vt.view(FP8_DTYPE), v.scale, v.block_size, v.hadamard_seed, True, v.seqlen)


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
    return FP8Tensor(x[:, : v.seqlen].contiguous().view(FP8_DTYPE), v.scale, v.block_size, v.hadamard_seed,
                     False, v.seqlen)


def vt_strides(vt: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, dim) strides of V^T data as the kernel takes them: those of dims it never steps over
    packed (size 1, as validation.kernel_strides does for (b, s, h, d); all of them in an empty tensor,
    whose strides torch leaves arbitrary, with at least one key group per row)."""
    b, h, d, sp = vt.shape
    if vt.numel() == 0:
        sd = max(sp, VT_GROUP)
        return h * d * sd, d * sd, sd
    sb, sh, sd, _ = vt.stride()
    if h == 1:
        sh = d * sd
    if b == 1:
        sb = h * sh
    return sb, sh, sd
