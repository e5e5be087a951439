// The feature key: what a compiled kernel computes, from the generator (cpp/generate_kernels.py) through
// the registry and the bindings to Python's dispatch (python/flashhopper/kernel_key.py mirrors the
// fields; tests/test_kernel_key.py checks that the two agree). A new feature that needs its own
// instantiation adds one field here, one there, and a loop in the generator.
#pragma once

#include <cstring>
#include <string>

#include "params.h"

namespace flashhopper {

// Which (query row, key) pairs take part (common/mask.h): none, causal (bottom-right), or a local
// window (window_left / window_right of the params, flash-attn's convention; causal is the window
// (unbounded, 0) with the right edge known at compile time).
enum class MaskKind : int { kNone = 0, kCausal = 1, kWindow = 2 };

inline char const* mask_name(MaskKind m) {
  switch (m) {
    case MaskKind::kNone: return "none";
    case MaskKind::kCausal: return "causal";
    case MaskKind::kWindow: return "window";
  }
  return "unknown";
}

// What the scores go through before the mask and the softmax (common/score_mod.h): nothing, or Gemma 2's
// softcap (its value is a runtime param). A template parameter, not a runtime branch: the branch sits in the
// key-block loop, and in the kernels without a softcap it cost 1-4% (docs/perf-notes.md, issue #23).
enum class ScoreModKind : int { kNone = 0, kSoftcap = 1 };

inline char const* score_mod_name(ScoreModKind s) {
  switch (s) {
    case ScoreModKind::kNone: return "none";
    case ScoreModKind::kSoftcap: return "softcap";
  }
  return "unknown";
}

// Where K/V come from (sm90/kv_blocks.h): the attention's own tensors (off), or a (paged) KV cache of the
// queries' element type (on), or of e4m3 with one float32 scale per (token, kv head) (e4m3: the Hopper
// producer warpgroup converts each stage to the queries' type in shared memory; docs/kvcache-fp8.md).
enum class KVCacheKind : int { kOff = 0, kOn = 1, kE4M3 = 2 };

inline char const* kvcache_name(KVCacheKind k) {
  switch (k) {
    case KVCacheKind::kOff: return "off";
    case KVCacheKind::kOn: return "on";
    case KVCacheKind::kE4M3: return "e4m3";
  }
  return "unknown";
}

// X(type, name): every field of the key, in order. The bindings expose them by this list.
#define FLASHHOPPER_KERNEL_KEY_FIELDS(X) \
  X(int, arch)              /* 90: Hopper path (sm_90a); 80: Ampere path (sm_80, also runs on sm_86..sm_90) */ \
  X(DType, dtype)           /* element type of Q, K, V */ \
  X(int, headdim)           /* of Q and K */ \
  X(int, headdim_v)         /* of V and O */ \
  X(MaskKind, mask)                                                                                              \
  X(std::string, variant)   /* "" = production; else a named ablation variant (generate_kernels.py) */ \
  X(ScoreModKind, score_mod)                                                                                     \
  X(bool, dropout)          /* P's scores dropped at random (common/dropout.h); training kernels */ \
  X(bool, varlen)           /* packed batches: cu_seqlens / seqused bounds (common/seqlen.h) */ \
  X(KVCacheKind, kvcache)   /* K/V from a (paged) cache: page table, cache_seqlens, split-KV (sm90/kv_blocks.h) */

struct KernelKey {
#define FLASHHOPPER_KEY_MEMBER(type, name) type name{};
  FLASHHOPPER_KERNEL_KEY_FIELDS(FLASHHOPPER_KEY_MEMBER)
#undef FLASHHOPPER_KEY_MEMBER

  bool operator==(KernelKey const& o) const {
    bool same = true;
#define FLASHHOPPER_KEY_EQ(type, name) same = same && name == o.name;
    FLASHHOPPER_KERNEL_KEY_FIELDS(FLASHHOPPER_KEY_EQ)
#undef FLASHHOPPER_KEY_EQ
    return same;
  }

  std::string describe() const {
    return "sm" + std::to_string(arch) + " " + dtype_name(dtype) + " headdim " + std::to_string(headdim) +
           (headdim_v != headdim ? "/" + std::to_string(headdim_v) : std::string()) + " mask " + mask_name(mask) +
           (score_mod == ScoreModKind::kNone ? std::string() : std::string(" ") + score_mod_name(score_mod)) +
           (dropout ? " dropout" : "") + (varlen ? " varlen" : "") + (kvcache == KVCacheKind::kOff ? std::string()
                                                              : kvcache == KVCacheKind::kOn ? std::string(" kvcache")
                                                                                            : std::string(" kvcache e4m3")) +
           (variant.empty() ? std::string() : " variant " + variant);
  }
};

// A production configuration has no variant.
struct DefaultVariant {
  static constexpr char const* kName = "";
};

// The compile-time image of a KernelKey: what the generated translation units instantiate the
// launchers with. Variant: a family's policy type (e.g. sm90/variants.h), DefaultVariant in production.
template <int kArch_, DType kDType_, int kHeadDim_, int kHeadDimV_, MaskKind kMask_,
          ScoreModKind kScoreMod_ = ScoreModKind::kNone, bool kDropout_ = false, bool kVarlen_ = false,
          KVCacheKind kKVCache_ = KVCacheKind::kOff, class Variant_ = DefaultVariant>
struct KernelConfig {
  static constexpr int kArch = kArch_;
  static constexpr DType kDType = kDType_;
  static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDimV_;
  static constexpr MaskKind kMask = kMask_;
  static constexpr ScoreModKind kScoreMod = kScoreMod_;
  static constexpr bool kDropout = kDropout_;
  static constexpr bool kVarlen = kVarlen_;
  static constexpr KVCacheKind kKVCacheKind = kKVCache_;
  static constexpr bool kKVCache = kKVCache_ != KVCacheKind::kOff;
  static constexpr bool kKVCacheFp8 = kKVCache_ == KVCacheKind::kE4M3;  // e4m3 cache, 16-bit queries
  using Variant = Variant_;
  static KernelKey key() {
    return {kArch, kDType, kHeadDim, kHeadDimV, kMask, Variant::kName, kScoreMod, kDropout, kVarlen, kKVCacheKind};
  }
};

}  // namespace flashhopper
