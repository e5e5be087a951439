// The kernels this build contains. Each generated translation unit instantiates one launcher for one
// KernelConfig (common/kernel_key.h); the generated registry lists them by KernelKey, so that dispatch
// is a table lookup, not a template switch, and the build's configuration (families, dtypes, head dims,
// masks, variants) is reported as the generator saw it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/kernel_key.h"
#include "common/kvcache_append.h"
#include "common/params.h"

namespace flashhopper {

// A launcher returns the number of CTAs its main kernel was launched with (0: an empty grid, nothing
// to compute, nothing launched).
using FwdLaunchFn = int64_t (*)(FwdParams const&, cudaStream_t);
using BwdLaunchFn = int64_t (*)(BwdParams const&, cudaStream_t);
using BwdWorkspaceFn = size_t (*)(BwdParams const&);

struct TileInfo {
  int block_m, block_n;  // forward: query rows and keys per tile; backward: query rows per step, keys per CTA
  // Forward kernels with a short-key tile (sm90/tile_size.h: ShortKeys): its keys per tile and the most keys a
  // padded call may have to run it; 0 without one.
  int block_n_short = 0, short_keys_max = 0;
};

struct FwdEntry {
  KernelKey key;
  FwdLaunchFn launch;
  TileInfo tiles;  // the report's IO model and the fp8 scale blocks use them
};

// Backward: preprocess, main kernel and postprocess behind one launcher.
struct BwdEntry {
  KernelKey key;
  BwdLaunchFn launch;
  BwdWorkspaceFn workspace_bytes;  // device scratch the launcher needs for these params
  TileInfo tiles;
};

// What the build was asked for (CMake's FLASHHOPPER_* options, as the generator read them).
struct BuildConfig {
  std::vector<int> archs;
  std::vector<std::string> modes, dtypes, masks, variants, score_mods, dropout, varlen, kvcache;
  std::vector<int> headdims;                         // Q/K head dims with V's the same
  std::vector<std::vector<int>> headdim_pairs;       // (Q/K, V) head dims that differ
};

// Defined in the generated registry.cpp.
std::vector<FwdEntry> const& fwd_kernels();
std::vector<BwdEntry> const& bwd_kernels();
BuildConfig const& build_config();

// Launchers, explicitly instantiated by the generated translation units (Config: a KernelConfig).
template <class Config>
int64_t run_fwd_sm90(FwdParams const& params, cudaStream_t stream);
template <class Config>
TileInfo fwd_tiles_sm90();
template <class Config>
int64_t run_fwd_sm80(FwdParams const& params, cudaStream_t stream);
template <class Config>
TileInfo fwd_tiles_sm80();
template <class Config>
int64_t run_bwd_sm90(BwdParams const& params, cudaStream_t stream);
template <class Config>
size_t bwd_workspace_bytes_sm90(BwdParams const& params);
template <class Config>
TileInfo bwd_tiles_sm90();
template <class Config>
int64_t run_bwd_sm80(BwdParams const& params, cudaStream_t stream);
template <class Config>
size_t bwd_workspace_bytes_sm80(BwdParams const& params);
template <class Config>
TileInfo bwd_tiles_sm80();

// FP8 quantization pass (cpp/quantize_fp8.cu; built with the sm90 family). Returns the CTAs launched.
int64_t launch_quantize_fp8(QuantParams const& params, cudaStream_t stream);

// KV-cache append (cpp/kvcache_append.cu; built with the sm90 family). Returns the CTAs launched.
int64_t launch_kvcache_append(KVAppendParams const& params, cudaStream_t stream);

}  // namespace flashhopper
