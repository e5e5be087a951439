"""The eager fast path (flashhopper._plans) on the GPU: a repeated configuration skips validation and the op, and
gives bit for bit what the full path gives; whatever it cannot vouch for goes the full way and raises there.

Outputs are allocated inside the call, so they are poisoned through the caching allocator: a NaN block of the
output's size is freed just before the call, which then gets it back (a row the kernel forgets stays NaN).
"""
from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_matches_reference, randn_qkv, rel_err, require_backend

import flashhopper as fh
from flashhopper import _plans, fp8, interface
from flashhopper.fp8 import attention as fp8_attention
from flashhopper.fp8 import ops as fp8_ops
from flashhopper.fp8 import quantize as fp8_quantize
from flashhopper.fp8 import quantized_kv

pytestmark = pytest.mark.gpu

# (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, headdim, causal, dtype): decode, GQA, odd lengths.
CASES = [
    (1, 128, 128, 8, 8, 64, True, torch.bfloat16),
    (2, 300, 517, 8, 2, 64, False, torch.float16),
    (3, 1, 1000, 4, 1, 64, True, torch.bfloat16),
    (2, 255, 255, 6, 3, 128, True, torch.bfloat16),
    (1, 1000, 77, 4, 4, 256, False, torch.float16),
]


def case_id(c: tuple) -> str:  # type: ignore[type-arg]
    b, sq, sk, hq, hkv, d, causal, dtype = c
    return f"b{b}-{sq}x{sk}-h{hq}/{hkv}-d{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"


def poison(*shapes_dtypes: tuple[tuple[int, ...], torch.dtype]) -> None:
    """Hand NaN-filled blocks of these sizes back to the caching allocator, for the next call's outputs."""
    blocks = [torch.full(s, math.nan, dtype=dt, device="cuda") for s, dt in shapes_dtypes]
    torch.cuda.synchronize()
    del blocks


