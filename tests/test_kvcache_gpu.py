"""The Hopper KV-cache kernel (flash_attn_with_kvcache) against per-entry exact attention on the GPU (skipped here).

Every case builds a logical cache per entry, with random lengths (0, 1, on a page boundary, full among them), and
lays it out contiguous or in pages of 16..256 rows scattered in random order. The poison is in the cache (every
slot at or past an entry's length, and every page no entry uses, holds NaN or inf) and in the outputs: the call
allocates them, so they come NaN-filled (helpers.nan_kvcache_outputs), and they must be finite
and match, entry by entry, exact attention over that entry's keys alone
with FA3's criterion (helpers.assert_matches_reference). Appends are checked bitwise against a manual write; a
decode step is captured in a CUDA graph and replayed with new lengths and page tables; torch.compile traces it.
"""
from __future__ import annotations

import random

import pytest
import torch
from helpers import assert_matches_reference, nan_kvcache_outputs  # noqa: F401  (a fixture)

from flashhopper import _device, _ext, append_kvcache, dispatch, flash_attn_func, flash_attn_with_kvcache
from flashhopper.kernel_key import VARLEN_HEADDIMS
from flashhopper.kvcache import CacheShapes, _kvcache_key, _kvcache_mask, resolve_backend
from flashhopper.reference import kvcache_entry

# The call allocates out and lse: NaN-filled for every test here (helpers.nan_kvcache_outputs).
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("nan_kvcache_outputs")]

DTYPES = [torch.bfloat16, torch.float16]
HEADS = [(32, 8), (8, 8), (8, 1)]  # GQA, MHA, MQA
LAYOUTS = [None, 16, 32, 64, 128, 256]  # None: a contiguous cache; else the page size
CAPACITY = 1024  # keys per entry: max_seqlen of a contiguous cache, pages x page size of a paged one


def require_kvcache(dtype: torch.dtype, headdim: int, seqlen_q: int, causal: bool,
                    window: tuple[int, int] | None = None, softcap: float = 0.0) -> None:
    """helpers.require_backend for the KV-cache kernel a call of this configuration runs (its key has kvcache
    set; one query row runs the non-causal kernel): skip where Hopper kernels cannot run or the build was not
    configured with it; FAIL when the build was configured with it and it is missing, or when the public
    function's dispatch refuses a kernel the build has."""
    index = torch.cuda.current_device()
    info = _device.device_info(index)
    if not dispatch.runs_on("sm90", info.capability):
        pytest.skip(f"the KV-cache kernels are Hopper (sm90) only; this is {info.name} (compute capability "
                    f"{info.capability[0]}.{info.capability[1]})")
    key = _kvcache_key(dtype, headdim, headdim, _kvcache_mask(seqlen_q, causal, window), "sm90", "on",
                       "softcap" if softcap else "none")
    if _ext.kernel("fwd", key) is None:
        if _ext.configured("fwd", key):
            pytest.fail(f"the build was configured with the fwd kernel {key.describe()}, but does not have it "
                        f"(kernels(): {len(_ext.compiled_kernels())} entries; build_info(): {_ext.build_info()})")
        build = _ext.build_info()
        if not build:
            pytest.skip(f"no compiled extension ({_ext.extension_error()})")
        reasons = [f"configure {option} with {value}" for option, have, value in (
            ("FLASHHOPPER_ARCHS", build["archs"], 90), ("FLASHHOPPER_MODES", build["modes"], "fwd"),
            ("FLASHHOPPER_DTYPES", build["dtypes"], key.short_dtype()), ("FLASHHOPPER_HDIMS", build["headdims"], headdim),
            ("FLASHHOPPER_MASKS", build["masks"], key.mask), ("FLASHHOPPER_KVCACHE", build.get("kvcache", ["off"]), "on"))
            if value not in have]
        pytest.skip(f"no fwd kernel {key.describe()}: {'; '.join(reasons) or f'not in this build {build}'}")
    q = torch.empty(1, seqlen_q, 1, headdim, dtype=dtype, device="cuda")
    shapes = CacheShapes(1, seqlen_q, 1, 1, headdim, headdim, False, 16, 1, 16, 0)
    try:
        resolve_backend(q, shapes, causal, None, "on", window, softcap)
    except ValueError as e:
        pytest.fail(f"dispatch refuses the KV-cache kernel {key.describe()}, which the build has: {e}")


