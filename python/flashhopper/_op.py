"""The package's torch ops (``torch.ops.flashhopper.*``), defined straight on the dispatcher.

``torch.library.custom_op`` wraps every call in Python layers of its own (an autograd wrapper even for
ops without a gradient, an output-alias check): about 15-20 us a call, as much as the rest of a
small-shape call's host path. Defined with ``torch.library.Library`` instead, a call goes from the
dispatcher to the implementation; fake implementations (torch.compile) and autograd formulas register
with ``torch.library.register_fake`` / ``register_autograd`` as for any op. Every op also gets an
AutocastCUDA kernel (``_autocast.register``): it says which of its inputs autocast casts.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _autocast

_lib = torch.library.Library("flashhopper", "FRAGMENT")


def define(name: str, cuda: Callable[..., Any], cpu: Callable[..., Any] | None = None, *,
           autocast: tuple[str, ...], mutates_args: tuple[str, ...] = ()) -> Any:
    """Define ``flashhopper::<name>`` with the schema of ``cuda``'s annotations (the inputs named in
    ``mutates_args`` written in place, none by default: e.g. a KV cache appended to), its CUDA implementation
    ``cuda`` and CPU implementation ``cpu`` (default: the same function), and its AutocastCUDA kernel, which
    casts the inputs named in ``autocast`` (may be none; never a mutated one: the cast would be a copy);
    returns the op's default overload."""
    if set(autocast) & set(mutates_args):
        raise ValueError(f"{name}: mutated inputs cannot be cast by autocast: {sorted(set(autocast) & set(mutates_args))}")
    _lib.define(name + torch.library.infer_schema(cuda, mutates_args=mutates_args))
    _lib.impl(name, cuda, "CUDA")
    _lib.impl(name, cuda if cpu is None else cpu, "CPU")
    _autocast.register(_lib, name, autocast)
    return getattr(torch.ops.flashhopper, name).default
