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

// One query block of fragment-ordered sums (dq_frag_layout.h) to rows [0, rows) of dst: each thread
// reads 16-byte chunks (two rows, two columns each), kBatch of them in flight.
template <class Element, int kFragCols>
CUTE_DEVICE void convert_frag_block(float const* src, Element* dst, int rows, ConvertAccumParams const& p) {
  using Layout = DqFragLayout<kFragCols>;
  using Pair = cutlass::Array<Element, 2>;
  cutlass::NumericArrayConverter<Element, float, 2> convert;
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
      auto store = [&](int r, float x, float y) {
        if (r < rows) *reinterpret_cast<Pair*>(dst + r * p.row_stride + col) = convert({x * p.scale, y * p.scale});
      };
      store(row, a[j].x, a[j].y);
      store(row + 8, a[j].z, a[j].w);
    }
  }
}

// dQ one query block at a time, each once the main kernel has counted all the key blocks that add
// to it (BlockInfo::num_n_blocks_of; zero for rows that see no key, whose dQ is the zeroed accumulator).
// Launched as a programmatic dependent of the main kernel, so its CTAs fill the SMs that the main
// kernel's tail leaves idle. Blocks are handed out in the order the main kernel finishes them:
// (batch, head) ascending, as its CTAs start, and within a head the last query block first, as
// every key block walks them. The sums are in fragment order (dq_frag_layout.h, 64-row blocks of
// kFragCols-column groups).
struct ConvertDqReadyParams {
  ConvertAccumParams accum;
  int const* ready;  // (batch, nheads, m_blocks): key blocks whose additions have landed
  int* ticket;       // zeroed: the next block to hand out
  int block_m, num_m_blocks;
};

template <class Element, class BlockInfo, int kFragCols>
__global__ void __launch_bounds__(256) convert_dq_when_ready_kernel(ConvertDqReadyParams const p, BlockInfo const bi) {
#if defined(__CUDA_ARCH__)
  static_assert(cutlass::arch::IsGdcGloballyEnabled, "build with -DCUTLASS_ENABLE_GDC_FOR_SM90 (see CMakeLists.txt)");
#endif
  __shared__ int next;
  int const total = p.accum.batch * p.accum.nheads * p.num_m_blocks;
  for (;;) {
    if (threadIdx.x == 0) {
      int const t = atomicAdd(p.ticket, 1);
      int work = -1;
      if (t < total) {
        int const bh = t / p.num_m_blocks, m_block = p.num_m_blocks - 1 - (t - bh * p.num_m_blocks);
        work = bh * p.num_m_blocks + m_block;
        int const need = bi.num_n_blocks_of(m_block);
        cuda::atomic_ref<int const, cuda::thread_scope_device> ready(p.ready[work]);
        while (ready.load(cuda::memory_order_acquire) < need) __nanosleep(256);  // spare L2 the polling
        __threadfence();  // the block's sums, before the barrier publishes them to the CTA
      }
      next = work;
    }
    __syncthreads();
    int const work = next;
    __syncthreads();  // everyone has read `next` before thread 0 writes it again
    if (work < 0) break;
    int const bh = work / p.num_m_blocks, m_block = work - bh * p.num_m_blocks;
    int const batch = bh / p.accum.nheads, head = bh - batch * p.accum.nheads;
    int const row_begin = m_block * p.block_m, rows = min(p.block_m, p.accum.seqlen - row_begin);
    Element* dst = static_cast<Element*>(p.accum.out) + batch * p.accum.batch_stride + head * p.accum.head_stride +
                   row_begin * p.accum.row_stride;
    convert_frag_block<Element, kFragCols>(p.accum.accum + int64_t(work) * p.block_m * p.accum.headdim, dst, rows,
                                           p.accum);
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
  launch_convert_accum<Element>({ws.at<float>(p.workspace, ws.dk_accum), p.dk_ptr, p.dk_batch_stride, p.dk_row_stride,
                                 p.dk_head_stride, p.batch, p.seqlen_k, p.nheads_kv, p.headdim, 1.f},
                                num_sms, stream);
  launch_convert_accum<Element>({ws.at<float>(p.workspace, ws.dv_accum), p.dv_ptr, p.dv_batch_stride, p.dv_row_stride,
                                 p.dv_head_stride, p.batch, p.seqlen_k, p.nheads_kv, p.headdim_v, 1.f},
                                num_sms, stream);
  check_launch(cudaGetLastError(), "backward dK/dV postprocess launch");
}

// dQ as the main kernel completes its query blocks (the main kernel counts them in
// ws.dq_semaphore and starts dependents early); BlockInfo's kBlockM is the counters' block.
template <class Element, int kFragCols, int kBlockM, int kBlockN, MaskKind kMask>
void launch_convert_dq_when_ready(BwdParams const& p, BwdWorkspace const& ws,
                                  BlockInfo<kBlockM, kBlockN, kMask> const& bi, int num_sms, cudaStream_t stream) {
  ConvertDqReadyParams const rp{dq_convert_params(p, ws), ws.at<int>(p.workspace, ws.dq_semaphore),
                                ws.at<int>(p.workspace, ws.dq_ticket), kBlockM, ceil_div(p.seqlen_q, kBlockM)};
  static_assert(kBlockM == DqFragLayout<8>::kBlockM, "fragment order is in 64-row blocks");
  auto kernel = &convert_dq_when_ready_kernel<Element, BlockInfo<kBlockM, kBlockN, kMask>, kFragCols>;
  int per_sm = 0;
  check_launch(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, 0), "occupancy query");
  int64_t const blocks = int64_t(p.batch) * p.nheads_q * rp.num_m_blocks;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(num_sms) * std::max(1, per_sm)))));
  config.blockDim = dim3(256);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  check_launch(cudaLaunchKernelEx(&config, kernel, rp, bi), "backward dQ postprocess launch");
}

}  // namespace flashhopper
