"""The compiled extension ``flashhopper._C``, imported lazily, and its kernel table by KernelKey.

Importing flashhopper must work without it (a ``FLASHHOPPER_PURE_PYTHON=1`` install, a CPU-only
machine, a broken build): the reference backend still runs, and the import error is kept so that
a request for a kernel can say why there is none.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .kernel_key import FP8_HEADDIMS, VARLEN_HEADDIMS, KernelKey, from_dict

_module: ModuleType | None = None
_error: str | None = None
_loaded = False


@dataclass(frozen=True)
class Entry:
    """One compiled kernel: what ``_C.fwd`` / ``_C.bwd`` take as ``index``, and its tile sizes."""
    index: int
    block_m: int
    block_n: int
    # A short-key tile beside it (the padded e4m3 d128 and 16-bit d96 forwards): its keys per tile and the most keys
    # a padded call may have to run it (0: none; cpp/sm90/tile_size.h, ShortKeys). block_m stays the long tile's.
    block_n_short: int = 0
    short_keys_max: int = 0


# (mode, key) -> entry, filled on first load.
_table: dict[tuple[str, KernelKey], Entry] = {}


def _load() -> ModuleType | None:
    global _module, _error, _loaded
    if not _loaded:
        _loaded = True
        try:
            _module = importlib.import_module("flashhopper._C")
        except ImportError as e:  # not built, or built against a CUDA runtime this machine lacks
            _error = f"{type(e).__name__}: {e}"
        else:
            for k in _module.kernels():
                _table[(k["mode"], from_dict(k))] = Entry(k["index"], k["block_m"], k["block_n"],
                                                                k.get("block_n_short", 0), k.get("short_keys_max", 0))
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
    """The kernels in this build, as ``_C.kernels()`` lists them: mode, index, the KernelKey's fields,
    block_m, block_n, block_n_short, short_keys_max ([] without _C)."""
    mod = _load()
    return [] if mod is None else list(mod.kernels())


def kernel(mode: str, key: KernelKey) -> Entry | None:
    """The compiled ``mode`` ("fwd" or "bwd") kernel for ``key``, or None."""
    _load()
    return _table.get((mode, key))


def has_kernel(mode: str, key: KernelKey) -> bool:
    return kernel(mode, key) is not None


def has_fp8_quantize() -> bool:
    """Whether this build has the fp8 quantization kernel (``_C.quantize_fp8``)."""
    mod = _load()
    return mod is not None and hasattr(mod, "quantize_fp8") and hasattr(mod, "QuantParams")


def build_info() -> dict[str, Any]:
    """What this build was configured with (archs, modes, dtypes, headdims, masks, variants, score_mods, dropout; {}
    without _C)."""
    mod = _load()
    return {} if mod is None else dict(mod.build_info())


def configured(mode: str, key: KernelKey) -> bool:
    """Whether the build was asked for this production kernel (FLASHHOPPER_ARCHS, _MODES, _DTYPES, _HDIMS,
    _MASKS, _SCORE_MODS, _DROPOUT, _VARLEN): then its absence is a broken build or a wrong key, not a configuration choice (the
    GPU tests fail on it rather than skip). The fp8 (e4m3) dtype is built as a Hopper forward only, without
    score mods or dropout, at FP8_HEADDIMS (cpp/generate_kernels.py); variants are ablation builds, never required."""
    info = build_info()
    if not info or key.variant:
        return False
    dtype = key.short_dtype()
    if dtype == "e4m3" and (key.arch != 90 or mode != "fwd" or key.score_mod != "none" or key.dropout
                            or key.headdim not in FP8_HEADDIMS):
        return False
    if key.headdim_v == key.headdim:
        hdims = key.headdim in info["headdims"]
    else:  # (Q/K, V) pairs: Hopper 16-bit kernels only
        hdims = key.arch == 90 and [key.headdim, key.headdim_v] in info.get("headdim_pairs", [])
    return (key.arch in info["archs"] and mode in info["modes"] and dtype in info["dtypes"] and hdims
            and key.mask in info["masks"] and key.score_mod in info.get("score_mods", ["none"])
            and ("on" if key.dropout else "off") in info.get("dropout", ["off"])
            and (varlen_configured(mode, key, info) if key.varlen else "off" in info.get("varlen", ["off"]))
            and (kvcache_configured(mode, key, info) if key.kvcache != "off"
                 else "off" in info.get("kvcache", ["off"])))


def kvcache_configured(mode: str, key: KernelKey, info: dict[str, Any]) -> bool:
    """Whether the build makes a KV-cache kernel for ``key`` (FLASHHOPPER_KVCACHE on, or e4m3: Hopper only): the
    16-bit-query forward of either family at VARLEN_HEADDIMS, with the build's masks (window too) and score mods,
    without dropout or varlen (cpp/generate_kernels.py)."""
    return (key.kvcache in info.get("kvcache", ["off"]) and (key.kvcache != "e4m3" or key.arch == 90)
            and mode == "fwd" and key.dtype != "float8_e4m3fn" and not key.dropout and not key.varlen
            and key.headdim == key.headdim_v and key.headdim in VARLEN_HEADDIMS)


def varlen_configured(mode: str, key: KernelKey, info: dict[str, Any]) -> bool:
    """Whether the build makes a packed-batch kernel for ``key`` (FLASHHOPPER_VARLEN on): the 16-bit forward
    and backward of either family (with dropout too where FLASHHOPPER_DROPOUT has "on": configured() checks it) and
    the Hopper fp8 forward, at VARLEN_HEADDIMS (cpp/generate_kernels.py)."""
    return ("on" in info.get("varlen", ["off"]) and mode in ("fwd", "bwd")
            and key.headdim == key.headdim_v and key.headdim in VARLEN_HEADDIMS)
