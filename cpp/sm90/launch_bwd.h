// Host launcher of the Hopper backward: carves the caller's workspace, then on one stream
//   1. preprocess: D = rowsum(dO * O) - dLSE and LSE * log2(e) per query row; the same kernel zeroes the
//      semaphores and the float32 accumulators that are added to from the start (not dQ's: its first key block
//      stores),
//   2. the main kernel (grid: key blocks x query heads x batch),
//   3. postprocess: dQ = softmax_scale * dQ_accum in the input dtype, each query block once the main
//      kernel has counted all its key blocks' additions, launched to run beside the main kernel's
//      tail; under GQA then dK, dV.
// Included by the generated translation units, one per KernelConfig (kernel_key.h).
#pragma once

#include <cuda_runtime.h>

#include <cutlass/numeric_types.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../common/block_info.h"
#include "../common/device_info.h"
#include "../common/element_type.h"
#include "../common/kernel_key.h"
#include "../common/params.h"
#include "../common/postprocess_bwd.h"
#include "../common/preprocess_bwd.h"
#include "../common/workspace_bwd.h"
#include "../registry.h"
#include "epilogue_bwd.h"
#include "kernel_bwd.h"
#include "mainloop_bwd.h"
#include "tile_scheduler.h"
#include "variants.h"
#include "varlen_prepare.h"

