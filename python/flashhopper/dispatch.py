"""Which backend runs a call: "sm90" (Hopper kernels), "sm80" (Ampere kernels) or "reference".

A call's kernel is named by its KernelKey (kernel_key.py: family, dtype, head dims, mask kind, variant)
and looked up in the build's table (``_ext.kernel``). Auto (backend=None): CPU tensors -> reference;
CUDA capability 9.0 with a compiled arch-90 kernel for the key -> sm90; capability 8.x-9.x with an
arch-80 kernel -> sm80; anything else is an error that says what to rebuild with. Never a silent fall
back to the slow reference on a GPU. Gradients run the backward of the family that ran the forward;
when they will be needed and that family has no backward kernel for the key, the forward already
refuses (require_bwd_kernel).
"""
from __future__ import annotations

import functools
from collections.abc import Container

import torch

from . import _device, _ext, validation
from ._device import DeviceInfo
from .kernel_key import KernelKey, mask_of, never_built

BACKENDS: tuple[str, ...] = ("sm90", "sm80", "reference")
ARCH: dict[str, int] = {"sm90": 90, "sm80": 80}
# Auto-dispatch preference, best first.
_AUTO_ORDER: tuple[str, ...] = ("sm90", "sm80")


def runs_on(backend: str, capability: tuple[int, int]) -> bool:
    """Whether a kernel family's code runs on a GPU of this compute capability."""
    if backend == "sm90":
        return capability == (9, 0)  # sm_90a code runs on 9.0 only
    if backend == "sm80":
        return (8, 0) <= capability < (10, 0)  # sm_80 SASS runs on 8.x; the build also has sm_90 SASS
    return False


def score_mod_of(softcap: float) -> str:
    """The score mod of a call: "softcap" for softcap > 0, else "none"."""
    return "softcap" if softcap > 0 else "none"


def kernel_key(backend: str, dtype: torch.dtype, headdim: int, causal: bool,
               window: tuple[int, int] | None = None, variant: str = "", softcap: float = 0.0,
               headdim_v: int | None = None, dropout: bool = False, varlen: bool = False) -> KernelKey:
    """The KernelKey of a call on kernel family ``backend`` ("sm90" or "sm80"); V's head dim is q's unless
    ``headdim_v`` says otherwise. ``window``: flash-attn's (left, right), -1 unbounded; it makes the mask
    "window" unless (-1, -1). ``softcap`` > 0 needs a softcap kernel (the value itself is a runtime
    argument); ``dropout`` (dropout_p > 0) a dropout kernel; ``varlen`` a packed batch's."""
    return _key(backend, dtype, headdim, mask_of(causal, window), variant, score_mod_of(softcap), headdim_v, dropout,
                varlen)


# Cached: every launch asks, and a key's construction validates its fields (host time of small calls).
@functools.lru_cache(maxsize=1024)
def _key(backend: str, dtype: torch.dtype, headdim: int, mask: str, variant: str = "",
         score_mod: str = "none", headdim_v: int | None = None, dropout: bool = False,
         varlen: bool = False, kvcache: str = "off") -> KernelKey:
    if backend not in ARCH:
        raise ValueError(f"backend must be one of {', '.join(map(repr, ARCH))} for a kernel, got {backend!r}")
    return KernelKey(ARCH[backend], str(dtype).removeprefix("torch."), headdim,
                     headdim if headdim_v is None else headdim_v, mask, variant, score_mod, dropout, varlen, kvcache)


def _describe(key: KernelKey) -> str:
    """The call's configuration as an error message names it (the family is said separately)."""
    mask = {"none": "non-causal", "causal": "causal", "window": "windowed (local)"}[key.mask]
    hd = f"{key.headdim}" if key.headdim_v == key.headdim else f"{key.headdim}/{key.headdim_v}"
    return (f"{key.dtype} headdim {hd} {mask}" + (" with softcap" if key.score_mod == "softcap" else "")
            + (" with dropout" if key.dropout else "")
            + (" on packed sequences (varlen)" if key.varlen else "")
            + {"off": "", "on": " reading a KV cache", "e4m3": " reading an e4m3 KV cache"}[key.kvcache]
            + (f" variant {key.variant}" if key.variant else ""))


