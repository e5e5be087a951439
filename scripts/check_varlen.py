#!/usr/bin/env python3
"""Quick check of every compiled packed-batch (varlen) kernel of one family (sm90; --arch 80: sm80), for
compute-sanitizer (scripts/gpu.sh sanitize-all) and by hand: each 16-bit varlen KernelKey of the build (mask,
softcap; no dropout, no variant) through flash_attn_varlen_func with that family's backend, on a packed batch
whose sequences have 0, 1, odd and block-crossing lengths (GQA 2), the backward too where the build has it
(autograd through the public call). Out, lse and the gradients are compared with attention_varlen_ref computed in
float32 on the CPU, so that no GPU GEMM runs beside ours (racecheck flags cuBLAS's own kernels). The real tests
are tests/test_varlen_gpu.py. Exit 1 if a result has NaN or an error reaches its limit, or if there is nothing to
check.
"""
from __future__ import annotations

import argparse
import math

import torch

import flashhopper
from flashhopper import _ext, flash_attn_varlen_func
from flashhopper.kernel_key import KernelKey, from_dict
from flashhopper.reference import attention_varlen_ref

from check_fwd import LIMIT, WINDOW  # (the scripts' folder is on the path when one runs)

SOFTCAP = 30.0
LSE_LIMIT = 1e-2  # lse's largest absolute error (natural log): float32 sums of the same scores differ by ~1e-5


def lengths(small: bool) -> tuple[list[int], list[int]]:
    # Empty and one-token sequences, odd lengths, queries != keys both ways, one that crosses several blocks.
    if small:
        return [0, 1, 17, 200, 130], [3, 1, 40, 200, 300]
    return [0, 1, 17, 1000, 255, 4096, 129], [5, 1, 300, 1000, 8193, 4096, 1]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(key: KernelKey, small: bool, bwd: bool) -> float:
    """The worst relative error of out (and the gradients with ``bwd``) for key's kernel; raises on NaN and on an
    lse off by LSE_LIMIT."""
    lq, lk = lengths(small)
    cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32) for x in (lq, lk)]
    dtype, d = getattr(torch, key.dtype), key.headdim
    causal, window = key.mask == "causal", WINDOW if key.mask == "window" else None
    softcap = SOFTCAP if key.score_mod == "softcap" else 0.0
    q, k, v = (torch.randn(sum(n), h, d, dtype=dtype, device="cuda", requires_grad=bwd)
               for n, h in ((lq, 4), (lk, 2), (lk, 2)))
    out, lse = flash_attn_varlen_func(q, k, v, cu[0].cuda(), cu[1].cuda(), max(lq), max(lk), causal=causal,
                                      window_size=window or (-1, -1), softcap=softcap, return_lse=True,
                                      backend=f"sm{key.arch}")
    leaves = [x.detach().cpu().float().requires_grad_(bwd) for x in (q, k, v)]
    ref, ref_lse = attention_varlen_ref(*leaves, cu[0], cu[1], 1 / math.sqrt(d), causal, window=window,
                                        softcap=softcap, dtype=torch.float32)
    found = {"out": (out, ref), "lse": (lse, ref_lse)}
    if bwd:
        dout = torch.randn_like(out)
        found.update(zip(("dq", "dk", "dv"), zip(torch.autograd.grad(out, (q, k, v), dout),
                                                  torch.autograd.grad(ref, leaves, dout.cpu().float()))))
    worst = 0.0
    for name, (got, want) in found.items():
        got = got.detach().cpu().float()
        finite = torch.isfinite(want)  # lse of rows without keys: -inf in both
        if torch.isnan(got).any() or not torch.equal(torch.isfinite(got), finite):
            raise AssertionError(f"{key.describe()}: {name} has NaN or misplaced infinities")
        if name == "lse":  # large values: a relative norm would hide an offset
            err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
            if not err < LSE_LIMIT:
                raise AssertionError(f"{key.describe()}: lse off by {err:.2e} (limit {LSE_LIMIT})")
        else:
            worst = max(worst, rel(got[finite], want[finite]))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="few small sequences (for compute-sanitizer)")
    ap.add_argument("--arch", type=int, choices=[90, 80], default=90, help="kernel family (80 runs on Hopper too)")
    args = ap.parse_args()
    keys = sorted((from_dict(k) for k in flashhopper.compiled_kernels()
                   if k["mode"] == "fwd" and k["arch"] == args.arch and k.get("varlen") and not k["dropout"]
                   and k["dtype"] in ("bfloat16", "float16") and not k["variant"]),
                  key=lambda key: (key.dtype, key.headdim, key.mask, key.score_mod))
    if not keys:
        raise SystemExit(f"no sm{args.arch} packed-batch forward kernel in this build: nothing to check")
    failed = []
    torch.manual_seed(0)
    for key in keys:
        bwd = _ext.has_kernel("bwd", key)
        try:
            err = check(key, args.small, bwd)
        except AssertionError as e:
            failed.append(str(e))
            print(f"FAILED {e}", flush=True)
            continue
        status = "ok" if err < LIMIT else "FAILED"
        if err >= LIMIT:
            failed.append(key.describe())
        print(f"{status} {key.describe()}{' + bwd' if bwd else ''}: worst rel err {err:.2e}", flush=True)
    print(f"kernels checked: {len(keys)}; failed: {len(failed)}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
