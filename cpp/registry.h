// The kernels this build contains. Each generated translation unit instantiates one launcher;
// the generated registry lists them so that dispatch is a table lookup, not a template switch.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "common/params.h"

namespace flashhopper {

using FwdLaunchFn = void (*)(FwdParams const&, cudaStream_t);

struct FwdKernel {
  int arch;  // 90: Hopper path (sm_90a), 80: Ampere path (sm_80, also runs on sm_86..sm_90)
  DType dtype;
  int headdim;
  bool causal;
  FwdLaunchFn launch;
  int block_m, block_n;  // query rows and keys per tile (the report's IO model uses them)
};

// Defined in the generated registry.cpp.
std::vector<FwdKernel> const& fwd_kernels();

// Launchers, explicitly instantiated by the generated translation units.
template <DType kDType, int kHeadDim, bool kCausal>
void run_fwd_sm90(FwdParams const& params, cudaStream_t stream);
template <DType kDType, int kHeadDim, bool kCausal>
void run_fwd_sm80(FwdParams const& params, cudaStream_t stream);

}  // namespace flashhopper
