// Ampere backward postprocess for dQ: the float32 accumulator holds each kBlockM x headdim tile in
// MMA-fragment order (red_add_fragment_order), each (entry, head)'s from scratch_row0_q on
// (common/workspace_bwd.h), so one CTA per (query block, head, batch entry) reads a tile back with the mainloop's own thread mapping, scales and converts it, stages it in shared
// memory and writes rows below seqlen_q in 16-byte pieces.
#pragma once

#include <cute/tensor.hpp>

#include "../common/utils.h"
#include "../common/workspace_bwd.h"
#include "gemm.h"

namespace flashhopper::sm80 {

using namespace cute;

template <class Mainloop, class Seqlens>
struct ConvertdQ {
  using Element = typename Mainloop::Element;
  static constexpr int kBlockM = Mainloop::kBlockM, kHeadDim = Mainloop::kHeadDim;
  static constexpr int kNumThreads = Mainloop::kNumThreads;
  static constexpr int kSmemBytes = int(cosize_v<typename Mainloop::SmemLayoutQ> * sizeof(Element));

  struct Params {
    float const* accum;  // (batch_coords, nheads, seqlen_q_rounded, headdim), tiles in fragment order
    Element* dq;
    int64_t batch_stride, row_stride, head_stride;
    Seqlens seqlens;
    int seqlen_q_rounded, nheads;
    float scale;
  };
};

template <class Mainloop, class Seqlens>
__global__ void __launch_bounds__(Mainloop::kNumThreads)
    convert_dq_kernel(CUTE_GRID_CONSTANT typename ConvertdQ<Mainloop, Seqlens>::Params const p) {
  using Element = typename Mainloop::Element;
  constexpr int kBlockM = Mainloop::kBlockM, kHeadDim = Mainloop::kHeadDim;
  extern __shared__ __align__(128) char smem[];
  int const m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  SeqlenInfo const seq = p.seqlens(batch);
  if (m_block * kBlockM >= seq.seqlen_q) return;  // past a shorter packed entry's rows
  typename Mainloop::TiledMmadQ mma_dq;
  Tensor acc = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  float const* tile =
      p.accum + (scratch_row0_q<kBlockM>(p.seqlens, seq, batch, head, p.nheads, p.seqlen_q_rounded) + m_block * kBlockM) *
                    kHeadDim;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) acc(i) = tile[i * Mainloop::kNumThreads + int(threadIdx.x)] * p.scale;
  Tensor s = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Mainloop::SmemLayoutQ{});
  store_fragment(mma_dq, convert_type<Element>(acc), s);
  __syncthreads();
  Element* dq = p.dq + seq.batch_coord * p.batch_stride + head * p.head_stride + int64_t(seq.offset_q) * p.row_stride;
  Tensor g = local_tile(gmem_rows<kHeadDim>(dq, seq.seqlen_q, p.row_stride), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                        make_coord(m_block, 0));
  store_rows<Mainloop::kNumThreads>(s, g, seq.seqlen_q - m_block * kBlockM);
}

}  // namespace flashhopper::sm80
