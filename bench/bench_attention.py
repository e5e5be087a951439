#!/usr/bin/env python3
"""Attention forward/backward throughput: flashhopper next to PyTorch SDPA's backends, same shapes.

Default grid (FlashAttention-3 paper): batch x seqlen = 16384 tokens, nheads x headdim = 2048,
seqlen 512..16384, head dims 64/128/256, causal off and on, forward and backward. Times are medians
of triton.testing.do_bench (L2 flushed between runs), or of CUDA events when triton is missing;
TFLOPS by flashhopper.flops. Prints one table per (mode, dtype, headdim, causal) with the providers
as columns and writes everything, with the versions and the git commit, as JSON to bench/results/.

    python bench/bench_attention.py                     # the full grid
    python bench/bench_attention.py --quick             # a few shapes, for a smoke run
    python bench/bench_attention.py --hdims 128 --seqlens 4096 8192 --causal on --mode fwd
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashhopper
from flashhopper import dispatch
from flashhopper.flops import attention_flops, tflops

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SDPA = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-fa2": SDPBackend.FLASH_ATTENTION,
        "sdpa-memeff": SDPBackend.EFFICIENT_ATTENTION}
OURS = {"flashhopper": None, "flashhopper-sm90": "sm90", "flashhopper-sm80": "sm80"}  # provider -> backend
PROVIDERS = ["flashhopper", "flashhopper-sm80", "sdpa-cudnn", "sdpa-fa2", "sdpa-memeff"]
Fn = Callable[[], Any]


class Unavailable(Exception):
    """A provider cannot run this configuration here; the message says why."""


# --- timing ---------------------------------------------------------------------------------

def _events_median(fn: Fn, warmup_ms: float, rep_ms: float) -> float:
    """CUDA-event median with L2 flushes, like do_bench, for machines without triton."""
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = max(5, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def make_timer(warmup_ms: float, rep_ms: float) -> tuple[str, Callable[[Fn], float]]:
    try:
        from triton.testing import do_bench
    except ImportError:
        return "cuda-events median (triton not installed)", lambda fn: _events_median(fn, warmup_ms, rep_ms)
    return "triton.testing.do_bench median", lambda fn: do_bench(
        fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


# --- providers: each returns the callable to time, after one untimed run that proves it works --

def ours(backend: str | None, mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         causal: bool) -> Fn:
    if mode == "bwd":
        raise Unavailable("flashhopper has no backward yet")
    try:
        name = dispatch.select_backend(q, q.shape[-1], q.dtype, causal, backend)
    except (ValueError, TypeError) as e:
        raise Unavailable(str(e)) from None
    if name == "reference":
        raise Unavailable("no kernel: auto-dispatch chose the reference")

    def fn() -> Any:
        return flashhopper.flash_attn_func(q, k, v, causal=causal, backend=name)

    return fn


def sdpa(backend: SDPBackend, mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         causal: bool) -> Fn:
    # Same memory as ours: (batch, seqlen, nheads, headdim) tensors, seen as (b, h, s, d) views.
    leaves = [x.detach().requires_grad_(mode == "bwd") for x in (q, k, v)]
    qt, kt, vt = (x.transpose(1, 2) for x in leaves)

    def fwd() -> torch.Tensor:  # run inside sdpa_kernel([backend]) (see provider_context)
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    try:
        with warnings.catch_warnings(), sdpa_kernel([backend]):
            warnings.simplefilter("ignore")  # SDPA explains refusals as warnings; we keep the error
            out = fwd()
    except RuntimeError as e:
        raise Unavailable(str(e).splitlines()[0]) from None
    if mode == "fwd":
        return fwd
    dout = torch.randn_like(out)

    def bwd() -> Any:  # the backward alone, on a graph kept from one forward
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    try:
        bwd()
    except RuntimeError as e:
        raise Unavailable(str(e).splitlines()[0]) from None
    return bwd


def provider_fn(provider: str, mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Fn:
    if provider in OURS:
        return ours(OURS[provider], mode, q, k, v, causal)
    return sdpa(SDPA[provider], mode, q, k, v, causal)


def provider_context(provider: str) -> contextlib.AbstractContextManager[Any]:
    """Entered around the timing rather than inside the timed call: SDPA's backend choice."""
    return sdpa_kernel([SDPA[provider]]) if provider in SDPA else contextlib.nullcontext()


