#!/usr/bin/env python3
"""Launch one configuration a few times, for `ncu` to profile (see scripts/gpu.sh profile).

    python scripts/profile_attention.py --hdim 256 --seqlen 2048 --causal            # forward
    python scripts/profile_attention.py --mode bwd --hdim 128 --seqlen 8192          # backward
FA3-paper shape: batch = 16384 // seqlen, nheads = 2048 // hdim, bf16. The backward runs one
forward, then --iters backward passes on the same graph (ncu filters by kernel name).
"""
import argparse

import torch

from flashhopper import flash_attn_func


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["fwd", "bwd"], default="fwd")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()
    b, h = 16384 // a.seqlen, 2048 // a.hdim
    q, k, v = (torch.randn(b, a.seqlen, h, a.hdim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=a.mode == "bwd") for _ in range(3))
    if a.mode == "fwd":
        for _ in range(a.iters):
            flash_attn_func(q, k, v, causal=a.causal, backend="sm90")
    else:
        out = flash_attn_func(q, k, v, causal=a.causal, deterministic=a.deterministic, backend="sm90")
        dout = torch.randn_like(out)
        for _ in range(a.iters):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
