#!/usr/bin/env python3
"""Where a backward's time goes: per-kernel GPU time of one `torch.autograd.grad`, ours and a peer's.

    python bench/bwd_breakdown.py --hdim 128 --seqlens 2048 16384 [--causal] [--peer sdpa-cudnn fa3]

FA3-paper shapes (batch = 16384 // seqlen, nheads = 2048 // hdim, bf16). Each provider (the benchmarks'
flashhopper.report.providers: a variant as flashhopper@<name>, FA3 with --fa3-path) is prepared as the
benchmarks prepare it (the forward once, the backward once); then `--iters` backward passes on the kept
graph under torch.profiler, the L2 flushed before each. Prints, per kernel name, the median time per pass
and its share of the pass's summed kernel time, and the pass's wall time (CUDA events, median), so that
launch gaps show as wall minus summed kernels.
"""
import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashhopper.report import fa3
from flashhopper.report.providers import Unavailable, provider, provider_name
from flashhopper.report.sweep import grid, inputs


def short(name: str, width: int = 70) -> str:
    name = name.replace("void ", "")
    return name if len(name) <= width else name[: width - 3] + "..."


def breakdown(name: str, hdim: int, seqlen: int, causal: bool, iters: int) -> None:
    shape = grid({hdim: (seqlen,)}, ["bwd"], ["bf16"], [causal], tokens=16384, width=2048)[0]
    q, k, v = inputs(shape)
    p = provider(name)
    try:
        with p.context():
            one = p.prepare("bwd", q, k, v, causal).fn
    except Unavailable as e:
        print(f"\n{name} d{hdim} s{seqlen}: skipped ({e})")
        return
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")  # several times L2
    for _ in range(3):
        one()
    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.bitwise_not_()  # a kernel of its own name, left out below
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            one()
            end.record()
            end.synchronize()
            walls.append(start.elapsed_time(end) * 1e3)
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "bitwise_not" not in ev.name.lower():
            per_kernel[ev.name].append(ev.time_range.elapsed_us())
    rows = []
    for kernel, times in per_kernel.items():
        if len(times) < iters:
            continue
        rows.append((kernel, statistics.median(times) * len(times) / iters))
    total = sum(t for _, t in rows)
    flops = shape.flops()
    wall = statistics.median(walls)
    print(f"\n{name} d{hdim} s{seqlen} {'causal' if causal else 'non-causal'}: wall {wall:.0f} us "
          f"({flops / wall / 1e6:.0f} TFLOPS), kernels {total:.0f} us")
    for kernel, t in sorted(rows, key=lambda r: -r[1]):
        print(f"  {t:9.1f} us {100 * t / total:5.1f}%  {short(kernel)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--peer", type=provider_name, nargs="*", default=["sdpa-cudnn"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fa3-path", type=Path, help=f"FlashAttention-3's folder, for --peer fa3 (default: ${fa3.ENV})")
    a = ap.parse_args()
    if a.fa3_path is not None:
        fa3.set_path(a.fa3_path)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for hdim in a.hdim:
        for s in a.seqlens:
            for who in ["flashhopper", *a.peer]:
                breakdown(who, hdim, s, a.causal, a.iters)


if __name__ == "__main__":
    main()
