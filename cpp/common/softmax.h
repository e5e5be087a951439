// Online softmax over score tiles held in registers, in (row, col) view. One object per thread
// tracks, for each of its rows, the running max m (raw score units) and a thread-partial running
// sum l; the quad shares a row, so max is reduced across it every block and the sum only at the end.
// Exponentials are exp2(s * scale_log2 - m * scale_log2): one FFMA and one MUFU.EX2 per score.
#pragma once

#include <cute/tensor.hpp>
#include <cmath>

#include "utils.h"

namespace flashhopper {

// kMaxOffset (FP8): probabilities are computed as 2^kMaxOffset * p, so that the fp8 P of the PV GEMM
// uses more of e4m3's range; the factor cancels in O / l and is taken out of the LSE.
// kLazyRescale > 0: the reference max of a row moves only when a block's max exceeds it by more than kLazyRescale
// (log2 units), so probabilities stay below 2^kLazyRescale (16-bit P and the float32 sum hold that) and the O rescale,
// a multiply per accumulator element every block, is skipped in the blocks where no row of a warp moved (max_moved).
template <int kRows, int kMaxOffset = 0, int kLazyRescale = 0>
struct OnlineSoftmax {
  static_assert(kMaxOffset + kLazyRescale <= 8, "P < 2^(kMaxOffset + kLazyRescale) must fit e4m3's 448");
  float row_max[kRows];  // reference max in scaled (log2) units: max(score * scale), or up to kLazyRescale below it
  float row_sum[kRows];
  float const scale_log2;  // softmax_scale * log2(e)
  bool max_moved = true;   // whether the last update moved a row's reference max (then O needs the rescale)

  CUTE_DEVICE explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {}

  // Turns scores into unnormalized probabilities in place. Returns, per row, the factor that
  // rescales the output accumulated so far to the new max (unused on the first block).
  // kCheckInf guards rows that have seen no visible key yet (max still -inf).
  // kLive < kRows: only the first kLive rows are updated (the others are padding the caller never stores: their
  // scores, state and O rows are left as they are, o_scale 1).
  template <bool kFirst, bool kCheckInf, int kLive = kRows, class TensorS>
  CUTE_DEVICE cute::array<float, kRows> update(TensorS& s) {
    return update<kFirst, kCheckInf, kLive>(s, scale_log2);
  }

