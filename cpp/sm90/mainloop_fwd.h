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
// FP8 (e4m3, docs/fp8.md): both WGMMA operands must be K-major, so V arrives transposed (V^T tiles,
// keys contiguous) with its keys permuted within groups of 16 such that the fp32 S accumulator of a
// thread converts to the fp8 A operand of the PV GEMM without shuffles. Q and K descales (one per
// 64 query rows, one per key block) fold into the softmax's per-block scale; the V descale of each
// key block folds into the O rescale that the online softmax does anyway; O leaves as bfloat16
// through its own shared-memory buffer (Q's fp8 stage is too small to stage it).
// Ablation build FLASHHOPPER_FP8_V_TRANSPOSE_IN_KERNEL (head dims 64 and 128, tile_size.h): V arrives
// row-major like K, TMA loads it into stages of its own, and producer warps transpose it into the same
// V^T stages (VTranspose below), which the consumers read through a pipeline of their own.
#pragma once

#include <cute/tensor.hpp>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include <type_traits>

#include "../common/block_info.h"
#include "../common/mask.h"
#include "../common/softmax.h"
#include "../common/utils.h"
#include "gemm.h"
#include "named_barriers.h"
#include "tile_size.h"

namespace flashhopper::sm90 {

using namespace cute;

// Tile: a FwdTileSize (block sizes, pipeline depths, and whether ping-pong and the intra-warpgroup
// overlap are on; both are, except in ablation builds).
template <class Element_, int kHeadDim_, class Tile, bool kCausal_>
struct FwdMainloop {
  using Element = Element_;
  static constexpr bool kFp8 = sizeof(Element) == 1;
  // FP8 only: V comes row-major and the producer warpgroup transposes it (tile_size.h).
  static constexpr bool kVTransposeInKernel = kFp8 && fp8_v_transposed_in_kernel(kHeadDim_);
  using ElementOut = std::conditional_t<kFp8, cutlass::bfloat16_t, Element>;
  // FP8: P = 2^8 p uses more of e4m3's normal range (its smallest normal is 2^-6).
  static constexpr int kMaxOffset = kFp8 ? 8 : 0;
  using Softmax = OnlineSoftmax<2, kMaxOffset>;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN;
  static constexpr int kStages = Tile::kStages, kQStages = Tile::kQStages;
  static constexpr bool kCausal = kCausal_, kOverlap = Tile::kOverlap;
  static constexpr int kNumMmaWG = kBlockM / 64;
  static constexpr int kNumMmaThreads = kNumMmaWG * cutlass::NumThreadsPerWarpGroup;
  static_assert(kBlockM % 64 == 0 && kNumMmaWG >= 1 && kNumMmaWG <= 3);
  using Sched = PingPong<kNumMmaWG, Tile::kPingPong>;

  using D = Int<kHeadDim>;
  using BN = Int<kBlockN>;

