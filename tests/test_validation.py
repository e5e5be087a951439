"""Every bad input raises TypeError/ValueError whose message starts with the argument's name."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from helpers import randn_qkv

from flashhopper import flash_attn_func, validation
from flashhopper.ops import bwd_into, fwd_into


def good(**kw: Any) -> dict[str, Any]:
    q, k, v = randn_qkv(2, 16, 24, 8, 2, 64)
    return {"q": q, "k": k, "v": v, **kw}


def raises(exc: type[Exception], name: str):  # type: ignore[no-untyped-def]
    return pytest.raises(exc, match=rf"^{name}\b")


@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_not_a_tensor(arg: str) -> None:
    kw = good()
    kw[arg] = np.zeros((2, 16, 8, 64), dtype=np.float32)
    with raises(TypeError, arg):
        flash_attn_func(**kw)


@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_wrong_rank(arg: str) -> None:
    kw = good()
    kw[arg] = kw[arg][0]
    with raises(ValueError, arg):
        flash_attn_func(**kw)


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.float8_e4m3fn])
def test_unsupported_dtype(dtype: torch.dtype) -> None:
    kw = good()
    kw["q"] = kw["q"].to(dtype)
    with raises(TypeError, "q"):
        flash_attn_func(**kw)


@pytest.mark.parametrize("arg", ["k", "v"])
def test_dtype_mismatch(arg: str) -> None:
    kw = good()
    kw[arg] = kw[arg].double()
    with raises(TypeError, arg):
        flash_attn_func(**kw)


def test_kernel_dtypes() -> None:
    validation.check_kernel_dtype("q", torch.bfloat16)
    validation.check_kernel_dtype("q", torch.float16)
    with raises(TypeError, "q"):
        validation.check_kernel_dtype("q", torch.float32)


def test_kernel_headdims() -> None:
    for d in (64, 96, 128, 192, 256):
        validation.check_kernel_headdim(d)
    for d in (32, 80, 512):
        with raises(ValueError, "q"):
            validation.check_kernel_headdim(d)


def test_reference_takes_any_headdim() -> None:
    q, k, v = randn_qkv(1, 5, 6, 2, 2, 96)
    assert flash_attn_func(q, k, v).shape == q.shape


@pytest.mark.parametrize("arg", ["k", "v"])
def test_different_devices(arg: str) -> None:
    kw = good()
    kw[arg] = kw[arg].to("meta")  # a second device that exists on every machine
    with raises(ValueError, arg):
        flash_attn_func(**kw)


@pytest.mark.parametrize(("arg", "shape"), [
    ("k", (3, 24, 2, 64)),   # batch mismatch
    ("k", (2, 24, 2, 32)),   # head dim mismatch (k and v alike, so v matches k)
])
def test_batch_and_headdim_mismatch(arg: str, shape: tuple[int, ...]) -> None:
    kw = good(k=torch.randn(shape), v=torch.randn(shape))
    with raises(ValueError, arg):
        flash_attn_func(**kw)


def test_k_v_shape_mismatch() -> None:
    kw = good()
    kw["v"] = torch.randn(2, 23, 2, 64)
    with raises(ValueError, "v"):
        flash_attn_func(**kw)


@pytest.mark.parametrize("nheads_kv", [3, 5, 16])
def test_nheads_not_divisible(nheads_kv: int) -> None:
    q, k, v = randn_qkv(2, 16, 24, 8, nheads_kv, 64)
    with raises(ValueError, "q"):
        flash_attn_func(q, k, v)


def test_zero_head_dim() -> None:
    q, k, v = randn_qkv(1, 4, 4, 2, 2, 0)
    with raises(ValueError, "q"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("scale", ["0.1", [0.1], torch.tensor(0.1), True])
def test_softmax_scale_type(scale: Any) -> None:
    with raises(TypeError, "softmax_scale"):
        flash_attn_func(**good(softmax_scale=scale))


@pytest.mark.parametrize("scale", [0, 0.0, -0.5, math.inf, -math.inf, math.nan])
def test_softmax_scale_value(scale: float) -> None:
    with raises(ValueError, "softmax_scale"):
        flash_attn_func(**good(softmax_scale=scale))


def test_softmax_scale_accepts_ints_and_numpy() -> None:
    assert validation.check_softmax_scale(2) == 2.0
    assert validation.check_softmax_scale(np.float32(0.5)) == 0.5


@pytest.mark.parametrize("arg", ["causal", "return_lse"])
def test_flags_must_be_bool(arg: str) -> None:
    with raises(TypeError, arg):
        flash_attn_func(**good(**{arg: 1}))


@pytest.mark.parametrize("backend", ["sm70", "SM90", "", "cuda", 90])
def test_unknown_backend(backend: Any) -> None:
    with raises(ValueError, "backend"):
        flash_attn_func(**good(backend=backend))


@pytest.mark.parametrize("backend", ["sm90", "sm80"])
def test_kernel_backend_on_cpu(backend: str) -> None:
    with raises(ValueError, "backend"):
        flash_attn_func(**good(backend=backend))


def test_fwd_into_refuses_cpu_tensors() -> None:
    kw = good()
    q = kw["q"].bfloat16()
    k, v = kw["k"].bfloat16(), kw["v"].bfloat16()
    out, lse = torch.empty_like(q), torch.empty(2, 8, 16)
    with raises(ValueError, "q"):
        fwd_into(q, k, v, out, lse, 0.125, False, 90)


@pytest.mark.parametrize("value", [-1, 1.5, True, None])
def test_max_smem_bytes(value: Any) -> None:
    with raises(ValueError, "max_smem_bytes"):
        validation.check_max_smem_bytes(value)


def test_window() -> None:
    assert validation.check_window(None) is None
    assert validation.check_window((3, -1)) == (3, -1)
    assert validation.check_window((-1, -1)) == (-1, -1)
    got = validation.check_window((np.int64(5), 0))
    assert got == (5, 0) and all(type(w) is int for w in got)  # type: ignore[union-attr]
    for bad in ([1, 2], (1,), (1, 2, 3), (True, 0), (1.0, 2), ("1", 2), 4):
        with raises(TypeError, "window"):
            validation.check_window(bad)
    for bad in ((-2, 0), (0, -5)):
        with raises(ValueError, "window"):
            validation.check_window(bad)


def test_variant_and_arch() -> None:
    validation.check_variant("")
    validation.check_variant("no-pingpong")
    with raises(TypeError, "variant"):
        validation.check_variant(None)
    validation.check_arch(80, (90, 80))
    for bad in (70, "90", True, 90.0):
        with raises(ValueError, "arch"):
            validation.check_arch(bad, (90, 80))


@pytest.mark.parametrize(("kw", "exc", "name"), [
    ({"window": (-3, 0)}, ValueError, "window"),
    ({"window": [4, 4]}, TypeError, "window"),
    ({"variant": 3}, TypeError, "variant"),
    ({"arch": 86}, ValueError, "arch"),
])
def test_kernel_arguments_checked_first(kw: dict[str, Any], exc: type[Exception], name: str) -> None:
    # Named for what is wrong with them, before the CPU tensors here are refused.
    q, k, v = randn_qkv(2, 16, 24, 8, 2, 64, dtype=torch.bfloat16)
    args = {"arch": 90, **kw}
    arch = args.pop("arch")
    with raises(exc, name):
        fwd_into(q, k, v, torch.empty_like(q), torch.empty(2, 8, 16), 0.125, False, arch, **args)
    with raises(exc, name):
        bwd_into(**bwd_args(arch=arch, **args))


# --- memory layout (checked right before a launch; CPU tensors stand in for CUDA ones) ---

def bf16_view(size: tuple[int, ...], stride: tuple[int, ...], offset: int = 0) -> torch.Tensor:
    base = torch.randn(4096 * 64, dtype=torch.bfloat16)
    return base.as_strided(size, stride, offset)


def test_layout_accepts_packed_and_sliced() -> None:
    validation.check_kernel_layout("q", torch.randn(2, 16, 4, 64, dtype=torch.bfloat16))
    qkv = torch.randn(2, 16, 3, 4, 64, dtype=torch.bfloat16)  # packed qkv: q = qkv[:, :, 0]
    for x in qkv.unbind(2):
        validation.check_kernel_layout("q", x)


def test_last_dim_not_contiguous() -> None:
    x = torch.randn(2, 16, 4, 64, dtype=torch.bfloat16)[..., ::2]
    with raises(ValueError, "k"):
        validation.check_kernel_layout("k", x)
    with raises(ValueError, "k"):
        validation.check_last_dim_contiguous("k", torch.randn(2, 64, 4, 16).transpose(1, 3))


def test_misaligned_pointer() -> None:
    x = bf16_view((2, 16, 4, 64), (16 * 4 * 64, 4 * 64, 64, 1), offset=1)  # 2 bytes past a 16-byte boundary
    assert x.data_ptr() % 16 == 2
    with raises(ValueError, "v"):
        validation.check_alignment("v", x)
    validation.check_alignment("v", bf16_view((2, 16, 4, 64), (16 * 4 * 64, 4 * 64, 64, 1), offset=8))


@pytest.mark.parametrize(("stride", "which"), [
    ((16 * 264 + 4, 264, 64, 1), "batch"),
    ((16 * 260, 260, 64, 1), "row"),     # 520 bytes
    ((16 * 264, 264, 66, 1), "head"),    # 132 bytes
])
def test_misaligned_stride(stride: tuple[int, ...], which: str) -> None:
    x = bf16_view((2, 16, 4, 64), stride)
    with pytest.raises(ValueError, match=rf"^out {which} stride"):
        validation.check_alignment("out", x)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_broadcast_input_rejected(dim: int) -> None:
    shape = [2, 16, 4, 64]
    x = torch.randn([1 if i == dim else n for i, n in enumerate(shape)], dtype=torch.bfloat16).expand(shape)
    assert x.stride(dim) == 0
    with pytest.raises(ValueError, match=r"^k is broadcast"):
        validation.check_alignment("k", x)


def test_strides_of_size_one_dims_are_ignored() -> None:
    x = bf16_view((1, 1, 1, 64), (3, 5, 7, 1))  # odd strides on dims that are never stepped over
    validation.check_alignment("q", x)
    assert validation.kernel_strides(x) == (64, 64, 64)
    y = bf16_view((2, 1, 4, 64), (4 * 64 + 8, 3, 64, 1))
    assert validation.kernel_strides(y) == (4 * 64 + 8, 4 * 64, 64)


def test_outputs() -> None:
    q = torch.randn(2, 16, 8, 64, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(2, 8, 16)
    validation.check_outputs(q, out, lse)
    with raises(ValueError, "out"):
        validation.check_outputs(q, out.float(), lse)
    with raises(ValueError, "out"):
        validation.check_outputs(q, out[:, :8], lse)
    with raises(ValueError, "lse"):
        validation.check_outputs(q, out, lse.double())
    with raises(ValueError, "lse"):
        validation.check_outputs(q, out, torch.empty(2, 16, 8).transpose(1, 2))
    with raises(TypeError, "lse"):
        validation.check_outputs(q, out, None)  # type: ignore[arg-type]


def test_deterministic_must_be_bool() -> None:
    with raises(TypeError, "deterministic"):
        flash_attn_func(**good(deterministic=1))


# --- backward inputs ---

def bwd_args(**kw: Any) -> dict[str, Any]:
    q, k, v = randn_qkv(2, 16, 24, 8, 2, 64, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(2, 8, 16)
    args = {"dout": torch.randn_like(q), "q": q, "k": k, "v": v, "out": out, "lse": lse,
            "dq": torch.empty_like(q), "dk": torch.empty_like(k), "dv": torch.empty_like(v),
            "softmax_scale": 0.125, "causal": False, "deterministic": False, "arch": 90}
    return {**args, **kw}


def test_bwd_into_refuses_cpu_tensors() -> None:
    with raises(ValueError, "q"):
        bwd_into(**bwd_args())


@pytest.mark.parametrize(("arg", "value", "exc"), [
    ("deterministic", 1, TypeError),
    ("causal", None, TypeError),
    ("softmax_scale", -1.0, ValueError),
    ("k", torch.randn(3, 24, 2, 64, dtype=torch.bfloat16), ValueError),
])
def test_bwd_into_checks_inputs_first(arg: str, value: Any, exc: type[Exception]) -> None:
    with raises(exc, arg):
        bwd_into(**bwd_args(**{arg: value}))


def test_dout() -> None:
    out = torch.empty(2, 16, 8, 64, dtype=torch.bfloat16)
    validation.check_dout(torch.randn_like(out), out)
    validation.check_dout(torch.randn(2, 16, 8, 128, dtype=torch.bfloat16)[..., :64], out)  # strided is fine
    with raises(TypeError, "dout"):
        validation.check_dout(np.zeros((2, 16, 8, 64)), out)
    with raises(TypeError, "dout"):
        validation.check_dout(None, out)
    with raises(ValueError, "dout"):
        validation.check_dout(out[0], out)  # rank 3
    with raises(ValueError, "dout"):
        validation.check_dout(out[:, :8], out)
    with raises(ValueError, "dout"):
        validation.check_dout(out.float(), out)
    with raises(ValueError, "dout"):
        validation.check_dout(out.to("meta"), out)


def test_dlse() -> None:
    q = torch.randn(2, 16, 8, 64, dtype=torch.bfloat16)
    validation.check_lse("dlse", torch.randn(2, 8, 16), q)
    with raises(TypeError, "dlse"):
        validation.check_lse("dlse", 0.0, q)
    for bad in (torch.randn(2, 8, 16, dtype=torch.float64), torch.randn(2, 16, 8),
                torch.randn(2, 16, 8).transpose(1, 2), torch.randn(1, 1, 1).expand(2, 8, 16)):
        with raises(ValueError, "dlse"):
            validation.check_lse("dlse", bad, q)


def test_grads() -> None:
    q, k, v = randn_qkv(2, 16, 24, 8, 2, 64, dtype=torch.bfloat16)
    validation.check_grads(q, k, v, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    for i, name in enumerate(("dq", "dk", "dv")):
        grads = [torch.empty_like(x) for x in (q, k, v)]
        grads[i] = grads[i].float()
        with raises(ValueError, name):
            validation.check_grads(q, k, v, *grads)
        grads[i] = None  # type: ignore[call-overload]
        with raises(TypeError, name):
            validation.check_grads(q, k, v, *grads)
    with raises(ValueError, "dk"):
        validation.check_grads(q, k, v, torch.empty_like(q), torch.empty_like(q), torch.empty_like(v))


def test_kernel_layout_ok_matches_the_layout_check() -> None:
    # The metadata-only check the autograd formula uses agrees with the real one.
    base = torch.randn(4 * 16 * 4 * 66 + 64, dtype=torch.bfloat16)
    cases = [
        torch.randn(2, 16, 4, 64, dtype=torch.bfloat16),
        torch.randn(2, 16, 3, 4, 64, dtype=torch.bfloat16)[:, :, 1],       # packed qkv
        base[1:1 + 2 * 16 * 4 * 64].view(2, 16, 4, 64),                   # 2 bytes off
        base[8:8 + 2 * 16 * 4 * 64].view(2, 16, 4, 64),                   # 16 bytes off: fine
        torch.ones(1, 1, 1, 1, dtype=torch.bfloat16).expand(2, 16, 4, 64),  # out.sum()'s gradient
        torch.randn(2, 16, 4, 65, dtype=torch.bfloat16)[..., :64],        # row stride 260 elements
        torch.randn(2, 64, 4, 16, dtype=torch.bfloat16).transpose(1, 3),  # last dim not contiguous
    ]
    for x in cases:
        try:
            validation.check_kernel_layout("dout", x)
            ok = True
        except ValueError:
            ok = False
        assert validation.kernel_layout_ok(x) == ok, (x.shape, x.stride(), x.storage_offset())
