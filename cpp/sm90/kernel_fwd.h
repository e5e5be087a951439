// The Hopper forward kernel: composes the mainloop (producer loads, consumer GEMMs + softmax),
// the epilogue and the persistent tile scheduler into one warp-specialized, persistent CTA.
//   warpgroup 0      producer: lowers its registers (setmaxnreg) and one thread issues all TMA; with an e4m3 KV
//                    cache its warps 1-3 transpose the e4m3 V stages into V^T ones (Mainloop::convert), or where
//                    blocks are gathered warp 2 loads and gathers K, warp 3 V (Mainloop::gather_v), warps 0-1 transpose
//   warpgroups 1..W  consumers: raise their registers; each owns 64 query rows of the tile
// One-consumer mode (KV caches whose tiles hold at most 64 rows, Mainloop::Params::one_consumer): warpgroup 1
// leaves the K/V stages to warpgroup 0 (half the GEMM work of a decode step's tile, whose rows beyond 64 are
// padding); with an e4m3 cache it transposes V stages beside the producer's converter warps.
// Each tile's batch entry has its own bounds (the mainloop's seqlen_info and block_info): a tile past
// the entry's last row is skipped, one whose rows see no key gets O = 0 and LSE = -inf (or the sink).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include <type_traits>

#include "../common/softmax.h"
#include "../common/utils.h"
#include "named_barriers.h"
#include "tile_scheduler.h"

namespace flashhopper::sm90 {

using namespace cute;

template <class Mainloop, class Epilogue, class Scheduler>
struct FwdKernel {
  using Element = typename Mainloop::Element;
  static constexpr int kNumMmaWG = Mainloop::kNumMmaWG;
  static constexpr int kNumThreads = (kNumMmaWG + 1) * cutlass::NumThreadsPerWarpGroup;
  // Register split (producer / consumer) that fills the 64K-register file.
  // Paged K/V (Mainloop::kProducerRegsBoost): the producer thread reads the page table for each 16-key chunk of a
  // block before issuing its copies, so it gets 16 more registers, the consumers 8 fewer (where they do not spill).
  // e4m3 caches: 48 more for the converter warps (ptxas: 32 more spilled 72 bytes, 48 spill 56, 64 spill 52).
  // CTA pairs: the tile's kPairsProducerRegs (tile_size.h).
  static constexpr int kBoost = Mainloop::kFp8Cache            ? 48
                                : Mainloop::kProducerRegsBoost ? 16
                                : Mainloop::kClusterM > 1      ? Mainloop::kPairsProducerRegs
                                                               : 0;
  static constexpr int kProducerRegs = (kNumMmaWG == 2 ? 24 : 32) + kBoost;
  static constexpr int kConsumerRegs = (kNumMmaWG == 2 ? 240 : 160) - kBoost / 2;
  static_assert(kNumMmaWG == 2 || kNumMmaWG == 3);
  // setmaxnreg only moves registers inside the CTA's launch allocation: kNumThreads x kLaunchRegs (ptxas gives
  // one CTA of kNumThreads at most 64K / kNumThreads, in steps of 8): 64512 at 384 threads, which 24 + 2 x 240
  // per warpgroup use up; 65536 at 512 threads (32 + 3 x 160).
  static constexpr int kLaunchRegs = 64 * 1024 / kNumThreads / 8 * 8;
  static_assert(cutlass::NumThreadsPerWarpGroup * (kProducerRegs + kNumMmaWG * kConsumerRegs) <=
                kNumThreads * kLaunchRegs);

  // The producer publishes each tile index (or -1: no more) to the consumers through this. Where the
  // schedule lives in global memory (packed batches: a binary search over the entries), it publishes the
  // decoded tile too, so that the consumers start without that chain of dependent loads; they still read
  // the entry's bounds themselves (a few independent loads; taken from shared memory instead, they stayed
  // in registers and the consumers spilled 80-160 bytes). Otherwise the consumers decode the index
  // (arithmetic on params).
  using TilePipeline = cutlass::PipelineAsync<2>;
  static constexpr bool kPublishWork = !std::is_same_v<typename Mainloop::Seqlens, UniformSeqlens>;
  struct PublishedTile {
    int tile;
    WorkTile work;
  };

