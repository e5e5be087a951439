"""Attention over a KV cache (flash-attn's ``flash_attn_with_kvcache``, issue #22): ``flash_attn_with_kvcache``
and its ops ``flashhopper::kvcache_append`` (new keys and values written into the cache in place) and
``flashhopper::kvcache_fwd`` (attention of q over each entry's cached keys); ``append_kvcache``, the append alone
(a varlen prefill's K/V stored without attending).

A cache is contiguous, (batch_cache, max_seqlen, nheads_kv, headdim) with entry b in row cache_batch_idx[b] (b
without it), or paged, (num_pages, page_size, nheads_kv, headdim) with entry b's key j in page
page_table[b, j // page_size], row j % page_size. Entry b holds cache_seqlens[b] keys (a device tensor, an int
for all, or None: the whole contiguous cache). Nothing reads those values on the host: the append is torch index
ops on device indices and the kernel takes cache_seqlens on the device, so a decode step (append one token,
attend) is CUDA-graph capturable with the lengths and page tables changed in place between replays. Both ops have
fake implementations (torch.compile); neither is differentiable (an inference entry point, as flash-attn's).

The Hopper kernel (KernelKey.kvcache) reads K/V blocks through the page table (a contiguous cache is one page of
max_seqlen rows per entry) and may split each entry's keys over several CTAs (split-KV) whose partial results a
combine kernel merges; a decode step's query heads that share a kv head run as the rows of one head (GQA
packing), so K/V are read once per kv head. The Ampere kernel (sm80, the fallback) gathers each K/V row from
its page with cp.async and splits the same way.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Any, Literal, NamedTuple, Optional, overload

import torch

from . import _autocast, _device, _ext, _launch, _op, _plans, dispatch, kvcache_fp8, reference, validation
from .fp8.format import seed_int64
from .kernel_key import VARLEN_HEADDIMS, normalize_window, window_of
from .ops import window_edges

# Opt-in checks that read cache_seqlens, page_table and cache_batch_idx on the host (a synchronization per call
# on the GPU; on the CPU they always run): lengths within the capacity, indices within the cache.
DEBUG_ENV = "FLASHHOPPER_DEBUG_KVCACHE"
# The heuristic's largest split count (FlashAttention-2's), and the largest a caller may ask for.
HEURISTIC_MAX_SPLITS = 128
# A tile's start (its Q, the first K/V blocks' latency, the partial store) in key blocks' time, for the heuristic.
SPLIT_TILE_START_BLOCKS = 2
MAX_SPLITS = 256
# The kernels load K/V in chunks of 16 rows: a paged cache's pages hold a multiple of that.
PAGE_ROWS_MULTIPLE = 16


class CacheShapes(NamedTuple):
    batch: int
    seqlen_q: int
    nheads_q: int
    nheads_kv: int
    headdim: int     # of q and the K cache
    headdim_v: int   # of the V cache and out
    paged: bool
    page_size: int   # rows per page; a contiguous cache: max_seqlen (one page per entry)
    num_pages: int   # pages; a contiguous cache: its rows (batch_cache)
    capacity: int    # the most keys an entry can hold: max_seqlen, or max_pages_per_seq * page_size
    seqlen_new: int  # tokens appended per entry (0 without k/v)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- validation (metadata only: traceable) ---

def _check_index_tensor(name: str, x: Any, shape: tuple[int, ...], device: torch.device, what: str,
                        like_name: str = "q") -> None:
    validation.check_tensor(name, x)
    if x.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {x.dtype}; it must be torch.int32 ({what})")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} ({what}), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but {like_name} is on {device}")


def check_kvcache_inputs(q: Any, k_cache: Any, v_cache: Any, k: Any, v: Any, cache_seqlens: Any, page_table: Any,
                         cache_batch_idx: Any, softmax_scale: Any, causal: Any,
                         num_splits: Any, fp8: bool = False) -> tuple[CacheShapes, float]:
    """Checks of flash_attn_with_kvcache's arguments (its docstring says what each must be); returns the shapes
    and the softmax scale (default 1/sqrt(headdim)). Metadata only: what would need the values (lengths within
    the capacity, indices within the cache) is check_kvcache_values' job. ``fp8``: e4m3 caches (their scales are
    kvcache_fp8.check_fp8_cache's)."""
    validation.check_tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must have 4 dimensions (batch, seqlen_q, nheads_q, headdim), got shape {tuple(q.shape)}")
    validation.check_dtype("q", q)
    shapes = check_cache_inputs(q, "q", k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, fp8)
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int, got {type(num_splits).__name__}")
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be 0 (heuristic) or 1..{MAX_SPLITS}, got {num_splits}")
    scale = 1.0 / math.sqrt(shapes.headdim) if softmax_scale is None else validation.check_softmax_scale(softmax_scale)
    validation.check_flag("causal", causal)
    return shapes, scale


def check_cache_inputs(like: torch.Tensor, like_name: str, k_cache: Any, v_cache: Any, k: Any, v: Any,
                       cache_seqlens: Any, page_table: Any, cache_batch_idx: Any, fp8: bool = False,
                       queries: bool = True) -> CacheShapes:
    """check_kvcache_inputs' checks of the caches, the new k/v, cache_seqlens, page_table and cache_batch_idx
    against ``like`` (named ``like_name`` in the messages), a checked 4-dimensional tensor whose batch, device,
    dtype and head dim they must match: q for flash_attn_with_kvcache, k for append_kvcache (no query: the
    shapes' query fields are k's; ``queries`` False: no GQA check, which is q's alone). Metadata only."""
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        validation.check_tensor(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch_cache, max_seqlen, nheads_kv, headdim) or paged "
                             f"(num_pages, page_size, nheads_kv, headdim), got shape {tuple(x.shape)}")
        if not fp8:
            validation.check_dtype(name, x)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.device != like.device:
            raise ValueError(f"{name} is on {x.device} but {like_name} is on {like.device}; {like_name} and the "
                             "caches must share one device")
        if x.dtype != like.dtype and not fp8:
            raise TypeError(f"{name} has dtype {x.dtype} but {like_name} has {like.dtype}; {like_name} and the "
                            "caches must share one dtype (or e4m3 caches with k_cache_scale and v_cache_scale)")
    batch, seqlen_q, nheads_q, headdim = like.shape
    slots, rows, nheads_kv, _ = k_cache.shape
    if k_cache.shape[3] != headdim:
        raise ValueError(f"k_cache head dim {k_cache.shape[3]} does not match {like_name} head dim {headdim}")
    if headdim < 1:
        raise ValueError(f"{like_name} head dim must be positive, got shape {tuple(like.shape)}")
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]) or v_cache.shape[3] < 1:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)} but "
                         "for the head dim (positive)")
    if queries and (nheads_kv < 1 or nheads_q % nheads_kv != 0):
        raise ValueError(f"{like_name} nheads {nheads_q} must be a multiple of the caches' nheads {nheads_kv} "
                         "(grouped-query attention)")

    paged = page_table is not None
    if paged:
        validation.check_tensor("page_table", page_table)
        if page_table.dtype != torch.int32:
            raise TypeError(f"page_table has dtype {page_table.dtype}; it must be torch.int32")
        if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.shape[1] < 1:
            raise ValueError(f"page_table must have shape ({batch}, max_pages_per_seq) with max_pages_per_seq >= 1 "
                             f"(a row of page indices per entry of {like_name}), got {tuple(page_table.shape)}")
        if page_table.device != like.device:
            raise ValueError(f"page_table is on {page_table.device} but {like_name} is on {like.device}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx selects rows of a contiguous cache; with page_table (a paged cache) the "
                             "page table says where each entry's keys are: pass one or the other")
        if rows < 1 or rows % PAGE_ROWS_MULTIPLE:
            raise ValueError(f"k_cache page size {rows} (dim 1 of a paged cache) must be a positive multiple of "
                             f"{PAGE_ROWS_MULTIPLE} (the kernels load 16-row chunks)")
        capacity = page_table.shape[1] * rows
    else:
        if cache_batch_idx is None:
            if slots != batch:
                raise ValueError(f"k_cache batch size {slots} does not match {like_name} batch size {batch} (pass "
                                 "cache_batch_idx to attend to other rows of a larger cache)")
        else:
            _check_index_tensor("cache_batch_idx", cache_batch_idx, (batch,), like.device,
                                f"a cache row per entry of {like_name}", like_name)
        capacity = rows

    if (k is None) != (v is None):
        raise ValueError(f"k and v are appended together: got k={'a tensor' if k is not None else 'None'} and "
                         f"v={'a tensor' if v is not None else 'None'}")
    seqlen_new = 0
    if k is not None:
        for name, x, cache, d in (("k", k, "k_cache", headdim), ("v", v, "v_cache", v_cache.shape[3])):
            validation.check_tensor(name, x)
            if x.dim() != 4:
                raise ValueError(f"{name} must have 4 dimensions (batch, seqlen_new, nheads_kv, headdim), got shape "
                                 f"{tuple(x.shape)}")
            if x.dtype != like.dtype:
                raise TypeError(f"{name} has dtype {x.dtype} but {cache} has {like.dtype}; the new keys and values "
                                "are written into the cache in its dtype" if not fp8 else
                                f"{name} has dtype {x.dtype} but {like_name} has {like.dtype}; new keys and values "
                                f"come in {like_name}'s dtype (the call quantizes them into the e4m3 cache)")
            if x.device != like.device:
                raise ValueError(f"{name} is on {x.device} but {like_name} is on {like.device}")
            want = (batch, k.shape[1], nheads_kv, d)
            if tuple(x.shape) != want:
                raise ValueError(f"{name} must have shape {want} ({like_name}'s batch, k's seqlen_new, {cache}'s "
                                 f"nheads and head dim), got {tuple(x.shape)}")
        seqlen_new = k.shape[1]
        if seqlen_new > capacity:
            raise ValueError(f"k has {seqlen_new} new tokens per entry, more than an entry of the cache holds "
                             f"({capacity})")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when k and v are appended (the position of each entry's "
                             "first new token)")

    if cache_seqlens is None:
        if paged:
            raise ValueError("cache_seqlens is required with page_table (each entry's number of cached keys)")
    elif isinstance(cache_seqlens, torch.Tensor):
        _check_index_tensor("cache_seqlens", cache_seqlens, (batch,), like.device,
                            f"one length per entry of {like_name}", like_name)
    elif isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, numbers.Integral):
        raise TypeError(f"cache_seqlens must be an int32 tensor (batch,), a Python int or None, got "
                        f"{type(cache_seqlens).__name__}")
    elif not 0 <= cache_seqlens <= capacity - seqlen_new:
        raise ValueError(f"cache_seqlens = {cache_seqlens} with {seqlen_new} new tokens does not fit the cache: "
                         f"0 <= cache_seqlens <= {capacity - seqlen_new} (capacity {capacity})")
    return CacheShapes(batch, seqlen_q, nheads_q, nheads_kv, headdim, v_cache.shape[3], paged, rows,
                       slots, capacity, seqlen_new)


