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
_fwd_kernels: frozenset[tuple[int, torch.dtype, int, bool]] = frozenset()
_bwd_kernels: frozenset[tuple[int, torch.dtype, int, bool]] = frozenset()

DTYPE_NAMES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _load() -> ModuleType | None:
    global _module, _error, _loaded, _fwd_kernels, _bwd_kernels
    if not _loaded:
        _loaded = True
        try:
            _module = importlib.import_module("flashhopper._C")
        except ImportError as e:  # not built, or built against a CUDA runtime this machine lacks
            _error = f"{type(e).__name__}: {e}"
        else:
            _fwd_kernels, _bwd_kernels = (frozenset(
                (k["arch"], DTYPE_NAMES[k["dtype"]], k["headdim"], k["causal"])
                for k in _module.kernels()
                if k["mode"] == mode and k["dtype"] in DTYPE_NAMES
            ) for mode in ("fwd", "bwd"))
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


def build_info() -> dict[str, Any]:
    mod = _load()
    return {} if mod is None else dict(mod.build_info())