def lengths_for(batch: int, capacity: int, page_size: int, seqlen_new: int = 0, rng: random.Random | None = None
                ) -> list[int]:
    """Entry lengths before an append of ``seqlen_new``: 0, 1, on a page boundary, full, then random."""
    rng = rng or random.Random(0)
    top = capacity - seqlen_new
    special = [0, 1, min(page_size, top), top, max(0, min(2 * page_size - 1, top))]
    return [special[i] if i < len(special) else rng.randint(0, top) for i in range(batch)]


def poisoned_cache(batch: int, hkv: int, d: int, dtype: torch.dtype, lengths: list[int], page_size: int | None,
                   capacity: int = CAPACITY, spare_pages: int = 5, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, page_table or None, the logical k and v (batch, capacity, hkv, d)): slots at or past an
    entry's length NaN in K and inf in V (or the other way round, every other entry); a paged cache's pages in
    random order, with ``spare_pages`` unused ones all NaN."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(batch, capacity, hkv, d, dtype=dtype, device="cuda", generator=g)
    v = torch.randn(batch, capacity, hkv, d, dtype=dtype, device="cuda", generator=g)
    for b, n in enumerate(lengths):
        k[b, n:], v[b, n:] = (float("nan"), float("inf")) if b % 2 == 0 else (float("inf"), float("nan"))
    if page_size is None:
        return k.clone(), v.clone(), None, k, v
    per = capacity // page_size
    num_pages = batch * per + spare_pages
    table = torch.randperm(num_pages, device="cuda", generator=g)[:batch * per].view(batch, per).to(torch.int32)
    kp = torch.full((num_pages, page_size, hkv, d), float("nan"), dtype=dtype, device="cuda")
    vp = torch.full_like(kp, float("nan"))
    kp[table.flatten().long()] = k.view(batch * per, page_size, hkv, d)
    vp[table.flatten().long()] = v.view(batch * per, page_size, hkv, d)
    return kp, vp, table, k, v


def check_entries(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, lengths: list[int], causal: bool, page_table: torch.Tensor | None = None,
                  cache_batch_idx: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                  window: tuple[int, int] | None = None, softcap: float = 0.0) -> None:
    """Out and lse finite (lse -inf only on rows without keys, the sink there with ``sinks``), and each entry with
    FA3's criterion against exact attention over its own first lengths[b] keys (gathered through the page table /
    cache_batch_idx)."""
    assert not torch.isnan(out).any() and torch.isfinite(out).all(), "out is not finite (a poisoned slot was read?)"
    assert not torch.isnan(lse).any() and not torch.isposinf(lse).any(), "lse has NaN or +inf"
    for b, n in enumerate(lengths):
        kb = kvcache_entry(k_cache, b, n, page_table, cache_batch_idx)
        vb = kvcache_entry(v_cache, b, n, page_table, cache_batch_idx)
        assert_matches_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], kb[None], vb[None], None, causal,
                                 sinks=sinks, window=window, softcap=softcap)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [1, 3, 200])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "contiguous" if x is None else f"paged{x}")
@pytest.mark.parametrize("d", list(VARLEN_HEADDIMS))
def test_matches_reference(d: int, layout: int | None, seqlen_q: int, causal: bool) -> None:
    i = LAYOUTS.index(layout) + VARLEN_HEADDIMS.index(d)
    dtype = DTYPES[i % 2]
    hq, hkv = HEADS[i % 3]
    require_kvcache(dtype, d, seqlen_q, causal)
    torch.manual_seed(i * 100 + seqlen_q)
    batch = 7
    lengths = lengths_for(batch, CAPACITY, layout or 64, rng=random.Random(i + seqlen_q))
    kc, vc, table, _, _ = poisoned_cache(batch, hkv, d, dtype, lengths, layout, seed=i)
    q = torch.randn(batch, seqlen_q, hq, d, dtype=dtype, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=causal,
                                       return_lse=True)
    assert out.shape == q.shape and lse.shape == (batch, hq, seqlen_q) and lse.dtype == torch.float32
    check_entries(out, lse, q, kc, vc, lengths, causal, table)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 13, 0])
