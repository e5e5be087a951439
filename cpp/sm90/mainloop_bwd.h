// Hopper backward mainloop. A CTA owns one block of kBlockN keys of one (batch, query head) and
// walks the query blocks that see it. Per query block m, on the two consumer warpgroups:
//
//   S  = Q K^T,  dP = dO V^T                  (SS WGMMA, from the TMA'd Q/dO stage and K/V)
//   P  = exp2(S * scale * log2e - LSE_m * log2e)   (recomputed from the forward's LSE)
//   dS = P * (dP - D_m),   D = rowsum(dO * O)   (from the preprocess kernel)
//   dV += P^T dO,  dK += dS^T Q                 (accumulated in registers over all m)
//   dQ_m += dS K                                (summed over key blocks in a float32 buffer)
//
// BwdTileSize picks one of two layouts (see tile_size.h): S^T with P^T/dS^T as register operands
// (kSdPSwapAB), or S with P/dS through shared memory and dV^T/dK^T split over the head dim.
// The producer warp loads K and V once (through the KVBlocks hook, kv_blocks.h), then Q (+ its LSE row
// statistics) and dO (+ D) per query block through PipelineTmaAsync stages. The query blocks, and
// which of them are masked (at the bottom of the walk for the right edge, at the top for a left edge),
// come from BlockInfo for the batch entry's bounds (Seqlens); the score mod's gradient from ScoreMod.
//
// dQ is summed in a float32 buffer laid out as the consumers' fragments (dq_frag_layout.h), by one of
// two paths (DqPath):
//  - kWriterBulk: each warpgroup stages its share of a slice in shared memory and a dQ-writer warp adds
//    the buffer with one bulk reduce-add (head dims 64/128, and the deterministic mode at every head
//    dim: there the ordered additions wait on each other, which TMA's completion counts hide better);
//  - kConsumerRed: the consumers add it themselves with 16-byte `red`s (head dim 256: its four slices a
//    step made the staging round trips cost more than the reductions).
// softmax_scale is applied once: to dK here, to dQ by the postprocess kernel.
#pragma once

#include <cute/tensor.hpp>

#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include <type_traits>

#include "../common/block_info.h"
#include "../common/dq_frag_layout.h"
#include "../common/dropout.h"
#include "../common/mask.h"
#include "../common/score_mod.h"
#include "../common/semaphore.h"
#include "../common/seqlen.h"
#include "../common/softmax.h"
#include "../common/utils.h"
#include "../common/workspace_bwd.h"
#include "dropout_feed.h"
#include "gemm.h"
#include "global_reduce.h"
#include "kv_blocks.h"
#include "named_barriers.h"

namespace flashhopper::sm90 {

using namespace cute;

// Operand descriptors of `t` as the A (kA) or B operand of a thread's slice of a tiled MMA.
template <bool kA, class ThrMma, class TensorT>
CUTE_DEVICE auto fragment_ab(ThrMma const& thr, TensorT const& t) {
  if constexpr (kA) {
    return thr.partition_fragment_A(t);
  } else {
    return thr.partition_fragment_B(t);
  }
}

enum class DqPath { kWriterBulk, kConsumerRed };

// kDeterministic: the instantiation the deterministic mode runs (the writer path at every head dim).
template <class Element_, int kHeadDim_, int kHeadDimV_, class Tile, MaskKind kMask_, bool kDeterministic = false,
          class ScoreMod_ = ScoreModIdentity, class Dropout_ = DropoutNone, class KVBlocks_ = ContiguousKVBlocks,
          class Seqlens_ = UniformSeqlens>
struct BwdMainloop {
  using Element = Element_;
  using ScoreMod = ScoreMod_;
  using Dropout = Dropout_;  // common/dropout.h: the forward's keep mask, drawn again per step (DropFeed below)
  using KVBlocks = KVBlocks_;
  using Seqlens = Seqlens_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN;
  static constexpr int kHeadDimV = kHeadDimV_;  // of V, O, dO and dV
  static constexpr int kStages = Tile::kStages, kStagesdO = Tile::kStagesdO, kStagesdS = Tile::kStagesdS;
  static constexpr MaskKind kMask = kMask_;
  static constexpr bool kSdPSwapAB = Tile::kSdPSwapAB, kdKVSwapAB = Tile::kdKVSwapAB;
  // P^T and dS^T as register A operands of the dV/dK GEMMs: their accumulator rows are keys.
  static constexpr bool kdKVRegsA = kSdPSwapAB && !kdKVSwapAB;
  // dS from the float32 P, with P^T made 16-bit (and dV issued) after the dS math (W8: 1-6% faster
  // at head dims 64 and 128). With dropout too, since its keep bits come from the feed (no Pd tile beside P).
  static constexpr bool kLateP = kdKVRegsA;
  static_assert(kSdPSwapAB != kdKVSwapAB, "supported layouts: S^T with dK/dV, or S with dK^T/dV^T");
  static constexpr int kNumMmaWG = 2;
  static constexpr int kNumMmaThreads = kNumMmaWG * cutlass::NumThreadsPerWarpGroup;
  // dQ (kBlockM x headdim): a 64-row block split over the warpgroups by columns, or 128 rows by rows.
  static_assert(kBlockM == 64 || kBlockM == 128, "dQ: one 64-row WGMMA atom per warpgroup");
  static_assert(kStagesdS == 1 || kStagesdS == kStages, "dS stages follow the Q stages");
  static constexpr DqPath kDqPath = kHeadDim >= 256 && !kDeterministic ? DqPath::kConsumerRed : DqPath::kWriterBulk;
  static constexpr bool kdQAtomic = kDqPath == DqPath::kConsumerRed;
  // dQ^T = K^T dS^T (Tile::kdQSwapAB, with the consumers' reds only): slice s of warpgroup w is head-dim rows
  // 64 (2 s + w) .. + 64 of dQ^T for all kBlockM queries, one N = kBlockM WGMMA per key step, one slice at a time.
  static constexpr bool kdQSwapAB = Tile::kdQSwapAB && kdQAtomic;
  static_assert(!kdQSwapAB || (!kSdPSwapAB && kBlockM == 64 && kHeadDim % (64 * kNumMmaWG) == 0),
                "dQ^T: S (not S^T) tiles of 64 queries, whole 64-row head-dim atoms per warpgroup");
  static constexpr int kdQSlices = kdQSwapAB ? kHeadDim / (64 * kNumMmaWG) : Tile::kdQSlices;
  // Without determinism the writer counts a query block's additions this many blocks after issuing
  // them, when they have long completed, so that waiting for them does not hold up the hand-offs
  // (1 and 2 measured alike).
  static constexpr int kdQCountLag = 1;
  // Without determinism and without a mask, the writer counts its last blocks as issued (kDqUnlanded): waiting
  // for them to land kept each CTA on its SM for the round trip (d64, 512 tokens: main kernel 440 -> 418 us).
  // Only then: there every key block ends on query block 0 of its head, which alone waits for the grid; with a
  // causal or window mask each ends on its own diagonal block, and nearly every block would (perf-notes, S21A).
  static constexpr bool kCountLastIssued = kMask == MaskKind::kNone;
  using BlockInfoT = BlockInfo<kBlockM, kBlockN, kMask>;
  using MaskT = Mask<kBlockN, kMask>;

  using D = Int<kHeadDim>;
  using DV = Int<kHeadDimV>;
  using BM = Int<kBlockM>;
  using BN = Int<kBlockN>;
  // dQ is computed in kdQSlices column slices, each split over the two warpgroups: by columns in 64-row
  // blocks, by rows in 128-row ones (each warpgroup then runs N = DSlice WGMMAs on its own rows of dS, which
  // reads less shared memory per FLOP than two N = DSlice / 2 halves of all rows).
  static constexpr bool kdQSplitRows = kBlockM == 128;
  using DSlice = Int<kHeadDim / kdQSlices>;
  using DQCols = Int<kdQSplitRows ? kHeadDim / kdQSlices : kHeadDim / kdQSlices / 2>;  // a warpgroup's of a slice
  // (dQ^T: a warpgroup's head-dim rows of a slice, 64.)

