// Host launcher of the Hopper backward: carves the caller's workspace, then on one stream
//   1. zeroes the float32 accumulators and semaphores (one memset),
//   2. preprocess: D = rowsum(dO * O) - dLSE and LSE * log2(e) per query row,
//   3. the main kernel (grid: key blocks x query heads x batch),
//   4. postprocess: dQ = softmax_scale * dQ_accum in the input dtype, each query block once the main
//      kernel has counted all its key blocks' additions, launched to run beside the main kernel's
//      tail; under GQA then dK, dV.
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
#include "../common/workspace_bwd.h"
#include "../registry.h"
#include "epilogue_bwd.h"
#include "kernel_bwd.h"
#include "mainloop_bwd.h"
#include "tile_scheduler.h"
#include "tile_size.h"

namespace flashhopper {

template <DType kDType, int kHeadDim, bool kCausal>
size_t bwd_workspace_bytes_sm90(BwdParams const& p) {
  using Tile = sm90::BwdTileSize<kHeadDim, kCausal>;
  return BwdWorkspace::make<Tile::kBlockM, Tile::kBlockN>(p).total;
}

// Steps 3 and 4 with one mainloop instantiation.
template <class Mainloop>
void launch_bwd_main_sm90(BwdParams const& p, BwdWorkspace const& ws, int num_sms, cudaStream_t stream) {
  using namespace cute;
  using Element = typename Mainloop::Element;
  using Epilogue = sm90::BwdEpilogue<Mainloop>;
  using Kernel = sm90::BwdKernel<Mainloop, Epilogue>;
  constexpr bool kCausal = Mainloop::kCausal;
  float* lse_log2 = ws.at<float>(p.workspace, ws.lse_log2);
  float* dpsum = ws.at<float>(p.workspace, ws.dpsum);
  float* dq_accum = ws.at<float>(p.workspace, ws.dq_accum);
  float* dk_accum = ws.gqa ? ws.at<float>(p.workspace, ws.dk_accum) : nullptr;
  float* dv_accum = ws.gqa ? ws.at<float>(p.workspace, ws.dv_accum) : nullptr;
  int* dq_sem = ws.at<int>(p.workspace, ws.dq_semaphore);
  int* dkv_sem = p.deterministic && ws.gqa ? ws.at<int>(p.workspace, ws.dkv_semaphore) : nullptr;

  typename Mainloop::ShapeQKV const shape_q{p.seqlen_q, p.headdim, p.nheads_q, p.batch};
  typename Mainloop::ShapeQKV const shape_k{p.seqlen_k, p.headdim, p.nheads_kv, p.batch};
  auto stride = [](int64_t row, int64_t head, int64_t batch) { return make_stride(row, _1{}, head, batch); };
  typename Kernel::Params const kp{
      Mainloop::make_params(static_cast<Element const*>(p.q_ptr), stride(p.q_row_stride, p.q_head_stride, p.q_batch_stride),
                            static_cast<Element const*>(p.do_ptr), stride(p.do_row_stride, p.do_head_stride, p.do_batch_stride),
                            shape_q, static_cast<Element const*>(p.k_ptr),
                            stride(p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                            static_cast<Element const*>(p.v_ptr), stride(p.v_row_stride, p.v_head_stride, p.v_batch_stride),
                            shape_k, lse_log2, dpsum, dq_accum, dq_sem, p.deterministic, ws.seqlen_q_rounded,
                            p.softmax_scale),
      // Without GQA, dK/dV go straight to the outputs, one per query head.
      Epilogue::make_params(static_cast<Element*>(p.dk_ptr), stride(p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride),
                            static_cast<Element*>(p.dv_ptr), stride(p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride),
                            typename Mainloop::ShapeQKV{p.seqlen_k, p.headdim, p.nheads_kv, p.batch}, dk_accum, dv_accum,
                            dkv_sem, p.nheads_q / p.nheads_kv, p.nheads_kv),
      sm90::make_bwd_scheduler_params(ceil_div(p.seqlen_k, Mainloop::kBlockN), p.batch, p.nheads_q, kCausal,
                                      p.deterministic, num_sms, sm90::kBwdCausalSectionWaves)};

  auto kernel = &sm90::bwd_kernel<Kernel>;
  int const smem_bytes = int(sizeof(typename Kernel::SharedStorage));
  check_launch(set_max_dynamic_smem_once(kernel, p.device, smem_bytes), "cudaFuncSetAttribute");
  dim3 const grid(unsigned(int64_t(ceil_div(p.seqlen_k, Mainloop::kBlockN)) * p.nheads_q * p.batch));
  kernel<<<grid, Kernel::kNumThreads, smem_bytes, stream>>>(kp);
  check_launch(cudaGetLastError(), "backward kernel launch");

  // Fragment-ordered dQ sums (every 64-row tile) are always converted block by block as they complete.
  constexpr int kFragCols = Mainloop::kdQFragOrder ? int(Mainloop::DQCols::value) : 0;
#ifdef FLASHHOPPER_BWD_SERIAL_DQ_CONVERT  // ablation: one pass over dQ after the main kernel
  if constexpr (kFragCols == 0) {
    launch_bwd_postprocess<Element>(p, ws, num_sms, stream);
    return;
  }
#endif
  // dQ block by block as the main kernel completes them (a programmatic dependent launch).
  launch_convert_dq_when_ready<Element, kFragCols>(p, ws, typename Mainloop::BlockInfo{p.seqlen_q, p.seqlen_k},
                                                   num_sms, stream);
  launch_convert_dkv<Element>(p, ws, num_sms, stream);
}

template <DType kDType, int kHeadDim, bool kCausal>
void run_bwd_sm90(BwdParams const& p, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  using Tile = sm90::BwdTileSize<kHeadDim, kCausal>;
  using Mainloop = sm90::BwdMainloop<Element, kHeadDim, Tile, kCausal>;
  check_bwd_params(p, kHeadDim);
  BwdWorkspace const ws = BwdWorkspace::make<Tile::kBlockM, Tile::kBlockN>(p);
  DeviceInfo const& dev = device_info(p.device);
  int const num_sms = p.num_sms > 0 ? p.num_sms : dev.num_sms;

  launch_bwd_preprocess<Element, kHeadDim>(p, ws, stream);
  // The deterministic mode has its own instantiation where dQ would be added from registers: it
  // keeps TMA reduce-adds (mainloop_bwd.h).
  if constexpr (Mainloop::kdQAtomic) {
    if (p.deterministic) {
      launch_bwd_main_sm90<sm90::BwdMainloop<Element, kHeadDim, Tile, kCausal, true>>(p, ws, num_sms, stream);
    } else {
      launch_bwd_main_sm90<Mainloop>(p, ws, num_sms, stream);
    }
  } else {
    launch_bwd_main_sm90<Mainloop>(p, ws, num_sms, stream);
  }
}

}  // namespace flashhopper
