#!/usr/bin/env python3
"""The fp8 quantization kernel on shapes where each persistent CTA walks several blocks (more blocks than
CTAs fit on the GPU at once), against reference_fp8.quantize_ref; small enough for compute-sanitizer:

    compute-sanitizer --tool racecheck python scripts/check_quant.py --small --dtypes bfloat16
    SANITIZE_SCRIPTS=check_quant scripts/gpu.sh sanitize

Exits non-zero on a mismatch (bytes and scales exact without the Hadamard transform; with it, at most
0.1% of the bytes one step apart, as tests/test_fp8_gpu.py allows).
"""
import argparse
import sys

import torch

from flashhopper import fp8, reference_fp8

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def check(headdim: int, seqlen: int, nheads: int, block: int, hadamard: bool, transpose: bool,
          dtype: torch.dtype) -> bool:
    x = (torch.randn(1, seqlen, nheads, headdim, device="cuda") * 3).to(dtype)
    got = fp8.quantize_fp8(x, block_size=block, hadamard=hadamard, seed=1, granularity="block",
                           transpose=transpose, kernel=True)
    want = reference_fp8.quantize_ref(x, block, "block", 1 if hadamard else None, transpose)
    a = got.data.view(torch.uint8).int()
    b = want.data.view(torch.uint8).int()
    diff = (a - b).abs()
    scales_ok = torch.equal(got.scale, want.scale) if not hadamard else bool(
        torch.allclose(got.scale, want.scale, rtol=1e-6, atol=0))
    bytes_ok = bool((diff == 0).all()) if not hadamard else bool(
        (diff <= 1).all() and (diff != 0).float().mean() <= 1e-3)
    ok = scales_ok and bytes_ok
    print(f"d{headdim} s{seqlen} h{nheads} block {block} hadamard={hadamard} transpose={transpose} "
          f"{str(dtype)[6:]}: {'ok' if ok else 'MISMATCH'} ({int((diff != 0).sum())} bytes differ)")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="fewer blocks (for compute-sanitizer)")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=sorted(DTYPES))
    a = ap.parse_args()
    # Blocks per run: d256 (one CTA per SM) needs more than the SM count, d64 (several CTAs per SM) more.
    shapes = [(256, 17001, 2, 128), (128, 40001, 2, 128), (64, 70001, 1, 64)] if a.small else \
        [(256, 65537, 4, 128), (128, 65537, 8, 128), (64, 65537, 16, 64)]
    ok = True
    for dtype in a.dtypes:
        for d, s, h, block in shapes:
            for hadamard, transpose in ((True, False), (False, True), (False, False)):
                ok &= check(d, s, h, block, hadamard, transpose, DTYPES[dtype])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
