// Parameters shared by every attention kernel family (sm90, sm80) and the bindings.
// Plain data only: the extension takes raw device pointers and strides from Python, so it never
// links libtorch. Each struct is declared from one field list, X(type, name, default): the bindings
// expose every field from the same list (cpp/bindings.cpp), so a new field is one line here.
// Which kernel runs is the KernelKey's business (kernel_key.h), not the params'.
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
// window_left / window_right: kernels with MaskKind::kWindow see keys j of row i with
// i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right; -1 = unbounded.
// softcap > 0: scores become softcap * tanh(scores * softmax_scale / softcap) before the softmax (16-bit
// kernels; common/score_mod.h). sinks_ptr: float32 (nheads_q,) sink logits that join each row's softmax
// denominator without a value (the LSE includes them; nullptr = none).
// FP8 (e4m3 kernels) only, docs/fp8.md: O is bfloat16; V comes transposed (V^T: head-dim rows
// v_dim_stride apart, keys contiguous and permuted within groups of 16, zero-padded to a multiple of
// 16); descales x ~ x_fp8 * scale, one per (batch, head, block of *_scale_block tokens), K and V
// indexed by kv head, a zero stride broadcasting (per-head or per-tensor scales).
// tile_counter: kernels whose mask has a right edge (causal, window) take tiles from this int32
// counter: zero before the first launch, and every launch leaves it at zero again. One per stream (kernels on two streams must not share it).
// dropout_threshold (kernels with dropout, common/dropout.h): scores whose random byte is below it are
// dropped (round(dropout_p * 256); 0 = none), the kept ones scaled by 256 / (256 - threshold);
// dropout_rng: device int64 (seed, offset) of the draws (python/flashhopper/dropout.py defines them).
// Packed batches (kernels with KernelKey.varlen, common/seqlen.h): Q/O are (total_q, nheads, headdim) and
// K/V (total_k, ...), batch strides unused; entry b has rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) (int32,
// batch + 1 on the device), of which seqused_q[b] are used when seqused_q is given (likewise for k);
// seqlen_q / seqlen_k are the entries' maxima; LSE is (nheads_q, total_q); varlen_workspace:
// VarlenWorkspace::bytes(batch) bytes of device memory (common/varlen_workspace.h), 256-byte aligned,
// any contents, not shared with a concurrent launch.
// KV-cache kernels (KernelKey.kvcache, sm90/kv_blocks.h): K/V are a cache of pages, (num_pages, page_size,
// nheads_kv, headdim) with k/v_batch_stride the page stride; key j of entry b lives in page
// page_table[b * page_table_batch_stride + j / page_size] (int32 on the device; nullptr: page b), row j % page_size.
// A contiguous cache (batch_cache, max_seqlen, ...) is one page of max_seqlen rows per entry, page_table its
// cache_batch_idx (stride 1) or nullptr; a paged one needs page_size % 16 == 0 (the loads copy 16-row chunks).
// Entry b has cache_seqlens[b] keys (int32 (batch,) on the device; nullptr: seqlen_k each), seqlen_k >= all of
// them; cache rows at or past an entry's length are never weighted, whatever they hold (NaN included). Q, O and
// LSE as in the padded forward. num_splits > 1 (split-KV): each entry's key blocks are cut into num_splits ranges
// run by different CTAs, partial O and LSE go to split_workspace (kvcache_split_workspace_bytes: float32
// (num_splits, batch, nheads_q, seqlen_q, headdim_v + 1), 256-byte aligned, any contents, not shared with a
// concurrent launch) and a combine kernel on the same stream writes O and LSE. rows_per_query g > 1 (GQA packing):
// the kernel's seqlen_q rows are (query, head) pairs, rows s g .. s g + g - 1 query s's (the causal rule divides).
// num_sms: multiprocessors for a persistent grid (0: the launcher asks the device). max_smem_bytes:
// sm80 kernels pick their tiles as on a device with this much shared memory per block (0: this
// device's limit); tests run the 99 KB tiles of sm_86/sm_89 on larger GPUs with it.
#define FLASHHOPPER_FWD_PARAMS(X)                                                                       \
  X(const void*, q_ptr, nullptr) X(const void*, k_ptr, nullptr) X(const void*, v_ptr, nullptr)           \
  X(void*, o_ptr, nullptr) X(float*, lse_ptr, nullptr)                                                   \
  X(int64_t, q_batch_stride, 0) X(int64_t, q_row_stride, 0) X(int64_t, q_head_stride, 0)                 \
  X(int64_t, k_batch_stride, 0) X(int64_t, k_row_stride, 0) X(int64_t, k_head_stride, 0)                 \
  X(int64_t, v_batch_stride, 0) X(int64_t, v_row_stride, 0) X(int64_t, v_head_stride, 0)                 \
  X(int64_t, o_batch_stride, 0) X(int64_t, o_row_stride, 0) X(int64_t, o_head_stride, 0)                 \
  X(int, batch, 0) X(int, seqlen_q, 0) X(int, seqlen_k, 0) X(int, nheads_q, 0) X(int, nheads_kv, 0)     \
  X(int, headdim, 0) X(int, headdim_v, 0) X(float, softmax_scale, 1.f)                                   \
  X(int, window_left, -1) X(int, window_right, -1)                                                       \
  X(float, softcap, 0.f) X(const float*, sinks_ptr, nullptr)                                             \
  X(const int64_t*, dropout_rng, nullptr) X(int, dropout_threshold, 0)                                   \
  X(int64_t, v_dim_stride, 0)                                                                            \
  X(const float*, q_scale_ptr, nullptr) X(const float*, k_scale_ptr, nullptr)                            \
  X(const float*, v_scale_ptr, nullptr)                                                                  \
  X(int64_t, q_scale_batch_stride, 0) X(int64_t, q_scale_head_stride, 0) X(int64_t, q_scale_block_stride, 0) \
  X(int64_t, k_scale_batch_stride, 0) X(int64_t, k_scale_head_stride, 0) X(int64_t, k_scale_block_stride, 0) \
  X(int64_t, v_scale_batch_stride, 0) X(int64_t, v_scale_head_stride, 0) X(int64_t, v_scale_block_stride, 0) \
  X(int, q_scale_block, 1 << 30) X(int, k_scale_block, 1 << 30) X(int, v_scale_block, 1 << 30)          \
  X(const int*, cu_seqlens_q, nullptr) X(const int*, cu_seqlens_k, nullptr)                              \
  X(const int*, seqused_q, nullptr) X(const int*, seqused_k, nullptr)                                    \
  X(int, total_q, 0) X(int, total_k, 0) X(void*, varlen_workspace, nullptr)                              \
  X(int*, tile_counter, nullptr) X(int, device, 0) X(int, num_sms, 0) X(int, max_smem_bytes, 0)            \
  X(const int*, page_table, nullptr) X(int64_t, page_table_batch_stride, 0) X(int, page_size, 0)        \
  X(int, num_pages, 0) X(const int*, cache_seqlens, nullptr) X(int, num_splits, 1)                       \
  X(void*, split_workspace, nullptr) X(int, rows_per_query, 1)

