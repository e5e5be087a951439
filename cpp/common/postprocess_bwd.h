// Backward postprocess, shared by the kernel families: a float32 accumulator (batch, nheads,
// seqlen, headdim), contiguous, times a scale, converted into a (batch, seqlen, nheads, headdim)
// gradient with the caller's strides. Used for dQ (scale = softmax_scale) and, under GQA, for the
// dK/dV sums over each group. Memory-bound: 8 elements per thread, 16-byte stores.
#pragma once

#include <cuda_runtime.h>

#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <algorithm>
#include <cstdint>

#include "params.h"
#include "workspace_bwd.h"

namespace flashhopper {

struct ConvertAccumParams {
  float const* accum;
  void* out;
  int64_t batch_stride, row_stride, head_stride;  // of out, in elements
  int batch, seqlen, nheads, headdim;
  float scale;
};

template <class Element>
__global__ void __launch_bounds__(256) convert_accum_kernel(ConvertAccumParams const p) {
  constexpr int kVec = 8;
  int64_t const vecs_per_row = p.headdim / kVec;
  int64_t const total = int64_t(p.batch) * p.nheads * p.seqlen * vecs_per_row;
  cutlass::NumericArrayConverter<Element, float, kVec> convert;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = i / vecs_per_row;
    int const col = int(i - rest * vecs_per_row) * kVec;
    int const row = int(rest % p.seqlen);
    rest /= p.seqlen;
    int const head = int(rest % p.nheads);
    int const batch = int(rest / p.nheads);
    auto const* src = reinterpret_cast<cutlass::Array<float, kVec> const*>(p.accum + i * kVec);
    cutlass::Array<float, kVec> v = *src;
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] *= p.scale;
    auto* dst = static_cast<Element*>(p.out) + batch * p.batch_stride + row * p.row_stride + head * p.head_stride + col;
    *reinterpret_cast<cutlass::Array<Element, kVec>*>(dst) = convert(v);
  }
}

template <class Element>
void launch_convert_accum(ConvertAccumParams const& p, int num_sms, cudaStream_t stream) {
  int64_t const total = int64_t(p.batch) * p.nheads * p.seqlen * (p.headdim / 8);
  if (total == 0) return;
  int const blocks = int(std::min<int64_t>((total + 255) / 256, int64_t(num_sms) * 8));
  convert_accum_kernel<Element><<<blocks, 256, 0, stream>>>(p);
}

// Under GQA, dK and dV from their float32 sums over each group.
template <class Element>
void launch_convert_dkv(BwdParams const& p, BwdWorkspace const& ws, int num_sms, cudaStream_t stream) {
  if (!ws.gqa) return;
  launch_convert_accum<Element>({ws.at<float>(p.workspace, ws.dk_accum), p.dk_ptr, p.dk_batch_stride, p.dk_row_stride,
                                 p.dk_head_stride, p.batch, p.seqlen_k, p.nheads_kv, p.headdim, 1.f},
                                num_sms, stream);
  launch_convert_accum<Element>({ws.at<float>(p.workspace, ws.dv_accum), p.dv_ptr, p.dv_batch_stride, p.dv_row_stride,
                                 p.dv_head_stride, p.batch, p.seqlen_k, p.nheads_kv, p.headdim, 1.f},
                                num_sms, stream);
  check_launch(cudaGetLastError(), "backward dK/dV postprocess launch");
}

// dQ = softmax_scale * dQ_accum (row-major (batch, nheads_q, seqlen_q, headdim)) in the input dtype;
// under GQA also dK and dV.
template <class Element>
void launch_bwd_postprocess(BwdParams const& p, BwdWorkspace const& ws, int num_sms, cudaStream_t stream) {
  launch_convert_accum<Element>({ws.at<float>(p.workspace, ws.dq_accum), p.dq_ptr, p.dq_batch_stride, p.dq_row_stride,
                                 p.dq_head_stride, p.batch, p.seqlen_q, p.nheads_q, p.headdim, p.softmax_scale},
                                num_sms, stream);
  check_launch(cudaGetLastError(), "backward dQ postprocess launch");
  launch_convert_dkv<Element>(p, ws, num_sms, stream);
}

}  // namespace flashhopper
