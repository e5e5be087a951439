// The K/V stage pipeline of the forward: CUTLASS's PipelineTmaAsync, but a stage is released by one thread per
// consumer warpgroup. With a one-CTA cluster, CUTLASS (>= 3.6) has every consumer thread arrive on the empty
// barrier (128 arrivals a warpgroup and stage, from an address known early), and ptxas hoists that arrive, and the
// PV GEMM's wait before it, above the softmax's exponentials (docs/perf-notes.md, session 14). A warpgroup's WGMMA
// is one operation, so once its first thread has waited for it, the stage's shared memory is no longer read.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/pipeline/pipeline.hpp>

namespace flashhopper::sm90 {

template <int kStages>
class PipelineTmaAsyncWarpgroupRelease : public cutlass::PipelineTmaAsync<kStages> {
  using Base = cutlass::PipelineTmaAsync<kStages>;

 public:
  using SharedStorage = typename Base::SharedStorage;
  using Params = typename Base::Params;
  using PipelineState = typename Base::PipelineState;
  using ThreadCategory = typename Base::ThreadCategory;

  // params.num_consumers: consumer threads, a multiple of a warpgroup.
  template <class ClusterShape>
  CUTE_DEVICE PipelineTmaAsyncWarpgroupRelease(SharedStorage& storage, Params params, ClusterShape cluster_shape)
      : Base(storage, per_warpgroup(params), cluster_shape), empty_(&storage.empty_barrier_[0]) {
    static_assert(cute::size(ClusterShape{}) == 1, "one-CTA clusters");
  }

  CUTE_DEVICE void consumer_release(PipelineState state) {
    empty_[state.index()].arrive(0u, uint32_t(threadIdx.x % cutlass::NumThreadsPerWarpGroup == 0));
  }

 private:
  CUTE_DEVICE static Params per_warpgroup(Params p) {
    p.num_consumers = p.num_consumers / cutlass::NumThreadsPerWarpGroup;
    return p;
  }
  typename Base::EmptyBarrier* empty_;
};

}  // namespace flashhopper::sm90
