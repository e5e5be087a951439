// Host-side device properties the launchers need, queried once per device.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

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

// Raise a kernel's dynamic shared-memory limit once per device (the attribute is per device).
template <class Kernel>
inline cudaError_t set_max_dynamic_smem_once(Kernel kernel, int device, int bytes) {
  static std::atomic<uint64_t> done{0};
  uint64_t const bit = uint64_t(1) << (device & 63);
  if (done.load(std::memory_order_acquire) & bit) return cudaSuccess;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) done.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}

}  // namespace flashhopper