class Counter:
    """Wraps a function and counts its calls (which path a call took)."""

    def __init__(self, fn):  # type: ignore[no-untyped-def]
        self.fn, self.n = fn, 0

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.n += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_repeat_takes_the_fast_path_and_matches(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[type-arg]
    b, sq, sk, hq, hkv, d, causal, dtype = case
    require_backend("sm90", dtype, d, causal)
    _plans.clear()
    q, k, v = randn_qkv(b, sq, sk, hq, hkv, d, dtype, device="cuda")
    checks = Counter(interface.check_inputs)
    monkeypatch.setattr(interface, "check_inputs", checks)
    with torch.no_grad():
        out_full, lse_full = fh.flash_attn_func(q, k, v, causal=causal, return_lse=True)  # full path, stores
        assert checks.n == 1 and len(interface._PLANS) == 1
        for _ in range(2):
            poison(((b, sq, hq, d), dtype), ((b, hq, sq), torch.float32))
            out, lse = fh.flash_attn_func(q, k, v, causal=causal, return_lse=True)
            assert checks.n == 1  # no validation: the fast path
            assert torch.equal(out, out_full) and torch.equal(lse, lse_full)
            assert out.is_contiguous() and lse.is_contiguous() and out.dtype == dtype
        # New tensors of the same metadata take it too; another configuration does not.
        q2, k2, v2 = randn_qkv(b, sq, sk, hq, hkv, d, dtype, device="cuda")
        out2, _ = fh.flash_attn_func(q2, k2, v2, causal=causal, return_lse=True)
        assert checks.n == 1
        assert torch.equal(out2, fh.flash_attn_func(q2, k2, v2, causal=causal, backend="sm90"))  # (full: key differs)
        assert checks.n == 2
        fh.flash_attn_func(q2, k2, v2, causal=causal, softmax_scale=0.5)
        assert checks.n == 3
    assert_matches_reference(out, lse, q, k, v, 1.0 / math.sqrt(d), causal)


def test_what_the_key_does_not_show_goes_the_full_way(monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs a backward below: a forward-only build skips it.
    require_backend("sm90", torch.bfloat16, 64, True, mode="bwd")
    _plans.clear()
    q, k, v = randn_qkv(1, 128, 128, 8, 8, 64, torch.bfloat16, device="cuda")
    checks = Counter(interface.check_inputs)
    monkeypatch.setattr(interface, "check_inputs", checks)
    with torch.no_grad():
        ref = fh.flash_attn_func(q, k, v, causal=True)
    # A misaligned view of the same metadata: the full path names it.
    base = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")
    odd = base[1:1 + q.numel()].view(q.shape)
    odd.copy_(q)
    with torch.no_grad(), pytest.raises(ValueError, match="q data pointer"):
        fh.flash_attn_func(odd, k, v, causal=True)
    assert checks.n == 2
    # Grad: autograd records through the op (full path), forward values identical.
    qg = q.clone().requires_grad_()
    out = fh.flash_attn_func(qg, k, v, causal=True)
    assert checks.n == 3 and out.grad_fn is not None and torch.equal(out, ref)
    out.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    # An int where validation wants a bool (1 == True) is no hit for the causal plan.
    with torch.no_grad(), pytest.raises(TypeError, match="causal"):
        fh.flash_attn_func(q, k, v, causal=1)
    # Under a dispatch mode the op runs (the mode sees it).
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Record():
        out = fh.flash_attn_func(q, k, v, causal=True)
    assert any("flashhopper.fwd" in s for s in seen) and torch.equal(out, ref)


def test_graph_capture_of_the_fast_path() -> None:
    require_backend("sm90", torch.bfloat16, 64, True)
    _plans.clear()
    q, k, v = randn_qkv(2, 200, 300, 8, 2, 64, torch.bfloat16, device="cuda")
    with torch.no_grad():
        eager = fh.flash_attn_func(q, k, v, causal=True)  # stores the plan
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            side = fh.flash_attn_func(q, k, v, causal=True)  # the fast path on a side stream (its own tile counter)
        torch.cuda.current_stream().wait_stream(s)
        assert torch.equal(side, eager)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fh.flash_attn_func(q, k, v, causal=True)
        for _ in range(2):
            out.fill_(math.nan)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)
        q.copy_(torch.randn_like(q))
        g.replay()
        assert torch.equal(out, fh.flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_prequantized_and_quantized_kv(causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    tiles = fp8.kernel_tiles(64, causal)
    if tiles is None:
        pytest.skip("no fp8 head dim 64 kernel in this build")
    _plans.clear()
    b, sq, sk, hq, hkv, d = 2, 200, 333, 8, 2, 64
    q, k, v = randn_qkv(b, sq, sk, hq, hkv, d, torch.bfloat16, device="cuda")
    kv = fp8.quantize_kv(k, v, causal=causal)
    q8 = fp8.quantize_fp8(q, block_size=64, seed=kv.k.hadamard_seed)
    full_checks = Counter(fp8_attention.check_fp8_inputs)
    monkeypatch.setattr(fp8_attention, "check_fp8_inputs", full_checks)
    ref_out, ref_lse = fp8.flash_attn_fp8_func(q8, kv.k, kv.v, causal=causal, return_lse=True)
    assert full_checks.n == 1
    for _ in range(2):
        poison(((b, sq, hq, d), torch.bfloat16), ((b, hq, sq), torch.float32))
        out, lse = fp8.flash_attn_fp8_func(q8, kv.k, kv.v, causal=causal, return_lse=True)
        assert full_checks.n == 1 and torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    # attend: the full path once (validating q, quantizing it with K's seed), then the fast path, both equal to
    # quantizing q first.
    first = kv.attend(q, causal=causal)
    assert full_checks.n == 2 and len(quantized_kv._PLANS) == 1 and torch.equal(first, ref_out)
    for _ in range(2):
        poison(((b, sq, hq, d), torch.bfloat16))
        assert torch.equal(kv.attend(q, causal=causal), ref_out)
    assert full_checks.n == 2
    q2 = torch.randn_like(q)
    expect = fp8.flash_attn_fp8_func(fp8.quantize_fp8(q2, block_size=64, seed=kv.k.hadamard_seed), kv.k, kv.v,
                                     causal=causal)
    assert torch.equal(kv.attend(q2, causal=causal), expect)
    # bf16 q, k, v quantized in the call (three quantizations, then the forward), with and without lse.
    n = full_checks.n
    e2e = [fp8.flash_attn_fp8_func(q, k, v, causal=causal, return_lse=True) for _ in range(3)]
    assert full_checks.n == n + 1
    for out, lse in e2e[1:]:  # (the second and third: the fast path)
        assert torch.equal(out, e2e[0][0]) and torch.equal(lse, e2e[0][1])
    plain = fp8.flash_attn_fp8_func(q, k, v, causal=causal)
    assert full_checks.n == n + 2 and torch.equal(plain, e2e[0][0])
    poison(((b, sq, hq, d), torch.bfloat16))
    assert torch.equal(fp8.flash_attn_fp8_func(q, k, v, causal=causal), plain) and full_checks.n == n + 2
    # ... and equal to quantizing first (the kernel's K/V block for this causal flag).
    kv_block = fp8.default_kv_block_size(d, causal)
    q8s, k8s = (fp8.quantize_fp8(x, block_size=bs) for x, bs in ((q, 64), (k, kv_block)))
    v8s = fp8.quantize_fp8(v, block_size=kv_block, hadamard=False, transpose=True)
    assert torch.equal(plain, fp8.flash_attn_fp8_func(q8s, k8s, v8s, causal=causal))
    # Another K seed is another key: quantized with its own signs.
    kv7 = fp8.quantize_kv(k, v, causal=causal, seed=7)
    q87 = fp8.quantize_fp8(q, block_size=64, seed=7)
    assert torch.equal(kv7.attend(q, causal=causal), fp8.flash_attn_fp8_func(q87, kv7.k, kv7.v, causal=causal))
    assert torch.equal(kv7.attend(q, causal=causal), fp8.flash_attn_fp8_func(q87, kv7.k, kv7.v, causal=causal))


@pytest.mark.parametrize("transpose", [False, True])
def test_quantize_fp8_repeat(transpose: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not fp8_ops.has_quant_kernel():
        pytest.skip("no fp8 quantization kernel in this build")
    _plans.clear()
    x = torch.randn(2, 200, 3, 128, device="cuda", dtype=torch.bfloat16)
    checks = Counter(fp8_quantize.check_input)
    monkeypatch.setattr(fp8_quantize, "check_input", checks)
    first = fp8.quantize_fp8(x, block_size=64, seed=5, transpose=transpose)
    assert checks.n == 1
    for _ in range(2):
        poison((tuple(first.data.shape), torch.float8_e4m3fn), (tuple(first.scale.shape), torch.float32))
        again = fp8.quantize_fp8(x, block_size=64, seed=5, transpose=transpose)
        assert checks.n == 1  # the fast path
        assert torch.equal(again.data.view(torch.uint8), first.data.view(torch.uint8))
        assert torch.equal(again.scale, first.scale) and again._replace(data=None, scale=None) == first._replace(
            data=None, scale=None)
    fp8.quantize_fp8(x, block_size=64, seed=6, transpose=transpose)  # another seed: the full path
    assert checks.n == 2


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


# (q lengths, k lengths, nheads_q, nheads_kv, headdim, causal, seqused, sinks, backend): empty and one-token
# sequences, GQA, unused slot tails, sink logits, and the Ampere kernels (no workspace, no tile counter).
VARLEN_CASES = [
    ([17, 128, 0, 255, 1], [17, 128, 0, 255, 1], 4, 4, 64, True, False, False, "sm90"),
    ([300, 5], [40, 700], 8, 2, 128, False, True, False, "sm90"),
    ([1, 64, 200], [1, 64, 200], 4, 1, 128, True, False, True, "sm90"),
    ([100, 33], [100, 90], 4, 2, 64, True, False, False, "sm80"),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"{c[4]}-{'causal' if c[5] else 'full'}-{c[8]}"
                         f"{'-seqused' if c[6] else ''}{'-sinks' if c[7] else ''}")
def test_varlen_repeat_takes_the_fast_path_and_matches(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[type-arg]
    from flashhopper import varlen

    lq, lk, hq, hkv, d, causal, use_seqused, use_sinks, backend = case
    require_backend(backend, torch.bfloat16, d, causal, varlen=True)
    _plans.clear()
    torch.manual_seed(3)
    q = torch.randn(sum(lq) + 8, hq, d, dtype=torch.bfloat16, device="cuda")  # 8 rows in no sequence
    k = torch.randn(sum(lk) + 8, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    cq, ck = cu(lq), cu(lk)
    used_q = torch.tensor([max(n - 3, 0) for n in lq], dtype=torch.int32, device="cuda") if use_seqused else None
    used_k = torch.tensor([max(n - 1, 0) for n in lk], dtype=torch.int32, device="cuda") if use_seqused else None
    sinks = torch.randn(hq, device="cuda") if use_sinks else None
    kw = dict(causal=causal, seqused_q=used_q, seqused_k=used_k, sinks=sinks, return_lse=True,
              backend=None if backend == "sm90" else backend)
    checks = Counter(varlen.validation.check_varlen_inputs)
    monkeypatch.setattr(varlen.validation, "check_varlen_inputs", checks)
    with torch.no_grad():
        poison(((q.shape[0], hq, d), torch.bfloat16), ((hq, q.shape[0]), torch.float32))
        out_full, lse_full = fh.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), **kw)  # stores the plan
        assert checks.n == 1 and len(varlen._PLANS) == 1
        for _ in range(2):
            poison(((q.shape[0], hq, d), torch.bfloat16), ((hq, q.shape[0]), torch.float32))
            out, lse = fh.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), **kw)
            assert checks.n == 1  # no validation: the fast path
            # Bit for bit the full path's, NaN where no sequence's used rows are (both calls leave them unwritten).
            assert torch.equal(out.nan_to_num(7.0), out_full.nan_to_num(7.0))
            assert torch.equal(lse.nan_to_num(7.0), lse_full.nan_to_num(7.0))
        # Other values of cu_seqlens (same metadata) take it too and give their own answer; other lengths' max do not.
        cq2 = cu(lq[::-1])
        ck2 = cu(lk[::-1])
        used2 = (None, None) if not use_seqused else (used_q.flip(0).contiguous(), used_k.flip(0).contiguous())
        kw2 = dict(kw, seqused_q=used2[0], seqused_k=used2[1])
        fast = fh.flash_attn_varlen_func(q, k, v, cq2, ck2, max(lq), max(lk), **kw2)
        assert checks.n == 1
        _plans.clear()
        full = fh.flash_attn_varlen_func(q, k, v, cq2, ck2, max(lq), max(lk), **kw2)
        assert checks.n == 2
        n = sum(lq)
        rows = torch.ones(n, dtype=torch.bool, device="cuda") if not use_seqused else torch.cat(
            [torch.arange(a, device="cuda") < u for a, u in zip(lq[::-1], used2[0].tolist())])
        assert torch.equal(fast[0][:n][rows], full[0][:n][rows]) and torch.equal(fast[1][:, :n][:, rows],
                                                                               full[1][:, :n][:, rows])
        # Reference per sequence (the first call's outputs).
        ref_out, ref_lse = fh.flash_attn_varlen_func(q.float(), k.float(), v.float(), cq, ck, max(lq), max(lk),
                                                     **dict(kw, backend="reference"))
    starts = cq.tolist()
    for b in range(len(lq)):
        nq = lq[b] if used_q is None else int(used_q[b])
        sl = slice(starts[b], starts[b] + nq)
        if nq:
            assert rel_err(out_full[sl].float(), ref_out[sl]) < 2e-2
            assert (lse_full[:, sl] - ref_lse[:, sl]).abs().max() < 2e-2


def test_varlen_fast_path_misaligned_grad_and_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashhopper import varlen

    require_backend("sm90", torch.bfloat16, 128, True, mode="bwd", varlen=True)  # (a call with grad below)
    _plans.clear()
    lengths = [400, 1, 600]
    q = torch.randn(sum(lengths), 4, 128, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn_like(q), torch.randn_like(q)
    cq = cu(lengths)
    checks = Counter(varlen.validation.check_varlen_inputs)
    monkeypatch.setattr(varlen.validation, "check_varlen_inputs", checks)
    with torch.no_grad():
        ref = fh.flash_attn_varlen_func(q, k, v, cq, cq, 600, 600, causal=True)
    # A misaligned view of the same metadata: the full path names it.
    base = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")
    odd = base[1:1 + q.numel()].view(q.shape)
    odd.copy_(q)
    with torch.no_grad(), pytest.raises(ValueError, match="q"):
        fh.flash_attn_varlen_func(odd, k, v, cq, cq, 600, 600, causal=True)
    assert checks.n == 2
    # Grad: the op records it (full path), same values.
    qg = q.clone().requires_grad_()
    out = fh.flash_attn_varlen_func(qg, k, v, cq, cq, 600, 600, causal=True)
    assert checks.n == 3 and out.grad_fn is not None and torch.equal(out, ref)
    # The debug checks read cu_seqlens each call: the full path, which raises on bad values.
    monkeypatch.setenv(varlen.DEBUG_ENV, "1")
    with torch.no_grad(), pytest.raises(ValueError):
        fh.flash_attn_varlen_func(q, k, v, cu([400, 1, 601]), cq, 600, 600, causal=True)
    monkeypatch.delenv(varlen.DEBUG_ENV)
    # Captured through the fast path, replayed with new lengths: equal to eager.
    n = checks.n
    with torch.no_grad():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gout = fh.flash_attn_varlen_func(q, k, v, cq, cq, 600, 600, causal=True)
        assert checks.n == n
        for new in ([1, 600, 400], [0, 600, 401]):
            cq.copy_(cu(new))
            gout.fill_(math.nan)
            g.replay()
            _plans.clear()
            eager = fh.flash_attn_varlen_func(q, k, v, cq, cq, 600, 600, causal=True)  # the full path
            assert torch.equal(gout, eager)
