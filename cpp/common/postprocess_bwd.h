// Backward postprocess, shared by the kernel families: a float32 accumulator (batch, nheads,
// seqlen, headdim), contiguous, times a scale, converted into a (batch, seqlen, nheads, headdim)
// gradient with the caller's strides. Used for dQ (scale = softmax_scale) and, under GQA, for the
// dK/dV sums over each group. Memory-bound: 8 elements per thread, 16-byte stores.
#pragma once

#include <cuda_runtime.h>

#include <cuda/atomic>

#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <algorithm>
#include <cstdint>

#include "block_info.h"
#include "dq_frag_layout.h"
#include "launch_attribute.h"
#include "params.h"
#include "workspace_bwd.h"

namespace flashhopper {

struct ConvertAccumParams {
  float const* accum;
  void* out;
  int64_t batch_stride, row_stride, head_stride;  // of out, in elements
  int batch, seqlen, nheads, headdim;
  float scale;
};

// Eight consecutive float32 sums, read from L2 only (.cg): they were added there, by TMA or by other
// SMs, possibly while the reading kernel already ran.
struct Accum8 {
  float4 lo, hi;
};
CUTE_DEVICE Accum8 load_accum8(float const* src) {
  return {__ldcg(reinterpret_cast<float4 const*>(src)), __ldcg(reinterpret_cast<float4 const*>(src) + 1)};
}

// scale * a in the output dtype, as one 16-byte store.
template <class Element>
CUTE_DEVICE void store_scaled8(Element* dst, Accum8 const& a, float scale) {
  cutlass::Array<float, 8> v;
  v[0] = a.lo.x, v[1] = a.lo.y, v[2] = a.lo.z, v[3] = a.lo.w, v[4] = a.hi.x, v[5] = a.hi.y, v[6] = a.hi.z, v[7] = a.hi.w;
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] *= scale;
  cutlass::NumericArrayConverter<Element, float, 8> convert;
  cutlass::Array<Element, 8> const out = convert(v);
  *reinterpret_cast<uint4*>(dst) = reinterpret_cast<uint4 const&>(out);
}

// Rows [0, rows) of dst set to 0 by the CTA (16-byte stores where dst's rows allow, else pairs).
template <class Element>
CUTE_DEVICE void zero_rows(Element* dst, int rows, ConvertAccumParams const& p) {
  if (p.row_stride % 8 == 0 && p.headdim % 8 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    int const vecs = p.headdim / 8;
    for (int v = threadIdx.x; v < rows * vecs; v += blockDim.x) {
      int const r = v / vecs, c = (v - r * vecs) * 8;
      *reinterpret_cast<uint4*>(dst + r * p.row_stride + c) = make_uint4(0, 0, 0, 0);
    }
  } else {
    int const pairs = p.headdim / 2;
    for (int v = threadIdx.x; v < rows * pairs; v += blockDim.x) {
      int const r = v / pairs, c = (v - r * pairs) * 2;
      *reinterpret_cast<uint32_t*>(dst + r * p.row_stride + c) = 0u;
    }
  }
}

template <class Element>
__global__ void __launch_bounds__(256) convert_accum_kernel(ConvertAccumParams const p) {
  int64_t const total = int64_t(p.batch) * p.nheads * p.seqlen * (p.headdim / 8);
  int64_t const vecs_per_row = p.headdim / 8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = i / vecs_per_row;
    int const col = int(i - rest * vecs_per_row) * 8;
    int const row = int(rest % p.seqlen);
    rest /= p.seqlen;
    int const head = int(rest % p.nheads);
    int const batch = int(rest / p.nheads);
    Accum8 const a = load_accum8(p.accum + i * 8);
    store_scaled8(static_cast<Element*>(p.out) + batch * p.batch_stride + row * p.row_stride + head * p.head_stride + col,
                  a, p.scale);
  }
}

