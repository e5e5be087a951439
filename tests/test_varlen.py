"""flash_attn_varlen_func on the CPU: the per-sequence reference, gradients, and the argument checks that
run before any kernel (the kernels' own tests are test_varlen_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from flashhopper import attention_ref, attention_varlen_ref, flash_attn_varlen_func
from flashhopper.varlen import DEBUG_ENV, check_values_here


def cu(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def make(lq: list[int], lk: list[int], hq: int = 4, hkv: int = 2, d: int = 16, dtype: torch.dtype = torch.float64):
    torch.manual_seed(sum(lq) + 7 * sum(lk))
    q = torch.randn(sum(lq), hq, d, dtype=dtype)
    k = torch.randn(sum(lk), hkv, d, dtype=dtype)
    v = torch.randn(sum(lk), hkv, d, dtype=dtype)
    return q, k, v, cu(lq), cu(lk)


@pytest.mark.parametrize("causal", [False, True])
def test_each_sequence_is_its_own_attention(causal: bool) -> None:
    lq, lk = [5, 0, 9, 1], [7, 3, 4, 1]
    q, k, v, cq, ck = make(lq, lk)
    out, lse = flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=causal, return_lse=True)
    assert out.shape == (sum(lq), 4, 16) and lse.shape == (4, sum(lq))
    for b in range(len(lq)):
        s, t = int(cq[b]), int(ck[b])
        if lq[b] == 0:
            continue
        ref, ref_lse = attention_ref(q[None, s:s + lq[b]], k[None, t:t + lk[b]], v[None, t:t + lk[b]], None, causal)
        torch.testing.assert_close(out[s:s + lq[b]], ref[0])
        torch.testing.assert_close(lse[:, s:s + lq[b]], ref_lse[0].float())


def test_seqused_ignores_the_rest_of_the_slot() -> None:
    q, k, v, cq, ck = make([6, 4], [6, 4])
    used = torch.tensor([3, 4], dtype=torch.int32)
    k2, v2 = k.clone(), v.clone()
    k2[3:6], v2[3:6] = 1e3, -1e3  # keys past seqused_k of sequence 0
    a = flash_attn_varlen_func(q, k, v, cq, ck, 6, 6, seqused_k=used)
    b = flash_attn_varlen_func(q, k2, v2, cq, ck, 6, 6, seqused_k=used)
    torch.testing.assert_close(a, b)


def test_reference_is_differentiable() -> None:
    q, k, v, cq, ck = make([3, 2], [2, 4], hq=2, hkv=1, d=4)
    for x in (q, k, v):
        x.requires_grad_()
    torch.autograd.gradcheck(lambda q, k, v: flash_attn_varlen_func(q, k, v, cq, ck, 3, 4, causal=True), (q, k, v))


@pytest.mark.parametrize("variant", ["window", "softcap", "sinks", "dropout"])
def test_variants_gradcheck(variant: str) -> None:
    # float64 gradchecks through the public call for each of #23's variants on packed batches (the reference's
    # autograd; the GPU tests compare the kernels with it). Dropout: a fresh generator of one seed per call, so
    # every evaluation drops the same entries.
    q, k, v, cq, ck = make([3, 0, 4], [4, 2, 5], hq=2, hkv=1, d=4)
    sinks = torch.randn(2, dtype=torch.float32)
    kw: dict[str, object] = {"window": dict(window_size=(2, 1)), "softcap": dict(softcap=1.5),
                             "sinks": dict(sinks=sinks), "dropout": dict(dropout_p=0.3)}[variant]
    for x in (q, k, v):
        x.requires_grad_()

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        extra = dict(generator=torch.Generator().manual_seed(5)) if variant == "dropout" else {}
        return flash_attn_varlen_func(q, k, v, cq, ck, 4, 5, causal=variant == "window", **kw, **extra)

    torch.autograd.gradcheck(f, (q, k, v))
    plain = flash_attn_varlen_func(q, k, v, cq, ck, 4, 5)
    assert not torch.allclose(f(q, k, v), plain)  # the variant changes the output (it is not a no-op here)


def test_backward_op_matches_autograd_of_the_reference() -> None:
    # The op the kernels' autograd calls, on its reference backend: gradients w.r.t. q, k, v and sinks
    # through out and lse, against torch's autograd of the differentiable reference (seqused, a window,
    # softcap and sinks included: every argument the op forwards).
    q, k, v, cq, ck = make([5, 0, 4], [6, 2, 4], hq=4, hkv=2, d=8)
    used_k = torch.tensor([4, 2, 4], dtype=torch.int32)
    sinks = torch.randn(4, dtype=torch.float32)
    kw = dict(seqused_k=used_k, window=(3, 1), softcap=2.0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = attention_varlen_ref(*leaves[:3], cq, ck, 0.3, False, sinks=leaves[3], **kw)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    valid = torch.isfinite(lse)
    loss = (out * dout).sum() + torch.where(valid, lse * dlse, 0).sum()
    want = torch.autograd.grad(loss, leaves)
    got = torch.ops.flashhopper.varlen_bwd(dout, q, k, v, out.detach(), lse.detach().float(), dlse.float(), cq, ck,
                                           None, used_k, 5, 6, 0.3, False, 3, 1, 2.0, sinks, False, "reference")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(got[1][4:6]) == 0  # keys past seqused_k get no gradient


@pytest.mark.parametrize("bad, err, match", [
    (dict(cu_seqlens_q=cu([2, 3]).long()), TypeError, "cu_seqlens_q has dtype torch.int64"),
    (dict(cu_seqlens_k=cu([2])), ValueError, "cu_seqlens_k has 2 entries"),
    (dict(cu_seqlens_q=torch.zeros(0, dtype=torch.int32)), ValueError, r"shape \(batch \+ 1,\)"),
    (dict(cu_seqlens_q=cu([2, 3])[None]), ValueError, r"shape \(batch \+ 1,\)"),
    (dict(max_seqlen_q=3.0), TypeError, "max_seqlen_q must be a Python int"),
    (dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be a Python int"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0"),
    (dict(seqused_q=torch.tensor([1], dtype=torch.int32)), ValueError, r"seqused_q must have shape \(2,\)"),
    (dict(seqused_k=torch.tensor([1, 2])), TypeError, "seqused_k has dtype torch.int64"),
    (dict(q=torch.randn(1, 5, 4, 16, dtype=torch.float64)), ValueError, "q must have 3 dimensions"),
    (dict(k=torch.randn(5, 3, 16, dtype=torch.float64), v=torch.randn(5, 3, 16, dtype=torch.float64)), ValueError,
     "multiple of k/v nheads"),
    (dict(v=torch.randn(5, 2, 16, dtype=torch.float32)), TypeError, "v has dtype"),
])
def test_bad_inputs(bad: dict, err: type, match: str) -> None:
    q, k, v, cq, ck = make([2, 3], [2, 3])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=3, max_seqlen_k=3)
    args.update(bad)
    with pytest.raises(err, match=match):
        flash_attn_varlen_func(**args)


# Values only the host copy shows (validation.check_varlen_values): always checked on CPU tensors.
BAD_VALUES = [
    # (q rows, cu_seqlens_q, seqused_q, message)
    (4, [0, 3, 3, 8, 9], None, r"cu_seqlens_q must be non-decreasing from >= 0 up to at most 4 .*\[0, 3, 3, 8, 9\]"),
    (9, [0, 5, 3, 9], None, r"cu_seqlens_q must be non-decreasing .*\[0, 5, 3, 9\]"),
    (9, [-2, 5, 9], None, r"cu_seqlens_q must be non-decreasing from >= 0 .*\[-2, 5, 9\]"),
    (9, [0, 4, 9], [5, 2], r"seqused_q must lie within each sequence's slot \(0 ..\[4, 5\]\), got \[5, 2\]"),
]


@pytest.mark.parametrize("rows, cu_q, used_q, match", BAD_VALUES)
def test_cpu_checks_the_values(monkeypatch: pytest.MonkeyPatch, rows: int, cu_q: list[int],
                               used_q: list[int] | None, match: str) -> None:
    monkeypatch.delenv(DEBUG_ENV, raising=False)  # no opt-in needed on the CPU
    batch = len(cu_q) - 1
    q, k, v, _, ck = make([rows], [1] * batch)
    cq = torch.tensor(cu_q, dtype=torch.int32)
    used = None if used_q is None else torch.tensor(used_q, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(q, k, v, cq, ck, 8, 1, seqused_q=used)


def test_cpu_checks_max_seqlen_and_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    q, k, v, cq, ck = make([2, 3], [2, 3])
    with pytest.raises(ValueError, match="max_seqlen_q is 2 but a sequence has 3 tokens"):
        flash_attn_varlen_func(q, k, v, cq, ck, 2, 3)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        flash_attn_varlen_func(q, k, v, cq, torch.tensor([0, 4, 3], dtype=torch.int32), 3, 4)
    with pytest.raises(ValueError, match="seqused_k must lie within"):
        flash_attn_varlen_func(q, k, v, cq, ck, 3, 3, seqused_k=torch.tensor([0, 4], dtype=torch.int32))


@pytest.mark.parametrize("debug", [False, True])
def test_good_values_pass(monkeypatch: pytest.MonkeyPatch, debug: bool) -> None:
    if debug:
        monkeypatch.setenv(DEBUG_ENV, "1")
    else:
        monkeypatch.delenv(DEBUG_ENV, raising=False)
    # Empty sequences, rows past cu_seqlens_q[-1], seqused at 0 and at the whole slot: all valid.
    q, k, v, _, ck = make([9], [2, 0, 3, 4])
    cq = torch.tensor([0, 3, 3, 8, 8], dtype=torch.int32)
    used = torch.tensor([3, 0, 2, 0], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cq, ck, 5, 4, seqused_q=used, seqused_k=torch.tensor([2, 0, 3, 4],
                                                                                                dtype=torch.int32))
    assert out.shape == q.shape


def test_values_read_off_the_cpu_only_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    # Off the CPU the values cost a device-to-host copy: the debug flag decides (a meta tensor stands in for CUDA).
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert check_values_here(torch.zeros(3, dtype=torch.int32))
    assert not check_values_here(torch.zeros(3, dtype=torch.int32, device="meta"))
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert check_values_here(torch.zeros(3, dtype=torch.int32, device="meta"))


def test_kernel_backend_needs_cuda() -> None:
    q, k, v, cq, ck = make([2, 3], [2, 3], dtype=torch.float16)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        flash_attn_varlen_func(q, k, v, cq, ck, 3, 3, backend="sm90")


def test_fake_op_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k, v = torch.empty(10, 4, 64), torch.empty(7, 2, 64), torch.empty(7, 2, 32)
        c = torch.empty(3, dtype=torch.int32)
        out, lse = torch.ops.flashhopper.varlen_fwd(q, k, v, c, c, None, None, 5, 5, 0.1, True, -1, -1, 0.0, None,
                                                    False, "sm90")
        dq, dk, dv, dsinks = torch.ops.flashhopper.varlen_bwd(out, q, k, v, out, lse, None, c, c, None, None, 5, 5,
                                                              0.1, True, -1, -1, 0.0, None, False, "sm90")
        rng = torch.empty(2, dtype=torch.int64)
        out2, _ = torch.ops.flashhopper.varlen_fwd(q, k, v, c, c, None, None, 5, 5, 0.1, True, -1, -1, 0.0, None,
                                                   False, "sm90", 0.1, rng)
        dq2 = torch.ops.flashhopper.varlen_bwd(out, q, k, v, out, lse, None, c, c, None, None, 5, 5, 0.1, True, -1,
                                               -1, 0.0, None, False, "sm90", 0.1, rng)[0]
    assert out.shape == (10, 4, 32) and lse.shape == (4, 10) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape, dsinks.shape) == (q.shape, k.shape, v.shape, (0,))
    assert out2.shape == out.shape and dq2.shape == q.shape  # with dropout's arguments


# --- dropout (flashhopper.dropout: sequence b draws as batch entry b) ---

def test_dropout_reference_draws_sequence_b_as_batch_entry_b() -> None:
    # Equal lengths: the packed batch with dropout is the padded batch with the same draw, entry for entry.
    from flashhopper.dropout import Dropout
    q, k, v, cq, ck = make([20, 20, 20], [33, 33, 33], hq=4, hkv=2, d=16)
    drop = Dropout(0.3, 0x1234_5678_9ABC_DEF0, 77)
    for causal in (False, True):
        out, lse = attention_varlen_ref(q, k, v, cq, ck, None, causal, dropout=drop)
        ref, ref_lse = attention_ref(q.view(3, 20, 4, 16), k.view(3, 33, 2, 16), v.view(3, 33, 2, 16), None, causal,
                                     dropout=drop)
        torch.testing.assert_close(out, ref.reshape(60, 4, 16))
        torch.testing.assert_close(lse, ref_lse.permute(1, 0, 2).reshape(4, 60))
    plain = attention_varlen_ref(q, k, v, cq, ck, None, False)[0]
    assert not torch.allclose(out, plain)  # the draw did drop something


def test_flash_attn_varlen_func_dropout_on_the_cpu() -> None:
    from flashhopper.dropout import from_rng_state, keep_mask, new_rng_state
    lq, lk = [5, 0, 9, 1], [7, 3, 40, 1]
    q, k, v, cq, ck = make(lq, lk)

    def run(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True, dropout_p=0.25, generator=g,
                                      return_lse=True, return_dropout_mask=True)

    out, lse, mask = run(3)
    out2, _, mask2 = run(3)
    out3, _, mask3 = run(4)
    assert torch.equal(out, out2) and torch.equal(mask, mask2) and not torch.equal(mask, mask3)
    assert mask.shape == (4, 4, max(lq), max(lk)) and mask.dtype == torch.bool
    drop = from_rng_state(0.25, new_rng_state(q.device, torch.Generator().manual_seed(3)))
    assert torch.equal(mask, keep_mask(drop, 4, 4, max(lq), max(lk)))
    ref, ref_lse = attention_varlen_ref(q, k, v, cq, ck, None, True, dropout=drop)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse.float())
    no_mask = flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), return_dropout_mask=True)
    assert no_mask[1].all() and no_mask[1].shape == (4, 4, max(lq), max(lk))


def test_dropout_backward_op_matches_autograd_of_the_reference() -> None:
    from flashhopper.dropout import from_rng_state, new_rng_state
    q, k, v, cq, ck = make([5, 0, 4], [6, 2, 4], hq=4, hkv=2, d=8)
    rng = new_rng_state(q.device, torch.Generator().manual_seed(5))
    drop = from_rng_state(0.4, rng)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = attention_varlen_ref(*leaves, cq, ck, 0.3, True, dropout=drop)
    dout = torch.randn_like(out)
    want = torch.autograd.grad((out * dout).sum(), leaves)
    got = torch.ops.flashhopper.varlen_bwd(dout, q, k, v, out.detach(), lse.detach().float(), None, cq, ck, None,
                                           None, 5, 6, 0.3, True, -1, -1, 0.0, None, False, "reference", 0.4, rng)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    plain = torch.ops.flashhopper.varlen_bwd(dout, q, k, v, out.detach(), lse.detach().float(), None, cq, ck, None,
                                             None, 5, 6, 0.3, True, -1, -1, 0.0, None, False, "reference")
    assert not torch.allclose(got[2], plain[2])  # the op did apply the mask


@pytest.mark.parametrize("bad, err, match", [
    (dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\]"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
    (dict(return_dropout_mask=1), TypeError, "return_dropout_mask"),
    (dict(generator=object()), TypeError, "generator"),
])
def test_bad_dropout_inputs(bad: dict, err: type, match: str) -> None:
    q, k, v, cq, ck = make([2, 3], [2, 3])
    with pytest.raises(err, match=match):
        flash_attn_varlen_func(q, k, v, cq, ck, 3, 3, **bad)
