// Per-head-dim tile choices of the Hopper forward kernel. kBlockM rows of Q per CTA (one consumer
// warpgroup per 64 rows), kBlockN keys per iteration, kStages-deep K and V pipelines, kQStages
// Q tiles (2: the next tile's Q loads while this one computes; O is staged in the used stage).
// Starting points taken from FA3's public choices; docs/perf-notes.md records what we measured.
#pragma once

#include "../common/params.h"

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

template <int kHeadDim, bool kCausal, DType kDType>
struct FwdTileSize;

// Small head dim: softmax costs as much as the GEMMs, so three consumer warpgroups share K/V.
template <bool kCausal, DType kDType>
struct FwdTileSize<64, kCausal, kDType> : FwdTilePolicy {
  static constexpr int kBlockM = 192, kBlockN = 128, kStages = 3, kQStages = 2;
};

template <bool kCausal, DType kDType>
struct FwdTileSize<128, kCausal, kDType> : FwdTilePolicy {
  static constexpr int kBlockM = 128, kBlockN = FLASHHOPPER_HDIM128_BLOCK_N, kStages = FLASHHOPPER_HDIM128_STAGES;
  // A wider K/V tile or a third K/V stage leaves room for one Q tile only.
  static constexpr int kQStages = FLASHHOPPER_HDIM128_QSTAGES;
};

// Large head dim: the O accumulator (64x256 fp32 per warpgroup) leaves room for 80 keys, and
// shared memory for one Q tile.
template <bool kCausal, DType kDType>
struct FwdTileSize<256, kCausal, kDType> : FwdTilePolicy {
  static constexpr int kBlockM = 128, kBlockN = 80, kStages = 2, kQStages = 1;
  static constexpr bool kPingPong = kPingPongDefault && FLASHHOPPER_HDIM256_PINGPONG;
};

// FP8 (e4m3): half the bytes per K/V tile, the same registers per score. kBlockN must be a multiple of
// 32 (the fp8 PV GEMM's k) and is also the K/V scale block the kernel needs (docs/fp8.md). O has its
// own bfloat16 staging buffer (64 x headdim x 2 bytes per warpgroup). Head dim 128: 192 keys measured
// best of 96..256 with the exp2 work per GEMM fixed, fewer iterations pay less per-iteration
// synchronization; 256 spills (docs/perf-notes.md). Head dim 256: 128 (96 was 7-9% slower).
#ifndef FLASHHOPPER_FP8_HDIM128_BLOCK_N
#define FLASHHOPPER_FP8_HDIM128_BLOCK_N 192
#endif
#ifndef FLASHHOPPER_FP8_HDIM256_BLOCK_N
#define FLASHHOPPER_FP8_HDIM256_BLOCK_N 128
#endif
#ifndef FLASHHOPPER_FP8_HDIM64_BLOCK_M
#define FLASHHOPPER_FP8_HDIM64_BLOCK_M 192
#endif
#ifndef FLASHHOPPER_FP8_HDIM64_BLOCK_N
#define FLASHHOPPER_FP8_HDIM64_BLOCK_N 128
#endif
template <bool kCausal>
struct FwdTileSize<64, kCausal, DType::kFloat8E4M3> : FwdTilePolicy {
  static constexpr int kBlockM = FLASHHOPPER_FP8_HDIM64_BLOCK_M, kBlockN = FLASHHOPPER_FP8_HDIM64_BLOCK_N;
  static constexpr int kStages = 3, kQStages = 2;
};
template <bool kCausal>
struct FwdTileSize<128, kCausal, DType::kFloat8E4M3> : FwdTilePolicy {
  static constexpr int kBlockM = 128, kBlockN = FLASHHOPPER_FP8_HDIM128_BLOCK_N, kStages = 2, kQStages = 2;
};
// Q 32 KB, K and V 2 x 32 KB each, O 64 KB: 224 KB of the 227.
template <bool kCausal>
struct FwdTileSize<256, kCausal, DType::kFloat8E4M3> : FwdTilePolicy {
  static constexpr int kBlockM = 128, kBlockN = FLASHHOPPER_FP8_HDIM256_BLOCK_N, kStages = 2, kQStages = 1;
};

// Where V gets transposed for the FP8 PV GEMM (issue #7). Default: the quantization pass writes V^T
// (docs/fp8.md). Ablation build FLASHHOPPER_FP8_V_TRANSPOSE_IN_KERNEL: the kernels at head dims 64 and 128
// take V row-major (batch, seqlen, heads, headdim) like K; TMA loads it into stages of its own and producer
// warps transpose it into the V^T stages (mainloop_fwd.h, VTranspose): +2 x 24 KB of shared memory at
// d128 (128x192: 161 -> 209 KB), +3 x 8 KB at d64 (192x128: 97 -> 121 KB). Head dim 256 keeps V^T: its
// 128x128 two-stage tile already takes 225 of the 227 KB, and two row-major V stages would need 64 KB more.
#ifdef FLASHHOPPER_FP8_V_TRANSPOSE_IN_KERNEL
inline constexpr bool kFp8VTransposeInKernel = true;
#else
inline constexpr bool kFp8VTransposeInKernel = false;
#endif
// True when the FP8 forward kernel of this head dim takes row-major V and transposes it itself
// (the extension reports it to Python: _C.fp8_v_transposed_in_kernel).
constexpr bool fp8_v_transposed_in_kernel(int headdim) { return kFp8VTransposeInKernel && headdim <= 128; }