@pytest.mark.parametrize(("seqlen_q", "layout"), [(1, 64), (1, None), (3, 16), (200, 128)])
def test_splits(num_splits: int, seqlen_q: int, layout: int | None) -> None:
    """Split-KV (each entry's keys over num_splits CTAs, merged): every count the reference's result, entries with
    fewer key blocks than splits (0 keys included) too; the heuristic (0) as well. 13: the combine loads splits in
    batches of 8 (common/combine_splits.h), one whole and one partial."""
    dtype, d, causal = torch.bfloat16, 128, True
    require_kvcache(dtype, d, seqlen_q, causal)
    torch.manual_seed(num_splits * 10 + seqlen_q)
    capacity = 4096
    lengths = [0, 1, 130, 4096, 2048, 3001]
    kc, vc, table, _, _ = poisoned_cache(len(lengths), 8, d, dtype, lengths, layout, capacity=capacity,
                                         seed=num_splits)
    q = torch.randn(len(lengths), seqlen_q, 32, d, dtype=dtype, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, num_splits=num_splits,
                                       return_lse=True)
    check_entries(out, lse, q, kc, vc, lengths, causal, table)
    one, one_lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, num_splits=1,
                                           return_lse=True)
    torch.testing.assert_close(out.float(), one.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, one_lse, atol=1e-3, rtol=1e-4)


def test_long_decode_splits() -> None:
    """Batch 1, 32 query / 8 kv heads, 100k keys in pages of 128: the heuristic splits (the case split-KV is for)."""
    require_kvcache(torch.bfloat16, 128, 1, True)
    torch.manual_seed(3)
    capacity = 128 * 1024
    lengths = [100_003]
    kc, vc, table, _, _ = poisoned_cache(1, 8, 128, torch.bfloat16, lengths, 128, capacity=capacity)
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    for num_splits in (0, 1):
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, num_splits=num_splits,
                                           return_lse=True)
        check_entries(out, lse, q, kc, vc, lengths, True, table)


