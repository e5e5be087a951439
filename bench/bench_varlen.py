#!/usr/bin/env python3
"""Packed batches (issue #21), same run, providers interleaved (median of --rounds), L2 flushed between runs
(report.timing). TFLOPS count the real work: the sum of the sequences' own FLOPs (fwd = 4 s_q s_k h d per
sequence, halved for causal; --mode bwd: the backward alone, 2.5 x that, on a graph kept from one forward).
Sections:

- equal: equal lengths, the varlen kernel against our padded-batch kernel on the same tokens (the FA3-paper
  grid: 16k tokens, 2048 / d heads, head dims 64/128/256, causal and not); --backend sm80 times the Ampere
  kernels (on any GPU that runs them), --graphs CUDA-graph replays (GPU time only);
--mode fp8: the e4m3 forward on pre-quantized inputs (the inference path: quantization not timed): the packed
kernel on PackedFP8Tensors against the padded one on FP8Tensors of the same tokens (equal), and in the mixed
section against the padded one at the mean length and FA3's varlen with e4m3 inputs and per-(sequence, head)
descales (when its build takes them).

- mixed: 64 documents, lengths log-uniform in 128..8192 (seeded), d128, 16 heads: the varlen kernel, our
  padded-batch kernel on equal sequences of the mean length (the same tokens), FlashAttention-3's varlen
  (--fa3-path, the fa3-full build) on the same packed batch and at equal lengths, and cuDNN's SDPA on the
  batch padded to the longest document (its time counts the padding; TFLOPS still count the real work; each
  row gives the padded and real token counts and the padded call's FLOPs over the real work).

    python bench/bench_varlen.py --fa3-path .peers/fa3-full --rounds 3 --out bench/results/varlen.json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flashhopper import (flash_attn_fp8_func, flash_attn_func, flash_attn_varlen_fp8_func, flash_attn_varlen_func,
                         fp8, quantize_fp8)
from flashhopper.flops import attention_flops, tflops
from flashhopper.report import fa3
from flashhopper.report.environment import environment, source_root
from flashhopper.report.providers import timeable
from flashhopper.report.timing import graphed, interleaved, make_timer

Fn = Callable[[], Any]


def cu_of(lengths: list[int]) -> torch.Tensor:
    c = [0]
    for n in lengths:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32, device="cuda")


def work(lengths: list[int], heads: int, d: int, causal: bool, mode: str = "fwd") -> int:
    return sum(attention_flops(1, n, n, heads, d, causal, mode) for n in lengths)


def padding_overhead(lengths: list[int], heads: int, d: int, causal: bool, mode: str = "fwd") -> dict[str, Any]:
    """What a batch padded to the longest document (cuDNN SDPA's call) costs over the packed one: its tokens, the
    real tokens, and the work it does over the real work (the FLOP convention's ratio: per head and mode alike)."""
    padded = [max(lengths)] * len(lengths)
    return {"padded_tokens": sum(padded), "real_tokens": sum(lengths),
            "padded_flops_ratio": work(padded, heads, d, causal, mode) / work(lengths, heads, d, causal, mode)}


def prepared(mode: str, fns: dict[str, Callable[..., Any]], q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> dict[str, Fn]:
    """Each provider's timed call: fns map (q, k, v) to its forward; mode bwd times its backward alone."""
    return {name: timeable(mode, lambda q, k, v, fn=fn: (lambda: fn(q, k, v)), q, k, v) for name, fn in fns.items()}


def packed_inputs(total: int, heads: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(total, heads, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))  # type: ignore[return-value]


def fp8_calls(lengths: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              names: tuple[str, str] = ("varlen", "dense")) -> dict[str, Fn]:
    """The e4m3 forward on pre-quantized inputs: the packed kernel over ``lengths`` and the padded kernel on
    equal sequences (all of the same length) of the same tokens, each quantized as its call would."""
    d, n = q.shape[-1], lengths[0]
    block_n = fp8.varlen_kernel_tiles(d, causal)[1]
    cu = cu_of(lengths)
    q8, k8 = (quantize_fp8(x, bs, cu_seqlens=cu) for x, bs in ((q, 64), (k, block_n)))
    v8 = quantize_fp8(v, block_n, False, transpose=True, cu_seqlens=cu)
    shape4 = (len(lengths), n, q.shape[1], d)
    dq8, dk8 = (quantize_fp8(x.view(shape4), bs) for x, bs in ((q, 64), (k, block_n)))
    dv8 = quantize_fp8(v.view(shape4), block_n, False, transpose=True)
    return {names[0]: lambda: flash_attn_varlen_fp8_func(q8, k8, v8, cu, cu, n, n, causal=causal),
            names[1]: lambda: flash_attn_fp8_func(dq8, dk8, dv8, causal=causal)}


def section_equal(timer: Callable[[Fn], float], rounds: int, hdims: list[int], backend: str | None = None,
                  graphs: bool = False, mode: str = "fwd") -> list[dict[str, Any]]:
    rows = []
    for d in hdims:
        heads = 2048 // d
        for causal in (False, True):
            for seqlen in (512, 2048, 8192):
                batch = 16384 // seqlen
                q, k, v = packed_inputs(batch * seqlen, heads, d)
                cu = cu_of([seqlen] * batch)
                shape4 = (batch, seqlen, heads, d)
                if mode == "fp8":
                    fns = fp8_calls([seqlen] * batch, q, k, v, causal)
                else:
                    fns = prepared(mode, {
                        "varlen": lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen,
                                                                         causal=causal, backend=backend),
                        "dense": lambda q, k, v: flash_attn_func(q.view(shape4), k.view(shape4), v.view(shape4),
                                                                 causal=causal, backend=backend)}, q, k, v)
                if graphs:
                    fns = {name: graphed(fn)[0] for name, fn in fns.items()}
                ms = interleaved(fns, timer, rounds)
                flops = work([seqlen] * batch, heads, d, causal, "fwd" if mode == "fp8" else mode)
                row = {"section": "equal", "mode": mode, "backend": backend or "auto", "graphs": graphs, "headdim": d,
                       "nheads": heads, "causal": causal, "seqlen": seqlen,
                       "batch": batch, "ms_varlen": ms["varlen"], "ms_dense": ms["dense"],
                       "tflops_varlen": tflops(flops, ms["varlen"]), "tflops_dense": tflops(flops, ms["dense"]),
                       "varlen_vs_dense": ms["dense"] / ms["varlen"]}
                rows.append(row)
                print(f"equal {mode}{'' if backend is None else ' ' + backend} d{d} {'causal' if causal else 'full'} {batch}x{seqlen}: varlen "
                      f"{row['tflops_varlen']:.0f} TFLOPS, dense {row['tflops_dense']:.0f}, "
                      f"x{row['varlen_vs_dense']:.3f}", flush=True)
    return rows


def section_mixed(timer: Callable[[Fn], float], rounds: int, seed: int, mode: str = "fwd") -> list[dict[str, Any]]:
    d, heads, docs = 128, 16, 64
    rng = random.Random(seed)
    lengths = [int(round(math.exp(rng.uniform(math.log(128), math.log(8192))))) for _ in range(docs)]
    total, longest = sum(lengths), max(lengths)
    mean = total // docs
    q, k, v = packed_inputs(total, heads, d)
    cu = cu_of(lengths)
    shape_e = (docs, mean, heads, d)
    cu_e = cu_of([mean] * docs)
    # SDPA's batch padded to the longest document (the fp8 mode does not time SDPA)
    qp, kp, vp = ((torch.randn(docs, heads, longest, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
                  if mode != "fp8" else (None, None, None))
    have_fa3 = fa3.configured()
    iface = fa3.load() if have_fa3 else None
    rows = []
    for causal in (False, True):
        # The same tokens at equal lengths: the first mean * docs rows.
        def eq(x: torch.Tensor) -> torch.Tensor:
            return x[:mean * docs]
        if mode == "fp8":
            rows.append(mixed_fp8(timer, rounds, lengths, q, k, v, causal, iface, seed))
            continue
        fns = prepared(mode, {
            "varlen": lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal),
            "dense_mean": lambda q, k, v: flash_attn_func(eq(q).view(shape_e), eq(k).view(shape_e),
                                                          eq(v).view(shape_e), causal=causal),
            "varlen_equal": lambda q, k, v: flash_attn_varlen_func(eq(q), eq(k), eq(v), cu_e, cu_e, mean, mean,
                                                                   causal=causal),
        }, q, k, v)
        if iface is not None:
            # FA3's interface returns (out, lse) or out depending on its version: the output alone is timed on.
            def first(x: Any) -> torch.Tensor:
                return x[0] if isinstance(x, tuple) else x
            fns.update(prepared(mode, {
                "fa3_varlen": lambda q, k, v: first(iface.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest,
                                                                                 causal=causal)),
                "fa3_varlen_equal": lambda q, k, v: first(iface.flash_attn_varlen_func(
                    eq(q), eq(k), eq(v), cu_e, cu_e, mean, mean, causal=causal)),
            }, q, k, v))

        def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = causal) -> torch.Tensor:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        fns.update(prepared(mode, {"sdpa_cudnn_padded": sdpa}, qp, kp, vp))
        ms = interleaved(fns, timer, rounds)
        real = work(lengths, heads, d, causal, mode)
        equal = work([mean] * docs, heads, d, causal, mode)
        row: dict[str, Any] = {"section": "mixed", "mode": mode, "headdim": d, "nheads": heads, "causal": causal, "docs": docs,
                               "seed": seed, "total_tokens": total, "longest": longest, "mean": mean,
                               "lengths": lengths, **padding_overhead(lengths, heads, d, causal, mode)}
        for name, t in ms.items():
            flops = equal if name in ("dense_mean", "varlen_equal", "fa3_varlen_equal") else real
            row[f"ms_{name}"] = t
            row[f"tflops_{name}"] = tflops(flops, t)
        row["varlen_vs_dense_mean"] = row["tflops_varlen"] / row["tflops_dense_mean"]
        if iface is not None:
            row["varlen_vs_fa3"] = ms["fa3_varlen"] / ms["varlen"]
        rows.append(row)
        print(f"mixed {mode} {'causal' if causal else 'full'} ({docs} docs, {total} tokens): "
              + ", ".join(f"{name} {row[f'tflops_{name}']:.0f}" for name in ms) + " TFLOPS"
              + (f"; varlen vs FA3 x{row['varlen_vs_fa3']:.3f}" if iface is not None else "")
              + f"; varlen vs dense at the mean length x{row['varlen_vs_dense_mean']:.3f}"
              + f"; SDPA padded {row['padded_tokens']} tokens for {row['real_tokens']} real, "
              f"x{row['padded_flops_ratio']:.2f} the real work", flush=True)
    return rows


def mixed_fp8(timer: Callable[[Fn], float], rounds: int, lengths: list[int], q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, causal: bool, iface: Any, seed: int) -> dict[str, Any]:
    docs, total, longest, heads, d = len(lengths), sum(lengths), max(lengths), q.shape[1], q.shape[2]
    mean = total // docs
    cu = cu_of(lengths)
    block_n = fp8.varlen_kernel_tiles(d, causal)[1]
    q8, k8 = (quantize_fp8(x, bs, cu_seqlens=cu) for x, bs in ((q, 64), (k, block_n)))
    v8 = quantize_fp8(v, block_n, False, transpose=True, cu_seqlens=cu)
    fns: dict[str, Fn] = {"varlen": lambda: flash_attn_varlen_fp8_func(q8, k8, v8, cu, cu, longest, longest,
                                                                       causal=causal)}
    # The same tokens at equal lengths: the first mean * docs rows.
    fns.update(fp8_calls([mean] * docs, q[:mean * docs], k[:mean * docs], v[:mean * docs], causal,
                         ("varlen_equal", "dense_mean")))
    if iface is not None:
        # FA3's e4m3 varlen: plain casts with one descale per (sequence, kv head), what its API takes.
        q8f, k8f, v8f = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        ones = torch.ones(docs, heads, dtype=torch.float32, device="cuda")
        def fa3_fp8() -> Any:
            return iface.flash_attn_varlen_func(q8f, k8f, v8f, cu, cu, longest, longest, causal=causal,
                                                q_descale=ones, k_descale=ones, v_descale=ones)
        try:
            fa3_fp8()
            fns["fa3_varlen"] = fa3_fp8
        except Exception as e:  # noqa: BLE001  (a build without e4m3 varlen: said, not fatal)
            print(f"FA3 e4m3 varlen not timed: {type(e).__name__}: {e}", flush=True)
    ms = interleaved(fns, timer, rounds)
    real, equal = work(lengths, heads, d, causal), work([mean] * docs, heads, d, causal)
    row: dict[str, Any] = {"section": "mixed", "mode": "fp8", "headdim": d, "nheads": heads, "causal": causal,
                           "docs": docs, "seed": seed, "total_tokens": total, "longest": longest, "mean": mean,
                           "lengths": lengths}
    for name, t in ms.items():
        row[f"ms_{name}"] = t
        row[f"tflops_{name}"] = tflops(equal if name in ("dense_mean", "varlen_equal") else real, t)
    row["varlen_vs_dense_mean"] = row["tflops_varlen"] / row["tflops_dense_mean"]
    if "fa3_varlen" in ms:
        row["varlen_vs_fa3"] = ms["fa3_varlen"] / ms["varlen"]
    print(f"mixed fp8 {'causal' if causal else 'full'} ({docs} docs, {total} tokens): "
          + ", ".join(f"{name} {row[f'tflops_{name}']:.0f}" for name in ms) + " TFLOPS"
          + (f"; varlen vs FA3 x{row['varlen_vs_fa3']:.3f}" if "varlen_vs_fa3" in row else "")
          + f"; varlen vs dense at the mean length x{row['varlen_vs_dense_mean']:.3f}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="*", choices=("equal", "mixed"), default=["equal", "mixed"])
    ap.add_argument("--mode", choices=("fwd", "bwd", "fp8"), default="fwd",
                    help="bwd: the backward alone; fp8: the e4m3 forward on pre-quantized inputs")
    ap.add_argument("--fa3-path", type=Path, help=f"FA3 build with varlen (fa3-full; default: ${fa3.ENV})")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="of the mixed section's document lengths")
    ap.add_argument("--hdims", type=int, nargs="*", default=[64, 128, 256], help="of the equal section")
    ap.add_argument("--backend", choices=("sm90", "sm80"), help="kernel family of the equal section (default: auto)")
    ap.add_argument("--graphs", action="store_true",
                    help="equal section: time CUDA-graph replays (the GPU's time alone; eager calls of 30-us kernels "
                         "also time the host whenever it falls behind)")
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_varlen needs a CUDA device", file=sys.stderr)
        return 1
    if args.graphs and args.mode == "bwd":
        ap.error("--graphs times forwards only: capturing the backward's autograd.grad failed on torch's RNG offset "
                 "bookkeeping (docs/perf-notes.md, issue #21 session 2)")
    if args.fa3_path is not None:
        fa3.set_path(args.fa3_path)
    timing, timer = make_timer(args.warmup_ms, args.rep_ms)
    rows: list[dict[str, Any]] = []
    with torch.set_grad_enabled(args.mode == "bwd"):
        if "equal" in args.sections:
            rows += section_equal(timer, args.rounds, args.hdims, args.backend, args.graphs, args.mode)
        if "mixed" in args.sections:
            rows += section_mixed(timer, args.rounds, args.seed, args.mode)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"environment": environment(timing, source_root()), "timing": timing,
                                        "rounds": args.rounds, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
