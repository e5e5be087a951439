#!/usr/bin/env python3
"""Prefill through one decoder layer's attention, bf16 next to fp8 (the README's fp8 example).

x (1, 8192, 4096) bf16 -> q, k, v projections (32 query heads of 128, 8 kv heads: GQA) -> causal
attention -> output projection; random weights scaled 1/sqrt(hidden), no RoPE. Prints, per path, the
attention's median time (do_bench, L2 flushed) and the layer output's relative error against a float32
reference and against the bf16 path.

    python bench/fp8_prefill.py [--seqlen 8192]
"""
from __future__ import annotations

import argparse
import sys

import torch

import flashhopper
from flashhopper import flash_attn_fp8_func, quantize_fp8, quantize_kv
from flashhopper.flops import attention_flops, tflops
from flashhopper.reference import attention_ref
from flashhopper.report.timing import make_timer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=8192)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fp8_prefill: needs a CUDA GPU (an H100 for the fp8 kernels)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    b, s, hidden, hq, hkv, d = 1, args.seqlen, 4096, 32, 8, 128
    x = torch.randn(b, s, hidden, device="cuda", dtype=torch.bfloat16)
    wq, wk, wv, wo = (torch.randn(hidden, n, device="cuda", dtype=torch.bfloat16) / hidden**0.5
                      for n in (hq * d, hkv * d, hkv * d, hidden))
    q, k, v = (x @ wq).view(b, s, hq, d), (x @ wk).view(b, s, hkv, d), (x @ wv).view(b, s, hkv, d)

    def layer_out(attn: torch.Tensor) -> torch.Tensor:  # output projection of (b, s, hq, d)
        return attn.reshape(b, s, hq * d).to(wo.dtype) @ wo

    # float32 reference: the same bf16 weights and input, every step in float32.
    x32, (wq32, wk32, wv32, wo32) = x.float(), (w.float() for w in (wq, wk, wv, wo))
    q32, k32, v32 = ((x32 @ w).view(b, s, -1, d) for w in (wq32, wk32, wv32))
    ref = attention_ref(q32, k32, v32, None, causal=True, dtype=torch.float32)[0].reshape(b, s, hq * d) @ wo32
    del q32, k32, v32

    kv = quantize_kv(k, v, causal=True)  # the fp8 KV cache: K and V per key block, K rotated (Hadamard), V as V^T
    q8 = quantize_fp8(q, block_size=64, seed=kv.k.hadamard_seed)  # what kv.attend does with q
    paths = {
        "bf16 flash_attn_func": lambda: flashhopper.flash_attn_func(q, k, v, causal=True),
        "fp8 kernel only (q, k, v quantized beforehand)": lambda: flash_attn_fp8_func(q8, kv.k, kv.v, causal=True),
        "fp8 kv.attend(q) (quantizes q)": lambda: kv.attend(q, causal=True),
        "fp8 flash_attn_fp8_func(q, k, v) (quantizes q, k, v)": lambda: flash_attn_fp8_func(q, k, v, causal=True),
    }
    timer_name, timer = make_timer(25, 100)
    flops = attention_flops(b, s, s, hq, d, causal=True)
    print(f"{torch.cuda.get_device_name()} | b={b} s={s} hidden={hidden} heads {hq}x{d}, {hkv} kv heads, causal "
          f"| {timer_name}\n")
    print("| attention path | ms | TFLOPS | layer out vs float32 | vs bf16 path |\n|---|---|---|---|---|")
    outs: dict[str, torch.Tensor] = {}
    for name, fn in paths.items():
        out = outs[name] = layer_out(fn()).double()
        ms = timer(fn)
        err_ref = ((out - ref.double()).norm() / ref.double().norm()).item()
        bf16 = outs["bf16 flash_attn_func"]
        err_bf16 = ((out - bf16).norm() / bf16.norm()).item()
        print(f"| {name} | {ms:.3f} | {tflops(flops, ms):.0f} | {err_ref:.2e} | {err_bf16:.2e} |")
    kv_ms = timer(lambda: quantize_kv(k, v, causal=True))
    print(f"\nquantize_kv(k, v) alone (once per prefill, then cached): {kv_ms:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
