// pybind11 module flashhopper._C. It takes raw device pointers, strides and a stream handle as
// plain integers: Python owns tensors, allocation, validation and the choice of kernel family.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "registry.h"
#include "sm90/tile_size.h"

namespace py = pybind11;
using namespace flashhopper;

namespace {

template <class Kernel>
Kernel const* find(std::vector<Kernel> const& table, int arch, DType dtype, int headdim, bool causal) {
  for (auto const& k : table) {
    if (k.arch == arch && k.dtype == dtype && k.headdim == headdim && k.causal == causal) return &k;
  }
  return nullptr;
}

template <class Kernel, class Params>
Kernel const& require(std::vector<Kernel> const& table, char const* what, Params const& p, int arch) {
  Kernel const* k = find(table, arch, p.dtype, p.headdim, p.causal);
  if (k == nullptr) {
    throw std::invalid_argument("flashhopper: this build has no sm" + std::to_string(arch) + " " + what +
                                " kernel for " + dtype_name(p.dtype) + " headdim " + std::to_string(p.headdim) +
                                (p.causal ? " causal" : " non-causal"));
  }
  return *k;
}

void check_cuda(cudaError_t err, char const* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flashhopper: ") + what + ": " + cudaGetErrorString(err));
  }
}

// Launch on the tensors' device and leave the caller's current device as it was.
template <class Fn>
void on_device(int device, char const* what, Fn&& launch) {
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
  launch();
  check_cuda(cudaGetLastError(), what);
}

void fwd(FwdParams const& params, int arch, uintptr_t stream) {
  FwdKernel const& k = require(fwd_kernels(), "forward", params, arch);
  on_device(params.device, "forward kernel launch", [&] { k.launch(params, reinterpret_cast<cudaStream_t>(stream)); });
}

size_t bwd_workspace_bytes(BwdParams const& params, int arch) {
  return require(bwd_kernels(), "backward", params, arch).workspace_bytes(params);
}

void bwd(BwdParams const& params, int arch, uintptr_t stream) {
  BwdKernel const& k = require(bwd_kernels(), "backward", params, arch);
  if (params.workspace == nullptr && k.workspace_bytes(params) > 0) {
    throw std::invalid_argument("flashhopper: the backward needs a workspace (BwdParams.workspace)");
  }
  on_device(params.device, "backward kernel launch", [&] { k.launch(params, reinterpret_cast<cudaStream_t>(stream)); });
}

template <class P, class T>
void def_ptr(py::class_<P>& c, char const* name, T P::*member) {
  c.def_property(
      name, [member](P const& p) { return reinterpret_cast<uintptr_t>(p.*member); },
      [member](P& p, uintptr_t v) { p.*member = reinterpret_cast<T>(v); });
}

template <class Kernel>
py::dict describe(Kernel const& k, char const* mode) {
  py::dict d;
  d["mode"] = mode;
  d["arch"] = k.arch;
  d["dtype"] = dtype_name(k.dtype);
  d["headdim"] = k.headdim;
  d["causal"] = k.causal;
  d["block_m"] = k.block_m;
  d["block_n"] = k.block_n;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "flashhopper CUDA kernels (raw-pointer interface; use the flashhopper package instead)";

  py::enum_<DType>(m, "DType")
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16)
      .value("float8_e4m3fn", DType::kFloat8E4M3);

  py::class_<FwdParams> p(m, "FwdParams");
  p.def(py::init<>());
  def_ptr(p, "q_ptr", &FwdParams::q_ptr);
  def_ptr(p, "k_ptr", &FwdParams::k_ptr);
  def_ptr(p, "v_ptr", &FwdParams::v_ptr);
  def_ptr(p, "o_ptr", &FwdParams::o_ptr);
  def_ptr(p, "lse_ptr", &FwdParams::lse_ptr);
  def_ptr(p, "tile_counter", &FwdParams::tile_counter);
#define FH_RW(field) p.def_readwrite(#field, &FwdParams::field)
  FH_RW(q_batch_stride); FH_RW(q_row_stride); FH_RW(q_head_stride);
  FH_RW(k_batch_stride); FH_RW(k_row_stride); FH_RW(k_head_stride);
  FH_RW(v_batch_stride); FH_RW(v_row_stride); FH_RW(v_head_stride);
  FH_RW(o_batch_stride); FH_RW(o_row_stride); FH_RW(o_head_stride);
  FH_RW(batch); FH_RW(seqlen_q); FH_RW(seqlen_k); FH_RW(nheads_q); FH_RW(nheads_kv); FH_RW(headdim);
  FH_RW(softmax_scale); FH_RW(causal); FH_RW(dtype); FH_RW(device); FH_RW(num_sms); FH_RW(max_smem_bytes);
  // FP8 (docs/fp8.md)
  def_ptr(p, "q_scale_ptr", &FwdParams::q_scale_ptr);
  def_ptr(p, "k_scale_ptr", &FwdParams::k_scale_ptr);
  def_ptr(p, "v_scale_ptr", &FwdParams::v_scale_ptr);
  FH_RW(v_dim_stride);
  FH_RW(q_scale_batch_stride); FH_RW(q_scale_head_stride); FH_RW(q_scale_block_stride); FH_RW(q_scale_block);
  FH_RW(k_scale_batch_stride); FH_RW(k_scale_head_stride); FH_RW(k_scale_block_stride); FH_RW(k_scale_block);
  FH_RW(v_scale_batch_stride); FH_RW(v_scale_head_stride); FH_RW(v_scale_block_stride); FH_RW(v_scale_block);
