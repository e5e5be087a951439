"""flash_attn_with_kvcache on the CPU: the reference against a brute-force computation, paged and contiguous caches
alike, the append's writes (and append_kvcache's, the append alone), cache_batch_idx, the argument checks that run
before anything is written or launched, the split-KV heuristic, the ops under torch.compile, and the launch's params
with the extension replaced by a recorder (the kernels themselves: test_kvcache_gpu.py)."""
from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from flashhopper import _device, _ext, _launch, append_kvcache, attention_kvcache_ref, flash_attn_with_kvcache
from flashhopper.kernel_key import KernelKey, from_dict
from flashhopper.kvcache import (SPLIT_TILE_START_BLOCKS, CacheShapes, kernel_num_splits, num_splits_heuristic,
                                 resolve_backend)

F64 = torch.float64


# --- helpers ---

def brute_force(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float,
                causal: bool, sinks: torch.Tensor | None = None,
                window: tuple[int, int] | None = None, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention written out per (entry, head, row) in float64: entry b's keys[b] (L, nheads_kv, d); row i sees
    key j iff not causal or j <= i + L - seqlen_q, and with ``window`` (left, right) (-1 unbounded) iff
    i + L - seqlen_q - left <= j <= i + L - seqlen_q + right; a row that sees none: 0 and -inf. ``sinks``
    (nheads_q,): head h's denominator gets exp(sinks[h]) with no value, and its lse includes it (a row that sees no
    key: the sink). ``softcap`` c > 0: each score s becomes c tanh(s / c)."""
    b, sq, hq, _ = q.shape
    dv = values[0].shape[-1]
    out = torch.zeros(b, sq, hq, dv, dtype=F64)
    lse = torch.full((b, hq, sq), -math.inf, dtype=F64)
    for e in range(b):
        kk, vv = keys[e].double(), values[e].double()
        n = kk.shape[0]
        g = hq // kk.shape[1]
        for h in range(hq):
            sink = -math.inf if sinks is None else float(sinks[h])
            for i in range(sq):
                diag = i + n - sq
                last = n if not causal else min(n, diag + 1)
                first = 0
                if window is not None:
                    if window[1] >= 0:
                        last = min(last, diag + window[1] + 1)
                    if window[0] >= 0:
                        first = max(0, diag - window[0])
                if last <= first:
                    lse[e, h, i] = sink
                    continue
                s = (kk[first:last, h // g] @ q[e, i, h].double()) * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                m = max(float(s.max()), sink)
                p = torch.exp(s - m)
                total = p.sum() + math.exp(sink - m)
                lse[e, h, i] = m + torch.log(total)
                out[e, i, h] = (p[:, None] * vv[first:last, h // g]).sum(0) / total
    return out, lse


def to_paged(cache: torch.Tensor, page_size: int, spare: int = 3,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous cache (batch, max_seqlen, h, d) scattered into pages of ``page_size`` rows in random order
    (``spare`` unused pages among them, NaN): (paged cache (num_pages, page_size, h, d), page_table int32)."""
    b, s, h, d = cache.shape
    assert s % page_size == 0
    per = s // page_size
    num_pages = b * per + spare
    perm = torch.randperm(num_pages, generator=generator)[:b * per].view(b, per).to(torch.int32)
    paged = torch.full((num_pages, page_size, h, d), float("nan"), dtype=cache.dtype)
    for e in range(b):
        for i in range(per):
            paged[perm[e, i]] = cache[e, i * page_size:(i + 1) * page_size]
    return paged, perm


def from_paged(paged: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """The contiguous view (batch, max_pages * page_size, h, d) of a paged cache."""
    return paged[page_table.long()].flatten(1, 2)


def poison_past(cache: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """A contiguous cache with NaN at every position at or past an entry's length."""
    cache = cache.clone()
    for e, n in enumerate(lengths):
        cache[e, n:] = float("nan")
    return cache


def make(batch: int, seqlen_q: int, max_seqlen: int, hq: int = 4, hkv: int = 2, d: int = 16, dv: int | None = None,
         dtype: torch.dtype = F64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(batch, seqlen_q, hq, d, dtype=dtype)
    kc = torch.randn(batch, max_seqlen, hkv, d, dtype=dtype)
    vc = torch.randn(batch, max_seqlen, hkv, d if dv is None else dv, dtype=dtype)
    return q, kc, vc


def i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# --- the reference ---

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 3, 7])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_reference_matches_brute_force(seqlen_q: int, causal: bool, hkv: int) -> None:
    lengths = [0, 1, 5, 16, 32]  # no key, fewer keys than query rows, a page boundary, a full cache
    q, kc, vc = make(len(lengths), seqlen_q, 32, hq=4, hkv=hkv, d=8, dv=12)
    kc, vc = poison_past(kc, lengths), poison_past(vc, lengths)
    out, lse = attention_kvcache_ref(q, kc, vc, i32(lengths), softmax_scale=0.4, causal=causal)
    want, want_lse = brute_force(q, [kc[e, :n] for e, n in enumerate(lengths)],
                                 [vc[e, :n] for e, n in enumerate(lengths)], 0.4, causal)
    assert out.shape == (5, seqlen_q, 4, 12) and lse.shape == (5, 4, seqlen_q)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()  # an entry without keys


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("hkv", [4, 1])
def test_sinks_match_brute_force(seqlen_q: int, causal: bool, hkv: int) -> None:
    """flash_attn_with_kvcache(sinks=...) on the CPU, paged: each query head's sink joins its rows' denominators (a
    large one dominates, a very negative one vanishes), and rows without keys get out = 0, lse = the sink."""
    lengths = [0, 1, 5, 32]
    q, kc, vc = make(len(lengths), seqlen_q, 32, hq=4, hkv=hkv, d=8)
    sinks = torch.tensor([0.5, -1.0, 6.0, -40.0], dtype=torch.float32)
    kc, vc = poison_past(kc, lengths), poison_past(vc, lengths)
    kp, table = to_paged(kc, 16, generator=torch.Generator().manual_seed(1))
    vp = torch.full_like(kp, float("nan"))
    for e in range(len(lengths)):
        for i in range(2):
            vp[table[e, i]] = vc[e, 16 * i:16 * (i + 1)]
    out, lse = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=i32(lengths), page_table=table, softmax_scale=0.4,
                                       causal=causal, return_lse=True, sinks=sinks)
    want, want_lse = brute_force(q, [kc[e, :n] for e, n in enumerate(lengths)],
                                 [vc[e, :n] for e, n in enumerate(lengths)], 0.4, causal, sinks)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse.float())  # (lse is float32 whatever the inputs)
    assert (out[0] == 0).all() and torch.equal(lse[0], sinks[:, None].expand(4, seqlen_q))
    plain, plain_lse = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=i32(lengths), page_table=table,
                                               softmax_scale=0.4, causal=causal, return_lse=True)
    assert not torch.allclose(out[1:], plain[1:])  # the sinks changed something
    torch.testing.assert_close(out[1:, :, 3], plain[1:, :, 3])  # exp(-40) is nothing next to a key


@pytest.mark.parametrize(("window", "causal"), [((4, 0), True), ((3, 2), False), ((0, 0), True), ((40, -1), False),
                                               ((-1, 3), False), ((6, 5), True)])
@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_window_matches_brute_force(window: tuple[int, int], causal: bool, seqlen_q: int, with_sinks: bool) -> None:
    """flash_attn_with_kvcache(window_size=...) on the CPU, paged, GQA: each entry's window bottom-right aligned to
    its own keys (causal: right edge 0), rows whose window holds no key get 0 (and the sink with sinks)."""
    lengths = [0, 1, 5, 9, 32]
    q, kc, vc = make(len(lengths), seqlen_q, 32, hq=4, hkv=2, d=8)
    sinks = torch.tensor([0.5, -1.0, 2.0, -3.0]) if with_sinks else None
    kc, vc = poison_past(kc, lengths), poison_past(vc, lengths)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(lengths), softmax_scale=0.4, causal=causal,
                                       window_size=window, return_lse=True, sinks=sinks)
    eff = (window[0], 0) if causal else window
    want, want_lse = brute_force(q, [kc[e, :n] for e, n in enumerate(lengths)],
                                 [vc[e, :n] for e, n in enumerate(lengths)], 0.4, causal, sinks, eff)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse.float())
    if window[0] >= 0 and window[0] + seqlen_q < 32:  # the window left keys out of the full entry
        full, _ = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(lengths), softmax_scale=0.4, causal=causal,
                                          return_lse=True, sinks=sinks)
        assert not torch.allclose(out[4], full[4])


