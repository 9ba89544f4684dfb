// Python binding of norm.cu: argument checks, output allocation, launch on the current stream.
#include "bind_util.h"
#include "norm.h"

namespace tsk {

static std::vector<at::Tensor> norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                    double eps, bool round_before_weight, bool return_sum, bool layer_norm,
                                    int64_t variant) {
  const char* what = layer_norm ? "layer_norm" : "rms_norm";
  TORCH_CHECK(x.is_cuda(), what, ": x must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows xr = row_view(x, what);
  NormArgs p{};
  p.rows = xr.rows;
  p.D = xr.d;
  p.x = x.data_ptr();
  p.sx = xr.stride;
  p.dtype = dtype_code(x.scalar_type(), what);
  p.eps = static_cast<float>(eps);
  p.round_before_weight = round_before_weight ? 1 : 0;
  p.layer_norm = layer_norm ? 1 : 0;
  TORCH_CHECK(xr.d <= norm_max_d(p.dtype), what, ": rows of at most ", num(norm_max_d(p.dtype)), " elements (got ", num(xr.d),
              ")");
  if (residual.has_value()) {
    check_cuda(*residual, x, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), what,
                ": residual must have x's sizes ", dims(x.sizes()), " and dtype ", x.scalar_type());
    const Rows rr = row_view(*residual, "residual");
    p.r = residual->data_ptr();
    p.sr = rr.stride;
  }
  for (const auto* t : {&weight, &bias}) {
    if (t->has_value())
      TORCH_CHECK((*t)->scalar_type() == x.scalar_type(), what, ": weight and bias must have x's dtype ", x.scalar_type());
  }
  p.w = vector_ptr(weight, x, xr.d, "weight");
  p.b = vector_ptr(bias, x, xr.d, "bias");
  TORCH_CHECK(layer_norm || !bias.has_value(), "rms_norm takes no bias");
  const auto options = x.options().memory_format(at::MemoryFormat::Contiguous);
  std::vector<at::Tensor> outs{at::empty(x.sizes(), options)};
  if (return_sum) outs.push_back(at::empty(x.sizes(), options));
  if (x.numel() == 0) return outs;
  TORCH_CHECK(p.rows <= 0x7fffffffLL, what, ": at most 2^31 - 1 rows");
  p.out = outs[0].data_ptr();
  p.sout = xr.d;
  if (return_sum) {
    p.h = outs[1].data_ptr();
    p.sh = xr.d;
  }
  check_launch(norm_launch(p, static_cast<int>(variant), c10::cuda::getCurrentCUDAStream(x.get_device()).stream()), what);
  return outs;
}

// [out] or [out, x + residual]: out = (x + residual) * rsqrt(mean((x + residual)^2) + eps) * weight.
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                 const std::optional<at::Tensor>& weight, double eps, bool round_before_weight,
                                 bool return_sum, int64_t variant) {
  return norm(x, residual, weight, std::nullopt, eps, round_before_weight, return_sum, false, variant);
}

// [out] or [out, x + residual]: out = layer_norm(x + residual, [D], weight, bias, eps).
std::vector<at::Tensor> layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                   double eps, bool return_sum, int64_t variant) {
  return norm(x, residual, weight, bias, eps, false, return_sum, true, variant);
}

int64_t max_d(at::ScalarType dtype) { return norm_max_d(dtype_code(dtype, "max_d")); }

}  // namespace tsk

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "Tilesmith native kernels: residual add + RMSNorm / LayerNorm over wide rows (CUDA C++)";
  m.def("rms_norm", &tsk::rms_norm, "[out] or [out, x + residual]", py::arg("x"), py::arg("residual") = py::none(),
        py::arg("weight") = py::none(), py::arg("eps") = 1e-6, py::arg("round_before_weight") = false,
        py::arg("return_sum") = false, py::arg("variant") = 0);
  m.def("layer_norm", &tsk::layer_norm, "[out] or [out, x + residual]", py::arg("x"),
        py::arg("residual") = py::none(), py::arg("weight") = py::none(), py::arg("bias") = py::none(),
        py::arg("eps") = 1e-5, py::arg("return_sum") = false, py::arg("variant") = 0);
  m.def("max_d", &tsk::max_d, "longest row the kernels take", py::arg("dtype"));
}
