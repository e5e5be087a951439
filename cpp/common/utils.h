// Small device helpers shared by the sm80 and sm90 paths: layout views of MMA accumulators,
// quad reductions, fast exp2 and register-fragment type conversion.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace flashhopper {

using namespace cute;

// View an MMA accumulator as (row, col) so that softmax and masking can walk rows.
//   sm80 mma.sync m16n8:  ((2,2),MMA_M,MMA_N)    -> ((2,MMA_M),(2,MMA_N))
//   sm90 wgmma 64xN:      ((2,2,V),MMA_M,MMA_N)  -> ((2,MMA_M),(2,V,MMA_N))
// In both, the first value mode holds 2 adjacent columns and the second the row and row+8.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_layout_rowcol(Layout const& acc) {
  static_assert(decltype(rank(acc))::value == 3);
  if constexpr (decltype(rank<0>(acc))::value == 3) {
    return make_layout(make_layout(layout<0, 1>(acc), layout<1>(acc)),
                       make_layout(layout<0, 0>(acc), layout<0, 2>(acc), layout<2>(acc)));
  } else {
    static_assert(decltype(rank<0>(acc))::value == 2);
    return make_layout(make_layout(layout<0, 1>(acc), layout<1>(acc)),
                       make_layout(layout<0, 0>(acc), layout<2>(acc)));
  }
}

template <class Tensor>
CUTE_DEVICE auto rowcol(Tensor&& t) {
  return make_tensor(t.data(), acc_layout_rowcol(t.layout()));
}

// Reinterpret a 16-bit accumulator-shaped fragment (P after conversion) as the A operand of the
// next MMA, whose k extent is 16 columns: two 8-column chunks of the accumulator.
//   sm90: ((2,2,V),MMA_M,1) -> ((2,2,2),MMA_M,V/2)
//   sm80: ((2,2),MMA_M,MMA_N) -> ((2,2,2),MMA_M,MMA_N/2)
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_layout_as_a_operand(Layout const& acc) {
  if constexpr (decltype(rank<0>(acc))::value == 3) {
    static_assert(decltype(size<2>(acc))::value == 1);
    auto v = logical_divide(layout<0, 2>(acc), Int<2>{});  // (2, V/2)
    return make_layout(make_layout(layout<0, 0>(acc), layout<0, 1>(acc), layout<0>(v)),
                       layout<1>(acc), layout<1>(v));
  } else {
    auto n = logical_divide(layout<2>(acc), Int<2>{});  // (2, MMA_N/2)
    return make_layout(make_layout(layout<0>(acc), layout<0>(n)), layout<1>(acc), layout<1>(n));
  }
}

// Reductions over the 4 threads of a quad, which together own one accumulator row.
template <class Op>
CUTE_DEVICE float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffff, x, 2));
  x = op(x, __shfl_xor_sync(0xffffffff, x, 1));
  return x;
}

struct MaxOp {
  CUTE_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  CUTE_DEVICE float operator()(float a, float b) const { return a + b; }
};

// One MUFU.EX2; the caller folds scale and max into one FFMA before it.
CUTE_DEVICE float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One MUFU.TANH (max relative error about 2^-11; sm_75 and newer).
CUTE_DEVICE float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One MUFU.LG2 (subnormal inputs kept: a tiny probability must not read as log 0).
CUTE_DEVICE float log2_approx(float x) {
  float y;
  asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Convert a register fragment elementwise (vectorized: F2FP packs two at a time).
template <class To, class Engine, class Layout>
CUTE_DEVICE auto convert_type(Tensor<Engine, Layout> const& t) {
  using From = typename Engine::value_type;
  constexpr int N = decltype(size(t))::value;
  cutlass::NumericArrayConverter<To, From, N> convert;
  Tensor out = make_tensor<To>(t.layout());
  *reinterpret_cast<cutlass::Array<To, N>*>(out.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, N> const*>(t.data()));
  return out;
}

template <class Engine, class Layout>
CUTE_DEVICE void fill_value(Tensor<Engine, Layout>& t, typename Engine::value_type v) {
  CUTE_UNROLL
  for (int i = 0; i < size(t); ++i) t(i) = v;
}

}  // namespace flashhopper
