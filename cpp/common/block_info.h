// Which (query row, key) pairs take part, and, block by block, which key blocks a query block visits
// (forward), which query blocks a key block visits (backward), and which of them need a mask. Shared
// by every kernel family so that sm80 and sm90, forward and backward agree on every range; the
// extension exposes the ranges to the tests (tests/test_block_ranges.py checks them against a
// brute-force walk over the visibility rule, and the forward and backward ranges against each other).
//
// Visibility (flash-attn's convention, bottom-right aligned): with diag = seqlen_k - seqlen_q, row r
// sees key c iff 0 <= c < seqlen_k and r + diag - left <= c <= r + diag + right. kPackedRows (GQA-packed KV-cache
// calls): rows are (query, head) pairs, g = rows_per_query to a query; the rule holds for query r / g, with
// seqlen_q / g queries (the forward's ranges and mask only). MaskKind::kNone has
// neither edge, kCausal the right edge with right = 0 known at compile time, kWindow both edges from
// the params (-1: unbounded). Masked iterations can sit at both ends of a row's range: the highest
// key blocks (the sequence end, the right edge) and the lowest (the left edge).
#pragma once

#include <cute/config.hpp>

#include "kernel_key.h"
#include "seqlen.h"

namespace flashhopper {

CUTE_HOST_DEVICE constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }  // a >= 0
CUTE_HOST_DEVICE constexpr int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
CUTE_HOST_DEVICE constexpr int ceil_div_signed(int a, int b) { return -floor_div(-a, b); }
CUTE_HOST_DEVICE constexpr int imax(int a, int b) { return a > b ? a : b; }
CUTE_HOST_DEVICE constexpr int imin(int a, int b) { return a < b ? a : b; }

template <MaskKind kMask, bool kPackedRows = false>
struct Visibility {
  static constexpr bool kHasRight = kMask != MaskKind::kNone;
  static constexpr bool kHasLeft = kMask == MaskKind::kWindow;
  // An unbounded edge (-1), or one wider than any sequence, becomes one that no pair reaches, far from
  // int overflow in the block arithmetic.
  static constexpr int kUnbounded = 1 << 28;

  int seqlen_q, seqlen_k;
  int left_, right_;  // kWindow only
  int rows_per_query_;  // kPackedRows only

  CUTE_HOST_DEVICE Visibility(SeqlenInfo const& s, int window_left, int window_right)
      : seqlen_q(s.seqlen_q),
        seqlen_k(s.seqlen_k),
        left_(window_left < 0 || window_left > kUnbounded ? kUnbounded : window_left),
        right_(window_right < 0 || window_right > kUnbounded ? kUnbounded : window_right),
        rows_per_query_(kPackedRows ? s.rows_per_query : 1) {}

  // The query position of row r >= 0 (itself, or r / g for packed rows).
  CUTE_HOST_DEVICE int query(int r) const { return kPackedRows ? r / rows_per_query_ : r; }
  CUTE_HOST_DEVICE int diag() const { return seqlen_k - (kPackedRows ? seqlen_q / rows_per_query_ : seqlen_q); }
  CUTE_HOST_DEVICE int right() const { return kMask == MaskKind::kCausal ? 0 : right_; }
  CUTE_HOST_DEVICE int left() const { return left_; }
};

template <int kBlockM, int kBlockN, MaskKind kMask, bool kPackedRows = false>
struct BlockInfo : Visibility<kMask, kPackedRows> {
  using Base = Visibility<kMask, kPackedRows>;
  using Base::diag, Base::kHasLeft, Base::kHasRight, Base::left, Base::query, Base::right, Base::seqlen_k,
      Base::seqlen_q;
  using Base::Base;
  static constexpr int kM = kBlockM, kN = kBlockN;

  CUTE_HOST_DEVICE int num_m_blocks() const { return ceil_div(seqlen_q, kBlockM); }
  CUTE_HOST_DEVICE int num_n_blocks() const { return ceil_div(seqlen_k, kBlockN); }