#undef FH_RW

  py::class_<QuantParams> qp(m, "QuantParams");
  qp.def(py::init<>());
  def_ptr(qp, "x_ptr", &QuantParams::x_ptr);
  def_ptr(qp, "out_ptr", &QuantParams::out_ptr);
  def_ptr(qp, "scale_ptr", &QuantParams::scale_ptr);
  def_ptr(qp, "signs_ptr", &QuantParams::signs_ptr);
#define FH_RW(field) qp.def_readwrite(#field, &QuantParams::field)
  FH_RW(x_batch_stride); FH_RW(x_row_stride); FH_RW(x_head_stride);
  FH_RW(out_batch_stride); FH_RW(out_row_stride); FH_RW(out_head_stride); FH_RW(out_dim_stride);
  FH_RW(scale_batch_stride); FH_RW(scale_head_stride); FH_RW(scale_block_stride);
  FH_RW(batch); FH_RW(seqlen); FH_RW(nheads); FH_RW(headdim); FH_RW(block_size); FH_RW(transpose);
  FH_RW(dtype); FH_RW(device);
#undef FH_RW

  py::class_<BwdParams> b(m, "BwdParams");
  b.def(py::init<>());
  def_ptr(b, "q_ptr", &BwdParams::q_ptr);
  def_ptr(b, "k_ptr", &BwdParams::k_ptr);
  def_ptr(b, "v_ptr", &BwdParams::v_ptr);
  def_ptr(b, "o_ptr", &BwdParams::o_ptr);
  def_ptr(b, "do_ptr", &BwdParams::do_ptr);
  def_ptr(b, "lse_ptr", &BwdParams::lse_ptr);
  def_ptr(b, "dlse_ptr", &BwdParams::dlse_ptr);
  def_ptr(b, "dq_ptr", &BwdParams::dq_ptr);
  def_ptr(b, "dk_ptr", &BwdParams::dk_ptr);
  def_ptr(b, "dv_ptr", &BwdParams::dv_ptr);
  def_ptr(b, "workspace", &BwdParams::workspace);
#define FH_RW(field) b.def_readwrite(#field, &BwdParams::field)
  FH_RW(q_batch_stride); FH_RW(q_row_stride); FH_RW(q_head_stride);
  FH_RW(k_batch_stride); FH_RW(k_row_stride); FH_RW(k_head_stride);
  FH_RW(v_batch_stride); FH_RW(v_row_stride); FH_RW(v_head_stride);
  FH_RW(o_batch_stride); FH_RW(o_row_stride); FH_RW(o_head_stride);
  FH_RW(do_batch_stride); FH_RW(do_row_stride); FH_RW(do_head_stride);
  FH_RW(dq_batch_stride); FH_RW(dq_row_stride); FH_RW(dq_head_stride);
  FH_RW(dk_batch_stride); FH_RW(dk_row_stride); FH_RW(dk_head_stride);
  FH_RW(dv_batch_stride); FH_RW(dv_row_stride); FH_RW(dv_head_stride);
  FH_RW(batch); FH_RW(seqlen_q); FH_RW(seqlen_k); FH_RW(nheads_q); FH_RW(nheads_kv); FH_RW(headdim);
  FH_RW(softmax_scale); FH_RW(causal); FH_RW(deterministic); FH_RW(dtype); FH_RW(device); FH_RW(num_sms);
  FH_RW(max_smem_bytes);
#undef FH_RW

  m.def("fwd", &fwd, py::arg("params"), py::arg("arch"), py::arg("stream"),
        "Launch the forward kernel of family `arch` (90 or 80) on `stream` (a cudaStream_t as int).");
  m.def("bwd", &bwd, py::arg("params"), py::arg("arch"), py::arg("stream"),
        "Launch the backward (preprocess, main kernel, postprocess) of family `arch` on `stream`.");
#ifdef FLASHHOPPER_HAS_QUANTIZE
  m.def("quantize_fp8", [](QuantParams const& params, uintptr_t stream) {
    on_device(params.device, "quantize_fp8 launch",
              [&] { launch_quantize_fp8(params, reinterpret_cast<cudaStream_t>(stream)); });
  }, py::arg("params"), py::arg("stream"),
        "Quantize to e4m3 with per-block descales, optionally Hadamard-transformed / transposed (docs/fp8.md).");
#endif
  m.def("bwd_workspace_bytes", &bwd_workspace_bytes, py::arg("params"), py::arg("arch"),
        "Bytes of device workspace the backward needs for these params (sizes, causal, deterministic).");

  m.def("fp8_v_transposed_in_kernel", [](int headdim) { return sm90::fp8_v_transposed_in_kernel(headdim); },
        py::arg("headdim"),
        "True when this build's fp8 forward kernel for `headdim` takes V row-major (batch, seqlen, heads, headdim) "
        "and transposes it itself (built with FLASHHOPPER_FP8_V_TRANSPOSE_IN_KERNEL: head dims 64 and 128); "
        "False: it takes V^T with keys permuted (docs/fp8.md).");

  m.def("kernels", [] {
    py::list out;
    for (auto const& k : fwd_kernels()) out.append(describe(k, "fwd"));
    for (auto const& k : bwd_kernels()) out.append(describe(k, "bwd"));
    return out;
  }, "The kernel configurations compiled into this build (mode 'fwd' or 'bwd').");

  m.def("build_info", [] {
    py::dict d;
    d["cuda_runtime"] = CUDART_VERSION;
#ifdef FLASHHOPPER_CUTLASS_VERSION
    d["cutlass"] = FLASHHOPPER_CUTLASS_VERSION;
#endif
    return d;
  });
}
