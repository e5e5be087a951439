// Backward preprocess, shared by the kernel families: per query row, D = rowsum(dO * O) - dLSE
// (float32) and the LSE in the form the main kernel uses, LSE * log2(e) (+inf where every
// probability is 0: rows that see no key without sinks, and the padding rows up to seqlen_q_rounded;
// with sinks such rows have the sink's finite LSE and their P is 0 by the mask). With sinks,
// also each row's share of the sinks' gradient (the main kernel needs nothing else for sinks: the
// LSE includes them).
// It also zeroes the workspace's semaphores and accumulators (not the sm90 dQ writer's sums, which its first
// key block stores), split evenly over its blocks: one kernel instead of a memset and a kernel (the main kernel
// runs after it on the stream).
// Memory-bound: 16-byte loads and stores, a few threads per row, shuffles to reduce.
#pragma once

#include <cuda_runtime.h>

#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <cmath>
#include <cstdint>

#include "params.h"
#include "seqlen.h"
#include "workspace_bwd.h"

namespace flashhopper {

template <class Seqlens>
struct BwdPreprocessParams {
  void const* o;
  void const* dout;
  float const* lse;   // (batch_coords, nheads, lse_rows) contiguous, natural log
  float const* dlse;  // same layout, or nullptr
  float* lse_log2;    // (batch_coords, nheads, seqlen_q_rounded): each entry's rows from its block-aligned offset
  float* dpsum;       // same
  float const* sinks; // (nheads,) sink logits, or nullptr
  float* dsinks_rows; // with sinks: like lse, each row's share of d(sinks)
  uint4* zero;        // the workspace's zeroed pieces (BwdWorkspace::zero_begin..zero_end)
  int64_t zero_vecs;  // their size in 16-byte vectors
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  Seqlens seqlens;
  int seqlen_q;       // the entries' most (the grid)
  int lse_rows;       // seqlen_q (padded batches) or total_q (packed)
  int seqlen_q_rounded, nheads;
};

template <class Element, int kHeadDim, int kBlockM>
struct BwdPreprocess {
  static constexpr int kThreads = 256;
  static constexpr int kVec = 16 / sizeof(Element);
  static constexpr int kVecsPerRow = kHeadDim / kVec;
  // A power of two (the shuffle reduction) dividing the row's vectors: 96 and 192 take 3 vectors each.
  static constexpr int kThreadsPerRow = (kVecsPerRow & -kVecsPerRow) < 32 ? (kVecsPerRow & -kVecsPerRow) : 32;
  static constexpr int kVecsPerThread = kVecsPerRow / kThreadsPerRow;
  static constexpr int kRowsPerBlock = kThreads / kThreadsPerRow;
  static_assert(kHeadDim % kVec == 0 && kVecsPerRow % kThreadsPerRow == 0);

