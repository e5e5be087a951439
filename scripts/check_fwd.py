#!/usr/bin/env python3
"""Quick check of every compiled forward kernel of one family (sm90; --arch 80: sm80): each KernelKey of
the build (dtype, head dim, mask, variant) on a few odd shapes, NaN-poisoned outputs, fresh random
inputs, the relative error against exact attention (float32 on the GPU). 16-bit kernels run through
flashhopper.ops.fwd_into (a "window" kernel with the window WINDOW), fp8 (e4m3) ones through
fp8.fwd_fp8_into on q, k, v quantized as flash_attn_fp8_func does (shapes with keys only; fwd_fp8_into
has no window nor variant, so those fp8 kernels are listed as not checked). A developer tool for the
device machine and for compute-sanitizer (--small: few, small shapes; scripts/gpu.sh sanitize); the
real tests are tests/test_fwd_gpu.py and tests/test_fp8_gpu.py, the timings bench/bench_attention.py.
Padded-batch kernels only: the packed (varlen) and KV-cache kernels take other entry points (their GPU tests,
tests/test_varlen_gpu.py and tests/test_kvcache*_gpu.py, are what runs them under compute-sanitizer).
Exit 1 if an output has NaN or an error reaches its limit, or if there is nothing to check.
"""
from __future__ import annotations

import argparse
import math

import torch

import flashhopper
from flashhopper import fp8
from flashhopper.kernel_key import BUILD_DTYPES, KernelKey, from_dict
from flashhopper.dropout import from_rng_state, new_rng_state
from flashhopper.ops import fwd_into
from flashhopper.reference import attention_ref

WINDOW = (63, 17)  # (left, right) for "window" kernels: edges inside key blocks, rows seeing a few blocks
FP8_LIMIT = 8e-2  # fp8's own error against exact attention (tests/test_fp8_gpu.py: REF_REL)
LIMIT = 2e-2
Shape = tuple[int, int, int, int, int]  # batch, seqlen_q, seqlen_k, nheads_q, nheads_kv


def shapes(small: bool) -> list[Shape]:
    # Odd lengths, seqlen_q != seqlen_k both ways (causal rows without keys), GQA and MQA, no keys at all.
    if small:
        return [(1, 17, 200, 4, 1), (2, 255, 130, 4, 2), (1, 300, 40, 2, 2), (1, 33, 0, 2, 1)]
    return [(1, 128, 128, 4, 4), (2, 1000, 1000, 8, 2), (1, 4096, 4096, 8, 8), (3, 255, 8193, 8, 1),
            (1, 8193, 17, 4, 4), (2, 17, 1000, 8, 8), (1, 1, 255, 2, 1), (1, 33, 0, 2, 2)]


def run(key: KernelKey, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        window: tuple[int, int] | None, softcap: float = 0.0, sinks: torch.Tensor | None = None,
        dropout_p: float = 0.0, dropout_rng: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the kernel of ``key`` on q, k, v (bf16 inputs, quantized here, for an fp8 key)."""
    causal = key.mask == "causal"
    b, sq, hq, _ = q.shape
    lse = torch.full((b, hq, sq), math.nan, device=q.device)
    if key.dtype != "float8_e4m3fn":
        out = q.new_full((*q.shape[:3], v.shape[-1]), math.nan)  # V's head dim (a (Q/K, V) pair's own)
        fwd_into(q, k, v, out, lse, scale, causal, key.arch, window=window, variant=key.variant, softcap=softcap,
                 sinks=sinks, dropout_p=dropout_p, dropout_rng=dropout_rng)
        return out, lse
    tiles = fp8.kernel_tiles(key.headdim, causal)
    assert tiles is not None, f"the build lists {key.describe()} but fp8.kernel_tiles does not find it"
    q8 = fp8.quantize_fp8(q, block_size=fp8.Q_BLOCK, hadamard=True)
    k8 = fp8.quantize_fp8(k, block_size=tiles[1], hadamard=True)
    v8 = fp8.quantize_fp8(v, block_size=tiles[1], hadamard=False, transpose=True)
    out = torch.full(q.shape, math.nan, dtype=torch.bfloat16, device=q.device)
    fp8.fwd_fp8_into(q8, k8, v8, out, lse, scale, causal)
    return out, lse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="few small shapes (for compute-sanitizer)")
    ap.add_argument("--dtypes", nargs="*", choices=list(BUILD_DTYPES.values()), default=list(BUILD_DTYPES.values()),
                    help="which built kernels to check (default: all)")
    ap.add_argument("--arch", type=int, choices=[90, 80], default=90, help="kernel family (80 runs on Hopper too)")
    ap.add_argument("--softcap", type=float, default=0.0, help="check the softcap kernels, with this softcap")
    ap.add_argument("--sinks", action="store_true", help="run the 16-bit kernels with random sink logits")
    ap.add_argument("--dropout", type=float, default=0.0, help="check the dropout kernels, with this dropout_p")
    args = ap.parse_args()
    score_mod = "softcap" if args.softcap > 0 else "none"  # --softcap checks the softcap kernels
    keys = sorted((from_dict(k) for k in flashhopper.compiled_kernels()
                   if k["mode"] == "fwd" and k["arch"] == args.arch and k["dtype"] in args.dtypes
                   and k["score_mod"] == score_mod and k["dropout"] == (args.dropout > 0)
                   and not k.get("varlen") and k.get("kvcache", "off") == "off"),
                  key=lambda key: (key.dtype, key.headdim, key.mask, key.variant))
    if not keys:
        raise SystemExit(f"no sm{args.arch} forward kernel for {args.dtypes} in this build: nothing to check")
    failed, checked = [], 0
    torch.manual_seed(0)
    for key in keys:
        is_fp8 = key.dtype == "float8_e4m3fn"
        if is_fp8 and (key.mask == "window" or key.variant):
            print(f"{key.describe()}: not checked (fwd_fp8_into runs the production none/causal kernels only)")
            continue
        checked += 1
        window = WINDOW if key.mask == "window" else None
        dtype = torch.bfloat16 if is_fp8 else getattr(torch, key.dtype)
        limit = FP8_LIMIT if is_fp8 else LIMIT
        for b, sq, sk, hq, hk in shapes(args.small):
            if is_fp8 and sk == 0:
                continue
            d = key.headdim
            q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
            k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
            v = torch.randn(b, sk, hk, key.headdim_v, device="cuda", dtype=dtype)
            softcap = 0.0 if is_fp8 else args.softcap
            sinks = torch.randn(hq, device="cuda") * 2 if args.sinks and not is_fp8 else None
            rng = new_rng_state(q.device) if args.dropout > 0 else None
            out, lse = run(key, q, k, v, 1 / math.sqrt(d), window, softcap, sinks, args.dropout, rng)
            drop = from_rng_state(args.dropout, rng) if rng is not None else None
            ref, ref_lse = attention_ref(q, k, v, None, key.mask == "causal", window=window, softcap=softcap,
                                         sinks=sinks, dropout=drop, dtype=torch.float32)
            err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            finite = torch.isfinite(ref_lse)
            lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
            nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
            where = f"{key.describe()} b{b} sq{sq} sk{sk} h{hq}/{hk}"
            print(f"{where}: rel_err {err:.2e} lse_err {lse_err:.1e} nan {nan}")
            if nan or not err < limit:
                failed.append(where)
    verdict = f"FAILED: {'; '.join(failed)}" if failed else "all within limits"
    print(f"{checked} of {len(keys)} kernels checked; {verdict}")
    if failed or not checked:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
