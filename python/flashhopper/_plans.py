"""Launch plans, and the eager fast path of calls that repeat a configuration (issue #20).

A ``Launch`` is what a kernel call needs beyond its tensors' pointers: the build's kernel (entry index) and
its params object, filled once. Every launch of the padded forward (16-bit and fp8) and of the quantization
goes through one (``_C.fwd_with`` / ``_C.quantize_fp8_with`` take the pointers beside the params, which they
copy: a Launch is never written after it is made, so threads may share it).

The fast path. A small call's host time is mostly Python (docs/perf-notes.md, issue #20): validation, backend
dispatch, the op dispatcher (22 us on the H200's host), the params fill (15 us). None of it depends on more than
the call's metadata. So the entry points keep a ``Plans`` cache from a call key (every property their validation
reads: the tensors' dtypes, devices, shapes and strides, the scalar arguments and their types, since
True == 1 == 1.0) to the Launch that the first such call made, after it passed every check on the full path.
A later call with that key allocates its outputs and launches, and nothing else. Whatever the fast path cannot
vouch for goes the full way, which validates and raises: the fast path raises no error of its own.

It is taken only where the op's dispatch would add nothing (``direct``): eager (no torch.compile or jit trace),
autocast off, no torch function or dispatch mode, no functorch transform, plain ``torch.Tensor`` inputs; and,
for the differentiable entry point, no autograd to record (``needs_grad``). Per call it checks the one layout property metadata cannot show, the
16-byte alignment of the data pointers (TMA). The kernel table and device properties are fixed for a process,
so a Launch does not go stale; ``clear()`` empties every cache (tests that fake the build).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import _ext, _launch
from .validation import TMA_ALIGN_BYTES


class Launch(NamedTuple):
    """A prepared kernel call: ``params`` (``_C.FwdParams`` or ``_C.QuantParams``) filled but for the pointers,
    the forward's kernel ``index`` in the build's table, whether it takes a tile ``counter``, and the device."""

    params: Any
    index: int
    counter: bool
    device: torch.device

    def fwd(self, q: int, k: int, v: int, out: int, lse: int, sinks: int = 0, dropout_rng: int = 0, q_scale: int = 0,
            k_scale: int = 0, v_scale: int = 0) -> int:
        """Launch the forward on these addresses (``data_ptr()``s; 0: none; ``*_scale``: the fp8 descales);
        returns the CTAs launched."""
        stream = _launch.stream(self.device)
        counter = _launch.tile_counter(self.device, stream).data_ptr() if self.counter else 0
        return int(_ext.extension().fwd_with(self.params, self.index, stream, q, k, v, out, lse, counter, sinks,
                                             dropout_rng, q_scale, k_scale, v_scale))

    def quantize(self, x: int, out: int, scale: int) -> int:
        """Launch the quantization of the address ``x`` into ``out`` and ``scale``; returns the CTAs launched."""
        return int(_ext.extension().quantize_fp8_with(self.params, _launch.stream(self.device), x, out, scale))


class Plans:
    """A bounded cache from call keys to what the fast path runs: a Launch, or a plan of several
    (fp8.attention.QuantizingPlan)."""

    LIMIT = 256  # configurations per entry point; past it the oldest goes (a model has a handful)

    def __init__(self) -> None:
        self._d: dict[Any, Any] = {}
        _all.append(self)

    def get(self, key: Any) -> Any:
        try:
            return self._d.get(key)
        except TypeError:  # an unhashable argument: the full path names what is wrong with it
            return None

    def put(self, key: Any, value: Any) -> None:
        if len(self._d) >= self.LIMIT:
            try:
                del self._d[next(iter(self._d))]
            except (KeyError, RuntimeError, StopIteration):  # another thread evicted or inserted meanwhile
                pass
        try:
            self._d[key] = value
        except TypeError:
            pass

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


_all: list[Plans] = []


def clear() -> None:
    """Forget every plan (tests that replace the extension or the device properties call it)."""
    for p in _all:
        p.clear()


def direct() -> bool:
    """Whether an eager call may skip the op dispatcher: nothing that hooks into it is active (a torch.compile
    or torch.jit trace, which must record the op; autocast; a torch function or dispatch mode; a functorch
    transform). The inputs' own types (plain ``torch.Tensor``) and grad are the caller's to check."""
    return not (torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None
                or torch.is_autocast_enabled() or torch._C._is_torch_function_mode_enabled()
                or torch._C._len_torch_dispatch_stack() or torch._C._functorch.peek_interpreter_stack() is not None)


def meta(x: torch.Tensor) -> Any:
    """What validation reads of a plain tensor: shape, strides, dtype, device (-1: CPU). A tensor whose
    ``data_ptr()`` does not hold its values as laid out (a lazily negated view, which only the op dispatcher
    materializes; a non-strided layout) gets an unhashable part instead, so that every key holding it misses
    (``Plans.get`` / ``put``) and the call takes the full path. (Conjugate views are complex: validation refuses
    them. Callers ask ``direct()`` first: under torch.compile, dynamo does not trace these flags.)"""
    if x.layout != torch.strided or x.is_neg():
        return [x.layout]
    return x.shape, x.stride(), x.dtype, x.get_device()


def scalars(*args: Any) -> tuple[Any, ...]:
    """Scalar arguments for a call key, with their types: True == 1 == 1.0, but a bool is no scale."""
    return args, tuple(map(type, args))


def pointers(*xs: torch.Tensor) -> tuple[int, ...] | None:
    """The data pointers of ``xs`` when all are 16-byte aligned (TMA), else None (the full path says which one
    is not)."""
    ptrs = tuple(x.data_ptr() for x in xs)
    bits = 0
    for p in ptrs:
        bits |= p
    return None if bits % TMA_ALIGN_BYTES else ptrs


def needs_grad(*xs: torch.Tensor | None) -> bool:
    """Whether autograd would record the call: grad mode is on and an input requires grad."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)