  // ---- Forward: query block m_block walks key blocks [n_block_min, n_block_max), the highest first.
  // A block pair is visited when some row of the query block (padding rows of the last one included)
  // may see some key of the key block; n_block_max <= n_block_min: no row sees a key.
  CUTE_HOST_DEVICE int n_block_max(int m_block) const {
    int n_max = num_n_blocks();
    if constexpr (kHasRight) {
      int const col_end = query((m_block + 1) * kBlockM - 1) + 1 + diag() + right();  // last row's right edge + 1
      n_max = col_end <= 0 ? 0 : imin(n_max, ceil_div(col_end, kBlockN));
    }
    return n_max;
  }
  CUTE_HOST_DEVICE int n_block_min(int m_block) const {
    if constexpr (kHasLeft) {
      return imax(0, floor_div(query(m_block * kBlockM) + diag() - left(), kBlockN));  // first row's left edge
    } else {
      return 0;
    }
  }
  // Key blocks from this one up hold a key past the right edge of some row: the masked iterations at
  // the top. (The sequence end lies in the highest block only; that iteration is always masked.)
  CUTE_HOST_DEVICE int n_block_right_masked_begin(int m_block) const {
    if constexpr (kHasRight) {
      return floor_div(query(m_block * kBlockM) + diag() + right() + 1, kBlockN);
    } else {
      return n_block_max(m_block);
    }
  }
  // Key blocks below this one hold a key before the left edge of some row: the masked iterations at
  // the bottom.
  CUTE_HOST_DEVICE int n_block_left_masked_end(int m_block) const {
    if constexpr (kHasLeft) {
      return ceil_div_signed(query((m_block + 1) * kBlockM - 1) + diag() - left(), kBlockN);
    } else {
      return n_block_min(m_block);
    }
  }
  // Key blocks that add to query block m_block's dQ in the backward (the dQ counters wait for this many).
  CUTE_HOST_DEVICE int num_n_blocks_of(int m_block) const { return imax(0, n_block_max(m_block) - n_block_min(m_block)); }

  // ---- Backward: key block n_block walks query blocks [m_block_min, m_block_max): exactly the query
  // blocks whose forward range holds n_block.
  CUTE_HOST_DEVICE int m_block_min(int n_block) const {
    if constexpr (kHasRight) {
      return imax(0, floor_div(n_block * kBlockN - diag() - right(), kBlockM));
    } else {
      return 0;
    }
  }
  CUTE_HOST_DEVICE int m_block_max(int n_block) const {
    int m_max = num_m_blocks();
    if constexpr (kHasLeft) {
      m_max = imin(m_max, floor_div((n_block + 1) * kBlockN - 1 + left() - diag(), kBlockM) + 1);
    }
    return m_max;
  }
  // Query blocks below this one have a row whose right edge comes before the block's last key.
  CUTE_HOST_DEVICE int m_block_right_masked_end(int n_block) const {
    if constexpr (kHasRight) {
      int const first_row_seeing_all = (n_block + 1) * kBlockN - 1 - diag() - right();
      return imin(m_block_max(n_block), imax(m_block_min(n_block), ceil_div_signed(first_row_seeing_all, kBlockM)));
    } else {
      return m_block_min(n_block);
    }
  }
  // Query blocks from this one up have a row whose left edge comes after the block's first key.
  CUTE_HOST_DEVICE int m_block_left_masked_begin(int n_block) const {
    if constexpr (kHasLeft) {
      int const first_row_missing_some = n_block * kBlockN + left() - diag() + 1;
      return imin(m_block_max(n_block), imax(m_block_min(n_block), floor_div(first_row_missing_some, kBlockM)));
    } else {
      return m_block_max(n_block);
    }
  }
};

// Split-KV (KV caches): the forward of split `split` of `num_splits` visits only its share of query block m_block's own
// key blocks [n_block_min, n_block_max), ceil(their count / num_splits) consecutive ones (a window's blocks, not the
// entry's: with a window the entry's would leave most splits empty); the masks stay those of the whole row (the
// masked iterations' rule still holds: a split's highest block is always masked, and a right edge below it masks
// the blocks the range says). The share is computed once, for the tile's query block: a division per range query
// cost the e4m3-cache decode 3-10% (perf-notes, session 25); other query blocks get their range cut to it.
template <class Base>
struct SplitBlockInfo : Base {
  int n_lo = 0, n_hi = 0;
  CUTE_HOST_DEVICE SplitBlockInfo(SeqlenInfo const& s, int window_left, int window_right, int m_block, int split,
                                  int num_splits)
      : Base(s, window_left, window_right) {
    int const lo = Base::n_block_min(m_block), hi = Base::n_block_max(m_block);
    int const per_split = ceil_div(imax(hi - lo, 0), num_splits);
    n_lo = imin(hi, lo + split * per_split);
    n_hi = imin(hi, n_lo + per_split);
  }
  CUTE_HOST_DEVICE int n_block_min(int m_block) const { return imax(Base::n_block_min(m_block), n_lo); }
  CUTE_HOST_DEVICE int n_block_max(int m_block) const { return imin(Base::n_block_max(m_block), n_hi); }
};

}  // namespace flashhopper
