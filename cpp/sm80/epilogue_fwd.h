// Ampere forward epilogue: O (normalized, float) converted in registers, staged in Q's shared-memory
// tile (free once the last S = Q K^T is done) and written to global memory in 16-byte rows, clipped
// at seqlen_q; LSE from the threads that own column 0 of each row.
//
// Not run on a GPU yet (written 2026-11-22): issue #5.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

#include "../common/utils.h"

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
    Tensor rO = convert_type<Element>(acc_o);
    auto r2s = make_tiled_copy_C(Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>{}, tiled_mma);
    auto r2s_thr = r2s.get_thread_slice(tid);
    __syncthreads();  // every warp is done reading Q
    copy(r2s, r2s_thr.retile_S(rO), r2s_thr.partition_D(sO));
    __syncthreads();

    int const rows = seqlen_q - m_block * kBlockM;
    Tensor gO = local_tile(Mainloop::rows(o, seqlen_q, o_row_stride), Shape<BM, D>{}, make_coord(m_block, 0));
    auto s2g = make_tiled_copy(Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{},
                               Layout<Shape<Int<Mainloop::kNumThreads / 8>, _8>, Stride<_8, _1>>{},
                               Layout<Shape<_1, _8>>{});
    auto s2g_thr = s2g.get_thread_slice(tid);
    Tensor tOsO = s2g_thr.partition_S(sO);
    Tensor tOgO = s2g_thr.partition_D(gO);
    Tensor tOcO = s2g_thr.partition_D(make_identity_tensor(Shape<BM, D>{}));
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tOgO); ++m) {
      if (get<0>(tOcO(0, m, 0)) < rows) copy(s2g, tOsO(_, m, _), tOgO(_, m, _));
    }

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

  // No row of the tile sees a key (causal with seqlen_q > seqlen_k): O = 0, LSE = -inf.
  CUTE_DEVICE static void store_empty(Element* o, int64_t o_row_stride, float* lse_row, int seqlen_q, int m_block) {
    int const rows = cute::min(int(kBlockM), seqlen_q - m_block * kBlockM);
    constexpr int kVec = 16 / sizeof(Element);
    for (int i = threadIdx.x; i < rows * (kHeadDim / kVec); i += blockDim.x) {
      int const r = i / (kHeadDim / kVec), c = i % (kHeadDim / kVec);
      *reinterpret_cast<uint4*>(o + int64_t(m_block * kBlockM + r) * o_row_stride + c * kVec) = make_uint4(0, 0, 0, 0);
    }
    for (int r = threadIdx.x; r < rows; r += blockDim.x) lse_row[m_block * kBlockM + r] = -INFINITY;
  }
};

}  // namespace flashhopper::sm80