def check_against_sdpa(fn: Fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> float:
    """||ours - SDPA|| / ||SDPA|| (untimed): a benchmark of a wrong kernel is worthless."""
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal).transpose(1, 2).double()
    return ((fn().double() - ref).norm() / ref.norm()).item()


# --- report ---------------------------------------------------------------------------------

def git_commit() -> str | None:
    """HEAD of the source tree; the device machine gets a copy without .git, so there the caller
    passes it in FLASHHOPPER_GIT_COMMIT."""
    if os.environ.get("FLASHHOPPER_GIT_COMMIT"):
        return os.environ["FLASHHOPPER_GIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("-dirty" if dirty else "")


def environment(timer: str) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "num_sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "flashhopper": flashhopper.__version__,
        "flashhopper_build": flashhopper.build_info(),
        "flashhopper_kernels": len(flashhopper.compiled_kernels()),
        "git_commit": git_commit(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "timer": timer,
        "command": " ".join(sys.argv),
    }


def print_table(rows: list[dict[str, Any]], providers: list[str]) -> None:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["dtype"], r["headdim"], r["causal"]), []).append(r)
    for (mode, dtype, hdim, causal), rs in groups.items():
        cols = [p for p in providers if any(r["provider"] == p and "tflops" in r for r in rs)]
        print(f"\n**{mode} {dtype} headdim {hdim} {'causal' if causal else 'non-causal'}** (TFLOPS)\n")
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
    ap.add_argument("--providers", nargs="+", default=PROVIDERS, choices=list(OURS) + list(SDPA))
    ap.add_argument("--tokens", type=int, default=16384, help="batch x seqlen (batch = tokens // seqlen, at least 1)")
    ap.add_argument("--width", type=int, default=2048, help="nheads x headdim")
    ap.add_argument("--quick", action="store_true", help="seqlens 1024 4096, head dim 128, shorter timing")
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--out", type=Path, help="JSON path (default bench/results/<device>_<date>.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device; nothing to measure", file=sys.stderr)
        return 2
    if args.quick:
        args.seqlens, args.hdims, args.rep_ms = [1024, 4096], [128], 30

    timer_name, timer = make_timer(args.warmup_ms, args.rep_ms)
    env = environment(timer_name)
    print(f"{env['device']} | torch {env['torch']} CUDA {env['cuda']} cuDNN {env['cudnn']} | flashhopper "
          f"{env['flashhopper']} ({env['flashhopper_kernels']} kernels) @ {env['git_commit']} | {timer_name}")
    modes = ["fwd", "bwd"] if args.mode == "both" else [args.mode]
    causals = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    dtype = DTYPES[args.dtype]
    rows: list[dict[str, Any]] = []
    notes: dict[str, str] = {}
    for mode in modes:
        for hdim in args.hdims:
            nheads = max(1, args.width // hdim)
            for causal in causals:
                for seqlen in args.seqlens:
                    batch = max(1, args.tokens // seqlen)
                    q, k, v = (torch.randn(batch, seqlen, nheads, hdim, dtype=dtype, device="cuda")
                               for _ in range(3))
                    flops = attention_flops(batch, seqlen, seqlen, nheads, hdim, causal,
                                            "bwd" if mode == "bwd" else "fwd")
                    for p in args.providers:
                        row = {"mode": mode, "dtype": args.dtype, "headdim": hdim, "causal": causal,
                               "seqlen": seqlen, "batch": batch, "nheads": nheads, "provider": p}
                        try:
                            fn = provider_fn(p, mode, q, k, v, causal)
                        except Unavailable as e:
                            row["skipped"] = str(e)
                            notes.setdefault(f"{p} ({mode})", str(e))
                            rows.append(row)
                            continue
                        if p in OURS:
                            row["rel_err_vs_sdpa"] = err = check_against_sdpa(fn, q, k, v, causal)
                            if not err < 1e-2:
                                print(f"WARNING: {p} differs from SDPA by {err:.2e} at {row}", file=sys.stderr)
                        with provider_context(p):
                            ms = timer(fn)
                        row.update(ms=ms, tflops=tflops(flops, ms))
                        rows.append(row)
                    del q, k, v
                    torch.cuda.empty_cache()
    print_table(rows, args.providers)
    if notes:
        print("\nSkipped (first reason per provider and mode):")
        for who, why in notes.items():
            print(f"- {who}: {why}")

    slug = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    out = args.out or ROOT / "bench" / "results" / f"{slug}_{dt.datetime.now():%Y-%m-%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "args": {k: str(v) for k, v in vars(args).items()},
                               "results": rows}, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
