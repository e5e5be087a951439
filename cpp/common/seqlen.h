// Sequence bounds of one batch entry: where its rows start in the global Q/O and K/V tensors and
// how many there are. The kernels never read sequence lengths from their params directly: each
// (tile, batch entry) builds a SeqlenInfo through its family's Seqlens policy and hands it to the
// block ranges (block_info.h), the mask, the loads and the stores.
//
// UniformSeqlens: every entry has the params' seqlen_q / seqlen_k and is addressed through the
// tensors' batch mode, so the row offsets are 0 (constants once inlined: no cost).
// VarlenSeqlens (packed batches, flash-attn's varlen): entries are row ranges of (total_rows, ...)
// tensors, offsets from cu_seqlens, lengths from cu_seqlens or seqused, batch coordinate 0. TMA would
// only clip at the end of the whole packed tensor, so each entry gets tensor maps of its own whose row
// extent ends at the entry's last row (varlen_prepare.h writes them before the kernel), which the copies
// of blocks reaching past that row use (block_tma_desc): loads never read, and stores never write, a
// neighbour's rows. kTmaClipsRows holds for both policies.
#pragma once

#include <cute/config.hpp>

#include <cstdint>

namespace flashhopper {

struct SeqlenInfo {
  int offset_q = 0, offset_k = 0;  // the entry's first row in the row mode of Q/O and of K/V
  int seqlen_q = 0, seqlen_k = 0;  // its rows (queries) and keys
  int batch_coord = 0;             // its coordinate in the tensors' batch mode
  int rows_per_query = 1;          // packed query rows (KV caches, GQA): rows r .. r + g - 1 are query r / g's
};

struct UniformSeqlens {
  int seqlen_q = 0, seqlen_k = 0;
  // Each entry is a slice of the batch mode, which TMA bounds by the entry's own length.
  static constexpr bool kTmaClipsRows = true;
  static constexpr bool kKVRowsClipped = true;  // K/V loads past the entry's keys read zeros
  static constexpr bool kSplits = false;        // split-KV (partial results and a combine kernel)
  static constexpr bool kPackedRows = false;    // a row is a query position (block_info.h: Visibility)
  static constexpr bool kPerEntryTma = false;
  static constexpr bool kPacked = false;  // entries share one row mode (batch coordinate 0)
  CUTE_HOST_DEVICE SeqlenInfo operator()(int batch) const { return {0, 0, seqlen_q, seqlen_k, batch}; }
  // The tensor map of tensor `which` (VarlenTensor) for entry `batch`: the one the params hold.
  CUTE_HOST_DEVICE void const* tma_desc(void const* shared, int /*which*/, int /*batch*/) const { return shared; }
  // Where entry `batch`'s rows start in per-row scratch of kBlock-row blocks (backward_rows below).
  CUTE_HOST_DEVICE int padded_offset_q(int /*batch*/, int /*block*/) const { return 0; }
  CUTE_HOST_DEVICE int padded_offset_k(int /*batch*/, int /*block*/) const { return 0; }
  // The entry's first block in a tensor kept in blocks per entry (FP8 scales, V^T): its own batch slice.
  CUTE_HOST_DEVICE static int first_block(int /*offset*/, int /*batch*/, int /*block*/) { return 0; }
};

// The tensors with per-entry tensor maps: the forward's Q, K, V, O; the backward's Q, K, V, dO (O's slot: rows
// of the queries, headdim_v), dK, dV. Each entry's first kVarlenGroup maps are contiguous (the forward's, laid
// out as when they were all there were), the backward's dK and dV in a second array.
enum VarlenTensor : int {
  kVarlenQ = 0, kVarlenK = 1, kVarlenV = 2, kVarlenO = 3, kVarlendO = 3, kVarlendK = 4, kVarlendV = 5,
  kVarlenGroup = 4, kVarlenTensors = 6
};

struct VarlenSeqlens {
  int const* cu_seqlens_q = nullptr;  // (batch + 1,) row offsets into the packed Q/O
  int const* cu_seqlens_k = nullptr;  // (batch + 1,) into K/V
  int const* seqused_q = nullptr;     // (batch,) rows of each slot in use, or nullptr: the whole slot
  int const* seqused_k = nullptr;
  void const* tma_descs = nullptr;    // kVarlenGroup 128-byte tensor maps per entry (varlen_prepare.h)
  void const* tma_descs_extra = nullptr;  // the rest (kVarlenTensors - kVarlenGroup per entry)
  static constexpr bool kTmaClipsRows = true;  // through the per-entry tensor maps
  static constexpr bool kKVRowsClipped = true;
  static constexpr bool kSplits = false;
  static constexpr bool kPackedRows = false;
  static constexpr bool kPerEntryTma = true;
  static constexpr bool kPacked = true;
  CUTE_HOST_DEVICE SeqlenInfo operator()(int batch) const {
    int const oq = cu_seqlens_q[batch], ok = cu_seqlens_k[batch];
    int const lq = seqused_q != nullptr ? seqused_q[batch] : cu_seqlens_q[batch + 1] - oq;
    int const lk = seqused_k != nullptr ? seqused_k[batch] : cu_seqlens_k[batch + 1] - ok;
    return {oq, ok, lq, lk, 0};
  }
  CUTE_HOST_DEVICE void const* tma_desc(void const* /*shared*/, int which, int batch) const {
    // `which` is a constant wherever an attention kernel asks: one of the two branches is left there.
    return which < kVarlenGroup
               ? static_cast<char const*>(tma_descs) + (int64_t(batch) * kVarlenGroup + which) * 128
               : static_cast<char const*>(tma_descs_extra) +
                     (int64_t(batch) * (kVarlenTensors - kVarlenGroup) + which - kVarlenGroup) * 128;
  }
  // Tensors kept in whole blocks of `block` rows per entry (the backward's per-row scratch, FP8 scales and
  // V^T, docs/fp8.md): entry b's blocks from block cu_seqlens[b] / block + b on (row (cu_seqlens[b] +
  // b * block) rounded down to a block), which leaves each entry its ceil(rows / block) blocks without
  // overlap (total / block + batch blocks in all). `offset` is the entry's cu_seqlens.
  CUTE_HOST_DEVICE static int first_block(int offset, int batch, int block) { return offset / block + batch; }
  CUTE_HOST_DEVICE int padded_offset_q(int batch, int block) const {
    return first_block(cu_seqlens_q[batch], batch, block) * block;
  }
  CUTE_HOST_DEVICE int padded_offset_k(int batch, int block) const {
    return first_block(cu_seqlens_k[batch], batch, block) * block;
  }
};

// A KV cache (flash_attn_with_kvcache): Q/O padded as in UniformSeqlens (batch mode, seqlen_q rows each), entry b's
// keys cache_seqlens[b] (or seqlen_k each) of a cache whose rows KVBlocks finds (sm90/kv_blocks.h: pages). The
// cache holds rows past an entry's length (the rest of its last page, of a contiguous cache's row), which TMA
// does not clip: the mainloop keeps them out of the PV GEMM itself (kKVRowsClipped false). Split-KV: an entry's
// key blocks may be cut into ranges run by different CTAs (kSplits; the params' num_splits). GQA packing: a kv
// head's g query heads may run as the rows of one head, query s's g heads the rows s g .. s g + g - 1
// (kPackedRows, rows_per_query = g; seqlen_q counts rows), which the causal mask and ranges divide back.
// kSplitKV false: a kernel for one split only (the chunked prefill's), without the split ranges and partial stores,
// whose per-tile values cost the consumers their uniform registers (docs/perf-notes.md, session 9).
template <bool kSplitKV = true>
struct CacheSeqlensT {
  int seqlen_q = 0, seqlen_k = 0;
  int const* cache_seqlens = nullptr;  // (batch,) keys per entry, or nullptr: seqlen_k each
  int rows_per_query = 1;
  static constexpr bool kTmaClipsRows = true;    // Q/O: the batch mode
  static constexpr bool kKVRowsClipped = false;
  static constexpr bool kSplits = kSplitKV;
  static constexpr bool kPackedRows = true;
  static constexpr bool kPerEntryTma = false;
  static constexpr bool kPacked = false;
  CUTE_HOST_DEVICE SeqlenInfo operator()(int batch) const {
    return {0, 0, seqlen_q, cache_seqlens != nullptr ? cache_seqlens[batch] : seqlen_k, batch, rows_per_query};
  }
  CUTE_HOST_DEVICE void const* tma_desc(void const* shared, int /*which*/, int /*batch*/) const { return shared; }
  CUTE_HOST_DEVICE int padded_offset_q(int /*batch*/, int /*block*/) const { return 0; }
  CUTE_HOST_DEVICE int padded_offset_k(int /*batch*/, int /*block*/) const { return 0; }
  CUTE_HOST_DEVICE static int first_block(int /*offset*/, int /*batch*/, int /*block*/) { return 0; }
};
using CacheSeqlens = CacheSeqlensT<true>;

}  // namespace flashhopper

