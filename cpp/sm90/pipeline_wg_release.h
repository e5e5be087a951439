// The K/V stage pipeline of the forward: CUTLASS's PipelineTmaAsync, but a stage is released by one thread per
// consumer warpgroup. With a one-CTA cluster, CUTLASS (>= 3.6) has every consumer thread arrive on the empty
// barrier (128 arrivals a warpgroup and stage, from an address known early), and ptxas hoists that arrive, and the
// PV GEMM's wait before it, above the softmax's exponentials (docs/perf-notes.md, session 14). A warpgroup's WGMMA
// is one operation, so once its first thread has waited for it, the stage's shared memory is no longer read.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/pipeline/pipeline.hpp>

namespace flashhopper::sm90 {

// kCluster = 2 (CTA pairs sharing each stage through multicast): the stage's empty barrier of either CTA counts the
// warpgroups of both, and thread 0 of each warpgroup arrives on both.
template <int kStages, int kCluster = 1>
class PipelineTmaAsyncWarpgroupRelease : public cutlass::PipelineTmaAsync<kStages> {
  using Base = cutlass::PipelineTmaAsync<kStages>;

 public:
  using SharedStorage = typename Base::SharedStorage;
  using Params = typename Base::Params;
  using PipelineState = typename Base::PipelineState;
  using ThreadCategory = typename Base::ThreadCategory;

  // params.num_consumers: consumer threads, a multiple of a warpgroup.
  // (CUTLASS counts (cluster x + y - 1) x the warpgroups of num_consumers threads where the cluster has several CTAs,
  // and num_consumers itself for one.)
  template <class ClusterShape>
  CUTE_DEVICE PipelineTmaAsyncWarpgroupRelease(SharedStorage& storage, Params params, ClusterShape cluster_shape)
      : Base(storage, kCluster == 1 ? per_warpgroup(params) : params, cluster_shape), empty_(&storage.empty_barrier_[0]) {
    static_assert(cute::size(ClusterShape{}) == kCluster && cute::size<1>(ClusterShape{}) == 1, "CTAs along x");
  }

  // arrive: false skips the arrival (callers pass a value that is never false to order the release after it:
  // mainloop_fwd.h, kAnchorPvWait).
  CUTE_DEVICE void consumer_release(PipelineState state, bool arrive = true) {
    uint32_t const leader = uint32_t(threadIdx.x % cutlass::NumThreadsPerWarpGroup == 0 && arrive);
    CUTE_UNROLL
    for (int cta = 0; cta < kCluster; ++cta) empty_[state.index()].arrive(uint32_t(cta), leader);
  }

 private:
  CUTE_DEVICE static Params per_warpgroup(Params p) {
    p.num_consumers = p.num_consumers / cutlass::NumThreadsPerWarpGroup;
    return p;
  }
  typename Base::EmptyBarrier* empty_;
};

// A CTA-local TMA pipeline (Q's) inside a cluster launch: CUTLASS's one-CTA PipelineTmaAsync releases a stage on
// the barrier of CTA 0 of the cluster (mapa to rank 0), which in a CTA pair is the partner's for rank 1. This one
// arrives on its own CTA's barrier.
template <int kStages>
class PipelineTmaAsyncLocalRelease : public cutlass::PipelineTmaAsync<kStages> {
  using Base = cutlass::PipelineTmaAsync<kStages>;

 public:
  using SharedStorage = typename Base::SharedStorage;
  using Params = typename Base::Params;
  using PipelineState = typename Base::PipelineState;
  using ThreadCategory = typename Base::ThreadCategory;

  template <class ClusterShape>
  CUTE_DEVICE PipelineTmaAsyncLocalRelease(SharedStorage& storage, Params params, ClusterShape cluster_shape)
      : Base(storage, params, cluster_shape), empty_(&storage.empty_barrier_[0]) {
    static_assert(cute::size(ClusterShape{}) == 1, "the CTA's own stages");
  }

  CUTE_DEVICE void consumer_release(PipelineState state) { empty_[state.index()].arrive(); }

 private:
  typename Base::EmptyBarrier* empty_;
};

}  // namespace flashhopper::sm90
