#!/usr/bin/env python3
"""Bandwidth of the fp8 quantization kernel next to a device-to-device copy, same run, same GPU.

quantize_fp8 on (batch, seqlen, nheads, headdim) bf16: one pass, fp8 + one float32 scale per (batch,
head, block) out, Hadamard on/off, (batch, seqlen, heads, d) or V^T (transpose) out. GB/s = (bytes
read + bytes written) / time, with the V^T padding keys and the scales counted as written; the copy
is ``dst.copy_(src)`` of a bf16 tensor of the input's size, GB/s = 2 * bytes / time. Sizes are
several times the 50 MB L2. Times are medians of triton.testing.do_bench (L2 flushed between runs),
or CUDA events without triton; each call is replayed from a CUDA graph where it can be captured, so
the Python wrapper's launch overhead is not timed ("eager" in the table where it could not).

    python bench/bench_quant.py
    python bench/bench_quant.py --hdims 128 --seqlens 65536 --out bench/results/quant.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from flashhopper import _ext
from flashhopper.report.environment import environment
from flashhopper.report.timing import Fn, graphed, make_timer

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def quant_bytes(b: int, s: int, h: int, d: int, itemsize: int, block: int, transpose: bool) -> tuple[int, int]:
    """(bytes read, bytes written) of one quantization."""
    keys = (s + 15) // 16 * 16 if transpose else s
    return b * s * h * d * itemsize, b * h * d * keys + b * h * math.ceil(s / block) * 4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384, 32768, 65536],
                    help="tokens at batch 1; with --width 4096, 128/256/512 MB of bf16 input")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--width", type=int, default=4096, help="nheads x headdim")
    ap.add_argument("--block", type=int, default=128, help="tokens per scale")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--no-graph", action="store_true", help="time the eager calls (wrapper overhead included)")
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_quant: no CUDA device; nothing to measure", file=sys.stderr)
        return 2
    if not _ext.has_fp8_quantize():
        print(f"bench_quant: this build has no fp8 quantization kernel (_C.quantize_fp8); "
              f"{_ext.extension_error() or 'rebuild with the fp8 kernels'}", file=sys.stderr)
        return 2
    from flashhopper.fp8 import quantize_fp8

    timer_name, timer = make_timer(args.warmup_ms, args.rep_ms)
    env = environment(timer_name, ROOT)
    print(f"{env['device']} | torch {env['torch']} CUDA {env['cuda']} | flashhopper @ {env['git_commit']} | "
          f"{timer_name} | {'eager calls' if args.no_graph else 'CUDA graph replays'}")
    dtype = DTYPES[args.dtype]
    rows: list[dict[str, Any]] = []
    for d in args.hdims:
        for s in args.seqlens:
            b, h = args.batch, max(1, args.width // d)
            x = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
            dst = torch.empty_like(x)
            copy: Fn = lambda: dst.copy_(x)  # noqa: E731
            copy_ms = timer(copy if args.no_graph else graphed(copy)[0])
            copy_gbps = 2 * x.nbytes / copy_ms / 1e6
            for had in (False, True):
                for transpose in (False, True):
                    def quant() -> Any:
                        return quantize_fp8(x, block_size=args.block, hadamard=had, transpose=transpose, kernel=True)

                    fn, is_graph = (quant, False) if args.no_graph else graphed(quant)
                    ms = timer(fn)
                    read, written = quant_bytes(b, s, h, d, x.element_size(), args.block, transpose)
                    gbps = (read + written) / ms / 1e6
                    rows.append(dict(batch=b, seqlen=s, nheads=h, headdim=d, dtype=args.dtype, block=args.block,
                                     hadamard=had, transpose=transpose, graph=is_graph, ms=ms,
                                     bytes_read=read, bytes_written=written, gbps=gbps,
                                     copy_ms=copy_ms, copy_gbps=copy_gbps, ratio_to_copy=gbps / copy_gbps))
            del x, dst
            torch.cuda.empty_cache()

    print(f"\n**fp8 quantization, {args.dtype} in, block {args.block}** (GB/s = (read + written) / time)\n")
    print("| headdim | (b, s, h, d) | MB in | Hadamard | out | ms | GB/s | copy GB/s | of copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        shape = f"({r['batch']}, {r['seqlen']}, {r['nheads']}, {r['headdim']})"
        print(f"| {r['headdim']} | {shape} | {r['bytes_read'] / 1e6:.0f} | {'on' if r['hadamard'] else 'off'} | "
              f"{'V^T' if r['transpose'] else 'bshd'}{'' if r['graph'] else ' (eager)'} | {r['ms']:.3f} | "
              f"{r['gbps']:.0f} | {r['copy_gbps']:.0f} | {100 * r['ratio_to_copy']:.0f}% |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"environment": env, "args": {k: str(v) for k, v in vars(args).items()},
                                        "results": rows}, indent=1) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
