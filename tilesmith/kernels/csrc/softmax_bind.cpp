// Python binding of softmax.cu: argument checks, output allocation, launch on the current stream.
#include "bind_util.h"
#include "softmax.h"

namespace tsk {

// softmax(a * scale_a + bias_a, -1) [+ softmax(b * scale_b + bias_b, -1)]; a (and b) [..., D]; the output has
// a's sizes and dtype and is contiguous.
static SoftmaxArgs make_args(const at::Tensor& a, const std::optional<at::Tensor>& b, double scale_a,
                             const std::optional<at::Tensor>& bias_a, double scale_b,
                             const std::optional<at::Tensor>& bias_b) {
  TORCH_CHECK(a.is_cuda(), "softmax: a must be a CUDA tensor");
  const Rows ar = row_view(a, "softmax: a");
  SoftmaxArgs p{};
  p.rows = ar.rows;
  p.D = ar.d;
  p.a = a.data_ptr();
  p.sa = ar.stride;
  p.dtype = dtype_code(a.scalar_type(), "softmax: a");
  p.scale_a = static_cast<float>(scale_a);
  p.scale_b = static_cast<float>(scale_b);
  if (b.has_value()) {
    check_cuda(*b, a, "softmax: b");
    TORCH_CHECK(b->sizes() == a.sizes() && b->scalar_type() == a.scalar_type(), "softmax: b must have a's sizes ",
                dims(a.sizes()), " and dtype ", a.scalar_type(), " (got ", dims(b->sizes()), ", ", b->scalar_type(), ")");
    const Rows br = row_view(*b, "softmax: b");
    p.b = b->data_ptr();
    p.sb = br.stride;
  }
  for (const auto* bias : {&bias_a, &bias_b}) {
    if (bias->has_value())
      TORCH_CHECK((*bias)->scalar_type() == a.scalar_type(), "softmax: a bias must have a's dtype ", a.scalar_type());
  }
  TORCH_CHECK(!bias_b.has_value() || b.has_value(), "softmax: bias_b needs b");
  p.bias_a = vector_ptr(bias_a, a, ar.d, "softmax: bias_a");
  p.bias_b = vector_ptr(bias_b, a, ar.d, "softmax: bias_b");
  p.sout = ar.d;
  return p;
}

// softmax(a * scale_a + bias_a, -1) [+ softmax(b * scale_b + bias_b, -1)]; a (and b) [..., D]; the output has
// a's sizes and dtype and is contiguous.
at::Tensor softmax(const at::Tensor& a, const std::optional<at::Tensor>& b, double scale_a,
                   const std::optional<at::Tensor>& bias_a, double scale_b, const std::optional<at::Tensor>& bias_b,
                   int64_t variant) {
  TORCH_CHECK(a.is_cuda(), "softmax: a must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(a.device());
  SoftmaxArgs p = make_args(a, b, scale_a, bias_a, scale_b, bias_b);
  at::Tensor out = at::empty(a.sizes(), a.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  TORCH_CHECK(p.rows <= 0x7fffffffLL, "softmax: at most 2^31 - 1 rows");
  p.out = out.data_ptr();
  check_launch(softmax_launch(p, static_cast<int>(variant), c10::cuda::getCurrentCUDAStream(a.get_device()).stream()),
               "softmax");
  return out;
}

// Which kernel softmax runs for these operands (an output is assumed 16-byte aligned, as the caching
// allocator's are): "register", "looped" or "staged".
std::string softmax_kernel(const at::Tensor& a, const std::optional<at::Tensor>& b, int64_t variant) {
  TORCH_CHECK(a.is_cuda(), "softmax: a must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(a.device());
  SoftmaxArgs p = make_args(a, b, 1.0, std::nullopt, 1.0, std::nullopt);
  p.out = reinterpret_cast<void*>(static_cast<uintptr_t>(256));  // a 16-byte aligned stand-in
  switch (softmax_pick(p, static_cast<int>(variant))) {
    case 2: return "looped";
    case 3: return "staged";
    default: return "register";
  }
}

int64_t register_capacity(at::ScalarType dtype, bool dual) {
  return softmax_register_capacity(dtype_code(dtype, "softmax_register_capacity"), dual);
}

}  // namespace tsk

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "Tilesmith native kernels: row softmax and the fused sum of two softmaxes (CUDA C++)";
  m.def("softmax", &tsk::softmax, "softmax(a * scale_a + bias_a) [+ softmax(b * scale_b + bias_b)] over the last dim",
        py::arg("a"), py::arg("b") = py::none(), py::arg("scale_a") = 1.0, py::arg("bias_a") = py::none(),
        py::arg("scale_b") = 1.0, py::arg("bias_b") = py::none(), py::arg("variant") = 0);
  m.def("softmax_kernel", &tsk::softmax_kernel, "name of the kernel softmax picks (no biases)", py::arg("a"),
        py::arg("b") = py::none(), py::arg("variant") = 0);
  m.def("register_capacity", &tsk::register_capacity, "longest row read only once (the register kernel)",
        py::arg("dtype"), py::arg("dual") = false);
}
