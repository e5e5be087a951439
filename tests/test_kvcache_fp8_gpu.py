"""The Hopper KV-cache kernel over an e4m3 cache (flash_attn_with_kvcache with k_cache_scale / v_cache_scale) on the
GPU (skipped here).

Caches are built as in test_kvcache_gpu (random lengths, pages scattered, every unused slot NaN or inf) and quantized
with kvcache_fp8.quantize_kv_cache, so the unused slots hold NaN data and NaN scales. The kernel must match exact
float64 attention over the cache's stored values (dequantized, q transformed as K is) to the rounding of P to e4m3
in the PV GEMM, and exact attention over the original values to fp8's error; appends write exactly the bytes
and scales quantize_rows gives; a captured decode step replays equal to an eager call.
"""
from __future__ import annotations

import random

import pytest
import torch
from helpers import nan_kvcache_outputs  # noqa: F401  (a fixture)
from test_kvcache_gpu import CAPACITY, lengths_for, poisoned_cache

from flashhopper import _device, _ext, append_kvcache, dispatch, flash_attn_with_kvcache, kvcache_fp8
from flashhopper.kernel_key import VARLEN_HEADDIMS
from flashhopper.kvcache import (CacheShapes, _append_fp8_kernel_takes, _kvcache_key, _kvcache_mask,
                                 resolve_backend)
from flashhopper.reference import attention_kvcache_ref, kvcache_entry

# The call allocates out and lse: NaN-filled for every test here (helpers.nan_kvcache_outputs).
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("nan_kvcache_outputs")]


def require_fp8_kvcache(dtype: torch.dtype, headdim: int, seqlen_q: int, causal: bool,
                        window: tuple[int, int] | None = None, softcap: float = 0.0) -> None:
    """Skip where Hopper kernels cannot run or the build was not configured with the e4m3-cache kernel; FAIL when
    it was configured and is missing, or when dispatch refuses a kernel the build has."""
    info = _device.device_info(torch.cuda.current_device())
    if not dispatch.runs_on("sm90", info.capability):
        pytest.skip(f"e4m3 KV caches are read by the Hopper (sm90) kernels only; this is {info.name}")
    key = _kvcache_key(dtype, headdim, headdim, _kvcache_mask(seqlen_q, causal, window), "sm90", "e4m3",
                       "softcap" if softcap else "none")
    if _ext.kernel("fwd", key) is None:
        if _ext.configured("fwd", key):
            pytest.fail(f"the build was configured with {key.describe()} but does not have it ({_ext.build_info()})")
        pytest.skip(f"no fwd kernel {key.describe()} in this build ({_ext.build_info() or _ext.extension_error()}): "
                    "configure FLASHHOPPER_KVCACHE with e4m3")
    q = torch.empty(1, seqlen_q, 1, headdim, dtype=dtype, device="cuda")
    shapes = CacheShapes(1, seqlen_q, 1, 1, headdim, headdim, False, 16, 1, 16, 0)
    try:
        resolve_backend(q, shapes, causal, None, "e4m3", window, softcap)
    except ValueError as e:
        pytest.fail(f"dispatch refuses the e4m3-cache kernel {key.describe()}, which the build has: {e}")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def check_against_stored(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
                         ks: torch.Tensor, vs: torch.Tensor, lengths: list[int], causal: bool,
                         table: torch.Tensor | None, seed: int | None, sinks: torch.Tensor | None = None,
                         window: tuple[int, int] | None = None, softcap: float = 0.0) -> None:
    """out / lse finite, and against float64 attention over the stored values (q transformed as K's rows):
    ||out - ref|| / ||ref|| within the rounding of P to e4m3 before the PV GEMM (2^-4 of each element, as the FP8
    forward's and FA3's: 1.8-2.9e-2 measured on these shapes; a wrong key or block gives O(1)). The kernel's scores are
    e4m3 GEMMs (q as two e4m3 terms, 2^-8 of each element; the tensor cores' fp8 accumulation keeps about 14 bits):
    up to ~3e-3 of a score in error, so the lse bound grows with |lse| (docs/kvcache-fp8.md)."""
    assert torch.isfinite(out).all(), "out is not finite (a poisoned slot was read?)"
    assert not torch.isnan(lse).any() and not torch.isposinf(lse).any(), "lse has NaN or +inf"
    qt = kvcache_fp8.transform_q(q.double(), seed)
    kd = kvcache_fp8.dequantize_kv_cache(k8, ks, None, torch.float64)
    vd = kvcache_fp8.dequantize_kv_cache(v8, vs, None, torch.float64)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    ref, ref_lse = attention_kvcache_ref(qt, kd, vd, lens, table, causal=causal, sinks=sinks, window=window,
                                         softcap=softcap, dtype=torch.float64)
    err = rel_err(out, ref)
    assert err < 4e-2, f"||out - ref|| / ||ref|| = {err:.3g} over the stored e4m3 values"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(seen, torch.isfinite(lse)), "rows without keys differ"
    lse_err = (lse[seen].double() - ref_lse[seen]).abs()
    assert (lse_err < 2e-2 + 4e-3 * ref_lse[seen].abs()).all(), f"lse off by {lse_err.max().item():.3g}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [1, 4, 100])
