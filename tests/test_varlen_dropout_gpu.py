"""Fused attention dropout on packed batches (flash_attn_varlen_func, issue #23), both kernel families (skipped
without a GPU).

The definition (flashhopper.dropout): sequence b of a packed batch draws as batch entry b of a padded batch, its
rows and keys counted from its own first token.
- The kernels' mask, read back as in tests/test_dropout_gpu.py: with q = 0 every probability of sequence b is
  1 / its keys, and with V's rows one-hot (row j of sequence b = e_j) out[i, j] is the kept-and-scaled P[i, j]; with
  dO's rows one-hot, dV[j, i] is the backward's regenerated P[i, j]. Both must be exactly keep_mask's entry b.
- Forward and backward against the per-sequence reference with the same draw (FA3's criterion), outputs poisoned.
- The public call: seeded runs repeat, the returned mask is the one used, autograd matches the reference.
"""
from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_grads_match_or_control, assert_matches_reference, require_backend, seeded_dropout_runs
from test_varlen_gpu import ARCH, BACKENDS, cu, packed

from flashhopper import flash_attn_varlen_func
from flashhopper.dropout import from_rng_state, keep_mask, new_rng_state
from flashhopper.kernel_key import VARLEN_HEADDIMS
from flashhopper.varlen import _launch_varlen_bwd, _launch_varlen_fwd

pytestmark = pytest.mark.gpu

NHEADS_Q = 4
# (q lengths, k lengths or None: the same): an empty sequence, one-query ones, lengths straddling the tiles, more
# keys than queries and fewer; the last sequence's batch index is high enough that a wrong (batch, head) counter shows.
# No one-key sequences, as in tests/test_dropout_gpu.py: their dq and dk are rounding noise (softmax constant) that
# helpers.one_key_noise_bound bounds for plain attention only (dropout's scale amplifies it).
LENGTHS = [
    ([130, 0, 1, 255, 64], [130, 0, 7, 255, 64]),
    ([700, 3, 129], [130, 300, 1000]),
    ([1] * 9 + [300], [5] * 9 + [257]),
]


