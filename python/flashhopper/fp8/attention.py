"""fp8 (e4m3) attention, forward only: ``flash_attn_fp8_func`` (bf16/fp16 or FP8Tensor in, quantized as
needed, bf16 out) and ``fwd_fp8_into`` (quantized inputs, caller-provided outputs: the test entry).

Both validate everything at shape level first. The work runs in the ops of fp8/ops.py: the kernels on
CUDA (never a fall back to the emulation on a GPU: no compiled kernel is an error), the reference
emulation on CPU. So ``torch.compile(flash_attn_fp8_func, fullgraph=True)`` traces it without a graph
break, and a CUDA-graph capture may hold its very first call.
"""
from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple, overload

import torch

from .. import _autocast, _plans, validation
from .._plans import Launch
from ..validation import Shapes
from . import ops
from .format import FP8Tensor, check_fp8_tensor, check_int, check_seed, round_up, seed_int64, to_vt
from .quantize import default_kv_block_size, quantize_fp8
from .validation import (Q_BLOCK, Q_WHY, check_aligned, check_fp8_inputs, check_input, check_input_alignment,
                         check_not_transposed, check_tile_alignment, kv_why, qk_seed, quant_kernel_takes)


def require_kernel(device: torch.device, headdim: int, causal: bool) -> tuple[int, int]:
    """(block_m, block_n) of the fp8 kernel that runs on CUDA ``device``, or ValueError saying what to rebuild."""
    problem = ops.device_problem(device.index)
    if problem:
        raise ValueError(f"q is on {problem} (CPU tensors run the reference emulation)")
    tiles = ops.kernel_tiles(headdim, causal)
    if tiles is None:
        raise ValueError(f"q: {ops.missing_kernel(headdim, causal)}")
    return tiles


def _kernel_tiles(device: torch.device, headdim: int, causal: bool) -> tuple[int, int] | None:
    """The tiles of the kernel that will run, None for the reference emulation (CPU)."""
    return require_kernel(device, headdim, causal) if device.type == "cuda" else None


def _matching_kv_block(given: int, headdim: int, tiles: tuple[int, int] | None, short_n: int) -> int:
    """The block for K or V quantized here beside a pre-quantized one in blocks of ``given`` keys: ``given`` where
    the quantization kernel takes it, else the block_n of a tile that divides it (K and V must be multiples of one)."""
    if tiles is None or quant_kernel_takes(given, headdim):
        return given
    return next((n for n in (tiles[1], short_n) if n and given % n == 0), given)


def _short_n(headdim: int, causal: bool) -> int:
    """block_n of the short-key tile beside the padded kernel (0: none): K/V blocks of its multiples run too."""
    short = ops.short_keys(headdim, causal)
    return 0 if short is None else short[0]


def _softmax_scale(softmax_scale: Any, headdim: int) -> float:
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else validation.check_softmax_scale(softmax_scale)


def fwd_fp8_into(q8: FP8Tensor, k8: FP8Tensor, v8: FP8Tensor, out: torch.Tensor, lse: torch.Tensor,
                 softmax_scale: float | None, causal: bool) -> int:
    """Run the fp8 forward kernel, writing into caller-provided ``out`` (bfloat16 (batch, seqlen_q,
    nheads_q, headdim)) and ``lse`` (float32, contiguous (batch, nheads_q, seqlen_q)); a row-major v8 is
    brought to V^T first (``to_vt``, a copy). Checks everything first; tests use it to poison the outputs
    before a run. Returns the CTAs launched (0: an empty grid, nothing to compute)."""
    validation.check_flag("causal", causal)
    check_fp8_tensor("q", q8)
    if q8.device.type != "cuda":
        raise ValueError(f"q is on {q8.device}; the fp8 kernels need CUDA tensors")
    tiles = require_kernel(q8.device, q8.headdim, causal)
    if isinstance(v8, FP8Tensor) and v8.transposed is False:
        v8 = to_vt(v8)
    shapes = check_fp8_inputs(q8, k8, v8, tiles, _short_n(q8.headdim, causal))
    scale = _softmax_scale(softmax_scale, shapes.headdim)
    validation.check_tensor("out", out)
    want = (shapes.batch, shapes.seqlen_q, shapes.nheads_q, shapes.headdim)
    if tuple(out.shape) != want or out.dtype != torch.bfloat16 or out.device != q8.device:
        raise ValueError(f"out must be bfloat16 of shape {want} on {q8.device}, "
                         f"got {tuple(out.shape)} {out.dtype} {out.device}")
    validation.check_lse("lse", lse, out)
    return ops.launch_fwd(q8, k8, v8, out, lse, scale, causal)