  static constexpr int kSmemLimit = 227 * 1024;
  struct SharedStorageBase {
    typename Mainloop::TensorStorage tensors;
    typename Mainloop::BarrierStorage barriers;
    typename TilePipeline::SharedStorage tile_pipeline;
    PublishedTile tiles[TilePipeline::Stages];
  };
  // The producer's copy of the schedule (tile_scheduler.h), in the shared memory the tiles leave.
  using ScheduleCache =
      typename Scheduler::template CacheT<Scheduler::cache_entries(kSmemLimit - int(sizeof(SharedStorageBase)) - 16)>;
  struct SharedStorageWithCache : SharedStorageBase {
    ScheduleCache schedule;
  };
  // (An empty member would still take a byte, padded to the tensors' alignment.)
  static constexpr bool kScheduleCache = !std::is_empty_v<ScheduleCache>;
  using SharedStorage = std::conditional_t<kScheduleCache, SharedStorageWithCache, SharedStorageBase>;
  CUTE_DEVICE static auto& schedule_cache(SharedStorage& ss, NoScheduleCache& none) {
    if constexpr (kScheduleCache) return ss.schedule; else return none;
  }
  static_assert(sizeof(SharedStorage) <= kSmemLimit, "tile does not fit in shared memory");

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    TileSchedulerParams scheduler;
  };

  // What a tile holds: rows of its batch entry (not past the entry's end) and, for those, visible keys.
  struct TileWork {
    WorkTile tile;
    SeqlenInfo seq;
    typename Mainloop::BlockInfoT block_info;
    bool has_rows, has_keys;
  };
  CUTE_DEVICE static TileWork tile_work(Params const& params, int tile) {
    WorkTile const w = Scheduler::decode(params.scheduler, tile);
    return tile_work(params, w, Mainloop::seqlen_info(params.mainloop, w.batch));
  }
  CUTE_DEVICE static TileWork tile_work(Params const& params, WorkTile const& w, SeqlenInfo const& seq) {
    auto const bi = Mainloop::block_info(params.mainloop, seq, w.m_block, w.split);
    // CTA pairs (kClusterM = 2): a head (packed: an entry's head) with an odd number of query tiles gives its last pair
    // a tile past its rows, which loads and computes like the others (its partner needs its share of K/V) and stores
    // nothing (the O map, packed the entry's own, and the LSE store clip rows past seqlen_q; Q loads as zeros).
    return {w, seq, bi, Mainloop::kClusterM > 1 || w.m_block * Mainloop::kBlockM < seq.seqlen_q,
            bi.n_block_max(w.m_block) > bi.n_block_min(w.m_block)};
  }

  // The sink logits (exp2 units) of this thread's two accumulator rows. GQA-packed rows (KV caches) are query heads of
  // their own; a split's partial LSE leaves the sink out, and the combine adds it once (common/combine_splits.h).
  CUTE_DEVICE static cute::array<float, 2> sinks_log2(Params const& params, SeqlenInfo const& seq, int m_block,
                                                       int head, int wg, int thread_idx) {
    cute::array<float, 2> sinks;
    if constexpr (Mainloop::Seqlens::kPackedRows) {
      bool const split = Epilogue::split_store(params.epilogue);
      CUTE_UNROLL
      for (int mi = 0; mi < 2; ++mi) {
        sinks[mi] = split ? -INFINITY
                          : Mainloop::sink_log2(params.mainloop, head, Epilogue::row_of(m_block, wg, thread_idx, mi),
                                                seq.rows_per_query);
      }
    } else {
      sinks[0] = sinks[1] = Mainloop::sink_log2(params.mainloop, head);
    }
    return sinks;
  }

