"""Packed batches of fp8 tokens (flash-attn's varlen layout, docs/fp8.md "Packed batches"): PackedFP8Tensor,
its invariants, and where each token's scale and V^T key live. Plain torch, device-side index arithmetic
only (no host copy of cu_seqlens), so the conversions may run inside a CUDA-graph capture.

Each sequence is quantized in blocks of its own, aligned with its first token: sequence b's block j is block
``cu_seqlens[b] // block_size + b + j`` of one block mode shared by all sequences (``first_block``), which
leaves every sequence its ceil(length / block_size) blocks without overlap, ``total // block_size + batch``
blocks in all. The scales are (nheads, nblocks); V^T's keys follow the same blocks: (nheads, headdim,
nblocks * block_size), sequence b's keys from column first_block(b) * block_size on, permuted in groups of 16
as in the padded layout; columns of no token hold zeros.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import validation
from .format import FP8_DTYPE, VT_GROUP, check_headdim, check_int, check_seed


def packed_nblocks(total: int, batch: int, block_size: int) -> int:
    """Scale blocks of a packed tensor of ``total`` tokens in ``batch`` sequences: total // block_size + batch."""
    return total // block_size + batch


def vt_position(key: torch.Tensor) -> torch.Tensor:
    """Position, within its group of 16, of key ``key % 16`` in V^T (the inverse of format.VT_ORDER)."""
    a = key % VT_GROUP
    return 4 * ((a // 2) % 4) + 2 * (a // 8) + a % 2


class PackedFP8Tensor(NamedTuple):
    """A packed batch of e4m3 tokens with float32 descales: ``x ~ float(data) * scale`` (docs/fp8.md).

    data: torch.float8_e4m3fn (total, nheads, headdim); or, when ``transposed``, V^T (nheads, headdim,
      nblocks * block_size), each sequence's keys from its first block's column on, permuted in groups of 16.
    scale: float32 (nheads, nblocks), nblocks = total // block_size + batch; token t of sequence b uses
      scale[:, cu_seqlens[b] // block_size + b + (t - cu_seqlens[b]) // block_size].
    block_size: tokens per scale (a block never spans two sequences).
    hadamard_seed: seed of the Hadamard signs applied to the rows, None for none (Q and K share one; V never).
    transposed: data is V^T.
    cu_seqlens: int32 (batch + 1,) on data's device, the sequences' token offsets (flash-attn's).
    total: tokens of the packed tensor (rows of the untransposed data).
    """

    data: torch.Tensor
    scale: torch.Tensor
    block_size: int
    hadamard_seed: int | None
    transposed: bool
    cu_seqlens: torch.Tensor
    total: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def nheads(self) -> int:
        return self.data.shape[0 if self.transposed else 1]

    @property
    def headdim(self) -> int:
        return self.data.shape[1 if self.transposed else 2]

    @property
    def nblocks(self) -> int:
        return packed_nblocks(self.total, self.batch, self.block_size)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self) -> torch.Tensor:
        """float32 (total, nheads, headdim), untransposed; tokens of no sequence are 0."""
        return dequantize_packed(self)


def check_packed_fp8_tensor(name: str, t: Any) -> None:
    """Every field of a PackedFP8Tensor, and that they agree with one another (shapes only: no values read)."""
    if not isinstance(t, PackedFP8Tensor):
        raise TypeError(f"{name} must be a PackedFP8Tensor (quantize_fp8 with cu_seqlens), got {type(t).__name__}")
    validation.check_tensor(f"{name}.data", t.data)
    if t.data.dtype != FP8_DTYPE:
        raise TypeError(f"{name}.data has dtype {t.data.dtype}; fp8 data must be torch.float8_e4m3fn")
    if not isinstance(t.transposed, bool):
        raise TypeError(f"{name}.transposed must be a bool, got {type(t.transposed).__name__}")
    check_int(f"{name}.block_size", t.block_size, minimum=1)
    check_int(f"{name}.total", t.total, minimum=0)
    if t.hadamard_seed is not None:
        check_seed(f"{name}.hadamard_seed", t.hadamard_seed)
    validation.check_tensor(f"{name}.cu_seqlens", t.cu_seqlens)
    if t.cu_seqlens.dtype != torch.int32 or t.cu_seqlens.dim() != 1 or t.cu_seqlens.shape[0] < 1:
        raise ValueError(f"{name}.cu_seqlens must be int32 of shape (batch + 1,), got {t.cu_seqlens.dtype} "
                         f"{tuple(t.cu_seqlens.shape)}")
    if t.cu_seqlens.device != t.data.device:
        raise ValueError(f"{name}.cu_seqlens is on {t.cu_seqlens.device} but {name}.data is on {t.data.device}")
    if t.data.dim() != 3:
        layout = "(nheads, headdim, nblocks * block_size)" if t.transposed else "(total, nheads, headdim)"
        raise ValueError(f"{name}.data must have 3 dimensions {layout}, got shape {tuple(t.data.shape)}")
    check_headdim(name, t.headdim)
    if t.transposed:
        want = (t.nheads, t.headdim, t.nblocks * t.block_size)
        if tuple(t.data.shape) != want:
            raise ValueError(f"{name}.data (V^T) has shape {tuple(t.data.shape)}; {t.total} tokens in {t.batch} "
                             f"sequences in blocks of {t.block_size} make it {want}")
    elif t.data.shape[0] != t.total:
        raise ValueError(f"{name}.data has {t.data.shape[0]} tokens but {name}.total is {t.total}")
    validation.check_tensor(f"{name}.scale", t.scale)
    if t.scale.dtype != torch.float32:
        raise TypeError(f"{name}.scale has dtype {t.scale.dtype}; descales are float32")
    if t.scale.device != t.data.device:
        raise ValueError(f"{name}.scale is on {t.scale.device} but {name}.data is on {t.data.device}")
    if tuple(t.scale.shape) != (t.nheads, t.nblocks):
        raise ValueError(f"{name}.scale has shape {tuple(t.scale.shape)}; it must be (nheads, total // block_size + "
                         f"batch) = {(t.nheads, t.nblocks)}")


def token_layout(cu_seqlens: torch.Tensor, total: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every token of a packed tensor (on cu_seqlens' device, int64 (total,)): its scale block, its V^T
    column, and whether it belongs to a sequence (tokens before cu_seqlens[0] or past cu_seqlens[-1] do not;
    their block and column are 0)."""
    cu = cu_seqlens.long()
    batch = cu.shape[0] - 1
    t = torch.arange(total, device=cu.device)
    if batch == 0:
        zero = torch.zeros_like(t)
        return zero, zero, torch.zeros_like(t, dtype=torch.bool)
    seq = (torch.searchsorted(cu, t, right=True) - 1).clamp(0, batch - 1)
    start = cu[seq]
    inside = (t >= start) & (t < cu[seq + 1])
    rel = t - start
    first = start // block_size + seq
    block = torch.where(inside, first + rel // block_size, 0)
    column = torch.where(inside, first * block_size + rel - rel % VT_GROUP + vt_position(rel), 0)
    return block, column, inside


def to_vt_packed(v: PackedFP8Tensor) -> PackedFP8Tensor:
    """Packed fp8 V (total, nheads, headdim) -> its V^T layout (nheads, headdim, nblocks * block_size), zero
    where no token lands; scales unchanged. Already transposed: returned as is."""
    check_packed_fp8_tensor("v", v)
    if v.transposed:
        return v
    _, column, inside = token_layout(v.cu_seqlens, v.total, v.block_size)
    cols = v.nblocks * v.block_size
    raw = v.data.view(torch.uint8)  # fp8 0.0 is byte 0
    vt = raw.new_zeros((v.nheads, v.headdim, cols + 1))
    # Tokens of no sequence go to a spare last column, dropped after.
    vt.index_copy_(2, torch.where(inside, column, cols), raw.permute(1, 2, 0))
    vt = vt[:, :, :cols].contiguous()
    return v._replace(data=vt.view(FP8_DTYPE), transposed=True)


def from_vt_packed(v: PackedFP8Tensor) -> PackedFP8Tensor:
    """The inverse of ``to_vt_packed``: (total, nheads, headdim), tokens of no sequence 0."""
    check_packed_fp8_tensor("v", v)
    if not v.transposed:
        return v
    _, column, inside = token_layout(v.cu_seqlens, v.total, v.block_size)
    raw = v.data.view(torch.uint8)
    x = raw[:, :, column].permute(2, 0, 1)
    x = torch.where(inside[:, None, None], x, 0).contiguous()
    return v._replace(data=x.view(FP8_DTYPE), transposed=False)


def dequantize_packed(t: PackedFP8Tensor) -> torch.Tensor:
    """float32 (total, nheads, headdim): data * scale, V^T brought back to the token layout; tokens of no
    sequence 0. The Hadamard transform, if any, stays applied."""
    check_packed_fp8_tensor("t", t)
    rows = from_vt_packed(t) if t.transposed else t
    block, _, inside = token_layout(t.cu_seqlens, t.total, t.block_size)
    scales = torch.where(inside[:, None], t.scale[:, block].transpose(0, 1), 0.0)  # (total, nheads)
    return rows.data.float() * scales[..., None]
