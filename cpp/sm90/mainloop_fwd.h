// Hopper forward mainloop: the producer side (TMA loads of Q once per tile and of K/V through
// PipelineTmaAsync stages) and the consumer side (per-warpgroup WGMMA with online softmax).
//
// Each consumer warpgroup owns 64 query rows of the tile and its own 64-row slice of Q in shared
// memory; all warpgroups share the K/V stages. Per key block a warpgroup issues S = Q K^T (both
// operands in smem) together with O += P V for the previous block (P from registers), waits for
// S only, runs the softmax while the PV GEMM is still on the tensor cores, then rescales O.
// Ping-pong: warpgroups take turns issuing their GEMMs (named barriers in round robin), so one
// warpgroup's softmax runs under another's GEMMs.
//
// Where the features plug in (docs/architecture.md): the batch entry's bounds come from the Seqlens
// policy (common/seqlen.h), the key-block range and which iterations are masked from BlockInfo and
// Mask (kMask; masked iterations at the top of the range for the sequence end and the right edge, at
// the bottom for a left edge), the score transform from ScoreMod (common/score_mod.h), and where a K/V
// block lives from KVBlocks (kv_blocks.h), in the producer only.
//
// FP8 (e4m3, docs/fp8.md): both WGMMA operands must be K-major, so V arrives transposed (V^T tiles,
// keys contiguous) with its keys permuted within groups of 16 such that the fp32 S accumulator of a
// thread converts to the fp8 A operand of the PV GEMM without shuffles. Q and K descales (one per
// 64 query rows, one per key block) fold into the softmax's per-block scale; the V descale of each
// key block folds into the O rescale that the online softmax does anyway; O leaves as bfloat16
// through its own shared-memory buffer (Q's fp8 stage is too small to stage it).
//
// e4m3 KV cache read by 16-bit queries (ElementKV = e4m3, KV caches only): each K/V block comes into e4m3 stages
// with its per-token scales, by TMA where blocks lie inside pages, else gathered row by row by the lanes of two
// producer warps (cp.async; kv_blocks.h; K by the loading role, V by role 1: kernel_fwd.h's roles). The S GEMMs read K's stages as loaded, e4m3 x
// e4m3, with q as two e4m3 terms per element (prepare_q8) and K's scales and q's row scales on S. The producer
// warpgroup's converter warps (convert(); with warpgroup 1 in one-consumer mode) transpose V's stages into V^T e4m3
// stages laid out as FP8's (keys permuted within groups of 16), a PipelineAsync to the PV GEMMs, e4m3 x e4m3 with P in
// e4m3 as FP8's; V's scales are per-key factors on P before it is rounded; rows past the keys become zeros.
#pragma once

#include <cute/tensor.hpp>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/memory.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include <type_traits>

#include "../common/block_info.h"
#include "../common/dropout.h"
#include "../common/mask.h"
#include "../common/score_mod.h"
#include "../common/seqlen.h"
#include "../common/softmax.h"
#include "../common/utils.h"
#include "gemm.h"
#include "kv_blocks.h"
#include "named_barriers.h"
#include "pipeline_wg_release.h"

namespace flashhopper::sm90 {

using namespace cute;

// The e4m3 cache stages of a tile (FwdFp8CacheTileSize::kCacheStages), 1 for tiles without them.
template <class Tile, class = void>
struct CacheStagesOf : std::integral_constant<int, 1> {};
template <class Tile>
struct CacheStagesOf<Tile, std::void_t<decltype(Tile::kCacheStages)>> : std::integral_constant<int, Tile::kCacheStages> {};
template <class Tile>
constexpr int cache_stages() { return CacheStagesOf<Tile>::value; }

// Tile: an FwdTileSize (block sizes, pipeline depths, ping-pong), possibly a variant's (variants.h).
template <class Element_, int kHeadDim_, int kHeadDimV_, class Tile, MaskKind kMask_, class ScoreMod_ = ScoreModIdentity,
          class Dropout_ = DropoutNone, class KVBlocks_ = ContiguousKVBlocks, class Seqlens_ = UniformSeqlens,
          class ElementKV_ = Element_>
struct FwdMainloop {
  using Element = Element_;
  using ElementKV = ElementKV_;  // of K/V in global memory: Element, or e4m3 for an e4m3 KV cache
  static constexpr bool kFp8Cache = !std::is_same_v<ElementKV, Element>;
  using ScoreMod = ScoreMod_;
  using Dropout = Dropout_;  // common/dropout.h: P's dropped scores zeroed before the PV GEMM
  using KVBlocks = KVBlocks_;
  using Seqlens = Seqlens_;
  static constexpr bool kFp8 = sizeof(Element) == 1;
  using ElementOut = std::conditional_t<kFp8, cutlass::bfloat16_t, Element>;
  // FP8: P = 2^8 p uses more of e4m3's normal range (its smallest normal is 2^-6).
  static constexpr int kMaxOffset = kFp8 ? 8 : 0;
  // 16-bit P: the lazy reference max (P < 2^8) skips most blocks' O rescale. FP8 keeps P's range for e4m3 (kMaxOffset)
  // and folds the V descales into the rescale, so it rescales every block.
  static constexpr int kLazyRescale = (kFp8 || kFp8Cache) ? 0 : 8;
  using Softmax = OnlineSoftmax<2, kMaxOffset, kLazyRescale>;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN;
  static constexpr int kHeadDimV = kHeadDimV_;  // of V and O
  // 16-bit O is staged in Q's slice (64 x headdim); FP8's V^T and scale blocks assume one head dim.
  static_assert(kHeadDimV <= kHeadDim && (!kFp8 || kHeadDimV == kHeadDim));
  static_assert(!kFp8 || !Dropout::kEnabled, "dropout is for training: 16-bit kernels only");
  static constexpr int kStages = Tile::kStages, kQStages = Tile::kQStages;
  // Tile::kClusterM = 2: the CTA pair shares each K/V block (half loaded by each, multicast to both).
  static constexpr int kClusterM = Tile::kClusterM;
  static constexpr int kPairsProducerRegs = Tile::kPairsProducerRegs;
  using ClusterShape = Shape<Int<kClusterM>, _1, _1>;
  using TmaLoadKV = std::conditional_t<kClusterM == 1, SM90_TMA_LOAD, SM90_TMA_LOAD_MULTICAST>;
  static constexpr uint16_t kMcastMask = uint16_t((1u << kClusterM) - 1u);
  static constexpr int kCacheStages = cache_stages<Tile>();  // e4m3 cache stages (kFp8Cache)
  // Producer warpgroup, by role (kernel_fwd.h: warps rotated by two where blocks are gathered): role 0 loads; roles
  // 1-3 convert, or where blocks are gathered (kGatherKV, below) role 1 gathers V and roles 2-3 convert.
  static constexpr int kNumConvertThreads = (KVBlocks::kGather ? 2 : 3) * cutlass::NumThreadsPerWarp;
  static constexpr MaskKind kMask = kMask_;
  static constexpr int kNumMmaWG = kBlockM / 64;
  static constexpr int kNumMmaThreads = kNumMmaWG * cutlass::NumThreadsPerWarpGroup;
  static_assert(kBlockM % 64 == 0 && kNumMmaWG >= 1 && kNumMmaWG <= 3);
  using Sched = PingPong<kNumMmaWG, Tile::kPingPong>;
  // Split-KV (KV caches): a tile's key range is its split's share (common/block_info.h).
  static constexpr bool kSplits = Seqlens::kSplits;
  static constexpr bool kPackedRows = Seqlens::kPackedRows;  // GQA-packed query rows (common/seqlen.h)
  using BlockInfoT = std::conditional_t<kSplits, SplitBlockInfo<BlockInfo<kBlockM, kBlockN, kMask, kPackedRows>>,
                                        BlockInfo<kBlockM, kBlockN, kMask, kPackedRows>>;
  using MaskT = Mask<kBlockN, kMask, kPackedRows>;

  using D = Int<kHeadDim>;
  using DV = Int<kHeadDimV>;
  using BN = Int<kBlockN>;

  // GEMMs of one consumer warpgroup: S(64 x BN) = Q(64 x D) K^T, O(64 x DV) += P(64 x BN) V.
  using TiledMmaQK = decltype(make_tiled_mma(ss_atom<Element, Element, float, Shape<_64, BN, D>>()));
  using TiledMmaPV = decltype(make_tiled_mma(rs_atom<Element, Element, float, Shape<_64, DV, BN>, GMMA::Major::K,
                                                     kFp8 ? GMMA::Major::K : GMMA::Major::MN>()));

