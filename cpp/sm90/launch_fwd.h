// Host launcher of the Hopper forward kernel: builds the TMA descriptors from the caller's
// pointers and strides, sizes the persistent grid and launches. Included by the generated
// translation units, one per KernelConfig (kernel_key.h).
#pragma once

#include <cuda_runtime.h>

#include <cutlass/numeric_types.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../common/block_info.h"
#include "../common/kvcache_launch.h"
#include "../common/launch_attribute.h"
#include "../common/device_info.h"
#include "../common/element_type.h"
#include "../common/kernel_key.h"
#include "../common/params.h"
#include "../common/varlen_workspace.h"
#include "../registry.h"
#include "epilogue_fwd.h"
#include "kernel_fwd.h"
#include "mainloop_fwd.h"
#include "tile_scheduler.h"
#include "variants.h"
#include "varlen_prepare.h"

namespace flashhopper {

namespace sm90 {

// kBlocks: the paged kernels' block walk (kv_blocks.h); run_fwd_sm90 picks it (e4m3 caches: kWhole or kChunked).
// kSplitKV: KV-cache kernels that can split an entry's keys (false: one split, common/seqlen.h).
// kForm: the tile's one-CTA kernel, its two-CTA cluster kernel (tile_size.h: CtaPairs) or its short-key kernel
// (ShortKeys), which run_fwd_sm90 picks at run time.
enum class TileForm { kOne, kPairs, kShortKeys };

template <class Config, PageBlocks kBlocks = Config::kKVCacheFp8 ? PageBlocks::kWhole : PageBlocks::kAny,
          bool kSplitKV = true, TileForm kForm = TileForm::kOne>
struct FwdConfig {
  using Element = typename ElementOf<Config::kDType>::type;
  // e4m3 KV caches: their own tiles (the e4m3 stages beside the 16-bit ones).
  using TableTile = typename FwdTileOf<typename Config::Variant, Config::kHeadDim, Config::kDType, Config::kHeadDimV>::type;
  // Kernels without a mask: the table's longer key block where it names one (tile_size.h: NoMaskKeys).
  using BaseTile = std::conditional_t<
      Config::kKVCacheFp8, FwdFp8CacheTileSize<Config::kHeadDim>,
      std::conditional_t<Config::kMask == MaskKind::kNone && TableTile::kNoMaskBlockN != 0, NoMaskKeys<TableTile>, TableTile>>;
  using Tile = std::conditional_t<kForm == TileForm::kPairs, CtaPairs<BaseTile>,
                                   std::conditional_t<kForm == TileForm::kShortKeys, ShortKeys<BaseTile>, BaseTile>>;
  using ScoreMod = typename ScoreModOf<Config::kScoreMod>::type;
  static_assert(Config::kDType != DType::kFloat8E4M3 || Config::kScoreMod == ScoreModKind::kNone,
                "the fp8 kernels have no score mod");
  using Dropout = DropoutOf<Config::kDropout>;
  static constexpr bool kVarlen = Config::kVarlen;
  // KV caches: pages through a page table, per-entry cache lengths, split-KV (kv_blocks.h, common/seqlen.h).
  static constexpr bool kKVCache = Config::kKVCache;
  static_assert(!kKVCache || (!kVarlen && !Config::kDropout && Config::kDType != DType::kFloat8E4M3),
                "KV-cache kernels: padded 16-bit queries without dropout");
  using Seqlens = std::conditional_t<kVarlen, VarlenSeqlens,
                                     std::conditional_t<kKVCache, CacheSeqlensT<kSplitKV>, UniformSeqlens>>;
  using KVBlocks = std::conditional_t<kKVCache, PagedKVBlocks<kBlocks>, ContiguousKVBlocks>;
  using ElementKV = std::conditional_t<Config::kKVCacheFp8, cutlass::float_e4m3_t, Element>;
  static_assert(!Config::kKVCacheFp8 || Config::kDType != DType::kFloat8E4M3, "e4m3 caches: 16-bit queries");
  using Mainloop = FwdMainloop<Element, Config::kHeadDim, Config::kHeadDimV, Tile, Config::kMask, ScoreMod, Dropout,
                               KVBlocks, Seqlens, ElementKV>;
  using ElementOut = typename Mainloop::ElementOut;
  static constexpr bool kFp8 = Mainloop::kFp8;
  // FP8 stages O in a buffer of its own; 16-bit O goes through the Q stage the tile used.
  using Epilogue = FwdEpilogue<ElementOut, Config::kHeadDimV, Mainloop::kNumMmaWG, typename Mainloop::SmemLayoutO,
                               Mainloop::kOSlotElems, typename Mainloop::TiledMmaPV, kFp8, typename Mainloop::Seqlens>;
  // Tiles whose cost varies (a mask with a right edge, packed entries of different lengths) are handed
  // out heaviest first, dynamically; packed CTA pairs, which both run each unit, in a static order.
  // KV caches: a split's share of an entry's keys costs about the same as any other's (decode), so static.
  using Scheduler = std::conditional_t<
      kVarlen, std::conditional_t<(Tile::kClusterM > 1), VarlenPairScheduler, VarlenTileScheduler>,
      std::conditional_t<kKVCache, SplitTileScheduler,
                         std::conditional_t<Config::kMask != MaskKind::kNone, DynamicTileScheduler, StaticTileScheduler>>>;
  using Kernel = FwdKernel<Mainloop, Epilogue, Scheduler>;
  // (CTA pairs: the schedule's blocks are pairs of query blocks, VarlenPairScheduler's units.)
  using Prepare = VarlenPrepare<Element, Tile::kBlockM * Tile::kClusterM, false, typename Mainloop::TMA_Q, typename Mainloop::TMA_K,
                                typename Mainloop::TMA_V, typename Epilogue::TMA_O>;
};

// Configs with a CTA-pair kernel beside the one-CTA one: padded or packed 16-bit non-causal production kernels without
// a score mod or dropout, where the tile names a key count (tile_size.h: kPairsFromKeys). (Packed e4m3, whose V^T
// lies in per-entry blocks: not built.)
template <class Config>
constexpr bool has_cta_pairs() {
  return FwdConfig<Config>::BaseTile::kPairsFromKeys > 0 && Config::kMask == MaskKind::kNone &&
         (!Config::kVarlen || Config::kDType != DType::kFloat8E4M3) &&
         !Config::kKVCache && Config::kScoreMod == ScoreModKind::kNone &&
         !Config::kDropout && std::is_same_v<typename Config::Variant, DefaultVariant>;
}

// Pairs pay a cluster launch and, where a head has an odd number of query tiles, one tile more: taken for rows of
// at least kPairsFromKeys keys, and for odd tile counts only where the extra tile costs under 2% (64 tiles).
// Packed batches: seqlen_q / seqlen_k are the longest entry's; each entry of an odd tile count pays one tile (its
// parity is known on the device only), so pairs where the entries all have seqlen_q queries and seqlen_k keys (the
// tensors' rows, no seqused: spare rows turn this off) and the tile count is even, or where even one tile per entry
// costs under 2% (64 tiles on average, over at most batch x seqlen_q rows: spare rows are no work).
// (Pairs at 2341 equal rows, 19 tiles, ran 4% slower than one CTA; at 2k and 8k 3-5% faster: perf-notes, S53VP.)
template <class Config>
bool use_cta_pairs(FwdParams const& p) {
  using Tile = typename FwdConfig<Config>::BaseTile;
  int const m_blocks = ceil_div(p.seqlen_q, Tile::kBlockM);
  if (p.seqlen_k < Tile::kPairsFromKeys) return false;
  if constexpr (Config::kVarlen) {
    int64_t const batch = p.batch;
    bool const equal = p.seqused_q == nullptr && p.seqused_k == nullptr && batch * p.seqlen_q == p.total_q &&
                       batch * p.seqlen_k == p.total_k;
    int64_t const rows = std::min<int64_t>(p.total_q, batch * p.seqlen_q);
    return (equal && m_blocks % 2 == 0) || rows >= batch * 64 * Tile::kBlockM;
  }
  return m_blocks % 2 == 0 || m_blocks >= 64;
}

// A K or V scale block that a tile of block_n keys reads: one scale per head (block stride 0), one block covering
// the row, or whole tiles per block.
inline bool scale_block_fits(int block, int64_t block_stride, int block_n, int seqlen) {
  return block_stride == 0 || block >= seqlen || block % block_n == 0;
}

// Configs with a short-key kernel beside the others: padded production kernels whose tile names one (with a mask
// only, where the tile says kShortKeysMaskedOnly).
template <class Config>
constexpr bool has_short_keys() {
  using Tile = typename FwdConfig<Config>::BaseTile;
  return Tile::kShortKeysBlockN > 0 && !Config::kVarlen && !Config::kKVCache &&
         std::is_same_v<typename Config::Variant, DefaultVariant> &&
         (Config::kMask != MaskKind::kNone || !Tile::kShortKeysMaskedOnly);
}

// Short rows whose K/V scale blocks it reads, and any row whose blocks only it reads (multiples of its block_n
// that are not of the other's: its speed from 1k keys is the other's less 3%, S44N). A short tile of fewer query
// rows (16-bit, no scale blocks) also needs few queries: it was measured on square shapes only (perf-notes, S38).
template <class Config>
bool use_short_keys(FwdParams const& p) {
  using Tile = typename FwdConfig<Config>::BaseTile;
  auto fits = [&](int block_n) {
    return scale_block_fits(p.k_scale_block, p.k_scale_block_stride, block_n, p.seqlen_k) &&
           scale_block_fits(p.v_scale_block, p.v_scale_block_stride, block_n, p.seqlen_k);
  };
  if (Tile::kShortKeysBlockM > 0 && p.seqlen_q > Tile::kShortKeysMax) return false;
  return fits(Tile::kShortKeysBlockN) && (p.seqlen_k <= Tile::kShortKeysMax || !fits(Tile::kBlockN));
}

}  // namespace sm90

// A KV cache's blocks each inside one page: pages a multiple of the block, or one page per entry (a contiguous
// cache).
template <class Config>
bool fwd_whole_blocks(FwdParams const& p) {
  int const block_n = sm90::FwdConfig<Config>::Tile::kBlockN;
  return p.page_size % block_n == 0 || p.seqlen_k <= p.page_size;
}

template <class Config, sm90::PageBlocks kBlocks, bool kSplitKV = true, sm90::TileForm kForm = sm90::TileForm::kOne>
int64_t run_fwd_sm90_blocks(FwdParams const& params, cudaStream_t stream) {
  using namespace cute;
  using C = sm90::FwdConfig<Config, kBlocks, kSplitKV, kForm>;
  using Element = typename C::Element;
  using Tile = typename C::Tile;
  using Mainloop = typename C::Mainloop;
  using Epilogue = typename C::Epilogue;
  using Scheduler = typename C::Scheduler;
  using Kernel = typename C::Kernel;
  using ElementOut = typename C::ElementOut;
  constexpr bool kFp8 = C::kFp8;

  if (params.headdim != Config::kHeadDim || params.headdim_v != Config::kHeadDimV) {
    throw std::invalid_argument("flashhopper: head dim does not match the kernel");
  }
  constexpr bool kVarlen = C::kVarlen;
  int const num_m_blocks = ceil_div(params.seqlen_q, Tile::kBlockM);
  // Packed batches: the rows of the batch's entries share one row mode (batch coordinate 0), and the tile
  // count is known on the device only: here an upper bound (an entry wastes at most one partial block; CTA pairs:
  // units of two blocks).
  int64_t const total_tiles = kVarlen ? (int64_t(ceil_div(params.total_q, Tile::kBlockM * Mainloop::kClusterM)) +
                                         params.batch) * params.nheads_q
                                      : int64_t(num_m_blocks) * params.nheads_q * params.batch;
  if (total_tiles == 0 || (kVarlen && params.total_q == 0)) return 0;  // no query rows: nothing to launch
  if constexpr (kVarlen) {
    if (params.cu_seqlens_q == nullptr || params.cu_seqlens_k == nullptr || params.varlen_workspace == nullptr) {
      throw std::invalid_argument("flashhopper: packed-batch kernels need cu_seqlens_q, cu_seqlens_k and varlen_workspace");
    }
  }
  if (Scheduler::kNeedsCounter && params.tile_counter == nullptr) {
    throw std::invalid_argument("flashhopper: these kernels need a zeroed int32 tile counter (FwdParams.tile_counter)");
  }
  // With no keys the kernel never loads K or V (every tile stores O = 0 and LSE = -inf or the sink), but their
  // tensor maps must still be valid: extents >= 1 and 16-byte strides over real memory, which empty
  // K/V tensors need not have. Q's serve.
  FwdParams p = params;
  constexpr bool kKVCache = C::kKVCache;
  int const num_splits = kKVCache ? kvcache_num_splits(p) : 1;
  if (!kSplitKV && num_splits > 1) throw std::logic_error("flashhopper: a one-split KV-cache kernel asked to split");
  // Packed: (total rows, headdim, heads, 1), each tensor's one batch coordinate given a stride past its
  // rows (tensor maps want strides that are non-zero multiples of 16 bytes).
  int const rows_q = kVarlen ? p.total_q : p.seqlen_q;
  if constexpr (kVarlen) {
    p.seqlen_k = p.total_k;  // the row extent of K/V below; the entries' own come from cu_seqlens
    p.q_batch_stride = p.q_row_stride * std::max(rows_q, 1);
    p.o_batch_stride = p.o_row_stride * std::max(rows_q, 1);
    p.k_batch_stride = p.k_row_stride * std::max(p.total_k, 1);
    p.v_batch_stride = kFp8 ? p.v_head_stride * std::max(p.nheads_kv, 1) : p.v_row_stride * std::max(p.total_k, 1);
    if constexpr (kFp8) {  // one block mode per scale tensor: entry b's blocks from cu_seqlens[b] / block + b on
      p.q_scale_batch_stride = p.k_scale_batch_stride = p.v_scale_batch_stride = 0;
    }
  }
  int const batch_coords = kVarlen ? 1 : p.batch;
  if (!kKVCache && p.seqlen_k == 0) {
    p.k_ptr = p.v_ptr = p.q_ptr;
    p.k_row_stride = p.v_row_stride = p.v_dim_stride = p.q_row_stride;
    p.k_head_stride = p.v_head_stride = p.q_head_stride;
    p.k_batch_stride = p.v_batch_stride = p.q_batch_stride;
  }
  int const rows_k = std::max(p.seqlen_k, 1);
  typename Mainloop::ShapeQKV const shape_q{rows_q, p.headdim, p.nheads_q, batch_coords};
  // KV caches: (page_size, headdim, kv heads, pages), the batch stride the page stride.
  typename Mainloop::ShapeQKV const shape_k = kKVCache
      ? typename Mainloop::ShapeQKV{p.page_size, p.headdim, p.nheads_kv, p.num_pages}
      : typename Mainloop::ShapeQKV{rows_k, p.headdim, p.nheads_kv, batch_coords};
  auto stride = [](int64_t row, int64_t head, int64_t batch) { return make_stride(row, _1{}, head, batch); };
  typename Mainloop::Descales descale{};
  if constexpr (kFp8) {
    // Without keys K and V (and their scales) are never read.
    if (p.q_scale_ptr == nullptr || (p.seqlen_k > 0 && (p.k_scale_ptr == nullptr || p.v_scale_ptr == nullptr))) {
      throw std::invalid_argument("flashhopper: fp8 kernels need q, k and v descales");
    }
    // A tile must not straddle two scale blocks (one block covering the whole sequence is fine).
    auto misaligned = [](int block, int64_t block_stride, int tile, int seqlen) {
      return !sm90::scale_block_fits(block, block_stride, tile, seqlen);
    };
    // (A padded kernel with a short-key form beside it: a block fitting either tile runs; run_fwd_sm90 picks.)
    constexpr int kShortN = sm90::has_short_keys<Config>() ? C::BaseTile::kShortKeysBlockN : 0;
    std::string const block_n_text =
        std::to_string(C::BaseTile::kBlockN) + (kShortN > 0 ? " or " + std::to_string(kShortN) : std::string());
    // Packed: the scales and V^T are laid out in blocks per entry (docs/fp8.md), so blocks are real ones.
    if (kVarlen && (p.q_scale_block_stride == 0 || p.k_scale_block_stride == 0 || p.v_scale_block_stride == 0 ||
                    p.q_scale_block % 64 != 0 || p.k_scale_block % Tile::kBlockN != 0 ||
                    p.v_scale_block % Tile::kBlockN != 0 || p.v_scale_block >= (1 << 24))) {
      throw std::invalid_argument("flashhopper: packed fp8 kernels need block scales: q_scale_block a multiple of 64, "
                                  "k/v_scale_block multiples of the kernel's block_n (" +
                                  std::to_string(Tile::kBlockN) + "), nonzero block strides");
    }
    if (misaligned(p.q_scale_block, p.q_scale_block_stride, 64, p.seqlen_q)) {
      throw std::invalid_argument("flashhopper: fp8 q_scale_block must be a multiple of 64");
    }
    if (misaligned(p.k_scale_block, p.k_scale_block_stride, Tile::kBlockN, p.seqlen_k) ||
        misaligned(p.v_scale_block, p.v_scale_block_stride, Tile::kBlockN, p.seqlen_k)) {
      throw std::invalid_argument("flashhopper: fp8 k/v_scale_block must be a multiple of the kernel's block_n (" +
                                  block_n_text + ")");
    }
    // The kernel indexes a row's blocks in 32 bits (Descale::Row).
    auto too_far = [](int block, int64_t block_stride, int seqlen) {
      return (int64_t(seqlen) / std::max(block, 1) + 1) * (block_stride < 0 ? -block_stride : block_stride) > INT32_MAX;
    };
    if (too_far(p.q_scale_block, p.q_scale_block_stride, p.seqlen_q) ||
        too_far(p.k_scale_block, p.k_scale_block_stride, p.seqlen_k) ||
        too_far(p.v_scale_block, p.v_scale_block_stride, p.seqlen_k)) {
      throw std::invalid_argument("flashhopper: fp8 scale block strides too large (block index x stride >= 2^31)");
    }
    // V^T: (headdim, keys), head-dim rows v_dim_stride apart (Q's without keys, above).
    if (p.v_dim_stride <= 0 || p.v_dim_stride % 16 != 0) {
      throw std::invalid_argument("flashhopper: fp8 kernels take V as V^T (batch, heads, headdim, seqlen_pad): "
                                  "v_dim_stride must be a positive multiple of 16");
    }
    auto div = [](int block) { return cutlass::FastDivmod(std::max(block, 1)); };
    descale = {{p.q_scale_ptr, p.q_scale_batch_stride, p.q_scale_head_stride, p.q_scale_block_stride, p.q_scale_block,
                div(p.q_scale_block)},
               {p.k_scale_ptr, p.k_scale_batch_stride, p.k_scale_head_stride, p.k_scale_block_stride, p.k_scale_block,
                div(p.k_scale_block)},
               {p.v_scale_ptr, p.v_scale_batch_stride, p.v_scale_head_stride, p.v_scale_block_stride, p.v_scale_block,
                div(p.v_scale_block)}};
  }
  auto const stride_v = kFp8 ? stride(p.v_dim_stride, p.v_head_stride, p.v_batch_stride)
                             : stride(p.v_row_stride, p.v_head_stride, p.v_batch_stride);

  DeviceInfo const& dev = device_info(p.device);
  int const num_sms = p.num_sms > 0 ? p.num_sms : dev.num_sms;
  // Packed FP8 V^T: (headdim, the entries' blocks of v_scale_block keys), docs/fp8.md; else from K's rows.
  int const vt_keys = kFp8 && kVarlen && p.total_k > 0 ? (p.total_k / p.v_scale_block + p.batch) * p.v_scale_block : 0;

  VarlenWorkspace const ws = kVarlen ? VarlenWorkspace::carve(p.varlen_workspace, p.batch) : VarlenWorkspace{};
  auto const seqlens = [&] {
    if constexpr (kVarlen) {
      return VarlenSeqlens{p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k, ws.descs, ws.descs_extra};
    } else if constexpr (kKVCache) {
      return CacheSeqlensT<kSplitKV>{p.seqlen_q, p.seqlen_k, p.cache_seqlens, std::max(1, p.rows_per_query)};
    } else {
      return UniformSeqlens{p.seqlen_q, p.seqlen_k};
    }
  }();
  // e4m3 caches: float32 scales (pages, kv heads, page_size), tokens contiguous, k/v_scale_batch_stride the page
  // stride and k/v_scale_head_stride the head stride (the same for K and V).
  typename Mainloop::CacheScales cache_scales{};
  if constexpr (Config::kKVCacheFp8) {
    if (p.k_scale_ptr == nullptr || p.v_scale_ptr == nullptr || p.k_scale_batch_stride != p.v_scale_batch_stride ||
        p.k_scale_head_stride != p.v_scale_head_stride || p.k_scale_head_stride % 4 != 0 ||
        p.k_scale_batch_stride % 4 != 0 || p.page_size % 16 != 0 ||
        (reinterpret_cast<uintptr_t>(p.k_scale_ptr) | reinterpret_cast<uintptr_t>(p.v_scale_ptr)) % 16 != 0) {
      throw std::invalid_argument("flashhopper: e4m3 KV caches need pages (or a contiguous cache's max_seqlen) of a "
                                  "multiple of 16 rows, and k and v scales (pages, kv heads, page_size) 16-byte aligned with "
                                  "tokens contiguous, the same strides, multiples of 4 elements");
    }
    cache_scales = {p.k_scale_ptr, p.v_scale_ptr, p.k_scale_batch_stride, p.k_scale_head_stride};
  }
  using ElementKV = typename Mainloop::ElementKV;
  typename Kernel::Params kp{
      Mainloop::make_params(static_cast<Element const*>(p.q_ptr), stride(p.q_row_stride, p.q_head_stride, p.q_batch_stride),
                            shape_q, static_cast<ElementKV const*>(p.k_ptr),
                            stride(p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                            static_cast<ElementKV const*>(p.v_ptr), stride_v, shape_k, p.softmax_scale,
                            seqlens, p.window_left, p.window_right, p.sinks_ptr,
                            make_score_mod<typename C::ScoreMod>(p.softmax_scale, p.softcap), {}, descale,
                            make_dropout<typename C::Dropout>(p.dropout_rng, p.dropout_threshold), vt_keys, num_splits,
                            cache_scales),
      Epilogue::make_params(static_cast<ElementOut*>(p.o_ptr),
                            typename Mainloop::ShapeQKV{rows_q, p.headdim_v, p.nheads_q, batch_coords},
                            stride(p.o_row_stride, p.o_head_stride, p.o_batch_stride), p.lse_ptr, seqlens,
                            num_splits > 1 ? static_cast<float*>(p.split_workspace) : nullptr, num_splits),
      // (params.seqlen_k: packed batches' longest entry; p's is their total by now)
      // (CTA pairs: each head's query tiles rounded up to whole pairs; kernel_fwd.h: tile_work.)
      sm90::make_tile_scheduler_params(ceil_div(num_m_blocks, Mainloop::kClusterM) * Mainloop::kClusterM, p.batch, p.nheads_q,
                                       p.nheads_q / p.nheads_kv,
                                       int64_t(params.seqlen_k) * (p.headdim + p.headdim_v) * int64_t(sizeof(ElementKV)),
                                       dev.l2_bytes > 0 ? dev.l2_bytes : int64_t(50) << 20, p.tile_counter)};

  if constexpr (kKVCache) {
    bool const whole_blocks = fwd_whole_blocks<Config>(p);
    if (!whole_blocks && p.page_size % sm90::kPageChunkRows != 0) {
      throw std::invalid_argument("flashhopper: a paged KV cache needs pages of a multiple of 16 rows");
    }
    kp.mainloop.kv_blocks = {p.page_table, p.page_table_batch_stride, cutlass::FastDivmod(p.page_size), p.num_pages,
                             whole_blocks};
    // Tiles of at most 64 rows (decode, short speculation): warpgroup 1's rows are padding (kernel_fwd.h).
    kp.mainloop.one_consumer = Mainloop::kNumMmaWG == 2 && p.seqlen_q <= 64;
    kp.scheduler.num_splits = num_splits;
    kp.scheduler.total_tiles = int(std::min<int64_t>(total_tiles * num_splits, INT32_MAX));
  }
  auto kernel = &sm90::fwd_kernel<Kernel>;
  int const smem_bytes = int(sizeof(typename Kernel::SharedStorage));
  cudaError_t err = raise_max_dynamic_smem(kernel, p.device, smem_bytes);
  if (err != cudaSuccess) throw std::runtime_error(std::string("flashhopper: cudaFuncSetAttribute: ") + cudaGetErrorString(err));
  if constexpr (kVarlen) {
    // The tile bound above sizes the grid; the prepare kernel writes the true count and the schedule.
    kp.scheduler.total_tiles = int(std::min<int64_t>(total_tiles, INT32_MAX));
    kp.scheduler.num_entries = p.batch;
    // Inside an entry, tiles of equal cost (no mask) go one head after another (the padded static order,
    // one head's K/V hot in L2); under a mask with a right edge, by block across an L2 section of heads
    // (the padded causal order). Measured both ways: docs/perf-notes.md (issue #21, K1).
    if constexpr (Config::kMask == MaskKind::kNone) kp.scheduler.heads_per_section = 1;
    kp.scheduler.entry_m_blocks = ws.blocks;
    kp.scheduler.entry_order = ws.order;
    kp.scheduler.tile_prefix = ws.prefix;
    kp.scheduler.total_ptr = ws.total;
    using Prepare = typename C::Prepare;
    auto const& mp = kp.mainloop;
    typename Prepare::Params const pp{
        {mp.tma_q, mp.tma_k, mp.tma_v, kp.epilogue.tma_o},
        {{{mp.shape_q, stride(p.q_row_stride, p.q_head_stride, p.q_batch_stride), kVarlenQ, true},
          {mp.shape_k, stride(p.k_row_stride, p.k_head_stride, p.k_batch_stride), kVarlenK, false},
          {mp.shape_v, stride_v, kVarlenV, false, kFp8 ? p.v_scale_block : 0},
          {kp.epilogue.shape_o, stride(p.o_row_stride, p.o_head_stride, p.o_batch_stride), kVarlenO, true, 0,
           int(sizeof(ElementOut))}}},
        seqlens, ws, p.batch, p.nheads_q};
    sm90::varlen_prepare_kernel<Prepare><<<Prepare::grid(p.batch), Prepare::kThreads, 0, stream>>>(pp);
  }
  dim3 grid(sm90::persistent_grid_size(kp.scheduler, num_sms));
  if constexpr (Mainloop::kClusterM > 1) {
    // CTA pairs on consecutive block indices take consecutive tiles of the static order: neighbouring query tiles of
    // one head (each head's count rounded up to pairs, so the grid and the tile count are even). Packed: both take
    // each unit of VarlenPairScheduler (total_tiles counts units).
    static_assert(!kKVCache && (kVarlen ? std::is_same_v<Scheduler, sm90::VarlenPairScheduler> : Scheduler::kNeighbourPairs),
                  "CTA pairs walk the static padded order or the packed units");
    constexpr int kCluster = Mainloop::kClusterM;
    int clusters = 0;
    err = max_active_clusters_once(clusters, kernel, p.device, Kernel::kNumThreads, smem_bytes, kCluster);
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("flashhopper: cluster occupancy query: ") + cudaGetErrorString(err));
    }
    if (clusters <= 0) throw std::runtime_error("flashhopper: no CTA pair fits on this device");
    clusters = std::max(1, std::min(clusters, num_sms / kCluster));  // (a caller's num_sms bounds the grid too)
    int64_t const pairs = kVarlen ? kp.scheduler.total_tiles : kp.scheduler.total_tiles / kCluster;
    grid.x = unsigned(std::min<int64_t>(clusters, pairs) * kCluster);
    LaunchWith launch(cluster_along_x(kCluster), grid, Kernel::kNumThreads, smem_bytes, stream);
    // Packed: also launched while the prepare kernel runs (as the one-CTA kernel below); the CTAs wait for it after
    // the pair's barrier setup.
    cudaLaunchAttribute both[2] = {launch.attr, programmatic_launch()};
    if constexpr (kVarlen) {
      launch.config.attrs = both;
      launch.config.numAttrs = 2;
    }
    err = cudaLaunchKernelEx(&launch.config, kernel, kp);
    if (err != cudaSuccess) throw std::runtime_error(std::string("flashhopper: cluster forward launch: ") + cudaGetErrorString(err));
  } else if constexpr (kVarlen) {
    // Launched while the prepare kernel still runs; it waits for it (griddepcontrol.wait) before reading.
    LaunchWith launch(programmatic_launch(), grid, Kernel::kNumThreads, smem_bytes, stream);
    err = cudaLaunchKernelEx(&launch.config, kernel, kp);
    if (err != cudaSuccess) throw std::runtime_error(std::string("flashhopper: varlen forward launch: ") + cudaGetErrorString(err));
  } else {
    kernel<<<grid, Kernel::kNumThreads, smem_bytes, stream>>>(kp);
  }
  if constexpr (kKVCache) {
    if (num_splits > 1) {
      combine_kvcache_splits<ElementOut, Config::kHeadDimV>(p, num_splits, kp.epilogue.o_partial, kp.epilogue.lse_partial,
                                                               stream);
    }
  }
  return grid.x;
}

