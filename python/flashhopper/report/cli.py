"""``flashhopper-report`` (also ``python -m flashhopper.report``): how close each attention kernel
runs to this GPU's ceilings, next to the peers on the machine.

On a CUDA GPU it measures the ceilings (dense bf16 and fp8 GEMM through torch, device-to-device
copy), then times every built flashhopper kernel and PyTorch SDPA's backends over a sweep (default:
a quick one, under 2 minutes on an H100; --full: the FlashAttention-3 paper's grid), and writes
report.json, report.csv and PNG plots to --out. Per row: time, TFLOPS, % of the measured GEMM
ceiling, % of the datasheet peak, speedup over the best peer, and the IO model's bytes.

The providers of a shape are timed in turn (A B C, A B C, ...) --rounds times (default 3) and each
time is the median over the rounds: under the power cap the clock drifts within a minute, and
interleaving exposes every provider to it alike.

--from FILE re-renders a report (or a bench/bench_attention.py result) without a GPU. With no GPU
and no --from, it renders the newest result shipped in bench/results/.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import flashhopper

from . import ceilings, fa3, render
from .environment import environment, source_root
from .progress import progress_bar
from .providers import provider_name, with_fa3
from .results import Report, load, newest
from .sweep import DTYPES, FULL, QUICK, grid, run_sweep
from .timing import make_timer


def _rounds(text: str) -> int:
    """--rounds: a whole number of at least 1 (run_sweep would refuse 0 only after the ceilings)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="flashhopper-report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the FA3-paper grid: head dims 64/128/256, seqlens "
                    "512..16k, fwd and bwd, every peer (several minutes)")
    ap.add_argument("--hdims", type=int, nargs="+", help="head dims (default: the sweep's)")
    ap.add_argument("--seqlens", type=int, nargs="+", help="sequence lengths, for every head dim")
    ap.add_argument("--causal", choices=["off", "on", "both"], default="both")
    ap.add_argument("--mode", choices=["fwd", "bwd", "both"], help="default: fwd (quick), both (--full)")
    ap.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["bf16"])
    ap.add_argument("--providers", nargs="+", type=provider_name, metavar="NAME",
                    help="providers.PROVIDERS or flashhopper@<variant>; default: ours + sdpa-cudnn, sdpa-fa2 "
                    "(quick), + sdpa-memeff (--full), + fa3, fa3-fp8 where FA3 is configured")
    ap.add_argument("--fa3-path", type=Path, help="a folder with FlashAttention-3's flash_attn_interface.py and "
                    f"flash_attn_3/, timed as the peers fa3 and fa3-fp8 (default: ${fa3.ENV})")
    ap.add_argument("--batch", type=int, help="fixed batch (default: tokens // seqlen)")
    ap.add_argument("--tokens", type=int, default=16384, help="batch x seqlen when --batch is not given")
    ap.add_argument("--width", type=int, default=2048, help="nheads x headdim")
    ap.add_argument("--warmup-ms", type=float, help="per measurement (default 10 quick, 25 full)")
    ap.add_argument("--rep-ms", type=float, help="per measurement (default 50 quick, 100 full)")
    ap.add_argument("--rounds", type=_rounds, default=3, metavar="N", help="time the providers of a shape in "
                    "turn N times; each time is the median of the N interleaved rounds (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("flashhopper-report"), help="output folder (default: %(default)s)")
    ap.add_argument("--from", dest="from_file", type=Path, metavar="FILE",
                    help="render this results file (report or bench_attention.py JSON) instead of measuring")
    ap.add_argument("--results-dir", type=Path, help="where to find the newest result without a GPU "
                    "(default: bench/results of the source tree)")
    return ap.parse_args(argv)


def measure(args: argparse.Namespace) -> Report:
    preset = FULL if args.full else QUICK
    hdims = args.hdims or list(preset.plan)
    longest = max(preset.plan.values(), key=len)  # for a head dim the preset does not list
    plan = {h: tuple(args.seqlens) if args.seqlens else preset.plan.get(h, longest) for h in hdims}
    modes = {"fwd": ["fwd"], "bwd": ["bwd"], "both": ["fwd", "bwd"]}.get(args.mode, list(preset.modes))
    causals = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    providers = args.providers or with_fa3(preset.providers)
    warmup_ms, rep_ms = args.warmup_ms or preset.warmup_ms, args.rep_ms or preset.rep_ms
    timer_name, timer = make_timer(warmup_ms, rep_ms)
    # The header shows the timer: say there that each time is a median over interleaved rounds.
    env = environment(f"{timer_name}, median of {args.rounds} interleaved rounds", source_root())
    env["kernels"] = flashhopper.compiled_kernels()
    print(f"{env['device']}: measuring the ceilings (GEMM bf16/fp8, copy)...", file=sys.stderr)
    ceil = ceilings.measure(timer, args.dtype)
    shapes = grid(plan, modes, args.dtype, causals, args.tokens, args.width, args.batch)
    with progress_bar("sweep") as tick:
        rows = run_sweep(shapes, providers, timer, tick, rounds=args.rounds)
    config = {"sweep": "full" if args.full else "quick", "plan": {str(h): list(s) for h, s in plan.items()},
              "modes": modes, "dtypes": args.dtype, "causal": causals, "providers": providers,
              "tokens": args.tokens, "width": args.width, "batch": args.batch, "warmup_ms": warmup_ms, "rep_ms": rep_ms,
              "rounds": args.rounds}
    return Report(env, config, rows, ceil, ceilings.datasheet_for(env["device"]))


def _results_dir(args: argparse.Namespace) -> Path | None:
    if args.results_dir is not None:
        return args.results_dir
    root = source_root()
    return None if root is None else root / "bench" / "results"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fa3_path is not None:
        fa3.set_path(args.fa3_path)
    if args.from_file is not None:
        report = load(args.from_file)
        print(f"rendering {args.from_file} ({report.device}, {report.date})")
    elif not torch.cuda.is_available():
        folder = _results_dir(args)
        path = newest(folder) if folder is not None and folder.is_dir() else None
        if path is None:
            where = f"no results file in {folder}" if folder else "not run from the flashhopper source tree"
            print(f"no CUDA GPU found, and no shipped result to render ({where}); pass --from FILE",
                  file=sys.stderr)
            return 2
        report = load(path)
        print(f"no CUDA GPU found: rendering {path} ({report.device}, {report.date})")
    else:
        report = measure(args)
    print(render.console(report))
    written = render.write_all(report, args.out)
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