@pytest.mark.parametrize(("softcap", "window", "with_sinks"), [(5.0, None, False), (0.5, None, True), (2.0, (6, 0), True)])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_softcap_matches_brute_force(softcap: float, window: tuple[int, int] | None, with_sinks: bool,
                                     seqlen_q: int) -> None:
    """flash_attn_with_kvcache(softcap=...) on the CPU (Gemma 2): each score s becomes c tanh(s / c) before the softmax,
    with windows and sinks as well."""
    lengths = [0, 1, 5, 32]
    q, kc, vc = make(len(lengths), seqlen_q, 32, hq=4, hkv=2, d=8)
    q = q * 3  # scores of a few units, so that a cap of 0.5-5 bends them
    sinks = torch.tensor([0.5, -1.0, 2.0, -3.0]) if with_sinks else None
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(lengths), softmax_scale=0.4, causal=True,
                                       window_size=window or (-1, -1), softcap=softcap, return_lse=True, sinks=sinks)
    want, want_lse = brute_force(q, [kc[e, :n] for e, n in enumerate(lengths)],
                                 [vc[e, :n] for e, n in enumerate(lengths)], 0.4, True, sinks, window, softcap)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse.float())
    plain = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(lengths), softmax_scale=0.4, causal=True,
                                    window_size=window or (-1, -1), sinks=sinks)
    assert not torch.allclose(out[3], plain[3])


def test_reference_paged_equals_contiguous() -> None:
    lengths = [17, 64, 0, 33]
    q, kc, vc = make(4, 2, 64)
    kp, table = to_paged(kc, 16)
    vp, _ = to_paged(vc, 16)
    # the same page table for both (to_paged draws its own): scatter v through the k table
    vp = torch.full_like(kp, float("nan"))
    for e in range(4):
        for i in range(4):
            vp[table[e, i]] = vc[e, 16 * i:16 * (i + 1)]
    a = attention_kvcache_ref(q, kc, vc, i32(lengths))
    b = attention_kvcache_ref(q, kp, vp, i32(lengths), page_table=table)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# --- the public function on the CPU ---

@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_paged_matches_contiguous(page_size: int, seqlen_q: int) -> None:
    gen = torch.Generator().manual_seed(page_size + seqlen_q)
    lengths = [0, 1, page_size, 2 * page_size - 1, 4 * page_size]  # empty, one key, page boundaries, full
    q, kc, vc = make(len(lengths), seqlen_q, 4 * page_size, hq=8, hkv=2)
    kc, vc = poison_past(kc, lengths), poison_past(vc, lengths)
    lens = i32(lengths)
    want, want_lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, return_lse=True)
    kp, table = to_paged(kc, page_size, generator=gen)
    vp = torch.full_like(kp, float("nan"))
    vp[table.flatten().long()] = vc.unflatten(1, (4, page_size)).flatten(0, 1)
    out, lse = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, page_table=table, return_lse=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    ref, ref_lse = brute_force(q, [kc[e, :n] for e, n in enumerate(lengths)],
                               [vc[e, :n] for e, n in enumerate(lengths)], 16 ** -0.5, True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse.float())
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any()


def test_int_and_none_cache_seqlens() -> None:
    q, kc, vc = make(3, 2, 24)
    full = flash_attn_with_kvcache(q, kc, vc)  # None: the whole cache
    torch.testing.assert_close(full, flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32([24] * 3)), rtol=0, atol=0)
    torch.testing.assert_close(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=9),
                               flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32([9] * 3)), rtol=0, atol=0)
    kp, table = to_paged(kc[:, :16], 16)
    vp = torch.full_like(kp, float("nan"))
    vp[table.flatten().long()] = vc[:, :16]
    torch.testing.assert_close(flash_attn_with_kvcache(q, kp, vp, cache_seqlens=16, page_table=table),
                               flash_attn_with_kvcache(q, kc, vc, cache_seqlens=16), rtol=0, atol=0)


def test_causal_default_is_true() -> None:
    q, kc, vc = make(2, 5, 8)
    lens = i32([8, 3])
    torch.testing.assert_close(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens),
                               flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True), rtol=0, atol=0)
    assert not torch.allclose(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens),
                              flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=False))


@pytest.mark.parametrize("seqlen_new", [1, 3, 16, 17])
@pytest.mark.parametrize("paged", [False, True])
def test_append_writes_then_attends(paged: bool, seqlen_new: int) -> None:
    page_size, max_seqlen = 16, 64
    lengths = [0, 15, 16, 30, max_seqlen - seqlen_new]  # appends that start and end on and across page boundaries
    b = len(lengths)
    q, kc, vc = make(b, 2, max_seqlen, hq=4, hkv=2)
    k = torch.randn(b, seqlen_new, 2, 16, dtype=F64)
    v = torch.randn(b, seqlen_new, 2, 16, dtype=F64)
    want_k, want_v = kc.clone(), vc.clone()
    for e, n in enumerate(lengths):
        want_k[e, n:n + seqlen_new], want_v[e, n:n + seqlen_new] = k[e], v[e]
    lens = i32(lengths)
    lens_before = lens.clone()
    if paged:
        kp, table = to_paged(kc, page_size)
        vp = torch.full_like(kp, float("nan"))
        vp[table.flatten().long()] = vc.unflatten(1, (4, page_size)).flatten(0, 1)
        spare = torch.ones(kp.shape[0], dtype=torch.bool)
        spare[table.flatten().long()] = False
        out, lse = flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=lens, page_table=table, return_lse=True)
        assert torch.equal(from_paged(kp, table), want_k) and torch.equal(from_paged(vp, table), want_v)
        assert torch.isnan(kp[spare]).all() and torch.isnan(vp[spare]).all()  # no other page written
    else:
        out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, return_lse=True)
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert torch.equal(lens, lens_before)  # cache_seqlens is the caller's to advance
    after = [n + seqlen_new for n in lengths]
    ref, ref_lse = brute_force(q, [want_k[e, :n] for e, n in enumerate(after)],
                               [want_v[e, :n] for e, n in enumerate(after)], 16 ** -0.5, True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse.float())


def test_append_with_int_cache_seqlens() -> None:
    q, kc, vc = make(2, 1, 40)
    k, v = torch.randn(2, 5, 2, 16, dtype=F64), torch.randn(2, 5, 2, 16, dtype=F64)
    kc2, vc2 = kc.clone(), vc.clone()
    a = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=7)
    b = flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=i32([7, 7]))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and torch.equal(kc[:, 7:12], k)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cache_batch_idx() -> None:
    q, _, _ = make(3, 2, 32)
    big_k, big_v = torch.randn(5, 32, 2, 16, dtype=F64), torch.randn(5, 32, 2, 16, dtype=F64)
    rows = i32([4, 0, 2])
    lens = i32([32, 5, 0])
    k, v = torch.randn(3, 2, 2, 16, dtype=F64), torch.randn(3, 2, 2, 16, dtype=F64)
    lens_small = i32([20, 5, 0])
    want_k, want_v = big_k.clone(), big_v.clone()
    for e, (r, n) in enumerate(zip(rows.tolist(), lens_small.tolist())):
        want_k[r, n:n + 2], want_v[r, n:n + 2] = k[e], v[e]
    out = flash_attn_with_kvcache(q, big_k, big_v, k, v, cache_seqlens=lens_small, cache_batch_idx=rows)
    assert torch.equal(big_k, want_k) and torch.equal(big_v, want_v)  # rows 1 and 3 untouched too
    dense = flash_attn_with_kvcache(q, want_k[rows.long()], want_v[rows.long()], cache_seqlens=lens_small + 2)
    torch.testing.assert_close(out, dense, rtol=0, atol=0)
    # and without an append, every row's length its own
    torch.testing.assert_close(flash_attn_with_kvcache(q, big_k, big_v, cache_seqlens=lens, cache_batch_idx=rows),
                               flash_attn_with_kvcache(q, big_k[rows.long()], big_v[rows.long()], cache_seqlens=lens),
                               rtol=0, atol=0)


