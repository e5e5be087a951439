#!/usr/bin/env python3
"""Before/after: bench_attention.py results of two builds on the same grid, cell by cell.

A cell is a shape and a provider (mode, dtype, head dim, causal, seqlen, batch, heads, provider). Each
side's time of a cell is the median over that side's files (run them in alternating processes: base,
new, base, new, so that clock drift reaches both alike); the ratio is new TFLOPS / base TFLOPS (base ms /
new ms: above 1 the new build is faster). Per (mode, provider): the geometric mean of the ratios, the
worst cell, and whether the mean lies within --tolerance of 1. Cells measured on one side only are
listed. Exit 1 when a mean lies outside the tolerance or a cell was measured on one side only.

    python bench/compare_builds.py --base base-1.json base-2.json --new new-1.json new-2.json
    scripts/gpu.sh compare ...        # builds both trees' runs and calls this (see scripts/gpu.sh)
A file's --label (bench_attention.py), when it has one, must name the side it is passed as.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashhopper.report.metrics import SHAPE

CELL = (*SHAPE, "provider")
Cell = tuple[Any, ...]


def load_side(paths: Sequence[Path], side: str) -> dict[Cell, float]:
    """Cell -> median ms over the files of one side; skipped rows leave no sample."""
    samples: dict[Cell, list[float]] = {}
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if not isinstance(doc, dict) or "results" not in doc:
            raise ValueError(f"{path}: not a bench/bench_attention.py result")
        label = doc.get("label")
        if label is not None and label != side:
            raise ValueError(f"{path} is labelled {label!r} but passed as --{side}")
        for row in doc["results"]:
            if row.get("ms") is not None:
                samples.setdefault(tuple(row[c] for c in CELL), []).append(row["ms"])
    return {cell: statistics.median(ms) for cell, ms in samples.items()}


def _order(cell: Cell) -> tuple[Any, ...]:
    return (cell[0], cell[-1], *cell[1:-1])  # mode, provider, then the shape


def _describe(cell: Cell) -> str:
    c = dict(zip(CELL, cell))
    return (f"{c['mode']} {c['provider']} {c['dtype']} d{c['headdim']} {'causal' if c['causal'] else 'non-causal'} "
            f"s{c['seqlen']} b{c['batch']} h{c['nheads']}")


def compare(base: dict[Cell, float], new: dict[Cell, float], tolerance: float) -> tuple[str, bool]:
    """The markdown report and whether every (mode, provider) mean lies within ``tolerance`` of 1
    with no cell measured on one side only."""
    both = sorted(base.keys() & new.keys(), key=_order)
    lines = ["| mode | provider | dtype | headdim | causal | seqlen | base ms | new ms | new/base |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[tuple[float, Cell]]] = {}
    for cell in both:
        row = dict(zip(CELL, cell))
        ratio = base[cell] / new[cell]
        groups.setdefault((row["mode"], row["provider"]), []).append((ratio, cell))
        lines.append(f"| {row['mode']} | {row['provider']} | {row['dtype']} | {row['headdim']} | "
                     f"{'yes' if row['causal'] else 'no'} | {row['seqlen']} | {base[cell]:.4f} | {new[cell]:.4f} | "
                     f"{ratio:.3f} |")
    ok = bool(both)  # nothing measured on both sides proves nothing
    lines += ["", f"Geometric mean of new/base TFLOPS per mode and provider (within {tolerance:.1%} of 1 = no change):",
              "", "| mode | provider | cells | geomean | worst cell | verdict |", "|---|---|---|---|---|---|"]
    for (mode, prov), rs in sorted(groups.items()):
        mean = math.exp(statistics.fmean(math.log(r) for r, _ in rs))
        worst, cell = max(rs, key=lambda rc: abs(math.log(rc[0])))
        inside = abs(mean - 1) <= tolerance
        ok &= inside
        verdict = "within" if inside else ("FASTER" if mean > 1 else "SLOWER")
        lines.append(f"| {mode} | {prov} | {len(rs)} | {mean:.4f} | {worst:.3f} ({_describe(cell)}) | {verdict} |")
    for side, only in (("base", base.keys() - new.keys()), ("new", new.keys() - base.keys())):
        if only:
            ok = False
            lines += ["", f"Measured in {side} only ({len(only)}): "
                      + "; ".join(_describe(cell) for cell in sorted(only, key=_order))]
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, nargs="+", required=True, help="result files of the baseline build")
    ap.add_argument("--new", type=Path, nargs="+", required=True, help="result files of the new build")
    ap.add_argument("--tolerance", type=float, default=0.02, help="allowed |geomean - 1| (default %(default)s)")
    args = ap.parse_args(argv)
    try:
        base, new = load_side(args.base, "base"), load_side(args.new, "new")
    except (OSError, ValueError, KeyError) as e:
        print(f"compare_builds: {e}", file=sys.stderr)
        return 2
    text, ok = compare(base, new, args.tolerance)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
