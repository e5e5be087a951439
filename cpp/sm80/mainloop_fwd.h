// Ampere forward mainloop (FlashAttention-2's schedule): one CTA owns kBlockM query rows, its four
// warps split them (16 rows per MMA atom), and it walks the key blocks from the last to the first.
// Q, K and V come in with cp.async into one swizzled shared-memory tile each and reach the
// tensor cores through ldmatrix (V transposed on the way, as the B operand of O += P V);
// mma.sync m16n8k16 with float accumulators. The next block's K loads while P V runs, and V while
// S = Q K^T runs. The online softmax, masks and block ranges are the ones the sm90 path uses.
//
// Not run on a GPU yet (written 2026-11-22, compiled for sm_80 and sm_90): issue #5.
#pragma once

#include <cute/tensor.hpp>

#include <cutlass/numeric_types.h>

#include <type_traits>

#include "../common/block_info.h"
#include "../common/mask.h"
#include "../common/softmax.h"
#include "../common/utils.h"

namespace flashhopper::sm80 {

using namespace cute;

template <class Element_, int kHeadDim_, class TileSize, bool kCausal_>
struct FwdMainloop {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = TileSize::kBlockM, kBlockN = TileSize::kBlockN;
  static constexpr bool kCausal = kCausal_;
  static constexpr int kNumThreads = TileSize::kNumWarps * 32;
  static_assert(kHeadDim % 64 == 0 && kBlockM % (16 * TileSize::kNumWarps) == 0);