def check_cache_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_cache_scale: Any, v_cache_scale: Any,
                       hadamard_seed: Any, like: torch.Tensor, fp8: bool) -> None:
    """An e4m3 cache's scales and seed (kvcache_fp8.check_fp8_cache, against ``like``: q, or append_kvcache's k);
    none of them for 16-bit caches."""
    if fp8:
        kvcache_fp8.check_fp8_cache(k_cache, v_cache, k_cache_scale, v_cache_scale, hadamard_seed, like)
    elif k_cache_scale is not None or v_cache_scale is not None or hadamard_seed is not None:
        raise ValueError("k_cache_scale, v_cache_scale and hadamard_seed are for e4m3 caches; these caches are "
                         f"{k_cache.dtype}")


def _is_fp8(k_cache: Any, v_cache: Any) -> bool:
    return any(isinstance(x, torch.Tensor) and x.dtype == kvcache_fp8.E4M3 for x in (k_cache, v_cache))


def check_kvcache_values(shapes: CacheShapes, cache_seqlens: torch.Tensor | int | None,
                         page_table: torch.Tensor | None, cache_batch_idx: torch.Tensor | None) -> None:
    """What check_kvcache_inputs cannot see without the values (on the GPU a synchronization, so only on request:
    FLASHHOPPER_DEBUG_KVCACHE=1): every entry's cache_seqlens + seqlen_new within 0..capacity, cache_batch_idx
    within the cache's rows, and the pages an entry uses within the cache's pages."""
    n = shapes.seqlen_new
    if isinstance(cache_seqlens, torch.Tensor):
        lengths = cache_seqlens.tolist()
        bad = [(b, x) for b, x in enumerate(lengths) if not 0 <= x <= shapes.capacity - n]
        if bad:
            raise ValueError(f"cache_seqlens (entry, value) {bad[:8]}: with {n} new tokens each must lie in 0.."
                             f"{shapes.capacity - n} (the cache holds {shapes.capacity} keys per entry)")
    else:
        lengths = [shapes.capacity if cache_seqlens is None else int(cache_seqlens)] * shapes.batch
    if cache_batch_idx is not None:
        rows = cache_batch_idx.tolist()
        bad = [(b, r) for b, r in enumerate(rows) if not 0 <= r < shapes.num_pages]
        if bad:
            raise ValueError(f"cache_batch_idx (entry, row) {bad[:8]} outside the cache's {shapes.num_pages} rows")
    if page_table is not None:
        table = page_table.tolist()
        for b, (length, pages) in enumerate(zip(lengths, table)):
            used = pages[:_ceil_div(length + n, shapes.page_size)]
            bad = [p for p in used if not 0 <= p < shapes.num_pages]
            if bad:
                raise ValueError(f"page_table[{b}] names pages {bad[:8]} (of the {len(used)} its {length + n} keys "
                                 f"use) outside the cache's {shapes.num_pages} pages")


# --- split-KV ---

def num_splits_heuristic(tiles: int, num_sms: int, n_blocks: int, max_splits: int = HEURISTIC_MAX_SPLITS) -> int:
    """The split-KV count: 1 when the ``tiles`` (batch x heads x query blocks) nearly fill the ``num_sms``
    multiprocessors (>= 80%); else the count s up to min(max_splits, n_blocks) that gives the busiest SM the least
    work, ceil(tiles * s / num_sms) tiles (the persistent static order deals them round-robin) of ceil(n_blocks / s)
    key blocks each plus SPLIT_TILE_START_BLOCKS for a tile's start; the smallest such s. FlashAttention-2's rule
    (the smallest s whose wave efficiency is within 85% of the best) left SMs idle: 14 splits of a 128k-key entry
    with 8 kv heads run on 112 of 132 SMs, 74 blocks each, where 16 give 128 SMs 64 (docs/perf-notes.md, session 35)."""
    if tiles <= 0 or n_blocks <= 1 or num_sms <= 0 or tiles >= 0.8 * num_sms:
        return 1

    def busiest(s: int) -> int:
        return _ceil_div(tiles * s, num_sms) * (_ceil_div(n_blocks, s) + SPLIT_TILE_START_BLOCKS)

    return min(range(1, min(max_splits, n_blocks) + 1), key=lambda s: (busiest(s), s))


def kernel_num_splits(num_splits: int, batch: int, kernel_heads: int, kernel_rows: int, seqlen_k: int,
                      block_m: int, block_n: int, num_sms: int) -> int:
    """The split count a launch uses: ``num_splits`` (0: num_splits_heuristic over the kernel's view: batch x
    kernel_heads x ceil(kernel_rows / block_m) tiles, ceil(seqlen_k / block_n) key blocks), never more than the
    key blocks (each split gets one at least), at least 1. ``seqlen_k``: the keys a query block sees (a window's
    span, bounded by the cache: window_keys), as the kernels split those."""
    n_blocks = _ceil_div(seqlen_k, block_n)
    if num_splits == 0:
        tiles = batch * kernel_heads * _ceil_div(kernel_rows, block_m)
        num_splits = num_splits_heuristic(tiles, num_sms, n_blocks)
    return max(1, min(num_splits, n_blocks))


# --- backend ---

def _kvcache_mask(seqlen_q: int, causal: bool, window: tuple[int, int] | None = None) -> str:
    # One query row sees every key of its entry either way (bottom-right aligned): the non-causal kernel, which
    # GQA packing needs (the packed rows are heads, not positions). A window (normalize_window's: not plain causal)
    # runs the window kernels, whose edges the params carry (ops.window_edges: causal is right = 0).
    if window is not None:
        return "window"
    return "causal" if causal and seqlen_q > 1 else "none"


def window_keys(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int] | None) -> int:
    """At most how many keys of an entry of ``seqlen_k`` one query block of ``seqlen_q`` rows sees: seqlen_k, or a
    window's span (left + right + the rows) when both its edges are bounded (causal: right 0)."""
    if window is None:
        return seqlen_k
    left, right = window[0], 0 if causal else window[1]
    return seqlen_k if left < 0 or right < 0 else min(seqlen_k, left + right + seqlen_q)


# GQA packing of several query tokens (speculative decoding, short chunks): up to this many rows (tokens x query
# heads per kv head) per kv head; beyond, the call is compute-bound and runs one head at a time.
PACK_MAX_ROWS = 256


