"""GPU timing shared by the report and bench/bench_attention.py: medians of
triton.testing.do_bench (L2 flushed between runs), or of CUDA events when triton is missing.

The flush: do_bench's (and "write") zeroes a 256 MB buffer, which leaves the L2 full of dirty lines that the timed
call evicts, so HBM takes their write-back beside the call's reads: ~9 us of a 100 us bf16 decode step measured
(docs/perf-notes.md, session 48), noise for a millisecond kernel. "read" flushes by reading the buffer (clean lines,
nothing to write back), as a step that follows the model's weight reads finds the L2."""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

Fn = Callable[[], Any]
Timer = Callable[[Fn], float]  # fn -> median milliseconds


FLUSHES = ("write", "read")


def _events_median(fn: Fn, warmup_ms: float, rep_ms: float, flush_by: str = "write") -> float:
    """CUDA-event median with an L2 flush before each run (``flush_by``: FLUSHES, the module's docstring), like
    do_bench's for "write"."""
    if flush_by not in FLUSHES:
        raise ValueError(f"flush_by must be one of {FLUSHES}, got {flush_by!r}")
    buf = torch.zeros(256 * 1024 * 1024 // 4, dtype=torch.float32, device="cuda")  # int32 sums cast to int64 first
    flush = buf.zero_ if flush_by == "write" else buf.sum
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
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def make_timer(warmup_ms: float, rep_ms: float, flush_by: str = "write") -> tuple[str, Timer]:
    """(description, timer): the timer returns the median time of fn in milliseconds. ``flush_by`` "read": CUDA
    events with the L2 flushed by reads (the module's docstring); "write": do_bench's zeroing."""
    if flush_by == "read":
        return "cuda-events median, L2 flushed by reads", lambda fn: _events_median(fn, warmup_ms, rep_ms, "read")
    if flush_by != "write":
        raise ValueError(f"flush_by must be one of {FLUSHES}, got {flush_by!r}")
    try:
        from triton.testing import do_bench
    except ImportError:
        return "cuda-events median (triton not installed)", lambda fn: _events_median(fn, warmup_ms, rep_ms)
    return "triton.testing.do_bench median", lambda fn: do_bench(
        fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def graphed(fn: Fn) -> tuple[Fn, bool]:
    """(replay of a CUDA graph of fn, True), or (fn, False) when fn cannot be captured. Timing the replay
    measures the GPU's time alone: no host time between the kernels, which small shapes otherwise include
    whenever the host falls behind (bench/bench_quant.py, bench/bench_varlen.py --graphs)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the capture (allocator, lazy inits)
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001  (anything the capture refuses: host syncs, pageable copies)
        torch.cuda.synchronize()
        return fn, False
    return graph.replay, True


def interleaved(fns: dict[str, Fn], timer: Timer, rounds: int) -> dict[str, float]:
    """Median of ``rounds`` timings of each of ``fns``, taken in turn (A B C, A B C, ...), so that drifts of the
    clock or the temperature fall on every provider alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(timer(fn))
    return {name: statistics.median(s) for name, s in samples.items()}

