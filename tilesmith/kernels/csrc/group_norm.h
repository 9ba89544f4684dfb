// Host-visible interface of group_norm.cu (plain C++: included by the binding and by the kernels).
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace tsk {

// x is [N, C, *spatial] contiguous (NCHW), seen as [N, G, L] with L = (C / G) * HW: each (n, g) group is one
// contiguous span of L elements. Per group, fp32 statistics (mean, biased variance), then per element
//   y = (x - mean) * (rsqrt(var + eps) * w[c]) + b[c]        (w / b omitted when null)
//   y = round_to_dtype(y)                                     (when round_mid: the FX program rounded here)
//   y = y / (1 + exp(-y))                                     (when silu)
// rounded once to the output dtype (x's dtype). x and out share one dtype (tsk::DType); w and b are [C]
// contiguous in any of the three float dtypes (their own codes) or null.
struct GroupNormArgs {
  long long N, C, HW;
  int G;
  const void* x;
  void* out;
  const void* w;
  const void* b;
  int dtype, w_dtype, b_dtype;
  float eps;
  int silu;
  int round_mid;
};

// Which kernel runs, and how it is laid out (group_norm_pick fills it; group_norm_launch runs it).
struct GroupNormConfig {
  int kernel;    // 1 register (the group read once into registers), 2 looped (two passes), 3 scalar looped
  int cluster;   // blocks per group (a thread-block cluster on sm_90 when > 1)
  int threads;   // threads per block
  int vectors;   // 16-byte vectors per thread (register kernel)
};

// variant: 0 auto, 1 register kernel (128-thread blocks, 8 vectors per thread, cluster up to 8), 2 looped,
// 3 scalar looped (any size / alignment), 4 register kernel with 256-thread blocks and 4 vectors per thread.
// A forced register variant the group does not fit (or that needs a cluster below sm_90) runs looped instead.
// Returns false for an unknown variant.
bool group_norm_pick(const GroupNormArgs& p, int variant, int sm_major, GroupNormConfig* cfg);
cudaError_t group_norm_launch(const GroupNormArgs& p, const GroupNormConfig& cfg, cudaStream_t stream);

}  // namespace tsk
