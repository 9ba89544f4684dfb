// Helpers shared by the Python bindings (host C++): dtype codes, row views, device checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>

namespace tsk {

// Numbers in error messages go through std::to_string, never `std::ostream << int64_t`.
// Rationale: on the H200 image (g++ 13.3, torch 2.11.0+cu130, 2026-12-02) a TORCH_CHECK in an extension built
// there segfaulted while raising when its message streamed an integer (int8_linear's "at most 16 rows ... got 17",
// and a minimal load_inline probe `TORCH_CHECK(n < 1, "boom ", n)`); messages streaming only text and ScalarType
// raised normally. IntArrayRef's operator<< streams integers too, so sizes and strides use dims().
inline std::string num(int64_t v) { return std::to_string(v); }

inline std::string dims(c10::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}

inline int dtype_code(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, name, ": dtype ", t, " is not supported (float32, bfloat16, float16)");
  }
  return -1;
}

// A tensor seen as `rows` rows of `d` contiguous elements `stride` elements apart: unit stride in the last
// dimension and leading dimensions that collapse into one (size-1 dimensions are ignored).
struct Rows {
  int64_t rows, d, stride;
};

inline Rows row_view(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 1, name, " must have at least one dimension");
  const int64_t d = t.size(-1);
  TORCH_CHECK(d <= 1 || t.stride(-1) == 1, name, " must have unit stride in its last dimension (sizes ", dims(t.sizes()),
              ", strides ", dims(t.strides()), ")");
  int64_t rows = 1, stride = d, expect = -1;
  for (int64_t i = t.dim() - 2; i >= 0; --i) {
    const int64_t s = t.size(i);
    if (s == 1) continue;
    if (expect < 0) {
      stride = t.stride(i);
    } else {
      TORCH_CHECK(t.stride(i) == expect, name, ": leading dimensions must collapse into rows (sizes ", dims(t.sizes()),
                  ", strides ", dims(t.strides()), ")");
    }
    expect = t.stride(i) * s;
    rows *= s;
  }
  return {rows, d, stride};
}

inline void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == like.device(), name, " must be on ", like.device(), " (got ", t.device(), ")");
}

// A [D] vector (bias, scale, norm weight): D elements, contiguous, on the device of `like`.
inline const void* vector_ptr(const std::optional<at::Tensor>& t, const at::Tensor& like, int64_t d,
                              const char* name) {
  if (!t.has_value()) return nullptr;
  check_cuda(*t, like, name);
  TORCH_CHECK(t->numel() == d, name, " must have ", num(d), " elements (got sizes ", dims(t->sizes()), ")");
  TORCH_CHECK(t->is_contiguous(), name, " must be contiguous (strides ", dims(t->strides()), ")");
  return t->data_ptr();
}

inline int sm_major(int device) {
  static int cache[64] = {0};
  if (device < 0 || device >= 64) return 0;
  if (cache[device] == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) major = 0;
    cache[device] = major > 0 ? major : -1;
  }
  return cache[device] > 0 ? cache[device] : 0;
}

inline void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace tsk
