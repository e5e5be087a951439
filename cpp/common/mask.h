// The mask policy: score tiles in (row, col) view get -inf where a row must not see a key (keys past
// seqlen_k, past a row's right edge, before its left edge; block_info.h has the rule). Shared by sm80
// and sm90, forward and backward. `coords` holds the (row, col) of each score inside the tile, from
// the MMA's own partitioning. Each edge is a template switch, so an iteration pays only for the edges
// that can cross it (the block ranges say which, block_info.h), and a mask kind without an edge
// compiles it out. A per-query-block list of key blocks (block-sparse attention) would be another
// BlockInfo / Mask pair with the same interface.
#pragma once

#include <cute/tensor.hpp>
#include <cmath>

#include "block_info.h"

namespace flashhopper {

template <int kBlockN, MaskKind kMask, bool kPackedRows = false>
struct Mask : Visibility<kMask, kPackedRows> {
  using Base = Visibility<kMask, kPackedRows>;
  using Base::diag, Base::kHasLeft, Base::kHasRight, Base::left, Base::query, Base::right, Base::seqlen_k;
  using Base::Base;

  // Forward: row_offset is the global index of the tile's row 0, n_block the key block.
  template <bool kSeqlenMask, bool kRightMask, bool kLeftMask = false, class TensorS, class TensorC>
  CUTE_DEVICE void apply(TensorS& s, TensorC const& coords, int row_offset, int n_block) const {
    static_assert(decltype(rank(s))::value == 2 && decltype(rank(coords))::value == 2);
    constexpr bool kRight = kHasRight && kRightMask, kLeft = kHasLeft && kLeftMask;
    if constexpr (!kSeqlenMask && !kRight && !kLeft) return;
    // As in apply_bwd: a score's (row, col) is score 0's plus a constant of the tile's layout, so the limits are
    // taken relative to score 0's column once per row and each test compares that constant (one ISETP and one FSEL a
    // score); comparing each score's own column made ptxas rebuild the columns from the thread index in every
    // masked step (S2R, LOP3, IMAD: 911 instructions a step at e4m3 d64 where FA3 has 654, now 699). Measured in
    // perf-notes, session 20: bf16 d64 causal +1-7%, e4m3 d256 causal +1-5%, e4m3 d64 causal 1-3% slower.
    auto const c0 = coords(0, 0);
    int const row0 = row_offset + int(get<0>(c0));
    int const col_offset = n_block * kBlockN + int(get<1>(c0));
    int const seqlen_limit = seqlen_k - col_offset;
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(s); ++mi) {
      int const row = query(row0 + int(get<0>(coords.layout()(mi, 0))));  // packed rows: the row's query
      // Columns (relative to score 0's) in [col_begin, col_limit) stay.
      int col_limit = seqlen_limit;
      if constexpr (kRight) {
        int const right_limit = row + 1 + diag() + right() - col_offset;
        col_limit = kSeqlenMask ? cute::min(col_limit, right_limit) : right_limit;
      }
      int const col_begin = kLeft ? row + diag() - left() - col_offset : 0;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s); ++ni) {
        int const col = int(get<1>(coords.layout()(mi, ni)));
        bool masked = col >= col_limit;
        if constexpr (kLeft) masked |= col < col_begin;
        s(mi, ni) = masked ? -INFINITY : s(mi, ni);
      }
    }
  }

  // Backward: one (query block, key block) tile whose first query is q0 and first key k0. With
  // kTransposed the tile is S^T, i.e. coords are (key, query).
  // fill: what a masked element becomes (-inf for scores, 0 for probabilities).
  template <bool kSeqlenMask, bool kRightMask, bool kLeftMask, bool kTransposed, class TensorS, class TensorC>
  CUTE_DEVICE void apply_bwd(TensorS& s, TensorC const& coords, int q0, int k0, float fill = -INFINITY) const {
    constexpr bool kRight = kHasRight && kRightMask, kLeft = kHasLeft && kLeftMask;
    if constexpr (!kSeqlenMask && !kRight && !kLeft) return;
    int const key_limit = seqlen_k - k0;       // local keys at or past this are padding
    int const diagonal = diag() + q0 - k0;     // local key c is on local row r's diagonal iff c == r + diagonal
    // Score i's (key - query) is score 0's plus a constant of the tile's layout (coords(0) is at layout offset
    // 0), so each test is one compare of that constant against a per-thread limit: computing (k - q) per score
    // made ptxas keep the loop-invariant differences live across the loop and spill them.
    constexpr int K = kTransposed ? 0 : 1, Q = kTransposed ? 1 : 0;
    auto const c0 = coords(0);
    int const kq0 = int(get<K>(c0)) - int(get<Q>(c0));
    int const right_limit = kRight ? diagonal + right() - kq0 : 0, left_limit = kLeft ? diagonal - left() - kq0 : 0;
    int const key_lim = key_limit - int(get<K>(c0));
    // Every test evaluated and one select: with short-circuit tests ptxas branched around each score's
    // (BSSY/BSYNC per score in the window kernels, ~10 instructions each).
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) {
      auto const off = coords.layout()(i);
      int const dk = int(get<K>(off)), dkq = dk - int(get<Q>(off));
      bool masked = false;
      if constexpr (kSeqlenMask) masked |= dk >= key_lim;
      if constexpr (kRight) masked |= dkq > right_limit;
      if constexpr (kLeft) masked |= dkq < left_limit;
      s(i) = masked ? fill : s(i);
    }
  }
};

}  // namespace flashhopper
