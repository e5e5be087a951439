// Building blocks shared by the Ampere forward and backward mainloops: the mma.sync atom and
// warp tilings, swizzled shared-memory tiles, cp.async tile loads, and the ldmatrix-fed GEMM.
#pragma once

#include <cute/tensor.hpp>

#include <cutlass/numeric_types.h>

#include <type_traits>

namespace flashhopper::sm80 {

using namespace cute;

// mma.sync m16n8k16 with float accumulators (HMMA.16816).
template <class Element>
using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                   MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;

// kWarpsM x kWarpsN warps; each repetition covers 16 rows and 16 columns per warp, so that one
// ldmatrix.x4 feeds two atoms of the B operand.
template <class Element, int kWarpsM, int kWarpsN>
using TiledMma = decltype(make_tiled_mma(MmaAtom<Element>{}, Layout<Shape<Int<kWarpsM>, Int<kWarpsN>, _1>>{},
                                         Tile<Int<16 * kWarpsM>, Int<16 * kWarpsN>, _16>{}));

// Rows of 64 (or 32) 16-bit elements swizzled so that ldmatrix (plain or transposed) and the
// 16-byte cp.async writes hit distinct banks.
template <int kCols>
using SmemAtom = std::conditional_t<kCols % 64 == 0,
                                    decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_8, _64>, Stride<_64, _1>>{})),
                                    decltype(composition(Swizzle<2, 3, 3>{}, Layout<Shape<_8, _32>, Stride<_32, _1>>{}))>;

// A (rows, cols) tile, cols contiguous; and the same bytes seen as (cols, rows) for the operands
// that need the transpose (ldmatrix .trans reads them).
template <int kRows, int kCols>
using SmemLayout = decltype(tile_to_shape(SmemAtom<kCols>{}, Shape<Int<kRows>, Int<kCols>>{}));
template <class Layout>
CUTE_HOST_DEVICE constexpr auto transposed(Layout const& l) {
  return composition(l, make_layout(make_shape(size<1>(l), size<0>(l)), GenRowMajor{}));
}

using LdsmN = SM75_U32x4_LDSM_N;  // operand stored K-contiguous
using LdsmT = SM75_U16x8_LDSM_T;  // operand stored with K strided (transposed on the way)

// Threads of the 16-byte-per-thread copies between global memory and (rows, kCols) tiles, one
// SmemAtom width per row of threads: 64 columns take 8 threads; 32 (head dim 96, 1.5 x 64) take 4.
template <int kNumThreads, int kCols>
using GmemThreadLayout = std::conditional_t<kCols % 64 == 0, Layout<Shape<Int<kNumThreads / 8>, _8>, Stride<_8, _1>>,
                                            Layout<Shape<Int<kNumThreads / 4>, _4>, Stride<_4, _1>>>;

// 16-byte cp.async per thread.
template <class Element, int kNumThreads, int kCols>
using GmemCopy = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{},
                                          GmemThreadLayout<kNumThreads, kCols>{}, Layout<Shape<_1, _8>>{}));

