#!/usr/bin/env python3
"""What the model variants cost (issue #23), same run, providers interleaved (A B C, A B C, ... median of
--rounds), L2 flushed between runs (report.timing). Three tables:

- cost: softcap (c = 30) and sinks against plain attention, same kernel, forward and backward, on the
  FA3-paper grid (16k tokens, 2048 / headdim heads) at 2k and 8k tokens per sequence;
- window: a sliding window (left, 0) with causal over one long sequence against dense causal attention
  over sequences as long as the window, with the same number of query tokens; "per work" divides each
  time by the (query, key) pairs it visits (flops.visible_pairs), so 1.0 means time proportional to work;
- fa3: ours against FlashAttention-3 (--fa3-path, the fa3-full build: window and softcap at head dim 128)
  on window and softcap rows, forward and backward;
- headdims: head dims 96 and 192 and the (Q/K, V) pairs 192x128 and 128x64 against head dim 128, TFLOPS
  counted as 2 * (d + dv) per score, on the FA3-paper grid (16k tokens, about 2048 / d heads);
- dropout: dropout_p = 0.1 against none, forward, backward and the two together (a training step's
  attention), on the cost section's grid.

    python bench/bench_variants.py --fa3-path .peers/fa3-full --rounds 3 --out bench/results/variants.json
    python bench/bench_variants.py --sections cost --hdims 64 --modes fwd   # a build with head dim 64 only
    python bench/bench_variants.py --sections headdims --modes fwd --pairs 128x64 --seqlens 512 1024 2048
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashhopper import flash_attn_func
from flashhopper.flops import attention_flops, tflops
from flashhopper.report import fa3
from flashhopper.report.environment import environment, source_root
from flashhopper.report.timing import interleaved, make_timer

Fn = Callable[[], Any]


@dataclass(frozen=True)
class Grid:
    """What --hdims, --modes and --causal restrict: the cost and dropout sections' head dims and masks (the
    others fix theirs), and the modes of every section but dropout (which times a training step's both)."""
    hdims: tuple[int, ...] = (64, 128, 256)
    modes: tuple[str, ...] = ("fwd", "bwd")
    causal: tuple[bool, ...] = (False, True)
    # the headdims section's (Q/K, V) pairs (128 always, the reference) and sequence lengths
    pairs: tuple[str, ...] = ("96", "192", "192x128", "128x64")
    seqlens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)  # the FA3-paper grid


def timeable(mode: str, call: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             sinks: torch.Tensor | None = None) -> Fn:
    """The forward, or the backward alone on a graph kept from one forward (q, k, v and sinks get grads)."""
    leaves = [x.detach().requires_grad_(mode == "bwd") for x in (q, k, v)]
    extra = [] if sinks is None else [sinks.detach().requires_grad_(mode == "bwd")]
    if mode == "fwd":
        return lambda: call(*leaves, *extra)
    out = call(*leaves, *extra)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves + extra, dout, retain_graph=True)


def ours(causal: bool, window: tuple[int, int] = (-1, -1), softcap: float = 0.0, with_sinks: bool = False,
         dropout_p: float = 0.0) -> Callable[..., torch.Tensor]:
    if dropout_p > 0:
        return lambda q, k, v: flash_attn_func(q, k, v, causal=causal, dropout_p=dropout_p)
    if with_sinks:
        return lambda q, k, v, s: flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, sinks=s)
    return lambda q, k, v: flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)


def inputs(batch: int, seqlen: int, heads: int, d: int, dv: int | None = None) -> tuple[torch.Tensor, ...]:
    q, k, v = (torch.randn(batch, seqlen, heads, dim, dtype=torch.bfloat16, device="cuda")
               for dim in (d, d, d if dv is None else dv))
    sinks = torch.randn(heads, device="cuda") + math.log(seqlen)
    return q, k, v, sinks


def section_cost(timer: Callable[[Fn], float], rounds: int, grid: Grid) -> list[dict[str, Any]]:
    rows = []
    for mode in grid.modes:
        for d in grid.hdims:
            for causal in grid.causal:
                for seqlen in (2048, 8192):
                    batch, heads = 16384 // seqlen, 2048 // d
                    q, k, v, s = inputs(batch, seqlen, heads, d)
                    fns = {"plain": timeable(mode, ours(causal), q, k, v),
                           "softcap": timeable(mode, ours(causal, softcap=30.0), q, k, v),
                           "sinks": timeable(mode, ours(causal, with_sinks=True), q, k, v, s)}
                    ms = interleaved(fns, timer, rounds)
                    flops = attention_flops(batch, seqlen, seqlen, heads, d, causal, mode)
                    rows.append({"section": "cost", "mode": mode, "headdim": d, "causal": causal, "seqlen": seqlen,
                                 "batch": batch, "nheads": heads, **{f"ms_{n}": t for n, t in ms.items()},
                                 "tflops_plain": tflops(flops, ms["plain"]),
                                 "softcap_over_plain": ms["softcap"] / ms["plain"],
                                 "sinks_over_plain": ms["sinks"] / ms["plain"]})
                    print(f"cost {mode} d{d} {'causal' if causal else 'full'} {seqlen}: plain {ms['plain']:.3f} ms "
                          f"({rows[-1]['tflops_plain']:.0f} TFLOPS), softcap x{rows[-1]['softcap_over_plain']:.3f}, "
                          f"sinks x{rows[-1]['sinks_over_plain']:.3f}", flush=True)
    return rows


