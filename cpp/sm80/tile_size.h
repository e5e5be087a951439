// Per-head-dim tiles of the Ampere (sm80) forward kernel: kBlockM query rows per CTA, kBlockN keys per
// iteration, four warps. Q, K and V each have one shared-memory tile; with 16-bit elements that is
// (kBlockM + 2 kBlockN) x headdim x 2 bytes, at most 96 KB, inside the 99 KB of sm_86/sm_89.
// Starting points taken from FlashAttention-2's public choices, to be measured (docs/perf-notes.md).
#pragma once

namespace flashhopper::sm80 {

template <int kHeadDim, bool kCausal>
struct FwdTileSize;

template <bool kCausal>
struct FwdTileSize<64, kCausal> {  // 48 KB
  static constexpr int kBlockM = 128, kBlockN = 128, kNumWarps = 4;
};
template <bool kCausal>
struct FwdTileSize<128, kCausal> {  // 64 KB
  static constexpr int kBlockM = 128, kBlockN = 64, kNumWarps = 4;
};
template <bool kCausal>
struct FwdTileSize<256, kCausal> {  // 96 KB
  static constexpr int kBlockM = 64, kBlockN = 64, kNumWarps = 4;
};

}  // namespace flashhopper::sm80
