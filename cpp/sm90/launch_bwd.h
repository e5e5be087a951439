// Host launcher of the Hopper backward: carves the caller's workspace, then on one stream
//   1. zeroes the float32 accumulators and semaphores (one memset),
//   2. preprocess: D = rowsum(dO * O) - dLSE and LSE * log2(e) per query row,
//   3. the main kernel (grid: key blocks x query heads x batch),
//   4. postprocess: dQ = softmax_scale * dQ_accum in the input dtype; under GQA also dK, dV.
// Included by the generated translation units, one per (dtype, head dim, causal).
#pragma once

#include <cuda_runtime.h>

#include <cutlass/numeric_types.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "../common/block_info.h"
#include "../common/device_info.h"
#include "../common/element_type.h"
#include "../common/params.h"
#include "../common/postprocess_bwd.h"
#include "../common/preprocess_bwd.h"
#include "../registry.h"
#include "epilogue_bwd.h"
#include "kernel_bwd.h"
#include "mainloop_bwd.h"
#include "tile_scheduler.h"
#include "tile_size.h"

namespace flashhopper {

namespace sm90 {

// Where each piece of the backward's scratch lives in the caller's workspace. The zeroed pieces
// are contiguous so that one memset clears them.
struct BwdWorkspace {
  static constexpr size_t kAlign = 256;
  size_t lse_log2 = 0, dpsum = 0;                      // float (batch, nheads_q, seqlen_q_rounded)
  size_t zero_begin = 0;                               // --- zeroed from here ---
  size_t dq_accum = 0;                                 // float (batch, nheads_q, seqlen_q, headdim)
  size_t dk_accum = 0, dv_accum = 0;                   // GQA: float (batch, nheads_kv, seqlen_k, headdim)
  size_t dq_semaphore = 0, dkv_semaphore = 0;          // deterministic: int per (batch, head, block)
  size_t zero_end = 0, total = 0;
  bool gqa = false;
  int seqlen_q_rounded = 0;

  template <int kBlockM, int kBlockN>
  static BwdWorkspace make(BwdParams const& p) {
    BwdWorkspace w;
    size_t at = 0;
    auto take = [&](size_t bytes) {
      size_t const here = at;
      at += (bytes + kAlign - 1) / kAlign * kAlign;
      return here;
    };
    int64_t const bq = int64_t(p.batch) * p.nheads_q, bkv = int64_t(p.batch) * p.nheads_kv;
    w.gqa = p.nheads_q != p.nheads_kv;
    w.seqlen_q_rounded = ceil_div(p.seqlen_q, kBlockM) * kBlockM;
    w.lse_log2 = take(bq * w.seqlen_q_rounded * sizeof(float));
    w.dpsum = take(bq * w.seqlen_q_rounded * sizeof(float));
    w.zero_begin = at;
    w.dq_accum = take(bq * p.seqlen_q * p.headdim * sizeof(float));
    if (w.gqa) {
      w.dk_accum = take(bkv * p.seqlen_k * p.headdim * sizeof(float));
      w.dv_accum = take(bkv * p.seqlen_k * p.headdim * sizeof(float));
    }
    if (p.deterministic) {
      w.dq_semaphore = take(bq * ceil_div(p.seqlen_q, kBlockM) * sizeof(int));
      if (w.gqa) w.dkv_semaphore = take(bkv * ceil_div(p.seqlen_k, kBlockN) * sizeof(int));
    }
    w.zero_end = at;
    w.total = at;
    return w;
  }

  template <class T>
  T* at(void* base, size_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
  }
};

}  // namespace sm90

template <DType kDType, int kHeadDim, bool kCausal>
size_t bwd_workspace_bytes_sm90(BwdParams const& p) {
  using Tile = sm90::BwdTileSize<kHeadDim, kCausal>;
  return sm90::BwdWorkspace::make<Tile::kBlockM, Tile::kBlockN>(p).total;
}

inline void check_launch(cudaError_t err, char const* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("flashhopper: ") + what + ": " + cudaGetErrorString(err));
}

