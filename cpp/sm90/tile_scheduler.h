// Persistent tile schedulers: one CTA per SM walks query tiles (m_block, head, batch). The
// producer thread picks each tile and publishes its index to the consumers (see FwdKernel).
//
// Non-causal tiles all cost the same, so CTAs stride through them in a static order with m_block
// fastest: the CTAs running at one time share a head's K/V in L2.
// Causal tiles cost ~(m_block + 1) key blocks, so each CTA takes its next tile from an atomic
// counter once its current tile's loads are out (greedy, which keeps SMs evenly loaded), in an order
// that is heaviest first inside sections of heads whose K/V fit in half of L2: the running CTAs
// then share few heads and reuse their K/V from L2. (Heaviest first over all heads balanced best
// in simulation but ran HBM-bound at 2k tokens: 128 heads' K/V live at once, 320 vs 600 TFLOPS.)
// The heads that do not fill a section join the last one: alone, a short last section's heaviest tiles
// started when the rest of the work was nearly done and ran past it. And a CTA that took its next tile
// when it started the current one committed to it a whole tile early, so the order balanced more like a
// static deal (scripts/sim_scheduler.py: 0.81-0.88 at head dim 256, 0.97-1.0 now). Both together measured
// +3-5% causal at head dim 128, +9-12% at 256, +5-9% e4m3 from 8k (docs/perf-notes.md, session 14).
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cute/config.hpp>

#include "../common/seqlen.h"

#include <algorithm>
#include <cstdint>

namespace flashhopper::sm90 {

struct WorkTile {
  int m_block, head, batch;
  int split = 0;  // split-KV: which of the entry's key ranges (SplitTileScheduler)
};

struct TileSchedulerParams {
  int num_m_blocks = 0;
  int num_heads = 0;  // query heads
  int num_bh = 0;     // batch * query heads
  int total_tiles = 0;
  int heads_per_section = 1;  // dynamic scheduler: (batch, head) pairs per L2 section
  int* counter = nullptr;     // dynamic schedulers only: zero at launch, left at zero on exit
  // Packed batches (VarlenTileScheduler): the entries' order and tile prefix sums, and the tile count,
  // which only the device knows (varlen_prepare.h writes them).
  int num_entries = 0;
  int const* entry_m_blocks = nullptr;
  int const* entry_order = nullptr;
  int const* tile_prefix = nullptr;
  int const* total_ptr = nullptr;
  int num_splits = 1;  // SplitTileScheduler: key ranges per (query block, head, entry)
};

// kv_bytes_per_kv_head: K+V bytes of one kv head; query heads of one GQA group share them.
inline TileSchedulerParams make_tile_scheduler_params(int num_m_blocks, int batch, int nheads_q, int heads_ratio,
                                                      int64_t kv_bytes_per_kv_head, int64_t l2_bytes, int* counter) {
  TileSchedulerParams p;
  p.num_m_blocks = num_m_blocks;
  p.num_heads = nheads_q;
  p.num_bh = batch * nheads_q;
  p.total_tiles = num_m_blocks * p.num_bh;
  int64_t const kv_heads = std::max<int64_t>(1, (l2_bytes / 2) / std::max<int64_t>(1, kv_bytes_per_kv_head));
  // At most one batch entry's heads, as the packed order: on short sequences sections of ~100 (batch, head) pairs
  // ran the causal forward 10% slower at head dim 128, 512 tokens (2-3% at 64 / 256; 2k-8k within noise;
  // docs/perf-notes.md, session 33).
  p.heads_per_section = int(std::min<int64_t>({p.num_bh, kv_heads * heads_ratio, int64_t(nheads_q)}));
  p.counter = counter;
  return p;
}

inline int persistent_grid_size(TileSchedulerParams const& p, int num_sms) {
  return std::max(1, std::min(num_sms, p.total_tiles));
}

// Each scheduler: total(p), the tile count (read once by the producer); initial(p), the CTA's first tile;
// next(p, tile, total), the one after; decode(p, tile), its (m_block, head, batch entry).
// What the producer keeps of the schedule in shared memory (VarlenTileScheduler's arrays); the others compute
// tiles from params alone. stage() fills it (the producer's first warp, once), total() and decode() read it.
struct NoScheduleCache {};

struct StaticTileScheduler {
  static constexpr bool kNeedsCounter = false;
  // CTAs 2c and 2c + 1 (a cluster of two) take tiles 2j and 2j + 1, neighbouring query tiles of one head, as long as
  // each head's tile count is even (the CTA-pair kernels round it up): they read the same K/V (tile_size.h: CtaPairs).
  static constexpr bool kNeighbourPairs = true;
  static constexpr bool kAfterPrepare = false;  // launched after a kernel it reads from (varlen_prepare.h)
  template <int> using CacheT = NoScheduleCache;
  static constexpr int cache_entries(int /*free_bytes*/) { return 0; }