  CUTE_DEVICE static void run(Params const& params, char* smem) {
    using Pipeline = typename Mainloop::Pipeline;
    using PipelineQ = typename Mainloop::PipelineQ;
    SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem);
    int const warp_group_idx = cutlass::canonical_warp_group_idx();
    // Producer roles by warp: 0 loads (Q, tiles; K where blocks are gathered), 1 gathers V (gathered blocks), the rest
    // convert (e4m3 caches). Gathered blocks rotate the roles by two warps, so that the gathering warps' cp.async
    // stream runs on SM sub-partitions 2-3 (warp index mod 4), not on 0, where a decode step's one live consumer warp
    // (warp 0 of warpgroup 1) issues its softmax and shared-memory loads.
    constexpr int kRoleShift = Mainloop::kGatherKV ? 2 : 0;
    int const warp_idx_in_wg = (cutlass::canonical_warp_idx_sync() + kRoleShift) % cutlass::NumWarpsPerWarpGroup;
    int const thread_idx = threadIdx.x % cutlass::NumThreadsPerWarpGroup;
    // A producer thread's index in its role's order (thread_idx itself where the roles are not rotated, so that
    // those kernels' code stays as it was).
    int const role_thread =
        kRoleShift == 0 ? thread_idx : warp_idx_in_wg * cutlass::NumThreadsPerWarp + thread_idx % cutlass::NumThreadsPerWarp;
    bool const is_producer = warp_group_idx == 0;
    bool const lane_predicate = cute::elect_one_sync();

    if (is_producer && warp_idx_in_wg == 0 && lane_predicate) {
      Mainloop::prefetch_descriptors(params.mainloop);
      Epilogue::prefetch_descriptors(params.epilogue);
    }

