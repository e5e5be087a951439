"""The e4m3 KV cache (issue #22): its format, the quantization of appended tokens, and the transform q gets.

Format (docs/kvcache-fp8.md). K and V caches of ``torch.float8_e4m3fn`` in the 16-bit caches' layouts (paged
(num_pages, page_size, nheads_kv, headdim) or contiguous (batch_cache, max_seqlen, nheads_kv, headdim)), each with
a float32 scale per (token, kv head): ``k_cache_scale`` / ``v_cache_scale`` of shape (num_pages, nheads_kv,
page_size) (contiguous: (batch_cache, nheads_kv, max_seqlen)), tokens contiguous. Token j of kv head h is
``float(cache[p, r, h, :]) * scale[p, h, r]``. A scale per token means an append never rescales what the cache
holds (a per-page scale fixed by a page's first token would clip later outliers) for 4 bytes per 128 (head dim
128: 3% of the cache).

Incoherent processing: with ``hadamard_seed`` K's rows are stored as ``H diag(signs) k / sqrt(d)`` (docs/fp8.md's
signs), which spreads an outlier channel over the row before its scale is taken; q then gets the same transform
(``transform_q``), so q.k is unchanged. V is never transformed. The kernel reads the cache as it is: the scores are
e4m3 GEMMs on K's blocks with q carried as two e4m3 terms, and the PV GEMMs e4m3 on V's blocks transposed in shared
memory, with P rounded to e4m3 after V's per-token scales (docs/kvcache-fp8.md, "Kernel" and "Precision of the
scores").
"""
from __future__ import annotations

import functools
import math

import torch

from . import validation
from .fp8.format import check_seed, hadamard_signs
from .reference_fp8 import hadamard_matrix

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _refuse_copy_in_capture(d: int, seed: int, device: torch.device) -> None:
    # A first use inside CUDA-graph capture cannot copy host values to the GPU (the capture would fail on it,
    # unexplained): ask for an eager warm-up (the callers' caches keep nothing of this call, so a later call builds).
    if not torch.compiler.is_compiling() and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the e4m3 cache's Hadamard transform (head dim {d}, hadamard_seed {seed}) is first used "
                           "inside CUDA-graph capture, which cannot copy it to the GPU: run the call once eagerly "
                           "before capturing (a warm-up, as CUDA graphs need anyway)")


@functools.lru_cache(maxsize=32)
def _transform_matrix(d: int, seed: int, device: torch.device) -> torch.Tensor:
    """M (d, d) float32 with x @ M = H diag(signs) x / sqrt(d) for row vectors x (M is orthogonal: the inverse is
    M^T). Built on the host and copied once per (d, seed, device)."""
    _refuse_copy_in_capture(d, seed, device)
    signs = hadamard_signs(d, seed)
    m = signs[:, None] * hadamard_matrix(d) / math.sqrt(d)
    return m.to(device)


@functools.lru_cache(maxsize=32)
def _signs(d: int, seed: int, device: torch.device) -> torch.Tensor:
    """hadamard_signs(d, seed) on ``device``, copied once per (d, seed, device)."""
    _refuse_copy_in_capture(d, seed, device)
    return hadamard_signs(d, seed).to(device)


def _butterflies(y: torch.Tensor) -> torch.Tensor:
    """H y along the last dim (Sylvester's H, unnormalized), float32, as the append kernel computes it: stages of
    stride 1, 2, ..., d / 2, each element of index i with bit h clear becoming y_i + y_(i+h), with it set
    y_(i-h) - y_i (so the bytes match, cpp/kvcache_append.cu)."""
    d = y.shape[-1]
    lead = y.shape[:-1]
    h = 1
    while h < d:
        pairs = y.reshape(*lead, d // (2 * h), 2, h)
        a, c = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + c, a - c), dim=-2).reshape(*lead, d)
        h *= 2
    return y


