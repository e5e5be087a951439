"""Which backend runs a call: "sm90" (Hopper kernels), "sm80" (Ampere kernels) or "reference".

Auto (backend=None): CPU tensors -> reference; CUDA capability 9.0 with a compiled arch-90 kernel for
(dtype, headdim, causal) -> sm90; capability 8.x-9.x with an arch-80 kernel -> sm80; anything else
is an error that says what is missing. Never a silent fall back to the slow reference on a GPU.
Gradients run the backward of the family that ran the forward; when they will be needed and that
family has no backward kernel for the configuration, the forward already refuses (require_bwd_kernel).
"""
from __future__ import annotations

from collections.abc import Container

import torch

from . import _device, _ext, validation
from ._device import DeviceInfo

BACKENDS: tuple[str, ...] = ("sm90", "sm80", "reference")
ARCH: dict[str, int] = {"sm90": 90, "sm80": 80}
# Auto-dispatch preference, best first.
_AUTO_ORDER: tuple[str, ...] = ("sm90", "sm80")
_BUILD_DTYPE: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16"}

KernelKey = tuple[int, torch.dtype, int, bool]  # (arch, dtype, headdim, causal)


def runs_on(backend: str, capability: tuple[int, int]) -> bool:
    """Whether a kernel family's code runs on a GPU of this compute capability."""
    if backend == "sm90":
        return capability == (9, 0)  # sm_90a code runs on 9.0 only
    if backend == "sm80":
        return (8, 0) <= capability < (10, 0)  # sm_80 SASS runs on 8.x; the build also has sm_90 SASS
    return False


def _describe(dtype: torch.dtype, headdim: int, causal: bool) -> str:
    return f"{str(dtype).removeprefix('torch.')} headdim {headdim} {'causal' if causal else 'non-causal'}"


def _rebuild_hint(backends: tuple[str, ...], dtype: torch.dtype, headdim: int, modes: str | None = None) -> str:
    archs = ";".join(str(ARCH[b]) for b in backends)
    mode = f" FLASHHOPPER_MODES={modes}" if modes else ""
    hint = (f"rebuild with FLASHHOPPER_ARCHS={archs}{mode} FLASHHOPPER_DTYPES={_BUILD_DTYPE[dtype]} "
            f"FLASHHOPPER_HDIMS={headdim} (or a superset), or pass backend='reference'")
    err = _ext.extension_error()
    return hint + (f"; the compiled extension did not import: {err}" if err else "")


def choose_kernel(info: DeviceInfo, index: int, dtype: torch.dtype, headdim: int, causal: bool,
                  backend: str | None, kernels: Container[KernelKey]) -> str:
    """Pure decision for a CUDA device: the kernel backend to use, or ValueError saying why none."""
    validation.check_kernel_dtype("q", dtype)
    validation.check_kernel_headdim(headdim)
    where = f"cuda:{index} ({info.name}, compute capability {info.capability[0]}.{info.capability[1]})"
    if info.capability < (8, 0):
        raise ValueError(f"q is on {where}; the flashhopper kernels need compute capability 8.0 or newer "
                         "(backend='reference' runs on any device)")
    if backend is not None:
        if not runs_on(backend, info.capability):
            need = "9.0 (Hopper)" if backend == "sm90" else "8.0-9.x"
            raise ValueError(f"backend={backend!r} needs compute capability {need}; q is on {where}")
        if (ARCH[backend], dtype, headdim, causal) not in kernels:
            raise ValueError(f"backend={backend!r}: this build has no {backend} kernel for "
                             f"{_describe(dtype, headdim, causal)}; {_rebuild_hint((backend,), dtype, headdim)}")
        return backend
    usable = tuple(b for b in _AUTO_ORDER if runs_on(b, info.capability))
    for b in usable:
        if (ARCH[b], dtype, headdim, causal) in kernels:
            return b
    if not usable:
        raise ValueError(f"q is on {where}, which no flashhopper kernel family supports "
                         "(sm90 needs 9.0, sm80 needs 8.x-9.x); pass backend='reference'")
    raise ValueError(f"q: this build has no {' or '.join(usable)} kernel for {_describe(dtype, headdim, causal)} "
                     f"on {where}; {_rebuild_hint(usable, dtype, headdim)}")


