// Semaphores of the deterministic backward, shared by the kernel families: one thread spins on a
// global counter until the CTAs before it in the fixed order have added their share.
#pragma once

#include <cute/config.hpp>

#include <cuda/atomic>

namespace flashhopper {

CUTE_DEVICE void wait_at_least(int const* sem, int value) {
  while (cuda::atomic_ref<int const, cuda::thread_scope_device>(*sem).load(cuda::memory_order_acquire) < value) {
  }
}
CUTE_DEVICE void signal(int* sem) {
  cuda::atomic_ref<int, cuda::thread_scope_device>(*sem).fetch_add(1, cuda::memory_order_release);
}

}  // namespace flashhopper
