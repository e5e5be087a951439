// Dropout's keep mask for the Hopper backward, drawn by spare producer warps (2-3, beside the dQ writer) into shared
// memory a step ahead of the consumers, who only apply it. Drawn in the consumers (common/dropout.h: draw), the
// Philox rounds, the lane pairs' exchange and the keep tests sat between a warpgroup's GEMMs: the backward ran
// 1.09-1.24x its time without dropout at head dim 128 and 1.33-1.57x at 64; with the feed 1.00-1.16x and 1.23-1.39x
// (H100, docs/perf-notes.md session 28). Here a consumer reads two words a step and spends five instructions per
// four scores. The forward draws in its consumers: its steps are ~2.5x shorter than the backward's, and three drawing
// warps (Philox rounds at 56 registers) fell behind them: 1.36-2.14x its time without dropout, against 1.23-1.65x
// drawn in its consumers (H100, the same run).
//
// The mask is common/dropout.h's, bit for bit (the same Philox counters, bytes and keep test). A step's tile is the
// consumer warps' accumulators (Layout below: where warp w's 16 rows x kCols columns lie); lane 4g + q of a warp
// holds rows g and g + 8 and columns 8i + 2q, 8i + 2q + 1. Rows are queries, or keys where the layout is transposed
// (the backward's S^T). A stage holds two words per consumer thread, its rows g and g + 8: bit j + 8c of a word is
// the keep bit of column 16j + (2q, 2q + 1, 2q + 8, 2q + 9)[c] of the row. One Philox call (a group of 4 rows x 4
// columns) serves lanes 4g + q and 4g + 4 + q (g even): the drawing thread of a (warp, lane pair) walks the row's
// 16-column groups and writes both lanes' words. A consumer shifts a word left by 7 - j to bring group j's four bits
// to bit 7 of each byte, where a sign-mode PRMT spreads two of them over a register's halves.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/pipeline/pipeline.hpp>

#include <cstdint>
#include <type_traits>

#include "../common/dropout.h"

namespace flashhopper::sm90 {

// Layouts of a step's tile over the consumer warps (offsets from the step's first query and key).
// The backward's S^T (kSdPSwapAB): warp w has keys 16w.., every query of the step.
template <int kBlockM, int kBlockN>
struct DropRowsKeys {
  static constexpr int kWarps = kBlockN / 16, kCols = kBlockM;
  static constexpr bool kTransposed = true;
  CUTE_HOST_DEVICE static constexpr int row0(int w) { return 16 * w; }
  CUTE_HOST_DEVICE static constexpr int col0(int) { return 0; }
};
// The backward's S split over the keys: warpgroup w / 4 has its half of the keys, warp w % 4 the queries 16 (w % 4)..
template <int kBlockM, int kBlockN>
struct DropRowsQueriesHalfKeys {
  static_assert(kBlockM == 64, "one warpgroup's 64 rows");
  static constexpr int kWarps = 8, kCols = kBlockN / 2;
  static constexpr bool kTransposed = false;
  CUTE_HOST_DEVICE static constexpr int row0(int w) { return 16 * (w % 4); }
  CUTE_HOST_DEVICE static constexpr int col0(int w) { return (w / 4) * kCols; }
};

// No dropout: no warps, no storage, nothing to apply.
// Layout: one of the above; kStages: stages of drawn steps; kDrawThreads: the drawing threads; kRegsBoost: their
// registers beyond the producer's own, taken from the consumers (the kernels' register split).
template <class Dropout, class Layout, int kStages_, int kDrawThreads, int kRegsBoost>
struct DropoutFeed {
  static constexpr bool kEnabled = false;
  static constexpr int kThreads = 0, kProducerRegsBoost = 0;
  struct SharedStorage {};
  struct BarrierStorage {};
  using Pipeline = int;
  using PipelineState = int;
  using Keep = int;
};

template <class Layout, int kStages_, int kDrawThreads, int kRegsBoost>
struct DropoutFeed<DropoutPhilox, Layout, kStages_, kDrawThreads, kRegsBoost> {
  static constexpr bool kEnabled = true;
  static constexpr int kCols = Layout::kCols, kGroups = kCols / 16;
  static_assert(kCols % 16 == 0 && kGroups <= 8, "a byte's 8 bits: up to 8 groups of 16 columns");
  static constexpr int kTasks = Layout::kWarps * 16;  // (consumer warp, lane pair)
  static constexpr int kStageWords = Layout::kWarps * cutlass::NumThreadsPerWarp * 2;  // 2 KB at 8 warps
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = kDrawThreads;
  static constexpr int kProducerRegsBoost = kRegsBoost;
  using Pipeline = cutlass::PipelineAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  struct SharedStorage {
    alignas(16) uint32_t words[kStages][kStageWords];
  };
  struct BarrierStorage {
    typename Pipeline::SharedStorage pipeline;
  };