@pytest.mark.parametrize("seqlen_new", range(1, 17))  # every append length of #22's 1..16 (page-crossing offsets)
@pytest.mark.parametrize("layout", [None, 16, 64], ids=lambda x: "contiguous" if x is None else f"paged{x}")
@pytest.mark.parametrize("seqlen_q", [1, 16])
def test_append(seqlen_new: int, layout: int | None, seqlen_q: int) -> None:
    """k/v written at cache_seqlens .. + seqlen_new - 1 (across page boundaries) before attending: the cache
    afterwards is bitwise a manual write, every other slot untouched, cache_seqlens unchanged, and the output is
    attention over cache_seqlens + seqlen_new keys."""
    dtype, d = torch.float16, 128
    require_kvcache(dtype, d, seqlen_q, True)
    torch.manual_seed(seqlen_new + (layout or 0))
    page = layout or 64
    lengths = [0, page - 1, page, 2 * page - seqlen_new // 2, CAPACITY - seqlen_new, 5]
    batch = len(lengths)
    kc, vc, table, _, _ = poisoned_cache(batch, 8, d, dtype, lengths, layout)
    k = torch.randn(batch, seqlen_new, 8, d, dtype=dtype, device="cuda")
    v = torch.randn(batch, seqlen_new, 8, d, dtype=dtype, device="cuda")
    q = torch.randn(batch, seqlen_q, 32, d, dtype=dtype, device="cuda")
    want_k, want_v = kc.clone(), vc.clone()
    for b, n in enumerate(lengths):
        for t in range(seqlen_new):
            pos = n + t
            if table is None:
                want_k[b, pos], want_v[b, pos] = k[b, t], v[b, t]
            else:
                p = int(table[b, pos // page])
                want_k[p, pos % page], want_v[p, pos % page] = k[b, t], v[b, t]
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, page_table=table, return_lse=True)
    assert torch.equal(kc.nan_to_num(), want_k.nan_to_num()) and torch.equal(vc.nan_to_num(), want_v.nan_to_num())
    assert torch.equal(torch.isnan(kc), torch.isnan(want_k)) and torch.equal(torch.isinf(vc), torch.isinf(want_v))
    assert lens.tolist() == lengths
    check_entries(out, lse, q, kc, vc, [n + seqlen_new for n in lengths], True, table)


@pytest.mark.parametrize("seqlen_new", [1, 16])
@pytest.mark.parametrize("layout", [None, 16], ids=lambda x: "contiguous" if x is None else f"paged{x}")
def test_append_kvcache(seqlen_new: int, layout: int | None) -> None:
    """append_kvcache (no attention: the append kernel on Hopper builds, torch index writes elsewhere) writes
    test_append's manual write bitwise, every other slot untouched, cache_seqlens unchanged; captured in a CUDA
    graph, a replay after cache_seqlens changed in place writes at the new positions."""
    dtype, d = torch.float16, 128
    torch.manual_seed(seqlen_new + (layout or 0))
    page = layout or 64
    lengths = [0, page - 1, page, 2 * page - seqlen_new // 2, CAPACITY - seqlen_new, 5]
    batch = len(lengths)
    kc, vc, table, _, _ = poisoned_cache(batch, 8, d, dtype, lengths, layout)
    k = torch.randn(batch, seqlen_new, 8, d, dtype=dtype, device="cuda")
    v = torch.randn(batch, seqlen_new, 8, d, dtype=dtype, device="cuda")
    want_k, want_v = kc.clone(), vc.clone()
    for b, n in enumerate(lengths):
        for t in range(seqlen_new):
            pos = n + t
            if table is None:
                want_k[b, pos], want_v[b, pos] = k[b, t], v[b, t]
            else:
                p = int(table[b, pos // page])
                want_k[p, pos % page], want_v[p, pos % page] = k[b, t], v[b, t]
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    append_kvcache(kc, vc, k, v, lens, table)
    assert torch.equal(kc.view(torch.int16), want_k.view(torch.int16))  # bitwise, NaN and inf slots included
    assert torch.equal(vc.view(torch.int16), want_v.view(torch.int16))
    assert lens.tolist() == lengths
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        append_kvcache(kc, vc, k, v, lens, table)
    lens.copy_(torch.tensor([n + seqlen_new for n in lengths[:-2]] + [0, 9], dtype=torch.int32))
    k.normal_()
    v.normal_()
    graph.replay()
    for b, n in enumerate(lens.tolist()):
        assert torch.equal(kvcache_entry(kc, b, n + seqlen_new, table)[n:], k[b]), "the replay missed K's positions"
        assert torch.equal(kvcache_entry(vc, b, n + seqlen_new, table)[n:], v[b]), "the replay missed V's positions"


def test_cache_batch_idx() -> None:
    dtype, d = torch.bfloat16, 64
    require_kvcache(dtype, d, 1, True)
    torch.manual_seed(5)
    rows_cache = 7
    lengths_all = [300, 0, 17, 1023, 512, 64, 1]
    kc, vc, _, _, _ = poisoned_cache(rows_cache, 2, d, dtype, lengths_all, None)
    rows = torch.tensor([6, 0, 3], dtype=torch.int32, device="cuda")
    lengths = [lengths_all[r] for r in rows.tolist()]
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    k = torch.randn(3, 1, 2, d, dtype=dtype, device="cuda")
    v = torch.randn(3, 1, 2, d, dtype=dtype, device="cuda")
    q = torch.randn(3, 1, 16, d, dtype=dtype, device="cuda")
    before = kc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, cache_batch_idx=rows, return_lse=True)
    for e, (r, n) in enumerate(zip(rows.tolist(), lengths)):
        assert torch.equal(kc[r, n], k[e, 0])
    untouched = [r for r in range(rows_cache) if r not in rows.tolist()]
    assert torch.equal(kc[untouched].nan_to_num(), before[untouched].nan_to_num())
    check_entries(out, lse, q, kc, vc, [n + 1 for n in lengths], True, cache_batch_idx=rows)


def test_uniform_and_full_lengths() -> None:
    """cache_seqlens as a Python int (one count for all, no device lengths) and None (the whole cache)."""
    dtype, d = torch.bfloat16, 128
    require_kvcache(dtype, d, 3, True)
    torch.manual_seed(7)
    q = torch.randn(4, 3, 16, d, dtype=dtype, device="cuda")
    kc, vc, _, _, _ = poisoned_cache(4, 4, d, dtype, [CAPACITY] * 4, None)
    out, lse = flash_attn_with_kvcache(q, kc, vc, return_lse=True)
    check_entries(out, lse, q, kc, vc, [CAPACITY] * 4, True)
    kc, vc, table, _, _ = poisoned_cache(4, 4, d, dtype, [333] * 4, 32)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=333, page_table=table, return_lse=True)
    check_entries(out, lse, q, kc, vc, [333] * 4, True, table)


def test_strided_q_decode() -> None:
    """q a slice of a fused projection (GQA packing reads it through its own head stride), a cache with a page
    stride of its own."""
    dtype, d = torch.bfloat16, 128
    require_kvcache(dtype, d, 1, True)
    torch.manual_seed(9)
    qkv = torch.randn(5, 1, 48, d, dtype=dtype, device="cuda")
    q = qkv[:, :, :32]
    buf = torch.randn(40, 64, 2, 8, d, dtype=dtype, device="cuda")
    kc, vc = buf[:, :, 0], buf[:, :, 1]  # (40 pages, 64 rows, 8 heads, d), page and row strides doubled
    lengths = [0, 64, 300, 1, 512]  # 8 pages of 64 rows per entry
    table = torch.randperm(40, device="cuda").view(5, 8).to(torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, return_lse=True)
    check_entries(out, lse, q, kc, vc, lengths, True, table)


def test_chunked_prefill_matches_dense() -> None:
    """2k new queries over a 6k cache (the first 4k cached, the chunk's own keys appended): the same as our dense
    causal kernel over the whole 6k, bottom-right aligned."""
    dtype, d = torch.bfloat16, 128
    require_kvcache(dtype, d, 2048, True)
    torch.manual_seed(11)
    total, cached = 6144, 4096
    k = torch.randn(1, total, 8, d, dtype=dtype, device="cuda")
    v = torch.randn(1, total, 8, d, dtype=dtype, device="cuda")
    q = torch.randn(1, total - cached, 32, d, dtype=dtype, device="cuda")
    kc = torch.full((1, 8192, 8, d), float("nan"), dtype=dtype, device="cuda")
    vc = torch.full_like(kc, float("inf"))
    kc[:, :cached], vc[:, :cached] = k[:, :cached], v[:, :cached]
    lens = torch.tensor([cached], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, k[:, cached:], v[:, cached:], cache_seqlens=lens, return_lse=True)
    assert_matches_reference(out, lse, q, k, v, None, True)
    try:
        dense = flash_attn_func(q, k, v, causal=True)
    except ValueError:  # no dense kernel in this build: the reference check above stands
        return
    torch.testing.assert_close(out.float(), dense.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "paged16"])
def test_cuda_graph_decode_step(layout: int | None) -> None:
    """A decode step (append one token, attend) captured once, replayed after cache_seqlens and the page table were
    changed in place: each replay equal to an eager call on the same state."""
    dtype, d = torch.bfloat16, 128
    require_kvcache(dtype, d, 1, True)
    torch.manual_seed(13)
    batch = 4
    lengths = [10, 500, 0, 1000]
    kc, vc, table, _, _ = poisoned_cache(batch, 8, d, dtype, lengths, layout, spare_pages=64)
    # Replays move the lengths anywhere: every slot a plain value (nan_to_num would leave inf as bf16's max, whose
    # scores overflow the float32 softmax once visible).
    kc = torch.where(torch.isfinite(kc), kc, torch.randn_like(kc))
    vc = torch.where(torch.isfinite(vc), vc, torch.randn_like(vc))
    q = torch.randn(batch, 1, 32, d, dtype=dtype, device="cuda")
    k = torch.randn(batch, 1, 8, d, dtype=dtype, device="cuda")
    v = torch.randn(batch, 1, 8, d, dtype=dtype, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, page_table=table, return_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    rng = random.Random(13)
    for _ in range(3):
        new = [rng.randint(0, CAPACITY - 1) for _ in range(batch)]
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        if table is not None:
            table.copy_(torch.randperm(kc.shape[0], device="cuda")[:table.numel()].view_as(table).to(torch.int32))
        k.normal_()
        v.normal_()
        graph.replay()
        got = (out.clone(), lse.clone())
        written = [kvcache_entry(kc, b, n + 1, table)[n].clone() for b, n in enumerate(new)]
        eager = step()  # appends the same token at the same place again: the same state
        assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1]), f"replay differs for lengths {new}"
        for b in range(batch):
            assert torch.equal(written[b], k[b, 0]), "the replay did not append at the new position"
        check_entries(got[0], got[1], q, kc, vc, [n + 1 for n in new], True, table)


def test_compile_fullgraph() -> None:
    dtype, d = torch.bfloat16, 64
    require_kvcache(dtype, d, 1, True)
    torch.manual_seed(17)
    lengths = [300, 1, 0, 77]
    kc, vc, table, _, _ = poisoned_cache(4, 2, d, dtype, lengths, 32)
    q = torch.randn(4, 1, 8, d, dtype=dtype, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")

    def f(q, kc, vc, lens, table):  # type: ignore[no-untyped-def]
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(q, kc, vc, lens, table), f(q, kc, vc, lens, table))


def test_public_call_and_no_grad() -> None:
    require_kvcache(torch.bfloat16, 128, 1, True)
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    kc = torch.randn(2, 64, 8, 128, dtype=torch.bfloat16, device="cuda")
    out = flash_attn_with_kvcache(q, kc, kc, cache_seqlens=10)
    assert out.shape == q.shape and not out.requires_grad


@pytest.mark.parametrize("layout", [None, 16], ids=["contiguous", "paged16"])
def test_eager_fast_path_repeats(layout: int | None) -> None:
    """A decode loop: the first call of a configuration takes the full path and keeps a plan; the repeats (the
    fast path: append kernel, prepared launch) write the cache and attend exactly as the full path does, with
    the lengths advancing between calls. A plan is kept for the configuration."""
    from flashhopper import kvcache

    dtype, d = torch.bfloat16, 128
    require_kvcache(dtype, d, 1, True)
    torch.manual_seed(19)
    batch, steps = 3, 4
    lengths = [5, 300, 0]
    kc, vc, table, _, _ = poisoned_cache(batch, 8, d, dtype, lengths, layout)
    kc = torch.where(torch.isfinite(kc), kc, torch.randn_like(kc))
    vc = torch.where(torch.isfinite(vc), vc, torch.randn_like(vc))
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    kvcache._PLANS.clear()
    for step in range(steps):
        q = torch.randn(batch, 1, 32, d, dtype=dtype, device="cuda")
        k = torch.randn(batch, 1, 8, d, dtype=dtype, device="cuda")
        v = torch.randn(batch, 1, 8, d, dtype=dtype, device="cuda")
        out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, page_table=table, return_lse=True)
        now = [n + step + 1 for n in lengths]
        for b in range(batch):
            assert torch.equal(kvcache_entry(kc, b, now[b], table)[now[b] - 1], k[b, 0]), "append missed"
            assert torch.equal(kvcache_entry(vc, b, now[b], table)[now[b] - 1], v[b, 0]), "append missed"
        check_entries(out, lse, q, kc, vc, now, True, table)
        lens += 1
    assert len(kvcache._PLANS) == 1, "the repeats should have one plan"


