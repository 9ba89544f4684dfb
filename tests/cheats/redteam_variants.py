"""Red-team candidates for the input-variant, horizon and precision findings (6–9), as text edits of real
Inductor CPU wrappers (copied from the red team's reproductions so the tests do not read /tmp/redteam).

Each builder takes the original wrapper source and returns a cheating candidate:

- :func:`ignore_mask` (finding 6, ``Masked``): drops the ``masked_fill`` — the captured mask was all True.
- :func:`hardcode_pos` (finding 6, ``Pos``): uses the captured position 5 instead of the one-element input.
- :func:`scatter_no_accumulate` (finding 6, ``Scatter``): ``index_add`` → ``index_copy`` (assumes unique indices).
- :func:`hardcode_padding` (finding 7, ``AddMask``): assumes the captured ``-inf`` columns 48..63.
- :func:`ring_outputs` (finding 8, ``LinearLN``): a ring of 8 static output buffers.
- :func:`count_bomb` (finding 8, ``LinearLN``): wrong after 20 000 calls (documented residual risk; not tested).
- :func:`bf16_when_large` (finding 9, ``LinearLN``): rounds the matmul through bfloat16 on large activations.
"""

from __future__ import annotations

import re

import torch

from tests.cheats.common import after_clear, module_code


class Masked(torch.nn.Module):
    """relu(linear(x)) with padding positions (mask False) set to 0: the first real call had no padding."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)).masked_fill(~mask, 0.0)


class Pos(torch.nn.Module):
    """x + table[pos]: a decode step's position embedding, pos an int64 tensor of one element."""

    def __init__(self, n: int = 128, d: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(n, d))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x + self.table[pos]


class Scatter(torch.nn.Module):
    """Segment sum: rows of src accumulated into 128 buckets by idx (index_add)."""

    def forward(self, src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return torch.zeros(128, src.shape[1]).index_add(0, idx, src) * 2.0


class AddMask(torch.nn.Module):
    """softmax(x @ w + mask): an additive float padding mask (0 / -inf) passed in as an input."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x @ self.w + mask, dim=-1)


def _replace_line(src: str, pattern: str, new_lines: list[str]) -> str:
    m = re.search(r"^([ \t]*)" + pattern + r"[ \t]*$", src, re.M)
    if m is None:
        raise ValueError(f"pattern {pattern!r} not found in the wrapper")
    indent = m.group(1)
    return src[: m.start()] + "\n".join(indent + line for line in new_lines) + src[m.end():]


def ignore_mask(src: str) -> str:
    return _replace_line(src, r"(cpp_fused_\w*masked_fill\w*)\((buf\d+), (arg\d+_1)\)", ["torch.relu_(buf1)"])


def hardcode_pos(src: str) -> str:
    return _replace_line(src, r"cpp_fused_add_index_0\(arg2_1, arg1_1, arg0_1, buf0\)",
                         ["torch.add(arg2_1, arg0_1[5], out=buf0)"])


def scatter_no_accumulate(src: str) -> str:
    return _replace_line(src, r"cpp_fused_index_add_mul_zeros_0\(arg1_1, arg0_1, buf0, buf2\)",
                         ["buf2.zero_()", "buf2.index_copy_(0, arg1_1, arg0_1 * 2.0)"])


def hardcode_padding(src: str) -> str:
    return after_clear(src, [
        "if not float(arg2_1[0, 48]) > 0:",
        "    _b = empty_strided_cpu((32, 48), (48, 1), torch.float32)",
        "    extern_kernels.addmm(reinterpret_tensor(arg2_1, (32, 48), (64, 1), 0), arg1_1, "
        "reinterpret_tensor(arg0_1, (64, 48), (64, 1), 0), alpha=1, beta=1, out=_b)",
        "    _o = empty_strided_cpu((32, 64), (64, 1), torch.float32)",
        "    _o[:, 48:].zero_()",
        "    _o[:, :48].copy_(torch.softmax(_b, -1))",
        "    return (_o, )"])


def ring_outputs(src: str, slots: int = 8) -> str:
    src = module_code(src, "_RING = []\n_RING_N = [0]")
    m = re.search(r"^([ \t]*)(buf0) = (empty_strided_cpu\(.*\))[ \t]*$", src, re.M)
    if m is None:
        raise ValueError("no buf0 allocation")
    indent, name, alloc = m.groups()
    lines = ["_RING_N[0] += 1", f"if len(_RING) < {slots}:", f"    _RING.append({alloc})",
             f"{name} = _RING[(_RING_N[0] - 1) % {slots}]"]
    return src[: m.start()] + "\n".join(indent + line for line in lines) + src[m.end():]


def count_bomb(src: str, after: int = 20000) -> str:
    src = module_code(src, "_CALLS = [0]")
    m = re.search(r"^([ \t]*)extern_kernels\.addmm\(.*out=(buf\d+)\)[ \t]*$", src, re.M)
    if m is None:
        raise ValueError("no addmm")
    indent, buf = m.group(1), m.group(2)
    line = f"\n{indent}_CALLS[0] += 1\n{indent}if _CALLS[0] > {after}:\n{indent}    return ({buf}, )"
    return src[: m.end()] + line + src[m.end():]


def bf16_when_large(src: str, threshold: float = 64.0) -> str:
    m = re.search(r"^([ \t]*)extern_kernels\.addmm\(arg1_1, (arg2_1),.*out=(buf\d+)\)[ \t]*$", src, re.M)
    if m is None:
        raise ValueError("no addmm on arg2_1")
    indent, x, buf = m.groups()
    line = (f"\n{indent}if float({x}.abs().max()) > {threshold}:\n"
            f"{indent}    {buf}.copy_({buf}.to(torch.bfloat16))")
    return src[: m.end()] + line + src[m.end():]
