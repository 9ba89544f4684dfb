// Host-visible interface of norm.cu (plain C++: included by the binding and by the kernels).
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace tsk {

// Per row of length D, with h = x (+ r when r is set; rounded to the dtype, as the FX program's add is):
//   RMSNorm:   out = h * rsqrt(mean(h^2) + eps) [rounded to the dtype first when round_before_weight] * w
//   LayerNorm: out = (h - mean(h)) * rsqrt(var(h) + eps) * w + b      (biased variance)
// fp32 statistics; x, r, h, out, w, b share one dtype (tsk::DType); w / b are [D] contiguous or null; h_out
// (when set) receives h. Strides are row strides in elements.
struct NormArgs {
  long long rows, D;
  const void* x;
  long long sx;
  const void* r;
  long long sr;
  void* h;
  long long sh;
  const void* w;
  const void* b;
  void* out;
  long long sout;
  float eps;
  int round_before_weight;
  int layer_norm;
  int dtype;
};

// variant: 0 the packed kernel (h kept in the dtype, 64 registers, one barrier per reduction), 1 the previous
// kernel (fp32 registers); same arithmetic, the block sums' order of the warps' partial sums differs.
cudaError_t norm_launch(const NormArgs& p, int variant, cudaStream_t stream);
// The largest D the (register-resident) kernels hold for this dtype.
long long norm_max_d(int dtype);

}  // namespace tsk
