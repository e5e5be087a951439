"""What every kernel launch does with its tensors, shared by the attention ops (``ops.py``) and the fp8
ops (``fp8/ops.py``): the reusable params objects, strides into params, the extension's dtype enum, the
stream, and the tile counter of the persistent schedulers. Nothing here validates: the callers have.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from . import _device, _ext, validation

_local = threading.local()  # one reusable params object per kind and thread: every field is rewritten per call
_c_dtypes: dict[torch.dtype, Any] = {}
_tile_counters: dict[tuple[int, int], torch.Tensor] = {}


def params(kind: str) -> Any:
    """This thread's ``_C.<kind>`` ("FwdParams", "BwdParams", "QuantParams"), made on first use."""
    p = getattr(_local, kind, None)
    if p is None:
        p = getattr(_ext.extension(), kind)()
        setattr(_local, kind, p)
    return p


def c_dtype(dtype: torch.dtype) -> Any:
    """``_C.DType`` of a kernel dtype."""
    if not _c_dtypes:
        C = _ext.extension()
        _c_dtypes.update({torch.float16: C.DType.float16, torch.bfloat16: C.DType.bfloat16,
                          torch.float8_e4m3fn: C.DType.float8_e4m3fn})
    return _c_dtypes[dtype]


def fill_strides(p: Any, **tensors: torch.Tensor) -> None:
    """p.<name>_batch_stride / _row_stride / _head_stride (in elements) of each named (batch, seqlen,
    nheads, headdim) tensor."""
    for name, x in tensors.items():
        for what, stride in zip(("batch", "row", "head"), validation.kernel_strides(x)):
            setattr(p, f"{name}_{what}_stride", stride)


def fill_device(p: Any, x: torch.Tensor) -> None:
    """p.device and p.num_sms of the device ``x`` is on."""
    p.device = x.device.index
    if hasattr(p, "num_sms"):
        p.num_sms = _device.device_info(x.device.index).num_sms


def _raw_stream(index: int) -> int:
    # torch's raw handle of the current stream, as Inductor's generated code asks for it: no torch.cuda.Stream
    # object per call (2 us). Looked up at call time: a CPU-only torch has no _cuda_* functions.
    return torch._C._cuda_getCurrentRawStream(index)


def _capturing() -> bool:
    # torch.cuda.is_current_stream_capturing() without its Python wrapper.
    return torch._C._cuda_isCurrentStreamCapturing()


def stream(device: torch.device) -> int:
    """The current stream of ``device``, as the extension takes it."""
    return _raw_stream(device.index)


def tile_counter(device: torch.device, stream_handle: int) -> torch.Tensor:
    """The int32 counter the persistent schedulers take tiles from: zero before a launch, left at zero
    by it. Eagerly, one per (device, stream), zeroed once and reused, so that launches on two streams
    never share one. Inside a CUDA-graph capture, a fresh one per call, zeroed by a node of the graph: a
    cached one made during the capture would hold garbage until the graph first replays."""
    if _capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = (device.index, stream_handle)
    c = _tile_counters.get(key)
    if c is None:
        c = _tile_counters[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return c
