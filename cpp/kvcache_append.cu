// The KV-cache append kernels (common/kvcache_append.h); built with the Hopper family, whose KV-cache kernels
// they feed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/hadamard_signs.h"
#include "common/kvcache_append.h"
#include "registry.h"

namespace flashhopper {

namespace {

// (page, row) of entry b's new token t in the cache's first two dims.
__device__ __forceinline__ void cache_place(KVAppendParams const& p, int b, int t, int64_t& page, int64_t& row) {
  int const pos = (p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.seqlen_offset) + t;
  if (p.page_table != nullptr) {
    page = p.page_table[b * p.table_stride + pos / p.page_size];
    row = pos % p.page_size;
  } else {
    page = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    row = pos;
  }
}

void check_launch(char const* what) {
  cudaError_t const err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("flashhopper: ") + what + ": " + cudaGetErrorString(err));
}

}  // namespace

__global__ void kvcache_append_kernel(KVAppendParams const p) {
  int const which = blockIdx.y;  // 0: K, 1: V
  int const vecs = p.row_bytes[which] / 16;
  int64_t const total = int64_t(p.batch) * p.seqlen_new * p.heads * vecs;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    int const vec = int(i % vecs);
    int64_t r = i / vecs;
    int const h = int(r % p.heads);
    r /= p.heads;
    int const t = int(r % p.seqlen_new);
    int const b = int(r / p.seqlen_new);
    int64_t page, row;
    cache_place(p, b, t, page, row);
    // Strides in bytes from here: element strides x (row bytes / headdim) are folded by the host.
    char* dst = static_cast<char*>(p.cache[which]) + page * p.cache_page_stride[which] +
                row * p.cache_row_stride[which] + h * p.cache_head_stride[which] + vec * 16;
    char const* src = static_cast<char const*>(p.src[which]) + b * p.src_batch_stride[which] +
                      int64_t(t) * p.src_row_stride[which] + h * p.src_head_stride[which] + vec * 16;
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<uint4 const*>(src);
  }
}

// A warp per new row (entry, token, head) of K (blockIdx.y 0) or V (1): lane l holds elements [kE l, kE l + kE).
// K's transform y = H diag(signs) x / sqrt(d) (Sylvester H, hadamard_signs.h's signs): the butterflies of stride
// < kE inside the lane, the others against lane l ^ (stride / kE) (the lower index keeps the sum, the upper the
// difference); its 1/sqrt(d) folded into the amax and the multiplier, as the quantization kernel does. Then
// scale = amax / 448 (1 for a zero row) and data = e4m3(y * (448 / amax)), IEEE divisions and round to nearest
// even (saturating), as kvcache_fp8.quantize_rows.
template <class T, int kE>
__global__ void kvcache_append_fp8_kernel(KVAppendParams const p) {
  int const which = blockIdx.y;
  int const lane = threadIdx.x % 32;
  int64_t const rows = int64_t(p.batch) * p.seqlen_new * p.heads;
  int64_t const warps = int64_t(gridDim.x) * (blockDim.x / 32);
  bool const hadamard = which == 0 && p.hadamard_k;
  uint32_t const key = hadamard_sign_key(p.hadamard_seed);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    int const h = int(r % p.heads);
    int const t = int(r / p.heads % p.seqlen_new);
    int const b = int(r / p.heads / p.seqlen_new);
    T const* src = reinterpret_cast<T const*>(static_cast<char const*>(p.src[which]) + b * p.src_batch_stride[which] +
                                              int64_t(t) * p.src_row_stride[which] + h * p.src_head_stride[which]) +
                   kE * lane;
    float v[kE];
    // kE 16-bit elements: 4, 8 or 16 bytes, aligned (16-byte rows, 16-byte strides).
    using Vec = std::conditional_t<kE == 2, uint32_t, std::conditional_t<kE == 4, uint2, uint4>>;
    Vec raw = *reinterpret_cast<Vec const*>(src);
    T const* e = reinterpret_cast<T const*>(&raw);
#pragma unroll
    for (int j = 0; j < kE; ++j) v[j] = float(e[j]);
    if (hadamard) {
#pragma unroll
      for (int j = 0; j < kE; ++j) {
        if (hadamard_sign_negative(key, kE * lane + j)) v[j] = -v[j];
      }
#pragma unroll
      for (int s = 1; s < kE; s *= 2) {
#pragma unroll
        for (int j = 0; j < kE; ++j) {
          if ((j & s) == 0) {
            float const a = v[j], c = v[j + s];
            v[j] = a + c;
            v[j + s] = a - c;
          }
        }
      }
#pragma unroll
      for (int m = 1; m < 32; m *= 2) {
        bool const upper = (lane & m) != 0;
#pragma unroll
        for (int j = 0; j < kE; ++j) {
          float const other = __shfl_xor_sync(0xffffffffu, v[j], m);
          v[j] = upper ? other - v[j] : v[j] + other;
        }
      }
    }
    // (fmaxf skips NaN: a row with a NaN keeps its other elements and a finite scale, where quantize_rows' amax is
    // NaN, giving scale 1 and zeros; with fast math's flush to zero, a row of only fp32 denormals quantizes to zeros.
    // Both differ from quantize_rows' bytes; finite rows above 2^-126 match.)
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < kE; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float const norm = !hadamard ? 1.f : (kE == 2 ? 0.125f : (kE == 8 ? 0.0625f : 0.08838834764831845f));
    amax *= norm;
    float const mul = (amax > 0.f ? __fdiv_rn(448.f, amax) : 0.f) * norm;
    int64_t page, row;
    cache_place(p, b, t, page, row);
    using OutVec = std::conditional_t<kE == 2, uint16_t, std::conditional_t<kE == 4, uint32_t, uint2>>;
    alignas(OutVec) uint8_t out[kE];
#pragma unroll
    for (int j = 0; j < kE; j += 2) {
      __nv_fp8x2_storage_t const two =
          __nv_cvt_float2_to_fp8x2(make_float2(v[j] * mul, v[j + 1] * mul), __NV_SATFINITE, __NV_E4M3);
      out[j] = uint8_t(two & 0xff), out[j + 1] = uint8_t(two >> 8);
    }
    char* dst = static_cast<char*>(p.cache[which]) + page * p.cache_page_stride[which] +
                row * p.cache_row_stride[which] + h * p.cache_head_stride[which] + kE * lane;
    *reinterpret_cast<OutVec*>(dst) = *reinterpret_cast<OutVec const*>(out);
    if (lane == 0) {
      p.scale[which][page * p.scale_page_stride[which] + h * p.scale_head_stride[which] + row] =
          amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
    }
  }
}

