// The Ampere forward kernel: one CTA per (query block, head, batch), four warps; composes the
// mainloop and the epilogue. No warp specialization, no persistence: FlashAttention-2's shape.
#pragma once

#include <cute/tensor.hpp>

#include "../common/seqlen.h"
#include "../common/softmax.h"
#include "epilogue_fwd.h"
#include "mainloop_fwd.h"

namespace flashhopper::sm80 {

using namespace cute;

// Seqlens: UniformSeqlens, or VarlenSeqlens (packed batches: the grid covers the longest entry, the CTAs
// past an entry's rows return at once; the loads and stores are row-predicated at the entry's ends, so
// they never touch a neighbour's rows).
template <class Mainloop, class Seqlens = UniformSeqlens>
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
    float* lse;  // (batch, nheads_q, lse_rows), the batch mode at the entries' batch coordinates
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    Seqlens seqlens;
    int lse_rows;  // seqlen_q; packed batches: total_q
    int nheads_q, heads_ratio;
    int window_left, window_right;
    float const* sinks;  // (nheads_q,) sink logits, or nullptr
    float scale_log2;  // of the softmax's exp2, after the score mod
    typename Mainloop::ScoreMod score_mod;
    typename Mainloop::Dropout dropout;
    // KV caches (Mainloop::kPaged; K/V are pages, the batch strides the page strides): the page table (nullptr:
    // page b for entry b), rows per page; split-KV: num_splits CTAs per query block, each writing its partial O
    // and LSE (float32 (num_splits, batch, nheads_q, seqlen_q, headdim) and (num_splits, batch, nheads_q,
    // seqlen_q)) for the combine kernel (common/combine_splits.h).
    int const* page_table;
    int64_t table_stride;
    cutlass::FastDivmod page_size;
    int num_splits;
    float* o_partial;
    float* lse_partial;
    int batch;
  };

  CUTE_DEVICE static void run(Params const& p, char* smem) {
    auto& ts = *reinterpret_cast<typename Mainloop::TensorStorage*>(smem);
    // Causal: the last query blocks see the most keys; launch them first (shorter tail; measured
    // +3% at head dim 256, seqlen 2k, neutral elsewhere).
    constexpr bool kPaged = Mainloop::kPaged;
    int const splits = kPaged ? p.num_splits : 1;
    int const split = kPaged ? int(blockIdx.x) % splits : 0;
    int const m_index = kPaged ? int(blockIdx.x) / splits : int(blockIdx.x);
    int const m_blocks = kPaged ? int(gridDim.x) / splits : int(gridDim.x);
    int const m_block = Mainloop::kMask != MaskKind::kNone ? m_blocks - 1 - m_index : m_index;
    int const head = blockIdx.y, batch = blockIdx.z;
    int const kv_head = head / p.heads_ratio;
    SeqlenInfo const seq = p.seqlens(batch);
    if (m_block * Mainloop::kBlockM >= seq.seqlen_q) return;  // past the entry's rows
    int64_t const b = seq.batch_coord;
    Element const* q = p.q + b * p.q_batch_stride + head * p.q_head_stride + seq.offset_q * p.q_row_stride;
    // KV caches: the kv head's base; the mainloop adds each row's page and row (PagedRows).
    Element const* k = p.k + kv_head * p.k_head_stride +
                       (kPaged ? 0 : b * p.k_batch_stride + seq.offset_k * p.k_row_stride);
    Element const* v = p.v + kv_head * p.v_head_stride +
                       (kPaged ? 0 : b * p.v_batch_stride + seq.offset_k * p.v_row_stride);
    PagedRows paged;
    if constexpr (kPaged) {
      paged = {p.page_table != nullptr ? p.page_table + batch * p.table_stride : nullptr, p.page_size,
               p.k_batch_stride, p.v_batch_stride, batch, split, splits};
    }
    bool const partial = kPaged && splits > 1;
    // Split-KV: this split's rows of the partial O and LSE.
    int64_t const part_row0 = ((int64_t(split) * p.batch + batch) * p.nheads_q + head) * p.lse_rows;
    Element* o = p.o + b * p.o_batch_stride + head * p.o_head_stride + seq.offset_q * p.o_row_stride;
    float* lse = p.lse + (b * p.nheads_q + head) * p.lse_rows + seq.offset_q;

    // Sink logits (exp2 units): the head's, or per row where GQA-packed rows are query heads (KV caches).
    float const head_sink_log2 = kPaged ? 0.f : sink_log2_of(p.sinks, head);
    auto const row_sink_log2 = [&](int row) {
      if constexpr (kPaged) return sink_log2_of(p.sinks, head, row, seq.rows_per_query);
      else return head_sink_log2;
    };
    typename Mainloop::TiledMma tiled_mma;
    Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<Mainloop::kBlockM>, Int<Mainloop::kHeadDim>>{});
    constexpr int kRows = decltype(size<0>(rowcol(acc_o)))::value;
    OnlineSoftmax<kRows> softmax(p.scale_log2);
    if (!Mainloop::mma(ts, q, p.q_row_stride, k, p.k_row_stride, v, p.v_row_stride, seq, p.window_left,
                       p.window_right, p.score_mod, p.dropout, batch * p.nheads_q + head, m_block, acc_o, softmax,
                       paged)) {
      if (partial) {  // the combine kernel skips a split whose LSE is -inf (its O is never read)
        int const rows = cute::min(int(Mainloop::kBlockM), seq.seqlen_q - m_block * Mainloop::kBlockM);
        for (int r = threadIdx.x; r < rows; r += blockDim.x) p.lse_partial[part_row0 + m_block * Mainloop::kBlockM + r] = -INFINITY;
        return;
      }
      Epilogue::store_empty(o, p.o_row_stride, lse, seq.seqlen_q, m_block,
                            [&](int row) { return row_sink_log2(row) * float(M_LN2); });
      return;
    }
    cute::array<float, kRows> row_lse;
    cute::array<float, kRows> sinks;
    if constexpr (kPaged) {  // a split's partial LSE leaves the sink out: the combine adds it once
      Tensor cO = rowcol(tiled_mma.get_thread_slice(threadIdx.x).partition_C(
          make_identity_tensor(Shape<Int<Mainloop::kBlockM>, Int<Mainloop::kHeadDim>>{})));
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        sinks[mi] = partial ? -INFINITY : row_sink_log2(m_block * Mainloop::kBlockM + int(get<0>(cO(mi, _0{}))));
      }
    } else {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) sinks[mi] = head_sink_log2;
    }
    auto inv_sum = softmax.finalize(row_lse, sinks);
    if constexpr (Mainloop::Dropout::kEnabled) {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) inv_sum[mi] *= p.dropout.scale();
    }
    Tensor out = rowcol(acc_o);
    OnlineSoftmax<kRows>::rescale(out, inv_sum);
    if (partial) {
      Epilogue::store_partial(acc_o, row_lse, p.o_partial, p.lse_partial, part_row0, seq.seqlen_q, m_block);
      return;
    }
    Epilogue::store(ts, acc_o, row_lse, o, p.o_row_stride, lse, seq.seqlen_q, m_block);
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, 1) fwd_kernel(CUTE_GRID_CONSTANT typename Kernel::Params const p) {
  extern __shared__ __align__(128) char smem[];
  Kernel::run(p, smem);
}

}  // namespace flashhopper::sm80
