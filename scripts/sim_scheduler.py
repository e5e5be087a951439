#!/usr/bin/env python3
"""Load balance of the persistent forward's tile orders on the FA3-paper grid, simulated on the CPU.

Each tile costs its number of key blocks plus a fixed per-tile overhead (in key blocks). Prints, per causal
shape, the efficiency (mean CTA load / makespan) of
  static-snake  tiles dealt round-robin in snake order (v1),
  greedy        the dynamic order (tile_scheduler.h: heaviest first inside sections of heads whose K/V fit
                in --section-mb), each CTA taking its next tile from the counter either when it starts its
                current one ("start") or `--ahead` key blocks before that one ends ("late": once the
                producer has issued its loads); the section of the heads left over either alone ("short
                last") or joined to the one before ("merged", the kernel's).
Efficiency says nothing about L2 reuse: heaviest-first over all heads balanced best here and still ran
HBM-bound at 2k (docs/perf-notes.md).

    python scripts/sim_scheduler.py --overhead 2
"""
import argparse
import heapq
import math

# (label, head dim, bytes per element, kBlockM, kBlockN): the forward tiles (cpp/sm90/tile_size.h)
TILES = (("bf16", 64, 2, 192, 128), ("bf16", 128, 2, 128, 128), ("bf16", 256, 2, 128, 80),
         ("e4m3", 64, 1, 192, 160), ("e4m3", 128, 1, 128, 192), ("e4m3", 256, 1, 128, 128))


def section_sizes(num_bh: int, per_section: int, merged: bool) -> list[int]:
    sizes = [min(per_section, num_bh - s) for s in range(0, num_bh, per_section)]
    if merged and len(sizes) > 1 and sizes[-1] < per_section:
        sizes[-2] += sizes.pop()
    return sizes


def tile_costs(seqlen: int, hdim: int, elem: int, block_m: int, block_n: int, section_bytes: float,
               overhead: float, merged: bool) -> list[float]:
    """Causal tile costs in the dynamic scheduler's order (FA3-paper shape: 16k tokens, 2048 / hdim heads)."""
    num_bh = (16384 // seqlen) * (2048 // hdim)
    num_m = math.ceil(seqlen / block_m)
    per_section = min(num_bh, max(1, int(section_bytes // (seqlen * hdim * 2 * elem))))
    costs = []
    for heads in section_sizes(num_bh, per_section, merged):
        for m in reversed(range(num_m)):
            costs += [math.ceil(min((m + 1) * block_m, seqlen) / block_n) + overhead] * heads
    return costs


def static_snake(costs: list[float], ctas: int) -> float:
    load = [0.0] * ctas
    for rnd in range(math.ceil(len(costs) / ctas)):
        for c in range(ctas):
            pos = rnd * ctas + (ctas - 1 - c if rnd & 1 else c)
            if pos < len(costs):
                load[c] += costs[pos]
    return sum(costs) / ctas / max(load)


def greedy(costs: list[float], ctas: int, ahead: float | None) -> float:
    """Each CTA fetches its next tile `ahead` key blocks before its current one ends; None: when it starts it."""
    events = []  # (fetch time, cta, end of its current tile)
    for c in range(min(ctas, len(costs))):
        heapq.heappush(events, (0.0 if ahead is None else max(0.0, costs[c] - ahead), c, costs[c]))
    nxt, end = min(ctas, len(costs)), 0.0
    while events:
        t_fetch, c, t_end = heapq.heappop(events)
        end = max(end, t_end)
        if nxt < len(costs):
            w = costs[nxt]
            nxt += 1
            heapq.heappush(events, (t_end if ahead is None else max(t_fetch, t_end + w - ahead), c, t_end + w))
    return sum(costs) / ctas / end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--overhead", type=float, default=2.0)
    ap.add_argument("--ctas", type=int, default=132)
    ap.add_argument("--section-mb", type=float, default=25.0, help="K/V bytes per section (half of the L2)")
    ap.add_argument("--ahead", type=float, default=2.0, help="late fetch: key blocks before the tile's end")
    a = ap.parse_args()
    sb = a.section_mb * 2**20
    print("shape              static-snake  start, short last  late, short last  late, merged (the kernel's)")
    for dt, hdim, elem, bm, bn in TILES:
        for seqlen in (512, 2048, 8192, 16384):
            short = tile_costs(seqlen, hdim, elem, bm, bn, sb, a.overhead, False)
            merged = tile_costs(seqlen, hdim, elem, bm, bn, sb, a.overhead, True)
            print(f"{dt} d{hdim:<3} s{seqlen:<5}  {static_snake(short, a.ctas):12.3f}  "
                  f"{greedy(short, a.ctas, None):17.3f}  {greedy(short, a.ctas, a.ahead):16.3f}  "
                  f"{greedy(merged, a.ctas, a.ahead):26.3f}")


if __name__ == "__main__":
    main()
