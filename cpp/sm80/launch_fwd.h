// Host launcher of the Ampere forward kernel: one CTA per (query block, head, batch). Included by
// the generated translation units, one per (dtype, head dim, causal); compiled for sm_80 and sm_90.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
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

template <DType kDType, int kHeadDim, bool kCausal>
void run_fwd_sm80(FwdParams const& p, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  using Tile = sm80::FwdTileSize<kHeadDim, kCausal>;
  using Mainloop = sm80::FwdMainloop<Element, kHeadDim, Tile, kCausal>;
  using Kernel = sm80::FwdKernel<Mainloop>;
  if (p.headdim != kHeadDim) throw std::invalid_argument("flashhopper: head dim does not match the kernel");

  typename Kernel::Params const kp{static_cast<Element const*>(p.q_ptr), static_cast<Element const*>(p.k_ptr),
                                   static_cast<Element const*>(p.v_ptr), static_cast<Element*>(p.o_ptr), p.lse_ptr,
                                   p.q_batch_stride, p.q_row_stride, p.q_head_stride,
                                   p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                                   p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                                   p.o_batch_stride, p.o_row_stride, p.o_head_stride,
                                   p.seqlen_q, p.seqlen_k, p.nheads_q, p.nheads_q / p.nheads_kv,
                                   float(p.softmax_scale * M_LOG2E)};
  auto kernel = &sm80::fwd_kernel<Kernel>;
  cudaError_t err = set_max_dynamic_smem_once(kernel, p.device, Kernel::kSmemBytes);
  if (err != cudaSuccess) throw std::runtime_error(std::string("flashhopper: cudaFuncSetAttribute: ") + cudaGetErrorString(err));
  dim3 const grid(ceil_div(p.seqlen_q, Tile::kBlockM), p.nheads_q, p.batch);
  kernel<<<grid, Kernel::kNumThreads, Kernel::kSmemBytes, stream>>>(kp);
}

}  // namespace flashhopper
