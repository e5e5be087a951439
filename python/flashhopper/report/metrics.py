"""Per-row numbers derived from the measurements: TFLOPS (through flashhopper.flops), the share of
the measured GEMM ceiling and of the datasheet peak, the speedup over the best peer on the same
shape and kernel precision (SDPA's backends, FA3 where it was measured), and the IO model's bytes
(standard attention against ours) with the bandwidth achieved.

Everything here is recomputed from the raw fields (shape, provider, ms, tile sizes), so a file
renders the same whichever tool wrote it.
"""
from __future__ import annotations

from typing import Any

from flashhopper.flops import attention_flops, tflops

from . import io_model
from .providers import is_ours
from .sweep import DTYPES

SHAPE = ("mode", "dtype", "headdim", "causal", "seqlen", "batch", "nheads")
# kernel_dtype: what the kernel computes in when it is not the inputs' dtype (the fp8 providers: "fp8").
RAW = SHAPE + ("provider", "backend", "kernel_dtype", "block_m", "block_n", "ms", "rel_err_vs_sdpa", "skipped")
DERIVED = ("tflops", "pct_gemm_ceiling", "pct_datasheet_peak", "best_peer", "speedup_vs_best_peer",
           "io_standard_bytes", "io_ours_bytes", "io_ours_tbps")
COLUMNS = RAW + DERIVED


def _pct(x: float, of: float | None) -> float | None:
    return 100.0 * x / of if of else None


def gemm_ceiling(ceilings: dict[str, Any] | None, dtype: str) -> float | None:
    """Measured GEMM TFLOPS for ``dtype``, None when not measured or failed."""
    return (((ceilings or {}).get("gemm") or {}).get(dtype) or {}).get("tflops")


def datasheet_peak(datasheet: dict[str, Any] | None, dtype: str) -> float | None:
    return ((datasheet or {}).get("tflops") or {}).get(dtype)


def _io(row: dict[str, Any]) -> dict[str, Any]:
    """IO model of our forward rows; None elsewhere (the backward's model is not written yet, and
    files without tile sizes cannot say what ours moves)."""
    dtype = DTYPES.get(row["dtype"])
    if row["mode"] != "fwd" or dtype is None:
        return {}
    b, h, s, d, es = row["batch"], row["nheads"], row["seqlen"], row["headdim"], dtype.itemsize
    # Standard attention in the inputs' precision; an fp8 kernel reads e4m3 Q, K, V and writes O as they came.
    kernel = DTYPES.get(row.get("kernel_dtype") or row["dtype"], dtype)
    out: dict[str, Any] = {"io_standard_bytes": io_model.standard_bytes(b, h, s, s, d, es)}
    if row["block_m"] and row["block_n"]:
        ours = io_model.flash_fwd_bytes(b, h, s, s, d, kernel.itemsize, row["block_m"], row["block_n"], row["causal"],
                                        out_bytes=es)
        out.update(io_ours_bytes=ours, io_ours_tbps=io_model.tbps(ours, row["ms"]))
    return out


def _peer_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """Rows that compete: the same shape, computed in the same precision (an fp8 kernel against fp8
    peers such as fa3-fp8, not against the bf16 ones)."""
    return (*(row[c] for c in SHAPE), row["kernel_dtype"])


def derive(rows: list[dict[str, Any]], ceilings: dict[str, Any] | None,
           datasheet: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every row with all COLUMNS (None where a value does not apply or is unknown)."""
    out: list[dict[str, Any]] = [{**{c: r.get(c) for c in RAW}, **dict.fromkeys(DERIVED)} for r in rows]
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in out:
        if r["ms"] is None:
            continue
        r["tflops"] = tflops(attention_flops(r["batch"], r["seqlen"], r["seqlen"], r["nheads"], r["headdim"],
                                             r["causal"], r["mode"]), r["ms"])
        compute = r["kernel_dtype"] or r["dtype"]  # an fp8 kernel is measured against the fp8 ceilings
        r["pct_gemm_ceiling"] = _pct(r["tflops"], gemm_ceiling(ceilings, compute))
        r["pct_datasheet_peak"] = _pct(r["tflops"], datasheet_peak(datasheet, compute))
        if not is_ours(r["provider"]) and r["tflops"] > best.get(_peer_key(r), {}).get("tflops", 0.0):
            best[_peer_key(r)] = r
    for r in out:
        if r["ms"] is None or not is_ours(r["provider"]):
            continue
        peer = best.get(_peer_key(r))
        if peer is not None:
            r["best_peer"], r["speedup_vs_best_peer"] = peer["provider"], r["tflops"] / peer["tflops"]
        r.update(_io(r))
    return out

