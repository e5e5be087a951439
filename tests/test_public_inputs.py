"""Bad input, function by function: every public callable of the package (flashhopper.__all__, and the public
methods of its classes) has a row of bad inputs below, each of which must raise TypeError/ValueError whose
message names the argument, before any kernel runs. The rows cover the kinds of bad input: wrong dtype,
device (CPU against meta, or against CUDA on the GPU), shape, stride (a last dimension that is not
contiguous), alignment (a view one element off a 16-byte boundary, or a misaligned stride) and unsupported
options. A kind that does not apply to a callable says why in NOT_APPLICABLE; a new public callable
without a row, or a row without one of its kinds, fails test_every_public_callable_has_a_row.

Checks that need a data pointer run right before a launch, so their rows (and those about what only the
kernels refuse, e.g. head dim 80) are GPU rows (marked gpu, skipped without CUDA). tests/test_validation.py
and tests/test_fp8_cpu.py test the checks themselves in depth; this file is the per-function table.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from helpers import require_backend

import flashhopper
from flashhopper import (FP8Tensor, QuantizedKV, _device, attention_ref, attention_varlen_ref, available_backends,
                         flash_attn_fp8_func, flash_attn_func, flash_attn_varlen_fp8_func, flash_attn_varlen_func, fp8,
                         hadamard_signs, quantize_fp8, quantize_kv, select_backend, to_vt)
from flashhopper import append_kvcache, attention_kvcache_ref, flash_attn_with_kvcache
from flashhopper import reference_fp8 as R

KINDS = ("dtype", "device", "shape", "stride", "alignment", "option")
BF16 = torch.bfloat16


@dataclass(frozen=True)
class Case:
    kind: str                      # one of KINDS
    what: str                      # the bad input, for the test id
    exc: type[Exception]
    match: str                     # searched in the message: names the argument
    call: Callable[[], Any]
    gpu: bool = False              # needs CUDA (and the kernels ``need`` asks for)
    need: Callable[[], None] | None = None


# --- inputs ---

def dev(gpu: bool) -> str:
    return "cuda" if gpu else "cpu"


def randn(*shape: int, dtype: torch.dtype = BF16, gpu: bool = False) -> torch.Tensor:
    return torch.randn(*shape, device=dev(gpu)).to(dtype)


def qkv(d: int = 64, gpu: bool = False, dtype: torch.dtype = BF16) -> list[torch.Tensor]:
    """q (2, 16, 8, d), k and v (2, 24, 2, d): GQA, seqlen_q != seqlen_k."""
    return [randn(2, 16, 8, d, dtype=dtype, gpu=gpu), randn(2, 24, 2, d, dtype=dtype, gpu=gpu),
            randn(2, 24, 2, d, dtype=dtype, gpu=gpu)]


def with_(xs: list[Any], i: int, x: Any) -> list[Any]:
    return [x if j == i else y for j, y in enumerate(xs)]


def qkv_with(i: int, f: Callable[[torch.Tensor], torch.Tensor], d: int = 64, gpu: bool = False) -> list[torch.Tensor]:
    """qkv() with f applied to the i-th."""
    xs = qkv(d, gpu)
    return with_(xs, i, f(xs[i]))


def strided(x: torch.Tensor) -> torch.Tensor:
    """x's values with last-dimension stride 2."""
    return torch.cat((x, x), -1)[..., ::2]


def misaligned(x: torch.Tensor) -> torch.Tensor:
    """x's values in a contiguous view one element (2 bytes in bf16, 1 in fp8) past a 16-byte boundary."""
    base = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    view = base[1:].view(x.shape)
    view.copy_(x)
    return view


def padded_heads(x: torch.Tensor) -> torch.Tensor:
    """x's values with a head stride of headdim + 2 elements (and a row stride of nheads times that)."""
    return torch.cat((x, x[..., :2]), -1)[..., : x.shape[-1]]


def fp8_qkv(gpu: bool = False, d: int = 64) -> list[FP8Tensor]:
    """Quantized q, k and V^T (the torch quantization: any device), in the blocks the kernels take."""
    q, k, v = qkv(d, gpu)
    block = fp8.default_kv_block_size(d, False)
    return [R.quantize_ref(q, 64, "block", 0), R.quantize_ref(k, block, "block", 0),
            R.quantize_ref(v, block, transpose=True)]


def fp8_qkv_with(i: int, f: Callable[[torch.Tensor], torch.Tensor], gpu: bool = False, d: int = 64
                 ) -> list[FP8Tensor]:
    """fp8_qkv() with f applied to the data of the i-th (as bytes: cat and copy of uint8 work on every device)."""
    ts = fp8_qkv(gpu, d)
    return with_(ts, i, ts[i]._replace(data=f(ts[i].data.view(torch.uint8)).view(fp8.FP8_DTYPE)))


def packed(gpu: bool = False, d: int = 64) -> list[Any]:
    """A packed batch (flash_attn_varlen_func's first seven arguments): sequences of 5 and 11 tokens, GQA."""
    cu = torch.tensor([0, 5, 16], dtype=torch.int32, device=dev(gpu))
    return [randn(16, 8, d, gpu=gpu), randn(16, 2, d, gpu=gpu), randn(16, 2, d, gpu=gpu), cu, cu.clone(), 11, 11]


def packed_with(i: int, f: Callable[[Any], Any], gpu: bool = False) -> list[Any]:
    xs = packed(gpu)
    return with_(xs, i, f(xs[i]))


