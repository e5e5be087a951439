// Named variants of the Hopper kernels: ablations worth keeping, as policy types that override a
// tile table. The generator instantiates one when a build asks for it by name (FLASHHOPPER_VARIANTS;
// cpp/generate_kernels.py: VARIANTS), registered under its own KernelKey (variant = its name), so a
// build reports it and it never replaces a production kernel. bench/ times a variant as the provider
// "flashhopper@<name>" next to the production kernel, in one process.
#pragma once

#include "../common/kernel_key.h"
#include "tile_size.h"

namespace flashhopper::sm90 {

// The forward tiles of a variant: the production table unless the variant overrides it.
template <class Variant, int kHeadDim, DType kDType, int kHeadDimV = kHeadDim>
struct FwdTileOf {
  using type = FwdTileSize<kHeadDim, kDType, kHeadDimV>;
};
template <class Variant, int kHeadDim, int kHeadDimV = kHeadDim>
struct BwdTileOf {
  using type = BwdTileSize<kHeadDim, kHeadDimV>;
};

namespace variant {

// The consumer warpgroups issue their GEMMs without taking turns (the FA3 paper's ablation).
struct NoPingPong {
  static constexpr char const* kName = "no-pingpong";
  template <class Base>
  struct Tile : Base {
    static constexpr bool kPingPong = false;
  };
};

}  // namespace variant

template <int kHeadDim, DType kDType, int kHeadDimV>
struct FwdTileOf<variant::NoPingPong, kHeadDim, kDType, kHeadDimV> {
  using type = variant::NoPingPong::Tile<FwdTileSize<kHeadDim, kDType, kHeadDimV>>;
};

}  // namespace flashhopper::sm90
