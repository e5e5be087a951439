#!/usr/bin/env python3
"""Host time per call of the entry points, on a tiny shape where the GPU idles: a loop of calls then
measures the Python layer, the op dispatch and the launch (the kernels take a few microseconds).

    python bench/host_time.py [label]      # one line per entry point, the best of three loops of 400 calls
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

import flashhopper as fh
from flashhopper import fp8


def per_call_us(fn: Callable[[], object], n: int = 400) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "this"
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    q8 = fp8.quantize_fp8(q, block_size=64)
    k8 = fp8.quantize_fp8(k, block_size=128)
    v8 = fp8.quantize_fp8(v, block_size=128, hadamard=False, transpose=True)
    rows: dict[str, Callable[[], object]] = {
        "bf16 flash_attn_func causal": lambda: fh.flash_attn_func(q, k, v, causal=True),
        "bf16 flash_attn_varlen_func causal": lambda: fh.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 128, 128,
                                                                               causal=True),
        "fp8 pre-quantized causal": lambda: fp8.flash_attn_fp8_func(q8, k8, v8, causal=True),
        "fp8 e2e causal": lambda: fp8.flash_attn_fp8_func(q, k, v, causal=True),
        "quantize_fp8": lambda: fp8.quantize_fp8(q, block_size=64),
    }
    for name, fn in rows.items():
        print(f"{label:5s} {name:36s} {min(per_call_us(fn) for _ in range(3)):7.1f} us")


if __name__ == "__main__":
    main()
