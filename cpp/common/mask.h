// The attention mask, applied to a score tile in (row, col) view: keys past seqlen_k and, for
// causal, keys after the query (bottom-right aligned) become -inf. Shared by sm80 and sm90;
// `coords` holds the (row, col) of each score inside the tile, from the MMA's own partitioning;
// row_offset is the global index of the tile's row 0. The backward's tiles may be transposed
// (rows = keys), so it has its own entry point.
#pragma once

#include <cute/tensor.hpp>
#include <cmath>

namespace flashhopper {

template <int kBlockN, bool kCausal>
struct Mask {
  int seqlen_q, seqlen_k;

  template <bool kSeqlenMask, bool kCausalMask, class TensorS, class TensorC>
  CUTE_DEVICE void apply(TensorS& s, TensorC const& coords, int row_offset, int n_block) const {
    static_assert(decltype(rank(s))::value == 2 && decltype(rank(coords))::value == 2);
    if constexpr (!kSeqlenMask && !(kCausal && kCausalMask)) return;
    int const col_offset = n_block * kBlockN;
    int const seqlen_limit = seqlen_k - col_offset;
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(s); ++mi) {
      int col_limit = seqlen_limit;
      if constexpr (kCausal && kCausalMask) {
        int const row = row_offset + int(get<0>(coords(mi, 0)));
        int const causal_limit = row + 1 + seqlen_k - seqlen_q - col_offset;
        col_limit = kSeqlenMask ? cute::min(col_limit, causal_limit) : causal_limit;
      }
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s); ++ni) {
        if (int(get<1>(coords(mi, ni))) >= col_limit) s(mi, ni) = -INFINITY;
      }
    }
  }

  // Backward: one (query block, key block) tile whose first query is q0 and first key k0. With
  // kTransposed the tile is S^T, i.e. coords are (key, query).
  template <bool kSeqlenMask, bool kCausalMask, bool kTransposed, class TensorS, class TensorC>
  CUTE_DEVICE void apply_bwd(TensorS& s, TensorC const& coords, int q0, int k0) const {
    if constexpr (!kSeqlenMask && !(kCausal && kCausalMask)) return;
    int const key_limit = seqlen_k - k0;           // local keys at or past this are padding
    int const diagonal = seqlen_k - seqlen_q + q0 - k0;  // local key c is visible to local row r iff c <= r + diagonal
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) {
      int const q = int(get<kTransposed ? 1 : 0>(coords(i)));
      int const k = int(get<kTransposed ? 0 : 1>(coords(i)));
      bool masked = kSeqlenMask && k >= key_limit;
      if constexpr (kCausal && kCausalMask) masked = masked || k > q + diagonal;
      if (masked) s(i) = -INFINITY;
    }
  }
};

}  // namespace flashhopper
