"""The shapes to measure and the loop that times every provider on each of them.

Shapes follow the FlashAttention-3 paper: batch x seqlen = ``tokens`` (16384), nheads x headdim =
``width`` (2048), square attention (seqlen_q = seqlen_k). Inputs are fresh randn tensors per shape.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashhopper.flops import attention_flops, tflops

from .providers import Prepared, Provider, Unavailable, check_against_sdpa, is_checked, is_ours, provider
from .timing import Timer

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
FA3_SEQLENS: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
Progress = Callable[[int, int, str], None]  # (done, total, what was just measured)


@dataclass(frozen=True)
class Shape:
    mode: str
    dtype: str
    headdim: int
    causal: bool
    seqlen: int
    batch: int
    nheads: int

    def flops(self) -> float:
        return attention_flops(self.batch, self.seqlen, self.seqlen, self.nheads, self.headdim, self.causal,
                               self.mode)  # type: ignore[arg-type]  # attention_flops checks it

    def label(self) -> str:
        return (f"{self.mode} {self.dtype} d{self.headdim} {'causal' if self.causal else 'non-causal'} "
                f"s{self.seqlen}")


@dataclass(frozen=True)
class Preset:
    plan: Mapping[int, tuple[int, ...]]  # head dim -> seqlens
    modes: tuple[str, ...]
    providers: tuple[str, ...]
    warmup_ms: float
    rep_ms: float


_OURS = ("flashhopper-sm90", "flashhopper-sm80")
# The default: under 2 minutes on an H100, head dim 128 over three lengths and the others at one.
QUICK = Preset({64: (4096,), 128: (1024, 4096, 16384), 256: (4096,)}, ("fwd",),
               _OURS + ("flashhopper-fp8", "sdpa-cudnn", "sdpa-fa2"), warmup_ms=10, rep_ms=50)
# The FlashAttention-3 paper's grid, every peer.
FULL = Preset({h: FA3_SEQLENS for h in (64, 128, 256)}, ("fwd", "bwd"),
              _OURS + ("flashhopper-fp8", "flashhopper-fp8-e2e", "sdpa-cudnn", "sdpa-fa2", "sdpa-memeff"),
              warmup_ms=25, rep_ms=100)


def grid(plan: Mapping[int, Sequence[int]], modes: Sequence[str], dtypes: Sequence[str],
         causals: Sequence[bool], tokens: int, width: int, batch: int | None = None) -> list[Shape]:
    """Every (mode, dtype, head dim, causal, seqlen) of ``plan``; batch = tokens // seqlen unless given."""
    return [Shape(mode, dtype, hdim, causal, seqlen, batch or max(1, tokens // seqlen), max(1, width // hdim))
            for mode in modes for dtype in dtypes for hdim, seqlens in plan.items()
            for causal in causals for seqlen in seqlens]


def inputs(shape: Shape, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh randn q, k, v (never zeros: data-dependent paths must do real work)."""
    dims = (shape.batch, shape.seqlen, shape.nheads, shape.headdim)
    dtype = DTYPES[shape.dtype]
    draw = torch.bfloat16 if dtype.itemsize == 1 else dtype  # randn has no fp8 kernel: draw, then round
    q, k, v = (torch.randn(dims, dtype=draw, device=device).to(dtype) for _ in range(3))
    return q, k, v


def _check_output(name: str, prov: Provider, prepared: Prepared, shape: Shape, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, row: dict[str, Any]) -> None:
    """The forward's error against SDPA into ``row``, for ours and FA3 (``is_checked``). A peer beyond its
    tolerance raises Unavailable: timed, its wrong output would stand as the best peer. Ours are timed
    all the same, with a warning: the row shows the error beside the time."""
    if not is_checked(name) or shape.mode != "fwd":
        return
    row["rel_err_vs_sdpa"] = err = check_against_sdpa(prepared.fn, q, k, v, shape.causal)
    if err is None or err < prov.rel_err_tolerance:  # fp8: its own rounding, its own tolerance
        return
    if not is_ours(name):
        raise Unavailable(f"output check failed: rel err {err:.2e} vs SDPA > tol {prov.rel_err_tolerance:.0e}")
    print(f"WARNING: {name} differs from SDPA by {err:.2e} at {row}", file=sys.stderr)


def run_sweep(shapes: Sequence[Shape], providers: Sequence[str], timer: Timer,
              progress: Progress | None = None, rounds: int = 1) -> list[dict[str, Any]]:
    """Time every provider on every shape: one row each, with the shape, the provider and either
    ms + tflops (ours also: backend, tile sizes; ours and FA3: error against SDPA) or why it was skipped
    (a peer whose output fails the check against SDPA is skipped, saying so, and not timed).

    With ``rounds`` > 1 the providers of a shape are timed in turn that many times (A B A B ...) and
    ms is the median of the rounds (each round's ms in ``ms_rounds``): under the power cap the clock
    drifts by several percent within a minute, and interleaving exposes every provider to it alike."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    resolved = {name: provider(name) for name in providers}  # an unknown name fails before any measurement
    rows: list[dict[str, Any]] = []
    total, done = len(shapes) * len(resolved), 0
    for shape in shapes:
        q, k, v = inputs(shape)
        timed: list[tuple[dict[str, Any], Provider, Prepared, list[float]]] = []
        for name, prov in resolved.items():
            row: dict[str, Any] = {**dataclasses.asdict(shape), "provider": name}
            rows.append(row)
            try:
                with prov.context():
                    prepared = prov.prepare(shape.mode, q, k, v, shape.causal)
                row.update(prepared.meta)
                _check_output(name, prov, prepared, shape, q, k, v, row)
            except Unavailable as e:
                row["skipped"] = str(e)
                done += 1
                if progress is not None:
                    progress(done, total, f"{shape.label()} {name}")
                continue
            timed.append((row, prov, prepared, []))
        for r in range(rounds):
            for row, prov, prepared, samples in timed:
                with prov.context():
                    samples.append(timer(prepared.fn))
                if r == rounds - 1:
                    done += 1
                    if progress is not None:
                        progress(done, total, f"{shape.label()} {row['provider']}")
        for row, _, _, samples in timed:
            ms = statistics.median(samples)
            row.update(ms=ms, tflops=tflops(shape.flops(), ms))
            if rounds > 1:
                row["ms_rounds"] = samples
        del q, k, v, timed
        torch.cuda.empty_cache()
    return rows


def skip_reasons(rows: Sequence[dict[str, Any]], by: Sequence[str] = ("mode",)) -> dict[str, str]:
    """The first skip reason per "provider (mode)", or per provider and the row fields ``by``."""
    notes: dict[str, str] = {}
    for r in rows:
        if r.get("skipped"):
            notes.setdefault(f"{r['provider']} ({' '.join(str(r[k]) for k in by)})", r["skipped"])
    return notes