def _check_seed_and_dim(hadamard_seed: int | None, d: int) -> None:
    if hadamard_seed is None:
        return
    check_seed("hadamard_seed", hadamard_seed)
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_seed needs a power-of-two head dim (the Hadamard transform's size), got {d}")


def transform_q(q: torch.Tensor, hadamard_seed: int | None) -> torch.Tensor:
    """q with the transform the cache's K rows have (``hadamard_seed``; None: q itself), in q's dtype. Computed in
    float32 (one matmul)."""
    if hadamard_seed is None:
        return q
    _check_seed_and_dim(hadamard_seed, q.shape[-1])
    m = _transform_matrix(q.shape[-1], int(hadamard_seed), q.device)
    return (q.float() @ m).to(q.dtype)


def quantize_rows(x: torch.Tensor, hadamard_seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row (last dim) of x (..., d), transformed first with ``hadamard_seed`` (K) or not (V), as e4m3 with
    its own float32 scale: amax = max |row|, scale = amax / 448 (1 for a zero row), data = round(row * 448 / amax)
    to e4m3 (round to nearest even, clamped to +-448). Returns (data (..., d), scale (...)). torch ops on the
    device: no synchronization (graph-capturable).

    In float32, as the append kernel (cpp/kvcache_append.cu), so that both give the same bytes: the transform as
    signs then butterflies (_butterflies), its 1 / sqrt(d) folded into the amax (max |H s x| * norm) and the
    multiplier ((448 / amax) * norm); IEEE divisions (tensor by tensor: torch divides by a scalar through its
    reciprocal). (Not for rows with NaN, whose amax here is NaN (scale 1, zeros) where the kernel's skips it, nor rows
    of float32 denormals only, which the kernel flushes to zero.)"""
    _check_seed_and_dim(hadamard_seed, x.shape[-1])
    y = x.float()
    amax = y.abs().amax(dim=-1) if hadamard_seed is None else None
    if hadamard_seed is not None:
        d = x.shape[-1]
        y = _butterflies(y * _signs(d, int(hadamard_seed), x.device))
        norm = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32, device=x.device)
        amax = y.abs().amax(dim=-1) * norm
    assert amax is not None
    full = torch.full_like(amax, E4M3_MAX)
    positive = amax > 0
    scale = torch.where(positive, amax / full, torch.ones_like(amax))
    mult = torch.where(positive, full / amax, torch.zeros_like(amax))
    if hadamard_seed is not None:
        mult = mult * norm
    data = (y * mult[..., None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return data, scale


def dequantize_rows(data: torch.Tensor, scale: torch.Tensor, hadamard_seed: int | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize_rows up to rounding: float(data) * scale, then the inverse transform."""
    y = data.to(torch.float32) * scale[..., None]
    if hadamard_seed is not None:
        y = y @ _transform_matrix(data.shape[-1], int(hadamard_seed), data.device).T
    return y.to(dtype)


def quantize_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, hadamard_seed: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 16-bit (or float32) cache, paged or contiguous, as an e4m3 one: (k_cache, v_cache, k_cache_scale,
    v_cache_scale), the scales (pages, nheads_kv, page_size) float32 contiguous. K with ``hadamard_seed``'s
    transform (pass the same seed to flash_attn_with_kvcache)."""
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        validation.check_tensor(name, x)
        if x.dim() != 4 or not x.is_floating_point() or x.dtype == E4M3:
            raise ValueError(f"{name} must be a 4-dimensional floating-point (not e4m3) cache, got "
                             f"{tuple(x.shape)} {x.dtype}")
    k8, ks = quantize_rows(k_cache, hadamard_seed)
    v8, vs = quantize_rows(v_cache, None)
    return k8, v8, ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous()


def dequantize_kv_cache(cache: torch.Tensor, scale: torch.Tensor, hadamard_seed: int | None = None,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An e4m3 cache (pages, page_size, nheads_kv, d) with its scales (pages, nheads_kv, page_size) as ``dtype``
    values in the original domain (the inverse transform applied when K was stored with ``hadamard_seed``)."""
    return dequantize_rows(cache, scale.transpose(1, 2), hadamard_seed, dtype)


def check_fp8_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_cache_scale: object, v_cache_scale: object,
                    hadamard_seed: object, q: torch.Tensor) -> None:
    """flash_attn_with_kvcache's e4m3-cache arguments: both caches e4m3 with scales (pages, nheads_kv, page_size)
    float32 on q's device, tokens contiguous, the two with the same strides (16-byte multiples); q 16-bit; K/V
    head dims equal; the seed an int or None (a power-of-two head dim with it)."""
    if v_cache.dtype != E4M3 or k_cache.dtype != E4M3:
        raise TypeError(f"an e4m3 cache needs both k_cache and v_cache e4m3, got {k_cache.dtype} and {v_cache.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"q has dtype {q.dtype}; an e4m3 cache is read by float16/bfloat16 queries")
    if v_cache.shape[3] != k_cache.shape[3]:
        raise ValueError(f"an e4m3 cache has one head dim for K and V, got {k_cache.shape[3]} and {v_cache.shape[3]}")
    want = (k_cache.shape[0], k_cache.shape[2], k_cache.shape[1])
    for name, s in (("k_cache_scale", k_cache_scale), ("v_cache_scale", v_cache_scale)):
        if s is None:
            raise ValueError(f"{name} is required with an e4m3 cache (float32 {want}: one scale per token and kv "
                             "head)")
        validation.check_tensor(name, s)
        assert isinstance(s, torch.Tensor)
        if s.dtype != torch.float32:
            raise TypeError(f"{name} has dtype {s.dtype}; it must be torch.float32")
        if tuple(s.shape) != want:
            raise ValueError(f"{name} must have shape {want} (pages, nheads_kv, page_size), got {tuple(s.shape)}")
        if s.device != q.device:
            raise ValueError(f"{name} is on {s.device} but q is on {q.device}")
        if s.stride(2) != 1 and s.shape[2] > 1:
            raise ValueError(f"{name} must have its tokens contiguous (stride 1 in dim 2), got strides "
                             f"{tuple(s.stride())}")
    assert isinstance(k_cache_scale, torch.Tensor) and isinstance(v_cache_scale, torch.Tensor)
    if scale_strides(k_cache_scale) != scale_strides(v_cache_scale):
        raise ValueError(f"k_cache_scale and v_cache_scale must have the same strides, got "
                         f"{tuple(k_cache_scale.stride())} and {tuple(v_cache_scale.stride())}")
    if k_cache.shape[1] % 16:
        raise ValueError(f"an e4m3 cache's pages (a contiguous one's max_seqlen) hold a multiple of 16 rows, got "
                         f"{k_cache.shape[1]} (the kernel copies each 16 rows' scales as one 64-byte chunk)")
    if hadamard_seed is not None:
        if isinstance(hadamard_seed, bool) or not isinstance(hadamard_seed, int):
            raise TypeError(f"hadamard_seed must be an int or None, got {type(hadamard_seed).__name__}")
        _check_seed_and_dim(hadamard_seed, k_cache.shape[3])


def scale_strides(scale: torch.Tensor) -> tuple[int, int]:
    """(page stride, head stride) of a scale array (pages, nheads_kv, page_size), a size-1 dim's stride taken as
    what a contiguous array would have (torch may report any value there; it is never multiplied by an index)."""
    pages, heads, rows = scale.shape
    head = scale.stride(1) if heads > 1 else rows
    return (scale.stride(0) if pages > 1 else heads * head), head


def scale_layout_ok(k_cache_scale: torch.Tensor) -> bool:
    """What the kernel's bulk copies need of the scales: a 16-byte aligned start, page and head strides of a
    multiple of 4 elements, 16-row pages (one 64-byte copy per 16 keys)."""
    page, head = scale_strides(k_cache_scale)
    return (k_cache_scale.data_ptr() % 16 == 0 and page % 4 == 0 and head % 4 == 0
            and k_cache_scale.shape[2] % 16 == 0)