def fp8_packed() -> fp8.PackedFP8Tensor:
    """packed()'s k quantized per sequence (the torch quantization)."""
    xs = packed()
    return R.quantize_varlen_ref(xs[1], xs[4], 64, 0)


def kv(gpu: bool = False, d: int = 64) -> QuantizedKV:
    _, k, v = qkv(d, gpu)
    return quantize_kv(k, v)


# --- what a GPU row needs ---

def dense_kernel() -> None:
    info = _device.device_info(torch.cuda.current_device())
    require_backend("sm90" if info.capability == (9, 0) else "sm80", BF16, 128, False)


def fp8_kernels() -> None:
    from test_fp8_gpu import require_fp8_kernel, require_quant_kernel

    require_fp8_kernel(128, False)
    require_quant_kernel()


def varlen_kernel() -> None:
    require_backend("sm90", BF16, 64, False, varlen=True)


def fp8_varlen_kernel() -> None:
    from test_fp8_varlen_gpu import require_kernel

    require_kernel(64, False)


def kvcache(gpu: bool = False, d: int = 64) -> list[Any]:
    """flash_attn_with_kvcache's q (2, 1, 8, d), paged caches (6 pages of 16 rows, 2 kv heads), no k/v, cache_seqlens,
    page_table."""
    table = torch.tensor([[4, 0], [2, 5]], dtype=torch.int32, device=dev(gpu))
    lens = torch.tensor([20, 3], dtype=torch.int32, device=dev(gpu))
    return [randn(2, 1, 8, d, gpu=gpu), randn(6, 16, 2, d, gpu=gpu), randn(6, 16, 2, d, gpu=gpu), None, None, lens,
            table]


def kvcache_with(i: int, f: Callable[[Any], Any], gpu: bool = False) -> list[Any]:
    xs = kvcache(gpu)
    return with_(xs, i, f(xs[i]))


def kvcache_kernel() -> None:
    from test_kvcache_gpu import require_kvcache

    require_kvcache(BF16, 64, 1, True)


def quant_kernel() -> None:
    from test_fp8_gpu import require_quant_kernel

    require_quant_kernel()


def gpu(kind: str, what: str, exc: type[Exception], match: str, call: Callable[[], Any],
        need: Callable[[], None]) -> Case:
    return Case(kind, what, exc, match, call, gpu=True, need=need)