int64_t launch_kvcache_append(KVAppendParams const& p, cudaStream_t stream) {
  constexpr int kThreads = 256;
  if (p.scale[0] != nullptr || p.scale[1] != nullptr) {
    if (p.scale[0] == nullptr || p.scale[1] == nullptr) {
      throw std::invalid_argument("flashhopper: an e4m3 cache append needs both scale arrays");
    }
    int64_t const rows = int64_t(p.batch) * p.seqlen_new * p.heads;
    if (rows == 0) return 0;
    int64_t const blocks = std::min<int64_t>((rows + kThreads / 32 - 1) / (kThreads / 32), 4096);
    dim3 const grid(unsigned(blocks), 2);
    auto go = [&](auto kernel) { kernel<<<grid, kThreads, 0, stream>>>(p); };
    switch (p.headdim * (p.src_bf16 ? 1 : -1)) {
      case 64: go(kvcache_append_fp8_kernel<__nv_bfloat16, 2>); break;
      case 128: go(kvcache_append_fp8_kernel<__nv_bfloat16, 4>); break;
      case 256: go(kvcache_append_fp8_kernel<__nv_bfloat16, 8>); break;
      case -64: go(kvcache_append_fp8_kernel<__half, 2>); break;
      case -128: go(kvcache_append_fp8_kernel<__half, 4>); break;
      case -256: go(kvcache_append_fp8_kernel<__half, 8>); break;
      default: throw std::invalid_argument("flashhopper: the e4m3 cache append takes head dims 64, 128 and 256");
    }
    check_launch("kvcache e4m3 append launch");
    return blocks * 2;
  }
  for (int w = 0; w < 2; ++w) {
    if (p.row_bytes[w] <= 0 || p.row_bytes[w] % 16 != 0) {
      throw std::invalid_argument("flashhopper: kvcache append rows must be multiples of 16 bytes");
    }
  }
  int64_t const total = int64_t(p.batch) * p.seqlen_new * p.heads * (std::max(p.row_bytes[0], p.row_bytes[1]) / 16);
  if (total == 0) return 0;
  int64_t const blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 4096);
  kvcache_append_kernel<<<dim3(unsigned(blocks), 2), kThreads, 0, stream>>>(p);
  check_launch("kvcache append launch");
  return blocks * 2;
}

}  // namespace flashhopper
