// pybind11 module flashhopper._C. It takes raw device pointers, strides and a stream handle as
// plain integers: Python owns tensors, allocation, validation and the choice of kernel family.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "registry.h"

namespace py = pybind11;
using namespace flashhopper;

namespace {

FwdKernel const* find_fwd(int arch, DType dtype, int headdim, bool causal) {
  for (auto const& k : fwd_kernels()) {
    if (k.arch == arch && k.dtype == dtype && k.headdim == headdim && k.causal == causal) return &k;
  }
  return nullptr;
}

void check_cuda(cudaError_t err, char const* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flashhopper: ") + what + ": " + cudaGetErrorString(err));
  }
}

void fwd(FwdParams const& params, int arch, uintptr_t stream) {
  FwdKernel const* k = find_fwd(arch, params.dtype, params.headdim, params.causal);
  if (k == nullptr) {
    throw std::invalid_argument("flashhopper: this build has no sm" + std::to_string(arch) + " forward kernel for " +
                                dtype_name(params.dtype) + " headdim " + std::to_string(params.headdim) +
                                (params.causal ? " causal" : " non-causal"));
  }
  // Launch on the tensors' device and leave the caller's current device as it was.
  int current = -1;
  check_cuda(cudaGetDevice(&current), "cudaGetDevice");
  if (current != params.device) check_cuda(cudaSetDevice(params.device), "cudaSetDevice");
  struct Restore {
    int device;
    bool needed;
    ~Restore() {
      if (needed) cudaSetDevice(device);
    }
  } restore{current, current != params.device};
  k->launch(params, reinterpret_cast<cudaStream_t>(stream));
  check_cuda(cudaGetLastError(), "forward kernel launch");
}

template <class T>
void def_ptr(py::class_<FwdParams>& c, char const* name, T FwdParams::*member) {
  c.def_property(
      name, [member](FwdParams const& p) { return reinterpret_cast<uintptr_t>(p.*member); },
      [member](FwdParams& p, uintptr_t v) { p.*member = reinterpret_cast<T>(v); });
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
  FH_RW(softmax_scale); FH_RW(causal); FH_RW(dtype); FH_RW(device); FH_RW(num_sms);
#undef FH_RW

  m.def("fwd", &fwd, py::arg("params"), py::arg("arch"), py::arg("stream"),
        "Launch the forward kernel of family `arch` (90 or 80) on `stream` (a cudaStream_t as int).");

  m.def("kernels", [] {
    py::list out;
    for (auto const& k : fwd_kernels()) {
      py::dict d;
      d["mode"] = "fwd";
      d["arch"] = k.arch;
      d["dtype"] = dtype_name(k.dtype);
      d["headdim"] = k.headdim;
      d["causal"] = k.causal;
      d["block_m"] = k.block_m;
      d["block_n"] = k.block_n;
      out.append(d);
    }
    return out;
  }, "The kernel configurations compiled into this build.");

  m.def("build_info", [] {
    py::dict d;
    d["cuda_runtime"] = CUDART_VERSION;
#ifdef FLASHHOPPER_CUTLASS_VERSION
    d["cutlass"] = FLASHHOPPER_CUTLASS_VERSION;
#endif
    return d;
  });
}
