// The score-mod hook: a transform of the raw scores S = Q K^T before the mask and the softmax,
// shared by the forward and the backward of both kernel families. The kernels call
//   score_mod.apply(scores)               raw S tile -> modified scores, in place (forward, and the
//                                         backward's recomputation of P)
//   score_mod.softmax_scale_log2(s)       the factor the softmax's exp2 applies to the modified scores
//   score_mod.chain(dS, P, lse_log2)      backward: dS w.r.t. the modified scores -> w.r.t. the scaled raw
//                                         scores (the kernels' softmax_scale on dQ/dK stays where it is)
//   g = score_mod.apply_keep_grad(S)      as apply, and returns what chain_kept needs (a tile kept across
//   score_mod.chain_kept(dS, g)           the dP GEMM): the sm90 backward where P^T lives in registers
// `P` is the tile's probabilities (float or 16-bit) and `lse_log2(mi, ni)` the row statistic of each
// element, so chain can recover what it needs from them where a tile kept across the dP GEMM would not
// fit (the sm80 backward, the sm90 tiles that stage P through shared memory).
#pragma once

#include <cuda_fp16.h>
#include <cute/config.hpp>
#include <cmath>
#include <stdexcept>
#include <type_traits>

#include "kernel_key.h"
#include "utils.h"

namespace flashhopper {

// Identity (ScoreModKind::kNone): the softmax folds softmax_scale * log2(e) into its exp2 FFMA.
struct ScoreModIdentity {
  struct NoGrad {};
  template <class TensorS>
  CUTE_DEVICE void apply(TensorS&) const {}
  template <class TensorS>
  CUTE_DEVICE NoGrad apply_keep_grad(TensorS&) const { return {}; }
  template <class TensordS, class TensorP, class Stat>
  CUTE_DEVICE void chain(TensordS&, TensorP const&, Stat&&) const {}
  template <class TensordS>
  CUTE_DEVICE void chain_kept(TensordS&, NoGrad) const {}
  CUTE_HOST_DEVICE float softmax_scale_log2(float scale_log2) const { return scale_log2; }
};

// Gemma 2's logit softcap (ScoreModKind::kSoftcap kernels; cap > 0 from the params): the modified score is
// t = tanh(S * softmax_scale / cap) and the softmax takes cap * t, i.e. exp2(t * cap * log2(e) - ...).
// Backward: d(cap * t)/d(S * scale) = 1 - t^2, either kept from the recomputation (chain_kept) or with t
// recovered from P and the LSE, log2(P) + lse_log2 = t * cap * log2(e) (chain). Where P == 0, dS is 0 anyway.
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
  // The backward where a tile of registers is free across the dP GEMM (the sm90 kernels with P^T in registers): the
  // derivative 1 - t^2 is kept from the forward recomputation, so chain_kept is one FMUL a score where chain spends a
  // MUFU.LG2 and ~6 more instructions (FA3 keeps it too).
  // Held as fp16 pairs (half the registers; 1 - t^2 is in [0, 1], and dS is rounded to 16 bits anyway).
  template <class TensorS>
  CUTE_DEVICE auto apply_keep_grad(TensorS& s) const {
    constexpr int kN = decltype(size(s))::value;
    static_assert(kN % 2 == 0);
    cute::array<__half2, kN / 2> g;
    CUTE_UNROLL
    for (int i = 0; i < kN / 2; ++i) {
      float const a = tanh_approx(s(2 * i) * pre), b = tanh_approx(s(2 * i + 1) * pre);
      s(2 * i) = a;
      s(2 * i + 1) = b;
      g[i] = __floats2half2_rn(fmaf(-a, a, 1.f), fmaf(-b, b, 1.f));
    }
    return g;
  }
  template <class TensordS, class Grad>
  CUTE_DEVICE void chain_kept(TensordS& ds, Grad const& g) const {
    CUTE_UNROLL
    for (int i = 0; i < decltype(size(ds))::value / 2; ++i) {
      float2 const f = __half22float2(g[i]);
      ds(2 * i) *= f.x;
      ds(2 * i + 1) *= f.y;
    }
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