def bits(x: torch.Tensor) -> torch.Tensor:
    """x's bytes: torch.equal on them compares bit for bit, NaN included."""
    return x.contiguous().view(torch.uint8)


@pytest.mark.parametrize("lens_kind", ["tensor", "int"])
@pytest.mark.parametrize("seqlen_new", [3, 17])
@pytest.mark.parametrize("paged", [False, True])
def test_append_kvcache_writes_what_the_attention_call_appends(paged: bool, seqlen_new: int, lens_kind: str) -> None:
    """append_kvcache on one clone of a cache, flash_attn_with_kvcache's append on another: the same bits, every
    slot (pages of 16, appends across page boundaries; K's spare pages NaN), cache_seqlens unchanged."""
    lengths = [14, 16, 30, 64 - seqlen_new] if lens_kind == "tensor" else [14] * 4
    q, kc, vc = make(len(lengths), 1, 64)
    k, v = _f64(len(lengths), seqlen_new, 2, 16), _f64(len(lengths), seqlen_new, 2, 16)
    table = None
    if paged:
        kc, table = to_paged(kc, 16, generator=torch.Generator().manual_seed(2))
        vc = torch.randn_like(kc)
    lens: torch.Tensor | int = i32(lengths) if lens_kind == "tensor" else lengths[0]
    mine, theirs = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    assert append_kvcache(*mine, k, v, lens, table) is None
    flash_attn_with_kvcache(q, *theirs, k, v, cache_seqlens=lens, page_table=table)
    for a, b in zip(mine, theirs):
        assert torch.equal(bits(a), bits(b))
    assert not torch.equal(bits(mine[0]), bits(kc))  # it wrote
    if isinstance(lens, torch.Tensor):
        assert lens.tolist() == lengths  # the caller advances the lengths


def test_append_kvcache_cache_batch_idx() -> None:
    big_k, big_v = _f64(5, 32, 2, 16), _f64(5, 32, 2, 16)
    q = _f64(3, 1, 4, 16)
    rows, lens = i32([4, 0, 2]), i32([20, 5, 0])
    k, v = _f64(3, 2, 2, 16), _f64(3, 2, 2, 16)
    mine, theirs = (big_k.clone(), big_v.clone()), (big_k.clone(), big_v.clone())
    append_kvcache(*mine, k, v, lens, cache_batch_idx=rows)
    flash_attn_with_kvcache(q, *theirs, k, v, cache_seqlens=lens, cache_batch_idx=rows)
    for a, b in zip(mine, theirs):
        assert torch.equal(bits(a), bits(b))
    assert torch.equal(mine[0][[1, 3]], big_k[[1, 3]]) and torch.equal(mine[0][4, 20:22], k[0])


def test_strided_inputs() -> None:
    """Any strides (a cache sliced from a larger buffer, q with heads interleaved) give what contiguous ones give."""
    lengths = i32([10, 3])
    buf_k, buf_v = torch.randn(2, 20, 6, 16, dtype=F64), torch.randn(2, 20, 6, 16, dtype=F64)
    kc, vc = buf_k[:, :, 1:3], buf_v[:, :, 3:5]
    q = torch.randn(2, 3, 8, 16, dtype=F64)[:, :, ::2]
    torch.testing.assert_close(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths),
                               flash_attn_with_kvcache(q.contiguous(), kc.contiguous(), vc.contiguous(),
                                                       cache_seqlens=lengths), rtol=0, atol=0)


def test_float32_and_half_inputs_on_the_reference() -> None:
    q, kc, vc = make(2, 3, 16, dtype=torch.float32)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32([16, 4]))
    assert out.dtype == torch.float32
    q, kc, vc = (x.bfloat16() for x in (q, kc, vc))
    assert flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32([16, 4])).dtype == torch.bfloat16


def test_no_gradient() -> None:
    q, kc, vc = make(2, 1, 8)
    q.requires_grad_()
    out, lse = flash_attn_with_kvcache(q, kc, vc, return_lse=True)
    assert not out.requires_grad and not lse.requires_grad and out.grad_fn is None


def test_empty_batch() -> None:
    q, kc, vc = make(0, 1, 8)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.zeros(0, dtype=torch.int32), return_lse=True)
    assert out.shape == (0, 1, 4, 16) and lse.shape == (0, 4, 1)


# --- argument checks ---

def base_args(paged: bool = False, append: bool = False) -> dict[str, Any]:
    q, kc, vc = make(2, 3, 32)
    args: dict[str, Any] = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=i32([4, 8]))
    if paged:
        args["k_cache"], args["page_table"] = to_paged(kc, 16)
        args["v_cache"] = args["k_cache"].clone()
    if append:
        args["k"], args["v"] = torch.randn(2, 2, 2, 16, dtype=F64), torch.randn(2, 2, 2, 16, dtype=F64)
    return args


def _f64(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64)


