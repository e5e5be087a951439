// The e4m3 cache converter's shared addresses (cpp/sm90/mainloop_fwd.h FwdMainloop::convert), checked on the host
// against the CuTe layouts for every e4m3 tile: each lane keeps its ldmatrix / stmatrix row addresses at key group 0
// and dim group 0 and derives the rest by XOR and strides. Exits non-zero on a mismatch.
//   nvcc -std=c++17 --expt-relaxed-constexpr -I$CUTLASS_INCLUDE scripts/check_vt_addr.cu -o /tmp/c && /tmp/c
#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cstdio>
using namespace cute;
template <int D, int BN, int S>
int check() {
  using E = cutlass::float_e4m3_t;
  using A8 = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, E, Int<BN>, Int<D>>());
  using L8 = decltype(tile_to_shape(A8{}, Shape<Int<BN>, Int<D>, Int<S>>{}));
  using At = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, E, Int<D>, Int<BN>>());
  using Lt = decltype(tile_to_shape(At{}, Shape<Int<D>, Int<BN>, Int<S>>{}));
  L8 l8; Lt lt; int bad = 0;
  constexpr int kPanel = size<1>(A8{});  // bytes per row of the e4m3 stage's atom
  constexpr int kPanelStride = BN * kPanel;
  int in16 = l8(16 % BN, 0, 0) - l8(0, 0, 0), out32 = lt(32 % D, 0, 0) - lt(0, 0, 0);
  for (int base = 0; base < 4096; base += 1024)  // buffer bases 1024-aligned
  for (int lane = 0; lane < 32; ++lane) {
    int key = lane % 8 + 8 * ((lane / 8) % 2), col = 16 * (lane / 16), row = col + 2 * (lane % 8) + (lane / 8) % 2;
    int src0 = base + l8(key, col, 0), dst0 = base + lt(row, 0, 0);
    for (int st = 0; st < S; ++st)
      for (int g = 0; g < BN / 16; ++g)
        for (int c = 0; c < D / 32; ++c) {
          int s = (src0 ^ ((32 * c) % kPanel)) + (32 * c / kPanel) * kPanelStride + g * in16 + st * BN * D;
          for (int b = 0; b < 16; ++b) bad += base + l8(16 * g + key, 32 * c + col + b, st) != s + b;
          int t = (dst0 ^ (16 * g)) + c * out32 + st * BN * D;
          for (int b = 0; b < 16; ++b) bad += base + lt(32 * c + row, 16 * g + b, st) != t + b;
        }
  }
  printf("D=%d BN=%d S=%d panel=%d atomT=%d in16=%d out32=%d bad=%d\n", D, BN, S, kPanel, int(size<1>(At{})), in16, out32, bad);
  return bad;
}
int main() { return check<64, 128, 4>() + check<128, 128, 4>() + check<256, 64, 3>() + check<128, 64, 2>() + check<64, 64, 2>(); }
