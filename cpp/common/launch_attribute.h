// Kernel launches that carry one launch attribute (cudaLaunchKernelEx, cudaOccupancyMaxActiveClusters): CTA clusters
// along x (the forward's CTA pairs), or programmatic dependent launch (a kernel that starts while the previous one on
// the stream still runs and waits for it in griddepcontrol.wait).
#pragma once

#include <cuda_runtime.h>

namespace flashhopper {

inline cudaLaunchAttribute cluster_along_x(int ctas) {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = unsigned(ctas);
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = 1;
  return a;
}

inline cudaLaunchAttribute programmatic_launch() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

// The config points at its own attribute, so it is neither copied nor moved.
struct LaunchWith {
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t config{};
  LaunchWith(cudaLaunchAttribute a, dim3 grid, int threads, int smem_bytes, cudaStream_t stream) : attr(a) {
    config.gridDim = grid;
    config.blockDim = dim3(unsigned(threads));
    config.dynamicSmemBytes = size_t(smem_bytes);
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = 1;
  }
  LaunchWith(LaunchWith const&) = delete;
  LaunchWith& operator=(LaunchWith const&) = delete;
};

}  // namespace flashhopper