  static constexpr bool kTakeBeforeLastV = false;
  template <class SeqlenOf>
  CUTE_DEVICE static void stage(TileSchedulerParams const&, NoScheduleCache&, int /*lane*/, SeqlenOf const&) {}
  CUTE_DEVICE static int total(TileSchedulerParams const& p, NoScheduleCache const&) { return p.total_tiles; }
  CUTE_DEVICE static int total(TileSchedulerParams const& p) { return p.total_tiles; }
  CUTE_DEVICE static int initial(TileSchedulerParams const&) { return int(blockIdx.x); }
  CUTE_DEVICE static int next(TileSchedulerParams const&, int tile, int /*total*/) { return tile + int(gridDim.x); }

  CUTE_DEVICE static WorkTile decode(TileSchedulerParams const& p, int tile) {
    int const bh = tile / p.num_m_blocks;
    return {tile - bh * p.num_m_blocks, bh % p.num_heads, bh / p.num_heads};
  }
  template <class SeqlenOf>
  CUTE_DEVICE static WorkTile decode(TileSchedulerParams const& p, NoScheduleCache const&, int tile, SeqlenOf const& seqlen_of,
                                     SeqlenInfo& seq) {
    WorkTile const w = decode(p, tile);
    seq = seqlen_of(w.batch);
    return w;
  }
};

// KV caches with split-KV: the static order over (query block, split, head, entry), query blocks fastest, then a
// (head, entry)'s splits, which read disjoint key ranges of the same K/V. Tiles cost alike within a launch
// (decode: a split's share of an entry's keys), so the order is static.
struct SplitTileScheduler : StaticTileScheduler {
  static constexpr bool kNeighbourPairs = false;
  CUTE_DEVICE static WorkTile decode(TileSchedulerParams const& p, int tile) {
    int const bhs = tile / p.num_m_blocks;
    int const bh = bhs / p.num_splits;
    return {tile - bhs * p.num_m_blocks, bh % p.num_heads, bh / p.num_heads, bhs - bh * p.num_splits};
  }
  template <class SeqlenOf>
  CUTE_DEVICE static WorkTile decode(TileSchedulerParams const& p, NoScheduleCache const&, int tile, SeqlenOf const& seqlen_of,
                                     SeqlenInfo& seq) {
    WorkTile const w = decode(p, tile);
    seq = seqlen_of(w.batch);
    return w;
  }
};

// Packed batches' tiles (varlen_prepare.h's schedule: entries sorted by blocks, the inclusive prefix sums of
// their tiles, blocks x heads, in that order): tile's entry (binary search), its index among the entry's
// tiles and the entry's `blocks`.
CUTE_DEVICE void decode_sorted_entry(int num_entries, int const* prefix, int const* order, int const* entry_blocks,
                                     int tile, int& entry, int& idx, int& blocks) {
  int lo = 0, hi = num_entries - 1;  // the first sorted entry whose inclusive prefix exceeds tile
  while (lo < hi) {
    int const mid = (lo + hi) / 2;
    if (prefix[mid] > tile) hi = mid; else lo = mid + 1;
  }
  entry = order[lo];
  blocks = entry_blocks[entry];
  idx = tile - (lo > 0 ? prefix[lo - 1] : 0);
}

// Every CTA fetches once per tile it runs, the last fetch failing; so exactly `total` fetches happen,
// and the one that draws total - 1 is the last: it re-zeroes the counter for the next launch on this
// stream.
CUTE_DEVICE int fetch_next_tile(int* counter, int total) {
  int const v = atomicAdd(counter, 1);
  if (v == total - 1) atomicExch(counter, 0);
  return v + int(gridDim.x);
}

struct DynamicTileScheduler {
  static constexpr bool kNeedsCounter = true;
  static constexpr bool kNeighbourPairs = false;
  static constexpr bool kAfterPrepare = false;
  template <int> using CacheT = NoScheduleCache;
  static constexpr int cache_entries(int /*free_bytes*/) { return 0; }