// Backward attention: gradients of the forward above with respect to q, k and v, given dO and the
// forward's O and LSE (lse_ptr: (batch, nheads_q, seqlen_q) contiguous, natural log; dlse_ptr: the
// optional gradient w.r.t. LSE, same layout, nullptr = zero). dq/dk/dv like q/k/v (any 16-byte-aligned
// strides, last dim contiguous); with GQA, dk/dv hold the sums over each kv head's group of query heads.
// The launcher needs `workspace`: bwd_workspace_bytes(...) bytes of device memory, any contents,
// 256-byte aligned, not shared with a concurrent launch (the fp32 dQ accumulator, the per-row
// statistics of the preprocess kernel). deterministic: bitwise-identical gradients from run to run,
// the fp32 accumulations across CTAs (dQ, and dK/dV under GQA) in a fixed order, enforced by
// semaphores in the workspace. window_*, softcap, dropout_*, num_sms, max_smem_bytes as in the forward (lse already
// holds the sinks, so the main kernel needs no sinks_ptr). With sinks_ptr, the preprocess also writes
// dsinks_rows_ptr (float32, (batch, nheads_q, seqlen_q) contiguous): each row's share of the sinks'
// gradient, -exp(sink - lse) * (rowsum(dO * O) - dLSE), which the caller sums over batch and rows.
// Packed batches (kernels with KernelKey.varlen): cu_seqlens_*, seqused_*, total_* and the layouts as in the
// forward (lse, dlse and dsinks_rows (nheads_q, total_q)); dQ, dK, dV rows of no entry are left unwritten
// (under GQA, dK and dV rows of no entry are written 0); the tensor maps' workspace is part of `workspace`.
#define FLASHHOPPER_BWD_PARAMS(X)                                                                       \
  X(const void*, q_ptr, nullptr) X(const void*, k_ptr, nullptr) X(const void*, v_ptr, nullptr)           \
  X(const void*, o_ptr, nullptr) X(const void*, do_ptr, nullptr)                                         \
  X(const float*, lse_ptr, nullptr) X(const float*, dlse_ptr, nullptr)                                   \
  X(void*, dq_ptr, nullptr) X(void*, dk_ptr, nullptr) X(void*, dv_ptr, nullptr) X(void*, workspace, nullptr) \
  X(int64_t, q_batch_stride, 0) X(int64_t, q_row_stride, 0) X(int64_t, q_head_stride, 0)                 \
  X(int64_t, k_batch_stride, 0) X(int64_t, k_row_stride, 0) X(int64_t, k_head_stride, 0)                 \
  X(int64_t, v_batch_stride, 0) X(int64_t, v_row_stride, 0) X(int64_t, v_head_stride, 0)                 \
  X(int64_t, o_batch_stride, 0) X(int64_t, o_row_stride, 0) X(int64_t, o_head_stride, 0)                 \
  X(int64_t, do_batch_stride, 0) X(int64_t, do_row_stride, 0) X(int64_t, do_head_stride, 0)              \
  X(int64_t, dq_batch_stride, 0) X(int64_t, dq_row_stride, 0) X(int64_t, dq_head_stride, 0)              \
  X(int64_t, dk_batch_stride, 0) X(int64_t, dk_row_stride, 0) X(int64_t, dk_head_stride, 0)              \
  X(int64_t, dv_batch_stride, 0) X(int64_t, dv_row_stride, 0) X(int64_t, dv_head_stride, 0)              \
  X(int, batch, 0) X(int, seqlen_q, 0) X(int, seqlen_k, 0) X(int, nheads_q, 0) X(int, nheads_kv, 0)     \
  X(int, headdim, 0) X(int, headdim_v, 0) X(float, softmax_scale, 1.f)                                   \
  X(int, window_left, -1) X(int, window_right, -1) X(bool, deterministic, false)                         \
  X(float, softcap, 0.f) X(const float*, sinks_ptr, nullptr) X(float*, dsinks_rows_ptr, nullptr)         \
  X(const int64_t*, dropout_rng, nullptr) X(int, dropout_threshold, 0)                                   \
  X(const int*, cu_seqlens_q, nullptr) X(const int*, cu_seqlens_k, nullptr)                              \
  X(const int*, seqused_q, nullptr) X(const int*, seqused_k, nullptr) X(int, total_q, 0) X(int, total_k, 0) \
  X(int, device, 0) X(int, num_sms, 0) X(int, max_smem_bytes, 0)

