// The Ampere backward kernel: one CTA per (key block, query head, batch), every warp on every GEMM;
// composes the mainloop and the epilogue. No warp specialization, no persistence: FlashAttention-2's
// shape. Packed batches (Seqlens = VarlenSeqlens): the grid covers the longest entry's key blocks, the
// CTAs past an entry's keys returning at once; per-row scratch as in common/workspace_bwd.h.
#pragma once

#include <cute/tensor.hpp>

#include "../common/block_info.h"
#include "../common/semaphore.h"
#include "../common/seqlen.h"
#include "../common/workspace_bwd.h"
#include "epilogue_bwd.h"
#include "mainloop_bwd.h"

namespace flashhopper::sm80 {

using namespace cute;

template <class Mainloop, class Seqlens_ = UniformSeqlens>
struct BwdKernel {
  using Seqlens = Seqlens_;
  using Element = typename Mainloop::Element;
  using Epilogue = BwdEpilogue<Mainloop>;
  static constexpr int kNumThreads = Mainloop::kNumThreads;
  static constexpr int kSmemBytes = int(sizeof(typename Mainloop::TensorStorage));

  struct Params {
    Element const *q, *k, *v, *dout;
    Element *dk, *dv;
    float const *lse_log2, *dpsum;  // (batch_coords, nheads_q, seqlen_q_rounded)
    float* dq_accum;                // (batch_coords, nheads_q, seqlen_q_rounded, headdim), tiles in fragment order
    float *dk_accum, *dv_accum;     // GQA: (batch_coords, nheads_kv, rows_k, headdim); else nullptr
    int* dq_semaphore;              // deterministic: one per query block of dq_accum, zeroed; else nullptr
    int* dkv_semaphore;             // deterministic GQA: (batch_coords, nheads_kv, n_blocks_k) zeroed; else nullptr
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t do_batch_stride, do_row_stride, do_head_stride;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
    Seqlens seqlens;
    int seqlen_q_rounded, nheads_q, nheads_kv;
    int rows_k, n_blocks_k;  // of dK/dV's sums and of their counters (common/workspace_bwd.h)
    int window_left, window_right;
    float scale_log2, softmax_scale;
    typename Mainloop::ScoreMod score_mod;
    typename Mainloop::Dropout dropout;
  };

  CUTE_DEVICE static void run(Params const& p, char* smem) {
    auto& ts = *reinterpret_cast<typename Mainloop::TensorStorage*>(smem);
    // Deterministic: last key block first, the order of the dQ turns (BwdMainloop::mma).
    int const n_block = p.dq_semaphore != nullptr ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x);
    int const head = blockIdx.y, batch = blockIdx.z;
    int const kv_head = head / (p.nheads_q / p.nheads_kv);
    int64_t const bh = int64_t(batch) * p.nheads_q + head;
    SeqlenInfo const seq = p.seqlens(batch);
    if (n_block * Mainloop::kBlockN >= seq.seqlen_k) return;  // past a shorter packed entry's keys
    int64_t const b = seq.batch_coord;
    int64_t const row0 = scratch_row0_q<Mainloop::kBlockM>(p.seqlens, seq, batch, head, p.nheads_q, p.seqlen_q_rounded);
    typename Mainloop::Args const args{p.q + b * p.q_batch_stride + head * p.q_head_stride + seq.offset_q * p.q_row_stride,
                                       p.k + b * p.k_batch_stride + kv_head * p.k_head_stride + seq.offset_k * p.k_row_stride,
                                       p.v + b * p.v_batch_stride + kv_head * p.v_head_stride + seq.offset_k * p.v_row_stride,
                                       p.dout + b * p.do_batch_stride + head * p.do_head_stride + seq.offset_q * p.do_row_stride,
                                       p.q_row_stride, p.k_row_stride, p.v_row_stride, p.do_row_stride,
                                       p.lse_log2 + row0, p.dpsum + row0, p.dq_accum + row0 * Mainloop::kHeadDim,
                                       p.dq_semaphore == nullptr ? nullptr : p.dq_semaphore + row0 / Mainloop::kBlockM,
                                       seq, p.window_left, p.window_right, p.scale_log2, p.score_mod, p.dropout,
                                       int(bh)};

    typename Mainloop::TiledMmadKV mma_dkv;
    Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<Mainloop::kBlockN>, Int<Mainloop::kHeadDim>>{});
    Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<Mainloop::kBlockN>, Int<Mainloop::kHeadDim>>{});
    clear(acc_dk);
    clear(acc_dv);
    bool const any = Mainloop::mma(ts, args, n_block, acc_dk, acc_dv);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;  // zero stays zero when !any
    if (p.dk_accum != nullptr) {  // GQA: each query head of the group adds its share
      int64_t const kv = b * p.nheads_kv + kv_head;
      // Deterministic: the group's heads take turns in head order, also those with nothing to add.
      int* sem = p.dkv_semaphore == nullptr
                     ? nullptr
                     : p.dkv_semaphore + scratch_block0_k<Mainloop::kBlockN>(p.seqlens, seq, batch, kv_head,
                                                                             p.nheads_kv, p.n_blocks_k) + n_block;
      if (sem != nullptr) {
        if (threadIdx.x == 0) wait_at_least(sem, head % (p.nheads_q / p.nheads_kv));
        __syncthreads();
      }
      if (any) {
        int64_t const offset = (kv * p.rows_k + seq.offset_k) * Mainloop::kHeadDim;
        Epilogue::reduce(acc_dk, acc_dv, p.dk_accum + offset, p.dv_accum + offset, seq.seqlen_k, n_block);
      }
      if (sem != nullptr) {
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) signal(sem);
      }
      return;
    }
    Epilogue::store(ts, acc_dk, acc_dv,
                    p.dk + b * p.dk_batch_stride + head * p.dk_head_stride + seq.offset_k * p.dk_row_stride,
                    p.dk_row_stride,
                    p.dv + b * p.dv_batch_stride + head * p.dv_head_stride + seq.offset_k * p.dv_row_stride,
                    p.dv_row_stride, seq.seqlen_k, n_block);
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, 1) bwd_kernel(CUTE_GRID_CONSTANT typename Kernel::Params const p) {
  extern __shared__ __align__(128) char smem[];
  Kernel::run(p, smem);
}

}  // namespace flashhopper::sm80
