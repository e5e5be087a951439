"""K and V quantized once, e.g. a KV cache, for attention with bf16/fp16 queries."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import _autocast, _plans, validation
from .attention import QuantizingPlan, _softmax_scale, flash_attn_fp8_func, fp8_key
from .format import FP8Tensor, seed_int64
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
                return plan((q, self.k, self.v), ptrs, False)  # type: ignore[return-value]
        for name, t in (("k", self.k), ("v", self.v)):
            if not isinstance(t, FP8Tensor):  # flash_attn_fp8_func would quantize it on every call
                raise TypeError(f"{name} must be an FP8Tensor (quantize_kv makes a QuantizedKV), "
                                f"got {type(t).__name__}")
        out = flash_attn_fp8_func(q, self.k, self.v, softmax_scale, causal)
        if key is not None and q.is_cuda and use_quant_kernel(q):  # type: ignore[union-attr]  # (key: a tensor)
            # q quantized as flash_attn_fp8_func did: its Q block, with K's Hadamard signs.
            seed = self.k.hadamard_seed
            plan = QuantizingPlan.make((None, self.k, self.v), ((q, 0, Q_BLOCK, None if seed is None else seed_int64(seed),
                                                                 False),),  # type: ignore[arg-type]
                                       _softmax_scale(softmax_scale, q.shape[-1]), causal, False)  # type: ignore[union-attr]
            _PLANS.put(key, plan)
        return out


# QuantizedKV.attend's configurations that took the full path once: call key -> QuantizingPlan.
_PLANS = _plans.Plans()


def _call_key(kv: QuantizedKV, q: Any, softmax_scale: Any, causal: Any) -> tuple[Any, ...] | None:
    """attend's call key (_plans): q a plain tensor, k and v FP8Tensors of plain tensors, v as V^T; else None."""
    k8, v8 = kv
    if (type(q) is not torch.Tensor or type(k8) is not FP8Tensor or type(v8) is not FP8Tensor
            or v8.transposed is not True or not _plans.direct()):  # direct() first: fp8_key reads tensor flags
        return None
    kp, vp = fp8_key(k8), fp8_key(v8)
    if kp is None or vp is None:
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
