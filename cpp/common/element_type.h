// The CUTLASS element type of each DType the kernels take.
#pragma once

#include <cutlass/numeric_types.h>

#include "params.h"

namespace flashhopper {

template <DType kDType>
struct ElementOf;
template <>
struct ElementOf<DType::kFloat16> {
  using type = cutlass::half_t;
};
template <>
struct ElementOf<DType::kBFloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct ElementOf<DType::kFloat8E4M3> {
  using type = cutlass::float_e4m3_t;
};

}  // namespace flashhopper
