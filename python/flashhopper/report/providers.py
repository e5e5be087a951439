"""Who gets timed: flashhopper's kernel families and the peers on this machine, in one table.

A provider turns (mode, q, k, v, causal) into a callable to time, after one untimed run that proves
it works, or raises Unavailable with a one-line reason. Our providers look their kernel up in the
build's registry by its KernelKey (``dispatch.kernel_key``, ``_ext.kernel``), so a mode, dtype or
family that a later build compiles is timed with no change here, and what is not built is skipped,
saying why. "flashhopper@<variant>" names the kernels of a named variant (``provider``). Peers:
PyTorch SDPA's backends, and FlashAttention-3 where it is configured (``fa3``).
Our providers are the ones whose name starts with "flashhopper".
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashhopper
from flashhopper import _ext, dispatch, fp8, ops, reference_fp8

from . import fa3
from .timing import Fn

MODES: tuple[str, ...] = ("fwd", "bwd")


class Unavailable(Exception):
    """A provider cannot run this configuration here; the message says why."""


class Prepared(NamedTuple):
    fn: Fn
    meta: dict[str, Any]  # recorded with the row: for ours the backend and its tile sizes


@dataclass(frozen=True)
class Provider:
    name: str
    prepare: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, bool], Prepared]
    # Entered around preparing and timing rather than inside the timed call (SDPA's backend choice).
    context: Callable[[], contextlib.AbstractContextManager[Any]] = field(default=contextlib.nullcontext)
    # The relative error against SDPA above which a result is suspect. fp8's own error on randn
    # inputs is ~5e-2 (tests/test_fp8_gpu.py), so its providers say so here (FP8_REL_ERR_TOLERANCE).
    rel_err_tolerance: float = 1e-2


# fp8 forwards' tolerance: ours and FA3's (per-head scales, emulated with reference_fp8) are ~5e-2 on randn.
FP8_REL_ERR_TOLERANCE = 8e-2


def is_ours(provider: str) -> bool:
    return provider.startswith("flashhopper")


def is_checked(provider: str) -> bool:
    """Whether the sweep checks this provider's forward against SDPA before timing it: ours and FA3's.
    SDPA's backends are the reference itself."""
    return is_ours(provider) or provider in FA3_PROVIDERS


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _kernel(backend: str, mode: str, dtype: torch.dtype, headdim: int, causal: bool, variant: str = "") -> _ext.Entry:
    """The build's ``mode`` kernel for this configuration, or Unavailable saying what to rebuild with."""
    try:
        return dispatch.require_kernel(mode, dispatch.kernel_key(backend, dtype, headdim, causal, variant=variant))
    except ValueError as e:
        raise Unavailable(str(e)) from None


def _require_hopper(q: torch.Tensor, what: str) -> None:
    if not q.is_cuda:
        raise Unavailable(f"q is on {q.device}; {what} need CUDA tensors")
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        raise Unavailable(f"{what} are sm_90a code; {q.device} is {torch.cuda.get_device_name(q.device)}")


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def timeable(mode: str, make_fwd: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Fn],
              q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Fn:
    """The forward, or the backward alone on a graph kept from one forward, after one run."""
    _check_mode(mode)
    try:
        leaves = [x.detach().requires_grad_(mode == "bwd") for x in (q, k, v)]
        fwd = make_fwd(*leaves)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SDPA explains refusals as warnings; we keep the error
            out = fwd()
        if mode == "fwd":
            return fwd
        dout = torch.randn_like(out)

        def bwd() -> Any:
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)

        bwd()
    except (RuntimeError, ValueError) as e:  # a kernel's refusal, or flash_attn_func's validation
        raise Unavailable(_first_line(e)) from None
    return bwd


