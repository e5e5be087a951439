// FP8 quantization in one pass (docs/fp8.md): fp16/bf16 rows in, e4m3 plus one float32 descale per
// (batch, head, block of tokens) out, optionally after a random-sign Hadamard transform of each row
// (incoherent processing) and optionally written transposed for the fp8 PV GEMM (V^T, keys permuted).
//
// A CTA holds one (token block, head, batch) block in registers at a time and walks several of them
// (persistent: as many CTAs as fit), copying the next block into shared memory with cp.async while it
// transforms this one. A thread owns 64 contiguous elements of one row, so the Hadamard butterflies
// of stride < 64 stay inside the thread and only those across a row's headdim/64 threads (consecutive
// lanes) are shuffles: half exchanges of 32 values (slot_dim). Global memory is only touched in
// coalesced 16-byte runs: the block comes into shared memory by the whole CTA (eight 16-byte copies a
// thread), and the fp8 result leaves the same way, row-major or as (headdim, keys) bytes for V^T.
// Memory-bound: 2 bytes read and 1 written per element, once (docs/perf-notes.md).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "device_info.h"
#include "element_type.h"
#include "hadamard_signs.h"
#include "params.h"

namespace flashhopper {

namespace quant {

inline constexpr int kElems = 64;          // contiguous elements of a row per thread
inline constexpr int kMaxThreads = 512;    // 128 registers a thread at most
inline constexpr float kFp8Max = 448.f;    // largest finite e4m3

// Position, inside its aligned group of 16, of key `a` in the V^T layout the fp8 PV GEMM reads
// (inverse of a(l) = 8*((l%4)/2) + 2*(l/4) + l%2, docs/fp8.md).
__host__ __device__ constexpr int vt_position(int a) { return 4 * ((a >> 1) & 3) + 2 * (a >> 3) + (a & 1); }

// Eight elements from shared memory, their sign bits flipped where `flip` has them set (the random
// signs of the Hadamard transform, applied exactly on the 16-bit inputs: one XOR per two elements).
template <class T>
__device__ __forceinline__ void load8(T const* src, uint4 flip, float* v) {
  uint4 raw = *reinterpret_cast<uint4 const*>(src);
  raw.x ^= flip.x;
  raw.y ^= flip.y;
  raw.z ^= flip.z;
  raw.w ^= flip.w;
  uint32_t const* w = &raw.x;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      // bf16 is the upper half of a float: one shift or mask per element (the generic conversion
      // spends an extra PRMT on the upper one).
      v[2 * j] = __uint_as_float(w[j] << 16);
      v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    } else {
      T const* e = reinterpret_cast<T const*>(w + j);
      v[2 * j] = float(e[0]);
      v[2 * j + 1] = float(e[1]);
    }
  }
}

