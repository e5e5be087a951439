#!/usr/bin/env python3
"""Attention forward/backward throughput: flashhopper next to PyTorch SDPA's backends (and FlashAttention-3
where it is configured), same shapes.

Default grid (FlashAttention-3 paper): batch x seqlen = 16384 tokens, nheads x headdim = 2048,
seqlen 512..16384, head dims 64/128/256, causal off and on, forward and backward. Times are medians
of triton.testing.do_bench (L2 flushed between runs), or of CUDA events when triton is missing;
TFLOPS by flashhopper.flops. Prints one table per (mode, dtype, headdim, causal) with the providers
as columns and writes everything, with the versions and the git commit, as JSON to bench/results/.

    python bench/bench_attention.py                     # the full grid
    python bench/bench_attention.py --quick             # a few shapes, for a smoke run
    python bench/bench_attention.py --hdims 128 --seqlens 4096 8192 --causal on --mode fwd
    python bench/bench_attention.py --providers flashhopper flashhopper@no-pingpong --rounds 3   # a variant
    python bench/bench_attention.py --fa3-path .peers/fa3 --providers flashhopper fa3 sdpa-cudnn

--rounds N (default 3) times the providers of a shape in turn (A B C, A B C, ...) N times and reports each
one's median over the rounds (ms_rounds keeps them): clock drift under the power cap hits all alike.
--label tags the file (e.g. base / new for bench/compare_builds.py, which takes files of two builds).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

from flashhopper.report import fa3
from flashhopper.report.environment import environment
from flashhopper.report.providers import provider_name, with_fa3
from flashhopper.report.sweep import DTYPES, grid, run_sweep, skip_reasons
from flashhopper.report.timing import make_timer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROVIDERS = ["flashhopper", "flashhopper-sm80", "sdpa-cudnn", "sdpa-fa2", "sdpa-memeff"]


def print_table(rows: list[dict[str, Any]], providers: list[str]) -> None:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["dtype"], r["headdim"], r["causal"]), []).append(r)
    for (mode, dtype, hdim, causal), rs in groups.items():
        cols = [p for p in providers if any(r["provider"] == p and "tflops" in r for r in rs)]
        # Providers whose kernel computes in another precision than the inputs (fp8 on bf16 inputs).
        other: dict[str, list[str]] = {}
        for p in cols:
            kd = next((r.get("kernel_dtype", dtype) for r in rs if r["provider"] == p and "tflops" in r), dtype)
            if kd != dtype:
                other.setdefault(kd, []).append(p)
        note = "".join(f"; {kd} kernels on these {dtype} inputs: {', '.join(ps)}" for kd, ps in other.items())
        print(f"\n**{mode} {dtype} headdim {hdim} {'causal' if causal else 'non-causal'}** (TFLOPS{note})\n")
        print("| seqlen | " + " | ".join(cols) + " |")
        print("|---|" + "---|" * len(cols))
        for s in sorted({r["seqlen"] for r in rs}):
            cells = {r["provider"]: f"{r['tflops']:.0f}" for r in rs if r["seqlen"] == s and "tflops" in r}
            print(f"| {s} | " + " | ".join(cells.get(p, "") for p in cols) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", choices=["off", "on", "both"], default="both")
    ap.add_argument("--mode", choices=["fwd", "bwd", "both"], default="both")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--providers", nargs="+", type=provider_name, metavar="NAME",
                    help="flashhopper.report.providers.PROVIDERS or flashhopper@<variant> (default: "
                    f"{' '.join(DEFAULT_PROVIDERS)}, + fa3 fa3-fp8 where FA3 is configured)")
    ap.add_argument("--fa3-path", type=Path, help="a folder with FlashAttention-3's flash_attn_interface.py and "
                    f"flash_attn_3/ (default: ${fa3.ENV})")
    ap.add_argument("--tokens", type=int, default=16384, help="batch x seqlen (batch = tokens // seqlen, at least 1)")
    ap.add_argument("--width", type=int, default=2048, help="nheads x headdim")
    ap.add_argument("--quick", action="store_true", help="seqlens 1024 4096, head dim 128, shorter timing")
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--rounds", type=int, default=3, metavar="N",
                    help="time the providers of a shape in turn N times; report the median of the N interleaved "
                    "rounds (default: %(default)s)")
    ap.add_argument("--label", help="recorded in the file and its default name (e.g. base, new)")
    ap.add_argument("--out", type=Path, help="JSON path (default bench/results/<device>[_<label>]_<date>.json)")
    args = ap.parse_args(argv)
    if args.fa3_path is not None:
        fa3.set_path(args.fa3_path)
    args.providers = args.providers or with_fa3(DEFAULT_PROVIDERS)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device; nothing to measure", file=sys.stderr)
        return 2
    if args.quick:
        args.seqlens, args.hdims, args.rep_ms = [1024, 4096], [128], 30

    timer_name, timer = make_timer(args.warmup_ms, args.rep_ms)
    env = environment(timer_name, ROOT)
    print(f"{env['device']} | torch {env['torch']} CUDA {env['cuda']} cuDNN {env['cudnn']} | flashhopper "
          f"{env['flashhopper']} ({env['flashhopper_kernels']} kernels) @ {env['git_commit']} | {timer_name}")
    modes = ["fwd", "bwd"] if args.mode == "both" else [args.mode]
    causals = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    shapes = grid({h: args.seqlens for h in args.hdims}, modes, [args.dtype], causals, args.tokens, args.width)
    rows = run_sweep(shapes, args.providers, timer, rounds=args.rounds)
    notes = skip_reasons(rows)
    print_table(rows, args.providers)
    if notes:
        print("\nSkipped (first reason per provider and mode):")
        for who, why in notes.items():
            print(f"- {who}: {why}")

    slug = "_".join(re.sub(r"[^a-z0-9]+", "-", x.lower()).strip("-") for x in (env["device"], args.label) if x)
    out = args.out or ROOT / "bench" / "results" / f"{slug}_{dt.datetime.now():%Y-%m-%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "args": {k: str(v) for k, v in vars(args).items()},
                               "label": args.label, "results": rows}, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
