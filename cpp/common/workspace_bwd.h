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

namespace flashhopper {

// Where each piece of the backward's scratch lives in the caller's workspace. The zeroed pieces
// are contiguous so that one memset clears them.
struct BwdWorkspace {
  static constexpr size_t kAlign = 256;
  size_t lse_log2 = 0, dpsum = 0;                      // float (batch, nheads_q, seqlen_q_rounded)
  size_t zero_begin = 0;                               // --- zeroed from here ---
  size_t dq_accum = 0;                                 // float (batch, nheads_q, seqlen_q_rounded, headdim)
  size_t dk_accum = 0, dv_accum = 0;                   // GQA: float (batch, nheads_kv, seqlen_k, headdim[_v])
  size_t dq_semaphore = 0;                             // int per (batch, head, query block): key blocks
                                                       // whose dQ additions have landed (sm90 counts
                                                       // them always, sm80 when deterministic)
  size_t dq_ticket = 0;                                // int: next query block for the dQ postprocess
  size_t dkv_semaphore = 0;                            // deterministic GQA: int per (batch, head, block)
  size_t zero_end = 0, total = 0;
  bool gqa = false;
  int seqlen_q_rounded = 0;

  template <int kBlockM, int kBlockN>
  static BwdWorkspace make(BwdParams const& p) {
    BwdWorkspace w;
    size_t at = 0;
    auto take = [&](size_t bytes) {
      size_t const here = at;
      at += (bytes + kAlign - 1) / kAlign * kAlign;
      return here;
    };
    int64_t const bq = int64_t(p.batch) * p.nheads_q, bkv = int64_t(p.batch) * p.nheads_kv;
    w.gqa = p.nheads_q != p.nheads_kv;
    w.seqlen_q_rounded = ceil_div(p.seqlen_q, kBlockM) * kBlockM;
    w.lse_log2 = take(bq * w.seqlen_q_rounded * sizeof(float));
    w.dpsum = take(bq * w.seqlen_q_rounded * sizeof(float));
    w.zero_begin = at;
    // Rounded rows: the sm80 kernel adds whole tiles (sm90 uses the first seqlen_q rows of a head).
    w.dq_accum = take(bq * w.seqlen_q_rounded * p.headdim * sizeof(float));
    if (w.gqa) {
      w.dk_accum = take(bkv * p.seqlen_k * p.headdim * sizeof(float));
      w.dv_accum = take(bkv * p.seqlen_k * p.headdim_v * sizeof(float));
    }
    w.dq_semaphore = take(bq * ceil_div(p.seqlen_q, kBlockM) * sizeof(int));
    w.dq_ticket = take(sizeof(int));
    if (p.deterministic && w.gqa) w.dkv_semaphore = take(bkv * ceil_div(p.seqlen_k, kBlockN) * sizeof(int));
    w.zero_end = at;
    w.total = at;
    return w;
  }

  template <class T>
  T* at(void* base, size_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
  }
};


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
