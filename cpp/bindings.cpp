// pybind11 module flashhopper._C. It takes raw device pointers, strides and a stream handle as
// plain integers: Python owns tensors, allocation, validation and the choice of kernel, which it
// makes among the entries of kernels() by their KernelKey (python/flashhopper/kernel_key.py) and names
// by the entry's index. Every params field is exposed from its struct's field list (common/params.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <array>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/block_info.h"
#include "common/varlen_workspace.h"
#include "registry.h"

namespace py = pybind11;
using namespace flashhopper;

namespace {

void check_cuda(cudaError_t err, char const* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flashhopper: ") + what + ": " + cudaGetErrorString(err));
  }
}

// Launch on the tensors' device and leave the caller's current device as it was.
template <class Fn>
auto on_device(int device, char const* what, Fn&& launch) {
  int current = -1;
  check_cuda(cudaGetDevice(&current), "cudaGetDevice");
  if (current != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  struct Restore {
    int device;
    bool needed;
    ~Restore() {
      if (needed) cudaSetDevice(device);
    }
  } restore{current, current != device};
  auto const ctas = launch();
  check_cuda(cudaGetLastError(), what);
  return ctas;
}

template <class Entry>
Entry const& entry(std::vector<Entry> const& table, int index, char const* what) {
  if (index < 0 || index >= int(table.size())) {
    throw std::invalid_argument(std::string("flashhopper: no ") + what + " kernel with index " + std::to_string(index));
  }
  return table[size_t(index)];
}

// Pointers cross as integers (Python passes tensor.data_ptr()); everything else as itself.
template <class P, class T>
void bind_field(py::class_<P>& c, char const* name, T P::*member) {
  if constexpr (std::is_pointer_v<T>) {
    c.def_property(
        name, [member](P const& p) { return reinterpret_cast<uintptr_t>(p.*member); },
        [member](P& p, uintptr_t v) { p.*member = reinterpret_cast<T>(v); });
  } else {
    c.def_readwrite(name, member);
  }
}

// A pointer argument as the field's type (Python passes tensor.data_ptr(), 0 for none).
template <class T>
void set_ptr(T& field, uintptr_t v) {
  field = reinterpret_cast<T>(v);
}

#define FLASHHOPPER_BIND(type, name, init) bind_field(cls, #name, &Struct::name);
template <class Struct>
void bind_fwd_params(py::class_<Struct>& cls) { FLASHHOPPER_FWD_PARAMS(FLASHHOPPER_BIND) }
template <class Struct>
void bind_bwd_params(py::class_<Struct>& cls) { FLASHHOPPER_BWD_PARAMS(FLASHHOPPER_BIND) }
template <class Struct>
void bind_quant_params(py::class_<Struct>& cls) { FLASHHOPPER_QUANT_PARAMS(FLASHHOPPER_BIND) }
#undef FLASHHOPPER_BIND

// A key field as Python sees it: enums by name, the rest as themselves.
py::object key_value(DType d) { return py::str(dtype_name(d)); }
py::object key_value(MaskKind m) { return py::str(mask_name(m)); }
py::object key_value(ScoreModKind s) { return py::str(score_mod_name(s)); }
py::object key_value(KVCacheKind k) { return py::str(kvcache_name(k)); }
template <class T>
py::object key_value(T const& v) {
  return py::cast(v);
}

template <class Entry>
py::dict describe(Entry const& e, char const* mode, int index) {
  py::dict d;
  d["mode"] = mode;
  d["index"] = index;
#define FLASHHOPPER_KEY_ITEM(type, name) d[#name] = key_value(e.key.name);
  FLASHHOPPER_KERNEL_KEY_FIELDS(FLASHHOPPER_KEY_ITEM)
#undef FLASHHOPPER_KEY_ITEM
  d["block_m"] = e.tiles.block_m;
  d["block_n"] = e.tiles.block_n;
  d["block_n_short"] = e.tiles.block_n_short;
  d["short_keys_max"] = e.tiles.short_keys_max;
  return d;
}

py::list key_fields() {
  py::list out;
#define FLASHHOPPER_KEY_NAME(type, name) out.append(#name);
  FLASHHOPPER_KERNEL_KEY_FIELDS(FLASHHOPPER_KEY_NAME)
#undef FLASHHOPPER_KEY_NAME
  return out;
}

// The block ranges of block_info.h for every query block (forward) and key block (backward), for the
// tests that check them against a brute-force walk of the visibility rule.
// With num_splits > 1, also split-KV's share of each query block's range (SplitBlockInfo) for every split.
template <int kBlockM, int kBlockN, MaskKind kMask>
py::dict block_ranges_of(int seqlen_q, int seqlen_k, int window_left, int window_right, int num_splits) {
  SeqlenInfo const seq = UniformSeqlens{seqlen_q, seqlen_k}(0);
  BlockInfo<kBlockM, kBlockN, kMask> const bi{seq, window_left, window_right};
  py::list fwd, bwd, splits;
  for (int m = 0; m < bi.num_m_blocks(); ++m) {
    fwd.append(py::make_tuple(bi.n_block_min(m), bi.n_block_max(m), bi.n_block_right_masked_begin(m),
                              bi.n_block_left_masked_end(m), bi.num_n_blocks_of(m)));
    py::list of_m;
    for (int s = 0; s < num_splits; ++s) {
      SplitBlockInfo<BlockInfo<kBlockM, kBlockN, kMask>> const sbi{seq, window_left, window_right, m, s, num_splits};
      of_m.append(py::make_tuple(sbi.n_block_min(m), sbi.n_block_max(m)));
    }
    splits.append(of_m);
  }
  for (int n = 0; n < bi.num_n_blocks(); ++n) {
    bwd.append(py::make_tuple(bi.m_block_min(n), bi.m_block_max(n), bi.m_block_right_masked_end(n),
                              bi.m_block_left_masked_begin(n)));
  }
  py::dict d;
  d["fwd"] = fwd;
  d["bwd"] = bwd;
  d["splits"] = splits;
  return d;
}

template <MaskKind kMask>
py::dict block_ranges_mask(int block_m, int block_n, int sq, int sk, int wl, int wr, int splits) {
#define FLASHHOPPER_TILE(bm, bn) \
  if (block_m == bm && block_n == bn) return block_ranges_of<bm, bn, kMask>(sq, sk, wl, wr, splits);
  FLASHHOPPER_TILE(64, 64) FLASHHOPPER_TILE(64, 80) FLASHHOPPER_TILE(64, 128) FLASHHOPPER_TILE(128, 64)
  FLASHHOPPER_TILE(128, 80) FLASHHOPPER_TILE(128, 128) FLASHHOPPER_TILE(128, 192) FLASHHOPPER_TILE(192, 128)
#undef FLASHHOPPER_TILE
  throw std::invalid_argument("block_ranges: no instantiation for these block sizes");
}

py::dict block_ranges(int block_m, int block_n, std::string const& mask, int seqlen_q, int seqlen_k, int window_left,
                      int window_right, int num_splits) {
  if (num_splits < 1) throw std::invalid_argument("block_ranges: num_splits must be >= 1");
  int const sq = seqlen_q, sk = seqlen_k, wl = window_left, wr = window_right, ns = num_splits;
  if (mask == "none") return block_ranges_mask<MaskKind::kNone>(block_m, block_n, sq, sk, wl, wr, ns);
  if (mask == "causal") return block_ranges_mask<MaskKind::kCausal>(block_m, block_n, sq, sk, wl, wr, ns);
  if (mask == "window") return block_ranges_mask<MaskKind::kWindow>(block_m, block_n, sq, sk, wl, wr, ns);
  throw std::invalid_argument("block_ranges: mask must be none, causal or window");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "flashhopper CUDA kernels (raw-pointer interface; use the flashhopper package instead)";

  py::enum_<DType>(m, "DType")
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16)
      .value("float8_e4m3fn", DType::kFloat8E4M3);

  py::class_<FwdParams> fwd_params(m, "FwdParams");
  fwd_params.def(py::init<>());
  bind_fwd_params(fwd_params);
  py::class_<BwdParams> bwd_params(m, "BwdParams");
  bwd_params.def(py::init<>());
  bind_bwd_params(bwd_params);
  py::class_<QuantParams> quant_params(m, "QuantParams");
  quant_params.def(py::init<>());
  bind_quant_params(quant_params);

  m.def("fwd", [](FwdParams const& params, int index, uintptr_t stream) {
    FwdEntry const& e = entry(fwd_kernels(), index, "forward");
    return on_device(params.device, "forward kernel launch",
                     [&] { return e.launch(params, reinterpret_cast<cudaStream_t>(stream)); });
  }, py::arg("params"), py::arg("index"), py::arg("stream"),
        "Launch forward kernel `index` (an entry of kernels()) on `stream` (a cudaStream_t as int). "
        "Returns the CTAs launched (0: empty grid, nothing to compute).");
  // The eager calls' launch (python/flashhopper/_plans.py): params prepared once for a configuration, with
  // one call's tensors. Taken by value, so the prepared object, which threads share, is never written.
  m.def("fwd_with", [](FwdParams params, int index, uintptr_t stream, uintptr_t q, uintptr_t k, uintptr_t v,
                       uintptr_t o, uintptr_t lse, uintptr_t tile_counter, uintptr_t sinks, uintptr_t dropout_rng,
                       uintptr_t q_scale, uintptr_t k_scale, uintptr_t v_scale) {
    FwdEntry const& e = entry(fwd_kernels(), index, "forward");
    set_ptr(params.q_ptr, q), set_ptr(params.k_ptr, k), set_ptr(params.v_ptr, v), set_ptr(params.o_ptr, o);
    set_ptr(params.lse_ptr, lse), set_ptr(params.tile_counter, tile_counter), set_ptr(params.sinks_ptr, sinks);
    set_ptr(params.dropout_rng, dropout_rng);
    set_ptr(params.q_scale_ptr, q_scale), set_ptr(params.k_scale_ptr, k_scale), set_ptr(params.v_scale_ptr, v_scale);
    return on_device(params.device, "forward kernel launch",
                     [&] { return e.launch(params, reinterpret_cast<cudaStream_t>(stream)); });
  }, py::arg("params"), py::arg("index"), py::arg("stream"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
        py::arg("lse"), py::arg("tile_counter"), py::arg("sinks"), py::arg("dropout_rng"), py::arg("q_scale"), py::arg("k_scale"),
        py::arg("v_scale"),
        "fwd() with these pointers in place of params' (0: none); params itself is left as it was.");
  m.def("fwd_varlen_with", [](FwdParams params, int index, uintptr_t stream, uintptr_t q, uintptr_t k, uintptr_t v,
                              uintptr_t o, uintptr_t lse, uintptr_t tile_counter, uintptr_t sinks,
                              uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k, uintptr_t seqused_q,
                              uintptr_t seqused_k, uintptr_t varlen_workspace) {
    FwdEntry const& e = entry(fwd_kernels(), index, "forward");
    set_ptr(params.q_ptr, q), set_ptr(params.k_ptr, k), set_ptr(params.v_ptr, v), set_ptr(params.o_ptr, o);
    set_ptr(params.lse_ptr, lse), set_ptr(params.tile_counter, tile_counter), set_ptr(params.sinks_ptr, sinks);
    set_ptr(params.cu_seqlens_q, cu_seqlens_q), set_ptr(params.cu_seqlens_k, cu_seqlens_k);
    set_ptr(params.seqused_q, seqused_q), set_ptr(params.seqused_k, seqused_k);
    set_ptr(params.varlen_workspace, varlen_workspace);
    return on_device(params.device, "forward kernel launch",
                     [&] { return e.launch(params, reinterpret_cast<cudaStream_t>(stream)); });
  }, py::arg("params"), py::arg("index"), py::arg("stream"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
        py::arg("lse"), py::arg("tile_counter"), py::arg("sinks"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"),
        py::arg("seqused_q"), py::arg("seqused_k"), py::arg("varlen_workspace"),
        "A packed-batch kernel's fwd() with these pointers in place of params' (0: none; varlen_workspace: "
        "varlen_workspace_bytes(batch) bytes on Hopper); params itself is left as it was.");
  m.def("fwd_kvcache_with", [](FwdParams params, int index, uintptr_t stream, uintptr_t q, uintptr_t k, uintptr_t v,
                               uintptr_t o, uintptr_t lse, uintptr_t page_table, uintptr_t cache_seqlens,
                               uintptr_t split_workspace, uintptr_t k_scale, uintptr_t v_scale, uintptr_t sinks) {
    FwdEntry const& e = entry(fwd_kernels(), index, "forward");
    set_ptr(params.q_ptr, q), set_ptr(params.k_ptr, k), set_ptr(params.v_ptr, v), set_ptr(params.o_ptr, o);
    set_ptr(params.lse_ptr, lse), set_ptr(params.page_table, page_table), set_ptr(params.cache_seqlens, cache_seqlens);
    set_ptr(params.split_workspace, split_workspace);
    if (k_scale != 0 || v_scale != 0) set_ptr(params.k_scale_ptr, k_scale), set_ptr(params.v_scale_ptr, v_scale);
    set_ptr(params.sinks_ptr, sinks);
    return on_device(params.device, "forward kernel launch",
                     [&] { return e.launch(params, reinterpret_cast<cudaStream_t>(stream)); });
  }, py::arg("params"), py::arg("index"), py::arg("stream"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
        py::arg("lse"), py::arg("page_table"), py::arg("cache_seqlens"), py::arg("split_workspace"),
        py::arg("k_scale") = 0, py::arg("v_scale") = 0, py::arg("sinks") = 0,
        "A KV-cache kernel's fwd() with these pointers in place of params' (0: none; k_scale / v_scale: an e4m3 "
        "cache's scales; sinks: float32 (nheads_q,) sink logits); params itself is left as it was.");
  m.def("bwd", [](BwdParams const& params, int index, uintptr_t stream) {
    BwdEntry const& e = entry(bwd_kernels(), index, "backward");
    if (params.workspace == nullptr) throw std::invalid_argument("flashhopper: the backward needs a workspace");
    return on_device(params.device, "backward kernel launch",
                     [&] { return e.launch(params, reinterpret_cast<cudaStream_t>(stream)); });
  }, py::arg("params"), py::arg("index"), py::arg("stream"),
        "Launch backward `index` (preprocess, main kernel, postprocess) on `stream`. Returns the main kernel's CTAs.");
  m.def("varlen_workspace_bytes", [](int batch) {
    if (batch < 0) throw std::invalid_argument("flashhopper: batch must be >= 0");
    return VarlenWorkspace::bytes(batch);
  }, py::arg("batch"),
        "Bytes of device workspace a packed-batch (varlen) forward of `batch` entries needs (FwdParams.varlen_workspace).");
  m.def("kvcache_split_workspace_bytes", [](int num_splits, int batch, int nheads, int seqlen_q, int headdim_v) {
    if (num_splits < 1 || batch < 0 || nheads < 0 || seqlen_q < 0 || headdim_v < 0) {
      throw std::invalid_argument("flashhopper: kvcache_split_workspace_bytes takes num_splits >= 1 and sizes >= 0");
    }
    return size_t(num_splits) * size_t(batch) * size_t(nheads) * size_t(seqlen_q) * size_t(headdim_v + 1) * sizeof(float);
  }, py::arg("num_splits"), py::arg("batch"), py::arg("nheads"), py::arg("seqlen_q"), py::arg("headdim_v"),
        "Bytes of device workspace a split-KV launch needs (FwdParams.split_workspace): float32 partial O and LSE, "
        "(num_splits, batch, nheads, seqlen_q, headdim_v + 1), in the kernel's view of the query rows and heads.");
  m.def("bwd_workspace_bytes", [](BwdParams const& params, int index) {
    return entry(bwd_kernels(), index, "backward").workspace_bytes(params);
  }, py::arg("params"), py::arg("index"),
        "Bytes of device workspace backward `index` needs for these params (sizes, deterministic).");
#ifdef FLASHHOPPER_HAS_KVCACHE_APPEND
  m.def("kvcache_append", [](uintptr_t stream, int device, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k, uintptr_t v,
                             std::array<int64_t, 3> k_cache_strides, std::array<int64_t, 3> v_cache_strides,
                             std::array<int64_t, 3> k_strides, std::array<int64_t, 3> v_strides, uintptr_t cache_seqlens,
                             int seqlen_offset, uintptr_t page_table, int64_t table_stride, uintptr_t cache_batch_idx,
                             int page_size, int batch, int seqlen_new, int heads, int k_row_bytes, int v_row_bytes) {
    KVAppendParams p;
    set_ptr(p.cache[0], k_cache), set_ptr(p.cache[1], v_cache), set_ptr(p.src[0], k), set_ptr(p.src[1], v);
    std::array<int64_t, 3> const* cs[2] = {&k_cache_strides, &v_cache_strides};
    std::array<int64_t, 3> const* ss[2] = {&k_strides, &v_strides};
    for (int w = 0; w < 2; ++w) {
      p.cache_page_stride[w] = (*cs[w])[0], p.cache_row_stride[w] = (*cs[w])[1], p.cache_head_stride[w] = (*cs[w])[2];
      p.src_batch_stride[w] = (*ss[w])[0], p.src_row_stride[w] = (*ss[w])[1], p.src_head_stride[w] = (*ss[w])[2];
    }
    set_ptr(p.cache_seqlens, cache_seqlens), set_ptr(p.page_table, page_table), set_ptr(p.cache_batch_idx, cache_batch_idx);
    p.seqlen_offset = seqlen_offset, p.table_stride = table_stride, p.page_size = page_size;
    p.batch = batch, p.seqlen_new = seqlen_new, p.heads = heads, p.row_bytes[0] = k_row_bytes, p.row_bytes[1] = v_row_bytes;
    p.device = device;
    return on_device(device, "kvcache append launch",
                     [&] { return launch_kvcache_append(p, reinterpret_cast<cudaStream_t>(stream)); });
  }, py::arg("stream"), py::arg("device"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"),
        py::arg("k_cache_strides"), py::arg("v_cache_strides"), py::arg("k_strides"), py::arg("v_strides"),
        py::arg("cache_seqlens"), py::arg("seqlen_offset"), py::arg("page_table"), py::arg("table_stride"),
        py::arg("cache_batch_idx"), py::arg("page_size"), py::arg("batch"), py::arg("seqlen_new"), py::arg("heads"),
        py::arg("k_row_bytes"), py::arg("v_row_bytes"),
        "Write k, v (batch, seqlen_new, heads, headdim) into the caches (common/kvcache_append.h); strides in BYTES "
        "(caches: page, row, head; k/v: batch, row, head), rows 16-byte multiples and 16-byte aligned.");
  m.def("kvcache_append_fp8", [](uintptr_t stream, int device, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k,
                                 uintptr_t v, std::array<int64_t, 3> k_cache_strides,
                                 std::array<int64_t, 3> v_cache_strides, std::array<int64_t, 3> k_strides,
                                 std::array<int64_t, 3> v_strides, uintptr_t k_scale, uintptr_t v_scale,
                                 std::array<int64_t, 2> k_scale_strides, std::array<int64_t, 2> v_scale_strides,
                                 uintptr_t cache_seqlens, int seqlen_offset, uintptr_t page_table, int64_t table_stride,
                                 uintptr_t cache_batch_idx, int page_size, int batch, int seqlen_new, int heads,
                                 int headdim, bool src_bf16, bool hadamard_k, int64_t hadamard_seed) {
    KVAppendParams p;
    set_ptr(p.cache[0], k_cache), set_ptr(p.cache[1], v_cache), set_ptr(p.src[0], k), set_ptr(p.src[1], v);
    set_ptr(p.scale[0], k_scale), set_ptr(p.scale[1], v_scale);
    std::array<int64_t, 3> const* cs[2] = {&k_cache_strides, &v_cache_strides};
    std::array<int64_t, 3> const* ss[2] = {&k_strides, &v_strides};
    std::array<int64_t, 2> const* sc[2] = {&k_scale_strides, &v_scale_strides};
    for (int w = 0; w < 2; ++w) {
      p.cache_page_stride[w] = (*cs[w])[0], p.cache_row_stride[w] = (*cs[w])[1], p.cache_head_stride[w] = (*cs[w])[2];
      p.src_batch_stride[w] = (*ss[w])[0], p.src_row_stride[w] = (*ss[w])[1], p.src_head_stride[w] = (*ss[w])[2];
      p.scale_page_stride[w] = (*sc[w])[0], p.scale_head_stride[w] = (*sc[w])[1];
      p.row_bytes[w] = headdim * 2;
    }
    set_ptr(p.cache_seqlens, cache_seqlens), set_ptr(p.page_table, page_table), set_ptr(p.cache_batch_idx, cache_batch_idx);
    p.seqlen_offset = seqlen_offset, p.table_stride = table_stride, p.page_size = page_size;
    p.batch = batch, p.seqlen_new = seqlen_new, p.heads = heads, p.headdim = headdim, p.src_bf16 = src_bf16;
    p.hadamard_k = hadamard_k, p.hadamard_seed = uint64_t(hadamard_seed);
    p.device = device;
    return on_device(device, "kvcache e4m3 append launch",
                     [&] { return launch_kvcache_append(p, reinterpret_cast<cudaStream_t>(stream)); });
  }, py::arg("stream"), py::arg("device"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"),
        py::arg("k_cache_strides"), py::arg("v_cache_strides"), py::arg("k_strides"), py::arg("v_strides"),
        py::arg("k_scale"), py::arg("v_scale"), py::arg("k_scale_strides"), py::arg("v_scale_strides"),
        py::arg("cache_seqlens"), py::arg("seqlen_offset"), py::arg("page_table"), py::arg("table_stride"),
        py::arg("cache_batch_idx"), py::arg("page_size"), py::arg("batch"), py::arg("seqlen_new"), py::arg("heads"),
        py::arg("headdim"), py::arg("src_bf16"), py::arg("hadamard_k"), py::arg("hadamard_seed"),
        "Quantize k, v (batch, seqlen_new, heads, headdim: 64, 128 or 256, 16-bit) into e4m3 caches, a float32 scale "
        "per row (common/kvcache_append.h; K with hadamard_seed's transform when hadamard_k): cache strides in BYTES "
        "(page, row, head), k/v strides in BYTES (batch, row, head), scale strides in ELEMENTS (page, head).");
#endif
#ifdef FLASHHOPPER_HAS_QUANTIZE
  m.def("quantize_fp8", [](QuantParams const& params, uintptr_t stream) {
    return on_device(params.device, "quantize_fp8 launch",
                     [&] { return launch_quantize_fp8(params, reinterpret_cast<cudaStream_t>(stream)); });
  }, py::arg("params"), py::arg("stream"),
        "Quantize to e4m3 with per-block descales, optionally Hadamard-transformed / transposed (docs/fp8.md). "
        "Returns the CTAs launched.");
  m.def("quantize_fp8_with", [](QuantParams params, uintptr_t stream, uintptr_t x, uintptr_t out, uintptr_t scale) {
    set_ptr(params.x_ptr, x), set_ptr(params.out_ptr, out), set_ptr(params.scale_ptr, scale);
    return on_device(params.device, "quantize_fp8 launch",
                     [&] { return launch_quantize_fp8(params, reinterpret_cast<cudaStream_t>(stream)); });
  }, py::arg("params"), py::arg("stream"), py::arg("x"), py::arg("out"), py::arg("scale"),
        "quantize_fp8() with these pointers in place of params'; params itself is left as it was.");
#endif

  m.def("kernels", [] {
    py::list out;
    for (size_t i = 0; i < fwd_kernels().size(); ++i) out.append(describe(fwd_kernels()[i], "fwd", int(i)));
    for (size_t i = 0; i < bwd_kernels().size(); ++i) out.append(describe(bwd_kernels()[i], "bwd", int(i)));
    return out;
  }, "The kernels of this build: mode, index, the KernelKey's fields and the tile sizes.");
  m.def("kernel_key_fields", &key_fields, "The KernelKey's fields, in order (cpp/common/kernel_key.h).");

  m.def("build_info", [] {
    BuildConfig const& c = build_config();
    py::dict d;
    d["cuda_runtime"] = CUDART_VERSION;
#ifdef FLASHHOPPER_CUTLASS_VERSION
    d["cutlass"] = FLASHHOPPER_CUTLASS_VERSION;
#endif
    d["archs"] = c.archs;
#ifdef FLASHHOPPER_ARCHS_FROM
    d["archs_from"] = FLASHHOPPER_ARCHS_FROM;  // "FLASHHOPPER_ARCHS", or how "auto" chose (visible GPUs)
#endif
    d["modes"] = c.modes;
    d["dtypes"] = c.dtypes;
    d["headdims"] = c.headdims;
    d["headdim_pairs"] = c.headdim_pairs;
    d["masks"] = c.masks;
    d["variants"] = c.variants;
    d["score_mods"] = c.score_mods;
    d["dropout"] = c.dropout;
    d["varlen"] = c.varlen;
    d["kvcache"] = c.kvcache;
    return d;
  }, "What this build was configured with (FLASHHOPPER_ARCHS, _MODES, _DTYPES, _HDIMS, _MASKS, _VARIANTS, "
     "_SCORE_MODS, _DROPOUT, _VARLEN, _KVCACHE).");

  m.def("block_ranges", &block_ranges, py::arg("block_m"), py::arg("block_n"), py::arg("mask"), py::arg("seqlen_q"),
        py::arg("seqlen_k"), py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("num_splits") = 1,
        "The kernels' block ranges (common/block_info.h), for tests: fwd[m] = (n_min, n_max, n_right_masked_begin, "
        "n_left_masked_end, n_blocks_adding_to_dq), bwd[n] = (m_min, m_max, m_right_masked_end, m_left_masked_begin), "
        "splits[m][s] = split-KV split s's (n_min, n_max) of query block m (SplitBlockInfo).");
}
