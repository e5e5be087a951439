// Ampere forward epilogue: O (normalized, float) converted in registers, staged in Q's shared-memory
// tile (free once the last S = Q K^T is done) and written to global memory in 16-byte rows, clipped
// at seqlen_q; LSE from the threads that own column 0 of each row.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

#include "../common/utils.h"
#include "gemm.h"

namespace flashhopper::sm80 {

using namespace cute;

template <class Mainloop>
struct FwdEpilogue {
  using Element = typename Mainloop::Element;
  static constexpr int kBlockM = Mainloop::kBlockM, kHeadDim = Mainloop::kHeadDim;
  using BM = Int<kBlockM>;
  using D = Int<kHeadDim>;

  template <class FragO, class LSE>
  CUTE_DEVICE static void store(typename Mainloop::TensorStorage& ts, FragO const& acc_o, LSE const& lse, Element* o,
                                int64_t o_row_stride, float* lse_row, int seqlen_q, int m_block) {
    int const tid = threadIdx.x;
    typename Mainloop::TiledMma tiled_mma;
    Tensor sO = make_tensor(make_smem_ptr(ts.smem_q.data()), typename Mainloop::SmemLayoutQ{});
    __syncthreads();  // every warp is done reading Q
    store_fragment(tiled_mma, convert_type<Element>(acc_o), sO);
    __syncthreads();

    int const rows = seqlen_q - m_block * kBlockM;
    Tensor gO = local_tile(Mainloop::rows(o, seqlen_q, o_row_stride), Shape<BM, D>{}, make_coord(m_block, 0));
    store_rows<Mainloop::kNumThreads>(sO, gO, rows);

    auto thr_mma = tiled_mma.get_thread_slice(tid);
    Tensor cO = rowcol(thr_mma.partition_C(make_identity_tensor(Shape<BM, D>{})));
    if (get<1>(cO(_0{}, _0{})) == 0) {  // one thread of each quad owns the row's LSE
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(cO); ++mi) {
        int const row = int(get<0>(cO(mi, _0{})));
        if (row < rows) lse_row[m_block * kBlockM + row] = lse[mi];
      }
    }
  }

  // Split-KV: this CTA's rows of O (normalized within the split, float) and their LSE, straight from registers to
  // the split's partial rows (row0: its first, in rows of the (split, batch, head) block of seqlen_q rows).
  template <class FragO, class LSE>
  CUTE_DEVICE static void store_partial(FragO const& acc_o, LSE const& lse, float* o_partial, float* lse_partial,
                                        int64_t row0, int seqlen_q, int m_block) {
    typename Mainloop::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(threadIdx.x);
    Tensor cO = rowcol(thr_mma.partition_C(make_identity_tensor(Shape<BM, D>{})));
    Tensor o = rowcol(acc_o);
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(cO); ++mi) {
      int const row = m_block * kBlockM + int(get<0>(cO(mi, _0{})));
      if (row >= seqlen_q) continue;
      float* dst = o_partial + (row0 + row) * kHeadDim;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(cO); ++ni) dst[get<1>(cO(mi, ni))] = o(mi, ni);
      if (get<1>(cO(mi, _0{})) == 0) lse_partial[row0 + row] = lse[mi];
    }
  }

  // No row of the tile sees a key (causal with seqlen_q > seqlen_k): O = 0, LSE = empty_lse(row) (-inf, or the
  // row's sink logit).
  template <class EmptyLse>
  CUTE_DEVICE static void store_empty(Element* o, int64_t o_row_stride, float* lse_row, int seqlen_q, int m_block,
                                      EmptyLse const& empty_lse) {
    int const rows = cute::min(int(kBlockM), seqlen_q - m_block * kBlockM);
    constexpr int kVec = 16 / sizeof(Element);
    for (int i = threadIdx.x; i < rows * (kHeadDim / kVec); i += blockDim.x) {
      int const r = i / (kHeadDim / kVec), c = i % (kHeadDim / kVec);
      *reinterpret_cast<uint4*>(o + int64_t(m_block * kBlockM + r) * o_row_stride + c * kVec) = make_uint4(0, 0, 0, 0);
    }
    for (int r = threadIdx.x; r < rows; r += blockDim.x) lse_row[m_block * kBlockM + r] = empty_lse(m_block * kBlockM + r);
  }
};

}  // namespace flashhopper::sm80
