#!/usr/bin/env python3
"""Direct check of the compiled forward kernels through flashhopper._C (no Python API layer):
poisoned outputs, fresh random inputs, error against a float32 reference. A developer tool for
the device machine and for compute-sanitizer runs (--small); the real tests are in tests/.
"""
from __future__ import annotations

import argparse
import math

import torch

from flashhopper import _C


def reference(q, k, v, scale, causal):
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hk, dim=2)
    v = v.repeat_interleave(hq // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.float()), lse


_counters: dict[int, torch.Tensor] = {}


def run(q, k, v, causal):
    b, sq, hq, d = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, hq, sq), float("nan"), device=q.device, dtype=torch.float32)
    p = _C.FwdParams()
    p.q_ptr, p.k_ptr, p.v_ptr, p.o_ptr, p.lse_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        setattr(p, f"{name}_batch_stride", t.stride(0))
        setattr(p, f"{name}_row_stride", t.stride(1))
        setattr(p, f"{name}_head_stride", t.stride(2))
    p.batch, p.seqlen_q, p.seqlen_k, p.nheads_q, p.nheads_kv, p.headdim = b, sq, k.shape[1], hq, k.shape[2], d
    p.softmax_scale = 1.0 / math.sqrt(d)
    p.causal = causal
    p.dtype = _C.DType.bfloat16 if q.dtype == torch.bfloat16 else _C.DType.float16
    p.device = q.device.index
    if causal:  # the dynamic scheduler's counter: zeroed once, re-zeroed by every launch
        counter = _counters.setdefault(q.device.index, torch.zeros(1, dtype=torch.int32, device=q.device))
        p.tile_counter = counter.data_ptr()
    _C.fwd(p, 90, torch.cuda.current_stream().cuda_stream)
    return out, lse


def bench(seqlens: list[int], peers: bool) -> None:
    """Quick side-by-side timing (bench/ has the real harness): 16k tokens, 2048 = h * d."""
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel

    built = {(k["dtype"], k["headdim"], k["causal"]) for k in _C.kernels() if k["arch"] == 90}
    print(f"{'d':>4} {'causal':>6} {'seqlen':>6} {'ours':>7} {'cudnn':>7} {'flash':>7}  (TFLOPS)")
    for dtype_name, d, causal in sorted(built):
        for s in seqlens:
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            row = []
            ms = do_bench(lambda: run(q, k, v, causal), warmup=50, rep=200, return_mode="median")
            row.append(flops / ms / 1e9)
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION) if peers else ():
                try:
                    with sdpa_kernel(be):
                        ms = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                                      warmup=50, rep=200, return_mode="median")
                    row.append(flops / ms / 1e9)
                except RuntimeError:
                    row.append(float("nan"))
            print(f"{d:>4} {int(causal):>6} {s:>6} " + " ".join(f"{x:7.1f}" for x in row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="few small shapes (for compute-sanitizer)")
    ap.add_argument("--bench", action="store_true", help="also time a few FA3-paper shapes against SDPA")
    ap.add_argument("--seqlens", type=int, nargs="*", default=[512, 2048, 8192, 16384])
    ap.add_argument("--no-peers", action="store_true", help="time only our kernels")
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float16"], help="which built kernels to check")
    args = ap.parse_args()
    built = {(k["dtype"], k["headdim"], k["causal"]) for k in _C.kernels() if k["arch"] == 90 and k["dtype"] in args.dtypes}
    if args.small:
        shapes = [(1, 17, 200, 4, 1), (2, 255, 130, 4, 2), (1, 300, 40, 2, 2)]
    else:
        shapes = [(1, 128, 128, 4, 4), (2, 1000, 1000, 8, 2), (1, 4096, 4096, 8, 8), (3, 255, 8193, 8, 1),
                  (1, 8193, 17, 4, 4), (2, 17, 1000, 8, 8), (1, 1, 255, 2, 1)]
    worst = 0.0
    torch.manual_seed(0)
    for dtype_name, d, causal in sorted(built):
        dtype = getattr(torch, dtype_name)
        for b, sq, sk, hq, hk in shapes:
            q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
            k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
            v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
            out, lse = run(q, k, v, causal)
            torch.cuda.synchronize()
            ref, ref_lse = reference(q, k, v, 1.0 / math.sqrt(d), causal)
            err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            finite = torch.isfinite(ref_lse)
            lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
            lse_ok = bool(torch.equal(torch.isfinite(lse), finite)) and not torch.isnan(lse).any().item()
            nan = torch.isnan(out).any().item()
            worst = max(worst, err if not nan else float("inf"))
            print(f"{dtype_name:9s} d{d:<3d} causal={int(causal)} b{b} sq{sq:<5d} sk{sk:<5d} h{hq}/{hk}: "
                  f"rel_err {err:.2e} lse_err {lse_err:.1e} lse_ok {lse_ok} nan {nan}")
    print(f"worst rel_err {worst:.2e}")
    if not worst < 2e-2:
        raise SystemExit(1)
    if args.bench:
        bench(args.seqlens, not args.no_peers)


if __name__ == "__main__":
    main()
