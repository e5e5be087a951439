// Host launcher of the Hopper forward kernel: builds the TMA descriptors from the caller's
// pointers and strides, sizes the persistent grid and launches. Included by the generated
// translation units, one per (dtype, head dim, causal).
#pragma once

#include <cuda_runtime.h>

#include <cutlass/numeric_types.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "../common/block_info.h"
#include "../common/device_info.h"
#include "../common/element_type.h"
#include "../common/params.h"
#include "../registry.h"
#include "epilogue_fwd.h"
#include "kernel_fwd.h"
#include "mainloop_fwd.h"
#include "tile_scheduler.h"
#include "tile_size.h"

namespace flashhopper {

template <DType kDType, int kHeadDim, bool kCausal>
void run_fwd_sm90(FwdParams const& p, cudaStream_t stream) {
  using namespace cute;
  using Element = typename ElementOf<kDType>::type;
  using Tile = sm90::FwdTileSize<kHeadDim, kCausal>;
  using Mainloop = sm90::FwdMainloop<Element, kHeadDim, Tile, kCausal>;
  using Epilogue = sm90::FwdEpilogue<Element, kHeadDim, Mainloop::kNumMmaWG, typename Mainloop::SmemLayoutQ,
                                     typename Mainloop::TiledMmaPV>;
  using Scheduler = std::conditional_t<kCausal, sm90::DynamicTileScheduler, sm90::StaticTileScheduler>;
  using Kernel = sm90::FwdKernel<Mainloop, Epilogue, Scheduler>;

  if (p.headdim != kHeadDim) throw std::invalid_argument("flashhopper: head dim does not match the kernel");
  if (Scheduler::kNeedsCounter && p.tile_counter == nullptr) {
    throw std::invalid_argument("flashhopper: causal kernels need a zeroed int32 tile counter (FwdParams.tile_counter)");
  }
  typename Mainloop::ShapeQKV const shape_q{p.seqlen_q, p.headdim, p.nheads_q, p.batch};
  typename Mainloop::ShapeQKV const shape_k{p.seqlen_k, p.headdim, p.nheads_kv, p.batch};
  auto stride = [](int64_t row, int64_t head, int64_t batch) { return make_stride(row, _1{}, head, batch); };

  DeviceInfo const& dev = device_info(p.device);
  int const num_sms = p.num_sms > 0 ? p.num_sms : dev.num_sms;
  int const num_m_blocks = ceil_div(p.seqlen_q, Tile::kBlockM);

  typename Kernel::Params const kp{
      Mainloop::make_params(static_cast<Element const*>(p.q_ptr), stride(p.q_row_stride, p.q_head_stride, p.q_batch_stride),
                            shape_q, static_cast<Element const*>(p.k_ptr),
                            stride(p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                            static_cast<Element const*>(p.v_ptr),
                            stride(p.v_row_stride, p.v_head_stride, p.v_batch_stride), shape_k, p.softmax_scale),
      Epilogue::make_params(static_cast<Element*>(p.o_ptr), shape_q,
                            stride(p.o_row_stride, p.o_head_stride, p.o_batch_stride), p.lse_ptr),
      sm90::make_tile_scheduler_params(num_m_blocks, p.batch, p.nheads_q, p.nheads_q / p.nheads_kv,
                                       int64_t(p.seqlen_k) * p.headdim * 2 * int64_t(sizeof(Element)),
                                       dev.l2_bytes > 0 ? dev.l2_bytes : int64_t(50) << 20, p.tile_counter)};

  auto kernel = &sm90::fwd_kernel<Kernel>;
  int const smem_bytes = int(sizeof(typename Kernel::SharedStorage));
  cudaError_t err = set_max_dynamic_smem_once(kernel, p.device, smem_bytes);
  if (err != cudaSuccess) throw std::runtime_error(std::string("flashhopper: cudaFuncSetAttribute: ") + cudaGetErrorString(err));
  dim3 const grid(sm90::persistent_grid_size(kp.scheduler, num_sms));
  kernel<<<grid, Kernel::kNumThreads, smem_bytes, stream>>>(kp);
}

}  // namespace flashhopper
