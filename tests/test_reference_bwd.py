"""The backward references: the explicit formula equals autograd through the exact forward, the
low-precision yardstick equals autograd through attention_lowp, and the GPU tests' assertion
(helpers.assert_grads_match) accepts a faithful FlashAttention-style backward and rejects broken ones."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_grads_match, randn_qkv, rel_err

from flashhopper.dropout import Dropout, keep_mask
from flashhopper.reference import (_group_sum, _heads_first, _probs_from_lse, attention_bwd_lowp, attention_bwd_ref,
                                   attention_lowp, attention_ref, visible)

# (seqlen_q, seqlen_k): equal, one of them 1, sq < sk, sq > sk (with causal: rows that see no key),
# lengths that are not multiples of any block size.
SEQLENS = [(1, 1), (1, 37), (37, 1), (23, 70), (70, 23), (64, 64), (65, 64)]
GQA = [(4, 4), (4, 2), (4, 1)]  # (nheads_q, nheads_kv): ratios 1, 2, 4
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with the -inf of rows that see no key replaced by 0, so that a loss can use it."""
    return torch.where(torch.isneginf(lse), 0.0, lse)


def autograd_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                   scale: float, causal: bool,
                   fwd: Callable[..., tuple[torch.Tensor, torch.Tensor]] = attention_ref,
                   window: tuple[int, int] | None = None) -> Grads:
    """d/d(q, k, v) of sum(out * dout) + sum(lse * dlse), by torch.autograd through ``fwd``."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out, lse = fwd(*leaves, scale, causal, window=window)
    outputs, grads = [out], [dout]
    if dlse is not None:
        outputs.append(finite(lse))
        grads.append(dlse.to(lse.dtype))
    return torch.autograd.grad(outputs, leaves, grads)  # type: ignore[return-value]


def assert_close(a: Grads, b: Grads, tol: float) -> None:
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert not torch.isnan(x).any(), name
        assert rel_err(x, y) <= tol, f"{name}: relative error {rel_err(x, y):.2e} > {tol}"


@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads", GQA)
@pytest.mark.parametrize("seqlens", SEQLENS)
def test_formula_equals_autograd(seqlens: tuple[int, int], nheads: tuple[int, int], causal: bool,
                                 with_dlse: bool) -> None:
    q, k, v = randn_qkv(2, *seqlens, *nheads, 24, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, 0.3, causal)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None  # also on rows that see no key: must not matter
    got = attention_bwd_ref(dout, q, k, v, out, lse, 0.3, causal, dlse)
    assert_close(got, autograd_grads(q, k, v, dout, dlse, 0.3, causal), 1e-10)


@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, 0), (0, 0), (3, -1), (-1, 4), (5, 2), (1000, 3)])
@pytest.mark.parametrize("seqlens", [(23, 70), (70, 23), (64, 64)])
def test_formula_equals_autograd_windowed(seqlens: tuple[int, int], window: tuple[int, int], causal: bool,
                                          with_dlse: bool) -> None:
    q, k, v = randn_qkv(2, *seqlens, 4, 2, 24, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, 0.3, causal, window=window)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    got = attention_bwd_ref(dout, q, k, v, out, lse, 0.3, causal, dlse, window=window)
    assert_close(got, autograd_grads(q, k, v, dout, dlse, 0.3, causal, window=window), 1e-10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(1, 1), (0, 0), (-1, 1), (2, -1)])
def test_gradcheck_windowed(window: tuple[int, int], causal: bool) -> None:
    # Finite differences of the exact windowed forward against the backward formula, through out and lse.
    q, k, v = (x.requires_grad_() for x in randn_qkv(1, 6, 5, 2, 1, 4, dtype=torch.float64))
    w_out, w_lse = torch.randn(1, 6, 2, 4, dtype=torch.float64), torch.randn(1, 2, 6, dtype=torch.float64)

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out, lse = attention_ref(q, k, v, 0.5, causal, window=window)
            ctx.save_for_backward(q, k, v, out, lse)
            return out, lse

        @staticmethod
        def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor) -> Grads:
            q, k, v, out, lse = ctx.saved_tensors
            return attention_bwd_ref(dout, q, k, v, out, lse, 0.5, causal, dlse, window=window)

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = Attention.apply(q, k, v)
        return (out * w_out).sum() + (finite(lse) * w_lse).sum()

    assert torch.autograd.gradcheck(loss, (q, k, v))


def test_rows_with_no_key_contribute_nothing() -> None:
    # seqlen_q 9 > seqlen_k 4, causal: rows 0-4 see no key. Their dout and dlse must not move anything.
    q, k, v = randn_qkv(1, 9, 4, 2, 1, 8, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, causal=True)
    assert torch.isneginf(lse[:, :, :5]).all() and torch.isfinite(lse[:, :, 5:]).all()
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    dq, dk, dv = attention_bwd_ref(dout, q, k, v, out, lse, causal=True, dlse=dlse)
    assert (dq[:, :5] == 0).all()
    dout[:, :5], dlse[:, :, :5] = 1e6, -1e6
    torch.testing.assert_close(attention_bwd_ref(dout, q, k, v, out, lse, causal=True, dlse=dlse), (dq, dk, dv),
                               atol=0, rtol=0)


def test_no_keys_and_no_queries() -> None:
    q, k, v = randn_qkv(2, 5, 0, 4, 2, 8, dtype=torch.float64)
    out, lse = attention_ref(q, k, v)
    dq, dk, dv = attention_bwd_ref(torch.randn_like(out), q, k, v, out, lse)
    assert dq.shape == q.shape and (dq == 0).all() and dk.shape == dv.shape == k.shape
    q, k, v = randn_qkv(2, 0, 5, 4, 2, 8, dtype=torch.float64)
    out, lse = attention_ref(q, k, v)
    dq, dk, dv = attention_bwd_ref(torch.randn_like(out), q, k, v, out, lse)
    assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all() and dk.shape == k.shape


def test_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Like attention_ref, the backward walks query rows in blocks; tiny blocks give the same answer.
    q, k, v = randn_qkv(2, 50, 30, 4, 2, 8, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, causal=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    qb, kb, vb, dob = (x.bfloat16() for x in (q, k, v, dout))
    whole = attention_bwd_ref(dout, q, k, v, out, lse, causal=True, dlse=dlse)
    whole_lowp = attention_bwd_lowp(dob, qb, kb, vb, causal=True, dlse=dlse.float())
    monkeypatch.setattr("flashhopper.reference._MAX_SCORE_ELEMENTS", 2 * 4 * 30 * 7)  # 7 rows per block
    assert_close(attention_bwd_ref(dout, q, k, v, out, lse, causal=True, dlse=dlse), whole, 1e-13)
    assert_close(attention_bwd_lowp(dob, qb, kb, vb, causal=True, dlse=dlse.float()), whole_lowp, 1e-3)


def test_float32_reference_is_close_to_float64() -> None:
    q, k, v = randn_qkv(1, 64, 80, 4, 2, 32)
    out, lse = attention_ref(q, k, v, causal=True)
    dout = torch.randn(q.shape, dtype=torch.float64)
    g64 = attention_bwd_ref(dout, q, k, v, out, lse, causal=True)
    g32 = attention_bwd_ref(dout, q, k, v, out, lse, causal=True, dtype=torch.float32)
    assert all(x.dtype == torch.float32 for x in g32)
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(g32, g64))


# --- the low-precision yardstick ---

def lowp_autograd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                  scale: float, causal: bool, window: tuple[int, int] | None = None) -> Grads:
    """Autograd through attention_lowp (GQA through its repeat_interleave, as PyTorch would do it)."""
    return autograd_grads(q, k, v, dout, dlse, scale, causal, fwd=attention_lowp, window=window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("seqlens", "nheads"), [((40, 70), (4, 4)), ((70, 40), (4, 2)), ((1, 33), (4, 1)),
                                                 ((33, 1), (2, 2))])
def test_lowp_equals_autograd(seqlens: tuple[int, int], nheads: tuple[int, int], causal: bool, with_dlse: bool,
                              dtype: torch.dtype) -> None:
    check_lowp_equals_autograd(seqlens, nheads, None, causal, with_dlse, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("seqlens", "nheads", "window"), [((40, 70), (4, 2), (9, 3)), ((70, 40), (4, 4), (-1, 5)),
                                                           ((50, 50), (4, 1), (0, 0))])
def test_lowp_equals_autograd_windowed(seqlens: tuple[int, int], nheads: tuple[int, int], window: tuple[int, int],
                                       causal: bool, with_dlse: bool, dtype: torch.dtype) -> None:
    check_lowp_equals_autograd(seqlens, nheads, window, causal, with_dlse, dtype)


def check_lowp_equals_autograd(seqlens: tuple[int, int], nheads: tuple[int, int], window: tuple[int, int] | None,
                               causal: bool, with_dlse: bool, dtype: torch.dtype) -> None:
    # The same roundings in the same places, up to float32 summation order (which can flip a rounding
    # to dtype here and there): the two differ by far less than either differs from exact gradients.
    # GQA dk, dv: autograd rounds each head's gradient before their sum, attention_bwd_lowp only the
    # sum, so there they differ by a rounding or so, and ours must be at least as accurate.
    q, k, v = randn_qkv(2, *seqlens, *nheads, 32, dtype=dtype)
    dout = torch.randn(q.shape, dtype=dtype)
    dlse = torch.randn(2, nheads[0], seqlens[0]) if with_dlse else None
    got = attention_bwd_lowp(dout, q, k, v, 0.2, causal, dlse, window=window)
    want = lowp_autograd(q, k, v, dout, dlse, 0.2, causal, window)
    out, lse = attention_ref(q, k, v, 0.2, causal, window=window)
    exact = attention_bwd_ref(dout, q, k, v, out, lse, 0.2, causal, dlse, window=window)
    for name, g, w, e in zip(("dq", "dk", "dv"), got, want, exact):
        assert g.dtype == dtype and g.shape == w.shape and not torch.isnan(g).any(), name
        same_roundings = name == "dq" or nheads[0] == nheads[1]
        assert rel_err(g, w) <= (0.1 if same_roundings else 1.0) * rel_err(w, e), name
        if not same_roundings:
            assert rel_err(g, e) <= 1.05 * rel_err(w, e), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lowp_error_is_the_input_precision(dtype: torch.dtype) -> None:
    q, k, v = randn_qkv(1, 100, 120, 4, 2, 64, dtype=dtype)
    dout = torch.randn(q.shape, dtype=dtype)
    out, lse = attention_ref(q, k, v, causal=True)
    exact = attention_bwd_ref(dout, q, k, v, out, lse, causal=True)
    eps = torch.finfo(dtype).eps
    for g, e in zip(attention_bwd_lowp(dout, q, k, v, causal=True), exact):
        assert g.dtype == dtype
        assert eps / 16 < rel_err(g, e) < 8 * eps


# --- the GPU tests' assertion, on a CPU emulation of a kernel ---

def emulated_kernel(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool, dlse: torch.Tensor | None = None, bug: str | None = None,
                    window: tuple[int, int] | None = None, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None, dropout: Dropout | None = None) -> Grads:
    """A FlashAttention-style backward as the kernels compute it: forward out rounded to q.dtype and
    float32 lse; float32 math on q.dtype operands; P and dS rounded to q.dtype for the dV, dQ, dK
    matmuls; D = rowsum(dO * O) from the rounded O. Softcap and sinks as the kernels have them (P from the
    capped scores and an LSE that includes the sink; dS times 1 - tanh^2). Dropout as the kernels have it: dV
    from s P rounded and masked, dS = P (s M dP - D). ``bug`` injects one mistake."""
    dt = q.dtype
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    o32, lse = attention_ref(q, k, v, scale, causal, window=window, softcap=softcap, sinks=sinks, dropout=dropout,
                             dtype=torch.float32)
    out = o32.to(dt)
    qt, kt, vt = _heads_first(q, k, v, torch.float32)
    dot = dout.transpose(1, 2).float()
    delta = (dot * out.transpose(1, 2).float()).sum(-1)
    if dlse is not None and bug != "ignores dlse":
        delta = delta - dlse
    if bug == "D 0.1% off":
        delta = delta * 1.001
    s = qt @ kt.transpose(-1, -2) * (scale * (1.01 if bug == "scale 1% off" else 1.0))
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    p = _probs_from_lse(s, lse, visible(sq, k.shape[1], causal, q.device,
                                        window=None if bug == "window ignored" else window))
    dp = dot @ vt.transpose(-1, -2)
    if dropout is not None:
        keep = keep_mask(dropout, b, hq, sq, k.shape[1], q.device)
        dv = torch.where(keep, (p * dropout.scale()).to(dt).float(), 0.0).transpose(-1, -2) @ dot
        dp = torch.where(keep, dp * dropout.scale(), 0.0)
    else:
        dv = p.to(dt).float().transpose(-1, -2) @ dot
    ds = p * (dp - delta[..., None])
    if softcap > 0:
        ds = ds * (1 - (s / softcap) ** 2)
    ds = ds.to(dt).float()
    dq = (ds @ kt * scale).to(dt).transpose(1, 2)
    dk = _group_sum(ds.transpose(-1, -2) @ qt * scale, hkv).to(dt).transpose(1, 2)
    dv = _group_sum(dv, hkv).to(dt).transpose(1, 2)
    if bug == "row left unwritten":
        dq = dq.clone()
        dq[:, -1] = math.nan
    if bug == "last key block skipped":
        dv = dv.clone()
        dv[:, -min(64, dv.shape[1]) // 2:] = 0
    if bug == "no-key rows not zero":
        dq = dq + 1e-3 * torch.randn_like(dq.float()).to(dt)  # small, everywhere, including rows without keys
    return dq, dk, dv


CASES = [(2, 70, 130, 4, 2, 64, True, None), (1, 130, 70, 4, 1, 64, True, None), (1, 300, 1, 4, 1, 128, False, None),
         (2, 65, 1, 4, 2, 64, True, None), (1, 1, 90, 4, 4, 64, False, None),
         (2, 90, 90, 4, 2, 64, False, (8, 8)), (1, 130, 70, 4, 4, 64, True, (16, -1)),
         (1, 40, 1, 4, 1, 64, False, (0, 0)),  # seqlen_k 1 with a window: only row 39 sees the key
         (2, 50, 70, 4, 2, 256, True, (0, 5)), (1, 40, 40, 2, 1, 64, False, (0, 0))]  # windows one key wide


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_assertion_accepts_a_faithful_kernel(case: tuple[Any, ...], with_dlse: bool, dtype: torch.dtype) -> None:
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = randn_qkv(b, sq, sk, hq, hkv, d, dtype=dtype)
    dout = torch.randn(q.shape, dtype=dtype)
    dlse = torch.randn(b, hq, sq) if with_dlse else None
    grads = emulated_kernel(dout, q, k, v, 1 / math.sqrt(d), causal, dlse, window=window)
    for ref_dtype in (torch.float32, torch.float64):
        assert_grads_match(grads, dout, q, k, v, None, causal, dlse, ref_dtype=ref_dtype, window=window)


@pytest.mark.parametrize(("bug", "case", "with_dlse"), [
    ("ignores dlse", CASES[0], True),
    ("scale 1% off", CASES[1], False),
    ("row left unwritten", CASES[0], False),
    ("last key block skipped", CASES[1], False),
    ("no-key rows not zero", CASES[1], False),
    ("D 0.1% off", CASES[2], False),  # seqlen_k 1: dq and dk must stay rounding noise
    ("D 0.1% off", CASES[7], False),  # the same, where the window leaves one row with the key
    ("D 0.1% off", CASES[8], False),  # a window one key wide: every row sees one key (found by scripts/fuzz.py)
    ("D 0.1% off", CASES[9], False),
    ("window ignored", CASES[5], False),
    ("window ignored", CASES[6], True),
])
def test_assertion_rejects_a_broken_kernel(bug: str, case: tuple[Any, ...], with_dlse: bool) -> None:
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = randn_qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16)
    dout = torch.randn(q.shape, dtype=torch.bfloat16)
    dlse = torch.randn(b, hq, sq) if with_dlse else None
    grads = emulated_kernel(dout, q, k, v, 1 / math.sqrt(d), causal, dlse, bug=bug, window=window)
    with pytest.raises(AssertionError):
        assert_grads_match(grads, dout, q, k, v, None, causal, dlse, window=window)


# --- dropout: the low-precision yardstick and the emulated kernel with a mask ---

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("seqlens", "nheads"), [((40, 70), (4, 4)), ((70, 40), (4, 2))])
def test_lowp_with_dropout_equals_autograd(seqlens: tuple[int, int], nheads: tuple[int, int], causal: bool) -> None:
    d = Dropout(0.3, 11, 2)
    q, k, v = randn_qkv(2, *seqlens, *nheads, 32, dtype=torch.bfloat16)
    dout = torch.randn(q.shape, dtype=torch.bfloat16)
    got = attention_bwd_lowp(dout, q, k, v, 0.2, causal, dropout=d)
    want = autograd_grads(q, k, v, dout, None, 0.2, causal,
                          fwd=lambda *a, window=None: attention_lowp(*a, window=window, dropout=d))
    out, lse = attention_ref(q, k, v, 0.2, causal, dropout=d)
    exact = attention_bwd_ref(dout, q, k, v, out, lse, 0.2, causal, dropout=d)
    for name, g, w, e in zip(("dq", "dk", "dv"), got, want, exact):
        same_roundings = name == "dq" or nheads[0] == nheads[1]
        assert rel_err(g, w) <= (0.1 if same_roundings else 1.0) * rel_err(w, e), name


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[4]])
def test_dropout_assertion_accepts_the_kernel_and_rejects_a_mask_mistake(case: tuple[Any, ...]) -> None:
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = randn_qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16)
    dout = torch.randn(q.shape, dtype=torch.bfloat16)
    drop = Dropout(0.2, 5, 9)
    grads = emulated_kernel(dout, q, k, v, 1 / math.sqrt(d), causal, dropout=drop)
    assert_grads_match(grads, dout, q, k, v, None, causal, dropout=drop)
    # Another draw's mask (the kernels' backward regenerating the wrong one) fails.
    wrong = emulated_kernel(dout, q, k, v, 1 / math.sqrt(d), causal, dropout=drop._replace(offset=10))
    with pytest.raises(AssertionError):
        assert_grads_match(wrong, dout, q, k, v, None, causal, dropout=drop)
