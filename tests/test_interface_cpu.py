"""flash_attn_func on CPU tensors (the reference backend), end to end."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_matches_reference, randn_qkv

from flashhopper import flash_attn_func
from flashhopper.reference import attention_ref


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads", [(4, 4), (4, 1), (8, 2)])
def test_equals_reference(nheads: tuple[int, int], causal: bool) -> None:
    q, k, v = randn_qkv(2, 40, 25, *nheads, 32, dtype=torch.float64)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == torch.float64
    assert lse.shape == (2, nheads[0], 40) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse.float(), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_keeps_input_dtype(dtype: torch.dtype) -> None:
    q, k, v = randn_qkv(1, 30, 30, 2, 2, 64, dtype=dtype)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.is_contiguous() and lse.is_contiguous()
    assert_matches_reference(out, lse, q, k, v, None, causal=True)


def test_default_scale_is_inverse_sqrt_headdim() -> None:
    q, k, v = randn_qkv(1, 16, 16, 2, 2, 64, dtype=torch.float64)
    default = flash_attn_func(q, k, v)
    torch.testing.assert_close(default, flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(64)), atol=0, rtol=0)
    assert not torch.allclose(default, flash_attn_func(q, k, v, softmax_scale=1.0))


def test_returns_tensor_without_lse() -> None:
    q, k, v = randn_qkv(1, 8, 8, 2, 2, 16)
    assert isinstance(flash_attn_func(q, k, v), torch.Tensor)


def test_noncontiguous_inputs() -> None:
    qkv = torch.randn(2, 33, 3, 4, 32, dtype=torch.float64)
    q, k, v = qkv.unbind(2)
    out = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out, attention_ref(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)[0])


@pytest.mark.parametrize("shape", [(0, 16, 16), (2, 0, 16), (0, 0, 0)])
def test_empty_inputs(shape: tuple[int, int, int]) -> None:
    b, sq, sk = shape
    q, k, v = randn_qkv(b, sq, sk, 4, 2, 64)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (b, 4, sq)


@pytest.mark.parametrize("causal", [False, True])
def test_no_keys(causal: bool) -> None:
    q, k, v = randn_qkv(2, 7, 0, 4, 2, 64, dtype=torch.bfloat16)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and (out == 0).all()
    assert torch.isneginf(lse).all()


def test_seqlen_one() -> None:
    q, k, v = randn_qkv(3, 1, 1, 8, 1, 128, dtype=torch.float64)
    out = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out, v.expand(3, 1, 8, 128))  # one key: its value, for every head


def test_gradients_flow() -> None:
    # The backward exists now (tests/test_autograd_cpu.py checks its values): every input gets one.
    q, k, v = (x.requires_grad_() for x in randn_qkv(1, 8, 8, 2, 2, 16))
    flash_attn_func(q, k, v).sum().backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in (q, k, v))
