// Which key blocks a query block visits, and which of them need a mask. Shared by every kernel
// family so that sm80 and sm90 agree on causal alignment (bottom-right, as in flash-attn).
#pragma once

#include <cute/config.hpp>

namespace flashhopper {

CUTE_HOST_DEVICE constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
CUTE_HOST_DEVICE constexpr int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
CUTE_HOST_DEVICE constexpr int imax(int a, int b) { return a > b ? a : b; }
CUTE_HOST_DEVICE constexpr int imin(int a, int b) { return a < b ? a : b; }

// Query row r sees key column c when c < seqlen_k and, for causal, c <= r + (seqlen_k - seqlen_q).
template <int kBlockM, int kBlockN, bool kCausal>
struct BlockInfo {
  int seqlen_q, seqlen_k;

  CUTE_HOST_DEVICE int n_block_max(int m_block) const {
    int n_max = ceil_div(seqlen_k, kBlockN);
    if constexpr (kCausal) {
      // Last visible column of the tile's last row, plus one.
      int col_end = (m_block + 1) * kBlockM + seqlen_k - seqlen_q;
      n_max = col_end <= 0 ? 0 : (col_end < n_max * kBlockN ? ceil_div(col_end, kBlockN) : n_max);
    }
    return n_max;
  }
  CUTE_HOST_DEVICE int n_block_min(int /*m_block*/) const { return 0; }

  // Blocks n >= this bound contain a column some row of the tile must not see (causal), so they
  // run the masked iteration; the ones below run without mask code.
  CUTE_HOST_DEVICE int n_block_causal_start(int m_block) const {
    if constexpr (kCausal) {
      return floor_div(m_block * kBlockM + seqlen_k - seqlen_q + 1, kBlockN);
    } else {
      return n_block_max(m_block);
    }
  }
};

// The backward walks the other way: a CTA owns key block n_block and visits the query blocks that
// see any of its keys. Same visibility rule as BlockInfo.
template <int kBlockM, int kBlockN, bool kCausal>
struct BwdBlockInfo {
  int seqlen_q, seqlen_k;

  CUTE_HOST_DEVICE int m_block_max() const { return ceil_div(seqlen_q, kBlockM); }

  // First query block with a row that sees the block's first key: row r sees key c iff
  // c <= r + seqlen_k - seqlen_q, so rows from n_block * kBlockN - (seqlen_k - seqlen_q) on.
  CUTE_HOST_DEVICE int m_block_min(int n_block) const {
    if constexpr (kCausal) {
      return imax(0, floor_div(n_block * kBlockN - (seqlen_k - seqlen_q), kBlockM));
    } else {
      return 0;
    }
  }

  // Key blocks that add to query block m_block's dQ: 0 .. n_block_end(m_block) - 1 (the same count
  // as BlockInfo::n_block_max; the deterministic backward orders the additions by it).
  CUTE_HOST_DEVICE int n_block_end(int m_block) const {
    int n_end = ceil_div(seqlen_k, kBlockN);
    if constexpr (kCausal) {
      int const col_end = (m_block + 1) * kBlockM + seqlen_k - seqlen_q;
      n_end = col_end <= 0 ? 0 : imin(n_end, ceil_div(col_end, kBlockN));
    }
    return n_end;
  }

  // Query blocks below this bound have a row that must not see a key of the block (causal): they
  // run the masked iteration. A block needs no causal mask once its first row sees the last key.
  CUTE_HOST_DEVICE int m_block_causal_end(int n_block) const {
    if constexpr (kCausal) {
      int const first_row_seeing_all = (n_block + 1) * kBlockN - 1 - (seqlen_k - seqlen_q);
      return imin(m_block_max(), imax(m_block_min(n_block), ceil_div(first_row_seeing_all, kBlockM)));
    } else {
      return m_block_min(n_block);
    }
  }
};

}  // namespace flashhopper
