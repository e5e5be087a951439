"""The chip's ceilings: measured in the same run (dense GEMM through torch, device-to-device copy)
and the datasheet peaks by device name."""
from __future__ import annotations

import re
from typing import Any

import torch

from flashhopper.flops import tflops

from .io_model import tbps
from .sweep import DTYPES
from .timing import Fn, Timer

GEMM_N = 8192  # n x n x n: large enough for cuBLAS to reach its steady state
COPY_BYTES = 1 << 30

_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
# Dense Tensor Core peaks (the datasheets' headline figures are with 2:4 sparsity, twice these).
DATASHEETS: tuple[dict[str, Any], ...] = (
    {"name": "H100 PCIe", "match": r"H100.*PCIe", "tflops": {"bf16": 756.5, "fp16": 756.5, "fp8": 1513.0},
     "hbm_tbps": 2.0, "source": _H100},
    {"name": "H100 SXM5", "match": r"H100.*(SXM|HBM3)", "tflops": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
     "hbm_tbps": 3.35, "source": _H100},
    {"name": "H200 SXM", "match": r"H200(?!.*NVL)", "tflops": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
     "hbm_tbps": 4.8, "source": "NVIDIA H200 Tensor Core GPU datasheet"},
    {"name": "A100 SXM 80GB", "match": r"A100.*SXM.*80GB", "tflops": {"bf16": 312.0, "fp16": 312.0, "fp8": None},
     "hbm_tbps": 2.039, "source": "NVIDIA A100 Tensor Core GPU datasheet"},
)


def datasheet_for(device: str) -> dict[str, Any] | None:
    """Datasheet peaks of the device named ``device`` (torch.cuda.get_device_name), None if unknown."""
    for sheet in DATASHEETS:
        if re.search(sheet["match"], device):
            return {k: v for k, v in sheet.items() if k != "match"}
    return None


def _reason(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _gemm(dtype: str, n: int) -> tuple[str, Fn]:
    if dtype == "fp8":
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)  # row-major
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm needs
        one = torch.ones((), device="cuda")  # float32 per-tensor scales
        return (f"torch._scaled_mm e4m3 {n}x{n}x{n}, bf16 out, fast accumulation",
                lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=True))
    x, y = (torch.randn(n, n, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    return f"torch.matmul {dtype} {n}x{n}x{n}", lambda: torch.matmul(x, y)


def gemm_ceiling(dtype: str, timer: Timer, n: int = GEMM_N) -> dict[str, Any]:
    """Dense GEMM throughput of this dtype; {"error": ...} where torch cannot run it here."""
    how = f"{dtype} GEMM {n}x{n}x{n}"
    try:
        how, fn = _gemm(dtype, n)
        ms = timer(fn)
    except Exception as e:  # e.g. no fp8 GEMM in this torch/cuBLAS: the report goes on without it
        return {"how": how, "error": _reason(e)}
    return {"how": how, "ms": ms, "tflops": tflops(2.0 * n**3, ms)}


def copy_ceiling(timer: Timer, nbytes: int = COPY_BYTES) -> dict[str, Any]:
    """Device-to-device copy bandwidth, counting the bytes read and the bytes written."""
    how = f"device-to-device copy_ of {nbytes >> 20} MiB (read + write counted)"
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        ms = timer(lambda: dst.copy_(src))
    except Exception as e:
        return {"how": how, "error": _reason(e)}
    return {"how": how, "ms": ms, "tbps": tbps(2 * nbytes, ms)}


def measure(timer: Timer, dtypes: list[str]) -> dict[str, Any]:
    """GEMM ceilings for bf16, fp8 and any other swept dtype, and the copy bandwidth."""
    gemm_dtypes = ["bf16", "fp8"] + [d for d in dtypes if d not in ("bf16", "fp8")]
    return {"gemm": {d: gemm_ceiling(d, timer) for d in gemm_dtypes}, "copy": copy_ceiling(timer)}