@pytest.mark.parametrize("layout", [None, 16, 64, 128], ids=lambda x: "contiguous" if x is None else f"paged{x}")
@pytest.mark.parametrize("d", list(VARLEN_HEADDIMS))
def test_matches_reference(d: int, layout: int | None, seqlen_q: int, causal: bool) -> None:
    i = [None, 16, 64, 128].index(layout) + VARLEN_HEADDIMS.index(d) + seqlen_q
    dtype = (torch.bfloat16, torch.float16)[i % 2]
    hq, hkv = ((32, 8), (8, 8), (8, 1))[i % 3]
    seed = (None, 1234)[i % 2]
    require_fp8_kvcache(dtype, d, seqlen_q, causal)
    torch.manual_seed(i)
    batch = 6
    lengths = lengths_for(batch, CAPACITY, layout or 64, rng=random.Random(i))
    kc, vc, table, _, _ = poisoned_cache(batch, hkv, d, dtype, lengths, layout, seed=i)
    k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, vc, seed)
    assert not torch.isfinite(k8.float()).all(), "the poison did not reach the cache"
    q = torch.randn(batch, seqlen_q, hq, d, dtype=dtype, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, causal=causal,
                                       return_lse=True, k_cache_scale=ks, v_cache_scale=vs, hadamard_seed=seed)
    check_against_stored(out, lse, q, k8, v8, ks, vs, lengths, causal, table, seed)
    # and against the original 16-bit values: fp8's error (3 mantissa bits), not more
    ref, _ = attention_kvcache_ref(q.double(), kc.double(), vc.double(), lens, table, causal=causal,
                                   dtype=torch.float64)
    err = rel_err(out, ref)
    assert err < 0.1, f"||out - ref|| / ||ref|| = {err:.3g} over the original values"


