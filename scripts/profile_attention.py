#!/usr/bin/env python3
"""Launch one configuration a few times, for `ncu` to profile (see scripts/gpu.sh profile).

    python scripts/profile_attention.py --hdim 256 --seqlen 2048 --causal            # forward
    python scripts/profile_attention.py --mode bwd --hdim 128 --seqlen 8192          # backward
    python scripts/profile_attention.py --provider flashhopper@no-pingpong ...       # a named variant
    python scripts/profile_attention.py --provider sdpa-fa2 ...    # a peer: SDPA's FlashAttention-2
    python scripts/profile_attention.py --provider fa3 --fa3-path .peers/fa3 ...     # FlashAttention-3
Any provider of the benchmarks (flashhopper.report.providers), prepared as they prepare it (one untimed
run), then --iters calls: FA3-paper shape (batch = 16384 // seqlen, nheads = 2048 // hdim), bf16 unless
--dtype. The backward runs one forward, then the backward passes on the same graph (ncu filters by kernel
name: PROFILE_KERNEL in scripts/gpu.sh for a peer's kernels).
"""
import argparse
from pathlib import Path

import torch

from flashhopper.report import fa3
from flashhopper.report.providers import provider, provider_name
from flashhopper.report.sweep import DTYPES, grid, inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["fwd", "bwd"], default="fwd")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--provider", type=provider_name, default="flashhopper-sm90",
                    help="e.g. flashhopper-sm90, flashhopper-sm80, flashhopper-deterministic, flashhopper-fp8, "
                    "flashhopper@<variant>, sdpa-fa2, fa3 (default: %(default)s)")
    ap.add_argument("--fa3-path", type=Path, help=f"FlashAttention-3's folder (default: ${fa3.ENV})")
    a = ap.parse_args()
    if a.fa3_path is not None:
        fa3.set_path(a.fa3_path)
    shape = grid({a.hdim: (a.seqlen,)}, [a.mode], [a.dtype], [a.causal], tokens=16384, width=2048)[0]
    q, k, v = inputs(shape)
    p = provider(a.provider)
    with p.context():
        fn = p.prepare(a.mode, q, k, v, a.causal).fn  # Unavailable says why it cannot run here
        for _ in range(a.iters):
            fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