def _ours(backend: str | None, mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          causal: bool, deterministic: bool = False) -> Prepared:
    headdim = q.shape[-1]
    try:
        name = dispatch.select_backend(q, headdim, q.dtype, causal, backend)
    except (ValueError, TypeError) as e:
        raise Unavailable(str(e)) from None
    if name not in dispatch.ARCH:
        raise Unavailable(f"no kernel: dispatch chose the {name} backend")
    entry = _kernel(name, mode, q.dtype, headdim, causal)

    def make(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> Fn:
        return lambda: flashhopper.flash_attn_func(q_, k_, v_, causal=causal, deterministic=deterministic, backend=name)

    meta = {"backend": name, "block_m": entry.block_m, "block_n": entry.block_n}
    if (mode == "fwd" and name == "sm90" and entry.short_keys_max > 0 and k.shape[1] <= entry.short_keys_max
            and q.shape[1] <= entry.short_keys_max):
        # The 16-bit short tile runs (cpp/sm90/launch_fwd.h: use_short_keys); the table entry does not carry its
        # rows, so no IO model for this call rather than the long tile's.
        meta.update(block_m=None, block_n=None)
    return Prepared(timeable(mode, make, q, k, v), meta)


def _variant(variant: str, mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Prepared:
    """The sm90 ``mode`` kernel of a named variant (cpp/sm90/variants.h), launched through ops.fwd_into /
    bwd_into on outputs allocated here: the kernels' memory traffic is the production provider's, and the
    timed call does the validation flash_attn_func does, without the allocation. The backward runs on the
    production forward's out and lse."""
    _check_mode(mode)
    _require_hopper(q, "the sm90 kernels")
    headdim = q.shape[-1]
    entry = _kernel("sm90", mode, q.dtype, headdim, causal, variant)
    arch, scale = dispatch.ARCH["sm90"], 1.0 / math.sqrt(headdim)
    # NaN-poisoned: an element the kernel leaves unwritten shows in the check against SDPA.
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), math.nan, dtype=torch.float32, device=q.device)
    try:
        if mode == "fwd":
            def fn() -> Any:
                ops.fwd_into(q, k, v, out, lse, scale, causal, arch, variant=variant)
                return out
        else:
            ops.fwd_into(q, k, v, out, lse, scale, causal, arch)
            dout = torch.randn_like(q)
            dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))

            def fn() -> Any:
                ops.bwd_into(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, False, arch, variant=variant)
                return dq, dk, dv
        fn()
    except (RuntimeError, ValueError) as e:
        raise Unavailable(_first_line(e)) from None
    return Prepared(fn, {"backend": "sm90", "block_m": entry.block_m, "block_n": entry.block_n})


def _fp8(quantize_in_call: bool, mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         causal: bool) -> Prepared:
    """The sm90 fp8 (e4m3) forward on bf16/fp16 (or raw e4m3) inputs, as flash_attn_fp8_func quantizes
    them: Q per 64 rows, K and V per block_n keys (default_kv_block_size: the short-key tile's at short rows), Q and K with the Hadamard transform, V as V^T (the
    layout the kernel reads, so that the timed call does not convert it).
    ``quantize_in_call`` False: quantized once, untimed (the kernel); True: the timed call quantizes
    all three (end to end). TFLOPS count the same FLOPs as the bf16 forward."""
    if mode != "fwd":
        raise Unavailable(f"fp8 is forward-only (mode {mode!r})")
    _require_hopper(q, "the fp8 kernels")
    headdim = q.shape[-1]
    tiles = fp8.kernel_tiles(headdim, causal)
    if tiles is None:
        raise Unavailable(f"this build has no sm90 fp8 forward kernel for headdim {headdim} "
                          f"{'causal' if causal else 'non-causal'}")
    # The block of the tile the call runs (the short-key tile for short padded calls), as flash_attn_fp8_func picks.
    block_m, block_n = tiles[0], fp8.default_kv_block_size(headdim, causal, k.shape[1])
    if quantize_in_call and not _ext.has_fp8_quantize():
        raise Unavailable("this build has no fp8 quantization kernel (_C.quantize_fp8)")
    if q.dtype == torch.float8_e4m3fn:  # --dtype fp8: raw e4m3 values, exact in bf16; quantized as usual
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    try:
        if quantize_in_call:
            def fn() -> Any:
                return fp8.flash_attn_fp8_func(q, k, v, causal=causal)
        else:
            q8 = fp8.quantize_fp8(q, block_size=64, hadamard=True)
            k8 = fp8.quantize_fp8(k, block_size=block_n, hadamard=True)
            v8 = fp8.quantize_fp8(v, block_size=block_n, hadamard=False, transpose=True)

            def fn() -> Any:
                return fp8.flash_attn_fp8_func(q8, k8, v8, causal=causal)
        fn()
    except (RuntimeError, ValueError) as e:
        raise Unavailable(_first_line(e)) from None
    return Prepared(fn, {"backend": "sm90", "block_m": block_m, "block_n": block_n, "kernel_dtype": "fp8"})


