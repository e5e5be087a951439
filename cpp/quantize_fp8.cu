// The FP8 quantization kernels (cpp/common/quantize_fp8.h), compiled once for the Hopper build.
#include "common/quantize_fp8.h"
#include "registry.h"

namespace flashhopper {

int64_t launch_quantize_fp8(QuantParams const& params, cudaStream_t stream) { return quantize_fp8(params, stream); }

}  // namespace flashhopper
