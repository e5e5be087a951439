// The random signs of the Hadamard transform (incoherent processing, docs/fp8.md): sign i of seed s is
// negative iff bit 0 of mix(mix(lo(s) ^ mix(hi(s) ^ 0x85ebca6b)) ^ (i * 0x9e3779b9)) is set, with mix the
// 32-bit integer hash below (lo, hi: the seed's 64 bits). A pure function of (seed, i), so the
// quantization kernel computes the signs itself (nothing to copy to the device, which CUDA-graph
// capture forbids) and Python's hadamard_signs (python/flashhopper/fp8/format.py) gives the same ones.
#pragma once

#include <cstdint>

namespace flashhopper {

__host__ __device__ constexpr uint32_t hash_mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

__host__ __device__ constexpr uint32_t hadamard_sign_key(uint64_t seed) {
  return hash_mix32(uint32_t(seed) ^ hash_mix32(uint32_t(seed >> 32) ^ 0x85ebca6bu));
}

// True where sign i of the seed whose key is `key` is -1.
__host__ __device__ constexpr bool hadamard_sign_negative(uint32_t key, int i) {
  return (hash_mix32(key ^ (uint32_t(i) * 0x9e3779b9u)) & 1u) != 0;
}

}  // namespace flashhopper
