#!/usr/bin/env python3
"""Launch one configuration a few times, for `ncu` to profile (see scripts/gpu.sh profile).

    python scripts/profile_attention.py --hdim 256 --seqlen 2048 --causal            # forward
    python scripts/profile_attention.py --mode bwd --hdim 128 --seqlen 8192          # backward
    python scripts/profile_attention.py --backend sdpa-fa2 ...   # a peer: SDPA's FlashAttention-2
FA3-paper shape: batch = 16384 // seqlen, nheads = 2048 // hdim, bf16. The backward runs one
forward, then --iters backward passes on the same graph (ncu filters by kernel name).
"""
import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from flashhopper import flash_attn_func


def sdpa_fa2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["fwd", "bwd"], default="fwd")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--backend", choices=["sm90", "sm80", "sdpa-fa2"], default="sm90")
    a = ap.parse_args()

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if a.backend == "sdpa-fa2":
            return sdpa_fa2(q, k, v, a.causal)
        return flash_attn_func(q, k, v, causal=a.causal, deterministic=a.deterministic, backend=a.backend)

    b, h = 16384 // a.seqlen, 2048 // a.hdim
    q, k, v = (torch.randn(b, a.seqlen, h, a.hdim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=a.mode == "bwd") for _ in range(3))
    if a.mode == "fwd":
        for _ in range(a.iters):
            attn(q, k, v)
    else:
        out = attn(q, k, v)
        dout = torch.randn_like(out)
        for _ in range(a.iters):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