def require_sm80_kvcache(dtype: torch.dtype, headdim: int, seqlen_q: int, causal: bool,
                         window: tuple[int, int] | None = None, softcap: float = 0.0) -> None:
    """The Ampere fallback's KV-cache kernel (run on any sm_80+ GPU, Hopper included: its sm_90 code): skip where
    the build was not configured with it, fail where it was and the kernel is missing."""
    index = torch.cuda.current_device()
    if not dispatch.runs_on("sm80", _device.device_info(index).capability):
        pytest.skip("the sm80 kernels need compute capability 8.0 or newer")
    key = _kvcache_key(dtype, headdim, headdim, _kvcache_mask(seqlen_q, causal, window), "sm80", "on",
                       "softcap" if softcap else "none")
    if _ext.kernel("fwd", key) is None:
        if _ext.configured("fwd", key):
            pytest.fail(f"the build was configured with the fwd kernel {key.describe()}, but does not have it")
        pytest.skip(f"no fwd kernel {key.describe()} in this build (FLASHHOPPER_ARCHS with 80, FLASHHOPPER_KVCACHE on)")


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize(("d", "layout", "seqlen_q", "causal", "heads"), [
    (64, None, 1, True, (32, 8)), (128, 16, 1, True, (32, 8)), (128, 64, 5, True, (8, 2)),
    (256, 128, 200, False, (4, 4)), (128, None, 200, True, (8, 8))])