  static constexpr bool kTakeBeforeLastV = false;
  template <class SeqlenOf>
  CUTE_DEVICE static void stage(TileSchedulerParams const&, NoScheduleCache&, int /*lane*/, SeqlenOf const&) {}
  CUTE_DEVICE static int total(TileSchedulerParams const& p, NoScheduleCache const&) { return p.total_tiles; }
  CUTE_DEVICE static int total(TileSchedulerParams const& p) { return p.total_tiles; }
  CUTE_DEVICE static int initial(TileSchedulerParams const&) { return int(blockIdx.x); }
  CUTE_DEVICE static int next(TileSchedulerParams const& p, int /*tile*/, int total) {
    return fetch_next_tile(p.counter, total);
  }

  CUTE_DEVICE static WorkTile decode(TileSchedulerParams const& p, int tile) {
    int const hps = p.heads_per_section;
    int const last = p.num_bh / hps - 1;  // (hps <= num_bh) the remainder of num_bh / hps joins this section
    int const tiles_per_section = p.num_m_blocks * hps;
    int const section = min(tile / tiles_per_section, last);
    int const r = tile - section * tiles_per_section;
    int const bh0 = section * hps;
    int const heads_here = section == last ? p.num_bh - bh0 : hps;
    int const m_idx = r / heads_here;
    int const bh = bh0 + (r - m_idx * heads_here);
    return {p.num_m_blocks - 1 - m_idx, bh % p.num_heads, bh / p.num_heads};
  }
  template <class SeqlenOf>
  CUTE_DEVICE static WorkTile decode(TileSchedulerParams const& p, NoScheduleCache const&, int tile, SeqlenOf const& seqlen_of,
                                     SeqlenInfo& seq) {
    WorkTile const w = decode(p, tile);
    seq = seqlen_of(w.batch);
    return w;
  }
};

// Packed batches: only tiles that hold rows, the longest entries first (their tiles cost the most:
// more keys per query block); inside an entry, sections of heads_per_section heads, each section's tiles
// by query block from the highest (the heaviest under a causal mask), its heads consecutive. The launcher
// takes the padded kernels' orders: under a causal mask sections whose K/V fit in half of L2 (the CTAs
// running at one time share them, and a section's last tiles are its lightest); without a mask one head
// per section (its blocks consecutive: one head's K/V hot). (All of an entry's heads consecutive measured
// 5-8% slower on long sequences, 16 heads' K/V overflowing L2; one head per section under a causal mask
// leaves each pair's causal ramp to the end: 0.92-0.97x the padded kernel at equal lengths, against
// 0.96-1.0x with sections; sections without a mask: 0.82-1.0x against 0.88-1.01x; docs/perf-notes.md.)
// Handed out dynamically: tile costs vary with the entries' lengths. varlen_prepare.h sorts the
// entries by query blocks and writes the prefix sums of their tiles; the producer finds a tile's
// entry by binary search over them and publishes the decoded tile to the consumers. The kernel waits
// for that kernel (programmatic dependent launch) before reading anything it wrote.
// The producer takes each next tile (the atomic) before its last V copy waits for a stage, and issues the
// tile's Q right after decoding it, so the decode's latency is paid in the consumers' wait for Q at every
// tile. Searched in global memory it is a chain of ~8 dependent L2 loads (the tile count, the binary search,
// the entry, its blocks, its bounds); a batch of up to kCacheEntries entries has its schedule and its
// entries' bounds copied to shared memory once instead (session 32).
struct VarlenTileScheduler {
  static constexpr bool kNeedsCounter = true;
  static constexpr bool kNeighbourPairs = false;
  static constexpr bool kAfterPrepare = true;
  static constexpr bool kTakeBeforeLastV = true;
  // The copy's capacity: up to 128 entries, as many as the kernel's free shared memory holds (head dim 256: 56).
  template <int kEntries>
  struct CacheT {
    static constexpr int kCapacity = kEntries;
    int total;
    int prefix[kEntries];  // as TileSchedulerParams::tile_prefix, entry_order, and the sorted entries' blocks
    int order[kEntries];
    int blocks[kEntries];
    SeqlenInfo seq[kEntries];  // the sorted entries' bounds
  };
  static constexpr int cache_entries(int free_bytes) {
    int const n = (free_bytes - int(sizeof(CacheT<1>)) + int(sizeof(int) * 3 + sizeof(SeqlenInfo))) /
                  int(sizeof(int) * 3 + sizeof(SeqlenInfo));
    return n < 1 ? 1 : n > 128 ? 128 : n;
  }
  template <class Cache>
  CUTE_DEVICE static bool cached(TileSchedulerParams const& p, Cache const&) { return p.num_entries <= Cache::kCapacity; }