@pytest.mark.parametrize("num_splits", [1, 2, 5, 0])
@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "paged16"])
def test_splits(num_splits: int, layout: int | None) -> None:
    require_fp8_kvcache(torch.bfloat16, 128, 1, True)
    torch.manual_seed(num_splits)
    lengths = [1000, 0, 17, 1024]
    kc, vc, table, _, _ = poisoned_cache(4, 8, 128, torch.bfloat16, lengths, layout, seed=num_splits)
    k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, vc, 7)
    q = torch.randn(4, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, num_splits=num_splits,
                                       return_lse=True, k_cache_scale=ks, v_cache_scale=vs, hadamard_seed=7)
    check_against_stored(out, lse, q, k8, v8, ks, vs, lengths, True, table, 7)


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize(("seqlen_q", "layout"), [(1, 16), (4, None), (100, 128)])
def test_sinks(seqlen_q: int, layout: int | None, num_splits: int) -> None:
    """Sink logits over an e4m3 cache: per query head (GQA-packed rows included), once per row with splits, the sink
    as the lse of rows without keys."""
    require_fp8_kvcache(torch.bfloat16, 128, seqlen_q, True)
    torch.manual_seed(seqlen_q + num_splits)
    lengths = [1000, 0, 17, 1024]
    kc, vc, table, _, _ = poisoned_cache(4, 8, 128, torch.bfloat16, lengths, layout, seed=num_splits + 3)
    k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, vc, 7)
    q = torch.randn(4, seqlen_q, 32, 128, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    sinks = torch.linspace(-2.0, 6.0, 32, device="cuda")[torch.randperm(32, device="cuda")]
    out, lse = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, num_splits=num_splits,
                                       return_lse=True, k_cache_scale=ks, v_cache_scale=vs, hadamard_seed=7,
                                       sinks=sinks)
    check_against_stored(out, lse, q, k8, v8, ks, vs, lengths, True, table, 7, sinks)
    # an entry without keys: lse is the sink (to float rounding: the kernels take it through exp2 units and back)
    torch.testing.assert_close(lse[1], sinks[:, None].expand(32, seqlen_q), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize(("window", "seqlen_q", "layout"), [((127, 0), 1, 16), ((255, 0), 4, None), ((60, 0), 100, 128)])
def test_window(window: tuple[int, int], seqlen_q: int, layout: int | None, num_splits: int) -> None:
    """Sliding windows over an e4m3 cache (with sinks): per entry, GQA-packed rows, splits over the window's blocks."""
    require_fp8_kvcache(torch.bfloat16, 128, seqlen_q, True, window)
    torch.manual_seed(seqlen_q + num_splits)
    lengths = [1000, 0, 17, 1024, window[0] + seqlen_q]
    kc, vc, table, _, _ = poisoned_cache(len(lengths), 8, 128, torch.bfloat16, lengths, layout, seed=num_splits + 5)
    k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, vc, 7)
    q = torch.randn(len(lengths), seqlen_q, 32, 128, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    sinks = torch.linspace(-2.0, 6.0, 32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, num_splits=num_splits,
                                       window_size=window, return_lse=True, k_cache_scale=ks, v_cache_scale=vs,
                                       hadamard_seed=7, sinks=sinks)
    check_against_stored(out, lse, q, k8, v8, ks, vs, lengths, True, table, 7, sinks, window)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("window", "seqlen_q", "layout"), [(None, 1, 16), ((255, 0), 4, None)])
def test_softcap(window: tuple[int, int] | None, seqlen_q: int, layout: int | None, num_splits: int) -> None:
    """Softcap over an e4m3 cache, with a window and sinks."""
    require_fp8_kvcache(torch.bfloat16, 128, seqlen_q, True, window, 5.0)
    torch.manual_seed(seqlen_q + num_splits)
    lengths = [1000, 0, 17, 1024]
    kc, vc, table, _, _ = poisoned_cache(len(lengths), 8, 128, torch.bfloat16, lengths, layout, seed=num_splits + 9)
    k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, vc, 7)
    q = torch.randn(len(lengths), seqlen_q, 32, 128, dtype=torch.bfloat16, device="cuda") * 3
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    sinks = torch.linspace(-2.0, 6.0, 32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, num_splits=num_splits,
                                       window_size=window or (-1, -1), softcap=5.0, return_lse=True, k_cache_scale=ks,
                                       v_cache_scale=vs, hadamard_seed=7, sinks=sinks)
    check_against_stored(out, lse, q, k8, v8, ks, vs, lengths, True, table, 7, sinks, window, 5.0)


