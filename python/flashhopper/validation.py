"""Input checks. Each is a small pure function that raises TypeError/ValueError whose message
starts with the name of the offending argument, before any kernel runs.

Two groups, because they can run at different times:
- shape-level checks (``check_inputs``, ``check_window``, ``check_kernel_dtype``, ``check_kernel_headdim``)
  read only metadata, so they also run while torch.compile traces with fake tensors;
- memory-layout checks (``check_kernel_layout``) read data pointers, so they run where the kernel
  is launched (see ops.py).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import torch

from .kernel_key import HEADDIM_PAIRS, HEADDIMS

KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
# The reference computes in float32/float64 whatever the input, so it takes these too.
REFERENCE_DTYPES: tuple[torch.dtype, ...] = KERNEL_DTYPES + (torch.float32, torch.float64)
KERNEL_HEADDIMS: tuple[int, ...] = HEADDIMS
# TMA: global addresses and every non-innermost stride must be multiples of 16 bytes.
TMA_ALIGN_BYTES = 16


class Shapes(NamedTuple):
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads_q: int
    nheads_kv: int
    headdim: int    # of q and k
    headdim_v: int  # of v and out


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, x: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_rank(name: str, x: torch.Tensor, rank: int = 4) -> None:
    if x.dim() != rank:
        raise ValueError(
            f"{name} must have {rank} dimensions (batch, seqlen, nheads, headdim), got shape {tuple(x.shape)}")


def check_dtype(name: str, x: torch.Tensor, allowed: tuple[torch.dtype, ...] = REFERENCE_DTYPES) -> None:
    if x.dtype not in allowed:
        raise TypeError(f"{name} has dtype {x.dtype}; supported: {_names(allowed)}")


def check_same_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but q has {q.dtype}; q, k and v must share one dtype")


def check_same_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; q, k and v must share one device")


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_headdim_of_its_own: bool = False) -> Shapes:
    """Shapes of (batch, seqlen_q, nheads_q, headdim) q and (batch, seqlen_k, nheads_kv, headdim) k/v;
    with ``v_headdim_of_its_own`` v's last dim may differ (out then has v's)."""
    b, sq, hq, d = q.shape
    _, sk, hkv, _ = k.shape
    if k.shape[0] != b:
        raise ValueError(f"k batch size {k.shape[0]} does not match q batch size {b}")
    if k.shape[3] != d:
        raise ValueError(f"k head dim {k.shape[3]} does not match q head dim {d}")
    if d < 1:
        raise ValueError(f"q head dim must be positive, got shape {tuple(q.shape)}")
    if v_headdim_of_its_own:
        if v.shape[:3] != k.shape[:3] or v.shape[3] < 1:
            raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)} but for the head dim "
                             "(positive)")
    elif v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    if (hkv == 0 and hq != 0) or (hkv > 0 and hq % hkv != 0):
        raise ValueError(f"q nheads {hq} must be a multiple of k/v nheads {hkv} (grouped-query attention)")
    return Shapes(b, sq, sk, hq, hkv, d, v.shape[3])


def check_softmax_scale(softmax_scale: Any) -> float:
    # bool is an int subclass; True as a scale is a bug, not a number.
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    s = float(softmax_scale)
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"softmax_scale must be a positive finite float, got {s}")
    return s


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_inputs(q: Any, k: Any, v: Any, softmax_scale: Any, causal: Any) -> tuple[Shapes, float]:
    """Checks shared by every backend; returns the shapes and the scale (default 1/sqrt(headdim))."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x)
        check_rank(name, x)
        check_dtype(name, x)
    # Devices first: under CUDA autocast only the CUDA ones were cast, and the device is the mistake.
    check_same_device(q, k, v)
    check_same_dtype(q, k, v)
    shapes = check_shapes(q, k, v, v_headdim_of_its_own=True)
    scale = 1.0 / math.sqrt(shapes.headdim) if softmax_scale is None else check_softmax_scale(softmax_scale)
    check_flag("causal", causal)
    return shapes, scale


def check_window(window: Any) -> tuple[int, int] | None:
    """None, or flash-attn's local window (left, right): row i sees key j iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, each edge -1 = unbounded.
    Returns it as a tuple of Python ints."""
    if window is None:
        return None
    if (not isinstance(window, tuple) or len(window) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) for w in window)):
        raise TypeError(f"window must be None or a tuple of two ints (left, right), got {window!r}")
    return check_window_named("window", window)


