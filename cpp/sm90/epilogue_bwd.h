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

#include "../common/utils.h"
#include "global_reduce.h"
#include "mainloop_bwd.h"
#include "named_barriers.h"

namespace flashhopper::sm90 {

using namespace cute;

template <class Mainloop>
struct BwdEpilogue {
  static_assert(Mainloop::Seqlens::kTmaClipsRows, "entries sharing the row mode need a row-predicated dK/dV store");
  using Element = typename Mainloop::Element;
  static constexpr int kHeadDim = Mainloop::kHeadDim, kBlockN = Mainloop::kBlockN;
  static constexpr bool kdKVSwapAB = Mainloop::kdKVSwapAB;
  using D = Int<kHeadDim>;
  using BN = Int<kBlockN>;
  using TiledMmadKV = typename Mainloop::TiledMmadKV;
  using ShapedKV = typename Mainloop::ShapedKV;
  using SmemLayoutK = typename Mainloop::SmemLayoutK;
  using SmemLayoutKt = typename Mainloop::SmemLayoutKt;
  using ShapeQKV = typename Mainloop::ShapeQKV;
  using StrideQKV = typename Mainloop::StrideQKV;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeQKV{}, StrideQKV{}));
  using TMA_dKV = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensor{}, SmemLayoutK{}, Shape<BN, D>{}, _1{}));

  struct Params {
    TMA_dKV tma_dk, tma_dv;  // over dk/dv as (seqlen_k, headdim, nheads_q, batch); used without GQA
    ShapeQKV shape_dkv;
    float* dk_accum;  // GQA: (batch, nheads_kv, seqlen_k, headdim) float32, zeroed
    float* dv_accum;
    int* dkv_semaphore;  // GQA + deterministic: (batch, nheads_kv, n_blocks) zeroed; else nullptr
    int heads_ratio, nheads_kv, seqlen_k;
  };

  static Params make_params(Element* dk, StrideQKV stride_dk, Element* dv, StrideQKV stride_dv, ShapeQKV shape_dkv,
                            float* dk_accum, float* dv_accum, int* dkv_semaphore, int heads_ratio, int nheads_kv) {
    auto mdK = make_tensor(make_gmem_ptr(dk), shape_dkv, stride_dk);
    auto mdV = make_tensor(make_gmem_ptr(dv), shape_dkv, stride_dv);
    return {make_tma_copy(SM90_TMA_STORE{}, mdK, SmemLayoutK{}, Shape<BN, D>{}, _1{}),
            make_tma_copy(SM90_TMA_STORE{}, mdV, SmemLayoutK{}, Shape<BN, D>{}, _1{}),
            shape_dkv,
            dk_accum,
            dv_accum,
            dkv_semaphore,
            heads_ratio,
            nheads_kv,
            get<0>(shape_dkv)};
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.tma_dk.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_dv.get_tma_descriptor());
  }

  template <class FragdKV, class TensorStorage>
  CUTE_DEVICE static void store(Params const& p, FragdKV const& tdKrdK, FragdKV const& tdVrdV, TensorStorage& ts,
                                int thread_idx, SeqlenInfo const& seq, int n_block, int head, int batch) {
    if (p.heads_ratio == 1) {
      store_tma(p, tdKrdK, tdVrdV, ts, thread_idx, seq, n_block, head);
    } else {
      store_atomic(p, tdKrdK, tdVrdV, thread_idx, seq, n_block, head, batch);
    }
  }

  template <class FragdKV, class TensorStorage>
  CUTE_DEVICE static void store_tma(Params const& p, FragdKV const& tdKrdK, FragdKV const& tdVrdV, TensorStorage& ts,
                                    int thread_idx, SeqlenInfo const& seq, int n_block, int head) {
    Tensor sdK = make_tensor(make_smem_ptr(ts.smem_k.data()), SmemLayoutK{});
    Tensor sdV = make_tensor(make_smem_ptr(ts.smem_v.data()), SmemLayoutK{});
    // Both warpgroups' last GEMMs (which read K and V) have completed before anyone overwrites them.
    cutlass::arch::NamedBarrier::sync(Mainloop::kNumMmaThreads, kBwdEpilogue);
    Tensor rdK = convert_type<Element>(tdKrdK);
    Tensor rdV = convert_type<Element>(tdVrdV);
    // stmatrix; dK^T / dV^T accumulators go through the transposed view with its transposing form.
    using StoreAtom = std::conditional_t<kdKVSwapAB, SM90_U16x8_STSM_T, SM90_U32x4_STSM_N>;
    auto smem_copy = make_tiled_copy_C(Copy_Atom<StoreAtom, Element>{}, TiledMmadKV{});
    auto thr_copy = smem_copy.get_thread_slice(thread_idx);
    auto as_acc = [&](auto* ptr) {  // the buffer in the accumulator's (row, col) order
      if constexpr (kdKVSwapAB) {
        return make_tensor(make_smem_ptr(ptr), SmemLayoutKt{});
      } else {
        return make_tensor(make_smem_ptr(ptr), SmemLayoutK{});
      }
    };
    copy(smem_copy, thr_copy.retile_S(rdK), thr_copy.partition_D(as_acc(ts.smem_k.data())));
    copy(smem_copy, thr_copy.retile_S(rdV), thr_copy.partition_D(as_acc(ts.smem_v.data())));
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by TMA
    cutlass::arch::NamedBarrier::sync(Mainloop::kNumMmaThreads, kBwdEpilogue);
    if (thread_idx == 0) {
      Tensor sdK1 = make_tensor(make_smem_ptr(ts.smem_k.data()), typename Mainloop::SmemLayoutKStaged{});
      Tensor sdV1 = make_tensor(make_smem_ptr(ts.smem_v.data()), typename Mainloop::SmemLayoutKStaged{});
      auto rows = [&](auto const& tma) {
        return local_tile(entry_rows(tma.get_tma_tensor(p.shape_dkv), seq.offset_k, head, seq.batch_coord),
                          Shape<BN, D>{}, make_coord(_, _0{}));
      };
      Tensor gdK = rows(p.tma_dk);
      Tensor gdV = rows(p.tma_dv);
      auto k_parts = tma_partition(p.tma_dk, _0{}, Layout<_1>{}, group_modes<0, 2>(sdK1), group_modes<0, 2>(gdK));
      auto v_parts = tma_partition(p.tma_dv, _0{}, Layout<_1>{}, group_modes<0, 2>(sdV1), group_modes<0, 2>(gdV));
      copy(p.tma_dk, get<1>(k_parts)(_, 0), get<0>(k_parts)(_, n_block));
      copy(p.tma_dv, get<1>(v_parts)(_, 0), get<0>(v_parts)(_, n_block));
      tma_store_arrive();
      tma_store_wait<0>();  // shared memory must outlive the reads
    }
  }

  template <class FragdKV>
  CUTE_DEVICE static void store_atomic(Params const& p, FragdKV const& tdKrdK, FragdKV const& tdVrdV, int thread_idx,
                                       SeqlenInfo const& seq, int n_block, int head, int batch) {
    int const kv_head = head / p.heads_ratio;
    int const wg = thread_idx / cutlass::NumThreadsPerWarpGroup;
    int64_t const offset = (int64_t(batch) * p.nheads_kv + kv_head) * int64_t(p.seqlen_k) * kHeadDim;
    float* dk_bh = p.dk_accum + offset;
    float* dv_bh = p.dv_accum + offset;
    int* sem = p.dkv_semaphore == nullptr
                   ? nullptr
                   : p.dkv_semaphore + (int64_t(batch) * p.nheads_kv + kv_head) * ceil_div(p.seqlen_k, kBlockN) + n_block;
    int const barrier = kBwdAtomicWG0 + wg;
    // Deterministic: the group's query heads add in order; the two warpgroups own disjoint
    // elements, so each waits for both halves of the previous head only.
    if (sem != nullptr) {
      if (thread_idx % cutlass::NumThreadsPerWarpGroup == 0) wait_at_least(sem, 2 * (head % p.heads_ratio));
      cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, barrier);
    }
    Tensor tdKVc = TiledMmadKV{}.get_thread_slice(thread_idx).partition_C(make_identity_tensor(ShapedKV{}));
    int const keys = seq.seqlen_k - n_block * kBlockN;  // valid rows of this key block
    float* dk_n = dk_bh + int64_t(n_block) * kBlockN * kHeadDim;
    float* dv_n = dv_bh + int64_t(n_block) * kBlockN * kHeadDim;
    if constexpr (!kdKVSwapAB) {  // rows are keys: 16-byte reductions along the head dim
      red_add_rows_v4(tdKrdK, tdKVc, keys, [&](int key, int col) { return dk_n + key * kHeadDim + col; });
      red_add_rows_v4(tdVrdV, tdKVc, keys, [&](int key, int col) { return dv_n + key * kHeadDim + col; });
    } else {  // dK^T: adjacent accumulator columns are keys, not contiguous in memory
      CUTE_UNROLL
      for (int i = 0; i < size(tdKrdK); ++i) {
        int const key = int(get<1>(tdKVc(i))), col = int(get<0>(tdKVc(i)));
        if (key < keys) {
          red_add(dk_n + key * kHeadDim + col, tdKrdK(i));
          red_add(dv_n + key * kHeadDim + col, tdVrdV(i));
        }
      }
    }
    if (sem != nullptr) {
      __threadfence();
      cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, barrier);
      if (thread_idx % cutlass::NumThreadsPerWarpGroup == 0) signal(sem);
    }
  }
};

}  // namespace flashhopper::sm90
