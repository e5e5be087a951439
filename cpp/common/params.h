// Parameters shared by every attention kernel family (sm90, sm80) and the bindings.
// Plain data only: the extension takes raw device pointers and strides from Python, so it
// never links libtorch.
#pragma once

#include <cstdint>

namespace flashhopper {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat8E4M3 = 2 };

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  return "unknown";
}

// Forward attention on the flash-attn layout (batch, seqlen, nheads, headdim), last dim contiguous.
// Strides are in elements. LSE is float32, contiguous (batch, nheads_q, seqlen_q), natural log.
struct FwdParams {
  const void* q_ptr = nullptr;
  const void* k_ptr = nullptr;
  const void* v_ptr = nullptr;
  void* o_ptr = nullptr;
  float* lse_ptr = nullptr;

  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  int batch = 0, seqlen_q = 0, seqlen_k = 0, nheads_q = 0, nheads_kv = 0, headdim = 0;
  float softmax_scale = 1.f;
  bool causal = false;
  DType dtype = DType::kBFloat16;

  // FP8 (dtype kFloat8E4M3) only; docs/fp8.md. O is bfloat16. V comes transposed (V^T: head-dim rows
  // v_dim_stride apart, keys contiguous and permuted within groups of 16, zero-padded to a multiple of
  // 16). Descales x ~ x_fp8 * scale, one per (batch, head, block of *_scale_block tokens); K and V are
  // indexed by kv head; a zero stride broadcasts (per-head or per-tensor scales).
  int64_t v_dim_stride = 0;
  const float* q_scale_ptr = nullptr;
  const float* k_scale_ptr = nullptr;
  const float* v_scale_ptr = nullptr;
  int64_t q_scale_batch_stride = 0, q_scale_head_stride = 0, q_scale_block_stride = 0;
  int64_t k_scale_batch_stride = 0, k_scale_head_stride = 0, k_scale_block_stride = 0;
  int64_t v_scale_batch_stride = 0, v_scale_head_stride = 0, v_scale_block_stride = 0;
  int q_scale_block = 1 << 30, k_scale_block = 1 << 30, v_scale_block = 1 << 30;

  // Causal kernels take tiles from this int32 counter: zero before the first launch, and every
  // launch leaves it at zero again. One per stream (kernels on two streams must not share it).
  int* tile_counter = nullptr;
  int device = 0;   // CUDA device ordinal the pointers live on
  int num_sms = 0;  // multiprocessors for a persistent grid; 0 lets the launcher query the device
  // sm80 kernels: pick the tiles as on a device with this much shared memory per block (bytes);
  // 0 = this device's limit. Tests run the 99 KB tiles of sm_86/sm_89 on larger GPUs with it.
  int max_smem_bytes = 0;
};

// Backward attention: gradients of the forward above with respect to q, k and v, given dO and the
// forward's O and LSE. Same layouts as the forward; dq/dk/dv like q/k/v (any 16-byte-aligned strides,
// last dim contiguous). With GQA, dk/dv hold the sums over each kv head's group of query heads.
// The launcher needs `workspace`: bwd_workspace_bytes(...) bytes of device memory, any contents, 256-byte
// aligned, not shared with a concurrent launch (it holds the fp32 dQ accumulator and the per-row
// statistics the preprocess kernel writes).
struct BwdParams {
  const void* q_ptr = nullptr;
  const void* k_ptr = nullptr;
  const void* v_ptr = nullptr;
  const void* o_ptr = nullptr;
  const void* do_ptr = nullptr;
  const float* lse_ptr = nullptr;   // the forward's LSE: (batch, nheads_q, seqlen_q) contiguous, natural log
  const float* dlse_ptr = nullptr;  // optional gradient of the loss w.r.t. LSE, same layout; nullptr = zero
  void* dq_ptr = nullptr;
  void* dk_ptr = nullptr;
  void* dv_ptr = nullptr;
  void* workspace = nullptr;

  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;

  int batch = 0, seqlen_q = 0, seqlen_k = 0, nheads_q = 0, nheads_kv = 0, headdim = 0;
  float softmax_scale = 1.f;
  bool causal = false;
  // Bitwise-identical gradients from run to run: the fp32 accumulations across CTAs (dQ, and dK/dV
  // under GQA) happen in a fixed order, enforced by semaphores in the workspace.
  bool deterministic = false;
  DType dtype = DType::kBFloat16;
  int device = 0;
  int num_sms = 0;
  // sm80 family: the shared memory a CTA may use, which picks its tiles; 0 = the device's opt-in
  // limit. Tests set 99 KB to run the sm_86/sm_89 tiles on a bigger GPU.
  int max_smem_bytes = 0;
};

// One pass of FP8 quantization (docs/fp8.md): x (batch, seqlen, nheads, headdim) in fp16/bf16 to e4m3
// plus one float32 descale per (batch, head, block of block_size tokens), optionally after the
// random-sign Hadamard transform of each row (signs_ptr), optionally written as V^T (transpose).
struct QuantParams {
  const void* x_ptr = nullptr;
  void* out_ptr = nullptr;
  float* scale_ptr = nullptr;
  const float* signs_ptr = nullptr;  // headdim x (+1/-1); nullptr: no Hadamard transform
  int64_t x_batch_stride = 0, x_row_stride = 0, x_head_stride = 0;
  // transpose: out is (batch, nheads, headdim, round_up(seqlen, 16)) and out_row_stride is unused.
  int64_t out_batch_stride = 0, out_row_stride = 0, out_head_stride = 0, out_dim_stride = 0;
  int64_t scale_batch_stride = 0, scale_head_stride = 0, scale_block_stride = 0;
  int batch = 0, seqlen = 0, nheads = 0, headdim = 0, block_size = 128;
  bool transpose = false;
  DType dtype = DType::kBFloat16;  // of x
  int device = 0;
};

}  // namespace flashhopper
