#!/usr/bin/env python3
"""Accuracy of the e4m3 KV cache (issue #22): flash_attn_with_kvcache over a bf16 cache, an e4m3 cache, and an e4m3
cache with K's random-sign Hadamard transform, each against float64 attention over the cache's original (bf16)
values: ||out - ref|| / ||ref|| and the largest |out - ref| / max |ref| per case.

Activations: K/V draws that look like a model's (decode over a 4k-token cache, 32 query / 8 kv heads, d128):
- gaussian: N(0, 1) entries;
- outlier channels: K's channels 0-3 at 20x (a few large key channels, as LLM keys have), V gaussian;
- outlier tokens: 1% of the tokens (attention-sink-like) at 50x in K and V;
- heavy tails: Student-t (3 degrees of freedom) entries in K and V.
On a GPU the kernels run; on the CPU the reference backend (float64 math over the dequantized values: the cache's
error alone, without the kernel's 16-bit rounding of them).

    python bench/kvcache_fp8_accuracy.py [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from flashhopper import attention_kvcache_ref, flash_attn_with_kvcache, kvcache_fp8

CASES = ("gaussian", "outlier channels", "outlier tokens", "heavy tails")


def activations(case: str, shape: tuple[int, ...], g: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(shape, generator=g, device=device)
    v = torch.randn(shape, generator=g, device=device)
    if case == "outlier channels":
        k[..., :4] *= 20
    elif case == "outlier tokens":
        pick = torch.rand(shape[:2], generator=g, device=device) < 0.01
        k[pick] *= 50
        v[pick] *= 50
    elif case == "heavy tails":
        t = torch.distributions.StudentT(3.0)
        k = t.sample(shape).to(device)
        v = t.sample(shape).to(device)
    return k.bfloat16(), v.bfloat16()


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = out.double() - ref
    return float(d.norm() / ref.norm()), float(d.abs().max() / ref.abs().max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--cache-len", type=int, default=4096)
    ap.add_argument("--seqlen-q", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--hadamard-seed", type=int, default=1234)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = None if device == "cuda" else "reference"
    hq, hkv, d, b, n, ps = 32, 8, 128, args.batch, args.cache_len, args.page_size
    rows: list[dict[str, Any]] = []
    for case in CASES:
        g = torch.Generator(device=device).manual_seed(args.seed)
        k, v = activations(case, (b, n, hkv, d), g, device)
        per = n // ps
        table = torch.randperm(b * per, generator=g, device=device).view(b, per).to(torch.int32)
        kp = torch.empty(b * per, ps, hkv, d, dtype=torch.bfloat16, device=device)
        vp = torch.empty_like(kp)
        kp[table.flatten().long()] = k.view(b * per, ps, hkv, d)
        vp[table.flatten().long()] = v.view(b * per, ps, hkv, d)
        lens = torch.full((b,), n, dtype=torch.int32, device=device)
        caches = {"bf16": (kp, vp, None, None, None)}
        for seed in (None, args.hadamard_seed):
            k8, v8, ks, vs = kvcache_fp8.quantize_kv_cache(kp, vp, seed)
            caches["e4m3" if seed is None else "e4m3 + Hadamard"] = (k8, v8, ks, vs, seed)
        for sq in args.seqlen_q:
            q = torch.randn(b, sq, hq, d, generator=g, device=device).bfloat16()
            ref, _ = attention_kvcache_ref(q.double(), kp.double(), vp.double(), lens, table, dtype=torch.float64)
            row: dict[str, Any] = {"case": case, "seqlen_q": sq}
            for name, (kc, vc, ks, vs, seed) in caches.items():
                out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, k_cache_scale=ks,
                                              v_cache_scale=vs, hadamard_seed=seed, backend=backend)
                row[name] = errors(out, ref)
            rows.append(row)
            print(row, flush=True)
    names = ["bf16", "e4m3", "e4m3 + Hadamard"]
    print(f"\ndevice: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (reference backend)'}; decode over "
          f"{b} x {n} keys, {hq}/{hkv} heads, d{d}, pages of {ps}; rel = ||out - ref|| / ||ref||, max = "
          "max |out - ref| / max |ref|, ref: float64 over the bf16 values\n")
    print("| activations | seqlen_q | " + " | ".join(f"{x} rel | {x} max" for x in names) + " |")
    print("|---|---|" + "---|---|" * len(names))
    for r in rows:
        print(f"| {r['case']} | {r['seqlen_q']} | " + " | ".join(f"{r[x][0]:.2e} | {r[x][1]:.2e}" for x in names) + " |")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
