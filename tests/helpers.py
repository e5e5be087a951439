"""Error measures and the one assertion every kernel result goes through."""
from __future__ import annotations

import pytest
import torch

from flashhopper import dispatch
from flashhopper.reference import attention_lowp, attention_ref


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| with norms in float64 (||out - ref|| when ref is all zeros)."""
    ref64 = ref.double()
    diff = (out.double() - ref64).norm().item()
    norm = ref64.norm().item()
    return diff / norm if norm > 0 else diff


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0


def randn_qkv(batch: int, seqlen_q: int, seqlen_k: int, nheads_q: int, nheads_kv: int, headdim: int,
              dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(batch, seqlen_q, nheads_q, headdim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, nheads_kv, headdim, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, nheads_kv, headdim, dtype=dtype, device=device)
    return q, k, v


def assert_matches_reference(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, softmax_scale: float | None, causal: bool,
                             atol: float = 1e-4, rtol: float = 1e-4, lse_atol: float = 1e-4) -> None:
    """A low-precision result passes iff it is at most twice as far from exact (float64) attention
    as PyTorch's own attention in the input precision is, plus a small slack: in max-abs error
    and in relative norm error, for out and for the finite lse rows. Rows that see no key must be
    exactly 0 with lse exactly -inf. NaN never passes."""
    ref, ref_lse = attention_ref(q, k, v, softmax_scale, causal, dtype=torch.float64)
    lowp, lowp_lse = attention_lowp(q, k, v, softmax_scale, causal)
    where = f"shape q {tuple(q.shape)} k {tuple(k.shape)} {q.dtype} causal={causal}"

    assert not torch.isnan(out).any(), f"out has NaN (rows left unwritten?): {where}"
    assert not torch.isnan(lse).any(), f"lse has NaN (rows left unwritten?): {where}"
    err, lowp_err = max_abs_err(out, ref), max_abs_err(lowp, ref)
    assert err <= 2 * lowp_err + atol, f"out max-abs error {err:.3e} > 2 x {lowp_err:.3e} + {atol}: {where}"
    rel, lowp_rel = rel_err(out, ref), rel_err(lowp, ref)
    assert rel <= 2 * lowp_rel + rtol, f"out relative error {rel:.3e} > 2 x {lowp_rel:.3e} + {rtol}: {where}"

    no_key = torch.isinf(ref_lse)  # (batch, nheads, seqlen_q); only -inf is possible
    assert torch.equal(torch.isneginf(lse), no_key), f"lse is -inf on other rows than the reference: {where}"
    assert (out.transpose(1, 2)[no_key] == 0).all(), f"rows that see no key are not exactly 0: {where}"
    finite = ~no_key
    lse_err = max_abs_err(lse[finite], ref_lse[finite])
    lowp_lse_err = max_abs_err(lowp_lse[finite], ref_lse[finite])
    assert lse_err <= 2 * lowp_lse_err + lse_atol, \
        f"lse max-abs error {lse_err:.3e} > 2 x {lowp_lse_err:.3e} + {lse_atol}: {where}"


def require_backend(backend: str, dtype: torch.dtype, headdim: int, causal: bool,
                    device: str | torch.device = "cuda") -> None:
    """Skip (not fail) when ``backend`` cannot run this configuration here: wrong GPU, not compiled.
    Call it before making inputs, so that a skip costs nothing."""
    try:
        dispatch.select_backend(torch.empty(0, device=device), headdim, dtype, causal, backend)
    except ValueError as e:
        pytest.skip(str(e))