namespace flashhopper {

namespace sm90 {

// The most key blocks per head with which the dQ writer's first key block stores (BwdConfig::dq_first_stores):
// the waits for the first store grow with the key blocks that reach a query block together, the zeroing saved does
// not. Measured on the H100 (perf-notes, session 34): without a mask a gain at 4 key blocks, even at 8; causal
// +4% at 8, -3% at 16.
inline int dq_first_store_max_blocks(MaskKind mask) { return mask == MaskKind::kNone ? 4 : 8; }

template <class Config>
struct BwdConfig {
  using Element = typename ElementOf<Config::kDType>::type;
  using Tile = std::conditional_t<
      Config::kDropout, BwdDropoutTileSize<Config::kHeadDim, Config::kHeadDimV>,
      std::conditional_t<Config::kScoreMod == ScoreModKind::kSoftcap, BwdSoftcapTileSize<Config::kHeadDim, Config::kHeadDimV>,
                         typename BwdTileOf<typename Config::Variant, Config::kHeadDim, Config::kHeadDimV>::type>>;
  static constexpr bool kVarlen = Config::kVarlen;
  using Seqlens = std::conditional_t<kVarlen, VarlenSeqlens, UniformSeqlens>;
  template <bool kDeterministic>
  using Mainloop = BwdMainloop<Element, Config::kHeadDim, Config::kHeadDimV, Tile, Config::kMask, kDeterministic,
                               typename ScoreModOf<Config::kScoreMod>::type, DropoutOf<Config::kDropout>,
                               ContiguousKVBlocks, Seqlens>;
  // The dQ writer (every instantiation but head dim 256's consumer reds; its deterministic one uses it but keeps the
  // zeroing) stores each query block's first dQ instead of adding it to zeroed sums where that is cheaper: always
  // when deterministic (the first in the order waits for no one), otherwise with few key blocks per head. With
  // many, the key blocks reach each query block at once and all but the first wait for its store to land (d128:
  // 512 tokens +8% non-causal, +18% causal; 2k -6%, 8k -10%: perf-notes, session 34).
  static constexpr bool kDqWriter = !Mainloop<false>::kdQAtomic;
  static bool dq_first_stores(BwdParams const& p) {
    return kDqWriter && (p.deterministic || ceil_div(p.seqlen_k, Tile::kBlockN) <= dq_first_store_max_blocks(Config::kMask));
  }
  static BwdWorkspace workspace(BwdParams const& p) {
    return BwdWorkspace::make<Tile::kBlockM, Tile::kBlockN, kVarlen, /*kTileTable=*/true, kDqWriter>(p, dq_first_stores(p));
  }
};

// Steps 3 and 4 with one mainloop instantiation (packed batches: after the prepare kernel, which patches
// each entry's tensor maps).
template <class Mainloop>
int64_t launch_bwd_main(BwdParams const& params, BwdWorkspace const& ws, int num_sms, cudaStream_t stream) {
  using namespace cute;
  using Element = typename Mainloop::Element;
  using Epilogue = BwdEpilogue<Mainloop>;
  using Kernel = BwdKernel<Mainloop, Epilogue>;
  using Seqlens = typename Mainloop::Seqlens;
  constexpr bool kVarlen = Seqlens::kPacked;
  BwdParams p = params;
  // Packed: (total rows, headdim, heads, 1), each tensor's one batch coordinate given a stride past its rows
  // (tensor maps want strides that are non-zero multiples of 16 bytes).
  int const rows_q = kVarlen ? p.total_q : p.seqlen_q, rows_k = kVarlen ? p.total_k : p.seqlen_k;
  if constexpr (kVarlen) {
    auto past = [](int64_t row_stride, int rows) { return row_stride * std::max(rows, 1); };
    p.q_batch_stride = past(p.q_row_stride, rows_q);
    p.do_batch_stride = past(p.do_row_stride, rows_q);
    p.k_batch_stride = past(p.k_row_stride, rows_k);
    p.v_batch_stride = past(p.v_row_stride, rows_k);
    p.dk_batch_stride = past(p.dk_row_stride, rows_k);
    p.dv_batch_stride = past(p.dv_row_stride, rows_k);
  }
  // With no query rows the kernel loads no Q or dO (every key block's range is empty: dK = dV = 0),
  // but their tensor maps must be valid: extents >= 1 and 16-byte strides over real memory, which
  // empty tensors need not have. K's serve.
  if (rows_q == 0) {
    p.q_ptr = p.do_ptr = p.k_ptr;
    p.q_row_stride = p.do_row_stride = p.k_row_stride;
    p.q_head_stride = p.do_head_stride = p.k_head_stride;
    p.q_batch_stride = p.do_batch_stride = p.k_batch_stride;
  }
  float* lse_log2 = ws.at<float>(p.workspace, ws.lse_log2);
  float* dpsum = ws.at<float>(p.workspace, ws.dpsum);
  float* dq_accum = ws.at<float>(p.workspace, ws.dq_accum);
  float* dk_accum = ws.gqa ? ws.at<float>(p.workspace, ws.dk_accum) : nullptr;
  float* dv_accum = ws.gqa ? ws.at<float>(p.workspace, ws.dv_accum) : nullptr;
  int* dq_sem = ws.at<int>(p.workspace, ws.dq_semaphore);
  // nullptr: every key block adds (to zeroed sums), none waits.
  int* dq_first = ws.dq_first_stores && !p.deterministic ? ws.at<int>(p.workspace, ws.dq_first) : nullptr;
  int* dkv_sem = p.deterministic && ws.gqa ? ws.at<int>(p.workspace, ws.dkv_semaphore) : nullptr;

  Seqlens const seqlens = bwd_seqlens<kVarlen>(p, ws);
  // Packed: the schedule's tile count is known on the device only (varlen_prepare.h): here an upper bound
  // (an entry wastes at most one partial block).
  int const num_n_blocks = ceil_div(p.seqlen_k, Mainloop::kBlockN);
  // Causal: sections of heads (tile_scheduler.h) sized by what a head reads: K, V, Q, dO and the float32 dQ sums.
  // From 2048 keys: below, sections measured 1-2% slower at head dims 64/128 (perf-notes, S39B).
  int64_t const causal_head_bytes =
      Mainloop::kMask == MaskKind::kCausal && !kVarlen && p.seqlen_k >= 2048
          ? (int64_t(p.seqlen_k) + p.seqlen_q) * (p.headdim + p.headdim_v) * int64_t(sizeof(Element)) +
                int64_t(p.seqlen_q) * p.headdim * 4
          : 0;
  int64_t const ctas = kVarlen ? (int64_t(ceil_div(rows_k, Mainloop::kBlockN)) + p.batch) * p.nheads_q
                               : int64_t(num_n_blocks) * p.nheads_q * p.batch;
  if (ctas > 0 && rows_k > 0) {
    int const batch_coords = ws.batch_coords;
    typename Mainloop::ShapeQKV const shape_q{std::max(rows_q, 1), p.headdim, p.nheads_q, batch_coords};
    typename Mainloop::ShapeQKV const shape_k{rows_k, p.headdim, p.nheads_kv, batch_coords};
    auto stride = [](int64_t row, int64_t head, int64_t batch) { return make_stride(row, _1{}, head, batch); };
    typename Kernel::Params kp{
        Mainloop::make_params(static_cast<Element const*>(p.q_ptr), stride(p.q_row_stride, p.q_head_stride, p.q_batch_stride),
                              static_cast<Element const*>(p.do_ptr), stride(p.do_row_stride, p.do_head_stride, p.do_batch_stride),
                              shape_q, static_cast<Element const*>(p.k_ptr),
                              stride(p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                              static_cast<Element const*>(p.v_ptr), stride(p.v_row_stride, p.v_head_stride, p.v_batch_stride),
                              shape_k, lse_log2, dpsum, dq_accum, dq_sem, dq_first, p.deterministic, ws.seqlen_q_rounded,
                              p.softmax_scale, seqlens, p.window_left, p.window_right,
                              make_score_mod<typename Mainloop::ScoreMod>(p.softmax_scale, p.softcap), {},
                              make_dropout<typename Mainloop::Dropout>(p.dropout_rng, p.dropout_threshold)),
        // Without GQA, dK/dV go straight to the outputs, one per query head.
        Epilogue::make_params(static_cast<Element*>(p.dk_ptr), stride(p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride),
                              static_cast<Element*>(p.dv_ptr), stride(p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride),
                              shape_k, dk_accum, dv_accum, dkv_sem, p.nheads_q / p.nheads_kv, p.nheads_kv,
                              ws.n_blocks_k, seqlens),
        make_bwd_scheduler_params(num_n_blocks, p.batch, p.nheads_q, p.deterministic, causal_head_bytes,
                                  device_info(p.device).l2_bytes)};

    VarlenWorkspace const vw = kVarlen ? VarlenWorkspace::carve(ws.at<char>(p.workspace, ws.varlen), p.batch)
                                       : VarlenWorkspace{};
    if constexpr (kVarlen) {
      int4* const tiles = ws.at<int4>(p.workspace, ws.tiles);
      kp.scheduler.tiles = tiles;
      using Prepare = VarlenPrepare<Element, Mainloop::kBlockN, true, typename Mainloop::TMA_Q,
                                    typename Mainloop::TMA_K, typename Mainloop::TMA_V, typename Mainloop::TMA_dO,
                                    typename Epilogue::TMA_dK, typename Epilogue::TMA_dV>;
      auto const& mp = kp.mainloop;
      auto const& ep = kp.epilogue;
      typename Prepare::Params const pp{
          {mp.tma_q, mp.tma_k, mp.tma_v, mp.tma_do, ep.tma_dk, ep.tma_dv},
          {{{shape_q, stride(p.q_row_stride, p.q_head_stride, p.q_batch_stride), kVarlenQ, true},
            {shape_k, stride(p.k_row_stride, p.k_head_stride, p.k_batch_stride), kVarlenK, false},
            {Mainloop::shape_v_of(shape_k), stride(p.v_row_stride, p.v_head_stride, p.v_batch_stride), kVarlenV, false},
            {Mainloop::shape_v_of(shape_q), stride(p.do_row_stride, p.do_head_stride, p.do_batch_stride), kVarlendO, true},
            {shape_k, stride(p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride), kVarlendK, false},
            {Mainloop::shape_v_of(shape_k), stride(p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride), kVarlendV,
             false}}},
          seqlens, vw, p.batch, p.nheads_q, tiles, ctas};
      varlen_prepare_kernel<Prepare><<<Prepare::grid(p.batch), Prepare::kThreads, 0, stream>>>(pp);
      check_launch(cudaGetLastError(), "varlen prepare launch");
    }
    auto kernel = &bwd_kernel<Kernel>;
    int const smem_bytes = int(sizeof(typename Kernel::SharedStorage));
    check_launch(raise_max_dynamic_smem(kernel, p.device, smem_bytes), "cudaFuncSetAttribute");
    kernel<<<dim3(unsigned(ctas)), Kernel::kNumThreads, smem_bytes, stream>>>(kp);
    check_launch(cudaGetLastError(), "backward kernel launch");
  }

  // dQ block by block as the main kernel completes them (a programmatic dependent launch); with no
  // keys it writes zeros right away (every block's count is 0).
  launch_convert_dq_when_ready<Element, Mainloop::FragLayout::kColumns, Mainloop::kdQSwapAB, Mainloop::kBlockM,
                               Mainloop::kBlockN, Mainloop::kMask>(p, ws, seqlens, num_sms, stream);
  launch_convert_dkv<Element>(p, ws, num_sms, stream);
  return ctas;
}

}  // namespace sm90

template <class Config>
size_t bwd_workspace_bytes_sm90(BwdParams const& p) {
  return sm90::BwdConfig<Config>::workspace(p).total;
}

template <class Config>
TileInfo bwd_tiles_sm90() {
  using Tile = typename sm90::BwdConfig<Config>::Tile;
  return {Tile::kBlockM, Tile::kBlockN};
}

template <class Config>
int64_t run_bwd_sm90(BwdParams const& p, cudaStream_t stream) {
  using C = sm90::BwdConfig<Config>;
  using Element = typename C::Element;
  using Tile = typename C::Tile;
  check_bwd_params(p, Config::kHeadDim, Config::kHeadDimV);
  if (int64_t(p.batch) * p.nheads_q == 0) return 0;  // no heads: every gradient is empty
  if constexpr (C::kVarlen) {
    if (p.cu_seqlens_q == nullptr || p.cu_seqlens_k == nullptr) {
      throw std::invalid_argument("flashhopper: packed-batch kernels need cu_seqlens_q and cu_seqlens_k");
    }
  }
  BwdWorkspace const ws = C::workspace(p);
  DeviceInfo const& dev = device_info(p.device);
  int const num_sms = p.num_sms > 0 ? p.num_sms : dev.num_sms;

  launch_bwd_preprocess<Element, Config::kHeadDimV, Tile::kBlockM>(p, ws, bwd_seqlens<C::kVarlen>(p, ws), stream);
  // The deterministic mode has its own instantiation where dQ would be added from registers: it
  // keeps the dQ writer (mainloop_bwd.h).
  using Mainloop = typename C::template Mainloop<false>;
  if constexpr (Mainloop::kdQAtomic) {
    if (p.deterministic) return sm90::launch_bwd_main<typename C::template Mainloop<true>>(p, ws, num_sms, stream);
  }
  return sm90::launch_bwd_main<Mainloop>(p, ws, num_sms, stream);
}

}  // namespace flashhopper