    // Barriers are initialized by warp 0 inside the pipeline constructors.
    // K/V stages: TMA -> consumers; with an e4m3 cache TMA -> converter warps (PipelineCache) -> consumers.
    using PipelineCache = typename Mainloop::PipelineCache;
    // Gathered e4m3 blocks: role 1 gathers V (Mainloop::gather_v), roles 2-3 convert.
    constexpr int kFirstConverter = Mainloop::kGatherKV ? 2 : 1;
    bool const is_v_gatherer = Mainloop::kGatherKV && is_producer && warp_idx_in_wg == 1;
    bool const is_converter = Mainloop::kFp8Cache && is_producer && warp_idx_in_wg >= kFirstConverter;
    bool const one_consumer = params.mainloop.one_consumer;
    bool const wg1_converts = Mainloop::kFp8Cache && one_consumer && warp_group_idx == 2;
    int const num_convert = Mainloop::kNumConvertThreads + (one_consumer ? cutlass::NumThreadsPerWarpGroup : 0);
    uint32_t const num_kv_consumers = one_consumer ? cutlass::NumThreadsPerWarpGroup : Mainloop::kNumMmaThreads;
    auto make_kv_pipelines = [&] {
      if constexpr (Mainloop::kFp8Cache) {
        // K: TMA -> the consumers' S GEMMs. V: TMA -> converters -> the consumers' V^T e4m3 stages. Each block with its
        // scales. Gathered blocks (Mainloop::kGatherKV): each of the 32 lanes of the gathering warp (K: role 0, V: role
        // 1) arrives once its copies land (cp.async.mbarrier.arrive.noinc), and no thread expects TMA bytes.
        constexpr bool kGather = Mainloop::kGatherKV;
        typename PipelineCache::Params k_params;
        k_params.num_producers = kGather ? cutlass::NumThreadsPerWarp : 1;
        k_params.transaction_bytes = kGather ? 0 : Mainloop::kKCacheStageBytes;
        k_params.role = !is_producer                ? PipelineCache::ThreadCategory::Consumer
                        : warp_idx_in_wg == 0 ? PipelineCache::ThreadCategory::Producer
                                              : PipelineCache::ThreadCategory::NonParticipant;
        k_params.is_leader = !kGather && is_producer && role_thread == 0;
        k_params.num_consumers = num_kv_consumers;
        PipelineCache k8(ss.barriers.pipeline_k8, k_params, Shape<_1, _1, _1>{});
        typename PipelineCache::Params c_params;
        c_params.num_producers = k_params.num_producers;
        c_params.transaction_bytes = kGather ? 0 : Mainloop::kVCacheStageBytes;
        c_params.role = is_producer && warp_idx_in_wg == (kGather ? 1 : 0) ? PipelineCache::ThreadCategory::Producer
                        : is_producer && warp_idx_in_wg == 0     ? PipelineCache::ThreadCategory::NonParticipant
                                                                 : PipelineCache::ThreadCategory::Consumer;
        c_params.is_leader = k_params.is_leader;
        c_params.num_consumers = num_convert;
        PipelineCache v8(ss.barriers.pipeline_v8, c_params, Shape<_1, _1, _1>{});
        typename Pipeline::Params a_params;
        a_params.role = is_converter || wg1_converts ? Pipeline::ThreadCategory::Producer
                        : is_producer ? Pipeline::ThreadCategory::NonParticipant
                                      : Pipeline::ThreadCategory::Consumer;
        a_params.producer_arv_count = num_convert;
        a_params.consumer_arv_count = num_kv_consumers;
        Pipeline v(ss.barriers.pipeline_v, a_params);
        return cute::make_tuple(k8, v, k8, v8);  // (the consumers' K pipeline is the load's)
      } else {
        typename Pipeline::Params kv_params;
        kv_params.transaction_bytes = Mainloop::kKStageBytes;
        kv_params.role = is_producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
        kv_params.is_leader = is_producer && thread_idx == 0;
        kv_params.num_consumers = num_kv_consumers;
        // (CTA pairs: each stage's empty barrier counts the consumers of both CTAs.)
        Pipeline k(ss.barriers.pipeline_k, kv_params, typename Mainloop::ClusterShape{});
        kv_params.transaction_bytes = Mainloop::kVStageBytes;
        Pipeline v(ss.barriers.pipeline_v, kv_params, typename Mainloop::ClusterShape{});
        return cute::make_tuple(k, v, k, v);  // (TMA feeds the consumers' stages)
      }
    };
    auto kv_pipelines = make_kv_pipelines();
    typename Mainloop::PipelineK& pipeline_k = get<0>(kv_pipelines);
    Pipeline& pipeline_v = get<1>(kv_pipelines);
    auto& pipeline_load_k = get<2>(kv_pipelines);
    auto& pipeline_load_v = get<3>(kv_pipelines);
    using PipelineLoad = std::remove_reference_t<decltype(pipeline_load_k)>;

    typename PipelineQ::Params q_params;
    q_params.transaction_bytes = Mainloop::kQStageBytes;
    q_params.role = is_producer ? PipelineQ::ThreadCategory::Producer : PipelineQ::ThreadCategory::Consumer;
    q_params.is_leader = is_producer && role_thread == 0;  // the loading warp's lane 0
    q_params.num_consumers = kNumMmaWG;  // one release per warpgroup (epilogue)
    PipelineQ pipeline_q(ss.barriers.pipeline_q, q_params, Shape<_1, _1, _1>{});

    typename TilePipeline::Params tile_params;
    tile_params.role = is_producer ? TilePipeline::ThreadCategory::Producer : TilePipeline::ThreadCategory::Consumer;
    tile_params.producer_arv_count = 1;
    tile_params.consumer_arv_count = Mainloop::kNumMmaThreads;
    TilePipeline tile_pipeline(ss.tile_pipeline, tile_params);
    // Barrier initialization is visible to every thread (CTA pairs: to the partner's too, whose TMA and releases
    // reach this CTA's barriers).
    if constexpr (Mainloop::kClusterM > 1) {
      cute::cluster_arrive_relaxed();
      cute::cluster_wait();
    } else {
      __syncthreads();
    }
    if constexpr (Scheduler::kAfterPrepare) {
      cutlass::arch::wait_on_dependent_grids();  // the prepare kernel's schedule and tensor maps are written
    }

