#!/usr/bin/env python3
"""KV-cache attention (issue #22): decode steps and a chunked prefill through flash_attn_with_kvcache, against
FlashAttention-3's flash_attn_with_kvcache and a device-to-device copy (the bandwidth ceiling), same run,
providers interleaved (median of --rounds), L2 flushed between runs (report.timing). Decode steps are timed as
CUDA-graph replays (a serving engine's decode step; the GPU's time alone) unless --eager.

- decode: one query token, d128, 32 query / 8 kv heads, bf16, every entry's cache full (cache_seqlens = cache_len
  on the device), for (batch, cache_len) in (8, 8k), (64, 2k), (1, 128k), (32, 32k), (128, 4k); caches contiguous,
  in pages of 16 and in pages of 128 (random page order). Providers: flashhopper (num_splits=0: the heuristic),
  fa3 (num_splits=0; --fa3-path / --fa3 or $FLASHHOPPER_FA3 / $FLASHHOPPER_FA3_PATH naming a folder with
  flash_attn_interface.py, e.g. the fa3-full peer build; skipped with the reason when absent), and copy (torch
  copy_ of a buffer as large as the K/V bytes). TB/s: the K/V bytes the call reads (sum over entries of
  seqlen_k x nheads_kv x headdim x 2 tensors x 2 bytes; q and out are negligible) over the time; the copy's:
  the bytes it reads and writes (2 x its buffer) over its time. Per row: time, TB/s, the fraction of the copy's
  TB/s, and FA3's time over ours (> 1: we are faster).
- prefill: 2k new query tokens (32 query / 8 kv heads, d128, causal bottom-right) over a 32k-key cache (batch 1:
  the chunk's own keys already in it), contiguous and in pages of 128, against our dense flash_attn_func on the
  same q and k/v = the first 32k cache rows (--prefill-headdims: d64 / d256 as well); TFLOPS count the visible
  (query, key) pairs exactly (4 x pairs x headdim x heads, pairs = sum_i (sk - sq + i + 1)).

- --cache fp8 (decode and spec): the same shapes with an e4m3 cache (kvcache_fp8: e4m3 K/V, a float32 scale per
  token and kv head; --hadamard-seed for K's transform and q's), the bytes read counted as e4m3 data plus scales.
  Providers: flashhopper (the e4m3 cache), flashhopper_bf16 (our bf16 cache of the same values, same run: the
  fp8 / bf16 time ratio) and fa3 (FA3's e4m3 path: q, K and V e4m3 with per-(batch, kv head) descales, 1 here).

Caches smaller than twice the L2 (--l2-mb) are timed in turns over several copies, so that no call finds the
previous call's bytes in L2 (every default shape is larger already).

    python bench/bench_decode.py --fa3-path .peers/fa3-full --rounds 3 --out
"""
from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flashhopper import flash_attn_func, flash_attn_with_kvcache
from flashhopper.flops import tflops, visible_pairs
from flashhopper.report import fa3
from flashhopper.report.environment import environment, source_root
from flashhopper.report.timing import FLUSHES, graphed, interleaved, make_timer

Fn = Callable[[], Any]

ROOT = Path(__file__).resolve().parent.parent
FA3_ENV = "FLASHHOPPER_FA3"  # this script's own name for the FA3 folder, beside report.fa3's FLASHHOPPER_FA3_PATH
DECODE_SHAPES: tuple[tuple[int, int], ...] = ((8, 8192), (64, 2048), (1, 131072), (32, 32768), (128, 4096))
LAYOUTS: tuple[str, ...] = ("contiguous", "paged16", "paged128")
NHEADS_Q, NHEADS_KV, HEADDIM = 32, 8, 128
DTYPE = torch.bfloat16
PREFILL_Q, PREFILL_K = 2048, 32768


# --- pure functions (tested without a GPU) ---

def page_size_of(layout: str) -> int | None:
    """"contiguous" -> None, "paged<N>" -> N."""
    if layout == "contiguous":
        return None
    if not layout.startswith("paged") or not layout[5:].isdigit() or int(layout[5:]) < 1:
        raise ValueError(f"layout must be 'contiguous' or 'paged<page size>', got {layout!r}")
    return int(layout[5:])