  using D = Int<kHeadDim>;
  using BM = Int<kBlockM>;
  using BN = Int<kBlockN>;

  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>, MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;
  // Warps stacked along M: each owns 16 rows of every 16 x kNumWarps row group.
  using TiledMma = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<Int<TileSize::kNumWarps>, _1, _1>>{},
                                           Tile<Int<16 * TileSize::kNumWarps>, _16, _16>{}));

  // 64-element (128-byte) rows swizzled so that ldmatrix and cp.async hit distinct banks.
  using SmemAtom = decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_8, _64>, Stride<_64, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<BM, D>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<BN, D>{}));
  // V read as (headdim, keys) for the B operand of O += P V: same bytes, transposed view.
  using SmemLayoutVt = decltype(composition(SmemLayoutKV{}, make_layout(Shape<D, BN>{}, GenRowMajor{})));

  // 16-byte cp.async per thread; a row of 64 elements takes 8 threads.
  using GmemCopy = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{},
                                            Layout<Shape<Int<kNumThreads / 8>, _8>, Stride<_8, _1>>{},
                                            Layout<Shape<_1, _8>>{}));
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;

  struct TensorStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 128> smem_q;  // O is staged here at the end
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 128> smem_k;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 128> smem_v;
  };

  // One (batch, head)'s Q, K, V or O as (seqlen, headdim).
  template <class T>
  CUTE_DEVICE static auto rows(T* ptr, int seqlen, int64_t row_stride) {
    return make_tensor(make_gmem_ptr(ptr), make_shape(seqlen, D{}), make_stride(row_stride, _1{}));
  }

  // Copy rows of a tile into shared memory with cp.async; rows at or past `valid_rows` are zeroed
  // instead (they would be padding of V, multiplied by P = 0: they must be finite).
  template <class TiledCopy, class Src, class Dst, class Coords>
  CUTE_DEVICE static void copy_rows(TiledCopy const& tiled_copy, Src const& src, Dst& dst, Coords const& coords,
                                    int valid_rows) {
    CUTE_UNROLL
    for (int m = 0; m < size<1>(dst); ++m) {
      if (get<0>(coords(0, m, 0)) < valid_rows) {
        copy(tiled_copy, src(_, m, _), dst(_, m, _));
      } else {
        clear(dst(_, m, _));
      }
    }
  }

  // Accumulates the unnormalized O of this CTA's rows into acc_o (zeroed here) and the softmax state;
  // returns false when no row sees a key (the caller writes O = 0, LSE = -inf).
  template <class FragO, class Softmax>
  CUTE_DEVICE static bool mma(TensorStorage& ts, Element const* q, int64_t q_row_stride, Element const* k,
                              int64_t k_row_stride, Element const* v, int64_t v_row_stride, int seqlen_q,
                              int seqlen_k, int m_block, FragO& acc_o, Softmax& softmax) {
    BlockInfo<kBlockM, kBlockN, kCausal> const info{seqlen_q, seqlen_k};
    int const n_block_max = info.n_block_max(m_block);
    int const n_block_min = info.n_block_min(m_block);
    if (n_block_max <= n_block_min) return false;
    int const tid = threadIdx.x;

    Tensor gQ = local_tile(rows(q, seqlen_q, q_row_stride), Shape<BM, D>{}, make_coord(m_block, 0));  // (BM, D)
    Tensor gK = local_tile(rows(k, seqlen_k, k_row_stride), Shape<BN, D>{}, make_coord(_, 0));  // (BN, D, n)
    Tensor gV = local_tile(rows(v, seqlen_k, v_row_stride), Shape<BN, D>{}, make_coord(_, 0));
    Tensor sQ = make_tensor(make_smem_ptr(ts.smem_q.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(ts.smem_k.data()), SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(ts.smem_v.data()), SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(ts.smem_v.data()), SmemLayoutVt{});

    GmemCopy gmem_copy;
    auto gthr = gmem_copy.get_thread_slice(tid);
    Tensor tQgQ = gthr.partition_S(gQ);
    Tensor tQsQ = gthr.partition_D(sQ);
    Tensor tKgK = gthr.partition_S(gK);  // (CPY, CPY_N, CPY_K, n)
    Tensor tKsK = gthr.partition_D(sK);
    Tensor tVgV = gthr.partition_S(gV);
    Tensor tVsV = gthr.partition_D(sV);
    Tensor tQcQ = gthr.partition_S(make_identity_tensor(Shape<BM, D>{}));
    Tensor tKcK = gthr.partition_S(make_identity_tensor(Shape<BN, D>{}));
    int const q_rows = seqlen_q - m_block * kBlockM;
    auto load_k = [&](int n) { copy_rows(gmem_copy, tKgK(_, _, _, n), tKsK, tKcK, seqlen_k - n * kBlockN); };
    auto load_v = [&](int n) { copy_rows(gmem_copy, tVgV(_, _, _, n), tVsV, tKcK, seqlen_k - n * kBlockN); };

    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(tid);
    Tensor tSrQ = thr_mma.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_K)
    Tensor tSrK = thr_mma.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K)
    Tensor tOrVt = thr_mma.partition_fragment_B(make_tensor(sV.data(), make_layout(Shape<D, BN>{})));
    auto s2r_q = make_tiled_copy_A(SmemCopyAtom{}, tiled_mma);
    auto s2r_k = make_tiled_copy_B(SmemCopyAtom{}, tiled_mma);
    auto s2r_v = make_tiled_copy_B(SmemCopyAtomT{}, tiled_mma);
    Tensor tSsQ = s2r_q.get_thread_slice(tid).partition_S(sQ);
    Tensor tSsK = s2r_k.get_thread_slice(tid).partition_S(sK);
    Tensor tOsVt = s2r_v.get_thread_slice(tid).partition_S(sVt);
    Tensor tSrQ_view = s2r_q.get_thread_slice(tid).retile_D(tSrQ);
    Tensor tSrK_view = s2r_k.get_thread_slice(tid).retile_D(tSrK);
    Tensor tOrVt_view = s2r_v.get_thread_slice(tid).retile_D(tOrVt);

    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<BM, BN>{});
    Tensor scores = rowcol(acc_s);
    Tensor tScS = rowcol(thr_mma.partition_C(make_identity_tensor(Shape<BM, BN>{})));
    Mask<kBlockN, kCausal> const mask{seqlen_q, seqlen_k};
    int const row_offset = m_block * kBlockM;
    int const n_causal = kCausal ? cute::max(info.n_block_causal_start(m_block), n_block_min) : n_block_max;

    // Prologue: Q and the last K block in flight together.
    int n_block = n_block_max - 1;
    copy_rows(gmem_copy, tQgQ, tQsQ, tQcQ, q_rows);
    load_k(n_block);
    cp_async_fence();
    clear(acc_o);

    // One loop body (a lambda per variant would take the fragments' addresses and put them on the
    // stack): the mask only where a block needs it, the softmax from a -inf / 0 start.
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(scores); ++mi) {
      softmax.row_max[mi] = -INFINITY;
      softmax.row_sum[mi] = 0.f;
    }
    for (; n_block >= n_block_min; --n_block) {
      clear(acc_s);
      cp_async_wait<0>();
      __syncthreads();  // K_n (and Q) landed; every warp is done with V_{n+1}
      load_v(n_block);
      cp_async_fence();
      CUTE_UNROLL
      for (int kk = 0; kk < size<2>(tSrQ); ++kk) {  // S = Q K_n^T
        copy(s2r_q, tSsQ(_, _, kk), tSrQ_view(_, _, kk));
        copy(s2r_k, tSsK(_, _, kk), tSrK_view(_, _, kk));
        gemm(tiled_mma, tSrQ(_, _, kk), tSrK(_, _, kk), acc_s);
      }
      // The highest block holds the sequence end; causal blocks from n_causal on hold the diagonal.
      if (n_block >= n_causal || n_block == n_block_max - 1) {
        mask.template apply<true, true>(scores, tScS, row_offset, n_block);
      }
      cp_async_wait<0>();
      __syncthreads();  // V_n landed; every warp is done with K_n
      if (n_block > n_block_min) {
        load_k(n_block - 1);
        cp_async_fence();
      }
      auto const o_scale = softmax.template update<false, true>(scores);
      Tensor o = rowcol(acc_o);
      Softmax::rescale(o, o_scale);
      Tensor p16 = convert_type<Element>(acc_s);
      Tensor tOrP = make_tensor(p16.data(), acc_layout_as_a_operand(p16.layout()));
      CUTE_UNROLL
      for (int kk = 0; kk < size<2>(tOrP); ++kk) {  // O += P V_n
        copy(s2r_v, tOsVt(_, _, kk), tOrVt_view(_, _, kk));
        gemm(tiled_mma, tOrP(_, _, kk), tOrVt(_, _, kk), acc_o);
      }
    }
    return true;
  }
};

}  // namespace flashhopper::sm80
