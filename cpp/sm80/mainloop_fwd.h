// Ampere forward mainloop (FlashAttention-2's schedule): one CTA owns kBlockM query rows, its four
// warps split them (16 rows per MMA atom), and it walks the key blocks from the last to the first.
// Q, K and V come in with cp.async into one swizzled shared-memory tile each and reach the
// tensor cores through ldmatrix (V transposed on the way, as the B operand of O += P V);
// mma.sync m16n8k16 with float accumulators. The next block's K loads while P V runs, and V while
// S = Q K^T runs. The online softmax, the mask policy (kMask), the block ranges and the score mod are
// the ones the sm90 path uses (common/).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/detail/helper_macros.hpp>
#include <cutlass/fast_math.h>

#include "../common/block_info.h"
#include "../common/mask.h"
#include "../common/dropout.h"
#include "../common/score_mod.h"
#include "../common/seqlen.h"
#include "../common/softmax.h"
#include "../common/utils.h"
#include "gemm.h"

namespace flashhopper::sm80 {

using namespace cute;

// KV caches (kPaged): key j of the entry lives in page page_table[j / page_size], row j % page_size of the cache
// (a contiguous cache: one page of max_seqlen rows per entry; page_table nullptr: page `batch`). Each thread's
// rows of a K/V block are copied from their own pages (cp.async, rows past the entry's keys zeroed, so whatever
// the cache holds there never reaches the output); the entry's key blocks may be split over CTAs (split-KV).
struct PagedRows {
  int const* page_table = nullptr;  // this entry's row of the table, or nullptr
  cutlass::FastDivmod page_size{1};
  int64_t page_stride_k = 0, page_stride_v = 0;
  int batch = 0;
  int split = 0, num_splits = 1;
};

template <class Element_, int kHeadDim_, class TileSize, MaskKind kMask_, class ScoreMod_ = ScoreModIdentity,
          class Dropout_ = DropoutNone, bool kPaged_ = false>
struct FwdMainloop {
  using Element = Element_;
  using ScoreMod = ScoreMod_;
  using Dropout = Dropout_;  // common/dropout.h: P's dropped scores zeroed before the PV GEMM
  static constexpr int kHeadDim = kHeadDim_, kBlockM = TileSize::kBlockM, kBlockN = TileSize::kBlockN;
  static constexpr MaskKind kMask = kMask_;
  static constexpr bool kPaged = kPaged_;  // KV caches: paged rows and split-KV (PagedRows)
  using BlockInfoT = std::conditional_t<kPaged, SplitBlockInfo<BlockInfo<kBlockM, kBlockN, kMask, true>>,
                                        BlockInfo<kBlockM, kBlockN, kMask>>;  // KV caches: packed query rows too
  static constexpr int kNumThreads = TileSize::kNumWarps * 32;
  // The head dim in whole swizzle atoms (SmemAtom: 64 or 32 columns).
  static_assert(kHeadDim % 32 == 0 && kBlockM % (16 * TileSize::kNumWarps) == 0);

  using D = Int<kHeadDim>;
  using BM = Int<kBlockM>;
  using BN = Int<kBlockN>;

  // Warps stacked along M: each owns 16 rows of every 16 x kNumWarps row group.
  using TiledMma = sm80::TiledMma<Element, TileSize::kNumWarps, 1>;
  using SmemLayoutQ = SmemLayout<kBlockM, kHeadDim>;
  using SmemLayoutKV = SmemLayout<kBlockN, kHeadDim>;
  using GmemCopy = sm80::GmemCopy<Element, kNumThreads, kHeadDim>;

  struct TensorStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 128> smem_q;  // O is staged here at the end
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 128> smem_k;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 128> smem_v;
  };

  template <class T>
  CUTE_DEVICE static auto rows(T* ptr, int seqlen, int64_t row_stride) {
    return gmem_rows<kHeadDim>(ptr, seqlen, row_stride);
  }