// e4m3 caches: one kernel per block walk, so that each holds its own code only (kv_blocks.h). 16-bit caches under
// the causal mask (chunked prefill, speculation): a second kernel for calls of one split, without the split-KV
// bookkeeping that cost the consumers their uniform registers (5-9% of a prefill: docs/perf-notes.md, session 9).
// Padded calls with short rows: the short-key tile (sm90::use_short_keys); non-causal calls with long rows (padded, or
// packed 16-bit): CTA pairs (sm90::use_cta_pairs). The rest: one kernel.
template <class Config>
int64_t run_fwd_sm90(FwdParams const& params, cudaStream_t stream) {
  using sm90::PageBlocks, sm90::TileForm;
  if constexpr (sm90::has_short_keys<Config>()) {
    if (sm90::use_short_keys<Config>(params)) {
      return run_fwd_sm90_blocks<Config, PageBlocks::kAny, true, TileForm::kShortKeys>(params, stream);
    }
  }
  if constexpr (sm90::has_cta_pairs<Config>()) {
    return sm90::use_cta_pairs<Config>(params)
               ? run_fwd_sm90_blocks<Config, PageBlocks::kAny, true, TileForm::kPairs>(params, stream)
               : run_fwd_sm90_blocks<Config, PageBlocks::kAny>(params, stream);
  } else if constexpr (Config::kKVCacheFp8) {
    return fwd_whole_blocks<Config>(params) ? run_fwd_sm90_blocks<Config, sm90::PageBlocks::kWhole>(params, stream)
                                            : run_fwd_sm90_blocks<Config, sm90::PageBlocks::kChunked>(params, stream);
  } else if constexpr (Config::kKVCache && Config::kMask == MaskKind::kCausal) {
    return params.num_splits <= 1 ? run_fwd_sm90_blocks<Config, sm90::PageBlocks::kAny, false>(params, stream)
                                  : run_fwd_sm90_blocks<Config, sm90::PageBlocks::kAny>(params, stream);
  } else {
    return run_fwd_sm90_blocks<Config, sm90::PageBlocks::kAny>(params, stream);
  }
}

template <class Config>
TileInfo fwd_tiles_sm90() {
  using Tile = typename sm90::FwdConfig<Config>::Tile;
  if constexpr (sm90::has_short_keys<Config>()) {
    return {Tile::kBlockM, Tile::kBlockN, Tile::kShortKeysBlockN, Tile::kShortKeysMax};
  } else {
    return {Tile::kBlockM, Tile::kBlockN};
  }
}

}  // namespace flashhopper