// ---------------------------------------------------------------------------------------------
// Backward. A CTA owns kBlockN keys (dK and dV stay in registers, split over two consumer
// warpgroups) and walks kBlockM-row query blocks. Two ways to lay the GEMMs out:
//  - kSdPSwapAB (head dims 64, 128): compute S^T = K Q^T and dP^T = V dO^T, so each warpgroup owns
//    64 keys as its accumulator rows. P^T and dS^T are then already the register A operands of
//    dV += P^T dO and dK += dS^T Q (no trip through shared memory); only dS is stored, for dQ.
//  - otherwise (head dim 256, where one warpgroup cannot hold 64 keys x 256 of both dK and dV):
//    S = Q K^T split over keys, P and dS go through shared memory, and dV^T = dO^T P,
//    dK^T = Q^T dS split over the head dim (kdKVSwapAB), 128 head-dim rows per warpgroup.
// dQ = dS K (kBlockM x headdim) is split over the head dim and summed over the key blocks in a
// float32 buffer by bulk reduce-adds of each warpgroup's share, staged in shared memory; at head
// dim 256 in column slices (kdQSlices) added from registers, except in the deterministic mode
// (mainloop_bwd.h).
// Head dim 128: 64 query rows per step. 80 (FLASHHOPPER_BWD_HDIM128_BLOCK_M=80; dQ^T is then the
// GEMM, kdQSwapAB, as 80 is no WGMMA M) asks ~8% less of shared memory per FLOP but ran 10% slower
// at 2k, short of registers (docs/perf-notes.md).
#ifndef FLASHHOPPER_BWD_HDIM128_BLOCK_M
#define FLASHHOPPER_BWD_HDIM128_BLOCK_M 64
#endif
#ifndef FLASHHOPPER_BWD_HDIM128_CAUSAL_BLOCK_M
#define FLASHHOPPER_BWD_HDIM128_CAUSAL_BLOCK_M 64
#endif
// Causal backward CTA order: heaviest key blocks first across sections of heads holding this many
// waves of CTAs (tile_scheduler.h); 0 keeps one head per section.
#ifndef FLASHHOPPER_BWD_CAUSAL_SECTION_WAVES
#define FLASHHOPPER_BWD_CAUSAL_SECTION_WAVES 0
#endif
inline constexpr int kBwdCausalSectionWaves = FLASHHOPPER_BWD_CAUSAL_SECTION_WAVES;

template <int kHeadDim, bool kCausal>
struct BwdTileSize;

// kStages: Q (with its LSE) stages; kStagesdO: dO (with D) stages; kStagesdS: P/dS buffers;
// kdQSlices: dQ column slices per query block; kdQSwapAB: compute dQ^T (for kBlockM not 64).
template <bool kCausal>
struct BwdTileSize<64, kCausal> {
  static constexpr int kBlockM = 64, kBlockN = 128, kStages = 2, kStagesdO = 2, kStagesdS = 2, kdQSlices = 1;
  static constexpr bool kSdPSwapAB = true, kdKVSwapAB = false, kdQSwapAB = false;
};

// Ablation FLASHHOPPER_BWD_HDIM128_S_LAYOUT: head dim 256's layout (S, P/dS through shared memory,
// dK^T/dV^T), FA3's choice for causal head dim 128.
#ifdef FLASHHOPPER_BWD_HDIM128_S_LAYOUT
template <bool kCausal>
struct BwdTileSize<128, kCausal> {
  static constexpr int kBlockM = 64, kBlockN = 128, kStages = 2, kStagesdO = 2, kStagesdS = FLASHHOPPER_BWD_HDIM128_S_LAYOUT, kdQSlices = 1;
  static constexpr bool kSdPSwapAB = false, kdKVSwapAB = true, kdQSwapAB = false;
};
#else
template <bool kCausal>
struct BwdTileSize<128, kCausal> {
  static constexpr int kBlockM = kCausal ? FLASHHOPPER_BWD_HDIM128_CAUSAL_BLOCK_M : FLASHHOPPER_BWD_HDIM128_BLOCK_M;
  static constexpr int kBlockN = 128, kStages = 2, kStagesdO = 2, kStagesdS = 2, kdQSlices = 1;
  static constexpr bool kSdPSwapAB = true, kdKVSwapAB = false, kdQSwapAB = kBlockM % 64 != 0;
};
#endif

#ifndef FLASHHOPPER_BWD_HDIM256_BLOCK_N
#define FLASHHOPPER_BWD_HDIM256_BLOCK_N 80
#endif
#ifndef FLASHHOPPER_BWD_HDIM256_DQ_SLICES
#define FLASHHOPPER_BWD_HDIM256_DQ_SLICES (FLASHHOPPER_BWD_HDIM256_BLOCK_N > 64 ? 4 : 2)
#endif
#ifndef FLASHHOPPER_BWD_HDIM256_DS_STAGES
#define FLASHHOPPER_BWD_HDIM256_DS_STAGES 1
#endif
// Head dim 256: 80 keys per CTA (20% less Q/dO traffic per FLOP than 64; dK^T/dV^T take 160
// registers), dQ in four 32-column slices to fit the registers (and, where dQ goes through TMA: the
// deterministic mode and FLASHHOPPER_BWD_DQ_TMA, the staging); one P/dS buffer (a second: +0-1%).
template <bool kCausal>
struct BwdTileSize<256, kCausal> {
  // One dO stage: it is released mid-iteration (after dV), so the next one loads under the dQ/dK GEMMs.
  static constexpr int kBlockM = 64, kBlockN = FLASHHOPPER_BWD_HDIM256_BLOCK_N, kStages = 2, kStagesdO = 1;
  static constexpr int kStagesdS = FLASHHOPPER_BWD_HDIM256_DS_STAGES, kdQSlices = FLASHHOPPER_BWD_HDIM256_DQ_SLICES;
  static constexpr bool kSdPSwapAB = false, kdKVSwapAB = true, kdQSwapAB = false;
};

}  // namespace flashhopper::sm90
