"""HBM traffic of one attention forward call by the FlashAttention paper's IO model (Dao et al.
2022, arXiv 2205.14135, section 3.2 and Theorem 2), in bytes.

Standard attention (the paper's Algorithm 0) materializes the scores S and probabilities P in HBM:
read Q and K, write S; read S, write P = softmax(S); read P and V, write O. Per (batch, head):
2 N d (Q, K) + N^2 (S written) + N^2 (S read) + N^2 (P written) + N^2 (P read) + N d (V) + N d (O)
= 4 N d + 4 N^2 elements, Theta(N d + N^2). With seqlen_q != seqlen_k: 2 (sq + sk) d + 4 sq sk.
S and P are counted in the input precision; a causal mask does not shrink them (the full matrix
is written and read).

Ours (Theorem 2: Theta(N^2 d^2 / M)), with the kernel's real tile in place of the paper's M: each
query tile of block_m rows reads its Q once and writes its O once, and streams K and V once, over
the key blocks it can see (non-causal: all; causal: whole block_n blocks up to its diagonal,
bottom-right aligned). Per (batch, query head): 2 sq d + 2 d * (keys streamed by all query tiles).
The float32 LSE (4 bytes a row) is left out, as in the paper. Nothing is subtracted for the K/V
re-reads that L2 serves, so bandwidth derived from these bytes (``tbps``) can exceed the HBM peak:
it is the rate at which the kernel consumes its operands.
"""
from __future__ import annotations


def standard_bytes(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int, elem_bytes: int) -> int:
    per_head = 2 * (seqlen_q + seqlen_k) * headdim + 4 * seqlen_q * seqlen_k
    return batch * nheads * per_head * elem_bytes


def keys_streamed(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, causal: bool) -> int:
    """Key rows loaded by all query tiles of one (batch, head), counting whole key blocks."""
    offset = seqlen_k - seqlen_q  # bottom-right causal: row i sees keys j <= i + offset
    total = 0
    for m0 in range(0, seqlen_q, block_m):
        last_row = min(m0 + block_m, seqlen_q) - 1
        n_end = min(seqlen_k, max(0, last_row + 1 + offset)) if causal else seqlen_k
        total += min(seqlen_k, -(-n_end // block_n) * block_n)
    return total


def flash_fwd_bytes(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int, elem_bytes: int,
                    block_m: int, block_n: int, causal: bool, out_bytes: int | None = None) -> int:
    """``out_bytes``: O's element size when it differs from Q, K, V's (the fp8 kernels write bf16)."""
    out_bytes = elem_bytes if out_bytes is None else out_bytes
    keys = keys_streamed(seqlen_q, seqlen_k, block_m, block_n, causal)
    per_head = seqlen_q * headdim * (elem_bytes + out_bytes) + 2 * headdim * keys * elem_bytes
    return batch * nheads * per_head


def tbps(nbytes: float, ms: float) -> float:
    """Bandwidth in TB/s (1e12 bytes per second) of ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e12