// Device code only (CuTe tensors; the host-only bindings include the bounds above for the tests).
#if defined(__CUDACC__)
#include <cute/tensor.hpp>

namespace flashhopper {

// The (rows, headdim) slice of a (rows, headdim, head, batch) tensor that holds one entry's rows of
// one head: m(_, _, head, batch_coord) from row `offset` on.
template <class Tensor4>
CUTE_HOST_DEVICE auto entry_rows(Tensor4 const& m, int offset, int head, int batch_coord) {
  using namespace cute;
  return domain_offset(make_coord(offset, _0{}), m(_, _, head, batch_coord));
}

// The tensor map for a copy of rows that lie inside the entry (`inside`) or reach past its end. Inside, the copy's
// own map reads and writes the same rows as the entry's (coordinates are global), and its descriptor, the same for
// every tile, stays in the SM's descriptor cache; only a block that crosses the entry's end needs the entry's map
// to clip it. (Every copy through the entry's maps made each tile fetch new descriptors: at equal lengths of 512
// the consumers waited on Q 11% of the samples against 2%, ncu, docs/perf-notes.md session 31.) The caller
// acquires the entry's maps (acquire_entry_maps) before the first copy that uses one.
template <class Seqlens, class Tma>
CUTE_DEVICE cute::TmaDescriptor const* block_tma_desc(Seqlens const& seqlens, Tma const& tma, int which, int batch,
                                                      bool inside) {
  auto const* own = tma.get_tma_descriptor();
  if constexpr (Seqlens::kPerEntryTma) {
    if (!inside) return static_cast<cute::TmaDescriptor const*>(seqlens.tma_desc(own, which, batch));
  }
  return own;
}

// Before a copy through entry `batch`'s maps (`needed`): the acquire of each map (which...) the first time this
// thread meets the entry (`acquired`: the entry it last acquired, -1 at first).
template <class Seqlens, class... Which>
CUTE_DEVICE void acquire_entry_maps(Seqlens const& seqlens, int batch, bool needed, int& acquired, Which... which) {
  if constexpr (Seqlens::kPerEntryTma) {
    if (needed && batch != acquired) {
      (cute::tma_descriptor_fence_acquire(
           static_cast<cute::TmaDescriptor const*>(seqlens.tma_desc(nullptr, which, batch))), ...);
      acquired = batch;
    }
  }
}

}  // namespace flashhopper
#endif