def _sdpa(mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Prepared:
    def make(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> Fn:
        # Same memory as ours: (batch, seqlen, nheads, headdim) tensors, seen as (b, h, s, d) views,
        # made once here so that the timed call does no Python work of its own.
        qt, kt, vt = (x.transpose(1, 2) for x in (q_, k_, v_))
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return Prepared(timeable(mode, make, q, k, v), {})


def _load_fa3() -> ModuleType:
    try:
        return fa3.load()
    except ImportError as e:
        raise Unavailable(str(e)) from None


def _fa3(mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Prepared:
    """FlashAttention-3's forward, or its backward through autograd (its build: bf16)."""
    interface = _load_fa3()
    _require_hopper(q, "FA3's kernels")

    def make(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> Fn:
        return lambda: interface.flash_attn_func(q_, k_, v_, causal=causal)  # returns out alone

    return Prepared(timeable(mode, make, q, k, v), {})


def quantize_per_kv_head(x: torch.Tensor, nheads_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (batch, seqlen, nheads, headdim) in e4m3 and its float32 descales (batch, nheads_kv), the shape of FA3's
    q/k/v_descale: one scale per (batch, kv head), from the amax over seqlen and headdim of that slice and, under
    GQA, of the query heads that share the kv head (FA3 descales them together). docs/fp8.md's "head"
    quantization (reference_fp8.quantize_ref), each group of heads seen as one wider head (adjacent in memory)."""
    b, s, h, d = x.shape
    if nheads_kv < 1 or h % nheads_kv:
        raise ValueError(f"nheads {h} is not a multiple of nheads_kv {nheads_kv}")
    t = reference_fp8.quantize_ref(x.reshape(b, s, nheads_kv, h // nheads_kv * d), None, "head")
    return t.data.view(b, s, h, d), t.scale.view(b, nheads_kv)


def _fa3_fp8(mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Prepared:
    """FlashAttention-3's e4m3 forward on inputs quantized once, untimed, with FA3's per-(batch, kv head)
    descales (``quantize_per_kv_head``)."""
    if mode != "fwd":
        raise Unavailable(f"FA3's fp8 is forward-only (mode {mode!r})")
    interface = _load_fa3()
    _require_hopper(q, "FA3's kernels")
    if q.dtype == torch.float8_e4m3fn:  # --dtype fp8: raw e4m3 values, exact in bf16; quantized as usual
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    nheads_kv = k.shape[2]
    try:
        (q8, qd), (k8, kd), (v8, vd) = (quantize_per_kv_head(x, nheads_kv) for x in (q, k, v))

        def fn() -> Any:
            return interface.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)

        fn()
    except (RuntimeError, ValueError) as e:
        raise Unavailable(_first_line(e)) from None
    return Prepared(fn, {"kernel_dtype": "fp8"})


_SDPA_BACKENDS: dict[str, SDPBackend] = {
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-fa2": SDPBackend.FLASH_ATTENTION,
    "sdpa-memeff": SDPBackend.EFFICIENT_ATTENTION,
}

PROVIDERS: dict[str, Provider] = {p.name: p for p in (
    Provider("flashhopper", functools.partial(_ours, None)),  # auto-dispatch: what flash_attn_func picks
    Provider("flashhopper-sm90", functools.partial(_ours, "sm90")),
    Provider("flashhopper-sm80", functools.partial(_ours, "sm80")),
    # The backward with deterministic=True (ordered dQ accumulation): its cost next to the default.
    Provider("flashhopper-deterministic", functools.partial(_ours, None, deterministic=True)),
    Provider("flashhopper-sm80-deterministic", functools.partial(_ours, "sm80", deterministic=True)),
    # fp8 forward: the kernel on inputs quantized beforehand, and end to end (quantizing q, k, v in the call).
    Provider("flashhopper-fp8", functools.partial(_fp8, False), rel_err_tolerance=FP8_REL_ERR_TOLERANCE),
    Provider("flashhopper-fp8-e2e", functools.partial(_fp8, True), rel_err_tolerance=FP8_REL_ERR_TOLERANCE),
    *(Provider(name, _sdpa, functools.partial(sdpa_kernel, [b])) for name, b in _SDPA_BACKENDS.items()),
    Provider("fa3", _fa3),
    Provider("fa3-fp8", _fa3_fp8, rel_err_tolerance=FP8_REL_ERR_TOLERANCE),
)}
FA3_PROVIDERS: tuple[str, ...] = ("fa3", "fa3-fp8")
VARIANT_PREFIX = "flashhopper@"


def provider(name: str) -> Provider:
    """The provider called ``name``: one of PROVIDERS, or "flashhopper@<variant>", the sm90 kernels of a
    named variant (cpp/sm90/variants.h), skipped with the reason where the build lacks them."""
    if name in PROVIDERS:
        return PROVIDERS[name]
    variant = name.removeprefix(VARIANT_PREFIX)
    if name.startswith(VARIANT_PREFIX) and re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", variant):
        return Provider(name, functools.partial(_variant, variant))
    raise ValueError(f"provider must be one of {', '.join(PROVIDERS)} or {VARIANT_PREFIX}<variant> "
                     f"(e.g. {VARIANT_PREFIX}no-pingpong), got {name!r}")


def provider_name(name: str) -> str:
    """argparse ``type`` of a provider option: the name, if ``provider`` knows it."""
    try:
        provider(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def with_fa3(names: Sequence[str]) -> list[str]:
    """``names``, plus the FA3 providers where FA3 is configured (--fa3-path, FLASHHOPPER_FA3_PATH)."""
    return [*names, *(p for p in FA3_PROVIDERS if fa3.configured() and p not in names)]


def check_against_sdpa(fn: Fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> float | None:
    """||out - SDPA|| / ||SDPA|| (untimed): a benchmark of a wrong kernel, ours or a peer's, is worthless.
    None where SDPA cannot run these inputs (e.g. fp8)."""
    try:
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal).transpose(1, 2).double()
    except RuntimeError:
        return None
    out = fn()
    out = out[0] if isinstance(out, tuple) else out  # FA3 builds that return (out, lse)
    return ((out.double() - ref).norm() / ref.norm()).item()