def section_window(timer: Callable[[Fn], float], rounds: int, grid: Grid) -> list[dict[str, Any]]:
    rows = []
    for mode in grid.modes:
        for total, left in ((32768, 4096), (32768, 1024), (16384, 4096)):
            d, heads = 128, 16
            qw, kw, vw, _ = inputs(1, total, heads, d)
            qd, kd, vd, _ = inputs(total // left, left, heads, d)
            fns = {"window": timeable(mode, ours(True, (left, 0)), qw, kw, vw),
                   "dense": timeable(mode, ours(True), qd, kd, vd)}
            ms = interleaved(fns, timer, rounds)
            fw = attention_flops(1, total, total, heads, d, True, mode, (left, 0))
            fd = attention_flops(total // left, left, left, heads, d, True, mode, (-1, 0))  # exact pairs
            row = {"section": "window", "mode": mode, "tokens": total, "window": [left, 0], "headdim": d, "nheads": heads,
                   "ms_window": ms["window"], "ms_dense": ms["dense"], "tflops_window": tflops(fw, ms["window"]),
                   "tflops_dense": tflops(fd, ms["dense"]), "work_ratio": fw / fd,
                   "time_per_work_ratio": (ms["window"] / fw) / (ms["dense"] / fd)}
            rows.append(row)
            print(f"window {mode} ({left}, 0) causal over {total}: {ms['window']:.3f} ms vs dense causal "
                  f"{total // left}x{left} {ms['dense']:.3f} ms; work x{row['work_ratio']:.2f}, time per work "
                  f"x{row['time_per_work_ratio']:.3f}", flush=True)
    return rows


def section_fa3(timer: Callable[[Fn], float], rounds: int, grid: Grid) -> list[dict[str, Any]]:
    iface = fa3.load()
    rows = []
    d, heads = 128, 16
    cases = [  # (label, seqlen, causal, window, softcap)
        ("window (4096,0) 32k", 32768, True, (4096, 0), 0.0),
        ("window (1024,0) 8k", 8192, True, (1024, 0), 0.0),
        ("window (256,256) 8k", 8192, False, (256, 256), 0.0),
        ("softcap 30 2k", 2048, False, (-1, -1), 30.0),
        ("softcap 30 8k", 8192, False, (-1, -1), 30.0),
        ("softcap 30 causal 2k", 2048, True, (-1, -1), 30.0),
        ("softcap 30 causal 8k", 8192, True, (-1, -1), 30.0),
    ]
    for mode in grid.modes:
        for label, seqlen, causal, window, softcap in cases:
            batch = max(1, 16384 // seqlen)
            q, k, v, _ = inputs(batch, seqlen, heads, d)

            def theirs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = causal,
                       window: tuple[int, int] = window, softcap: float = softcap) -> torch.Tensor:
                return iface.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)

            fns = {"flashhopper": timeable(mode, ours(causal, window, softcap), q, k, v),
                   "fa3": timeable(mode, theirs, q, k, v)}
            ms = interleaved(fns, timer, rounds)
            flops = attention_flops(batch, seqlen, seqlen, heads, d, causal, mode, window)
            row = {"section": "fa3", "mode": mode, "case": label, "batch": batch, "seqlen": seqlen, "headdim": d,
                   "nheads": heads, "causal": causal, "window": list(window), "softcap": softcap,
                   "ms_flashhopper": ms["flashhopper"], "ms_fa3": ms["fa3"],
                   "tflops_flashhopper": tflops(flops, ms["flashhopper"]), "tflops_fa3": tflops(flops, ms["fa3"]),
                   "speedup_vs_fa3": ms["fa3"] / ms["flashhopper"]}
            rows.append(row)
            print(f"fa3 {mode} {label}: ours {row['tflops_flashhopper']:.0f} TFLOPS, FA3 {row['tflops_fa3']:.0f}, "
                  f"x{row['speedup_vs_fa3']:.3f}", flush=True)
    return rows


HEADDIM_PAIRS = {"96": (96, 96), "128": (128, 128), "192": (192, 192), "192x128": (192, 128), "128x64": (128, 64)}


def section_headdims(timer: Callable[[Fn], float], rounds: int, grid: Grid) -> list[dict[str, Any]]:
    rows = []
    dims = {name: HEADDIM_PAIRS[name] for name in ("128", *grid.pairs)}
    for mode in grid.modes:
        for causal in (False, True):
            for seqlen in grid.seqlens:
                batch, fns, flops = 16384 // seqlen, {}, {}
                for name, (d, dv) in dims.items():
                    heads = round(2048 / d)
                    q, k, v, _ = inputs(batch, seqlen, heads, d, dv)
                    fns[name] = timeable(mode, ours(causal), q, k, v)
                    flops[name] = attention_flops(batch, seqlen, seqlen, heads, d, causal, mode, headdim_v=dv)
                ms = interleaved(fns, timer, rounds)
                tf = {name: tflops(flops[name], ms[name]) for name in dims}
                rows.append({"section": "headdims", "mode": mode, "causal": causal, "seqlen": seqlen, "batch": batch,
                             **{f"ms_{n}": t for n, t in ms.items()}, **{f"tflops_{n}": t for n, t in tf.items()},
                             **{f"{n}_over_128": tf[n] / tf["128"] for n in dims if n != "128"}})
                print(f"headdims {mode} {'causal' if causal else 'full'} {seqlen}: "
                      + ", ".join(f"{n} {tf[n]:.0f}" + ("" if n == "128" else f" (x{tf[n] / tf['128']:.2f})")
                                  for n in dims) + " TFLOPS", flush=True)
    return rows


def section_dropout(timer: Callable[[Fn], float], rounds: int, grid: Grid) -> list[dict[str, Any]]:
    rows = []
    for d in grid.hdims:
        for causal in grid.causal:
            for seqlen in (2048, 8192):
                batch, heads = 16384 // seqlen, 2048 // d
                q, k, v, _ = inputs(batch, seqlen, heads, d)
                fns = {f"{name}_{mode}": timeable(mode, ours(causal, dropout_p=p), q, k, v)
                       for name, p in (("plain", 0.0), ("dropout", 0.1)) for mode in ("fwd", "bwd")}
                ms = interleaved(fns, timer, rounds)
                row: dict[str, Any] = {"section": "dropout", "headdim": d, "causal": causal, "seqlen": seqlen,
                                       "batch": batch, "nheads": heads, **{f"ms_{n}": t for n, t in ms.items()}}
                for mode in ("fwd", "bwd"):
                    row[f"{mode}_dropout_over_plain"] = ms[f"dropout_{mode}"] / ms[f"plain_{mode}"]
                    row[f"tflops_plain_{mode}"] = tflops(attention_flops(batch, seqlen, seqlen, heads, d, causal, mode),
                                                         ms[f"plain_{mode}"])
                row["fwdbwd_dropout_over_plain"] = ((ms["dropout_fwd"] + ms["dropout_bwd"])
                                                    / (ms["plain_fwd"] + ms["plain_bwd"]))
                rows.append(row)
                print(f"dropout d{d} {'causal' if causal else 'full'} {seqlen}: plain fwd {row['tflops_plain_fwd']:.0f} / "
                      f"bwd {row['tflops_plain_bwd']:.0f} TFLOPS; dropout 0.1 x{row['fwd_dropout_over_plain']:.3f} fwd, "
                      f"x{row['bwd_dropout_over_plain']:.3f} bwd, x{row['fwdbwd_dropout_over_plain']:.3f} fwd+bwd",
                      flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="*", choices=("cost", "window", "fa3", "headdims", "dropout"),
                    default=["cost", "window", "fa3", "headdims", "dropout"])
    ap.add_argument("--fa3-path", type=Path, help=f"FA3 build with window and softcap (default: ${fa3.ENV})")
    ap.add_argument("--hdims", nargs="*", type=int, default=list(Grid.hdims),
                    help="head dims of the cost and dropout sections (the build must have them)")
    ap.add_argument("--modes", nargs="*", choices=("fwd", "bwd"), default=list(Grid.modes),
                    help="modes of the cost, window, fa3 and headdims sections")
    ap.add_argument("--causal", choices=("off", "on", "both"), default="both",
                    help="masks of the cost and dropout sections")
    ap.add_argument("--pairs", nargs="*", choices=[n for n in HEADDIM_PAIRS if n != "128"], default=list(Grid.pairs),
                    help="(Q/K, V) head dims of the headdims section, against 128")
    ap.add_argument("--seqlens", nargs="*", type=int, default=list(Grid.seqlens),
                    help="sequence lengths of the headdims section (16k tokens each)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_variants needs a CUDA device", file=sys.stderr)
        return 1
    if args.fa3_path is not None:
        fa3.set_path(args.fa3_path)
    timing, timer = make_timer(args.warmup_ms, args.rep_ms)
    rows: list[dict[str, Any]] = []
    masks = {"off": (False,), "on": (True,), "both": (False, True)}[args.causal]
    grid = Grid(tuple(args.hdims), tuple(args.modes), masks, tuple(args.pairs), tuple(args.seqlens))
    for name, fn in (("cost", section_cost), ("window", section_window), ("fa3", section_fa3),
                     ("headdims", section_headdims), ("dropout", section_dropout)):
        if name not in args.sections:
            continue
        if name == "fa3" and not fa3.configured():
            print("fa3 section skipped: no FA3 build (--fa3-path or $" + fa3.ENV + ")")
            continue
        rows += fn(timer, args.rounds, grid)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"environment": environment(timing, source_root()), "timing": timing, "rounds": args.rounds,
                                        "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