  // ---- GEMMs: one TiledMma over both consumer warpgroups (thread index 0..255) each ----------
  // S or S^T (and dP or dP^T), K = headdim; split over the keys.
  using ShapeSdP = std::conditional_t<kSdPSwapAB, Shape<BN, BM>, Shape<BM, BN>>;
  using AtomShapeSdP = std::conditional_t<kSdPSwapAB, Shape<Int<kBlockN / 2>, BM, D>, Shape<BM, Int<kBlockN / 2>, D>>;
  using AtomLayoutSdP = std::conditional_t<kSdPSwapAB, Layout<Shape<_2, _1, _1>>, Layout<Shape<_1, _2, _1>>>;
  using TiledMmaSdP = decltype(make_tiled_mma(ss_atom<Element, Element, float, AtomShapeSdP>(), AtomLayoutSdP{}));
  // dV, dK (kBlockN x headdim, split over keys) or dV^T, dK^T (headdim x kBlockN, split over the
  // head dim), K = kBlockM. dK^T's and dV^T's warpgroups each take whole 64-row atoms of their GEMM's head dim (256:
  // 128 rows each); Q/K 192 mirrors uneven shares instead (kdKVMirror, below). (192 split the keys until session 28:
  // N = 48 atoms, which read 84 KB of shared memory a step per GEMM; the mirror measured 1-4% faster.)
  static_assert(!kdKVSwapAB || Tile::kdKVMirror || (kHeadDim % 128 == 0 && kHeadDimV % 128 == 0),
                "dK^T / dV^T: whole 64-row atoms per warpgroup, or the mirrored slots");
  template <class Dim>
  using ShapedKVOf = std::conditional_t<kdKVSwapAB, Shape<Dim, BN>, Shape<BN, Dim>>;
  template <class Dim>
  using AtomShapedKVOf = std::conditional_t<kdKVSwapAB, Shape<_64, BN, BM>, Shape<Int<kBlockN / 2>, Dim, BM>>;
  template <class Dim>
  using TiledMmadKVOf = decltype(make_tiled_mma(
      std::conditional_t<kdKVRegsA,
                         decltype(rs_atom<Element, Element, float, AtomShapedKVOf<Dim>, GMMA::Major::K,
                                          GMMA::Major::MN>()),
                         decltype(ss_atom<Element, Element, float, AtomShapedKVOf<Dim>, GMMA::Major::MN,
                                          GMMA::Major::MN>())>{},
      Layout<Shape<_2, _1, _1>>{}));
  using ShapedK = ShapedKVOf<D>;
  using ShapedV = ShapedKVOf<DV>;
  using TiledMmadK = TiledMmadKVOf<D>;
  using TiledMmadV = TiledMmadKVOf<DV>;
  // kdKVMirror (Q/K head dim 192, tile_size.h): dK^T and dV^T split over the head dim unevenly, mirrored, in three
  // 64-row slots per warpgroup of one warpgroup's N = kBlockN WGMMAs, each slot's operands chosen at run time
  // (dkv_slot). V 192: slot 0 is dV^T (both warpgroups), slot 1 dK^T on warpgroup 0 and dV^T on 1, slot 2 dK^T.
  // V 128 (five atoms): slot 0 is dV^T, slot 1 dK^T, slot 2 dK^T on warpgroup 0 and nothing on 1. So the dV^T
  // slots, which read dO, go out first and dO is released after slot 1 on both, as with one dV^T GEMM.
  static constexpr bool kdKVMirror = Tile::kdKVMirror;
  static constexpr bool kExpUnderdP = Tile::kExpUnderdP;
  static_assert(!kdKVMirror || (kdKVSwapAB && kHeadDim == 192 && (kHeadDimV == 192 || kHeadDimV == 128) && !kdQSwapAB),
                "mirrored slots: the 64-row atoms of dK^T (three) and dV^T (three or two) over two warpgroups");
  static constexpr int kdKVSlots = 3;
  using TiledMmadKVSlot = decltype(make_tiled_mma(
      ss_atom<Element, Element, float, Shape<_64, BN, BM>, GMMA::Major::MN, GMMA::Major::MN>(), Layout<Shape<_1, _1, _1>>{}));
  using ShapedKVSlot = Shape<_64, BN>;
  struct DkvSlot {
    bool is_v;  // dV^T (A = dO^T, B = P) or dK^T (A = Q^T, B = dS)
    int atom;   // its rows: head-dim columns 64 atom .. 64 atom + 63
    bool live;  // false: an empty slot (V 128, warpgroup 1's third)
  };
  CUTE_HOST_DEVICE static constexpr DkvSlot dkv_slot(int wg, int slot) {
    if constexpr (kHeadDimV == kHeadDim) {
      return wg == 0 ? DkvSlot{slot == 0, slot == 0 ? 2 : slot - 1, true} : DkvSlot{slot < 2, slot, true};
    } else {
      return slot == 0 ? DkvSlot{true, wg, true} : wg == 0 ? DkvSlot{false, slot - 1, true} : DkvSlot{false, 2, slot == 1};
    }
  }

  // What a consumer thread sums over the walk, cleared by the kernel and stored by the epilogue: dK and dV (or
  // dK^T and dV^T) fragments of TiledMmadK / TiledMmadV, or the kdKVMirror slots of TiledMmadKVSlot.
  struct AccumdKdV {
    decltype(partition_fragment_C(TiledMmadK{}, ShapedK{})) dk;
    decltype(partition_fragment_C(TiledMmadV{}, ShapedV{})) dv;
    CUTE_DEVICE void clear() {
      cute::clear(dk);
      cute::clear(dv);
    }
  };
  struct AccumSlots {
    cute::array<decltype(partition_fragment_C(TiledMmadKVSlot{}, ShapedKVSlot{})), kdKVSlots> slot;
    CUTE_DEVICE void clear() {
      CUTE_UNROLL
      for (int s = 0; s < kdKVSlots; ++s) cute::clear(slot[s]);
    }
  };
  using Accumulators = std::conditional_t<kdKVMirror, AccumSlots, AccumdKdV>;
  // dQ = dS K (kBlockM x headdim), one slice of DSlice columns at a time, split over the head dim.
  // dS is stored the way the S accumulator holds it (adjacent pairs contiguous), so as dQ's A
  // operand it is MN-major when S was S^T.
  static constexpr GMMA::Major kMajordS = kSdPSwapAB ? GMMA::Major::MN : GMMA::Major::K;
  // dQ^T: A = the K^T slice (MN-major: K's head dim is contiguous), B = dS^T, i.e. dS as stored (K-major).
  using ShapedQ = std::conditional_t<kdQSwapAB, Shape<DSlice, BM>, Shape<BM, DSlice>>;  // accumulator tile
  using AtomShapedQ = std::conditional_t<kdQSwapAB, Shape<_64, BM, BN>, Shape<_64, DQCols, BN>>;
  using MmaAtomdQ = std::conditional_t<
      kdQSwapAB, decltype(ss_atom<Element, Element, float, AtomShapedQ, GMMA::Major::MN, kMajordS>()),
      decltype(ss_atom<Element, Element, float, AtomShapedQ, kMajordS, GMMA::Major::MN>())>;
  using TiledMmadQ = decltype(make_tiled_mma(MmaAtomdQ{}, std::conditional_t<kdQSplitRows || kdQSwapAB,
                                                                              Layout<Shape<_2, _1, _1>>,
                                                                              Layout<Shape<_1, _2, _1>>>{}));
  // Fragment order of a dQ slice's sums (dq_frag_layout.h): a warpgroup's share is 64 rows x DQCols, group
  // slice * 2 + warpgroup of the query block's 64-row block, or group slice of 64-row block `warpgroup`;
  // dQ^T's: 64 head-dim rows x the 64 queries, group slice * 2 + warpgroup.
  using FragLayout = DqFragLayout<kdQSwapAB ? kBlockM : DQCols::value, kdQSwapAB>;
  static constexpr int kdQHalfFloats = 64 * DQCols::value;  // one warpgroup's share of a slice
  CUTE_HOST_DEVICE static constexpr int dq_share_offset(int slice, int wg) {  // floats, in its query block
    return kdQSplitRows ? wg * 64 * kHeadDim + FragLayout::offset(slice, 0, 0)
                        : FragLayout::offset(slice * kNumMmaWG + wg, 0, 0);
  }

