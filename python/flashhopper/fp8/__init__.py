"""FP8 (e4m3) attention forward: the format, quantization, and the kernels through torch ops.

    from flashhopper import flash_attn_fp8_func, quantize_kv
    out = flash_attn_fp8_func(q, k, v, causal=True)     # bf16/fp16 in, quantized here, bf16 out
    kv = quantize_kv(k, v)                               # or: quantize K/V once (a KV cache) ...
    out = kv.attend(q)                                   # ... and attend with bf16 queries

The contract with the CUDA side is docs/fp8.md: descales ``x ~ float(x_fp8) * scale`` per (batch, head,
block of tokens), optional random-sign Hadamard transform of Q and K rows (incoherent processing), V
given to the kernel transposed with its keys permuted. One concern per module: ``format`` (FP8Tensor,
Hadamard signs, the V^T layout), ``packed`` (PackedFP8Tensor: packed batches), ``validation``, ``quantize``,
``attention``, ``varlen`` (packed batches), ``quantized_kv``, and ``ops`` (the torch ops
``flashhopper::quantize_fp8`` / ``fwd_fp8`` and their packed-batch forms ``varlen_*``: the kernels on CUDA,
the reference emulation of ``reference_fp8`` on CPU). Forward only: nothing here is differentiable.
"""
from __future__ import annotations

from .attention import flash_attn_fp8_func, fwd_fp8_into, require_kernel
from .format import (FP8_DTYPE, GRANULARITIES, HEADDIMS, VT_GROUP, VT_ORDER, FP8Tensor, check_fp8_tensor, dequantize,
                     from_vt, hadamard_signs, nblocks, round_up, to_vt, token_scales, vt_key_index)
from .ops import (NO_BLOCK, fill_fwd_params, fill_quant_params, kernel_key, kernel_tiles, launch_fwd, launch_quantize,
                  launch_varlen_fwd, varlen_kernel_key, varlen_kernel_tiles)
from .packed import (PackedFP8Tensor, check_packed_fp8_tensor, dequantize_packed, from_vt_packed, packed_nblocks,
                     to_vt_packed, token_layout)
from .quantize import DEFAULT_KV_BLOCK, default_kv_block_size, quantize_fp8
from .quantized_kv import QuantizedKV, quantize_kv
from .varlen import flash_attn_varlen_fp8_func, require_varlen_kernel
from .validation import (INPUT_DTYPES, Q_BLOCK, QUANT_MAX_BLOCK_ELEMENTS, check_fp8_inputs, check_input,
                         check_quant_block_size, check_tile_alignment)

__all__ = [
    "DEFAULT_KV_BLOCK", "FP8_DTYPE", "GRANULARITIES", "HEADDIMS", "INPUT_DTYPES", "NO_BLOCK",
    "QUANT_MAX_BLOCK_ELEMENTS", "Q_BLOCK", "VT_GROUP", "VT_ORDER", "FP8Tensor", "QuantizedKV", "check_fp8_inputs", "check_fp8_tensor",
    "check_input", "check_quant_block_size", "check_tile_alignment", "default_kv_block_size", "dequantize",
    "fill_fwd_params", "fill_quant_params", "flash_attn_fp8_func", "from_vt", "fwd_fp8_into", "hadamard_signs",
    "kernel_key", "kernel_tiles", "launch_fwd", "launch_quantize", "nblocks", "quantize_fp8", "quantize_kv",
    "require_kernel", "round_up", "to_vt", "token_scales", "vt_key_index",
    # packed batches (fp8/packed.py, fp8/varlen.py)
    "PackedFP8Tensor", "check_packed_fp8_tensor", "dequantize_packed", "flash_attn_varlen_fp8_func", "from_vt_packed",
    "launch_varlen_fwd", "packed_nblocks", "require_varlen_kernel", "to_vt_packed", "token_layout",
    "varlen_kernel_key", "varlen_kernel_tiles",
]