// One 64-row block of fragment-ordered sums (dq_frag_layout.h) to rows [0, rows) of dst, through `tile` (shared,
// 64 x (headdim + 8) elements): each thread reads 16-byte chunks (two rows or, transposed, two queries, and two
// columns each), kBatch of them in flight, and puts them in the tile; then each writes 8 contiguous elements of
// a row (16 bytes; pairs where dst's rows are not 16-byte aligned). Written straight from the chunks the stores
// were 4 bytes, rows apart: 87 us against FA3's 47 for 32 x 32 heads x 512 tokens of d64 (perf-notes, S16E).
template <class Element, int kFragCols, bool kTransposed = false>
CUTE_DEVICE void convert_frag_block(float const* src, Element* dst, int rows, Element* tile, ConvertAccumParams const& p) {
  using Layout = DqFragLayout<kFragCols, kTransposed>;
  using Pair = cutlass::Array<Element, 2>;
  cutlass::NumericArrayConverter<Element, float, 2> convert;
  int const ld = p.headdim + 8;
  int const chunks = Layout::kBlockM * p.headdim / 4;
  constexpr int kBatch = 4;
  for (int k0 = threadIdx.x; k0 < chunks; k0 += kBatch * blockDim.x) {
    float4 a[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      int const k = k0 + j * blockDim.x;
      if (k < chunks) a[j] = __ldcg(reinterpret_cast<float4 const*>(src) + k);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      int const k = k0 + j * blockDim.x;
      if (k >= chunks) continue;
      int row = 0, col = 0;
      Layout::coord(k, row, col);
      if constexpr (!kTransposed) {  // (row, col..col+1) and (row + 8, col..col+1)
        *reinterpret_cast<Pair*>(tile + row * ld + col) = convert({a[j].x * p.scale, a[j].y * p.scale});
        *reinterpret_cast<Pair*>(tile + (row + 8) * ld + col) = convert({a[j].z * p.scale, a[j].w * p.scale});
      } else {  // row a head-dim index, col a query: (q, d), (q + 1, d), (q, d + 8), (q + 1, d + 8)
        tile[col * ld + row] = Element(a[j].x * p.scale);
        tile[(col + 1) * ld + row] = Element(a[j].y * p.scale);
        tile[col * ld + row + 8] = Element(a[j].z * p.scale);
        tile[(col + 1) * ld + row + 8] = Element(a[j].w * p.scale);
      }
    }
  }
  __syncthreads();
  int const rows_here = min(rows, Layout::kBlockM);
  if (p.row_stride % 8 == 0 && p.headdim % 8 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    int const vecs = p.headdim / 8;
    for (int v = threadIdx.x; v < rows_here * vecs; v += blockDim.x) {
      int const r = v / vecs, c = (v - r * vecs) * 8;
      *reinterpret_cast<uint4*>(dst + r * p.row_stride + c) = *reinterpret_cast<uint4 const*>(tile + r * ld + c);
    }
  } else {
    int const pairs = p.headdim / 2;
    for (int v = threadIdx.x; v < rows_here * pairs; v += blockDim.x) {
      int const r = v / pairs, c = (v - r * pairs) * 2;
      *reinterpret_cast<Pair*>(dst + r * p.row_stride + c) = *reinterpret_cast<Pair const*>(tile + r * ld + c);
    }
  }
  __syncthreads();  // the tile is read before the next block's chunks land in it
}

// dQ one query block at a time, each once the main kernel has counted all the key blocks that add
// to it (BlockInfo::num_n_blocks_of; zero for rows that see no key: their dQ is 0, their sums never written)
// and, where some were counted as issued (kDqUnlanded), once the main kernel has completed.
// Launched as a programmatic dependent of the main kernel, so its CTAs fill the SMs that the main
// kernel's tail leaves idle. Blocks are handed out in the order the main kernel finishes them:
// (batch, head) ascending, as its CTAs start, and within a head the last query block first, as
// every key block walks them. The sums are in fragment order (dq_frag_layout.h, 64-row blocks of
// kFragCols-column groups), each (entry, head)'s blocks from scratch_row0_q on.
template <class Seqlens>
struct ConvertDqReadyParams {
  ConvertAccumParams accum;  // batch: the entries
  int const* ready;          // per block of the sums: key blocks whose additions have landed
  int* ticket;               // zeroed: the next block to hand out
  int block_m, blocks_per_head;  // blocks per (batch coordinate, head): seqlen_q_rounded / block_m
  Seqlens seqlens;
  int window_left, window_right;
};

