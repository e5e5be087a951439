// Per-head-dim tiles of the Ampere (sm80) kernels. Forward: kBlockM query rows per CTA, kBlockN keys per
// iteration. Q, K and V each have one shared-memory tile; with 16-bit elements that is
// (kBlockM + 2 kBlockN) x headdim x 2 bytes. As for the backward (below), one table per
// shared-memory class kSmemKB: 99 (sm_86, sm_89), 163 (sm_80), 227 (sm_90); `type` names the table
// that defines the tiles. Starting points taken from FlashAttention-2's public choices, measured
// (docs/perf-notes.md).
#pragma once

#include "../common/device_info.h"
#include "../common/params.h"

namespace flashhopper::sm80 {

// The largest shared-memory class whose tiles fit the device (or the caller's limit, p.max_smem_bytes):
// 227, 163 or 99. Cfg<Config, kSmemKB>::Kernel::kSmemBytes is what that class's kernel asks for.
template <template <class, int> class Cfg, class Config, class Params>
int smem_class(Params const& p) {
  int const limit = p.max_smem_bytes > 0 ? p.max_smem_bytes : device_info(p.device).max_smem_optin;
  if (Cfg<Config, 227>::Kernel::kSmemBytes <= limit) return 227;
  if (Cfg<Config, 163>::Kernel::kSmemBytes <= limit) return 163;
  return 99;
}

// kCausal: the tiles of the masks with a right edge (causal, window), whose tiles cost unevenly.
template <int kHeadDim, bool kCausal, int kSmemKB = 227>
struct FwdTileSize;

template <int kHeadDim, bool kCausal>  // the sm_80 tiles unless a head dim has its own
struct FwdTileSize<kHeadDim, kCausal, 227> : FwdTileSize<kHeadDim, kCausal, 163> {};
template <int kHeadDim, bool kCausal>  // the 99 KB tiles unless a head dim has its own
struct FwdTileSize<kHeadDim, kCausal, 163> : FwdTileSize<kHeadDim, kCausal, 99> {};

// Head dim 64: 128 x 64 measured 1.04x FA2 non-causal where 128 x 128 gave 0.93x, but 0.91-0.94x
// causal where 128 x 128 gave 0.95x (H100, 2026-11-22, before the row-check-free K/V loads, which
// took the kept tiles to 1.08-1.15x; docs/perf-notes.md).
template <bool kCausal>
struct FwdTileSize<64, kCausal, 99> {  // 48 KB
  using type = FwdTileSize;
  static constexpr int kBlockM = 128, kBlockN = kCausal ? 128 : 64;
  static constexpr int kNumWarps = 4;
};
template <bool kCausal>
struct FwdTileSize<96, kCausal, 99> {  // 48 KB; a starting point from FA2's choices, not yet measured here
  using type = FwdTileSize;
  static constexpr int kBlockM = 128, kBlockN = 64, kNumWarps = 4;
};
template <bool kCausal>
struct FwdTileSize<128, kCausal, 99> {  // 64 KB
  using type = FwdTileSize;
  static constexpr int kBlockM = 128, kBlockN = 64, kNumWarps = 4;
};
template <bool kCausal>
struct FwdTileSize<192, kCausal, 99> {  // 96 KB; a starting point from FA2's choices, not yet measured here
  using type = FwdTileSize;
  static constexpr int kBlockM = 128, kBlockN = 64, kNumWarps = 8;
};
template <bool kCausal>
struct FwdTileSize<256, kCausal, 99> {  // 96 KB
  using type = FwdTileSize;
  static constexpr int kBlockM = 64, kBlockN = 64, kNumWarps = 4;
};
// Head dim 256 with more than 99 KB, non-causal: 128 query rows on 8 warps share each K/V tile
// (FA2's choice): 1.02-1.06x FA2 where 64 x 64 gave 0.99-1.02x. Causal keeps 64 x 64 (1.03-1.14x;
// 128 x 64 gave 0.98x at 1k). H100, 2026-11-22, docs/perf-notes.md.
template <>
struct FwdTileSize<256, false, 163> {  // 128 KB
  using type = FwdTileSize;
  static constexpr int kBlockM = 128, kBlockN = 64, kNumWarps = 8;
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
// Head dim 96: hd128's tiles, but dQ (and at 99 KB dK / dV) on 4 warps along the rows, so that
// the other two split 96 columns into 3 x 32.
template <bool kCausal>
struct BwdTileSize<96, kCausal, 163> {  // 116 KB; a starting point from FA2's choices, not yet measured here
  using type = BwdTileSize;
  static constexpr int kBlockM = 64, kBlockN = 128, kNumWarps = 8, kStagesQ = 2;
  static constexpr int kWarpsMSdP = 2, kWarpsNdKV = 4, kWarpsMdQ = 4;
};
template <bool kCausal>
struct BwdTileSize<96, kCausal, 99> {  // 76 KB; a starting point from FA2's choices, not yet measured here
  using type = BwdTileSize;
  static constexpr int kBlockM = 64, kBlockN = 64, kNumWarps = 8, kStagesQ = 2;
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
// Head dim 192: hd256's tiles; double-buffered Q fits 163 KB too.
template <bool kCausal>
struct BwdTileSize<192, kCausal, 163> {  // 136 KB; a starting point from FA2's choices, not yet measured here
  using type = BwdTileSize;
  static constexpr int kBlockM = 64, kBlockN = 64, kNumWarps = 8, kStagesQ = 2;
  static constexpr int kWarpsMSdP = 4, kWarpsNdKV = 2, kWarpsMdQ = 2;
};
template <bool kCausal>
struct BwdTileSize<192, kCausal, 99> {  // 64 KB; a starting point from hd256's tiles, not yet measured here
  using type = BwdTileSize;
  static constexpr int kBlockM = 32, kBlockN = 32, kNumWarps = 4, kStagesQ = 2;
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