  // One warp; the caller synchronizes it before reading. A sorted entry's blocks are its tiles over the
  // heads; a batch of 32 entries costs two L2 round trips (the order, then the bounds).
  template <class Cache, class SeqlenOf>
  CUTE_DEVICE static void stage(TileSchedulerParams const& p, Cache& c, int lane, SeqlenOf const& seqlen_of) {
    if (lane == 0) c.total = *p.total_ptr;
    if (!cached(p, c)) return;
    for (int s = lane; s < p.num_entries; s += 32) {
      int const incl = p.tile_prefix[s], excl = s > 0 ? p.tile_prefix[s - 1] : 0;
      int const entry = p.entry_order[s];
      c.prefix[s] = incl;
      c.order[s] = entry;
      c.blocks[s] = (incl - excl) / p.num_heads;
      c.seq[s] = seqlen_of(entry);
    }
  }
  template <class Cache>
  CUTE_DEVICE static int total(TileSchedulerParams const& p, Cache const& c) { return c.total; }
  CUTE_DEVICE static int total(TileSchedulerParams const& p) { return *p.total_ptr; }
  CUTE_DEVICE static int initial(TileSchedulerParams const&) { return int(blockIdx.x); }
  CUTE_DEVICE static int next(TileSchedulerParams const& p, int /*tile*/, int total) {
    return fetch_next_tile(p.counter, total);
  }

