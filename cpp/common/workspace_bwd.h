// The backward's scratch in the caller's workspace, shared by the kernel families, and the launch
// error check of their host launchers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "block_info.h"
#include "params.h"
#include "varlen_workspace.h"

namespace flashhopper {

// Where each piece of the backward's scratch lives in the caller's workspace. The zeroed pieces
// are contiguous so that the preprocess kernel clears them as one range. Per-row pieces are (batch
// coordinate, head, rows): a padded batch has batch coordinates of seqlen rows (rounded up to blocks),
// a packed one (kVarlen) one coordinate whose rows hold every entry's, each from a block boundary on
// (Seqlens::padded_offset_*).
struct BwdWorkspace {
  static constexpr size_t kAlign = 256;
  size_t lse_log2 = 0, dpsum = 0;                      // float (batch_coords, nheads_q, seqlen_q_rounded)
  size_t varlen = 0;                                   // packed: VarlenWorkspace (the entries' tensor maps)
  size_t tiles = 0;                                    // packed, kTileTable: int4 per CTA (its tile; varlen_prepare.h)
  size_t dq_accum = 0;                                 // float (batch_coords, nheads_q, seqlen_q_rounded, headdim);
                                                       // zeroed unless dq_first_stores (then before zero_begin)
  size_t zero_begin = 0;                               // --- zeroed from here ---
  size_t dk_accum = 0, dv_accum = 0;                   // GQA: float (batch_coords, nheads_kv, rows_k, headdim[_v])
  size_t dq_semaphore = 0;                             // int per (batch_coord, head, query block): key blocks
                                                       // whose dQ additions have landed (sm90 counts
                                                       // them always, sm80 when deterministic), or
                                                       // been issued: then kDqUnlanded is set too
  size_t dq_ticket = 0;                                // int: next query block for the dQ postprocess
  size_t dq_first = 0;                                 // kDqWriter: int per query block, the key blocks that have
                                                       // taken a turn at it (the first one stores its dQ)
  size_t dkv_semaphore = 0;                            // deterministic GQA: int per (batch_coord, kv head, key block)
  size_t zero_end = 0, total = 0;
  bool gqa = false;
  bool dq_first_stores = false;  // dq_accum is not zeroed: the first key block at each query block stores
  int seqlen_q_rounded = 0;  // rows per (batch coordinate, head) of the per-row pieces: whole query blocks
  int batch_coords = 0;      // batch (padded) or 1 (packed)
  int rows_k = 0;            // rows per (batch coordinate, kv head) of dK/dV's sums: seqlen_k or total_k
  int n_blocks_k = 0;        // key blocks per (batch coordinate, kv head) of their counters

  // kDqWriter (sm90's dQ writer): dq_first's counters. dq_first_stores: the first key block to reach a query
  // block stores its dQ where the others add theirs, so dq_accum is not zeroed (perf-notes, session 34).
  template <int kBlockM, int kBlockN, bool kVarlen = false, bool kTileTable = false, bool kDqWriter = false>
  static BwdWorkspace make(BwdParams const& p, bool dq_first_stores = false) {
    BwdWorkspace w;
    size_t at = 0;
    auto take = [&](size_t bytes) {
      size_t const here = at;
      at += (bytes + kAlign - 1) / kAlign * kAlign;
      return here;
    };
    w.gqa = p.nheads_q != p.nheads_kv;
    w.dq_first_stores = dq_first_stores;
    w.batch_coords = kVarlen ? 1 : p.batch;
    // Packed: entry b's blocks start at block (cu_seqlens[b] + b * kBlock) / kBlock, all within these rows.
    w.seqlen_q_rounded = kVarlen ? ceil_div(p.total_q + p.batch * kBlockM, kBlockM) * kBlockM
                                 : ceil_div(p.seqlen_q, kBlockM) * kBlockM;
    w.rows_k = kVarlen ? p.total_k : p.seqlen_k;
    w.n_blocks_k = kVarlen ? ceil_div(p.total_k + p.batch * kBlockN, kBlockN) : ceil_div(p.seqlen_k, kBlockN);
    int64_t const bq = int64_t(w.batch_coords) * p.nheads_q, bkv = int64_t(w.batch_coords) * p.nheads_kv;
    w.lse_log2 = take(bq * w.seqlen_q_rounded * sizeof(float));
    w.dpsum = take(bq * w.seqlen_q_rounded * sizeof(float));
    if (kVarlen) w.varlen = take(VarlenWorkspace::bytes(p.batch));
    if (kVarlen && kTileTable) w.tiles = take(int64_t(w.n_blocks_k) * p.nheads_q * 4 * sizeof(int));  // the grid's CTAs
    // Rounded rows: the sm80 kernel adds whole tiles (sm90 uses the first seqlen_q rows of a head).
    size_t const dq_bytes = bq * w.seqlen_q_rounded * p.headdim * sizeof(float);
    if (dq_first_stores) w.dq_accum = take(dq_bytes);
    w.zero_begin = at;
    if (!dq_first_stores) w.dq_accum = take(dq_bytes);
    if (w.gqa) {
      w.dk_accum = take(bkv * w.rows_k * p.headdim * sizeof(float));
      w.dv_accum = take(bkv * w.rows_k * p.headdim_v * sizeof(float));
    }
    w.dq_semaphore = take(bq * (w.seqlen_q_rounded / kBlockM) * sizeof(int));
    w.dq_ticket = take(sizeof(int));
    if (kDqWriter) w.dq_first = take(bq * (w.seqlen_q_rounded / kBlockM) * sizeof(int));
    if (p.deterministic && w.gqa) w.dkv_semaphore = take(bkv * w.n_blocks_k * sizeof(int));
    w.zero_end = at;
    w.total = at;
    return w;
  }

