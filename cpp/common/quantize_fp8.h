// FP8 quantization in one pass (docs/fp8.md): fp16/bf16 rows in, e4m3 plus one float32 descale per
// (batch, head, block of tokens) out, optionally after a random-sign Hadamard transform of each row
// (incoherent processing) and optionally written transposed for the fp8 PV GEMM (V^T, keys permuted).
//
// One CTA per (token block, head, batch) holds its whole block in registers. A thread owns 64
// contiguous elements of one row, so the Hadamard butterflies of stride < 64 stay inside the thread
// and only those across a row's headdim/64 threads (consecutive lanes) are shuffles. Global memory is
// only touched in coalesced 16-byte runs: the block is loaded into shared memory by the whole CTA
// (eight loads a thread, all in flight), and the fp8 result leaves the same way, row-major or as
// (headdim, keys) bytes for V^T. Memory-bound: 2 bytes read and 1 written per element, once.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "element_type.h"
#include "params.h"

namespace flashhopper {

namespace quant {

inline constexpr int kElems = 64;          // contiguous elements of a row per thread
inline constexpr int kMaxThreads = 512;    // ~110 registers a thread
inline constexpr float kFp8Max = 448.f;    // largest finite e4m3

// Position, inside its aligned group of 16, of key `a` in the V^T layout the fp8 PV GEMM reads
// (inverse of a(l) = 8*((l%4)/2) + 2*(l/4) + l%2, docs/fp8.md).
__host__ __device__ constexpr int vt_position(int a) { return 4 * ((a >> 1) & 3) + 2 * (a >> 3) + (a & 1); }

template <class T>
__device__ __forceinline__ void load8(T const* src, float* v) {
  uint4 const raw = *reinterpret_cast<uint4 const*>(src);
  T const* e = reinterpret_cast<T const*>(&raw);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = float(e[j]);
}

__device__ __forceinline__ uint32_t to_fp8x4(float a, float b, float c, float d) {
  uint32_t const lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  uint32_t const hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// Shared memory of one CTA: the input block (block_size, headdim + 8) elements, then the fp8 block,
// (block_size, headdim + 16) bytes or for V^T (headdim, block_size + 16). The pads keep 16-byte
// alignment and move consecutive rows to other banks.
template <class T, int kHeadDim>
constexpr int in_pitch() { return kHeadDim + 8; }
template <class T, int kHeadDim, bool kTranspose>
int smem_bytes(int block_size) {
  int const out = kTranspose ? kHeadDim * (block_size + 16) : block_size * (kHeadDim + 16);
  return block_size * in_pitch<T, kHeadDim>() * int(sizeof(T)) + out;
}

template <class T, int kHeadDim, bool kTranspose>
__global__ void __launch_bounds__(kMaxThreads) quantize_fp8_kernel(QuantParams const p) {
  constexpr int kLanesPerRow = kHeadDim / kElems;  // 1, 2 or 4
  constexpr int kInPitch = in_pitch<T, kHeadDim>();
  constexpr int kVecsPerRow = kHeadDim / 8;  // 16-byte input vectors per row
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float warp_max[kMaxThreads / 32];

  int const blk = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  int const tid = threadIdx.x, nthreads = blockDim.x;  // nthreads = block_size * kLanesPerRow
  int const B = p.block_size;
  int const token0 = blk * B;
  int const row = tid / kLanesPerRow, part = tid % kLanesPerRow;
  bool const valid = token0 + row < p.seqlen;
  int const col0 = part * kElems;
  T* s_in = reinterpret_cast<T*>(smem);
  uint8_t* s_out = smem + B * kInPitch * sizeof(T);

  {  // The block into shared memory: a warp reads whole rows; rows past seqlen are zeros.
    T const* x = static_cast<T const*>(p.x_ptr) + batch * p.x_batch_stride + head * p.x_head_stride;
    uint4 raw[kElems / 8];  // B * kVecsPerRow == nthreads * kElems / 8
#pragma unroll
    for (int k = 0; k < kElems / 8; ++k) {
      int const i = k * nthreads + tid, r = i / kVecsPerRow, c = i % kVecsPerRow;
      raw[k] = token0 + r < p.seqlen
                   ? *reinterpret_cast<uint4 const*>(x + int64_t(token0 + r) * p.x_row_stride + c * 8)
                   : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kElems / 8; ++k) {
      int const i = k * nthreads + tid, r = i / kVecsPerRow, c = i % kVecsPerRow;
      *reinterpret_cast<uint4*>(s_in + r * kInPitch + c * 8) = raw[k];
    }
  }
  __syncthreads();
  float v[kElems];
#pragma unroll
  for (int i = 0; i < kElems / 8; ++i) load8(s_in + row * kInPitch + col0 + 8 * i, v + 8 * i);

  if (p.signs_ptr != nullptr) {
    float4 const* sign4 = reinterpret_cast<float4 const*>(p.signs_ptr + col0);
#pragma unroll
    for (int i = 0; i < kElems / 4; ++i) {
      float4 const sg = sign4[i];
      v[4 * i] *= sg.x;
      v[4 * i + 1] *= sg.y;
      v[4 * i + 2] *= sg.z;
      v[4 * i + 3] *= sg.w;
    }
    // Butterflies inside the thread (strides 1 .. 32): y_i = x_i + x_{i+h}, y_{i+h} = x_i - x_{i+h}.
#pragma unroll
    for (int h = 1; h < kElems; h *= 2) {
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        if ((j & h) == 0) {
          float const a = v[j], b = v[j + h];
          v[j] = a + b;
          v[j + h] = a - b;
        }
      }
    }
    // Across the row's lanes (strides 64, 128): the lower partner keeps the sum, the upper the difference.
#pragma unroll
    for (int lane_h = 1; lane_h < kLanesPerRow; lane_h *= 2) {
      bool const upper = (part & lane_h) != 0;
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        float const other = __shfl_xor_sync(0xffffffffu, v[j], lane_h);
        v[j] = upper ? other - v[j] : v[j] + other;
      }
    }
    float const norm = kHeadDim == 64 ? 0.125f : (kHeadDim == 256 ? 0.0625f : 0.08838834764831845f);  // 1/sqrt(d)
#pragma unroll
    for (int j = 0; j < kElems; ++j) v[j] *= norm;
  }

