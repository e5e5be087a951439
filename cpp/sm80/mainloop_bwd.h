// Ampere backward mainloop (FlashAttention-2's schedule): a CTA owns one key block (K, V stay in
// shared memory) and walks the query blocks that see it. Per query block, with every warp on
// every GEMM (mma.sync m16n8k16, operands through ldmatrix, transposed ones with ldmatrix .trans):
//   S = Q K^T, P = exp2(S scale_log2 - LSE_log2)            P recomputed from the forward's LSE
//   dP = dO V^T, dS = P (dP - D)                             D = rowsum(dO O) from the preprocess
//   P, dS -> shared memory (16-bit)
//   dV += P^T dO;   then the next dO loads
//   dQ  = dS K      added into the float32 dQ accumulator with fire-and-forget reductions
//                   (in fragment order: red_add_fragment_order), issued during dK's GEMM:
//   dK += dS^T Q;   then the next Q loads (single-buffered Q; double-buffered it loaded at the top).
// dK and dV stay in registers for the whole walk. The mask policy, block ranges, score mod and the
// P / dS math are the ones the sm90 path uses (common/).
#pragma once

#include <cute/tensor.hpp>

#include "../common/block_info.h"
#include "../common/mask.h"
#include "../common/dropout.h"
#include "../common/score_mod.h"
#include "../common/semaphore.h"
#include "../common/seqlen.h"
#include "../common/softmax.h"
#include "../common/utils.h"
#include "gemm.h"

namespace flashhopper::sm80 {

using namespace cute;

CUTE_DEVICE void red_add(float* p, float v) { asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v)); }

// acc: an mma.sync accumulator; elements 2i and 2i+1 are adjacent columns of one row. Adds each
// element at addr(row, col) for rows below row_limit (sm_90 adds the pairs with one instruction).
template <class Frag, class Coords, class Addr>
CUTE_DEVICE void red_add_fragment(Frag const& acc, Coords const& coords, int row_limit, Addr&& addr) {
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    int const row = int(get<0>(coords(i)));
    if (row < row_limit) {
      float* p = addr(row, int(get<1>(coords(i))));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(acc(i)), "f"(acc(i + 1)));
#else
      red_add(p, acc(i));
      red_add(p + 1, acc(i + 1));
#endif
    }
  }
}

// The float32 dQ accumulator holds each kBlockM x headdim tile in MMA-fragment order: thread t's
// element i at i * kNumThreads + t, so that one warp's reduction covers 128 contiguous bytes (in
// (row, col) order it touches 8 rows). Scalar reductions: measured on the H100, both the
// (row, col)-ordered red.v2 and a fragment-ordered red.v4 kept L2 busier (73%, 80%) than this
// pattern. The sm80 postprocess reads the tiles back with the same mapping.
// part / num_parts: the share of the elements to add now (all of them by default).
template <int kNumThreads, class Frag>
CUTE_DEVICE void red_add_fragment_order(Frag const& acc, float* tile, int part = 0, int num_parts = 1) {
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    if (i * num_parts / size(acc) == part) red_add(tile + i * kNumThreads + int(threadIdx.x), acc(i));
  }
}

template <class Element_, int kHeadDim_, class TileSize, MaskKind kMask_, class ScoreMod_ = ScoreModIdentity,
          class Dropout_ = DropoutNone>
struct BwdMainloop {
  using Element = Element_;
  using ScoreMod = ScoreMod_;
  using Dropout = Dropout_;  // common/dropout.h: the forward's keep mask, drawn again per tile
  static constexpr int kHeadDim = kHeadDim_, kBlockM = TileSize::kBlockM, kBlockN = TileSize::kBlockN;
  static constexpr int kNumWarps = TileSize::kNumWarps, kNumThreads = kNumWarps * 32;
  static constexpr int kStagesQ = TileSize::kStagesQ;
  static constexpr MaskKind kMask = kMask_;
  using BlockInfoT = BlockInfo<kBlockM, kBlockN, kMask>;
  static_assert(kStagesQ == 1 || kStagesQ == 2);
  // The head dim in whole swizzle atoms (SmemAtom: 64 or 32 columns), and the warps that split it
  // (dK / dV, dQ) tile it exactly: the dQ accumulator's fragment order has no padding.
  static_assert(kHeadDim % 32 == 0 && kHeadDim % (16 * (kNumWarps / TileSize::kWarpsNdKV)) == 0 &&
                kHeadDim % (16 * (kNumWarps / TileSize::kWarpsMdQ)) == 0);