CASES: dict[str, list[Case]] = {
    "flash_attn_func": [
        Case("dtype", "k int8", TypeError, r"^k has dtype torch.int8",
             lambda: flash_attn_func(*with_(qkv(), 1, randn(2, 24, 2, 64, dtype=torch.int8)))),
        gpu("dtype", "float32 without autocast", TypeError, r"^q has dtype torch.float32; the flashhopper kernels",
            lambda: flash_attn_func(*qkv(128, gpu=True, dtype=torch.float32)), dense_kernel),
        Case("device", "q meta", ValueError, r"^k is on cpu but q is on meta",
             lambda: flash_attn_func(*with_(qkv(), 0, randn(2, 16, 8, 64).to("meta")))),
        gpu("device", "v cpu", ValueError, r"^v is on cpu but q is on cuda",
            lambda: flash_attn_func(*with_(qkv(128, gpu=True), 2, randn(2, 24, 2, 128))), dense_kernel),
        Case("shape", "q rank 5", ValueError, r"^q must have 4 dimensions",
             lambda: flash_attn_func(*with_(qkv(), 0, randn(2, 16, 8, 1, 64)))),
        Case("shape", "v heads", ValueError, r"^v shape \(2, 24, 4, 64\) must equal k shape",
             lambda: flash_attn_func(*with_(qkv(), 2, randn(2, 24, 4, 64)))),
        gpu("stride", "q last dim", ValueError, r"^q must have a contiguous last dimension",
            lambda: flash_attn_func(*qkv_with(0, strided, 128, gpu=True)), dense_kernel),
        gpu("alignment", "k offset", ValueError, r"^k data pointer 0x[0-9a-f]+ is not 16-byte aligned",
            lambda: flash_attn_func(*qkv_with(1, misaligned, 128, gpu=True)), dense_kernel),
        gpu("alignment", "v row stride", ValueError, r"^v row stride 260 \(520 bytes\) is not a multiple of 16",
            lambda: flash_attn_func(*qkv_with(2, padded_heads, 128, gpu=True)), dense_kernel),
        Case("option", "backend", ValueError, r"^backend must be one of",
             lambda: flash_attn_func(*qkv(), backend="fastest")),
        Case("option", "return_lse", TypeError, r"^return_lse must be a bool",
             lambda: flash_attn_func(*qkv(), return_lse="yes")),
        Case("option", "softmax_scale", TypeError, r"^softmax_scale must be a float",
             lambda: flash_attn_func(*qkv(), softmax_scale=1j)),
        gpu("option", "head dim 80", ValueError, r"^q head dim 80 is not supported by the flashhopper kernels",
            lambda: flash_attn_func(*qkv(80, gpu=True)), dense_kernel),
        Case("option", "window_size", TypeError, r"^window_size must be a pair of ints",
             lambda: flash_attn_func(*qkv(), window_size=(8,))),
        Case("option", "window_size edge", ValueError, r"^window_size must be \(left, right\)",
             lambda: flash_attn_func(*qkv(), window_size=(-3, 0))),
        Case("option", "softcap", ValueError, r"^softcap must be 0 \(off\) or a positive finite float",
             lambda: flash_attn_func(*qkv(), softcap=-2.0)),
        Case("dtype", "sinks bf16", TypeError, r"^sinks has dtype torch.bfloat16",
             lambda: flash_attn_func(*qkv(), sinks=torch.zeros(8, dtype=BF16))),
        Case("shape", "sinks per kv head", ValueError, r"^sinks must have shape \(8,\)",
             lambda: flash_attn_func(*qkv(), sinks=torch.zeros(2))),
        gpu("device", "sinks cpu", ValueError, r"^sinks is on cpu but q is on cuda",
            lambda: flash_attn_func(*qkv(128, gpu=True), sinks=torch.zeros(8)), dense_kernel),
        Case("option", "dropout_p negative", ValueError, r"^dropout_p must be in \[0, 1\], got -0.1",
             lambda: flash_attn_func(*qkv(), dropout_p=-0.1)),
        Case("option", "dropout_p above 1", ValueError, r"^dropout_p must be in \[0, 1\], got 1.5",
             lambda: flash_attn_func(*qkv(), dropout_p=1.5)),
        Case("option", "dropout_p str", TypeError, r"^dropout_p must be a float, got str",
             lambda: flash_attn_func(*qkv(), dropout_p="0.1")),
        Case("option", "dropout_p bool", TypeError, r"^dropout_p must be a float, got bool",
             lambda: flash_attn_func(*qkv(), dropout_p=True)),
        Case("option", "dropout_p tensor", TypeError, r"^dropout_p must be a float, got Tensor",
             lambda: flash_attn_func(*qkv(), dropout_p=torch.tensor([0.1, 0.2]))),
        Case("option", "generator int", TypeError, r"^generator must be a torch.Generator or None, got int",
             lambda: flash_attn_func(*qkv(), dropout_p=0.1, generator=5)),
        gpu("device", "generator cpu", ValueError, r"^generator is on cpu but q is on cuda",
            lambda: flash_attn_func(*qkv(128, gpu=True), dropout_p=0.1, generator=torch.Generator()), dense_kernel),
        Case("option", "return_dropout_mask", TypeError, r"^return_dropout_mask must be a bool",
             lambda: flash_attn_func(*qkv(), return_dropout_mask=1)),
    ],
    "flash_attn_fp8_func": [
        Case("dtype", "v float64", TypeError, r"^v has dtype torch.float64",
             lambda: flash_attn_fp8_func(*with_(qkv(), 2, randn(2, 24, 2, 64, dtype=torch.float64)))),
        Case("dtype", "q.data bf16", TypeError, r"^q.data has dtype torch.bfloat16",
             lambda: flash_attn_fp8_func(*with_(fp8_qkv(), 0, fp8_qkv()[0]._replace(data=randn(2, 16, 8, 64))))),
        Case("device", "v meta", ValueError, r"^v is on meta but q is on cpu",
             lambda: flash_attn_fp8_func(*with_(qkv(), 2, randn(2, 24, 2, 64).to("meta")))),
        gpu("device", "k cpu", ValueError, r"^k is on cpu but q is on cuda",
            lambda: flash_attn_fp8_func(*with_(qkv(128, gpu=True), 1, randn(2, 24, 2, 128))), fp8_kernels),
        Case("shape", "k rank 3", ValueError, r"^k must have 4 dimensions",
             lambda: flash_attn_fp8_func(*with_(qkv(), 1, randn(24, 2, 64)))),
        Case("shape", "k.seqlen", ValueError, r"^k.data .* does not hold seqlen 25 tokens",
             lambda: flash_attn_fp8_func(*with_(fp8_qkv(), 1, fp8_qkv()[1]._replace(seqlen=25)))),
        Case("stride", "q last dim", ValueError, r"^q must have a contiguous last dimension",
             lambda: flash_attn_fp8_func(*qkv_with(0, strided))),
        gpu("stride", "q.data last dim", ValueError, r"^q must have a contiguous last dimension",
            lambda: flash_attn_fp8_func(*fp8_qkv_with(0, strided, gpu=True, d=128)), fp8_kernels),
        gpu("alignment", "q offset", ValueError, r"^q is not laid out for the quantization kernel's 16-byte loads",
            lambda: flash_attn_fp8_func(*qkv_with(0, misaligned, 128, gpu=True)), fp8_kernels),
        gpu("alignment", "k.data offset", ValueError, r"^k data pointer 0x[0-9a-f]+ is not 16-byte aligned",
            lambda: flash_attn_fp8_func(*fp8_qkv_with(1, misaligned, gpu=True, d=128)), fp8_kernels),
        Case("option", "head dim 96", ValueError, r"^q head dim 96 is not supported by the fp8 path",
             lambda: flash_attn_fp8_func(*qkv(96))),
        Case("option", "seed", TypeError, r"^seed must be an int", lambda: flash_attn_fp8_func(*qkv(), seed=0.5)),
        Case("option", "hadamard", TypeError, r"^hadamard must be a bool",
             lambda: flash_attn_fp8_func(*qkv(), hadamard=None)),
        Case("option", "kv_block_size", ValueError, r"^kv_block_size must be >= 1",
             lambda: flash_attn_fp8_func(*qkv(), kv_block_size=-1)),
        gpu("option", "kv_block_size off the tiles", ValueError, r"^kv_block_size \d+: the fp8 kernel",
            lambda: flash_attn_fp8_func(*qkv(128, gpu=True), kv_block_size=fp8.kernel_tiles(128, False)[1] + 16),  # type: ignore[index]
            fp8_kernels),
    ],
    "quantize_fp8": [
        Case("dtype", "x int32", TypeError, r"^x has dtype torch.int32",
             lambda: quantize_fp8(randn(1, 8, 2, 64, dtype=torch.int32))),
        Case("dtype", "raw e4m3", TypeError, r"^x is a float8_e4m3fn tensor without its scales",
             lambda: quantize_fp8(randn(1, 8, 2, 64).to(fp8.FP8_DTYPE))),
        Case("device", "kernel=True on cpu", ValueError, r"^kernel=True: x is on cpu",
             lambda: quantize_fp8(randn(1, 8, 2, 64), kernel=True)),
        Case("shape", "x rank 2", ValueError, r"^x must have 4 dimensions", lambda: quantize_fp8(randn(8, 64))),
        Case("stride", "x last dim", ValueError, r"^x must have a contiguous last dimension",
             lambda: quantize_fp8(strided(randn(1, 8, 2, 64)))),
        gpu("alignment", "x offset", ValueError, r"^x data pointer 0x[0-9a-f]+ is not 16-byte aligned",
            lambda: quantize_fp8(misaligned(randn(1, 64, 2, 128, gpu=True))), quant_kernel),
        Case("option", "granularity", ValueError, r"^granularity must be one of",
             lambda: quantize_fp8(randn(1, 8, 2, 64), granularity="token")),
        Case("option", "block_size of 'head'", TypeError, r"^block_size must be an int",
             lambda: quantize_fp8(randn(1, 8, 2, 64), "64", granularity="head")),
        Case("option", "transpose", TypeError, r"^transpose must be a bool",
             lambda: quantize_fp8(randn(1, 8, 2, 64), transpose="no")),
        gpu("option", "block_size for the kernel", ValueError, r"^block_size 24: the quantization kernel",
            lambda: quantize_fp8(randn(1, 64, 2, 128, gpu=True), 24, kernel=True), quant_kernel),
    ],
    "quantize_kv": [
        Case("dtype", "v float32", TypeError, r"^v has dtype torch.float32",
             lambda: quantize_kv(randn(1, 8, 2, 64), randn(1, 8, 2, 64, dtype=torch.float32))),
        Case("device", "v meta", ValueError, r"^v is on meta but k is on cpu",
             lambda: quantize_kv(randn(1, 8, 2, 64), randn(1, 8, 2, 64).to("meta"))),
        Case("shape", "v seqlen", ValueError, r"^v shape \(1, 9, 2, 64\) must equal k shape",
             lambda: quantize_kv(randn(1, 8, 2, 64), randn(1, 9, 2, 64))),
        Case("stride", "v last dim", ValueError, r"^v must have a contiguous last dimension",
             lambda: quantize_kv(randn(1, 8, 2, 64), strided(randn(1, 8, 2, 64)))),
        gpu("alignment", "k offset", ValueError, r"^k is not laid out for the quantization kernel's 16-byte loads",
            lambda: quantize_kv(*qkv_with(1, misaligned, 128, gpu=True)[1:]), quant_kernel),
        Case("option", "block_size", TypeError, r"^block_size must be an int",
             lambda: quantize_kv(randn(1, 8, 2, 64), randn(1, 8, 2, 64), block_size=1.5)),
        Case("option", "causal", TypeError, r"^causal must be a bool",
             lambda: quantize_kv(randn(1, 8, 2, 64), randn(1, 8, 2, 64), causal="yes")),
        Case("option", "seed", ValueError, r"^seed must be in \[-2\*\*63, 2\*\*64\)",
             lambda: quantize_kv(randn(1, 8, 2, 64), randn(1, 8, 2, 64), seed=-(2**63) - 1)),
    ],
    "QuantizedKV.attend": [
        Case("dtype", "q float64", TypeError, r"^q has dtype torch.float64",
             lambda: kv().attend(randn(2, 16, 8, 64, dtype=torch.float64))),
        Case("device", "q meta", ValueError, r"\bq is on meta", lambda: kv().attend(randn(2, 16, 8, 64).to("meta"))),
        Case("shape", "q head dim", ValueError, r"\bq head dim 128", lambda: kv().attend(randn(2, 16, 8, 128))),
        Case("shape", "q rank 3", ValueError, r"^q must have 4 dimensions", lambda: kv().attend(randn(16, 8, 64))),
        Case("stride", "q last dim", ValueError, r"^q must have a contiguous last dimension",
             lambda: kv().attend(strided(randn(2, 16, 8, 64)))),
        gpu("alignment", "q offset", ValueError, r"^q is not laid out for the quantization kernel's 16-byte loads",
            lambda: kv(gpu=True, d=128).attend(misaligned(randn(2, 16, 8, 128, gpu=True))), fp8_kernels),
        Case("option", "causal", TypeError, r"^causal must be a bool",
             lambda: kv().attend(randn(2, 16, 8, 64), causal=1)),
        Case("option", "softmax_scale", ValueError, r"^softmax_scale must be a positive finite float",
             lambda: kv().attend(randn(2, 16, 8, 64), softmax_scale=-1.0)),
        Case("option", "k not quantized", TypeError, r"^k must be an FP8Tensor",
             lambda: QuantizedKV(*qkv()[1:]).attend(randn(2, 16, 8, 64))),  # type: ignore[arg-type]
    ],
    "to_vt": [
        Case("dtype", "v.data bf16", TypeError, r"^v.data has dtype torch.bfloat16",
             lambda: to_vt(fp8_qkv()[1]._replace(data=randn(2, 24, 2, 64)))),
        Case("dtype", "v.scale float16", TypeError, r"^v.scale has dtype torch.float16",
             lambda: to_vt((lambda t: t._replace(scale=t.scale.half()))(fp8_qkv()[1]))),
        Case("device", "v.scale meta", ValueError, r"^v.scale is on meta but v.data is on cpu",
             lambda: to_vt((lambda t: t._replace(scale=t.scale.to("meta")))(fp8_qkv()[1]))),
        Case("shape", "v.data rank 3", ValueError, r"^v.data must have 4 dimensions",
             lambda: to_vt((lambda t: t._replace(data=t.data[0]))(fp8_qkv()[1]))),
        Case("shape", "v.scale blocks", ValueError, r"^v.scale has shape \(2, 2, 3\)",
             lambda: to_vt(fp8_qkv()[1]._replace(scale=torch.ones(2, 2, 3)))),
        Case("option", "a tensor", TypeError, r"^v must be an FP8Tensor, got Tensor",
             lambda: to_vt(randn(2, 24, 2, 64))),  # type: ignore[arg-type]
        Case("option", "transposed", TypeError, r"^v.transposed must be a bool",
             lambda: to_vt(fp8_qkv()[1]._replace(transposed="no"))),
        Case("option", "head dim 32", ValueError, r"^v head dim 32 is not supported by the fp8 path",
             lambda: to_vt(R.quantize_ref(randn(2, 24, 2, 32), 128))),
    ],
    "FP8Tensor.dequantize": [
        Case("dtype", "data bf16", TypeError, r"^t.data has dtype torch.bfloat16",
             lambda: fp8_qkv()[1]._replace(data=randn(2, 24, 2, 64)).dequantize()),
        Case("dtype", "scale float64", TypeError, r"^t.scale has dtype torch.float64",
             lambda: (lambda t: t._replace(scale=t.scale.double()))(fp8_qkv()[1]).dequantize()),
        Case("device", "scale meta", ValueError, r"^t.scale is on meta but t.data is on cpu",
             lambda: (lambda t: t._replace(scale=t.scale.to("meta")))(fp8_qkv()[1]).dequantize()),
        Case("shape", "scale", ValueError, r"^t.scale has shape \(3, 3, 3\)",
             lambda: fp8_qkv()[1]._replace(scale=torch.ones(3, 3, 3)).dequantize()),
        Case("shape", "seqlen", ValueError, r"^t.data .* does not hold seqlen 5 tokens",
             lambda: fp8_qkv()[1]._replace(seqlen=5).dequantize()),
        Case("option", "block_size 0", ValueError, r"^t.block_size must be >= 1",
             lambda: fp8_qkv()[1]._replace(block_size=0).dequantize()),
        Case("option", "transposed", TypeError, r"^t.transposed must be a bool",
             lambda: fp8_qkv()[1]._replace(transposed=1).dequantize()),
    ],
    "hadamard_signs": [
        Case("option", "headdim 96", ValueError, r"^headdim must be a power of two", lambda: hadamard_signs(96)),
        Case("option", "headdim float", TypeError, r"^headdim must be an int", lambda: hadamard_signs(64.0)),  # type: ignore[arg-type]
        Case("option", "seed str", TypeError, r"^seed must be an int", lambda: hadamard_signs(64, "1")),  # type: ignore[arg-type]
        Case("option", "seed 2**64", ValueError, r"^seed must be in", lambda: hadamard_signs(64, 2**64)),
    ],
    "attention_ref": [
        Case("dtype", "q int32", TypeError, r"^q has dtype torch.int32",
             lambda: attention_ref(*with_(qkv(dtype=torch.float32), 0, randn(2, 16, 8, 64, dtype=torch.int32)))),
        Case("device", "k meta", ValueError, r"^k is on meta",
             lambda: attention_ref(*with_(qkv(), 1, randn(2, 24, 2, 64).to("meta")))),
        Case("shape", "k batch", ValueError, r"^k batch size 3",
             lambda: attention_ref(*with_(qkv(), 1, randn(3, 24, 2, 64)))),
        Case("shape", "v seqlen", ValueError, r"^v shape",
             lambda: attention_ref(*with_(qkv(), 2, randn(2, 23, 2, 64)))),
        Case("option", "causal", TypeError, r"^causal must be a bool", lambda: attention_ref(*qkv(), causal=1)),
        Case("option", "softmax_scale", ValueError, r"^softmax_scale must be a positive",
             lambda: attention_ref(*qkv(), softmax_scale=-1.0)),
        Case("option", "window", TypeError, r"^window must be None or a tuple",
             lambda: attention_ref(*qkv(), window=[1, 2])),  # type: ignore[arg-type]
        Case("option", "dtype", TypeError, r"^dtype must be torch.float32 or torch.float64",
             lambda: attention_ref(*qkv(), dtype=torch.int32)),
    ],
    "flash_attn_varlen_func": [
        Case("dtype", "q int8", TypeError, r"^q has dtype torch.int8",
             lambda: flash_attn_varlen_func(*packed_with(0, lambda x: x.to(torch.int8)))),
        Case("dtype", "cu_seqlens_k int64", TypeError, r"^cu_seqlens_k has dtype torch.int64",
             lambda: flash_attn_varlen_func(*packed_with(4, lambda x: x.long()))),
        Case("device", "cu_seqlens_q meta", ValueError, r"^cu_seqlens_q is on meta",
             lambda: flash_attn_varlen_func(*packed_with(3, lambda x: x.to("meta")))),
        Case("shape", "q 4-D", ValueError, r"^q must have 3 dimensions",
             lambda: flash_attn_varlen_func(*packed_with(0, lambda x: x[None]))),
        Case("shape", "seqused_k length", ValueError, r"^seqused_k must have shape \(2,\)",
             lambda: flash_attn_varlen_func(*packed(), seqused_k=torch.ones(3, dtype=torch.int32))),
        Case("shape", "cu_seqlens_k batch", ValueError, r"^cu_seqlens_k has 2 entries",
             lambda: flash_attn_varlen_func(*packed_with(4, lambda x: x[:2]))),
        gpu("stride", "q last dim stride 2", ValueError, r"^q must have a contiguous last dimension",
            lambda: flash_attn_varlen_func(*packed_with(0, strided, gpu=True)), varlen_kernel),
        gpu("alignment", "q misaligned", ValueError, r"^q data pointer .* is not 16-byte aligned",
            lambda: flash_attn_varlen_func(*packed_with(0, misaligned, gpu=True)), varlen_kernel),
        Case("option", "max_seqlen_q float", TypeError, r"^max_seqlen_q must be a Python int",
             lambda: flash_attn_varlen_func(*packed_with(5, float))),
        Case("option", "causal", TypeError, r"^causal must be a bool",
             lambda: flash_attn_varlen_func(*packed(), causal=1)),  # type: ignore[arg-type]
        Case("option", "window_size", TypeError, r"^window_size must be a pair of ints",
             lambda: flash_attn_varlen_func(*packed(), window_size=5)),  # type: ignore[arg-type]
        Case("option", "backend", ValueError, r"^backend must be one of",
             lambda: flash_attn_varlen_func(*packed(), backend="gpu")),
    ],
    "flash_attn_varlen_fp8_func": [
        Case("dtype", "q int8", TypeError, r"^q has dtype torch.int8",
             lambda: flash_attn_varlen_fp8_func(*packed_with(0, lambda x: x.to(torch.int8)))),
        Case("dtype", "cu_seqlens_k int64", TypeError, r"^cu_seqlens_k has dtype torch.int64",
             lambda: flash_attn_varlen_fp8_func(*packed_with(4, lambda x: x.long()))),
        Case("device", "cu_seqlens_q meta", ValueError, r"^cu_seqlens_q is on meta",
             lambda: flash_attn_varlen_fp8_func(*packed_with(3, lambda x: x.to("meta")))),
        Case("shape", "q 4-D", ValueError, r"^q must have 3 dimensions",
             lambda: flash_attn_varlen_fp8_func(*packed_with(0, lambda x: x[None]))),
        Case("shape", "k head dim", ValueError, r"^k and v head dims \(128, 64\) must equal q's",
             lambda: flash_attn_varlen_fp8_func(*packed_with(1, lambda x: torch.cat((x, x), -1)))),
        Case("shape", "k quantized with other cu_seqlens", ValueError, r"^k.cu_seqlens is not cu_seqlens_k",
             lambda: flash_attn_varlen_fp8_func(*with_(packed(), 1, fp8_packed()._replace(
                 cu_seqlens=torch.tensor([0, 5, 16], dtype=torch.int32))))),
        Case("stride", "q last dim stride 2", ValueError, r"^q must have a contiguous last dimension",
             lambda: flash_attn_varlen_fp8_func(*packed_with(0, strided))),
        gpu("alignment", "q misaligned", ValueError, r"^q is not laid out for the quantization kernel's 16-byte loads",
            lambda: flash_attn_varlen_fp8_func(*packed_with(0, misaligned, gpu=True)), fp8_varlen_kernel),
        Case("option", "causal", TypeError, r"^causal must be a bool",
             lambda: flash_attn_varlen_fp8_func(*packed(), causal=1)),  # type: ignore[arg-type]
        Case("option", "q_block_size 32", ValueError, r"^q_block_size 32",
             lambda: flash_attn_varlen_fp8_func(*packed(), q_block_size=32)),
        Case("option", "seed out of range", ValueError, r"^seed must be in",
             lambda: flash_attn_varlen_fp8_func(*packed(), seed=1 << 64)),
    ],
    "PackedFP8Tensor.dequantize": [
        Case("dtype", "data bf16", TypeError, r"^t.data has dtype torch.bfloat16",
             lambda: fp8_packed()._replace(data=randn(16, 2, 64)).dequantize()),
        Case("device", "scale meta", ValueError, r"^t.scale is on meta but t.data is on cpu",
             lambda: (lambda t: t._replace(scale=t.scale.to("meta")))(fp8_packed()).dequantize()),
        Case("shape", "scale", ValueError, r"^t.scale has shape \(3, 3\)",
             lambda: fp8_packed()._replace(scale=torch.ones(3, 3)).dequantize()),
        Case("shape", "total", ValueError, r"^t.data has 16 tokens but t.total is 5",
             lambda: fp8_packed()._replace(total=5).dequantize()),
        Case("option", "block_size 0", ValueError, r"^t.block_size must be >= 1",
             lambda: fp8_packed()._replace(block_size=0).dequantize()),
        Case("option", "transposed", TypeError, r"^t.transposed must be a bool",
             lambda: fp8_packed()._replace(transposed=1).dequantize()),
    ],
    "attention_varlen_ref": [
        Case("dtype", "cu_seqlens_q float", TypeError, r"^cu_seqlens_q has dtype torch.float32",
             lambda: attention_varlen_ref(*packed_with(3, lambda x: x.float())[:5])),
        Case("device", "k meta", ValueError, r"^k is on meta",
             lambda: attention_varlen_ref(*packed_with(1, lambda x: x.to("meta"))[:5])),
        Case("shape", "v 2-D", ValueError, r"^v must have 3 dimensions",
             lambda: attention_varlen_ref(*packed_with(2, lambda x: x[0])[:5])),
        Case("option", "causal", TypeError, r"^causal must be a bool",
             lambda: attention_varlen_ref(*packed()[:5], causal=1)),  # type: ignore[arg-type]
    ],
    "flash_attn_with_kvcache": [
        Case("dtype", "k_cache float32", TypeError, r"^k_cache has dtype torch.float32 but q has torch.bfloat16",
             lambda: flash_attn_with_kvcache(*kvcache_with(1, lambda x: x.float()))),
        Case("dtype", "page_table int64", TypeError, r"^page_table has dtype torch.int64",
             lambda: flash_attn_with_kvcache(*kvcache_with(6, lambda x: x.long()))),
        Case("device", "cache_seqlens meta", ValueError, r"^cache_seqlens is on meta",
             lambda: flash_attn_with_kvcache(*kvcache_with(5, lambda x: x.to("meta")))),
        Case("shape", "page size 8", ValueError, r"^k_cache page size 8",
             lambda: flash_attn_with_kvcache(*with_(kvcache_with(1, lambda x: x[:, :8]), 2, randn(6, 8, 2, 64)))),
        Case("shape", "page_table batch", ValueError, r"^page_table must have shape \(2, max_pages_per_seq\)",
             lambda: flash_attn_with_kvcache(*kvcache_with(6, lambda x: x[:1]))),
        gpu("stride", "q last dim stride 2", ValueError, r"^q must have a contiguous last dimension",
            lambda: flash_attn_with_kvcache(*kvcache_with(0, strided, gpu=True)), kvcache_kernel),
        gpu("alignment", "k_cache misaligned", ValueError, r"^k_cache data pointer .* is not 16-byte aligned",
            lambda: flash_attn_with_kvcache(*kvcache_with(1, misaligned, gpu=True)), kvcache_kernel),
        Case("option", "num_splits", ValueError, r"^num_splits must be 0",
             lambda: flash_attn_with_kvcache(*kvcache(), num_splits=-1)),
        Case("option", "window_size", TypeError, r"^window_size must be a pair of ints",
             lambda: flash_attn_with_kvcache(*kvcache(), window_size=(8,))),
        Case("option", "softcap", ValueError, r"^softcap must be 0 \(off\) or a positive finite float",
             lambda: flash_attn_with_kvcache(*kvcache(), softcap=-30.0)),
        Case("option", "cache_seqlens None with pages", ValueError, r"^cache_seqlens is required with page_table",
             lambda: flash_attn_with_kvcache(*kvcache_with(5, lambda x: None))),
        Case("option", "return_softmax_lse int", TypeError, r"^return_softmax_lse must be a bool",
             lambda: flash_attn_with_kvcache(*kvcache(), return_softmax_lse=1)),
    ],
    "append_kvcache": [
        Case("dtype", "v float32", TypeError, r"^v has dtype torch.float32 but v_cache has torch.bfloat16",
             lambda: append_kvcache(*kvcache()[1:3], randn(2, 3, 2, 64), randn(2, 3, 2, 64, dtype=torch.float32),
                                    *kvcache()[5:])),
        Case("device", "cache_seqlens meta", ValueError, r"^cache_seqlens is on meta but k is on cpu",
             lambda: append_kvcache(*kvcache()[1:3], randn(2, 3, 2, 64), randn(2, 3, 2, 64),
                                    kvcache()[5].to("meta"), kvcache()[6])),
        Case("shape", "k nheads", ValueError, r"^k must have shape \(2, 3, 2, 64\)",
             lambda: append_kvcache(*kvcache()[1:3], randn(2, 3, 4, 64), randn(2, 3, 2, 64), *kvcache()[5:])),
        Case("option", "hadamard_seed on a 16-bit cache", ValueError, r"^k_cache_scale, v_cache_scale and hadamard_seed",
             lambda: append_kvcache(*kvcache()[1:3], randn(2, 3, 2, 64), randn(2, 3, 2, 64), *kvcache()[5:],
                                    hadamard_seed=3)),
    ],
    "attention_kvcache_ref": [
        Case("dtype", "v_cache float32", TypeError, r"^v_cache has dtype torch.float32",
             lambda: attention_kvcache_ref(*kvcache_with(2, lambda x: x.float())[:3], 3)),
        Case("device", "k_cache meta", ValueError, r"^k_cache is on meta",
             lambda: attention_kvcache_ref(*kvcache_with(1, lambda x: x.to("meta"))[:3], 3)),
        Case("shape", "cache_seqlens length", ValueError, r"^cache_seqlens must have shape \(2,\)",
             lambda: attention_kvcache_ref(*kvcache()[:3], torch.ones(3, dtype=torch.int32))),
        Case("option", "causal", TypeError, r"^causal must be a bool",
             lambda: attention_kvcache_ref(*kvcache()[:3], 3, causal=1)),  # type: ignore[arg-type]
    ],
    "select_backend": [
        Case("dtype", "dtype int32", TypeError, r"^dtype must be one of",
             lambda: select_backend(randn(1, 4, 2, 64), 64, torch.int32, False)),
        Case("device", "kernel backend on cpu", ValueError, r"^backend='sm80' needs CUDA tensors, but q is on cpu",
             lambda: select_backend(randn(1, 4, 2, 64), 64, BF16, False, "sm80")),
        Case("shape", "q not a tensor", TypeError, r"^q must be a torch.Tensor",
             lambda: select_backend(np.zeros((1, 4, 2, 64)), 64, BF16, False)),  # type: ignore[arg-type]
        Case("shape", "headdim 0", ValueError, r"^headdim must be positive",
             lambda: select_backend(randn(1, 4, 2, 64), 0, BF16, False)),
        Case("dtype", "headdim a str", TypeError, r"^headdim must be an int",
             lambda: select_backend(randn(1, 4, 2, 64), "64", BF16, False)),  # type: ignore[arg-type]
        Case("option", "backend", ValueError, r"^backend must be one of",
             lambda: select_backend(randn(1, 4, 2, 64), 64, BF16, False, "gpu")),
        Case("option", "window", TypeError, r"^window must be None or a tuple",
             lambda: select_backend(randn(1, 4, 2, 64), 64, BF16, False, window=(1,))),
        Case("option", "causal", TypeError, r"^causal must be a bool",
             lambda: select_backend(randn(1, 4, 2, 64), 64, BF16, 1)),  # type: ignore[arg-type]
    ],
    "available_backends": [
        Case("option", "device 'tpu'", ValueError, r"^device 'tpu' is not a device",
             lambda: available_backends("tpu")),
        Case("option", "device 2.5", TypeError, r"^device must be a torch.device, str, int or None",
             lambda: available_backends(2.5)),  # type: ignore[arg-type]
    ],
}

