"""K and V quantized once, e.g. a KV cache, for attention with bf16/fp16 queries."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import _autocast, _plans, validation
from .._plans import Launch
from . import ops
from .attention import _softmax_scale, flash_attn_fp8_func, fp8_key
from .format import FP8Tensor, round_up, seed_int64
from .quantize import default_kv_block_size, quantize_fp8, use_quant_kernel
from .validation import Q_BLOCK, check_input, check_input_alignment


class QuantizedKV(NamedTuple):
    """K and V quantized once (``quantize_kv``), for attention with bf16/fp16 queries."""

    k: FP8Tensor
    v: FP8Tensor  # V^T, the layout the kernels read

    def attend(self, q: torch.Tensor | FP8Tensor, softmax_scale: float | None = None,
               causal: bool = False) -> torch.Tensor:
        """``flash_attn_fp8_func(q, k, v, softmax_scale, causal)``: q is quantized with K's Hadamard seed
        (under CUDA autocast, from the autocast dtype, as there)."""
        key = _call_key(self, q, softmax_scale, causal)
        if key is not None:  # a configuration that passed everything before: quantize q and attend (_plans)
            plan = _PLANS.get(key)
            ptrs = None if plan is None else _plans.pointers(q, self.k.data, self.v.data)  # type: ignore[arg-type]
            if ptrs is not None:
                return plan(q, self.k, self.v, ptrs)
        for name, t in (("k", self.k), ("v", self.v)):
            if not isinstance(t, FP8Tensor):  # flash_attn_fp8_func would quantize it on every call
                raise TypeError(f"{name} must be an FP8Tensor (quantize_kv makes a QuantizedKV), "
                                f"got {type(t).__name__}")
        out = flash_attn_fp8_func(q, self.k, self.v, softmax_scale, causal)
        if key is not None and q.is_cuda and use_quant_kernel(q):  # type: ignore[union-attr]  # (key: a tensor)
            _PLANS.put(key, _AttendPlan.make(q, self.k, self.v, softmax_scale, causal))  # type: ignore[arg-type]
        return out


class _AttendPlan(NamedTuple):
    """QuantizedKV.attend's launches for bf16/fp16 queries (_plans): q's quantization into one scratch buffer
    (its e4m3 rows, at ``scale_offset`` its descales) and the fp8 forward from it, whose lse (not returned) goes
    to the same buffer at ``lse_offset``: one allocation besides out."""

    quantize: Launch
    fwd: Launch
    scale_offset: int
    lse_offset: int
    nbytes: int

    @staticmethod
    def make(q: torch.Tensor, k8: FP8Tensor, v8: FP8Tensor, softmax_scale: float | None, causal: bool) -> _AttendPlan:
        """The plan of a call like ``attend(q, softmax_scale, causal)`` on k8, v8, which just ran on the full path:
        its Q block and Hadamard seed, as flash_attn_fp8_func chose them."""
        data, scale = ops.empty_quantized(q, Q_BLOCK, False)  # contiguous, as the scratch buffer's views
        seed = k8.hadamard_seed
        quantize = ops.quantize_launch(q, data, scale, Q_BLOCK, None if seed is None else seed_int64(seed), False)
        out, lse = ops.empty_outputs(data)
        fwd = ops.fwd_launch(FP8Tensor(data, scale, Q_BLOCK, seed, False, q.shape[1]), k8, v8, out, lse,
                             _softmax_scale(softmax_scale, q.shape[-1]), causal)
        scale_offset = round_up(data.numel(), 16)
        lse_offset = round_up(scale_offset + 4 * scale.numel(), 16)
        return _AttendPlan(quantize, fwd, scale_offset, lse_offset, lse_offset + 4 * lse.numel())

    def __call__(self, q: torch.Tensor, k8: FP8Tensor, v8: FP8Tensor, ptrs: tuple[int, int, int]) -> torch.Tensor:
        """attend(q) on k8, v8, whose data pointers (q's, k8's, v8's) are ``ptrs``."""
        scratch = q.new_empty(self.nbytes, dtype=torch.uint8)  # freed in stream order, as any op's temporary
        q8 = scratch.data_ptr()
        q8_scale = q8 + self.scale_offset
        self.quantize.quantize(ptrs[0], q8, q8_scale)
        out = q.new_empty(q.shape, dtype=torch.bfloat16)  # (contiguous, as the plan's params were filled for)
        self.fwd.fwd(q8, ptrs[1], ptrs[2], out.data_ptr(), q8 + self.lse_offset, 0, 0, q8_scale, k8.scale.data_ptr(),
                     v8.scale.data_ptr())
        return out


# QuantizedKV.attend's configurations that took the full path once: call key -> _AttendPlan.
_PLANS = _plans.Plans()


def _call_key(kv: QuantizedKV, q: Any, softmax_scale: Any, causal: Any) -> tuple[Any, ...] | None:
    """attend's call key (_plans): q a plain tensor, k and v FP8Tensors of plain tensors, v as V^T; else None."""
    k8, v8 = kv
    if (type(q) is not torch.Tensor or type(k8) is not FP8Tensor or type(v8) is not FP8Tensor
            or v8.transposed is not True):
        return None
    kp, vp = fp8_key(k8), fp8_key(v8)
    if kp is None or vp is None or not _plans.direct():
        return None
    return _plans.meta(q), kp, vp, _plans.scalars(softmax_scale, causal)


def quantize_kv(k: torch.Tensor, v: torch.Tensor, block_size: int | None = None, hadamard: bool = True,
                seed: int = 0, *, causal: bool | None = None) -> QuantizedKV:
    """Quantize K (Hadamard signs of ``seed`` when ``hadamard``) and V (as V^T) once, e.g. a KV cache.

    block_size None: the fp8 kernel's block_n for this head dim (``default_kv_block_size``; pass
    ``causal`` when the causal and non-causal kernels' block_n have no common block that the
    quantization kernel allows), 128 without a kernel table.
    Under ``torch.autocast("cuda")``, float32, float16 or bfloat16 k and v on CUDA are cast to the autocast
    dtype first and quantized from it, as in ``quantize_fp8``.
    """
    if _autocast.enabled():
        k, v = _autocast.cast(k, v)
    check_input("k", k)
    check_input("v", v)
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    if v.device != k.device:
        raise ValueError(f"v is on {v.device} but k is on {k.device}; k and v must share one device")
    if use_quant_kernel(k):
        check_input_alignment("k", k)
        check_input_alignment("v", v)
    if causal is not None:
        validation.check_flag("causal", causal)
    if block_size is None:
        block_size = default_kv_block_size(k.shape[-1], causal)
    return QuantizedKV(quantize_fp8(k, block_size, hadamard, seed),
                       quantize_fp8(v, block_size, hadamard=False, transpose=True))
