// The score-mod hook: a transform of the raw scores S = Q K^T before the mask and the softmax,
// shared by the forward and the backward of both kernel families. The kernels call
//   score_mod.apply(scores)               raw S tile -> modified scores, in place (forward, and the
//                                         backward's recomputation of P)
//   score_mod.softmax_scale_log2(s)       the factor the softmax's exp2 applies to the modified scores
//   score_mod.chain(dS, P, lse_log2)      backward: dS w.r.t. the modified scores -> w.r.t. the scaled raw
//                                         scores (the kernels' softmax_scale on dQ/dK stays where it is)
// `P` is the tile's probabilities (float or 16-bit) and `lse_log2(mi, ni)` the row statistic of each
// element, so a mod can recover what it needs from them instead of keeping a tile of registers alive
// across the dP GEMM (the backward's register budget has no room for one).
#pragma once

#include <cute/config.hpp>
#include <cmath>
#include <stdexcept>
#include <type_traits>

#include "kernel_key.h"
#include "utils.h"

namespace flashhopper {

// Identity (ScoreModKind::kNone): the softmax folds softmax_scale * log2(e) into its exp2 FFMA.
struct ScoreModIdentity {
  template <class TensorS>
  CUTE_DEVICE void apply(TensorS&) const {}
  template <class TensordS, class TensorP, class Stat>
  CUTE_DEVICE void chain(TensordS&, TensorP const&, Stat&&) const {}
  CUTE_HOST_DEVICE float softmax_scale_log2(float scale_log2) const { return scale_log2; }
};

// Gemma 2's logit softcap (ScoreModKind::kSoftcap kernels; cap > 0 from the params): the modified score is
// t = tanh(S * softmax_scale / cap) and the softmax takes cap * t, i.e. exp2(t * cap * log2(e) - ...).
// Backward: d(cap * t)/d(S * scale) = 1 - t^2, with t recovered from P and the LSE, log2(P) + lse_log2 =
// t * cap * log2(e), so no tile of t stays in registers across the dP GEMM. Where P == 0, dS is 0 anyway.
struct ScoreModSoftcap {
  float pre = 0.f;        // softmax_scale / cap
  float cap_log2 = 0.f;   // cap * log2(e)

  CUTE_HOST_DEVICE static ScoreModSoftcap make(float softmax_scale, float softcap) {
    return {softmax_scale / softcap, softcap * float(M_LOG2E)};
  }

  template <class TensorS>
  CUTE_DEVICE void apply(TensorS& s) const {
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) s(i) = tanh_approx(s(i) * pre);
  }
  template <class TensordS, class TensorP, class Stat>
  CUTE_DEVICE void chain(TensordS& ds, TensorP const& p, Stat&& lse_log2) const {
    float const inv = 1.f / cap_log2;
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(ds); ++mi) {
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(ds); ++ni) {
        float const pv = float(p(mi, ni));
        float const t = (log2_approx(pv) + lse_log2(mi, ni)) * inv;
        ds(mi, ni) = pv > 0.f ? ds(mi, ni) * (1.f - fminf(t * t, 1.f)) : 0.f;
      }
    }
  }
  CUTE_HOST_DEVICE float softmax_scale_log2(float) const { return cap_log2; }
};

template <ScoreModKind kKind>
struct ScoreModOf {
  using type = ScoreModIdentity;
};
template <>
struct ScoreModOf<ScoreModKind::kSoftcap> {
  using type = ScoreModSoftcap;
};

// The launchers' constructor of a kernel's ScoreMod from the params' softmax_scale and softcap; a softcap
// kernel needs softcap > 0 and the others softcap == 0 (dispatch keys the call by it).
template <class ScoreMod>
ScoreMod make_score_mod(float softmax_scale, float softcap) {
  if constexpr (std::is_same_v<ScoreMod, ScoreModSoftcap>) {
    if (!(softcap > 0.f)) throw std::invalid_argument("flashhopper: a softcap kernel needs softcap > 0");
    return ScoreModSoftcap::make(softmax_scale, softcap);
  } else {
    if (softcap != 0.f) throw std::invalid_argument("flashhopper: softcap != 0 needs a softcap kernel");
    return {};
  }
}

}  // namespace flashhopper
