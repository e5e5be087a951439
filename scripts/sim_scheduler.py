#!/usr/bin/env python3
"""Load balance of the persistent tile orders on the FA3-paper grid, simulated on the CPU.

Each tile costs its number of key blocks plus a fixed per-tile overhead (in key blocks; ~4 at d=128
by docs/perf-notes.md). Prints, per shape, the efficiency (mean CTA load / max CTA load) of
  static-snake  tiles dealt round-robin in snake order (v1),
  greedy        each CTA takes the next tile when it starts one (the causal scheduler),
for L2 section budgets (bytes of K/V per section). Efficiency says nothing about L2 reuse:
heaviest-first over all heads balanced best here and still ran HBM-bound at 2k (see the notes).

    python scripts/sim_scheduler.py --overhead 4
"""
import argparse
import heapq
import math


def tile_costs(seqlen: int, hdim: int, block_m: int, block_n: int, causal: bool, section_bytes: float,
               overhead: float) -> list[float]:
    batch, heads = 16384 // seqlen, 2048 // hdim
    num_m, num_bh = math.ceil(seqlen / block_m), batch * heads
    per_section = min(num_bh, max(1, int(section_bytes // (seqlen * hdim * 2 * 2))))
    costs = []
    for t in range(num_m * num_bh):  # the DynamicTileScheduler's decode
        section, r = divmod(t, num_m * per_section)
        here = min(per_section, num_bh - section * per_section)
        m = num_m - 1 - r // here
        n_blocks = math.ceil(seqlen / block_n)
        if causal:
            n_blocks = min(n_blocks, math.ceil((m + 1) * block_m / block_n))
        costs.append(n_blocks + overhead)
    return costs


def static_snake(costs: list[float], ctas: int) -> float:
    load = [0.0] * ctas
    for rnd in range(math.ceil(len(costs) / ctas)):
        for c in range(ctas):
            pos = rnd * ctas + (ctas - 1 - c if rnd & 1 else c)
            if pos < len(costs):
                load[c] += costs[pos]
    return sum(costs) / ctas / max(load)


def greedy(costs: list[float], ctas: int) -> float:
    heap = [(0.0, c) for c in range(ctas)]
    for w in costs:
        t, c = heapq.heappop(heap)
        heapq.heappush(heap, (t + w, c))
    return sum(costs) / ctas / max(t for t, _ in heap)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--overhead", type=float, default=4.0)
    ap.add_argument("--ctas", type=int, default=132)
    args = ap.parse_args()
    budgets = (25e6, 1e15)  # half of H100's L2 (the kernel's choice), and no sections at all
    print("shape                      static-snake  greedy(25MB sections)  greedy(no sections)")
    for hdim, bm, bn in ((64, 192, 128), (128, 128, 128), (256, 128, 80)):
        for seqlen in (512, 2048, 8192, 16384):
            c25 = tile_costs(seqlen, hdim, bm, bn, True, budgets[0], args.overhead)
            call = tile_costs(seqlen, hdim, bm, bn, True, budgets[1], args.overhead)
            print(f"d{hdim:<3} s{seqlen:<5} causal       {static_snake(c25, args.ctas):12.3f}  "
                  f"{greedy(c25, args.ctas):21.3f}  {greedy(call, args.ctas):19.3f}")


if __name__ == "__main__":
    main()