def _packs_gqa(seqlen_q: int, nheads_q: int, nheads_kv: int) -> bool:
    """Whether a call runs GQA-packed: several query heads per kv head, and one query token (decode: a strided
    view) or a few (a packed copy of q; the kernel's causal rule divides the rows back into tokens)."""
    return nheads_q > nheads_kv and (seqlen_q == 1 or seqlen_q * (nheads_q // nheads_kv) <= PACK_MAX_ROWS)


KVCACHE_BACKENDS = ("sm90", "sm80")  # kernel families with KV-cache kernels, the preferred first


def _kvcache_key(dtype: torch.dtype, headdim: int, headdim_v: int, mask: str, backend: str = "sm90",
                 cache: str = "on", score_mod: str = "none") -> Any:
    return dispatch._key(backend, dtype, headdim, mask, "", score_mod, headdim_v, dropout=False, varlen=False,
                         kvcache=cache)


# As dispatch._missing_bwd_cuda: a constant under torch.compile (the device query cannot be traced), returning the
# message rather than raising (a ValueError raised inside an assume_constant_result function surfaces as an
# internal dynamo error).
@torch.compiler.assume_constant_result
def _kvcache_backend(index: int, dtype: torch.dtype, headdim: int, headdim_v: int, mask: str, backend: str,
                     cache: str = "on", score_mod: str = "none") -> str:
    """The kernel family a CUDA call runs ("sm90", "sm80"; ``backend``: "" for the first of KVCACHE_BACKENDS that
    runs on the device and was built), or "!" followed by why there is none."""
    info = _device.device_info(index)
    where = f"q is on cuda:{index} ({info.name}, compute capability {info.capability[0]}.{info.capability[1]})"
    names = (backend,) if backend else KVCACHE_BACKENDS if cache == "on" else ("sm90",)  # (e4m3: Hopper only)
    usable = [b for b in names if dispatch.runs_on(b, info.capability)]
    if not usable:
        return (f"!{where}; backend={backend!r} does not run there" if backend else
                f"!{where}; the KV-cache kernels are Hopper (sm90) and Ampere-family (sm80) ones; pass "
                "backend='reference'")
    errors = []
    for b in usable:
        try:
            dispatch.require_kernel("fwd", _kvcache_key(dtype, headdim, headdim_v, mask, b, cache, score_mod))
        except ValueError as e:
            errors.append(str(e))
            continue
        return b
    return "!" + errors[0]


def resolve_backend(q: torch.Tensor, shapes: CacheShapes, causal: bool, backend: str | None, cache: str = "on",
                    window: tuple[int, int] | None = None, softcap: float = 0.0) -> str:
    """"sm90", "sm80" or "reference" for a validated call: CPU tensors (backend None) and backend='reference' run
    the reference; CUDA tensors the Hopper KV-cache kernel where it runs and was built, else the Ampere one (or the
    family named), or a ValueError saying why there is none (never a silent fall back to the reference on a GPU)."""
    if dispatch.reference_backend(q, backend):
        return "reference"
    validation.check_kernel_dtype("q", q.dtype)
    if shapes.headdim != shapes.headdim_v or shapes.headdim not in VARLEN_HEADDIMS:
        hd = f"{shapes.headdim}" if shapes.headdim == shapes.headdim_v else f"{shapes.headdim}/{shapes.headdim_v}"
        raise ValueError(f"q head dim {hd}: the KV-cache kernels have head dims "
                         f"{', '.join(map(str, VARLEN_HEADDIMS))} (q, K and V alike); backend='reference' takes any")
    name = _kvcache_backend(q.device.index, q.dtype, shapes.headdim, shapes.headdim_v,
                            _kvcache_mask(shapes.seqlen_q, causal, window), backend or "", cache,
                            dispatch.score_mod_of(softcap))
    if name.startswith("!"):
        raise ValueError(name[1:])
    return name


def _check_kernel_layouts(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The kernel's TMA needs 16-byte aligned strides and starts: checked before the append writes the cache, from
    metadata (validation.kernel_layout_ok; the launch checks the real pointers). Not while torch.compile traces
    (dynamo cannot read a storage offset); the launch's check runs all the same."""
    if torch.compiler.is_compiling():
        return
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not validation.kernel_layout_ok(x):
            validation.check_kernel_layout(name, x)  # names what is wrong
            raise ValueError(f"{name} (storage offset {x.storage_offset()}, strides {tuple(x.stride())}) is not laid "
                             "out for the kernels' TMA loads: 16-byte aligned start and strides; call .contiguous()")


# --- the append: flashhopper::kvcache_append ---

def _append_index(k_cache: torch.Tensor, k: torch.Tensor, cache_seqlens: torch.Tensor | None, seqlen_offset: int,
                  page_table: torch.Tensor | None,
                  cache_batch_idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, row) int64 (batch, seqlen_new) of each new token in the cache's first two dims, on the device."""
    batch, seqlen_new = k.shape[:2]
    steps = torch.arange(seqlen_new, device=k.device)
    if cache_seqlens is not None:
        pos = cache_seqlens.to(torch.int64)[:, None] + steps
    else:
        pos = (steps + seqlen_offset).expand(batch, seqlen_new)
    if page_table is not None:
        page_size = k_cache.shape[1]
        return page_table.gather(1, pos // page_size).to(torch.int64), pos % page_size
    slot = (torch.arange(batch, device=k.device) if cache_batch_idx is None else cache_batch_idx.to(torch.int64))
    return slot[:, None].expand(batch, seqlen_new), pos


def kvcache_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cache_seqlens: Optional[torch.Tensor], seqlen_offset: int,  # noqa: UP045
                   page_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor]) -> None:  # noqa: UP045
    """Write k, v (batch, seqlen_new, nheads_kv, headdim) into the caches in place: entry b's token t at position
    cache_seqlens[b] + t (``seqlen_offset`` + t for every entry when cache_seqlens is None) of its cache (paged:
    page page_table[b, pos // page_size], row pos % page_size; contiguous: row cache_batch_idx[b] (b), position
    pos). torch index ops with device indices only: no synchronization, graph-capturable. cache_seqlens itself is
    left as it is. Positions past the capacity or pages outside the cache are a device-side index error (not
    checked without FLASHHOPPER_DEBUG_KVCACHE=1)."""
    if k.numel() == 0:
        return
    if _append_kernel_takes(k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx):
        _launch_append(k_cache, v_cache, k, v, cache_seqlens, seqlen_offset, page_table, cache_batch_idx)
        return
    index = _append_index(k_cache, k, cache_seqlens, seqlen_offset, page_table, cache_batch_idx)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def _append_kernel_takes(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cache_seqlens: torch.Tensor | None, page_table: torch.Tensor | None,
                         cache_batch_idx: torch.Tensor | None) -> bool:
    """Whether the extension's append kernel (cpp/kvcache_append.cu: one 16-byte copy per thread, K and V in one
    launch, where the index writes take eight torch ops) can write these: CUDA tensors whose rows are 16-byte
    multiples at 16-byte aligned addresses, contiguous int32 index tensors. Otherwise the torch index writes."""
    return (_append_kernel_here(k_cache, "kvcache_append") and all(map(_rows_16b, (k_cache, v_cache, k, v)))
            and _index_layout_ok(cache_seqlens, page_table, cache_batch_idx))


def _append_kernel_here(k_cache: torch.Tensor, binding: str) -> bool:
    # The extension has the binding and k_cache's GPU runs its kernels, built with the Hopper family only (sm_90a
    # code): other GPUs take the torch ops.
    return (k_cache.is_cuda and _ext.has_extension() and hasattr(_ext.extension(), binding)
            and dispatch.runs_on("sm90", _device.device_info(k_cache.device.index).capability))


def _rows_16b(x: torch.Tensor) -> bool:
    # Rows of 16-byte multiples at 16-byte aligned addresses (the kernels' vector accesses).
    es = x.element_size()
    return not (x.stride(3) != 1 or (x.shape[3] * es) % 16 or x.data_ptr() % 16
                or any((st * es) % 16 for st in x.stride()[:3]))


def _index_layout_ok(cache_seqlens: torch.Tensor | None, page_table: torch.Tensor | None,
                     cache_batch_idx: torch.Tensor | None) -> bool:
    # Index tensors the kernels read as contiguous int32 (a page table by rows).
    return all(t is None or t.is_contiguous() for t in (cache_seqlens, cache_batch_idx)) and (
        page_table is None or page_table.shape[1] == 1 or page_table.stride(1) == 1)


class _AppendLaunch(NamedTuple):
    """An append kernel call (16-bit, or e4m3 with ``fp8``) prepared from tensors' metadata: the strides and sizes
    the extension takes, in its argument order; each run passes the pointers. Eager plans keep one (_Plan)."""

    fp8: bool
    strides: tuple[list[int], ...]  # k_cache, v_cache, k, v (bytes); e4m3: then k_scale, v_scale (elements)
    table_stride: int
    sizes: tuple[Any, ...]  # page_size, batch, seqlen_new, heads, then the row bytes (e4m3: head dim, bf16, hadamard, seed)

    def run(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            cache_seqlens: torch.Tensor | None, seqlen_offset: int, page_table: torch.Tensor | None,
            cache_batch_idx: torch.Tensor | None, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        C = _ext.extension()
        device = k.device
        head = (_launch.stream(device), device.index, k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr())
        tail = (0 if cache_seqlens is None else cache_seqlens.data_ptr(), seqlen_offset,
                0 if page_table is None else page_table.data_ptr(), self.table_stride,
                0 if cache_batch_idx is None else cache_batch_idx.data_ptr(), *self.sizes)
        if self.fp8:
            assert scales is not None
            C.kvcache_append_fp8(*head, *self.strides[:4], scales[0].data_ptr(), scales[1].data_ptr(),
                                 *self.strides[4:], *tail)
        else:
            C.kvcache_append(*head, *self.strides, *tail)


def _byte_strides(x: torch.Tensor) -> list[int]:  # (page or batch, row, head), in bytes
    return [st * x.element_size() for st in x.stride()[:3]]


def _append_launch(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   page_table: torch.Tensor | None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                   hadamard_seed: int | None = None) -> _AppendLaunch:
    b, s_new, h, d = k.shape
    table_stride = 0 if page_table is None else page_table.stride(0)
    strides = tuple(_byte_strides(x) for x in (k_cache, v_cache, k, v))
    if scales is None:
        return _AppendLaunch(False, strides, table_stride, (k_cache.shape[1], b, s_new, h, d * k.element_size(),
                                                            v.shape[3] * v.element_size()))
    strides += tuple(list(kvcache_fp8.scale_strides(x)) for x in scales)
    return _AppendLaunch(True, strides, table_stride, (k_cache.shape[1], b, s_new, h, d, k.dtype == torch.bfloat16,
                                                       hadamard_seed is not None,
                                                       0 if hadamard_seed is None else int(hadamard_seed)))


def _launch_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cache_seqlens: torch.Tensor | None, seqlen_offset: int, page_table: torch.Tensor | None,
                   cache_batch_idx: torch.Tensor | None) -> None:
    _append_launch(k_cache, v_cache, k, v, page_table).run(k_cache, v_cache, k, v, cache_seqlens, seqlen_offset,
                                                           page_table, cache_batch_idx)


kvcache_append_op = _op.define("kvcache_append", kvcache_append, autocast=(), mutates_args=("k_cache", "v_cache"))


@torch.library.register_fake("flashhopper::kvcache_append")
def _(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
      cache_seqlens: Optional[torch.Tensor], seqlen_offset: int,  # noqa: UP045
      page_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor]) -> None:  # noqa: UP045
    return None


# --- the attention: flashhopper::kvcache_fwd ---

def _empty_outputs(q: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, sq, hq, _ = q.shape
    out = torch.empty((b, sq, hq, v_cache.shape[3]), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    return out, lse


class KVCacheLaunch(NamedTuple):
    """A prepared KV-cache kernel call (a _plans.Launch's counterpart): ``params`` filled but for the pointers of
    q, the caches, out, lse, the page table (or cache_batch_idx), the lengths and the split workspace; the kernel
    ``index``, the split workspace's bytes (0: no split) and the device. Never written after it is made."""

    params: Any
    index: int
    workspace_bytes: int
    device: torch.device
    pack: int = 0  # several query tokens GQA-packed: g (q copied to (batch, kv head, token, g) rows), else 0

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
            table: torch.Tensor | None, lengths: torch.Tensor | None,
            scales: tuple[torch.Tensor, torch.Tensor] | None = None, sinks: torch.Tensor | None = None) -> int:
        if self.pack:
            # Token s's g query heads of kv head h are rows s g .. s g + g - 1 of kernel head h; out and lse come
            # back through the same permutation.
            b, sq, hq, d = q.shape
            g, dv = self.pack, out.shape[3]
            hkv = hq // g
            qp = q.reshape(b, sq, hkv, g, d).transpose(1, 2).contiguous()  # (b, hkv, sq, g, d)
            op = out.new_empty((b, hkv, sq, g, dv))
            lp = lse.new_empty((b, hkv, sq, g))
            ctas = self._launch(qp, k_cache, v_cache, op, lp, table, lengths, scales, sinks)
            out.view(b, sq, hkv, g, dv).copy_(op.transpose(1, 2))
            lse.view(b, hkv, g, sq).copy_(lp.permute(0, 1, 3, 2))
            return ctas
        return self._launch(q, k_cache, v_cache, out, lse, table, lengths, scales, sinks)

    def _launch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, table: torch.Tensor | None, lengths: torch.Tensor | None,
                scales: tuple[torch.Tensor, torch.Tensor] | None, sinks: torch.Tensor | None) -> int:
        # Partial O and LSE of the splits, any contents (float32 (splits, batch, heads, rows, headdim_v + 1)).
        # (It, table and lengths live until the launch is enqueued: enough, as the allocator reuses memory in
        # stream order.)
        workspace = (torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.device)
                     if self.workspace_bytes else None)
        return int(_ext.extension().fwd_kvcache_with(
            self.params, self.index, _launch.stream(self.device), q.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), out.data_ptr(), lse.data_ptr(), 0 if table is None else table.data_ptr(),
            0 if lengths is None else lengths.data_ptr(), 0 if workspace is None else workspace.data_ptr(),
            0 if scales is None else scales[0].data_ptr(), 0 if scales is None else scales[1].data_ptr(),
            0 if sinks is None else sinks.data_ptr()))


