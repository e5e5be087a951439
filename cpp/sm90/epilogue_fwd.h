// Hopper forward epilogue, per consumer warpgroup: O (already normalized, fp32) is converted in
// registers, written with stmatrix into this warpgroup's 64-row slice of the Q stage it just used,
// and stored by one thread with a TMA store, which clips rows past the batch entry's end (Seqlens
// kTmaClipsRows: the tensors' batch mode, or a packed entry's own tensor map); the kernel releases that
// Q stage once TMA has read it. FP8 (kOwnBuffer): O is bfloat16, twice Q's bytes, so it has a buffer of
// its own, reused once the previous tile's store has been read. LSE goes straight to global memory from
// the threads that own column 0 of each row: (batch, head, rows), or for packed entries (head, total rows).
// (Storing O from registers instead measured 5-16% slower: docs/perf-notes.md.)
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include "../common/seqlen.h"
#include "../common/utils.h"
#include "named_barriers.h"

namespace flashhopper::sm90 {

using namespace cute;

// kHeadDim: O's (V's) head dim. SmemLayoutO: one warpgroup's (64, headdim) O; its slot for (warpgroup, stage)
// starts kSlotElems * (stage * kNumMmaWG + warpgroup) elements into the buffer: Q's stages (a slot per
// warpgroup's Q slice), or O's own buffer (kOwnBuffer, one stage).
template <class Element, int kHeadDim, int kNumMmaWG, class SmemLayoutO, int kSlotElems, class TiledMmaPV,
          bool kOwnBuffer, class Seqlens>
struct FwdEpilogue {
  static_assert(Seqlens::kTmaClipsRows, "entries sharing the row mode without tensor maps of their own need a "
                                        "row-predicated O store here");
  using D = Int<kHeadDim>;
  using ShapeO = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen_q, headdim, head, batch)
  using StrideO = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeO{}, StrideO{}));
  using TMA_O = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensor{}, SmemLayoutO{}, Shape<_64, D>{}, _1{}));

  struct Params {
    TMA_O tma_o;
    ShapeO shape_o;
    Element* o_ptr;  // for tiles with no visible key, which skip shared memory
    StrideO stride_o;
    float* lse_ptr;  // (batch, head, seqlen_q) contiguous; packed: (head, total rows)
    Seqlens seqlens;
    // Split-KV (Seqlens::kSplits, num_splits > 1): each split's normalized O and its LSE, float32
    // (num_splits, batch, head, seqlen_q, headdim) and (num_splits, batch, head, seqlen_q), for the combine kernel.
    float* o_partial = nullptr;
    float* lse_partial = nullptr;
    int num_splits = 1;
    int batch = 0;
  };

  // The entry's (rows, headdim) slice of O for this head.
  template <class Tensor4>
  CUTE_DEVICE static auto rows_of(Tensor4 const& m, SeqlenInfo const& seq, int head) {
    return entry_rows(m, seq.offset_q, head, seq.batch_coord);
  }

  static Params make_params(Element* o, ShapeO shape_o, StrideO stride_o, float* lse, Seqlens seqlens = {},
                            float* split_workspace = nullptr, int num_splits = 1) {
    auto mO = make_tensor(make_gmem_ptr(o), shape_o, stride_o);
    int64_t const rows = int64_t(num_splits) * get<3>(shape_o) * get<2>(shape_o) * get<0>(shape_o);
    return {make_tma_copy(SM90_TMA_STORE{}, mO, SmemLayoutO{}, Shape<_64, D>{}, _1{}), shape_o, o,
            stride_o, lse, seqlens, split_workspace,
            split_workspace != nullptr ? split_workspace + rows * kHeadDim : nullptr, num_splits, get<3>(shape_o)};
  }

  CUTE_DEVICE static bool split_store(Params const& p) {
    if constexpr (Seqlens::kSplits) return p.num_splits > 1;
    else return false;
  }
  // The partial rows of (split, entry, head): their first row in the split workspace.
  CUTE_DEVICE static int64_t partial_row0(Params const& p, int split, int batch, int head) {
    return ((int64_t(split) * p.batch + batch) * get<2>(p.shape_o) + head) * get<0>(p.shape_o);
  }

  // Split-KV: this warpgroup's rows of O (normalized within the split, fp32) and their LSE, straight from
  // registers (a split's partial is small: the combine kernel reads it once).
  template <class FragO, class LSE>
  CUTE_DEVICE static void store_partial(Params const& p, FragO const& tOrO, LSE const& lse, SeqlenInfo const& seq,
                                        int m_block, int head, int batch, int wg, int thread_idx, int split) {
    auto thr_mma = TiledMmaPV{}.get_thread_slice(thread_idx);
    Tensor tOcO = rowcol(thr_mma.partition_C(make_identity_tensor(Shape<_64, D>{})));
    Tensor o = rowcol(tOrO);
    int64_t const row0 = partial_row0(p, split, batch, head);
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(tOcO); ++mi) {
      int const row = (m_block * kNumMmaWG + wg) * 64 + int(get<0>(tOcO(mi, _0{})));
      if (row >= seq.seqlen_q) continue;
      float* dst = p.o_partial + (row0 + row) * kHeadDim;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(tOcO); ++ni) dst[get<1>(tOcO(mi, ni))] = o(mi, ni);
      if (get<1>(tOcO(mi, _0{})) == 0) p.lse_partial[row0 + row] = lse[mi];
    }
  }

  // The tile row (of seqlen_q) of this thread's accumulator row mi (rowcol view).
  CUTE_DEVICE static int row_of(int m_block, int wg, int thread_idx, int mi) {
    auto thr_mma = TiledMmaPV{}.get_thread_slice(thread_idx);
    Tensor tOcO = rowcol(thr_mma.partition_C(make_identity_tensor(Shape<_64, D>{})));
    return (m_block * kNumMmaWG + wg) * 64 + int(get<0>(tOcO(mi, _0{})));
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.tma_o.get_tma_descriptor());
  }

  // Whether warpgroup wg's 64 rows of query block m_block lie inside the entry (its O store then goes through
  // the params' map: common/seqlen.h, block_tma_desc).
  CUTE_DEVICE static bool rows_inside(SeqlenInfo const& seq, int m_block, int wg) {
    return (m_block * kNumMmaWG + wg + 1) * 64 <= seq.seqlen_q;
  }

  // At the start of a tile whose O store needs the entry's tensor map (packed batches, rows reaching past the
  // entry's end), the thread that will store O orders the prepare kernel's write of that map before its TMA store
  // (fence.proxy.tensormap acquire), once per entry it meets (`acquired`). Here the fence overlaps the wait for the
  // first K block; right before the store it cost 5-10% on short sequences (docs/perf-notes.md).
  CUTE_DEVICE static void begin_tile(Params const& p, SeqlenInfo const& seq, int m_block, int wg, int batch,
                                     int thread_idx, int& acquired) {
    if (thread_idx == 0) acquire_entry_maps(p.seqlens, batch, !rows_inside(seq, m_block, wg), acquired, kVarlenO);
  }

  // Where the LSE of (entry, head) starts: its batch coordinate's rows of the head, then the entry's offset.
  CUTE_DEVICE static int64_t lse_offset(Params const& p, SeqlenInfo const& seq, int head) {
    return (int64_t(seq.batch_coord) * get<2>(p.shape_o) + head) * get<0>(p.shape_o) + seq.offset_q;
  }

  template <class FragO, class LSE>
  CUTE_DEVICE static void store(Params const& p, FragO const& tOrO, LSE const& lse, Element* smem_o, int stage,
                                SeqlenInfo const& seq, int m_block, int head, int batch, int wg, int thread_idx,
                                int split = 0) {
    if (split_store(p)) {
      store_partial(p, tOrO, lse, seq, m_block, head, batch, wg, thread_idx, split);
      return;
    }
    Tensor sO = make_tensor(make_smem_ptr(smem_o + kSlotElems * (stage * kNumMmaWG + wg)), SmemLayoutO{});  // (64, D)
    Tensor tOrO_out = convert_type<Element>(tOrO);
    if constexpr (kOwnBuffer) {
      // The previous tile's store must have read the buffer (issued a whole tile ago: no wait in practice).
      if (thread_idx == 0) tma_store_wait<0>();
      epilogue_barrier_sync(wg);
    }

    auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, TiledMmaPV{});
    auto thr_copy = smem_copy.get_thread_slice(thread_idx);
    Tensor tRrO = thr_copy.retile_S(tOrO_out);
    Tensor tRsO = thr_copy.partition_D(sO);  // (CPY, CPY_M, CPY_N)
    copy(smem_copy, tRrO, tRsO);
    cutlass::arch::fence_view_async_shared();  // make the generic-proxy writes visible to TMA
    epilogue_barrier_sync(wg);
    if (thread_idx == 0) {
      Tensor mO = rows_of(p.tma_o.get_tma_tensor(p.shape_o), seq, head);
      Tensor gO = local_tile(mO, Shape<_64, D>{}, make_coord(_, _0{}));  // (64, D, m64)
      auto parts = tma_partition(p.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO), group_modes<0, 2>(gO));
      copy(p.tma_o.with(block_tma_desc(p.seqlens, p.tma_o, kVarlenO, batch, rows_inside(seq, m_block, wg))),
           get<1>(parts), get<0>(parts)(_, m_block * kNumMmaWG + wg));
      tma_store_arrive();
    }
    store_lse(p, lse, seq, m_block, head, batch, wg, thread_idx);
  }

  template <class LSE>
  CUTE_DEVICE static void store_lse(Params const& p, LSE const& lse, SeqlenInfo const& seq, int m_block, int head,
                                    int batch, int wg, int thread_idx) {
    auto thr_mma = TiledMmaPV{}.get_thread_slice(thread_idx);
    Tensor tOcO = rowcol(thr_mma.partition_C(make_identity_tensor(Shape<_64, D>{})));
    if (get<1>(tOcO(_0{}, _0{})) != 0) return;  // one thread of each quad owns the row
    int const seqlen_q = seq.seqlen_q;
    float* lse_bh = p.lse_ptr + lse_offset(p, seq, head);
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(tOcO); ++mi) {
      int const row = (m_block * kNumMmaWG + wg) * 64 + int(get<0>(tOcO(mi, _0{})));
      if (row < seqlen_q) lse_bh[row] = lse[mi];
    }
  }

  // A tile whose rows see no key (causal with seqlen_q > seqlen_k): O = 0, LSE = empty_lse(row) (-inf, or the
  // row's sink logit), written directly (16-byte stores) so that it never touches shared memory the
  // producer may be filling.
  template <class EmptyLse>
  CUTE_DEVICE static void store_empty(Params const& p, SeqlenInfo const& seq, int m_block, int head, int batch,
                                      int wg, int thread_idx, EmptyLse const& empty_lse, int split = 0) {
    if (split_store(p)) {  // the combine kernel skips a split whose LSE is -inf (its O is never read)
      int64_t const row0 = partial_row0(p, split, batch, head) + (m_block * kNumMmaWG + wg) * 64;
      for (int r = thread_idx; r < 64; r += cutlass::NumThreadsPerWarpGroup) {
        if ((m_block * kNumMmaWG + wg) * 64 + r < seq.seqlen_q) p.lse_partial[row0 + r] = -INFINITY;
      }
      return;
    }
    constexpr int kVec = 16 / sizeof(Element);
    constexpr int kVecsPerRow = kHeadDim / kVec;
    int const seqlen_q = seq.seqlen_q;
    int const row0 = (m_block * kNumMmaWG + wg) * 64;
    Element* o_bh = p.o_ptr + int64_t(seq.batch_coord) * get<3>(p.stride_o) + int64_t(head) * get<2>(p.stride_o) +
                    int64_t(seq.offset_q) * get<0>(p.stride_o);
    for (int i = thread_idx; i < 64 * kVecsPerRow; i += cutlass::NumThreadsPerWarpGroup) {
      int const row = row0 + i / kVecsPerRow;
      if (row < seqlen_q) {
        *reinterpret_cast<uint4*>(o_bh + int64_t(row) * get<0>(p.stride_o) + (i % kVecsPerRow) * kVec) =
            make_uint4(0, 0, 0, 0);
      }
    }
    float* lse_bh = p.lse_ptr + lse_offset(p, seq, head);
    for (int r = thread_idx; r < 64; r += cutlass::NumThreadsPerWarpGroup) {
      if (row0 + r < seqlen_q) lse_bh[row0 + r] = empty_lse(row0 + r);
    }
  }
};

}  // namespace flashhopper::sm90
