"""The built-in agent (``agent_model="tilesmith/builtin"``): deterministic generators, no LLM, no keys.

Generators, proposed through the same host gate as any LLM candidate (see ``docs/builtin-agent.md``):

- ``cudagraph`` (:mod:`.cudagraph`): replay the whole ``call`` from one CUDA graph;
- ``launch_config`` (:mod:`.launch_config`): per-Triton-kernel launch configurations found by a measured
  search in a worker process (:mod:`.search_worker`), pinned into the kernel sources;
- ``wrapper_cleanup`` (:mod:`.cleanup`): drop provably redundant host statements;
- ``native_kernels`` (:mod:`.native`): a graph whose whole FX program is one known pattern (int8 decode
  GEMV, row softmax, residual + RMSNorm/LayerNorm) calls a hand-written CUDA C++ kernel from
  :mod:`tilesmith.kernels` instead (docs/native-kernels.md).

:class:`BuiltinOptimizerFactory` is what ``tilesmith.agent.make_factory`` constructs.
"""

from tilesmith.agent.builtin.optimizer import BuiltinOptimizer, BuiltinOptimizerFactory, default_generators

__all__ = ["BuiltinOptimizer", "BuiltinOptimizerFactory", "default_generators"]
