// Attention dropout inside the kernels: the keep mask that python/flashhopper/dropout.py defines, drawn
// per score from (seed, offset) so that the backward regenerates it instead of storing it. The definition
// (philox4x32, group, the keep test) is every kernel's; the Hopper backward draws it in spare producer warps into shared
// memory (sm90/dropout_feed.h), the Hopper forward and the Ampere kernels in the consumer threads themselves (draw /
// apply below), on S tiles (rows = queries) in the (row, col) view of an m16n8 accumulator (utils.h: rowcol).
//
// The definition: the scores of one (batch, head) form groups of 16, rows {2a, 2a+1, 2a+8, 2a+9} x
// columns {2b, 2b+1, 2b+8, 2b+9} of a 16 x 16 block; one Philox4x32-7 call per group, counter (key
// group, query group, batch * heads + head, offset), key (seed); score (r, c) of the group takes byte
// 4r + c of the output and is kept iff that byte >= threshold.
//
// How a consumer thread draws: in an m16n8 accumulator a thread holds rows g and g + 8 (g = lane / 4) and
// columns 2q, 2q + 1 (q = lane % 4) of each 8-column chunk, so lanes L and L ^ 4 hold the same groups,
// half of each. A "unit" is a thread's part of one group: its 8 scores when the thread's two 8-column
// chunks of a 16-column block are adjacent in the view (kGroupsWhole: rowcol columns 4u..4u+3), else
// the 4 scores of one chunk. The two lanes of a pair split the Philox calls, each drawing every other
// unit, and swap what the other needs (two shuffles): one call per 16 of a thread's scores. The mask
// is applied to the 16-bit P, two scores per register (DropoutPhilox::apply); the forward scales O by
// 1 / keep probability at the end, the backward gives the dV GEMM s P masked (Pd) and computes
// dS = P (s dP - D) where Pd is not 0, -P D where it is (DropoutPhilox::grad_scores): no mask kept in registers.
#pragma once

#include <cute/tensor.hpp>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

namespace flashhopper {

// Dropout's runtime values, in the params: the threshold (round(p * 256); 0 = keep all) and a device
// pointer to (seed, offset) as two int64, read by the kernel so that a CUDA graph replays with new ones.
struct DropoutArgs {
  int64_t const* rng = nullptr;
  int threshold = 0;
  float scale = 1.f;  // 256 / (256 - threshold): kept scores are scaled by it (0 when all are dropped)
};

constexpr uint32_t kPhiloxRounds = 7;  // FlashAttention's count; python/flashhopper/dropout.py

CUTE_DEVICE uint4 philox4x32(uint4 c, uint32_t k0, uint32_t k1) {
  CUTE_UNROLL
  for (uint32_t i = 0; i < kPhiloxRounds; ++i) {
    if (i) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    // The halves of each product apart (IMAD.HI + IMAD): no register pairs to keep aligned.
    uint32_t const h0 = __umulhi(0xD2511F53u, c.x), l0 = 0xD2511F53u * c.x;
    uint32_t const h1 = __umulhi(0xCD9E8D57u, c.z), l1 = 0xCD9E8D57u * c.z;
    c = make_uint4(h1 ^ c.y ^ k0, l1, h0 ^ c.w ^ k1, l0);
  }
  return c;
}

// No dropout: the kernels' hooks compile to nothing.
struct DropoutNone {
  static constexpr bool kEnabled = false;
  CUTE_HOST_DEVICE static DropoutNone make(DropoutArgs const&) { return {}; }
  CUTE_HOST_DEVICE float scale() const { return 1.f; }
};

struct DropoutPhilox {
  static constexpr bool kEnabled = true;
  int64_t const* rng;
  uint32_t threshold;
  float scale_;

  CUTE_HOST_DEVICE static DropoutPhilox make(DropoutArgs const& a) {
    return {a.rng, uint32_t(a.threshold), a.scale};
  }
  CUTE_HOST_DEVICE float scale() const { return scale_; }

  // The draws of one (batch, head): key, the counter's last two words, and the keep tests' constants: threshold2
  // (the threshold in both 16-bit halves: keep_halves) and keep_add, keep_or (keep_bits, four bytes at a time).
  struct Stream {
    uint32_t k0, k1, bh, offset, threshold2, keep_add, keep_or;
  };
  CUTE_DEVICE Stream stream(int bh) const {
    uint64_t const seed = uint64_t(rng[0]);
    bool const low = threshold <= 128u;
    return {uint32_t(seed), uint32_t(seed >> 32), uint32_t(bh), uint32_t(uint64_t(rng[1])),
            threshold * 0x00010001u, ((low ? 128u : 256u) - threshold) * 0x01010101u, low ? ~0u : 0u};
  }

  // The group of a query or key index x >= 0 (the counter's first two words): its 16-block, and which of the
  // block's row (column) pairs {2a, 2a + 1, 2a + 8, 2a + 9} it is in. Unsigned: no sign fix-ups around the shifts.
  CUTE_HOST_DEVICE static uint32_t group(int x) {
    uint32_t const u = uint32_t(x);
    return (u / 16) * 4 + (u % 8) / 2;
  }

