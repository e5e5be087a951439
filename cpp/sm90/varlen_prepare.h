// The kernel that runs before a packed-batch (varlen) forward, on the same stream: no host ever sees
// cu_seqlens, so what depends on the entries' lengths is computed here, on the device.
//   - Tensor maps of each entry's rows (Q, K, V, O): the params' maps with the row extent ending at the
//     entry's last row, so that TMA zero-fills loads and drops stores past it instead of touching the
//     next entry (each warp patches one map in shared memory with tensormap.replace and copies it out
//     with the release fence; the forward acquires it before use).
//   - The tile schedule (VarlenTileScheduler): each entry's query blocks, the entries sorted by them
//     (rank by counting, O(batch^2) in one CTA: microseconds for hundreds of entries), the prefix
//     sums of the sorted entries' tiles and their total.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cute/tensor.hpp>
#include <cutlass/arch/grid_dependency_control.h>

#include "../common/block_info.h"
#include "../common/seqlen.h"
#include "../common/varlen_workspace.h"

namespace flashhopper::sm90 {

using namespace cute;

template <class Mainloop, class Epilogue>
struct VarlenPrepare {
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;

  struct Params {
    typename Mainloop::Params mainloop;  // the maps to patch, the shapes and the seqlens
    typename Epilogue::Params epilogue;
    VarlenWorkspace ws;
    int batch, nheads_q;
    typename Mainloop::StrideQKV stride_q, stride_k, stride_v, stride_o;
  };

  static int grid(int batch) { return std::max(1, ceil_div(batch * kVarlenTensors, kWarps)); }

  // One warp: map `which` of entry `entry` into its workspace slot.
  CUTE_DEVICE static void patch(Params const& p, int entry, int which, TmaDescriptor& smem_desc) {
    SeqlenInfo const seq = p.mainloop.seqlens(entry);
    bool const is_q = which == kVarlenQ || which == kVarlenO;
    // Rows [0, end) of the packed tensor; an empty entry keeps a legal extent (its map is never used).
    int const end = cute::max(1, is_q ? seq.offset_q + seq.seqlen_q : seq.offset_k + seq.seqlen_k);
    auto const& mp = p.mainloop;
    TmaDescriptor const* src = which == kVarlenQ   ? mp.tma_q.get_tma_descriptor()
                               : which == kVarlenK ? mp.tma_k.get_tma_descriptor()
                               : which == kVarlenV ? mp.tma_v.get_tma_descriptor()
                                                   : p.epilogue.tma_o.get_tma_descriptor();
    int const lane = threadIdx.x % 32;
    if (lane < 8) reinterpret_cast<uint4*>(&smem_desc)[lane] = reinterpret_cast<uint4 const*>(src)[lane];
    __syncwarp();
    if (cute::elect_one_sync()) {
      cute::array<uint32_t, 5> shape = {1, 1, 1, 1, 1};
      cute::array<uint64_t, 5> stride = {0, 0, 0, 0, 0};
      using Element = typename Mainloop::Element;
      auto fill = [&](auto const& tma, auto shape4, auto stride4) {
        Tensor t = make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), shape4, stride4);
        cute::detail::fill_tma_gmem_shape_stride(tma, t, shape, stride);
      };
      auto rows = [&](auto const& s) { return make_shape(end, get<1>(s), get<2>(s), get<3>(s)); };
      if (which == kVarlenQ) fill(mp.tma_q, rows(mp.shape_q), p.stride_q);
      else if (which == kVarlenK) fill(mp.tma_k, rows(mp.shape_k), p.stride_k);
      else if (which == kVarlenV) fill(mp.tma_v, rows(mp.shape_v), p.stride_v);
      else fill(p.epilogue.tma_o, rows(p.epilogue.shape_o), p.stride_o);
      for (auto& s : stride) s = s * sizeof(Element);  // the maps count strides in bytes
      cute::tma_descriptor_replace_dims_strides_in_shared_mem(smem_desc, shape, stride);
    }
    __syncwarp();
    auto* dst = reinterpret_cast<TmaDescriptor*>(static_cast<char*>(p.ws.descs) +
                                                 (int64_t(entry) * kVarlenTensors + which) * VarlenWorkspace::kDescBytes);
    cute::tma_descriptor_cp_fence_release(dst, smem_desc);
  }

  // CTA 0: the schedule's arrays.
  CUTE_DEVICE static void schedule(Params const& p) {
    int const tid = threadIdx.x;
    int const n = p.batch;
    for (int i = tid; i < n; i += kThreads) {
      p.ws.m_blocks[i] = ceil_div(p.mainloop.seqlens(i).seqlen_q, Mainloop::kBlockM);
    }
    __syncthreads();
    for (int i = tid; i < n; i += kThreads) {
      int const mi = p.ws.m_blocks[i];
      int rank = 0;
      for (int j = 0; j < n; ++j) {
        int const mj = p.ws.m_blocks[j];
        rank += (mj > mi) || (mj == mi && j < i);
      }
      p.ws.order[rank] = i;
    }
    __syncthreads();
    using Scan = cub::BlockScan<int, kThreads>;
    __shared__ typename Scan::TempStorage scan_storage;
    int carry = 0;
    for (int base = 0; base < n; base += kThreads) {
      int const s = base + tid;
      int const tiles = s < n ? p.ws.m_blocks[p.ws.order[s]] * p.nheads_q : 0;
      int incl, chunk;
      Scan(scan_storage).InclusiveSum(tiles, incl, chunk);
      if (s < n) p.ws.prefix[s] = carry + incl;
      carry += chunk;
      __syncthreads();  // scan_storage is reused
    }
    if (tid == 0) *p.ws.total = carry;
  }

  CUTE_DEVICE static void run(Params const& p) {
    // The forward may launch now (programmatic dependent launch): its prologue overlaps this kernel, and
    // it waits for this kernel's completion before it reads the workspace.
    cutlass::arch::launch_dependent_grids();
    __shared__ alignas(128) TmaDescriptor smem_desc[kWarps];
    int const warp = threadIdx.x / 32;
    int const slot = blockIdx.x * kWarps + warp;
    if (slot < p.batch * kVarlenTensors) patch(p, slot / kVarlenTensors, slot % kVarlenTensors, smem_desc[warp]);
    if (blockIdx.x == 0) schedule(p);
  }
};

template <class Prepare>
__global__ void __launch_bounds__(Prepare::kThreads) varlen_prepare_kernel(CUTE_GRID_CONSTANT typename Prepare::Params const p) {
  Prepare::run(p);
}

}  // namespace flashhopper::sm90