def _rebuild_hint(backends: tuple[str, ...], key: KernelKey, modes: str | None = None) -> str:
    never = never_built(key)
    if never:
        return f"no build has one: {never}"
    archs = ";".join(str(ARCH[b]) for b in backends)
    mode = f" FLASHHOPPER_MODES={modes}" if modes else ""
    # The default FLASHHOPPER_MASKS is none;causal: a window kernel has to be asked for by name.
    masks = " FLASHHOPPER_MASKS=none;causal;window" if key.mask == "window" else ""
    # Likewise the default FLASHHOPPER_SCORE_MODS is none.
    score_mods = " FLASHHOPPER_SCORE_MODS=none;softcap" if key.score_mod == "softcap" else ""
    dropout = " FLASHHOPPER_DROPOUT=off;on" if key.dropout else ""  # likewise (default off)
    varlen = " FLASHHOPPER_VARLEN=off;on" if key.varlen else ""  # in the default build, but may be turned off
    varlen += {"off": "", "on": " FLASHHOPPER_KVCACHE=off;on",  # likewise
               "e4m3": " FLASHHOPPER_KVCACHE=off;on;e4m3"}[key.kvcache]
    variant = f" FLASHHOPPER_VARIANTS={key.variant}" if key.variant else ""
    hdims = f"{key.headdim}" if key.headdim_v == key.headdim else f"{key.headdim}x{key.headdim_v}"
    hint = (f"rebuild with FLASHHOPPER_ARCHS={archs}{mode} FLASHHOPPER_DTYPES={key.short_dtype()} "
            f"FLASHHOPPER_HDIMS={hdims}{masks}{score_mods}{dropout}{varlen}{variant} (or a superset), or pass backend='reference'")
    err = _ext.extension_error()
    return hint + (f"; the compiled extension did not import: {err}" if err else "")


def choose_kernel(info: DeviceInfo, index: int, dtype: torch.dtype, headdim: int, mask: str,
                  backend: str | None, kernels: Container[KernelKey], score_mod: str = "none",
                  headdim_v: int | None = None, dropout: bool = False, varlen: bool = False) -> str:
    """Pure decision for a CUDA device: the kernel backend to use for a call of this dtype, head dim (and
    V's, None: the same), mask kind (kernel_key.mask_of), score mod, dropout and batch layout (``varlen``:
    packed sequences), given the forward kernels ``kernels``; or ValueError saying why none."""
    validation.check_kernel_dtype("q", dtype)
    validation.check_kernel_headdim(headdim, headdim_v)
    where = f"cuda:{index} ({info.name}, compute capability {info.capability[0]}.{info.capability[1]})"
    if info.capability < (8, 0):
        raise ValueError(f"q is on {where}; the flashhopper kernels need compute capability 8.0 or newer "
                         "(backend='reference' runs on any device)")
    if backend is not None:
        if not runs_on(backend, info.capability):
            need = "9.0 (Hopper)" if backend == "sm90" else "8.0-9.x"
            raise ValueError(f"backend={backend!r} needs compute capability {need}; q is on {where}")
        key = _key(backend, dtype, headdim, mask, "", score_mod, headdim_v, dropout, varlen)
        if key not in kernels:
            raise ValueError(f"backend={backend!r}: this build has no {backend} kernel for {_describe(key)}; "
                             f"{_rebuild_hint((backend,), key)}")
        return backend
    usable = tuple(b for b in _AUTO_ORDER if runs_on(b, info.capability))
    for b in usable:
        if _key(b, dtype, headdim, mask, "", score_mod, headdim_v, dropout, varlen) in kernels:
            return b
    if not usable:
        raise ValueError(f"q is on {where}, which no flashhopper kernel family supports "
                         "(sm90 needs 9.0, sm80 needs 8.x-9.x); pass backend='reference'")
    key = _key(usable[0], dtype, headdim, mask, "", score_mod, headdim_v, dropout, varlen)
    raise ValueError(f"q: this build has no {' or '.join(usable)} kernel for {_describe(key)} on {where}; "
                     f"{_rebuild_hint(usable, key)}")