  // The keep test of a word's four random bytes b at once: bit 7 of each byte of the result is set iff b >=
  // threshold (the other bits are not defined). With y = (b & 0x7F) + c, no carry leaves a byte: for threshold t
  // <= 128, c = 128 - t and b >= t iff b's bit 7 or y's is set; above, c = 256 - t and iff both are. The
  // majority of (b, y, keep_or) is the one or the other (one LOP3): three instructions per four scores.
  CUTE_DEVICE static uint32_t keep_bits(Stream const& st, uint32_t b) {
    uint32_t const y = (b & 0x7F7F7F7Fu) + st.keep_add;
    return (b & y) | (b & st.keep_or) | (y & st.keep_or);
  }

  // The keep test of two random bytes zero-extended into the 16-bit halves of `spread`: each half of the result is
  // all ones iff its byte >= threshold. One HSET2: read as f16, 0x0000-0x00FF are non-negative subnormals in the
  // integers' order, compared exactly (no .ftz), as FlashAttention-2 tests its bytes.
  CUTE_DEVICE static uint32_t keep_halves(Stream const& st, uint32_t spread) {
    uint32_t m;
    asm("set.ge.u32.f16x2 %0, %1, %2;" : "=r"(m) : "r"(spread), "r"(st.threshold2));
    return m;
  }

  // The layout of a (row, col)-view tile's draws (see the file's comment): units of 2 rows x kUnitCols columns.
  template <class TensorC, bool kGroupsWhole>
  struct Units {
    static constexpr int kRows = decltype(size<0>(std::declval<TensorC>()))::value;
    static constexpr int kCols = decltype(size<1>(std::declval<TensorC>()))::value;
    static constexpr int kUnitCols = kGroupsWhole ? 4 : 2;
    static_assert(kRows % 2 == 0 && kCols % kUnitCols == 0);
    static constexpr int kPerRow = kCols / kUnitCols, kCount = kRows / 2 * kPerRow;
    CUTE_DEVICE static int row(int u) { return 2 * (u / kPerRow); }
    CUTE_DEVICE static int col(int u) { return kUnitCols * (u % kPerRow); }
  };

  // This lane's random bytes for every score of a (row, col)-view S tile (rows = queries): two words per unit (X0,
  // X1 of the file's comment), words 2u and 2u + 1. coords: the tile's (row, col) coordinates; q0 / k0: the global
  // query / key index of coordinate 0 (k0 a tile origin: a multiple of 16). kGroupsWhole: a thread's two 8-column
  // chunks of each 16-column block are adjacent columns of the view (rowcol columns 4u .. 4u + 3), else each chunk is
  // drawn alone.
  template <bool kGroupsWhole, class TensorC>
  CUTE_DEVICE static auto draw(Stream const& st, TensorC const& coords, int q0, int k0) {
    using U = Units<TensorC, kGroupsWhole>;
    cute::array<uint32_t, 2 * U::kCount> words;
    bool const odd = (threadIdx.x & 4) != 0;  // this lane's row parity (g % 2); its partner is lane ^ 4
    // Byte selectors that gather a lane's 8 bytes of a group's 16 into two words X0 (from words 0, 1)
    // and X1 (from words 2, 3): a lane takes the words of its row parity, X_r2 byte 2j + c2 is its
    // score (row g + 8 r2, column 2q + c2 + 8j).
    auto selector = [](bool parity) -> uint32_t { return parity ? 0x7654u : 0x3210u; };
    uint32_t const sel_mine = selector(odd), sel_other = selector(!odd);
    // The Philox counter of a unit, from its first score's coordinates. k0 is a tile origin, a multiple of 16, so
    // group(k0 + c) = k0 / 4 + group(c): in the forwards, whose loops walk the keys, the coordinates' part is the same
    // every step (hoisted by the compiler) and a step pays one add instead of the group's shifts and masks. (The same
    // split for q0 made the Ampere backward, whose loop walks the queries, hold them all and spill.)
    auto counter = [&](int u) {
      auto const c = coords(U::row(u), U::col(u));
      return make_uint4(uint32_t(k0) / 4 + group(int(get<1>(c))), group(q0 + int(get<0>(c))), st.bh, st.offset);
    };
    CUTE_UNROLL
    for (int u = 0; u + 1 < U::kCount; u += 2) {
      // The even lane draws unit u, the odd one u + 1; each sends the other its words.
      uint4 const c0 = counter(u), c1 = counter(u + 1);
      uint4 const w = philox4x32(odd ? c1 : c0, st.k0, st.k1);
      uint32_t const x0 = __byte_perm(w.x, w.y, sel_mine), x1 = __byte_perm(w.z, w.w, sel_mine);
      uint32_t const z0 = __shfl_xor_sync(0xffffffffu, __byte_perm(w.x, w.y, sel_other), 4);
      uint32_t const z1 = __shfl_xor_sync(0xffffffffu, __byte_perm(w.z, w.w, sel_other), 4);
      words[2 * u] = odd ? z0 : x0;
      words[2 * u + 1] = odd ? z1 : x1;
      words[2 * u + 2] = odd ? x0 : z0;
      words[2 * u + 3] = odd ? x1 : z1;
    }
    if constexpr (U::kCount % 2 == 1) {
      uint4 const w = philox4x32(counter(U::kCount - 1), st.k0, st.k1);
      words[2 * U::kCount - 2] = __byte_perm(w.x, w.y, sel_mine);
      words[2 * U::kCount - 1] = __byte_perm(w.z, w.w, sel_mine);
    }
    return words;
  }

