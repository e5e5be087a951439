"""The feature key: what a compiled kernel computes, one definition from the build to the call.

``cpp/generate_kernels.py`` enumerates KernelKeys to instantiate (it loads this file by path, so it
imports nothing but the standard library: no torch at build time), the extension lists its kernels
with the same fields (``_C.kernels()``, from ``cpp/common/kernel_key.h``, whose field list
``tests/test_kernel_key.py`` compares with FIELDS), and dispatch builds the key of a call and looks it
up. A feature that needs its own instantiation adds a field here and in kernel_key.h.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

MASKS: tuple[str, ...] = ("none", "causal", "window")
# What the scores go through before the softmax (cpp/common/score_mod.h): nothing, or Gemma 2's softcap.
SCORE_MODS: tuple[str, ...] = ("none", "softcap")
# Attention dropout (cpp/common/dropout.h) compiled in or not: build-option spelling (FLASHHOPPER_DROPOUT).
DROPOUTS: tuple[str, ...] = ("off", "on")
# Packed-batch (varlen) kernels built or not: build-option spelling (FLASHHOPPER_VARLEN); the head dims
# they are built at (the FA3-paper three).
VARLENS: tuple[str, ...] = ("off", "on")
VARLEN_HEADDIMS: tuple[int, ...] = (64, 128, 256)
# KV-cache kernels (flash_attn_with_kvcache: paged or contiguous caches, per-entry cache lengths, split-KV) built
# or not: build-option spelling (FLASHHOPPER_KVCACHE); forward, 16-bit queries, at the varlen head dims. "on": the
# cache has the queries' dtype; "e4m3": an e4m3 cache with per-token scales (Hopper only, docs/kvcache-fp8.md).
KVCACHES: tuple[str, ...] = ("off", "on", "e4m3")
# Build-option spelling (FLASHHOPPER_DTYPES) -> the dtype names the key carries (torch's, without "torch.").
BUILD_DTYPES: dict[str, str] = {"fp16": "float16", "bf16": "bfloat16", "e4m3": "float8_e4m3fn"}
ARCHS: tuple[int, ...] = (90, 80)
MODES: tuple[str, ...] = ("fwd", "bwd")
# Head dims (of Q/K, and V) with kernels; the FP8 forward (its tiles, V transpose and scale blocks) has
# the FA3-paper three.
HEADDIMS: tuple[int, ...] = (64, 96, 128, 192, 256)
FP8_HEADDIMS: tuple[int, ...] = (64, 128, 256)
# (Q/K, V) head dims that differ, Hopper 16-bit kernels only: DeepSeek-V3's prefill, and 128 / 64. Build
# option spelling "192x128" (FLASHHOPPER_HDIMS).
HEADDIM_PAIRS: tuple[tuple[int, int], ...] = ((192, 128), (128, 64))


def parse_headdim(token: str) -> tuple[int, int]:
    """A FLASHHOPPER_HDIMS entry as (Q/K, V) head dims: "128" -> (128, 128), "192x128" -> (192, 128)."""
    qk, _, v = token.partition("x")
    pair = (int(qk), int(v or qk))
    if (pair[0] == pair[1] and pair[0] not in HEADDIMS) or (pair[0] != pair[1] and pair not in HEADDIM_PAIRS):
        raise ValueError(f"head dims {token!r}: the kernels have {', '.join(map(str, HEADDIMS))} and "
                         f"{', '.join(f'{a}x{b}' for a, b in HEADDIM_PAIRS)}")
    return pair


@dataclass(frozen=True)
class KernelKey:
    arch: int        # 90: Hopper (sm_90a); 80: Ampere (sm_80, also runs on 8.6-9.0)
    dtype: str       # "float16", "bfloat16", "float8_e4m3fn" (of Q, K, V)
    headdim: int     # of Q and K
    headdim_v: int   # of V and O
    mask: str        # "none", "causal", "window" (flash-attn's window_size; causal is its (-1, 0) fast case)
    variant: str = ""  # "" in production; else a named ablation variant (cpp/sm90/variants.h)
    score_mod: str = "none"  # "none" or "softcap" (its value is a runtime argument)
    dropout: bool = False    # P's scores dropped at random (training; p and the seed are runtime arguments)
    varlen: bool = False     # packed batches (cu_seqlens / seqused bounds: flash_attn_varlen_func)
    kvcache: str = "off"     # K/V from a (paged) cache ("on", or "e4m3" for an e4m3 one): page table, split-KV

    def __post_init__(self) -> None:
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        if self.score_mod not in SCORE_MODS:
            raise ValueError(f"score_mod must be one of {SCORE_MODS}, got {self.score_mod!r}")
        if self.kvcache not in KVCACHES:
            raise ValueError(f"kvcache must be one of {KVCACHES}, got {self.kvcache!r}")
        if self.dtype not in BUILD_DTYPES.values():
            raise ValueError(f"dtype must be one of {tuple(BUILD_DTYPES.values())}, got {self.dtype!r}")

    def short_dtype(self) -> str:
        return next(k for k, v in BUILD_DTYPES.items() if v == self.dtype)

    def describe(self) -> str:
        hd = f"{self.headdim}" if self.headdim_v == self.headdim else f"{self.headdim}/{self.headdim_v}"
        return (f"sm{self.arch} {self.dtype} headdim {hd} mask {self.mask}"
                + (f" {self.score_mod}" if self.score_mod != "none" else "")
                + (" dropout" if self.dropout else "")
                + (" varlen" if self.varlen else "")
                + {"off": "", "on": " kvcache", "e4m3": " kvcache e4m3"}[self.kvcache]
                + (f" variant {self.variant}" if self.variant else ""))

    def file_name(self, mode: str) -> str:
        """The configuration's name, e.g. fwd_sm90_bf16_hdim128_causal (its generated unit holds every
        configuration of its arch, mode, dtype and head dims: cpp/generate_kernels.py's tu_name)."""
        hd = f"hdim{self.headdim}" + ("" if self.headdim_v == self.headdim else f"v{self.headdim_v}")
        mask = "" if self.mask == "none" else f"_{self.mask}"
        score_mod = "" if self.score_mod == "none" else f"_{self.score_mod}"
        variant = f"_v-{self.variant}" if self.variant else ""
        dropout = "_dropout" if self.dropout else ""
        varlen = "_varlen" if self.varlen else ""
        kvcache = {"off": "", "on": "_kvcache", "e4m3": "_kvcache-e4m3"}[self.kvcache]
        return f"{mode}_sm{self.arch}_{self.short_dtype()}_{hd}{mask}{score_mod}{dropout}{varlen}{kvcache}{variant}"


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(KernelKey))