__device__ __forceinline__ uint32_t to_fp8x4(float a, float b, float c, float d) {
  uint32_t const lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  uint32_t const hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// The Hadamard butterflies across a row's threads (strides 64 and 128) are half exchanges: of the two
// partners of lane bit k, each keeps both outputs (sum and difference) of the element indices whose bit
// 5 - k is its lane bit k, and receives the partner's 32 values of those: 32 shuffles a stage, not 64.
// For the values sent to be in the same register slots in both partners, a thread holds element e of
// its 64 in slot e ^ lbl, lbl < 64 having lane bit k at bit 5 - k (it loads its 16-byte vectors in that
// order). Every butterfly, of stride h on a = v[j], b = v[j + h], is v[j] = fma(s, a, b),
// v[j + h] = fma(-s, b, a) with s = 1: a + b, a - b; or with s = -1 where lbl has bit h (the lower element
// in b): b - a, b + a, the difference and sum in the slots the labelling gives them, rounded as the plain
// adds (the products by +-1 are exact). A half exchange is that butterfly with b from the partner's slot
// j + h; then slot bit 5 - k stands for dim bit 6 + k (XOR lane bit k) and lane bit k for element bit
// 5 - k: in the end the thread at col0 holds dim col0 ^ lbl ^ slot_dim(q) in slot q.
template <int kLanesPerRow>
__host__ __device__ constexpr int slot_dim(int q) {
  for (int k = 0; (1 << k) < kLanesPerRow; ++k) {
    int const h = kElems / 2 >> k;
    if (q & h) q ^= h | kElems << k;  // slot bit 5 - k to dim bit 6 + k
  }
  return q;
}

// Shared memory of one CTA: two input blocks (block_size, headdim + 8) elements (the next one loads
// while this one is transformed), then the fp8 block, (block_size, out_pitch) bytes or for V^T
// (headdim, block_size + vt_pitch_pad) bytes. The pads keep 16-byte alignment and move consecutive rows
// to other banks.
template <class T, int kHeadDim>
constexpr int in_pitch() { return kHeadDim + 8; }
// Row-major staging: a thread stores 16-byte runs, its own 64 bytes or with the transform runs spread over
// the row (slot_dim). For those a pad of 16 bytes per thread of the row puts the stores of a quarter warp
// (2 or 4 rows) on distinct banks (at head dim 128 with the row parity in lbl).
template <int kHeadDim>
__host__ __device__ constexpr int out_pitch(bool hadamard) {
  return kHeadDim + 16 * (hadamard ? kHeadDim / kElems : 1);
}
// V^T staging: dim row d starts kVtSkew * (d / kElems) bytes further in, so that the byte stores of the
// row's 64-element parts (which are 64 dim rows apart: the same bank for any even pitch) spread over
// other banks.
inline constexpr int kVtSkew = 16;
template <int kHeadDim>
constexpr int vt_pitch_pad() { return 16 + kVtSkew * (kHeadDim / kElems - 1); }
template <class T, int kHeadDim>
__host__ __device__ constexpr int in_bytes(int block_size) { return block_size * in_pitch<T, kHeadDim>() * int(sizeof(T)); }
template <class T, int kHeadDim, bool kTranspose>
int smem_bytes(int block_size, bool hadamard) {
  int const out = kTranspose ? kHeadDim * (block_size + vt_pitch_pad<kHeadDim>())
                             : block_size * out_pitch<kHeadDim>(hadamard);
  return 2 * in_bytes<T, kHeadDim>(block_size) + out;
}

__device__ __forceinline__ void cp_async_16(void* smem, void const* gmem, bool valid) {
  // src-size 0 fills the 16 bytes with zeros (rows past seqlen).
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(uint32_t(__cvta_generic_to_shared(smem))),
               "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}

// Persistent CTAs: each walks the (token block, head, batch) blocks with a stride of the grid, and
// copies block i+1 into its second input buffer (cp.async, no registers) while it transforms block i.
// One 512-thread CTA per SM at head dim 256 (128 registers a thread) could not overlap its own loads,
// transform and stores otherwise.
template <class T, int kHeadDim, bool kTranspose>
__global__ void __launch_bounds__(kMaxThreads) quantize_fp8_kernel(QuantParams const p) {
  constexpr int kLanesPerRow = kHeadDim / kElems;  // 1, 2 or 4
  constexpr int kInPitch = in_pitch<T, kHeadDim>();
  constexpr unsigned kVecsPerRow = kHeadDim / 8;  // 16-byte input vectors per row
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float warp_max[kMaxThreads / 32];
  __shared__ __align__(16) uint32_t sign_flip[kHeadDim / 2];  // sign bits of the random signs, 2 per word

  int const tid = threadIdx.x, nthreads = blockDim.x;  // nthreads = block_size * kLanesPerRow
  int const B = p.block_size;
  int const row = tid / kLanesPerRow, part = tid % kLanesPerRow;
  int const col0 = part * kElems;
  bool const packed = p.cu_seqlens != nullptr;
  // Packed: the blocks of all sequences in one block mode (first_block below), none per batch slice.
  int const blocks_per_head = packed ? p.seqlen / B + p.batch : (p.seqlen + B - 1) / B;
  int const num_work = blocks_per_head * p.nheads * (packed ? 1 : p.batch);
  bool const hadamard = p.hadamard;
  // The transform's slot labelling (slot_dim): lane bit k at bit 5 - k; at head dim 128 also the row's
  // parity at bit 4 (the same in both partners), for the banks of the staging stores (out_pitch).
  int const lbl = !hadamard ? 0
                  : kLanesPerRow == 4 ? (part & 1) << 5 | (part & 2) << 3
                  : kLanesPerRow == 2 ? part << 5 | (row & 1) << 4
                  : 0;
  auto s_in = [&](int buf) { return reinterpret_cast<T*>(smem + buf * in_bytes<T, kHeadDim>(B)); };
  uint8_t* s_out = smem + 2 * in_bytes<T, kHeadDim>(B);
  if (hadamard) {  // read by all threads after the loop's first barrier
    uint32_t const key = hadamard_sign_key(uint64_t(p.hadamard_seed));
    for (int i = tid; i < kHeadDim / 2; i += nthreads) {
      sign_flip[i] = (hadamard_sign_negative(key, 2 * i) ? 0x8000u : 0u) |
                     (hadamard_sign_negative(key, 2 * i + 1) ? 0x80000000u : 0u);
    }
  }

  // A block of work: `rows` rows of x from row `token0` of batch slice `batch` (<= 0: none; the rest are
  // zeros; row-major out has the same rows), its scale block `blk` and V^T's first key for it `col`.
  struct Work {
    int blk, head, batch, token0, rows, col;
  };
  auto decode = [&](int work) {
    int const bh = work / blocks_per_head;
    int const blk = work - bh * blocks_per_head;
    if (!packed) {
      int const token0 = blk * B;
      return Work{blk, bh % p.nheads, bh / p.nheads, token0, p.seqlen - token0, token0};
    }
    // The sequence whose blocks hold blk: the last b with first_block(b) = cu_seqlens[b] / B + b <= blk
    // (strictly increasing in b).
    int lo = 0, hi = p.batch - 1;
    while (lo < hi) {
      int const mid = (lo + hi + 1) / 2;
      if (p.cu_seqlens[mid] / B + mid <= blk) lo = mid; else hi = mid - 1;
    }
    int const start = p.cu_seqlens[lo], j = blk - (start / B + lo);
    int const rows = p.batch > 0 ? p.cu_seqlens[lo + 1] - start - j * B : 0;
    return Work{blk, bh, 0, start + j * B, rows, blk * B};
  };
  // One block into an input buffer: a warp reads whole rows; rows past the block's are zeros.
  auto load_async = [&](Work const& w, T* dst) {
    int const token0 = w.token0;
    int const rows = w.rows;
    // A block of no sequence (packed) copies nothing: its zero-size copies get an address inside x.
    T const* x = static_cast<T const*>(p.x_ptr) + w.batch * p.x_batch_stride + w.head * p.x_head_stride +
                 (rows > 0 ? int64_t(token0) * p.x_row_stride : 0);
#pragma unroll
    for (int k = 0; k < kElems / 8; ++k) {  // B * kVecsPerRow == nthreads * kElems / 8
      unsigned const i = unsigned(k * nthreads + tid), r = i / kVecsPerRow, c = i % kVecsPerRow;
      bool const in = int(r) < rows;
      cp_async_16(dst + r * kInPitch + c * 8, in ? x + int64_t(r) * p.x_row_stride + c * 8 : x, in);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };

  int work = blockIdx.x;
  Work next = decode(work);
  if (work < num_work) load_async(next, s_in(0));
  for (int it = 0; work < num_work; ++it, work += gridDim.x) {
    Work const cur = next;
    bool const valid = row < cur.rows;
    // The next block's copy goes into the buffer the previous iteration read (all threads are past
    // its reads: the barrier after the amax below).
    if (work + int(gridDim.x) < num_work) {
      next = decode(work + gridDim.x);
      load_async(next, s_in((it + 1) & 1));
      asm volatile("cp.async.wait_group 1;" ::: "memory");
    } else {
      asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
    __syncthreads();  // every thread's copies of this block have landed
    T const* in_row = s_in(it & 1) + row * kInPitch + col0;
    float v[kElems];
    if (hadamard) {
      // Vector i ^ swz into v[8 i ..]: slot q holds element q ^ lbl. The threads of a row (128 bytes apart)
      // read distinct banks so, too.
      int const swz = lbl / 8;
      uint4 const* flip = reinterpret_cast<uint4 const*>(sign_flip + col0 / 2);
#pragma unroll
      for (int i = 0; i < kElems / 8; ++i) load8(in_row + 8 * (i ^ swz), flip[i ^ swz], v + 8 * i);
      // Butterflies inside the thread (strides 1 .. 32): y_i = x_i + x_{i+h}, y_{i+h} = x_i - x_{i+h},
      // in the slots of the labelling (slot_dim).
#pragma unroll
      for (int h = 1; h < kElems; h *= 2) {
        float const s = h >= 16 && (lbl & h) != 0 ? -1.f : 1.f;  // lbl has bits 4 and 5 only
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
          if ((j & h) == 0) {
            float const a = v[j], b = v[j + h];
            v[j] = fmaf(s, a, b);
            v[j + h] = fmaf(-s, b, a);
          }
        }
      }
      // Half exchanges across the row's lanes (strides 64, 128): lane bit k against slot bit 5 - k.
#pragma unroll
      for (int k = 0; (1 << k) < kLanesPerRow; ++k) {
        int const h = kElems / 2 >> k;
        float const s = (lbl & h) != 0 ? -1.f : 1.f;
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
          if ((j & h) == 0) {
            float const a = v[j], b = __shfl_xor_sync(0xffffffffu, v[j + h], 1 << k);
            v[j] = fmaf(s, a, b);
            v[j + h] = fmaf(-s, b, a);
          }
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kElems / 8; ++i) load8(in_row + 8 * i, make_uint4(0, 0, 0, 0), v + 8 * i);
    }
    // The transform's 1/sqrt(headdim) is folded into the amax and the quantization multiplier
    // (docs/fp8.md): max |y| * norm is max |y * norm| (rounding is monotonic).
    float const norm = !hadamard ? 1.f : (kHeadDim == 64 ? 0.125f : (kHeadDim == 256 ? 0.0625f : 0.08838834764831845f));

    // amax of the block: thread, warp, CTA.
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < kElems; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (tid % 32 == 0) warp_max[tid / 32] = amax;
    // Also: every thread is done reading this input buffer and the previous block's staged output.
    __syncthreads();
    amax = 0.f;
    for (int w = 0; w < nthreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
    amax *= norm;
    // IEEE division (not the fast-math approximation) so that the reference reproduces the bytes.
    float const inv = amax > 0.f ? __fdiv_rn(kFp8Max, amax) : 0.f;
    if (tid == 0) {
      p.scale_ptr[cur.batch * p.scale_batch_stride + cur.head * p.scale_head_stride + cur.blk * p.scale_block_stride] =
          amax > 0.f ? __fdiv_rn(amax, kFp8Max) : 1.f;
    }
    float const mul = inv * norm;

    uint8_t* out = static_cast<uint8_t*>(p.out_ptr) + cur.batch * p.out_batch_stride + cur.head * p.out_head_stride;
    // Dim of v[16 u] (v[16 u + 1 .. 16 u + 15] hold the next ones): the thread's own in order, or where
    // the half exchanges left them.
    auto run_dim = [&](int u) {
      return hadamard ? col0 ^ lbl ^ slot_dim<kLanesPerRow>(16 * u) : col0 + 16 * u;
    };
    if constexpr (!kTranspose) {
      // Stage (B, headdim) bytes, then write whole rows (a warp covers 512 contiguous bytes of them).
      int const pitch = out_pitch<kHeadDim>(hadamard);
      uint8_t* dst = s_out + row * pitch;
#pragma unroll
      for (int u = 0; u < kElems / 16; ++u) {
        float const* w = v + 16 * u;
        *reinterpret_cast<uint4*>(dst + run_dim(u)) =
            make_uint4(to_fp8x4(w[0] * mul, w[1] * mul, w[2] * mul, w[3] * mul),
                       to_fp8x4(w[4] * mul, w[5] * mul, w[6] * mul, w[7] * mul),
                       to_fp8x4(w[8] * mul, w[9] * mul, w[10] * mul, w[11] * mul),
                       to_fp8x4(w[12] * mul, w[13] * mul, w[14] * mul, w[15] * mul));
      }
      __syncthreads();
      constexpr unsigned kRuns = kHeadDim / 16;
      uint8_t* out_rows = out + int64_t(cur.token0) * p.out_row_stride;  // rows like x's
      int const rows = cur.rows;
      for (unsigned i = tid; i < unsigned(B) * kRuns; i += nthreads) {
        unsigned const r = i / kRuns, c = i % kRuns;
        if (int(r) < rows) {
          *reinterpret_cast<uint4*>(out_rows + int64_t(r) * p.out_row_stride + c * 16) =
              *reinterpret_cast<uint4 const*>(s_out + r * pitch + c * 16);
        }
      }
    } else {
      // Stage (headdim, B) bytes with the keys in V^T order, then write whole 16-byte runs of keys.
      // Lanes of a warp hold consecutive keys, so one byte store covers 32 (or 16 x 2) adjacent bytes.
      uint8_t* smem_vt = s_out;
      int const ld = B + vt_pitch_pad<kHeadDim>();  // row pitch: keeps 16-byte alignment for the reads below
      uint8_t* const key = smem_vt + (row & ~15) + vt_position(row & 15);
#pragma unroll
      for (int u = 0; u < kElems / 16; ++u) {
        int const dim0 = run_dim(u);  // 16 dims of one 64-dim part
        uint8_t* dst = key + dim0 * ld + kVtSkew * (dim0 / kElems);
#pragma unroll
        for (int j = 0; j < 16; j += 2) {
          // Padding keys: +0 bytes (the signs of the Hadamard transform may have made their zeros -0).
          float const* w = v + 16 * u + j;
          uint16_t const two =
              valid ? __nv_cvt_float2_to_fp8x2(make_float2(w[0] * mul, w[1] * mul), __NV_SATFINITE, __NV_E4M3)
                    : uint16_t(0);
          dst[j * ld] = uint8_t(two & 0xff);
          dst[(j + 1) * ld] = uint8_t(two >> 8);
        }
      }
      __syncthreads();
      // Padded keys left from the block's first (packed: the whole block, so gaps hold zeros too).
      int const keys = packed ? B : (p.seqlen + 15) / 16 * 16 - cur.token0;
      unsigned const runs = unsigned(B) / 16;
      for (unsigned i = tid; i < kHeadDim * runs; i += nthreads) {
        unsigned const dim = i / runs, run = i % runs;
        if (int(run * 16) < keys) {
          *reinterpret_cast<uint4*>(out + dim * p.out_dim_stride + cur.col + run * 16) =
              *reinterpret_cast<uint4 const*>(smem_vt + dim * ld + kVtSkew * (dim / kElems) + run * 16);
        }
      }
    }
  }
}

template <class T, int kHeadDim>
int64_t launch_quantize(QuantParams const& p, cudaStream_t stream) {
  int const threads = p.block_size * (kHeadDim / kElems);  // one row (part) per thread
  int64_t const work = p.cu_seqlens != nullptr ? (int64_t(p.seqlen / p.block_size) + p.batch) * p.nheads
                                                : int64_t((p.seqlen + p.block_size - 1) / p.block_size) * p.nheads * p.batch;
  if (work > INT32_MAX) throw std::invalid_argument("flashhopper.quantize_fp8: more than 2^31 blocks");
  auto launch = [&](auto transpose) {
    constexpr bool kTranspose = decltype(transpose)::value;
    auto kernel = &quantize_fp8_kernel<T, kHeadDim, kTranspose>;
    DeviceInfo const& dev = device_info(p.device);
    int const smem = smem_bytes<T, kHeadDim, kTranspose>(p.block_size, p.hadamard);
    if (smem > 48 * 1024) raise_max_dynamic_smem(kernel, p.device, smem);
    // As many CTAs as fit at once (by registers and shared memory), each looping over blocks.
    int per_sm = 0;
    max_blocks_per_sm_once(per_sm, kernel, p.device, threads, smem);
    int64_t const grid = std::min<int64_t>(work, int64_t(std::max(per_sm, 1)) * dev.num_sms);
    kernel<<<unsigned(grid), threads, smem, stream>>>(p);
    return grid;
  };
  return p.transpose ? launch(std::true_type{}) : launch(std::false_type{});
}

}  // namespace quant

// Host entry: checks what the kernel assumes, then dispatches on (input type, head dim). Returns the
// CTAs launched (0: nothing to quantize).
inline int64_t quantize_fp8(QuantParams const& p, cudaStream_t stream) {
  auto fail = [](std::string const& why) { throw std::invalid_argument("flashhopper.quantize_fp8: " + why); };
  if (p.headdim != 64 && p.headdim != 128 && p.headdim != 256) fail("headdim must be 64, 128 or 256");
  // Whole warps (one thread per 64 elements of a row): at headdim 64 the block is a multiple of 32.
  if (p.block_size < 16 || p.block_size % 16 != 0 || p.block_size * p.headdim % (32 * quant::kElems) != 0 ||
      p.block_size * p.headdim > quant::kElems * quant::kMaxThreads) {
    fail("block_size must be a multiple of 16 (of 32 at headdim 64) with block_size * headdim <= 32768");
  }
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) fail("x must be float16 or bfloat16");
  if (p.seqlen <= 0 || p.batch <= 0 || p.nheads <= 0) return 0;  // an empty grid: nothing to launch
  auto by_dim = [&](auto tag) -> int64_t {
    using T = decltype(tag);
    switch (p.headdim) {
      case 64: return quant::launch_quantize<T, 64>(p, stream);
      case 128: return quant::launch_quantize<T, 128>(p, stream);
      default: return quant::launch_quantize<T, 256>(p, stream);
    }
  };
  return p.dtype == DType::kFloat16 ? by_dim(__half{}) : by_dim(__nv_bfloat16{});
}

}  // namespace flashhopper
