"""fp8 (e4m3) attention over packed batches (flash-attn's varlen layout), forward only:
``flash_attn_varlen_fp8_func``. q, k, v are packed bf16/fp16 tensors, quantized here per sequence, or
PackedFP8Tensors (``quantize_fp8(..., cu_seqlens=...)``). Validation at shape level first, then the op
``flashhopper::varlen_fwd_fp8`` (the kernel on CUDA, the per-sequence reference emulation on CPU): no host
synchronization, so torch.compile traces it and a CUDA graph may capture it.
"""
from __future__ import annotations

from typing import Any, Literal, overload

import torch

from .. import _autocast, validation
from ..varlen import check_values_here
from . import ops
from .attention import _softmax_scale
from .format import check_int, check_seed
from .packed import PackedFP8Tensor, check_packed_fp8_tensor, to_vt_packed
from .quantize import default_kv_block_size, quantize_fp8
from .validation import (Q_BLOCK, Q_WHY, check_aligned, check_input_alignment, check_packed_input, kv_why,
                         qk_seed)


def require_varlen_kernel(device: torch.device, headdim: int, causal: bool) -> tuple[int, int]:
    """(block_m, block_n) of the packed-batch fp8 kernel for CUDA ``device``, or ValueError saying what to rebuild."""
    problem = ops.device_problem(device.index)
    if problem:
        raise ValueError(f"q is on {problem} (CPU tensors run the reference emulation)")
    tiles = ops.varlen_kernel_tiles(headdim, causal)
    if tiles is None:
        raise ValueError(f"q: {ops.missing_varlen_kernel(headdim, causal)}")
    return tiles


def _check_same_cu(name: str, t: PackedFP8Tensor, cu: torch.Tensor, cu_name: str) -> None:
    """A pre-quantized tensor's blocks follow its own cu_seqlens: they must be the call's."""
    same = t.cu_seqlens is cu or (t.cu_seqlens.shape == cu.shape and (torch.compiler.is_compiling()
                                                                       or t.cu_seqlens.data_ptr() == cu.data_ptr()))
    if not same:
        raise ValueError(f"{name}.cu_seqlens is not {cu_name}: a PackedFP8Tensor's scale blocks follow the "
                         f"sequences it was quantized with, so pass that tensor as {cu_name}")


@overload
def flash_attn_varlen_fp8_func(q: Any, k: Any, v: Any, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float | None = ...,
                               causal: bool = ..., seqused_q: torch.Tensor | None = ...,
                               seqused_k: torch.Tensor | None = ..., return_lse: Literal[False] = ...,
                               hadamard: bool = ..., seed: int = ..., q_block_size: int | None = ...,
                               kv_block_size: int | None = ...) -> torch.Tensor: ...


@overload
def flash_attn_varlen_fp8_func(q: Any, k: Any, v: Any, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float | None = ...,
                               causal: bool = ..., seqused_q: torch.Tensor | None = ...,
                               seqused_k: torch.Tensor | None = ..., *, return_lse: Literal[True],
                               hadamard: bool = ..., seed: int = ..., q_block_size: int | None = ...,
                               kv_block_size: int | None = ...) -> tuple[torch.Tensor, torch.Tensor]: ...


