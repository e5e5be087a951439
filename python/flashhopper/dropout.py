"""Attention dropout's random numbers, defined once: which (query, key) scores of which head are kept.

The kernels are to regenerate the mask in the backward from (seed, offset) instead of storing it, so the
mask is a pure function of the score's coordinates, computed with Philox4x32-7 (Salmon et al., SC'11:
Philox4x32 with 7 rounds passes TestU01's BigCrush; cuRAND and PyTorch run 10, FlashAttention's
dropout 7, which the kernels' cost asks for: cpp/common/dropout.h), counter-based:

- the scores of one (batch, head) form 16 x 16 blocks; a block's 256 scores form 16 groups of 16,
  group (a, b) = rows {2a, 2a+1, 2a+8, 2a+9} x columns {2b, 2b+1, 2b+8, 2b+9} of the block (a, b in
  0..3). Such a group is what two threads hold in a 16 x 16 WGMMA / mma.sync accumulator tile, whether
  the kernel computes S or S^T (the backward's layout), so each thread draws for its own scores;
- one Philox4x32-7 call per group: key (seed low 32 bits, seed high 32 bits), counter (block column * 4 + b,
  block row * 4 + a, batch * nheads + head, offset), where rows are query rows and columns keys (in a packed
  batch, flash_attn_varlen_func's, the batch index is the sequence's and rows and columns count from the
  sequence's first token); its four 32-bit outputs are 16 bytes, little-endian;
- score (r, c) of the group (r, c in 0..3: r = 2 * (row in block >= 8) + row % 2, likewise c) takes byte
  4 r + c; it is kept iff that byte >= t, t = round(dropout_p * 256). The keep probability is then
  exactly (256 - t) / 256 and kept scores are scaled by 256 / (256 - t): dropout_p is rounded to a
  multiple of 1/256 (0.1 -> 26/256 = 0.1016), so that the expectation stays exact.

Dropout applies to P after the softmax (its normalizer sees every score), before P V, as in
FlashAttention; the LSE is unaffected.

The (seed, offset) of a call live on its device (new_rng_state), drawn from a torch generator by a
device op, so that a CUDA graph draws fresh ones on every replay and the backward reads the forward's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_MASK32 = 0xFFFFFFFF
ROUNDS = 7  # of the dropout's Philox (philox4x32 itself is the general Philox4x32-R)


class Dropout(NamedTuple):
    """What a dropout draw needs: the probability, and the generator state it starts from."""
    p: float
    seed: int    # 64 bits
    offset: int  # the Philox counter's last word (32 bits)
    batch_start: int = 0  # the batch index of a tensor's first entry (a packed batch's sequence b alone: b)

    def threshold(self) -> int:
        return round(self.p * 256)

    def scale(self) -> float:
        """The factor kept scores are scaled by: 1 / keep probability."""
        t = self.threshold()
        return 256.0 / (256 - t) if t < 256 else 0.0


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of m * x for uint32 values held in int64 (no overflow: halves of 16 bits)."""
    lo_part = x * (m & 0xFFFF)                # < 2^48
    hi_part = x * (m >> 16)                   # < 2^48
    high = (hi_part + (lo_part >> 16)) >> 16  # floor(m x / 2^32)
    low = (lo_part + ((hi_part & 0xFFFF) << 16)) & _MASK32
    return high, low


def philox4x32(counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], key: tuple[int, int],
               rounds: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-``rounds`` of int64 tensors holding uint32 counters (broadcast together) and a 2 x 32-bit key;
    the four uint32 outputs, in int64 tensors."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _MASK32 for c in counter)
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for i in range(rounds):
        if i:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def keep_mask(dropout: Dropout, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
              device: torch.device | str = "cpu", rows: slice | None = None) -> torch.Tensor:
    """bool (batch, nheads, seqlen_q, seqlen_k): the scores dropout keeps (see the module's docstring);
    ``rows``: only those query rows (a slice with step 1)."""
    start, stop, _ = (rows or slice(None)).indices(seqlen_q)
    rows = torch.arange(start, max(start, stop), device=device, dtype=torch.int64)
    seqlen_q = rows.numel()
    cols = torch.arange(seqlen_k, device=device, dtype=torch.int64)
    first = dropout.batch_start * nheads
    bh = torch.arange(first, first + batch * nheads, device=device, dtype=torch.int64).view(batch, nheads, 1, 1)

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # group coordinate (block * 4 + pair index) and the 2-bit position inside the group
        inner = x % 16
        return (x // 16) * 4 + (inner % 8) // 2, 2 * (inner // 8) + inner % 2

    row_group, r = split(rows)
    col_group, c = split(cols)
    words = philox4x32((col_group.view(1, 1, 1, -1), row_group.view(1, 1, -1, 1), bh, torch.tensor(dropout.offset)),
                       (dropout.seed & _MASK32, (dropout.seed >> 32) & _MASK32), ROUNDS)
    byte_index = (4 * r.view(-1, 1) + c.view(1, -1)).expand(seqlen_q, seqlen_k)  # 0..15
    word = torch.stack(torch.broadcast_tensors(*words), dim=-1)  # (b, h, sq, sk, 4)
    chosen = torch.gather(word, -1, (byte_index // 4).expand(*word.shape[:-1]).unsqueeze(-1)).squeeze(-1)
    byte = (chosen >> (8 * (byte_index % 4))) & 0xFF
    return byte >= dropout.threshold()


def new_rng_state(device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A call's dropout state: int64 (seed, offset) on ``device``, drawn from ``generator`` (None: the
    device's default generator) by a device op (no host synchronization; a CUDA graph replays the draw)."""
    return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, device=device, generator=generator)


def from_rng_state(p: float, rng: torch.Tensor) -> Dropout:
    """The Dropout of probability ``p`` whose (seed, offset) ``rng`` holds (reads it: a host copy)."""
    seed, offset = (int(x) for x in rng.tolist())
    return Dropout(p, seed & 0xFFFFFFFFFFFFFFFF, offset & _MASK32)