  // GEMMs of one consumer warpgroup: S(64 x BN) = Q(64 x D) K^T, O(64 x D) += P(64 x BN) V.
  using TiledMmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, BN, D>>()));
  using TiledMmaPV = decltype(make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, Shape<_64, D, BN>,
                                                                   GMMA::Major::K, kFp8 ? GMMA::Major::K : GMMA::Major::MN>()));

  // Q: one 64-row slice per consumer warpgroup, kQStages tiles deep. The 16-bit epilogue stages O in
  // the warpgroup's slice once its last S GEMM is done, so O needs no buffer of its own (FP8 does).
  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, _64, D>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<_64, D, Int<kNumMmaWG>, Int<kQStages>>{}));
  using SmemAtomKV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BN, D>());
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomKV{}, Shape<BN, D, Int<kStages>>{}));
  // V as PV's B operand, (headdim, keys). 16-bit: V's own tiles read MN-major (headdim contiguous).
  // FP8: V^T tiles, K-major (keys contiguous), as loaded or as transposed in the kernel.
  using SmemAtomVt = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, D, BN>());
  using SmemLayoutVt = std::conditional_t<
      kFp8, decltype(tile_to_shape(SmemAtomVt{}, Shape<D, BN, Int<kStages>>{})),
      decltype(composition(SmemLayoutK{}, make_ordered_layout(Shape<D, BN, Int<kStages>>{}, Step<_2, _1, _3>{})))>;
  // The V stages the consumers read (smem_v): V tiles (keys, headdim), or for FP8 V^T tiles (headdim, keys).
  using SmemLayoutV = std::conditional_t<kFp8, SmemLayoutVt, SmemLayoutK>;
  // What TMA writes for V: SmemLayoutV, except with the in-kernel transpose: row-major V tiles laid out as
  // K's, in stages of their own (smem_vraw).
  using SmemLayoutVLoad = std::conditional_t<kVTransposeInKernel, SmemLayoutK, SmemLayoutV>;
  using TileV = std::conditional_t<kFp8 && !kVTransposeInKernel, Shape<D, BN>, Shape<BN, D>>;
  // FP8: O (bfloat16) staged for its TMA store, 64 rows per consumer warpgroup.
  using SmemAtomO = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, ElementOut, _64, D>());
  using SmemLayoutO = decltype(tile_to_shape(SmemAtomO{}, Shape<_64, D, Int<kNumMmaWG>, _1>{}));

  // Global tensors as (seqlen, headdim, head, batch).
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQKV{}));
  using TMA_Q = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}), Shape<_64, D>{}, _1{}));
  using TMA_K = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutK{}), Shape<BN, D>{}, _1{}));
  // FP8's V^T has the same tensor type: (headdim, keys) with the keys at stride 1.
  using TMA_V = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutVLoad{}), TileV{}, _1{}));

  static constexpr uint32_t kQStageBytes = uint32_t(size(take<0, 3>(SmemLayoutQ{})) * sizeof(Element));
  static constexpr uint32_t kKVStageBytes = uint32_t(size(take<0, 2>(SmemLayoutK{})) * sizeof(Element));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  // Q stages are released by one thread per consumer warpgroup, once TMA has read the O staged there.
  using PipelineQ = cutlass::PipelineTmaAsync<kQStages>;
  using PipelineStateQ = typename PipelineQ::PipelineState;

  struct TensorStorage16 {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> smem_q;
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> smem_v;
  };
  struct TensorStorageFp8 : TensorStorage16 {
    cute::array_aligned<ElementOut, cosize_v<SmemLayoutO>, 1024> smem_o;
  };
  // In-kernel transpose: TMA fills smem_vraw (row-major V), the producer warps smem_v (V^T).
  struct TensorStorageFp8VRaw : TensorStorageFp8 {
    cute::array_aligned<Element, cosize_v<SmemLayoutVLoad>, 1024> smem_vraw;
  };
  using TensorStorage = std::conditional_t<kVTransposeInKernel, TensorStorageFp8VRaw,
                                           std::conditional_t<kFp8, TensorStorageFp8, TensorStorage16>>;
  CUTE_DEVICE static Element* v_load_smem(TensorStorage& ts) {
    if constexpr (kVTransposeInKernel) return ts.smem_vraw.data();
    else return ts.smem_v.data();
  }

  // In-kernel transpose: pipeline_v carries the row-major V tiles from TMA to the transposing producer
  // warps (its consumers), pipeline_vt the V^T tiles from them to the consumer warpgroups. PipelineV is the
  // pipeline the consumers read V through.
  using PipelineVt = cutlass::PipelineAsync<kStages>;
  using PipelineV = std::conditional_t<kVTransposeInKernel, PipelineVt, Pipeline>;
  struct BarrierStorageBase {
    typename PipelineQ::SharedStorage pipeline_q;
    typename Pipeline::SharedStorage pipeline_k;
    typename Pipeline::SharedStorage pipeline_v;
  };
  struct BarrierStorageVt : BarrierStorageBase {
    typename PipelineVt::SharedStorage pipeline_vt;
  };
  using BarrierStorage = std::conditional_t<kVTransposeInKernel, BarrierStorageVt, BarrierStorageBase>;
  // Threads of the producer warpgroup that transpose V (0: none); VTranspose is defined further down.
  static constexpr int v_transpose_threads() {
    if constexpr (kVTransposeInKernel) return VTranspose::kThreads;
    else return 0;
  }

  // FP8 descales: scale(b, h, block) = ptr[b * batch + h * head + (token / block) * block_stride].
  struct Descale {
    float const* ptr;
    int64_t batch, head, block_stride;
    int block;
    CUTE_DEVICE float operator()(int b, int h, int token) const {
      return ptr[b * batch + h * head + (token / block) * block_stride];
    }
  };
  struct Descales {
    Descale q, k, v;
  };

  struct Params {
    TMA_Q tma_q;
    TMA_K tma_k;
    TMA_V tma_v;
    ShapeQKV shape_q, shape_k, shape_v;  // shape_v: V's, or for FP8's V^T (headdim, keys padded to 16)
    int heads_ratio;  // query heads per kv head (GQA/MQA)
    float scale_log2;
    BlockInfo<kBlockM, kBlockN, kCausal> block_info;
    Descales descale;  // FP8 only
  };

  static Params make_params(Element const* q, StrideQKV stride_q, ShapeQKV shape_q, Element const* k,
                            StrideQKV stride_k, Element const* v, StrideQKV stride_v, ShapeQKV shape_k,
                            float softmax_scale, Descales descale = {}) {
    auto mQ = make_tensor(make_gmem_ptr(q), shape_q, stride_q);
    auto mK = make_tensor(make_gmem_ptr(k), shape_k, stride_k);
    // FP8's V^T: (headdim, keys); the TMA bound is the padded key count, since a group of 16 keys
    // holds them permuted (a key below seqlen_k may sit at a position above it). Row-major V (in-kernel
    // transpose) is bounded like K: TMA zero-fills the keys past seqlen_k, so no NaN garbage reaches the
    // PV GEMM (their p is 0).
    ShapeQKV const shape_v = kFp8 && !kVTransposeInKernel
                                 ? ShapeQKV{get<1>(shape_k), (get<0>(shape_k) + 15) / 16 * 16, get<2>(shape_k),
                                            get<3>(shape_k)}
                                 : shape_k;
    auto mV = make_tensor(make_gmem_ptr(v), shape_v, stride_v);
    return {make_tma_copy(SM90_TMA_LOAD{}, mQ, take<0, 2>(SmemLayoutQ{}), Shape<_64, D>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(SmemLayoutK{}), Shape<BN, D>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, mV, take<0, 2>(SmemLayoutVLoad{}), TileV{}, _1{}),
            shape_q,
            shape_k,
            shape_v,
            get<2>(shape_q) / get<2>(shape_k),
            float(softmax_scale * M_LOG2E),
            {get<0>(shape_q), get<0>(shape_k)},
            descale};
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
  }

  // ---------------------------------------------------------------------------------------------
  // Producer: one thread issues every TMA of a tile. The first K block goes out before the wait
  // for a free Q stage (with one Q stage that wait lasts until the previous tile's O is stored);
  // then Q, then K/V with V trailing K by one block so that the first S GEMM never waits on V.
  CUTE_DEVICE static void load(Params const& p, PipelineQ& pipeline_q, Pipeline& pipeline_k, Pipeline& pipeline_v,
                               PipelineStateQ& write_q, PipelineState& write_k, PipelineState& write_v,
                               TensorStorage& ts, int m_block, int head, int batch) {
    int const n_block_max = p.block_info.n_block_max(m_block);
    int const n_block_min = p.block_info.n_block_min(m_block);

    Tensor sQ = make_tensor(make_smem_ptr(ts.smem_q.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(ts.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(v_load_smem(ts)), SmemLayoutVLoad{});
    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q)(_, _, head, batch);
    Tensor mK = p.tma_k.get_tma_tensor(p.shape_k)(_, _, head / p.heads_ratio, batch);
    Tensor mV = p.tma_v.get_tma_tensor(p.shape_v)(_, _, head / p.heads_ratio, batch);
    Tensor gQ = local_tile(mQ, Shape<_64, D>{}, make_coord(_, _0{}));  // (64, D, m64)
    Tensor gK = local_tile(mK, Shape<BN, D>{}, make_coord(_, _0{}));   // (BN, D, n)
    Tensor gV = [&] {
      if constexpr (kFp8 && !kVTransposeInKernel) {
        return local_tile(mV, TileV{}, make_coord(_0{}, _));  // (D, BN, n)
      } else {
        return local_tile(mV, TileV{}, make_coord(_, _0{}));  // (BN, D, n)
      }
    }();
    auto q_parts = tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto k_parts = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto v_parts = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    Tensor tQgQ = get<0>(q_parts);  // (TMA, m64)
    Tensor tQsQ = get<1>(q_parts);  // (TMA, wg, q_stage)
    Tensor tKgK = get<0>(k_parts);  // (TMA, n)
    Tensor tKsK = get<1>(k_parts);  // (TMA, stage)
    Tensor tVgV = get<0>(v_parts);
    Tensor tVsV = get<1>(v_parts);

    auto load_k = [&](int n_block) {
      pipeline_k.producer_acquire(write_k);
      copy(p.tma_k.with(*pipeline_k.producer_get_barrier(write_k), 0, TMA::CacheHintSm90::EVICT_LAST),
           tKgK(_, n_block), tKsK(_, write_k.index()));
      ++write_k;
    };
    auto load_v = [&](int n_block) {
      pipeline_v.producer_acquire(write_v);
      copy(p.tma_v.with(*pipeline_v.producer_get_barrier(write_v), 0, TMA::CacheHintSm90::EVICT_LAST),
           tVgV(_, n_block), tVsV(_, write_v.index()));
      ++write_v;
    };

    int n_block = n_block_max - 1;
    load_k(n_block);
    pipeline_q.producer_acquire(write_q);
    CUTE_UNROLL
    for (int wg = 0; wg < kNumMmaWG; ++wg) {
      copy(p.tma_q.with(*pipeline_q.producer_get_barrier(write_q), 0, TMA::CacheHintSm90::EVICT_FIRST),
           tQgQ(_, m_block * kNumMmaWG + wg), tQsQ(_, wg, write_q.index()));
    }
    ++write_q;
    for (; n_block > n_block_min; --n_block) {
      load_k(n_block - 1);
      load_v(n_block);
    }
    load_v(n_block_min);
  }

  // ---------------------------------------------------------------------------------------------
  // In-kernel V transpose (kVTransposeInKernel). A raw stage holds a V tile row-major, (BN keys, D) laid
  // out as K's (K-major; SW128 at d128, SW64 at d64); its V^T stage is SmemLayoutVt, (D, BN) with the keys
  // of each aligned group of 16 stored in the order 0 1 8 9 2 3 10 11 4 5 12 13 6 7 14 15 (key a at
  // position vt_position(a), docs/fp8.md): what the quantization pass writes, so the consumers (to_p)
  // are the same. The warps 1..kWarps of the producer warpgroup (warp 0 issues the TMA) each move
  // `slabs` of kSlabGroups groups x D dims per stage, one unit of 16 keys x 32 dims (512 bytes) at a time:
  //  - ldmatrix.x4.trans (b16): matrix j = rows keys 16g + 8 (j % 2) + 0..7, the 16 bytes at dims
  //    c + 16 (j / 2). Lane t (q = t / 4, m = t % 4) gets the 16-bit column q of rows 2m and 2m + 1, so its
  //    register j holds [key 2m: dims 2q, 2q+1 | key 2m+1: dims 2q, 2q+1] (keys + 8 for odd j, dims + 16 for
  //    j >= 2): a 4x4 byte block of keys {2m, 2m+1, 2m+8, 2m+9}, the four keys of V^T positions 4m..4m+3.
  //  - one PRMT per output word: [key 2m, 2m+1, 2m+8, 2m+9] at dim 2q (selector 0x6420) or 2q + 1 (0x7531),
  //    i.e. word m of that dim's 16-byte V^T row of the group.
  //  - stmatrix.x4 (not transposed): lane t's register j lands in row q, word m of matrix j, so row r of
  //    matrix j is the V^T row of the dim that lanes 4r..4r+3 hold in register j.
  // Banks: the ldmatrix rows of a matrix are 8 consecutive keys at one 16-byte chunk: 8 distinct 16-byte
  // bank groups under the SW128 (d128) and SW64 (d64) swizzles. The stmatrix rows of a matrix would be dims
  // c + 2r, r = 0..7, where r and r + 4 (8 dims apart) fall on the same banks in both V^T layouts (SW64 with
  // 64-byte rows at d128, SW128 at d64): a 2-way conflict. So lanes with q >= 4 swap their two dims (the PRMT
  // selector is per lane: no extra instruction): row r of matrix 2k is dim c + 16k + 2r + (r >= 4), of
  // matrix 2k + 1 the other one of the pair; 8 distinct bank groups in either layout (checked in a model).
  // Per unit a thread issues 1 LDSM, 4 PRMT and 1 STSM (+1 LOP3 for the address at 24 registers); addresses
  // are the lane's row for the slab's first unit XOR an offset inside the swizzle atom plus a whole-atom
  // offset. Registers: at d128 (two consumer warpgroups at 240) setmaxnreg leaves the producer 24, all the
  // launch allocation allows (kernel_fwd.h), so one unit is in flight at a time; at d64 (32) two.
  struct VTranspose {
    static constexpr int kGroups = kBlockN / 16;  // aligned groups of 16 keys (the unit of the permutation)
    static constexpr int kChunks = kHeadDim / 32;
    // Groups per slab: a power of two whose positions stay inside one V^T swizzle-atom row (16 * groups
    // bytes), so that a unit's offset is the slab's XOR a constant; at most 4.
    static constexpr int kVtAtomBytes = int(size<1>(SmemAtomVt{}));
    static constexpr int kSlabGroups = kGroups % 4 == 0 && 64 <= kVtAtomBytes ? 4
                                       : kGroups % 2 == 0 && 32 <= kVtAtomBytes ? 2 : 1;
    static constexpr int kSlabs = kGroups / kSlabGroups;
    static constexpr int kWarps = kSlabs < 3 ? kSlabs : 3;  // warps 1..3 of the producer warpgroup
    static constexpr int kThreads = kWarps * cutlass::NumThreadsPerWarp;
    static constexpr int kUnits = kSlabGroups * kChunks;  // per slab
    static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0);
    // A raw row (one key) is one swizzle-atom row: the chunk XOR below stays inside it.
    static_assert(int(size<1>(SmemAtomKV{})) == kHeadDim, "raw V rows must be one swizzle atom wide");

    // Byte offsets inside one stage. Lane `lane`'s ldmatrix row for the slab's first unit: key
    // 16 kSlabGroups slab + lane % 16, dims from 16 (lane / 16). Its stmatrix row: V^T row of dim
    // 16 (j / 2) + 2r + ((j % 2) ^ (r / 4)) (j = lane / 8, r = lane % 8), positions from 16 kSlabGroups slab.
    CUTE_HOST_DEVICE static uint32_t raw_lane_offset(int slab, int lane) {
      return uint32_t(SmemLayoutVLoad{}(16 * kSlabGroups * slab + lane % 16, 16 * (lane / 16), 0));
    }
    CUTE_HOST_DEVICE static uint32_t vt_lane_offset(int slab, int lane) {
      int const r = lane % 8, j = lane / 8;
      return uint32_t(SmemLayoutVt{}(16 * (j / 2) + 2 * r + ((j % 2) ^ (r / 4)), 16 * kSlabGroups * slab, 0));
    }
    // Unit u of a slab: group i = u % kSlabGroups of the slab, dims from c = 32 (u / kSlabGroups).
    // The raw row moves by 32 c bytes inside its 16-byte-chunk swizzle (XOR) and by 16 i whole keys (add,
    // a multiple of the 8-row swizzle period); the V^T row by 16 i positions inside its atom row (XOR) and
    // by 32 c whole dims (add).
    CUTE_HOST_DEVICE static uint32_t raw_unit_offset(uint32_t lane_offset, int u) {
      int const i = u % kSlabGroups, c = u / kSlabGroups;
      return (lane_offset ^ uint32_t(SmemLayoutVLoad{}(0, 32 * c, 0))) + uint32_t(SmemLayoutVLoad{}(16 * i, 0, 0));
    }
    CUTE_HOST_DEVICE static uint32_t vt_unit_offset(uint32_t lane_offset, int u) {
      int const i = u % kSlabGroups, c = u / kSlabGroups;
      return (lane_offset ^ uint32_t(SmemLayoutVt{}(0, 16 * i, 0))) + uint32_t(SmemLayoutVt{}(32 * c, 0, 0));
    }
    // PRMT selector of the even registers (the odd ones take the other dim: selector ^ 0x1111).
    CUTE_HOST_DEVICE static uint32_t selector(int lane) { return (lane / 16) ? 0x7531u : 0x6420u; }

    CUTE_DEVICE static void ldsm_t_x4(uint32_t addr, uint32_t (&w)[4]) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                   : "r"(addr));
    }
    CUTE_DEVICE static void stsm_x4(uint32_t addr, uint32_t const (&o)[4]) {
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(o[0]),
                   "r"(o[1]), "r"(o[2]), "r"(o[3])
                   : "memory");
    }

    // One slab: raw / vt are the shared-memory addresses of the lane's rows for unit 0 (a stage starts on
    // a 1024-byte boundary, so the XORs of the unit offsets act on the offset inside the stage alone).
    // kLookahead: the next unit's ldmatrix goes out before this one's stmatrix (the asm statements keep
    // their order), 4 more live registers; only where the producer has 32 registers (below).
    template <bool kLookahead>
    CUTE_DEVICE static void slab(uint32_t raw, uint32_t vt, uint32_t sel) {
      uint32_t const sel_other = sel ^ 0x1111u;
      uint32_t w[kLookahead ? 2 : 1][4];
      auto store_at = [&](uint32_t addr, uint32_t const (&x)[4]) {
        uint32_t const o[4] = {__byte_perm(x[0], x[1], sel), __byte_perm(x[0], x[1], sel_other),
                               __byte_perm(x[2], x[3], sel), __byte_perm(x[2], x[3], sel_other)};
        stsm_x4(addr, o);
      };
      auto store = [&](int u, uint32_t const (&x)[4]) { store_at(vt_unit_offset(vt, u), x); };
      if constexpr (kLookahead) {
        ldsm_t_x4(raw_unit_offset(raw, 0), w[0]);
        CUTE_UNROLL
        for (int u = 0; u < kUnits; ++u) {
          if (u + 1 < kUnits) ldsm_t_x4(raw_unit_offset(raw, u + 1), w[(u + 1) % 2]);
          store(u, w[u % 2]);
        }
      } else {
        // 24 registers: one unit at a time, and the groups in a loop that is not unrolled, so that the
        // per-group XORs are not all hoisted into registers (ptxas spilled otherwise). The raw row steps
        // by whole keys (an add), the V^T row's XOR is recomputed per group; the chunks are unrolled.
        uint32_t raw_i = raw;
#pragma unroll 1
        for (int i = 0; i < kSlabGroups; ++i, raw_i += uint32_t(SmemLayoutVLoad{}(16, 0, 0))) {
          uint32_t const vt_i = vt ^ uint32_t(SmemLayoutVt{}(0, 16 * i, 0));
          CUTE_UNROLL
          for (int c = 0; c < kChunks; ++c) {
            ldsm_t_x4(raw_i ^ uint32_t(SmemLayoutVLoad{}(0, 32 * c, 0)), w[0]);
            store_at(vt_i + uint32_t(SmemLayoutVt{}(32 * c, 0, 0)), w[0]);
          }
        }
      }
    }

    // Transpose stage `stage` (raw -> V^T); `warp` counts from 0 among the transposing warps.
    // kProducerRegs: what setmaxnreg leaves the producer warpgroup (kernel_fwd.h).
    template <int kProducerRegs>
    CUTE_DEVICE static void stage(TensorStorage& ts, int stage, int warp, int lane) {
      uint32_t const raw = cute::cast_smem_ptr_to_uint(ts.smem_vraw.data()) + uint32_t(SmemLayoutVLoad{}(0, 0, stage));
      uint32_t const vt = cute::cast_smem_ptr_to_uint(ts.smem_v.data()) + uint32_t(SmemLayoutVt{}(0, 0, stage));
      uint32_t const sel = selector(lane);
      constexpr bool kLookahead = kProducerRegs >= 32;
      if constexpr (kSlabs == kWarps) {  // one slab per warp
        slab<kLookahead>(raw + raw_lane_offset(warp, lane), vt + vt_lane_offset(warp, lane), sel);
      } else {
        for (int s = warp; s < kSlabs; s += kWarps) {
          slab<kLookahead>(raw + raw_lane_offset(s, lane), vt + vt_lane_offset(s, lane), sel);
        }
      }
    }
  };

  // The transposing warps' side of one tile: every V block the producer loads for it, in the same order.
  // Both pipelines have kStages stages and advance together; `blocks` counts the V blocks transposed so
  // far (stage blocks % kStages, phase (blocks / kStages) % 2 on pipeline_v's consumer side, the other
  // phase on pipeline_vt's producer side): one register where two PipelineStates would hold four, and
  // the producer warpgroup has 24 at two consumer warpgroups.
  template <int kProducerRegs>
  CUTE_DEVICE static void transpose_v(Params const& p, Pipeline& pipeline_v, PipelineVt& pipeline_vt, uint32_t& blocks,
                                      TensorStorage& ts, int m_block, int warp, int lane) {
    static_assert(kVTransposeInKernel);
    for (int n = p.block_info.n_block_max(m_block) - p.block_info.n_block_min(m_block); n > 0; --n, ++blocks) {
      int const stage = int(blocks % kStages);
      uint32_t const phase = (blocks / kStages) % 2;
      PipelineState const state(stage, phase, 0);
      pipeline_v.consumer_wait(state);
      pipeline_vt.producer_acquire(PipelineState(stage, phase ^ 1, 0));
      VTranspose::template stage<kProducerRegs>(ts, stage, warp, lane);
      // The generic-proxy stores must be visible to the consumers' WGMMA (async proxy) before the arrive.
      cutlass::arch::fence_view_async_shared();
      pipeline_vt.producer_commit(state);
      pipeline_v.consumer_release(state);  // its ldmatrix reads are done: their data has been stored
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Consumer: one warpgroup's 64 rows of the tile, reading Q from stage q_stage (already waited
  // for). Accumulates the unnormalized O into tOrO (zeroed by the caller) and the softmax state
  // into `softmax`; K/V stages are released as they are consumed, the Q stage by the epilogue.
  // on_first_issue() runs once the first S GEMM is on the tensor cores (the kernel releases the
  // previous tile's Q stage there).
  // Returns the factor the finished O still needs (FP8: the V descale of the last key block; else 1).
  template <class FragO, class OnFirstIssue>
  CUTE_DEVICE static float mma(Params const& p, Pipeline& pipeline_k, PipelineV& pipeline_v,
                               PipelineState& read_k, PipelineState& read_v, TensorStorage& ts,
                               int q_stage, FragO& tOrO, Softmax& softmax, int m_block, int head, int batch,
                               int wg, int thread_idx, OnFirstIssue&& on_first_issue) {
    int const n_block_max = p.block_info.n_block_max(m_block);
    int const n_block_min = p.block_info.n_block_min(m_block);
    int const row_offset = m_block * kBlockM + wg * 64;
    int const kv_head = head / p.heads_ratio;
    // Per key block: the softmax scale (times the q and k descales) and the V descale.
    float const q_descale = kFp8 ? p.descale.q(batch, head, row_offset) * p.scale_log2 : p.scale_log2;
    auto qk_scale = [&](int n) {
      if constexpr (kFp8) return q_descale * p.descale.k(batch, kv_head, n * kBlockN);
      else return q_descale;
    };
    auto v_descale = [&](int n) {
      if constexpr (kFp8) return p.descale.v(batch, kv_head, n * kBlockN);
      else return 1.f;
    };
    Mask<kBlockN, kCausal> const mask{p.block_info.seqlen_q, p.block_info.seqlen_k};

    Tensor sQ = make_tensor(make_smem_ptr(ts.smem_q.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(ts.smem_k.data()), SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(ts.smem_v.data()), SmemLayoutVt{});

    TiledMmaQK mma_qk;
    TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(thread_idx);
    auto thr_pv = mma_pv.get_thread_slice(thread_idx);
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ)(_, _, _, wg, q_stage);  // (MMA, 1, K)
    Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, 1, K, stage)
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, 1, K, stage)
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<_64, BN>{});
    Tensor tScS = rowcol(thr_qk.partition_C(make_identity_tensor(Shape<_64, BN>{})));
    Tensor scores = rowcol(tSrS);
    // P as the A operand of the PV GEMM. 16-bit: the accumulator's own layout. FP8: per 32-key k-block
    // a thread holds 4 registers of 4 keys, (row r, keys 16h + 4t .. 16h + 4t + 3) in register 2h + r,
    // while its accumulator holds keys 8j + 2t, 8j + 2t + 1; V^T's key permutation makes the accumulator's
    // keys {16h + 2t, +1, 16h + 8 + 2t, +1} the ones the A operand wants, so the conversion only regroups.
    Tensor tOrP = [&] {
      if constexpr (kFp8) {
        return make_tensor<Element>(Shape<Shape<_4, _2, _2>, _1, Int<kBlockN / 32>>{});
      } else {
        return make_tensor<Element>(acc_layout_as_a_operand(tSrS.layout()));
      }
    }();

    auto to_p = [&] {
      if constexpr (kFp8) {
        static_assert(kBlockN % 32 == 0);
        cutlass::NumericArrayConverter<Element, float, 4> convert;
        CUTE_UNROLL
        for (int kb = 0; kb < kBlockN / 32; ++kb) {
          CUTE_UNROLL
          for (int h = 0; h < 2; ++h) {
            CUTE_UNROLL
            for (int r = 0; r < 2; ++r) {
              cutlass::Array<float, 4> four;
              CUTE_UNROLL
              for (int b = 0; b < 4; ++b) four[b] = tSrS(make_coord(b % 2, r, kb * 4 + h * 2 + b / 2), 0, 0);
              auto const packed = convert(four);
              CUTE_UNROLL
              for (int b = 0; b < 4; ++b) tOrP(make_coord(b, r, h), 0, kb) = packed[b];
            }
          }
        }
      } else {
        Tensor p16 = convert_type<Element>(tSrS);
        CUTE_UNROLL
        for (int i = 0; i < size(tOrP); ++i) tOrP(i) = p16(i);
      }
    };
    // O is kept in units of the V descale of the newest key block in it: moving from block n + 1 to
    // n multiplies by v_descale(n + 1) / v_descale(n) together with the softmax rescale.
    float v_descale_prev = v_descale(n_block_max - 1);
    auto rescale_o = [&](cute::array<float, 2> o_scale, float vd) {
      if constexpr (kFp8) {
        float const ratio = v_descale_prev / vd;
        v_descale_prev = vd;
        o_scale[0] *= ratio;
        o_scale[1] *= ratio;
      }
      Tensor o = rowcol(tOrO);
      Softmax::rescale(o, o_scale);
    };

    // S_n = Q K_n^T for key block n; the caller waits for it.
    auto issue_s = [&] {
      pipeline_k.consumer_wait(read_k);
      wgmma<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
    };
    auto release_k = [&] {
      pipeline_k.consumer_release(read_k);
      ++read_k;
    };
    // O += P V for the block whose P is in tOrP.
    auto issue_pv = [&] {
      pipeline_v.consumer_wait(read_v);
      wgmma<false, -1>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
    };
    auto release_v = [&] {
      pipeline_v.consumer_release(read_v);
      ++read_v;
    };
    // Masked iterations first (key blocks are walked from the last): the sequence end and the
    // causal diagonal only ever fall in the highest blocks.
    int const n_causal = kCausal ? cute::max(p.block_info.n_block_causal_start(m_block), n_block_min) : n_block_max;

    // First (highest) key block: S only; it always carries the sequence-end and causal masks.
    int n_block = n_block_max - 1;
    Sched::sync(wg);
    issue_s();
    Sched::arrive(wg);
    on_first_issue();
    warpgroup_wait<0>();
    release_k();
    mask.template apply<true, true>(scores, tScS, row_offset, n_block);
    softmax.template update<true, true>(scores, qk_scale(n_block));
    to_p();

    if constexpr (kOverlap) {
      // S_n is issued together with O += P_{n+1} V_{n+1}; the softmax of S_n runs while the PV
      // GEMM is still on the tensor cores, and O is rescaled once it has finished.
      auto step = [&](int n, auto causal_mask) {
        constexpr bool kMask = decltype(causal_mask)::value;
        // Descale loads go out before the GEMMs and land while they run.
        float const s_scale = qk_scale(n), vd = v_descale(n);
        Sched::sync(wg);
        issue_s();
        issue_pv();
        Sched::arrive(wg);
        warpgroup_wait<1>();
        release_k();
        if constexpr (kMask) mask.template apply<false, true>(scores, tScS, row_offset, n);
        auto o_scale = softmax.template update<false, kMask>(scores, s_scale);
        warpgroup_wait<0>();
        release_v();
        rescale_o(o_scale, vd);
        to_p();
      };
      for (--n_block; n_block >= n_causal; --n_block) step(n_block, cute::true_type{});
      for (; n_block >= n_block_min; --n_block) step(n_block, cute::false_type{});
      Sched::sync(wg);
      issue_pv();
      Sched::arrive(wg);
      warpgroup_wait<0>();
      release_v();
    } else {
      // Ablation: every GEMM waits for its result before the softmax (FA2's order).
      auto pv_now = [&] {
        Sched::sync(wg);
        issue_pv();
        Sched::arrive(wg);
        warpgroup_wait<0>();
        release_v();
      };
      auto step = [&](int n, auto causal_mask) {
        constexpr bool kMask = decltype(causal_mask)::value;
        float const s_scale = qk_scale(n), vd = v_descale(n);
        Sched::sync(wg);
        issue_s();
        Sched::arrive(wg);
        warpgroup_wait<0>();
        release_k();
        if constexpr (kMask) mask.template apply<false, true>(scores, tScS, row_offset, n);
        auto o_scale = softmax.template update<false, kMask>(scores, s_scale);
        rescale_o(o_scale, vd);
        to_p();
        pv_now();
      };
      pv_now();
      for (--n_block; n_block >= n_causal; --n_block) step(n_block, cute::true_type{});
      for (; n_block >= n_block_min; --n_block) step(n_block, cute::false_type{});
    }
    return v_descale_prev;
  }
};

}  // namespace flashhopper::sm90
