// The kernels this build contains. Each generated translation unit instantiates one launcher;
// the generated registry lists them so that dispatch is a table lookup, not a template switch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "common/params.h"

namespace flashhopper {

using FwdLaunchFn = void (*)(FwdParams const&, cudaStream_t);
using BwdLaunchFn = void (*)(BwdParams const&, cudaStream_t);
using BwdWorkspaceFn = size_t (*)(BwdParams const&);

struct FwdKernel {
  int arch;  // 90: Hopper path (sm_90a), 80: Ampere path (sm_80, also runs on sm_86..sm_90)
  DType dtype;
  int headdim;
  bool causal;
  FwdLaunchFn launch;
  int block_m, block_n;  // query rows and keys per tile (the report's IO model uses them)
};

// Backward: preprocess, main kernel and postprocess behind one launcher.
struct BwdKernel {
  int arch;
  DType dtype;
  int headdim;
  bool causal;
  BwdLaunchFn launch;
  BwdWorkspaceFn workspace_bytes;  // device scratch the launcher needs for these params
  int block_m, block_n;  // query rows per inner step, keys per CTA
};

// Defined in the generated registry.cpp.
std::vector<FwdKernel> const& fwd_kernels();
std::vector<BwdKernel> const& bwd_kernels();

// Launchers, explicitly instantiated by the generated translation units.
template <DType kDType, int kHeadDim, bool kCausal>
void run_fwd_sm90(FwdParams const& params, cudaStream_t stream);
template <DType kDType, int kHeadDim, bool kCausal>
void run_fwd_sm80(FwdParams const& params, cudaStream_t stream);
template <DType kDType, int kHeadDim, bool kCausal>
void run_bwd_sm90(BwdParams const& params, cudaStream_t stream);
template <DType kDType, int kHeadDim, bool kCausal>
size_t bwd_workspace_bytes_sm90(BwdParams const& params);
template <DType kDType, int kHeadDim, bool kCausal>
void run_bwd_sm80(BwdParams const& params, cudaStream_t stream);
template <DType kDType, int kHeadDim, bool kCausal>
size_t bwd_workspace_bytes_sm80(BwdParams const& params);

// FP8 quantization pass (cpp/quantize_fp8.cu; built with the sm90 family).
void launch_quantize_fp8(QuantParams const& params, cudaStream_t stream);

}  // namespace flashhopper