def test_sm80_fallback(d: int, layout: int | None, seqlen_q: int, causal: bool, heads: tuple[int, int],
                       num_splits: int) -> None:
    """The Ampere kernel (backend='sm80', on this GPU through its sm_90 code): paged and contiguous caches, GQA
    packing, split-KV, NaN / inf in every unused slot; FA3's criterion per entry."""
    dtype = torch.float16 if d == 64 else torch.bfloat16
    require_sm80_kvcache(dtype, d, seqlen_q, causal)
    torch.manual_seed(d + seqlen_q + num_splits)
    batch, (hq, hkv) = 5, heads
    lengths = lengths_for(batch, CAPACITY, layout or 64, rng=random.Random(d + seqlen_q))
    if seqlen_q > 1:
        lengths = [max(n, seqlen_q) for n in lengths]
    kc, vc, table, _, _ = poisoned_cache(batch, hkv, d, dtype, lengths, layout, seed=d)
    q = torch.randn(batch, seqlen_q, hq, d, dtype=dtype, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=causal,
                                       num_splits=num_splits, return_lse=True, backend="sm80")
    check_entries(out, lse, q, kc, vc, lengths, causal, table)


@pytest.mark.parametrize("num_splits", [1, 0])
@pytest.mark.parametrize(("seqlen_q", "heads", "layout"), [
    (2, (32, 8), None), (4, (32, 8), 16), (8, (16, 2), 64), (16, (32, 8), None), (5, (8, 1), 128)])