def check_window_size(window_size: Any) -> tuple[int, int] | None:
    """flash-attn's ``window_size`` argument: a pair (left, right) of ints (a list is taken too), each -1
    for unbounded or >= 0; (-1, -1) is no window. Returns None for no window, else the tuple."""
    if window_size == (-1, -1) and type(window_size) is tuple:  # the default, on every call: no checks to make
        return None
    if isinstance(window_size, list):
        window_size = tuple(window_size)
    if (not isinstance(window_size, tuple) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded, got {window_size!r}")
    window = check_window_named("window_size", window_size)
    return None if window == (-1, -1) else window


def check_window_named(name: str, window: tuple[Any, Any]) -> tuple[int, int]:
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"{name} must be (left, right) with each edge >= 0, or -1 for unbounded, got {window}")
    return left, right


def check_softcap(softcap: Any) -> float:
    """Gemma 2's logit softcap: 0 (off) or a positive finite float c; scores become c * tanh(scores / c)."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    c = float(softcap)
    if not (math.isfinite(c) and c >= 0):
        raise ValueError(f"softcap must be 0 (off) or a positive finite float, got {c}")
    return c


def check_dropout_p(dropout_p: Any) -> float:
    """Attention dropout's probability: a float in [0, 1] (0: off; flashhopper.dropout rounds it to 1/256)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"dropout_p must be in [0, 1], got {p}")
    return p


def check_generator(generator: Any, q: torch.Tensor) -> None:
    """Dropout's random source: None (the device's default generator) or a torch.Generator of q's device type."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != q.device.type:
        raise ValueError(f"generator is on {generator.device} but q is on {q.device}: dropout draws its seed "
                         "on q's device")


def check_dropout_rng(rng: Any, q: torch.Tensor) -> None:
    """A call's dropout state (flashhopper.dropout.new_rng_state): int64 (2,) on q's device."""
    check_tensor("dropout_rng", rng)
    if rng.dtype != torch.int64 or rng.shape != (2,) or rng.device != q.device:
        raise ValueError(f"dropout_rng must be an int64 tensor of shape (2,) (seed, offset) on {q.device}, got "
                         f"{rng.dtype} {tuple(rng.shape)} on {rng.device}")


def check_sinks(sinks: Any, q: torch.Tensor) -> None:
    """Learnable sink logits: None, or a float32 tensor of shape (nheads_q,) on q's device."""
    if sinks is None:
        return
    check_tensor("sinks", sinks)
    hq = q.shape[2]
    if sinks.dtype != torch.float32:
        raise TypeError(f"sinks has dtype {sinks.dtype}; it must be float32 (one logit per query head)")
    if sinks.shape != (hq,):
        raise ValueError(f"sinks must have shape ({hq},) (one logit per query head), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")


def check_max_smem_bytes(max_smem_bytes: Any) -> None:
    if not isinstance(max_smem_bytes, int) or isinstance(max_smem_bytes, bool) or max_smem_bytes < 0:
        raise ValueError(f"max_smem_bytes must be a non-negative int, got {max_smem_bytes!r}")


def check_variant(variant: Any) -> None:
    """A kernel variant's name ("" in production; the build lists the others)."""
    if not isinstance(variant, str):
        raise TypeError(f"variant must be a str, got {type(variant).__name__}")


def check_arch(arch: Any, archs: tuple[int, ...]) -> None:
    """A kernel family by its arch number (90, 80)."""
    if isinstance(arch, bool) or not isinstance(arch, int) or arch not in archs:
        raise ValueError(f"arch must be one of {', '.join(map(str, archs))}, got {arch!r}")


def check_kernel_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in KERNEL_DTYPES:
        raise TypeError(
            f"{name} has dtype {dtype}; the flashhopper kernels take {_names(KERNEL_DTYPES)} "
            "(backend='reference' also takes float32/float64)")


def check_kernel_headdim(headdim: int, headdim_v: int | None = None) -> None:
    """Q/K's head dim (and V's, where it differs) is one the kernels have."""
    if headdim_v is None or headdim_v == headdim:
        if headdim not in KERNEL_HEADDIMS:
            raise ValueError(
                f"q head dim {headdim} is not supported by the flashhopper kernels "
                f"(supported: {', '.join(map(str, KERNEL_HEADDIMS))}); backend='reference' takes any head dim")
    elif (headdim, headdim_v) not in HEADDIM_PAIRS:
        raise ValueError(
            f"q/k head dim {headdim} with v head dim {headdim_v} is not supported by the flashhopper kernels "
            f"(supported: equal head dims, and {', '.join(f'{a}/{b}' for a, b in HEADDIM_PAIRS)}); "
            "backend='reference' takes any head dims")