# Kinds that do not apply to a callable that takes tensors, and why.
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    ("to_vt", "stride"): "a copy in torch: any layout",
    ("to_vt", "alignment"): "a copy in torch: any layout",
    ("FP8Tensor.dequantize", "stride"): "torch math: any layout",
    ("FP8Tensor.dequantize", "alignment"): "torch math: any layout",
    ("PackedFP8Tensor.dequantize", "stride"): "torch math: any layout",
    ("PackedFP8Tensor.dequantize", "alignment"): "torch math: any layout",
    ("attention_ref", "stride"): "torch math: any layout",
    ("attention_ref", "alignment"): "torch math: any layout",
    ("attention_varlen_ref", "stride"): "torch math: any layout",
    ("attention_varlen_ref", "alignment"): "torch math: any layout",
    ("attention_kvcache_ref", "stride"): "torch math: any layout",
    ("attention_kvcache_ref", "alignment"): "torch math: any layout",
    ("append_kvcache", "stride"): "torch index writes where the append kernel cannot: any layout",
    ("append_kvcache", "alignment"): "torch index writes where the append kernel cannot: any layout",
    ("select_backend", "stride"): "reads q's device only",
    ("select_backend", "alignment"): "reads q's device only",
}
# Public callables without inputs to get wrong.
NO_INPUT = {"build_info", "compiled_kernels", "extension_error", "has_extension"}
# Accessors of a value type, as its properties are: the FP8Tensor is checked by the functions that take it
# (check_fp8_tensor), and the kernels' launch reads scales() on the hot path.
ACCESSORS = {"FP8Tensor.scales"}