  // A drawing thread (tid in [0, kThreads)): the words of the step whose first query is q0 and first key k0.
  CUTE_DEVICE static void draw(DropoutPhilox::Stream const& st, uint32_t* words, int q0, int k0, int tid) {
    for (int t = tid; t < kTasks; t += kThreads) {
      int const w = t / 16, pair = (t % 16) / 4, q = t % 4;
      int const lane = 8 * pair + q;  // the pair's even-row lane (g = 2 pair); its partner is lane + 4
      // The counter's row group is the same for rows g, g + 1, g + 8, g + 9; column group j is group 0's plus 4 j
      // (16 columns on).
      int const row = Layout::row0(w) + 2 * pair, col = Layout::col0(w) + 2 * q;
      uint32_t const row_group = DropoutPhilox::group((Layout::kTransposed ? k0 : q0) + row);
      uint32_t const col_group = DropoutPhilox::group((Layout::kTransposed ? q0 : k0) + col);
      uint32_t even0 = 0, odd0 = 0, even8 = 0, odd8 = 0;
      CUTE_UNROLL
      for (int j = 0; j < kGroups; ++j) {
        // Counter (key group, query group, batch x heads + head, offset); output word r is the group's query row r
        // (2a, 2a + 1, 2a + 8, 2a + 9), its byte c key c.
        uint4 const r = philox4x32(Layout::kTransposed
                                       ? make_uint4(row_group, col_group + 4u * j, st.bh, st.offset)
                                       : make_uint4(col_group + 4u * j, row_group, st.bh, st.offset),
                                   st.k0, st.k1);
        uint32_t kx = DropoutPhilox::keep_bits(st, r.x), ky = DropoutPhilox::keep_bits(st, r.y);
        uint32_t kz = DropoutPhilox::keep_bits(st, r.z), kw = DropoutPhilox::keep_bits(st, r.w);
        if constexpr (Layout::kTransposed) {
          // Rows are keys: a lane's four bits are one byte (its key) of each word (the queries): a 4 x 4 byte
          // transpose, the even lane's rows taking bytes 0 and 2, the odd's 1 and 3.
          uint32_t const t01 = __byte_perm(kx, ky, 0x5140), t23 = __byte_perm(kz, kw, 0x5140);
          uint32_t const u01 = __byte_perm(kx, ky, 0x7362), u23 = __byte_perm(kz, kw, 0x7362);
          kx = __byte_perm(t01, t23, 0x5410);  // byte 0 of each: the even lane's row g
          ky = __byte_perm(t01, t23, 0x7632);  // byte 1: the odd lane's row g + 1
          kz = __byte_perm(u01, u23, 0x5410);  // byte 2: the even lane's row g + 8
          kw = __byte_perm(u01, u23, 0x7632);  // byte 3: the odd lane's row g + 9
        }
        // Now kx, ky, kz, kw: rows g, g + 1, g + 8, g + 9 (the even lane's g, g + 8, the odd's), their bits at bit 7.
        even0 |= (kx & 0x80808080u) >> (7 - j);
        odd0 |= (ky & 0x80808080u) >> (7 - j);
        even8 |= (kz & 0x80808080u) >> (7 - j);
        odd8 |= (kw & 0x80808080u) >> (7 - j);
      }
      uint32_t* const out = words + (w * cutlass::NumThreadsPerWarp + lane) * 2;
      *reinterpret_cast<uint2*>(out) = make_uint2(even0, even8);
      *reinterpret_cast<uint2*>(out + 8) = make_uint2(odd0, odd8);
    }
  }

