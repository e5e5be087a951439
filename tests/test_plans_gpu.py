"""The eager fast path (flashhopper._plans) on the GPU: a repeated configuration skips validation and the op, and
gives bit for bit what the full path gives; whatever it cannot vouch for goes the full way and raises there.

Outputs are allocated inside the call, so they are poisoned through the caching allocator: a NaN block of the
output's size is freed just before the call, which then gets it back (a row the kernel forgets stays NaN).
"""
from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_matches_reference, randn_qkv, require_backend

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
