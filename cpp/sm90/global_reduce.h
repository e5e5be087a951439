// Float32 reductions into global memory. From WGMMA accumulator fragments: fire-and-forget `red`
// instructions (an unused atomicAdd result still compiles to ATOMG, which waits for L2's answer:
// `red` measured 1.4x faster), used by the GQA dK/dV epilogue, once per CTA, and for the
// head-dim-256 dQ (mainloop_bwd.h). No "memory" clobber: nothing in the issuing thread reads these
// addresses; code that must order them (the deterministic semaphores) uses __threadfence() and a
// barrier after them. From shared memory: the bulk reduce-add of the staged dQ (bulk_reduce_add).
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

namespace flashhopper::sm90 {

using namespace cute;

CUTE_DEVICE void red_add(float* p, float v) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v));
}

CUTE_DEVICE void red_add_v4(float* p, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d));
}

// One bulk asynchronous reduce-add of `bytes` contiguous float32 values from shared to global memory
// (both 16-byte aligned, bytes a multiple of 16), committed with the caller's bulk group
// (tma_store_arrive / tma_store_wait). CuTe has the tensor-map form only (SM90_TMA_REDUCE_ADD); this
// one needs no tensor map, for sums laid out in fragment order (common/dq_frag_layout.h).
CUTE_DEVICE void bulk_reduce_add(float* gmem, float const* smem, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem),
               "r"(cast_smem_ptr_to_uint(smem)), "r"(bytes)
               : "memory");
}

// acc: one thread's WGMMA accumulator ((2,2,V), MMA_M, MMA_N) - flat elements i, i+1 are two
// adjacent columns and i+4, i+5 the same columns 8 further on; coords: its (row, col) in the tile.
// Lanes 2k and 2k+1 of a quad swap one pair each so that every lane holds 4 consecutive columns,
// then each adds them with one 16-byte reduction to addr(row, col) for rows below row_limit.
template <class Frag, class Coords, class Addr>
CUTE_DEVICE void red_add_rows_v4(Frag const& acc, Coords const& coords, int row_limit, Addr&& addr) {
  static_assert(decltype(rank<0>(acc.layout()))::value == 3 && decltype(size<0, 2>(acc.layout()))::value % 2 == 0,
                "expects a WGMMA accumulator with an even number of 8-column groups");
  bool const odd = threadIdx.x % 2 == 1;  // lane % 4 is 2k or 2k+1
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    if (i % 2 != 0 || (i / 4) % 2 != 0) continue;  // first column pair of an even 8-column group
    float const a0 = acc(i), a1 = acc(i + 1), b0 = acc(i + 4), b1 = acc(i + 5);
    // The even lane keeps group g (its columns c..c+1, then the odd lane's c+2..c+3); the odd
    // lane keeps group g+1 (the even lane's columns, then its own).
    float const r0 = __shfl_xor_sync(0xffffffff, odd ? a0 : b0, 1);
    float const r1 = __shfl_xor_sync(0xffffffff, odd ? a1 : b1, 1);
    int const row = int(get<0>(coords(i)));
    if (row < row_limit) {
      if (odd) {
        red_add_v4(addr(row, int(get<1>(coords(i + 4))) - 2), r0, r1, b0, b1);
      } else {
        red_add_v4(addr(row, int(get<1>(coords(i)))), a0, a1, r0, r1);
      }
    }
  }
}

}  // namespace flashhopper::sm90