def test_packed_speculative_tokens(seqlen_q: int, heads: tuple[int, int], layout: int | None, num_splits: int) -> None:
    """Several query tokens with GQA (speculative decoding): the kv head's query heads run as packed rows (token
    s's heads rows s g .. s g + g - 1; the causal rule per token), out and lse permuted back; against the
    reference per entry, NaN in every unused slot, short entries (fewer keys than tokens) included."""
    dtype, d = torch.bfloat16, 128
    require_kvcache(dtype, d, seqlen_q, True)
    torch.manual_seed(seqlen_q * 10 + num_splits)
    batch, (hq, hkv) = 6, heads
    lengths = lengths_for(batch, CAPACITY, layout or 64, rng=random.Random(seqlen_q))
    kc, vc, table, _, _ = poisoned_cache(batch, hkv, d, dtype, lengths, layout, seed=seqlen_q)
    q = torch.randn(batch, seqlen_q, hq, d, dtype=dtype, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=True,
                                       num_splits=num_splits, return_lse=True)
    check_entries(out, lse, q, kc, vc, lengths, True, table)
    if _ext.kernel("fwd", _kvcache_key(dtype, d, d, "causal", "sm80")) is not None:
        out80, lse80 = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=True,
                                               num_splits=num_splits, return_lse=True, backend="sm80")
        check_entries(out80, lse80, q, kc, vc, lengths, True, table)


SINK_CASES = [(1, (32, 8), 16), (1, (8, 8), None), (1, (8, 1), 128), (3, (32, 8), 64), (200, (8, 2), 128)]


@pytest.mark.parametrize("backend", ["sm90", "sm80"])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize(("seqlen_q", "heads", "layout"), SINK_CASES)
def test_sinks(seqlen_q: int, heads: tuple[int, int], layout: int | None, num_splits: int, backend: str) -> None:
    """Sink logits (gpt-oss) over a KV cache: GQA-packed rows take their own query head's sink, a split call adds it
    once (in the combine), rows without keys get out = 0 and lse = the sink; FA3's criterion per entry against exact
    attention with the sinks. Each head's sink differs and is large enough to move the output (a sink taken from
    the wrong head, twice or not at all fails)."""
    dtype, d, causal = torch.bfloat16, 128, True
    (require_kvcache if backend == "sm90" else require_sm80_kvcache)(dtype, d, seqlen_q, causal)
    torch.manual_seed(seqlen_q * 10 + num_splits)
    hq, hkv = heads
    lengths = [0, 1, 130, 2048, 1000, 777]
    kc, vc, table, _, _ = poisoned_cache(len(lengths), hkv, d, dtype, lengths, layout, capacity=2048,
                                         seed=seqlen_q + num_splits)
    q = torch.randn(len(lengths), seqlen_q, hq, d, dtype=dtype, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    sinks = torch.linspace(-2.0, 6.0, hq, device="cuda")[torch.randperm(hq, device="cuda")]
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=causal,
                                       num_splits=num_splits, return_lse=True, sinks=sinks, backend=backend)
    check_entries(out, lse, q, kc, vc, lengths, causal, table, sinks=sinks)
    # an entry without keys: lse is the sink (to float rounding: the kernels take it through exp2 units and back)
    torch.testing.assert_close(lse[0], sinks[:, None].expand(hq, seqlen_q), rtol=1e-6, atol=1e-6)


WINDOW_CASES = [((127, 0), True, 1, (32, 8), 16), ((255, 0), True, 3, (32, 8), 64), ((100, 20), False, 200, (8, 2), 128),
                ((1000, 0), True, 1, (8, 8), None), ((0, 0), True, 5, (16, 2), 16)]


