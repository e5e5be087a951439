#!/usr/bin/env python3
"""Quick check of every compiled sm90 (or, with --arch 80, sm80) forward kernel: poisoned outputs, fresh random inputs, error
against exact attention (float32 on the GPU), through flashhopper.ops.fwd_into. A developer tool for
the device machine and for compute-sanitizer runs (--small: few, small shapes); the real tests are
tests/test_fwd_gpu.py, the real timings bench/bench_attention.py.
"""
from __future__ import annotations

import argparse
import math

import torch

import flashhopper
from flashhopper.ops import fwd_into
from flashhopper.reference import attention_ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", action="store_true", help="few small shapes (for compute-sanitizer)")
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float16"], help="which built kernels to check")
    ap.add_argument("--arch", type=int, choices=[90, 80], default=90, help="kernel family (80 runs on Hopper too)")
    args = ap.parse_args()
    built = sorted((k["dtype"], k["headdim"], k["causal"]) for k in flashhopper.compiled_kernels()
                   if k["mode"] == "fwd" and k["arch"] == args.arch and k["dtype"] in args.dtypes)
    if not built:
        raise SystemExit(f"no sm{args.arch} forward kernel for {args.dtypes} in this build: nothing to check")
    if args.small:
        shapes = [(1, 17, 200, 4, 1), (2, 255, 130, 4, 2), (1, 300, 40, 2, 2)]
    else:
        shapes = [(1, 128, 128, 4, 4), (2, 1000, 1000, 8, 2), (1, 4096, 4096, 8, 8), (3, 255, 8193, 8, 1),
                  (1, 8193, 17, 4, 4), (2, 17, 1000, 8, 8), (1, 1, 255, 2, 1)]
    worst = 0.0
    torch.manual_seed(0)
    for dtype_name, d, causal in built:
        dtype = getattr(torch, dtype_name)
        for b, sq, sk, hq, hk in shapes:
            q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
            k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
            v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
            out = torch.full_like(q, math.nan)
            lse = torch.full((b, hq, sq), math.nan, device="cuda")
            fwd_into(q, k, v, out, lse, 1 / math.sqrt(d), causal, args.arch)
            ref, ref_lse = attention_ref(q, k, v, None, causal, dtype=torch.float32)
            err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            finite = torch.isfinite(ref_lse)
            lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
            nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
            worst = max(worst, math.inf if nan else err)
            print(f"{dtype_name:14s} d{d:<3d} causal={int(causal)} b{b} sq{sq:<5d} sk{sk:<5d} h{hq}/{hk}: "
                  f"rel_err {err:.2e} lse_err {lse_err:.1e} nan {nan}")
    print(f"worst rel_err {worst:.2e} over {len(built)} kernels")
    if not worst < 2e-2:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