def kernel_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements, as handed to the kernel.

    A dimension of size 1 is never stepped over, so its stride is arbitrary in PyTorch (views can
    leave odd values there); replace it by the packed one so that it cannot fail the TMA check. An
    empty dimension inside counts as one for that (its tensor has no element to address).
    """
    _, s, h, d = x.shape
    sb, ss, sh, _ = x.stride()
    if h == 1:
        sh = d
    if s == 1:
        ss = max(h, 1) * sh
    if x.shape[0] == 1:
        sb = max(s, 1) * ss
    return sb, ss, sh


def check_last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    if x.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dimension (stride 1), got strides {tuple(x.stride())}; "
            "call .contiguous()")


def check_alignment(name: str, x: torch.Tensor) -> None:
    """TMA: data pointer and batch/row/head strides in bytes must be multiples of 16."""
    es = x.element_size()
    if x.data_ptr() % TMA_ALIGN_BYTES:
        raise ValueError(
            f"{name} data pointer {x.data_ptr():#x} is not {TMA_ALIGN_BYTES}-byte aligned "
            "(a view at an odd offset?); the kernels load through TMA, which needs it: call .clone() "
            "(.contiguous() keeps a contiguous view where it is)")
    for what, stride in zip(("batch", "row", "head"), kernel_strides(x)):
        if stride == 0:  # size-1 dims were normalized above, so this one is broadcast
            raise ValueError(
                f"{name} is broadcast along its {what} dimension (stride 0); the kernels need real memory "
                "there: call .contiguous()")
        if (stride * es) % TMA_ALIGN_BYTES:
            raise ValueError(
                f"{name} {what} stride {stride} ({stride * es} bytes) is not a multiple of {TMA_ALIGN_BYTES} bytes; "
                "the kernels load through TMA, which needs it: call .contiguous()")


def check_kernel_layout(name: str, x: torch.Tensor) -> None:
    check_last_dim_contiguous(name, x)
    check_alignment(name, x)


def check_lse(name: str, lse: Any, q: torch.Tensor) -> None:
    """An LSE-shaped tensor (the forward's lse, or dlse): float32, contiguous (batch, nheads_q, seqlen_q)."""
    check_tensor(name, lse)
    b, sq, hq, _ = q.shape
    if lse.shape != (b, hq, sq) or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(
            f"{name} must be float32 of shape {(b, hq, sq)} on {q.device}, "
            f"got {tuple(lse.shape)} {lse.dtype} {lse.device}")
    if not lse.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(lse.stride())}")


def check_like(name: str, x: Any, like_name: str, like: torch.Tensor) -> None:
    """``x`` is a tensor of exactly the shape, dtype and device of ``like`` (strides may differ)."""
    check_tensor(name, x)
    if x.shape != like.shape or x.dtype != like.dtype or x.device != like.device:
        raise ValueError(
            f"{name} must match {like_name} in shape, dtype and device: got {tuple(x.shape)} {x.dtype} {x.device}, "
            f"{like_name} is {tuple(like.shape)} {like.dtype} {like.device}")


def check_outputs(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, v: torch.Tensor | None = None) -> None:
    """Caller-provided out (like q, with v's head dim) and lse (float32, contiguous (batch, nheads_q, seqlen_q))."""
    if v is None or v.shape[3] == q.shape[3]:
        check_like("out", out, "q", q)
    else:
        check_tensor("out", out)
        want = (*q.shape[:3], v.shape[3])
        if tuple(out.shape) != want or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must be {want} (q's shape with v's head dim) {q.dtype} {q.device}: got "
                             f"{tuple(out.shape)} {out.dtype} {out.device}")
    check_lse("lse", lse, q)


def check_dout(dout: Any, out: torch.Tensor) -> None:
    """The gradient of the loss w.r.t. the forward's output: a rank-4 tensor like out."""
    check_tensor("dout", dout)
    check_rank("dout", dout)
    check_like("dout", dout, "out", out)


def check_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dq: Any, dk: Any, dv: Any) -> None:
    """Caller-provided gradients, each like its input (shape, dtype, device)."""
    for name, g, like_name, like in (("dq", dq, "q", q), ("dk", dk, "k", k), ("dv", dv, "v", v)):
        check_like(name, g, like_name, like)