// Ticket t's (entry, head, query block), or false where t names none (a packed batch's padding block).
// Padded batches: (batch, head) t / blocks_per_head, blocks from the last. Packed: the tickets of entry b
// are nheads times its blocks [base_b, base_{b+1}) of the scratch (base_b = padded_offset_q / block_m),
// found by binary search; per head from the last block again.
template <class Seqlens>
CUTE_DEVICE bool decode_dq_ticket(ConvertDqReadyParams<Seqlens> const& p, int t, int& batch, int& head, int& m_block) {
  int const nheads = p.accum.nheads;
  if constexpr (!Seqlens::kPacked) {
    int const bh = t / p.blocks_per_head;
    m_block = p.blocks_per_head - 1 - (t - bh * p.blocks_per_head);
    batch = bh / nheads;
    head = bh - batch * nheads;
    return true;
  } else {
    auto base = [&](int b) { return p.seqlens.padded_offset_q(b, p.block_m) / p.block_m; };
    int lo = 0, hi = p.accum.batch - 1;  // the last entry whose first ticket is <= t
    while (lo < hi) {
      int const mid = (lo + hi + 1) / 2;
      if (int64_t(base(mid)) * nheads <= t) lo = mid;
      else hi = mid - 1;
    }
    int const first = base(lo), span = base(lo + 1) - first;  // span >= 1: base rises by a block per entry
    int const idx = t - first * nheads;
    if (idx < 0 || idx >= span * nheads) return false;
    batch = lo;
    head = idx / span;
    m_block = span - 1 - (idx - head * span);
    return m_block < ceil_div(p.seqlens(lo).seqlen_q, p.block_m);
  }
}

template <class Element, class BlockInfo, int kFragCols, bool kTransposed, class Seqlens>
__global__ void __launch_bounds__(256) convert_dq_when_ready_kernel(ConvertDqReadyParams<Seqlens> const p) {
#if defined(__CUDA_ARCH__)
  static_assert(cutlass::arch::IsGdcGloballyEnabled, "build with -DCUTLASS_ENABLE_GDC_FOR_SM90 (see CMakeLists.txt)");
#endif
  __shared__ int next[4];  // batch (-1: no more work, -2: none this round), head, block, key blocks adding to it
  extern __shared__ __align__(16) char convert_smem[];  // convert_frag_block's tile (dq_tile_smem_bytes)
  Element* const tile = reinterpret_cast<Element*>(convert_smem);
  int const nheads = p.accum.nheads;
  int const total = (Seqlens::kPacked ? 1 : p.accum.batch) * nheads * p.blocks_per_head;
  for (;;) {
    if (threadIdx.x == 0) {
      int const t = atomicAdd(p.ticket, 1);
      int batch = -1, head = 0, m_block = 0, need = 0;
      if (t < total) {
        if (decode_dq_ticket(p, t, batch, head, m_block)) {
          SeqlenInfo const seq = p.seqlens(batch);
          need = BlockInfo{seq, p.window_left, p.window_right}.num_n_blocks_of(m_block);
          int64_t const block =
              scratch_row0_q<BlockInfo::kM>(p.seqlens, seq, batch, head, nheads, p.blocks_per_head * p.block_m) /
                  p.block_m + m_block;
          cuda::atomic_ref<int const, cuda::thread_scope_device> ready(p.ready[block]);
          int count;
          while (((count = ready.load(cuda::memory_order_acquire)) & ~kDqUnlanded) < need) __nanosleep(256);
          // Counted as issued: the additions have landed once the main kernel has completed.
          if (count & kDqUnlanded) cutlass::arch::wait_on_dependent_grids();
          __threadfence();  // the block's sums, before the barrier publishes them to the CTA
        } else {
          batch = -2;
        }
      }
      next[0] = batch, next[1] = head, next[2] = m_block, next[3] = need;
    }
    __syncthreads();
    int const batch = next[0], head = next[1], m_block = next[2], need = next[3];
    __syncthreads();  // everyone has read `next` before thread 0 writes it again
    if (batch == -1) break;
    if (batch == -2) continue;
    SeqlenInfo const seq = p.seqlens(batch);
    int64_t const row0 = scratch_row0_q<BlockInfo::kM>(p.seqlens, seq, batch, head, nheads,
                                                            p.blocks_per_head * p.block_m) + int64_t(m_block) * p.block_m;
    int const rows = min(p.block_m, seq.seqlen_q - m_block * p.block_m);
    Element* dst = static_cast<Element*>(p.accum.out) + seq.batch_coord * p.accum.batch_stride +
                   head * p.accum.head_stride + (int64_t(seq.offset_q) + m_block * p.block_m) * p.accum.row_stride;
    if (need == 0) {  // no key block wrote its sums (the sm90 writer stores the first instead of zeroing)
      zero_rows(dst, min(rows, BlockInfo::kM), p.accum);
      continue;
    }
    // A query block of 128 rows is two 64-row fragment blocks (dq_frag_layout.h).
    constexpr int kFragRows = DqFragLayout<kFragCols>::kBlockM;
    CUTE_UNROLL
    for (int r0 = 0; r0 < BlockInfo::kM; r0 += kFragRows) {
      if (r0 == 0 || r0 < rows) {
        convert_frag_block<Element, kFragCols, kTransposed>(p.accum.accum + (row0 + r0) * p.accum.headdim,
                                                            dst + r0 * p.accum.row_stride, rows - r0, tile, p.accum);
      }
    }
  }
  // This grid ends only after the main kernel has ended and its writes (dK, dV) are visible, so
  // work ordered after it on the stream sees them.
  cutlass::arch::wait_on_dependent_grids();
}

