// Backward preprocess, shared by the kernel families: per query row, D = rowsum(dO * O) - dLSE
// (float32) and the LSE in the form the main kernel uses, LSE * log2(e) (+inf where every
// probability is 0: rows that see no key without sinks, and the padding rows up to seqlen_q_rounded;
// with sinks such rows have the sink's finite LSE and their P is 0 by the mask). With sinks,
// also each row's share of the sinks' gradient (the main kernel needs nothing else for sinks: the
// LSE includes them).
// Memory-bound: 16-byte loads, a few threads per row, shuffles to reduce.
#pragma once

#include <cuda_runtime.h>

#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <cmath>
#include <cstdint>

#include "params.h"
#include "workspace_bwd.h"

namespace flashhopper {

struct BwdPreprocessParams {
  void const* o;
  void const* dout;
  float const* lse;   // (batch, nheads, seqlen_q) contiguous, natural log
  float const* dlse;  // same layout, or nullptr
  float* lse_log2;    // (batch, nheads, seqlen_q_rounded)
  float* dpsum;       // (batch, nheads, seqlen_q_rounded)
  float const* sinks; // (nheads,) sink logits, or nullptr
  float* dsinks_rows; // with sinks: (batch, nheads, seqlen_q), each row's share of d(sinks)
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int seqlen_q, seqlen_q_rounded, nheads;
};

template <class Element, int kHeadDim>
struct BwdPreprocess {
  static constexpr int kThreads = 256;
  static constexpr int kVec = 16 / sizeof(Element);
  static constexpr int kVecsPerRow = kHeadDim / kVec;
  // A power of two (the shuffle reduction) dividing the row's vectors: 96 and 192 take 3 vectors each.
  static constexpr int kThreadsPerRow = (kVecsPerRow & -kVecsPerRow) < 32 ? (kVecsPerRow & -kVecsPerRow) : 32;
  static constexpr int kVecsPerThread = kVecsPerRow / kThreadsPerRow;
  static constexpr int kRowsPerBlock = kThreads / kThreadsPerRow;
  static_assert(kHeadDim % kVec == 0 && kVecsPerRow % kThreadsPerRow == 0);

  static dim3 grid(BwdPreprocessParams const& p, int batch) {
    return dim3((p.seqlen_q_rounded + kRowsPerBlock - 1) / kRowsPerBlock, p.nheads, batch);
  }
};

template <class Element, int kHeadDim>
__global__ void __launch_bounds__(BwdPreprocess<Element, kHeadDim>::kThreads)
    bwd_preprocess_kernel(BwdPreprocessParams const p) {
  using Cfg = BwdPreprocess<Element, kHeadDim>;
  using Vec = cutlass::Array<Element, Cfg::kVec>;
  int const row = blockIdx.x * Cfg::kRowsPerBlock + threadIdx.x / Cfg::kThreadsPerRow;
  int const part = threadIdx.x % Cfg::kThreadsPerRow;
  int const head = blockIdx.y, batch = blockIdx.z;

  float dot = 0.f;
  if (row < p.seqlen_q) {
    auto const* o = static_cast<Element const*>(p.o) + batch * p.o_batch_stride + row * p.o_row_stride +
                    head * p.o_head_stride + part * Cfg::kVec;
    auto const* d = static_cast<Element const*>(p.dout) + batch * p.do_batch_stride + row * p.do_row_stride +
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

  if (part == 0 && row < p.seqlen_q_rounded) {
    int64_t const bh = int64_t(batch) * p.nheads + head;
    float lse_log2 = INFINITY, dpsum = 0.f;
    if (row < p.seqlen_q) {
      float const lse = p.lse[bh * p.seqlen_q + row];
      lse_log2 = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
      dpsum = dot - (p.dlse != nullptr ? p.dlse[bh * p.seqlen_q + row] : 0.f);
    }
    p.lse_log2[bh * p.seqlen_q_rounded + row] = lse_log2;
    p.dpsum[bh * p.seqlen_q_rounded + row] = dpsum;
    // The sink's probability in the row is exp(sink - lse); d(loss)/d(sink) = -sum over rows of it times D.
    if (p.sinks != nullptr && row < p.seqlen_q) {
      float const lse = p.lse[bh * p.seqlen_q + row];
      p.dsinks_rows[bh * p.seqlen_q + row] = lse == -INFINITY ? 0.f : -expf(p.sinks[head] - lse) * dpsum;
    }
  }
}

// Zero the workspace's accumulators (one memset) and run the preprocess into its statistics.
template <class Element, int kHeadDim>
void launch_bwd_preprocess(BwdParams const& p, BwdWorkspace const& ws, cudaStream_t stream) {
  check_launch(cudaMemsetAsync(ws.at<char>(p.workspace, ws.zero_begin), 0, ws.zero_end - ws.zero_begin, stream),
               "backward workspace memset");
  BwdPreprocessParams pre{p.o_ptr, p.do_ptr, p.lse_ptr, p.dlse_ptr,
                          ws.at<float>(p.workspace, ws.lse_log2), ws.at<float>(p.workspace, ws.dpsum),
                          p.sinks_ptr, p.dsinks_rows_ptr,
                          p.o_batch_stride, p.o_row_stride, p.o_head_stride,
                          p.do_batch_stride, p.do_row_stride, p.do_head_stride,
                          p.seqlen_q, ws.seqlen_q_rounded, p.nheads_q};
  using Pre = BwdPreprocess<Element, kHeadDim>;
  if (p.seqlen_q == 0) return;  // no query rows: no statistics (an empty grid)
  bwd_preprocess_kernel<Element, kHeadDim><<<Pre::grid(pre, p.batch), Pre::kThreads, 0, stream>>>(pre);
  check_launch(cudaGetLastError(), "backward preprocess launch");
}

}  // namespace flashhopper