  // The same with this block's own scale (FP8: softmax_scale * log2(e) * q and k descales). The max is
  // kept in scaled units, so blocks with different scales compare correctly; scale must be > 0.
  template <bool kFirst, bool kCheckInf, int kLive = kRows, class TensorS>
  CUTE_DEVICE cute::array<float, kRows> update(TensorS& s, float scale) {
    static_assert(decltype(size<0>(s))::value == kRows && kLive >= 1 && kLive <= kRows && (kLive == kRows || !kFirst));
    cute::array<float, kRows> o_scale;
    CUTE_UNROLL
    for (int mi = kLive; mi < kRows; ++mi) o_scale[mi] = 1.f;
    if constexpr (kLazyRescale > 0 && !kFirst) max_moved = false;
    CUTE_UNROLL
    for (int mi = 0; mi < kLive; ++mi) {
      float m = -INFINITY;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s); ++ni) m = fmaxf(m, s(mi, ni));
      m = quad_allreduce(m, MaxOp{}) * scale;
      if constexpr (!kFirst) {
        m = fmaxf(m, row_max[mi]);
        // Keep the old reference while the max grew by at most kLazyRescale (-inf - -inf is NaN: kept, still -inf).
        if constexpr (kLazyRescale > 0) m = (m - row_max[mi] > float(kLazyRescale)) ? m : row_max[mi];
      }
      // A row with no visible key keeps max -inf; use 0 so exp2 gives 0, never NaN.
      float const m_used = (kCheckInf && m == -INFINITY) ? 0.f : m;
      float const m_shifted = m_used - float(kMaxOffset);
      float sum = 0.f;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s); ++ni) {
        s(mi, ni) = exp2_approx(s(mi, ni) * scale - m_shifted);
        sum += s(mi, ni);
      }
      if constexpr (kFirst) {
        o_scale[mi] = 1.f;
        row_sum[mi] = sum;
      } else {
        o_scale[mi] = exp2_approx(row_max[mi] - m_used);
        row_sum[mi] = row_sum[mi] * o_scale[mi] + sum;
        if constexpr (kLazyRescale > 0) max_moved |= (m != row_max[mi]);
      }
      row_max[mi] = m;
    }
    return o_scale;
  }

  // update (not the first block) fused with O's rescale: every row's max first, then at_exp() (where the caller waits
  // for the GEMM that accumulates into O), then each row's exponentials with its O columns multiplied by
  // o_scale * o_extra written between them (FA3's e4m3 loop has them there). ptxas still schedules the multiplies after
  // the exponentials; what this order changed at e4m3 d128 is a loop ~25 instructions shorter and the PV wait's place,
  // which ptxas picks per kernel (perf-notes, session 43).
  // kWaitAfter > 0: at_exp(x) after row 0's first kWaitAfter exponentials (x the last of them), and every O multiply
  // after at_exp; 0: at_exp(0) before the exponentials.
  template <bool kCheckInf, int kWaitAfter = 0, class TensorS, class TensorO, class AtExp>
  CUTE_DEVICE void update_rescaling(TensorS& s, float scale, TensorO& o, float o_extra, AtExp&& at_exp) {
    static_assert(decltype(size<0>(s))::value == kRows && decltype(size<0>(o))::value == kRows);
    static_assert(kLazyRescale == 0, "a lazy rescale skips O's multiplies per warp");
    float m_shifted[kRows], o_scale[kRows];
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      float m = -INFINITY;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s); ++ni) m = fmaxf(m, s(mi, ni));
      m = fmaxf(quad_allreduce(m, MaxOp{}) * scale, row_max[mi]);
      float const m_used = (kCheckInf && m == -INFINITY) ? 0.f : m;
      m_shifted[mi] = m_used - float(kMaxOffset);
      o_scale[mi] = exp2_approx(row_max[mi] - m_used);
      row_max[mi] = m;
    }
    constexpr int kS = decltype(size<1>(s))::value, kO = decltype(size<1>(o))::value;
    static_assert(kWaitAfter >= 0 && kWaitAfter <= kS);
    if constexpr (kWaitAfter == 0) at_exp(0.f);
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      float const f = o_scale[mi] * o_extra;
      float sum = 0.f;
      CUTE_UNROLL
      for (int ni = 0; ni < kS; ++ni) {
        s(mi, ni) = exp2_approx(s(mi, ni) * scale - m_shifted[mi]);
        sum += s(mi, ni);
        if constexpr (kWaitAfter > 0) {
          if (mi == 0 && ni == kWaitAfter - 1) at_exp(s(0, ni));
        }
        // O is read only after at_exp (the PV GEMM writes it until then): row 0's first columns after the loop.
        if (kWaitAfter == 0 || mi > 0 || ni >= kWaitAfter) {
          CUTE_UNROLL
          for (int j = ni * kO / kS; j < (ni + 1) * kO / kS; ++j) o(mi, j) *= f;
        }
      }
      if (kWaitAfter > 0 && mi == 0) {
        CUTE_UNROLL
        for (int j = 0; j < kWaitAfter * kO / kS; ++j) o(0, j) *= f;
      }
      row_sum[mi] = row_sum[mi] * o_scale[mi] + sum;
    }
  }

  template <int kLive = kRows, class TensorO>
  CUTE_DEVICE static void rescale(TensorO& o, cute::array<float, kRows> const& scale) {
    static_assert(decltype(size<0>(o))::value == kRows);
    CUTE_UNROLL
    for (int mi = 0; mi < kLive; ++mi) {
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(o); ++ni) o(mi, ni) *= scale[mi];
    }
  }

  // Reduces the row sums across the quad. Returns the factor per row that turns the accumulated O into
  // the output (0 for a row whose denominator is 0, so its output is 0) and writes the natural-log LSE
  // (-inf for such a row). sink_log2: a learnable sink logit of the row's head in the exp2's units
  // (logit * log2(e)), -inf for none: it joins the denominator without a value, out = sum_j p_j v_j /
  // (exp(sink) + sum_j p_j), and the LSE includes it. Both are taken relative to m_new = max(row max,
  // sink), so neither a large sink nor a row with no visible key overflows.
  CUTE_DEVICE cute::array<float, kRows> finalize(cute::array<float, kRows>& lse, float sink_log2 = -INFINITY) {
    cute::array<float, kRows> sinks;
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) sinks[mi] = sink_log2;
    return finalize(lse, sinks);
  }
  // The same with a sink per row (GQA-packed rows are different query heads: sink_log2_of).
  CUTE_DEVICE cute::array<float, kRows> finalize(cute::array<float, kRows>& lse,
                                                 cute::array<float, kRows> const& sinks_log2) {
    cute::array<float, kRows> inv_sum;
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      float const l = quad_allreduce(row_sum[mi], SumOp{});
      float const m = row_max[mi];  // -inf for a row that saw no key (then l == 0)
      float const sink_log2 = sinks_log2[mi];
      float const m_new = fmaxf(m, sink_log2);
      // l is in units of 2^(m - kMaxOffset); rescaled to 2^m_new and to true probabilities.
      float const a = m == -INFINITY ? 0.f : exp2f(m - m_new) * exp2f(-float(kMaxOffset));
      float const total = l * a + (sink_log2 == -INFINITY ? 0.f : exp2f(sink_log2 - m_new));
      bool const empty = (total == 0.f) || (total != total);
      inv_sum[mi] = empty ? 0.f : a / total;
      lse[mi] = empty ? -INFINITY : (m_new + __log2f(total)) * float(M_LN2);
    }
    return inv_sum;
  }
};