def never_built(key: KernelKey) -> str:
    """Why no build instantiates ``key``, whatever its FLASHHOPPER_* options ("" where one can): the rules of
    cpp/generate_kernels.py that do not depend on a kernel family's own lists, kept here once for the generator,
    which skips these keys, and for dispatch, which says so instead of a rebuild hint."""
    square = key.headdim == key.headdim_v
    if key.kvcache != "off" and not (square and key.headdim in VARLEN_HEADDIMS):
        return (f"the KV-cache kernels have head dims {', '.join(map(str, VARLEN_HEADDIMS))} (q, K and V alike); "
                "backend='reference' takes any")
    if key.kvcache == "e4m3" and key.arch != 90:  # its conversion runs in the Hopper producer warpgroup
        return "an e4m3 KV cache has Hopper (sm90) kernels only; pass backend='reference' (or run on an H100/H200)"
    if key.kvcache != "off" and (key.dtype == "float8_e4m3fn" or key.varlen or key.dropout or key.variant):
        return "the KV-cache kernels take 16-bit queries, without packed batches, dropout or variants"
    if key.dtype == "float8_e4m3fn" and (key.arch != 90 or not square or key.headdim not in FP8_HEADDIMS
                                          or key.score_mod != "none" or key.dropout):
        return ("the fp8 (e4m3) kernels are Hopper (sm90) ones at head dims "
                f"{', '.join(map(str, FP8_HEADDIMS))} (q, K and V alike), without softcap or dropout; "
                "backend='reference' takes any")
    if key.varlen and not (square and key.headdim in VARLEN_HEADDIMS and not key.variant):
        return ("packed batches (varlen) have kernels at head dims "
                f"{', '.join(map(str, VARLEN_HEADDIMS))} only (q, K and V alike); for other head dims "
                "pad the batch and call flash_attn_func, or pass backend='reference', which takes any")
    if not square and (key.arch != 90 or key.variant):  # pairs: the Hopper production kernels only
        return ("Q/K and V head dims that differ have Hopper (sm90) 16-bit kernels only; pass "
                "backend='reference' (or run on an H100/H200)")
    return ""


def mask_of(causal: bool, window: tuple[int, int] | None = None) -> str:
    """The mask kind of a call: a window (other than the unbounded (-1, -1)) -> "window" (causal narrows
    its right edge to 0), else "causal" or "none"."""
    if window is not None and tuple(window) != (-1, -1):
        return "window"
    return "causal" if causal else "none"


def window_of(window_left: int, window_right: int) -> tuple[int, int] | None:
    """The ops' (window_left, window_right) arguments as a window: None for (-1, -1), no window."""
    return None if (window_left, window_right) == (-1, -1) else (window_left, window_right)


def normalize_window(causal: bool, window: tuple[int, int] | None) -> tuple[bool, tuple[int, int] | None]:
    """(causal, window) as the kernels run a call: a window that is plain causal attention ((-1, 0), or
    (-1, right) with causal) becomes causal without a window, so that it runs the causal kernels."""
    if window is not None and window[0] == -1 and (causal or window[1] == 0):
        return True, None
    return causal, window


def from_dict(d: dict[str, object]) -> KernelKey:
    """The key of an entry of ``_C.kernels()`` (a dict with the key's fields and more)."""
    return KernelKey(**{f: d[f] for f in FIELDS})  # type: ignore[arg-type]
