// Ampere backward epilogue: dK (scaled here by softmax_scale) and dV of one key block leave the
// registers.
//  - one query head per kv head: converted, staged in the K and V tiles and written in 16-byte
//    rows, clipped at seqlen_k;
//  - GQA: every query head of the group adds its share into float32 accumulators (the
//    postprocess converts them).
#pragma once

#include <cute/tensor.hpp>

#include "../common/utils.h"
#include "gemm.h"
#include "mainloop_bwd.h"

namespace flashhopper::sm80 {

using namespace cute;

template <class Mainloop>
struct BwdEpilogue {
  using Element = typename Mainloop::Element;
  static constexpr int kHeadDim = Mainloop::kHeadDim, kBlockN = Mainloop::kBlockN;
  using D = Int<kHeadDim>;
  using BN = Int<kBlockN>;

  template <class FragdKV>
  CUTE_DEVICE static void store(typename Mainloop::TensorStorage& ts, FragdKV const& acc_dk, FragdKV const& acc_dv,
                                Element* dk, int64_t dk_row_stride, Element* dv, int64_t dv_row_stride,
                                int seqlen_k, int n_block) {
    typename Mainloop::TiledMmadKV mma_dkv;
    Tensor sdK = make_tensor(make_smem_ptr(ts.smem_k.data()), typename Mainloop::SmemLayoutKV{});
    Tensor sdV = make_tensor(make_smem_ptr(ts.smem_v.data()), typename Mainloop::SmemLayoutKV{});
    __syncthreads();  // every warp is done reading K and V
    store_fragment(mma_dkv, convert_type<Element>(acc_dk), sdK);
    store_fragment(mma_dkv, convert_type<Element>(acc_dv), sdV);
    __syncthreads();

    int const rows = seqlen_k - n_block * kBlockN;
    auto tile = [&](Element* out, int64_t row_stride) {
      return local_tile(gmem_rows<kHeadDim>(out, seqlen_k, row_stride), Shape<BN, D>{}, make_coord(n_block, 0));
    };
    store_rows<Mainloop::kNumThreads>(sdK, tile(dk, dk_row_stride), rows);
    store_rows<Mainloop::kNumThreads>(sdV, tile(dv, dv_row_stride), rows);
  }

  // GQA: float32 (seqlen_k, headdim) accumulators of this kv head, zeroed before the launch.
  template <class FragdKV>
  CUTE_DEVICE static void reduce(FragdKV const& acc_dk, FragdKV const& acc_dv, float* dk_accum, float* dv_accum,
                                 int seqlen_k, int n_block) {
    typename Mainloop::TiledMmadKV mma_dkv;
    Tensor coords = mma_dkv.get_thread_slice(threadIdx.x).partition_C(make_identity_tensor(Shape<BN, D>{}));
    int const rows = seqlen_k - n_block * kBlockN;
    int64_t const offset = int64_t(n_block) * kBlockN * kHeadDim;
    red_add_fragment(acc_dk, coords, rows, [&](int r, int c) { return dk_accum + offset + r * kHeadDim + c; });
    red_add_fragment(acc_dv, coords, rows, [&](int r, int c) { return dv_accum + offset + r * kHeadDim + c; });
  }
};

}  // namespace flashhopper::sm80
