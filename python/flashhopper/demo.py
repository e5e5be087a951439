"""``python -m flashhopper.demo``: run flash_attn_func once per configuration, print its error against
an exact float32 reference and its time next to PyTorch SDPA.

On a CUDA GPU: bf16, batch 2, seqlen 4096, 16 heads, head dim 128, causal off and on; device time
of back-to-back launches (the benchmarks' timer) and, apart, the host time per call. Without one:
the reference backend on a small CPU shape, saying so.
Exit status 1 if a configuration that ran was less accurate than twice PyTorch's own error.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import _ext, dispatch
from .flops import attention_flops, tflops
from .interface import flash_attn_func
from .reference import attention_ref
from .report.timing import make_timer


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, norms in float64."""
    ref64 = ref.double()
    return ((out.double() - ref64).norm() / ref64.norm()).item()


def time_ms(fn: Callable[[], object], cuda: bool, iters: int = 20, warmup: int = 3) -> float:
    """Median time of fn in milliseconds. On the GPU: device time of back-to-back launches (the
    report's timer, do_bench where triton is installed), as the benchmarks measure it; timing one
    synchronized call would count the GPU idling through the host-side overhead instead."""
    if cuda:
        return make_timer(warmup_ms=10, rep_ms=50)[1](fn)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_overhead_us(fn: Callable[[], object], calls: int = 50) -> float:
    """Host time per call when the launches just queue up (validation, dispatch, allocation)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / calls * 1e6


def run_case(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, iters: int) -> bool:
    """One configuration: error and time of flash_attn_func next to SDPA. False if it could not
    run or was less accurate than twice SDPA's error."""
    b, s, h, d = q.shape
    cuda = q.is_cuda
    label = f"{'causal    ' if causal else 'non-causal'} {str(q.dtype).removeprefix('torch.')} b={b} s={s} h={h} d={d}"
    try:
        backend = dispatch.select_backend(q, d, q.dtype, causal)
    except (ValueError, TypeError) as e:
        print(f"{label}: skipped: {e}")
        return False
    out = flash_attn_func(q, k, v, causal=causal, backend=backend)
    ref, _ = attention_ref(q, k, v, causal=causal, dtype=torch.float32)
    # SDPA takes (batch, nheads, seqlen, headdim); transposed views, no copies.
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    sdpa_out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    err, sdpa_err = rel_err(out, ref), rel_err(sdpa_out, ref)
    ours = lambda: flash_attn_func(q, k, v, causal=causal, backend=backend)  # noqa: E731
    ms = time_ms(ours, cuda, iters)
    sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), cuda, iters)
    flops = attention_flops(b, s, s, h, d, causal)

    def speed(t: float) -> str:
        return f"{t:.3f} ms = {tflops(flops, t):.1f} TFLOPS" if cuda else f"{t:.3f} ms"

    host = f"; host overhead {host_overhead_us(ours):.0f} us/call" if cuda else ""
    print(f"{label}: flashhopper[{backend}] ||out-ref||/||ref|| = {err:.2e} (PyTorch SDPA: {sdpa_err:.2e}); "
          f"time {speed(ms)} (SDPA: {speed(sdpa_ms)}){host}")
    return err <= 2 * sdpa_err + 1e-5


def run(batch: int, seqlen: int, nheads: int, headdim: int, dtype: torch.dtype, device: torch.device,
        iters: int) -> bool:
    ok = True
    for causal in (False, True):
        q, k, v = (torch.randn(batch, seqlen, nheads, headdim, dtype=dtype, device=device) for _ in range(3))
        ok &= run_case(q, k, v, causal, iters)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20, help="timed repetitions (median reported)")
    args = ap.parse_args(argv)
    kernels = _ext.compiled_kernels()
    print(f"flashhopper extension: {len(kernels)} compiled kernels" if _ext.has_extension()
          else f"flashhopper extension: not available ({_ext.extension_error()})")
    if torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
        print(f"device: {torch.cuda.get_device_name(dev)}; reference: exact attention in float32")
        ok = run(2, 4096, 16, 128, torch.bfloat16, dev, args.iters)
    else:
        print("no CUDA GPU found: running the reference backend on a small CPU shape "
              "(the flashhopper kernels need an NVIDIA GPU, compute capability 8.0+)")
        ok = run(1, 256, 4, 64, torch.bfloat16, torch.device("cpu"), max(1, args.iters // 4))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
