// Hopper backward epilogue: dK (already scaled) and dV of one key block leave the registers.
//  - one query head per kv head: converted, staged in the K and V buffers (both consumer
//    warpgroups are done with them), and written by one thread with TMA stores (rows past the batch
//    entry's keys are clipped by TMA: Seqlens kTmaClipsRows);
//  - GQA: every query head of the group adds its share into float32 accumulators with atomics
//    (deterministic mode: in query-head order), converted by the postprocess kernel.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <type_traits>

#include "../common/utils.h"
#include "../common/workspace_bwd.h"
#include "global_reduce.h"
#include "mainloop_bwd.h"
#include "named_barriers.h"

namespace flashhopper::sm90 {

using namespace cute;

template <class Mainloop>
struct BwdEpilogue {
  static_assert(Mainloop::Seqlens::kTmaClipsRows, "entries sharing the row mode need a row-predicated dK/dV store");
  using Element = typename Mainloop::Element;
  static constexpr int kHeadDim = Mainloop::kHeadDim, kHeadDimV = Mainloop::kHeadDimV, kBlockN = Mainloop::kBlockN;
  static constexpr bool kdKVSwapAB = Mainloop::kdKVSwapAB;
  using D = Int<kHeadDim>;
  using DV = Int<kHeadDimV>;
  using BN = Int<kBlockN>;
  using SmemLayoutK = typename Mainloop::SmemLayoutK;
  using SmemLayoutV = typename Mainloop::SmemLayoutV;
  using ShapeQKV = typename Mainloop::ShapeQKV;
  using StrideQKV = typename Mainloop::StrideQKV;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeQKV{}, StrideQKV{}));
  using TMA_dK = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensor{}, SmemLayoutK{}, Shape<BN, D>{}, _1{}));
  using TMA_dV = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensor{}, SmemLayoutV{}, Shape<BN, DV>{}, _1{}));

  using Seqlens = typename Mainloop::Seqlens;
  struct Params {
    TMA_dK tma_dk;  // over dk/dv as (rows, headdim[_v], nheads_kv, batch coordinates); used without GQA
    TMA_dV tma_dv;
    ShapeQKV shape_dkv;
    float* dk_accum;  // GQA: (batch coordinates, nheads_kv, rows, headdim) float32, zeroed
    float* dv_accum;
    int* dkv_semaphore;  // GQA + deterministic: (batch coordinates, nheads_kv, n_blocks_k) zeroed; else nullptr
    int heads_ratio, nheads_kv, rows_k, n_blocks_k;
    Seqlens seqlens;
  };

  // rows_k: of dK/dV's rows (seqlen_k, or total_k packed); n_blocks_k: key blocks per (batch coordinate,
  // kv head) of the counters (common/workspace_bwd.h).
  static Params make_params(Element* dk, StrideQKV stride_dk, Element* dv, StrideQKV stride_dv, ShapeQKV shape_dkv,
                            float* dk_accum, float* dv_accum, int* dkv_semaphore, int heads_ratio, int nheads_kv,
                            int n_blocks_k, Seqlens seqlens) {
    auto mdK = make_tensor(make_gmem_ptr(dk), shape_dkv, stride_dk);
    auto mdV = make_tensor(make_gmem_ptr(dv), Mainloop::shape_v_of(shape_dkv), stride_dv);
    return {make_tma_copy(SM90_TMA_STORE{}, mdK, SmemLayoutK{}, Shape<BN, D>{}, _1{}),
            make_tma_copy(SM90_TMA_STORE{}, mdV, SmemLayoutV{}, Shape<BN, DV>{}, _1{}),
            shape_dkv,
            dk_accum,
            dv_accum,
            dkv_semaphore,
            heads_ratio,
            nheads_kv,
            get<0>(shape_dkv),
            n_blocks_k,
            seqlens};
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.tma_dk.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_dv.get_tma_descriptor());
  }

  using Accumulators = typename Mainloop::Accumulators;
  static constexpr bool kdKVMirror = Mainloop::kdKVMirror;

  template <class TensorStorage>
  CUTE_DEVICE static void store(Params const& p, Accumulators const& acc, TensorStorage& ts, int thread_idx,
                                SeqlenInfo const& seq, int n_block, int head, int batch) {
    if (p.heads_ratio == 1) {
      store_tma(p, acc, ts, thread_idx, seq, n_block, head, batch);
    } else {
      store_atomic(p, acc, thread_idx, seq, n_block, head, batch);
    }
  }

  // One accumulator (dK or dV) into its staging buffer (K's or V's), through stmatrix; dK^T / dV^T
  // accumulators go through the transposed view with its transposing form.
  template <class TiledMma, class SmemLayout, class Frag>
  CUTE_DEVICE static void stage(Frag const& acc, typename Mainloop::Element* smem, int thread_idx) {
    Tensor r = convert_type<Element>(acc);
    using StoreAtom = std::conditional_t<kdKVSwapAB, SM90_U16x8_STSM_T, SM90_U32x4_STSM_N>;
    auto smem_copy = make_tiled_copy_C(Copy_Atom<StoreAtom, Element>{}, TiledMma{});
    auto thr_copy = smem_copy.get_thread_slice(thread_idx);
    Tensor s = [&] {  // the buffer in the accumulator's (row, col) order
      if constexpr (kdKVSwapAB) {
        return make_tensor(make_smem_ptr(smem), composition(SmemLayout{}, make_ordered_layout(
                                                                             Shape<decltype(size<1>(SmemLayout{})), BN>{},
                                                                             Step<_2, _1>{})));
      } else {
        return make_tensor(make_smem_ptr(smem), SmemLayout{});
      }
    }();
    copy(smem_copy, thr_copy.retile_S(r), thr_copy.partition_D(s));
  }

  // kdKVMirror: one slot (64 head-dim rows of dK^T or dV^T, all keys) into rows 64 atom.. of its buffer.
  template <class SmemLayout, class Frag>
  CUTE_DEVICE static void stage_slot(Frag const& acc, typename Mainloop::Element* smem, int atom, int wg_thread) {
    Tensor r = convert_type<Element>(acc);
    auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, Element>{}, typename Mainloop::TiledMmadKVSlot{});
    auto thr_copy = smem_copy.get_thread_slice(wg_thread);
    Tensor s = make_tensor(make_smem_ptr(smem), composition(SmemLayout{}, make_ordered_layout(
                                                                              Shape<decltype(size<1>(SmemLayout{})), BN>{},
                                                                              Step<_2, _1>{})));
    copy(smem_copy, thr_copy.retile_S(r),
         thr_copy.partition_D(local_tile(s, typename Mainloop::ShapedKVSlot{}, make_coord(atom, _0{}))));
  }

  template <class TensorStorage>
  CUTE_DEVICE static void store_tma(Params const& p, Accumulators const& acc, TensorStorage& ts, int thread_idx,
                                    SeqlenInfo const& seq, int n_block, int head, int batch) {
    // Both warpgroups' last GEMMs (which read K and V) have completed before anyone overwrites them.
    cutlass::arch::NamedBarrier::sync(Mainloop::kNumMmaThreads, kBwdEpilogue);
    if constexpr (kdKVMirror) {
      int const wg = thread_idx / cutlass::NumThreadsPerWarpGroup;
      CUTE_UNROLL
      for (int s = 0; s < Mainloop::kdKVSlots; ++s) {
        auto const slot = Mainloop::dkv_slot(wg, s);
        if (!slot.live) continue;
        int const t = thread_idx % cutlass::NumThreadsPerWarpGroup;
        auto* const smem = slot.is_v ? ts.smem_v.data() : ts.smem_k.data();
        if constexpr (std::is_same_v<SmemLayoutK, SmemLayoutV>) {  // one instance for both buffers
          stage_slot<SmemLayoutK>(acc.slot[s], smem, slot.atom, t);
        } else if (slot.is_v) {
          stage_slot<SmemLayoutV>(acc.slot[s], smem, slot.atom, t);
        } else {
          stage_slot<SmemLayoutK>(acc.slot[s], smem, slot.atom, t);
        }
      }
    } else {
      stage<typename Mainloop::TiledMmadK, SmemLayoutK>(acc.dk, ts.smem_k.data(), thread_idx);
      stage<typename Mainloop::TiledMmadV, SmemLayoutV>(acc.dv, ts.smem_v.data(), thread_idx);
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by TMA
    cutlass::arch::NamedBarrier::sync(Mainloop::kNumMmaThreads, kBwdEpilogue);
    if (thread_idx == 0) {
      Tensor sdK1 = make_tensor(make_smem_ptr(ts.smem_k.data()), typename Mainloop::SmemLayoutKStaged{});
      Tensor sdV1 = make_tensor(make_smem_ptr(ts.smem_v.data()), typename Mainloop::SmemLayoutVStaged{});
      auto rows = [&](auto const& tma, auto const& shape, auto dim) {
        return local_tile(entry_rows(tma.get_tma_tensor(shape), seq.offset_k, head, seq.batch_coord),
                          Shape<BN, decltype(dim)>{}, make_coord(_, _0{}));
      };
      Tensor gdK = rows(p.tma_dk, p.shape_dkv, D{});
      Tensor gdV = rows(p.tma_dv, Mainloop::shape_v_of(p.shape_dkv), DV{});
      auto k_parts = tma_partition(p.tma_dk, _0{}, Layout<_1>{}, group_modes<0, 2>(sdK1), group_modes<0, 2>(gdK));
      auto v_parts = tma_partition(p.tma_dv, _0{}, Layout<_1>{}, group_modes<0, 2>(sdV1), group_modes<0, 2>(gdV));
      // A packed batch's block that reaches past the entry's keys goes through its own maps: those rows are dropped,
      // not written (common/seqlen.h, block_tma_desc).
      bool const inside = (n_block + 1) * kBlockN <= seq.seqlen_k;
      int acquired = -1;
      acquire_entry_maps(p.seqlens, batch, !inside, acquired, kVarlendK, kVarlendV);
      copy(p.tma_dk.with(block_tma_desc(p.seqlens, p.tma_dk, kVarlendK, batch, inside)), get<1>(k_parts)(_, 0),
           get<0>(k_parts)(_, n_block));
      copy(p.tma_dv.with(block_tma_desc(p.seqlens, p.tma_dv, kVarlendV, batch, inside)), get<1>(v_parts)(_, 0),
           get<0>(v_parts)(_, n_block));
      tma_store_arrive();
      tma_store_wait<0>();  // shared memory must outlive the reads
    }
  }

  // One accumulator's share added into its float32 sums (kDim columns per key).
  template <class TiledMma, int kDim, class Frag>
  CUTE_DEVICE static void add_rows(Frag const& acc, float* dst, int keys, int thread_idx) {
    Tensor c = TiledMma{}.get_thread_slice(thread_idx).partition_C(
        make_identity_tensor(typename Mainloop::template ShapedKVOf<Int<kDim>>{}));
    if constexpr (!kdKVSwapAB) {  // rows are keys: 16-byte reductions along the head dim
      red_add_rows_v4(acc, c, keys, [&](int key, int col) { return dst + key * kDim + col; });
    } else {  // dK^T: adjacent accumulator columns are keys, not contiguous in memory
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) {
        int const key = int(get<1>(c(i))), col = int(get<0>(c(i)));
        if (key < keys) red_add(dst + key * kDim + col, acc(i));
      }
    }
  }

  CUTE_DEVICE static void store_atomic(Params const& p, Accumulators const& acc, int thread_idx, SeqlenInfo const& seq,
                                       int n_block, int head, int batch) {
    int const kv_head = head / p.heads_ratio;
    int const wg = thread_idx / cutlass::NumThreadsPerWarpGroup;
    int64_t const bh_rows = (int64_t(seq.batch_coord) * p.nheads_kv + kv_head) * int64_t(p.rows_k) + seq.offset_k;
    float* dk_bh = p.dk_accum + bh_rows * kHeadDim;
    float* dv_bh = p.dv_accum + bh_rows * kHeadDimV;
    int* sem = p.dkv_semaphore == nullptr
                   ? nullptr
                   : p.dkv_semaphore + scratch_block0_k<kBlockN>(p.seqlens, seq, batch, kv_head, p.nheads_kv,
                                                                 p.n_blocks_k) + n_block;
    int const barrier = kBwdAtomicWG0 + wg;
    // Deterministic: the group's query heads add in order; the two warpgroups own disjoint
    // elements, so each waits for both halves of the previous head only.
    if (sem != nullptr) {
      if (thread_idx % cutlass::NumThreadsPerWarpGroup == 0) wait_at_least(sem, 2 * (head % p.heads_ratio));
      cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, barrier);
    }
    int const keys = seq.seqlen_k - n_block * kBlockN;  // valid rows of this key block
    if constexpr (kdKVMirror) {
      // A slot's rows are head-dim columns 64 atom.. of dK or dV.
      Tensor c = typename Mainloop::TiledMmadKVSlot{}
                     .get_thread_slice(thread_idx % cutlass::NumThreadsPerWarpGroup)
                     .partition_C(make_identity_tensor(typename Mainloop::ShapedKVSlot{}));
      CUTE_UNROLL
      for (int s = 0; s < Mainloop::kdKVSlots; ++s) {
        auto const slot = Mainloop::dkv_slot(wg, s);
        if (!slot.live) continue;
        int const dim = slot.is_v ? kHeadDimV : kHeadDim;
        float* const dst = (slot.is_v ? dv_bh : dk_bh) + int64_t(n_block) * kBlockN * dim + 64 * slot.atom;
        CUTE_UNROLL
        for (int i = 0; i < size(acc.slot[s]); ++i) {
          int const key = int(get<1>(c(i))), col = int(get<0>(c(i)));
          if (key < keys) red_add(dst + key * dim + col, acc.slot[s](i));
        }
      }
    } else {
      add_rows<typename Mainloop::TiledMmadK, kHeadDim>(acc.dk, dk_bh + int64_t(n_block) * kBlockN * kHeadDim, keys,
                                                        thread_idx);
      add_rows<typename Mainloop::TiledMmadV, kHeadDimV>(acc.dv, dv_bh + int64_t(n_block) * kBlockN * kHeadDimV, keys,
                                                         thread_idx);
    }
    if (sem != nullptr) {
      __threadfence();
      cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, barrier);
      if (thread_idx % cutlass::NumThreadsPerWarpGroup == 0) signal(sem);
    }
  }
};

}  // namespace flashhopper::sm90
