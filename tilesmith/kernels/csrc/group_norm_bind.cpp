// Python binding of group_norm.cu: argument checks, output allocation, launch on the current stream.
#include "bind_util.h"
#include "group_norm.h"

namespace tsk {

// Largest group (C / G * HW elements) the kernels take: 32-bit in-group indices with room to spare.
constexpr int64_t kMaxGroup = int64_t(1) << 30;

static GroupNormArgs make_args(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, int64_t num_groups, double eps, bool silu,
                               bool round_mid) {  // callers check x.is_cuda() before their device guard
  TORCH_CHECK(x.dim() >= 2, "group_norm: x must be [N, C, *spatial] (got sizes ", dims(x.sizes()), ")");
  TORCH_CHECK(x.is_contiguous(), "group_norm: x must be contiguous NCHW (sizes ", dims(x.sizes()), ", strides ",
              dims(x.strides()), "): each (n, g) group is read as one contiguous span; channels-last and other "
              "layouts are not supported (call .contiguous() first)");
  const int64_t n = x.size(0), c = x.size(1);
  TORCH_CHECK(num_groups > 0 && c % num_groups == 0, "group_norm: num_groups (", num(num_groups),
              ") must be positive and divide the channels (", num(c), ")");
  int64_t hw = 1;
  for (int64_t i = 2; i < x.dim(); ++i) hw *= x.size(i);
  TORCH_CHECK((c / num_groups) * hw < kMaxGroup, "group_norm: groups of at most 2^30 elements (C / G * HW = ",
              num((c / num_groups) * hw), ")");
  TORCH_CHECK(n * num_groups * 8 < 0x7fffffffLL, "group_norm: at most 2^28 groups (N * G = ", num(n * num_groups), ")");
  GroupNormArgs p{};
  p.N = n;
  p.C = c;
  p.HW = hw;
  p.G = static_cast<int>(num_groups);
  p.x = x.data_ptr();
  p.dtype = dtype_code(x.scalar_type(), "group_norm");
  p.eps = static_cast<float>(eps);
  p.silu = silu ? 1 : 0;
  p.round_mid = round_mid ? 1 : 0;
  p.w = vector_ptr(weight, x, c, "group_norm: weight");
  p.b = vector_ptr(bias, x, c, "group_norm: bias");
  if (weight.has_value()) p.w_dtype = dtype_code(weight->scalar_type(), "group_norm: weight");
  if (bias.has_value()) p.b_dtype = dtype_code(bias->scalar_type(), "group_norm: bias");
  return p;
}

static GroupNormConfig pick(const GroupNormArgs& p, const at::Tensor& x, int64_t variant) {
  GroupNormConfig cfg{};
  TORCH_CHECK(group_norm_pick(p, static_cast<int>(variant), sm_major(x.get_device()), &cfg),
              "group_norm: variant must be 0 (auto), 1 (register), 2 (looped), 3 (scalar) or 4 (register, "
              "256 threads); got ", num(variant));
  return cfg;
}

// silu(group_norm(x, num_groups, weight, bias, eps)) (SiLU when `silu`), in x's dtype, contiguous.
at::Tensor group_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, int64_t num_groups, double eps, bool silu,
                      bool round_before_silu, int64_t variant) {
  TORCH_CHECK(x.is_cuda(), "group_norm: x must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  GroupNormArgs p = make_args(x, weight, bias, num_groups, eps, silu, round_before_silu);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  p.out = out.data_ptr();
  const GroupNormConfig cfg = pick(p, x, variant);
  check_launch(group_norm_launch(p, cfg, c10::cuda::getCurrentCUDAStream(x.get_device()).stream()), "group_norm");
  return out;
}

// "register cluster=8 threads=128 vectors=8", "looped cluster=2 threads=256" or "scalar ...": what runs.
std::string group_norm_kernel(const at::Tensor& x, int64_t num_groups, int64_t variant) {
  TORCH_CHECK(x.is_cuda(), "group_norm: x must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  GroupNormArgs p = make_args(x, std::nullopt, std::nullopt, num_groups, 1e-5, false, false);
  p.out = reinterpret_cast<void*>(static_cast<uintptr_t>(256));  // a 16-byte aligned stand-in
  const GroupNormConfig cfg = pick(p, x, variant);
  std::string name = cfg.kernel == 1 ? "register" : cfg.kernel == 2 ? "looped" : "scalar";
  name += " cluster=" + std::to_string(cfg.cluster) + " threads=" + std::to_string(cfg.threads);
  if (cfg.kernel == 1) name += " vectors=" + std::to_string(cfg.vectors);
  return name;
}

}  // namespace tsk

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "Tilesmith native kernels: GroupNorm (+ affine, + SiLU) over contiguous NCHW tensors (CUDA C++)";
  m.def("group_norm", &tsk::group_norm, "silu(group_norm(x)) (SiLU optional), in x's dtype", py::arg("x"),
        py::arg("weight") = py::none(), py::arg("bias") = py::none(), py::arg("num_groups") = 32,
        py::arg("eps") = 1e-5, py::arg("silu") = true, py::arg("round_before_silu") = false, py::arg("variant") = 0);
  m.def("group_norm_kernel", &tsk::group_norm_kernel, "which kernel group_norm runs for x", py::arg("x"),
        py::arg("num_groups") = 32, py::arg("variant") = 0);
}
