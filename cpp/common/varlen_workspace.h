// The device workspace of a packed-batch (varlen) launch: per entry, the tensor maps of its rows
// (common/seqlen.h's VarlenTensor slots) and the tile schedule's arrays (sm90/tile_scheduler.h's
// VarlenTileScheduler); written by the prepare kernel before each launch, so any contents will do.
// Its size depends on the batch alone: a CUDA graph captures it as a fixed allocation.
#pragma once

#include <cstddef>
#include <cstdint>

#include "seqlen.h"

namespace flashhopper {

struct VarlenWorkspace {
  static constexpr size_t kDescBytes = 128;  // a CUtensorMap, 64-byte aligned in global memory

  void* descs = nullptr;     // (batch, kVarlenGroup) tensor maps, then (batch, the rest): VarlenSeqlens::tma_desc
  void* descs_extra = nullptr;
  int* blocks = nullptr;     // (batch,) each entry's blocks: of queries (forward) or keys (backward)
  int* order = nullptr;      // (batch,) entries sorted by blocks, most first
  int* prefix = nullptr;     // (batch,) inclusive prefix sums of the sorted entries' tiles
  int* total = nullptr;      // the tile count

  static size_t bytes(int batch) {
    return size_t(batch) * kVarlenTensors * kDescBytes + (size_t(3) * batch + 1) * sizeof(int);
  }
  // The workspace carved from `base` (256-byte aligned).
  static VarlenWorkspace carve(void* base, int batch) {
    VarlenWorkspace w;
    char* p = static_cast<char*>(base);
    w.descs = p;
    w.descs_extra = p + size_t(batch) * kVarlenGroup * kDescBytes;
    int* ints = reinterpret_cast<int*>(p + size_t(batch) * kVarlenTensors * kDescBytes);
    w.blocks = ints;
    w.order = ints + batch;
    w.prefix = ints + 2 * size_t(batch);
    w.total = ints + 3 * size_t(batch);
    return w;
  }
};

}  // namespace flashhopper