  template <class Cache, class SeqlenOf>
  CUTE_DEVICE static WorkTile decode(TileSchedulerParams const& p, Cache const& c, int tile, SeqlenOf const& seqlen_of,
                                     SeqlenInfo& seq) {
    if (!cached(p, c)) {
      WorkTile const w = decode(p, tile);
      seq = seqlen_of(w.batch);
      return w;
    }
    int lo = 0, hi = p.num_entries - 1;  // as decode_sorted_entry, over the copies
    while (lo < hi) {
      int const mid = (lo + hi) / 2;
      if (c.prefix[mid] > tile) hi = mid; else lo = mid + 1;
    }
    seq = c.seq[lo];
    return decode_in_entry(p, c.order[lo], tile - (lo > 0 ? c.prefix[lo - 1] : 0), c.blocks[lo]);
  }
  CUTE_DEVICE static WorkTile decode(TileSchedulerParams const& p, int tile) {
    int entry, idx, blocks;
    decode_sorted_entry(p.num_entries, p.tile_prefix, p.entry_order, p.entry_m_blocks, tile, entry, idx, blocks);
    return decode_in_entry(p, entry, idx, blocks);
  }
  // The idx-th of entry's tiles (blocks x heads).
  CUTE_DEVICE static WorkTile decode_in_entry(TileSchedulerParams const& p, int entry, int idx, int blocks) {
    int const per_section = min(p.heads_per_section, p.num_heads);
    int const section = idx / (blocks * per_section);
    int const r = idx - section * blocks * per_section;
    int const head0 = section * per_section;
    int const heads_here = min(per_section, p.num_heads - head0);  // the entry's last section may be short
    int const m_idx = r / heads_here;
    return {blocks - 1 - m_idx, head0 + (r - m_idx * heads_here), entry};
  }
};

// Packed batches in CTA pairs (tile_size.h: CtaPairs; no mask): both CTAs of a cluster run the same unit, (entry,
// head, two neighbouring query blocks), each its block 2 x pair + its rank, so that they read the same K/V. The
// prepare kernel counts units: its blocks are pairs of query blocks (varlen_prepare.h at 2 kBlockM rows), sorted and
// summed as VarlenTileScheduler's tiles, and decoded the same way. An entry of an odd number of query blocks gives
// its last units' rank-1 CTAs a block past its rows (kernel_fwd.h: tile_work). Both CTAs walk the units without
// talking to each other, so the order is static: round after round of one unit per cluster, the rounds alternating
// direction (cluster c takes r C + c in even rounds r, r C + C - 1 - c in odd ones, C clusters): units come longest
// entry first, so a cluster's longer units pair with shorter ones (plain striding gives cluster 0 the longest unit of
// every round). Inside an entry units cost alike, and the clusters of a round still share few heads' K/V.
struct VarlenPairScheduler : VarlenTileScheduler {
  static constexpr bool kNeedsCounter = false;
  static constexpr bool kTakeBeforeLastV = false;
  CUTE_DEVICE static int initial(TileSchedulerParams const&) { return int(blockIdx.x) / 2; }
  CUTE_DEVICE static int next(TileSchedulerParams const&, int unit, int /*total*/) {
    int const clusters = int(gridDim.x) / 2, cluster = int(blockIdx.x) / 2;
    int const round = unit / clusters + 1;
    return round * clusters + (round % 2 == 0 ? cluster : clusters - 1 - cluster);
  }
  template <class Cache, class SeqlenOf>
  CUTE_DEVICE static WorkTile decode(TileSchedulerParams const& p, Cache const& c, int unit, SeqlenOf const& seqlen_of,
                                     SeqlenInfo& seq) {
    return own_block(VarlenTileScheduler::decode(p, c, unit, seqlen_of, seq));
  }
  CUTE_DEVICE static WorkTile decode(TileSchedulerParams const& p, int unit) {
    return own_block(VarlenTileScheduler::decode(p, unit));
  }
  // A unit's pair index (m_block) -> this CTA's query block.
  CUTE_DEVICE static WorkTile own_block(WorkTile w) {
    w.m_block = 2 * w.m_block + int(cute::block_rank_in_cluster());
    return w;
  }
};

// ---------------------------------------------------------------------------------------------
// Backward: one CTA per (key block, query head, batch), launched as a 1-D grid that the hardware
// starts in index order. In causal attention key block n has ~(num_n_blocks - n) query blocks of work, so
// key blocks go heaviest first (n ascending) across a section of heads_per_section (batch, head) pairs, section
// after section: the sections are as many heads as half of L2 holds (their K, V, Q, dO and float32 dQ sums), and
// the heaviest CTAs of the last section start early enough that the grid ends evenly. One head per section (the
// order before session 38) left the busiest SM 7.7% past the average at head dim 128, 4k (ncu; FA3 1.7%): the
// last head's heaviest CTAs started when nearly all work was done (docs/perf-notes.md, S38Z; sections: +0-2% from
// 2k keys, 1-2% slower at 512-1k, so one head per section there, S39B). Non-causal CTAs cost alike: one head per
// section. Deterministic runs reverse n (the semaphores make a CTA wait on higher key blocks of its head and on
// lower heads, which must have lower indices, i.e. have started) with one head per section.
struct BwdTile {
  int n_block, head, batch;
};

struct BwdSchedulerParams {
  int num_n_blocks = 0;
  int nheads = 0;
  bool reverse_n = false;
  int heads_per_section = 1;
  int num_bh = 0;
  // Packed batches: each CTA's tile, written by the prepare kernel (varlen_prepare.h; the grid is an upper bound).
  int4 const* tiles = nullptr;
};

// head_bytes: what one (batch, head) of a causal backward keeps reading (0: one head per section).
inline BwdSchedulerParams make_bwd_scheduler_params(int num_n_blocks, int batch, int nheads, bool deterministic,
                                                     int64_t head_bytes = 0, int64_t l2_bytes = 0) {
  BwdSchedulerParams p{num_n_blocks, nheads, deterministic};
  p.num_bh = batch * nheads;
  if (head_bytes > 0 && !deterministic) {
    int64_t const fit = (l2_bytes > 0 ? l2_bytes : int64_t(50) << 20) / 2 / head_bytes;
    p.heads_per_section = int(std::max<int64_t>(1, std::min<int64_t>({fit, int64_t(nheads), int64_t(p.num_bh)})));
  }
  return p;
}

CUTE_DEVICE BwdTile decode_bwd_tile(BwdSchedulerParams const& p, int linear) {
  int const per_section = p.num_n_blocks * p.heads_per_section;
  int const section = linear / per_section;
  int const r = linear - section * per_section;
  int const bh0 = section * p.heads_per_section;
  int const heads_here = min(p.heads_per_section, p.num_bh - bh0);  // the last section may be short
  int const n = r / heads_here;
  int const bh = bh0 + (r - n * heads_here);
  return {p.reverse_n ? p.num_n_blocks - 1 - n : n, bh % p.nheads, bh / p.nheads};
}

// Packed batches: the longest entries (by key blocks) first, each (entry, head)'s key blocks consecutive,
// ordered as above; false past the schedule's last tile (the grid is an upper bound). CTAs waiting on
// others (deterministic) still wait only on lower indices: within an entry, lower heads and, reversed,
// higher key blocks come first. The prepare kernel decodes every CTA's tile into a table: one load,
// {block, head, entry, the entry's blocks}, issued before the CTA sets up its barriers.
CUTE_DEVICE int4 load_packed_bwd_tile(BwdSchedulerParams const& p, int linear) { return __ldg(p.tiles + linear); }
CUTE_DEVICE bool decode_packed_bwd_tile(BwdSchedulerParams const& p, int4 t, BwdTile& tile) {
  if (t.x < 0) return false;
  tile = {p.reverse_n ? t.w - 1 - t.x : t.x, t.y, t.z};
  return true;
}

}  // namespace flashhopper::sm90
