#!/usr/bin/env python3
"""Quick check of every compiled backward kernel of one family (sm90; --arch 80: sm80): each KernelKey of
the build (dtype, head dim, mask, variant) on a few odd shapes, fresh random inputs, the production
forward kernel of the same mask for out and lse, then the backward into NaN-poisoned dq, dk, dv (through
flashhopper.ops.fwd_into / bwd_into; a "window" kernel with check_fwd's WINDOW), each gradient's relative
error against reference gradients in float32 (from exact out and lse). A developer tool for the device
machine and for compute-sanitizer (--small: few, small shapes; scripts/gpu.sh sanitize); the real tests
are tests/test_bwd_gpu.py. Exit 1 if any gradient has NaN or the worst relative error reaches 2e-2, or if
there is nothing to check. Padded-batch kernels only (the packed ones: tests/test_varlen_gpu.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import math

import torch

import flashhopper
from flashhopper import _ext
from flashhopper.kernel_key import from_dict
from flashhopper.dropout import from_rng_state, new_rng_state
from flashhopper.ops import bwd_into, fwd_into
from flashhopper.reference import attention_bwd_ref, attention_ref, sinks_grad_ref

from check_fwd import WINDOW  # this script's folder

Shape = tuple[int, int, int, int, int]  # batch, seqlen_q, seqlen_k, nheads_q, nheads_kv


def shapes(small: bool) -> list[Shape]:
    # Odd lengths, seqlen_q != seqlen_k both ways (causal rows without keys included), GQA and MQA, no
    # queries (the kernel writes dk = dv = 0) and no keys (dq = 0). Not seqlen_k 1: there dq and dk vanish
    # in exact arithmetic (softmax over one key is constant), a relative error means nothing, and
    # tests/test_bwd_gpu.py bounds their rounding noise instead.
    if small:
        return [(1, 17, 200, 4, 1), (2, 255, 130, 4, 2), (1, 300, 40, 2, 2), (1, 0, 40, 2, 1), (1, 33, 0, 2, 2)]
    return [(1, 128, 128, 4, 4), (2, 1000, 1000, 8, 2), (1, 4096, 4096, 8, 8), (3, 255, 8193, 8, 1),
            (1, 8193, 17, 4, 4), (2, 17, 1000, 8, 8), (1, 1, 255, 2, 1), (2, 777, 2, 4, 2),
            (1, 0, 300, 4, 2), (2, 100, 0, 4, 4),
            (4, 2048, 2048, 16, 16)]  # last: several waves of CTAs, as in the benchmarks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="few small shapes (for compute-sanitizer)")
    ap.add_argument("--dtypes", nargs="*", choices=["bfloat16", "float16"], default=["bfloat16", "float16"],
                    help="which built kernels to check")
    ap.add_argument("--deterministic", action="store_true",
                    help="run the deterministic backward, twice per shape, and require identical bits")
    ap.add_argument("--arch", type=int, choices=[90, 80], default=90, help="kernel family (80 runs on Hopper too)")
    ap.add_argument("--max-smem-bytes", type=int, default=0,
                    help="sm80: pick tiles as on a GPU with this much shared memory per block (101376: sm_86/sm_89)")
    ap.add_argument("--softcap", type=float, default=0.0, help="check the softcap kernels, with this softcap")
    ap.add_argument("--sinks", action="store_true", help="run with random sink logits (and check their gradient)")
    ap.add_argument("--dropout", type=float, default=0.0, help="check the dropout kernels, with this dropout_p")
    args = ap.parse_args()
    score_mod = "softcap" if args.softcap > 0 else "none"  # --softcap checks the softcap kernels
    keys = sorted((from_dict(k) for k in flashhopper.compiled_kernels()
                   if k["mode"] == "bwd" and k["arch"] == args.arch and k["dtype"] in args.dtypes
                   and k["score_mod"] == score_mod and k["dropout"] == (args.dropout > 0)
                   and not k.get("varlen") and k.get("kvcache", "off") == "off"),
                  key=lambda key: (key.dtype, key.headdim, key.mask, key.variant))
    # The backward needs the forward's out and lse: the production kernel of the same mask.
    missing_fwd = [key for key in keys if not _ext.has_kernel("fwd", dataclasses.replace(key, variant=""))]
    if missing_fwd:
        print(f"skipping {len(missing_fwd)} backward kernels without a forward in this build: "
              + "; ".join(key.describe() for key in missing_fwd))
        keys = [key for key in keys if key not in missing_fwd]
    if not keys:
        raise SystemExit(f"no sm{args.arch} backward kernel (with its forward) for {args.dtypes} in this build: "
                         "nothing to check")
    worst = 0.0
    torch.manual_seed(0)
    for key in keys:
        dtype, d, causal = getattr(torch, key.dtype), key.headdim, key.mask == "causal"
        window = WINDOW if key.mask == "window" else None
        scale = 1 / math.sqrt(d)
        for b, sq, sk, hq, hk in shapes(args.small):
            q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
            k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
            v = torch.randn(b, sk, hk, key.headdim_v, device="cuda", dtype=dtype)  # a (Q/K, V) pair's own
            out = torch.full((b, sq, hq, key.headdim_v), math.nan, device="cuda", dtype=dtype)
            lse = torch.full((b, hq, sq), math.nan, device="cuda")
            sinks = torch.randn(hq, device="cuda") * 2 if args.sinks else None
            rng = new_rng_state(q.device) if args.dropout > 0 else None
            drop = from_rng_state(args.dropout, rng) if rng is not None else None
            fwd_into(q, k, v, out, lse, scale, causal, key.arch, window=window, softcap=args.softcap, sinks=sinks,
                     dropout_p=args.dropout, dropout_rng=rng)
            dout = torch.randn_like(out)

            def run() -> tuple[torch.Tensor, ...]:
                dq, dk, dv = (torch.full_like(x, math.nan) for x in (q, k, v))
                rows = None if sinks is None else torch.full_like(lse, math.nan)
                bwd_into(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, args.deterministic, key.arch,
                         window=window, variant=key.variant, max_smem_bytes=args.max_smem_bytes,
                         softcap=args.softcap, sinks=sinks, dsinks_rows=rows, dropout_p=args.dropout, dropout_rng=rng)
                return (dq, dk, dv) if rows is None else (dq, dk, dv, rows.sum(dim=(0, 2)))

            grads = run()
            same = not args.deterministic or all(torch.equal(a, c) for a, c in zip(grads, run()))
            ref_out, ref_lse = attention_ref(q, k, v, scale, causal, window=window, softcap=args.softcap,
                                             sinks=sinks, dropout=drop, dtype=torch.float32)
            ref = attention_bwd_ref(dout, q, k, v, ref_out, ref_lse, scale, causal, window=window,
                                    softcap=args.softcap, dropout=drop, dtype=torch.float32)
            if sinks is not None:
                ref = (*ref, sinks_grad_ref(dout, ref_out, ref_lse, sinks, dtype=torch.float32))
            errs = [((g.float() - r).norm() / r.norm().clamp_min(1e-30)).item() for g, r in zip(grads, ref)]
            nan = any(bool(torch.isnan(g).any()) for g in grads)
            # d(sinks) sums signed per-row terms over every row: its relative error is judged 5x looser.
            errs_judged = errs[:3] + [e / 5 for e in errs[3:]]
            worst = max(worst, math.inf if nan or not same else max(errs_judged))
            print(f"{key.describe()} b{b} sq{sq} sk{sk} h{hq}/{hk}: "
                  f"rel_err dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} nan {nan}"
                  + (f" dsinks {errs[3]:.2e}" if len(errs) > 3 else "")
                  + (f" same_bits {same}" if args.deterministic else ""))
    print(f"worst rel_err {worst:.2e} over {len(keys)} kernels")
    if not worst < 2e-2:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
