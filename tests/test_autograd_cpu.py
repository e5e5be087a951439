"""Gradients through flash_attn_func on CPU tensors (the reference backend): gradcheck, agreement with
autograd through the exact forward, the upstream-gradient cases autograd produces, and the refusal at
forward time when a kernel backend has no backward built."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import randn_qkv, rel_err

from flashhopper import _ext, dispatch, flash_attn_func, interface
from flashhopper.reference import attention_ref

GQA = [(4, 4), (4, 2), (4, 1)]


def leaves(*shape: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(x.requires_grad_() for x in randn_qkv(*shape, dtype=dtype))  # type: ignore[return-value]


def finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isneginf(lse), 0.0, lse)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads", GQA)
@pytest.mark.parametrize("seqlens", [(5, 7), (7, 4), (1, 3)])
def test_gradcheck(seqlens: tuple[int, int], nheads: tuple[int, int], causal: bool) -> None:
    q, k, v = leaves(1, *seqlens, *nheads, 4)
    w_out = torch.randn(q.shape, dtype=torch.float64)
    w_lse = torch.randn(1, nheads[0], seqlens[0], dtype=torch.float64)

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = flash_attn_func(q, k, v, 0.5, causal, return_lse=True, backend="reference")
        # lse is float32 by contract: its rounding (~1e-7) would swamp the finite differences (eps
        # 1e-6). So the loss takes the value of the exact float64 lse while its gradient flows
        # through ours: gradcheck then compares our backward, dlse path included, with finite
        # differences of the exact function.
        exact = finite(attention_ref(q.detach(), k.detach(), v.detach(), 0.5, causal)[1])
        ours = finite(lse).double()
        return (out * w_out).sum() + ((ours - ours.detach() + exact) * w_lse).sum()

    assert torch.autograd.gradcheck(loss, (q, k, v))
    # And through out alone, as returned.
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, 0.5, causal, backend="reference"),
                                    (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(2, 1), (0, 0), (-1, 2), (3, -1)])
def test_gradcheck_windowed_op(window: tuple[int, int], causal: bool) -> None:
    # flash_attn_func takes no window yet; the op does, and its autograd formula hands the window to
    # the backward (a lost window would differentiate another function).
    q, k, v = leaves(1, 7, 5, 4, 2, 4)

    def out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.flashhopper.fwd.default(q, k, v, 0.5, causal, *window, 0.0, None, False, "reference")[0]

    assert torch.autograd.gradcheck(out, (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads", GQA)
@pytest.mark.parametrize("seqlens", [(33, 20), (20, 33), (1, 1)])
def test_equals_autograd_through_exact(seqlens: tuple[int, int], nheads: tuple[int, int], causal: bool) -> None:
    q, k, v = leaves(2, *seqlens, *nheads, 16)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad([out, finite(lse)], (q, k, v), [dout, dlse])
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal)
    want = torch.autograd.grad([ref_out, finite(ref_lse)], (q, k, v), [dout, dlse.double()])
    for g, w in zip(got, want):
        assert g.dtype == torch.float64 and g.shape == w.shape
        assert rel_err(g, w) < 1e-6  # the float32 lse is what separates them


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_input_dtypes_and_shapes(dtype: torch.dtype) -> None:
    q, k, v = leaves(2, 9, 12, 4, 2, 16, dtype=dtype)
    flash_attn_func(q, k, v, causal=True).float().square().sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.dtype == dtype and x.grad.shape == x.shape
        assert torch.isfinite(x.grad).all()


def test_out_sum_and_lse_only() -> None:
    # out.sum() hands the backward stride-0 ones; a loss of lse alone gives no gradient for out.
    q, k, v = leaves(1, 6, 6, 2, 2, 8)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    g_sum = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    ref_out, ref_lse = attention_ref(q, k, v)
    for g, w in zip(g_sum, torch.autograd.grad(ref_out.sum(), (q, k, v), retain_graph=True)):
        assert rel_err(g, w) < 1e-6
    g_lse = torch.autograd.grad(lse.sum(), (q, k, v), allow_unused=True)
    want = torch.autograd.grad(ref_lse.sum(), (q, k, v), allow_unused=True)
    assert g_lse[2] is None or (g_lse[2] == 0).all()  # lse does not depend on v
    for g, w in zip(g_lse[:2], want[:2]):
        assert g is not None and w is not None and rel_err(g, w) < 1e-6


def test_only_some_inputs_require_grad() -> None:
    q, k, v = randn_qkv(1, 8, 8, 2, 1, 8, dtype=torch.float64)
    k.requires_grad_()
    flash_attn_func(q, k, v, causal=True).sum().backward()
    assert k.grad is not None and k.grad.shape == k.shape and q.grad is None


def test_no_keys_and_no_queries() -> None:
    q, k, v = leaves(2, 5, 0, 4, 2, 8)
    flash_attn_func(q, k, v, causal=True).sum().backward()
    assert q.grad is not None and (q.grad == 0).all() and k.grad is not None and k.grad.shape == k.shape
    q, k, v = leaves(2, 0, 5, 4, 2, 8)
    flash_attn_func(q, k, v).sum().backward()
    assert k.grad is not None and (k.grad == 0).all() and v.grad is not None and (v.grad == 0).all()


def test_double_backward_is_refused() -> None:
    # Not implemented: a second derivative must fail loudly, never be silently zero.
    q, k, v = leaves(1, 5, 5, 2, 2, 8)
    (g,) = torch.autograd.grad(flash_attn_func(q, k, v).square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="flashhopper.bwd"):
        g.sum().backward()


def test_deterministic_flag() -> None:
    q, k, v = leaves(1, 7, 9, 4, 2, 8)
    a = torch.autograd.grad(flash_attn_func(q, k, v, causal=True, deterministic=True).sum(), (q, k, v))
    b = torch.autograd.grad(flash_attn_func(q, k, v, causal=True).sum(), (q, k, v))
    for x, y in zip(a, b):
        assert torch.equal(x, y)  # the reference is deterministic either way
    with pytest.raises(TypeError, match=r"^deterministic\b"):
        flash_attn_func(q, k, v, deterministic=1)  # type: ignore[call-overload]


# --- forward-time refusal when the kernel family has no backward for the configuration ---

@pytest.fixture
def no_bwd_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend dispatch chose sm90 for these CPU tensors, on a build whose backward kernels are missing.
    monkeypatch.setattr(interface, "resolve_backend", lambda q, headdim, dtype, causal, backend=None, window=None, softcap=0.0, headdim_v=None, dropout=False: "sm90")
    monkeypatch.setattr(_ext, "has_kernel", lambda mode, key: mode == "fwd")
    monkeypatch.setattr(_ext, "extension_error", lambda: None)


@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_missing_bwd_kernel_refused_at_forward(no_bwd_kernels: None, arg: str) -> None:
    kw: dict[str, Any] = dict(zip("qkv", randn_qkv(2, 16, 16, 8, 2, 128, dtype=torch.bfloat16)))
    kw[arg].requires_grad_()
    with pytest.raises(ValueError) as e:
        flash_attn_func(**kw, causal=True)
    msg = str(e.value)
    assert msg.startswith(f"{arg} requires grad, but this build has no sm90 backward kernel for bfloat16 "
                          "headdim 128 causal")
    assert "FLASHHOPPER_ARCHS=90 FLASHHOPPER_MODES=fwd;bwd FLASHHOPPER_DTYPES=bf16 FLASHHOPPER_HDIMS=128" in msg
    assert "torch.no_grad()" in msg and "backend='reference'" in msg


def test_missing_bwd_kernel_is_fine_without_grad(no_bwd_kernels: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Forward-only use never needs the backward: no_grad, or inputs that do not require grad.
    launched: list[str] = []
    monkeypatch.setattr(torch.ops.flashhopper.fwd, "default",
                        lambda q, k, v, scale, causal, left, right, cap, sinks, det, backend: launched.append(backend) or (q, q))
    q, k, v = leaves(1, 8, 8, 2, 2, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        flash_attn_func(q, k, v)
    flash_attn_func(q.detach(), k.detach(), v.detach())
    assert launched == ["sm90", "sm90"]


def test_require_bwd_kernel_ignores_the_reference() -> None:
    q, k, v = leaves(1, 4, 4, 2, 2, 96)
    dispatch.require_bwd_kernel("reference", q, k, v, 96, False)  # no kernel involved: never raises