def public_callables() -> set[str]:
    """flashhopper.__all__'s functions, and the public methods of its classes (their NamedTuple constructors
    take anything: the fields are checked where they are used)."""
    names: set[str] = set()
    for name in flashhopper.__all__:
        obj = getattr(flashhopper, name)
        if inspect.isclass(obj):
            names |= {f"{name}.{m}" for m, f in vars(obj).items() if inspect.isfunction(f) and not m.startswith("_")}
        elif callable(obj) and not inspect.ismodule(obj):
            names.add(name)
    return names


def takes_tensors(name: str) -> bool:
    if "." in name:  # a method of FP8Tensor or QuantizedKV, which hold tensors
        return True
    return any("Tensor" in str(p.annotation) for p in inspect.signature(getattr(flashhopper, name)).parameters.values())


def test_every_public_callable_has_a_row() -> None:
    public = public_callables()
    assert public == set(CASES) | NO_INPUT | ACCESSORS, "a public callable without a row (or a row for none)"
    for name in NO_INPUT:
        assert not inspect.signature(getattr(flashhopper, name)).parameters, f"{name} takes arguments now: add a row"
    for name, cases in CASES.items():
        kinds = {c.kind for c in cases}
        assert kinds <= set(KINDS), name
        wanted = KINDS if takes_tensors(name) else ("option",)
        missing = [k for k in wanted if k not in kinds and (name, k) not in NOT_APPLICABLE]
        assert not missing, f"{name}: no row of kind {missing} (add one, or say in NOT_APPLICABLE why none applies)"
    assert all(name in CASES and kind not in {c.kind for c in CASES[name]} for name, kind in NOT_APPLICABLE), \
        "NOT_APPLICABLE names a kind the table has"


def params() -> list[Any]:
    out = []
    for name, cases in CASES.items():
        for c in cases:
            marks = [pytest.mark.gpu] if c.gpu else []
            out.append(pytest.param(c, id=f"{name}-{c.kind}-{c.what}", marks=marks))
    return out


@pytest.mark.parametrize("case", params())
def test_bad_input_is_refused(case: Case) -> None:
    if case.need is not None:
        case.need()
    with pytest.raises(case.exc, match=case.match):
        case.call()
