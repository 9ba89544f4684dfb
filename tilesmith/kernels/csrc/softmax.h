// Host-visible interface of softmax.cu (plain C++: included by the binding and by the kernels).
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace tsk {

// out[r, :] = softmax(a[r, :] * scale_a + bias_a) (+ softmax(b[r, :] * scale_b + bias_b) when b is set),
// over rows of length D. a, b, out share one dtype (tsk::DType); biases are [D] contiguous in that dtype or
// null; strides are row strides in elements.
struct SoftmaxArgs {
  long long rows, D;
  const void* a;
  long long sa;
  const void* b;
  long long sb;
  const void* bias_a;
  const void* bias_b;
  float scale_a, scale_b;
  void* out;
  long long sout;
  int dtype;
};

// variant: 0 auto, 1 register-resident rows (one read of the data), 2 looped (two reads; any D), 3 staged
// (register-resident rows fed by a TMA pipeline through shared memory; sm_90+, 16-byte aligned rows of at
// least 32 KB per row (pair) up to the register capacity; elsewhere variant 3 runs what auto would run
// without it). Auto: staged where it applies (kAutoStaged in softmax.cu), else register, else looped.
cudaError_t softmax_launch(const SoftmaxArgs& p, int variant, cudaStream_t stream);
// Which kernel softmax_launch runs for these arguments on the current device: 1 register, 2 looped, 3 staged.
int softmax_pick(const SoftmaxArgs& p, int variant);
// The largest D the register-resident kernel holds for this dtype / arity (vectorised or not).
long long softmax_register_capacity(int dtype, bool dual);

}  // namespace tsk
