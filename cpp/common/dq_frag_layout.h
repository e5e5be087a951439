// The float32 dQ accumulator in fragment order (sm90 backward, 64-row query blocks): a query block's
// kBlockM x headdim sums are stored as the consumer threads hold them, so that 4 of a thread's
// accumulator values are one 16-byte `red` (or shared-memory store, staged for a bulk reduce-add)
// and a warp's 32 of them cover 512 contiguous bytes. Both directions live here: the main kernel
// writes with `offset`, the dQ postprocess reads with `coord`.
//
// The main kernel computes dQ (64 rows x headdim) in column groups of kCols per warpgroup (a group
// per slice and warpgroup). In a warpgroup's m64 x kCols WGMMA accumulator, thread t (0..127) holds
// fragment value i = e + 2 h + 4 j at row 16 (t / 32) + (t % 32) / 4 + 8 h and column
// 8 j + 2 (t % 4) + e. Values i..i+3 (i % 4 == 0) are one 16-byte chunk:
//   offset(group, t, i) = ((group * kCols / 8 + i / 4) * 128 + t) * 4 + i % 4   (floats)
// Each 64-row block takes 64 * headdim floats, blocks (then heads, then batches) one after another; a
// 128-row query block is two of them (its warpgroups split the rows: one 64-row block each).
// kTransposed: the kernel computed dQ^T (head dim x 64 queries), in groups of 64 head-dim rows with all
// kCols = 64 queries as columns; the offsets are the same, and a chunk holds (query, dim) (q, d), (q + 1, d),
// (q, d + 8), (q + 1, d + 8).
#pragma once

#include <cute/config.hpp>

namespace flashhopper {

template <int kCols, bool kTransposed = false>
struct DqFragLayout {
  static_assert(kCols % 8 == 0, "8-column groups of the WGMMA accumulator");
  static constexpr int kBlockM = 64;  // one m64 WGMMA atom per warpgroup
  static constexpr int kColumns = kCols;
  static constexpr int kChunksPerGroup = kCols / 8;

  // Float offset, within its query block, of fragment value i (a multiple of 4) of thread t.
  CUTE_HOST_DEVICE static constexpr int offset(int group, int t, int i) {
    return ((group * kChunksPerGroup + i / 4) * 128 + t) * 4;
  }
  // The (row, col) of the accumulator's first value of 16-byte chunk k of a block; its four values are (row,
  // col), (row, col + 1), (row + 8, col), (row + 8, col + 1) of the accumulator: of dQ, or of dQ^T (kTransposed:
  // row a head-dim index, col a query).
  CUTE_HOST_DEVICE static constexpr void coord(int k, int& row, int& col) {
    int const t = k % 128, gj = k / 128;
    int const group = gj / kChunksPerGroup, j = gj % kChunksPerGroup;
    int const r = 16 * (t / 32) + (t % 32) / 4, c = 8 * j + 2 * (t % 4);
    row = kTransposed ? group * 64 + r : r;
    col = kTransposed ? c : group * kCols + c;
  }
};

}  // namespace flashhopper
