// Python binding of int8_linear.cu: argument checks, output allocation, launch on the current stream.
#include "bind_util.h"
#include "int8_linear.h"

namespace tsk {

static Int8LinearArgs make_args(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                                const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                                at::Tensor* out) {
  TORCH_CHECK(x.is_cuda(), "int8_linear: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "int8_linear: x must be bfloat16 (got ", x.scalar_type(), ")");
  check_cuda(w, x, "int8_linear: w");
  TORCH_CHECK(w.scalar_type() == at::kChar, "int8_linear: w must be int8 (got ", w.scalar_type(), ")");
  TORCH_CHECK(w.dim() == 2, "int8_linear: w must be [N, K] (got sizes ", dims(w.sizes()), ")");
  const Rows xr = row_view(x, "int8_linear: x");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(xr.d == K, "int8_linear: x has ", num(xr.d), " features, w has ", num(K));
  TORCH_CHECK(K <= 1 || w.stride(1) == 1, "int8_linear: w must have unit stride along K (strides ", dims(w.strides()), ")");
  TORCH_CHECK(xr.rows <= 16, "int8_linear: at most 16 rows of x (decode shapes), got ", num(xr.rows));
  Int8LinearArgs p{};
  p.M = static_cast<int>(xr.rows);
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.x = static_cast<const uint16_t*>(x.data_ptr());
  p.sx = xr.stride;
  p.w = static_cast<const int8_t*>(w.data_ptr());
  p.sw = N > 1 ? w.stride(0) : K;
  p.scale = vector_ptr(scale, x, N, "int8_linear: scale");
  p.scale_dtype = scale.has_value() ? dtype_code(scale->scalar_type(), "int8_linear: scale") : 0;
  p.bias = vector_ptr(bias, x, N, "int8_linear: bias");
  p.bias_dtype = bias.has_value() ? dtype_code(bias->scalar_type(), "int8_linear: bias") : 0;
  if (residual.has_value()) {
    check_cuda(*residual, x, "int8_linear: residual");
    TORCH_CHECK(out == nullptr || residual->sizes() == out->sizes(), "int8_linear: residual must have the output's "
                "sizes ", dims(out ? out->sizes() : x.sizes()), " (got ", dims(residual->sizes()), ")");
    const Rows rr = row_view(*residual, "int8_linear: residual");
    p.res = residual->data_ptr();
    p.res_dtype = dtype_code(residual->scalar_type(), "int8_linear: residual");
    p.sres = rr.stride;
  }
  if (out != nullptr) {
    p.out = out->data_ptr();
    p.out_dtype = dtype_code(out->scalar_type(), "int8_linear: out_dtype");
    p.sout = N;
  }
  return p;
}

static std::vector<int64_t> out_sizes(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  return sizes;
}

// out = bf16(x @ w.T) * scale + bias + residual; shapes x [..., K] (at most 16 rows), w [N, K] int8.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                       std::optional<at::ScalarType> out_dtype, int64_t variant) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 1, "int8_linear: x must be a CUDA tensor with at least one dimension");
  TORCH_CHECK(w.dim() == 2, "int8_linear: w must be [N, K] (got sizes ", dims(w.sizes()), ")");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty(out_sizes(x, w.size(0)), x.options().dtype(out_dtype.value_or(at::kBFloat16)));
  const Int8LinearArgs p = make_args(x, w, scale, bias, residual, &out);
  if (out.numel() == 0) return out;
  check_launch(int8_linear_launch(p, static_cast<int>(variant), sm_major(x.get_device()),
                                  c10::cuda::getCurrentCUDAStream(x.get_device()).stream()),
               "int8_linear");
  return out;
}

// Which kernel int8_linear runs for these operands: "fma", "fma_splitk", "mma" or "scalar".
std::string int8_linear_kernel(const at::Tensor& x, const at::Tensor& w, int64_t variant) {
  const Int8LinearArgs p = make_args(x, w, std::nullopt, std::nullopt, std::nullopt, nullptr);
  switch (int8_linear_pick(p, static_cast<int>(variant), sm_major(x.get_device()))) {
    case 1: return "fma";
    case 2: return "mma";
    case 4: return "fma_splitk";
    default: return "scalar";
  }
}

}  // namespace tsk

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "Tilesmith native kernels: int8 weight-only linear for decode shapes (CUDA C++)";
  m.def("int8_linear", &tsk::int8_linear, "bf16(x @ w.T) * scale + bias + residual (int8 w, bf16 x, M <= 16)",
        py::arg("x"), py::arg("w"), py::arg("scale") = py::none(), py::arg("bias") = py::none(),
        py::arg("residual") = py::none(), py::arg("out_dtype") = py::none(), py::arg("variant") = 0);
  m.def("int8_linear_kernel", &tsk::int8_linear_kernel, "name of the kernel int8_linear picks", py::arg("x"),
        py::arg("w"), py::arg("variant") = 0);
}
