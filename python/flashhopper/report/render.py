"""What a report looks like: console tables, CSV, JSON and PNG plots, all from a Report."""
from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tabulate import tabulate

from .metrics import COLUMNS, datasheet_peak, gemm_ceiling
from .providers import is_ours
from .results import Report, to_json
from .sweep import skip_reasons

TABLE_HEADERS = ("seqlen", "batch x heads", "provider", "ms", "TFLOPS", "% GEMM ceiling", "% datasheet peak",
                 "vs best peer", "IO standard", "IO ours", "ours TB/s")
_ALIGN = ("right", "right", "left", *["right"] * 4, "left", *["right"] * 3)
IO_NOTE = ("IO: HBM bytes by the FlashAttention paper's model (section 3.2, Theorem 2): standard attention writes "
           "and reads S and P (4Nd + 4N^2 elements); ours reads Q and writes O once and streams K, V once per "
           "query tile of the kernel's real block_m x block_n. ours TB/s = those bytes / time: K/V re-reads "
           "partly hit L2, so it may exceed the HBM peak.")


def _f(x: float | None, fmt: str, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{fmt}}{suffix}"


def _bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def group_title(mode: str, dtype: str, headdim: int, causal: bool) -> str:
    return f"{mode} {dtype} headdim {headdim} {'causal' if causal else 'non-causal'}"


def _groups(rows: Iterable[dict[str, Any]], *keys: str) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    out: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def _provider_order(rows: Iterable[dict[str, Any]]) -> list[str]:
    names = list(dict.fromkeys(r["provider"] for r in rows))
    return [n for n in names if is_ours(n)] + [n for n in names if not is_ours(n)]


def table_rows(rows: list[dict[str, Any]]) -> dict[str, list[list[str]]]:
    """Derived rows that were measured, as formatted cells, one table per (mode, dtype, head dim, causal)."""
    measured = [r for r in rows if r["tflops"] is not None]
    order = {p: i for i, p in enumerate(_provider_order(measured))}
    tables: dict[str, list[list[str]]] = {}
    for key, rs in _groups(measured, "mode", "dtype", "headdim", "causal").items():
        rs.sort(key=lambda r: (r["seqlen"], order[r["provider"]]))
        tables[group_title(*key)] = [[
            str(r["seqlen"]), f"{r['batch']} x {r['nheads']}", r["provider"], f"{r['ms']:.3f}", f"{r['tflops']:.0f}",
            _f(r["pct_gemm_ceiling"], ".1f", "%"), _f(r["pct_datasheet_peak"], ".1f", "%"),
            "" if r["speedup_vs_best_peer"] is None else f"{r['speedup_vs_best_peer']:.2f}x {r['best_peer']}",
            "" if not is_ours(r["provider"]) else _bytes(r["io_standard_bytes"]),
            "" if not is_ours(r["provider"]) else _bytes(r["io_ours_bytes"]),
            "" if not is_ours(r["provider"]) else _f(r["io_ours_tbps"], ".2f"),
        ] for r in rs]
    return tables


def _ceiling_line(report: Report) -> str:
    if report.ceilings is None:
        return ("Ceilings: not measured in this file (a bench_attention.py result); "
                "'% GEMM ceiling' is n/a, the datasheet peaks below still apply.")
    parts = [f"{d} GEMM " + (f"{c['tflops']:.0f} TFLOPS" if "tflops" in c else f"failed ({c['error']})")
             for d, c in report.ceilings.get("gemm", {}).items()]
    copy = report.ceilings.get("copy") or {}
    parts.append("copy " + (f"{copy['tbps']:.2f} TB/s" if "tbps" in copy else f"failed ({copy.get('error')})"))
    hows = "; ".join(c["how"] for c in [*report.ceilings.get("gemm", {}).values(), copy] if "how" in c)
    return f"Ceilings measured in the same run: {', '.join(parts)}  [{hows}]"


def _datasheet_line(report: Report) -> str:
    sheet = report.datasheet
    if sheet is None:
        return f"Datasheet: no entry for {report.device!r}; '% datasheet peak' is n/a."
    peaks = ", ".join(f"{d} {_f(v, '.1f')}" for d, v in sheet["tflops"].items())
    return (f"Datasheet ({sheet['name']}, dense): {peaks} TFLOPS, HBM {sheet['hbm_tbps']} TB/s "
            f"[source: {sheet['source']}]")


def header(report: Report) -> str:
    env = report.environment
    where = "measured in this run" if report.source is None else f"from {report.source}"
    lines = [
        f"{report.device}, {report.date} ({where})",
        f"torch {env.get('torch')} CUDA {env.get('cuda')} cuDNN {env.get('cudnn')} | flashhopper "
        f"{env.get('flashhopper')} ({env.get('flashhopper_kernels')} kernels) @ {env.get('git_commit')} | "
        f"{env.get('timer')}",
    ]
    if env.get("gpu_health"):
        lines.append(f"GPU health recorded with the file: {env['gpu_health']}")
    lines += [_ceiling_line(report), _datasheet_line(report),
              "TFLOPS by the FlashAttention convention (flashhopper.flops); 'vs best peer' = our TFLOPS / the "
              "best peer's (SDPA, FA3 where measured) on the same shape, in the same kernel precision.", IO_NOTE]
    return "\n".join(lines)