def missing_bwd_kernel(backend: str, dtype: torch.dtype, headdim: int, causal: bool,
                       kernels: Container[KernelKey], *, window: tuple[int, int] | None = None,
                       softcap: float = 0.0, headdim_v: int | None = None, dropout: bool = False,
                       varlen: bool = False) -> str:
    """Pure decision: "" when ``kernels`` (backward kernels) has the backward for this forward
    configuration, otherwise why not and what to rebuild with. The reference needs no kernel."""
    if backend not in ARCH:
        return ""
    key = kernel_key(backend, dtype, headdim, causal, window, softcap=softcap, headdim_v=headdim_v, dropout=dropout,
                     varlen=varlen)
    if key in kernels:
        return ""
    # A fwd-only build (FLASHHOPPER_MODES=fwd) is the likely cause: the hint names both modes, so
    # that following it does not drop the forward kernels.
    return (f"this build has no {backend} backward kernel for {_describe(key)}; "
            f"{_rebuild_hint((backend,), key, modes='fwd;bwd')}, or run the forward under "
            "torch.no_grad() (or on detached inputs) if no gradient is needed")


def require_kernel(mode: str, key: KernelKey) -> _ext.Entry:
    """The compiled ``mode`` kernel for ``key``, or ValueError saying what to rebuild with. For callers
    that name the family themselves (ops.fwd_into / bwd_into, the ops with a resolved backend)."""
    entry = _ext.kernel(mode, key)
    if entry is None:
        backend = next(b for b, a in ARCH.items() if a == key.arch)
        what = "forward" if mode == "fwd" else "backward"
        raise ValueError(f"arch={key.arch}: this build has no {backend} {what} kernel for {_describe(key)}; "
                         f"{_rebuild_hint((backend,), key, modes=None if mode == 'fwd' else 'fwd;bwd')}")
    return entry


class _CompiledKernels:
    """Live view of the build's ``mode`` kernels, so the extension is imported only when a GPU call asks."""

    def __init__(self, mode: str = "fwd") -> None:
        self._mode = mode

    def __contains__(self, key: object) -> bool:
        return isinstance(key, KernelKey) and _ext.has_kernel(self._mode, key)


# Under torch.compile the choice is made once at trace time: its inputs (device, dtype, head dim,
# mask kind) are already guarded, and the device query inside could not be traced.
@torch.compiler.assume_constant_result
def _select_cuda(index: int, dtype: torch.dtype, headdim: int, mask: str, backend: str | None,
                 score_mod: str = "none", headdim_v: int | None = None, dropout: bool = False,
                 varlen: bool = False) -> str:
    return choose_kernel(_device.device_info(index), index, dtype, headdim, mask, backend, _CompiledKernels(),
                         score_mod, headdim_v, dropout, varlen)


# Returns the message rather than raising: under torch.compile, a ValueError raised inside an
# assume_constant_result function surfaces as an internal dynamo error, while one raised by the
# traced caller stays a ValueError (fullgraph=True: an "observed exception" error that quotes it).
# The window travels as its two ints: constant-result arguments are best kept scalars.
@torch.compiler.assume_constant_result
def _missing_bwd_cuda(backend: str, dtype: torch.dtype, headdim: int, causal: bool, window_left: int,
                      window_right: int, score_mod: str = "none", headdim_v: int | None = None,
                      dropout: bool = False, varlen: bool = False) -> str:
    # _CompiledKernels looks _ext up at call time (tests replace _ext.has_kernel). The softcap travels as
    # its score mod: which kernel, not its value.
    return missing_bwd_kernel(backend, dtype, headdim, causal, _CompiledKernels("bwd"),
                              window=(window_left, window_right), softcap=1.0 if score_mod == "softcap" else 0.0,
                              headdim_v=headdim_v, dropout=dropout, varlen=varlen)


def require_bwd_kernel(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, headdim: int,
                       causal: bool, *, window: tuple[int, int] | None = None,
                       sinks: torch.Tensor | None = None, softcap: float = 0.0, dropout: bool = False,
                       varlen: bool = False) -> None:
    """ValueError, at forward time, when autograd will ask ``backend`` for a backward this build lacks:
    grad mode is on and q, k, v (or sinks) requires grad. Better now than after the whole forward graph ran.
    q, k, v as flash_attn_func's (batch, seqlen, nheads, headdim), or a packed batch's (``varlen``)."""
    if backend not in ARCH or not torch.is_grad_enabled():
        return
    left, right = (-1, -1) if window is None else window
    for name, x in (("q", q), ("k", k), ("v", v), ("sinks", sinks)):
        if x is not None and x.requires_grad:
            msg = _missing_bwd_cuda(backend, q.dtype, headdim, causal, left, right, score_mod_of(softcap), v.shape[-1],
                                    dropout, varlen)
            if msg:
                raise ValueError(f"{name} requires grad, but {msg}")
            return


