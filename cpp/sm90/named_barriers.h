// Named-barrier ids of the Hopper kernels (offset past CUTLASS's reserved ids by NamedBarrier: the
// hardware has 16 and CUTLASS keeps 8, so ids 0..7).
// Ping-pong: consumer warpgroup w waits on barrier kSched + w before issuing its GEMMs and, once
// they are issued, arrives on the next warpgroup's, so warpgroups issue in round robin.
#pragma once

#include <cutlass/arch/barrier.h>

namespace flashhopper::sm90 {

enum NamedBarriers : uint32_t {
  kSchedBarrier0 = 0,     // 0 .. kNumMmaWG-1: ping-pong turn of each consumer warpgroup
  kEpilogueBarrier0 = 4,  // 4 .. 4+kNumMmaWG-1: a warpgroup's own epilogue (128 threads)
};

// Backward (its own kernel, so the ids are reused).
enum BwdNamedBarriers : uint32_t {
  kBwdPdS = 0,        // both consumer warpgroups: P/dS written (and, single-buffered, free to write)
  kBwddQFull0 = 1,    // 1, 2: a consumer warpgroup's dQ half is staged for the dQ writer
  kBwddQEmpty0 = 3,   // 3, 4: the dQ writer has sent that half; the buffer may be refilled
  kBwdAtomicWG0 = 5,  // 5, 6: one warpgroup around its deterministic atomics
  kBwdEpilogue = 7,   // both consumer warpgroups: done with K/V smem, then dK/dV staged there
  // Both consumer warpgroups before counting their dQ atomics. That path has no dQ writer, so it
  // takes a hand-off id (8 was hardware barrier 16, which wrapped to barrier 0, __syncthreads').
  kBwddQAtomic = kBwddQFull0,
};
static_assert(kBwdEpilogue < 8 && kEpilogueBarrier0 + 4 <= 8, "CUTLASS leaves 8 named barriers to the kernel");
// The dQ hand-offs pair one consumer warpgroup with the dQ-writer warp.
inline constexpr uint32_t kdQHandoffThreads = cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp;

template <int kNumMmaWG, bool kEnabled>
struct PingPong {
  static constexpr bool kOn = kEnabled && kNumMmaWG > 1;
  static constexpr uint32_t kThreads = 2 * cutlass::NumThreadsPerWarpGroup;

  CUTE_DEVICE static void sync(int wg) {
    if constexpr (kOn) cutlass::arch::NamedBarrier::sync(kThreads, kSchedBarrier0 + wg);
  }
  CUTE_DEVICE static void arrive(int wg) {
    if constexpr (kOn) {
      int const next = wg + 1 == kNumMmaWG ? 0 : wg + 1;
      cutlass::arch::NamedBarrier::arrive(kThreads, kSchedBarrier0 + next);
    }
  }
  // The last warpgroup opens the first turn for warpgroup 0.
  CUTE_DEVICE static void init(int wg) {
    if constexpr (kOn) {
      if (wg == kNumMmaWG - 1) cutlass::arch::NamedBarrier::arrive(kThreads, kSchedBarrier0);
    }
  }
};

CUTE_DEVICE void epilogue_barrier_sync(int wg) {
  cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, kEpilogueBarrier0 + wg);
}
// The same barrier outside the epilogue (a warpgroup's 128 threads, in program order with its epilogue's uses).
CUTE_DEVICE void warpgroup_barrier_sync(int wg) { epilogue_barrier_sync(wg); }

}  // namespace flashhopper::sm90