// One pass of FP8 quantization (docs/fp8.md): x (batch, seqlen, nheads, headdim) in fp16/bf16 (dtype)
// to e4m3 plus one float32 descale per (batch, head, block of block_size tokens), optionally after the
// random-sign Hadamard transform of each row (hadamard; the signs are a hash of hadamard_seed,
// hadamard_signs.h), optionally written as V^T (transpose: out is (batch, nheads, headdim,
// round_up(seqlen, 16)) and out_row_stride is unused).
// Packed batches (cu_seqlens: int32 (batch + 1) on the device): x is (total = seqlen rows, nheads, headdim),
// batch strides unused, and each sequence is quantized in blocks of its own: sequence b's block j is block
// cu_seqlens[b] / block_size + b + j of the scales (nheads, total / block_size + batch) and, transposed, of
// V^T's keys (nheads, headdim, (total / block_size + batch) * block_size); blocks of no sequence get scale 1
// and zero keys (docs/fp8.md).
#define FLASHHOPPER_QUANT_PARAMS(X)                                                                     \
  X(const void*, x_ptr, nullptr) X(void*, out_ptr, nullptr) X(float*, scale_ptr, nullptr)                \
  X(bool, hadamard, false) X(int64_t, hadamard_seed, 0)                                                  \
  X(int64_t, x_batch_stride, 0) X(int64_t, x_row_stride, 0) X(int64_t, x_head_stride, 0)                 \
  X(int64_t, out_batch_stride, 0) X(int64_t, out_row_stride, 0) X(int64_t, out_head_stride, 0)           \
  X(int64_t, out_dim_stride, 0)                                                                          \
  X(int64_t, scale_batch_stride, 0) X(int64_t, scale_head_stride, 0) X(int64_t, scale_block_stride, 0)   \
  X(int, batch, 0) X(int, seqlen, 0) X(int, nheads, 0) X(int, headdim, 0) X(int, block_size, 128)       \
  X(bool, transpose, false) X(DType, dtype, DType::kBFloat16) X(const int*, cu_seqlens, nullptr)             \
  X(int, device, 0)

#define FLASHHOPPER_PARAM_MEMBER(type, name, init) type name = init;
struct FwdParams {
  FLASHHOPPER_FWD_PARAMS(FLASHHOPPER_PARAM_MEMBER)
};
struct BwdParams {
  FLASHHOPPER_BWD_PARAMS(FLASHHOPPER_PARAM_MEMBER)
};
struct QuantParams {
  FLASHHOPPER_QUANT_PARAMS(FLASHHOPPER_PARAM_MEMBER)
};
#undef FLASHHOPPER_PARAM_MEMBER

}  // namespace flashhopper
