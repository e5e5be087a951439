"""The compiled extension ``flashhopper._C``, imported lazily.

Importing flashhopper must work without it (a ``FLASHHOPPER_PURE_PYTHON=1`` install, a CPU-only
machine, a broken build): the reference backend still runs, and the import error is kept so that
a request for a kernel can say why there is none.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

_module: ModuleType | None = None
_error: str | None = None
_loaded = False
# (arch, dtype, headdim, causal) of every compiled forward / backward kernel; filled on first load.
# fp8 entries are keyed by torch.float8_e4m3fn, so they never match a bf16/fp16 lookup.
_fwd_kernels: frozenset[tuple[int, torch.dtype, int, bool]] = frozenset()
_bwd_kernels: frozenset[tuple[int, torch.dtype, int, bool]] = frozenset()
# (headdim, causal) -> (block_m, block_n) of the arch-90 fp8 forward kernels (docs/fp8.md).
_fp8_fwd_tiles: dict[tuple[int, bool], tuple[int, int]] = {}

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn,
}


def _load() -> ModuleType | None:
    global _module, _error, _loaded, _fwd_kernels, _bwd_kernels, _fp8_fwd_tiles
    if not _loaded:
        _loaded = True
        try:
            _module = importlib.import_module("flashhopper._C")
        except ImportError as e:  # not built, or built against a CUDA runtime this machine lacks
            _error = f"{type(e).__name__}: {e}"
        else:
            kernels = list(_module.kernels())
            _fwd_kernels, _bwd_kernels = (frozenset(
                (k["arch"], DTYPE_NAMES[k["dtype"]], k["headdim"], k["causal"])
                for k in kernels
                if k["mode"] == mode and k["dtype"] in DTYPE_NAMES
            ) for mode in ("fwd", "bwd"))
            _fp8_fwd_tiles = {
                (k["headdim"], k["causal"]): (k["block_m"], k["block_n"])
                for k in kernels
                if k["mode"] == "fwd" and k["arch"] == 90 and k["dtype"] == "float8_e4m3fn"
            }
    return _module


def has_extension() -> bool:
    """True when ``flashhopper._C`` imports."""
    return _load() is not None


def extension_error() -> str | None:
    """Why ``flashhopper._C`` did not import (None when it did)."""
    _load()
    return _error


def extension() -> ModuleType:
    """``flashhopper._C``, or RuntimeError saying why it is missing."""
    mod = _load()
    if mod is None:
        raise RuntimeError(f"flashhopper: the compiled extension is not available ({_error})")
    return mod


def compiled_kernels() -> list[dict[str, Any]]:
    """The kernel configurations in this build, as ``_C.kernels()`` lists them ([] without _C)."""
    mod = _load()
    return [] if mod is None else list(mod.kernels())


def has_fwd_kernel(arch: int, dtype: torch.dtype, headdim: int, causal: bool) -> bool:
    _load()
    return (arch, dtype, headdim, causal) in _fwd_kernels


def has_bwd_kernel(arch: int, dtype: torch.dtype, headdim: int, causal: bool) -> bool:
    """Whether this build has the arch-``arch`` backward (preprocess, main kernel, postprocess)."""
    _load()
    return (arch, dtype, headdim, causal) in _bwd_kernels


def fp8_kernel_tiles(headdim: int, causal: bool) -> tuple[int, int] | None:
    """(block_m, block_n) of this build's arch-90 fp8 (e4m3) forward kernel, or None without one."""
    _load()
    return _fp8_fwd_tiles.get((headdim, causal))


def has_fp8_quantize() -> bool:
    """Whether this build has the fp8 quantization kernel (``_C.quantize_fp8``)."""
    mod = _load()
    return mod is not None and hasattr(mod, "quantize_fp8") and hasattr(mod, "QuantParams")


def build_info() -> dict[str, Any]:
    mod = _load()
    return {} if mod is None else dict(mod.build_info())
