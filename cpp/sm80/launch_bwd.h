// Host launcher of the Ampere backward: carves the caller's workspace, then on one stream the
// shared preprocess (D and LSE per row, the accumulators zeroed), the main kernel (grid: key blocks x
// query heads x batch) and the postprocess (dQ from its fragment-ordered tiles; under GQA the shared dK, dV one).
// The tiles follow the shared memory the device allows (sm80::BwdTileSize: 99 KB on sm_86/sm_89).
// Included by the generated translation units, one per KernelConfig (kernel_key.h); compiled for
// sm_80 and sm_90.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "../common/block_info.h"
#include "../common/device_info.h"
#include "../common/element_type.h"
#include "../common/kernel_key.h"
#include "../common/score_mod.h"
#include "../common/params.h"
#include "../common/postprocess_bwd.h"
#include "../common/preprocess_bwd.h"
#include "../common/workspace_bwd.h"
#include "../registry.h"
#include "kernel_bwd.h"
#include "mainloop_bwd.h"
#include "postprocess_bwd.h"
#include "tile_size.h"

namespace flashhopper {

namespace sm80 {

template <class Config, int kSmemKB>
struct BwdConfig {
  static_assert(Config::kHeadDimV == Config::kHeadDim, "a V head dim of its own is not built yet");
  using Element = typename ElementOf<Config::kDType>::type;
  using Tile = typename BwdTileSize<Config::kHeadDim, Config::kMask != MaskKind::kNone, kSmemKB>::type;
  using Mainloop = BwdMainloop<Element, Config::kHeadDim, Tile, Config::kMask,
                               typename ScoreModOf<Config::kScoreMod>::type, DropoutOf<Config::kDropout>>;
  static constexpr bool kVarlen = Config::kVarlen;
  using Seqlens = std::conditional_t<kVarlen, VarlenSeqlens, UniformSeqlens>;
  using Kernel = BwdKernel<Mainloop, Seqlens>;
  static_assert(Kernel::kSmemBytes <= kSmemKB * 1024, "the tiles must fit their shared-memory class");
  static BwdWorkspace workspace(BwdParams const& p) { return BwdWorkspace::make<Tile::kBlockM, Tile::kBlockN, kVarlen>(p); }
};

template <class Config, int kSmemKB>
size_t bwd_workspace_bytes(BwdParams const& p) {
  return BwdConfig<Config, kSmemKB>::workspace(p).total;
}

template <class Config, int kSmemKB>
int64_t run_bwd(BwdParams const& p, cudaStream_t stream) {
  using C = BwdConfig<Config, kSmemKB>;
  using Element = typename C::Element;
  using Tile = typename C::Tile;
  using Kernel = typename C::Kernel;
  check_bwd_params(p, Config::kHeadDim, Config::kHeadDimV);
  if (int64_t(p.batch) * p.nheads_q == 0) return 0;  // no heads: every gradient is empty
  // Offsets inside a query block are 32-bit (sm80::block_rows).
  if (std::max(p.q_row_stride, p.do_row_stride) > INT32_MAX / Tile::kBlockM)
    throw std::invalid_argument("flashhopper: Q/dO row stride too large for the sm80 kernels");
  if constexpr (C::kVarlen) {
    if (p.cu_seqlens_q == nullptr || p.cu_seqlens_k == nullptr) {
      throw std::invalid_argument("flashhopper: packed-batch kernels need cu_seqlens_q and cu_seqlens_k");
    }
  }
  BwdWorkspace const ws = C::workspace(p);
  auto const seqlens = bwd_seqlens<C::kVarlen>(p, ws);
  int const num_sms = p.num_sms > 0 ? p.num_sms : device_info(p.device).num_sms;

  auto const score_mod = make_score_mod<typename ScoreModOf<Config::kScoreMod>::type>(p.softmax_scale, p.softcap);
  auto const dropout = make_dropout<typename C::Mainloop::Dropout>(p.dropout_rng, p.dropout_threshold);
  launch_bwd_preprocess<Element, Config::kHeadDimV, Tile::kBlockM>(p, ws, seqlens, stream);

  // Packed: over the longest entry's key blocks (seqlen_k), each entry's CTAs past its keys returning at once;
  // the batch strides are unused (one batch coordinate).
  dim3 const grid(ceil_div(p.seqlen_k, Tile::kBlockN), p.nheads_q, p.batch);
  int64_t const ctas = int64_t(grid.x) * grid.y * grid.z;
  if (ctas > 0) {
    typename Kernel::Params const kp{
        static_cast<Element const*>(p.q_ptr), static_cast<Element const*>(p.k_ptr),
        static_cast<Element const*>(p.v_ptr), static_cast<Element const*>(p.do_ptr),
        static_cast<Element*>(p.dk_ptr), static_cast<Element*>(p.dv_ptr),
        ws.at<float>(p.workspace, ws.lse_log2), ws.at<float>(p.workspace, ws.dpsum),
        ws.at<float>(p.workspace, ws.dq_accum),
        ws.gqa ? ws.at<float>(p.workspace, ws.dk_accum) : nullptr,
        ws.gqa ? ws.at<float>(p.workspace, ws.dv_accum) : nullptr,
        p.deterministic ? ws.at<int>(p.workspace, ws.dq_semaphore) : nullptr,
        p.deterministic && ws.gqa ? ws.at<int>(p.workspace, ws.dkv_semaphore) : nullptr,
        p.q_batch_stride, p.q_row_stride, p.q_head_stride,
        p.k_batch_stride, p.k_row_stride, p.k_head_stride,
        p.v_batch_stride, p.v_row_stride, p.v_head_stride,
        p.do_batch_stride, p.do_row_stride, p.do_head_stride,
        p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride,
        p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride,
        seqlens, ws.seqlen_q_rounded, p.nheads_q, p.nheads_kv, ws.rows_k, ws.n_blocks_k,
        p.window_left, p.window_right, score_mod.softmax_scale_log2(float(p.softmax_scale * M_LOG2E)),
        p.softmax_scale, score_mod, dropout};
    auto kernel = &bwd_kernel<Kernel>;
    check_launch(raise_max_dynamic_smem(kernel, p.device, Kernel::kSmemBytes), "cudaFuncSetAttribute");
    kernel<<<grid, Kernel::kNumThreads, Kernel::kSmemBytes, stream>>>(kp);
    check_launch(cudaGetLastError(), "backward kernel launch");
  }

  // dQ from its fragment-ordered tiles (zero without keys: the accumulator stays zeroed); dK, dV
  // (GQA) as on sm90.
  if (p.seqlen_q > 0) {
    using Convert = ConvertdQ<typename C::Mainloop, typename C::Seqlens>;
    typename Convert::Params const cp{ws.at<float>(p.workspace, ws.dq_accum), static_cast<Element*>(p.dq_ptr),
                                      p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride,
                                      seqlens, ws.seqlen_q_rounded, p.nheads_q, p.softmax_scale};
    auto convert = &convert_dq_kernel<typename C::Mainloop, typename C::Seqlens>;
    check_launch(raise_max_dynamic_smem(convert, p.device, Convert::kSmemBytes), "cudaFuncSetAttribute");
    convert<<<dim3(ceil_div(p.seqlen_q, Tile::kBlockM), p.nheads_q, p.batch), Kernel::kNumThreads,
              Convert::kSmemBytes, stream>>>(cp);
    check_launch(cudaGetLastError(), "backward dQ postprocess launch");
  }
  launch_convert_dkv<Element>(p, ws, num_sms, stream);
  return ctas;
}

}  // namespace sm80

template <class Config>
size_t bwd_workspace_bytes_sm80(BwdParams const& p) {
  switch (sm80::smem_class<sm80::BwdConfig, Config>(p)) {
    case 227: return sm80::bwd_workspace_bytes<Config, 227>(p);
    case 163: return sm80::bwd_workspace_bytes<Config, 163>(p);
    default: return sm80::bwd_workspace_bytes<Config, 99>(p);
  }
}

template <class Config>
int64_t run_bwd_sm80(BwdParams const& p, cudaStream_t stream) {
  switch (sm80::smem_class<sm80::BwdConfig, Config>(p)) {
    case 227: return sm80::run_bwd<Config, 227>(p, stream);
    case 163: return sm80::run_bwd<Config, 163>(p, stream);
    default: return sm80::run_bwd<Config, 99>(p, stream);
  }
}

// The tiles of the largest shared-memory class (what a Hopper or A100 runs).
template <class Config>
TileInfo bwd_tiles_sm80() {
  using Tile = typename sm80::BwdConfig<Config, 227>::Tile;
  return {Tile::kBlockM, Tile::kBlockN};
}

}  // namespace flashhopper
