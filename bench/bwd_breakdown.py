#!/usr/bin/env python3
"""Where a backward's time goes: per-kernel GPU time of one `torch.autograd.grad`, ours and a peer's.

    python bench/bwd_breakdown.py --hdim 128 --seqlens 2048 16384 [--causal] [--peer sdpa-cudnn]

FA3-paper shapes (batch = 16384 // seqlen, nheads = 2048 // hdim, bf16). The forward runs once; then
`--iters` backward passes on the kept graph under torch.profiler, the L2 flushed before each. Prints,
per kernel name, the median time per pass and its share of the pass's summed kernel time, and the
pass's wall time (CUDA events, median), so that launch gaps show as wall minus summed kernels.
"""
import argparse
import statistics
from collections import defaultdict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention
from torch.profiler import ProfilerActivity, profile

from flashhopper import flash_attn_func

PEERS = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-fa2": SDPBackend.FLASH_ATTENTION}


def short(name: str, width: int = 70) -> str:
    name = name.replace("void ", "")
    return name if len(name) <= width else name[: width - 3] + "..."


def breakdown(provider: str, hdim: int, seqlen: int, causal: bool, iters: int) -> None:
    b, h = 16384 // seqlen, 2048 // hdim
    q, k, v = (torch.randn(b, seqlen, h, hdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    if provider == "flashhopper":
        out = flash_attn_func(q, k, v, causal=causal)
    else:
        with sdpa_kernel(PEERS[provider]):
            out = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=causal).transpose(1, 2)
    dout = torch.randn_like(out)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")  # several times L2

    def one() -> None:
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

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
    for name, times in per_kernel.items():
        if len(times) < iters:
            continue
        rows.append((name, statistics.median(times) * len(times) / iters))
    total = sum(t for _, t in rows)
    flops = 2.5 * 4 * b * h * seqlen * seqlen * hdim * (0.5 if causal else 1.0)
    wall = statistics.median(walls)
    print(f"\n{provider} d{hdim} s{seqlen} {'causal' if causal else 'non-causal'}: wall {wall:.0f} us "
          f"({flops / wall / 1e6:.0f} TFLOPS), kernels {total:.0f} us")
    for name, t in sorted(rows, key=lambda r: -r[1]):
        print(f"  {t:9.1f} us {100 * t / total:5.1f}%  {short(name)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--peer", choices=sorted(PEERS), nargs="*", default=["sdpa-cudnn"])
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for hdim in a.hdim:
        for s in a.seqlens:
            for provider in ["flashhopper", *a.peer]:
                breakdown(provider, hdim, s, a.causal, a.iters)


if __name__ == "__main__":
    main()
