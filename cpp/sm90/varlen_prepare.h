// The kernel that runs before a packed-batch (varlen) forward or backward, on the same stream: no host
// ever sees cu_seqlens, so what depends on the entries' lengths is computed here, on the device.
//   - Tensor maps of each entry's rows (forward: Q, K, V, O; backward: Q, K, V, dO, dK, dV): the params'
//     maps with the row extent (FP8's V^T: key extent) ending at the entry's last row, so that TMA zero-fills loads and drops
//     stores past it instead of touching the next entry (each warp patches one map in shared memory with
//     tensormap.replace and copies it out with the release fence; the kernel acquires it before use).
//   - The tile schedule (the forward's VarlenTileScheduler, the backward's decode_bwd_tile): each entry's
//     blocks (of queries, or of keys), the entries sorted by them (rank by counting, O(batch^2) in one
//     CTA: microseconds for hundreds of entries), the prefix sums of the sorted entries' tiles (blocks x
//     query heads) and their total; for the backward (Params::tiles) also each CTA's tile, so that a CTA finds
//     its tile in one load instead of a search over the prefix sums (a chain of ~8 dependent loads at every CTA
//     start: the backward's CTAs are not persistent; docs/perf-notes.md, session 33).
#pragma once

#include <cub/block/block_scan.cuh>
#include <cute/tensor.hpp>
#include <cutlass/arch/grid_dependency_control.h>

#include "../common/block_info.h"
#include "../common/seqlen.h"
#include "../common/varlen_workspace.h"

namespace flashhopper::sm90 {

using namespace cute;

// TmaCopies: the kernel's TMA copies whose maps are patched, Params::maps[i] describing the i-th.
// Block 0 also writes the tile schedule over the entries' blocks of kBlock rows: of queries (the forward's
// tiles) or, kKeys, of keys (the backward's).
template <class Element, int kBlock, bool kKeys, class... TmaCopies>
struct VarlenPrepare {
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kMaps = int(sizeof...(TmaCopies));
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;

  struct Map {
    ShapeQKV shape;     // the (rows, cols, heads, batch) tensor the map was made for: its rows are replaced
    StrideQKV stride;
    int slot;           // VarlenTensor
    bool q_rows;        // spans the queries' rows (Q, O, dO) or the keys' (K, V, dK, dV)
    int vt_block = 0;   // FP8's V^T (headdim, keys): its keys (mode 1) in blocks of this many per entry
    int elem_bytes = int(sizeof(Element));  // of the map's elements (FP8's O is bfloat16)
  };
  struct Params {
    cute::tuple<TmaCopies...> tmas;  // the source maps, copies of the kernel's
    cute::array<Map, kMaps> maps;
    VarlenSeqlens seqlens;
    VarlenWorkspace ws;
    int batch, nheads_q;
    int4* tiles = nullptr;  // (num_tiles,) {block, head, entry, entry's blocks}; block -1 past the schedule
    int64_t num_tiles = 0;  // the grid of the kernel that reads them
  };

  static int grid(int batch) { return std::max(1, ceil_div(batch * kMaps, kWarps)); }

  // One warp: map i of entry `entry` into its workspace slot.
  template <class TmaCopy>
  CUTE_DEVICE static void patch(Params const& p, TmaCopy const& tma, Map const& m, int entry, TmaDescriptor& smem_desc) {
    SeqlenInfo const seq = p.seqlens(entry);
    // Rows [0, end) of the packed tensor; an empty entry keeps a legal extent (its map is never used).
    // V^T: the entry's keys start at its first block and are padded to 16 (permuted within groups of 16).
    int const end = cute::max(1, m.vt_block > 0
                                     ? VarlenSeqlens::first_block(seq.offset_k, entry, m.vt_block) * m.vt_block +
                                           (seq.seqlen_k + 15) / 16 * 16
                                 : m.q_rows ? seq.offset_q + seq.seqlen_q
                                            : seq.offset_k + seq.seqlen_k);
    int const lane = threadIdx.x % 32;
    if (lane < 8) {
      reinterpret_cast<uint4*>(&smem_desc)[lane] = reinterpret_cast<uint4 const*>(tma.get_tma_descriptor())[lane];
    }
    __syncwarp();
    if (cute::elect_one_sync()) {
      cute::array<uint32_t, 5> shape = {1, 1, 1, 1, 1};
      cute::array<uint64_t, 5> stride = {0, 0, 0, 0, 0};
      auto const rows = m.vt_block > 0 ? get<0>(m.shape) : end, cols = m.vt_block > 0 ? end : get<1>(m.shape);
      Tensor t = make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                             make_shape(rows, cols, get<2>(m.shape), get<3>(m.shape)), m.stride);
      cute::detail::fill_tma_gmem_shape_stride(tma, t, shape, stride);
      for (auto& s : stride) s = s * m.elem_bytes;  // the maps count strides in bytes
      cute::tma_descriptor_replace_dims_strides_in_shared_mem(smem_desc, shape, stride);
    }
    __syncwarp();
    auto* dst = reinterpret_cast<TmaDescriptor*>(const_cast<void*>(p.seqlens.tma_desc(nullptr, m.slot, entry)));
    cute::tma_descriptor_cp_fence_release(dst, smem_desc);
  }

