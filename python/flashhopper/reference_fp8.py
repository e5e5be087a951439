"""Slow truths for the fp8 (e4m3) forward: the quantization of docs/fp8.md written out in torch, and an
emulation of the fp8 kernel's arithmetic on the dequantized data (``dequantize`` and ``token_scales``
belong to the format, fp8/format.py, and are re-exported here). The CPU implementations of the fp8
ops run these.

quantize_ref follows the kernel operation by operation in float32 (Hadamard butterflies in the same
order, the same float32 1/sqrt(headdim), IEEE divisions, round-to-nearest-even with saturation), so on
finite inputs it reproduces the kernel's bytes and scales. attention_fp8_ref uses the final row max
where the kernel uses a running one, so the two agree to fp8 rounding, not bitwise.
"""
from __future__ import annotations

import math

import torch

from .fp8.format import (FP8_DTYPE, GRANULARITIES, VT_GROUP, FP8Tensor, dequantize, hadamard_signs, nblocks,
                         round_up, to_vt, token_scales)
from .fp8.packed import PackedFP8Tensor, packed_nblocks, to_vt_packed
from .reference import _rows_per_block, default_scale, visible

__all__ = ["E4M3_MAX", "P_OFFSET", "attention_fp8_ref", "attention_varlen_fp8_ref", "dequantize", "hadamard_matrix",
           "hadamard_transform", "outlier_inputs", "quantize_ref", "quantize_varlen_ref", "rmse", "token_scales"]

E4M3_MAX = 448.0  # largest finite e4m3
# The kernel computes P' = 2^P_OFFSET * exp(s - rowmax) in [0, 256]: more of e4m3's range for the fp8 P.
P_OFFSET = 8


def _check_pow2(d: int) -> None:
    if d < 1 or d & (d - 1):
        raise ValueError(f"headdim must be a power of two for the Hadamard transform, got {d}")


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
                    ) -> torch.Tensor:
    """The Sylvester Hadamard matrix: H[i][j] = (-1)^popcount(i & j), d a power of two (H H^T = d I)."""
    _check_pow2(d)
    i = torch.arange(d, device=device)
    both = i[:, None] & i[None, :]
    parity = torch.zeros_like(both)
    for bit in range(d.bit_length()):
        parity ^= (both >> bit) & 1
    return (1 - 2 * parity).to(dtype)