def kernel_layout_ok(x: torch.Tensor) -> bool:
    """check_kernel_layout from metadata alone (strides and storage offset, no data pointer), so that
    it also answers for the fake tensors of a torch.compile trace. Assumes the storage itself is
    16-byte aligned (the caching allocator aligns far more); the launch still checks the real pointer."""
    es = x.element_size()
    return (x.dim() == 4 and x.stride(-1) == 1 and (x.storage_offset() * es) % TMA_ALIGN_BYTES == 0
            and all(s != 0 and (s * es) % TMA_ALIGN_BYTES == 0 for s in kernel_strides(x)))


# --- packed batches (flash_attn_varlen_func) ---

def check_varlen_inputs(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                        max_seqlen_k: Any, seqused_q: Any, seqused_k: Any, softmax_scale: Any,
                        causal: Any) -> tuple[Shapes, float]:
    """Checks of a packed batch: q (total_q, nheads_q, headdim), k/v (total_k, nheads_kv, headdim), cu_seqlens
    int32 (batch + 1,) and seqused int32 (batch,) or None on q's device, max_seqlen Python ints. Returns the
    shapes of the (1, total, nheads, headdim) views (batch: the number of sequences) and the scale. Metadata
    only: what would need the values (monotonic cu_seqlens, lengths within the tensors and max_seqlen) is
    check_varlen_values' job (always on CPU tensors, on CUDA ones under FLASHHOPPER_DEBUG_VARLEN=1)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x)
        if x.dim() != 3:
            raise ValueError(f"{name} must have 3 dimensions (total_tokens, nheads, headdim) in a packed batch, "
                             f"got shape {tuple(x.shape)}")
    shapes, scale = check_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale, causal)
    batch = check_varlen_bounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, q.device)
    return shapes._replace(batch=batch, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k), scale


def check_cu_seqlens(name: str, cu: Any, device: torch.device) -> None:
    """flash-attn's cu_seqlens: int32 (batch + 1,) on ``device`` (the values are check_varlen_values' job)."""
    check_tensor(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {cu.dtype}; it must be torch.int32 (flash-attn's cu_seqlens)")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must have shape (batch + 1,), got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")


def check_varlen_bounds(cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any, seqused_q: Any,
                        seqused_k: Any, device: torch.device) -> int:
    """The sequence bounds of a packed batch (check_varlen_inputs' arguments of the same names); returns batch."""
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, device)
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] - 1 != batch:
        raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.shape[0]} entries but cu_seqlens_q has {batch + 1}: "
                         "one batch")
    for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if used is None:
            continue
        check_tensor(name, used)
        if used.dtype != torch.int32:
            raise TypeError(f"{name} has dtype {used.dtype}; it must be torch.int32")
        if used.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},) (one length per sequence), got {tuple(used.shape)}")
        if used.device != device:
            raise ValueError(f"{name} is on {used.device} but q is on {device}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"{name} must be a Python int (the longest sequence), got {type(m).__name__}")
        if m < 0:
            raise ValueError(f"{name} must be >= 0, got {m}")
    return batch


def check_varlen_values(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                        max_seqlen_q: int, max_seqlen_k: int, seqused_q: torch.Tensor | None,
                        seqused_k: torch.Tensor | None) -> None:
    """What check_varlen_inputs cannot see without copying the values to the host (for CUDA tensors a
    synchronization, so only on request: FLASHHOPPER_DEBUG_VARLEN=1; CPU tensors always): cu_seqlens
    non-decreasing from >= 0 and within the tensors, seqused within its slot, and the lengths within max_seqlen."""
    for tag, cu, used, total, longest in (("q", cu_seqlens_q, seqused_q, q.shape[0], max_seqlen_q),
                                          ("k", cu_seqlens_k, seqused_k, k.shape[0], max_seqlen_k)):
        c = cu.tolist()
        if c[0] < 0 or any(b < a for a, b in zip(c, c[1:])) or c[-1] > total:
            raise ValueError(f"cu_seqlens_{tag} must be non-decreasing from >= 0 up to at most {total} (the "
                             f"packed {tag}'s tokens), got {c}")
        lengths = [b - a for a, b in zip(c, c[1:])]
        if used is not None:
            u = used.tolist()
            if any(x < 0 or x > slot for x, slot in zip(u, lengths)):
                raise ValueError(f"seqused_{tag} must lie within each sequence's slot (0 ..{lengths}), got {u}")
            lengths = u
        if lengths and max(lengths) > longest:
            raise ValueError(f"max_seqlen_{tag} is {longest} but a sequence has {max(lengths)} tokens")
