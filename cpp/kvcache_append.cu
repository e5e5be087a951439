// The KV-cache append kernel (common/kvcache_append.h); built with the Hopper family, whose KV-cache kernels
// it feeds.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/kvcache_append.h"
#include "registry.h"

namespace flashhopper {

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
    int const pos = (p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.seqlen_offset) + t;
    int64_t page, row;
    if (p.page_table != nullptr) {
      page = p.page_table[b * p.table_stride + pos / p.page_size];
      row = pos % p.page_size;
    } else {
      page = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
      row = pos;
    }
    // Strides in bytes from here: element strides x (row bytes / headdim) are folded by the host.
    char* dst = static_cast<char*>(p.cache[which]) + page * p.cache_page_stride[which] +
                row * p.cache_row_stride[which] + h * p.cache_head_stride[which] + vec * 16;
    char const* src = static_cast<char const*>(p.src[which]) + b * p.src_batch_stride[which] +
                      int64_t(t) * p.src_row_stride[which] + h * p.src_head_stride[which] + vec * 16;
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<uint4 const*>(src);
  }
}

int64_t launch_kvcache_append(KVAppendParams const& p, cudaStream_t stream) {
  for (int w = 0; w < 2; ++w) {
    if (p.row_bytes[w] <= 0 || p.row_bytes[w] % 16 != 0) {
      throw std::invalid_argument("flashhopper: kvcache append rows must be multiples of 16 bytes");
    }
  }
  int64_t const total = int64_t(p.batch) * p.seqlen_new * p.heads * (std::max(p.row_bytes[0], p.row_bytes[1]) / 16);
  if (total == 0) return 0;
  constexpr int kThreads = 256;
  int64_t const blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 4096);
  kvcache_append_kernel<<<dim3(unsigned(blocks), 2), kThreads, 0, stream>>>(p);
  cudaError_t const err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("flashhopper: kvcache append launch: ") + cudaGetErrorString(err));
  return blocks * 2;
}

}  // namespace flashhopper
