#!/usr/bin/env python3
"""Quick check of every compiled KV-cache kernel (sm90), for compute-sanitizer (scripts/gpu.sh sanitize-all) and by
hand: each KV-cache forward KernelKey of the build (16-bit and e4m3 caches, mask, softcap) through
flash_attn_with_kvcache, contiguous and in pages of 16 (scattered, spare pages), after an append of two tokens (the
call's own; e4m3: the quantizing kernel through append_kvcache, K with a Hadamard seed, q transformed on the CPU),
entries of 0, 1, a page's and more keys, split counts 1 and 3, GQA 8 / 2. Every cache slot past an entry's keys
after the append holds NaN (e4m3: NaN bytes and scales), so a read past the end shows in out. Out and lse are
compared with attention_kvcache_ref computed in float32 on the CPU over the cache's stored values (no GPU GEMM
beside ours: racecheck flags cuBLAS's own kernels). The real tests are tests/test_kvcache_gpu.py and
tests/test_kvcache_fp8_gpu.py. Exit 1 if a result has NaN, is off, or if there is nothing to check.
"""
from __future__ import annotations

import argparse

import torch

import flashhopper
from flashhopper import append_kvcache, flash_attn_with_kvcache, kvcache_fp8
from flashhopper.kernel_key import KernelKey, from_dict
from flashhopper.reference import attention_kvcache_ref

from check_fwd import LIMIT, WINDOW  # (the scripts' folder is on the path when one runs)

SOFTCAP = 30.0
FP8_LIMIT = 4e-2  # the e4m3 cache against exact attention over its stored values (P rounded to e4m3: tests' bound)
LENGTHS = [0, 1, 16, 150]  # before the append of NEW tokens: empty, one key, a full page, several pages
NEW = 2
CAPACITY = 192  # keys per entry (12 pages of 16)
SEED = 5


def poison_past(cache: torch.Tensor, lengths: list[int], table: torch.Tensor | None, value: float | int) -> None:
    """Write ``value`` into every slot of ``cache`` past each entry's length, and into the pages no entry owns."""
    if table is None:
        for b, n in enumerate(lengths):
            cache[b, n:] = value
        return
    page = cache.shape[1]
    for p in set(range(cache.shape[0])) - set(table.flatten().tolist()):
        cache[p] = value
    for b, n in enumerate(lengths):
        for j, p in enumerate(table[b].tolist()):
            if n - j * page < page:
                cache[p, max(n - j * page, 0):] = value


