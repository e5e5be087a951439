"""flashhopper: exact attention for NVIDIA Hopper, with an Ampere fallback and a PyTorch reference.

    from flashhopper import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)   # q, k, v: (batch, seqlen, nheads, headdim)
    out.sum().backward()                          # differentiable: fills q.grad, k.grad, v.grad
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import fp8, kvcache_fp8, reference, reference_fp8
from ._ext import build_info, compiled_kernels, extension_error, has_extension
from .dispatch import BACKENDS, available_backends, select_backend
from .fp8 import (FP8Tensor, PackedFP8Tensor, QuantizedKV, flash_attn_fp8_func, flash_attn_varlen_fp8_func,
                  hadamard_signs, quantize_fp8, quantize_kv, to_vt)
from .interface import flash_attn_func
from .kvcache import append_kvcache, flash_attn_with_kvcache
from .reference import attention_kvcache_ref, attention_ref, attention_varlen_ref
from .varlen import flash_attn_varlen_func

try:
    __version__: str = version("flashhopper")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "BACKENDS",
    "FP8Tensor",
    "PackedFP8Tensor",
    "QuantizedKV",
    "__version__",
    "append_kvcache",
    "attention_kvcache_ref",
    "attention_ref",
    "attention_varlen_ref",
    "available_backends",
    "build_info",
    "compiled_kernels",
    "extension_error",
    "flash_attn_fp8_func",
    "flash_attn_func",
    "flash_attn_varlen_fp8_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "fp8",
    "hadamard_signs",
    "has_extension",
    "kvcache_fp8",
    "quantize_fp8",
    "quantize_kv",
    "reference",
    "reference_fp8",
    "select_backend",
    "to_vt",
]