BAD = [
    # (overrides, paged, append, error, message)
    (dict(q=[1.0]), False, False, TypeError, "q must be a torch.Tensor"),
    (dict(q=_f64(2, 4, 16)), False, False, ValueError, "q must have 4 dimensions"),
    (dict(k_cache=_f64(2, 32, 16)), False, False, ValueError, "k_cache must have 4 dimensions"),
    (dict(q=torch.zeros(2, 3, 4, 16, dtype=torch.int32)), False, False, TypeError, "q has dtype torch.int32"),
    (dict(k_cache=torch.randn(2, 32, 2, 16)), False, False, TypeError, "k_cache has dtype torch.float32 but q"),
    (dict(v_cache=torch.randn(2, 32, 2, 16)), False, False, TypeError, "v_cache has dtype torch.float32 but q"),
    (dict(k_cache=torch.empty(2, 32, 2, 16, dtype=F64, device="meta")), False, False, ValueError,
     "k_cache is on meta"),
    (dict(k_cache=_f64(2, 32, 2, 8)), False, False, ValueError, "k_cache head dim 8 does not match q head dim 16"),
    (dict(v_cache=_f64(2, 31, 2, 16)), False, False, ValueError, "v_cache shape"),
    (dict(k_cache=_f64(2, 32, 3, 16), v_cache=_f64(2, 32, 3, 16)), False, False, ValueError,
     "q nheads 4 must be a multiple of the caches' nheads 3"),
    (dict(k_cache=_f64(3, 32, 2, 16), v_cache=_f64(3, 32, 2, 16)), False, False, ValueError,
     "k_cache batch size 3 does not match q batch size 2"),
    (dict(cache_seqlens=torch.tensor([4, 8])), False, False, TypeError, "cache_seqlens has dtype torch.int64"),
    (dict(cache_seqlens=i32([4])), False, False, ValueError, r"cache_seqlens must have shape \(2,\)"),
    (dict(cache_seqlens=i32([[4, 8]])), False, False, ValueError, r"cache_seqlens must have shape \(2,\)"),
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int32, device="meta")), False, False, ValueError,
     "cache_seqlens is on meta"),
    (dict(cache_seqlens=4.0), False, False, TypeError, "cache_seqlens must be an int32 tensor"),
    (dict(cache_seqlens=True), False, False, TypeError, "cache_seqlens must be an int32 tensor"),
    (dict(cache_seqlens=33), False, False, ValueError, "cache_seqlens = 33 with 0 new tokens does not fit"),
    (dict(cache_seqlens=-1), False, False, ValueError, "cache_seqlens = -1"),
    (dict(cache_seqlens=31), False, True, ValueError, "cache_seqlens = 31 with 2 new tokens does not fit"),
    (dict(cache_seqlens=i32([31, 0])), False, True, ValueError, r"cache_seqlens \(entry, value\) \[\(0, 31\)\]"),
    (dict(cache_seqlens=i32([-1, 0])), False, False, ValueError, r"cache_seqlens \(entry, value\) \[\(0, -1\)\]"),
    (dict(page_table=torch.zeros(2, 2, dtype=torch.int64)), True, False, TypeError, "page_table has dtype torch.int64"),
    (dict(page_table=i32([0, 1])), True, False, ValueError, r"page_table must have shape \(2, max_pages_per_seq\)"),
    (dict(page_table=torch.zeros(3, 2, dtype=torch.int32)), True, False, ValueError,
     r"page_table must have shape \(2, max_pages_per_seq\)"),
    (dict(page_table=torch.zeros(2, 0, dtype=torch.int32)), True, False, ValueError, "max_pages_per_seq >= 1"),
    (dict(page_table=torch.zeros(2, 2, dtype=torch.int32, device="meta")), True, False, ValueError,
     "page_table is on meta"),
    (dict(page_table=i32([[0, 1], [2, 99]]), cache_seqlens=i32([4, 17])), True, False, ValueError,
     r"page_table\[1\] names pages \[99\]"),
    (dict(page_table=i32([[0, -1], [2, 3]]), cache_seqlens=i32([16, 0])), True, True, ValueError,
     r"page_table\[0\] names pages \[-1\]"),  # the append's pages
    (dict(page_table=i32([[0, -1], [2, 99]])), True, False, None, "pages past the keys are never read"),
    (dict(k_cache=_f64(8, 24, 2, 16), v_cache=_f64(8, 24, 2, 16), page_table=i32([[0, 1], [2, 3]])), True, False,
     ValueError, "k_cache page size 24 .* must be a positive multiple of 16"),
    (dict(cache_seqlens=None), True, False, ValueError, "cache_seqlens is required with page_table"),
    (dict(cache_batch_idx=i32([0, 1])), True, False, ValueError, "cache_batch_idx selects rows of a contiguous cache"),
    (dict(cache_batch_idx=torch.tensor([0, 1])), False, False, TypeError, "cache_batch_idx has dtype torch.int64"),
    (dict(cache_batch_idx=i32([0])), False, False, ValueError, r"cache_batch_idx must have shape \(2,\)"),
    (dict(cache_batch_idx=i32([0, 2])), False, False, ValueError, r"cache_batch_idx \(entry, row\) \[\(1, 2\)\]"),
    (dict(k=_f64(2, 2, 2, 16)), False, False, ValueError, "k and v are appended together"),
    (dict(v=_f64(2, 2, 2, 16)), False, False, ValueError, "k and v are appended together"),
    (dict(k=torch.randn(2, 2, 2, 16)), False, True, TypeError, "k has dtype torch.float32 but k_cache"),
    (dict(k=_f64(3, 2, 2, 16)), False, True, ValueError, r"k must have shape \(2, 2, 2, 16\)"),
    (dict(k=_f64(2, 2, 4, 16)), False, True, ValueError, r"k must have shape \(2, 2, 2, 16\)"),
    (dict(v=_f64(2, 2, 2, 8)), False, True, ValueError, r"v must have shape \(2, 2, 2, 16\)"),
    (dict(v=_f64(2, 3, 2, 16)), False, True, ValueError, r"v must have shape \(2, 2, 2, 16\)"),
    (dict(k=_f64(2, 2, 16)), False, True, ValueError, "k must have 4 dimensions"),
    (dict(k=_f64(2, 33, 2, 16), v=_f64(2, 33, 2, 16)), False, True, ValueError,
     "k has 33 new tokens per entry, more than an entry of the cache holds"),
    (dict(cache_seqlens=None), False, True, ValueError, "cache_seqlens is required when k and v are appended"),
    (dict(num_splits=-1), False, False, ValueError, "num_splits must be 0"),
    (dict(num_splits=257), False, False, ValueError, "num_splits must be 0"),
    (dict(num_splits=1.5), False, False, TypeError, "num_splits must be an int"),
    (dict(num_splits=True), False, False, TypeError, "num_splits must be an int"),
    (dict(softmax_scale=-1.0), False, False, ValueError, "softmax_scale must be a positive finite float"),
    (dict(causal="yes"), False, False, TypeError, "causal must be a bool"),
    (dict(return_lse=1), False, False, TypeError, "return_lse must be a bool"),
    (dict(backend="cuda"), False, False, ValueError, "backend must be one of"),
    (dict(backend="sm90"), False, False, ValueError, "backend='sm90' needs CUDA tensors"),
    (dict(backend="sm80"), False, False, ValueError, "backend='sm80' needs CUDA tensors"),
    (dict(window_size=(16, 0)), False, False, None, "windows run (the reference on the CPU)"),
    (dict(window_size=(-2, 0)), False, False, ValueError, "window_size"),
    (dict(window_size=(16,)), False, False, TypeError, "window_size must be a pair"),
    (dict(softcap=30.0), False, False, None, "softcap runs (the reference on the CPU)"),
    (dict(softcap=-1.0), False, False, ValueError, "softcap must be 0 .off. or a positive finite float"),
    (dict(softcap="30"), False, False, TypeError, "softcap must be a float"),
    (dict(sinks=torch.zeros(4)), False, False, None, "float32 sinks, one per query head"),
    (dict(sinks=torch.zeros(4, dtype=F64)), False, False, TypeError, "sinks has dtype torch.float64"),
    (dict(sinks=torch.zeros(2)), False, False, ValueError, r"sinks must have shape \(4,\) \(one logit per query head\)"),
    (dict(sinks=torch.zeros(4, device="meta")), False, False, ValueError, "sinks is on meta but q is on cpu"),
    (dict(sinks=[0.0] * 4), False, False, TypeError, "sinks must be a torch.Tensor"),
    (dict(rotary_cos=_f64(32, 8)), False, False, TypeError, "rotary_cos"),
    (dict(cache_leftpad=i32([0, 0])), False, False, TypeError, "cache_leftpad"),
]


@pytest.mark.parametrize("case", range(len(BAD)), ids=[m[:40] for *_, m in BAD])
def test_bad_inputs(case: int) -> None:
    bad, paged, append, err, match = BAD[case]
    args = base_args(paged, append)
    args.update(bad)
    kc, vc = args["k_cache"], args["v_cache"]
    before = [x.clone() for x in (kc, vc) if isinstance(x, torch.Tensor) and x.device.type == "cpu"]
    if err is None:  # a case that looks bad and is not
        flash_attn_with_kvcache(**args)
        return
    with pytest.raises(err, match=match):
        flash_attn_with_kvcache(**args)
    after = [x for x in (kc, vc) if isinstance(x, torch.Tensor) and x.device.type == "cpu"]
    for x, y in zip(before, after):  # a refused call writes nothing
        assert torch.equal(x.nan_to_num(), y.nan_to_num())


def test_good_base_args() -> None:
    for paged in (False, True):
        for append in (False, True):
            flash_attn_with_kvcache(**base_args(paged, append))


def append_args(paged: bool = False) -> dict[str, Any]:
    """append_kvcache's arguments: base_args' caches, lengths and page table, and its k / v."""
    args = base_args(paged, append=True)
    del args["q"]
    return args