def _kernel_table(page_table: torch.Tensor | None, cache_batch_idx: torch.Tensor | None) -> torch.Tensor | None:
    """What the kernel reads as its page table: the page table (rows contiguous), cache_batch_idx, or None."""
    if page_table is not None:
        return page_table if page_table.shape[1] == 1 or page_table.stride(1) == 1 else page_table.contiguous()
    return None if cache_batch_idx is None else cache_batch_idx.contiguous()


def _prepare_kvcache_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlen_k: int,
                         table: torch.Tensor | None, softmax_scale: float, causal: bool,
                         num_splits: int, backend: str = "sm90",
                         scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                         window: tuple[int, int] | None = None, softcap: float = 0.0) -> KVCacheLaunch:
    """The KVCacheLaunch of a call, from the tensors' metadata alone: the kernel, GQA packing, the split count and
    every params field but the pointers (``table``: _kernel_table's; ``scales``: an e4m3 cache's)."""
    b, sq, hq, d = q.shape
    page_size, hkv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    cache = "on" if scales is None else "e4m3"
    entry = dispatch.require_kernel("fwd", _kvcache_key(q.dtype, d, dv, _kvcache_mask(sq, causal, window), backend,
                                                        cache, dispatch.score_mod_of(softcap)))
    pack = 0
    if _packs_gqa(sq, hq, hkv) and sq == 1:
        # GQA packing: the g query heads of a kv head are g rows of one head (K/V read once per kv head). Query
        # head h * g + r is row r of kernel head h: row stride = q's head stride, head stride g times it. The lse
        # (batch, nheads_q, 1) contiguous is the kernel's (batch, nheads_kv, g) contiguous; out is contiguous.
        g = hq // hkv
        q4 = q.as_strided((b, g, hkv, d), (q.stride(0), q.stride(2), g * q.stride(2), q.stride(3)))
        o4 = torch.empty(0, device="meta").as_strided((b, g, hkv, dv), (hq * dv, dv, g * dv, 1))
        rows, heads = g, hkv
    elif _packs_gqa(sq, hq, hkv):
        # Several tokens: q copied to (batch, kv head, token, g) rows per call (KVCacheLaunch.run), rows s g ..
        # s g + g - 1 token s's (the kernel's causal rule divides by g: rows_per_query).
        pack = g = hq // hkv
        rows, heads = sq * g, hkv
        q4 = torch.empty(0, device="meta").as_strided((b, rows, hkv, d), (hkv * rows * d, d, rows * d, 1))
        o4 = torch.empty(0, device="meta").as_strided((b, rows, hkv, dv), (hkv * rows * dv, dv, rows * dv, 1))
    else:
        q4, rows, heads = q, sq, hq
        o4 = torch.empty(0, device="meta").as_strided((b, sq, hq, dv), (sq * hq * dv, hq * dv, dv, 1))
    for name, x in ((("q", q4),) if not pack else ()) + (("k_cache", k_cache), ("v_cache", v_cache)):
        validation.check_kernel_layout(name, x)
    num_sms = _device.device_info(q.device.index).num_sms
    splits = kernel_num_splits(num_splits, b, heads, rows, window_keys(sq, seqlen_k, causal, window), entry.block_m,
                               entry.block_n, num_sms)
    C = _ext.extension()

    p = C.FwdParams()  # its own: a KVCacheLaunch may be kept and reused (never the thread's shared object)
    _launch.fill_strides(p, q=q4, k=k_cache, v=v_cache, o=o4)
    p.batch, p.seqlen_q, p.seqlen_k = b, rows, seqlen_k
    p.nheads_q, p.nheads_kv, p.headdim, p.headdim_v = heads, hkv, d, dv
    p.softmax_scale, p.softcap = softmax_scale, softcap
    p.page_table_batch_stride = 0 if table is None else (table.stride(0) if table.dim() == 2 else 1)
    p.page_size, p.num_pages = page_size, k_cache.shape[0]
    p.num_splits = splits
    p.rows_per_query = (hq // hkv) if _packs_gqa(sq, hq, hkv) else 1
    # Window edges in query positions (packed rows: the kernel divides rows back into queries), capped past the keys.
    p.window_left, p.window_right = window_edges(causal, window, sq, seqlen_k)
    if scales is not None:  # (pages, kv heads, page_size), tokens contiguous; K's and V's strides are equal
        if not kvcache_fp8.scale_layout_ok(scales[0]) or not kvcache_fp8.scale_layout_ok(scales[1]):
            raise ValueError("k_cache_scale / v_cache_scale must start 16-byte aligned, with page and head strides "
                             "of a multiple of 4 elements and pages of a multiple of 16 rows (.contiguous() gives "
                             "that)")
        p.k_scale_batch_stride, p.k_scale_head_stride = kvcache_fp8.scale_strides(scales[0])
        p.v_scale_batch_stride, p.v_scale_head_stride = p.k_scale_batch_stride, p.k_scale_head_stride
    _launch.fill_device(p, q)
    nbytes = int(C.kvcache_split_workspace_bytes(splits, b, heads, rows, dv)) if splits > 1 else 0
    return KVCacheLaunch(p, entry.index, nbytes, q.device, pack)


def _launch_kvcache_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cache_seqlens: torch.Tensor | None, seqlen_k: int, page_table: torch.Tensor | None,
                        cache_batch_idx: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                        softmax_scale: float, causal: bool, num_splits: int, backend: str = "sm90",
                        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                        sinks: torch.Tensor | None = None, window: tuple[int, int] | None = None,
                        softcap: float = 0.0) -> int:
    """The KV-cache forward of kernel family ``backend`` into out (batch, seqlen_q, nheads_q, headdim_v) and lse float32 (batch,
    nheads_q, seqlen_q), both contiguous. ``cache_seqlens``: int32 (batch,) key counts on the device, each at most
    ``seqlen_k``, or None: every entry has seqlen_k keys; ``sinks``: float32 (nheads_q,) sink logits or None;
    ``window``: normalized (kernel_key.normalize_window) or None; ``softcap``: 0 (off) or c > 0.
    Returns the CTAs launched (the extension's answer)."""
    b, sq, hq, _ = q.shape
    dv = v_cache.shape[3]
    if not (out.is_contiguous() and out.shape == (b, sq, hq, dv)):
        raise ValueError(f"out must be contiguous of shape {(b, sq, hq, dv)}, got {tuple(out.shape)} "
                         f"strides {tuple(out.stride())}")
    if not (lse.is_contiguous() and lse.dtype == torch.float32 and lse.numel() == b * hq * sq):
        raise ValueError(f"lse must be float32 contiguous (batch, nheads_q, seqlen_q), got {tuple(lse.shape)} "
                         f"{lse.dtype} strides {tuple(lse.stride())}")
    validation.check_kernel_layout("out", out)
    table = _kernel_table(page_table, cache_batch_idx)
    lengths = None if cache_seqlens is None else cache_seqlens.contiguous()
    launch = _prepare_kvcache_fwd(q, k_cache, v_cache, seqlen_k, table, softmax_scale, causal, num_splits, backend,
                                  scales, window, softcap)
    return launch.run(q, k_cache, v_cache, out, lse, table, lengths, scales,
                      None if sinks is None else sinks.contiguous())


