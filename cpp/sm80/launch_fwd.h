// Host launcher of the Ampere forward kernel: one CTA per (query block, head, batch). The tiles follow
// the shared memory the device allows (sm80::FwdTileSize, as the backward). Included by the generated
// translation units, one per KernelConfig (kernel_key.h); compiled for sm_80 and sm_90.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../common/block_info.h"
#include "../common/kvcache_launch.h"
#include "../common/device_info.h"
#include "../common/element_type.h"
#include "../common/kernel_key.h"
#include "../common/score_mod.h"
#include "../common/params.h"
#include "../registry.h"
#include "kernel_fwd.h"
#include "mainloop_fwd.h"
#include "tile_size.h"

namespace flashhopper {

namespace sm80 {

template <class Config, int kSmemKB>
struct FwdConfig {
  static_assert(Config::kHeadDimV == Config::kHeadDim, "a V head dim of its own is not built yet");
  using Element = typename ElementOf<Config::kDType>::type;
  using Tile = typename FwdTileSize<Config::kHeadDim, Config::kMask != MaskKind::kNone, kSmemKB>::type;
  // KV caches (kv_blocks's sm80 counterpart: PagedRows in mainloop_fwd.h): pages, cache_seqlens, split-KV.
  static_assert(!Config::kKVCache || (!Config::kVarlen && !Config::kDropout), "KV-cache kernels: padded, no dropout");
  using Seqlens = std::conditional_t<Config::kVarlen, VarlenSeqlens,
                                     std::conditional_t<Config::kKVCache, CacheSeqlens, UniformSeqlens>>;
  using Kernel = FwdKernel<FwdMainloop<Element, Config::kHeadDim, Tile, Config::kMask,
                                       typename ScoreModOf<Config::kScoreMod>::type, DropoutOf<Config::kDropout>,
                                       Config::kKVCache>,
                           Seqlens>;
  static_assert(Kernel::kSmemBytes <= kSmemKB * 1024, "the tiles must fit their shared-memory class");
};

template <class Config, int kSmemKB>
int64_t run_fwd(FwdParams const& p, cudaStream_t stream) {
  using C = FwdConfig<Config, kSmemKB>;
  using Element = typename C::Element;
  using Tile = typename C::Tile;
  using Kernel = typename C::Kernel;
  // Offsets inside a key block are 32-bit (sm80::block_rows).
  if (std::max(p.k_row_stride, p.v_row_stride) > INT32_MAX / Tile::kBlockN)
    throw std::invalid_argument("flashhopper: K/V row stride too large for the sm80 kernels");
  constexpr bool kKVCache = Config::kKVCache;
  int const num_splits = kKVCache ? kvcache_num_splits(p) : 1;
  // Packed batches: seqlen_q is the longest entry's (its CTAs past an entry's rows return at once). Split-KV:
  // num_splits CTAs per query block, next to each other.
  dim3 const grid(ceil_div(p.seqlen_q, Tile::kBlockM) * num_splits, p.nheads_q, p.batch);
  if constexpr (Config::kVarlen) {
    if (p.cu_seqlens_q == nullptr || p.cu_seqlens_k == nullptr) {
      throw std::invalid_argument("flashhopper: packed-batch kernels need cu_seqlens_q and cu_seqlens_k");
    }
  }
  auto const seqlens = [&] {
    if constexpr (Config::kVarlen) {
      return VarlenSeqlens{p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k, nullptr};
    } else if constexpr (kKVCache) {
      return CacheSeqlens{p.seqlen_q, p.seqlen_k, p.cache_seqlens, std::max(1, p.rows_per_query)};
    } else {
      return UniformSeqlens{p.seqlen_q, p.seqlen_k};
    }
  }();
  auto const score_mod = make_score_mod<typename ScoreModOf<Config::kScoreMod>::type>(p.softmax_scale, p.softcap);
  auto const dropout = make_dropout<DropoutOf<Config::kDropout>>(p.dropout_rng, p.dropout_threshold);
  if (int64_t(grid.x) * grid.y * grid.z == 0) return 0;  // no query rows: an empty grid

  typename Kernel::Params const kp{static_cast<Element const*>(p.q_ptr), static_cast<Element const*>(p.k_ptr),
                                   static_cast<Element const*>(p.v_ptr), static_cast<Element*>(p.o_ptr), p.lse_ptr,
                                   p.q_batch_stride, p.q_row_stride, p.q_head_stride,
                                   p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                                   p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                                   p.o_batch_stride, p.o_row_stride, p.o_head_stride,
                                   seqlens, Config::kVarlen ? p.total_q : p.seqlen_q, p.nheads_q,
                                   p.nheads_q / p.nheads_kv,
                                   p.window_left, p.window_right, p.sinks_ptr,
                                   score_mod.softmax_scale_log2(float(p.softmax_scale * M_LOG2E)), score_mod, dropout,
                                   p.page_table, p.page_table_batch_stride,
                                   cutlass::FastDivmod(kKVCache ? std::max(p.page_size, 1) : 1), num_splits,
                                   static_cast<float*>(p.split_workspace),
                                   p.split_workspace == nullptr ? nullptr
                                       : static_cast<float*>(p.split_workspace) +
                                             int64_t(num_splits) * p.batch * p.nheads_q * p.seqlen_q * p.headdim_v,
                                   p.batch};
  auto kernel = &fwd_kernel<Kernel>;
  cudaError_t err = raise_max_dynamic_smem(kernel, p.device, Kernel::kSmemBytes);
  if (err != cudaSuccess) throw std::runtime_error(std::string("flashhopper: cudaFuncSetAttribute: ") + cudaGetErrorString(err));
  kernel<<<grid, Kernel::kNumThreads, Kernel::kSmemBytes, stream>>>(kp);
  if constexpr (kKVCache) {  // constexpr: the combine is instantiated for the cache's head dims only (not 96, 192)
    if (num_splits > 1) combine_kvcache_splits<Element, Config::kHeadDim>(p, num_splits, kp.o_partial, kp.lse_partial, stream);
  }
  return int64_t(grid.x) * grid.y * grid.z;
}

}  // namespace sm80

template <class Config>
int64_t run_fwd_sm80(FwdParams const& p, cudaStream_t stream) {
  if (p.headdim != Config::kHeadDim) throw std::invalid_argument("flashhopper: head dim does not match the kernel");
  switch (sm80::smem_class<sm80::FwdConfig, Config>(p)) {
    case 227: return sm80::run_fwd<Config, 227>(p, stream);
    case 163: return sm80::run_fwd<Config, 163>(p, stream);
    default: return sm80::run_fwd<Config, 99>(p, stream);
  }
}

// The tiles of the largest shared-memory class (what a Hopper or A100 runs; the report's IO model).
template <class Config>
TileInfo fwd_tiles_sm80() {
  using Tile = typename sm80::FwdConfig<Config, 227>::Tile;
  return {Tile::kBlockM, Tile::kBlockN};
}

}  // namespace flashhopper