  // ---- Shared memory --------------------------------------------------------------------------
  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BM, D>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<BM, D, Int<kStages>>{}));
  using SmemAtomdO = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BM, DV>());
  using SmemLayoutdO = decltype(tile_to_shape(SmemAtomdO{}, Shape<BM, DV, Int<kStagesdO>>{}));
  // Q^T and dO^T views (headdim, kBlockM, stage) of the same bytes, for the dK and dV GEMMs.
  using SmemLayoutQt = decltype(composition(SmemLayoutQ{}, make_ordered_layout(Shape<D, BM, Int<kStages>>{},
                                                                               Step<_2, _1, _3>{})));
  using SmemLayoutdOt = decltype(composition(SmemLayoutdO{}, make_ordered_layout(Shape<DV, BM, Int<kStagesdO>>{},
                                                                                 Step<_2, _1, _3>{})));
  // K^T is dQ's MN-major B operand, a warpgroup's DQCols columns at a time: those must be whole swizzle
  // atoms or lie inside one. At head dim 96 (48 columns) the 64-byte swizzle's 32-column atoms do
  // neither, so K and V take the 32-byte swizzle there; at 192 (96 columns a warpgroup) the 64-byte one.
  using KVAtomCols = std::conditional_t<DQCols::value % 64 == 0 || 64 % DQCols::value == 0, D, DQCols>;
  using SmemAtomKV =
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BN, KVAtomCols>());
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomKV{}, Shape<BN, D>{}));
  using SmemAtomV = std::conditional_t<
      kHeadDimV == kHeadDim, SmemAtomKV,
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BN, DV>())>;
  using SmemLayoutV = decltype(tile_to_shape(SmemAtomV{}, Shape<BN, DV>{}));
  // The same layouts with a stage mode of size 1, for the TMA partition.
  using SmemLayoutKStaged = decltype(tile_to_shape(SmemAtomKV{}, Shape<BN, D, _1>{}));
  using SmemLayoutVStaged = decltype(tile_to_shape(SmemAtomV{}, Shape<BN, DV, _1>{}));
  using SmemLayoutKt = decltype(composition(SmemLayoutK{}, make_ordered_layout(Shape<D, BN>{}, Step<_2, _1>{})));
  // P and dS as the S accumulator tile (ShapeSdP), its second mode contiguous; and transposed.
  static constexpr int kSdPRows = size<0>(ShapeSdP{}), kSdPCols = size<1>(ShapeSdP{});
  // Split over columns (S, not S^T), each warpgroup's columns must be whole swizzle atoms for the
  // stmatrix partition: at 80 keys a warpgroup's 40 columns take the 8-column interleaved atom.
  using SmemAtomPdSWide = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element,
                                                                                      Int<kSdPRows>, Int<kSdPCols>>());
  static constexpr bool kPdSAtomPerWG = !kSdPSwapAB && (kSdPCols / 2) % size<1>(SmemAtomPdSWide{}) != 0;
  using SmemAtomPdS = std::conditional_t<
      kPdSAtomPerWG,
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kSdPRows>,
                                                                   Int<kSdPCols / 2>>()),
      SmemAtomPdSWide>;
  using SmemLayoutPdS = decltype(tile_to_shape(SmemAtomPdS{}, Shape<Int<kSdPRows>, Int<kSdPCols>, Int<kStagesdS>>{}));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_ordered_layout(Shape<Int<kSdPCols>, Int<kSdPRows>, Int<kStagesdS>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutdSq = std::conditional_t<kSdPSwapAB, SmemLayoutPdSt, SmemLayoutPdS>;  // (kBlockM, kBlockN, stage)
  // stmatrix of P/dS: four 8x8 matrices per instruction when each thread's share allows it.
  using SmemCopyAtomPdS = Copy_Atom<std::conditional_t<(kBlockM * kBlockN / kNumMmaThreads) % 8 == 0,
                                                       SM90_U32x4_STSM_N, SM90_U32x2_STSM_N>, Element>;

  // ---- Global tensors and TMA -----------------------------------------------------------------
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen, headdim, head, batch)
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQKV{}));
  using TMA_Q = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}), Shape<BM, D>{}, _1{}));
  using TMA_dO = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutdO{}), Shape<BM, DV>{}, _1{}));
  using TMA_K = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{}, Shape<BN, D>{}, _1{}));
  using TMA_V = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutV{}, Shape<BN, DV>{}, _1{}));

  static constexpr uint32_t kKVBytes = uint32_t((size(SmemLayoutK{}) + size(SmemLayoutV{})) * sizeof(Element));
  static constexpr uint32_t kRowStatBytes = uint32_t(kBlockM * sizeof(float));  // LSE or D of one query block
  static constexpr uint32_t kQStageBytes = uint32_t(size(take<0, 2>(SmemLayoutQ{})) * sizeof(Element)) + kRowStatBytes;
  static constexpr uint32_t kdOStageBytes = uint32_t(size(take<0, 2>(SmemLayoutdO{})) * sizeof(Element)) + kRowStatBytes;

  using PipelineKV = cutlass::PipelineTmaAsync<1>;
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;      // Q + LSE
  using PipelinedO = cutlass::PipelineTmaAsync<kStagesdO>;  // dO + D
  using PipelineState = typename Pipeline::PipelineState;
  using PipelineStatedO = typename PipelinedO::PipelineState;

  // Dropout: each step's keep mask, drawn by the producer warpgroup's warps 2-3 (dropout_feed.h) in the layout of the
  // S^T tile or of S split over the keys, as many stages as Q's (the consumers read a stage with Q's state: both
  // advance once a step). The drawers' registers: 16 more than the producer's 24, 8 fewer per consumer thread (232).
  using DropLayout =
      std::conditional_t<kSdPSwapAB, DropRowsKeys<kBlockM, kBlockN>, DropRowsQueriesHalfKeys<kBlockM, kBlockN>>;
  using DropFeed = DropoutFeed<Dropout, DropLayout, kStages, 2 * cutlass::NumThreadsPerWarp, 16>;
  // (Empty bases where there is no dropout: the other kernels' layouts stay as they were.)
  struct DropBarriers {
    typename DropFeed::BarrierStorage drop;
  };
  struct DropWords {
    typename DropFeed::SharedStorage drop;
  };
  struct NoDrop {};
  struct NoDropWords {};

  struct BarrierStorage : std::conditional_t<DropFeed::kEnabled, DropBarriers, NoDrop> {
    typename PipelineKV::SharedStorage pipeline_kv;
    typename Pipeline::SharedStorage pipeline_q;
    typename PipelinedO::SharedStorage pipeline_do;
  };
  // All of the CTA's shared memory. The small pieces come first and the 1 KB-aligned tiles after, so
  // that alignment costs at most one padding gap; P exists only when it goes through shared memory
  // (an empty base otherwise).
  template <class T, int N>
  using Tile1K = cute::array_aligned<T, N, 1024>;
  struct PStorage {
    Tile1K<Element, cosize_v<SmemLayoutPdS>> smem_p;
  };
  struct NoPStorage {};
  struct TensorStorage : std::conditional_t<kdKVRegsA, NoPStorage, PStorage>,
                         std::conditional_t<DropFeed::kEnabled, DropWords, NoDropWords> {
    BarrierStorage barriers;
    cute::array_aligned<float, kBlockM * kStages, 16> smem_lse;      // bulk copies need 16 bytes
    cute::array_aligned<float, kBlockM * kStagesdO, 16> smem_dpsum;
    Tile1K<Element, cosize_v<SmemLayoutK>> smem_k;
    Tile1K<Element, cosize_v<SmemLayoutV>> smem_v;
    Tile1K<Element, cosize_v<SmemLayoutQ>> smem_q;
    Tile1K<Element, cosize_v<SmemLayoutdO>> smem_do;
    Tile1K<Element, cosize_v<SmemLayoutPdS>> smem_ds;
    // kWriterBulk: each warpgroup's staged share of a dQ slice, in fragment order (unused otherwise).
    Tile1K<float, kdQAtomic ? 256 : kNumMmaWG * kdQHalfFloats> smem_dq;
  };

  struct Params {
    TMA_Q tma_q;
    TMA_dO tma_do;
    TMA_K tma_k;
    TMA_V tma_v;
    ShapeQKV shape_q, shape_k;  // (rows, headdim, heads, batch); dO and V have headdim_v
    // Per-row scratch (common/workspace_bwd.h), each (entry, head) from its scratch_row0_q on:
    float const* lse_log2;  // (batch_coords, head, seqlen_q_rounded): LSE * log2(e), +inf where P must be 0
    float const* dpsum;     // same: rowsum(dO * O) - dLSE, 0 on padding rows
    float* dq_accum;        // same rows x headdim, float32 in fragment order (kBlockM-row blocks); zeroed unless the
                            // launcher chose first stores (BwdConfig::dq_first_stores: dq_first, or deterministic)
    int* dq_semaphore;      // per query block of dq_accum, zeroed: key blocks whose dQ additions have landed
    int* dq_first;          // not deterministic: per query block, zeroed: key blocks that took a turn (the first
                            // stores); nullptr: dq_accum is zeroed and every key block adds
    bool deterministic;     // key blocks add in a fixed order (they wait on dq_semaphore)
    int seqlen_q_rounded;
    int heads_ratio;
    float softmax_scale, scale_log2;
    Seqlens seqlens;
    int window_left, window_right;
    ScoreMod score_mod;
    typename KVBlocks::Params kv_blocks;
    Dropout dropout;
  };

  CUTE_DEVICE static SeqlenInfo seqlen_info(Params const& p, int batch) { return p.seqlens(batch); }
  CUTE_HOST_DEVICE static BlockInfoT block_info(Params const& p, SeqlenInfo const& s) {
    return {s, p.window_left, p.window_right};
  }

  // A (rows, headdim, heads, batch) shape with headdim_v instead: dO's of Q's, V's of K's.
  CUTE_HOST_DEVICE static ShapeQKV shape_v_of(ShapeQKV const& s) {
    return {get<0>(s), int(kHeadDimV), get<2>(s), get<3>(s)};
  }

  static Params make_params(Element const* q, StrideQKV stride_q, Element const* dout, StrideQKV stride_do,
                            ShapeQKV shape_q, Element const* k, StrideQKV stride_k, Element const* v,
                            StrideQKV stride_v, ShapeQKV shape_k, float const* lse_log2, float const* dpsum,
                            float* dq_accum, int* dq_semaphore, int* dq_first, bool deterministic, int seqlen_q_rounded,
                            float softmax_scale, Seqlens seqlens, int window_left, int window_right,
                            ScoreMod score_mod = {}, typename KVBlocks::Params kv_blocks = {}, Dropout dropout = {}) {
    auto mQ = make_tensor(make_gmem_ptr(q), shape_q, stride_q);
    auto mdO = make_tensor(make_gmem_ptr(dout), shape_v_of(shape_q), stride_do);
    auto mK = make_tensor(make_gmem_ptr(k), shape_k, stride_k);
    auto mV = make_tensor(make_gmem_ptr(v), shape_v_of(shape_k), stride_v);
    return {make_tma_copy(SM90_TMA_LOAD{}, mQ, take<0, 2>(SmemLayoutQ{}), Shape<BM, D>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mdO, take<0, 2>(SmemLayoutdO{}), Shape<BM, DV>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mK, SmemLayoutK{}, Shape<BN, D>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mV, SmemLayoutV{}, Shape<BN, DV>{}, _1{}),
            shape_q,
            shape_k,
            lse_log2,
            dpsum,
            dq_accum,
            dq_semaphore,
            dq_first,
            deterministic,
            seqlen_q_rounded,
            get<2>(shape_q) / get<2>(shape_k),
            softmax_scale,
            score_mod.softmax_scale_log2(float(softmax_scale * M_LOG2E)),
            seqlens,
            window_left,
            window_right,
            score_mod,
            kv_blocks,
            dropout};
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
  }

  // Deterministic: the key blocks that add to a query block's dQ do so from the highest to the
  // lowest (so that in causal attention every CTA starts at once: all walk the query blocks from the
  // last one down). This many of them come before n_block.
  CUTE_DEVICE static int later_key_blocks(BlockInfoT const& bi, int m_block, int n_block) {
    return bi.n_block_max(m_block) - 1 - n_block;
  }

  // (entry, head)'s first row in the per-row scratch (row statistics: LSE, D); its first query block
  // among all of them (the dq_semaphore entries and the fragment-ordered dQ blocks), that divided by kBlockM.
  CUTE_DEVICE static int64_t row_stat_offset(Params const& p, SeqlenInfo const& seq, int head, int batch) {
    return scratch_row0_q<kBlockM>(p.seqlens, seq, batch, head, get<2>(p.shape_q), p.seqlen_q_rounded);
  }
  CUTE_DEVICE static int64_t first_m_block(Params const& p, SeqlenInfo const& seq, int head, int batch) {
    return row_stat_offset(p, seq, head, batch) / kBlockM;
  }

  // ---------------------------------------------------------------------------------------------
  // Producer: one thread. K and V once, then per query block Q with its LSE and dO with its D.
  CUTE_DEVICE static void load(Params const& p, PipelineKV& pipeline_kv, Pipeline& pipeline_q, PipelinedO& pipeline_do,
                               TensorStorage& ts, SeqlenInfo const& seq, BlockInfoT const& bi, int n_block, int head,
                               int batch) {
    int const m_begin = bi.m_block_min(n_block), m_end = bi.m_block_max(n_block);
    if (m_end <= m_begin) return;
    int const kv_head = head / p.heads_ratio;
    KVBlocks const kv_blocks(p.kv_blocks, batch, seq.seqlen_k);

    Tensor sQ = make_tensor(make_smem_ptr(ts.smem_q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ts.smem_do.data()), SmemLayoutdO{});
    // K and V have no stage mode; the same layout with one of size 1, for the TMA partitioning.
    Tensor sK = make_tensor(make_smem_ptr(ts.smem_k.data()), SmemLayoutKStaged{});
    Tensor sV = make_tensor(make_smem_ptr(ts.smem_v.data()), SmemLayoutVStaged{});
    auto q_rows = [&](auto const& tma, ShapeQKV const& shape, auto dim) {
      return local_tile(entry_rows(tma.get_tma_tensor(shape), seq.offset_q, head, seq.batch_coord),
                        Shape<BM, decltype(dim)>{}, make_coord(_, _0{}));
    };
    auto kv_rows = [&](auto const& tma, ShapeQKV const& shape, auto dim) {
      return local_tile(entry_rows(tma.get_tma_tensor(shape), seq.offset_k, kv_head, seq.batch_coord),
                        Shape<BN, decltype(dim)>{}, make_coord(_, _0{}));
    };
    Tensor gQ = q_rows(p.tma_q, p.shape_q, D{});
    Tensor gdO = q_rows(p.tma_do, shape_v_of(p.shape_q), DV{});
    Tensor gK = kv_rows(p.tma_k, p.shape_k, D{});
    Tensor gV = kv_rows(p.tma_v, shape_v_of(p.shape_k), DV{});
    auto q_parts = tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto do_parts = tma_partition(p.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
    auto k_parts = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto v_parts = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    float const* lse_bh = p.lse_log2 + row_stat_offset(p, seq, head, batch);
    float const* dpsum_bh = p.dpsum + row_stat_offset(p, seq, head, batch);
    // A packed batch's blocks that reach past the entry's rows go through its own maps (rows past its end are
    // zero-filled), the others through the params' (common/seqlen.h, block_tma_desc).
    auto q_inside = [&](int m_block) { return (m_block + 1) * kBlockM <= seq.seqlen_q; };
    bool const kv_inside = (n_block + 1) * kBlockN <= seq.seqlen_k;
    int acquired = -1;
    acquire_entry_maps(p.seqlens, batch, !kv_inside || !q_inside(m_end - 1), acquired, kVarlenQ, kVarlendO, kVarlenK,
                       kVarlenV);
    TmaDescriptor const* desc_k = block_tma_desc(p.seqlens, p.tma_k, kVarlenK, batch, kv_inside);
    TmaDescriptor const* desc_v = block_tma_desc(p.seqlens, p.tma_v, kVarlenV, batch, kv_inside);

    auto write_kv = cutlass::make_producer_start_state<PipelineKV>();
    pipeline_kv.producer_acquire(write_kv);
    auto* kv_bar = pipeline_kv.producer_get_barrier(write_kv);
    kv_blocks.load(p.tma_k, desc_k, *kv_bar, get<0>(k_parts), n_block, get<1>(k_parts)(_, 0), TMA::CacheHintSm90::EVICT_FIRST);
    kv_blocks.load(p.tma_v, desc_v, *kv_bar, get<0>(v_parts), n_block, get<1>(v_parts)(_, 0), TMA::CacheHintSm90::EVICT_FIRST);

    // Every key block of this head reads the same Q and dO: keep them in L2.
    auto write_q = cutlass::make_producer_start_state<Pipeline>();
    auto write_do = cutlass::make_producer_start_state<PipelinedO>();
    for (int m_block = m_end - 1; m_block >= m_begin; --m_block) {
      pipeline_q.producer_acquire(write_q);
      auto* q_bar = pipeline_q.producer_get_barrier(write_q);
      copy(p.tma_q.with(block_tma_desc(p.seqlens, p.tma_q, kVarlenQ, batch, q_inside(m_block)), *q_bar, 0,
                        TMA::CacheHintSm90::EVICT_LAST),
           get<0>(q_parts)(_, m_block),
           get<1>(q_parts)(_, write_q.index()));
      SM90_BULK_COPY_G2S::copy(lse_bh + m_block * kBlockM, q_bar, ts.smem_lse.data() + write_q.index() * kBlockM,
                               kRowStatBytes);
      ++write_q;
      pipeline_do.producer_acquire(write_do);
      auto* do_bar = pipeline_do.producer_get_barrier(write_do);
      copy(p.tma_do.with(block_tma_desc(p.seqlens, p.tma_do, kVarlendO, batch, q_inside(m_block)), *do_bar, 0,
                         TMA::CacheHintSm90::EVICT_LAST),
           get<0>(do_parts)(_, m_block),
           get<1>(do_parts)(_, write_do.index()));
      SM90_BULK_COPY_G2S::copy(dpsum_bh + m_block * kBlockM, do_bar, ts.smem_dpsum.data() + write_do.index() * kBlockM,
                               kRowStatBytes);
      ++write_do;
    }
  }

  // ---------------------------------------------------------------------------------------------
  // dQ writer (kWriterBulk): one warp. As each consumer warpgroup fills its buffer with its share of a
  // dQ slice, one lane sends it to dq_accum and hands the buffer back once it has been read. With dq_first (the
  // launcher's choice, short key ranges), the first key block to reach a query block stores its dQ there and
  // counts it in dq_semaphore as soon as it has landed; the others wait for that count, then bulk-reduce-add
  // theirs. dq_accum then needs no zeroing: the preprocess wrote 4 bytes per dQ element (and the first addition
  // read them back) for nothing but this. Without it every key block adds to the zeroed sums.
  // Once a query block's additions have landed in global memory, its dq_semaphore counts them: the
  // postprocess converts a block as soon as every key block has counted (it runs beside this
  // kernel's tail). Deterministic: key blocks add one at a time, in later_key_blocks order (the first one
  // stores), and count at once; otherwise the first to take a turn (dq_first) stores and counts at once, the others'
  // blocks are counted two at a time behind one release fence, kdQCountLag or more query blocks later (or with a
  // stored block's, or at the end), and the last one on landing or, kCountLastIssued, as issued.
  CUTE_DEVICE static void store_dq(Params const& p, TensorStorage& ts, SeqlenInfo const& seq, BlockInfoT const& bi,
                                   int n_block, int head, int batch) {
    if constexpr (kdQAtomic) return;  // the consumers add and count dQ themselves
    static_assert(kdQCountLag == 1, "the writer remembers whether the block before this one was its stored one");
    int const m_begin = bi.m_block_min(n_block), m_end = bi.m_block_max(n_block);
    if (m_end <= m_begin) return;  // no query sees the block: the consumers hand nothing over
    int64_t const m_block0 = first_m_block(p, seq, head, batch);
    int* const sem_bh = p.dq_semaphore + m_block0;
    int* const first_bh = p.dq_first + m_block0;  // (read only where dq_first is not nullptr)
    float* const dq_bh = p.dq_accum + m_block0 * int64_t(kBlockM * kHeadDim);  // fragment order
    bool const lane0 = cute::elect_one_sync();
    constexpr int kGroupsPerBlock = kdQSlices * kNumMmaWG;  // bulk async-groups the writer commits per block
    auto add_count = [&](int m) {
      cuda::atomic_ref<int, cuda::thread_scope_device>(sem_bh[m]).fetch_add(1, cuda::memory_order_release);
    };
    // Counts after one release fence (the fence is the writer's cost: ERRBAR stalls at the hand-off, S35N / S36N).
    auto release = [] { cuda::atomic_thread_fence(cuda::memory_order_release, cuda::thread_scope_device); };
    auto add_relaxed = [&](int m) {
      cuda::atomic_ref<int, cuda::thread_scope_device>(sem_bh[m]).fetch_add(1, cuda::memory_order_relaxed);
    };
    // Lane 0: once at most kPending bulk groups (the newest) are in flight, the async proxy's writes before the count.
    auto landed = [&](auto pending) {
      asm volatile("cp.async.bulk.wait_group %0;" ::"n"(decltype(pending)::value) : "memory");
      asm volatile("fence.proxy.async.global;" ::: "memory");
    };

    CUTE_UNROLL
    for (int wg = 0; wg < kNumMmaWG; ++wg) cutlass::arch::NamedBarrier::arrive(kdQHandoffThreads, kBwddQEmpty0 + wg);
    bool stored_next = false;  // lane 0: block m_block + 1 was stored (and counted) by this key block
    int held = -1;             // lane 0 (not deterministic): a landed-later block whose count waits for a second one
    for (int m_block = m_end - 1; m_block >= m_begin; --m_block) {
      // Lane 0: whether this key block stores the query block's dQ. The turn is taken before the dQ is staged,
      // so the atomic's round trip runs under the wait for it.
      int turn = 0;
      if (lane0) {
        if (p.deterministic) {
          turn = later_key_blocks(bi, m_block, n_block);
          wait_at_least(sem_bh + m_block, turn);
        } else {
          turn = p.dq_first != nullptr ? atomicAdd(first_bh + m_block, 1) : 1;
        }
      }
      __syncwarp();
      CUTE_UNROLL
      for (int slice = 0; slice < kdQSlices; ++slice) {
        CUTE_UNROLL
        for (int wg = 0; wg < kNumMmaWG; ++wg) {
          cutlass::arch::NamedBarrier::sync(kdQHandoffThreads, kBwddQFull0 + wg);
          if (lane0) {
            float* const dst = dq_bh + m_block * int64_t(kBlockM * kHeadDim) + dq_share_offset(slice, wg);
            float const* const src = ts.smem_dq.data() + wg * kdQHalfFloats;
            if (turn == 0) {
              SM90_BULK_COPY_S2G::copy(src, dst, kdQHalfFloats * sizeof(float));
            } else {
              if (!p.deterministic && p.dq_first != nullptr && slice == 0 && wg == 0) {  // the first's store landed
                wait_at_least_masked(sem_bh + m_block, 1, ~kDqUnlanded);
                asm volatile("fence.proxy.async.global;" ::: "memory");
              }
              bulk_reduce_add(dst, src, kdQHalfFloats * sizeof(float));
            }
            tma_store_arrive();
          }
        }
        if (lane0) tma_store_wait<1>();
        __syncwarp();
        cutlass::arch::NamedBarrier::arrive(kdQHandoffThreads, kBwddQEmpty0);
        if (lane0) tma_store_wait<0>();
        __syncwarp();
        cutlass::arch::NamedBarrier::arrive(kdQHandoffThreads, kBwddQEmpty0 + 1);
      }
      if (lane0) {
        if (p.deterministic) {
          landed(Int<0>{});
          add_count(m_block);
        } else {
          bool const count_next = m_block + kdQCountLag < m_end && !stored_next;  // issued, not stored
          if (turn == 0) {  // at once: the other key blocks wait for it; all this block issued has landed with it
            landed(Int<0>{});
            release();
            add_relaxed(m_block);
            if (held >= 0) add_relaxed(held);
            if (count_next) add_relaxed(m_block + kdQCountLag);
            held = -1;
          } else if (count_next) {  // blocks issued and not stored: two counts behind one fence
            if (held < 0) {
              held = m_block + kdQCountLag;
            } else {
              landed(Int<kdQCountLag * kGroupsPerBlock>{});
              release();
              add_relaxed(held);
              add_relaxed(m_block + kdQCountLag);
              held = -1;
            }
          }
          stored_next = turn == 0;
        }
      }
      __syncwarp();
    }
    if (lane0 && !p.deterministic) {
      // m_begin's count, unless stored (and counted) here, and the held one's: one wait and one fence for both where
      // m_begin waits for its landing.
      bool const count_begin = !stored_next;
      if (count_begin && !kCountLastIssued) {
        landed(Int<0>{});
        release();
        add_relaxed(m_begin);
        if (held >= 0) add_relaxed(held);
      } else {
        if (held >= 0) {  // all but m_begin's groups have landed
          landed(Int<kdQCountLag * kGroupsPerBlock>{});
          release();
          add_relaxed(held);
        }
        if (count_begin) {  // kCountLastIssued: its reads of shared memory are done (the loop waited for them)
          cuda::atomic_ref<int, cuda::thread_scope_device> sem(sem_bh[m_begin]);
          sem.fetch_or(kDqUnlanded, cuda::memory_order_relaxed);  // before the count: a reader of it sees the mark
          sem.fetch_add(1, cuda::memory_order_relaxed);
        }
      }
    }
    __syncwarp();
  }

  // Dropout (the producer warpgroup's warps 2-3, tid in [0, DropFeed::kThreads)): the key block's keep masks, step by
  // step in the consumers' order (from the last query block), for the (batch, head) stream the forward drew.
  CUTE_DEVICE static void draw_dropout(Params const& p, typename DropFeed::Pipeline& pipeline, TensorStorage& ts,
                                       BlockInfoT const& bi, int n_block, int head, int batch, int tid) {
    if constexpr (DropFeed::kEnabled) {
      auto write = cutlass::make_producer_start_state<typename DropFeed::Pipeline>();
      auto const st = p.dropout.stream(batch * get<2>(p.shape_q) + head);
      for (int m_block = bi.m_block_max(n_block) - 1; m_block >= bi.m_block_min(n_block); --m_block) {
        DropFeed::produce(pipeline, write, ts.drop, st, m_block * kBlockM, n_block * kBlockN, tid);
      }
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Consumers: both warpgroups, thread_idx 0..255. Accumulates dK (unscaled until the end) and dV
  // into the caller's zeroed Accumulators. Returns false if no query block sees this key block.
  template <class Accum>
  CUTE_DEVICE static bool mma(Params const& p, PipelineKV& pipeline_kv, Pipeline& pipeline_q, PipelinedO& pipeline_do,
                              TensorStorage& ts, Accum& acc, int thread_idx, SeqlenInfo const& seq,
                              BlockInfoT const& bi, int n_block, int head, int batch,
                              typename DropFeed::Pipeline& pipeline_drop) {
    static_assert(std::is_same_v<Accum, Accumulators>);
    // dO is released once slots 0 and 1 are done: slot 2 must not read it on either warpgroup.
    static_assert(!kdKVMirror || (!dkv_slot(0, 2).is_v && !dkv_slot(1, 2).is_v), "dO's readers are slots 0 and 1");
    int const m_begin = bi.m_block_min(n_block), m_end = bi.m_block_max(n_block);
    if (m_end <= m_begin) return false;
    // The dK and dV fragments; under kdKVMirror the slots (named below only in branches it discards).
    auto& tdKrdK = [&]() -> auto& {
      if constexpr (kdKVMirror) return acc.slot;
      else return acc.dk;
    }();
    auto& tdVrdV = [&]() -> auto& {
      if constexpr (kdKVMirror) return acc.slot;
      else return acc.dv;
    }();
    int const wg = thread_idx / cutlass::NumThreadsPerWarpGroup;
    int64_t const m_block0 = first_m_block(p, seq, head, batch);
    int* const sem_bh = p.dq_semaphore + m_block0;
    // Once every consumer thread's reductions so far have landed, count query blocks [m0, m1) done.
    auto count_dq_atomics = [&](int m0, int m1) {
      __threadfence();
      cutlass::arch::NamedBarrier::sync(kNumMmaThreads, kBwddQAtomic);
      for (int m = m0 + thread_idx; m < m1; m += kNumMmaThreads) signal(sem_bh + m);
    };

    Tensor sQ = make_tensor(make_smem_ptr(ts.smem_q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ts.smem_do.data()), SmemLayoutdO{});
    Tensor sQt = make_tensor(make_smem_ptr(ts.smem_q.data()), SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(ts.smem_do.data()), SmemLayoutdOt{});
    Tensor sK = make_tensor(make_smem_ptr(ts.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ts.smem_v.data()), SmemLayoutV{});
    Tensor sKt = make_tensor(make_smem_ptr(ts.smem_k.data()), SmemLayoutKt{});
    Tensor sdS = make_tensor(make_smem_ptr(ts.smem_ds.data()), SmemLayoutPdS{});
    Tensor sdSq = make_tensor(make_smem_ptr(ts.smem_ds.data()), SmemLayoutdSq{});
    Tensor sdSt = make_tensor(make_smem_ptr(ts.smem_ds.data()), SmemLayoutPdSt{});

    TiledMmaSdP mma_sdp;
    TiledMmadK mma_dk;
    TiledMmadV mma_dv;
    TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(thread_idx);
    // Shared-memory operands (GMMA descriptors) depend only on the warpgroup. Sliced at its first thread,
    // taken from lane 0, they stay in uniform registers: from the thread index ptxas built them in vector
    // registers and moved them over (R2UR) before every GMMA (W10: head dim 64 3-7% faster). Only here:
    // a warp-uniform `wg` for the dQ hand-off too made head dim 128 2-3% slower (W12).
    int const wg_thread0 = __shfl_sync(0xffffffffu, wg, 0) * cutlass::NumThreadsPerWarpGroup;
    auto wg_sdp = mma_sdp.get_thread_slice(wg_thread0);
    auto wg_dk = mma_dk.get_thread_slice(wg_thread0);
    auto wg_dv = mma_dv.get_thread_slice(wg_thread0);
    auto wg_dq = mma_dq.get_thread_slice(wg_thread0);

    // Operand descriptors, stage mode last where there is one.
    Tensor tSrQ = fragment_ab<!kSdPSwapAB>(wg_sdp, sQ);
    Tensor tSrK = fragment_ab<kSdPSwapAB>(wg_sdp, sK);
    Tensor tdPrdO = fragment_ab<!kSdPSwapAB>(wg_sdp, sdO);
    Tensor tdPrV = fragment_ab<kSdPSwapAB>(wg_sdp, sV);
    Tensor tdVrdO = fragment_ab<kdKVSwapAB>(wg_dv, sdOt);
    Tensor tdKrQ = fragment_ab<kdKVSwapAB>(wg_dk, sQt);
    Tensor tdQrdS = [&] {
      if constexpr (kdQSwapAB) return wg_dq.partition_fragment_B(sdS);
      else return wg_dq.partition_fragment_A(sdSq);
    }();
    // kdKVMirror: the slots' operands for every head-dim atom and stage (Q^T, dO^T: (MMA, atom, k, stage); P^T,
    // dS^T: (MMA, 1, k, stage)), one warpgroup's (the slot MMA is one warpgroup's).
    int const wg_uniform = wg_thread0 / cutlass::NumThreadsPerWarpGroup;
    auto const slot_operands = [&] {
      if constexpr (kdKVMirror) {
        auto wg_slot = TiledMmadKVSlot{}.get_thread_slice(0);
        Tensor sPt = make_tensor(make_smem_ptr(ts.smem_p.data()), SmemLayoutPdSt{});
        return cute::make_tuple(wg_slot.partition_fragment_A(sQt), wg_slot.partition_fragment_A(sdOt),
                                wg_slot.partition_fragment_B(sPt), wg_slot.partition_fragment_B(sdSt));
      } else {
        return 0;
      }
    }();

    auto smem_copy_pds = make_tiled_copy_C(SmemCopyAtomPdS{}, mma_sdp);
    auto thr_copy_pds = smem_copy_pds.get_thread_slice(thread_idx);
    Tensor tdSsdS = thr_copy_pds.partition_D(sdS);  // (CPY, CPY_M, CPY_N, stage)

    // (row, col) of each score in the S / S^T tile, and the query row of each.
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(ShapeSdP{}));
    Tensor tScS_rc = rowcol(tScS);
    // The per-query statistics (LSE, D) of an element. Held whole in registers they cost 2 * kBlockM / 4 of them
    // with S^T (2-8% slower at 64 rows, docs/perf-notes.md v7), so they are read where they are used:
    // - S^T at 128 rows (head dim 64): a thread's 32 columns are 8 k + 2 (lane % 4) + e (ni = 2 k + e), the same for
    //   the 8 lanes of a lane % 4 group. Lane 4 j + g loads columns 16 j + 8 kk + 2 g + e (kk, e < 2: two LDS.64 per
    //   statistic per step) and column (k, e) comes from lane 4 (k / 2) + g by a shuffle whose lane is an immediate,
    //   the low two bits kept from the caller's (segment mask 3): no lane arithmetic for ptxas to hoist and spill.
    //   32 LDS.64 per statistic per step became 2 (their FFMAs waited on them); +2-3% non-causal (perf-notes, W15).
    // - otherwise from shared memory, element by element.
    auto stat = [&](float const* s_stat) {
      if constexpr (kSdPSwapAB && kBlockM == 128) {
        static_assert(decltype(size<1>(tScS_rc))::value == kBlockM / 4, "S^T: 32 columns per thread");
        int const lane = thread_idx % 32;
        float2 const lo = *reinterpret_cast<float2 const*>(s_stat + 16 * (lane / 4) + 2 * (lane % 4));
        float2 const hi = *reinterpret_cast<float2 const*>(s_stat + 16 * (lane / 4) + 8 + 2 * (lane % 4));
        return [lo, hi](int, int ni) {
          int const k = ni / 2, e = ni % 2;
          float const v = (k % 2 == 0) ? (e == 0 ? lo.x : lo.y) : (e == 0 ? hi.x : hi.y);
          float out;
          asm("shfl.sync.idx.b32 %0, %1, %2, 0x31f, 0xffffffff;" : "=f"(out) : "f"(v), "r"(4 * (k / 2)));
          return out;
        };
      } else {
        return [&tScS_rc, s_stat](int mi, int ni) {
          return s_stat[kSdPSwapAB ? int(get<1>(tScS_rc(0, ni))) : int(get<0>(tScS_rc(mi, 0)))];
        };
      }
    };
    // P and dS through shared memory with dV^T a plain GEMM (head dim 256): P is fenced and made visible on its own so
    // that dV goes out before dS's stores and fence (one more barrier a step, under the dV GEMM; as FA3; S40E).
    constexpr bool kdVBeforedS = !kdKVRegsA && !kdKVMirror;
    // dV^T += dO^T P^T with P^T from shared memory (P through shared memory, no mirrored slots).
    auto issue_dv_smem_p = [&](int stage_do, int stage_ds) {
      if constexpr (!kdKVRegsA && !kdKVMirror) {
        Tensor sPt = make_tensor(make_smem_ptr(ts.smem_p.data()), SmemLayoutPdSt{});
        Tensor tdVrP = wg_dv.partition_fragment_B(sPt);
        wgmma<false, -1>(mma_dv, tdVrdO(_, _, _, stage_do), tdVrP(_, _, _, stage_ds), tdVrdV);
      }
    };
    // The statistics read now into registers (a thread's distinct rows or columns): with kExpUnderdP, the LSE as the
    // S GEMM goes out, so that P's exponentials start as soon as S lands (read lazily, their LDS sat after the mask,
    // where ptxas put the dP wait before the exponentials).
    auto stat_now = [&](float const* s_stat) {
      if constexpr (kSdPSwapAB) {
        constexpr int kCols = decltype(size<1>(tScS_rc))::value;
        cute::array<float, kCols> v;
        CUTE_UNROLL
        for (int ni = 0; ni < kCols; ++ni) v[ni] = s_stat[int(get<1>(tScS_rc(0, ni)))];
        return [v](int, int ni) { return v[ni]; };
      } else {
        constexpr int kRows = decltype(size<0>(tScS_rc))::value;
        cute::array<float, kRows> v;
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) v[mi] = s_stat[int(get<0>(tScS_rc(mi, 0)))];
        return [v](int mi, int) { return v[mi]; };
      }
    };

    // Fragment-order offsets are linear in (slice, warpgroup, thread, value): this thread's part (kdQAtomic).
    int const dq_thread_offset =
        dq_share_offset(0, wg) + FragLayout::offset(0, thread_idx % cutlass::NumThreadsPerWarpGroup, 0);
    MaskT const mask{seq, p.window_left, p.window_right};
    bool const seqlen_mask = (n_block + 1) * kBlockN > seq.seqlen_k;  // the last key block has padding
    // Dropout: the step's keep mask (DropFeed), in the stage of Q's state; read as the S and dP GEMMs go out.
    auto fetch_keep = [&](PipelineState const& q_state) {
      if constexpr (DropFeed::kEnabled) return DropFeed::fetch(pipeline_drop, q_state, ts, thread_idx);
      else return 0;
    };

    PipelineState read_q;
    PipelineStatedO read_do;
    {
      auto read_kv = typename PipelineKV::PipelineState{};
      pipeline_kv.consumer_wait(read_kv);
    }

    // Query blocks below m_right_end have a row whose right edge cuts the key block; from m_left_begin
    // on, a row whose left edge does.
    int const m_right_end = bi.m_block_right_masked_end(n_block);
    int const m_left_begin = bi.m_block_left_masked_begin(n_block);
    // One loop body for masked and unmasked blocks: two instances of it made the compiler shuffle
    // (and spill) the dK/dV accumulators between them. Only the mask is behind a uniform branch.
    auto apply_mask = [&](auto& tSrS, int m_block, float fill) {
      int const q0 = m_block * kBlockM, k0 = n_block * kBlockN;
      if constexpr (BlockInfoT::kHasLeft) {
        if (m_block < m_right_end || m_block >= m_left_begin || seqlen_mask) {
          mask.template apply_bwd<true, true, true, kSdPSwapAB>(tSrS, tScS, q0, k0, fill);
        }
      } else if (m_block < m_right_end) {
        if (seqlen_mask) {
          mask.template apply_bwd<true, true, false, kSdPSwapAB>(tSrS, tScS, q0, k0, fill);
        } else {
          mask.template apply_bwd<false, true, false, kSdPSwapAB>(tSrS, tScS, q0, k0, fill);
        }
      } else if (seqlen_mask) {
        mask.template apply_bwd<true, false, false, kSdPSwapAB>(tSrS, tScS, q0, k0, fill);
      }
    };

    // kConsumerRed: a slice's sums added to dQ's float32 sums (fragment order) from this thread's registers.
    auto red_slice = [&](auto& frag, float* dq_thread, int slice) {
      CUTE_UNROLL
      for (int i = 0; i < size(frag); i += 4) {
        red_add_v4(dq_thread + (dq_share_offset(slice, 0) + FragLayout::offset(0, 0, i)), frag(i), frag(i + 1),
                   frag(i + 2), frag(i + 3));
      }
    };
    // dQ^T (kdQSwapAB): the last slice's reds go out in the next step, after its S GEMM, so that their register
    // reads drain under that GEMM (issued at the step's end, the next S GEMM waited for them: ncu, S43N / S44).
    // The first step adds zeros to its own block: a branch around the reds under the S GEMM made ptxas
    // serialize every WGMMA of the loop (C7518).
    using FragdQ = decltype(partition_fragment_C(mma_dq, ShapedQ{}));
    FragdQ tdQrdQ_held;
    if constexpr (kdQSwapAB) clear(tdQrdQ_held);
    float* dq_held = p.dq_accum + (m_block0 + m_end - 1) * int64_t(kBlockM * kHeadDim) + dq_thread_offset;

    auto step = [&](int m_block) {
      int const stage_q = read_q.index(), stage_do = read_do.index();
      int const stage_ds = kStagesdS == 1 ? 0 : stage_q;
      Tensor tSrS = partition_fragment_C(mma_sdp, ShapeSdP{});
      Tensor tdPrdP = partition_fragment_C(mma_sdp, ShapeSdP{});

      pipeline_q.consumer_wait(read_q);
      float const* const s_lse = ts.smem_lse.data() + stage_q * kBlockM;
      auto const lse_early = [&] {
        if constexpr (kExpUnderdP) return stat_now(s_lse);
        else return 0;
      }();
      if constexpr (kSdPSwapAB) {
        wgmma<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, stage_q), tSrS);
      } else {
        wgmma<true, -1>(mma_sdp, tSrQ(_, _, _, stage_q), tSrK, tSrS);
      }
      if constexpr (kdQSwapAB) {
        warpgroup_fence_operand(tdQrdQ_held);
        red_slice(tdQrdQ_held, dq_held, kdQSlices - 1);
      }
      pipeline_do.consumer_wait(read_do);
      if constexpr (kSdPSwapAB) {
        wgmma<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage_do), tdPrdP);
      } else {
        wgmma<true, -1>(mma_sdp, tdPrdO(_, _, _, stage_do), tdPrV, tdPrdP);
      }
      [[maybe_unused]] auto const keep = fetch_keep(read_q);
      // P from S while dP is on the tensor cores.
      auto const lse = [&] {
        if constexpr (kExpUnderdP) return lse_early;
        else return stat(s_lse);
      }();
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      auto const dmod = [&] {
        if constexpr (kLateP) return p.score_mod.apply_keep_grad(tSrS);
        else { p.score_mod.apply(tSrS); return 0; }
      }();
      // kExpUnderdP: masked probabilities to 0 after the exponentials rather than scores to -inf before them, so the
      // exponentials sit before the mask's branches (ptxas put the dP wait first at the branches' join).
      if constexpr (!kExpUnderdP) apply_mask(tSrS, m_block, -INFINITY);
      Tensor scores = rowcol(tSrS);
      probs_from_lse(scores, lse, p.scale_log2);
      if constexpr (kExpUnderdP) apply_mask(tSrS, m_block, 0.f);
      Tensor rdS = [&] {
        if constexpr (kLateP) {
          // dS from the float P, then P^T to 16 bits for dV: a 16-bit P is never live beside the float P
          // and dP, so the float P fits (dV goes out after the dS math instead of under it).
          auto const dpsum = stat(ts.smem_dpsum.data() + stage_do * kBlockM);
          warpgroup_wait<0>();  // dP done
          warpgroup_fence_operand(tdPrdP);
          Tensor dscores = rowcol(tdPrdP);
          if constexpr (DropFeed::kEnabled) {
            DropFeed::grad_scores(scores, dscores, dpsum, keep, p.dropout.scale());  // dS = P (s Z dP - D)
          } else {
            grad_scores(scores, dscores, dpsum);
          }
          p.score_mod.chain_kept(tdPrdP, dmod);
          Tensor rP = convert_type<Element>(tSrS);
          if constexpr (DropFeed::kEnabled) DropFeed::apply(rowcol(rP), keep);  // dV takes P Z
          Tensor rdS = convert_type<Element>(tdPrdP);
          if constexpr (kStagesdS == 1) cutlass::arch::NamedBarrier::sync(kNumMmaThreads, kBwdPdS);
          copy(smem_copy_pds, thr_copy_pds.retile_S(rdS), tdSsdS(_, _, _, stage_ds));
          // dV goes out between dS's stores and their fence, which then waits less (W12: head dim 64 1-5%).
          Tensor tdVrP = make_tensor(rP.data(), acc_layout_as_a_operand(rP.layout()));
          wgmma<false, -1>(mma_dv, tdVrP, tdVrdO(_, _, _, stage_do), tdVrdV);
          return rdS;
        } else {
          // P and dS through shared memory (head dims 192, 256): dS from the float P too, both made 16-bit after
          // the dS math; from the 16-bit P each score paid its unpacking (PRMT / IMAD.U32) twice. With dropout,
          // dS = P (s Z dP - D) with Z the step's keep bits (DropFeed::grad_scores), then P Z in place for dV
          // (1 / keep probability applied to dV once, after the loop). (Until session 28 dropout took dS from the
          // 16-bit P, whose float32 copy had to die early while a Pd = s P Z tile was live beside it.)
          auto const dpsum = stat(ts.smem_dpsum.data() + stage_do * kBlockM);
          warpgroup_wait<0>();  // dP done
          warpgroup_fence_operand(tdPrdP);
          Tensor dscores = rowcol(tdPrdP);
          if constexpr (DropFeed::kEnabled) {
            DropFeed::grad_scores(scores, dscores, dpsum, keep, p.dropout.scale());
          } else {
            grad_scores(scores, dscores, dpsum);
          }
          p.score_mod.chain(dscores, scores, lse);
          Tensor rP = convert_type<Element>(tSrS);
          if constexpr (DropFeed::kEnabled) DropFeed::apply(rowcol(rP), keep);
          Tensor rdS = convert_type<Element>(tdPrdP);
          // With one dS (and P) buffer, both warpgroups must be done with the previous block's GEMMs.
          if constexpr (kStagesdS == 1) cutlass::arch::NamedBarrier::sync(kNumMmaThreads, kBwdPdS);
          Tensor sP = make_tensor(make_smem_ptr(ts.smem_p.data()), SmemLayoutPdS{});
          copy(smem_copy_pds, thr_copy_pds.retile_S(rP), thr_copy_pds.partition_D(sP)(_, _, _, stage_ds));
          if constexpr (kdVBeforedS) {
            // P visible first, then dV goes out while dS is stored and fenced (as FA3 at head dim 256).
            cutlass::arch::fence_view_async_shared();
            cutlass::arch::NamedBarrier::sync(kNumMmaThreads, kBwdPdS);
            copy(smem_copy_pds, thr_copy_pds.retile_S(rdS), tdSsdS(_, _, _, stage_ds));
            issue_dv_smem_p(stage_do, stage_ds);
          } else {
            copy(smem_copy_pds, thr_copy_pds.retile_S(rdS), tdSsdS(_, _, _, stage_ds));
          }
          return rdS;
        }
      }();
      // dS (and P) written by both warpgroups, visible to the tensor cores.
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(kNumMmaThreads, kBwdPdS);
      // kdKVMirror: slots [first, last) in one batch, each its A and B picked by dkv_slot (uniform per warpgroup).
      auto issue_slots = [&](auto first, auto last) {
        if constexpr (kdKVMirror) {
          TiledMmadKVSlot mma_slot;
          mma_slot.accumulate_ = GMMA::ScaleOut::One;
          auto const& [tQt, tdOt, tPt, tdSt] = slot_operands;
          CUTE_UNROLL
          for (int s = first; s < last; ++s) warpgroup_fence_operand(acc.slot[s]);
          warpgroup_arrive();
          CUTE_UNROLL
          for (int s = first; s < last; ++s) {
            DkvSlot const slot = dkv_slot(wg_uniform, s);
            Tensor acc_s = acc.slot[s](_, _0{}, _0{});
            if (slot.live) {
              CUTE_UNROLL
              for (int k = 0; k < size<2>(tQt); ++k) {
                cute::gemm(mma_slot, slot.is_v ? tdOt(_, slot.atom, k, stage_do) : tQt(_, slot.atom, k, stage_q),
                           slot.is_v ? tPt(_, _0{}, k, stage_ds) : tdSt(_, _0{}, k, stage_ds), acc_s);
              }
            }
          }
          warpgroup_commit_batch();
          CUTE_UNROLL
          for (int s = first; s < last; ++s) warpgroup_fence_operand(acc.slot[s]);
        }
      };
      if constexpr (kdKVMirror) {
        issue_slots(_0{}, _2{});  // the dV^T slots (and warpgroup 0's first dK^T one): dO's readers
      } else if constexpr (!kdKVRegsA && !kdVBeforedS) {
        issue_dv_smem_p(stage_do, stage_ds);
      }
      // dQ slices, with dK issued after the first: dQ_0, dK, dQ_1, ...
      auto issue_dq = [&](auto& tdQrdQ, int slice) {
        auto const sKt_slice = local_tile(sKt, Shape<DSlice, BN>{}, make_coord(slice, _0{}));
        if constexpr (kdQSwapAB) {
          wgmma<true, -1>(mma_dq, wg_dq.partition_fragment_A(sKt_slice), tdQrdS(_, _, _, stage_ds), tdQrdQ);
        } else {
          wgmma<true, -1>(mma_dq, tdQrdS(_, _, _, stage_ds), wg_dq.partition_fragment_B(sKt_slice), tdQrdQ);
        }
      };
      auto issue_dk = [&]() {
        if constexpr (kdKVMirror) {
          issue_slots(_2{}, Int<kdKVSlots>{});
        } else if constexpr (kdKVRegsA) {
          Tensor tdKrdS = make_tensor(rdS.data(), acc_layout_as_a_operand(rdS.layout()));
          wgmma<false, -1>(mma_dk, tdKrdS, tdKrQ(_, _, _, stage_q), tdKrdK);
        } else {
          Tensor tdKrdS = wg_dk.partition_fragment_B(sdSt);
          wgmma<false, -1>(mma_dk, tdKrQ(_, _, _, stage_q), tdKrdS(_, _, _, stage_ds), tdKrdK);
        }
      };

      // A slice's sums, in fragment order: added by the consumers (kConsumerRed) or staged for the
      // dQ writer once it has emptied this warpgroup's buffer (kWriterBulk).
      // The thread's own part of the offsets is added once, the (slice, value) part is a constant: per-value
      // 64-bit sums made ptxas keep 16 address pairs live across the loop (and spill) at head dim 256.
      float* const dq_thread = p.dq_accum + (m_block0 + m_block) * int64_t(kBlockM * kHeadDim) + dq_thread_offset;
      auto stage_dq = [&](auto& frag, int slice) {
        warpgroup_fence_operand(frag);
        int const t = thread_idx % cutlass::NumThreadsPerWarpGroup;
        if constexpr (kdQAtomic) {
          red_slice(frag, dq_thread, slice);
        } else {
          cutlass::arch::NamedBarrier::sync(kdQHandoffThreads, kBwddQEmpty0 + wg);
          // Thread t's values i..i+3 at float ((i / 4) * 128 + t) * 4 of the buffer: a warp's
          // 16-byte stores cover 512 contiguous bytes, conflict-free.
          uint32_t const base = cast_smem_ptr_to_uint(ts.smem_dq.data() + wg * kdQHalfFloats);
          CUTE_UNROLL
          for (int i = 0; i < size(frag); i += 4) {
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(
                             base + uint32_t(FragLayout::offset(0, t, i) * sizeof(float))),
                         "f"(frag(i)), "f"(frag(i + 1)), "f"(frag(i + 2)), "f"(frag(i + 3)));
          }
          cutlass::arch::fence_view_async_shared();
          cutlass::arch::NamedBarrier::arrive(kdQHandoffThreads, kBwddQFull0 + wg);
        }
      };
      if constexpr (kdQSwapAB) {
        // One slice at a time in one accumulator (as FA3): dQ_0, dK; dQ_1 once dQ_0's reds are out; the last
        // slice's reds in the next step (tdQrdQ_held).
        FragdQ& tdQrdQ = tdQrdQ_held;
        issue_dq(tdQrdQ, 0);
        issue_dk();
        warpgroup_wait<1>();  // dV and dQ_0 done; dK in flight
        pipeline_do.consumer_release(read_do);
        ++read_do;
        stage_dq(tdQrdQ, 0);
        CUTE_UNROLL
        for (int slice = 1; slice < kdQSlices; ++slice) {
          issue_dq(tdQrdQ, slice);
          warpgroup_wait<0>();
          if (slice + 1 < kdQSlices) stage_dq(tdQrdQ, slice);
        }
        warpgroup_fence_operand(tdQrdQ);
        dq_held = dq_thread;
      } else if constexpr (kdQSlices <= 2) {
        // Every slice in flight at once: dQ_0, dK, dQ_1.
        cute::array<FragdQ, kdQSlices> tdQrdQ;
        issue_dq(tdQrdQ[0], 0);
        issue_dk();
        if constexpr (kdQSlices == 2) issue_dq(tdQrdQ[1], 1);
        warpgroup_wait<kdQSlices>();  // dV and dQ_0 done; dK (and dQ_1) in flight
        pipeline_do.consumer_release(read_do);
        ++read_do;
        stage_dq(tdQrdQ[0], 0);
        warpgroup_wait<0>();
        if constexpr (kdQSlices == 2) stage_dq(tdQrdQ[1], 1);
      } else {
        // Two slices in flight, in two rotating accumulators (all of them do not fit beside the
        // 80-key dK^T/dV^T): dQ_0, dK, dQ_1; then each slice is issued as the one two before it
        // has been staged.
        cute::array<FragdQ, 2> tdQrdQ;
        issue_dq(tdQrdQ[0], 0);
        issue_dk();
        issue_dq(tdQrdQ[1], 1);
        warpgroup_wait<2>();  // dV and dQ_0 done
        pipeline_do.consumer_release(read_do);
        ++read_do;
        stage_dq(tdQrdQ[0], 0);
        CUTE_UNROLL
        for (int slice = 2; slice < kdQSlices; ++slice) {
          issue_dq(tdQrdQ[slice % 2], slice);
          warpgroup_wait<1>();  // slice - 1 (and dK) done
          stage_dq(tdQrdQ[(slice - 1) % 2], slice - 1);
        }
        warpgroup_wait<0>();
        stage_dq(tdQrdQ[(kdQSlices - 1) % 2], kdQSlices - 1);
      }
      if constexpr (kdKVMirror) {
        CUTE_UNROLL
        for (int s = 0; s < kdKVSlots; ++s) warpgroup_fence_operand(acc.slot[s]);
      } else {
        warpgroup_fence_operand(tdKrdK);
      }
      pipeline_q.consumer_release(read_q);
      ++read_q;
    };

    CUTE_NO_UNROLL
    for (int m_block = m_end - 1; m_block >= m_begin; --m_block) step(m_block);
    if constexpr (kdQSwapAB) {
      warpgroup_fence_operand(tdQrdQ_held);
      red_slice(tdQrdQ_held, dq_held, kdQSlices - 1);
    }

    // dQ atomics (never deterministic: that mode runs the writer path): this CTA's additions to every
    // block it walked are counted at once (one fence per thread, not one per step).
    if constexpr (kdQAtomic) count_dq_atomics(m_begin, m_end);

    // dK's softmax scale; with dropout, dV's 1 / keep probability (the steps added P Z dO).
    float const dv_scale = Dropout::kEnabled ? p.dropout.scale() : 1.f;
    if constexpr (kdKVMirror) {
      CUTE_UNROLL
      for (int s = 0; s < kdKVSlots; ++s) {
        float const scale = dkv_slot(wg_uniform, s).is_v ? dv_scale : p.softmax_scale;
        CUTE_UNROLL
        for (int i = 0; i < size(acc.slot[s]); ++i) acc.slot[s](i) *= scale;
      }
    } else {
      CUTE_UNROLL
      for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= p.softmax_scale;
      if constexpr (Dropout::kEnabled) {
        CUTE_UNROLL
        for (int i = 0; i < size(tdVrdV); ++i) tdVrdV(i) *= dv_scale;
      }
    }
    return true;
  }
};

}  // namespace flashhopper::sm90
