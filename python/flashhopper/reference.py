"""Slow truths the kernels are tested against, in the flash-attn layout.

q is (batch, seqlen_q, nheads_q, headdim); k and v are (batch, seqlen_k, nheads_kv, headdim), v's head dim
possibly its own. Every forward function returns ``(out, lse)``: out like q (with v's head dim), lse of
shape (batch, nheads_q, seqlen_q), natural log; every backward function returns ``(dq, dk, dv)``, each like its input.
Conventions shared with the kernels:
- grouped-query attention: query head h reads kv head ``h // (nheads_q // nheads_kv)``;
- causal is bottom-right aligned: query row i sees key j iff ``j <= i + seqlen_k - seqlen_q``;
- a local window (flash-attn's ``window_size`` = (left, right), -1 = unbounded): row i sees key j iff
  ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``; with causal as well, the
  right edge is min(right, 0) (causal is the window (-1, 0));
- softcap c > 0 (Gemma 2): the scaled scores s become c * tanh(s / c) before the softmax;
- sinks (float32, one logit per query head, gpt-oss): each row's softmax denominator gets exp(sink)
  added, with no value, so out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)) and lse includes it;
- a query row that sees no key gets out = 0 and lse = -inf (= the sink with sinks).
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from . import validation
from .dropout import Dropout, keep_mask

# Scores are materialized one block of query rows at a time, at most this many elements per
# block, so that the float64 reference fits in GPU memory at seqlen 8k and beyond.
_MAX_SCORE_ELEMENTS = 1 << 27


def default_scale(headdim: int) -> float:
    return 1.0 / math.sqrt(headdim)


def _edges(causal: bool, window: tuple[int, int] | None) -> tuple[int | None, int | None]:
    """(left, right) distances from a row's diagonal that bound what it sees; None = unbounded."""
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0  # min(right, 0): a window's right edge is -1 (unbounded) or >= 0, never narrower
    return (None if left < 0 else left), (None if right < 0 else right)


def _visible_tile(i: torch.Tensor, j: torch.Tensor, offset: int, left: int | None, right: int | None
                  ) -> torch.Tensor | None:
    """Boolean mask of (row i, key j) pairs (broadcast), True where the row sees the key; None if all do.
    ``offset`` is seqlen_k - seqlen_q (the diagonal of row i is key i + offset)."""
    mask = None
    if right is not None:
        mask = j <= i + offset + right
    if left is not None:
        seen = j >= i + offset - left
        mask = seen if mask is None else mask & seen
    return mask