// The sink logit of a row of kernel head `head`, in the exp2's units (logit * log2(e)); -inf without sinks
// (float32 (nheads_q,) or nullptr). GQA-packed rows (KV caches, rows_per_query g > 1) are query heads: row r of
// kernel head h is query head h g + r % g.
CUTE_HOST_DEVICE float sink_log2_of(float const* sinks, int head, int row = 0, int rows_per_query = 1) {
  return sinks == nullptr ? -INFINITY : sinks[head * rows_per_query + row % rows_per_query] * float(M_LOG2E);
}

// Backward: the probabilities are recomputed from the forward's statistics instead of a running
// max, P = exp2(S * scale_log2 - lse_log2), and the score gradient is dS = P * (dP - D) with
// D = rowsum(dO * O) (minus dLSE when the loss uses LSE). Both take the per-query statistic of every
// element through stat(mi, ni), so the tile can be S or S^T. lse_log2 is +inf for padding rows and
// for rows with no visible key (without sinks; with them such rows are masked), which gives P = 0 there.
template <class TensorS, class Stat>
CUTE_DEVICE void probs_from_lse(TensorS& s, Stat&& lse_log2, float scale_log2) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(s); ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s); ++ni) s(mi, ni) = exp2_approx(s(mi, ni) * scale_log2 - lse_log2(mi, ni));
  }
}

// dP is overwritten with dS; P may be float or the 16-bit P of the dV GEMM.
template <class TensorP, class TensorDP, class Stat>
CUTE_DEVICE void grad_scores(TensorP const& p, TensorDP& dp, Stat&& d) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(p); ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(p); ++ni) dp(mi, ni) = float(p(mi, ni)) * (dp(mi, ni) - d(mi, ni));
  }
}

}  // namespace flashhopper
