// One WGMMA batch, shared by the Hopper forward and backward mainloops.
#pragma once

#include <cute/tensor.hpp>

#include <type_traits>

namespace flashhopper::sm90 {

using namespace cute;

// CuTe's WGMMA atom for a (64, N, K) tile, checked to be one atom of the tile's whole N. CuTe has every N from 8 to
// 256 in steps of 8 only under CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (else 8, 16, 32, 64, 96, 128, 192, 256), and
// without it picks a narrower atom that divides N, silently: more and smaller WGMMAs. That define's headers cost
// every translation unit ~30 s of compiling on a 2-core machine (a d128 unit: 109 s with, 71 without), so the
// generator sets it only in the units whose tiles need it (generate_kernels.py: extended_wgmma_shapes); a tile that
// needs it elsewhere fails to compile here.
template <class MmaOp, class TileShape>
CUTE_HOST_DEVICE constexpr MmaOp checked_atom() {
  constexpr int kAtomN = size<1>(typename MMA_Traits<MmaOp>::Shape_MNK{});
  constexpr int kTileN = size<1>(TileShape{});
  static_assert(kAtomN == kTileN,
                "no WGMMA atom of the tile's N: add this unit to extended_wgmma_shapes in cpp/generate_kernels.py");
  return MmaOp{};
}
template <class ElementA, class ElementB, class ElementC, class TileShape, GMMA::Major kMajorA = GMMA::Major::K,
          GMMA::Major kMajorB = GMMA::Major::K>
CUTE_HOST_DEVICE constexpr auto ss_atom() {
  return checked_atom<decltype(GMMA::ss_op_selector<ElementA, ElementB, ElementC, TileShape, kMajorA, kMajorB>()),
                      TileShape>();
}
template <class ElementA, class ElementB, class ElementC, class TileShape, GMMA::Major kMajorA = GMMA::Major::K,
          GMMA::Major kMajorB = GMMA::Major::K>
CUTE_HOST_DEVICE constexpr auto rs_atom() {
  return checked_atom<decltype(GMMA::rs_op_selector<ElementA, ElementB, ElementC, TileShape, kMajorA, kMajorB>()),
                      TileShape>();
}

// Fence the operands, issue all k-blocks, commit; then wait until at most kWait batches of this
// warpgroup are in flight (kWait < 0: do not wait). A comes from registers (RS) or a shared-memory
// descriptor (SS); the accumulator is zeroed first when kZeroInit.
template <bool kZeroInit, int kWait, class TiledMma, class TA, class TB, class TC>
CUTE_DEVICE void wgmma(TiledMma& mma, TA const& tA, TB const& tB, TC& tC) {
  constexpr bool kARegs = !std::is_same_v<typename TA::iterator, GMMA::DescriptorIterator>;
  if constexpr (kARegs) warpgroup_fence_operand(const_cast<TA&>(tA));
  warpgroup_fence_operand(tC);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tA); ++k) {
    cute::gemm(mma, tA(_, _, k), tB(_, _, k), tC);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(tC);
  if constexpr (kARegs) warpgroup_fence_operand(const_cast<TA&>(tA));
}

// C = A0 B + A1 B in one batch, both A from shared memory (SS): the e4m3 cache's S, q split into two e4m3 terms.
template <int kWait, class TiledMma, class TA, class TB, class TC>
CUTE_DEVICE void wgmma_sum(TiledMma& mma, TA const& tA0, TA const& tA1, TB const& tB, TC& tC) {
  static_assert(std::is_same_v<typename TA::iterator, GMMA::DescriptorIterator>, "SS only");
  warpgroup_fence_operand(tC);
  warpgroup_arrive();
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tA0); ++k) {
    cute::gemm(mma, tA0(_, _, k), tB(_, _, k), tC);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tA1); ++k) cute::gemm(mma, tA1(_, _, k), tB(_, _, k), tC);
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(tC);
}

}  // namespace flashhopper::sm90