// One (batch, head)'s rows as (seqlen, headdim).
template <int kHeadDim, class T>
CUTE_DEVICE auto gmem_rows(T* ptr, int seqlen, int64_t row_stride) {
  return make_tensor(make_gmem_ptr(ptr), make_shape(seqlen, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
}

// Rows [n kRows, (n + 1) kRows) of a (seqlen, kCols) row-major matrix as one tile. The tile's base is
// 64-bit, the offsets inside it 32-bit (the launchers check kRows * row_stride < 2^31): per-row
// addresses then cost one add instead of 64-bit multiply-adds kept live across the loop.
template <int kRows, int kCols, class T>
CUTE_DEVICE auto block_rows(T* ptr, int64_t row_stride, int n) {
  return make_tensor(make_gmem_ptr(ptr + int64_t(n) * kRows * row_stride),
                     make_layout(make_shape(Int<kRows>{}, Int<kCols>{}), make_stride(int(row_stride), _1{})));
}

// Copy a partitioned tile into shared memory with cp.async; rows at or past `valid_rows` are
// zeroed instead (padding that meets P = 0 or a masked score must be finite).
template <class TiledCopy, class Src, class Dst, class Coords>
CUTE_DEVICE void copy_rows(TiledCopy const& tiled_copy, Src const& src, Dst&& dst, Coords const& coords,
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

// Write a shared-memory tile to global memory in 16-byte row pieces, rows below valid_rows only.
template <int kNumThreads, class STile, class GTile>
CUTE_DEVICE void store_rows(STile const& s, GTile&& g, int valid_rows) {
  using Element = typename STile::value_type;
  constexpr int kCols = decltype(size<1>(s))::value;
  auto s2g = make_tiled_copy(Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{},
                             GmemThreadLayout<kNumThreads, kCols>{}, Layout<Shape<_1, _8>>{});
  auto thr = s2g.get_thread_slice(threadIdx.x);
  Tensor ts = thr.partition_S(s);
  Tensor tg = thr.partition_D(g);
  Tensor tc = thr.partition_D(make_identity_tensor(shape(g)));
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tg); ++m) {
    if (get<0>(tc(0, m, 0)) < valid_rows) copy(s2g, ts(_, m, _), tg(_, m, _));
  }
}

struct NoHook {
  CUTE_DEVICE void operator()(int) const {}
};

// acc += A B^T over the shared k extent. sA is (M, K) and sB (N, K) in shared memory (possibly
// transposed views, read with the matching ldmatrix); rA, when given, is A already in registers
// (the P of O += P V). The next k slice is loaded while the current one multiplies. hook(k) runs
// after slice k is issued: independent work (e.g. global reductions) spread between the MMAs.
template <class AtomA, class AtomB, class TiledMma_, class Acc, class SA, class SB, class Hook = NoHook>
CUTE_DEVICE void gemm_ss(TiledMma_ const& tiled_mma, Acc& acc, SA const& sA, SB const& sB, Hook&& hook = {}) {
  int const tid = threadIdx.x;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor rA = thr_mma.partition_fragment_A(sA);
  Tensor rB = thr_mma.partition_fragment_B(sB);
  auto copy_a = make_tiled_copy_A(Copy_Atom<AtomA, typename SA::value_type>{}, tiled_mma);
  auto copy_b = make_tiled_copy_B(Copy_Atom<AtomB, typename SB::value_type>{}, tiled_mma);
  Tensor tsA = copy_a.get_thread_slice(tid).partition_S(sA);
  Tensor tsB = copy_b.get_thread_slice(tid).partition_S(sB);
  Tensor trA = copy_a.get_thread_slice(tid).retile_D(rA);
  Tensor trB = copy_b.get_thread_slice(tid).retile_D(rB);
  copy(copy_a, tsA(_, _, 0), trA(_, _, 0));
  copy(copy_b, tsB(_, _, 0), trB(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      copy(copy_a, tsA(_, _, k + 1), trA(_, _, k + 1));
      copy(copy_b, tsB(_, _, k + 1), trB(_, _, k + 1));
    }
    cute::gemm(tiled_mma, rA(_, _, k), rB(_, _, k), acc);
    hook(k);
  }
}

template <class AtomB, class TiledMma_, class Acc, class RA, class SB>
CUTE_DEVICE void gemm_rs(TiledMma_ const& tiled_mma, Acc& acc, RA const& rA, SB const& sB) {
  int const tid = threadIdx.x;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor rB = thr_mma.partition_fragment_B(sB);
  auto copy_b = make_tiled_copy_B(Copy_Atom<AtomB, typename SB::value_type>{}, tiled_mma);
  Tensor tsB = copy_b.get_thread_slice(tid).partition_S(sB);
  Tensor trB = copy_b.get_thread_slice(tid).retile_D(rB);
  copy(copy_b, tsB(_, _, 0), trB(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) copy(copy_b, tsB(_, _, k + 1), trB(_, _, k + 1));
    cute::gemm(tiled_mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// Write an accumulator-shaped 16-bit fragment into a shared-memory tile (P, dS, staged outputs).
template <class TiledMma_, class Frag, class STile>
CUTE_DEVICE void store_fragment(TiledMma_ const& tiled_mma, Frag const& frag, STile&& s) {
  auto r2s = make_tiled_copy_C(Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, typename Frag::value_type>{},
                               tiled_mma);
  auto thr = r2s.get_thread_slice(threadIdx.x);
  copy(r2s, thr.retile_S(frag), thr.partition_D(s));
}

}  // namespace flashhopper::sm80