  // Q: one 64-row slice per consumer warpgroup, kQStages tiles deep. The 16-bit epilogue stages O in
  // the warpgroup's slice once its last S GEMM is done, so O needs no buffer of its own (FP8 does).
  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, _64, D>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<_64, D, Int<kNumMmaWG>, Int<kQStages>>{}));
  using SmemAtomKV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BN, D>());
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomKV{}, Shape<BN, D, Int<kStages>>{}));
  // V as PV's B operand, (headdim_v, keys). 16-bit: V's own tiles read MN-major (headdim contiguous).
  // FP8: V^T tiles, K-major (keys contiguous), as loaded.
  using SmemAtomV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BN, DV>());
  using SmemLayoutV16 = decltype(tile_to_shape(SmemAtomV{}, Shape<BN, DV, Int<kStages>>{}));
  using SmemAtomVt = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, DV, BN>());
  using SmemLayoutVt = std::conditional_t<
      kFp8, decltype(tile_to_shape(SmemAtomVt{}, Shape<DV, BN, Int<kStages>>{})),
      decltype(composition(SmemLayoutV16{}, make_ordered_layout(Shape<DV, BN, Int<kStages>>{}, Step<_2, _1, _3>{})))>;
  // The V stages as TMA writes them: V tiles (keys, headdim_v), or for FP8 V^T tiles (headdim, keys).
  using SmemLayoutV = std::conditional_t<kFp8, SmemLayoutVt, SmemLayoutV16>;
  using TileV = std::conditional_t<kFp8, Shape<DV, BN>, Shape<BN, DV>>;
  // e4m3 cache: the stages TMA writes (K and V as in global memory, (keys, headdim)) and their scales.
  using SmemAtomK8 = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, ElementKV, BN, D>());
  using SmemLayoutK8 = decltype(tile_to_shape(SmemAtomK8{}, Shape<BN, D, Int<kCacheStages>>{}));
  using SmemAtomV8 = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, ElementKV, BN, DV>());
  using SmemLayoutV8 = decltype(tile_to_shape(SmemAtomV8{}, Shape<BN, DV, Int<kCacheStages>>{}));
  using SmemLayoutScale = Layout<Shape<BN, Int<kCacheStages>>>;
  using SmemLayoutScaleT = Layout<Shape<BN, Int<kStages>>>;
  // e4m3 cache, S = Q K^T on the e4m3 K stages as loaded (e4m3 x e4m3 WGMMA, no K conversion): each row of q
  // (times its scale, the row's largest |q| to 448) is the sum of two e4m3 terms, hi = e4m3(x) and lo = e4m3(x - hi),
  // both GEMMs accumulating into S, which keeps q to about 2^-8 of each element (bf16 holds 2^-9). The two terms
  // live in the warpgroup's slice of the Q stage the bf16 q came in (the same bytes: 2 x 1 byte for 2), written
  // 128 columns at a time in the order (rows, term, 128-column panel), so that each pass overwrites only the
  // bf16 columns it has read (prepare_q8).
  using SmemAtomQ8 = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, ElementKV, _64, D>());
  using SmemLayoutQ8 = decltype(tile_to_shape(SmemAtomQ8{}, Shape<_64, D, _2>{}, Step<_1, _3, _2>{}));
  // e4m3 cache, O += P V on V^T e4m3 stages (headdim_v, keys), which convert() transposes from V's e4m3 stages with
  // FP8's key permutation (above), so that P's accumulator converts to the A operand as in FP8 (to_p). P, times its
  // keys' factors, goes in as one e4m3 term, as in FP8 (2^-4 of each element; two terms like q's cost 12-15% of the
  // decode's time for up to a third less output error: docs/perf-notes.md, V4/V5).
  using SmemAtomVt8 = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, ElementKV, DV, BN>());
  using SmemLayoutVt8 = decltype(tile_to_shape(SmemAtomVt8{}, Shape<DV, BN, Int<kStages>>{}));
  // The e4m3 x e4m3 GEMMs of an e4m3 cache (void for the other kernels, which have none).
  template <bool kCache, class = void>
  struct E4m3Mmas {
    using QK = void;
    using PV = void;
  };
  template <class Unused>
  struct E4m3Mmas<true, Unused> {
    using QK = decltype(make_tiled_mma(ss_atom<ElementKV, ElementKV, float, Shape<_64, BN, D>>()));
    using PV = decltype(make_tiled_mma(rs_atom<ElementKV, ElementKV, float, Shape<_64, DV, BN>>()));
  };
  using TiledMmaQK8 = typename E4m3Mmas<kFp8Cache>::QK;
  using TiledMmaPV8 = typename E4m3Mmas<kFp8Cache>::PV;
  static constexpr float kPFactor = 256.f;  // P in e4m3: p x factor x 2^8 (to_p_cache)
  using SmemAtomKLoad = std::conditional_t<kFp8Cache, SmemAtomK8, SmemAtomKV>;
  using SmemAtomVLoad = std::conditional_t<kFp8Cache, SmemAtomV8, SmemAtomV>;
  using SmemLayoutKLoad = std::conditional_t<kFp8Cache, SmemLayoutK8, SmemLayoutK>;
  using SmemLayoutVLoad = std::conditional_t<kFp8Cache, SmemLayoutV8, SmemLayoutV>;
  // O of one consumer warpgroup as the epilogue stages it (64 x headdim_v): 16-bit in that warpgroup's
  // slice of the Q stage the tile used (kOSlotElems apart), FP8 (bfloat16 O) in a buffer of its own.
  using SmemAtomO = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, ElementOut, _64, DV>());
  using SmemLayoutO = decltype(tile_to_shape(SmemAtomO{}, Shape<_64, DV>{}));
  static constexpr int kOSlotElems = kFp8 ? 64 * kHeadDimV : 64 * kHeadDim;

  // Global tensors as (rows, headdim, head, batch); FP8's V^T as (headdim, keys, head, batch).
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQKV{}));
  using GmemTensorKV = decltype(make_tensor(make_gmem_ptr(static_cast<ElementKV const*>(nullptr)), ShapeQKV{}, StrideQKV{}));
  using TMA_Q = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}), Shape<_64, D>{}, _1{}));
  // Paged K/V (kv_blocks.h): boxes of 16 keys x one swizzle-atom panel of the stage, copied chunk by chunk.
  static constexpr bool kPaged = KVBlocks::kPaged;
  // Blocks gathered by producer warps' lanes with cp.async (kv_blocks.h: the kChunked walk; K by role 0 in load, V by
  // role 1 in gather_v: one warp for both measured 1.4-1.6x the time in pages of 16, docs/perf-notes.md G2W).
  static constexpr bool kGatherKV = KVBlocks::kGather;
  static_assert(!kGatherKV || kFp8Cache, "gathered blocks: the e4m3 cache's chunk walk");
  // e4m3 caches: whole blocks by TMA (kWhole) or gathered (kChunked); the TMA chunk walk (kAny) brings no V scales.
  static_assert(!kFp8Cache || KVBlocks::kBlocks != PageBlocks::kAny, "e4m3 caches: kWhole or kChunked kernels");
  static_assert(!kPaged || !kFp8, "paged K/V: 16-bit kernels");
  // (Packed pairs run one entry's unit: both CTAs load through the same entry's maps; 16-bit only.)
  static_assert(kClusterM == 1 || (kClusterM == 2 && !kPaged && !kFp8Cache && (!Seqlens::kPacked || !kFp8) &&
                                   !BlockInfoT::kHasRight && !BlockInfoT::kHasLeft),
                "CTA pairs share every K/V block: non-causal, contiguous K/V only");
  static_assert(!kFp8Cache || (kPaged && kHeadDimV == kHeadDim && kNumMmaWG == 2), "e4m3 caches: KV-cache kernels");
  static constexpr int kPanelK = size<1>(SmemAtomKLoad{}), kPanelV = size<1>(SmemAtomVLoad{});
  // The paged producer reads a block's page indices at once with 16 more registers; consumers at 232 registers
  // spill at head dim 256, and 3 consumer warpgroups (head dim 64) have none to give (ptxas -v).
  static constexpr bool kProducerRegsBoost = kPaged && kNumMmaWG == 2 && (kHeadDim <= 128 || kFp8Cache);
  using ChunkK = Shape<Int<kPageChunkRows>, Int<kPanelK>>;
  using ChunkV = Shape<Int<kPageChunkRows>, Int<kPanelV>>;
  using TMA_K = std::conditional_t<
      kPaged, decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorKV{}, tile_to_shape(SmemAtomKLoad{}, ChunkK{}), ChunkK{}, _1{})),
      decltype(make_tma_copy(TmaLoadKV{}, GmemTensorKV{}, take<0, 2>(SmemLayoutKLoad{}), Shape<BN, D>{}, Int<kClusterM>{}))>;
  using TMA_V = std::conditional_t<
      kPaged, decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorKV{}, tile_to_shape(SmemAtomVLoad{}, ChunkV{}), ChunkV{}, _1{})),
      decltype(make_tma_copy(TmaLoadKV{}, GmemTensorKV{}, take<0, 2>(SmemLayoutVLoad{}), TileV{}, Int<kClusterM>{}))>;
  // Paged K/V whose blocks each lie inside one page: one copy per block, as for contiguous K/V.
  using TMA_KBlock = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorKV{}, take<0, 2>(SmemLayoutKLoad{}), Shape<BN, D>{}, _1{}));
  using TMA_VBlock = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensorKV{}, take<0, 2>(SmemLayoutVLoad{}), TileV{}, _1{}));
  struct NoBlockTma {};
  struct BlockTmas {
    TMA_KBlock k;
    TMA_VBlock v;
  };
  // e4m3 cache scales: float32 (pages, kv heads, page_size) with these strides, tokens contiguous. A block's go with
  // its copy into the stage's slot: a bulk copy on the same barrier, or gathered with its rows.
  struct CacheScales {
    float const* k = nullptr;
    float const* v = nullptr;
    int64_t page_stride = 0, head_stride = 0;
  };
  // Paged K/V for the gathers: row r of page g of kv head h at k + g x page + h x head + r x row (V likewise).
  struct GatherKV {
    ElementKV const* k = nullptr;
    ElementKV const* v = nullptr;
    int64_t row_k = 0, head_k = 0, page_k = 0, row_v = 0, head_v = 0, page_v = 0;
  };

  static constexpr uint32_t kQStageBytes = uint32_t(size(take<0, 3>(SmemLayoutQ{})) * sizeof(Element));
  static constexpr uint32_t kKStageBytes = uint32_t(size(take<0, 2>(SmemLayoutK{})) * sizeof(Element));
  static constexpr uint32_t kVStageBytes = uint32_t(size(take<0, 2>(SmemLayoutV{})) * sizeof(Element));
  // e4m3 cache stages: the block and its scales.
  static constexpr uint32_t kKCacheStageBytes =
      uint32_t(size(take<0, 2>(SmemLayoutK8{})) * sizeof(ElementKV) + kBlockN * sizeof(float));
  static constexpr uint32_t kVCacheStageBytes =
      uint32_t(size(take<0, 2>(SmemLayoutV8{})) * sizeof(ElementKV) + kBlockN * sizeof(float));

  // The K/V stages the consumers read: 16-bit ones filled by TMA, or for an e4m3 cache V^T e4m3 ones filled by the
  // converter warps.
  // Tile::kWarpgroupRelease: the K/V stages released by one thread per warpgroup (pipeline_wg_release.h).
  using PipelineTma = std::conditional_t<Tile::kWarpgroupRelease, PipelineTmaAsyncWarpgroupRelease<kStages, kClusterM>,
                                         cutlass::PipelineTmaAsync<kStages>>;
  using Pipeline = std::conditional_t<kFp8Cache, cutlass::PipelineAsync<kStages>, PipelineTma>;
  using PipelineState = typename Pipeline::PipelineState;
  using PipelineCache = cutlass::PipelineTmaAsync<kCacheStages>;  // e4m3 stages: TMA -> consumers (K), converters (V)
  using PipelineStateCache = typename PipelineCache::PipelineState;
  // What the consumers' S GEMMs read K from.
  using PipelineK = std::conditional_t<kFp8Cache, PipelineCache, Pipeline>;
  // Q stages are released by one thread per consumer warpgroup, once TMA has read the O staged there.
  using PipelineQ = std::conditional_t<kClusterM == 1, cutlass::PipelineTmaAsync<kQStages>,
                                       PipelineTmaAsyncLocalRelease<kQStages>>;
  using PipelineStateQ = typename PipelineQ::PipelineState;

  struct TensorStorage16 {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> smem_q;
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> smem_v;
  };
  struct TensorStorageFp8 : TensorStorage16 {
    cute::array_aligned<ElementOut, kNumMmaWG * kOSlotElems, 1024> smem_o;
  };
  // e4m3 cache: the consumers read K's e4m3 stages; V's are transposed into V^T e4m3 ones.
  struct TensorStorageFp8Cache {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> smem_q;  // (and each warpgroup's q terms: prepare_q8)
    cute::array_aligned<ElementKV, cosize_v<SmemLayoutVt8>, 1024> smem_vt8;
    cute::array_aligned<ElementKV, cosize_v<SmemLayoutK8>, 1024> smem_k8;
    cute::array_aligned<ElementKV, cosize_v<SmemLayoutV8>, 1024> smem_v8;
    cute::array_aligned<float, cosize_v<SmemLayoutScale>, 128> smem_ks;
    cute::array_aligned<float, cosize_v<SmemLayoutScale>, 128> smem_vs;
    // Per V^T stage: each key's factor (its scale over the block's largest; 0 past the entry's keys), and that largest.
    cute::array_aligned<float, cosize_v<SmemLayoutScaleT>, 128> smem_vfac;
    cute::array_aligned<float, kStages, 16> smem_vmax;
    cute::array_aligned<float, 64 * kNumMmaWG, 16> smem_qrow;  // per query row: 1 / its q scale (prepare_q8)
  };
  using TensorStorage = std::conditional_t<kFp8, TensorStorageFp8,
                                           std::conditional_t<kFp8Cache, TensorStorageFp8Cache, TensorStorage16>>;
  struct BarrierStorage16 {
    typename PipelineQ::SharedStorage pipeline_q;
    typename Pipeline::SharedStorage pipeline_k;
    typename Pipeline::SharedStorage pipeline_v;
  };
  struct BarrierStorageCache : BarrierStorage16 {
    typename PipelineCache::SharedStorage pipeline_k8;
    typename PipelineCache::SharedStorage pipeline_v8;
  };
  using BarrierStorage = std::conditional_t<kFp8Cache, BarrierStorageCache, BarrierStorage16>;
  // Where TMA writes K/V: the 16-bit stages, or the e4m3 ones.
  CUTE_DEVICE static ElementKV* load_smem_k(TensorStorage& ts) {
    if constexpr (kFp8Cache) return ts.smem_k8.data();
    else return ts.smem_k.data();
  }
  CUTE_DEVICE static ElementKV* load_smem_v(TensorStorage& ts) {
    if constexpr (kFp8Cache) return ts.smem_v8.data();
    else return ts.smem_v.data();
  }

  // FP8 descales: scale(b, h, block) = ptr[b * batch + h * head + (first + token / block) * block_stride],
  // `first` the entry's first block (packed batches keep each entry's blocks in one block mode, batch 0).
  // The consumers take a tile's Row once: per key block the index is one IMAD.HI (block_div, set on the host), where
  // `token / block` cost two integer divisions per block (I2F / MUFU.RCP / F2I, on the pipe the exponentials load):
  // +10-13% at e4m3 d64, +3-8% at d128 (perf-notes, session 13).
  struct Descale {
    float const* ptr;
    int64_t batch, head, block_stride;
    int block;
    cutlass::FastDivmod block_div;  // of block
    // Within a row the block offset fits 32 bits (the launcher checks it): one IMAD and one IMAD.WIDE a block.
    struct Row {
      float const* ptr;
      int block_stride;
      cutlass::FastDivmod block_div;
      CUTE_DEVICE float operator()(int token) const { return ptr[block_div.div(token) * block_stride]; }
    };
    CUTE_DEVICE int first(int offset, int b) const { return Seqlens::first_block(offset, b, block); }
    CUTE_DEVICE Row row(int b, int h, int first_block) const {
      return {ptr + b * batch + h * head + first_block * block_stride, int(block_stride), block_div};
    }
  };
  struct Descales {
    Descale q, k, v;
  };

  struct Params {
    TMA_Q tma_q;
    TMA_K tma_k;
    TMA_V tma_v;
    ShapeQKV shape_q, shape_k, shape_v;  // shape_v: V's (keys, headdim_v), or FP8's V^T (headdim, keys padded to 16)
    int heads_ratio;                     // query heads per kv head (GQA/MQA)
    float scale_log2;                    // of the softmax's exp2, after the score mod
    Seqlens seqlens;
    int window_left, window_right;       // MaskKind::kWindow
    float const* sinks;                  // (nheads_q,) sink logits, or nullptr
    ScoreMod score_mod;
    typename KVBlocks::Params kv_blocks;
    Descales descale;                    // FP8 only
    Dropout dropout;
    int num_splits;                      // split-KV (kSplits): each entry's key blocks in this many ranges
    std::conditional_t<kPaged, BlockTmas, NoBlockTma> tma_block;  // paged: whole-block copies
    CacheScales scales;                  // e4m3 cache: per-token scales
    GatherKV gather;                     // kGatherKV: K/V as plain pointers
    // KV caches whose tiles hold at most 64 rows (decode, short speculation): consumer warpgroup 1's rows are all
    // padding, so it skips them, and with an e4m3 cache converts stages beside the producer's warps (the kernel).
    bool one_consumer;
  };

  // The sink logit of a row of the head in the softmax's exp2 units (OnlineSoftmax::finalize), -inf without sinks;
  // GQA-packed rows (rows_per_query > 1) are query heads of their own (sink_log2_of).
  CUTE_DEVICE static float sink_log2(Params const& p, int head, int row = 0, int rows_per_query = 1) {
    return sink_log2_of(p.sinks, head, row, rows_per_query);
  }

  // What the params' seqlens say of one batch entry, and its block ranges.
  CUTE_DEVICE static SeqlenInfo seqlen_info(Params const& p, int batch) { return p.seqlens(batch); }
  CUTE_DEVICE static BlockInfoT block_info(Params const& p, SeqlenInfo const& s, int m_block, int split = 0) {
    if constexpr (kSplits) {
      return {s, p.window_left, p.window_right, m_block, split, p.num_splits};
    } else {
      return {s, p.window_left, p.window_right};
    }
  }

  // shape_q, shape_k: the global tensors (rows, headdim, heads, batch); q, k, v with their strides.
  static Params make_params(Element const* q, StrideQKV stride_q, ShapeQKV shape_q, ElementKV const* k,
                            StrideQKV stride_k, ElementKV const* v, StrideQKV stride_v, ShapeQKV shape_k,
                            float softmax_scale, Seqlens seqlens, int window_left, int window_right,
                            float const* sinks = nullptr, ScoreMod score_mod = {}, typename KVBlocks::Params kv_blocks = {},
                            Descales descale = {}, Dropout dropout = {}, int vt_keys = 0, int num_splits = 1,
                            CacheScales scales = {}) {
    auto mQ = make_tensor(make_gmem_ptr(q), shape_q, stride_q);
    auto mK = make_tensor(make_gmem_ptr(k), shape_k, stride_k);
    // FP8's V^T: (headdim, keys); the TMA bound is the padded key count, since a group of 16 keys
    // holds them permuted (a key below seqlen_k may sit at a position above it). Packed batches: vt_keys,
    // the columns of the entries' blocks (VarlenSeqlens::first_block).
    ShapeQKV const shape_v = kFp8 ? ShapeQKV{get<1>(shape_k), vt_keys > 0 ? vt_keys : (get<0>(shape_k) + 15) / 16 * 16,
                                             get<2>(shape_k), get<3>(shape_k)}
                                  : ShapeQKV{get<0>(shape_k), kHeadDimV, get<2>(shape_k), get<3>(shape_k)};
    auto mV = make_tensor(make_gmem_ptr(v), shape_v, stride_v);
    auto tma_k = [&] {
      if constexpr (kPaged) return make_tma_copy(SM90_TMA_LOAD{}, mK, tile_to_shape(SmemAtomKLoad{}, ChunkK{}), ChunkK{}, _1{});
      else return make_tma_copy(TmaLoadKV{}, mK, take<0, 2>(SmemLayoutKLoad{}), Shape<BN, D>{}, Int<kClusterM>{});
    };
    auto tma_v = [&] {
      if constexpr (kPaged) return make_tma_copy(SM90_TMA_LOAD{}, mV, tile_to_shape(SmemAtomVLoad{}, ChunkV{}), ChunkV{}, _1{});
      else return make_tma_copy(TmaLoadKV{}, mV, take<0, 2>(SmemLayoutVLoad{}), TileV{}, Int<kClusterM>{});
    };
    auto tma_block = [&] {
      if constexpr (kPaged) {
        return BlockTmas{make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(SmemLayoutKLoad{}), Shape<BN, D>{}, _1{}),
                         make_tma_copy(SM90_TMA_LOAD{}, mV, take<0, 2>(SmemLayoutVLoad{}), TileV{}, _1{})};
      } else {
        return NoBlockTma{};
      }
    };

    return {make_tma_copy(SM90_TMA_LOAD{}, mQ, take<0, 2>(SmemLayoutQ{}), Shape<_64, D>{}, _1{}),
            tma_k(),
            tma_v(),
            shape_q,
            shape_k,
            shape_v,
            get<2>(shape_q) / get<2>(shape_k),
            score_mod.softmax_scale_log2(float(softmax_scale * M_LOG2E)),
            seqlens,
            window_left,
            window_right,
            sinks,
            score_mod,
            kv_blocks,
            descale,
            dropout,
            num_splits,
            tma_block(),
            scales,
            GatherKV{k, v, get<0>(stride_k), get<2>(stride_k), get<3>(stride_k), get<0>(stride_v), get<2>(stride_v),
                     get<3>(stride_v)},
            false};  // one_consumer: the launcher's choice
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    if constexpr (kPaged) {
      cute::prefetch_tma_descriptor(p.tma_block.k.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_block.v.get_tma_descriptor());
    }
  }

  // e4m3 cache: the scales of rows [row, row + rows) of page `page` (kv head `kv_head`) into `dst`, on the barrier
  // of the K (which 0) or V (1) copy they go with. A chunk past the entry's keys (page = num_pages) copies the
  // array's first 64 bytes instead (any readable bytes: the converter writes those rows as zeros).
  CUTE_DEVICE static void load_scales(Params const& p, int which, int kv_head, uint64_t& barrier, int page, int row,
                                      float* dst, int rows) {
    float const* base = which == 0 ? p.scales.k : p.scales.v;
    float const* src = page < p.kv_blocks.num_pages
                           ? base + int64_t(page) * p.scales.page_stride + int64_t(kv_head) * p.scales.head_stride + row
                           : base;
    SM90_BULK_COPY_G2S::copy(src, &barrier, dst, rows * int(sizeof(float)));
  }

  struct NoLoadHook {
    CUTE_DEVICE void operator()() const {}
  };

  // ---------------------------------------------------------------------------------------------
  // Producer: one thread issues every TMA of a tile. The first K block goes out before the wait
  // for a free Q stage (with one Q stage that wait lasts until the previous tile's O is stored);
  // then Q, then K/V with V trailing K by one block so that the first S GEMM never waits on V.
  // PipelineKV: Pipeline, or PipelineCache for an e4m3 cache (the converter warps read those stages).
  // before_last_v() runs before the wait for the last V block's stage (the kernel takes its next tile there).
  template <class PipelineKV, class BeforeLastV = NoLoadHook>
  CUTE_DEVICE static void load(Params const& p, PipelineQ& pipeline_q, PipelineKV& pipeline_k, PipelineKV& pipeline_v,
                               PipelineStateQ& write_q, typename PipelineKV::PipelineState& write_k,
                               typename PipelineKV::PipelineState& write_v,
                               TensorStorage& ts, SeqlenInfo const& seq, BlockInfoT const& bi, int m_block, int head,
                               int batch, int& acquired_entry, BeforeLastV&& before_last_v = {}) {
    int const n_block_max = bi.n_block_max(m_block);
    int const n_block_min = bi.n_block_min(m_block);
    int const kv_head = head / p.heads_ratio;
    KVBlocks const kv_blocks(p.kv_blocks, batch, seq.seqlen_k);
    // Packed batches: the entry's own maps only for the blocks that reach past its rows (block_tma_desc).
    auto q_inside = [&](int m64) { return (m64 + 1) * 64 <= seq.seqlen_q; };
    auto kv_inside = [&](int n_block) { return (n_block + 1) * kBlockN <= seq.seqlen_k; };
    acquire_entry_maps(p.seqlens, batch, !q_inside(m_block * kNumMmaWG + kNumMmaWG - 1) || !kv_inside(n_block_max - 1),
                       acquired_entry, kVarlenQ, kVarlenK, kVarlenV);

    Tensor sQ = make_tensor(make_smem_ptr(ts.smem_q.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(load_smem_k(ts)), SmemLayoutKLoad{});
    Tensor sV = make_tensor(make_smem_ptr(load_smem_v(ts)), SmemLayoutVLoad{});
    Tensor mQ = entry_rows(p.tma_q.get_tma_tensor(p.shape_q), seq.offset_q, head, seq.batch_coord);
    Tensor gQ = local_tile(mQ, Shape<_64, D>{}, make_coord(_, _0{}));  // (64, D, m64)
    auto q_parts = tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    Tensor tQgQ = get<0>(q_parts);  // (TMA, m64)
    Tensor tQsQ = get<1>(q_parts);  // (TMA, wg, q_stage)
    // issuer: the thread that issues Q's copies (all that run this, but one lane where a warp gathers K/V).
    auto load_q = [&](bool issuer) {
      pipeline_q.producer_acquire(write_q);
      if (issuer) {
        CUTE_UNROLL
        for (int wg = 0; wg < kNumMmaWG; ++wg) {
          int const m64 = m_block * kNumMmaWG + wg;
          copy(p.tma_q.with(block_tma_desc(p.seqlens, p.tma_q, kVarlenQ, batch, q_inside(m64)),
                            *pipeline_q.producer_get_barrier(write_q), 0, TMA::CacheHintSm90::EVICT_FIRST),
               tQgQ(_, m64), tQsQ(_, wg, write_q.index()));
        }
      }
      ++write_q;
    };
    // The tile's load order (above), whatever copies a block.
    auto issue = [&](auto&& load_k, auto&& load_v, bool q_issuer = true) {
      int n_block = n_block_max - 1;
      load_k(n_block);
      load_q(q_issuer);
      for (; n_block > n_block_min; --n_block) {
        load_k(n_block - 1);
        load_v(n_block);
      }
      before_last_v();
      load_v(n_block_min);
    };

    if constexpr (kGatherKV) {
      // The producer warp's 32 lanes gather each K block with its scales (gather_block); Q stays a TMA copy (load_q,
      // lane 0).
      // K here; V by role 1 (gather_v), so that two warps' copies are in flight.
      issue([&](int n) { gather_block<false>(p, kv_blocks, pipeline_k, write_k, n, kv_head, ts); }, [&](int) {},
            cutlass::canonical_lane_idx() == 0);
    } else if constexpr (kPaged) {
      // K/V pages of the kv head: (page_size, headdim, page); each block chunk by chunk (kv_blocks.h).
      Tensor pK = p.tma_k.get_tma_tensor(p.shape_k)(_, _, kv_head, _);
      Tensor pV = p.tma_v.get_tma_tensor(p.shape_v)(_, _, kv_head, _);
      Tensor bK = p.tma_block.k.get_tma_tensor(p.shape_k)(_, _, kv_head, _);
      Tensor bV = p.tma_block.v.get_tma_tensor(p.shape_v)(_, _, kv_head, _);
      // e4m3 cache: each copy's scales ride on the same barrier, into the stage's scale slot.
      auto scales = [&](int which, uint64_t& barrier, int stage) {
        if constexpr (kFp8Cache) {
          float* const dst = (which == 0 ? ts.smem_ks.data() : ts.smem_vs.data()) + stage * kBlockN;
          return [&p, which, kv_head, &barrier, dst](int page, int row, int stage_row, int rows) {
            load_scales(p, which, kv_head, barrier, page, row, dst + stage_row, rows);
          };
        } else {
          return NoPageCompanion{};
        }
      };
      auto load_k = [&](int n_block) {
        pipeline_k.producer_acquire(write_k);
        uint64_t& barrier = *pipeline_k.producer_get_barrier(write_k);
        // (e4m3 cache: K's scales with every copy, chunks too; the consumers read K's stages as loaded.)
        kv_blocks.template load_paged<kBlockN, kPanelK, Shape<BN, D>, kProducerRegsBoost, kFp8Cache>(
            p.tma_k, p.tma_block.k, barrier, pK, bK, n_block, sK(_, _, write_k.index()), TMA::CacheHintSm90::EVICT_LAST,
            scales(0, barrier, write_k.index()));
        ++write_k;
      };
      auto load_v = [&](int n_block) {
        pipeline_v.producer_acquire(write_v);
        uint64_t& barrier = *pipeline_v.producer_get_barrier(write_v);
        kv_blocks.template load_paged<kBlockN, kPanelV, TileV, kProducerRegsBoost, false>(
            p.tma_v, p.tma_block.v, barrier, pV, bV, n_block, sV(_, _, write_v.index()), TMA::CacheHintSm90::EVICT_LAST,
            scales(1, barrier, write_v.index()));
        ++write_v;
      };
      issue(load_k, load_v);
    } else if constexpr (!kFp8Cache) {
    Tensor mK = entry_rows(p.tma_k.get_tma_tensor(p.shape_k), seq.offset_k, kv_head, seq.batch_coord);
    Tensor gK = local_tile(mK, Shape<BN, D>{}, make_coord(_, _0{}));   // (BN, D, n)
    Tensor gV = [&] {
      Tensor mV4 = p.tma_v.get_tma_tensor(p.shape_v);
      if constexpr (kFp8) {  // V^T: the keys are the second mode; packed, each entry's from a block boundary on
        int const vt_offset = Seqlens::kPacked ? p.descale.v.first(seq.offset_k, batch) * p.descale.v.block : 0;
        Tensor mV = domain_offset(make_coord(_0{}, vt_offset), mV4(_, _, kv_head, seq.batch_coord));
        return local_tile(mV, TileV{}, make_coord(_0{}, _));  // (DV, BN, n)
      } else {
        return local_tile(entry_rows(mV4, seq.offset_k, kv_head, seq.batch_coord), TileV{}, make_coord(_, _0{}));
      }
    }();
    // Clusters: this CTA's share of each block (rows split by its rank), multicast to the pair.
    int const cta_rank = kClusterM > 1 ? int(cute::block_rank_in_cluster()) : 0;
    auto k_parts = tma_partition(p.tma_k, cta_rank, Layout<Int<kClusterM>>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto v_parts = tma_partition(p.tma_v, cta_rank, Layout<Int<kClusterM>>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    Tensor tKgK = get<0>(k_parts);  // (TMA, n)
    Tensor tKsK = get<1>(k_parts);  // (TMA, stage)
    Tensor tVgV = get<0>(v_parts);
    Tensor tVsV = get<1>(v_parts);

    auto load_k = [&](int n_block) {
      pipeline_k.producer_acquire(write_k);
      kv_blocks.load(p.tma_k, block_tma_desc(p.seqlens, p.tma_k, kVarlenK, batch, kv_inside(n_block)),
                     *pipeline_k.producer_get_barrier(write_k), tKgK, n_block, tKsK(_, write_k.index()),
                     TMA::CacheHintSm90::EVICT_LAST, kMcastMask);
      ++write_k;
    };
    auto load_v = [&](int n_block) {
      pipeline_v.producer_acquire(write_v);
      kv_blocks.load(p.tma_v, block_tma_desc(p.seqlens, p.tma_v, kVarlenV, batch, kv_inside(n_block)),
                     *pipeline_v.producer_get_barrier(write_v), tVgV, n_block, tVsV(_, write_v.index()),
                     TMA::CacheHintSm90::EVICT_LAST, kMcastMask);
      ++write_v;
    };
    issue(load_k, load_v);
    }
  }

  // Gathered blocks (kGatherKV): the producer warpgroup's role-1 warp gathers the tile's V blocks with their scales,
  // in the converters' order, as the loading warp does K's (load).
  template <class PipelineKV>
  CUTE_DEVICE static void gather_v(Params const& p, PipelineKV& pipeline_v, typename PipelineKV::PipelineState& write_v,
                                   TensorStorage& ts, SeqlenInfo const& seq, BlockInfoT const& bi, int m_block,
                                   int head, int batch) {
    if constexpr (kGatherKV) {
      KVBlocks const kv_blocks(p.kv_blocks, batch, seq.seqlen_k);
      for (int n_block = bi.n_block_max(m_block) - 1; n_block >= bi.n_block_min(m_block); --n_block) {
        gather_block<true>(p, kv_blocks, pipeline_v, write_v, n_block, head / p.heads_ratio, ts);
      }
    }
  }

  // One gathered block (K's, or V's: kIsV) with its scales into the stage `write` names, by the calling warp's lanes:
  // each waits for the stage, none arrives until its copies are out, and the barrier's phase (32 arrivals: the
  // kernel's pipelines) completes when they have all landed.
  template <bool kIsV, class PipelineKV>
  CUTE_DEVICE static void gather_block(Params const& p, KVBlocks const& kv_blocks, PipelineKV& pipeline,
                                       typename PipelineKV::PipelineState& write, int n_block, int kv_head,
                                       TensorStorage& ts) {
    auto const& g = p.gather;
    pipeline.producer_acquire(write);
    Tensor stage = make_tensor(make_smem_ptr(kIsV ? ts.smem_v8.data() : ts.smem_k8.data()),
                               std::conditional_t<kIsV, SmemLayoutV8, SmemLayoutK8>{})(_, _, write.index());
    kv_blocks.template gather<kBlockN>(
        kIsV ? g.v + kv_head * g.head_v : g.k + kv_head * g.head_k, kIsV ? g.row_v : g.row_k,
        kIsV ? g.page_v : g.page_k, n_block, stage, cutlass::canonical_lane_idx(),
        (kIsV ? p.scales.v : p.scales.k) + int64_t(kv_head) * p.scales.head_stride, p.scales.page_stride,
        (kIsV ? ts.smem_vs.data() : ts.smem_ks.data()) + write.index() * kBlockN);
    pipeline.producer_commit(write, cutlass::arch::cpasync_barrier_arrive_noinc);
    ++write;
  }

  // ---------------------------------------------------------------------------------------------
  // e4m3 cache converter: roles 1-3 of the producer warpgroup (2-3 where blocks are gathered; thread_idx 0.. among
  // them) take each e4m3 V stage in the producer's order and transpose it into a V^T e4m3 stage (the PV GEMM's
  // K-major B operand: the bytes as loaded, keys permuted within groups of 16 as FP8's V^T), with the rows' scales
  // as the stage's per-key factors, which the consumers apply to P before rounding it; keys at or past the entry's
  // end become zeros (whatever the cache holds there, NaN included). A warp moves 16 keys x 32 bytes per step:
  // ldmatrix.trans of four 8 x 8 tiles of 16-bit pairs gives each lane 2 keys x 2 bytes per tile, two byte permutes
  // per tile pair make 4 keys x 1 byte of two V^T rows, and stmatrix writes the four tiles of V^T rows. (Until
  // session 6 the converters wrote 16-bit V stages: twice the bytes, ~40 instructions per 16 bytes, 32 KB of stages
  // per block at head dim 128; perf-notes.)
  // thread_idx: 0 .. num_threads - 1 among the converters (whole warps; 128 more in one-consumer mode).
  CUTE_DEVICE static void convert(Params const& p, PipelineCache& pipeline_v8, Pipeline& pipeline_v,
                                  PipelineStateCache& read_v8, PipelineState& write_v, TensorStorage& ts,
                                  SeqlenInfo const& seq, BlockInfoT const& bi, int m_block, int head, int batch,
                                  int thread_idx, int num_threads) {
    if constexpr (kFp8Cache) {
      int const n_block_max = bi.n_block_max(m_block);
      int const n_block_min = bi.n_block_min(m_block);
      Tensor sV8 = make_tensor(make_smem_ptr(ts.smem_v8.data()), SmemLayoutV8{});    // (keys, headdim_v, stage)
      Tensor sVs = make_tensor(make_smem_ptr(ts.smem_vs.data()), SmemLayoutScale{});
      Tensor sVt8 = make_tensor(make_smem_ptr(ts.smem_vt8.data()), SmemLayoutVt8{});  // (headdim_v, keys, stage)
      Tensor sVfac = make_tensor(make_smem_ptr(ts.smem_vfac.data()), SmemLayoutScaleT{});
      // factor = scale / (the block's largest), that largest in smem_vmax: the consumers keep O in units of the newest
      // block's largest, so that P's factors stay at most 1 whatever the scales' size.
      // Steps (key group g, dim group c): 16 keys x 32 bytes. A lane's ldmatrix row is key 16 g + lane % 8 + 8 ((lane / 8)
      // % 2), bytes 32 c + 16 (lane / 16); its stmatrix row is V^T row 32 c + 16 (lane / 16) + 2 (lane % 8) + (lane / 8) % 2,
      // keys 16 g .. 16 g + 15. Both swizzles only permute 16-byte pieces inside a row of their atom, so from the
      // lane's addresses at g = c = 0: the e4m3 stage's at (src0 ^ (32 c mod panel)) + (32 c / panel) x panel stride
      // + g x (16 rows), V^T's at (dst0 ^ 16 g) + c x (32 rows), plus the stages' strides (scripts/check_vt_addr.cu
      // checks this against the layouts for the e4m3 tiles). A compact loop, not unrolled: ncu measured the unrolled one's warps stalled on
      // instruction fetch (V2, perf-notes).
      constexpr int kKeyGroups = kBlockN / 16, kDimGroups = kHeadDimV / 32, kSteps = kKeyGroups * kDimGroups;
      constexpr uint32_t kPanel = size<1>(SmemAtomV8{}) * sizeof(ElementKV);  // bytes per row of the e4m3 atom
      constexpr uint32_t kPanelStride = kBlockN * kPanel;
      static_assert(kBlockN % 16 == 0 && kHeadDimV % 32 == 0 && kPanel % 32 == 0);
      static_assert(kBlockN * sizeof(ElementKV) <= size<1>(SmemAtomVt8{}) * sizeof(ElementKV), "V^T: one atom per row");
      auto addr = [](auto const& ref) { return cute::cast_smem_ptr_to_uint(&ref); };
      constexpr uint32_t kInStage = kBlockN * kHeadDimV * sizeof(ElementKV);
      constexpr uint32_t kOutStage = kHeadDimV * kBlockN * sizeof(ElementKV);
      uint32_t const in_keys16 = addr(sV8(16 % kBlockN, 0, 0)) - addr(sV8(0, 0, 0));
      uint32_t const out_rows32 = addr(sVt8(32 % kHeadDimV, 0, 0)) - addr(sVt8(0, 0, 0));
      int const lane = thread_idx % cutlass::NumThreadsPerWarp, warp = thread_idx / cutlass::NumThreadsPerWarp;
      int const num_warps = num_threads / cutlass::NumThreadsPerWarp;
      uint32_t src0, dst0;
      {
        int const key = lane % 8 + 8 * ((lane / 8) % 2), col = 16 * (lane / 16);
        src0 = addr(sV8(key, col, 0));
        dst0 = addr(sVt8(col + 2 * (lane % 8) + (lane / 8) % 2, 0, 0));
      }
      auto one = [&](int n_block) {
        int const valid = seq.seqlen_k - n_block * kBlockN;
        pipeline_v8.consumer_wait(read_v8);
        pipeline_v.producer_acquire(write_v);
        int const in = read_v8.index(), out = write_v.index();
        // The scales become the consumers' per-key factors (the e4m3 stage is released below); past the keys 0.
        // Shared-memory accesses through 32-bit shared addresses throughout: through CuTe's generic pointers here
        // the compiler emitted generic LD/ST (ncu: long-scoreboard stalls; the decode ran at 0.3 of the copy).
        auto load_scale = [&](int r) {
          float f = 0.f;
          if (r < valid) cutlass::arch::shared_load<4>(&f, addr(sVs(r, in)));
          return f;
        };
        float m = 0.f;  // every warp finds the block's largest V scale itself
        for (int r = lane; r < kBlockN; r += cutlass::NumThreadsPerWarp) m = fmaxf(m, load_scale(r));
        CUTE_UNROLL
        for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float const mult = m > 0.f ? 1.f / m : 0.f;
        if (thread_idx == 0) ts.smem_vmax[out] = m;
        for (int r = thread_idx; r < kBlockN; r += num_threads) {
          float const f = load_scale(r) * mult;
          cutlass::arch::shared_store<4>(addr(sVfac(r, out)), &f);
        }
        // The lane's 4 keys of group g in each word it writes: 16 g + {2 q, 2 q + 1, 2 q + 8, 2 q + 9}, q = lane % 4
        // (FP8's permutation); bytes of keys at or past `valid` are zeroed (the block with the entry's last key).
        bool const partial = valid < kBlockN;
        uint32_t const in_base = uint32_t(in) * kInStage, out_base = uint32_t(out) * kOutStage;
        for (int step = warp; step < kSteps; step += num_warps) {
          uint32_t const g = uint32_t(step) / kDimGroups, c32 = uint32_t(step) % kDimGroups * 32;
          uint32_t const src = (src0 ^ (c32 % kPanel)) + c32 / kPanel * kPanelStride + g * in_keys16 + in_base;
          uint32_t const dst = (dst0 ^ (g * 16)) + c32 / 32 * out_rows32 + out_base;
          uint32_t keep = 0xffffffffu;
          if (partial) {
            int const k0 = 16 * int(g) + 2 * (lane % 4);
            keep = (k0 < valid ? 0xffu : 0u) | (k0 + 1 < valid ? 0xff00u : 0u) | (k0 + 8 < valid ? 0xff0000u : 0u) |
                   (k0 + 9 < valid ? 0xff000000u : 0u);
          }
          uint32_t r0, r1, r2, r3;
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                       : "r"(src));
          uint32_t const w0 = __byte_perm(r0, r1, 0x6420) & keep, w1 = __byte_perm(r0, r1, 0x7531) & keep;
          uint32_t const w2 = __byte_perm(r2, r3, 0x6420) & keep, w3 = __byte_perm(r2, r3, 0x7531) & keep;
          asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n"
                       :: "r"(dst), "r"(w0), "r"(w1), "r"(w2), "r"(w3));
        }
        cutlass::arch::fence_view_async_shared();  // the generic-proxy writes before the GEMMs' async reads
        pipeline_v8.consumer_release(read_v8);
        ++read_v8;
        pipeline_v.producer_commit(write_v);
        ++write_v;
      };
      // The producer's V order (load's `issue`).
      for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) one(n_block);
    }
  }

  // e4m3 cache: q as two e4m3 terms per element (SmemLayoutQ8) in warpgroup wg's slice of Q stage q_stage, and
  // 1 / each row's scale in smem_qrow, for the S GEMMs on K's e4m3 stages. 16-element vectors: thread t takes
  // vector t + 128 i of each pass's (64 x 128 columns), so a row's vectors are kVecs adjacent lanes (its largest
  // |q| by shuffles). Each pass reads its bf16 columns before the warpgroup's barrier and writes the two terms after
  // it, into bytes that only those columns held (the terms' order). Ends with the terms visible to the GEMMs.
  // fold (tiles of at most 8 rows, mma's half_rows): row r's second term also goes into row r + 8 of the first
  // term, which is padding there, so that one GEMM on the first term gives both (mma folds row r + 8 into row r);
  // rows 8-15 then leave that term alone.
  CUTE_DEVICE static void prepare_q8(TensorStorage& ts, int q_stage, int wg, int thread_idx, bool fold) {
    if constexpr (kFp8Cache) {
      constexpr int kPassCols = cute::min(kHeadDim, 128), kPasses = kHeadDim / kPassCols;
      constexpr int kVecs = kPassCols / 16, kPerThread = 64 * kVecs / cutlass::NumThreadsPerWarpGroup;
      static_assert(kHeadDim % kPassCols == 0 && kPerThread >= 1 && 32 % kVecs == 0);
      Tensor sQ = make_tensor(make_smem_ptr(ts.smem_q.data()), SmemLayoutQ{})(_, _, wg, q_stage);  // (64, D)
      Tensor sQ8 = make_tensor(make_smem_ptr(reinterpret_cast<ElementKV*>(&sQ(0, 0))), SmemLayoutQ8{});  // (64, D, 2)
      using Vec16 = cutlass::Array<Element, 16>;
      auto load16 = [&](int r, int c, Vec16& x) {
        cutlass::arch::shared_load<16>(x.data(), cute::cast_smem_ptr_to_uint(&sQ(r, c)));
        cutlass::arch::shared_load<16>(x.data() + 8, cute::cast_smem_ptr_to_uint(&sQ(r, c + 8)));
      };
      auto to_float = [](Vec16 const& x) { return cutlass::NumericArrayConverter<float, Element, 16>{}(x); };
      // Each row's largest |q| over every pass (the same rows in each pass).
      float amax[kPerThread];
      CUTE_UNROLL
      for (int i = 0; i < kPerThread; ++i) {
        int const v = thread_idx + i * cutlass::NumThreadsPerWarpGroup, r = v / kVecs, c = (v % kVecs) * 16;
        float m = 0.f;
        CUTE_UNROLL
        for (int pass = 0; pass < kPasses; ++pass) {
          Vec16 x;
          load16(r, pass * kPassCols + c, x);
          auto const f = to_float(x);
          CUTE_UNROLL
          for (int j = 0; j < 16; ++j) m = fmaxf(m, fabsf(f[j]));
        }
        CUTE_UNROLL
        for (int o = 1; o < kVecs; o *= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        amax[i] = m;
      }
      CUTE_UNROLL
      for (int pass = 0; pass < kPasses; ++pass) {
        Vec16 x[kPerThread];
        CUTE_UNROLL
        for (int i = 0; i < kPerThread; ++i) {
          int const v = thread_idx + i * cutlass::NumThreadsPerWarpGroup, r = v / kVecs, c = (v % kVecs) * 16;
          load16(r, pass * kPassCols + c, x[i]);
        }
        warpgroup_barrier_sync(wg);  // every thread has read this pass's bf16 columns
        // The row scales after the barrier: the previous tile's consumers have read theirs (ts_qrow).
        if (pass == 0) {
          CUTE_UNROLL
          for (int i = 0; i < kPerThread; ++i) {
            int const v = thread_idx + i * cutlass::NumThreadsPerWarpGroup, r = v / kVecs;
            // A row of zeros keeps scale 1 (its S row is 0 whatever the factor).
            if (v % kVecs == 0) ts.smem_qrow[wg * 64 + r] = amax[i] > 0.f ? amax[i] * (1.f / 448.f) : 1.f;
          }
        }
        CUTE_UNROLL
        for (int i = 0; i < kPerThread; ++i) {
          int const v = thread_idx + i * cutlass::NumThreadsPerWarpGroup, r = v / kVecs, c = (v % kVecs) * 16;
          float const sq = amax[i] > 0.f ? 448.f / amax[i] : 1.f;
          auto const f = to_float(x[i]);
          cutlass::Array<float, 16> hi_in, lo_in;
          CUTE_UNROLL
          for (int j = 0; j < 16; ++j) hi_in[j] = f[j] * sq;
          auto const hi = cutlass::NumericArrayConverter<ElementKV, float, 16>{}(hi_in);
          auto const hi_f = cutlass::NumericArrayConverter<float, ElementKV, 16>{}(hi);
          CUTE_UNROLL
          for (int j = 0; j < 16; ++j) lo_in[j] = hi_in[j] - hi_f[j];
          auto const lo = cutlass::NumericArrayConverter<ElementKV, float, 16>{}(lo_in);
          if (!fold || r < 8 || r >= 16) {
            cutlass::arch::shared_store<16>(cute::cast_smem_ptr_to_uint(&sQ8(r, pass * kPassCols + c, 0)), &hi);
          }
          cutlass::arch::shared_store<16>(cute::cast_smem_ptr_to_uint(&sQ8(r, pass * kPassCols + c, 1)), &lo);
          if (fold && r < 8) {
            cutlass::arch::shared_store<16>(cute::cast_smem_ptr_to_uint(&sQ8(r + 8, pass * kPassCols + c, 0)), &lo);
          }
        }
      }
      cutlass::arch::fence_view_async_shared();  // the generic-proxy writes before the GEMMs' async reads
      warpgroup_barrier_sync(wg);                // every term and row scale written
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Consumer: one warpgroup's 64 rows of the tile, reading Q from stage q_stage (already waited
  // for). Accumulates the unnormalized O into tOrO (zeroed by the caller) and the softmax state
  // into `softmax`; K/V stages are released as they are consumed, the Q stage by the epilogue.
  // on_first_issue() runs once the first S GEMM is on the tensor cores (the kernel releases the
  // previous tile's Q stage there).
  // Returns the factor the finished O still needs (FP8: the V descale of the last key block; dropout:
  // 1 / keep probability; else 1).
  // 1 / the q scale of row `row` of warpgroup wg's 64 (prepare_q8).
  CUTE_DEVICE static float ts_qrow(TensorStorage& ts, int wg, int row) {
    if constexpr (kFp8Cache) {
      float f;
      cutlass::arch::shared_load<4>(&f, cute::cast_smem_ptr_to_uint(ts.smem_qrow.data() + wg * 64 + row));
      return f;
    } else {
      return 1.f;
    }
  }

  template <class FragO, class OnFirstIssue>
  CUTE_DEVICE static float mma(Params const& p, PipelineK& pipeline_k, Pipeline& pipeline_v,
                               typename PipelineK::PipelineState& read_k, PipelineState& read_v, TensorStorage& ts,
                               int q_stage, FragO& tOrO, Softmax& softmax, SeqlenInfo const& seq,
                               BlockInfoT const& bi, int m_block, int head, int batch,
                               int wg, int thread_idx, OnFirstIssue&& on_first_issue) {
    int const n_block_max = bi.n_block_max(m_block);
    int const n_block_min = bi.n_block_min(m_block);
    int const row_offset = m_block * kBlockM + wg * 64;
    int const kv_head = head / p.heads_ratio;
    // Per key block: the softmax scale (times the q and k descales) and the V descale.
    // A warpgroup whose rows are all past the entry's end (the last tile) reads the last row's scale: the
    // scale array has no block for its rows (its outputs are never stored).
    auto const k_scales = kFp8 ? p.descale.k.row(batch, kv_head, p.descale.k.first(seq.offset_k, batch))
                               : typename Descale::Row{};
    auto const v_scales = kFp8 ? p.descale.v.row(batch, kv_head, p.descale.v.first(seq.offset_k, batch))
                               : typename Descale::Row{};
    float const q_descale =
        kFp8 ? p.descale.q.row(batch, head, p.descale.q.first(seq.offset_q, batch))(
                   cute::max(cute::min(row_offset, seq.seqlen_q - 1), 0)) * p.scale_log2
             : p.scale_log2;
    auto qk_scale = [&](int n) {
      if constexpr (kFp8) return q_descale * k_scales(n * kBlockN);
      else return q_descale;
    };
    auto v_descale = [&](int n) {
      if constexpr (kFp8) return v_scales(n * kBlockN);
      else return 1.f;
    };
    // FP8, unmasked steps: each warp holds the k (times q) and v descales of 32 key blocks, lane i those of block
    // top - i, and those of the 32 below them, loaded 32 blocks before they are needed: a block's pair is then two
    // shuffles, where a division, an address and a load cost ~15 instructions each (with the divisors and pointers
    // reloaded from the constant bank). +1-3% non-causal (perf-notes, sessions 18-19). Causal kernels that opened it
    // after their masked steps measured 2-4% slower at 2k (their first unmasked step waits on the window's loads), so
    // they use it only where it opens before the first GEMM (Tile::kEarlyDescaleWindow). Its shuffles go after the
    // GEMM issue.
    static constexpr bool kDescaleWindow = kFp8 && (Tile::kEarlyDescaleWindow || !BlockInfoT::kHasRight);
    // Without a right edge only: causal kernels lost 1.5-2.6% with it (S43V).
    static constexpr bool kRescaleInExp = Tile::kRescaleInExp && (!BlockInfoT::kHasRight || Tile::kAnchorPvWait);
    // With a right edge only: kernels without one lost 1.6-2.7% anchored (tile_size.h: kAnchorPvWait).
    static constexpr bool kAnchor = kRescaleInExp && Tile::kAnchorPvWait && BlockInfoT::kHasRight;
    static_assert(!kAnchor || Tile::kWarpgroupRelease, "the anchor predicates the one-thread release");
    int const lane = threadIdx.x % cutlass::NumThreadsPerWarp;
    int window_top = 0;
    float k_cur = 0.f, v_cur = 0.f, k_next = 0.f, v_next = 0.f;
    auto fetch = [&](int top, float& k, float& v) {
      if constexpr (kFp8) {
        int const token = cute::max(top - lane, n_block_min) * kBlockN;
        k = q_descale * k_scales(token);
        v = v_scales(token);
      }
    };
    auto open_window = [&](int top) {
      window_top = top;
      fetch(top, k_cur, v_cur);
      if (top - 32 >= n_block_min) fetch(top - 32, k_next, v_next);
    };
    // Blocks come in falling order, at most 32 apart between calls.
    auto window_scales = [&](int n) {
      if constexpr (kFp8) {
        if (window_top - n >= 32) {
          window_top -= 32;
          k_cur = k_next, v_cur = v_next;
          if (window_top - 32 >= n_block_min) fetch(window_top - 32, k_next, v_next);
        }
        int const i = window_top - n;
        return cute::array<float, 2>{__shfl_sync(0xffffffff, k_cur, i), __shfl_sync(0xffffffff, v_cur, i)};
      } else {
        return cute::array<float, 2>{q_descale, 1.f};
      }
    };
    auto block_scales = [&](int n, auto windowed) {
      if constexpr (decltype(windowed)::value) return window_scales(n);
      else return cute::array<float, 2>{qk_scale(n), v_descale(n)};
    };
    MaskT const mask{seq, p.window_left, p.window_right};
    // KV caches: a warp whose 16 rows are all past the tile's last one (a decode step's tile fills 4 of 128 with GQA
    // packing) skips their softmax (those rows are never stored; their P stays finite or not, row by row, and only
    // their own O rows see it), leaving its issue slots to the e4m3 converters and the GEMM issue.
    // The warp index comes from lane 0 so that ptxas sees a warp-uniform branch: with it (and split-KV compiled
    // out) the consumers keep their pipeline state in uniform registers (docs/perf-notes.md, session 9).
    bool const warp_live = [&] {
      if constexpr (kPaged) {
        int const warp = __shfl_sync(0xffffffffu, thread_idx / cutlass::NumThreadsPerWarp, 0);
        return row_offset + 16 * warp < seq.seqlen_q;
      } else {
        return true;
      }
    }();
    // Ping-pong turns only with the other warpgroup working (one-consumer mode: warpgroup 0 alone).
    auto sched_sync = [&] {
      if (!p.one_consumer) Sched::sync(wg);
    };
    auto sched_arrive = [&] {
      if (!p.one_consumer) Sched::arrive(wg);
    };

    Tensor sQ = make_tensor(make_smem_ptr(ts.smem_q.data()), SmemLayoutQ{});

    TiledMmaQK mma_qk;
    auto thr_qk = mma_qk.get_thread_slice(thread_idx);
    // The PV GEMM and its B operand (MMA, 1, K, stage): V's stages, or (e4m3 cache) the V^T e4m3 stages.
    auto pv = [&] {
      if constexpr (kFp8Cache) {
        TiledMmaPV8 mma_pv8;
        Tensor sVt8 = make_tensor(make_smem_ptr(ts.smem_vt8.data()), SmemLayoutVt8{});
        return cute::make_tuple(mma_pv8, mma_pv8.get_thread_slice(thread_idx).partition_fragment_B(sVt8));
      } else {
        TiledMmaPV mma_pv;
        Tensor sVt = make_tensor(make_smem_ptr(ts.smem_v.data()), SmemLayoutVt{});
        return cute::make_tuple(mma_pv, mma_pv.get_thread_slice(thread_idx).partition_fragment_B(sVt));
      }
    }();
    auto& mma_pv = get<0>(pv);
    auto& tOrV = get<1>(pv);
    // The S GEMMs' operands: Q's stage and K's 16-bit stages, or (e4m3 cache) q's two e4m3 terms and K's e4m3 stages.
    // e4m3 caches, tiles of at most 8 rows (a decode step's GQA-packed heads): each thread's second accumulator row
    // (rows 8-15 of warp 0; warps 1-3 skip the softmax already) is padding, so the unmasked steps leave it alone: the
    // live warp's chain per block is what paced the decode (perf-notes, session 49), and their S GEMMs read q's two
    // terms folded into one (prepare_q8). Head dims up to 128: at 256 the second loop took the e4m3-cache kernels'
    // spills from ~850 to 1000-1500 bytes a unit.
    constexpr bool kHalfRows = kFp8Cache && kHeadDim <= 128;
    bool const half_rows = kHalfRows && seq.seqlen_q - row_offset <= 8;
    if constexpr (kFp8Cache) prepare_q8(ts, q_stage, wg, thread_idx, half_rows);
    auto qk = [&] {
      if constexpr (kFp8Cache) {
        TiledMmaQK8 mma_qk8;
        auto thr_qk8 = mma_qk8.get_thread_slice(thread_idx);
        Tensor sQ8 = make_tensor(make_smem_ptr(reinterpret_cast<ElementKV*>(&sQ(0, 0, wg, q_stage))), SmemLayoutQ8{});
        Tensor sK8 = make_tensor(make_smem_ptr(ts.smem_k8.data()), SmemLayoutK8{});
        return cute::make_tuple(mma_qk8, thr_qk8.partition_fragment_A(sQ8),  // (MMA, 1, K, term)
                                thr_qk8.partition_fragment_B(sK8));         // (MMA, 1, K, stage)
      } else {
        Tensor sK = make_tensor(make_smem_ptr(ts.smem_k.data()), SmemLayoutK{});
        return cute::make_tuple(mma_qk, thr_qk.partition_fragment_A(sQ)(_, _, _, wg, q_stage),  // (MMA, 1, K)
                                thr_qk.partition_fragment_B(sK));                            // (MMA, 1, K, stage)
      }
    }();
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<_64, BN>{});
    Tensor tScS = rowcol(thr_qk.partition_C(make_identity_tensor(Shape<_64, BN>{})));
    Tensor scores = rowcol(tSrS);
    // P as the A operand of the PV GEMM. 16-bit: the accumulator's own layout. FP8: per 32-key k-block
    // a thread holds 4 registers of 4 keys, (row r, keys 16h + 4t .. 16h + 4t + 3) in register 2h + r,
    // while its accumulator holds keys 8j + 2t, 8j + 2t + 1; V^T's key permutation makes the accumulator's
    // keys {16h + 2t, +1, 16h + 8 + 2t, +1} the ones the A operand wants, so the conversion only regroups.
    // e4m3 cache: P as e4m3, in FP8's layout.
    using ElementP = std::conditional_t<kFp8Cache, ElementKV, Element>;
    Tensor tOrP = [&] {
      if constexpr (kFp8 || kFp8Cache) {
        return make_tensor<ElementP>(Shape<Shape<_4, _2, _2>, _1, Int<kBlockN / 32>>{});
      } else {
        return make_tensor<Element>(acc_layout_as_a_operand(tSrS.layout()));
      }
    }();
    // Anchored kernels (kAnchor: every exponential before the PV wait) alternate two P fragments over pairs of
    // unmasked steps: the step converts P into the one the in-flight PV GEMM does not read. With one, ptxas converted
    // into spare registers under the GEMM and moved them into the A operand after its wait (24 moves a step at
    // head dim 128: perf-notes, session 50).
    // (Not in kernels with a left edge too (windows): their four step copies spilled 2.5 KB.)
    static constexpr bool kDoubleP = kAnchor && !BlockInfoT::kHasLeft;
    auto tOrP2 = [&] {  // (nothing in kernels with one fragment)
      if constexpr (kDoubleP) return make_fragment_like(tOrP);
      else return cute::Int<0>{};
    }();

    // Dropout for the (batch, head) of the tile, applied to P after the softmax, whose sums saw every score.
    // (Drawing a block's random bytes while its S GEMM runs instead measured no faster at head dims 64 and
    // 128 and 0.1x slower at 256; drawn a step ahead by the producer's three spare warps, as the backward does
    // (dropout_feed.h), the forward ran 1.36-2.14x its time without dropout against 1.23-1.65x here: its steps are
    // too short for three warps' Philox rounds. docs/perf-notes.md, sessions 24 and 28.)
    auto const drop = [&] {
      if constexpr (Dropout::kEnabled) return p.dropout.stream(batch * get<2>(p.shape_q) + head);
      else return 0;
    }();
    // FP8's regrouping: emit(four, r, h, kb) gets the 4 accumulator values that go to A-operand register
    // (make_coord(_, r, h), 0, kb). half: row r = 0 only (the other's registers keep what they held).
    auto regroup = [&](auto&& emit, auto half) {
      static_assert(!(kFp8 || kFp8Cache) || kBlockN % 32 == 0);
      CUTE_UNROLL
      for (int kb = 0; kb < kBlockN / 32; ++kb) {
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          CUTE_UNROLL
          for (int r = 0; r < (decltype(half)::value ? 1 : 2); ++r) {
            cutlass::Array<float, 4> four;
            CUTE_UNROLL
            for (int b = 0; b < 4; ++b) four[b] = tSrS(make_coord(b % 2, r, kb * 4 + h * 2 + b / 2), 0, 0);
            emit(four, r, h, kb);
          }
        }
      }
    };
    auto to_p = [&](int n, auto half) {
      if constexpr (kFp8 || kFp8Cache) {
        regroup([&](cutlass::Array<float, 4> const& four, int r, int h, int kb) {
          auto const packed = cutlass::NumericArrayConverter<ElementP, float, 4>{}(four);
          CUTE_UNROLL
          for (int b = 0; b < 4; ++b) tOrP(make_coord(b, r, h), 0, kb) = packed[b];
        }, half);
      } else {
        Tensor p16 = convert_type<Element>(tSrS);
        if constexpr (Dropout::kEnabled) {
          Dropout::template apply<true>(drop, rowcol(p16), tScS, row_offset, n * kBlockN);
        }
        CUTE_UNROLL
        for (int i = 0; i < size(tOrP); ++i) tOrP(i) = p16(i);
      }
    };
    // kDoubleP: P into the second fragment (to_p's e4m3 conversion; kept apart so that kernels with one fragment
    // compile as before).
    auto to_p2 = [&] {
      if constexpr (kDoubleP) {
        regroup([&](cutlass::Array<float, 4> const& four, int r, int h, int kb) {
          auto const packed = cutlass::NumericArrayConverter<ElementP, float, 4>{}(four);
          CUTE_UNROLL
          for (int b = 0; b < 4; ++b) tOrP2(make_coord(b, r, h), 0, kb) = packed[b];
        }, cute::false_type{});
      }
    };
    // O is kept in units of the V descale of the newest key block in it: moving from block n + 1 to
    // n multiplies by v_descale(n + 1) / v_descale(n) together with the softmax rescale.
    // (e4m3 cache: the largest V scale of the newest block, set by to_p_cache; 0 before the first.)
    float v_descale_prev = kFp8Cache ? 0.f : v_descale(n_block_max - 1);
    // FP8: the factor that moves O from the previous block's V descale to vd's, which becomes the current one.
    auto take_v_descale = [&](float vd) {
      float const ratio = v_descale_prev / vd;
      v_descale_prev = vd;
      return ratio;
    };
    auto rescale_o = [&](cute::array<float, 2> o_scale, float vd) {
      if constexpr (kFp8) {
        float const ratio = take_v_descale(vd);
        o_scale[0] *= ratio;
        o_scale[1] *= ratio;
      }
      Tensor o = rowcol(tOrO);
      // Warp-uniform: the rows of O are the warp's own, and a row whose max stayed has o_scale 1.
      if (kLazyRescale == 0 || __any_sync(0xffffffffu, softmax.max_moved)) Softmax::rescale(o, o_scale);
    };

    Tensor tScSflat = thr_qk.partition_C(make_identity_tensor(Shape<_64, BN>{}));
    // Per-key factors from a stage's array, two adjacent keys per 8-byte load: the accumulator fragment
    // holds (key pair, row pair, key group) in that order (utils.h rowcol), so elements 4g .. 4g + 3 are keys c, c + 1
    // of two rows. `extra` multiplies every factor.
    // half: the fragment's first row of each pair only (kHalfRows below).
    auto apply_factors = [&](auto& frag, float const* base, int stage, float extra, auto half) {
      CUTE_UNROLL
      for (int g = 0; g < size(frag) / 4; ++g) {
        float2 f;
        cutlass::arch::shared_load<8>(&f, cute::cast_smem_ptr_to_uint(base + stage * kBlockN + get<1>(tScSflat(4 * g))));
        CUTE_UNROLL
        for (int e = 0; e < (decltype(half)::value ? 2 : 4); ++e) {
          using T = std::decay_t<decltype(frag(0))>;
          frag(4 * g + e) = static_cast<T>(float(frag(4 * g + e)) * ((e % 2 == 0 ? f.x : f.y) * extra));
        }
      }
    };
    // K's scales (the e4m3 stage's) and the rows' 1 / q scales on S (before the score mod and mask; read before the K
    // stage is released). The thread's accumulator rows are the same in every block.
    float const row_factor[2] = {kFp8Cache ? ts_qrow(ts, wg, get<0>(tScSflat(0))) : 1.f,
                                 kFp8Cache ? ts_qrow(ts, wg, get<0>(tScSflat(2))) : 1.f};
    auto scale_s = [&](int stage, auto half) {
      if constexpr (kFp8Cache) {
        CUTE_UNROLL
        for (int g = 0; g < size(tSrS) / 4; ++g) {
          float2 f;
          cutlass::arch::shared_load<8>(&f, cute::cast_smem_ptr_to_uint(ts.smem_ks.data() + stage * kBlockN +
                                                                        get<1>(tScSflat(4 * g))));
          if constexpr (decltype(half)::value) {  // one GEMM on the first term: row g + 8 holds row g's second
            tSrS(4 * g) += tSrS(4 * g + 2);
            tSrS(4 * g + 1) += tSrS(4 * g + 3);
          }
          tSrS(4 * g) *= f.x * row_factor[0];
          tSrS(4 * g + 1) *= f.y * row_factor[0];
          if constexpr (!decltype(half)::value) {
            tSrS(4 * g + 2) *= f.x * row_factor[1];
            tSrS(4 * g + 3) *= f.y * row_factor[1];
          }
        }
      }
    };
    // S_n = Q K_n^T for key block n; the caller waits for it.
    // half (kHalfRows): q's terms folded into the first one (prepare_q8), half the GEMM.
    auto issue_s = [&](auto half) {
      pipeline_k.consumer_wait(read_k);
      // Gathered K: cp.async wrote the stage through the generic proxy; the WGMMA reads it through the async one.
      if constexpr (kGatherKV) cutlass::arch::fence_view_async_shared();
      if constexpr (kFp8Cache) {
        auto const& tSrQ8 = get<1>(qk);
        if constexpr (decltype(half)::value) {
          wgmma<true, -1>(get<0>(qk), tSrQ8(_, _, _, 0), get<2>(qk)(_, _, _, read_k.index()), tSrS);
        } else {
          wgmma_sum<-1>(get<0>(qk), tSrQ8(_, _, _, 0), tSrQ8(_, _, _, 1), get<2>(qk)(_, _, _, read_k.index()), tSrS);
        }
      } else {
        wgmma<true, -1>(get<0>(qk), get<1>(qk), get<2>(qk)(_, _, _, read_k.index()), tSrS);
      }
    };
    auto release_k = [&] {
      pipeline_k.consumer_release(read_k);
      ++read_k;
    };
    // Cache rows past the entry's keys in its highest block (the rest of a page) are not clipped by TMA and may
    // hold anything, NaN included, which P = 0 would not cancel (0 * NaN): each warpgroup zeroes them in that V
    // stage before its first PV GEMM reads it (both write the same zeros; K's are masked to -inf instead).
    int guard_rows = 0;  // valid keys of the highest block, when it has fewer than kBlockN
    if constexpr (!Seqlens::kKVRowsClipped && !kFp8Cache) {  // (e4m3 cache: convert() writes those rows as zeros)
      static_assert(!kFp8, "V row guard: 16-bit V tiles");
      int const valid = seq.seqlen_k - (n_block_max - 1) * kBlockN;
      guard_rows = valid < kBlockN ? valid : 0;
    }
    auto guard_v = [&](int stage) {
      if constexpr (!Seqlens::kKVRowsClipped && !kFp8Cache) {
        if (guard_rows > 0) {
          Tensor sV = make_tensor(make_smem_ptr(ts.smem_v.data()), SmemLayoutV{});  // (keys, headdim_v, stage)
          constexpr int kVec = 16 / sizeof(Element);  // 16 bytes: contiguous under the swizzle
          int const n = (kBlockN - guard_rows) * (kHeadDimV / kVec);
          for (int i = thread_idx; i < n; i += cutlass::NumThreadsPerWarpGroup) {
            int const r = guard_rows + i / (kHeadDimV / kVec), c = (i % (kHeadDimV / kVec)) * kVec;
            *reinterpret_cast<uint4*>(&sV(r, c, stage)) = make_uint4(0, 0, 0, 0);
          }
          cutlass::arch::fence_view_async_shared();  // the generic-proxy zeros before the GEMM's async reads
          warpgroup_barrier_sync(wg);
          guard_rows = 0;
        }
      }
    };
    // e4m3 cache, once the softmax of block n is done and the previous PV GEMM has finished: wait for block n's V^T
    // stage, move O to the units of its largest V scale (with the softmax's o_scale, `rescale`) and turn P, times its
    // keys' factors and 2^8, into e4m3 (2^8: e4m3's smallest normal is 2^-6, as FP8's kMaxOffset). (A block whose V
    // rows are all zeros, scales 0, keeps O's units.)
    auto to_p_cache = [&](auto rescale, cute::array<float, 2> o_scale, auto half) {
      constexpr int kLive = decltype(half)::value ? 1 : 2;
      if constexpr (kFp8Cache) {
        pipeline_v.consumer_wait(read_v);
        int const stage = read_v.index();
        float vmax;
        cutlass::arch::shared_load<4>(&vmax, cute::cast_smem_ptr_to_uint(ts.smem_vmax.data() + stage));
        float const unit = vmax > 0.f ? vmax : v_descale_prev;
        float const ratio = v_descale_prev > 0.f && unit > 0.f ? v_descale_prev / unit : 1.f;
        v_descale_prev = unit;
        if (warp_live) {
          if constexpr (decltype(rescale)::value) {
            o_scale[0] *= ratio;
            o_scale[1] *= ratio;
            Tensor o = rowcol(tOrO);
            Softmax::template rescale<kLive>(o, o_scale);
          }
          apply_factors(tSrS, ts.smem_vfac.data(), stage, kPFactor, half);
        }
        to_p(0, half);
      }
    };
    // O += P V for the block whose P is in tOrP (e4m3 cache: its V^T stage waited for by to_p_cache).
    auto issue_pv = [&] {
      if constexpr (!kFp8Cache) {
        pipeline_v.consumer_wait(read_v);
        guard_v(read_v.index());
      }
      wgmma<false, -1>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
    };
    auto issue_pv2 = [&] {  // kDoubleP: O += P V from the second fragment
      if constexpr (kDoubleP) {
        pipeline_v.consumer_wait(read_v);
        guard_v(read_v.index());
        wgmma<false, -1>(mma_pv, tOrP2, tOrV(_, _, _, read_v.index()), tOrO);
      }
    };
    auto release_v = [&] {
      pipeline_v.consumer_release(read_v);
      ++read_v;
    };
    // Key blocks are walked from the last. Masked iterations at the top: [n_right, n_block_max) hold the
    // sequence end (the highest block only) or a key past some row's right edge; masked at the bottom:
    // [n_block_min, n_left) hold a key before some row's left edge. The top ones also apply the left
    // edge, for windows narrow enough that the two ranges meet.
    int const n_right = BlockInfoT::kHasRight ? cute::max(bi.n_block_right_masked_begin(m_block), n_block_min)
                                              : n_block_max;
    int const n_left = BlockInfoT::kHasLeft ? cute::min(cute::max(bi.n_block_left_masked_end(m_block), n_block_min),
                                                        n_right)
                                            : n_block_min;

    // First (highest) key block: S only; it always carries the sequence-end mask and both edges.
    int n_block = n_block_max - 1;
    // Tile::kEarlyDescaleWindow: the descale window opens before the first GEMM, its loads landing under the masked
    // steps (opened after them, the first unmasked step waits for its loads); otherwise after the masked steps.
    auto open_window_at = [&](int n_first) {  // n_first: the first unmasked block
      if (kDescaleWindow && n_first >= n_left) {
        open_window(Tile::kWarpgroupRelease ? cute::max(n_first - 1, n_block_min) : n_first);
      }
    };
    if constexpr (Tile::kEarlyDescaleWindow) open_window_at(cute::min(n_block_max - 2, n_right - 1));
    sched_sync();
    issue_s(cute::false_type{});
    sched_arrive();
    on_first_issue();
    warpgroup_wait<0>();
    if (warp_live) scale_s(read_k.index(), cute::false_type{});
    release_k();
    if (warp_live) {
      p.score_mod.apply(scores);
      mask.template apply<true, true, true>(scores, tScS, row_offset, n_block);
      softmax.template update<true, true>(scores, qk_scale(n_block));
    }
    if constexpr (kFp8Cache) to_p_cache(cute::false_type{}, {}, cute::false_type{});
    else to_p(n_block, cute::false_type{});

    // S_n is issued together with O += P_{n+1} V_{n+1}; the softmax of S_n runs while the PV GEMM
    // is still on the tensor cores, and O is rescaled once it has finished.
    // With the warpgroup release, e4m3's descales are loaded one block ahead: the first exponential's FFMA then waits
    // for no load issued in its own step, and ptxas can keep the PV wait after the exponentials (perf-notes, session 15).
    float next_s_scale = 0.f, next_vd = 0.f;
    if constexpr (Tile::kWarpgroupRelease) {
      next_s_scale = qk_scale(cute::max(n_block_max - 2, 0));
      next_vd = v_descale(cute::max(n_block_max - 2, 0));
    }
    // Forced inline: with three instances (right-masked, plain, left-masked: windows over a KV cache) cicc kept one
    // as a call, and every fragment it touches went to the stack (1.3-1.5 KB of local memory a thread).
    // half (kHalfRows): the thread's second accumulator row is padding; its scores, softmax, factors and P are skipped.
    // pb: the P fragments the step reads (its PV GEMM) and writes (to_p): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0).
    auto step = [&](int n, auto right_edge, auto left_edge, auto half, auto pb) CUTLASS_LAMBDA_FUNC_INLINE {
      constexpr bool kRight = decltype(right_edge)::value, kLeft = decltype(left_edge)::value;
      constexpr int kPb = decltype(pb)::value;
      static_assert(kPb == 0 || (kDoubleP && kRescaleInExp), "two P fragments: anchored steps only");
      constexpr int kLive = decltype(half)::value ? 1 : 2;
      // Per-block descale loads go out before the GEMMs and land while they run; the window's shuffles go after the
      // GEMM issue (the first one after opening waits for the window's loads).
      constexpr bool kWindowed = kDescaleWindow && !(kRight || kLeft);
      float s_scale, vd;
      auto prefetch = [&] {
        auto const next = block_scales(cute::max(n - 1, n_block_min), cute::bool_constant<kWindowed>{});
        next_s_scale = next[0], next_vd = next[1];
      };
      if constexpr (Tile::kWarpgroupRelease) {
        s_scale = next_s_scale, vd = next_vd;
        if constexpr (!kWindowed) prefetch();
      } else if constexpr (!kWindowed) {
        auto const scales = block_scales(n, cute::false_type{});
        s_scale = scales[0], vd = scales[1];
      }
      sched_sync();
      issue_s(half);
      if constexpr (kPb == 2) issue_pv2();
      else issue_pv();
      sched_arrive();
      if constexpr (kWindowed) {
        if constexpr (Tile::kWarpgroupRelease) {
          prefetch();
        } else {
          auto const scales = window_scales(n);
          s_scale = scales[0], vd = scales[1];
        }
      }
      warpgroup_wait<1>();
      if (warp_live) scale_s(read_k.index(), half);
      if constexpr (!kAnchor) release_k();
      if constexpr (kRescaleInExp) {
        static_assert(!Tile::kPvWaitFirst && !kFp8Cache && kLazyRescale == 0);
        float const ratio = kFp8 ? take_v_descale(vd) : 1.f;
        // dep: an exponential (kAnchor). ptxas keeps the PV wait after K's release (both ordered); an arrive predicated
        // on an exponential's bits cannot move above it. Never 0xffffffff (the canonical NaN is 0x7fffffff), so the
        // arrive always happens; `!(dep < 0)` would be folded away (MUFU.EX2 is never negative).
        auto at_exp = [&](float dep) {
          if constexpr (kAnchor) {
            pipeline_k.consumer_release(read_k, __float_as_uint(dep) != 0xffffffffu);
            ++read_k;
          }
          warpgroup_wait<0>();
          release_v();
        };
        // Row 0's 8th exponential: ptxas then put all 99 before the wait (S43, SASS); a later one changed nothing.
        constexpr int kWaitAfter = kAnchor ? 8 : 0;
        if (warp_live) {
          p.score_mod.apply(scores);
          if constexpr (kRight || kLeft) mask.template apply<false, kRight, kLeft>(scores, tScS, row_offset, n);
          Tensor o = rowcol(tOrO);
          softmax.template update_rescaling<kRight || kLeft, kWaitAfter>(scores, s_scale, o, ratio, at_exp);
        } else {
          at_exp(0.f);
        }
        if constexpr (kPb == 1) to_p2();
        else to_p(n, half);
        return;
      }
      if constexpr (Tile::kPvWaitFirst) {
        warpgroup_wait<0>();
        release_v();
      }
      cute::array<float, 2> o_scale{};
      if (warp_live) {
        p.score_mod.apply(scores);
        if constexpr (kRight || kLeft) mask.template apply<false, kRight, kLeft>(scores, tScS, row_offset, n);
        o_scale = softmax.template update<false, kRight || kLeft, kLive>(scores, s_scale);
      }
      if constexpr (!Tile::kPvWaitFirst) {
        warpgroup_wait<0>();
        release_v();
      }
      if constexpr (kFp8Cache) {
        to_p_cache(cute::true_type{}, o_scale, half);
      } else {
        if (warp_live) rescale_o(o_scale, vd);
        to_p(n, half);
      }
    };
    constexpr bool kLeftEdge = BlockInfoT::kHasLeft;
    // (kHalfRows: above, with prepare_q8.)
    for (--n_block; n_block >= n_right; --n_block) {
      step(n_block, cute::true_type{}, cute::bool_constant<kLeftEdge>{}, cute::false_type{}, cute::Int<0>{});
    }
    if constexpr (!Tile::kEarlyDescaleWindow) open_window_at(n_block);
    if constexpr (kHalfRows) {
      if (half_rows) {
        for (; n_block >= n_left; --n_block) {
          step(n_block, cute::false_type{}, cute::false_type{}, cute::true_type{}, cute::Int<0>{});
        }
      }
    }
    if constexpr (kDoubleP) {
      for (; n_block >= n_left + 1; n_block -= 2) {
        step(n_block, cute::false_type{}, cute::false_type{}, cute::false_type{}, cute::Int<1>{});
        step(n_block - 1, cute::false_type{}, cute::false_type{}, cute::false_type{}, cute::Int<2>{});
      }
    }
    for (; n_block >= n_left; --n_block) {
      step(n_block, cute::false_type{}, cute::false_type{}, cute::false_type{}, cute::Int<0>{});
    }
    if constexpr (kLeftEdge) {
      for (; n_block >= n_block_min; --n_block) {
        step(n_block, cute::false_type{}, cute::true_type{}, cute::false_type{}, cute::Int<0>{});
      }
    }
    sched_sync();
    issue_pv();
    sched_arrive();
    warpgroup_wait<0>();
    release_v();
    return (kFp8Cache ? v_descale_prev / kPFactor : v_descale_prev) * p.dropout.scale();
  }
};

}  // namespace flashhopper::sm90
