"""V with a head dim of its own (DeepSeek-V3's prefill: Q/K 192, V 128; and Q/K 128, V 64): out and dv
take V's head dim. The reference anywhere (float64 gradcheck on CPU), the Hopper kernels on the GPU
against it (FA3's criterion, outputs and gradients NaN-poisoned first), and the errors of what no
kernel has."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_grads_match_or_control, assert_matches_reference, randn_qkv, require_backend

from flashhopper import flash_attn_func, validation
from flashhopper.dispatch import ARCH
from flashhopper.kernel_key import HEADDIM_PAIRS, parse_headdim
from flashhopper.ops import bwd_into, fwd_into
from flashhopper.reference import attention_ref

SEQLENS = [(1, 1), (17, 300), (255, 255), (300, 17), (1000, 1000)]
NHEADS_Q = 8


def qkv(batch: int, sq: int, sk: int, hq: int, hkv: int, d: int, dv: int, dtype: torch.dtype,
        device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, _ = randn_qkv(batch, sq, sk, hq, hkv, d, dtype, device)
    v = torch.randn(batch, sk, hkv, dv, dtype=dtype, device=device)
    return q, k, v


def test_reference_out_has_v_headdim() -> None:
    q, k, v = qkv(2, 5, 7, 4, 2, 16, 8, torch.float64, "cpu")
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 5, 4, 8) and lse.shape == (2, 4, 5)
    # Each of V's columns on its own: attention is linear in V, so splitting V splits out.
    first, _ = attention_ref(q, k, v[..., :3], causal=True)
    assert torch.allclose(out[..., :3], first)


def test_reference_gradcheck() -> None:
    q, k, v = (x.requires_grad_() for x in qkv(1, 4, 5, 2, 1, 6, 3, torch.float64, "cpu"))
    assert torch.autograd.gradcheck(lambda a, b, c: flash_attn_func(a, b, c, causal=True), (q, k, v))


def test_shapes_and_kernel_headdims_refused() -> None:
    q, k, v = qkv(1, 4, 5, 2, 1, 8, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"^v shape \(1, 6, 1, 4\) must equal k shape"):
        flash_attn_func(q, k, v[:, :4].repeat(1, 2, 1, 1)[:, :6])
    with pytest.raises(ValueError, match=r"^q/k head dim 192 with v head dim 64 is not supported"):
        validation.check_kernel_headdim(192, 64)
    for d, dv in HEADDIM_PAIRS:
        validation.check_kernel_headdim(d, dv)
    assert parse_headdim("192x128") == (192, 128) and parse_headdim("96") == (96, 96)
    with pytest.raises(ValueError, match="head dims '192x64'"):
        parse_headdim("192x64")


def test_fp8_keeps_one_headdim() -> None:
    from flashhopper import flash_attn_fp8_func
    q, k, v = qkv(1, 4, 5, 2, 1, 128, 64, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="must equal k shape"):
        flash_attn_fp8_func(q, k, v)


def cases() -> list[tuple[int, int, int, int, bool, int, torch.dtype]]:
    out = []
    for i, ((d, dv), (sq, sk), causal) in enumerate(
            (p, s, c) for p in HEADDIM_PAIRS for s in SEQLENS for c in (False, True)):
        gqa, dtype = [(1, torch.bfloat16), (4, torch.float16), (8, torch.bfloat16)][i % 3]
        out.append((d, dv, sq, sk, causal, gqa, dtype))
    return out


def case_id(c: tuple[int, int, int, int, bool, int, torch.dtype]) -> str:
    d, dv, sq, sk, causal, gqa, dtype = c
    return f"d{d}v{dv}-{sq}x{sk}-{'causal' if causal else 'full'}-gqa{gqa}-{str(dtype)[6:]}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases(), ids=case_id)
def test_kernel_fwd_bwd(case: tuple[int, int, int, int, bool, int, torch.dtype]) -> None:
    d, dv, sq, sk, causal, gqa, dtype = case
    require_backend("sm90", dtype, d, causal, mode="bwd", headdim_v=dv)
    q, k, v = qkv(2, sq, sk, NHEADS_Q, NHEADS_Q // gqa, d, dv, dtype, "cuda")
    scale = 1 / math.sqrt(d)
    out = torch.full((2, sq, NHEADS_Q, dv), math.nan, dtype=dtype, device="cuda")
    lse = torch.full((2, NHEADS_Q, sq), math.nan, device="cuda")
    fwd_into(q, k, v, out, lse, scale, causal, ARCH["sm90"])
    assert_matches_reference(out, lse, q, k, v, scale, causal)
    dout = torch.randn_like(out)
    dq, dk, dvv = (torch.full_like(x, math.nan) for x in (q, k, v))
    bwd_into(dout, q, k, v, out, lse, dq, dk, dvv, scale, causal, False, ARCH["sm90"])
    assert_grads_match_or_control((dq, dk, dvv), dout, q, k, v, scale, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1024, 1024), (1025, 1025), (1024, 1025), (1025, 1024), (2000, 512), (512, 2000)])
def test_short_tile_bounds_v64(sq: int, sk: int, causal: bool, dtype: torch.dtype) -> None:
    # Q/K 128, V 64 runs a 128 x 128 tile up to 1024 queries and keys and its 192 x 128 tile beyond
    # (sm90/launch_fwd.h: use_short_keys): both sides of the bound (the cases above are all short).
    require_backend("sm90", dtype, 128, causal, headdim_v=64)
    q, k, v = qkv(2, sq, sk, NHEADS_Q, NHEADS_Q // 4, 128, 64, dtype, "cuda")
    scale = 1 / math.sqrt(128)
    out = torch.full((2, sq, NHEADS_Q, 64), math.nan, dtype=dtype, device="cuda")
    lse = torch.full((2, NHEADS_Q, sq), math.nan, device="cuda")
    fwd_into(q, k, v, out, lse, scale, causal, ARCH["sm90"])
    assert_matches_reference(out, lse, q, k, v, scale, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("d, dv", HEADDIM_PAIRS)
def test_flash_attn_func_autograd(d: int, dv: int) -> None:
    # The public path: dispatch to the pair's kernels, autograd through out and lse, dv shaped like v.
    require_backend("sm90", torch.bfloat16, d, True, mode="bwd", headdim_v=dv)
    q, k, v = (x.requires_grad_() for x in qkv(2, 700, 700, 8, 2, d, dv, torch.bfloat16, "cuda"))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 700, 8, dv)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward((out, lse), (dout, dlse))
    assert v.grad is not None and v.grad.shape == v.shape
    q0, k0, v0 = (x.detach() for x in (q, k, v))
    assert_matches_reference(out.detach(), lse.detach(), q0, k0, v0, 1 / math.sqrt(d), True)
    assert_grads_match_or_control((q.grad, k.grad, v.grad), dout, q0, k0, v0, 1 / math.sqrt(d), True, dlse)


@pytest.mark.gpu
@pytest.mark.parametrize("d, dv", HEADDIM_PAIRS)
def test_deterministic_backward(d: int, dv: int) -> None:
    # GQA: dK/dV of a kv head summed over its query heads in a fixed order, dQ's key blocks too.
    require_backend("sm90", torch.bfloat16, d, False, mode="bwd", headdim_v=dv)
    q, k, v = qkv(2, 777, 1300, 8, 2, d, dv, torch.bfloat16, "cuda")
    scale = 1 / math.sqrt(d)
    out = torch.empty(2, 777, 8, dv, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(2, 8, 777, device="cuda")
    fwd_into(q, k, v, out, lse, scale, False, ARCH["sm90"])
    dout = torch.randn_like(out)
    runs = []
    for _ in range(3):
        grads = tuple(torch.full_like(x, math.nan) for x in (q, k, v))
        bwd_into(dout, q, k, v, out, lse, *grads, scale, False, True, ARCH["sm90"])
        runs.append(grads)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other)), "gradients differ between deterministic runs"
    assert_grads_match_or_control(runs[0], dout, q, k, v, scale, False)
