// Host launcher of the Ampere forward kernel: one CTA per (query block, head, batch). The tiles follow
// the shared memory the device allows (sm80::FwdTileSize, as the backward). Included by the generated
// translation units, one per (dtype, head dim, causal); compiled for sm_80 and sm_90.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../common/block_info.h"
#include "../common/device_info.h"
#include "../common/element_type.h"
#include "../common/params.h"
#include "../registry.h"
#include "kernel_fwd.h"
#include "mainloop_fwd.h"
#include "tile_size.h"

namespace flashhopper {

namespace sm80 {

template <DType kDType, int kHeadDim, bool kCausal, int kSmemKB>
struct FwdConfig {
  using Element = typename ElementOf<kDType>::type;
  using Tile = typename FwdTileSize<kHeadDim, kCausal, kSmemKB>::type;
  using Kernel = FwdKernel<FwdMainloop<Element, kHeadDim, Tile, kCausal>>;
  static_assert(Kernel::kSmemBytes <= kSmemKB * 1024, "the tiles must fit their shared-memory class");
};

template <DType kDType, int kHeadDim, bool kCausal, int kSmemKB>
void run_fwd(FwdParams const& p, cudaStream_t stream) {
  using Config = FwdConfig<kDType, kHeadDim, kCausal, kSmemKB>;
  using Element = typename Config::Element;
  using Tile = typename Config::Tile;
  using Kernel = typename Config::Kernel;
  // Offsets inside a key block are 32-bit (sm80::block_rows).
  if (std::max(p.k_row_stride, p.v_row_stride) > INT32_MAX / Tile::kBlockN)
    throw std::invalid_argument("flashhopper: K/V row stride too large for the sm80 kernels");

  typename Kernel::Params const kp{static_cast<Element const*>(p.q_ptr), static_cast<Element const*>(p.k_ptr),
                                   static_cast<Element const*>(p.v_ptr), static_cast<Element*>(p.o_ptr), p.lse_ptr,
                                   p.q_batch_stride, p.q_row_stride, p.q_head_stride,
                                   p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                                   p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                                   p.o_batch_stride, p.o_row_stride, p.o_head_stride,
                                   p.seqlen_q, p.seqlen_k, p.nheads_q, p.nheads_q / p.nheads_kv,
                                   float(p.softmax_scale * M_LOG2E)};
  auto kernel = &fwd_kernel<Kernel>;
  cudaError_t err = set_max_dynamic_smem_once(kernel, p.device, Kernel::kSmemBytes);
  if (err != cudaSuccess) throw std::runtime_error(std::string("flashhopper: cudaFuncSetAttribute: ") + cudaGetErrorString(err));
  dim3 const grid(ceil_div(p.seqlen_q, Tile::kBlockM), p.nheads_q, p.batch);
  kernel<<<grid, Kernel::kNumThreads, Kernel::kSmemBytes, stream>>>(kp);
}

}  // namespace sm80

template <DType kDType, int kHeadDim, bool kCausal>
void run_fwd_sm80(FwdParams const& p, cudaStream_t stream) {
  if (p.headdim != kHeadDim) throw std::invalid_argument("flashhopper: head dim does not match the kernel");
  switch (sm80::smem_class<sm80::FwdConfig, kDType, kHeadDim, kCausal>(p)) {
    case 227: return sm80::run_fwd<kDType, kHeadDim, kCausal, 227>(p, stream);
    case 163: return sm80::run_fwd<kDType, kHeadDim, kCausal, 163>(p, stream);
    default: return sm80::run_fwd<kDType, kHeadDim, kCausal, 99>(p, stream);
  }
}

}  // namespace flashhopper
