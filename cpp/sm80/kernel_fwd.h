// The Ampere forward kernel: one CTA per (query block, head, batch), four warps; composes the
// mainloop and the epilogue. No warp specialization, no persistence: FlashAttention-2's shape.
#pragma once

#include <cute/tensor.hpp>

#include "../common/softmax.h"
#include "epilogue_fwd.h"
#include "mainloop_fwd.h"

namespace flashhopper::sm80 {

using namespace cute;

template <class Mainloop>
struct FwdKernel {
  using Element = typename Mainloop::Element;
  using Epilogue = FwdEpilogue<Mainloop>;
  static constexpr int kNumThreads = Mainloop::kNumThreads;
  static constexpr int kSmemBytes = int(sizeof(typename Mainloop::TensorStorage));

  struct Params {
    Element const* q;
    Element const* k;
    Element const* v;
    Element* o;
    float* lse;  // (batch, nheads_q, seqlen_q)
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int seqlen_q, seqlen_k, nheads_q, heads_ratio;
    float scale_log2;
  };

  CUTE_DEVICE static void run(Params const& p, char* smem) {
    auto& ts = *reinterpret_cast<typename Mainloop::TensorStorage*>(smem);
    // Causal: the last query blocks see the most keys; launch them first (shorter tail; measured
    // +3% at head dim 256, seqlen 2k, neutral elsewhere).
    int const m_block = Mainloop::kCausal ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x);
    int const head = blockIdx.y, batch = blockIdx.z;
    int const kv_head = head / p.heads_ratio;
    Element const* q = p.q + batch * p.q_batch_stride + head * p.q_head_stride;
    Element const* k = p.k + batch * p.k_batch_stride + kv_head * p.k_head_stride;
    Element const* v = p.v + batch * p.v_batch_stride + kv_head * p.v_head_stride;
    Element* o = p.o + batch * p.o_batch_stride + head * p.o_head_stride;
    float* lse = p.lse + (int64_t(batch) * p.nheads_q + head) * p.seqlen_q;

    typename Mainloop::TiledMma tiled_mma;
    Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<Mainloop::kBlockM>, Int<Mainloop::kHeadDim>>{});
    constexpr int kRows = decltype(size<0>(rowcol(acc_o)))::value;
    OnlineSoftmax<kRows> softmax(p.scale_log2);
    if (!Mainloop::mma(ts, q, p.q_row_stride, k, p.k_row_stride, v, p.v_row_stride, p.seqlen_q, p.seqlen_k, m_block,
                       acc_o, softmax)) {
      Epilogue::store_empty(o, p.o_row_stride, lse, p.seqlen_q, m_block);
      return;
    }
    cute::array<float, kRows> row_lse;
    auto const inv_sum = softmax.finalize(row_lse);
    Tensor out = rowcol(acc_o);
    OnlineSoftmax<kRows>::rescale(out, inv_sum);
    Epilogue::store(ts, acc_o, row_lse, o, p.o_row_stride, lse, p.seqlen_q, m_block);
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, 1) fwd_kernel(CUTE_GRID_CONSTANT typename Kernel::Params const p) {
  extern __shared__ __align__(128) char smem[];
  Kernel::run(p, smem);
}

}  // namespace flashhopper::sm80