  // Accumulates the unnormalized O of this CTA's rows into acc_o (zeroed here) and the softmax state;
  // returns false when no row sees a key (the caller writes O = 0, LSE = -inf or the sink).
  // q, k, v: the batch entry's first row of this head (seq: its bounds); bh: batch * nheads + head (dropout).
  template <class FragO, class Softmax>
  CUTE_DEVICE static bool mma(TensorStorage& ts, Element const* q, int64_t q_row_stride, Element const* k,
                              int64_t k_row_stride, Element const* v, int64_t v_row_stride, SeqlenInfo const& seq,
                              int window_left, int window_right, ScoreMod const& score_mod, Dropout const& dropout,
                              int bh, int m_block, FragO& acc_o, Softmax& softmax, PagedRows const& paged = {}) {
    BlockInfoT const info = [&] {
      if constexpr (kPaged) return BlockInfoT{seq, window_left, window_right, m_block, paged.split, paged.num_splits};
      else return BlockInfoT{seq, window_left, window_right};
    }();
    int const n_block_max = info.n_block_max(m_block);
    int const n_block_min = info.n_block_min(m_block);
    if (n_block_max <= n_block_min) return false;
    int const tid = threadIdx.x;
    int const seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;

    Tensor gQ = local_tile(rows(q, seqlen_q, q_row_stride), Shape<BM, D>{}, make_coord(m_block, 0));  // (BM, D)
    Tensor sQ = make_tensor(make_smem_ptr(ts.smem_q.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(ts.smem_k.data()), SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(ts.smem_v.data()), SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(ts.smem_v.data()), transposed(SmemLayoutKV{}));  // (D, BN)

    GmemCopy gmem_copy;
    auto gthr = gmem_copy.get_thread_slice(tid);
    Tensor tQgQ = gthr.partition_S(gQ);
    Tensor tQsQ = gthr.partition_D(sQ);
    Tensor tKsK = gthr.partition_D(sK);  // (CPY, CPY_N, CPY_K)
    Tensor tVsV = gthr.partition_D(sV);
    Tensor tQcQ = gthr.partition_S(make_identity_tensor(Shape<BM, D>{}));
    Tensor tKcK = gthr.partition_S(make_identity_tensor(Shape<BN, D>{}));
    int const q_rows = seqlen_q - m_block * kBlockM;
    // Only the highest key block can hold the sequence end (check_end); the others load without row checks.
    auto load_kv = [&](Element const* ptr, int64_t row_stride, int64_t page_stride, auto& dst, int n, auto check_end) {
      if constexpr (kPaged) {
        // Each of this thread's rows from its page: the block tile re-based so that the row lands where the
        // partition puts it (only that row of it is read).
        CUTE_UNROLL
        for (int m = 0; m < size<1>(dst); ++m) {
          int const r = int(get<0>(tKcK(0, m, 0)));
          int const key = n * kBlockN + r;
          if (key < seqlen_k) {
            int idx, row;
            paged.page_size(idx, row, key);
            int64_t const page = paged.page_table != nullptr ? paged.page_table[idx] : paged.batch;
            Element const* row_ptr = ptr + page * page_stride + (int64_t(row) - r) * row_stride;
            Tensor src = gthr.partition_S(block_rows<kBlockN, kHeadDim>(row_ptr, row_stride, 0));
            copy(gmem_copy, src(_, m, _), dst(_, m, _));
          } else {
            clear(dst(_, m, _));
          }
        }
      } else {
        Tensor src = gthr.partition_S(block_rows<kBlockN, kHeadDim>(ptr, row_stride, n));
        int const valid = seqlen_k - n * kBlockN;
        if (decltype(check_end)::value && valid < kBlockN) {
          copy_rows(gmem_copy, src, dst, tKcK, valid);
        } else {
          copy(gmem_copy, src, dst);
        }
      }
    };
    auto load_k = [&](int n, auto check_end) { load_kv(k, k_row_stride, paged.page_stride_k, tKsK, n, check_end); };
    auto load_v = [&](int n, auto check_end) { load_kv(v, v_row_stride, paged.page_stride_v, tVsV, n, check_end); };

    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(tid);
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<BM, BN>{});
    Tensor scores = rowcol(acc_s);
    Tensor tScS = rowcol(thr_mma.partition_C(make_identity_tensor(Shape<BM, BN>{})));
    Mask<kBlockN, kMask, kPaged> const mask{seq, window_left, window_right};
    int const row_offset = m_block * kBlockM;
    auto const drop = [&] {
      if constexpr (Dropout::kEnabled) return dropout.stream(bh);
      else return 0;
    }();

    // Prologue: Q and the last K block in flight together.
    int n_block = n_block_max - 1;
    copy_rows(gmem_copy, tQgQ, tQsQ, tQcQ, q_rows);
    load_k(n_block, cute::true_type{});
    cp_async_fence();
    clear(acc_o);

    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(scores); ++mi) {
      softmax.row_max[mi] = -INFINITY;
      softmax.row_sum[mi] = 0.f;
    }
    // One iteration; kTop: the block holds the sequence end or a key past some row's right edge (the
    // top of the range; it applies every edge), kBottom: a key before some row's left edge; in both a
    // row may have seen no visible key yet.
    // Forced inline, as the sm90 mainloop's step (a called instance put the fragments on the stack).
    auto step = [&](auto top, auto bottom) CUTLASS_LAMBDA_FUNC_INLINE {
      constexpr bool kTop = decltype(top)::value, kBottom = decltype(bottom)::value;
      constexpr bool kMasked = kTop || kBottom;
      clear(acc_s);
      cp_async_wait<0>();
      __syncthreads();  // K_n (and Q) landed; every warp is done with V_{n+1}
      load_v(n_block, top);  // the other blocks are all below the highest
      cp_async_fence();
      gemm_ss<LdsmN, LdsmN>(tiled_mma, acc_s, sQ, sK);  // S = Q K_n^T
      score_mod.apply(scores);
      if constexpr (kMasked) mask.template apply<kTop, kTop, true>(scores, tScS, row_offset, n_block);
      cp_async_wait<0>();
      __syncthreads();  // V_n landed; every warp is done with K_n
      if (n_block > n_block_min) {
        load_k(n_block - 1, cute::false_type{});
        cp_async_fence();
      }
      auto const o_scale = softmax.template update<false, kMasked>(scores);
      Tensor o = rowcol(acc_o);
      Softmax::rescale(o, o_scale);
      Tensor p16 = convert_type<Element>(acc_s);
      if constexpr (Dropout::kEnabled) {  // the softmax's sums saw every score
        Dropout::template apply<true>(drop, rowcol(p16), tScS, row_offset, n_block * kBlockN);
      }
      Tensor tOrP = make_tensor(p16.data(), acc_layout_as_a_operand(p16.layout()));
      gemm_rs<LdsmT>(tiled_mma, acc_o, tOrP, sVt);  // O += P V_n
    };
    // The highest block holds the sequence end; from n_right on, blocks cross a row's right edge;
    // below n_left, a row's left edge (block_info.h).
    int const n_right = BlockInfoT::kHasRight ? cute::max(info.n_block_right_masked_begin(m_block), n_block_min)
                                              : n_block_max;
    int const n_top_end = cute::min(n_right, n_block_max - 1);
    int const n_left =
        BlockInfoT::kHasLeft ? cute::min(cute::max(info.n_block_left_masked_end(m_block), n_block_min), n_top_end)
                             : n_block_min;
    for (; n_block >= n_top_end; --n_block) step(cute::true_type{}, cute::false_type{});
    for (; n_block >= n_left; --n_block) step(cute::false_type{}, cute::false_type{});
    if constexpr (BlockInfoT::kHasLeft) {
      for (; n_block >= n_block_min; --n_block) step(cute::false_type{}, cute::true_type{});
    }
    return true;
  }
};

}  // namespace flashhopper::sm80
