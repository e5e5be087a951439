// Per-head-dim tile choices of the Hopper kernels. Forward: kBlockM rows of Q per CTA (one consumer
// warpgroup per 64 rows), kBlockN keys per iteration, kStages-deep K and V pipelines, kQStages Q tiles
// (2: the next tile's Q loads while this one computes; O is staged in the used stage), ping-pong
// between the consumer warpgroups. Starting points taken from FA3's public choices; docs/perf-notes.md
// records what we measured, including the alternatives that lost (they are not kept as switches). A
// variant worth keeping overrides a table through sm90/variants.h and is instantiated by name.
#pragma once

#include "../common/params.h"

namespace flashhopper::sm90 {

// kHeadDimV: V's (and O's) head dim where it differs from Q/K's.
template <int kHeadDim, DType kDType, int kHeadDimV = kHeadDim>
struct FwdTileSize;

struct FwdTileDefaults {
  static constexpr bool kPingPong = true;
  // K/V stages released by one thread per consumer warpgroup, not by all of them (sm90/pipeline_wg_release.h):
  // ptxas can then run exponentials under the PV GEMM. Measured per head dim (perf-notes, session 15): +1-2% bf16 and
  // +4-6% e4m3 non-causal at 128; 1-3% slower at 64 and 256, whose loops it left worse.
  static constexpr bool kWarpgroupRelease = false;
  // The PV GEMM waited for before the softmax, not after it. e4m3: ptxas hoists that wait above the exponentials
  // anyway (SASS, session 41), but with the wait written after them it converts P into spare registers and moves the
  // words into the PV GEMM's A-operand registers with a PRMT each (20 per step at head dim 64, 26 at 128); written
  // first, the conversion lands in half of them directly.
  static constexpr bool kPvWaitFirst = false;
  // e4m3: the 32-block descale window (mainloop_fwd.h: kDescaleWindow) opened before the first GEMM, and used by
  // kernels with a right edge (causal, windows) too, whose unmasked steps otherwise load their k and v descales per
  // block (~30 instructions a step at head dim 64: SASS, session 41).
  static constexpr bool kEarlyDescaleWindow = false;
  // O's rescale written into the exponential loop (OnlineSoftmax::update_rescaling) with the PV wait after the row
  // maxes, in kernels without a right edge (mainloop_fwd.h). ptxas still puts the multiplies after the exponentials,
  // but the loop is ~25 instructions shorter: e4m3 d128 non-causal +1.9-2.8% from 1k (S43V, session 43).
  static constexpr bool kRescaleInExp = false;
  // Kernels with a right edge (causal, windows) too take kRescaleInExp, with K's release, and so the PV GEMM's wait
  // that ptxas keeps after it, predicated on an exponential of the step: ptxas then runs all the exponentials under
  // the PV GEMM (99 of 99 at e4m3 d128 causal; 2 unanchored). e4m3 d128 causal +0.5-2.4% from 1k (S44XE, S45QS);
  // non-causal lost 1.6-2.7% anchored (S44XE), so kernels without a right edge keep kRescaleInExp's own place.
  static constexpr bool kAnchorPvWait = false;
  // CTAs per cluster along the query tiles: 1, or 2 in CtaPairs<Tile> (below).
  static constexpr int kClusterM = 1;
  // Padded non-causal calls (no score mod, no dropout) with at least this many keys run CtaPairs<Tile>
  // (launch_fwd.h: use_cta_pairs); 0: never.
  static constexpr int kPairsFromKeys = 0;
  // Registers the pair's producer warpgroup takes from the consumers (kernel_fwd.h): its share of each block
  // (its rank's TMA coordinates) spilled 56 bytes at 24 (16-bit d128).
  static constexpr int kPairsProducerRegs = 16;
  // Padded calls of at most kShortKeysMax keys run ShortKeys<Tile> (below; launch_fwd.h: use_short_keys), whose
  // tiles hold kShortKeysBlockN keys (0: never) and kShortKeysBlockM query rows (0: the tile's).
  static constexpr int kShortKeysBlockN = 0, kShortKeysMax = 0, kShortKeysBlockM = 0;
  // The short tile only for kernels with a mask (causal, windows), where it was measured faster.
  static constexpr bool kShortKeysMaskedOnly = false;
  // Kernels without a mask (no causal or window edge) take kNoMaskBlockN keys a block where it is set (NoMaskKeys).
  static constexpr int kNoMaskBlockN = 0;
};

// Two-CTA clusters on neighbouring query tiles of one head: each CTA loads half of every K/V block and multicasts it
// to both, so L2 serves each K/V byte once per pair (FA3's non-causal cluster). Session 38, H100, 3 processes x 3
// rounds against the one-CTA kernel: head dim 128 +2.6-4.3% from 2k keys, -1.5% at 1k; 256 +2.5-3.4% from 2k
// (perf-notes, session 38). A head with an odd number of query tiles pays one more tile (kernel_fwd.h: tile_work).
template <class Tile>
struct CtaPairs : Tile {
  static constexpr int kClusterM = 2;
};

// Kernels without a mask: no partial blocks on a diagonal or window edge, so a longer key block only spreads the
// per-block softmax and barrier costs over more keys (launch_fwd.h: FwdConfig picks it for MaskKind::kNone).
template <class Tile>
struct NoMaskKeys : Tile {
  static constexpr int kBlockN = Tile::kNoMaskBlockN;
};

// Short key ranges: a tile of fewer keys where the row's keys are few enough that the last block's padding costs
// more than the smaller tile's per-key overhead (e4m3 d128: 1024 keys are 5 1/3 blocks of 192, 9.4% more score
// work than keys, 8 blocks of 128), or of fewer rows where the long tile's last query block is mostly padding
// (head dim 96: 512 rows are 2 2/3 tiles of 192). It reads K/V scales in blocks of its own block_n (launch_fwd.h:
// use_short_keys).
template <class Tile>
struct ShortKeys : Tile {
  static constexpr int kBlockN = Tile::kShortKeysBlockN;
  static constexpr int kBlockM = Tile::kShortKeysBlockM > 0 ? Tile::kShortKeysBlockM : Tile::kBlockM;
  static constexpr int kPairsFromKeys = 0;
};

// Small head dim: softmax costs as much as the GEMMs, so three consumer warpgroups share K/V.
template <DType kDType>
struct FwdTileSize<64, kDType> : FwdTileDefaults {
  static constexpr int kBlockM = 192, kBlockN = 128, kStages = 3, kQStages = 2;
};

// Head dim 96: the 64's layout (three consumer warpgroups); 96 columns take the 64-byte swizzle.
// A starting point (FA3 uses 192 x 144), measured in docs/perf-notes.md.
template <DType kDType>
struct FwdTileSize<96, kDType> : FwdTileDefaults {
  static constexpr int kBlockM = 192, kBlockN = 96, kStages = 2, kQStages = 2;
  // Without a mask, 112 keys a block: +1-3% from 2k (S54T); the causal kernel lost 3.6% at 2k with them (8k-16k even),
  // and the masked softcap / window / dropout kernels spilled 8-72 bytes at 112 (perf-notes, session 54).
  static constexpr int kNoMaskBlockN = 112;
  // Up to 1024 queries and keys, 128 x 128 on two consumer warpgroups: +8-10% at 512 tokens (three 192-row tiles
  // cover 576 rows), causal +8% at 1k; from 2k it is 5-11% slower (perf-notes, session 38: m128).
  static constexpr int kShortKeysBlockM = 128, kShortKeysBlockN = 128, kShortKeysMax = 1024;
  // K/V stages released by one thread per warpgroup, as at 128: non-causal 1k +3.6% (the short tile), other cells of
  // 512-8k even, causal even (S56B, perf-notes session 56).
  static constexpr bool kWarpgroupRelease = true;
};

// 128 x 128 with two Q stages beat 128 x 176 (FA3's) and three K/V stages (perf-notes, v3 ablations).
template <DType kDType>
struct FwdTileSize<128, kDType> : FwdTileDefaults {
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2, kQStages = 2;
  static constexpr bool kWarpgroupRelease = true;
  static constexpr int kPairsFromKeys = 2048;
};

// Large head dim: the O accumulator (64x256 fp32 per warpgroup) leaves room for 80 keys, and
// shared memory for one Q tile. Without ping-pong: +1-5% in every cell of two runs (perf-notes, session 13):
// the softmax of 80 keys is short against two 256-wide GEMMs, so the turns only added waits.
template <DType kDType>
struct FwdTileSize<256, kDType> : FwdTileDefaults {
  static constexpr int kBlockM = 128, kBlockN = 80, kStages = 2, kQStages = 1;
  static constexpr bool kPingPong = false;
  static constexpr int kPairsFromKeys = 2048;
};

// Head dim 192: O takes 96 registers per thread, S 56 at 112 keys; Q 48 KB, K and V 2 x 42 KB each.
// A starting point (FA3's choice), measured in docs/perf-notes.md.
template <DType kDType>
struct FwdTileSize<192, kDType> : FwdTileDefaults {
  static constexpr int kBlockM = 128, kBlockN = 112, kStages = 2, kQStages = 1;
};

// Q/K 192, V 128 (DeepSeek-V3's prefill): O as at head dim 128, 128 keys; Q 48 KB, K 2 x 48 KB, V 2 x 32 KB.
// Starting points (FA3's), measured in docs/perf-notes.md.
template <DType kDType>
struct FwdTileSize<192, kDType, 128> : FwdTileDefaults {
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2, kQStages = 1;
};
// Q/K 128, V 64 forward: head dim 64's 192 x 128 on three consumer warpgroups (O takes 32 registers, as at 64):
// +7-10% non-causal from 2k and causal from 8k against head dim 128's 128 x 128; causal at 512 tokens 15% slower
// (3 tiles of 192 rows for 512; perf-notes, session 19).
template <DType kDType>
struct FwdTileSize<128, kDType, 64> : FwdTileDefaults {
  static constexpr int kBlockM = 192, kBlockN = 128, kStages = 2, kQStages = 2;
  // Causal (and window) calls of up to 1024 queries and keys: 128 x 128 on two consumer warpgroups, as head dim 96's
  // short tile: +9.5% at 512, +9.8% at 1k (three 192-row tiles cover 576 of 512 rows); without a mask it ran 2-3%
  // slower there, so those kernels keep 192 x 128 (perf-notes, S55V).
  static constexpr int kShortKeysBlockM = 128, kShortKeysBlockN = 128, kShortKeysMax = 1024;
  static constexpr bool kShortKeysMaskedOnly = true;
};

// FP8 (e4m3): half the bytes per K/V tile, the same registers per score. kBlockN must be a multiple of
// 32 (the fp8 PV GEMM's k) and is also the K/V scale block the kernel needs (docs/fp8.md). O has its
// own bfloat16 staging buffer (64 x headdim x 2 bytes per warpgroup). Head dim 128: 192 keys measured
// best of 96..256 (fewer iterations pay less per-iteration synchronization; 256 spills). Head dim 256:
// 128 (96 was 7-9% slower). Head dim 64: 192 x 160 (FA3's; 128 was 3% slower causal from 8k, 1% faster causal at 2k,
// even non-causal: session 14), without ping-pong: its loop is not paced by the tensor cores, so the turns only cost
// waits (FA3's has none either; +1-4% from 8k, session 13).
template <>
struct FwdTileSize<64, DType::kFloat8E4M3> : FwdTileDefaults {
  static constexpr int kBlockM = 192, kBlockN = 160, kStages = 3, kQStages = 2;
  static constexpr bool kPingPong = false;
  // Both +2-4% causal from 2k, +0-1% non-causal (S42PG). At 128 and 256 both lost 1-5% (S42PG): off there.
  static constexpr bool kPvWaitFirst = true;
  static constexpr bool kEarlyDescaleWindow = true;
};
template <>
struct FwdTileSize<128, DType::kFloat8E4M3> : FwdTileDefaults {
  static constexpr int kBlockM = 128, kBlockN = 192, kStages = 2, kQStages = 2;
  static constexpr bool kWarpgroupRelease = true;
  static constexpr bool kRescaleInExp = true, kAnchorPvWait = true;
  // CTA pairs: +0.6-1.2% from 2k (session 38). Not at head dim 64: -2% at 4k, even elsewhere (session 39).
  static constexpr int kPairsFromKeys = 2048;
  // 128 keys up to 1024: +4.4-6.5% at 512-1k, -2.6-2.9% non-causal at 2k-4k (S44N, S45QS). A 96-key tile (which
  // would read 192-key scales) costs ~12% more per key than 192 by S44N's fit and loses at 1k (perf-notes, session 44).
  static constexpr int kShortKeysBlockN = 128, kShortKeysMax = 1024;
};
// Q 32 KB, K and V 2 x 32 KB each, O 64 KB: 224 KB of the 227. CTA pairs with the producer at its 24 registers
// (40 bytes of spill; with 16 more, the consumers' 8 fewer spilled 84 bytes and lost 22%): +2.7-5.8% from 2k
// (session 39).
template <>
struct FwdTileSize<256, DType::kFloat8E4M3> : FwdTileDefaults {
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2, kQStages = 1;
  static constexpr int kPairsFromKeys = 2048, kPairsProducerRegs = 0;
};

// KV caches of e4m3 read by 16-bit queries (KVCacheKind::kE4M3): TMA lands each block in e4m3 stages
// (kCacheStages deep, with the block's per-token scales); the consumers' S GEMMs read K's as they are, and the
// producer warpgroup's other warps transpose V's into the kStages V^T e4m3 stages of the PV GEMM. Two consumer
// warpgroups at every head dim (decode fills few rows; the converters need the producer warpgroup's registers).
// Head dim 128: 128 keys (Q 32 KB, V^T 2 x 16 KB, e4m3 3 x 2 x 16 KB: 165 KB with the scales); pages of 128 rows
// are then whole blocks (112 keys lost to 128 in pages of 128 by 40%: docs/perf-notes.md, T5). 3 e4m3 stages: 4
// measured 0-4% slower (F6); 3 V^T stages, with 3 or 4 e4m3 stages, even (S48V). Head dim 256: 64 keys (Q 64 KB,
// V^T 2 x 16 KB, e4m3 3 x 2 x 16 KB).
template <int kHeadDim>
struct FwdFp8CacheTileSize : FwdTileDefaults {
  static constexpr int kBlockM = 128, kBlockN = kHeadDim == 256 ? 64 : 128, kQStages = 1;
  static constexpr int kStages = 2, kCacheStages = 3;
};

// ---------------------------------------------------------------------------------------------
// Backward. A CTA owns kBlockN keys (dK and dV stay in registers, split over two consumer
// warpgroups) and walks kBlockM-row query blocks. Two ways to lay the GEMMs out:
//  - kSdPSwapAB (head dims 64, 128): compute S^T = K Q^T and dP^T = V dO^T, so each warpgroup owns
//    64 keys as its accumulator rows. P^T and dS^T are then already the register A operands of
//    dV += P^T dO and dK += dS^T Q (no trip through shared memory); only dS is stored, for dQ.
//  - otherwise (head dim 256, where one warpgroup cannot hold 64 keys x 256 of both dK and dV):
//    S = Q K^T split over keys, P and dS go through shared memory, and dV^T = dO^T P,
//    dK^T = Q^T dS (kdKVSwapAB), split over the head dim where each warpgroup gets whole 64-row
//    WGMMA atoms (256: 128 rows each), mirrored over uneven shares at Q/K 192 (kdKVMirror).
// dQ = dS K (kBlockM x headdim), in kdQSlices column slices, is split over the warpgroups by columns at 64 rows
// and by rows at 128, or computed as dQ^T = K^T dS^T in 64-row head-dim atoms (kdQSwapAB), and summed over the
// key blocks in a float32 buffer (mainloop_bwd.h: DqPath).
// kStages: Q (with its LSE) stages; kStagesdO: dO (with D) stages; kStagesdS: P/dS buffers.
template <int kHeadDim, int kHeadDimV = kHeadDim>
struct BwdTileSize;

// Head dim 64: 128 query rows per step (64 paid every per-step cost twice per FLOP: 1.48x FA3's instructions,
// perf-notes L10; 128 rows: 1.04-1.08x from 2k). S^T and dP^T take 64 registers each per thread.
template <>
struct BwdTileSize<64> {
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2, kStagesdO = 2, kStagesdS = 2, kdQSlices = 1;
  static constexpr bool kSdPSwapAB = true, kdKVSwapAB = false, kdQSwapAB = false, kdKVMirror = false;
  static constexpr bool kExpUnderdP = false;
};

// Head dim 64 in 64-row steps, for the kernels whose element work does not fit beside 128-row S^T/dP^T tiles:
// there dropout spilled 192 bytes and softcap 46, and their training steps ran 5-10% slower (perf-notes, W5).
struct BwdTileHeadDim64Rows64 {
  static constexpr int kBlockM = 64, kBlockN = 128, kStages = 2, kStagesdO = 2, kStagesdS = 2, kdQSlices = 1;
  static constexpr bool kSdPSwapAB = true, kdKVSwapAB = false, kdQSwapAB = false, kdKVMirror = false;
  static constexpr bool kExpUnderdP = false;
};

// 64 query rows per step; 80 (dQ^T as the GEMM) asked less of shared memory per FLOP but ran 10%
// slower, and head dim 256's layout (FA3's choice at 128) lost too (perf-notes, backward v6).
// kExpUnderdP: the LSE read as the S GEMM goes out and P's exponentials before the mask (masked P set to 0), so that
// they run under the dP GEMM: here +2-3% non-causal, +0-1% causal from 2k (-2.5% at 1k); at head dims 64 and 256 the
// same order was 6-9% and 1-4% slower (perf-notes, S40A / S40E).
template <>
struct BwdTileSize<128> {
  static constexpr int kBlockM = 64, kBlockN = 128, kStages = 2, kStagesdO = 2, kStagesdS = 2, kdQSlices = 1;
  static constexpr bool kSdPSwapAB = true, kdKVSwapAB = false, kdQSwapAB = false, kdKVMirror = false;
  static constexpr bool kExpUnderdP = true;
};

// Head dim 96: head dim 128's layout (dK and dV take 48 registers each per thread).
template <>
struct BwdTileSize<96> {
  static constexpr int kBlockM = 64, kBlockN = 128, kStages = 2, kStagesdO = 2, kStagesdS = 2, kdQSlices = 1;
  static constexpr bool kSdPSwapAB = true, kdKVSwapAB = false, kdQSwapAB = false, kdKVMirror = false;
  static constexpr bool kExpUnderdP = false;
};

// Head dim 192: with S^T, one warpgroup would hold 64 keys x 192 of both dK and dV (192 registers).
// Head dim 256's layout instead (S, P and dS through shared memory, dK^T / dV^T), the two 192-row accumulators
// split over the head dim unevenly and mirrored (kdKVMirror): warpgroup 0 holds dK^T rows 0..127 and dV^T rows
// 128..191, warpgroup 1 dV^T rows 0..127 and dK^T rows 128..191, 144 registers each, all 96 keys, so every
// dK^T / dV^T WGMMA is N = 96 (the key split's N = 48 ones read 84 KB of shared memory a step per GEMM, these 60).
// dQ in one slice, 96 columns per warpgroup (48 registers beside them, no spill): its N = 96 WGMMAs read dS once
// a step where three 64-column slices (N = 32 per warpgroup) read it three times, 60 KB of shared memory a step
// instead of 108 (perf-notes, session 24). FA3 uses 64 x 96 too (its dK^T / dV^T split over the keys).
template <>
struct BwdTileSize<192> {
  static constexpr int kBlockM = 64, kBlockN = 96, kStages = 2, kStagesdO = 1, kStagesdS = 1, kdQSlices = 1;
  static constexpr bool kSdPSwapAB = false, kdKVSwapAB = true, kdQSwapAB = false, kdKVMirror = true;
  static constexpr bool kExpUnderdP = false;
};

// Q/K 192, V 128: head dim 192's layout, its five atoms of dK^T / dV^T mirrored unevenly: warpgroup 0 holds dV^T
// rows 0..63 and dK^T rows 0..127, warpgroup 1 dV^T rows 64..127 and dK^T rows 128..191 (three 48-register slots
// each, warpgroup 1's third empty). Five N = 96 atoms read 100 KB of shared memory a step where dK^T split over the
// keys and dV^T over the head dim read 124.
// Q/K 128, V 64: head dim 128's.
template <>
struct BwdTileSize<192, 128> : BwdTileSize<192> {};
template <>
struct BwdTileSize<128, 64> : BwdTileSize<128> {};

// Head dim 256: 80 keys per CTA (20% less Q/dO traffic per FLOP than 64; dK^T/dV^T take 160
// registers); one dO stage, released mid-iteration (after dV), so the next one loads under the dQ/dK
// GEMMs; one P/dS buffer (a second: +0-1%). dQ as dQ^T = K^T dS^T (kdQSwapAB): each warpgroup a 64-row
// atom of the head dim x the 64 queries per slice, N = 64 WGMMAs, half the instructions and less shared
// memory per FLOP than dQ's 32-column N = 32 halves; the deterministic instantiation (its slices staged
// in shared memory, where 128-row slices do not fit) keeps dQ in kdQSlices column slices.
template <>
struct BwdTileSize<256> {
  static constexpr int kBlockM = 64, kBlockN = 80, kStages = 2, kStagesdO = 1, kStagesdS = 1, kdQSlices = 4;
  static constexpr bool kSdPSwapAB = false, kdKVSwapAB = true, kdQSwapAB = true, kdKVMirror = false;
  static constexpr bool kExpUnderdP = false;
};

// Kernels with dropout (common/dropout.h): the plain tiles, except head dim 256's 80 keys, split 40 / 40 between
// the warpgroups, which leave a thread's 8-key chunks in halves of the Philox groups (one draw per 8 of its
// scores, not 16) and spilled 130-145 bytes; 64 keys (32 each: whole groups, dK^T/dV^T in 128 registers).
// Without kExpUnderdP: at head dim 128 the LSE held across the S GEMM beside the keep bits spilled 128-192 bytes.
template <int kHeadDim, int kHeadDimV = kHeadDim>
struct BwdDropoutTileSize : BwdTileSize<kHeadDim, kHeadDimV> {
  static constexpr bool kExpUnderdP = false;
};
template <>
struct BwdDropoutTileSize<256> : BwdTileSize<256> {
  static constexpr int kBlockN = 64;
};
template <>
struct BwdDropoutTileSize<64> : BwdTileHeadDim64Rows64 {};

// Kernels with a softcap (without dropout): the plain tiles but head dim 64's, and without kExpUnderdP (not
// measured with the tanh's MUFU work before the dP wait; at head dim 64 such a MUFU burst lost 6-9%, S40A).
template <int kHeadDim, int kHeadDimV = kHeadDim>
struct BwdSoftcapTileSize : BwdTileSize<kHeadDim, kHeadDimV> {
  static constexpr bool kExpUnderdP = false;
};
template <>
struct BwdSoftcapTileSize<64> : BwdTileHeadDim64Rows64 {};

}  // namespace flashhopper::sm90
