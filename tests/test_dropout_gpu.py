"""Fused attention dropout on the GPU (issue #23), both kernel families (skipped without a GPU).

- The kernels' mask itself, read back: with q = 0 every visible probability is 1 / seqlen_k, and with
  one-hot V rows (V = I) out[i, j] is the kept-and-scaled P[i, j]; with one-hot dO rows, dV[j, i] is the
  backward's regenerated P[i, j] (its S^T layout). Both must be exactly flashhopper.dropout's mask.
- Forward and backward against the float64/float32 reference with the same draw, by FA3's criterion
  (helpers.assert_matches_reference / assert_grads_match with dropout=), outputs poisoned with NaN.
- The public path: flash_attn_func(dropout_p=, generator=) repeats under one seed, changes with another,
  returns the mask it used, and autograd's gradients match the reference with that draw.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import (assert_grads_match_or_control, assert_matches_reference, randn_qkv, require_backend,
                     seeded_dropout_runs)
from test_fwd_gpu import BACKENDS

from flashhopper import flash_attn_func
from flashhopper.dispatch import ARCH
from flashhopper.dropout import from_rng_state, keep_mask, new_rng_state
from flashhopper.ops import bwd_into, fwd_into
from flashhopper.validation import KERNEL_HEADDIMS

HDIMS = list(KERNEL_HEADDIMS)
# No one-key rows (seqlen_k 1): there dq and dk are rounding noise, which helpers.one_key_noise_bound bounds
# for plain attention only (tests/test_bwd_gpu.py covers them); one query row instead.
SEQLENS = [(1, 130), (130, 130), (255, 700), (700, 130), (1000, 1000)]
PROBS = [0.1, 0.5]
ROTATED = list(itertools.product([1, 4], [1, 2], [torch.bfloat16, torch.float16]))  # (gqa, batch, dtype)
NHEADS_Q = 4


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("headdim", HDIMS)
def test_kernel_mask_is_the_definition(headdim: int, backend: str) -> None:
    require_backend(backend, torch.bfloat16, headdim, False, mode="bwd", dropout=True)
    b, h, n, p = 2, 3, headdim, 0.3
    q = torch.zeros(b, n, h, headdim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, n, h, headdim, dtype=torch.bfloat16, device="cuda")
    eye = torch.eye(n, dtype=torch.bfloat16, device="cuda")[None, :, None, :].expand(b, n, h, n).contiguous()
    rng = new_rng_state(torch.device("cuda"))
    d = from_rng_state(p, rng)
    want = keep_mask(d, b, h, n, n, "cuda")  # (b, h, rows, keys)
    level = d.scale() / n  # a kept probability

    out, lse = torch.full_like(eye, math.nan), torch.full((b, h, n), math.nan, device="cuda")
    fwd_into(q, k, eye, out, lse, 1.0, False, ARCH[backend], dropout_p=p, dropout_rng=rng)
    got = out.float().transpose(1, 2)  # (b, h, rows, keys): P[i, j] kept and scaled, or 0
    assert torch.equal(got > level / 2, want), f"forward mask differs in {(got > level / 2).ne(want).sum()} places"
    torch.testing.assert_close(got[want], torch.full_like(got[want], level), rtol=1e-2, atol=0)
    torch.testing.assert_close(lse, torch.full_like(lse, math.log(n)))  # dropout leaves the LSE alone

    dq, dk, dv = (torch.full_like(x, math.nan) for x in (q, k, eye))
    bwd_into(eye, q, k, eye, out, lse, dq, dk, dv, 1.0, False, False, ARCH[backend], dropout_p=p, dropout_rng=rng)
    got_t = dv.float().permute(0, 2, 3, 1)  # dv[b, key j, h, row i] -> (b, h, rows i, keys j)
    assert torch.equal(got_t > level / 2, want), f"backward mask differs in {(got_t > level / 2).ne(want).sum()} places"
    torch.testing.assert_close(got_t[want], torch.full_like(got_t[want], level), rtol=1e-2, atol=0)


def grid() -> list[tuple[int, int, int, bool, float, int, int, torch.dtype]]:
    cases = []
    for i, ((sq, sk), causal, p) in enumerate(itertools.product(SEQLENS, (False, True), PROBS)):
        gqa, batch, dtype = ROTATED[i % len(ROTATED)]
        cases.append((sq, sk, HDIMS[i % len(HDIMS)], causal, p, gqa, batch, dtype))
    return cases


def case_id(c: tuple[int, int, int, bool, float, int, int, torch.dtype]) -> str:
    sq, sk, d, causal, p, gqa, batch, dtype = c
    return f"{sq}x{sk}-d{d}-{'causal' if causal else 'full'}-p{p:g}-gqa{gqa}-b{batch}-{str(dtype)[6:]}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", grid(), ids=case_id)
def test_dropout_fwd_bwd(case: tuple[int, int, int, bool, float, int, int, torch.dtype], backend: str) -> None:
    sq, sk, d, causal, p, gqa, batch, dtype = case
    require_backend(backend, dtype, d, causal, mode="bwd", dropout=True)
    q, k, v = randn_qkv(batch, sq, sk, NHEADS_Q, NHEADS_Q // gqa, d, dtype, "cuda")
    scale = 1 / math.sqrt(d)
    rng = new_rng_state(q.device)
    drop = from_rng_state(p, rng)
    out, lse = torch.full_like(q, math.nan), torch.full((batch, NHEADS_Q, sq), math.nan, device="cuda")
    fwd_into(q, k, v, out, lse, scale, causal, ARCH[backend], dropout_p=p, dropout_rng=rng)
    assert_matches_reference(out, lse, q, k, v, scale, causal, dropout=drop)

    dout = torch.randn_like(q)
    dq, dk, dv = (torch.full_like(x, math.nan) for x in (q, k, v))
    bwd_into(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, False, ARCH[backend], dropout_p=p, dropout_rng=rng)
    # As tests/test_bwd_gpu.py: a bound failure is judged again against the FlashAttention-style emulation.
    assert_grads_match_or_control((dq, dk, dv), dout, q, k, v, scale, causal, dropout=drop)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_func_dropout(backend: str) -> None:
    """Seeded runs repeat bitwise, another seed draws another mask, the returned mask is the one used
    (out and the gradients match the reference with that draw), and the keep rate is 1 - p."""
    require_backend(backend, torch.bfloat16, 128, True, mode="bwd", dropout=True)
    q, k, v = randn_qkv(2, 1000, 1000, 8, 2, 128, torch.bfloat16, "cuda")
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    p = 0.17

    def run(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator("cuda").manual_seed(seed)
        return flash_attn_func(q, k, v, causal=True, backend=backend, return_lse=True, dropout_p=p, generator=g,
                               return_dropout_mask=True)

    out, lse, mask, drop = seeded_dropout_runs(run, p)
    assert torch.equal(keep_mask(drop, 2, 8, 1000, 1000, "cuda"), mask)
    keep = (256 - drop.threshold()) / 256
    visible = torch.ones(1000, 1000, device="cuda").tril().bool()
    rate = mask[:, :, visible].float().mean().item()
    n = mask[:, :, visible].numel()
    assert abs(rate - keep) < 5 * math.sqrt(keep * (1 - keep) / n)

    dout = torch.randn_like(out)
    out.backward(dout)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    assert_matches_reference(out.detach(), lse.detach(), qd, kd, vd, None, True, dropout=drop)
    assert_grads_match_or_control((q.grad, k.grad, v.grad), dout, qd, kd, vd, 1 / math.sqrt(128), True,
                                  dropout=drop)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_zero_is_the_plain_kernel(backend: str) -> None:
    """dropout_p=0 runs the kernel without dropout: bitwise the call without the argument."""
    require_backend(backend, torch.bfloat16, 128, True, mode="fwd")
    q, k, v = randn_qkv(1, 300, 300, 4, 4, 128, torch.bfloat16, "cuda")
    a = flash_attn_func(q, k, v, causal=True, backend=backend, return_lse=True)
    b = flash_attn_func(q, k, v, causal=True, backend=backend, return_lse=True, dropout_p=0.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_one_drops_everything(backend: str) -> None:
    require_backend(backend, torch.bfloat16, 128, False, mode="fwd", dropout=True)
    q, k, v = randn_qkv(1, 200, 200, 4, 4, 128, torch.bfloat16, "cuda")
    out, lse = flash_attn_func(q, k, v, backend=backend, return_lse=True, dropout_p=1.0)
    assert (out == 0).all()
    ref = flash_attn_func(q, k, v, backend=backend, return_lse=True)[1]
    torch.testing.assert_close(lse, ref)

