// Which key blocks a query block visits, and which of them need a mask. Shared by every kernel
// family so that sm80 and sm90 agree on causal alignment (bottom-right, as in flash-attn).
#pragma once

#include <cute/config.hpp>

namespace flashhopper {

CUTE_HOST_DEVICE constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
CUTE_HOST_DEVICE constexpr int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

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

}  // namespace flashhopper