  template <class T>
  T* at(void* base, size_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
  }
};

// A dq_semaphore count that includes additions still in flight (sm90, not deterministic, no mask: a CTA counts
// its last query block without waiting for it to land, so as not to hold its SM for the round trip); the dQ
// postprocess converts such a block only once the main kernel has completed. The count is the other bits.
constexpr int kDqUnlanded = 1 << 30;

// Where one (entry, head)'s per-row scratch starts: its first row in the (batch_coords, heads, rows) pieces
// (row statistics, dQ sums: rows = seqlen_q_rounded, kBlock = kBlockM; its block index, divided by kBlock).
template <int kBlock, class Seqlens>
CUTE_HOST_DEVICE int64_t scratch_row0_q(Seqlens const& s, SeqlenInfo const& seq, int batch, int head, int nheads,
                                        int rows) {
  return (int64_t(seq.batch_coord) * nheads + head) * rows + s.padded_offset_q(batch, kBlock);
}
// The first key block of one (entry, kv head) among the (batch_coords, kv heads, n_blocks_k) counters.
template <int kBlock, class Seqlens>
CUTE_HOST_DEVICE int64_t scratch_block0_k(Seqlens const& s, SeqlenInfo const& seq, int batch, int kv_head,
                                          int nheads_kv, int n_blocks_k) {
  return (int64_t(seq.batch_coord) * nheads_kv + kv_head) * n_blocks_k + s.padded_offset_k(batch, kBlock) / kBlock;
}

// The bounds policy of a backward launch: the entries' bounds from cu_seqlens (packed; their tensor maps
// in the workspace's varlen piece) or the params' lengths.
template <bool kVarlen>
auto bwd_seqlens(BwdParams const& p, BwdWorkspace const& ws) {
  if constexpr (kVarlen) {
    VarlenWorkspace const vw = VarlenWorkspace::carve(ws.at<char>(p.workspace, ws.varlen), p.batch);
    return VarlenSeqlens{p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k, vw.descs, vw.descs_extra};
  } else {
    return UniformSeqlens{p.seqlen_q, p.seqlen_k};
  }
}

// What every backward launcher needs of its parameters (the Python layer checks them first).
inline void check_bwd_params(BwdParams const& p, int head_dim, int head_dim_v) {
  if (p.headdim != head_dim || p.headdim_v != head_dim_v) {
    throw std::invalid_argument("flashhopper: head dim does not match the kernel");
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.nheads_q < 0 || p.nheads_kv < 0) {
    throw std::invalid_argument("flashhopper: negative sizes");
  }
  if (p.nheads_q > 0 && (p.nheads_kv == 0 || p.nheads_q % p.nheads_kv != 0)) {
    throw std::invalid_argument("flashhopper: nheads_q must be a multiple of nheads_kv");
  }
  if (p.workspace == nullptr || reinterpret_cast<uintptr_t>(p.workspace) % BwdWorkspace::kAlign != 0) {
    throw std::invalid_argument("flashhopper: the backward workspace must be a 256-byte aligned device buffer");
  }
}

inline void check_launch(cudaError_t err, char const* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("flashhopper: ") + what + ": " + cudaGetErrorString(err));
}

}  // namespace flashhopper