APPEND_BAD = [
    # (overrides, paged, error, message): flash_attn_with_kvcache's checks, with k where q stood
    (dict(k=[1.0]), False, TypeError, "k must be a torch.Tensor"),
    (dict(k=None), False, TypeError, "k must be a torch.Tensor"),
    (dict(k=_f64(2, 2, 16)), False, ValueError, "k must have 4 dimensions"),
    (dict(k=torch.zeros(2, 2, 2, 16, dtype=torch.int32)), False, TypeError, "k has dtype torch.int32"),
    (dict(v=None), False, ValueError, "k and v are appended together"),
    (dict(k_cache=_f64(2, 32, 16)), False, ValueError, "k_cache must have 4 dimensions"),
    (dict(k_cache=torch.randn(2, 32, 2, 16)), False, TypeError, "k_cache has dtype torch.float32 but k"),
    (dict(v=torch.randn(2, 2, 2, 16)), False, TypeError, "v has dtype torch.float32 but v_cache"),
    (dict(k_cache=torch.empty(2, 32, 2, 16, dtype=F64, device="meta")), False, ValueError, "k_cache is on meta"),
    (dict(v=torch.empty(2, 2, 2, 16, dtype=F64, device="meta")), False, ValueError, "v is on meta but k is on cpu"),
    (dict(k_cache=_f64(2, 32, 2, 8)), False, ValueError, "k_cache head dim 8 does not match k head dim 16"),
    (dict(v_cache=_f64(2, 31, 2, 16)), False, ValueError, "v_cache shape"),
    (dict(k_cache=_f64(3, 32, 2, 16), v_cache=_f64(3, 32, 2, 16)), False, ValueError,
     "k_cache batch size 3 does not match k batch size 2"),
    (dict(k_cache=_f64(2, 32, 4, 16), v_cache=_f64(2, 32, 4, 16)), False, ValueError,
     r"k must have shape \(2, 2, 4, 16\)"),
    (dict(v=_f64(2, 3, 2, 16)), False, ValueError, r"v must have shape \(2, 2, 2, 16\)"),
    (dict(k=_f64(2, 33, 2, 16), v=_f64(2, 33, 2, 16)), False, ValueError, "k has 33 new tokens per entry"),
    (dict(cache_seqlens=None), False, ValueError, "cache_seqlens is required when k and v are appended"),
    (dict(cache_seqlens=torch.tensor([4, 8])), False, TypeError, "cache_seqlens has dtype torch.int64"),
    (dict(cache_seqlens=i32([4])), False, ValueError, r"cache_seqlens must have shape \(2,\)"),
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int32, device="meta")), False, ValueError,
     "cache_seqlens is on meta but k is on cpu"),
    (dict(cache_seqlens=4.0), False, TypeError, "cache_seqlens must be an int32 tensor"),
    (dict(cache_seqlens=True), False, TypeError, "cache_seqlens must be an int32 tensor"),
    (dict(cache_seqlens=31), False, ValueError, "cache_seqlens = 31 with 2 new tokens does not fit"),
    (dict(cache_seqlens=i32([31, 0])), False, ValueError, r"cache_seqlens \(entry, value\) \[\(0, 31\)\]"),
    (dict(page_table=torch.zeros(2, 2, dtype=torch.int64)), True, TypeError, "page_table has dtype torch.int64"),
    (dict(page_table=torch.zeros(3, 2, dtype=torch.int32)), True, ValueError,
     r"page_table must have shape \(2, max_pages_per_seq\)"),
    (dict(page_table=i32([[0, -1], [2, 3]]), cache_seqlens=i32([15, 0])), True, ValueError,
     r"page_table\[0\] names pages \[-1\]"),
    (dict(k_cache=_f64(8, 24, 2, 16), v_cache=_f64(8, 24, 2, 16), page_table=i32([[0, 1], [2, 3]])), True,
     ValueError, "k_cache page size 24 .* must be a positive multiple of 16"),
    (dict(cache_batch_idx=i32([0, 1])), True, ValueError, "cache_batch_idx selects rows of a contiguous cache"),
    (dict(cache_batch_idx=i32([0, 2])), False, ValueError, r"cache_batch_idx \(entry, row\) \[\(1, 2\)\]"),
    (dict(hadamard_seed=3), False, ValueError, "k_cache_scale, v_cache_scale and hadamard_seed are for e4m3 caches"),
    (dict(k_cache_scale=torch.ones(2, 2, 32)), False, ValueError, "are for e4m3 caches"),
]


@pytest.mark.parametrize("case", range(len(APPEND_BAD)), ids=[m[:40] for *_, m in APPEND_BAD])
def test_append_kvcache_bad_inputs(case: int) -> None:
    """Refused with flash_attn_with_kvcache's error before anything is written."""
    bad, paged, err, match = APPEND_BAD[case]
    args = append_args(paged)
    args.update(bad)
    kc, vc = args["k_cache"], args["v_cache"]
    before = [bits(x.clone()) for x in (kc, vc) if x.device.type == "cpu"]
    with pytest.raises(err, match=match):
        append_kvcache(**args)
    for x, y in zip(before, [bits(x) for x in (kc, vc) if x.device.type == "cpu"]):
        assert torch.equal(x, y)


def test_append_kvcache_good_args() -> None:
    for paged in (False, True):
        append_kvcache(**append_args(paged))


def test_no_kernel_for_cuda_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA inputs (fake here) get the Hopper kernel or an error that says what to rebuild with; never the
    reference; other GPUs, other dtypes and head dims are told so."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    monkeypatch.setattr(_ext, "kernel", lambda mode, key: None)
    shapes = CacheShapes(2, 1, 8, 2, 128, 128, True, 16, 10, 64, 0)
    with FakeTensorMode():
        q = torch.empty(2, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
        q32 = torch.empty(2, 1, 8, 128, dtype=torch.float32, device="cuda")
    monkeypatch.setattr(_device, "device_info", lambda index: _device.DeviceInfo("H100", (9, 0), 132))
    with pytest.raises(ValueError, match="this build has no sm90 forward kernel for bfloat16 headdim 128 non-causal "
                                         "reading a KV cache; rebuild with .*FLASHHOPPER_KVCACHE=off;on"):
        resolve_backend(q, shapes, True, None)
    with pytest.raises(ValueError, match="this build has no sm80 forward kernel for bfloat16 headdim 128 non-causal "
                                         "reading a KV cache"):
        resolve_backend(q, shapes, True, "sm80")
    assert resolve_backend(q, shapes, True, "reference") == "reference"
    with pytest.raises(TypeError, match="q has dtype torch.float32; the flashhopper kernels take"):
        resolve_backend(q32, shapes, True, None)
    with pytest.raises(ValueError, match="KV-cache kernels have head dims 64, 128, 256"):
        resolve_backend(q, shapes._replace(headdim=96, headdim_v=96), True, None)
    monkeypatch.setattr(_ext, "kernel", lambda mode, key: _ext.Entry(0, 64, 128) if key.kvcache != "off" else None)
    assert resolve_backend(q, shapes, True, None) == "sm90"
    monkeypatch.setattr(_device, "device_info", lambda index: _device.DeviceInfo("A100", (8, 0), 108))
    assert resolve_backend(q, shapes, True, None) == "sm80"  # the Ampere fallback
    with pytest.raises(ValueError, match="backend='sm90' does not run there"):
        resolve_backend(q, shapes, True, "sm90")
    monkeypatch.setattr(_device, "device_info", lambda index: _device.DeviceInfo("T4", (7, 5), 40))
    with pytest.raises(ValueError, match="KV-cache kernels are Hopper .* and Ampere-family"):
        resolve_backend(q, shapes, True, None)


# --- split-KV heuristic ---

@pytest.mark.parametrize(("tiles", "num_sms", "n_blocks", "want"), [
    (8, 132, 1024, 16),     # batch 1 x 8 kv heads (GQA-packed decode), 128k keys: 128 SMs, 64 blocks each
    (1024, 132, 32, 1),     # batch 128 x 8 kv heads: the SMs are full already
    (128 * 32, 132, 64, 1),
    (106, 132, 100, 1),     # >= 80% of the SMs
    (64, 132, 64, 2),       # batch 8 x 8, 8k keys
    (8, 132, 1, 1),         # one key block: nothing to split
    (0, 132, 100, 1),
    (1, 132, 3, 3),
    (1, 132, 1024, 128),    # one tile: the most splits the heuristic takes (8 blocks each)
    (64, 132, 16, 2),       # one wave of 8 + 2 blocks beats two of 4 + 2
])
def test_num_splits_heuristic(tiles: int, num_sms: int, n_blocks: int, want: int) -> None:
    assert num_splits_heuristic(tiles, num_sms, n_blocks) == want


def test_kernel_num_splits() -> None:
    # (num_splits, batch, heads, rows, seqlen_k, block_m, block_n, num_sms)
    assert kernel_num_splits(0, 1, 8, 4, 131072, 64, 128, 132) > 1
    assert kernel_num_splits(0, 128, 32, 1, 4096, 64, 128, 132) == 1
    assert kernel_num_splits(0, 128, 8, 4, 4096, 64, 128, 132) == 1
    assert kernel_num_splits(7, 1, 8, 4, 200, 64, 128, 132) == 2  # never more splits than key blocks
    assert kernel_num_splits(3, 1, 8, 4, 1000, 64, 128, 132) == 3
    assert kernel_num_splits(5, 1, 8, 4, 0, 64, 128, 132) == 1
    # the busiest SM's work, (tiles * s / SMs rounded up) x (blocks per split + a tile's start), is the least over
    # every split count, and no smaller count has as little
    for tiles in range(1, 106):
        for n_blocks in (2, 7, 64, 512, 1024):
            s = num_splits_heuristic(tiles, 132, n_blocks)
            work = [math.ceil(tiles * t / 132) * (math.ceil(n_blocks / t) + SPLIT_TILE_START_BLOCKS)
                    for t in range(1, min(128, n_blocks) + 1)]
            assert work[s - 1] == min(work) and min(work) not in work[:s - 1], (tiles, n_blocks, s)


# --- the ops ---

def test_fake_op_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(3, 1, 8, 64, dtype=torch.bfloat16)
        kc = torch.empty(10, 16, 2, 64, dtype=torch.bfloat16)
        vc = torch.empty(10, 16, 2, 32, dtype=torch.bfloat16)
        lens = torch.empty(3, dtype=torch.int32)
        table = torch.empty(3, 4, dtype=torch.int32)
        out, lse = torch.ops.flashhopper.kvcache_fwd(q, kc, vc, lens, 64, table, None, 0.1, True, 0, "sm90")
        torch.ops.flashhopper.kvcache_append(kc, vc, torch.empty(3, 2, 2, 64, dtype=torch.bfloat16),
                                             torch.empty(3, 2, 2, 32, dtype=torch.bfloat16), lens, 0, table, None)
        out_s, lse_s = torch.ops.flashhopper.kvcache_fwd(q, kc, vc, lens, 64, table, None, 0.1, True, 0, "sm90",
                                                         torch.empty(8))
    assert out.shape == (3, 1, 8, 32) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (3, 8, 1) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert out_s.shape == out.shape and lse_s.shape == lse.shape


def test_append_op_schema_mutates_the_caches() -> None:
    schema = torch.ops.flashhopper.kvcache_append.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["k_cache", "v_cache"]
    assert not any(a.alias_info for a in torch.ops.flashhopper.kvcache_fwd.default._schema.arguments)


@pytest.mark.parametrize("paged", [False, True])
def test_opcheck(paged: bool) -> None:
    args = base_args(paged, append=True)
    q, kc, vc, lens = args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"]
    table = args.get("page_table")
    kc, vc = kc.nan_to_num(), vc.nan_to_num()
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.flashhopper.kvcache_append.default,
                          (kc, vc, args["k"], args["v"], lens, 0, table, None), test_utils=utils)
    torch.library.opcheck(torch.ops.flashhopper.kvcache_fwd.default,
                          (q, kc, vc, lens + 2, 32, table, None, 0.25, True, 0, "reference"), test_utils=utils)
    torch.library.opcheck(torch.ops.flashhopper.kvcache_fwd.default,
                          (q, kc, vc, lens + 2, 32, table, None, 0.25, True, 0, "reference", torch.randn(4)),
                          test_utils=utils)


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile (dynamo) is not supported here")
@pytest.mark.parametrize("paged", [False, True])
def test_compile_fullgraph_decode_step(paged: bool) -> None:
    """A decode step (append one token, attend) traced whole: the same outputs and the same cache writes."""
    torch._dynamo.reset()
    args = base_args(paged)
    q = args["q"][:, :1]
    k, v = _f64(2, 1, 2, 16), _f64(2, 1, 2, 16)

    def step(q, kc, vc, k, v, lens, table):  # type: ignore[no-untyped-def]
        out, lse = flash_attn_with_kvcache(q * 2, kc, vc, k, v, cache_seqlens=lens, page_table=table,
                                           return_lse=True)
        return out + 1, lse

    caches = [(args["k_cache"].clone(), args["v_cache"].clone()) for _ in range(2)]
    eager = step(q, *caches[0], k, v, args["cache_seqlens"], args.get("page_table"))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, *caches[1], k, v, args["cache_seqlens"],
                                                                        args.get("page_table"))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(caches[0], caches[1]):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert not torch.equal(caches[1][0].nan_to_num(), args["k_cache"].nan_to_num())  # the append happened


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile (dynamo) is not supported here")
@pytest.mark.parametrize("paged", [False, True])
def test_compile_fullgraph_append_kvcache(paged: bool) -> None:
    """A prefill's K/V stored by append_kvcache inside a traced function: the same cache writes as eager."""
    torch._dynamo.reset()
    args = append_args(paged)

    def store(kc, vc, k, v, lens, table):  # type: ignore[no-untyped-def]
        append_kvcache(kc, vc, k * 2, v, lens, table)
        return lens + k.shape[1]

    caches = [(args["k_cache"].clone(), args["v_cache"].clone()) for _ in range(2)]
    rest = (args["k"], args["v"], args["cache_seqlens"], args.get("page_table"))
    eager = store(*caches[0], *rest)
    compiled = torch.compile(store, fullgraph=True, backend="aot_eager")(*caches[1], *rest)
    assert torch.equal(eager, compiled)
    for a, b in zip(caches[0], caches[1]):
        assert torch.equal(bits(a), bits(b))
    assert not torch.equal(bits(caches[1][0]), bits(args["k_cache"]))  # the append happened