template <class Element>
void launch_convert_accum(ConvertAccumParams const& p, int num_sms, cudaStream_t stream) {
  int64_t const total = int64_t(p.batch) * p.nheads * p.seqlen * (p.headdim / 8);
  if (total == 0) return;
  int const blocks = int(std::min<int64_t>((total + 255) / 256, int64_t(num_sms) * 8));
  convert_accum_kernel<Element><<<blocks, 256, 0, stream>>>(p);
}

// dQ's conversion: softmax_scale is applied here, once.
inline ConvertAccumParams dq_convert_params(BwdParams const& p, BwdWorkspace const& ws) {
  return {ws.at<float>(p.workspace, ws.dq_accum), p.dq_ptr, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride,
          p.batch, p.seqlen_q, p.nheads_q, p.headdim, p.softmax_scale};
}

// Under GQA, dK and dV from their float32 sums over each group.
template <class Element>
void launch_convert_dkv(BwdParams const& p, BwdWorkspace const& ws, int num_sms, cudaStream_t stream) {
  if (!ws.gqa) return;
  // (Packed: one batch coordinate of total_k rows; rows of no entry hold zeros.)
  launch_convert_accum<Element>({ws.at<float>(p.workspace, ws.dk_accum), p.dk_ptr, p.dk_batch_stride, p.dk_row_stride,
                                 p.dk_head_stride, ws.batch_coords, ws.rows_k, p.nheads_kv, p.headdim, 1.f},
                                num_sms, stream);
  launch_convert_accum<Element>({ws.at<float>(p.workspace, ws.dv_accum), p.dv_ptr, p.dv_batch_stride, p.dv_row_stride,
                                 p.dv_head_stride, ws.batch_coords, ws.rows_k, p.nheads_kv, p.headdim_v, 1.f},
                                num_sms, stream);
  check_launch(cudaGetLastError(), "backward dK/dV postprocess launch");
}

// dQ as the main kernel completes its query blocks (the main kernel counts them in
// ws.dq_semaphore and starts dependents early); BlockInfo's kBlockM is the counters' block.
template <class Element, int kFragCols, bool kTransposed, int kBlockM, int kBlockN, MaskKind kMask, class Seqlens>
void launch_convert_dq_when_ready(BwdParams const& p, BwdWorkspace const& ws, Seqlens const& seqlens, int num_sms,
                                  cudaStream_t stream) {
  ConvertDqReadyParams<Seqlens> const rp{dq_convert_params(p, ws), ws.at<int>(p.workspace, ws.dq_semaphore),
                                         ws.at<int>(p.workspace, ws.dq_ticket), kBlockM,
                                         ws.seqlen_q_rounded / kBlockM, seqlens, p.window_left, p.window_right};
  static_assert(kBlockM % DqFragLayout<8>::kBlockM == 0, "fragment order is in 64-row blocks");
  auto kernel = &convert_dq_when_ready_kernel<Element, BlockInfo<kBlockM, kBlockN, kMask>, kFragCols, kTransposed, Seqlens>;
  int const smem = int(DqFragLayout<8>::kBlockM * (p.headdim + 8) * sizeof(Element));  // convert_frag_block's tile
  int per_sm = 0;
  check_launch(max_blocks_per_sm_once(per_sm, kernel, p.device, 256, smem), "occupancy query");
  int64_t const blocks = int64_t(ws.batch_coords) * p.nheads_q * rp.blocks_per_head;
  dim3 const grid(unsigned(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(num_sms) * std::max(1, per_sm)))));
  LaunchWith launch(programmatic_launch(), grid, 256, smem, stream);
  check_launch(cudaLaunchKernelEx(&launch.config, kernel, rp), "backward dQ postprocess launch");
}

}  // namespace flashhopper
