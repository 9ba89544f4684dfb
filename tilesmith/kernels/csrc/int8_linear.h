// Host-visible interface of int8_linear.cu (plain C++: included by the binding and by the kernels).
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace tsk {

// Pointers are device pointers; strides are row strides in elements; dtype codes are tsk::DType
// (0 fp32, 1 bf16, 2 fp16). scale / bias / res may be null.
struct Int8LinearArgs {
  int M, N, K;
  const uint16_t* x;  // bf16 bits, [M, K], row stride sx
  long long sx;
  const int8_t* w;  // [N, K], row stride sw
  long long sw;
  const void* scale;  // [N]
  int scale_dtype;
  const void* bias;  // [N]
  int bias_dtype;
  const void* res;  // [M, N], row stride sres
  int res_dtype;
  long long sres;
  void* out;  // [M, N], row stride sout
  int out_dtype;
  long long sout;
};

// variant: 0 auto, 1 fma (CUDA cores), 2 mma (tensor cores, sm_80+), 3 scalar (any K / alignment),
// 4 fma_splitk (fma with K split over two warps per row pair; M == 1, fma above).
int int8_linear_pick(const Int8LinearArgs& p, int variant, int sm_major);
cudaError_t int8_linear_launch(const Int8LinearArgs& p, int variant, int sm_major, cudaStream_t stream);

}  // namespace tsk
