"""Hand-written CUDA C++ kernels for graph patterns where Inductor's generated code stops short of the roofline.

Families (sources in ``csrc/``; one PyTorch extension each, built on first use, see :mod:`.build`):

- ``int8_linear``: int8 weight-only linear for decode shapes (M ≤ 16 rows of bf16 activations, int8 weight
  ``[N, K]``, per-output-channel scale, optional bias and residual): ``out = bf16(x @ W.T) * scale + bias +
  residual`` — CUDA-core and tensor-core (``mma.sync`` bf16) kernels that stream the weight once.
- ``softmax``: row softmax over long rows with pre-ops (``x * scale + bias``) and the fused sum of two
  softmaxes, reading each row once (register-resident online statistics).
- ``norm``: residual add + RMSNorm / LayerNorm over wide rows (one read, fp32 statistics).
- ``group_norm``: GroupNorm (+ affine, + SiLU) over contiguous NCHW tensors, each group read once into the
  registers of a block or of a thread-block cluster (sm_90), else two passes.

:mod:`.runtime` is what a candidate wrapper imports (``native_module(family, key)``: load a finished build,
never build); :mod:`.build` builds under a file lock in Tilesmith's kernel directory
(``TILESMITH_KERNEL_DIR``, default ``<cache root>/kernels``). ``docs/native-kernels.md`` describes the
kernels, the cache and how the built-in agent proposes them.
"""

from tilesmith.kernels.runtime import FAMILIES, KernelUnavailable, kernel_dir, native_module

__all__ = ["FAMILIES", "KernelUnavailable", "kernel_dir", "native_module"]