  using D = Int<kHeadDim>;
  using BM = Int<kBlockM>;
  using BN = Int<kBlockN>;

  using TiledMmaSdP = TiledMma<Element, TileSize::kWarpsMSdP, kNumWarps / TileSize::kWarpsMSdP>;  // (BM, BN)
  using TiledMmadKV = TiledMma<Element, TileSize::kWarpsNdKV, kNumWarps / TileSize::kWarpsNdKV>;  // (BN, D)
  using TiledMmadQ = TiledMma<Element, TileSize::kWarpsMdQ, kNumWarps / TileSize::kWarpsMdQ>;     // (BM, D)

  using SmemLayoutQ = SmemLayout<kBlockM, kHeadDim>;
  using SmemLayoutKV = SmemLayout<kBlockN, kHeadDim>;
  using SmemLayoutP = SmemLayout<kBlockM, kBlockN>;
  using GmemCopy = sm80::GmemCopy<Element, kNumThreads, kHeadDim>;

  struct TensorStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ> * kStagesQ, 128> smem_q;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 128> smem_do;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 128> smem_k;  // dK is staged here at the end
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 128> smem_v;  // and dV here
    cute::array_aligned<Element, cosize_v<SmemLayoutP>, 128> smem_p;
    cute::array_aligned<Element, cosize_v<SmemLayoutP>, 128> smem_ds;
  };

  // One (batch entry, head)'s inputs (from the entry's first row) and statistics.
  struct Args {
    Element const *q, *k, *v, *dout;
    int64_t q_row_stride, k_row_stride, v_row_stride, do_row_stride;
    float const* lse_log2;  // this head's seqlen_q_rounded rows (padding rows: +inf)
    float const* dpsum;     // D, same rows (padding rows: 0)
    float* dq_accum;        // seqlen_q_rounded / kBlockM tiles in fragment order (red_add_fragment_order)
    int* dq_semaphore;      // deterministic: one zeroed counter per query block; else nullptr
    SeqlenInfo seq;
    int window_left, window_right;
    float scale_log2;
    ScoreMod score_mod;
    Dropout dropout;
    int bh;  // batch * nheads_q + head (dropout's draws)
  };

  // Accumulates this key block's dK (unscaled: dS^T Q) and dV into the zeroed acc_dk, acc_dv and adds
  // every visited query block's dQ (unscaled) into args.dq_accum. Returns false when no query sees
  // the block (dK = dV = 0).
  template <class FragdKV>
  CUTE_DEVICE static bool mma(TensorStorage& ts, Args const& args, int n_block, FragdKV& acc_dk, FragdKV& acc_dv) {
    BlockInfoT const info{args.seq, args.window_left, args.window_right};
    int const m_block_min = info.m_block_min(n_block);
    int const m_block_max = info.m_block_max(n_block);
    if (m_block_min >= m_block_max) return false;
    // Query blocks below m_right_end have a row whose right edge cuts the key block; from m_left_begin
    // on, one whose left edge does.
    int const m_right_end = info.m_block_right_masked_end(n_block);
    int const m_left_begin = info.m_block_left_masked_begin(n_block);
    int const seqlen_q = args.seq.seqlen_q, seqlen_k = args.seq.seqlen_k;
    // Only the last key block has keys past seqlen_k.
    bool const seqlen_mask = (n_block + 1) * kBlockN > seqlen_k;
    int const tid = threadIdx.x;

    Tensor gK = local_tile(gmem_rows<kHeadDim>(args.k, seqlen_k, args.k_row_stride), Shape<BN, D>{},
                           make_coord(n_block, 0));
    Tensor gV = local_tile(gmem_rows<kHeadDim>(args.v, seqlen_k, args.v_row_stride), Shape<BN, D>{},
                           make_coord(n_block, 0));
    auto sQ = [&](int stage) {
      return make_tensor(make_smem_ptr(ts.smem_q.data() + stage * cosize_v<SmemLayoutQ>), SmemLayoutQ{});
    };
    Tensor sdO = make_tensor(make_smem_ptr(ts.smem_do.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(ts.smem_k.data()), SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(ts.smem_v.data()), SmemLayoutKV{});
    Tensor sP = make_tensor(make_smem_ptr(ts.smem_p.data()), SmemLayoutP{});
    Tensor sdS = make_tensor(make_smem_ptr(ts.smem_ds.data()), SmemLayoutP{});
    // Transposed views for the operands whose k extent is strided in memory.
    Tensor sdOt = make_tensor(sdO.data(), transposed(SmemLayoutQ{}));  // (D, BM)
    Tensor sKt = make_tensor(sK.data(), transposed(SmemLayoutKV{}));   // (D, BN)
    Tensor sPt = make_tensor(sP.data(), transposed(SmemLayoutP{}));    // (BN, BM)
    Tensor sdSt = make_tensor(sdS.data(), transposed(SmemLayoutP{}));

    GmemCopy gmem_copy;
    auto gthr = gmem_copy.get_thread_slice(tid);
    Tensor tdOsdO = gthr.partition_D(sdO);
    Tensor tQcQ = gthr.partition_S(make_identity_tensor(Shape<BM, D>{}));
    Tensor tKcK = gthr.partition_S(make_identity_tensor(Shape<BN, D>{}));
    int const k_rows = seqlen_k - n_block * kBlockN;
    // Only the last query block can hold the sequence end; the others load without row checks.
    auto load_rows = [&](Element const* ptr, int64_t row_stride, auto&& dst, int m) {
      Tensor src = gthr.partition_S(block_rows<kBlockM, kHeadDim>(ptr, row_stride, m));
      int const valid = seqlen_q - m * kBlockM;
      if (valid < kBlockM) {
        copy_rows(gmem_copy, src, dst, tQcQ, valid);
      } else {
        copy(gmem_copy, src, dst);
      }
    };
    auto load_q = [&](int m, int stage) { load_rows(args.q, args.q_row_stride, gthr.partition_D(sQ(stage)), m); };
    auto load_do = [&](int m) { load_rows(args.dout, args.do_row_stride, tdOsdO, m); };

    TiledMmaSdP mma_sdp;
    TiledMmadKV mma_dkv;
    TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(tid);
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<BM, BN>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<BM, BN>{});
    Tensor acc_dq = partition_fragment_C(mma_dq, Shape<BM, D>{});
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<BM, BN>{}));
    Tensor tScS_rc = rowcol(tScS);
    constexpr int kRows = decltype(size<0>(rowcol(acc_s)))::value;
    Mask<kBlockN, kMask> const mask{args.seq, args.window_left, args.window_right};
    // Dropout: a warp's columns are whole 16-key blocks only when no other warp splits the keys
    // (TiledMma interleaves warps by 8 columns).
    constexpr bool kDropGroupsWhole = kNumWarps == TileSize::kWarpsMSdP;
    auto const drop = [&] {
      if constexpr (Dropout::kEnabled) return args.dropout.stream(args.bh);
      else return 0;
    }();

    // Prologue: K, V, the first Q and dO in flight together.
    copy_rows(gmem_copy, gthr.partition_S(gK), gthr.partition_D(sK), tKcK, k_rows);
    copy_rows(gmem_copy, gthr.partition_S(gV), gthr.partition_D(sV), tKcK, k_rows);
    load_q(m_block_min, 0);
    load_do(m_block_min);
    cp_async_fence();

    for (int m_block = m_block_min; m_block < m_block_max; ++m_block) {
      int const stage = kStagesQ == 1 ? 0 : (m_block - m_block_min) % 2;
      // This block's rows' statistics, read while the copies land.
      float lse[kRows], dsum[kRows];
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        int const row = m_block * kBlockM + int(get<0>(tScS_rc(mi, 0)));
        lse[mi] = args.lse_log2[row];
        dsum[mi] = args.dpsum[row];
      }
      cp_async_wait<0>();
      __syncthreads();  // Q_m, dO_m landed; every warp is done with the previous block's P, dS, Q
      if constexpr (kStagesQ == 2) {
        if (m_block + 1 < m_block_max) {
          load_q(m_block + 1, stage ^ 1);
          cp_async_fence();
        }
      }

      clear(acc_s);
      gemm_ss<LdsmN, LdsmN>(mma_sdp, acc_s, sQ(stage), sK);  // S = Q K^T
      args.score_mod.apply(acc_s);
      if (seqlen_mask || m_block < m_right_end || (BlockInfoT::kHasLeft && m_block >= m_left_begin)) {
        mask.template apply_bwd<true, true, true, false>(acc_s, tScS, m_block * kBlockM, n_block * kBlockN);
      }
      Tensor scores = rowcol(acc_s);
      probs_from_lse(scores, [&](int mi, int) { return lse[mi]; }, args.scale_log2);
      // Dropout: dV takes Pd = s P where kept, 0 where dropped; dS takes both (DropoutPhilox::grad_scores).
      auto const rPd = [&] {
        if constexpr (Dropout::kEnabled) {
          Tensor sp = make_tensor<float>(acc_s.layout());
          CUTE_UNROLL
          for (int i = 0; i < size(sp); ++i) sp(i) = acc_s(i) * args.dropout.scale();
          Tensor d = convert_type<Element>(sp);
          Dropout::template apply<kDropGroupsWhole>(drop, rowcol(d), tScS_rc, m_block * kBlockM,
                                                           n_block * kBlockN);
          return d;
        } else {
          return 0;
        }
      }();
      clear(acc_dp);
      gemm_ss<LdsmN, LdsmN>(mma_sdp, acc_dp, sdO, sV);  // dP = dO V^T
      Tensor dp = rowcol(acc_dp);
      if constexpr (Dropout::kEnabled) {
        args.dropout.grad_scores(scores, rowcol(rPd), dp, [&](int mi, int) { return dsum[mi]; });  // P (Z s dP - D)
      } else {
        grad_scores(scores, dp, [&](int mi, int) { return dsum[mi]; });  // dS = P (dP - D)
      }
      args.score_mod.chain(dp, scores, [&](int mi, int) { return lse[mi]; });
      if constexpr (Dropout::kEnabled) {
        store_fragment(mma_sdp, rPd, sP);
      } else {
        store_fragment(mma_sdp, convert_type<Element>(acc_s), sP);
      }
      store_fragment(mma_sdp, convert_type<Element>(acc_dp), sdS);
      __syncthreads();  // P, dS complete

      gemm_ss<LdsmT, LdsmT>(mma_dkv, acc_dv, sPt, sdOt);  // dV += P^T dO
      __syncthreads();  // every warp is done with dO
      if (m_block + 1 < m_block_max) {
        load_do(m_block + 1);
        cp_async_fence();
      }
      clear(acc_dq);
      gemm_ss<LdsmN, LdsmT>(mma_dq, acc_dq, sdS, sKt);  // dQ = dS K
      // Deterministic: key blocks n_block_min .. n_block_max - 1 all add into this query block; they
      // take turns from the last down: a higher key block starts its walk at a higher query block,
      // so it gets here first (ascending turns measured 0.41-0.50x of the default causal). The
      // kernel launches key blocks in that order, so a CTA only waits on ones started before it.
      if (args.dq_semaphore != nullptr) {
        if (tid == 0) wait_at_least(args.dq_semaphore + m_block, info.n_block_max(m_block) - 1 - n_block);
        __syncthreads();
      }
      // dQ's reductions are handed to dK's GEMM in slices (ptxas still pulls most of them to its
      // first MMAs). Issued as one block before or after it they filled the load/store queue (ncu,
      // head dim 256, 8k: LG-throttle 1.75 cycles per instruction, now 1.05; 0.98x -> 1.01x FA2).
      Tensor sQt = make_tensor(sQ(stage).data(), transposed(SmemLayoutQ{}));  // (D, BM)
      float* dq_tile = args.dq_accum + int64_t(m_block) * kBlockM * kHeadDim;
      gemm_ss<LdsmT, LdsmT>(mma_dkv, acc_dk, sdSt, sQt, [&](int k) {  // dK += dS^T Q
        constexpr int kSlices = kBlockM / 16;  // the k extent of dK = dS^T Q is the query block
        red_add_fragment_order<kNumThreads>(acc_dq, dq_tile, k, kSlices);
      });
      if (args.dq_semaphore != nullptr) {
        __threadfence();  // this CTA's reductions are ordered before the turn passes
        __syncthreads();
        if (tid == 0) signal(args.dq_semaphore + m_block);
      }
      if constexpr (kStagesQ == 1) {
        __syncthreads();  // every warp is done with Q
        if (m_block + 1 < m_block_max) {
          load_q(m_block + 1, 0);
          cp_async_fence();
        }
      }
    }
    return true;
  }
};

}  // namespace flashhopper::sm80