@torch.no_grad()
def flash_attn_varlen_fp8_func(q: torch.Tensor | PackedFP8Tensor, k: torch.Tensor | PackedFP8Tensor,
                               v: torch.Tensor | PackedFP8Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                               softmax_scale: float | None = None, causal: bool = False,
                               seqused_q: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
                               return_lse: bool = False, hadamard: bool = True, seed: int = 0,
                               q_block_size: int | None = None,
                               kv_block_size: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with fp8 (e4m3) Q, K, V over a packed batch; flash_attn_varlen_func's layout and
    sequence arguments (cu_seqlens int32 (batch + 1,) on the device, seqused, max_seqlen Python ints), forward only.

    q (total_q, nheads_q, headdim), k, v (total_k, nheads_kv, headdim): bf16/fp16, quantized here per sequence
    (Q in blocks of ``q_block_size`` tokens, default 64; K and V of ``kv_block_size``, default the kernel's
    block_n; Q and K with the Hadamard signs of ``seed`` when ``hadamard``), or PackedFP8Tensors from
    ``quantize_fp8(x, ..., cu_seqlens=cu_seqlens_q or _k)`` (v transposed or not), quantized with the same
    cu_seqlens tensor; a pre-quantized k (or q) decides the other's Hadamard seed, as in flash_attn_fp8_func.
    Each sequence attends within itself, causal bottom-right per sequence. Returns out (bfloat16 (total_q,
    nheads_q, headdim)), or (out, lse) with lse float32 (nheads_q, total_q); rows of no sequence's used range
    are left unwritten. CUDA tensors run the Hopper kernel (ValueError when the build has none), CPU tensors the
    per-sequence reference emulation (reference_fp8.attention_varlen_fp8_ref).
    """
    if _autocast.enabled():
        casts = [x for x in (q, k, v) if isinstance(x, torch.Tensor)]
        cast = iter(_autocast.cast(*casts))
        q, k, v = (next(cast) if isinstance(x, torch.Tensor) else x for x in (q, k, v))
    validation.check_flag("causal", causal)
    validation.check_flag("return_lse", return_lse)
    validation.check_flag("hadamard", hadamard)
    check_seed("seed", seed)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, PackedFP8Tensor):
            check_packed_fp8_tensor(name, x)
            if name != "v" and x.transposed:
                raise ValueError(f"{name} must be in the (total, nheads, headdim) layout; only v is transposed")
        else:
            check_packed_input(name, x)
    device = q.device
    for name, x in (("k", k), ("v", v)):
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}")
    validation.check_varlen_bounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                                   device)
    for name, x, cu, cu_name in (("q", q, cu_seqlens_q, "cu_seqlens_q"), ("k", k, cu_seqlens_k, "cu_seqlens_k"),
                                 ("v", v, cu_seqlens_k, "cu_seqlens_k")):
        if isinstance(x, PackedFP8Tensor):
            _check_same_cu(name, x, cu, cu_name)

    def dims(x: Any) -> tuple[int, int, int]:  # (tokens, heads, head dim) of either form
        return (x.total, x.nheads, x.headdim) if isinstance(x, PackedFP8Tensor) else tuple(x.shape)  # type: ignore

    (_, hq, d), (tk, hkv, dk), (tv, hv, dv) = dims(q), dims(k), dims(v)
    if dk != d or dv != d:
        raise ValueError(f"k and v head dims ({dk}, {dv}) must equal q's ({d}) in the fp8 kernels")
    if (tv, hv) != (tk, hkv):
        raise ValueError(f"v has {tv} tokens of {hv} heads but k has {tk} of {hkv}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q nheads {hq} must be a multiple of k/v nheads {hkv} (grouped-query attention)")
    scale = _softmax_scale(softmax_scale, d)
    if check_values_here(cu_seqlens_q):
        rows_q, rows_k = (x.data if isinstance(x, PackedFP8Tensor) else x for x in (q, k))  # (total, heads, dim)
        validation.check_varlen_values(rows_q, rows_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       seqused_q, seqused_k)
    tiles = require_varlen_kernel(device, d, causal) if device.type == "cuda" else None
    if tiles is not None and ops.has_quant_kernel():  # fail before quantizing anything, naming the argument
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, PackedFP8Tensor):
                check_input_alignment(name, x.unsqueeze(0))

    for name, bs, given in (("q_block_size", q_block_size, (q,)), ("kv_block_size", kv_block_size, (k, v))):
        if bs is None:
            continue
        check_int(name, bs, minimum=1)
        if all(isinstance(x, PackedFP8Tensor) for x in given):
            raise ValueError(f"{name} sets the block size of tensors quantized here, but "
                             f"{'q is' if name == 'q_block_size' else 'k and v are'} already PackedFP8Tensor")
    q_bs = Q_BLOCK if q_block_size is None else q_block_size
    kv_bs = (tiles[1] if tiles is not None else default_kv_block_size(d, causal)) if kv_block_size is None \
        else kv_block_size
    # Every block size the kernel reads must fit its tiles (packed: no per-head scales).
    q_sizes = [("q.block_size", q.block_size) if isinstance(q, PackedFP8Tensor) else ("q_block_size", q_bs)]
    kv_sizes = [(f"{n}.block_size", x.block_size) if isinstance(x, PackedFP8Tensor) else ("kv_block_size", kv_bs)
                for n, x in (("k", k), ("v", v))]
    for name, bs in q_sizes:
        check_aligned(name, bs, Q_BLOCK, Q_WHY)
    if tiles is not None:
        for name, bs in kv_sizes:
            check_aligned(name, bs, tiles[1], kv_why(d, tiles[1]))

    seed_qk = qk_seed(q, k, v, hadamard, seed, PackedFP8Tensor)

    def quantize(x: Any, cu: torch.Tensor, block: int, seed_: int | None, transpose: bool = False) -> PackedFP8Tensor:
        if isinstance(x, PackedFP8Tensor):
            return to_vt_packed(x) if transpose else x
        return quantize_fp8(x, block, seed_ is not None, 0 if seed_ is None else seed_, transpose=transpose,
                            cu_seqlens=cu)

    q8 = quantize(q, cu_seqlens_q, q_bs, seed_qk)
    k8 = quantize(k, cu_seqlens_k, kv_bs, seed_qk)
    v8 = quantize(v, cu_seqlens_k, kv_bs, None, transpose=True)
    out, lse = ops.varlen_fwd_op(q8.data, q8.scale, k8.data, k8.scale, v8.data, v8.scale, cu_seqlens_q, cu_seqlens_k,
                                 seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, q8.block_size, k8.block_size,
                                 v8.block_size, scale, causal)
    return (out, lse) if return_lse else out