  template <class Seqlens>
  static dim3 grid(BwdPreprocessParams<Seqlens> const& p, int batch) {
    int const rows = (p.seqlen_q + kBlockM - 1) / kBlockM * kBlockM;  // every entry's, padding rows included
    return dim3((rows + kRowsPerBlock - 1) / kRowsPerBlock, p.nheads, batch);
  }
};

template <class Element, int kHeadDim, int kBlockM, class Seqlens>
__global__ void __launch_bounds__(BwdPreprocess<Element, kHeadDim, kBlockM>::kThreads)
    bwd_preprocess_kernel(BwdPreprocessParams<Seqlens> const p) {
  using Cfg = BwdPreprocess<Element, kHeadDim, kBlockM>;
  using Vec = cutlass::Array<Element, Cfg::kVec>;
  int const head = blockIdx.y, batch = blockIdx.z;
  {  // This block's share of the zeroing, before the early return below: every block takes one.
    int64_t const blocks = int64_t(gridDim.x) * gridDim.y * gridDim.z;
    int64_t const block = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    int64_t const per = (p.zero_vecs + blocks - 1) / blocks;
    int64_t const end = min(block * per + per, p.zero_vecs);
    for (int64_t i = block * per + threadIdx.x; i < end; i += Cfg::kThreads) p.zero[i] = make_uint4(0, 0, 0, 0);
  }
  SeqlenInfo const seq = p.seqlens(batch);
  int const rows_rounded = (seq.seqlen_q + kBlockM - 1) / kBlockM * kBlockM;  // this entry's, with padding rows
  if (int(blockIdx.x) * Cfg::kRowsPerBlock >= rows_rounded) return;  // past the entry (block-uniform)
  int const row = blockIdx.x * Cfg::kRowsPerBlock + threadIdx.x / Cfg::kThreadsPerRow;
  int const part = threadIdx.x % Cfg::kThreadsPerRow;
  int64_t const b = seq.batch_coord;

  float dot = 0.f;
  if (row < seq.seqlen_q) {
    int64_t const r = seq.offset_q + row;
    auto const* o = static_cast<Element const*>(p.o) + b * p.o_batch_stride + r * p.o_row_stride +
                    head * p.o_head_stride + part * Cfg::kVec;
    auto const* d = static_cast<Element const*>(p.dout) + b * p.do_batch_stride + r * p.do_row_stride +
                    head * p.do_head_stride + part * Cfg::kVec;
    cutlass::NumericArrayConverter<float, Element, Cfg::kVec> to_float;
#pragma unroll
    for (int j = 0; j < Cfg::kVecsPerThread; ++j) {
      auto const of = to_float(reinterpret_cast<Vec const*>(o)[j * Cfg::kThreadsPerRow]);
      auto const df = to_float(reinterpret_cast<Vec const*>(d)[j * Cfg::kThreadsPerRow]);
#pragma unroll
      for (int i = 0; i < Cfg::kVec; ++i) dot += of[i] * df[i];
    }
  }
#pragma unroll
  for (int offset = Cfg::kThreadsPerRow / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffff, dot, offset);

  if (part == 0 && row < rows_rounded) {
    int64_t const in = (b * p.nheads + head) * p.lse_rows + seq.offset_q + row;  // lse, dlse, dsinks_rows
    int64_t const out = scratch_row0_q<kBlockM>(p.seqlens, seq, batch, head, p.nheads, p.seqlen_q_rounded) + row;
    float lse_log2 = INFINITY, dpsum = 0.f;
    if (row < seq.seqlen_q) {
      float const lse = p.lse[in];
      lse_log2 = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
      dpsum = dot - (p.dlse != nullptr ? p.dlse[in] : 0.f);
    }
    p.lse_log2[out] = lse_log2;
    p.dpsum[out] = dpsum;
    // The sink's probability in the row is exp(sink - lse); d(loss)/d(sink) = -sum over rows of it times D.
    if (p.sinks != nullptr && row < seq.seqlen_q) {
      float const lse = p.lse[in];
      p.dsinks_rows[in] = lse == -INFINITY ? 0.f : -expf(p.sinks[head] - lse) * dpsum;
    }
  }
}

// Run the preprocess into the workspace's statistics and zero its accumulators; kBlockM is the workspace's
// (its per-row pieces are in whole query blocks).
template <class Element, int kHeadDim, int kBlockM, class Seqlens>
void launch_bwd_preprocess(BwdParams const& p, BwdWorkspace const& ws, Seqlens const& seqlens, cudaStream_t stream) {
  static_assert(BwdWorkspace::kAlign % sizeof(uint4) == 0, "the zeroed pieces are whole 16-byte vectors");
  constexpr bool kPacked = Seqlens::kPacked;
  BwdPreprocessParams<Seqlens> pre{p.o_ptr, p.do_ptr, p.lse_ptr, p.dlse_ptr,
                                   ws.at<float>(p.workspace, ws.lse_log2), ws.at<float>(p.workspace, ws.dpsum),
                                   p.sinks_ptr, p.dsinks_rows_ptr,
                                   ws.at<uint4>(p.workspace, ws.zero_begin),
                                   int64_t((ws.zero_end - ws.zero_begin) / sizeof(uint4)),
                                   p.o_batch_stride, p.o_row_stride, p.o_head_stride,
                                   p.do_batch_stride, p.do_row_stride, p.do_head_stride,
                                   seqlens, p.seqlen_q, kPacked ? p.total_q : p.seqlen_q,
                                   ws.seqlen_q_rounded, p.nheads_q};
  using Pre = BwdPreprocess<Element, kHeadDim, kBlockM>;
  if (p.seqlen_q == 0 || (kPacked && p.total_q == 0)) {  // no query rows: no statistics (an empty grid)
    check_launch(cudaMemsetAsync(pre.zero, 0, ws.zero_end - ws.zero_begin, stream), "backward workspace memset");
    return;
  }
  bwd_preprocess_kernel<Element, kHeadDim, kBlockM, Seqlens><<<Pre::grid(pre, p.batch), Pre::kThreads, 0, stream>>>(pre);
  check_launch(cudaGetLastError(), "backward preprocess launch");
}

}  // namespace flashhopper
