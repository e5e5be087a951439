// K/V block addressing, the producer's hook: where key block n_block of one (batch entry, kv head)
// lives and how it reaches its shared-memory stage. Every K and V load of the forward and backward
// producers goes through it; the consumers only ever see stages, so another addressing (a paged KV
// cache: a page-table lookup, and several copies per block where pages are smaller than kBlockN)
// replaces this type alone.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

namespace flashhopper::sm90 {

using namespace cute;

// K and V as (rows, headdim, kv head, batch) tensors, each entry's keys contiguous in its rows.
struct ContiguousKVBlocks {
  struct Params {};

  CUTE_DEVICE ContiguousKVBlocks(Params const&, int /*batch*/) {}

  // One TMA copy: block n_block of `blocks` ((TMA, n) partitioned source) into `stage`, through tensor map
  // `desc` (the params' own, or the batch entry's: common/seqlen.h).
  template <class TmaCopy, class Blocks, class Stage>
  CUTE_DEVICE void load(TmaCopy const& tma, TmaDescriptor const* desc, uint64_t& barrier, Blocks const& blocks,
                        int n_block, Stage&& stage, TMA::CacheHintSm90 hint) const {
    copy(tma.with(desc, barrier, 0, hint), blocks(_, n_block), stage);
  }
};

}  // namespace flashhopper::sm90