def hadamard_transform(x: torch.Tensor, signs: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Each row (last dim) becomes H · diag(signs) · x / sqrt(d), in x's dtype if float32/float64, else
    float32. Computed as the kernel does: the sign flip, butterflies of stride 1, 2, 4, ... (the lower
    element keeps the sum, the upper the difference), then a multiply by 1/sqrt(d) rounded to x's dtype
    (left out with ``normalize=False``: the quantization folds it into its multiplier)."""
    d = x.shape[-1]
    _check_pow2(d)
    if signs.shape != (d,):
        raise ValueError(f"signs must have shape ({d},), got {tuple(signs.shape)}")
    dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    y = x.to(dtype) * signs.to(dtype=dtype, device=x.device)
    rows = y.numel() // d
    out = y.reshape(rows, d)
    h = 1
    while h < d:
        pairs = out.reshape(rows, d // (2 * h), 2, h)
        lo, hi = pairs[:, :, 0], pairs[:, :, 1]
        out = torch.stack((lo + hi, lo - hi), dim=2).reshape(rows, d)
        h *= 2
    out = out.reshape(y.shape)
    return out * torch.tensor(1.0 / math.sqrt(d), dtype=dtype) if normalize else out


def _amax(y: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """max |y| over ``dims`` (kept), 0 for empty groups (torch refuses to reduce an empty dim)."""
    if any(y.shape[dim] == 0 for dim in dims):
        shape = [1 if i in dims else n for i, n in enumerate(y.shape)]
        return y.new_zeros(shape)
    return y.abs().amax(dim=dims, keepdim=True)


def quantize_ref(x: torch.Tensor, block_size: int | None = 128, granularity: str = "block",
                 signs: torch.Tensor | int | None = None, transpose: bool = False, *,
                 hadamard_seed: int | None = None) -> FP8Tensor:
    """docs/fp8.md's quantization of x (batch, seqlen, nheads, headdim), any float dtype, in float32.

    granularity "block" (one scale per ``block_size`` tokens of a (batch, head)), "head" or "tensor".
    signs: None (no Hadamard transform), an int seed (the signs ``hadamard_signs(headdim, seed)``) or
    the ±1 signs themselves, with ``hadamard_seed`` naming them for the FP8Tensor.
    Per scale group: amax = max |x| (after the transform), scale = amax / 448 (1 when amax is 0),
    x_fp8 = e4m3_rn_satfinite(x * (448 / amax)) with 448 / amax rounded once (x * 0 when amax is 0);
    with the transform, x * (448 / amax) is y * ((448 / amax) * norm), y unnormalized, norm = 1/sqrt(d).
    transpose: return V^T (``fp8.to_vt``). Scales: (batch, nheads, nblocks) contiguous for "block",
    (batch, nheads, 1) for "head", a (1, 1, 1) tensor broadcast to (batch, nheads, 1) for "tensor".
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(map(repr, GRANULARITIES))}, got {granularity!r}")
    b, s, h, d = x.shape
    seed = hadamard_seed
    if isinstance(signs, bool):  # an int subclass, never a seed here
        raise TypeError("signs must be None, an int seed or a tensor of ±1, got a bool")
    if isinstance(signs, int):
        seed, signs = signs, hadamard_signs(d, signs)
    elif signs is not None and seed is None:
        raise ValueError("hadamard_seed must name the signs passed (an FP8Tensor records it, so that Q and K "
                         "can be checked to share it); or pass the seed itself as signs")
    # With the transform, y is left unnormalized and 1/sqrt(d) (float32) is folded in as the kernel does
    # it: amax = max |y| * norm (= max |y * norm|, rounding being monotonic), multiplier (448 / amax) * norm.
    y = x.float() if signs is None else hadamard_transform(x.float(), signs, normalize=False)
    norm = None if signs is None else torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32, device=y.device)

    if granularity == "block":
        if block_size is None or block_size < 1:
            raise ValueError(f"block_size must be a positive int for granularity 'block', got {block_size}")
        nblk = nblocks(s, block_size)
        padded = y.new_zeros((b, nblk * block_size, h, d))  # zeros leave every amax unchanged
        padded[:, :s] = y
        amax = _amax(padded.view(b, nblk, block_size, h, d), (2, 4)).view(b, nblk, h).transpose(1, 2)
    elif granularity == "head":
        amax = _amax(y, (1, 3)).view(b, 1, h).transpose(1, 2)  # (b, h, 1)
    else:
        amax = _amax(y.reshape(1, -1), (1,)).view(1, 1, 1)
    if norm is not None:
        amax = amax * norm
    # Tensor / tensor: IEEE division on every device (CUDA turns "/ python scalar" into a multiply).
    limit = torch.full_like(amax, E4M3_MAX)
    scale = torch.where(amax > 0, amax / limit, 1.0).contiguous()
    inv = torch.where(amax > 0, limit / amax, 0.0)
    if norm is not None:
        inv = inv * norm

    if block_size is not None and granularity == "block":  # (checked above; said again for the type checker)
        token_block = torch.arange(s, device=y.device) // block_size
        inv_tokens = inv[:, :, token_block].transpose(1, 2)  # (b, s, h)
    else:
        inv_tokens = inv.transpose(1, 2)  # (b or 1, 1, h or 1)
    data = (y * inv_tokens[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    if granularity == "tensor":
        scale = scale.expand(b, h, 1)
    t = FP8Tensor(data, scale, block_size if granularity == "block" else None, seed, False, s)
    return to_vt(t) if transpose else t


def attention_fp8_ref(q8: FP8Tensor, k8: FP8Tensor, v8: FP8Tensor, softmax_scale: float | None = None,
                      causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 kernel's arithmetic on dequantized Q, K, V, in float32: (out (batch, seqlen_q, nheads_q,
    headdim), lse (batch, nheads_q, seqlen_q)), both float32.

    S = deq(Q) deq(K)^T * softmax_scale (causal bottom-right, as reference.attention_ref);
    P' = exp2((S - rowmax) * log2(e) + 8), rounded to e4m3 for the PV product; l = rowsum of the
    unrounded P'; O = (P'_fp8 @ deq(V)) / l; lse = rowmax + log(l) - 8 ln 2. Rows that see no key:
    O = 0, lse = -inf. GQA: query head h reads kv head h // (nheads_q // nheads_kv).
    """
    q, k, v = dequantize(q8), dequantize(k8), dequantize(v8)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = default_scale(d) if softmax_scale is None else softmax_scale
    group = hq // hkv if hkv else 1
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(group, dim=1)
    out = torch.empty(b, hq, sq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    log2e = 1.0 / math.log(2.0)
    step = _rows_per_block(q, sk)
    for m0 in range(0, sq, step):
        rows = slice(m0, m0 + step)
        s = (qt[:, :, rows] @ kt.transpose(-1, -2)) * scale
        mask = visible(sq, sk, causal, q.device, rows=rows)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        m = s.amax(dim=-1) if sk else s.new_full(s.shape[:-1], float("-inf"))
        m_safe = torch.where(torch.isinf(m), 0.0, m)  # no visible key: exp2(-inf) = 0, not NaN
        p = torch.exp2((s - m_safe[..., None]) * log2e + P_OFFSET)
        l = p.sum(dim=-1)
        o = p.clamp(max=E4M3_MAX).to(FP8_DTYPE).float() @ vt
        seen = l > 0
        out[:, :, rows] = torch.where(seen[..., None], o / torch.where(seen, l, 1.0)[..., None], 0.0)
        lse[:, :, rows] = torch.where(seen, m_safe + torch.log(torch.where(seen, l, 1.0)) - P_OFFSET * math.log(2.0),
                                      float("-inf"))
    return out.transpose(1, 2), lse


# --- packed batches (fp8/packed.py): each sequence as a padded batch of one ---

def quantize_varlen_ref(x: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int, signs: int | None = None,
                        transpose: bool = False) -> PackedFP8Tensor:
    """quantize_ref ("block") of each sequence of packed x (total, nheads, headdim), its blocks aligned with its
    first token, laid out as fp8/packed.py says: scale (nheads, total // block_size + batch), 1 in blocks of no
    sequence; data like x (rows of no sequence 0) or V^T (``transpose``). signs: None or an int seed."""
    total, h, d = x.shape
    batch = cu_seqlens.shape[0] - 1
    data = torch.zeros((total, h, d), dtype=FP8_DTYPE, device=x.device)
    scale = torch.ones((h, packed_nblocks(total, batch, block_size)), dtype=torch.float32, device=x.device)
    starts = cu_seqlens.tolist()
    for b in range(batch):
        s0, s1 = starts[b], starts[b + 1]
        if s1 <= s0:
            continue
        t = quantize_ref(x[None, s0:s1], block_size, "block", signs)
        data[s0:s1] = t.data[0]
        first = s0 // block_size + b
        scale[:, first:first + t.nblocks] = t.scale[0]
    packed = PackedFP8Tensor(data, scale, block_size, signs, False, cu_seqlens, total)
    return to_vt_packed(packed) if transpose else packed


def _sequence(t: PackedFP8Tensor, b: int, start: int, length: int) -> FP8Tensor:
    """Sequence b (its first ``length`` tokens, from ``start``) of a packed tensor as a padded batch of one,
    with its own scale blocks (V^T: its columns, the group padding included)."""
    first = start // t.block_size + b
    scale = t.scale[None, :, first:first + nblocks(length, t.block_size)]
    if t.transposed:
        c0 = first * t.block_size
        data = t.data[None, :, :, c0:c0 + round_up(length, VT_GROUP)]
    else:
        data = t.data[None, start:start + length]
    return FP8Tensor(data, scale, t.block_size, t.hadamard_seed, t.transposed, length)


def attention_varlen_fp8_ref(q8: PackedFP8Tensor, k8: PackedFP8Tensor, v8: PackedFP8Tensor,
                             softmax_scale: float | None = None, causal: bool = False, *,
                             seqused_q: torch.Tensor | None = None,
                             seqused_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_fp8_ref of each sequence of a packed batch (v8 in V^T), the first seqused tokens of each slot
    when given: (out (total_q, nheads_q, headdim), lse (nheads_q, total_q)) float32; rows of no sequence's
    used range get out 0 and lse -inf (the kernel leaves them unwritten)."""
    hq, d = q8.nheads, q8.headdim
    out = torch.zeros((q8.total, hq, d), dtype=torch.float32, device=q8.device)
    lse = torch.full((hq, q8.total), -math.inf, dtype=torch.float32, device=q8.device)
    cq, ck = q8.cu_seqlens.tolist(), k8.cu_seqlens.tolist()
    used_q = None if seqused_q is None else seqused_q.tolist()
    used_k = None if seqused_k is None else seqused_k.tolist()
    for b in range(len(cq) - 1):
        lq = cq[b + 1] - cq[b] if used_q is None else used_q[b]
        lk = ck[b + 1] - ck[b] if used_k is None else used_k[b]
        if lq <= 0:
            continue
        o_b, lse_b = attention_fp8_ref(_sequence(q8, b, cq[b], lq), _sequence(k8, b, ck[b], lk),
                                       _sequence(v8, b, ck[b], lk), softmax_scale, causal)
        out[cq[b]:cq[b] + lq] = o_b[0]
        lse[:, cq[b]:cq[b] + lq] = lse_b[0]
    return out, lse


def outlier_inputs(shape: tuple[int, ...], generator: torch.Generator | None = None) -> torch.Tensor:
    """float32 N(0, 1) with 0.1% of the entries replaced by N(0, 10^2): the FA3 paper's fp8 accuracy setup."""
    x = torch.randn(shape, generator=generator)
    outliers = torch.rand(shape, generator=generator) < 1e-3
    return torch.where(outliers, 10.0 * torch.randn(shape, generator=generator), x)


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """Root mean square of a - b, in float64."""
    return (a.double() - b.double()).square().mean().sqrt().item()
