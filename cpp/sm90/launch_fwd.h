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
  using Tile = sm90::FwdTileSize<kHeadDim, kCausal, kDType>;
  using Mainloop = sm90::FwdMainloop<Element, kHeadDim, Tile, kCausal>;
  using ElementOut = typename Mainloop::ElementOut;
  constexpr bool kFp8 = Mainloop::kFp8;
  // FP8 stages O in a buffer of its own; 16-bit O goes through the Q stage the tile used.
  using SmemLayoutO = std::conditional_t<kFp8, typename Mainloop::SmemLayoutO, typename Mainloop::SmemLayoutQ>;
  using Epilogue = sm90::FwdEpilogue<ElementOut, kHeadDim, Mainloop::kNumMmaWG, SmemLayoutO,
                                     typename Mainloop::TiledMmaPV, kFp8>;
  using Scheduler = std::conditional_t<kCausal, sm90::DynamicTileScheduler, sm90::StaticTileScheduler>;
  using Kernel = sm90::FwdKernel<Mainloop, Epilogue, Scheduler>;

  if (p.headdim != kHeadDim) throw std::invalid_argument("flashhopper: head dim does not match the kernel");
  if (Scheduler::kNeedsCounter && p.tile_counter == nullptr) {
    throw std::invalid_argument("flashhopper: causal kernels need a zeroed int32 tile counter (FwdParams.tile_counter)");
  }
  typename Mainloop::ShapeQKV const shape_q{p.seqlen_q, p.headdim, p.nheads_q, p.batch};
  typename Mainloop::ShapeQKV const shape_k{p.seqlen_k, p.headdim, p.nheads_kv, p.batch};
  auto stride = [](int64_t row, int64_t head, int64_t batch) { return make_stride(row, _1{}, head, batch); };
  typename Mainloop::Descales descale{};
  if constexpr (kFp8) {
    if (p.q_scale_ptr == nullptr || p.k_scale_ptr == nullptr || p.v_scale_ptr == nullptr) {
      throw std::invalid_argument("flashhopper: fp8 kernels need q, k and v descales");
    }
    // A tile must not straddle two scale blocks (one block covering the whole sequence is fine).
    auto misaligned = [](int block, int64_t block_stride, int tile, int seqlen) {
      return block_stride != 0 && block < seqlen && block % tile != 0;
    };
    if (misaligned(p.q_scale_block, p.q_scale_block_stride, 64, p.seqlen_q)) {
      throw std::invalid_argument("flashhopper: fp8 q_scale_block must be a multiple of 64");
    }
    if (misaligned(p.k_scale_block, p.k_scale_block_stride, Tile::kBlockN, p.seqlen_k) ||
        misaligned(p.v_scale_block, p.v_scale_block_stride, Tile::kBlockN, p.seqlen_k)) {
      throw std::invalid_argument("flashhopper: fp8 k/v_scale_block must be a multiple of the kernel's block_n (" +
                                  std::to_string(Tile::kBlockN) + ")");
    }
    descale = {{p.q_scale_ptr, p.q_scale_batch_stride, p.q_scale_head_stride, p.q_scale_block_stride, p.q_scale_block},
               {p.k_scale_ptr, p.k_scale_batch_stride, p.k_scale_head_stride, p.k_scale_block_stride, p.k_scale_block},
               {p.v_scale_ptr, p.v_scale_batch_stride, p.v_scale_head_stride, p.v_scale_block_stride, p.v_scale_block}};
  }
  // V^T for FP8: (headdim, keys), head-dim rows v_dim_stride apart; row-major V (like K) where the kernel
  // transposes it (FLASHHOPPER_FP8_V_TRANSPOSE_IN_KERNEL, tile_size.h). The stride that layout does not use
  // is 1 from Python (fp8.fill_fp8_params), which fails this check: V in the other layout is refused.
  constexpr bool kVtInMemory = kFp8 && !Mainloop::kVTransposeInKernel;
  if constexpr (kFp8) {
    int64_t const used = kVtInMemory ? p.v_dim_stride : p.v_row_stride;
    if (used <= 0 || used % 16 != 0) {
      throw std::invalid_argument(
          kVtInMemory ? "flashhopper: this fp8 kernel takes V as V^T (batch, heads, headdim, seqlen_pad): "
                        "v_dim_stride must be a positive multiple of 16"
                      : "flashhopper: this fp8 kernel (built with FLASHHOPPER_FP8_V_TRANSPOSE_IN_KERNEL) takes V "
                        "row-major (batch, seqlen, heads, headdim): v_row_stride must be a positive multiple of 16");
    }
  }
  auto const stride_v = kVtInMemory ? stride(p.v_dim_stride, p.v_head_stride, p.v_batch_stride)
                                    : stride(p.v_row_stride, p.v_head_stride, p.v_batch_stride);

  DeviceInfo const& dev = device_info(p.device);
  int const num_sms = p.num_sms > 0 ? p.num_sms : dev.num_sms;
  int const num_m_blocks = ceil_div(p.seqlen_q, Tile::kBlockM);

  typename Kernel::Params const kp{
      Mainloop::make_params(static_cast<Element const*>(p.q_ptr), stride(p.q_row_stride, p.q_head_stride, p.q_batch_stride),
                            shape_q, static_cast<Element const*>(p.k_ptr),
                            stride(p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                            static_cast<Element const*>(p.v_ptr), stride_v, shape_k, p.softmax_scale, descale),
      Epilogue::make_params(static_cast<ElementOut*>(p.o_ptr), shape_q,
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