@overload
def flash_attn_fp8_func(q: torch.Tensor | FP8Tensor, k: torch.Tensor | FP8Tensor, v: torch.Tensor | FP8Tensor,
                        softmax_scale: float | None = ..., causal: bool = ..., return_lse: Literal[False] = ...,
                        hadamard: bool = ..., seed: int = ..., q_block_size: int | None = ...,
                        kv_block_size: int | None = ...) -> torch.Tensor: ...


@overload
def flash_attn_fp8_func(q: torch.Tensor | FP8Tensor, k: torch.Tensor | FP8Tensor, v: torch.Tensor | FP8Tensor,
                        softmax_scale: float | None = ..., causal: bool = ..., *, return_lse: Literal[True],
                        hadamard: bool = ..., seed: int = ..., q_block_size: int | None = ...,
                        kv_block_size: int | None = ...) -> tuple[torch.Tensor, torch.Tensor]: ...


def flash_attn_fp8_func(q: torch.Tensor | FP8Tensor, k: torch.Tensor | FP8Tensor, v: torch.Tensor | FP8Tensor,
                        softmax_scale: float | None = None, causal: bool = False, return_lse: bool = False,
                        hadamard: bool = True, seed: int = 0, q_block_size: int | None = None,
                        kv_block_size: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with fp8 (e4m3) Q, K, V; flash-attn layout, forward only.

    Each of q (batch, seqlen_q, nheads_q, headdim), k, v (batch, seqlen_k, nheads_kv, headdim) is a
    bf16/fp16 tensor, quantized here, or an FP8Tensor (``quantize_fp8``; a row-major v is brought to
    V^T, the layout the kernels read, by ``to_vt``).
    Quantized here: Q in blocks of ``q_block_size`` (default 64) tokens, K and V of ``kv_block_size``
    (default the block_n of the tile the call runs: ``default_kv_block_size(headdim, causal, seqlen_k)``, or a
    pre-quantized k's or v's block); Q and K with the Hadamard signs of ``seed`` when ``hadamard``. When
    k (or q) is an FP8Tensor, the other is quantized with its hadamard_seed instead, so that bf16
    queries can attend to a pre-quantized K/V; two FP8Tensors must carry the same seed.
    softmax_scale defaults to 1/sqrt(headdim); causal is bottom-right aligned, as in flash_attn_func.

    CUDA tensors run the fp8 kernel (ValueError when this build has none for the configuration); CPU
    tensors run ``reference_fp8.attention_fp8_ref``, both through the op ``flashhopper::fwd_fp8``.
    Returns out (bfloat16 (batch, seqlen_q, nheads_q, headdim)), or (out, lse) with lse float32
    (batch, nheads_q, seqlen_q), natural log.

    Autocast, as far as fp8 allows SDPA's behaviour: under ``torch.autocast("cuda")``, tensor inputs on
    CUDA that are float32, float16 or bfloat16 are cast to the autocast dtype before anything else, then
    quantized from it; FP8Tensors are left as they are, and out stays bfloat16 (the kernel's output,
    whatever the inputs' dtype). CPU tensors are never cast.
    """
    key = _call_key(q, k, v, softmax_scale, causal, return_lse, hadamard, seed, q_block_size, kv_block_size)
    if key is not None:  # a configuration that passed everything below before (_plans)
        plan = _PLANS.get(key)
        ptrs = None if plan is None else _plans.pointers(*(x.data if type(x) is FP8Tensor else x  # type: ignore[union-attr]
                                                           for x in (q, k, v)))
        if ptrs is not None:
            return plan((q, k, v), ptrs, return_lse)
    with torch.no_grad():  # nothing here is differentiable; quantizing an input that requires grad is fine
        return _fp8_attention(q, k, v, softmax_scale, causal, return_lse, hadamard, seed, q_block_size, kv_block_size,
                              key)


def _fp8_attention(q: torch.Tensor | FP8Tensor, k: torch.Tensor | FP8Tensor, v: torch.Tensor | FP8Tensor,
                   softmax_scale: float | None, causal: bool, return_lse: bool, hadamard: bool, seed: int,
                   q_block_size: int | None, kv_block_size: int | None,
                   key: tuple[Any, ...] | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_fp8_func's full path: validation, quantization, the op; ``key``: the call key under which a
    pre-quantized call's Launch is kept (None: none)."""
    if _autocast.enabled():
        q, k, v = _autocast.cast(q, k, v)
    validation.check_flag("causal", causal)
    validation.check_flag("return_lse", return_lse)
    validation.check_flag("hadamard", hadamard)
    check_seed("seed", seed)
    if isinstance(q, FP8Tensor) and isinstance(k, FP8Tensor) and isinstance(v, FP8Tensor):
        # Nothing to quantize (the inference path: a small call's host time is its cost): one pass of checks.
        for name, bs in (("q_block_size", q_block_size), ("kv_block_size", kv_block_size)):
            if bs is not None:
                raise ValueError(f"{name} sets the block size of tensors quantized here, but q, k and v are "
                                 "already FP8Tensor")
        v8 = v if v.transposed is True else to_vt(v)  # to_vt checks v
        shapes = check_fp8_inputs(q, k, v8)
        tiles = _kernel_tiles(q.device, shapes.headdim, causal)
        if tiles is not None:
            check_tile_alignment(q, k, v8, tiles, _short_n(shapes.headdim, causal))
        scale = _softmax_scale(softmax_scale, shapes.headdim)
        out, lse = _attend(q, k, v8, scale, causal)
        if key is not None and tiles is not None:  # (key: v was V^T already, so v8 is v)
            _PLANS.put(key, QuantizingPlan.make((q, k, v8), (), scale, causal, return_lse))
        return (out, lse) if return_lse else out
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, FP8Tensor):
            check_fp8_tensor(name, x)
        else:
            check_input(name, x)
    for name, t in (("q", q), ("k", k)):
        if isinstance(t, FP8Tensor):
            check_not_transposed(name, t)
    validation.check_same_device(q, k, v)  # type: ignore[arg-type]  # FP8Tensor has .device and .shape
    shapes: Shapes = validation.check_shapes(q, k, v)  # type: ignore[arg-type]  # before any quantization
    scale = _softmax_scale(softmax_scale, shapes.headdim)
    tiles = _kernel_tiles(q.device, shapes.headdim, causal)

    # Block sizes for what is quantized here.
    for name, bs, given in (("q_block_size", q_block_size, (q,)), ("kv_block_size", kv_block_size, (k, v))):
        if bs is None:
            continue
        check_int(name, bs, minimum=1)
        if all(isinstance(x, FP8Tensor) for x in given):
            raise ValueError(f"{name} sets the block size of tensors quantized here, but "
                             f"{'q is' if name == 'q_block_size' else 'k and v are'} already FP8Tensor")
    q_bs = Q_BLOCK if q_block_size is None else q_block_size
    short_n = _short_n(shapes.headdim, causal) if tiles is not None else 0
    kv_bs = kv_block_size
    # Beside a pre-quantized k or v (blocks of one tile's multiples), the other one in blocks of the same tile.
    given_kv = [x.block_size for x in (k, v) if isinstance(x, FP8Tensor) and x.block_size is not None]
    if kv_bs is None:
        kv_bs = (_matching_kv_block(given_kv[0], shapes.headdim, tiles, short_n) if given_kv
                 else default_kv_block_size(shapes.headdim, causal, shapes.seqlen_k))
    if tiles is not None:  # fail before quantizing anything
        if ops.has_quant_kernel():  # (as quantize_fp8 would; said here to name the argument)
            for name, x in (("q", q), ("k", k), ("v", v)):
                if not isinstance(x, FP8Tensor):
                    check_input_alignment(name, x)
        if not isinstance(q, FP8Tensor):
            check_aligned("q_block_size", q_bs, Q_BLOCK, Q_WHY)
        # (a block derived from a pre-quantized one: check_fp8_inputs names that tensor's block below)
        if not (isinstance(k, FP8Tensor) and isinstance(v, FP8Tensor)) and (kv_block_size is not None or not given_kv):
            check_aligned("kv_block_size", kv_bs, tiles[1], kv_why(shapes.headdim, tiles[1], short_n), short_n)

    # Q and K must share their Hadamard signs; a pre-quantized one decides.
    seed_qk = qk_seed(q, k, v, hadamard, seed, FP8Tensor)

    def quantize(x: torch.Tensor | FP8Tensor, block: int, seed_: int | None, transpose: bool = False) -> FP8Tensor:
        if isinstance(x, FP8Tensor):
            return x
        return quantize_fp8(x, block, seed_ is not None, 0 if seed_ is None else seed_, transpose=transpose)

    q8 = quantize(q, q_bs, seed_qk)
    k8 = quantize(k, kv_bs, seed_qk)
    v8 = to_vt(v) if isinstance(v, FP8Tensor) else quantize(v, kv_bs, None, transpose=True)
    check_fp8_inputs(q8, k8, v8, tiles, short_n)
    out, lse = _attend(q8, k8, v8, scale, causal)
    if key is not None and tiles is not None and ops.has_quant_kernel():  # (key: q, k, v are tensors)
        seed64 = None if seed_qk is None else seed_int64(seed_qk)
        _PLANS.put(key, QuantizingPlan.make((None, None, None), ((q, 0, q_bs, seed64, False), (k, 1, kv_bs, seed64, False),
                                                                 (v, 2, kv_bs, None, True)), scale, causal, return_lse))
    return (out, lse) if return_lse else out


def _attend(q8: FP8Tensor, k8: FP8Tensor, v8: FP8Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.flashhopper.fwd_fp8.default(q8.data, q8.scale, k8.data, k8.scale, v8.data, v8.scale,
                                                 q8.block_size, k8.block_size, v8.block_size, scale, causal)


# flash_attn_fp8_func's pre-quantized configurations that took the full path once (_plans): call key -> Launch.
_PLANS = _plans.Plans()


def fp8_key(t: FP8Tensor) -> tuple[Any, ...] | None:
    """An FP8Tensor's part of a call key (_plans): what its validation reads; None unless its data and scale
    are plain tensors."""
    d, s = t.data, t.scale
    if type(d) is not torch.Tensor or type(s) is not torch.Tensor:
        return None
    return _plans.meta(d), _plans.meta(s), _plans.scalars(t.block_size, t.hadamard_seed, t.transposed, t.seqlen)


def _call_key(q: Any, k: Any, v: Any, *args: Any) -> tuple[Any, ...] | None:
    """flash_attn_fp8_func's call key (``args``: its scalar arguments) when q, k and v are FP8Tensors, v as V^T
    (a row-major v is converted on every call), or all three plain tensors; None for any other call (a mix)."""
    if not _plans.direct():  # first: the parts read tensor flags that dynamo does not trace
        return None
    if type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor:
        parts: tuple[Any, ...] = (_plans.meta(q), _plans.meta(k), _plans.meta(v))
    elif type(q) is FP8Tensor and type(k) is FP8Tensor and type(v) is FP8Tensor and v.transposed is True:
        parts = fp8_key(q), fp8_key(k), fp8_key(v)
        if parts[0] is None or parts[1] is None or parts[2] is None:
            return None
    else:
        return None
    return (*parts, _plans.scalars(*args))


class QuantizingPlan(NamedTuple):
    """The launches of an fp8 call (_plans): the quantization of those of q, k, v that are bf16/fp16 here, each into
    one scratch buffer at the offsets of its data and scales, and the forward, which reads them from there (the
    others from their FP8Tensors). Its lse goes to the scratch too when the call does not return it
    (``lse_offset`` >= 0): one allocation besides the outputs, none for pre-quantized inputs that return lse."""

    quantize: tuple[tuple[Launch, int, int, int], ...]  # (launch, which input: 0 q / 1 k / 2 v, data, scale offsets)
    fwd: Launch
    lse_offset: int
    nbytes: int

    @staticmethod
    def make(xs8: tuple[FP8Tensor | None, FP8Tensor | None, FP8Tensor | None],
             quantized: tuple[tuple[torch.Tensor, int, int, int | None, bool], ...], softmax_scale: float, causal: bool,
             return_lse: bool) -> QuantizingPlan:
        """The plan of a call like one that just passed the full path: ``xs8`` its q, k, v that were FP8Tensors (v
        as V^T; None for the others), ``quantized`` the others as (tensor, which input, block size, Hadamard seed as
        the quantization op takes it, transpose)."""
        xs8_ = list(xs8)
        launches, offset = [], 0
        for x, i, block, seed64, transpose in quantized:
            data, scale = ops.empty_quantized(x, block, transpose)  # contiguous, as the scratch's views will be
            data_offset, scale_offset = offset, round_up(offset + data.numel(), 16)
            offset = round_up(scale_offset + 4 * scale.numel(), 16)
            launches.append((ops.quantize_launch(x, data, scale, block, seed64, transpose), i, data_offset, scale_offset))
            xs8_[i] = FP8Tensor(data, scale, block, None, transpose, x.shape[1])  # (the signs do not enter params)
        q8, k8, v8 = xs8_
        out, lse = ops.empty_outputs(q8.data)  # type: ignore[union-attr]
        fwd = ops.fwd_launch(q8, k8, v8, out, lse, softmax_scale, causal)  # type: ignore[arg-type]
        lse_offset = -1 if return_lse else offset
        return QuantizingPlan(tuple(launches), fwd, lse_offset, offset + (0 if return_lse else 4 * lse.numel()))

    def __call__(self, xs: tuple[torch.Tensor | FP8Tensor, ...], ptrs: tuple[int, ...],
                 return_lse: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The call on q, k, v ``xs``, whose data pointers (a tensor's, or an FP8Tensor's data's) are ``ptrs``."""
        q = xs[0].data if type(xs[0]) is FP8Tensor else xs[0]
        # One scratch allocation, held until the launches are queued (freed then in stream order, as any op's
        # temporary: a buffer dropped before would be handed to out below).
        scratch = q.new_empty(self.nbytes, dtype=torch.uint8) if self.nbytes else None  # type: ignore[union-attr]
        base = 0 if scratch is None else scratch.data_ptr()
        data = list(ptrs)
        scales = [x.scale.data_ptr() if type(x) is FP8Tensor else 0 for x in xs]  # type: ignore[union-attr]
        for launch, i, data_offset, scale_offset in self.quantize:
            launch.quantize(ptrs[i], base + data_offset, base + scale_offset)
            data[i], scales[i] = base + data_offset, base + scale_offset
        b, sq, hq, d = q.shape
        out = q.new_empty((b, sq, hq, d), dtype=torch.bfloat16)  # contiguous, as the plan's params were filled for
        lse = q.new_empty((b, hq, sq), dtype=torch.float32) if return_lse else None  # type: ignore[union-attr]
        self.fwd.fwd(*data, out.data_ptr(), base + self.lse_offset if lse is None else lse.data_ptr(), 0, 0, *scales)
        del scratch
        return (out, lse) if return_lse else out  # type: ignore[return-value]