@pytest.mark.parametrize("seqlen_new", [1, 16])
@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("d", list(VARLEN_HEADDIMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("strided", [False, True], ids=["kernel", "torch-ops"])
def test_append(seqlen_new: int, layout: int | None, d: int, dtype: torch.dtype, strided: bool) -> None:
    """New rows land quantized (bytes and scales as quantize_rows gives them) at each entry's positions, across page
    boundaries, and the attention sees them: through the append kernel, and through the torch ops where the kernel
    does not take the layout (k / v rows not 16-byte aligned)."""
    require_fp8_kvcache(dtype, d, 1, True)
    if strided and (seqlen_new != 1 or d != 64):
        pytest.skip("the torch-ops path: one shape is enough")
    torch.manual_seed(seqlen_new + d)
    batch, hkv, seed = 5, 2, 99
    lengths = lengths_for(batch, CAPACITY, 16, seqlen_new, random.Random(seqlen_new))
    kc, vc, table, _, _ = poisoned_cache(batch, hkv, d, dtype, lengths, layout)
    k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, vc, seed)
    def misaligned(x: torch.Tensor) -> torch.Tensor:  # rows 2 bytes past a 16-byte boundary: the kernel refuses them
        return torch.cat([torch.zeros_like(x[..., :1]), x], dim=-1)[..., 1:] if strided else x

    def check_rows(k: torch.Tensor, v: torch.Tensor) -> None:
        kq, kqs = kvcache_fp8.quantize_rows(k, seed)
        vq, vqs = kvcache_fp8.quantize_rows(v, None)
        for b, n in enumerate(lengths):
            got_k = kvcache_entry(k8, b, n + seqlen_new, table)[n:]
            got_v = kvcache_entry(v8, b, n + seqlen_new, table)[n:]
            got_ks = kvcache_entry(ks.transpose(1, 2), b, n + seqlen_new, table)[n:]
            got_vs = kvcache_entry(vs.transpose(1, 2), b, n + seqlen_new, table)[n:]
            assert torch.equal(got_k.view(torch.uint8), kq[b].view(torch.uint8)) and torch.equal(got_ks, kqs[b])
            assert torch.equal(got_v.view(torch.uint8), vq[b].view(torch.uint8)) and torch.equal(got_vs, vqs[b])

    k = misaligned(torch.randn(batch, seqlen_new, hkv, d, dtype=dtype, device="cuda"))
    v = misaligned(torch.randn_like(k))
    q = torch.randn(batch, 1, 8, d, dtype=dtype, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    takes = _append_fp8_kernel_takes(k8, v8, ks, vs, k, v, lens, table, None)
    assert takes == (not strided), "the test does not exercise the path it names"
    out, lse = flash_attn_with_kvcache(q, k8, v8, k, v, cache_seqlens=lens, page_table=table, return_lse=True,
                                       k_cache_scale=ks, v_cache_scale=vs, hadamard_seed=seed)
    check_rows(k, v)
    check_against_stored(out, lse, q, k8, v8, ks, vs, [n + seqlen_new for n in lengths], True, table, seed)
    # The same slots again (bytes only): outliers in one channel (what the transform is for), rows 1e-3 to 1e2 in
    # magnitude, a zero row.
    mag = torch.logspace(-3, 2, batch * seqlen_new, device="cuda").view(batch, seqlen_new, 1, 1)
    k = torch.randn(batch, seqlen_new, hkv, d, device="cuda") * mag
    k[..., 3] *= 30
    k[0, 0, 0] = 0
    k, v = misaligned(k.to(dtype)), misaligned((torch.randn(k.shape, device="cuda") * mag).to(dtype))
    append_kvcache(k8, v8, k, v, lens, table, k_cache_scale=ks, v_cache_scale=vs, hadamard_seed=seed)
    check_rows(k, v)


def test_cuda_graph_decode_step() -> None:
    """Append one token and attend, captured once; replays with new lengths and page tables equal eager calls."""
    require_fp8_kvcache(torch.bfloat16, 128, 1, True)
    torch.manual_seed(3)
    batch, seed = 4, 5
    lengths = [10, 500, 0, 1000]
    kc, vc, table, _, _ = poisoned_cache(batch, 8, 128, torch.bfloat16, lengths, 16, spare_pages=64)
    kc = torch.where(torch.isfinite(kc), kc, torch.randn_like(kc))
    vc = torch.where(torch.isfinite(vc), vc, torch.randn_like(vc))
    k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, vc, seed)
    q = torch.randn(batch, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return flash_attn_with_kvcache(q, k8, v8, k, v, cache_seqlens=lens, page_table=table, return_lse=True,
                                       k_cache_scale=ks, v_cache_scale=vs, hadamard_seed=seed)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    rng = random.Random(3)
    for _ in range(3):
        new = [rng.randint(0, CAPACITY - 1) for _ in range(batch)]
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        table.copy_(torch.randperm(k8.shape[0], device="cuda")[:table.numel()].view_as(table).to(torch.int32))
        k.normal_()
        v.normal_()
        graph.replay()
        got = (out.clone(), lse.clone())
        eager = step()
        assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1]), f"replay differs for lengths {new}"
        check_against_stored(got[0], got[1], q, k8, v8, ks, vs, [n + 1 for n in new], True, table, seed)