def _one_hot_rows(lengths: list[int], heads: int, d: int) -> torch.Tensor:
    """(sum(lengths), heads, d): row j of each sequence is e_j (lengths at most d)."""
    eye = torch.eye(d, dtype=torch.bfloat16, device="cuda")
    return torch.cat([eye[:n] for n in lengths])[:, None, :].expand(-1, heads, d).contiguous()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_mask_is_the_definition(causal: bool, backend: str) -> None:
    d, h, p = 128, 3, 0.3
    require_backend(backend, torch.bfloat16, d, causal, mode="bwd", dropout=True, varlen=True)
    lq, lk = [128, 1, 77, 0, 128], [128, 5, 128, 9, 100]
    cq, ck = cu(lq), cu(lk)
    q = torch.zeros(sum(lq), h, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(sum(lk), h, d, dtype=torch.bfloat16, device="cuda")
    v = _one_hot_rows(lk, h, d)
    rng = new_rng_state(torch.device("cuda"))
    drop = from_rng_state(p, rng)
    want_all = keep_mask(drop, len(lq), h, max(lq), max(lk), "cuda")  # (batch, h, rows, keys)
    out = torch.full((sum(lq), h, d), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((h, sum(lq)), math.nan, device="cuda")
    _launch_varlen_fwd(q, k, v, cq, ck, None, None, max(lq), max(lk), out, lse, 1.0, causal, None, 0.0, None,
                       ARCH[backend], dropout_p=p, dropout_rng=rng)
    dout = _one_hot_rows(lq, h, d)
    dq, dk, dv = (torch.full_like(x, math.nan) for x in (q, k, v))
    _launch_varlen_bwd(dout, q, k, v, out, lse, None, cq, ck, None, None, max(lq), max(lk), dq, dk, dv, 1.0, causal,
                       None, 0.0, None, None, False, ARCH[backend], dropout_p=p, dropout_rng=rng)
    for b, (nq, nk) in enumerate(zip(lq, lk)):
        oq, ok = int(cq[b]), int(ck[b])
        if nq == 0:
            continue
        # Visible keys (causal: bottom-right) and their uniform probability 1 / (visible keys of the row).
        rows = torch.arange(nq, device="cuda")[:, None]
        seen = (torch.arange(nk, device="cuda")[None, :] <= rows + nk - nq) if causal else torch.ones(
            nq, nk, dtype=torch.bool, device="cuda")
        level = (drop.scale() / seen.sum(1, keepdim=True).clamp(min=1)).expand(nq, nk)
        want = want_all[b, :, :nq, :nk] & seen  # (h, rows, keys)
        got = out[oq:oq + nq, :, :nk].float().permute(1, 0, 2)  # (h, rows, keys)
        assert torch.equal(got > level / 2, want), f"sequence {b}: forward mask differs in " \
            f"{(got > level / 2).ne(want).sum()} places"
        torch.testing.assert_close(got[want], level.expand_as(got)[want], rtol=1e-2, atol=0)
        got_t = dv[ok:ok + nk, :, :nq].float().permute(1, 2, 0)  # dv[key j, h, row i] -> (h, rows, keys)
        assert torch.equal(got_t > level / 2, want), f"sequence {b}: backward mask differs in " \
            f"{(got_t > level / 2).ne(want).sum()} places"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", list(VARLEN_HEADDIMS))
@pytest.mark.parametrize("case", range(len(LENGTHS)))
def test_varlen_dropout_fwd_bwd(case: int, d: int, causal: bool, backend: str) -> None:
    dtype = [torch.bfloat16, torch.float16][(case + d // 64) % 2]
    require_backend(backend, dtype, d, causal, mode="bwd", dropout=True, varlen=True)
    lq, lk = LENGTHS[case]
    lk = lq if lk is None else lk
    gqa = [1, 2, 4][case % 3]
    p = [0.1, 0.5][(case + int(causal)) % 2]
    torch.manual_seed(case * 100 + d)
    q, k, v, cq, ck = packed(lq, lk, NHEADS_Q, NHEADS_Q // gqa, d, dtype, pad=case % 2 * 37)
    rng = new_rng_state(q.device)
    drop = from_rng_state(p, rng)
    scale = d ** -0.5
    out = torch.full((q.shape[0], NHEADS_Q, d), math.nan, dtype=dtype, device="cuda")
    lse = torch.full((NHEADS_Q, q.shape[0]), math.nan, device="cuda")
    _launch_varlen_fwd(q, k, v, cq, ck, None, None, max(lq), max(lk), out, lse, scale, causal, None, 0.0, None,
                       ARCH[backend], dropout_p=p, dropout_rng=rng)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(x, math.nan) for x in (q, k, v))
    _launch_varlen_bwd(dout, q, k, v, out, lse, None, cq, ck, None, None, max(lq), max(lk), dq, dk, dv, scale, causal,
                       None, 0.0, None, None, False, ARCH[backend], dropout_p=p, dropout_rng=rng)
    for b in range(len(lq)):
        oq, ok, nq, nk = int(cq[b]), int(ck[b]), lq[b], lk[b]
        if nq == 0:
            continue
        seq_drop = drop._replace(batch_start=b)
        rq, rk = slice(oq, oq + nq), slice(ok, ok + nk)
        assert_matches_reference(out[None, rq], lse[None, :, rq], q[None, rq], k[None, rk], v[None, rk], scale, causal,
                                 dropout=seq_drop)
        assert_grads_match_or_control((dq[None, rq], dk[None, rk], dv[None, rk]), dout[None, rq], q[None, rq],
                                      k[None, rk], v[None, rk], scale, causal, dropout=seq_drop)
    unused = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    unused[:int(cq[-1])] = False
    assert torch.isnan(out[unused]).all() and torch.isnan(dq[unused]).all(), "rows of no sequence were written"


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_varlen_func_dropout(backend: str) -> None:
    """Seeded runs repeat bitwise, another seed draws another mask, the returned mask is the one used (out and
    autograd's gradients match the reference with that draw), and dropout_p=0 is the call without dropout."""
    require_backend(backend, torch.bfloat16, 128, True, mode="bwd", dropout=True, varlen=True)
    lq, lk = [300, 1, 1000, 57], [300, 9, 1000, 57]  # no one-key sequence (see LENGTHS)
    torch.manual_seed(3)
    q, k, v, cq, ck = packed(lq, lk, 8, 2, 128, torch.bfloat16)
    for x in (q, k, v):
        x.requires_grad_()
    p = 0.17

    def run(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator("cuda").manual_seed(seed)
        return flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True, backend=backend,
                                      return_lse=True, dropout_p=p, generator=g, return_dropout_mask=True)

    out, lse, mask, drop = seeded_dropout_runs(run, p)
    assert mask.shape == (len(lq), 8, max(lq), max(lk))
    assert torch.equal(keep_mask(drop, len(lq), 8, max(lq), max(lk), "cuda"), mask)

    dout = torch.randn_like(out)
    out.backward(dout)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    for b in range(len(lq)):
        r = slice(int(cq[b]), int(cq[b]) + lq[b])
        t = slice(int(ck[b]), int(ck[b]) + lk[b])
        seq_drop = drop._replace(batch_start=b)
        assert_matches_reference(out.detach()[None, r], lse.detach()[None, :, r], qd[None, r], kd[None, t],
                                 vd[None, t], None, True, dropout=seq_drop)
        assert_grads_match_or_control((q.grad[None, r], k.grad[None, t], v.grad[None, t]), dout[None, r],
                                      qd[None, r], kd[None, t], vd[None, t], 128 ** -0.5, True, dropout=seq_drop)

    plain = flash_attn_varlen_func(qd, kd, vd, cq, ck, max(lq), max(lk), causal=True, backend=backend)
    assert torch.equal(plain, flash_attn_varlen_func(qd, kd, vd, cq, ck, max(lq), max(lk), causal=True,
                                                     backend=backend, dropout_p=0.0))