  // One step's words into the next stage, the consumers' order.
  CUTE_DEVICE static void produce(Pipeline& pipeline, PipelineState& write, SharedStorage& ss,
                                  DropoutPhilox::Stream const& st, int q0, int k0, int tid) {
    pipeline.producer_acquire(write);
    draw(st, ss.words[write.index()], q0, k0, tid);
    pipeline.producer_commit(write);
    ++write;
  }

  // A consumer's side: the stages in order, one per step; state: the step's, taken from a pipeline of as many
  // stages that advances once a step too (the backward's Q), so the feed keeps no registers of its own.
  using Keep = cute::array<uint32_t, 2>;  // rows g, g + 8
  // ts: the mainloop's storage (its `drop`); consumer: the thread's index among the consumer threads (warp w =
  // consumer / 32 of the Layout).
  template <class TensorStorage>
  CUTE_DEVICE static Keep fetch(Pipeline& pipeline, PipelineState const& state, TensorStorage const& ts, int consumer) {
    pipeline.consumer_wait(state);
    uint2 const w = reinterpret_cast<uint2 const*>(ts.drop.words[state.index()])[consumer];
    pipeline.consumer_release(state);
    return {w.x, w.y};
  }

  // Zeroes the dropped scores of a 16-bit tile in (row, col) view (rows g, g + 8; column 2i + c2 = 8i + 2q + c2 of
  // the warp's columns, a register's pair), given the step's words.
  template <class TensorP>
  CUTE_DEVICE static void apply(TensorP&& p, Keep const& keep) {
    static_assert(sizeof(typename std::remove_reference_t<TensorP>::value_type) == 2, "16-bit P");
    static_assert(decltype(size<0>(p))::value == 2 && decltype(size<1>(p))::value == kCols / 4);
    CUTE_UNROLL
    for (int r2 = 0; r2 < 2; ++r2) {
      CUTE_UNROLL
      for (int j = 0; j < kGroups; ++j) {
        uint32_t const bits = keep[r2] << (7 - j);  // group j's bits at bit 7 of bytes c = 0..3
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {  // columns 2q + 8h, +1: bytes 2h, 2h + 1
          uint32_t& pair = reinterpret_cast<uint32_t&>(p(r2, 4 * j + 2 * h));
          pair &= DropoutPhilox::sign_select(bits, (8u | (2 * h)) * 0x11u | (8u | (2 * h + 1)) * 0x1100u);
        }
      }
    }
  }

  // The backward's dS with dropout, in place of dP (float, (row, col) view as apply's): dS = P (s Z dP - D), Z the
  // keep bit, s the 1 / keep probability; p: the float P (whole), d(mi, ni): the row statistic D. Per score a
  // sign-mode PRMT (Z over 32 bits), an AND, an FFMA and an FMUL.
  template <class TensorP, class TensorDP, class Stat>
  CUTE_DEVICE static void grad_scores(TensorP const& p, TensorDP& dp, Stat&& d, Keep const& keep, float scale) {
    static_assert(decltype(size<1>(dp))::value == kCols / 4);
    CUTE_UNROLL
    for (int r2 = 0; r2 < 2; ++r2) {
      CUTE_UNROLL
      for (int j = 0; j < kGroups; ++j) {
        uint32_t const bits = keep[r2] << (7 - j);
        CUTE_UNROLL
        for (int c = 0; c < 4; ++c) {  // column 4j + c: byte c
          int const ni = 4 * j + c;
          uint32_t const z = DropoutPhilox::sign_select(bits, (8u | c) * 0x1111u);
          float const dp_kept = __uint_as_float(__float_as_uint(dp(r2, ni)) & z);
          dp(r2, ni) = float(p(r2, ni)) * (dp_kept * scale - d(r2, ni));
        }
      }
    }
  }
};

}  // namespace flashhopper::sm90
