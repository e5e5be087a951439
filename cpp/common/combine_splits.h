// Split-KV's combine: each split of a row's keys left O_s (normalized within the split, float32) and LSE_s; the
// row's O is sum_s exp(LSE_s - LSE) O_s with LSE = log sum_s exp(LSE_s). One warp per row: the lanes reduce the
// splits' LSEs, then each lane sums the weighted O_s of its headdim / 32 columns (adjacent lanes, adjacent
// columns: coalesced). A split with LSE -inf (no key in its range) has weight 0 and its O_s is never read (it
// was never written). With sinks the row's sink joins once, here: LSE = log (sum_s exp(LSE_s) + exp(sink)).
// Plain CUDA, shared by every kernel family that splits. The kernel and its launcher have internal linkage: the
// sm90 and sm80 translation units instantiate them for different architectures, and one merged host stub would bind
// every launch to one of the two device images (NVIDIA/cub#545).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace flashhopper {

struct CombineParams {
  float const* o_partial = nullptr;    // (num_splits, batch, heads, rows, headdim)
  float const* lse_partial = nullptr;  // (num_splits, batch, heads, rows)
  void* o = nullptr;                   // (batch, rows, heads, headdim) with these element strides
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  float* lse = nullptr;                // (batch, heads, rows) contiguous
  int num_splits = 1, batch = 0, heads = 0, rows = 0;
  // Sink logits (float32 (heads x rows_per_query,), or nullptr), which the splits' partial LSEs leave out: the row's
  // denominator gets exp(sink) once, here. Row r of head h is query head h g + r % g (g = rows_per_query: GQA-packed
  // rows, softmax.h's sink_log2_of).
  float const* sinks = nullptr;
  int rows_per_query = 1;
};

inline constexpr int kCombineWarps = 4;
inline constexpr int kCombineMaxSplits = 256;

namespace {

template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_splits_kernel(CombineParams const p) {
  static_assert(kHeadDim % 64 == 0, "two columns per lane at least, in pairs");
  constexpr int kPer = kHeadDim / 32;
  __shared__ float weights[kCombineWarps][kCombineMaxSplits];
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t const total = int64_t(p.batch) * p.heads * p.rows;
  int64_t const row_id = int64_t(blockIdx.x) * kCombineWarps + warp;  // (batch, head, row) flattened
  if (row_id >= total) return;
  int64_t const split_stride = total;

  int const r = int(row_id % p.rows);
  int64_t const bh = row_id / p.rows;
  int const h = int(bh % p.heads), b = int(bh / p.heads);
  float const sink = p.sinks == nullptr ? -INFINITY : p.sinks[h * p.rows_per_query + r % p.rows_per_query];

  float m = sink;  // the max over the splits' LSEs and the sink
  for (int s = lane; s < p.num_splits; s += 32) m = fmaxf(m, p.lse_partial[s * split_stride + row_id]);
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float sum = 0.f;
  for (int s = lane; s < p.num_splits; s += 32) {
    float const l = p.lse_partial[s * split_stride + row_id];
    float const w = l == -INFINITY ? 0.f : expf(l - m);
    weights[warp][s] = w;
    sum += w;
  }
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (sink != -INFINITY) sum += expf(sink - m);  // (the same on every lane)
  __syncwarp();

  // kBatch splits' loads in flight before their sums: one split at a time, each load waited for in turn, made the
  // combine of 16 splits of one row 6-8 us (decode of 1 x 131072 keys: 32 warps in all; perf-notes, session 48).
  // Splits of weight 0 (or past the last) load nothing: their O_s was never written.
  constexpr int kBatch = 8;
  float acc[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) acc[i] = 0.f;
  for (int s0 = 0; s0 < p.num_splits; s0 += kBatch) {
    float w[kBatch];
    float2 v[kBatch][kPer / 2];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      int const s = s0 + j;
      w[j] = s < p.num_splits ? weights[warp][s] : 0.f;
      float const* src = p.o_partial + (int64_t(s) * split_stride + row_id) * kHeadDim + lane * kPer;
#pragma unroll
      for (int i = 0; i < kPer; i += 2) {
        v[j][i / 2] = w[j] != 0.f ? *reinterpret_cast<float2 const*>(src + i) : make_float2(0.f, 0.f);
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
#pragma unroll
      for (int i = 0; i < kPer; i += 2) {
        acc[i] += w[j] * v[j][i / 2].x;
        acc[i + 1] += w[j] * v[j][i / 2].y;
      }
    }
  }
  float const inv = sum > 0.f ? 1.f / sum : 0.f;
  Element* dst = static_cast<Element*>(p.o) + b * p.o_batch_stride + int64_t(r) * p.o_row_stride +
                 int64_t(h) * p.o_head_stride + lane * kPer;
#pragma unroll
  for (int i = 0; i < kPer; ++i) dst[i] = Element(acc[i] * inv);
  if (lane == 0) p.lse[row_id] = sum > 0.f ? m + logf(sum) : -INFINITY;
}

template <class Element, int kHeadDim>
cudaError_t launch_combine_splits(CombineParams const& p, cudaStream_t stream) {
  int64_t const total = int64_t(p.batch) * p.heads * p.rows;
  if (total == 0) return cudaSuccess;
  int64_t const blocks = (total + kCombineWarps - 1) / kCombineWarps;
  combine_splits_kernel<Element, kHeadDim><<<dim3(unsigned(blocks)), kCombineWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

}  // namespace flashhopper