def kvcache_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: Optional[torch.Tensor], seqlen_k: int,  # noqa: UP045
                page_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],  # noqa: UP045
                softmax_scale: float, causal: bool, num_splits: int,
                backend: str, sinks: Optional[torch.Tensor] = None,  # noqa: UP045
                window_left: int = -1, window_right: int = -1,
                softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over a KV cache: (out (batch, seqlen_q, nheads_q, headdim_v) like q, lse float32 (batch,
    nheads_q, seqlen_q)), both contiguous. Entry b attends to its first cache_seqlens[b] keys (int32 (batch,) on
    q's device: the counts after any append), or to ``seqlen_k`` keys each when cache_seqlens is None;
    ``seqlen_k`` bounds them all otherwise (the capacity). Arguments as flash_attn_with_kvcache's, validated;
    ``backend`` resolved ("sm90", "sm80" or "reference"); ``num_splits`` 0: the heuristic; the window normalized
    (kernel_key.normalize_window), (-1, -1) for none; ``softcap`` 0 for none."""
    return _kvcache_fwd(q, k_cache, v_cache, cache_seqlens, seqlen_k, page_table, cache_batch_idx, softmax_scale,
                        causal, num_splits, backend, sinks=sinks, window=window_of(window_left, window_right),
                        softcap=softcap)


def _kvcache_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | None,
                 seqlen_k: int, page_table: torch.Tensor | None, cache_batch_idx: torch.Tensor | None,
                 softmax_scale: float, causal: bool, num_splits: int, backend: str,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 sinks: torch.Tensor | None = None, window: tuple[int, int] | None = None,
                 softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _empty_outputs(q, v_cache)
    if backend == "reference":
        dtype = torch.float64 if (not q.is_cuda or q.dtype == torch.float64) else torch.float32
        if scales is not None:  # the e4m3 cache's values as stored (q has K's transform already)
            k_cache = kvcache_fp8.dequantize_kv_cache(k_cache, scales[0], None, dtype)
            v_cache = kvcache_fp8.dequantize_kv_cache(v_cache, scales[1], None, dtype)
            q = q.to(dtype)
        ref_out, ref_lse = reference.attention_kvcache_ref(q, k_cache, v_cache,
                                                           seqlen_k if cache_seqlens is None else cache_seqlens,
                                                           page_table, cache_batch_idx, softmax_scale, causal,
                                                           sinks=sinks, window=window, softcap=softcap,
                                                           dtype=dtype)
        out.copy_(ref_out)
        lse.copy_(ref_lse)
    elif backend in KVCACHE_BACKENDS:
        if lse.numel() == 0:
            pass  # nothing to compute (no entry, no query row or no head)
        elif seqlen_k == 0:  # no entry has a key: what a row that sees none gets, without a launch
            out.zero_()
            if sinks is None:
                lse.fill_(-math.inf)
            else:
                lse.copy_(sinks[None, :, None].expand_as(lse))
        else:
            _launch_kvcache_fwd(q, k_cache, v_cache, cache_seqlens, seqlen_k, page_table, cache_batch_idx, out, lse,
                                softmax_scale, causal, num_splits, backend, scales, sinks, window, softcap)
    else:
        raise ValueError(f"backend must be 'sm90', 'sm80' or 'reference' for a KV cache, got {backend!r}")
    return out, lse


kvcache_fwd_op = _op.define("kvcache_fwd", kvcache_fwd, autocast=())


@torch.library.register_fake("flashhopper::kvcache_fwd")
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: Optional[torch.Tensor],  # noqa: UP045
      seqlen_k: int, page_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],  # noqa: UP045
      softmax_scale: float, causal: bool, num_splits: int, backend: str,
      sinks: Optional[torch.Tensor] = None,  # noqa: UP045
      window_left: int = -1, window_right: int = -1, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return _empty_outputs(q, v_cache)


def kvcache_fwd_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_cache_scale: torch.Tensor,
                    v_cache_scale: torch.Tensor, cache_seqlens: Optional[torch.Tensor], seqlen_k: int,  # noqa: UP045
                    page_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],  # noqa: UP045
                    softmax_scale: float, causal: bool, num_splits: int,
                    backend: str, sinks: Optional[torch.Tensor] = None,  # noqa: UP045
                    window_left: int = -1, window_right: int = -1,
                    softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """kvcache_fwd over an e4m3 cache with its per-token scales (kvcache_fp8), q already transformed as K's rows
    are (kvcache_fp8.transform_q). Backends "sm90" and "reference"."""
    return _kvcache_fwd(q, k_cache, v_cache, cache_seqlens, seqlen_k, page_table, cache_batch_idx, softmax_scale,
                        causal, num_splits, backend, (k_cache_scale, v_cache_scale), sinks,
                        window_of(window_left, window_right), softcap)


kvcache_fwd_fp8_op = _op.define("kvcache_fwd_fp8", kvcache_fwd_fp8, autocast=())


@torch.library.register_fake("flashhopper::kvcache_fwd_fp8")
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_cache_scale: torch.Tensor,
      v_cache_scale: torch.Tensor, cache_seqlens: Optional[torch.Tensor], seqlen_k: int,  # noqa: UP045
      page_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],  # noqa: UP045
      softmax_scale: float, causal: bool, num_splits: int, backend: str,
      sinks: Optional[torch.Tensor] = None,  # noqa: UP045
      window_left: int = -1, window_right: int = -1, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return _empty_outputs(q, v_cache)


# --- the e4m3 cache's append: flashhopper::kvcache_append_fp8 ---

def kvcache_append_fp8(k_cache: torch.Tensor, v_cache: torch.Tensor, k_cache_scale: torch.Tensor,
                       v_cache_scale: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cache_seqlens: Optional[torch.Tensor], seqlen_offset: int,  # noqa: UP045
                       page_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],  # noqa: UP045
                       hadamard_seed: Optional[int]) -> None:  # noqa: UP045
    """kvcache_append into an e4m3 cache: each new row quantized with its own scale (kvcache_fp8.quantize_rows; K
    with ``hadamard_seed``'s transform), data and scale written at the row's place: one kernel launch where it takes
    the layout (_append_fp8_kernel_takes), torch ops with device indices otherwise (graph-capturable either way)."""
    if k.numel() == 0:
        return
    if _append_fp8_kernel_takes(k_cache, v_cache, k_cache_scale, v_cache_scale, k, v, cache_seqlens, page_table,
                                cache_batch_idx):
        _launch_append_fp8(k_cache, v_cache, k_cache_scale, v_cache_scale, k, v, cache_seqlens, seqlen_offset,
                           page_table, cache_batch_idx, hadamard_seed)
        return
    index = _append_index(k_cache, k, cache_seqlens, seqlen_offset, page_table, cache_batch_idx)
    for cache, scale, x, seed in ((k_cache, k_cache_scale, k, hadamard_seed), (v_cache, v_cache_scale, v, None)):
        data, s = kvcache_fp8.quantize_rows(x, seed)   # (b, s_new, h, d), (b, s_new, h)
        cache.index_put_(index, data)
        # scale (pages, heads, page_size): the same (page, row) pairs, heads in between
        scale.permute(0, 2, 1).index_put_(index, s)


def _append_fp8_kernel_takes(k_cache: torch.Tensor, v_cache: torch.Tensor, k_cache_scale: torch.Tensor,
                             v_cache_scale: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cache_seqlens: torch.Tensor | None, page_table: torch.Tensor | None,
                             cache_batch_idx: torch.Tensor | None) -> bool:
    """Whether the extension's quantizing append (cpp/kvcache_append.cu: a warp per new row, K and V in one launch)
    can write these: what _append_kernel_takes asks of the 16-bit rows and index tensors, head dim 64, 128 or 256 of
    bfloat16 / float16, e4m3 caches with 8-byte aligned rows and float32 scales with tokens contiguous. Otherwise the
    torch ops (quantize_rows and index writes)."""
    if (k.dtype not in (torch.bfloat16, torch.float16) or v.dtype != k.dtype or k.shape[3] not in (64, 128, 256)
            or v.shape[3] != k.shape[3] or k_cache.dtype != kvcache_fp8.E4M3 or v_cache.dtype != kvcache_fp8.E4M3):
        return False
    if not _append_kernel_here(k_cache, "kvcache_append_fp8") or not (_rows_16b(k) and _rows_16b(v)):
        return False
    for x in (k_cache, v_cache):
        if x.stride(3) != 1 or x.data_ptr() % 16 or any(st % 8 for st in x.stride()[:3]):
            return False
    for s in (k_cache_scale, v_cache_scale):
        if s.dtype != torch.float32 or (s.stride(2) != 1 and s.shape[2] > 1) or s.device != k_cache.device:
            return False
    return _index_layout_ok(cache_seqlens, page_table, cache_batch_idx)


def _launch_append_fp8(k_cache: torch.Tensor, v_cache: torch.Tensor, k_cache_scale: torch.Tensor,
                       v_cache_scale: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cache_seqlens: torch.Tensor | None, seqlen_offset: int, page_table: torch.Tensor | None,
                       cache_batch_idx: torch.Tensor | None, hadamard_seed: int | None) -> None:
    scales = (k_cache_scale, v_cache_scale)
    _append_launch(k_cache, v_cache, k, v, page_table, scales, hadamard_seed).run(
        k_cache, v_cache, k, v, cache_seqlens, seqlen_offset, page_table, cache_batch_idx, scales)


kvcache_append_fp8_op = _op.define("kvcache_append_fp8", kvcache_append_fp8, autocast=(),
                                   mutates_args=("k_cache", "v_cache", "k_cache_scale", "v_cache_scale"))


@torch.library.register_fake("flashhopper::kvcache_append_fp8")
def _(k_cache: torch.Tensor, v_cache: torch.Tensor, k_cache_scale: torch.Tensor, v_cache_scale: torch.Tensor,
      k: torch.Tensor, v: torch.Tensor, cache_seqlens: Optional[torch.Tensor], seqlen_offset: int,  # noqa: UP045
      page_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],  # noqa: UP045
      hadamard_seed: Optional[int]) -> None:  # noqa: UP045
    return None


def _append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: Any, v: Any, cache_seqlens: torch.Tensor | int,
            page_table: torch.Tensor | None, cache_batch_idx: torch.Tensor | None,
            scales: tuple[Any, Any] | None, seed: int | None) -> None:
    """The validated append of flash_attn_with_kvcache and append_kvcache, through the ops (torch.compile, CUDA
    graphs): ``scales`` an e4m3 cache's (the quantizing op), ``seed`` its Hadamard seed as int64. Under no_grad."""
    lengths = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    offset = 0 if lengths is not None else int(cache_seqlens)
    if scales is not None:
        kvcache_append_fp8_op(k_cache, v_cache, scales[0], scales[1], k, v, lengths, offset, page_table,
                              cache_batch_idx, seed)
    else:
        kvcache_append_op(k_cache, v_cache, k, v, lengths, offset, page_table, cache_batch_idx)


# --- the eager fast path (issue #20's, for this entry point) ---

class _Plan(NamedTuple):
    """What a repeated eager call runs: the append (when it has k/v) and the prepared kernel call."""

    launch: KVCacheLaunch
    seqlen_new: int
    offset: int  # the append's first position when cache_seqlens is an int (else 0)
    fp8: bool = False  # an e4m3 cache: the quantizing append, q's transform, the scales' pointers
    seed: int | None = None  # the e4m3 cache's Hadamard seed (int64), or None
    append: _AppendLaunch | None = None  # the append kernel's call, where the first call's layout takes it


_PLANS = _plans.Plans()


def _call_key(q: Any, k_cache: Any, v_cache: Any, k: Any, v: Any, cache_seqlens: Any, page_table: Any,
              cache_batch_idx: Any, softmax_scale: Any, causal: Any, num_splits: Any, return_lse: Any, backend: Any,
              window_size: Any, softcap: Any, k_cache_scale: Any = None, v_cache_scale: Any = None,
              hadamard_seed: Any = None, sinks: Any = None) -> Any:
    """Everything the full path's checks and the launch read, or None where the fast path does not apply (a
    tensor subclass, or anything but a plain tensor where one is expected)."""
    tensors = (q, k_cache, v_cache, k, v, page_table, cache_batch_idx, k_cache_scale, v_cache_scale, sinks)
    for x in tensors:
        if x is not None and type(x) is not torch.Tensor:
            return None
    if isinstance(cache_seqlens, torch.Tensor):
        if type(cache_seqlens) is not torch.Tensor:
            return None
        lengths = _plans.meta(cache_seqlens)
    else:
        lengths = _plans.scalars(cache_seqlens)
    return (tuple(None if x is None else _plans.meta(x) for x in tensors), lengths,
            _plans.scalars(softmax_scale, causal, num_splits, return_lse, backend, window_size, softcap, hadamard_seed))


def _run_plan(plan: _Plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
              v: torch.Tensor | None, cache_seqlens: Any, page_table: torch.Tensor | None,
              cache_batch_idx: torch.Tensor | None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
              sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The call through its plan, or None (nothing done) where a pointer is not 16-byte aligned."""
    if _plans.pointers(q, k_cache, v_cache, *(scales or ())) is None:
        return None
    lengths = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    if k is not None:
        assert v is not None
        # The key holds the layout the plan's append was made for: only the pointers' alignment is each call's.
        if plan.append is not None and _plans.pointers(k, v) is not None:
            plan.append.run(k_cache, v_cache, k, v, lengths, plan.offset, page_table, cache_batch_idx, scales)
        elif plan.fp8:
            assert scales is not None  # (the key: the first call had them)
            with torch.no_grad():  # (torch ops: k / v that require grad must not make the cache require it)
                kvcache_append_fp8(k_cache, v_cache, scales[0], scales[1], k, v, lengths, plan.offset, page_table,
                                   cache_batch_idx, plan.seed)
        else:
            return None
    if lengths is not None and plan.seqlen_new:
        lengths = lengths + plan.seqlen_new
    if plan.fp8:
        with torch.no_grad():
            q = kvcache_fp8.transform_q(q, plan.seed)
    out, lse = _empty_outputs(q, v_cache)
    plan.launch.run(q, k_cache, v_cache, out, lse, page_table if page_table is not None else cache_batch_idx, lengths,
                    scales, None if sinks is None else sinks.contiguous())
    return out, lse


def _plan_of(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
             v: torch.Tensor | None, cache_seqlens: Any, page_table: torch.Tensor | None,
             cache_batch_idx: torch.Tensor | None, shapes: CacheShapes, seqlen_k: int, scale: float, causal: bool,
             num_splits: int, backend: str, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
             seed: int | None = None, window: tuple[int, int] | None = None, softcap: float = 0.0) -> _Plan | None:
    """The plan of a call that just ran the kernel on the full path, or None where the fast path would have to
    copy something per call (index tensors that are not contiguous, an append the kernel does not take).
    ``scales``: an e4m3 cache's (its append is torch ops, any layout), ``seed`` its Hadamard seed (int64)."""
    if seqlen_k == 0 or q.numel() == 0 or (page_table is not None and page_table.shape[1] > 1
                                            and page_table.stride(1) != 1):
        return None
    if any(t is not None and not t.is_contiguous() for t in (cache_batch_idx, cache_seqlens
                                                            if isinstance(cache_seqlens, torch.Tensor) else None)):
        return None
    lengths = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    if (k is not None and scales is None
            and not _append_kernel_takes(k_cache, v_cache, k, v, lengths, page_table, cache_batch_idx)):
        return None
    append = None
    if k is not None and (scales is None or _append_fp8_kernel_takes(k_cache, v_cache, scales[0], scales[1], k, v,
                                                                     lengths, page_table, cache_batch_idx)):
        append = _append_launch(k_cache, v_cache, k, v, page_table, scales, seed)
    table = page_table if page_table is not None else cache_batch_idx
    launch = _prepare_kvcache_fwd(q, k_cache, v_cache, seqlen_k, table, scale, causal, num_splits, backend, scales,
                                  window, softcap)
    offset = int(cache_seqlens) if cache_seqlens is not None and lengths is None else 0
    return _Plan(launch, shapes.seqlen_new, offset, scales is not None, seed, append)


# --- the public function ---

@overload
def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = ..., v: torch.Tensor | None = ...,
                            cache_seqlens: torch.Tensor | int | None = ..., page_table: torch.Tensor | None = ...,
                            cache_batch_idx: torch.Tensor | None = ..., softmax_scale: float | None = ...,
                            causal: bool = ..., num_splits: int = ..., return_lse: Literal[False] = ...,
                            backend: str | None = ..., *, window_size: tuple[int, int] = ...,
                            softcap: float = ..., k_cache_scale: torch.Tensor | None = ...,
                            v_cache_scale: torch.Tensor | None = ...,
                            hadamard_seed: int | None = ..., sinks: torch.Tensor | None = ...,
                            return_softmax_lse: Literal[False] | None = ...) -> torch.Tensor: ...


@overload
def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = ..., v: torch.Tensor | None = ...,
                            cache_seqlens: torch.Tensor | int | None = ..., page_table: torch.Tensor | None = ...,
                            cache_batch_idx: torch.Tensor | None = ..., softmax_scale: float | None = ...,
                            causal: bool = ..., num_splits: int = ..., *, return_lse: Literal[True],
                            backend: str | None = ..., window_size: tuple[int, int] = ...,
                            softcap: float = ..., k_cache_scale: torch.Tensor | None = ...,
                            v_cache_scale: torch.Tensor | None = ...,
                            hadamard_seed: int | None = ..., sinks: torch.Tensor | None = ...,
                            return_softmax_lse: bool | None = ...) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = ..., v: torch.Tensor | None = ...,
                            cache_seqlens: torch.Tensor | int | None = ..., page_table: torch.Tensor | None = ...,
                            cache_batch_idx: torch.Tensor | None = ..., softmax_scale: float | None = ...,
                            causal: bool = ..., num_splits: int = ..., return_lse: bool = ...,
                            backend: str | None = ..., *, window_size: tuple[int, int] = ...,
                            softcap: float = ..., k_cache_scale: torch.Tensor | None = ...,
                            v_cache_scale: torch.Tensor | None = ...,
                            hadamard_seed: int | None = ..., sinks: torch.Tensor | None = ...,
                            return_softmax_lse: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            cache_seqlens: torch.Tensor | int | None = None, page_table: torch.Tensor | None = None,
                            cache_batch_idx: torch.Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = True, num_splits: int = 0, return_lse: bool = False,
                            backend: str | None = None, *, window_size: tuple[int, int] = (-1, -1),
                            softcap: float = 0.0, k_cache_scale: torch.Tensor | None = None,
                            v_cache_scale: torch.Tensor | None = None, hadamard_seed: int | None = None,
                            sinks: torch.Tensor | None = None, return_softmax_lse: bool | None = None
                            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of new queries over a KV cache, optionally appending new keys and values to it first
    (flash-attn's ``flash_attn_with_kvcache``: decode, and chunked prefill).

    q: (batch, seqlen_q, nheads_q, headdim), seqlen_q from 1 (a decode step) up. k_cache, v_cache: contiguous
    (batch_cache, max_seqlen, nheads_kv, headdim), entry b in row cache_batch_idx[b] (int32 (batch,); without
    it row b, and batch_cache must be batch); or paged (num_pages, page_size, nheads_kv, headdim) with page_table
    int32 (batch, max_pages_per_seq): entry b's key j in page page_table[b, j // page_size], row j % page_size
    (page_size a multiple of 16). The caches share q's dtype and device; nheads_q a multiple of nheads_kv (GQA:
    query head h reads kv head h // (nheads_q // nheads_kv)); V's head dim may differ for the reference. Any
    strides with a contiguous last dim (the kernel: 16-byte multiples).

    cache_seqlens: each entry's cached keys before the call, int32 (batch,) on q's device, or a Python int for
    all; None: the whole contiguous cache (max_seqlen each; required with page_table, and with k/v).
    k, v: (batch, seqlen_new, nheads_kv, headdim) or None. When given they are written into the cache in place
    at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (crossing pages as the page table says),
    before attending; entry b then attends to its first cache_seqlens[b] + seqlen_new keys. cache_seqlens itself
    is not modified (as in flash-attn: the caller advances it). The positions must fit the cache (not checked
    on the GPU without FLASHHOPPER_DEBUG_KVCACHE=1, which reads the lengths and indices on the host; a position
    outside is a device-side index error).

    causal: bottom-right aligned per entry, query row i of entry b sees key j iff j <= i + seqlen_k_b - seqlen_q
    (seqlen_k_b: the entry's keys after the append). **Default True**, unlike flash-attn (whose default is
    False): pass causal=False for its default. With one query row both are the same.
    num_splits: split-KV, each entry's keys cut over that many CTAs whose partial results are merged (0: a
    heuristic from the tiles, the key blocks and the device's multiprocessors; 1: no split; at most 256, and
    never more than the key blocks). return_lse (or flash-attn's name for it, return_softmax_lse, so that a
    drop-in call keeps its keyword): also return lse float32 (batch, nheads_q, seqlen_q), natural
    log; a row that sees no key (an entry with none) has out = 0 and lse = -inf (the sink's logit with sinks).
    sinks: float32 (nheads_q,) learnable sink logits (gpt-oss), as flash_attn_func's: each row's softmax
    denominator gets exp(sinks[h]) with no value; the lse includes it. Split-KV adds it once, in the combine.
    backend: None picks the Hopper kernel for CUDA tensors where it runs and was built, else the Ampere one (an
    error saying what to rebuild with when this build has neither), and the float64 reference for CPU tensors;
    "sm90", "sm80" or "reference" (any dtype and head dim) by name.

    Not differentiable (an inference entry point, as flash-attn's): inputs that require grad are read as
    detached, the result has no gradient. window_size=(left, right) as flash_attn_func's (-1 unbounded; with causal
    the right edge is 0), bottom-right aligned per entry: query row i of entry b sees keys i + L_b - seqlen_q - left
    .. i + L_b - seqlen_q + right (L_b its keys); key blocks outside the window are skipped, and split-KV splits the
    window's blocks (the window kernels: FLASHHOPPER_MASKS with window, as flash_attn_func's). softcap=c > 0 (Gemma
    2): scores become c * tanh(s / c) before the softmax (the softcap kernels: FLASHHOPPER_SCORE_MODS with softcap).
    Not supported: rotary embeddings, cache_leftpad and ALiBi (no such arguments).

    e4m3 caches (the Hopper kernel; docs/kvcache-fp8.md, kvcache_fp8.py): k_cache and v_cache of
    torch.float8_e4m3fn with k_cache_scale / v_cache_scale float32 (num_pages, nheads_kv, page_size) (contiguous
    caches: (batch_cache, nheads_kv, max_seqlen)), one scale per token and kv head, tokens contiguous; q, k and v
    16-bit. New k/v rows are quantized into the cache (each row its own scale; K transformed by the random-sign
    Hadamard of ``hadamard_seed`` first, when given, and q then gets the same transform in the call: pass the seed
    the cache was written with on every call). kvcache_fp8.quantize_kv_cache converts a 16-bit cache. Under CUDA autocast q, k and v run in the autocast dtype, like SDPA's inputs; the caches are
    never cast (their dtype must be that one). No host synchronization on the kernel path: the call (append
    included) can be captured in a CUDA graph and replayed with cache_seqlens and page_table changed in place.

    Eager calls that repeat a configuration (the same dtypes, shapes, strides and arguments: a decode loop) take a
    fast path, as flash_attn_func's (docs/architecture.md): the checks and the launch preparation of the first
    such call are kept, and a repeat appends, allocates and launches (e4m3 caches: the quantizing append's torch
    ops and q's transform too).

    Returns out (batch, seqlen_q, nheads_q, headdim_v) like q, or (out, lse).
    """
    if return_softmax_lse is not None:  # flash-attn's keyword: the same flag
        validation.check_flag("return_softmax_lse", return_softmax_lse)
        if return_softmax_lse:
            return_lse = True
    key = None
    fp8 = _is_fp8(k_cache, v_cache)
    # (FLASHHOPPER_DEBUG_KVCACHE's value checks are per call: the full path runs them.)
    if _plans.direct() and os.environ.get(DEBUG_ENV) != "1":
        key = _call_key(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, softmax_scale, causal,
                        num_splits, return_lse, backend, window_size, softcap, k_cache_scale, v_cache_scale,
                        hadamard_seed, sinks)
        plan = None if key is None else _PLANS.get(key)
        if plan is not None:
            scales = (k_cache_scale, v_cache_scale) if plan.fp8 else None
            res = _run_plan(plan, q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, scales, sinks)
            if res is not None:
                return res if return_lse else res[0]
    if _autocast.enabled():
        q, k, v = _autocast.cast(q, k, v)
    shapes, scale = check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx,
                                         softmax_scale, causal, num_splits, fp8)
    check_cache_scales(k_cache, v_cache, k_cache_scale, v_cache_scale, hadamard_seed, q, fp8)
    validation.check_flag("return_lse", return_lse)
    validation.check_sinks(sinks, q)
    cap = validation.check_softcap(softcap)
    causal, window = normalize_window(causal, validation.check_window_size(window_size))
    name = resolve_backend(q, shapes, causal, backend, "e4m3" if fp8 else "on", window, cap)
    if name != "reference":
        _check_kernel_layouts(q, k_cache, v_cache)
    if not torch.compiler.is_compiling() and (not q.is_cuda or os.environ.get(DEBUG_ENV) == "1"):
        check_kvcache_values(shapes, cache_seqlens, page_table, cache_batch_idx)
    lengths = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    with torch.no_grad():
        seed = None if hadamard_seed is None else seed_int64(hadamard_seed)
        if k is not None:
            _append(k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx,
                    (k_cache_scale, v_cache_scale) if fp8 else None, seed)
        if lengths is not None:
            # Each entry's keys after the append, made on the device (graph-safe); the capacity bounds them.
            if shapes.seqlen_new:
                lengths = lengths + shapes.seqlen_new
            seqlen_k = shapes.capacity
        else:  # every entry has the same keys: the kernel takes the count alone
            seqlen_k = shapes.capacity if cache_seqlens is None else int(cache_seqlens) + shapes.seqlen_new
        if fp8:
            out, lse = kvcache_fwd_fp8_op(kvcache_fp8.transform_q(q, seed), k_cache, v_cache, k_cache_scale,
                                          v_cache_scale, lengths, seqlen_k, page_table, cache_batch_idx, scale, causal,
                                          int(num_splits), name, sinks, *(window or (-1, -1)), cap)
        else:
            out, lse = kvcache_fwd_op(q, k_cache, v_cache, lengths, seqlen_k, page_table, cache_batch_idx, scale,
                                      causal, int(num_splits), name, sinks, *(window or (-1, -1)), cap)
    if key is not None and name in KVCACHE_BACKENDS:
        plan = _plan_of(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, shapes, seqlen_k, scale,
                        causal, int(num_splits), name, (k_cache_scale, v_cache_scale) if fp8 else None, seed, window,
                        cap)
        if plan is not None:
            _PLANS.put(key, plan)
    return (out, lse) if return_lse else out


def append_kvcache(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cache_seqlens: torch.Tensor | int, page_table: torch.Tensor | None = None,
                   cache_batch_idx: torch.Tensor | None = None, *, k_cache_scale: torch.Tensor | None = None,
                   v_cache_scale: torch.Tensor | None = None, hadamard_seed: int | None = None) -> None:
    """Write new keys and values into a KV cache in place, without attending: what flash_attn_with_kvcache(q,
    k_cache, v_cache, k, v, ...) writes before it attends, for a serving engine that prefilled prompts through
    flash_attn_varlen_func and now stores their K/V (issue #22).

    k, v: (batch, seqlen_new, nheads_kv, headdim) and (..., headdim_v), entry b's token t written at position
    cache_seqlens[b] + t of its cache (int32 (batch,) on k's device, or a Python int for all), across pages as
    page_table says. k_cache, v_cache, page_table, cache_batch_idx, k_cache_scale, v_cache_scale and hadamard_seed
    as flash_attn_with_kvcache's (there k's batch, device and dtype play q's part): a contiguous or paged cache of
    k's dtype, or an e4m3 one with its scales, the new rows quantized (K with the seed's transform: pass the seed
    the cache is read with). Every argument is checked, with flash_attn_with_kvcache's checks and messages, before
    anything is written. cache_seqlens is not modified (as flash_attn_with_kvcache leaves it, flash-attn's
    convention): the caller advances the lengths by seqlen_new. The positions must fit the cache (checked on the
    CPU; on the GPU only with FLASHHOPPER_DEBUG_KVCACHE=1, which reads them on the host). No host synchronization
    otherwise (the ops flashhopper::kvcache_append / kvcache_append_fp8): CUDA-graph capturable, traceable by
    torch.compile(fullgraph=True). Not differentiable: k and v are read as detached. Under CUDA autocast k and v
    are cast as flash_attn_with_kvcache casts them."""
    fp8 = _is_fp8(k_cache, v_cache)
    if _autocast.enabled():
        k, v = _autocast.cast(k, v)
    # k stands where q stands in flash_attn_with_kvcache's checks: the batch, device and dtype the rest must match.
    validation.check_tensor("k", k)
    if k.dim() != 4:
        raise ValueError(f"k must have 4 dimensions (batch, seqlen_new, nheads_kv, headdim), got shape "
                         f"{tuple(k.shape)}")
    validation.check_dtype("k", k)
    shapes = check_cache_inputs(k, "k", k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, fp8,
                                queries=False)
    check_cache_scales(k_cache, v_cache, k_cache_scale, v_cache_scale, hadamard_seed, k, fp8)
    if not torch.compiler.is_compiling() and (not k.is_cuda or os.environ.get(DEBUG_ENV) == "1"):
        check_kvcache_values(shapes, cache_seqlens, page_table, cache_batch_idx)
    with torch.no_grad():
        _append(k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx,
                (k_cache_scale, v_cache_scale) if fp8 else None,
                None if hadamard_seed is None else seed_int64(hadamard_seed))