def console(report: Report) -> str:
    """The whole report as text: header, one table per group, the skipped providers."""
    parts = [header(report)]
    for title, cells in table_rows(report.derived()).items():
        parts.append(f"\n{title}\n" + tabulate(cells, headers=TABLE_HEADERS, tablefmt="github",
                                               disable_numparse=True, colalign=_ALIGN))
    notes = skip_reasons(report.rows, by=("mode", "dtype"))
    if notes:
        parts.append("\nSkipped (first reason per provider, mode and dtype):\n"
                     + "\n".join(f"- {who}: {why}" for who, why in notes.items()))
    return "\n".join(parts)


def write_json(report: Report, path: Path) -> None:
    path.write_text(json.dumps(to_json(report), indent=1) + "\n")


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)


def _seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def _panel(ax: Any, rows: list[dict[str, Any]], providers: list[str], color: dict[str, str],
           lines: list[tuple[float, str, dict[str, Any]]], top: float) -> None:
    """One head dim and causal setting: a line per provider, the ceilings as horizontal lines."""
    for p in providers:
        pts = sorted((r["seqlen"], r["tflops"]) for r in rows if r["provider"] == p)
        if pts:
            ours = is_ours(p)
            ax.plot(*zip(*pts), marker="o", color=color[p], label=p, lw=2.4 if ours else 1.3,
                    ls="-" if ours else "--", ms=5 if ours else 4)
    for y, label, style in lines:
        ax.axhline(y, label=label, **style)
    if not rows:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="gray")
    seqlens = sorted({r["seqlen"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [_seqlen_label(s) for s in seqlens])
    ax.minorticks_off()
    ax.set_ylim(0, top)
    ax.grid(alpha=0.3)
    ax.set_xlabel("sequence length")


def plot(report: Report, rows: list[dict[str, Any]], folder: Path) -> list[Path]:
    """One PNG per (mode, dtype): TFLOPS against seqlen, a panel per (causal, head dim), ours
    against the peers, the measured GEMM ceiling and the datasheet peak as horizontal lines."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    measured = [r for r in rows if r["tflops"] is not None]
    providers = _provider_order(measured)
    color = {p: f"C{i % 10}" for i, p in enumerate(providers)}
    written = []
    for (mode, dtype), rs in _groups(measured, "mode", "dtype").items():
        ceiling, peak = gemm_ceiling(report.ceilings, dtype), datasheet_peak(report.datasheet, dtype)
        lines: list[tuple[float, str, dict[str, Any]]] = []
        if ceiling:
            lines.append((ceiling, f"{dtype} GEMM ceiling, measured ({ceiling:.0f})", {"color": "black", "ls": "-."}))
        if peak:
            lines.append((peak, f"{dtype} datasheet peak ({peak:.0f})", {"color": "gray", "ls": ":"}))
        top = 1.1 * max([r["tflops"] for r in rs] + [y for y, _, _ in lines])
        hdims, causals = sorted({r["headdim"] for r in rs}), sorted({r["causal"] for r in rs})
        fig = Figure(figsize=(4.2 * len(hdims) + 0.6, 3.3 * len(causals) + 1.2), layout="constrained")
        axes = fig.subplots(len(causals), len(hdims), squeeze=False, sharey=True)
        for i, causal in enumerate(causals):
            for j, hdim in enumerate(hdims):
                panel = [r for r in rs if r["causal"] == causal and r["headdim"] == hdim]
                _panel(axes[i][j], panel, providers, color, lines, top)
                axes[i][j].set_title(f"head dim {hdim}, {'causal' if causal else 'non-causal'}", fontsize=10)
            axes[i][0].set_ylabel("TFLOPS (FA convention)")
        handles = {label: h for ax in axes.flat for h, label in zip(*ax.get_legend_handles_labels())}
        labels = [p for p in providers if p in handles] + [x for x in handles if x not in providers]
        fig.legend([handles[x] for x in labels], labels, loc="outside lower center", ncols=min(4, len(labels)),
                   fontsize=9, frameon=False)
        note = "" if report.ceilings is not None else " (no measured ceiling in this file)"
        fig.suptitle(f"flashhopper {mode} {dtype} vs peers: {report.device}, {report.date[:10]}{note}", fontsize=11)
        path = folder / f"tflops_{mode}_{dtype}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


def write_all(report: Report, folder: Path) -> list[Path]:
    """report.json, report.csv and the PNGs into ``folder`` (created); returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = report.derived()
    write_json(report, folder / "report.json")
    write_csv(rows, folder / "report.csv")
    return [folder / "report.json", folder / "report.csv", *plot(report, rows, folder)]