def check(key: KernelKey, paged: bool, splits: int) -> float:
    """The relative error of out against the reference (raises on NaN or an lse that is off)."""
    dtype, d = getattr(torch, key.dtype), key.headdim
    fp8 = key.kvcache == "e4m3"
    seqlen_q = 1 if key.mask == "none" else 4
    causal = key.mask != "none"
    window = WINDOW if key.mask == "window" else None
    softcap = SOFTCAP if key.score_mod == "softcap" else 0.0
    batch, hq, hkv = len(LENGTHS), 8, 2
    g = torch.Generator().manual_seed(d + seqlen_q)
    if paged:
        pages = batch * CAPACITY // 16 + 3  # spare pages nobody owns
        table = torch.randperm(pages, generator=g)[:batch * CAPACITY // 16].view(batch, -1).to(torch.int32)
        shape = (pages, 16, hkv, d)
    else:
        table, shape = None, (batch, CAPACITY, hkv, d)
    kc, vc = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(batch, seqlen_q, hq, d, generator=g).to(dtype)
    k, v = (torch.randn(batch, NEW, hkv, d, generator=g).to(dtype) for _ in range(2))
    after = [n + NEW for n in LENGTHS]
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    table_gpu = None if table is None else table.cuda()
    if fp8:
        k8, v8, ks, vs = (x.cuda() for x in kvcache_fp8.quantize_kv_cache(kc, vc, SEED))
        for x, nan in ((k8.view(torch.uint8), 0x7F), (v8.view(torch.uint8), 0x7F)):
            poison_past(x, after, table, nan)
        for s in (ks, vs):
            poison_past(s.transpose(1, 2), after, table, float("nan"))
        # The append through append_kvcache (the quantizing kernel, K with the seed's transform), then the attention
        # with q transformed here on the CPU: the call with hadamard_seed would transform q by a cuBLAS matmul, a GPU
        # GEMM beside ours that racecheck flags.
        append_kvcache(k8, v8, k.cuda(), v.cuda(), lens.cuda(), table_gpu, k_cache_scale=ks, v_cache_scale=vs,
                       hadamard_seed=SEED)
        qt = kvcache_fp8.transform_q(q.float(), SEED).to(dtype)
        out, lse = flash_attn_with_kvcache(qt.cuda(), k8, v8, cache_seqlens=torch.tensor(after, dtype=torch.int32,
                                                                                          device="cuda"),
                                           page_table=table_gpu, causal=causal, num_splits=splits,
                                           window_size=window or (-1, -1), softcap=softcap, return_lse=True,
                                           k_cache_scale=ks, v_cache_scale=vs)
        kd = kvcache_fp8.dequantize_kv_cache(k8.cpu(), ks.cpu(), None, torch.float32)
        vd = kvcache_fp8.dequantize_kv_cache(v8.cpu(), vs.cpu(), None, torch.float32)
        qd = qt.float()
        limit = FP8_LIMIT
    else:
        kc, vc = kc.cuda(), vc.cuda()
        for x in (kc, vc):
            poison_past(x, after, table, float("nan"))
        out, lse = flash_attn_with_kvcache(q.cuda(), kc, vc, k.cuda(), v.cuda(), cache_seqlens=lens.cuda(),
                                           page_table=table_gpu, causal=causal, num_splits=splits,
                                           window_size=window or (-1, -1), softcap=softcap, return_lse=True)
        kd, vd, qd = kc.cpu().float(), vc.cpu().float(), q.float()
        limit = LIMIT
    # (the appended rows are in the caches now: the reference reads them as the kernel stored them)
    ref, ref_lse = attention_kvcache_ref(qd, kd, vd, torch.tensor(after, dtype=torch.int32), table, causal=causal,
                                         window=window, softcap=softcap, dtype=torch.float32)
    out, lse = out.cpu().float(), lse.cpu()
    if torch.isnan(out).any() or torch.isnan(lse).any():
        raise AssertionError(f"{key.describe()}: NaN in out or lse (a slot past an entry's keys was read?)")
    seen = torch.isfinite(ref_lse)
    if not torch.equal(seen, torch.isfinite(lse)):
        raise AssertionError(f"{key.describe()}: rows without keys differ")
    lse_err = (lse[seen] - ref_lse[seen]).abs()
    lse_limit = 2e-2 + 4e-3 * ref_lse[seen].abs() if fp8 else torch.full_like(lse_err, 1e-2)
    if not (lse_err < lse_limit).all():
        raise AssertionError(f"{key.describe()}: lse off by {lse_err.max().item():.2e}")
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    if not err < limit:
        raise AssertionError(f"{key.describe()}: rel err {err:.2e} (limit {limit})")
    return err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="*", default=None, help="only these query dtypes (bfloat16 float16)")
    ap.add_argument("--hdims", nargs="*", type=int, default=None, help="only these head dims")
    args = ap.parse_args()
    keys = sorted((from_dict(k) for k in flashhopper.compiled_kernels()
                   if k["mode"] == "fwd" and k["arch"] == 90 and k.get("kvcache", "off") != "off"
                   and not k["dropout"] and not k["variant"]
                   and (args.dtypes is None or k["dtype"] in args.dtypes)
                   and (args.hdims is None or k["headdim"] in args.hdims)),
                  key=lambda key: (key.kvcache, key.dtype, key.headdim, key.mask, key.score_mod))
    if not keys:
        raise SystemExit("no sm90 KV-cache kernel in this build: nothing to check")
    failed = []
    for key in keys:
        worst = 0.0
        for paged in (False, True):
            for splits in (1, 3):
                try:
                    worst = max(worst, check(key, paged, splits))
                except AssertionError as e:
                    failed.append(f"{e} ({'paged16' if paged else 'contiguous'}, {splits} splits)")
                    print(f"FAILED {failed[-1]}", flush=True)
        print(f"{key.describe()}: worst rel err {worst:.2e}", flush=True)
    print(f"kernels checked: {len(keys)}; failed: {len(failed)}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