# --- the launch, with the extension replaced by a recorder ---

class FakeC:
    """_C's API as the KV-cache launch uses it: kernels() with kvcache entries, kvcache_split_workspace_bytes,
    fwd_kvcache_with(params, index, stream, pointers...) recording the params with the pointers."""

    class FwdParams(SimpleNamespace):  # with _C.FwdParams' defaults of the fields the launch must leave alone
        def __init__(self) -> None:
            super().__init__(num_sms=0, rows_per_query=1, window_left=-1, window_right=-1, softcap=0.0, sinks_ptr=0, dropout_rng=0,
                             dropout_threshold=0, cu_seqlens_q=0, cu_seqlens_k=0, seqused_q=0, seqused_k=0,
                             varlen_workspace=0, q_scale_ptr=0, k_scale_ptr=0, v_scale_ptr=0, total_q=0, total_k=0,
                             tile_counter=0, max_smem_bytes=0)

    def __init__(self) -> None:
        self.table = []
        for dtype in ("bfloat16", "float16"):
            for hd in (64, 128):
                for mask in ("none", "causal", "window"):
                    for score_mod in ("none", "softcap"):
                        self.table.append({"mode": "fwd", "index": len(self.table), "arch": 90, "dtype": dtype,
                                           "headdim": hd, "headdim_v": hd, "mask": mask, "variant": "",
                                           "score_mod": score_mod, "dropout": False, "varlen": False,
                                           "kvcache": "on", "block_m": 64, "block_n": 128})
        self.calls: list[tuple[dict[str, Any], int, int]] = []
        self.workspace_queries: list[tuple[int, ...]] = []

    def kernels(self) -> list[dict[str, Any]]:
        return self.table

    def key_of(self, index: int) -> KernelKey:
        return from_dict(self.table[index])

    def kvcache_split_workspace_bytes(self, splits: int, batch: int, heads: int, rows: int, dv: int) -> int:
        self.workspace_queries.append((splits, batch, heads, rows, dv))
        return splits * batch * heads * rows * (dv + 1) * 4

    def fwd_kvcache_with(self, params: Any, index: int, stream: int, q: int, k: int, v: int, o: int, lse: int,
                         page_table: int, cache_seqlens: int, split_workspace: int, k_scale: int = 0,
                         v_scale: int = 0, sinks: int = 0) -> int:
        d = dict(vars(params))
        d.update(q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=o, lse_ptr=lse, page_table=page_table, cache_seqlens=cache_seqlens,
                 split_workspace=split_workspace, k_scale_ptr=k_scale, v_scale_ptr=v_scale, sinks_ptr=sinks)
        self.calls.append((d, index, stream))
        return 3


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeC]:
    c = FakeC()
    table = {("fwd", from_dict(k)): _ext.Entry(k["index"], k["block_m"], k["block_n"]) for k in c.kernels()}
    monkeypatch.setattr(_ext, "extension", lambda: c)
    monkeypatch.setattr(_ext, "kernel", lambda mode, key: table.get((mode, key)))
    monkeypatch.setattr(_launch, "_local", threading.local())
    monkeypatch.setattr(_device, "device_info", lambda index: _device.DeviceInfo("fake", (9, 0), 132))
    monkeypatch.setattr(_launch, "_raw_stream", lambda index: 4242)
    yield c


def kvcache_fwd(q, kc, vc, lens, seqlen_k, table=None, rows=None, causal=True, num_splits=1, sinks=None):  # type: ignore[no-untyped-def]
    return torch.ops.flashhopper.kvcache_fwd.default(q, kc, vc, lens, seqlen_k, table, rows, 0.125, causal,
                                                     num_splits, "sm90", sinks)