  // amax of the block: thread, warp, CTA.
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kElems; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (tid % 32 == 0) warp_max[tid / 32] = amax;
  __syncthreads();
  amax = 0.f;
  for (int w = 0; w < nthreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
  // IEEE division (not the fast-math approximation) so that the reference reproduces the bytes.
  float const inv = amax > 0.f ? __fdiv_rn(kFp8Max, amax) : 0.f;
  if (tid == 0) {
    p.scale_ptr[batch * p.scale_batch_stride + head * p.scale_head_stride + blk * p.scale_block_stride] =
        amax > 0.f ? __fdiv_rn(amax, kFp8Max) : 1.f;
  }

  uint8_t* out = static_cast<uint8_t*>(p.out_ptr) + batch * p.out_batch_stride + head * p.out_head_stride;
  if constexpr (!kTranspose) {
    // Stage (B, headdim) bytes, then write whole rows (a warp covers 512 contiguous bytes of them).
    constexpr int kOutPitch = kHeadDim + 16;
    uint4* dst = reinterpret_cast<uint4*>(s_out + row * kOutPitch + col0);
#pragma unroll
    for (int i = 0; i < kElems / 16; ++i) {
      float const* w = v + 16 * i;
      dst[i] = make_uint4(to_fp8x4(w[0] * inv, w[1] * inv, w[2] * inv, w[3] * inv),
                          to_fp8x4(w[4] * inv, w[5] * inv, w[6] * inv, w[7] * inv),
                          to_fp8x4(w[8] * inv, w[9] * inv, w[10] * inv, w[11] * inv),
                          to_fp8x4(w[12] * inv, w[13] * inv, w[14] * inv, w[15] * inv));
    }
    __syncthreads();
    constexpr int kRuns = kHeadDim / 16;
    for (int i = tid; i < B * kRuns; i += nthreads) {
      int const r = i / kRuns, c = i % kRuns;
      if (token0 + r < p.seqlen) {
        *reinterpret_cast<uint4*>(out + int64_t(token0 + r) * p.out_row_stride + c * 16) =
            *reinterpret_cast<uint4 const*>(s_out + r * kOutPitch + c * 16);
      }
    }
  } else {
    // Stage (headdim, B) bytes with the keys in V^T order, then write whole 16-byte runs of keys.
    // Lanes of a warp hold consecutive keys, so one byte store covers 32 (or 16 x 2) adjacent bytes.
    uint8_t* smem_vt = s_out;
    int const ld = B + 16;  // row pitch: keeps 16-byte alignment for the reads below
    int const pos = (row & ~15) + vt_position(row & 15);
#pragma unroll
    for (int j = 0; j < kElems; j += 2) {
      // Padding keys: +0 bytes (the signs of the Hadamard transform may have made their zeros -0).
      uint16_t const two = valid ? __nv_cvt_float2_to_fp8x2(make_float2(v[j] * inv, v[j + 1] * inv), __NV_SATFINITE,
                                                            __NV_E4M3)
                                 : uint16_t(0);
      smem_vt[(col0 + j) * ld + pos] = uint8_t(two & 0xff);
      smem_vt[(col0 + j + 1) * ld + pos] = uint8_t(two >> 8);
    }
    __syncthreads();
    int const seqlen_pad = (p.seqlen + 15) / 16 * 16;
    int const runs = B / 16;
    for (int i = tid; i < kHeadDim * runs; i += nthreads) {
      int const dim = i / runs, run = i % runs;
      int const key = token0 + run * 16;
      if (key < seqlen_pad) {
        *reinterpret_cast<uint4*>(out + dim * p.out_dim_stride + key) =
            *reinterpret_cast<uint4 const*>(smem_vt + dim * ld + run * 16);
      }
    }
  }
}

template <class T, int kHeadDim>
void launch_quantize(QuantParams const& p, cudaStream_t stream) {
  int const threads = p.block_size * (kHeadDim / kElems);  // one row (part) per thread
  dim3 const grid((p.seqlen + p.block_size - 1) / p.block_size, p.nheads, p.batch);
  auto launch = [&](auto transpose) {
    constexpr bool kTranspose = decltype(transpose)::value;
    auto kernel = &quantize_fp8_kernel<T, kHeadDim, kTranspose>;
    int const smem = smem_bytes<T, kHeadDim, kTranspose>(p.block_size);
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    kernel<<<grid, threads, smem, stream>>>(p);
  };
  if (p.transpose) {
    launch(std::true_type{});
  } else {
    launch(std::false_type{});
  }
}

}  // namespace quant

// Host entry: checks what the kernel assumes, then dispatches on (input type, head dim).
inline void quantize_fp8(QuantParams const& p, cudaStream_t stream) {
  auto fail = [](std::string const& why) { throw std::invalid_argument("flashhopper.quantize_fp8: " + why); };
  if (p.headdim != 64 && p.headdim != 128 && p.headdim != 256) fail("headdim must be 64, 128 or 256");
  // Whole warps (one thread per 64 elements of a row): at headdim 64 the block is a multiple of 32.
  if (p.block_size < 16 || p.block_size % 16 != 0 || p.block_size * p.headdim % (32 * quant::kElems) != 0 ||
      p.block_size * p.headdim > quant::kElems * quant::kMaxThreads) {
    fail("block_size must be a multiple of 16 (of 32 at headdim 64) with block_size * headdim <= 32768");
  }
  if (p.seqlen <= 0 || p.batch <= 0 || p.nheads <= 0) return;
  auto by_dim = [&](auto tag) {
    using T = decltype(tag);
    switch (p.headdim) {
      case 64: quant::launch_quantize<T, 64>(p, stream); break;
      case 128: quant::launch_quantize<T, 128>(p, stream); break;
      default: quant::launch_quantize<T, 256>(p, stream); break;
    }
  };
  if (p.dtype == DType::kFloat16) {
    by_dim(__half{});
  } else if (p.dtype == DType::kBFloat16) {
    by_dim(__nv_bfloat16{});
  } else {
    fail("x must be float16 or bfloat16");
  }
}

}  // namespace flashhopper
