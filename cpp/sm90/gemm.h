// One WGMMA batch, shared by the Hopper forward and backward mainloops.
#pragma once

#include <cute/tensor.hpp>

#include <type_traits>

namespace flashhopper::sm90 {

using namespace cute;

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