def kv_bytes(seqlens_k: list[int], nheads_kv: int, headdim: int, element_size: int = 2, scale_bytes: int = 0) -> int:
    """The K and V bytes an attention call over caches of these entry lengths reads (``scale_bytes``: per token and
    kv head of each, an e4m3 cache's scale)."""
    return sum(seqlens_k) * nheads_kv * (headdim * element_size + scale_bytes) * 2


def causal_pairs(seqlen_q: int, seqlen_k: int) -> int:
    """(query row, key) pairs a bottom-right causal call sees: sum over rows i of (seqlen_k - seqlen_q + i + 1),
    each clipped to 0..seqlen_k (flops.visible_pairs, in closed form for seqlen_k >= seqlen_q)."""
    if seqlen_k >= seqlen_q:
        return seqlen_q * (seqlen_k - seqlen_q) + seqlen_q * (seqlen_q + 1) // 2
    return visible_pairs(seqlen_q, seqlen_k, True, None)


def prefill_flops(seqlen_q: int, seqlen_k: int, nheads: int, headdim: int) -> int:
    """FLOPs of a causal chunk: two matmuls of 2 x headdim per visible pair and head."""
    return 4 * causal_pairs(seqlen_q, seqlen_k) * headdim * nheads


def copies_for_l2(nbytes: int, l2_bytes: int, limit: int = 16) -> int:
    """How many copies of a working set of ``nbytes`` to rotate through so that they exceed twice the L2."""
    if nbytes <= 0:
        return 1
    return max(1, min(limit, math.ceil(2 * l2_bytes / nbytes) if nbytes < 2 * l2_bytes else 1))