def missing_bwd_kernel(backend: str, dtype: torch.dtype, headdim: int, causal: bool,
                       kernels: Container[KernelKey]) -> str:
    """Pure decision: "" when ``kernels`` (backward kernels) has the backward for this forward
    configuration, otherwise why not and what to rebuild with. The reference needs no kernel."""
    if backend not in ARCH or (ARCH[backend], dtype, headdim, causal) in kernels:
        return ""
    # A fwd-only build (FLASHHOPPER_MODES=fwd) is the likely cause: the hint names both modes, so
    # that following it does not drop the forward kernels.
    return (f"this build has no {backend} backward kernel for {_describe(dtype, headdim, causal)}; "
            f"{_rebuild_hint((backend,), dtype, headdim, modes='fwd;bwd')}, or run the forward under "
            "torch.no_grad() (or on detached inputs) if no gradient is needed")


class _CompiledKernels:
    """Live view of the kernel set, so the extension is imported only when a GPU call asks."""

    def __init__(self, mode: str = "fwd") -> None:
        self._has = _ext.has_fwd_kernel if mode == "fwd" else _ext.has_bwd_kernel

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and self._has(*key)


# Under torch.compile the choice is made once at trace time: its inputs (device, dtype, head dim,
# causal) are already guarded, and the device query inside could not be traced.
@torch.compiler.assume_constant_result
def _select_cuda(index: int, dtype: torch.dtype, headdim: int, causal: bool, backend: str | None) -> str:
    return choose_kernel(_device.device_info(index), index, dtype, headdim, causal, backend, _CompiledKernels())


# Returns the message rather than raising: under torch.compile, a ValueError raised inside an
# assume_constant_result function surfaces as an internal dynamo error, while one raised by the
# traced caller stays a ValueError (fullgraph=True: an "observed exception" error that quotes it).
@torch.compiler.assume_constant_result
def _missing_bwd_cuda(backend: str, dtype: torch.dtype, headdim: int, causal: bool) -> str:
    # _CompiledKernels looks _ext up at call time (tests replace _ext.has_bwd_kernel).
    return missing_bwd_kernel(backend, dtype, headdim, causal, _CompiledKernels("bwd"))


def require_bwd_kernel(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, headdim: int,
                       causal: bool) -> None:
    """ValueError, at forward time, when autograd will ask ``backend`` for a backward this build lacks:
    grad mode is on and q, k or v requires grad. Better now than after the whole forward graph ran."""
    if backend not in ARCH or not torch.is_grad_enabled():
        return
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.requires_grad:
            msg = _missing_bwd_cuda(backend, q.dtype, headdim, causal)
            if msg:
                raise ValueError(f"{name} requires grad, but {msg}")
            return


def select_backend(q: torch.Tensor, headdim: int, dtype: torch.dtype, causal: bool,
                   backend: str | None = None) -> str:
    """Resolve ``backend`` (None = auto) to one of BACKENDS for inputs like ``q``."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))} or None, got {backend!r}")
    if backend == "reference":
        return "reference"
    if q.device.type != "cuda":
        if backend is None:
            return "reference"
        raise ValueError(f"backend={backend!r} needs CUDA tensors, but q is on {q.device}")
    return _select_cuda(q.device.index, dtype, headdim, causal, backend)


def available_backends(device: torch.device | str | int | None = None) -> list[str]:
    """Backends with at least one compiled kernel that runs on ``device`` (default: current CUDA
    device, or none), plus "reference", which runs anywhere."""
    out: list[str] = []
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        cap = _device.device_info(index).capability
        archs = {k["arch"] for k in _ext.compiled_kernels() if k["mode"] == "fwd"}
        out = [b for b in _AUTO_ORDER if ARCH[b] in archs and runs_on(b, cap)]
    return out + ["reference"]
