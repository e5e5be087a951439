#!/usr/bin/env python3
"""Quick check of every compiled sm90 (or, with --arch 80, sm80) backward kernel: fresh random inputs, the forward kernel for out
and lse, then the backward into NaN-poisoned dq, dk, dv (through flashhopper.ops.fwd_into/bwd_into),
each gradient's relative error against reference gradients in float32 (from exact out and lse).
A developer tool for the device machine and for compute-sanitizer runs (--small: few, small shapes);
the real tests are tests/test_bwd_gpu.py. Exit 1 if any gradient has NaN or the worst relative
error exceeds 2e-2, or if there is nothing to check.
"""
from __future__ import annotations

import argparse
import math

import torch

import flashhopper
from flashhopper.ops import bwd_into, fwd_into
from flashhopper.reference import attention_bwd_ref, attention_ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", action="store_true", help="few small shapes (for compute-sanitizer)")
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float16"], help="which built kernels to check")
    ap.add_argument("--deterministic", action="store_true",
                    help="run the deterministic backward, twice per shape, and require identical bits")
    ap.add_argument("--arch", type=int, choices=[90, 80], default=90, help="kernel family (80 runs on Hopper too)")
    ap.add_argument("--max-smem-bytes", type=int, default=0,
                    help="sm80: pick tiles as on a GPU with this much shared memory per block (101376: sm_86/sm_89)")
    args = ap.parse_args()
    kernels = flashhopper.compiled_kernels()
    have_fwd = {(k["dtype"], k["headdim"], k["causal"]) for k in kernels if k["mode"] == "fwd" and k["arch"] == args.arch}
    built = sorted((k["dtype"], k["headdim"], k["causal"]) for k in kernels
                   if k["mode"] == "bwd" and k["arch"] == args.arch and k["dtype"] in args.dtypes)
    missing_fwd = [b for b in built if b not in have_fwd]
    if missing_fwd:  # the backward needs the forward's out and lse
        print(f"skipping {len(missing_fwd)} backward kernels without a forward in this build: {missing_fwd}")
        built = [b for b in built if b in have_fwd]
    if not built:
        raise SystemExit(f"no sm{args.arch} backward kernel (with its forward) for {args.dtypes} in this build: "
                         "nothing to check")
    # (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv): odd lengths, seqlen_q != seqlen_k both ways
    # (causal rows without keys included), GQA and MQA. Not seqlen_k 1: there dq and dk vanish in
    # exact arithmetic (softmax over one key is constant), a relative error means nothing, and
    # tests/test_bwd_gpu.py bounds their rounding noise instead.
    if args.small:
        shapes = [(1, 17, 200, 4, 1), (2, 255, 130, 4, 2), (1, 300, 40, 2, 2)]
    else:
        shapes = [(1, 128, 128, 4, 4), (2, 1000, 1000, 8, 2), (1, 4096, 4096, 8, 8), (3, 255, 8193, 8, 1),
                  (1, 8193, 17, 4, 4), (2, 17, 1000, 8, 8), (1, 1, 255, 2, 1), (2, 777, 2, 4, 2),
                  (4, 2048, 2048, 16, 16)]  # last: several waves of CTAs, as in the benchmarks
    worst = 0.0
    torch.manual_seed(0)
    for dtype_name, d, causal in built:
        dtype = getattr(torch, dtype_name)
        scale = 1 / math.sqrt(d)
        for b, sq, sk, hq, hk in shapes:
            q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
            k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
            v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
            out = torch.full_like(q, math.nan)
            lse = torch.full((b, hq, sq), math.nan, device="cuda")
            fwd_into(q, k, v, out, lse, scale, causal, args.arch)
            dout = torch.randn_like(q)

            def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                grads = tuple(torch.full_like(x, math.nan) for x in (q, k, v))
                bwd_into(dout, q, k, v, out, lse, *grads, scale, causal, args.deterministic, args.arch,
                         max_smem_bytes=args.max_smem_bytes)
                return grads  # type: ignore[return-value]

            grads = run()
            same = not args.deterministic or all(torch.equal(a, c) for a, c in zip(grads, run()))
            ref_out, ref_lse = attention_ref(q, k, v, scale, causal, dtype=torch.float32)
            ref = attention_bwd_ref(dout, q, k, v, ref_out, ref_lse, scale, causal, dtype=torch.float32)
            errs = [((g.float() - r).norm() / r.norm().clamp_min(1e-30)).item() for g, r in zip(grads, ref)]
            nan = any(bool(torch.isnan(g).any()) for g in grads)
            worst = max(worst, math.inf if nan or not same else max(errs))
            print(f"{dtype_name:14s} d{d:<3d} causal={int(causal)} b{b} sq{sq:<5d} sk{sk:<5d} h{hq}/{hk}: "
                  f"rel_err dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} nan {nan}"
                  + (f" same_bits {same}" if args.deterministic else ""))
    print(f"worst rel_err {worst:.2e} over {len(built)} kernels")
    if not worst < 2e-2:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
