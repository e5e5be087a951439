// The score-mod hook: a transform of the raw scores S = Q K^T before the mask and the softmax,
// shared by the forward and the backward of both kernel families. The forward calls
//   score_mod.apply(scores)                 raw S tile (row, col) -> modified scores, in place
//   score_mod.softmax_scale_log2(s)         the factor the softmax's exp2 applies to them
// and the backward, which recomputes P from S, additionally
//   auto grad = score_mod.apply_with_grad(scores)   the same transform, keeping what dS needs
//   score_mod.chain(dscores, grad)                  dS w.r.t. the modified scores -> w.r.t. raw S
// Identity (today's only mod) is free: the softmax folds softmax_scale * log2(e) into its exp2 FFMA,
// as before. A tanh softcap would be apply: s = tanh(s * softmax_scale / cap), softmax_scale_log2:
// cap * log2(e), and chain: ds *= (1 - tanh^2) * softmax_scale / cap (the backward's dK/dQ scale
// then moves into chain), each behind its own template type, so the identity kernels do not change.
#pragma once

#include <cute/config.hpp>

namespace flashhopper {

struct ScoreModIdentity {
  struct Grad {};  // nothing to keep for dS

  template <class TensorS>
  CUTE_DEVICE void apply(TensorS&) const {}
  template <class TensorS>
  CUTE_DEVICE Grad apply_with_grad(TensorS&) const {
    return {};
  }
  template <class TensordS>
  CUTE_DEVICE void chain(TensordS&, Grad const&) const {}
  CUTE_HOST_DEVICE float softmax_scale_log2(float scale_log2) const { return scale_log2; }
};

}  // namespace flashhopper
