"""Who gets timed: flashhopper's kernel families and the peers on this machine, in one table.

A provider turns (mode, q, k, v, causal) into a callable to time, after one untimed run that proves
it works, or raises Unavailable with a one-line reason. Our providers look their kernel up in the
build's registry (``flashhopper.compiled_kernels()``), so a mode, dtype or family that a later build
compiles (backward, fp8, sm80) is timed with no change here, and what is not built is skipped,
saying why. A new peer (e.g. FlashAttention-3) is one more entry in PROVIDERS.
Our providers are the ones whose name starts with "flashhopper".
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashhopper
from flashhopper import _ext, dispatch, fp8

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
    # inputs is ~5e-2 (tests/test_fp8_gpu.py), so its providers say so here.
    rel_err_tolerance: float = 1e-2


def is_ours(provider: str) -> bool:
    return provider.startswith("flashhopper")


def find_kernel(arch: int, mode: str, dtype: torch.dtype, headdim: int, causal: bool) -> dict[str, Any] | None:
    """The registry entry of the compiled kernel for this configuration, or None."""
    want = (arch, mode, str(dtype).removeprefix("torch."), headdim, causal)
    for k in flashhopper.compiled_kernels():
        if (k["arch"], k["mode"], k["dtype"], k["headdim"], k["causal"]) == want:
            return k
    return None


def _timeable(mode: str, make_fwd: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Fn],
              q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Fn:
    """The forward, or the backward alone on a graph kept from one forward, after one run."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
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
    except RuntimeError as e:
        raise Unavailable(str(e).splitlines()[0]) from None
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
    kernel = find_kernel(dispatch.ARCH[name], mode, q.dtype, headdim, causal)
    if kernel is None:
        raise Unavailable(f"this build has no {name} {mode} kernel for {str(q.dtype).removeprefix('torch.')} "
                          f"headdim {headdim} {'causal' if causal else 'non-causal'}")

    def make(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> Fn:
        return lambda: flashhopper.flash_attn_func(q_, k_, v_, causal=causal, deterministic=deterministic, backend=name)

    return Prepared(_timeable(mode, make, q, k, v),
                    {"backend": name, "block_m": kernel["block_m"], "block_n": kernel["block_n"]})


def _sdpa(mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Prepared:
    def make(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> Fn:
        # Same memory as ours: (batch, seqlen, nheads, headdim) tensors, seen as (b, h, s, d) views,
        # made once here so that the timed call does no Python work of its own.
        qt, kt, vt = (x.transpose(1, 2) for x in (q_, k_, v_))
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return Prepared(_timeable(mode, make, q, k, v), {})


def _fp8(quantize_in_call: bool, mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         causal: bool) -> Prepared:
    """The sm90 fp8 (e4m3) forward on bf16/fp16 (or raw e4m3) inputs, as flash_attn_fp8_func quantizes
    them: Q per 64 rows, K and V per block_n keys, Q and K with the Hadamard transform, V in the layout
    the kernel reads (V^T, or row-major where the build transposes V in the kernel).
    ``quantize_in_call`` False: quantized once, untimed (the kernel); True: the timed call quantizes
    all three (end to end). TFLOPS count the same FLOPs as the bf16 forward."""
    if mode != "fwd":
        raise Unavailable(f"fp8 is forward-only (mode {mode!r})")
    if not q.is_cuda:
        raise Unavailable(f"q is on {q.device}; the fp8 kernels need CUDA tensors")
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        raise Unavailable(f"the fp8 kernels are sm_90a code; {q.device} is {torch.cuda.get_device_name(q.device)}")
    headdim = q.shape[-1]
    kernel = find_kernel(90, "fwd", torch.float8_e4m3fn, headdim, causal)
    if kernel is None:
        raise Unavailable(f"this build has no sm90 fp8 forward kernel for headdim {headdim} "
                          f"{'causal' if causal else 'non-causal'}")
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
            k8 = fp8.quantize_fp8(k, block_size=kernel["block_n"], hadamard=True)
            # V^T, or row-major for kernels that transpose V themselves (FLASHHOPPER_FP8_V_TRANSPOSE_IN_KERNEL):
            # the layout the kernel reads, so that the timed call does not convert it.
            v8 = fp8.quantize_fp8(v, block_size=kernel["block_n"], hadamard=False,
                                  transpose=fp8.kernel_v_transposed(headdim))

            def fn() -> Any:
                return fp8.flash_attn_fp8_func(q8, k8, v8, causal=causal)
        fn()
    except (RuntimeError, ValueError) as e:
        raise Unavailable(str(e).splitlines()[0]) from None
    return Prepared(fn, {"backend": "sm90", "block_m": kernel["block_m"], "block_n": kernel["block_n"],
                         "kernel_dtype": "fp8"})


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
    Provider("flashhopper-fp8", functools.partial(_fp8, False), rel_err_tolerance=8e-2),
    Provider("flashhopper-fp8-e2e", functools.partial(_fp8, True), rel_err_tolerance=8e-2),
    *(Provider(name, _sdpa, functools.partial(sdpa_kernel, [b])) for name, b in _SDPA_BACKENDS.items()),
)}


def check_against_sdpa(fn: Fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> float | None:
    """||ours - SDPA|| / ||SDPA|| (untimed): a benchmark of a wrong kernel is worthless. None where
    SDPA cannot run these inputs (e.g. fp8)."""
    try:
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal).transpose(1, 2).double()
    except RuntimeError:
        return None
    return ((fn().double() - ref).norm() / ref.norm()).item()
