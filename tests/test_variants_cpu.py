"""The reference and the public API of the model variants (softcap, sinks, window_size), on the CPU:
the reference against naive float64 formulas, its backward formulas against autograd, gradcheck of
flash_attn_func's reference backend with all of them, and the argument checks."""
from __future__ import annotations

import math

import pytest
import torch

from flashhopper import flash_attn_func
from flashhopper.reference import (attention_bwd_lowp, attention_bwd_ref, attention_lowp, attention_ref,
                                   sinks_grad_ref, visible)


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
          window: tuple[int, int] | None, softcap: float, sinks: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over [scores, sink] written out per (batch, head), float64, no GQA."""
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    mask = visible(sq, sk, causal, window=window)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(b, h, sq, 1)], dim=-1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double()), lse


CASES = [(False, None, 2.0, True), (True, None, 0.0, True), (False, (5, 3), 1.5, False), (True, (4, -1), 3.0, True),
         (True, None, 2.5, False)]


@pytest.mark.parametrize(("causal", "window", "softcap", "with_sinks"), CASES)
def test_reference_matches_naive(causal: bool, window: tuple[int, int] | None, softcap: float,
                                 with_sinks: bool) -> None:
    q, k, v = (torch.randn(2, n, 3, 16, dtype=torch.float64) * 2 for n in (23, 17, 17))
    sinks = torch.randn(3, dtype=torch.float32) * 3 if with_sinks else None
    out, lse = attention_ref(q, k, v, 0.3, causal, window=window, softcap=softcap, sinks=sinks)
    want, want_lse = naive(q, k, v, 0.3, causal, window, softcap, sinks)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    if with_sinks and causal:  # rows 0..5 see no key (seqlen_q > seqlen_k): out 0, lse = the sink
        assert (out[:, :6] == 0).all()
        torch.testing.assert_close(lse[:, :, :6], sinks.double()[None, :, None].expand(2, 3, 6))


@pytest.mark.parametrize(("causal", "window", "softcap", "with_sinks"), CASES)
def test_bwd_formulas_match_autograd(causal: bool, window: tuple[int, int] | None, softcap: float,
                                     with_sinks: bool) -> None:
    """attention_bwd_ref (softcap's tanh derivative) and sinks_grad_ref against float64 autograd through
    attention_ref, with a dlse term; GQA."""
    q = (torch.randn(2, 23, 4, 16, dtype=torch.float64) * 2).requires_grad_()
    k = torch.randn(2, 17, 2, 16, dtype=torch.float64).requires_grad_()
    v = torch.randn(2, 17, 2, 16, dtype=torch.float64).requires_grad_()
    sinks = (torch.randn(4, dtype=torch.float32) * 3).requires_grad_() if with_sinks else None
    out, lse = attention_ref(q, k, v, 0.3, causal, window=window, softcap=softcap, sinks=sinks)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward([out, lse], [dout, dlse])
    grads = attention_bwd_ref(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), 0.3, causal,
                              dlse, window=window, softcap=softcap)
    for g, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, x.grad)
    if with_sinks:
        ds = sinks_grad_ref(dout, out.detach(), lse.detach(), sinks.detach(), dlse)
        torch.testing.assert_close(ds.float(), sinks.grad)


@pytest.mark.parametrize(("causal", "window", "softcap", "with_sinks"), CASES)
def test_bwd_lowp_matches_autograd_of_lowp(causal: bool, window: tuple[int, int] | None, softcap: float,
                                           with_sinks: bool) -> None:
    """The yardstick's backward (attention_bwd_lowp) is autograd through attention_lowp, variants included."""
    q = (torch.randn(1, 40, 2, 32) * 2).bfloat16().requires_grad_()
    k = torch.randn(1, 33, 2, 32).bfloat16().requires_grad_()
    v = torch.randn(1, 33, 2, 32).bfloat16().requires_grad_()
    sinks = torch.randn(2) * 2 if with_sinks else None
    out, lse = attention_lowp(q, k, v, 0.2, causal, window=window, softcap=softcap, sinks=sinks)
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = attention_bwd_lowp(dout, q.detach(), k.detach(), v.detach(), 0.2, causal, window=window,
                               softcap=softcap, sinks=sinks)
    for g, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(g.float(), x.grad.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("causal", "window_size"), [(False, (3, 2)), (True, (4, -1)), (False, (-1, -1))])
def test_flash_attn_func_gradients(causal: bool, window_size: tuple[int, int]) -> None:
    """The op's autograd with every variant at once (reference backend): gradcheck of out w.r.t. q, k, v
    against finite differences (float64), and the gradients of out and lse, sinks included, against
    autograd through attention_ref (lse is float32 by contract, hence the tolerance)."""
    q = (torch.randn(1, 9, 2, 8, dtype=torch.float64) * 2).requires_grad_()
    k = torch.randn(1, 7, 1, 8, dtype=torch.float64).requires_grad_()
    v = torch.randn(1, 7, 1, 8, dtype=torch.float64).requires_grad_()
    sinks = torch.randn(2, dtype=torch.float32).requires_grad_()
    kw = {"window_size": window_size, "softcap": 2.0, "backend": "reference"}
    torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, 0.4, causal, sinks=sinks.detach(), **kw),
                             (q, k, v))

    out, lse = flash_attn_func(q, k, v, 0.4, causal, return_lse=True, sinks=sinks, **kw)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad([out, lse], [q, k, v, sinks], [dout, dlse])
    window = None if window_size == (-1, -1) else window_size
    out_ref, lse_ref = attention_ref(q, k, v, 0.4, causal, window=window, softcap=2.0, sinks=sinks)
    want = torch.autograd.grad([out_ref, lse_ref], [q, k, v, sinks], [dout, dlse.double()])
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-5)


def test_window_size_normalization() -> None:
    """(-1, 0) is causal, and causal with an unbounded left edge is causal: the same result as causal=True."""
    q, k, v = (torch.randn(1, n, 2, 8, dtype=torch.float64) for n in (12, 15, 15))
    want = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(flash_attn_func(q, k, v, window_size=(-1, 0)), want)
    torch.testing.assert_close(flash_attn_func(q, k, v, causal=True, window_size=(-1, 5)), want)
    torch.testing.assert_close(flash_attn_func(q, k, v, window_size=[-1, -1]), flash_attn_func(q, k, v))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"window_size": (1,)}, TypeError, "window_size"),
    ({"window_size": (1.0, 2)}, TypeError, "window_size"),
    ({"window_size": (-2, 0)}, ValueError, "window_size"),
    ({"window_size": None}, TypeError, "window_size"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"softcap": math.inf}, ValueError, "softcap"),
    ({"softcap": "3"}, TypeError, "softcap"),
    ({"softcap": True}, TypeError, "softcap"),
    ({"sinks": torch.zeros(4, dtype=torch.float64)}, TypeError, "sinks"),
    ({"sinks": torch.zeros(3)}, ValueError, "sinks"),
    ({"sinks": torch.zeros(4, 1)}, ValueError, "sinks"),
    ({"sinks": [0.0] * 4}, TypeError, "sinks"),
])
def test_bad_variant_arguments(kwargs: dict, error: type, match: str) -> None:
    q, k, v = (torch.randn(1, 5, 4, 8) for _ in range(3))
    with pytest.raises(error, match=match):
        flash_attn_func(q, k, v, **kwargs)
