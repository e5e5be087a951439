"""Model variants on the GPU (issue #23): softcap, learnable sinks and the public window_size, forward and
backward, on both kernel families (skipped without a GPU).

Each kernel case runs fwd_into / bwd_into into outputs poisoned with NaN and is judged by FA3's
criterion against the float64/float32 reference with the same variant (helpers.assert_matches_reference,
assert_grads_match): within twice PyTorch's own low-precision error plus a small slack. The sinks'
gradient (a sum over every row) is judged the same way against PyTorch's autograd through its
low-precision attention (assert_dsinks_match). The grid crosses softcap x sinks x mask with head dims,
GQA and dtypes rotating; the flash_attn_func cases check the public path (autograd, dispatch, window
normalization) end to end.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import (assert_dsinks_match, assert_grads_match, assert_matches_reference, randn_qkv, rel_err,
                     require_backend)
from test_fwd_gpu import BACKENDS

from flashhopper import flash_attn_func
from flashhopper.dispatch import ARCH
from flashhopper.ops import bwd_into, fwd_into
from flashhopper.reference import attention_bwd_ref, attention_ref
from flashhopper.validation import KERNEL_HEADDIMS

HDIMS = list(KERNEL_HEADDIMS)
SOFTCAPS = [0.0, 4.0]
# (causal, window): the masks each variant meets; (-1, 0)-style windows are causal (tests/test_fwd_gpu.py
# has the window grid itself).
MASKS = [(False, None), (True, None), (False, (100, 7)), (True, (33, -1))]
SEQLENS = [(1, 1), (130, 130), (255, 700), (700, 130), (1000, 1000)]
ROTATED = list(itertools.product([1, 4], [1, 2], [torch.bfloat16, torch.float16]))  # (gqa, batch, dtype)
NHEADS_Q = 8
Case = tuple[int, int, int, bool, tuple[int, int] | None, float, bool, int, int, torch.dtype]


def grid() -> list[Case]:
    """(seqlen_q, seqlen_k, headdim, causal, window, softcap, sinks, gqa, batch, dtype): every softcap x
    sinks x mask combination meets every seqlen pair; head dim and the rotated values cycle."""
    cases = []
    for i, ((sq, sk), softcap, sinks, (causal, window)) in enumerate(
            itertools.product(SEQLENS, SOFTCAPS, (False, True), MASKS)):
        if softcap == 0.0 and not sinks:
            continue  # plain attention: tests/test_fwd_gpu.py
        gqa, batch, dtype = ROTATED[i % len(ROTATED)]
        cases.append((sq, sk, HDIMS[i % len(HDIMS)], causal, window, softcap, sinks, gqa, batch, dtype))
    return cases


def case_id(c: Case) -> str:
    sq, sk, d, causal, window, softcap, sinks, gqa, batch, dtype = c
    mask = ("causal" if causal else "full") + (f"-win{window[0]}_{window[1]}" if window else "")
    return (f"{sq}x{sk}-d{d}-{mask}-cap{softcap:g}-{'sinks' if sinks else 'nosinks'}-gqa{gqa}-b{batch}-"
            f"{str(dtype)[6:]}")


def make_case(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
    sq, sk, d, _causal, _window, _softcap, sinks, gqa, batch, dtype = case
    q, k, v = randn_qkv(batch, sq, sk, NHEADS_Q, NHEADS_Q // gqa, d, dtype, "cuda")
    q = q * 3  # scores of a few units, so that the softcap's tanh bends them
    # Sink logits around the rows' own log-sum-exp (a few units), one far above. One far below too when rows
    # see several keys: over a single key it would leave the softmax constant, the gradients of q and k
    # rounding noise, which FA3's criterion cannot judge (helpers.one_key_noise_bound covers that case
    # without sinks).
    s = torch.randn(NHEADS_Q, device="cuda") * 2 + math.log(max(sk, 1))
    s[-1] = 12.0
    if sk > 1:
        s[0] = -30.0
    return q.to(dtype), k, v, (s if sinks else None), 1 / math.sqrt(d)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", grid(), ids=case_id)
def test_variant_fwd_bwd(case: Case, backend: str) -> None:
    sq, sk, d, causal, window, softcap, sinks, _gqa, _batch, dtype = case
    require_backend(backend, dtype, d, causal, mode="bwd", window=window, softcap=softcap)
    q, k, v, s, scale = make_case(case)
    b, _, h, _ = q.shape
    out, lse = torch.full_like(q, math.nan), torch.full((b, h, sq), math.nan, device="cuda")
    fwd_into(q, k, v, out, lse, scale, causal, ARCH[backend], window=window, softcap=softcap, sinks=s)
    assert_matches_reference(out, lse, q, k, v, scale, causal, window=window, softcap=softcap, sinks=s)

    dout, dlse = torch.randn_like(q), (torch.randn_like(lse) if sinks else None)
    dq, dk, dv = (torch.full_like(x, math.nan) for x in (q, k, v))
    rows = torch.full_like(lse, math.nan) if s is not None else None
    bwd_into(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, False, ARCH[backend], dlse, window=window,
             softcap=softcap, sinks=s, dsinks_rows=rows)
    # With sinks and one key per row (1 x 1) the softmax over [score, sink] is nearly constant for most
    # heads: dq and dk are then dominated by the 16-bit out in D (see assert_dsinks_match), which FA3's
    # criterion cannot judge; tests/test_fwd_gpu.py and the fuzz cover one-key rows. dv is judged still.
    judged = (dq, dk, dv) if sk > 1 or s is None else None
    if judged is not None:
        assert_grads_match(judged, dout, q, k, v, scale, causal, dlse, window=window, softcap=softcap, sinks=s)
    else:
        assert not any(torch.isnan(g).any() for g in (dq, dk, dv))
        ref_out, ref_lse = attention_ref(q, k, v, scale, causal, window=window, softcap=softcap, sinks=s,
                                         dtype=torch.float32)
        _, _, ref_dv = attention_bwd_ref(dout, q, k, v, ref_out, ref_lse, scale, causal, dlse, window=window,
                                         softcap=softcap, dtype=torch.float32)
        assert rel_err(dv, ref_dv) < 1e-2
    if s is not None:
        assert_dsinks_match(rows.sum(dim=(0, 2)), dout, q, k, v, scale, causal, window, softcap, s, dlse, out=out,
                            lse=lse)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_keys_get_the_sink(backend: str) -> None:
    """Rows that see no key (causal with seqlen_q > seqlen_k, and whole key-less tiles): out 0 and
    lse = the sink, in the forward; their gradients are 0."""
    require_backend(backend, torch.bfloat16, 128, True, mode="bwd")
    q, k, v = randn_qkv(2, 300, 40, 4, 4, 128, torch.bfloat16, "cuda")
    sinks = torch.tensor([0.5, -2.0, 3.0, 8.0], device="cuda")
    b, sq, h, _ = q.shape
    out, lse = torch.full_like(q, math.nan), torch.full((b, h, sq), math.nan, device="cuda")
    fwd_into(q, k, v, out, lse, 0.1, True, ARCH[backend], sinks=sinks)
    empty = slice(0, sq - k.shape[1])  # rows before the diagonal's first key
    assert (out[:, empty] == 0).all()
    torch.testing.assert_close(lse[:, :, empty], sinks[None, :, None].expand(b, h, sq - k.shape[1]))
    assert_matches_reference(out, lse, q, k, v, 0.1, True, sinks=sinks)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_at_minus_infinity_are_no_sinks(backend: str) -> None:
    """A sink of logit -inf adds nothing to the denominator: out and lse bitwise those without sinks."""
    require_backend(backend, torch.bfloat16, 128, True, mode="fwd")
    q, k, v = randn_qkv(2, 500, 700, 8, 2, 128, torch.bfloat16, "cuda")
    a = flash_attn_func(q, k, v, causal=True, backend=backend, return_lse=True)
    b = flash_attn_func(q, k, v, causal=True, backend=backend, return_lse=True,
                        sinks=torch.full((8,), -math.inf, device="cuda"))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("causal", "window_size"), [(False, (256, 0)), (True, (128, -1)), (False, (64, 64)),
                                                     (False, (-1, 0))])
def test_flash_attn_func_variants_autograd(causal: bool, window_size: tuple[int, int], backend: str) -> None:
    """The public path with all three at once: autograd gives dq, dk, dv and sinks.grad."""
    window = None if window_size == (-1, 0) else window_size
    require_backend(backend, torch.bfloat16, 64, causal or window is None, mode="bwd", window=window, softcap=5.0)
    q, k, v = randn_qkv(2, 1000, 1000, 8, 2, 64, torch.bfloat16, "cuda")
    q = (q * 3).requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    sinks = torch.randn(8, device="cuda").add_(3).requires_grad_()
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window_size, softcap=5.0, sinks=sinks,
                               backend=backend, return_lse=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    causal_eff = causal or window_size == (-1, 0)
    qd, kd, vd, sd = q.detach(), k.detach(), v.detach(), sinks.detach()
    assert_matches_reference(out.detach(), lse.detach(), qd, kd, vd, None, causal_eff, window=window, softcap=5.0,
                             sinks=sd)
    assert_grads_match((q.grad, k.grad, v.grad), dout, qd, kd, vd, None, causal_eff, window=window, softcap=5.0,
                       sinks=sd)
    assert_dsinks_match(sinks.grad, dout, qd, kd, vd, 1 / 8, causal_eff, window, 5.0, sd, out=out.detach(),
                        lse=lse.detach())
