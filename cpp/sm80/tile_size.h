// Per-head-dim tiles of the Ampere (sm80) kernels. Forward: kBlockM query rows per CTA, kBlockN keys per
// iteration, four warps. Q, K and V each have one shared-memory tile; with 16-bit elements that is
// (kBlockM + 2 kBlockN) x headdim x 2 bytes, at most 96 KB, inside the 99 KB of sm_86/sm_89.
// Starting points taken from FlashAttention-2's public choices, to be measured (docs/perf-notes.md).
#pragma once

namespace flashhopper::sm80 {

template <int kHeadDim, bool kCausal>
struct FwdTileSize;

// Head dim 64: 128 x 64 measured 1.04x FA2 non-causal where 128 x 128 gave 0.93x, but 0.91-0.94x
// causal where 128 x 128 gives 0.95x (H100, 2026-11-22, docs/perf-notes.md). Build-time
// overrides for ablations (scripts/gpu.sh ablate).
#ifndef FLASHHOPPER_SM80_HDIM64_BLOCK_M
#define FLASHHOPPER_SM80_HDIM64_BLOCK_M 128
#endif
#ifndef FLASHHOPPER_SM80_HDIM64_BLOCK_N
#define FLASHHOPPER_SM80_HDIM64_BLOCK_N (kCausal ? 128 : 64)
#endif
template <bool kCausal>
struct FwdTileSize<64, kCausal> {  // 48 KB
  static constexpr int kBlockM = FLASHHOPPER_SM80_HDIM64_BLOCK_M, kBlockN = FLASHHOPPER_SM80_HDIM64_BLOCK_N;
  static constexpr int kNumWarps = 4;
};
template <bool kCausal>
struct FwdTileSize<128, kCausal> {  // 64 KB
  static constexpr int kBlockM = 128, kBlockN = 64, kNumWarps = 4;
};
template <bool kCausal>
struct FwdTileSize<256, kCausal> {  // 96 KB
  static constexpr int kBlockM = 64, kBlockN = 64, kNumWarps = 4;
};

// Backward: a CTA owns kBlockN keys and walks the query blocks of kBlockM rows. Warp tilings of
// the three GEMM shapes: kWarpsMSdP warps along the queries of S / dP (kBlockM x kBlockN),
// kWarpsNdKV along the keys of dK / dV (kBlockN x headdim), kWarpsMdQ along the queries of dQ
// (kBlockM x headdim); the other warps split the second dimension. kStagesQ = 2 double-buffers Q.
// Shared memory: (kStagesQ + 1) kBlockM x d (Q, dO) + 2 kBlockN x d (K, V) + 2 kBlockM x kBlockN
// (P, dS), 16-bit. One table per shared-memory class, kSmemKB: 99 (sm_86, sm_89), 163 (sm_80),
// 227 (sm_90); the launcher takes the largest class whose tiles fit the device. `type` names the
// table that defines the tiles, so that classes sharing tiles share one kernel.
template <int kHeadDim, bool kCausal, int kSmemKB = 227>
struct BwdTileSize;

template <int kHeadDim, bool kCausal>  // the sm_80 tiles unless a head dim has its own
struct BwdTileSize<kHeadDim, kCausal, 227> : BwdTileSize<kHeadDim, kCausal, 163> {};

template <bool kCausal>
struct BwdTileSize<64, kCausal, 163> {  // 144 KB
  using type = BwdTileSize;
  static constexpr int kBlockM = 128, kBlockN = 128, kNumWarps = 8, kStagesQ = 2;
  static constexpr int kWarpsMSdP = 4, kWarpsNdKV = 4, kWarpsMdQ = 4;
};
template <bool kCausal>
struct BwdTileSize<64, kCausal, 99> {  // 88 KB
  using type = BwdTileSize;
  static constexpr int kBlockM = 64, kBlockN = 128, kNumWarps = 8, kStagesQ = 2;
  static constexpr int kWarpsMSdP = 2, kWarpsNdKV = 4, kWarpsMdQ = 4;
};
template <bool kCausal>
struct BwdTileSize<128, kCausal, 163> {  // 144 KB
  using type = BwdTileSize;
  static constexpr int kBlockM = 64, kBlockN = 128, kNumWarps = 8, kStagesQ = 2;
  static constexpr int kWarpsMSdP = 2, kWarpsNdKV = 4, kWarpsMdQ = 2;
};
template <bool kCausal>
struct BwdTileSize<128, kCausal, 99> {  // 96 KB
  using type = BwdTileSize;
  static constexpr int kBlockM = 64, kBlockN = 64, kNumWarps = 8, kStagesQ = 2;
  static constexpr int kWarpsMSdP = 2, kWarpsNdKV = 2, kWarpsMdQ = 2;
};
template <bool kCausal>
struct BwdTileSize<256, kCausal, 227> {  // 176 KB
  using type = BwdTileSize;
  static constexpr int kBlockM = 64, kBlockN = 64, kNumWarps = 8, kStagesQ = 2;
  static constexpr int kWarpsMSdP = 4, kWarpsNdKV = 2, kWarpsMdQ = 2;
};
template <bool kCausal>
struct BwdTileSize<256, kCausal, 163> {  // 144 KB
  using type = BwdTileSize;
  static constexpr int kBlockM = 64, kBlockN = 64, kNumWarps = 8, kStagesQ = 1;
  static constexpr int kWarpsMSdP = 4, kWarpsNdKV = 2, kWarpsMdQ = 2;
};
template <bool kCausal>
struct BwdTileSize<256, kCausal, 99> {  // 84 KB
  using type = BwdTileSize;
  static constexpr int kBlockM = 32, kBlockN = 32, kNumWarps = 4, kStagesQ = 2;
  static constexpr int kWarpsMSdP = 2, kWarpsNdKV = 2, kWarpsMdQ = 2;
};

}  // namespace flashhopper::sm80
