"""CUDA autocast, as for ``torch.nn.functional.scaled_dot_product_attention`` (on autocast's lower-precision
list): under ``torch.autocast("cuda")``, the floating CUDA inputs run in the autocast dtype
(``torch.get_autocast_dtype("cuda")``, read at call time). Autocast's own rule, plus fp8: a tensor is cast
when it is floating, on CUDA, and neither float64 (autocast leaves it) nor fp8 (data whose scales travel
beside it). CPU tensors are never cast (CUDA autocast does not apply to them, as for SDPA), nor is anything
when autocast is off.

Two places apply it. The public functions cast first, before validation and dispatch, which pick the
kernel by dtype (``enabled`` is their one check when autocast is off). The ops' AutocastCUDA kernels
(``register``) cast the inputs each op names and run it below autocast, so that ``torch.ops.flashhopper.*``
called directly behaves the same, and an op's body (the reference's float32 matmuls on the GPU) never
runs under autocast. The Autocast key is dispatched to only while autocast is on and a CUDA tensor is
among the arguments: with autocast off the ops cost nothing more. Autocast's cast is differentiable:
a float32 leaf gets a float32 gradient.
"""
from __future__ import annotations

from typing import Any

import torch

# What autocast casts: floating, but not float64 (autocast's rule) and not fp8.
CASTABLE: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
_KEY = torch._C.DispatchKey.AutocastCUDA

# Whether CUDA autocast is on. Without an argument the function answers for CUDA; with "cuda" it parses
# the device name on every call, twice the host time (it is the one check of a call without autocast).
enabled = torch.is_autocast_enabled


def cast(*xs: Any) -> tuple[Any, ...]:
    """``xs`` with each castable CUDA tensor in CUDA autocast's dtype; anything else (a CPU tensor, an
    FP8Tensor, a bad argument left for validation to name) as is. For callers that checked ``enabled()``."""
    dtype = torch.get_autocast_dtype("cuda")
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in CASTABLE else x
                 for x in xs)


def register(lib: torch.library.Library, name: str, castable: tuple[str, ...]) -> None:
    """The AutocastCUDA kernel of ``flashhopper::<name>``: cast the arguments named ``castable`` (the
    activations; never scales or lse, which are float32 by contract), then run the op with autocast
    excluded. torch.library.register_autocast's pattern, with the dtype read at call time instead of
    fixed at registration, and only the named arguments cast."""
    op = getattr(torch.ops.flashhopper, name).default
    names = [a.name for a in op._schema.arguments]
    positions = frozenset(names.index(n) for n in castable)  # ValueError at import for a name not in the schema

    def kernel(*args: Any, **kwargs: Any) -> Any:  # the schema's positional arguments, in order
        if positions:
            args = tuple(cast(a)[0] if i in positions else a for i, a in enumerate(args))
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
            return op(*args, **kwargs)

    lib.impl(name, kernel, "AutocastCUDA")