def visible(seqlen_q: int, seqlen_k: int, causal: bool, device: torch.device | str | None = None,
            rows: slice | None = None, *, window: tuple[int, int] | None = None) -> torch.Tensor | None:
    """Boolean (rows, seqlen_k) mask, True where query row i may attend key j; None if all may."""
    left, right = _edges(causal, window)
    if left is None and right is None:
        return None
    r = rows if rows is not None else slice(0, seqlen_q)
    i = torch.arange(r.start, min(r.stop, seqlen_q), device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return _visible_tile(i, j, seqlen_k - seqlen_q, left, right)


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(b, h, s, d) copies in ``dtype``, kv heads repeated to match q's (GQA)."""
    group = q.shape[2] // k.shape[2] if k.shape[2] else 1
    qt = q.transpose(1, 2).to(dtype)
    kt = k.transpose(1, 2).to(dtype).repeat_interleave(group, dim=1)
    vt = v.transpose(1, 2).to(dtype).repeat_interleave(group, dim=1)
    return qt, kt, vt


def _mod_scores(raw: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """The scores the softmax takes: raw (q k^T) * scale, then the softcap c * tanh(s / c) if c > 0."""
    s = raw * scale
    return softcap * torch.tanh(s / softcap) if softcap > 0 else s


def _softmax_rows(scores: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, lse) of each (b, h, row, key) row; rows with no visible key give zeros and -inf
    (the sink's logit with sinks, which join every row's denominator)."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None].expand_as(lse))
    # exp(-inf - (-inf)) would be NaN for rows with no key; shifting by 0 there gives exp(-inf) = 0.
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p, lse


def _rows_per_block(q: torch.Tensor, seqlen_k: int) -> int:
    b, _, h, _ = q.shape
    return max(1, _MAX_SCORE_ELEMENTS // max(1, b * h * seqlen_k))


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                  causal: bool = False, *, window: tuple[int, int] | None = None, softcap: float = 0.0,
                  sinks: torch.Tensor | None = None, dropout: Dropout | None = None,
                  dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention computed entirely in ``dtype`` (float64 by default); out and lse in ``dtype``.
    ``dropout``: P's dropped scores zeroed and the kept ones scaled, after the softmax (flashhopper.dropout
    says which); the lse is the softmax's."""
    _, scale = validation.check_inputs(q, k, v, softmax_scale, causal)
    window = validation.check_window(window)
    softcap = validation.check_softcap(softcap)
    validation.check_sinks(sinks, q)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64 (what the reference computes in), got {dtype}")
    b, sq, h, d = q.shape
    sk = k.shape[1]
    qt, kt, vt = _heads_first(q, k, v, dtype)
    out = torch.empty(b, h, sq, v.shape[3], dtype=dtype, device=q.device)
    lse = torch.empty(b, h, sq, dtype=dtype, device=q.device)
    step = _rows_per_block(q, sk)
    for m0 in range(0, sq, step):
        rows = slice(m0, m0 + step)
        scores = _mod_scores(qt[:, :, rows] @ kt.transpose(-1, -2), scale, softcap)
        p, lse_rows = _softmax_rows(scores, visible(sq, sk, causal, q.device, rows, window=window), sinks)
        lse[:, :, rows] = lse_rows
        out[:, :, rows] = _dropped(p, dropout, sq, sk, rows) @ vt
    return out.transpose(1, 2), lse


def _dropped(p: torch.Tensor, dropout: Dropout | None, seqlen_q: int, seqlen_k: int, rows: slice) -> torch.Tensor:
    """P (b, h, rows, keys) after dropout: dropped entries 0, kept ones times the scale."""
    if dropout is None:
        return p
    keep = keep_mask(dropout, p.shape[0], p.shape[1], seqlen_q, seqlen_k, p.device, rows)
    return torch.where(keep, p * dropout.scale(), 0.0)


def attention_lowp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                   causal: bool = False, *, window: tuple[int, int] | None = None, softcap: float = 0.0,
                   sinks: torch.Tensor | None = None, dropout: Dropout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention the way plain PyTorch does it in the input's precision: both matmuls in q.dtype
    (bf16/fp16 on GPU), softmax in float32 (dropout, as attention_ref's, on the float32 P). Its error against attention_ref is the yardstick that
    kernel errors are measured by. Returns out in q.dtype and lse in float32."""
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    b, sq, h, d = q.shape
    sk = k.shape[1]
    qt, kt, vt = _heads_first(q, k, v, q.dtype)
    out = torch.empty(b, h, sq, v.shape[3], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    step = _rows_per_block(q, sk)
    for m0 in range(0, sq, step):
        rows = slice(m0, m0 + step)
        scores = _mod_scores((qt[:, :, rows] @ kt.transpose(-1, -2)).float(), scale, softcap)
        p, lse_rows = _softmax_rows(scores, visible(sq, sk, causal, q.device, rows, window=window), sinks)
        lse[:, :, rows] = lse_rows
        out[:, :, rows] = _dropped(p, dropout, sq, sk, rows).to(q.dtype) @ vt
    return out.transpose(1, 2), lse


def attention_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int = 64, block_n: int = 64,
                    softmax_scale: float | None = None, causal: bool = False, *,
                    window: tuple[int, int] | None = None, dtype: torch.dtype = torch.float64
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The FlashAttention recurrence, written out block by block (arXiv 2205.14135, Algorithm 1,
    with the loop order and the deferred normalization of FlashAttention-2, as the kernels do it).

    For each block of ``block_m`` query rows, walk the ``block_n``-key blocks keeping per row a
    running max m, a running sum l of exp(s - m) and an unnormalized output acc; when the max
    grows, rescale l and acc by exp(m_old - m_new). At the end out = acc / l and lse = m + log(l).
    Scores are never materialized beyond one (block_m, block_n) tile per (batch, head). Key blocks
    that no row of a query block sees (past the right edge, before the left edge) are skipped.
    """
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    b, sq, h, d = q.shape
    sk = k.shape[1]
    offset = sk - sq  # row i's diagonal is key i + offset
    left, right = _edges(causal, window)
    qt, kt, vt = _heads_first(q, k, v, dtype)
    out = torch.empty(b, h, sq, v.shape[3], dtype=dtype, device=q.device)
    lse = torch.empty(b, h, sq, dtype=dtype, device=q.device)
    for m0 in range(0, sq, block_m):
        m1 = min(m0 + block_m, sq)
        q_blk = qt[:, :, m0:m1]
        m = torch.full((b, h, m1 - m0), float("-inf"), dtype=dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(b, h, m1 - m0, v.shape[3], dtype=dtype, device=q.device)
        # Keys past the last row's right edge or before the first row's left edge are invisible to
        # the whole block. Blocks stay aligned to multiples of block_n, as in the kernels.
        n_end = sk if right is None else min(sk, max(0, m1 + offset + right))
        n_begin = 0 if left is None else max(0, m0 + offset - left) // block_n * block_n
        for n0 in range(n_begin, n_end, block_n):
            n1 = min(n0 + block_n, sk)
            s = (q_blk @ kt[:, :, n0:n1].transpose(-1, -2)) * scale
            i = torch.arange(m0, m1, device=q.device)[:, None]
            j = torch.arange(n0, n1, device=q.device)[None, :]
            mask = _visible_tile(i, j, offset, left, right)
            if mask is not None and not bool(mask.all()):  # the block crosses some row's edge: mask it
                s = s.masked_fill(~mask, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row that has seen no key yet has m_new = -inf; shift by 0 so exp gives 0, not NaN.
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)  # rescales what was accumulated under the old max
            l = alpha * l + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ vt[:, :, n0:n1]
            m = m_new
        seen = l > 0
        out[:, :, m0:m1] = torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None], 0.0)
        lse[:, :, m0:m1] = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), float("-inf"))
    return out.transpose(1, 2), lse