template <DType kDType, int kHeadDim, bool kCausal>
void run_bwd_sm90(BwdParams const& p, cudaStream_t stream) {
  using namespace cute;
  using Element = typename ElementOf<kDType>::type;
  using Tile = sm90::BwdTileSize<kHeadDim, kCausal>;
  using Mainloop = sm90::BwdMainloop<Element, kHeadDim, Tile, kCausal>;
  using Epilogue = sm90::BwdEpilogue<Mainloop>;
  using Kernel = sm90::BwdKernel<Mainloop, Epilogue>;

  if (p.headdim != kHeadDim) throw std::invalid_argument("flashhopper: head dim does not match the kernel");
  if (p.batch <= 0 || p.seqlen_q <= 0 || p.seqlen_k <= 0 || p.nheads_q <= 0 || p.nheads_kv <= 0) {
    throw std::invalid_argument("flashhopper: the backward launcher needs non-empty inputs (the caller handles empty ones)");
  }
  if (p.nheads_q % p.nheads_kv != 0) throw std::invalid_argument("flashhopper: nheads_q must be a multiple of nheads_kv");
  sm90::BwdWorkspace const ws = sm90::BwdWorkspace::make<Tile::kBlockM, Tile::kBlockN>(p);
  if (p.workspace == nullptr || reinterpret_cast<uintptr_t>(p.workspace) % sm90::BwdWorkspace::kAlign != 0) {
    throw std::invalid_argument("flashhopper: the backward workspace must be a 256-byte aligned device buffer");
  }
  float* lse_log2 = ws.at<float>(p.workspace, ws.lse_log2);
  float* dpsum = ws.at<float>(p.workspace, ws.dpsum);
  float* dq_accum = ws.at<float>(p.workspace, ws.dq_accum);
  float* dk_accum = ws.gqa ? ws.at<float>(p.workspace, ws.dk_accum) : nullptr;
  float* dv_accum = ws.gqa ? ws.at<float>(p.workspace, ws.dv_accum) : nullptr;
  int* dq_sem = p.deterministic ? ws.at<int>(p.workspace, ws.dq_semaphore) : nullptr;
  int* dkv_sem = p.deterministic && ws.gqa ? ws.at<int>(p.workspace, ws.dkv_semaphore) : nullptr;
  DeviceInfo const& dev = device_info(p.device);
  int const num_sms = p.num_sms > 0 ? p.num_sms : dev.num_sms;

  check_launch(cudaMemsetAsync(ws.at<char>(p.workspace, ws.zero_begin), 0, ws.zero_end - ws.zero_begin, stream),
               "backward workspace memset");

  BwdPreprocessParams pre{p.o_ptr, p.do_ptr, p.lse_ptr, p.dlse_ptr, lse_log2, dpsum,
                          p.o_batch_stride, p.o_row_stride, p.o_head_stride,
                          p.do_batch_stride, p.do_row_stride, p.do_head_stride,
                          p.seqlen_q, ws.seqlen_q_rounded, p.nheads_q};
  using Pre = BwdPreprocess<Element, kHeadDim>;
  bwd_preprocess_kernel<Element, kHeadDim><<<Pre::grid(pre, p.batch), Pre::kThreads, 0, stream>>>(pre);
  check_launch(cudaGetLastError(), "backward preprocess launch");

  typename Mainloop::ShapeQKV const shape_q{p.seqlen_q, p.headdim, p.nheads_q, p.batch};
  typename Mainloop::ShapeQKV const shape_k{p.seqlen_k, p.headdim, p.nheads_kv, p.batch};
  auto stride = [](int64_t row, int64_t head, int64_t batch) { return make_stride(row, _1{}, head, batch); };
  typename Kernel::Params const kp{
      Mainloop::make_params(static_cast<Element const*>(p.q_ptr), stride(p.q_row_stride, p.q_head_stride, p.q_batch_stride),
                            static_cast<Element const*>(p.do_ptr), stride(p.do_row_stride, p.do_head_stride, p.do_batch_stride),
                            shape_q, static_cast<Element const*>(p.k_ptr),
                            stride(p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                            static_cast<Element const*>(p.v_ptr), stride(p.v_row_stride, p.v_head_stride, p.v_batch_stride),
                            shape_k, lse_log2, dpsum, dq_accum, dq_sem, ws.seqlen_q_rounded, p.softmax_scale),
      // Without GQA, dK/dV go straight to the outputs, one per query head.
      Epilogue::make_params(static_cast<Element*>(p.dk_ptr), stride(p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride),
                            static_cast<Element*>(p.dv_ptr), stride(p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride),
                            typename Mainloop::ShapeQKV{p.seqlen_k, p.headdim, p.nheads_kv, p.batch}, dk_accum, dv_accum,
                            dkv_sem, p.nheads_q / p.nheads_kv, p.nheads_kv),
      sm90::make_bwd_scheduler_params(ceil_div(p.seqlen_k, Tile::kBlockN), p.batch, p.nheads_q, kCausal,
                                      p.deterministic, num_sms, sm90::kBwdCausalSectionWaves)};

  auto kernel = &sm90::bwd_kernel<Kernel>;
  int const smem_bytes = int(sizeof(typename Kernel::SharedStorage));
  check_launch(set_max_dynamic_smem_once(kernel, p.device, smem_bytes), "cudaFuncSetAttribute");
  dim3 const grid(unsigned(int64_t(ceil_div(p.seqlen_k, Tile::kBlockN)) * p.nheads_q * p.batch));
  kernel<<<grid, Kernel::kNumThreads, smem_bytes, stream>>>(kp);
  check_launch(cudaGetLastError(), "backward kernel launch");

  launch_convert_accum<Element>({dq_accum, p.dq_ptr, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, p.batch,
                                 p.seqlen_q, p.nheads_q, p.headdim, p.softmax_scale},
                                num_sms, stream);
  if (ws.gqa) {
    launch_convert_accum<Element>({dk_accum, p.dk_ptr, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, p.batch,
                                   p.seqlen_k, p.nheads_kv, p.headdim, 1.f},
                                  num_sms, stream);
    launch_convert_accum<Element>({dv_accum, p.dv_ptr, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, p.batch,
                                   p.seqlen_k, p.nheads_kv, p.headdim, 1.f},
                                  num_sms, stream);
  }
  check_launch(cudaGetLastError(), "backward postprocess launch");
}

}  // namespace flashhopper
