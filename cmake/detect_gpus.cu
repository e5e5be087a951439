// Prints "major.minor" of each CUDA device this process can see (CUDA_VISIBLE_DEVICES applies), one per
// line; nothing when there is no driver or no device. Run at configure time by DetectGpuArchs.cmake.
#include <cstdio>
#include <cuda_runtime.h>

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, i) == cudaSuccess) std::printf("%d.%d\n", p.major, p.minor);
  }
  return 0;
}
