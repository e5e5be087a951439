// Sequence bounds of one batch entry: where its rows start in the global Q/O and K/V tensors and
// how many there are. The kernels never read sequence lengths from their params directly: each
// (tile, batch entry) builds a SeqlenInfo through its family's Seqlens policy and hands it to the
// block ranges (block_info.h), the mask, the loads and the stores.
//
// UniformSeqlens (today's only policy): every entry has the params' seqlen_q / seqlen_k and is
// addressed through the tensors' batch mode, so the row offsets are 0 (constants once inlined: no
// cost). A packed batch (varlen, cu_seqlens / seqused) or a KV cache (cache_seqlens) is another
// policy filling the same fields from device arrays: offsets from cu_seqlens with batch_coord 0 over
// a (total_rows, ...) view. kTmaClipsRows then becomes false: TMA only clips at the end of the whole
// packed tensor, so a store must not let it clip a tile at an entry's end (epilogue_fwd.h says where).
#pragma once

#include <cute/config.hpp>

namespace flashhopper {

struct SeqlenInfo {
  int offset_q = 0, offset_k = 0;  // the entry's first row in the row mode of Q/O and of K/V
  int seqlen_q = 0, seqlen_k = 0;  // its rows (queries) and keys
  int batch_coord = 0;             // its coordinate in the tensors' batch mode
};

struct UniformSeqlens {
  int seqlen_q = 0, seqlen_k = 0;
  // Each entry is a slice of the batch mode, which TMA bounds by the entry's own length.
  static constexpr bool kTmaClipsRows = true;
  CUTE_HOST_DEVICE SeqlenInfo operator()(int batch) const { return {0, 0, seqlen_q, seqlen_k, batch}; }
};

}  // namespace flashhopper

// Device code only (CuTe tensors; the host-only bindings include the bounds above for the tests).
#if defined(__CUDACC__)
#include <cute/tensor.hpp>

namespace flashhopper {

// The (rows, headdim) slice of a (rows, headdim, head, batch) tensor that holds one entry's rows of
// one head: m(_, _, head, batch_coord) from row `offset` on.
template <class Tensor4>
CUTE_HOST_DEVICE auto entry_rows(Tensor4 const& m, int offset, int head, int batch_coord) {
  using namespace cute;
  return domain_offset(make_coord(offset, _0{}), m(_, _, head, batch_coord));
}

}  // namespace flashhopper
#endif
