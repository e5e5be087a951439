#!/usr/bin/env python3
"""Host time per call of the entry points, on a tiny shape where the GPU idles: a loop of calls then
measures the Python layer, the op dispatch and the launch (the kernels take a few microseconds).

    python bench/host_time.py [--label L] [--fa3-path DIR] [--loops N]

One line per entry point: the best of N loops (default 5) of 400 calls each, without grad (inference).
Issue #20's shape: batch 1, 128 tokens, 8 heads of 64, causal. PyTorch's SDPA and, with --fa3-path (a folder
with FlashAttention-3's flash_attn_interface), FA3 are timed on the same tensors for scale. The KV-cache rows:
a decode step (one token, 8 query / 2 kv heads of 64) over 256 cached keys, bf16 and e4m3 caches, with and
without a one-token append (the same slot each call). --only NAME...: the rows whose name contains one of them
(a build without some kernels).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

import flashhopper as fh
from flashhopper import fp8, kvcache_fp8


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="this")
    ap.add_argument("--fa3-path", default=None)
    ap.add_argument("--loops", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    qd = q[:, :1]
    kc, vc = (torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kn, vn = kc[:, :1].clone(), vc[:, :1].clone()
    lens = torch.tensor([200], dtype=torch.int32, device="cuda")

    def fp8_prequantized() -> Callable[[], object]:
        q8, k8 = fp8.quantize_fp8(q, block_size=64), fp8.quantize_fp8(k, block_size=128)
        v8 = fp8.quantize_fp8(v, block_size=128, hadamard=False, transpose=True)
        return lambda: fp8.flash_attn_fp8_func(q8, k8, v8, causal=True)

    def fp8_attend() -> Callable[[], object]:
        kv = fp8.quantize_kv(k, v, block_size=128)
        return lambda: kv.attend(q, causal=True)

    def e4m3_decode(append: bool) -> Callable[[], Callable[[], object]]:
        def make() -> Callable[[], object]:
            kc8, vc8, ks, vs = kvcache_fp8.quantize_kv_cache(kc, vc)
            new = (kn, vn) if append else (None, None)
            return lambda: fh.flash_attn_with_kvcache(qd, kc8, vc8, *new, cache_seqlens=lens, k_cache_scale=ks,
                                                      v_cache_scale=vs)
        return make

    def fa3_row() -> Callable[[], object]:
        sys.path.insert(0, args.fa3_path)
        import flash_attn_interface as fa3  # noqa: PLC0415  (a measuring instrument, optional)
        return lambda: fa3.flash_attn_func(q, k, v, causal=True)

    # Each row's inputs are made only if it runs.
    rows: dict[str, Callable[[], Callable[[], object]]] = {
        "sdpa causal": lambda: lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
        "bf16 flash_attn_func causal": lambda: lambda: fh.flash_attn_func(q, k, v, causal=True),
        "bf16 flash_attn_varlen_func causal": lambda: lambda: fh.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 128,
                                                                                       128, causal=True),
        "fp8 pre-quantized causal": fp8_prequantized,
        "fp8 QuantizedKV.attend causal": fp8_attend,
        "fp8 e2e causal": lambda: lambda: fp8.flash_attn_fp8_func(q, k, v, causal=True),
        "quantize_fp8": lambda: lambda: fp8.quantize_fp8(q, block_size=64),
        "bf16 kvcache decode": lambda: lambda: fh.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens),
        "bf16 kvcache decode + append": lambda: lambda: fh.flash_attn_with_kvcache(qd, kc, vc, kn, vn,
                                                                                   cache_seqlens=lens),
        "e4m3 kvcache decode": e4m3_decode(False),
        "e4m3 kvcache decode + append": e4m3_decode(True),
    }
    if args.fa3_path:
        rows["fa3 flash_attn_func causal"] = fa3_row
    with torch.no_grad():
        for name, make in rows.items():
            if args.only and not any(o in name for o in args.only):
                continue
            fn = make()
            best = min(per_call_us(fn) for _ in range(args.loops))
            print(f"{args.label:5s} {name:36s} {best:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
