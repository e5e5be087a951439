// Semaphores of the backward's dQ sums, shared by the kernel families: one thread spins on a global counter
// until the CTAs before it (the deterministic order, or the key block that stored the sums first) have added.
#pragma once

#include <cute/config.hpp>

#include <cuda/atomic>

namespace flashhopper {

CUTE_DEVICE void wait_at_least(int const* sem, int value) {
  while (cuda::atomic_ref<int const, cuda::thread_scope_device>(*sem).load(cuda::memory_order_acquire) < value) {
  }
}
// The same on the bits of the counter in mask (others carry marks, e.g. kDqUnlanded).
CUTE_DEVICE void wait_at_least_masked(int const* sem, int value, int mask) {
  while ((cuda::atomic_ref<int const, cuda::thread_scope_device>(*sem).load(cuda::memory_order_acquire) & mask) <
         value) {
  }
}
CUTE_DEVICE void signal(int* sem) {
  cuda::atomic_ref<int, cuda::thread_scope_device>(*sem).fetch_add(1, cuda::memory_order_release);
}

}  // namespace flashhopper