def test_launch_gqa_packed_decode(fake: FakeC) -> None:
    """One query token, 8 query heads over 2 kv heads: the kernel sees 2 heads of 4 rows (a kv head's query heads),
    q's and out's strides to match, the lse as (batch, nheads_kv, 4); the non-causal kernel even with causal."""
    p0 = _launch.params("FwdParams")  # left over from another path: must be reset
    p0.window_left, p0.cu_seqlens_q, p0.sinks_ptr, p0.dropout_threshold, p0.tile_counter = 7, 99, 98, 5, 97
    p0.varlen_workspace, p0.q_scale_ptr, p0.total_q = 96, 95, 11
    q = torch.randn(3, 1, 16, 64, dtype=torch.bfloat16)[:, :, ::2]  # head stride 128
    kc = torch.randn(3, 40, 2, 64, dtype=torch.bfloat16)
    vc = torch.randn(3, 40, 2, 64, dtype=torch.bfloat16)
    lens = i32([40, 0, 17])
    out, lse = kvcache_fwd(q, kc, vc, lens, 40)
    (p, index, stream), = fake.calls
    assert fake.key_of(index) == KernelKey(90, "bfloat16", 64, 64, "none", kvcache="on") and stream == 4242
    assert (p["batch"], p["seqlen_q"], p["nheads_q"], p["nheads_kv"], p["seqlen_k"]) == (3, 4, 2, 2, 40)
    assert (p["q_batch_stride"], p["q_row_stride"], p["q_head_stride"]) == (q.stride(0), 128, 4 * 128)
    assert out.shape == (3, 1, 8, 64) and out.is_contiguous() and lse.shape == (3, 8, 1) and lse.is_contiguous()
    assert (p["o_batch_stride"], p["o_row_stride"], p["o_head_stride"]) == (8 * 64, 64, 4 * 64)
    assert p["q_ptr"] == q.data_ptr() and p["o_ptr"] == out.data_ptr() and p["lse_ptr"] == lse.data_ptr()
    assert (p["k_ptr"], p["v_ptr"]) == (kc.data_ptr(), vc.data_ptr())
    assert (p["k_batch_stride"], p["k_row_stride"], p["k_head_stride"]) == kc.stride()[:3]
    assert (p["page_size"], p["num_pages"], p["page_table"], p["page_table_batch_stride"]) == (40, 3, 0, 0)
    assert p["cache_seqlens"] == lens.data_ptr()
    assert (p["num_splits"], p["split_workspace"]) == (1, 0) and not fake.workspace_queries
    assert (p["softmax_scale"], p["headdim"], p["headdim_v"], p["num_sms"]) == (0.125, 64, 64, 132)
    for field, default in (("window_left", -1), ("window_right", -1), ("softcap", 0.0), ("sinks_ptr", 0),
                           ("dropout_rng", 0), ("dropout_threshold", 0), ("cu_seqlens_q", 0), ("cu_seqlens_k", 0),
                           ("seqused_q", 0), ("seqused_k", 0), ("varlen_workspace", 0), ("q_scale_ptr", 0),
                           ("k_scale_ptr", 0), ("v_scale_ptr", 0), ("total_q", 0), ("total_k", 0),
                           ("tile_counter", 0), ("max_smem_bytes", 0)):
        assert p[field] == default, field


@pytest.mark.parametrize(("seqlen_q", "hq", "causal", "mask"), [(1, 2, True, "none"), (5, 8, True, "causal"),
                                                                 (5, 8, False, "none"), (1, 8, False, "none")])
def test_launch_plain_layout(fake: FakeC, seqlen_q: int, hq: int, causal: bool, mask: str) -> None:
    """One head per kv head: q's own strides; several query heads per kv head: packed rows, one token (strided
    view) or several (a copy of q, rows_per_query = the group size); the mask as asked (one query row:
    non-causal)."""
    q = torch.randn(2, seqlen_q, hq, 128, dtype=torch.float16)
    kc = torch.randn(6, 32, 2, 128, dtype=torch.float16)
    table = i32([[5, 1], [0, 3]])
    out, lse = kvcache_fwd(q, kc, kc, i32([20, 64]), 64, table, causal=causal)
    (p, index, _), = fake.calls
    packed = hq > 2
    assert fake.key_of(index) == KernelKey(90, "float16", 128, 128, mask, kvcache="on")
    assert (p["seqlen_q"], p["nheads_q"]) == ((seqlen_q * hq // 2, 2) if packed else (seqlen_q, hq))
    assert p["rows_per_query"] == (hq // 2 if packed else 1)
    if packed and seqlen_q > 1:  # the packed copy: (batch, kv head, token, g) rows
        rows = seqlen_q * hq // 2
        assert (p["q_batch_stride"], p["q_row_stride"], p["q_head_stride"]) == (2 * rows * 128, 128, rows * 128)
    if not packed:
        assert (p["q_batch_stride"], p["q_row_stride"], p["q_head_stride"]) == q.stride()[:3]
    assert (p["page_table"], p["page_table_batch_stride"], p["page_size"], p["num_pages"]) == (table.data_ptr(), 2,
                                                                                             32, 6)
    assert p["seqlen_k"] == 64
    assert lse.shape == (2, hq, seqlen_q) and out.shape == (2, seqlen_q, hq, 128)


def test_launch_cache_batch_idx_and_uniform_lengths(fake: FakeC) -> None:
    q = torch.randn(2, 3, 4, 64, dtype=torch.bfloat16)
    kc = torch.randn(5, 48, 4, 64, dtype=torch.bfloat16)
    rows = torch.tensor([[4, 9], [1, 9]], dtype=torch.int32)[:, 0]  # strided: passed contiguous
    kvcache_fwd(q, kc, kc, None, 33, rows=rows)
    (p, _, _), = fake.calls
    assert p["page_table"] != 0 and p["page_table_batch_stride"] == 1 and p["page_table"] != rows.data_ptr()
    assert (p["cache_seqlens"], p["seqlen_k"], p["page_size"], p["num_pages"]) == (0, 33, 48, 5)


def test_launch_splits(fake: FakeC) -> None:
    """num_splits as asked (within the key blocks), the heuristic's choice for 0, and a workspace sized by the
    kernel's view of the call (packed heads and rows)."""
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16)
    kc = torch.randn(4, 16, 8, 128, dtype=torch.bfloat16)  # few pages, a page table of 128k keys
    table = torch.zeros(1, 8192, dtype=torch.int32)
    lens = i32([64])
    kvcache_fwd(q, kc, kc, lens, 131072, table, num_splits=3)
    kvcache_fwd(q, kc, kc, lens, 131072, table, num_splits=0)
    kvcache_fwd(q, kc, kc, lens, 200, table[:, :13], num_splits=7)  # 2 key blocks of 128
    splits = [c[0]["num_splits"] for c in fake.calls]
    assert splits == [3, num_splits_heuristic(8, 132, 1024), 2] and splits[1] > 1
    assert fake.workspace_queries == [(3, 1, 8, 4, 128), (splits[1], 1, 8, 4, 128), (2, 1, 8, 4, 128)]
    assert all(c[0]["split_workspace"] != 0 for c in fake.calls)


def test_launch_sinks(fake: FakeC) -> None:
    """Sinks reach the kernel as a pointer to float32 (nheads_q,) (contiguous: a strided view is copied), GQA-packed
    and split alike (the kernels index them per packed row; the combine adds them); no sinks: a null pointer."""
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16)
    kc = torch.randn(4, 16, 8, 128, dtype=torch.bfloat16)
    table = torch.zeros(1, 8192, dtype=torch.int32)
    lens = i32([64])
    sinks = torch.randn(32)
    strided = torch.randn(64)[::2]
    kvcache_fwd(q, kc, kc, lens, 131072, table, num_splits=3, sinks=sinks)
    kvcache_fwd(q, kc, kc, lens, 131072, table, num_splits=1, sinks=strided)
    kvcache_fwd(q, kc, kc, lens, 131072, table, num_splits=3)
    (a, _, _), (b, _, _), (c, _, _) = fake.calls
    assert a["sinks_ptr"] == sinks.data_ptr() and (a["num_splits"], a["rows_per_query"]) == (3, 4)
    assert b["sinks_ptr"] not in (0, strided.data_ptr()) and c["sinks_ptr"] == 0


def test_launch_window(fake: FakeC) -> None:
    """A window runs the window kernel with its edges in the params (causal: right 0; capped past the keys), GQA-packed
    decode included, and the split heuristic counts the window's key blocks, not the cache's."""
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16)
    kc = torch.randn(4, 16, 8, 128, dtype=torch.bfloat16)
    table = torch.zeros(1, 8192, dtype=torch.int32)
    lens = i32([64])
    op = torch.ops.flashhopper.kvcache_fwd.default
    op(q, kc, kc, lens, 131072, table, None, 0.125, True, 0, "sm90", None, 1023, 0)
    op(q, kc, kc, lens, 131072, table, None, 0.125, False, 0, "sm90", None, 1 << 20, 5)
    op(q, kc, kc, lens, 131072, table, None, 0.125, True, 0, "sm90")
    (a, ia, _), (b, ib, _), (c, ic, _) = fake.calls
    assert fake.key_of(ia).mask == "window" and fake.key_of(ib).mask == "window" and fake.key_of(ic).mask == "none"
    assert (a["window_left"], a["window_right"], a["rows_per_query"]) == (1023, 0, 4)
    assert (b["window_left"], b["window_right"]) == (131073, 5)  # capped at seqlen_q + seqlen_k
    assert (c["window_left"], c["window_right"]) == (-1, -1)
    assert a["num_splits"] == num_splits_heuristic(8, 132, 8)  # 1024 keys: 8 blocks of 128
    assert c["num_splits"] == num_splits_heuristic(8, 132, 1024)