def _group_sum(x: torch.Tensor, nheads_kv: int) -> torch.Tensor:
    """(b, nheads_q, s, d) per-query-head gradients of repeated kv heads -> (b, nheads_kv, s, d) sums."""
    b, h, s, d = x.shape
    return x.view(b, nheads_kv, h // nheads_kv if nheads_kv else 0, s, d).sum(2)


def _probs_from_lse(scores: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """P = exp(scores - lse), the forward's probabilities recovered from its LSE, 0 where masked
    and on rows that see no key (lse -inf: shift by 0 there, so that exp(-inf) gives 0, not NaN)."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])


def attention_bwd_ref(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, softmax_scale: float | None = None, causal: bool = False,
                      dlse: torch.Tensor | None = None, *, window: tuple[int, int] | None = None,
                      softcap: float = 0.0, dropout: Dropout | None = None,
                      dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention w.r.t. q, k, v by the explicit backward formula, entirely in ``dtype``.

    Given dout (like out), the forward's out and lse, and optionally dlse (the gradient w.r.t. lse),
    per (batch, query head), with S = q k^T and the forward's P = exp(S * scale - lse):
        D  = rowsum(dout * out) - dlse          dV = P^T dout      dP = dout V^T
        dS = P * (dP - D)                       dQ = scale * dS K  dK = scale * dS^T Q
    (the dlse term: d lse_i / d S_ij = P_ij * scale). With a softcap c, P comes from the capped scores
    c * tanh(S * scale / c) and dS gets the factor 1 - tanh^2. Sinks need nothing here (lse includes
    them; their own gradient is sinks_grad_ref). With dropout (mask M, scale s) dV = (s M * P)^T dout and
    dS = P * (s M * dP - D), D as above (out is the dropped output). Masked entries and rows that see no key have
    P = 0 and contribute nothing; with GQA, dK and dV of a kv head sum over its group of query heads.
    This is what the kernels compute, so out and lse are taken as given rather than recomputed:
    pass exact ones (attention_ref) for the true gradients. Query rows are processed in blocks, as in
    attention_ref. Returns dq, dk, dv in ``dtype``.
    """
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qt, kt, vt = _heads_first(q, k, v, dtype)
    dot = dout.transpose(1, 2).to(dtype)
    lse = lse.to(dtype)
    delta = (dot * out.transpose(1, 2).to(dtype)).sum(-1)  # D: (b, hq, sq)
    if dlse is not None:
        delta = delta - dlse.to(dtype)
    dq = torch.empty(b, hq, sq, d, dtype=dtype, device=q.device)
    dk = torch.zeros(b, hq, sk, d, dtype=dtype, device=q.device)  # per query head; summed per group below
    dv = torch.zeros(b, hq, sk, v.shape[3], dtype=dtype, device=q.device)
    step = _rows_per_block(q, sk)
    for m0 in range(0, sq, step):
        rows = slice(m0, m0 + step)
        scores = _mod_scores(qt[:, :, rows] @ kt.transpose(-1, -2), scale, softcap)
        p = _probs_from_lse(scores, lse[:, :, rows], visible(sq, sk, causal, q.device, rows, window=window))
        dv += _dropped(p, dropout, sq, sk, rows).transpose(-1, -2) @ dot[:, :, rows]
        # With dropout the gradient reaching P is dP's kept entries, scaled (D = rowsum(dout * out) holds as is).
        ds = p * (_dropped(dot[:, :, rows] @ vt.transpose(-1, -2), dropout, sq, sk, rows) - delta[:, :, rows, None])
        if softcap > 0:
            ds = ds * (1 - (scores / softcap) ** 2)
        dq[:, :, rows] = (ds @ kt) * scale
        dk += (ds.transpose(-1, -2) @ qt[:, :, rows]) * scale
    return dq.transpose(1, 2), _group_sum(dk, hkv).transpose(1, 2), _group_sum(dv, hkv).transpose(1, 2)


def attention_bwd_lowp(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       softmax_scale: float | None = None, causal: bool = False, dlse: torch.Tensor | None = None,
                       *, window: tuple[int, int] | None = None, softcap: float = 0.0,
                       sinks: torch.Tensor | None = None,
                       dropout: Dropout | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients PyTorch itself computes in the input precision: what autograd through
    attention_lowp gives (the yardstick for the kernels' backward), written out so that it runs
    in blocks of query rows. Autograd through attention_lowp would keep every block's float32
    probabilities alive for the backward, b * h * seqlen_q * seqlen_k of them (over 6 GB at 8k
    tokens for the tests' largest case); this formula recomputes them per block instead.

    Step by step as autograd does it (tests/test_reference_bwd.py checks the two agree): the forward of
    attention_lowp (scores from a q.dtype matmul, softmax in float32, P cast to q.dtype); then
    dV = P^T dout and dP = dout V^T as q.dtype matmuls; the softmax backward in float32,
    dS = P * (dP - rowsum(P * dP) + dlse) (autograd's D is rowsum(P * dP), not rowsum(dout * out));
    dS * scale cast to q.dtype; dQ = dS K and dK = dS^T Q as q.dtype matmuls. Sums over row blocks
    and over a GQA group are kept in float32 and rounded to q.dtype once, as one matmul would (their
    block products are float32 matmuls of q.dtype-rounded operands: exact products, float32 sums,
    which is what a q.dtype GEMM does before rounding its output).
    dout must have q's dtype; dlse is float32 (batch, nheads_q, seqlen_q) or None.
    """
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    dt = q.dtype
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qt, kt, vt = _heads_first(q, k, v, dt)
    dot = dout.transpose(1, 2).to(dt)
    dq = torch.empty(b, hq, sq, d, dtype=dt, device=q.device)
    dk = torch.zeros(b, hq, sk, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(b, hq, sk, v.shape[3], dtype=torch.float32, device=q.device)
    step = _rows_per_block(q, sk)
    for m0 in range(0, sq, step):
        rows = slice(m0, m0 + step)
        scores = _mod_scores((qt[:, :, rows] @ kt.transpose(-1, -2)).float(), scale, softcap)
        p, _ = _softmax_rows(scores, visible(sq, sk, causal, q.device, rows, window=window), sinks)
        dv += _dropped(p, dropout, sq, sk, rows).to(dt).float().transpose(-1, -2) @ dot[:, :, rows].float()
        # dP w.r.t. P: through the dropout's mask and scale (autograd's D below is rowsum(P * that)).
        dp = _dropped((dot[:, :, rows] @ vt.transpose(-1, -2)).float(), dropout, sq, sk, rows)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        if dlse is not None:
            ds = ds + p * dlse[:, :, rows, None].float()
        if softcap > 0:
            ds = ds * (1 - (scores / softcap) ** 2)
        ds = (ds * scale).to(dt)
        dq[:, :, rows] = ds @ kt
        dk += ds.float().transpose(-1, -2) @ qt[:, :, rows].float()
    return (dq.transpose(1, 2), _group_sum(dk, hkv).to(dt).transpose(1, 2),
            _group_sum(dv, hkv).to(dt).transpose(1, 2))


def sinks_grad_ref(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                   dlse: torch.Tensor | None = None, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Gradient w.r.t. the sink logits (nheads_q,): the sink's probability in row i is
    exp(sink - lse_i), and d(loss)/d(sink) = -sum over batch and rows of exp(sink - lse_i) * D_i with
    D = rowsum(dout * out) - dlse, as for any logit whose value vector is zero. Given the forward's out
    and lse (which includes the sinks); computed in ``dtype``."""
    delta = (dout.transpose(1, 2).to(dtype) * out.transpose(1, 2).to(dtype)).sum(-1)  # (b, hq, sq)
    if dlse is not None:
        delta = delta - dlse.to(dtype)
    lse = lse.to(dtype)
    p_sink = torch.where(torch.isneginf(lse), 0.0, torch.exp(sinks.to(dtype)[None, :, None] - lse))
    return -(p_sink * delta).sum(dim=(0, 2))


def _varlen_sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, seqused_q: torch.Tensor | None,
                      seqused_k: torch.Tensor | None) -> Iterator[tuple[int, slice, slice]]:
    """The index, query and key rows of each sequence of a packed batch that has queries (read on the host)."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used_q = None if seqused_q is None else seqused_q.tolist()
    used_k = None if seqused_k is None else seqused_k.tolist()
    for b in range(len(starts_q) - 1):
        oq, ok = starts_q[b], starts_k[b]
        lq = starts_q[b + 1] - oq if used_q is None else used_q[b]
        lk = starts_k[b + 1] - ok if used_k is None else used_k[b]
        if lq > 0:
            yield b, slice(oq, oq + lq), slice(ok, ok + lk)


def _of_sequence(dropout: Dropout | None, b: int) -> Dropout | None:
    """A packed batch's dropout as sequence b alone sees it: batch entry b of the definition."""
    return None if dropout is None else dropout._replace(batch_start=b)


def attention_varlen_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, softmax_scale: float | None = None, causal: bool = False, *,
                         seqused_q: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
                         window: tuple[int, int] | None = None, softcap: float = 0.0,
                         sinks: torch.Tensor | None = None, dropout: Dropout | None = None,
                         dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed batches (flash-attn's varlen layout): q (total_q, nheads_q, headdim), k and v (total_k,
    nheads_kv, headdim); sequence b has the rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q (the first
    seqused_q[b] of them when given) and likewise of k and v, and attends within itself only, every
    convention as in attention_ref (causal bottom-right per sequence). Returns out (total_q, nheads_q,
    headdim_v) and lse (nheads_q, total_q) in ``dtype``; rows in no sequence's used range get out = 0 and
    lse = -inf (the kernels leave them unwritten). ``dropout``: sequence b draws as batch entry b (flashhopper.dropout).
    Differentiable (torch autograd) w.r.t. q, k, v and sinks. Reads cu_seqlens and seqused on the host."""
    _, softmax_scale = validation.check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, 0, 0, seqused_q, seqused_k,
                                                      softmax_scale, causal)
    total_q, hq = q.shape[0], q.shape[1]
    out = torch.zeros(total_q, hq, v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((hq, total_q), -math.inf, dtype=dtype, device=q.device)
    for b, rq, rk in _varlen_sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        o_b, lse_b = attention_ref(q[None, rq], k[None, rk], v[None, rk], softmax_scale, causal,
                                   window=window, softcap=softcap, sinks=sinks, dropout=_of_sequence(dropout, b),
                                   dtype=dtype)
        out[rq] = o_b[0]
        lse[:, rq] = lse_b[0]
    return out, lse


def attention_varlen_bwd_ref(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                             softmax_scale: float | None = None, causal: bool = False,
                             dlse: torch.Tensor | None = None, *, seqused_q: torch.Tensor | None = None,
                             seqused_k: torch.Tensor | None = None, window: tuple[int, int] | None = None,
                             softcap: float = 0.0, sinks: torch.Tensor | None = None,
                             dropout: Dropout | None = None, dtype: torch.dtype = torch.float64,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """attention_bwd_ref (and sinks_grad_ref) per sequence of a packed batch (attention_varlen_ref's layout; out,
    lse (nheads_q, total_q) and dlse as it returns them): (dq, dk, dv, dsinks or None) in ``dtype``, rows of no
    sequence getting zero gradients. Reads cu_seqlens and seqused on the host."""
    dq, dk, dv = (torch.zeros(x.shape, dtype=dtype, device=x.device) for x in (q, k, v))
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=dtype, device=sinks.device)
    for b, rq, rk in _varlen_sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        lse_b = lse[None, :, rq]
        dlse_b = None if dlse is None else dlse[None, :, rq]
        g = attention_bwd_ref(dout[None, rq], q[None, rq], k[None, rk], v[None, rk], out[None, rq], lse_b,
                              softmax_scale, causal, dlse_b, window=window, softcap=softcap,
                              dropout=_of_sequence(dropout, b), dtype=dtype)
        dq[rq], dk[rk], dv[rk] = g[0][0], g[1][0], g[2][0]
        if sinks is not None:
            dsinks += sinks_grad_ref(dout[None, rq], out[None, rq], lse_b, sinks, dlse_b, dtype=dtype)
    return dq, dk, dv, dsinks


# --- KV caches (flash_attn_with_kvcache) ---

def _kvcache_lengths(cache_seqlens: torch.Tensor | int | None, batch: int, capacity: int) -> list[int]:
    """Each entry's key count, read on the host: a tensor's values, an int for all, None: the whole cache."""
    if cache_seqlens is None:
        return [capacity] * batch
    if isinstance(cache_seqlens, torch.Tensor):
        lengths = [int(n) for n in cache_seqlens.tolist()]
        if len(lengths) != batch:
            raise ValueError(f"cache_seqlens must have shape ({batch},) (one length per entry), got "
                             f"{tuple(cache_seqlens.shape)}")
        return lengths
    return [int(cache_seqlens)] * batch


def kvcache_entry(cache: torch.Tensor, b: int, length: int, page_table: torch.Tensor | None = None,
                  cache_batch_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``length`` rows (length, nheads_kv, headdim) of entry ``b`` of a KV cache, gathered densely.
    Paged (``page_table`` given; cache (num_pages, page_size, nheads_kv, headdim)): key j lives in page
    page_table[b, j // page_size], row j % page_size. Contiguous (cache (batch_cache, max_seqlen, ...)): row
    cache_batch_idx[b] of the cache (b without it), its first ``length`` positions. Reads indices on the host;
    ValueError for one outside the cache."""
    if page_table is not None:
        page_size = cache.shape[1]
        n_pages = -(-length // page_size) if page_size else 0
        if n_pages > page_table.shape[1]:
            raise ValueError(f"entry {b} has {length} keys, more than its {page_table.shape[1]} pages of {page_size} "
                             "rows hold")
        pages = [int(p) for p in page_table[b, :n_pages].tolist()]
        bad = [p for p in pages if not 0 <= p < cache.shape[0]]
        if bad:
            raise ValueError(f"page_table[{b}] names pages {bad} outside the cache's {cache.shape[0]} pages")
        if not pages:
            return cache.new_empty((0, *cache.shape[2:]))
        return cache[torch.tensor(pages, device=cache.device)].flatten(0, 1)[:length]
    row = b if cache_batch_idx is None else int(cache_batch_idx[b])
    if not 0 <= row < cache.shape[0]:
        raise ValueError(f"cache_batch_idx[{b}] = {row} is outside the cache's {cache.shape[0]} rows")
    if length > cache.shape[1]:
        raise ValueError(f"entry {b} has {length} keys, more than the cache's {cache.shape[1]} positions")
    return cache[row, :length]


def attention_kvcache_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cache_seqlens: torch.Tensor | int | None = None, page_table: torch.Tensor | None = None,
                          cache_batch_idx: torch.Tensor | None = None, softmax_scale: float | None = None,
                          causal: bool = True, *, sinks: torch.Tensor | None = None,
                          window: tuple[int, int] | None = None, softcap: float = 0.0,
                          dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (batch, seqlen_q, nheads_q, headdim) over a KV cache, each entry alone: entry b's keys are
    the first cache_seqlens[b] of its cache (an int: the same for every entry; None: the whole capacity),
    gathered densely (kvcache_entry: paged through ``page_table`` (batch, max_pages) or contiguous, rows
    ``cache_batch_idx``), then attention_ref with batch 1 (every convention as there: GQA, causal bottom-right
    per entry, so query row i sees key j iff j <= i + cache_seqlens[b] - seqlen_q; a row that sees no key, an
    entry with no keys included, gets out = 0 and lse = -inf, or the sink with ``sinks``; ``window`` as
    attention_ref's, per entry; ``softcap`` likewise). Nothing is appended (flash_attn_with_kvcache
    writes k/v into the cache first, then attends to cache_seqlens + seqlen_new keys). Returns out (batch,
    seqlen_q, nheads_q, headdim_v) and lse (batch, nheads_q, seqlen_q) in ``dtype``. Reads cache_seqlens and
    the indices on the host."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        validation.check_tensor(name, x)
        validation.check_rank(name, x)
        validation.check_dtype(name, x)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but q has {q.dtype}; q and the caches must share one dtype")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    capacity = (page_table.shape[1] * k_cache.shape[1]) if page_table is not None else k_cache.shape[1]
    lengths = _kvcache_lengths(cache_seqlens, q.shape[0], capacity)
    outs, lses = [], []
    for b, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"cache_seqlens[{b}] = {length} is negative")
        kb = kvcache_entry(k_cache, b, length, page_table, cache_batch_idx)
        vb = kvcache_entry(v_cache, b, length, page_table, cache_batch_idx)
        out_b, lse_b = attention_ref(q[b:b + 1], kb[None], vb[None], softmax_scale, causal, window=window,
                                     softcap=softcap, sinks=sinks, dtype=dtype)
        outs.append(out_b)
        lses.append(lse_b)
    if not outs:
        return (torch.empty((0, *q.shape[1:3], v_cache.shape[3]), dtype=dtype, device=q.device),
                torch.empty((0, q.shape[2], q.shape[1]), dtype=dtype, device=q.device))
    return torch.cat(outs), torch.cat(lses)
