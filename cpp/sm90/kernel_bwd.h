// The Hopper backward kernel: one CTA per (key block, query head, batch), warp-specialized.
//   warpgroup 0      producer: lowers its registers (setmaxnreg); warp 0 (one thread) issues the
//                    TMA loads, warp 1 is the dQ writer (bulk reduce-adds, mainloop_bwd.h: DqPath); with dropout
//                    warps 2-3 draw the keep masks (Mainloop::draw_dropout, dropout_feed.h)
//   warpgroups 1, 2  consumers: raise their registers; the five GEMMs, the softmax gradient and
//                    the dK/dV epilogue
// One CTA per key block, not persistent (packed batches: the grid an upper bound of the key blocks, CTAs past
// the prepare kernel's schedule returning at once): the hardware launches CTAs in block-index order, and
// tile_scheduler.h maps indices to (key block, head, batch) heaviest first. The deterministic mode
// makes CTAs wait on each other; a CTA may only wait on CTAs of lower index, which are running or
// done (never on one not launched yet), so there the key blocks are mapped in reverse: the highest
// key block, which adds to dQ first, gets the lowest index.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "named_barriers.h"
#include "tile_scheduler.h"

namespace flashhopper::sm90 {

using namespace cute;

template <class Mainloop, class Epilogue>
struct BwdKernel {
  static constexpr int kNumThreads = (Mainloop::kNumMmaWG + 1) * cutlass::NumThreadsPerWarpGroup;
  // Fills the 64K-register file; dropout's drawing warps take some of the consumers' (Mainloop::DropFeed).
  using DropFeed = typename Mainloop::DropFeed;
  static constexpr int kProducerRegs = 24 + DropFeed::kProducerRegsBoost;
  static constexpr int kConsumerRegs = 240 - DropFeed::kProducerRegsBoost / 2;
  static_assert(cutlass::NumThreadsPerWarpGroup * (kProducerRegs + Mainloop::kNumMmaWG * kConsumerRegs) <= 64 * 1024 &&
                kConsumerRegs % 8 == 0);

  using SharedStorage = typename Mainloop::TensorStorage;  // tiles, row statistics and barriers
  static constexpr int kSmemLimit = 227 * 1024;
  static_assert(sizeof(SharedStorage) <= kSmemLimit, "tile does not fit in shared memory");

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    BwdSchedulerParams scheduler;
  };

  // Every pipeline here: one loading thread (the leader sets the transaction bytes), and all
  // consumer threads release each stage.
  template <class P>
  CUTE_DEVICE static P make_pipeline(typename P::SharedStorage& storage, uint32_t transaction_bytes, bool is_producer,
                                     bool is_leader) {
    typename P::Params params;
    params.transaction_bytes = transaction_bytes;
    params.role = is_producer ? P::ThreadCategory::Producer : P::ThreadCategory::Consumer;
    params.is_leader = is_leader;
    params.num_consumers = Mainloop::kNumMmaThreads;
    return P(storage, params, Shape<_1, _1, _1>{});
  }

  CUTE_DEVICE static void run(Params const& params, char* smem) {
    using PipelineKV = typename Mainloop::PipelineKV;
    using Pipeline = typename Mainloop::Pipeline;
    using PipelinedO = typename Mainloop::PipelinedO;
    SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem);
    int const warp_group_idx = cutlass::canonical_warp_group_idx();
    int const warp_idx_in_wg = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
    bool const is_producer = warp_group_idx == 0;
    bool const is_loader = threadIdx.x == 0;  // the pipelines' leader: it sets the transaction bytes
    [[maybe_unused]] int4 packed_tile{};
    if constexpr (Mainloop::Seqlens::kPacked) packed_tile = load_packed_bwd_tile(params.scheduler, int(blockIdx.x));

    if (is_loader) {
      Mainloop::prefetch_descriptors(params.mainloop);
      Epilogue::prefetch_descriptors(params.epilogue);
    }

    // Barriers are initialized by warp 0 inside the pipeline constructors.
    auto pipeline_kv = make_pipeline<PipelineKV>(ss.barriers.pipeline_kv, Mainloop::kKVBytes, is_producer, is_loader);
    auto pipeline_q = make_pipeline<Pipeline>(ss.barriers.pipeline_q, Mainloop::kQStageBytes, is_producer, is_loader);
    // dO with its D (headdim_v columns).
    auto pipeline_do = make_pipeline<PipelinedO>(ss.barriers.pipeline_do, Mainloop::kdOStageBytes, is_producer, is_loader);
    bool const is_drawer = DropFeed::kEnabled && is_producer && warp_idx_in_wg >= 2;
    auto pipeline_drop = [&] {
      if constexpr (DropFeed::kEnabled) {
        using DropPipeline = typename DropFeed::Pipeline;
        typename DropPipeline::Params d_params;
        d_params.role = is_drawer     ? DropPipeline::ThreadCategory::Producer
                        : is_producer ? DropPipeline::ThreadCategory::NonParticipant
                                      : DropPipeline::ThreadCategory::Consumer;
        d_params.producer_arv_count = DropFeed::kThreads;
        d_params.consumer_arv_count = Mainloop::kNumMmaThreads;
        return DropPipeline(ss.barriers.drop.pipeline, d_params);
      } else {
        return 0;
      }
    }();
    __syncthreads();  // barrier initialization is visible to every thread

    // The dQ postprocess may start once every CTA has started: it only waits on blocks that resident
    // CTAs complete, so it can never hold an SM that a CTA of this grid still needs.
    cutlass::arch::launch_dependent_grids();

    BwdTile tile;
    if constexpr (Mainloop::Seqlens::kPacked) {
      if (!decode_packed_bwd_tile(params.scheduler, packed_tile, tile)) return;  // past the schedule
    } else {
      tile = decode_bwd_tile(params.scheduler, int(blockIdx.x));
    }
    int const n_block = tile.n_block, head = tile.head, batch = tile.batch;
    SeqlenInfo const seq = Mainloop::seqlen_info(params.mainloop, batch);
    auto const bi = Mainloop::block_info(params.mainloop, seq);
    if (is_producer) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      if (warp_idx_in_wg == 0) {
        if (is_loader) {
          Mainloop::load(params.mainloop, pipeline_kv, pipeline_q, pipeline_do, ss, seq, bi, n_block, head, batch);
        }
      } else if (warp_idx_in_wg == 1) {
        Mainloop::store_dq(params.mainloop, ss, seq, bi, n_block, head, batch);
      } else if (is_drawer) {
        Mainloop::draw_dropout(params.mainloop, pipeline_drop, ss, bi, n_block, head, batch,
                               threadIdx.x - 2 * cutlass::NumThreadsPerWarp);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
      int const thread_idx = threadIdx.x - cutlass::NumThreadsPerWarpGroup;  // 0..255 over both warpgroups
      typename Mainloop::Accumulators acc;  // dK and dV
      acc.clear();
      Mainloop::mma(params.mainloop, pipeline_kv, pipeline_q, pipeline_do, ss, acc, thread_idx, seq, bi, n_block, head,
                    batch, pipeline_drop);
      Epilogue::store(params.epilogue, acc, ss, thread_idx, seq, n_block, head, batch);
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, 1)
    bwd_kernel(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
  extern __shared__ __align__(1024) char smem[];
  Kernel::run(params, smem);
}

}  // namespace flashhopper::sm90