def test_launch_softcap(fake: FakeC) -> None:
    """softcap > 0 runs the softcap kernel with the cap in the params; 0 the plain one with 0."""
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16)
    kc = torch.randn(2, 40, 2, 64, dtype=torch.bfloat16)
    op = torch.ops.flashhopper.kvcache_fwd.default
    op(q, kc, kc, i32([40, 3]), 40, None, None, 0.125, True, 1, "sm90", None, -1, -1, 30.0)
    op(q, kc, kc, i32([40, 3]), 40, None, None, 0.125, True, 1, "sm90", None, 7, 0, 30.0)
    op(q, kc, kc, i32([40, 3]), 40, None, None, 0.125, True, 1, "sm90")
    (a, ia, _), (b, ib, _), (c, ic, _) = fake.calls
    assert (fake.key_of(ia).score_mod, fake.key_of(ia).mask, a["softcap"]) == ("softcap", "none", 30.0)
    assert (fake.key_of(ib).score_mod, fake.key_of(ib).mask, b["softcap"]) == ("softcap", "window", 30.0)
    assert (fake.key_of(ic).score_mod, c["softcap"]) == ("none", 0.0)


def test_window_keys() -> None:
    from flashhopper.kvcache import window_keys
    assert window_keys(1, 1000, True, None) == 1000
    assert window_keys(1, 1000, True, (127, -1)) == 128  # causal: the right edge is 0
    assert window_keys(3, 1000, False, (10, 4)) == 17
    assert window_keys(3, 1000, False, (10, -1)) == 1000 and window_keys(3, 1000, False, (-1, 2)) == 1000
    assert window_keys(3, 12, False, (100, 100)) == 12


def test_launch_without_keys_or_rows(fake: FakeC) -> None:
    q = torch.randn(2, 3, 4, 64, dtype=torch.bfloat16)
    kc = torch.randn(2, 0, 2, 64, dtype=torch.bfloat16)
    out, lse = kvcache_fwd(q, kc, kc, None, 0)
    assert not fake.calls and (out == 0).all() and torch.isneginf(lse).all()
    sinks = torch.tensor([1.0, 2.0, -3.0, 0.5])
    out, lse = kvcache_fwd(q, kc, kc, None, 0, sinks=sinks)  # a row without keys: the sink's logit
    assert not fake.calls and (out == 0).all() and torch.equal(lse, sinks[None, :, None].expand(2, 4, 3))
    out, lse = kvcache_fwd(q[:0], kc, kc, None, 0)
    assert not fake.calls and out.shape == (0, 3, 4, 64)


def test_launch_checks_the_layout(fake: FakeC) -> None:
    q = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16)
    kc = torch.randn(2, 16, 2, 72, dtype=torch.bfloat16)[..., 1:65]  # 2-byte offset: not 16-byte aligned
    with pytest.raises(ValueError, match="k_cache data pointer .* is not 16-byte aligned"):
        kvcache_fwd(q, kc, kc, None, 16)
    assert not fake.calls


# --- bench/bench_decode.py's pure parts ---

def _bench() -> Any:
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("bench_decode", Path(__file__).resolve().parent.parent / "bench" /
                                                  "bench_decode.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_bench_counts() -> None:
    from flashhopper.flops import visible_pairs
    bench = _bench()
    for sq, sk in ((1, 1), (1, 100), (5, 5), (2048, 32768), (7, 3), (300, 301)):
        assert bench.causal_pairs(sq, sk) == visible_pairs(sq, sk, True, None), (sq, sk)
    assert bench.causal_pairs(2048, 32768) == 2048 * 30720 + 2048 * 2049 // 2
    assert bench.prefill_flops(2048, 32768, 32, 128) == 4 * bench.causal_pairs(2048, 32768) * 128 * 32
    assert bench.kv_bytes([8192] * 8, 8, 128) == 8 * 8192 * 8 * 128 * 2 * 2
    mb = 2**20
    assert bench.copies_for_l2(268 * mb, 50 * mb) == 1
    assert bench.copies_for_l2(30 * mb, 50 * mb) == 4  # 4 x 30 MB > 100 MB
    assert bench.copies_for_l2(1, 50 * mb) == 16  # capped
    assert bench.tbps(3e12, 1000.0) == pytest.approx(3.0)
    assert [bench.page_size_of(x) for x in ("contiguous", "paged16", "paged128")] == [None, 16, 128]
    with pytest.raises(ValueError, match="layout must be"):
        bench.page_size_of("paged")
    assert bench.default_out().name.startswith("decode-") and bench.default_out().suffix == ".json"


def test_bench_table_and_cli(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    rows = [{"section": "decode", "batch": 8, "cache_len": 8192, "layout": "paged16", "num_splits": 2,
             "us_flashhopper": 100.0, "tbps_flashhopper": 2.7, "of_copy": 0.9, "tbps_copy": 3.0, "us_fa3": 110.0,
             "tbps_fa3": 2.45, "fa3_over_ours": 1.1},
            {"section": "decode", "batch": 1, "cache_len": 131072, "layout": "contiguous", "num_splits": 14,
             "us_flashhopper": 200.0, "tbps_flashhopper": 2.68, "of_copy": 0.89, "tbps_copy": 3.01},
            {"section": "prefill", "layout": "contiguous", "seqlen_q": 2048, "seqlen_k": 32768, "headdim": 128,
             "us_flashhopper": 1000.0, "tflops_flashhopper": 500.0, "us_dense": 950.0, "tflops_dense": 520.0,
             "ratio_vs_dense": 0.95}]
    table = bench.markdown(rows)
    assert "| decode | 8 | 8192 | paged16 | 2 | 100.0 | 2.70 | 0.90 | 110.0 | 2.45 | 1.10 |" in table
    assert "| decode | 1 | 131072 | contiguous | 14 | 200.0 | 2.68 | 0.89 | - | - | - |" in table
    assert "| 2048 | 32768 | 128 | contiguous | 1000.0 | 500 | 950.0 | 520 | 0.950 | - |" in table
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0 and "flash_attn_with_kvcache" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert bench.main(["--shapes", "1x1024"]) == 1
    with pytest.raises(SystemExit):
        bench.main(["--layouts", "pages"])


def test_flash_attn_keyword_return_softmax_lse() -> None:
    # flash-attn names the flag return_softmax_lse: a drop-in call keeps it and gets (out, lse) as with return_lse.
    torch.manual_seed(2)
    q = torch.randn(2, 1, 4, 64, dtype=torch.float64)
    kc, vc = torch.randn(2, 32, 2, 64, dtype=torch.float64), torch.randn(2, 32, 2, 64, dtype=torch.float64)
    lens = torch.tensor([7, 32], dtype=torch.int32)
    want = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, return_lse=True)
    got = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, return_softmax_lse=True)
    assert isinstance(got, tuple) and all(torch.equal(a, b) for a, b in zip(got, want))
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, return_softmax_lse=False)
    assert torch.equal(out, want[0])
