// What the KV-cache launchers of both kernel families do around their kernel (params.h's KV-cache fields): the
// checks of the params, and the split-KV combine after it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "combine_splits.h"
#include "params.h"

namespace flashhopper {

// The split count of a KV-cache launch (at least 1), after checking what the kernels need.
inline int kvcache_num_splits(FwdParams const& p) {
  int const num_splits = std::max(1, p.num_splits);
  if (p.num_pages < 1 || p.page_size < 1) {
    throw std::invalid_argument("flashhopper: KV-cache kernels need a cache of at least one page of at least one row");
  }
  if (num_splits > kCombineMaxSplits || (num_splits > 1 && p.split_workspace == nullptr)) {
    throw std::invalid_argument("flashhopper: num_splits must be 1.." + std::to_string(kCombineMaxSplits) +
                                ", and a split needs split_workspace");
  }
  return num_splits;
}

namespace {  // (internal linkage, as the combine kernel's: combine_splits.h)

// After a split launch: O and LSE from the splits' partials (float32 (splits, batch, heads, rows, headdim_v) and
// (splits, batch, heads, rows) in the kernel's view of p).
template <class Element, int kHeadDimV>
void combine_kvcache_splits(FwdParams const& p, int num_splits, float const* o_partial, float const* lse_partial,
                            cudaStream_t stream) {
  CombineParams cp;
  cp.o_partial = o_partial;
  cp.lse_partial = lse_partial;
  cp.o = p.o_ptr;
  cp.o_batch_stride = p.o_batch_stride;
  cp.o_row_stride = p.o_row_stride;
  cp.o_head_stride = p.o_head_stride;
  cp.lse = p.lse_ptr;
  cp.num_splits = num_splits;
  cp.batch = p.batch;
  cp.heads = p.nheads_q;
  cp.rows = p.seqlen_q;
  cp.sinks = p.sinks_ptr;
  cp.rows_per_query = std::max(1, p.rows_per_query);
  cudaError_t const err = launch_combine_splits<Element, kHeadDimV>(cp, stream);
  if (err != cudaSuccess) throw std::runtime_error(std::string("flashhopper: split-KV combine launch: ") + cudaGetErrorString(err));
}

}  // namespace

}  // namespace flashhopper