  // CTA 0: the schedule's arrays.
  CUTE_DEVICE static void schedule(Params const& p) {
    int const tid = threadIdx.x;
    int const n = p.batch;
    for (int i = tid; i < n; i += kThreads) {
      SeqlenInfo const seq = p.seqlens(i);
      p.ws.blocks[i] = ceil_div(kKeys ? seq.seqlen_k : seq.seqlen_q, kBlock);
    }
    __syncthreads();
    for (int i = tid; i < n; i += kThreads) {
      int const mi = p.ws.blocks[i];
      int rank = 0;
      for (int j = 0; j < n; ++j) {
        int const mj = p.ws.blocks[j];
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
      int const tiles = s < n ? p.ws.blocks[p.ws.order[s]] * p.nheads_q : 0;
      int incl, chunk;
      Scan(scan_storage).InclusiveSum(tiles, incl, chunk);
      if (s < n) p.ws.prefix[s] = carry + incl;
      carry += chunk;
      __syncthreads();  // scan_storage is reused
    }
    if (tid == 0) *p.ws.total = carry;
    if (p.tiles != nullptr) {
      // Sorted entry s's tiles are [prefix[s - 1], prefix[s]), its heads one after another (the backward's
      // order: tile_scheduler.h, decode_packed_bwd_tile): a warp an entry (one long entry: one warp, microseconds
      // against its backward's milliseconds).
      int const lane = tid % 32;
      for (int s = tid / 32; s < n; s += kWarps) {
        int const e = p.ws.order[s], blocks = p.ws.blocks[e];
        int const start = s > 0 ? p.ws.prefix[s - 1] : 0, count = p.ws.prefix[s] - start;
        for (int i = lane; i < count; i += 32) {
          int const head = i / blocks;
          p.tiles[start + i] = make_int4(i - head * blocks, head, e, blocks);
        }
      }
      for (int64_t i = carry + tid; i < p.num_tiles; i += kThreads) p.tiles[i] = make_int4(-1, 0, 0, 0);
    }
  }

  CUTE_DEVICE static void run(Params const& p) {
    // The forward may launch now (programmatic dependent launch): its prologue overlaps this kernel, and
    // it waits for this kernel's completion before it reads the workspace.
    cutlass::arch::launch_dependent_grids();
    __shared__ alignas(128) TmaDescriptor smem_desc[kWarps];
    int const warp = threadIdx.x / 32;
    int const slot = blockIdx.x * kWarps + warp;
    if (slot < p.batch * kMaps) {
      int const entry = slot / kMaps, i = slot % kMaps;
      cute::for_each(make_int_sequence<kMaps>{}, [&](auto I) {
        if (I == i) patch(p, get<I>(p.tmas), p.maps[I], entry, smem_desc[warp]);
      });
    }
    if (blockIdx.x == 0) schedule(p);
  }
};

template <class Prepare>
__global__ void __launch_bounds__(Prepare::kThreads) varlen_prepare_kernel(CUTE_GRID_CONSTANT typename Prepare::Params const p) {
  Prepare::run(p);
}

}  // namespace flashhopper::sm90
