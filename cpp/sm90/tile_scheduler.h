// Persistent tile schedulers: one CTA per SM walks query tiles (m_block, head, batch). The
// producer thread picks each tile and publishes its index to the consumers (see FwdKernel).
//
// Non-causal tiles all cost the same, so CTAs stride through them in a static order with m_block
// fastest: the CTAs running at one time share a head's K/V in L2.
// Causal tiles cost ~(m_block + 1) key blocks, so the order is heaviest first (m_block
// descending, heads inside) and each CTA takes its next tile from an atomic counter when it
// starts the current one: greedy longest-first, which keeps SMs evenly loaded. The running CTAs
// then hold neighbouring m_blocks of all heads, which walk the same K/V blocks nearly in step.
#pragma once

#include <cute/config.hpp>

#include <algorithm>

namespace flashhopper::sm90 {

struct WorkTile {
  int m_block, head, batch;
};

struct TileSchedulerParams {
  int num_m_blocks = 0;
  int num_heads = 0;  // query heads
  int num_bh = 0;     // batch * query heads
  int total_tiles = 0;
  int* counter = nullptr;  // dynamic scheduler only: zero at launch, left at zero on exit
};

inline TileSchedulerParams make_tile_scheduler_params(int num_m_blocks, int batch, int nheads, int* counter) {
  return {num_m_blocks, nheads, batch * nheads, num_m_blocks * batch * nheads, counter};
}

inline int persistent_grid_size(TileSchedulerParams const& p, int num_sms) {
  return std::max(1, std::min(num_sms, p.total_tiles));
}

struct StaticTileScheduler {
  static constexpr bool kNeedsCounter = false;

  CUTE_DEVICE static int initial(TileSchedulerParams const&) { return int(blockIdx.x); }
  CUTE_DEVICE static int next(TileSchedulerParams const&, int tile) { return tile + int(gridDim.x); }

  CUTE_DEVICE static WorkTile decode(TileSchedulerParams const& p, int tile) {
    int const bh = tile / p.num_m_blocks;
    return {tile - bh * p.num_m_blocks, bh % p.num_heads, bh / p.num_heads};
  }
};

struct DynamicTileScheduler {
  static constexpr bool kNeedsCounter = true;

  CUTE_DEVICE static int initial(TileSchedulerParams const&) { return int(blockIdx.x); }

  // Every CTA fetches once per tile it runs, the last fetch failing; so exactly total_tiles
  // fetches happen, and the one that draws total_tiles - 1 is the last: it re-zeroes the
  // counter for the next launch on this stream.
  CUTE_DEVICE static int next(TileSchedulerParams const& p, int /*tile*/) {
    int const v = atomicAdd(p.counter, 1);
    if (v == p.total_tiles - 1) atomicExch(p.counter, 0);
    return v + int(gridDim.x);
  }

  CUTE_DEVICE static WorkTile decode(TileSchedulerParams const& p, int tile) {
    int const m_idx = tile / p.num_bh;
    int const bh = tile - m_idx * p.num_bh;
    return {p.num_m_blocks - 1 - m_idx, bh % p.num_heads, bh / p.num_heads};
  }
};

}  // namespace flashhopper::sm90
