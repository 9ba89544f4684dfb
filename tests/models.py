"""Small CPU models for pipeline tests, and honest candidate edits for their wrappers."""

from __future__ import annotations

import re

import torch


class MulSum(torch.nn.Module):
    """``tanh(x @ w)`` written as broadcast-multiply-sum.

    Inductor lowers the multiply-sum to one C++ reduction loop (``cpp_fused_mul_sum_tanh_unsqueeze_0``);
    calling the BLAS matmul instead (:func:`mm_instead_of_loop`) is an honest rewrite that is several times
    faster on CPU (0.25 ms vs 0.07 ms for 64×256·256×256 on this 2-core machine), so the real gate
    accepts it robustly even on a busy machine.
    """

    def __init__(self, k: int = 512, n: int = 256):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(k, n) / k**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh((x[:, :, None] * self.w[None]).sum(1))


_LOOP = re.compile(r"cpp_fused_mul_sum_tanh_unsqueeze_\d+\((buf\d+), (\w+), (\w+)\)")


def has_mulsum_loop(text: str) -> bool:
    return bool(_LOOP.search(text))


def mm_instead_of_loop(text: str) -> str:
    """Replace the C++ multiply-sum loop call by ``extern_kernels.mm`` + in-place ``tanh``."""
    return _LOOP.sub(r"extern_kernels.mm(\2, \3, out=\1); torch.tanh(\1, out=\1)", text, count=1)


class TwoLayer(torch.nn.Module):
    """Linear → GELU → Linear (inference and training graphs with extern addmm and one C++ kernel)."""

    def __init__(self, d: int = 64, h: int = 128):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, h)
        self.fc2 = torch.nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def graph_break_fn(x: torch.Tensor) -> torch.Tensor:
    """Two graphs: Dynamo breaks at ``torch._dynamo.graph_break()``."""
    y = torch.sin(x) * 2
    torch._dynamo.graph_break()
    return torch.cos(y) + 1