    TileSchedulerParams const& sched = params.scheduler;
    // A reader of the tile pipeline (the consumer warpgroups): the next published tile, tile -1 when done.
    auto next_tile = [&](typename TilePipeline::PipelineState& read_tile) {
      tile_pipeline.consumer_wait(read_tile);
      PublishedTile const t = ss.tiles[read_tile.index()];
      tile_pipeline.consumer_release(read_tile);
      ++read_tile;
      return t;
    };
    if (is_producer) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      // One thread issues every load, or the whole warp where it gathers K/V (each lane walks the same static
      // schedule; lane_predicate's thread alone publishes the tiles).
      static_assert(!Mainloop::kGatherKV || !Scheduler::kNeedsCounter, "gathering lanes walk a static schedule");
      NoScheduleCache no_cache;
      auto& schedule = schedule_cache(ss, no_cache);
      if constexpr (kScheduleCache) {
        if (warp_idx_in_wg == 0) {
          Scheduler::stage(sched, schedule, threadIdx.x % cutlass::NumThreadsPerWarp,
                           [&](int b) { return Mainloop::seqlen_info(params.mainloop, b); });
          __syncwarp();
        }
      }
      if (warp_idx_in_wg == 0 && (Mainloop::kGatherKV || lane_predicate)) {
        auto write_q = cutlass::make_producer_start_state<PipelineQ>();
        auto write_k = cutlass::make_producer_start_state<PipelineLoad>();
        auto write_v = cutlass::make_producer_start_state<PipelineLoad>();
        auto write_tile = cutlass::make_producer_start_state<TilePipeline>();
        int tile = Scheduler::initial(sched);
        int acquired_entry = -1;  // the last batch entry whose tensor maps this thread acquired
        while (true) {
          // (Read per tile rather than held: the producer has few registers.)
          int const total_tiles = Scheduler::total(sched, schedule);
          bool const valid = tile < total_tiles;
          tile_pipeline.producer_acquire(write_tile);
          PublishedTile& slot = ss.tiles[write_tile.index()];
          if (!valid) {
            if (lane_predicate) {
              slot.tile = -1;
              tile_pipeline.producer_commit(write_tile);
            }
            // CTA pairs: this CTA exits only once every consumer of the pair has released every K/V stage, so that no
            // release from the partner arrives at a barrier of an exited CTA.
            if constexpr (Mainloop::kClusterM > 1) {
              pipeline_load_k.producer_tail(write_k);
              pipeline_load_v.producer_tail(write_v);
            }
            break;
          }
          SeqlenInfo seq;
          WorkTile const w = Scheduler::decode(sched, schedule, tile,
                                               [&](int b) { return Mainloop::seqlen_info(params.mainloop, b); }, seq);
          TileWork const t = tile_work(params, w, seq);
          if (lane_predicate) {
            slot.tile = tile;
            if constexpr (kPublishWork) slot.work = t.tile;
            tile_pipeline.producer_commit(write_tile);
          }
          ++write_tile;
          // Taken once this tile's loads are out (the consumers a few key blocks from its end), not when it
          // started: a dynamic schedule then hands the next tile to the CTA that frees up first (tile_scheduler.h).
          // kTakeBeforeLastV: before the last V copy's wait for a stage, which then covers the atomic's latency.
          int next = -1;
          auto take_next = [&] { next = Scheduler::next(sched, tile, total_tiles); };
          if (t.has_rows && t.has_keys) {  // otherwise the consumers write zeros (or nothing), without Q
            Mainloop::load(params.mainloop, pipeline_q, pipeline_load_k, pipeline_load_v, write_q, write_k, write_v,
                           ss.tensors, t.seq, t.block_info, t.tile.m_block, t.tile.head, t.tile.batch, acquired_entry,
                           [&] { if constexpr (Scheduler::kTakeBeforeLastV) take_next(); });
          }
          if (next < 0) take_next();
          tile = next;
        }
      } else if (is_v_gatherer) {
        if constexpr (Mainloop::kGatherKV) {
          static_assert(!Scheduler::kNeedsCounter, "the V gatherer walks a static schedule");
          auto write_v8 = cutlass::make_producer_start_state<PipelineLoad>();
          int const total_tiles = Scheduler::total(sched);
          for (int tile = Scheduler::initial(sched); tile < total_tiles;
               tile = Scheduler::next(sched, tile, total_tiles)) {
            TileWork const t = tile_work(params, tile);
            if (t.has_rows && t.has_keys) {
              Mainloop::gather_v(params.mainloop, pipeline_load_v, write_v8, ss.tensors, t.seq, t.block_info,
                                 t.tile.m_block, t.tile.head, t.tile.batch);
            }
          }
        }
      } else if (is_converter) {
        if constexpr (Mainloop::kFp8Cache) {
        // The producer's tiles, walked the same way (the schedule is static: a function of the tile index).
        static_assert(!Scheduler::kNeedsCounter, "converter warps walk a static schedule");
        typename Mainloop::PipelineStateCache read_v8;
        auto write_v = cutlass::make_producer_start_state<Pipeline>();
        int const total_tiles = Scheduler::total(sched);
        for (int tile = Scheduler::initial(sched); tile < total_tiles; tile = Scheduler::next(sched, tile, total_tiles)) {
          TileWork const t = tile_work(params, tile);
          if (t.has_rows && t.has_keys) {
            Mainloop::convert(params.mainloop, pipeline_load_v, pipeline_v, read_v8, write_v, ss.tensors, t.seq,
                              t.block_info, t.tile.m_block, t.tile.head, t.tile.batch,
                              role_thread - kFirstConverter * cutlass::NumThreadsPerWarp, num_convert);
          }
        }
        }
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
      int const wg = warp_group_idx - 1;
      int acquired_entry = -1;  // as the producer's (O's map)
      if (!one_consumer) Mainloop::Sched::init(wg);
      // One-consumer mode, e4m3 cache: warpgroup 1 converts (its own pipeline states, the converters' order).
      typename Mainloop::PipelineStateCache read_v8;
      auto write_v = cutlass::make_producer_start_state<Pipeline>();
      typename Mainloop::PipelineK::PipelineState read_k;
      typename Mainloop::PipelineState read_v;
      typename Mainloop::PipelineStateQ read_q;
      typename TilePipeline::PipelineState read_tile;
      // Q-stage release: O is staged for its TMA store in the Q stage the tile used, so that stage
      // is free once TMA has read O. With two Q stages that is checked during the next tile, after
      // its first GEMM is issued (long done by then); with one, right after the store, since the
      // next tile's Q cannot load before. FP8 stages O in its own buffer: Q is free after the mainloop.
      constexpr bool kOInQ = !Mainloop::kFp8;
      constexpr bool kDeferRelease = kOInQ && Mainloop::kQStages > 1;
      typename Mainloop::PipelineStateQ pending_q;
      bool q_release_pending = false;
      auto release_q_after_store = [&](auto const& q_state) {
        if (thread_idx == 0) {
          tma_store_wait<0>();
          pipeline_q.consumer_release(q_state);
        }
      };
      auto on_first_issue = [&] {
        if constexpr (kDeferRelease) {
          if (q_release_pending) release_q_after_store(pending_q);
          q_release_pending = false;
        }
      };

      while (true) {
        PublishedTile const pub = next_tile(read_tile);
        if (pub.tile < 0) break;
        TileWork const t = kPublishWork ? tile_work(params, pub.work, Mainloop::seqlen_info(params.mainloop, pub.work.batch))
                                        : tile_work(params, pub.tile);
        WorkTile const& w = t.tile;
        if (!t.has_rows) continue;
        if (!t.has_keys) {  // LSE = the row's sink (GQA-packed rows: each its query head's), or -inf
          if constexpr (Mainloop::Seqlens::kPackedRows) {
            Epilogue::store_empty(params.epilogue, t.seq, w.m_block, w.head, w.batch, wg, thread_idx,
                                  [&](int row) {
                                    return Mainloop::sink_log2(params.mainloop, w.head, row, t.seq.rows_per_query) *
                                           float(M_LN2);
                                  },
                                  w.split);
          } else {
            float const empty_lse = Mainloop::sink_log2(params.mainloop, w.head) * float(M_LN2);
            Epilogue::store_empty(params.epilogue, t.seq, w.m_block, w.head, w.batch, wg, thread_idx,
                                  [empty_lse](int) { return empty_lse; }, w.split);
          }
          continue;
        }
        if (one_consumer && wg == 1) {  // its rows are padding: no GEMMs, no store
          if constexpr (Mainloop::kFp8Cache) {
            Mainloop::convert(params.mainloop, pipeline_load_v, pipeline_v, read_v8, write_v, ss.tensors, t.seq,
                              t.block_info, w.m_block, w.head, w.batch, Mainloop::kNumConvertThreads + thread_idx,
                              num_convert);
          }
          // The Q stage's release still counts this warpgroup (after its load: phases stay in order).
          pipeline_q.consumer_wait(read_q);
          if (thread_idx == 0) pipeline_q.consumer_release(read_q);
          ++read_q;
          continue;
        }
        Epilogue::begin_tile(params.epilogue, t.seq, w.m_block, wg, w.batch, thread_idx, acquired_entry);
        Tensor tOrO = partition_fragment_C(typename Mainloop::TiledMmaPV{}, Shape<_64, Int<Mainloop::kHeadDimV>>{});
        clear(tOrO);
        typename Mainloop::Softmax softmax(params.mainloop.scale_log2);

        pipeline_q.consumer_wait(read_q);
        float const o_descale = Mainloop::mma(params.mainloop, pipeline_k, pipeline_v, read_k, read_v, ss.tensors,
                                              read_q.index(), tOrO, softmax, t.seq, t.block_info, w.m_block, w.head,
                                              w.batch, wg, thread_idx, on_first_issue);
        if constexpr (!kOInQ) {
          if (thread_idx == 0) pipeline_q.consumer_release(read_q);  // every S GEMM has completed
        }

        cute::array<float, 2> lse;
        auto inv_sum = softmax.finalize(lse, sinks_log2(params, t.seq, w.m_block, w.head, wg, thread_idx));
        if constexpr (Mainloop::kFp8 || Mainloop::kFp8Cache || Mainloop::Dropout::kEnabled) {
          inv_sum[0] *= o_descale;
          inv_sum[1] *= o_descale;
        }
        Tensor o = rowcol(tOrO);
        Mainloop::Softmax::rescale(o, inv_sum);
        if constexpr (kOInQ) {
          Epilogue::store(params.epilogue, tOrO, lse, ss.tensors.smem_q.data(), read_q.index(), t.seq, w.m_block,
                          w.head, w.batch, wg, thread_idx, w.split);
        } else {
          Epilogue::store(params.epilogue, tOrO, lse, ss.tensors.smem_o.data(), 0, t.seq, w.m_block, w.head, w.batch,
                          wg, thread_idx);
        }
        if constexpr (kDeferRelease) {
          pending_q = read_q;
          q_release_pending = true;
        } else if constexpr (kOInQ) {
          release_q_after_store(read_q);
        }
        ++read_q;
      }
      // TMA must have read the last O before the CTA's shared memory goes away.
      if (thread_idx == 0) tma_store_wait<0>();
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, 1)
    fwd_kernel(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
  extern __shared__ __align__(1024) char smem[];
  Kernel::run(params, smem);
}

}  // namespace flashhopper::sm90
