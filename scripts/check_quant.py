#!/usr/bin/env python3
"""The fp8 quantization kernel on shapes where each persistent CTA walks several blocks (more blocks than
CTAs fit on the GPU at once), against reference_fp8.quantize_ref; small enough for compute-sanitizer:

    compute-sanitizer --tool racecheck python scripts/check_quant.py --small --dtypes bfloat16
    scripts/gpu.sh sanitize        # with the attention checks, under every tool

The Hadamard signs come from the seed inside the kernel (cpp/common/hadamard_signs.h) and from
fp8.hadamard_signs in the reference: SEEDS has one with 64 significant bits, so that both halves of the
seed reach the key. Exits non-zero on a mismatch (bytes and scales exact without the Hadamard transform;
with it, at most 0.1% of the bytes one step apart, as tests/test_fp8_gpu.py allows).
"""
import argparse
import sys

import torch

from flashhopper import fp8, reference_fp8

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SEEDS = (1, 0x9E3779B97F4A7C15)


def check(headdim: int, seqlen: int, nheads: int, block: int, seed: int | None, transpose: bool,
          dtype: torch.dtype) -> bool:
    """``seed`` None: no Hadamard transform."""
    x = (torch.randn(1, seqlen, nheads, headdim, device="cuda") * 3).to(dtype)
    got = fp8.quantize_fp8(x, block_size=block, hadamard=seed is not None, seed=seed or 0, granularity="block",
                           transpose=transpose, kernel=True)
    want = reference_fp8.quantize_ref(x, block, "block", seed, transpose)
    a = got.data.view(torch.uint8).int()
    b = want.data.view(torch.uint8).int()
    diff = (a - b).abs()
    scales_ok = torch.equal(got.scale, want.scale) if seed is None else bool(
        torch.allclose(got.scale, want.scale, rtol=1e-6, atol=0))
    bytes_ok = bool((diff == 0).all()) if seed is None else bool(
        (diff <= 1).all() and (diff != 0).float().mean() <= 1e-3)
    ok = scales_ok and bytes_ok
    print(f"d{headdim} s{seqlen} h{nheads} block {block} hadamard seed {seed} transpose={transpose} "
          f"{str(dtype)[6:]}: {'ok' if ok else 'MISMATCH'} ({int((diff != 0).sum())} bytes differ)")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="fewer blocks (for compute-sanitizer)")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=sorted(DTYPES))
    a = ap.parse_args()
    # Blocks per run: d256 (one CTA per SM) needs more than the SM count, d64 (several CTAs per SM) more.
    shapes = [(256, 17001, 2, 128), (128, 40001, 2, 128), (64, 70001, 1, 64)] if a.small else \
        [(256, 65537, 4, 128), (128, 65537, 8, 128), (64, 65537, 16, 64)]
    cases = [(seed, False) for seed in SEEDS] + [(None, True), (None, False)]  # (Hadamard seed, V^T)
    ok = True
    for dtype in a.dtypes:
        for d, s, h, block in shapes:
            for seed, transpose in cases:
                ok &= check(d, s, h, block, seed, transpose, DTYPES[dtype])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
