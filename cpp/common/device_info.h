// Host-side device properties the launchers need, queried once per device.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>

#include "launch_attribute.h"

namespace flashhopper {

struct DeviceInfo {
  int num_sms = 0;
  int64_t l2_bytes = 0;
  int max_smem_optin = 0;  // dynamic shared memory a block may opt into
};

inline DeviceInfo const& device_info(int device) {
  static DeviceInfo cache[64];
  static std::atomic<bool> ready[64];
  if (device < 0 || device >= 64) device = 0;
  if (!ready[device].load(std::memory_order_acquire)) {
    DeviceInfo info;
    int l2 = 0;
    cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
    info.l2_bytes = l2;
    cudaDeviceGetAttribute(&info.max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cache[device] = info;
    ready[device].store(true, std::memory_order_release);
  }
  return cache[device];
}

// Per-launch host work that depends only on (kernel, device, launch shape) is done once and remembered: a
// cudaFuncSetAttribute or occupancy query costs microseconds on every call of a small shape (issue #20). Keyed
// by the kernel's address, not its type: kernels of one signature are distinct functions, which a static per
// template instantiation would lump together.
namespace detail {
using OnceKey = std::array<intptr_t, 5>;  // (what, kernel, device, a, b)
inline std::mutex& once_mutex() {
  static std::mutex m;
  return m;
}
inline std::map<OnceKey, int>& once_values() {
  static std::map<OnceKey, int> m;
  return m;
}
// value of `query` (a cudaError_t, writing an int) under key, computed on the first successful call only.
template <class Query>
cudaError_t once(OnceKey const& key, int& value, Query&& query) {
  {
    std::lock_guard<std::mutex> lock(once_mutex());
    auto const it = once_values().find(key);
    if (it != once_values().end()) {
      value = it->second;
      return cudaSuccess;
    }
  }
  cudaError_t const err = query(value);
  if (err == cudaSuccess) {
    std::lock_guard<std::mutex> lock(once_mutex());
    once_values().emplace(key, value);
  }
  return err;
}
}  // namespace detail

// Raise a kernel's dynamic shared-memory limit on the current device `device` (the attribute is per device) to at
// least `bytes`, when a launch needs more than before: the limit only grows, so a kernel launched with sizes that
// vary (the quantization's, by block size) never loses what an earlier size needed.
template <class Kernel>
inline cudaError_t raise_max_dynamic_smem(Kernel kernel, int device, int bytes) {
  std::lock_guard<std::mutex> lock(detail::once_mutex());  // held across the set: the limit and the cache agree
  int& limit = detail::once_values()[{2, reinterpret_cast<intptr_t>(kernel), device, 0, 0}];  // 0 when new
  if (bytes <= limit) return cudaSuccess;
  cudaError_t const err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) limit = bytes;
  return err;
}

// Blocks of `threads` threads and `smem` bytes of dynamic shared memory that fit on one SM of the current device
// `device` at once (cudaOccupancyMaxActiveBlocksPerMultiprocessor), queried once.
template <class Kernel>
inline cudaError_t max_blocks_per_sm_once(int& blocks, Kernel kernel, int device, int threads, int smem) {
  return detail::once({1, reinterpret_cast<intptr_t>(kernel), device, threads, smem}, blocks, [&](int& out) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&out, kernel, threads, smem);
  });
}

// Clusters of `cluster` CTAs (along x) of `threads` threads and `smem` bytes that the current device `device` runs at
// once (cudaOccupancyMaxActiveClusters: a GPC's SMs host whole clusters only), queried once.
template <class Kernel>
inline cudaError_t max_active_clusters_once(int& clusters, Kernel kernel, int device, int threads, int smem, int cluster) {
  return detail::once({3, reinterpret_cast<intptr_t>(kernel), device, threads, smem * 16 + cluster}, clusters,
                      [&](int& out) {
    LaunchWith launch(cluster_along_x(cluster), dim3(unsigned(cluster)), threads, smem, nullptr);
    return cudaOccupancyMaxActiveClusters(&out, kernel, &launch.config);
  });
}

}  // namespace flashhopper
