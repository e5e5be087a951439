// Per-head-dim tile choices of the Hopper forward kernel. kBlockM rows of Q per CTA (one consumer
// warpgroup per 64 rows), kBlockN keys per iteration, kStages-deep K and V pipelines, kQStages
// Q tiles (2: the next tile's Q loads while this one computes; O is staged in the used stage).
// Starting points taken from FA3's public choices; docs/perf-notes.md records what we measured.
#pragma once

namespace flashhopper::sm90 {

// Ablation builds (docs/perf-notes.md) turn mechanisms off to measure what each is worth.
#ifdef FLASHHOPPER_NO_PINGPONG
inline constexpr bool kPingPongDefault = false;
#else
inline constexpr bool kPingPongDefault = true;
#endif
#ifdef FLASHHOPPER_NO_OVERLAP
inline constexpr bool kOverlapDefault = false;
#else
inline constexpr bool kOverlapDefault = true;
#endif
#ifndef FLASHHOPPER_HDIM128_BLOCK_N
#define FLASHHOPPER_HDIM128_BLOCK_N 128
#endif
#ifndef FLASHHOPPER_HDIM128_STAGES
#define FLASHHOPPER_HDIM128_STAGES 2
#endif
#ifndef FLASHHOPPER_HDIM128_QSTAGES
#define FLASHHOPPER_HDIM128_QSTAGES (FLASHHOPPER_HDIM128_BLOCK_N > 128 || FLASHHOPPER_HDIM128_STAGES > 2 ? 1 : 2)
#endif

#ifndef FLASHHOPPER_HDIM256_PINGPONG
#define FLASHHOPPER_HDIM256_PINGPONG 1
#endif
struct FwdTilePolicy {
  static constexpr bool kPingPong = kPingPongDefault, kOverlap = kOverlapDefault;
};

template <int kHeadDim, bool kCausal>
struct FwdTileSize;

// Small head dim: softmax costs as much as the GEMMs, so three consumer warpgroups share K/V.
template <bool kCausal>
struct FwdTileSize<64, kCausal> : FwdTilePolicy {
  static constexpr int kBlockM = 192, kBlockN = 128, kStages = 3, kQStages = 2;
};

template <bool kCausal>
struct FwdTileSize<128, kCausal> : FwdTilePolicy {
  static constexpr int kBlockM = 128, kBlockN = FLASHHOPPER_HDIM128_BLOCK_N, kStages = FLASHHOPPER_HDIM128_STAGES;
  // A wider K/V tile or a third K/V stage leaves room for one Q tile only.
  static constexpr int kQStages = FLASHHOPPER_HDIM128_QSTAGES;
};

// Large head dim: the O accumulator (64x256 fp32 per warpgroup) leaves room for 80 keys, and
// shared memory for one Q tile.
template <bool kCausal>
struct FwdTileSize<256, kCausal> : FwdTilePolicy {
  static constexpr int kBlockM = 128, kBlockN = 80, kStages = 2, kQStages = 1;
  static constexpr bool kPingPong = kPingPongDefault && FLASHHOPPER_HDIM256_PINGPONG;
};

}  // namespace flashhopper::sm90