@pytest.mark.parametrize("backend", ["sm90", "sm80"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize(("window", "causal", "seqlen_q", "heads", "layout"), WINDOW_CASES)
def test_window(window: tuple[int, int], causal: bool, seqlen_q: int, heads: tuple[int, int], layout: int | None,
                num_splits: int, with_sinks: bool, backend: str) -> None:
    """Sliding windows over a KV cache (gpt-oss / Mistral decode): per entry, bottom-right aligned to its own keys;
    GQA-packed decode and speculative tokens, split-KV over the window's key blocks, with and without sinks; FA3's
    criterion per entry against exact attention with the window. Entries shorter than, as long as and far longer
    than the window; every unused slot poisoned."""
    dtype, d = torch.bfloat16, 128
    (require_kvcache if backend == "sm90" else require_sm80_kvcache)(dtype, d, seqlen_q, causal, window)
    torch.manual_seed(seqlen_q * 10 + num_splits + with_sinks)
    hq, hkv = heads
    lengths = [0, 1, 130, 2048, 1000, window[0] + seqlen_q, 777]
    kc, vc, table, _, _ = poisoned_cache(len(lengths), hkv, d, dtype, lengths, layout, capacity=2048, seed=num_splits)
    q = torch.randn(len(lengths), seqlen_q, hq, d, dtype=dtype, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    sinks = torch.linspace(-2.0, 6.0, hq, device="cuda") if with_sinks else None
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=causal,
                                       window_size=window, num_splits=num_splits, return_lse=True, sinks=sinks,
                                       backend=backend)
    check_entries(out, lse, q, kc, vc, lengths, causal, table, sinks=sinks, window=window)


@pytest.mark.parametrize("backend", ["sm90", "sm80"])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize(("window", "seqlen_q", "heads", "layout"), [
    (None, 1, (32, 8), 16), (None, 3, (32, 8), None), ((255, 0), 1, (8, 8), 128), ((100, 0), 200, (8, 2), 64)])
def test_softcap(window: tuple[int, int] | None, seqlen_q: int, heads: tuple[int, int], layout: int | None,
                 num_splits: int, backend: str) -> None:
    """Gemma 2's softcap over a KV cache (scores c tanh(s / c)), with windows and sinks: packed rows, splits; FA3's
    criterion per entry against exact attention with the cap."""
    dtype, d, causal, cap = torch.bfloat16, 128, True, 5.0
    (require_kvcache if backend == "sm90" else require_sm80_kvcache)(dtype, d, seqlen_q, causal, window, cap)
    torch.manual_seed(seqlen_q * 10 + num_splits)
    hq, hkv = heads
    lengths = [0, 1, 130, 2048, 1000, 777]
    kc, vc, table, _, _ = poisoned_cache(len(lengths), hkv, d, dtype, lengths, layout, capacity=2048, seed=num_splits)
    q = torch.randn(len(lengths), seqlen_q, hq, d, dtype=dtype, device="cuda") * 3  # scores the cap bends
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    sinks = torch.linspace(-2.0, 6.0, hq, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=causal,
                                       window_size=window or (-1, -1), softcap=cap, num_splits=num_splits,
                                       return_lse=True, sinks=sinks, backend=backend)
    check_entries(out, lse, q, kc, vc, lengths, causal, table, sinks=sinks, window=window, softcap=cap)


def test_sinks_fast_path_and_graph() -> None:
    """A decode loop with sinks: the repeats (eager fast path) equal the full path bit for bit, and a captured step
    replays with the sinks changed in place."""
    from flashhopper import kvcache

    dtype, d = torch.bfloat16, 128
    require_kvcache(dtype, d, 1, True)
    torch.manual_seed(23)
    lengths = [5, 300, 0, 1024]
    kc, vc, table, _, _ = poisoned_cache(len(lengths), 8, d, dtype, lengths, 16)
    q = torch.randn(len(lengths), 1, 32, d, dtype=dtype, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    sinks = torch.randn(32, device="cuda") + 2
    kvcache._PLANS.clear()
    first = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, return_lse=True, sinks=sinks)
    again = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, return_lse=True, sinks=sinks)
    assert len(kvcache._PLANS) == 1
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    check_entries(*again, q, kc, vc, lengths, True, table, sinks=sinks)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, sinks=sinks)  # warm-up
        with torch.cuda.graph(graph, stream=stream):
            out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, return_lse=True,
                                               sinks=sinks)
    torch.cuda.current_stream().wait_stream(stream)
    sinks.copy_(torch.randn(32, device="cuda") - 1)
    graph.replay()
    torch.cuda.synchronize()
    check_entries(out, lse, q, kc, vc, lengths, True, table, sinks=sinks)


def test_debug_checks_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASHHOPPER_DEBUG_KVCACHE=1 checks the lengths on the host on every call, repeats of a configuration too
    (they never take the eager fast path): an append past the capacity raises instead of writing elsewhere."""
    dtype, d = torch.bfloat16, 128
    require_kvcache(dtype, d, 1, True)
    monkeypatch.setenv("FLASHHOPPER_DEBUG_KVCACHE", "1")
    kc = torch.zeros(2, 64, 8, d, dtype=dtype, device="cuda")
    vc = torch.zeros_like(kc)
    q = torch.randn(2, 1, 32, d, dtype=dtype, device="cuda")
    k = torch.randn(2, 1, 8, d, dtype=dtype, device="cuda")
    lens = torch.tensor([10, 20], dtype=torch.int32, device="cuda")
    for _ in range(2):
        flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=lens)
    lens.fill_(64)  # full: the append would write past the capacity
    with pytest.raises(ValueError):
        flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=lens)
