// Appending new keys and values to a KV cache (flash_attn_with_kvcache's k / v): token t of entry b goes to
// position pos = cache_seqlens[b] + t (or seqlen_offset + t) of the entry's cache, in page
// page_table[b * table_stride + pos / page_size], row pos % page_size; without a table, in cache row
// cache_batch_idx[b] (or b), position pos (a contiguous cache: one page of max_seqlen rows per entry). One
// 16-byte copy per thread, K and V in one launch: what the same index writes cost as eight torch ops. Into an e4m3
// cache, a warp per new row quantizes it (and K's transform) in the same launch: what cost some twenty torch ops.
#pragma once

#include <cstdint>

namespace flashhopper {

struct KVAppendParams {
  void* cache[2] = {nullptr, nullptr};          // K, V caches (pages, page_size, heads, headdim)
  void const* src[2] = {nullptr, nullptr};      // new K, V (batch, seqlen_new, heads, headdim)
  int64_t cache_page_stride[2] = {0, 0}, cache_row_stride[2] = {0, 0}, cache_head_stride[2] = {0, 0};
  int64_t src_batch_stride[2] = {0, 0}, src_row_stride[2] = {0, 0}, src_head_stride[2] = {0, 0};
  int const* cache_seqlens = nullptr;           // (batch,) or nullptr: seqlen_offset for every entry
  int seqlen_offset = 0;
  int const* page_table = nullptr;              // int32 (batch, pages), or nullptr
  int64_t table_stride = 0;
  int const* cache_batch_idx = nullptr;         // without a page table: the entry's cache row, or nullptr: b
  int page_size = 1;
  int batch = 0, seqlen_new = 0, heads = 0;
  int row_bytes[2] = {0, 0};                    // headdim x element size: multiples of 16
  int device = 0;
  // An e4m3 cache (docs/kvcache-fp8.md; kvcache_fp8.quantize_rows defines it): each new row quantized with its own
  // float32 scale, scale[w][page * scale_page_stride[w] + head * scale_head_stride[w] + row]; K's rows first
  // transformed by the random-sign Hadamard transform of hadamard_seed when hadamard_k. src is 16-bit
  // (src_bf16: bfloat16, else float16) of headdim 64, 128 or 256; row_bytes are the source rows'.
  float* scale[2] = {nullptr, nullptr};
  int64_t scale_page_stride[2] = {0, 0}, scale_head_stride[2] = {0, 0};
  bool hadamard_k = false;
  uint64_t hadamard_seed = 0;
  bool src_bf16 = true;
  int headdim = 0;
};

}  // namespace flashhopper