def tbps(nbytes: float, ms: float) -> float:
    """Terabytes per second of ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e12


def default_out(now: dt.datetime | None = None) -> Path:
    return ROOT / "bench" / "results" / f"decode-{(now or dt.datetime.now()).strftime('%Y-%m-%d')}.json"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as markdown tables, one per section."""
    out = []
    decode = [r for r in rows if (r["section"] == "decode" or r["section"].startswith("spec"))
              and r.get("cache", "bf16") == "bf16"]
    fp8 = [r for r in rows if r.get("cache") == "fp8" and "us_flashhopper" in r]
    if fp8:
        out += ["| step | batch | cache | layout | splits | fp8 us | TB/s | of copy | bf16 us | fp8 / bf16 | "
                "FA3 fp8 us | FA3 / ours |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in fp8:
            fa, b16 = r.get("us_fa3"), r.get("us_flashhopper_bf16")
            out.append(f"| {r['section']} | {r['batch']} | {r['cache_len']} | {r['layout']} | {r.get('num_splits', '')} | "
                       f"{r['us_flashhopper']:.1f} | {r['tbps_flashhopper']:.2f} | {r['of_copy']:.2f} | "
                       + (f"{b16:.1f} | {r['fp8_over_bf16']:.3f} | " if b16 is not None else "- | - | ")
                       + (f"{fa:.1f} | {r['fa3_over_ours']:.2f} |" if fa is not None else "- | - |"))
        out.append("")
    if decode:
        out += ["| step | batch | cache | layout | splits | flashhopper us | TB/s | of copy | FA3 us | FA3 TB/s | "
                "FA3 / ours |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in decode:
            fa = r.get("us_fa3")
            if "us_flashhopper" not in r:  # not timed (the reason was printed)
                continue
            out.append(f"| {r['section']} | {r['batch']} | {r['cache_len']} | {r['layout']} | {r.get('num_splits', '')} | "
                       f"{r['us_flashhopper']:.1f} | {r['tbps_flashhopper']:.2f} | {r['of_copy']:.2f} | "
                       + (f"{fa:.1f} | {r['tbps_fa3']:.2f} | {r['fa3_over_ours']:.2f} |" if fa is not None
                          else "- | - | - |"))
        copies = {(r["batch"], r["cache_len"]): r["tbps_copy"] for r in decode}
        out.append("")
        out.append("copy TB/s (read + write): " + ", ".join(f"{b}x{n}: {t:.2f}" for (b, n), t in copies.items()))
    prefill = [r for r in rows if r["section"] == "prefill"]
    if prefill:
        out += ["", "| chunk | cache | d | layout | kvcache us | TFLOPS | dense us | dense TFLOPS | kvcache / dense | "
                "FA3 us |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in prefill:
            fa = r.get("us_fa3")
            if "us_flashhopper" not in r:
                continue
            out.append(f"| {r['seqlen_q']} | {r['seqlen_k']} | {r['headdim']} | {r['layout']} | "
                       f"{r['us_flashhopper']:.1f} | {r['tflops_flashhopper']:.0f} | {r['us_dense']:.1f} | "
                       f"{r['tflops_dense']:.0f} | {r['ratio_vs_dense']:.3f} | {'-' if fa is None else f'{fa:.1f}'} |")
    return "\n".join(out)


# --- the GPU part ---

def make_cache(batch: int, cache_len: int, layout: str, generator: torch.Generator, headdim: int = HEADDIM
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(k_cache, v_cache, page_table or None) holding batch x cache_len random keys: contiguous (batch, cache_len,
    h, d), or pages in random order with a page table."""
    page = page_size_of(layout)
    if page is None:
        shape = (batch, cache_len, NHEADS_KV, headdim)
        table = None
    else:
        per = math.ceil(cache_len / page)
        shape = (batch * per, page, NHEADS_KV, headdim)
        table = torch.randperm(batch * per, device="cuda", generator=generator).view(batch, per).to(torch.int32)
    k = torch.randn(shape, dtype=DTYPE, device="cuda", generator=generator)
    v = torch.randn(shape, dtype=DTYPE, device="cuda", generator=generator)
    return k, v, table


def rotating(fns: list[Fn]) -> Fn:
    """A callable that calls the next of ``fns`` each time (one: itself)."""
    if len(fns) == 1:
        return fns[0]
    turn = itertools.cycle(fns)
    return lambda: next(turn)()


def fa3_module() -> tuple[Any, str]:
    """(FA3's flash_attn_interface module or None, why not)."""
    if not fa3.configured():
        return None, f"FA3 not configured (--fa3-path, ${FA3_ENV} or ${fa3.ENV})"
    try:
        iface = fa3.load()
    except ImportError as e:
        return None, str(e)
    if not hasattr(iface, "flash_attn_with_kvcache"):
        return None, f"FA3 from {fa3.path()} has no flash_attn_with_kvcache"
    return iface, ""


def first(x: Any) -> Any:
    return x[0] if isinstance(x, tuple) else x


GRAPHED: dict[str, bool] = {}  # provider -> whether its last timed calls were CUDA-graph replays


def provider_fns(q: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
                 lens: torch.Tensor, iface: Any, graphs: bool = False) -> tuple[dict[str, Fn], dict[str, str]]:
    """The timed calls over the cache copies (rotated), each run once first; providers that fail are left out with
    the reason. ``graphs``: each call captured in a CUDA graph and replayed (a serving engine's decode step: the
    GPU's time alone, no host time per call), where the capture works (GRAPHED says)."""
    ours = [lambda k=k, v=v, t=t: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, page_table=t, num_splits=0)
            for k, v, t in caches]
    candidates: dict[str, list[Fn]] = {"flashhopper": ours}
    if iface is not None:
        candidates["fa3"] = [lambda k=k, v=v, t=t: first(iface.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=lens, page_table=t, causal=True, num_splits=0)) for k, v, t in caches]
    return timed_providers(candidates, graphs)


def timed_providers(candidates: dict[str, list[Fn]], graphs: bool) -> tuple[dict[str, Fn], dict[str, str]]:
    """Each provider's calls run once (one that fails is left out with the reason), then rotated; ``graphs``: each
    call captured in a CUDA graph and replayed, where the capture works (GRAPHED says)."""
    fns: dict[str, Fn] = {}
    skipped: dict[str, str] = {}
    for name, calls in candidates.items():
        try:
            for call in calls:
                call()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (a build without the kernel, an FA3 without the feature: said)
            skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        if graphs:
            replays = [graphed(call) for call in calls]
            calls = [r for r, _ in replays]
            GRAPHED[name] = all(ok for _, ok in replays)
        fns[name] = rotating(calls)
    return fns, skipped


def fp8_provider_fns(q: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
                     lens: torch.Tensor, iface: Any, seed: int | None, graphs: bool = False
                     ) -> tuple[dict[str, Fn], dict[str, str]]:
    """provider_fns for an e4m3 cache of the same values: ours over it, ours over the bf16 caches, and FA3's e4m3
    path (q cast to e4m3, unit descales)."""
    from flashhopper import kvcache_fp8
    q8s = [kvcache_fp8.quantize_kv_cache(k, v, seed) + (t,) for k, v, t in caches]
    candidates: dict[str, list[Fn]] = {
        "flashhopper": [lambda c=c: flash_attn_with_kvcache(q, c[0], c[1], cache_seqlens=lens, page_table=c[4],
                                                            k_cache_scale=c[2], v_cache_scale=c[3], hadamard_seed=seed)
                        for c in q8s],
        "flashhopper_bf16": [lambda k=k, v=v, t=t: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, page_table=t)
                             for k, v, t in caches]}
    if iface is not None:
        qf8 = q.to(torch.float8_e4m3fn)
        ones = torch.ones(q.shape[0], caches[0][0].shape[2], dtype=torch.float32, device="cuda")
        candidates["fa3"] = [lambda c=c: first(iface.flash_attn_with_kvcache(
            qf8, c[0], c[1], cache_seqlens=lens, page_table=c[4], causal=True, num_splits=0, q_descale=ones,
            k_descale=ones, v_descale=ones)) for c in q8s]
    return timed_providers(candidates, graphs)


def our_splits(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor | None, seqlen_k: int) -> int | None:
    """The split count the heuristic picks for this call (as the launch computes it), None without the kernel."""
    from flashhopper import _device, dispatch
    from flashhopper.kvcache import _kvcache_key, _kvcache_mask, _packs_gqa, kernel_num_splits
    try:
        entry = dispatch.require_kernel("fwd", _kvcache_key(q.dtype, q.shape[3], k.shape[3],
                                                            _kvcache_mask(q.shape[1], True)))
    except ValueError:
        return None
    b, sq, hq, _ = q.shape
    packed = _packs_gqa(sq, hq, k.shape[2])
    heads, rows = (k.shape[2], sq * (hq // k.shape[2])) if packed else (hq, sq)
    bound = seqlen_k if table is None else table.shape[1] * k.shape[1]
    return kernel_num_splits(0, b, heads, rows, bound, entry.block_m, entry.block_n,
                             _device.device_info(q.device.index).num_sms)


def section_decode(timer: Callable[[Fn], float], rounds: int, shapes: list[tuple[int, int]], layouts: list[str],
                   iface: Any, fa3_reason: str, l2_bytes: int, seed: int, graphs: bool = True,
                   seqlen_q: int = 1, cache: str = "bf16", hadamard_seed: int | None = None) -> list[dict[str, Any]]:
    rows = []
    for batch, cache_len in shapes:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        nbytes = (kv_bytes([cache_len] * batch, NHEADS_KV, HEADDIM) if cache == "bf16"
                  else kv_bytes([cache_len] * batch, NHEADS_KV, HEADDIM, 1, 4))
        n_copies = copies_for_l2(nbytes, l2_bytes)
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        q = torch.randn(batch, seqlen_q, NHEADS_Q, HEADDIM, dtype=DTYPE, device="cuda", generator=gen)
        lens = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
        for layout in layouts:
            caches = [make_cache(batch, cache_len, layout, gen) for _ in range(n_copies)]
            fns, skipped = (provider_fns(q, caches, lens, iface, graphs) if cache == "bf16"
                            else fp8_provider_fns(q, caches, lens, iface, hadamard_seed, graphs))
            if iface is None:
                skipped["fa3"] = fa3_reason
            fns["copy"] = lambda dst=dst, src=src: dst.copy_(src)
            ms = interleaved(fns, timer, rounds)
            row: dict[str, Any] = {"section": "decode" if seqlen_q == 1 else f"spec{seqlen_q}", "batch": batch, "cache_len": cache_len, "layout": layout,
                                   "nheads_q": NHEADS_Q, "nheads_kv": NHEADS_KV, "headdim": HEADDIM,
                                   "dtype": "bf16", "cache": cache, "hadamard_seed": hadamard_seed,
                                   "kv_bytes": nbytes, "cache_copies": n_copies,
                                   "num_splits": our_splits(q, caches[0][0], caches[0][2], cache_len),
                                   "graphed": {n: GRAPHED.get(n, False) for n in fns if n != "copy"},
                                   "skipped": skipped}
            for name, t in ms.items():
                row[f"us_{name}"] = t * 1e3
                row[f"tbps_{name}"] = tbps(2 * nbytes if name == "copy" else nbytes, t)
            if "flashhopper" not in ms:
                print(f"{row['section']} {cache} {batch}x{cache_len} {layout}: flashhopper not timed: {skipped.get('flashhopper')}",
                      flush=True)
                rows.append(row)
                continue
            row["of_copy"] = row["tbps_flashhopper"] / row["tbps_copy"]
            if "flashhopper_bf16" in ms:
                row["fp8_over_bf16"] = ms["flashhopper"] / ms["flashhopper_bf16"]
            if "fa3" in ms:
                row["fa3_over_ours"] = ms["fa3"] / ms["flashhopper"]
            rows.append(row)
            print(f"{row['section']} {cache} {batch}x{cache_len} {layout}: flashhopper {row['us_flashhopper']:.1f} us "
                  f"{row['tbps_flashhopper']:.2f} TB/s ({row['of_copy']:.2f} of copy, splits {row['num_splits']})"
                  + (f", FA3 {row['us_fa3']:.1f} us {row['tbps_fa3']:.2f} TB/s, FA3/ours x{row['fa3_over_ours']:.3f}"
                     if "fa3" in ms else f", FA3 not timed ({skipped.get('fa3')})"), flush=True)
            del caches, fns
        del src, dst
        torch.cuda.empty_cache()
    return rows


def section_prefill(timer: Callable[[Fn], float], rounds: int, layouts: list[str], iface: Any,
                    seed: int, headdim: int = HEADDIM) -> list[dict[str, Any]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sq, sk = PREFILL_Q, PREFILL_K
    q = torch.randn(1, sq, NHEADS_Q, headdim, dtype=DTYPE, device="cuda", generator=gen)
    lens = torch.full((1,), sk, dtype=torch.int32, device="cuda")
    flops = prefill_flops(sq, sk, NHEADS_Q, headdim)
    rows = []
    for layout in layouts:
        k, v, table = make_cache(1, sk, layout, gen, headdim)
        if table is None:
            kd, vd = k[:, :sk], v[:, :sk]
        else:  # the same keys, dense: the pages in table order
            kd = k[table[0].long()].flatten(0, 1)[None, :sk]
            vd = v[table[0].long()].flatten(0, 1)[None, :sk]
        fns, skipped = provider_fns(q, [(k, v, table)], lens, iface)
        fns["dense"] = lambda kd=kd, vd=vd: flash_attn_func(q, kd, vd, causal=True)
        ms = interleaved(fns, timer, rounds)
        row: dict[str, Any] = {"section": "prefill", "layout": layout, "seqlen_q": sq, "seqlen_k": sk,
                               "nheads_q": NHEADS_Q, "nheads_kv": NHEADS_KV, "headdim": headdim, "causal": True,
                               "flops": flops, "skipped": skipped}
        for name, t in ms.items():
            row[f"us_{name}"] = t * 1e3
            row[f"tflops_{name}"] = tflops(flops, t)
        if "flashhopper" in ms:
            row["ratio_vs_dense"] = ms["dense"] / ms["flashhopper"]
            print(f"prefill {sq} over {sk} d{headdim} {layout}: kvcache {row['tflops_flashhopper']:.0f} TFLOPS, dense "
                  f"{row['tflops_dense']:.0f}, kvcache / dense x{row['ratio_vs_dense']:.3f}"
                  + (f", FA3 {row['tflops_fa3']:.0f}" if "fa3" in ms else ""), flush=True)
        rows.append(row)
        del k, v, kd, vd, fns
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="*", choices=("decode", "spec", "prefill"), default=["decode", "prefill"],
                    help="spec: --spec-tokens query tokens per step (speculative decoding) on the decode shapes, "
                         "causal, GQA-packed rows")
    ap.add_argument("--spec-tokens", type=int, default=4)
    ap.add_argument("--cache", nargs="*", choices=("bf16", "fp8"), default=["bf16"],
                    help="decode/spec caches: bf16, and/or fp8 (e4m3 with per-token scales; against our bf16 cache "
                         "and FA3's e4m3 path)")
    ap.add_argument("--hadamard-seed", type=int, default=None, help="fp8 caches: K's (and q's) Hadamard transform")
    ap.add_argument("--shapes", nargs="*", metavar="BATCHxCACHE",
                    help="decode shapes, e.g. 8x8192 (default: " + " ".join(f"{b}x{n}" for b, n in DECODE_SHAPES) + ")")
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), help="contiguous, paged<page size>")
    ap.add_argument("--fa3-path", "--fa3", dest="fa3_path", type=Path,
                    help=f"folder with FA3's flash_attn_interface.py and flash_attn_3/ (default: ${FA3_ENV} or "
                         f"${fa3.ENV})")
    ap.add_argument("--prefill-headdims", type=int, nargs="*", choices=(64, 128, 256), default=[HEADDIM],
                    help="prefill: head dims to run (32 / 8 heads each)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each provider's median over them")
    ap.add_argument("--l2-mb", type=float, default=50, help="L2 size: smaller caches are rotated over copies")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eager", action="store_true",
                    help="time decode steps as eager calls (host time included where it exceeds the GPU's) rather "
                         "than CUDA-graph replays")
    ap.add_argument("--flush", choices=FLUSHES, default="write",
                    help="how the L2 is flushed before each timed call: write (do_bench's zeroing, whose dirty lines "
                         "the call then writes back) or read (clean lines; report.timing)")
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--out", type=Path, nargs="?", const=default_out(),
                    help=f"write JSON there (no value: {default_out().relative_to(ROOT)})")
    args = ap.parse_args(argv)
    shapes = list(DECODE_SHAPES)
    if args.shapes:
        try:
            shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes]  # type: ignore[misc]
        except ValueError:
            ap.error(f"--shapes takes BATCHxCACHE, e.g. 8x8192, got {args.shapes}")
    for layout in args.layouts:
        try:
            page_size_of(layout)
        except ValueError as e:
            ap.error(str(e))
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA device", file=sys.stderr)
        return 1
    if args.fa3_path is not None:
        fa3.set_path(args.fa3_path)
    elif os.environ.get(FA3_ENV):
        fa3.set_path(Path(os.environ[FA3_ENV]))
    iface, fa3_reason = fa3_module()
    if iface is None:
        print(f"FA3 not timed: {fa3_reason}", flush=True)
    timing, timer = make_timer(args.warmup_ms, args.rep_ms, args.flush)
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for cache in args.cache:
            if "decode" in args.sections:
                rows += section_decode(timer, args.rounds, shapes, args.layouts, iface, fa3_reason,
                                       int(args.l2_mb * 2**20), args.seed, graphs=not args.eager, cache=cache,
                                       hadamard_seed=args.hadamard_seed)
            if "spec" in args.sections:
                rows += section_decode(timer, args.rounds, shapes, args.layouts, iface, fa3_reason,
                                       int(args.l2_mb * 2**20), args.seed, graphs=not args.eager,
                                       seqlen_q=args.spec_tokens, cache=cache, hadamard_seed=args.hadamard_seed)
        if "prefill" in args.sections:
            for headdim in args.prefill_headdims:
                rows += section_prefill(timer, args.rounds, args.layouts, iface, args.seed, headdim)
    print()
    print(markdown(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"environment": environment(timing, source_root()), "timing": timing,
                                        "rounds": args.rounds, "results": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