def test_compile_fullgraph() -> None:
    require_fp8_kvcache(torch.bfloat16, 128, 1, True)
    kc = torch.randn(8, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
    k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, torch.randn_like(kc), 1)
    table = torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4)
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(2, 1, 2, 128, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor([5, 40], dtype=torch.int32, device="cuda")

    def f(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return flash_attn_with_kvcache(q, k8, v8, k, k, cache_seqlens=lens, page_table=table, k_cache_scale=ks,
                                       v_cache_scale=vs, hadamard_seed=1)

    eager = f(q, k)
    compiled = torch.compile(f, fullgraph=True)(q, k)
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "paged16"])
def test_eager_fast_path_repeats(layout: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode loop over an e4m3 cache with appends: the repeats take the eager fast path (one plan kept) and give
    the full path's caches, scales, out and lse bit for bit (the full path forced by FLASHHOPPER_DEBUG_KVCACHE on a
    copy of the same loop), and attend as the reference over the stored values does."""
    from flashhopper import kvcache

    require_fp8_kvcache(torch.bfloat16, 128, 1, True)
    torch.manual_seed(23)
    batch, steps, seed = 3, 4, 5
    lengths = [5, 300, 0]
    kc, vc, table, _, _ = poisoned_cache(batch, 8, 128, torch.bfloat16, lengths, layout, seed=3)
    kc = torch.where(torch.isfinite(kc), kc, torch.randn_like(kc))
    vc = torch.where(torch.isfinite(vc), vc, torch.randn_like(vc))
    caches = [list(kvcache_fp8.quantize_kv_cache(kc, vc, seed)) for _ in range(2)]
    caches[1] = [x.clone() for x in caches[0]]
    inputs = [(torch.randn(batch, 1, 32, 128, dtype=torch.bfloat16, device="cuda"),
               torch.randn(batch, 1, 8, 128, dtype=torch.bfloat16, device="cuda"),
               torch.randn(batch, 1, 8, 128, dtype=torch.bfloat16, device="cuda")) for _ in range(steps)]
    results = []
    for run, full in enumerate((True, False)):
        if full:
            monkeypatch.setenv("FLASHHOPPER_DEBUG_KVCACHE", "1")
        else:
            monkeypatch.delenv("FLASHHOPPER_DEBUG_KVCACHE", raising=False)
        kvcache._PLANS.clear()
        k8, v8, ks, vs = caches[run]
        lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        outs = []
        for q, k, v in inputs:
            outs.append(flash_attn_with_kvcache(q, k8, v8, k, v, cache_seqlens=lens, page_table=table, return_lse=True,
                                                k_cache_scale=ks, v_cache_scale=vs, hadamard_seed=seed))
            lens += 1
        results.append(outs)
        if not full:
            assert len(kvcache._PLANS) == 1, "the repeats should have one plan"
    for a, b in zip(caches[0], caches[1]):
        assert torch.equal(a.view(torch.uint8) if a.dtype == kvcache_fp8.E4M3 else a,
                           b.view(torch.uint8) if b.dtype == kvcache_fp8.E4M3 else b), "the appends differ"
    for (o1, l1), (o2, l2) in zip(*results):
        assert torch.equal(o1, o2) and torch.equal(l1, l2), "fast path and full path differ"
    k8, v8, ks, vs = caches[1]
    now = [n + steps for n in lengths]
    q = inputs[-1][0]
    check_against_stored(results[1][-1][0], results[1][-1][1], q, k8, v8, ks, vs, now, True, table, seed)