  // Zeroes the dropped scores of a 16-bit tile in (row, col) view, whose scores (mi, ni) and (mi, ni + 1),
  // ni even, share a 32-bit register (an m16n8 accumulator's column pair, converted), given its draws.
  // Per pair of scores: its two bytes spread into the halves (PRMT), the test (keep_halves: HSET2) and an AND,
  // 6 instructions per four scores (keep_bits + a sign-mode PRMT + AND took 7).
  template <bool kGroupsWhole, class TensorP, class TensorC, class Words>
  CUTE_DEVICE static void apply_draws(Stream const& st, TensorP&& p, TensorC const& coords, Words const& words) {
    static_assert(sizeof(typename std::remove_reference_t<TensorP>::value_type) == 2, "16-bit P");
    using U = Units<TensorC, kGroupsWhole>;
    CUTE_UNROLL
    for (int u = 0; u < U::kCount; ++u) {
      // Half groups: which 8-column chunk of its 16-column block the unit is (a thread's coordinate).
      int const half = kGroupsWhole ? 0 : (int(get<1>(coords(U::row(u), U::col(u)))) % 16) / 8;
      CUTE_UNROLL
      for (int r2 = 0; r2 < 2; ++r2) {
        CUTE_UNROLL
        for (int jj = 0; jj < U::kUnitCols / 2; ++jj) {
          int const j = kGroupsWhole ? jj : half;
          int const w = r2;  // the pair's word of the unit's two
          uint32_t const b0 = uint32_t(2 * j), b1 = b0 + 1;
          uint32_t& pair = reinterpret_cast<uint32_t&>(p(U::row(u) + r2, U::col(u) + 2 * jj));
          // The pair's two bytes (c2 = 0, 1) into the low bytes of the two halves, zeros above.
          uint32_t const spread = __byte_perm(words[2 * u + w], 0u, 0x4040u | b0 | (b1 << 8));
          pair &= keep_halves(st, spread);
        }
      }
    }
  }

  template <bool kGroupsWhole, class TensorP, class TensorC>
  CUTE_DEVICE static void apply(Stream const& st, TensorP&& p, TensorC const& coords, int q0, int k0) {
    apply_draws<kGroupsWhole>(st, p, coords, draw<kGroupsWhole>(st, coords, q0, k0));
  }

  // PRMT with a selector whose nibbles may ask for sign mode (8 | byte: that byte's bit 7 replicated), which
  // __byte_perm does not expose; a constant selector after unrolling.
  CUTE_DEVICE static uint32_t sign_select(uint32_t x, uint32_t selector) {
    uint32_t r;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(x), "r"(selector));
    return r;
  }

  // The backward's dS with dropout, in place of dP: dS = P * (Z s dP - D), where Z (kept) is read off Pd = s P
  // where kept and 0 where dropped (the dV GEMM's operand; where P is 0, dS is 0 either way) and P is the
  // whole probabilities. (Pd dP - P D, one instruction less, lost precision: the two products nearly
  // cancel, and the kernels failed FA3's criterion on dq and dk by 2.1-2.2x at 1000 keys.)
  template <class TensorP, class TensorPd, class TensorDP, class Stat>
  CUTE_DEVICE void grad_scores(TensorP const& p, TensorPd const& pd, TensorDP& dp, Stat&& d) const {
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(p); ++mi) {
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(p); ++ni) {
        float const dp_kept = float(pd(mi, ni)) != 0.f ? dp(mi, ni) * scale_ : 0.f;
        dp(mi, ni) = float(p(mi, ni)) * (dp_kept - d(mi, ni));
      }
    }
  }
};

template <bool kDropout>
using DropoutOf = std::conditional_t<kDropout, DropoutPhilox, DropoutNone>;

// The launchers' constructor from the params (dropout_rng, dropout_threshold): a dropout kernel needs the
// (seed, offset) pointer and a threshold in [0, 256], the others threshold 0 (dispatch keys the call by it).
template <class Dropout>
Dropout make_dropout(int64_t const* rng, int threshold) {
  if constexpr (Dropout::kEnabled) {
    if (rng == nullptr) throw std::invalid_argument("flashhopper: a dropout kernel needs dropout_rng (seed, offset)");
    if (threshold < 0 || threshold > 256) throw std::invalid_argument("flashhopper: dropout_threshold must be in [0, 256]");
    return Dropout::make({rng, threshold, threshold < 256 ? 256.f / float(256 - threshold) : 0.f});
  } else {
    if (threshold != 0) throw std::invalid_argument("flashhopper: dropout needs a dropout kernel");
    return {};
  }
}

}  // namespace flashhopper