def select_backend(q: torch.Tensor, headdim: int, dtype: torch.dtype, causal: bool,
                   backend: str | None = None, *, window: tuple[int, int] | None = None,
                   softcap: float = 0.0, headdim_v: int | None = None, dropout: bool = False,
                   varlen: bool = False) -> str:
    """Resolve ``backend`` (None = auto) to one of BACKENDS for inputs like ``q`` with this mask
    (``causal`` and ``window``, flash-attn's (left, right), -1 unbounded), softcap and V head dim
    (``headdim_v``, None: ``headdim``), dropout (a kernel with it) and batch layout (``varlen``: packed
    sequences). The public form: checks its arguments, then resolve_backend."""
    validation.check_tensor("q", q)
    if isinstance(headdim, bool) or not isinstance(headdim, int):
        raise TypeError(f"headdim must be an int, got {type(headdim).__name__}")
    if headdim < 1:
        raise ValueError(f"headdim must be positive, got {headdim}")
    if not isinstance(dtype, torch.dtype) or dtype not in validation.REFERENCE_DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(map(str, validation.REFERENCE_DTYPES))}, got {dtype!r}")
    validation.check_flag("causal", causal)
    softcap = validation.check_softcap(softcap)
    if headdim_v is not None and (isinstance(headdim_v, bool) or not isinstance(headdim_v, int) or headdim_v < 1):
        raise ValueError(f"headdim_v must be a positive int or None, got {headdim_v!r}")
    validation.check_flag("dropout", dropout)
    validation.check_flag("varlen", varlen)
    return resolve_backend(q, headdim, dtype, causal, backend, window=window, softcap=softcap, headdim_v=headdim_v,
                           dropout=dropout, varlen=varlen)


def reference_backend(q: torch.Tensor, backend: str | None) -> str:
    """"reference" where a call runs the reference (backend='reference', or None with CPU tensors), "" where a
    CUDA kernel family is to be chosen; a ValueError for an unknown name or a kernel family asked of CPU tensors."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))} or None, got {backend!r}")
    if backend == "reference":
        return "reference"
    if q.device.type != "cuda":
        if backend is None:
            return "reference"
        raise ValueError(f"backend={backend!r} needs CUDA tensors, but q is on {q.device}")
    return ""


def resolve_backend(q: torch.Tensor, headdim: int, dtype: torch.dtype, causal: bool,
                    backend: str | None = None, *, window: tuple[int, int] | None = None,
                    softcap: float = 0.0, headdim_v: int | None = None, dropout: bool = False,
                    varlen: bool = False) -> str:
    """select_backend for arguments an entry point has validated already (flash_attn_func's check_inputs:
    the per-call path does not check q, headdim, dtype and causal twice); ``varlen``: a packed batch's kernel."""
    reference = reference_backend(q, backend)
    window = validation.check_window(window)
    if reference:
        return reference
    return _select_cuda(q.device.index, dtype, headdim, mask_of(causal, window), backend, score_mod_of(softcap),
                        headdim_v, dropout, varlen)


def available_backends(device: torch.device | str | int | None = None) -> list[str]:
    """Backends with at least one compiled forward kernel that runs on ``device`` (default: current
    CUDA device, or none), plus "reference", which runs anywhere."""
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
            raise TypeError(f"device must be a torch.device, str, int or None, got {type(device).__name__}")
        try:
            device = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"device {device!r} is not a device: {e}") from None
    out: list[str] = []
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        cap = _device.device_info(index).capability
        archs = {k["arch"] for k in _ext.compiled_kernels() if k["mode"] == "fwd"}
        out = [b for b in _AUTO_ORDER if ARCH[b] in archs and runs_on(b, cap)]
    return out + ["reference"]
