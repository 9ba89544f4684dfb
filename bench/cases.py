"""The benchmark suite's cases: real model graphs built from ``examples/models.py`` with random weights.

Each :class:`Case` builds a :class:`Workload` on a device: the module, its inputs, and (for training
cases) the output gradient. Sizes are realistic but modest so the whole suite fits in ~8 minutes on one
H200; ``tiny=True`` gives a few-kilobyte version of the same graph for CPU harness tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from examples import models

__all__ = ["CASES", "Case", "Workload", "get_case"]


@dataclass
class Workload:
    """What one case runs: ``model(*inputs)``; for ``train`` also ``out.backward(grad)``."""

    model: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    train: bool = False
    grad: torch.Tensor | None = None
    shapes: dict[str, str] = field(default_factory=dict)
    """Readable input shapes for reports, e.g. ``{"x": "bf16[8, 1024, 768]"}``."""


@dataclass(frozen=True)
class Case:
    """One benchmark case."""

    name: str
    description: str
    build: Callable[[torch.device, bool], Workload]
    """``build(device, tiny)`` returns a fresh, seeded workload."""
    train: bool = False


def _finish(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, *, train: bool = False,
            channels_last: bool = False) -> torch.nn.Module:
    models.randomize_(model, seed=0)
    model = model.to(device=device, dtype=dtype)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train(train)
    model.requires_grad_(train)
    return model


def _randn(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _label(t: torch.Tensor) -> str:
    from torch.fx.graph import dtype_abbrs

    return f"{dtype_abbrs.get(t.dtype, str(t.dtype))}[{', '.join(map(str, t.shape))}]"


def _workload(model: torch.nn.Module, names: tuple[str, ...], inputs: tuple[torch.Tensor, ...], *,
              train: bool = False, grad: torch.Tensor | None = None) -> Workload:
    return Workload(model, inputs, train, grad, {n: _label(t) for n, t in zip(names, inputs, strict=True)})


def _mlp(device: torch.device, tiny: bool) -> Workload:
    dim, hidden, n = (32, 64, 8) if tiny else (1024, 4096, 64)
    model = _finish(models.MLPBlock(dim, hidden), device, torch.float32)
    return _workload(model, ("x",), (_randn((n, dim), device, torch.float32),))


def _gpt2(device: torch.device, tiny: bool) -> Workload:
    b, t, c, h = (2, 16, 32, 2) if tiny else (8, 1024, 768, 12)
    model = _finish(models.GPT2Block(c, h), device, torch.bfloat16)
    return _workload(model, ("x",), (_randn((b, t, c), device, torch.bfloat16),))


def _gpt2_train(device: torch.device, tiny: bool) -> Workload:
    b, t, c, h = (2, 16, 32, 2) if tiny else (4, 1024, 768, 12)
    model = _finish(models.GPT2Block(c, h), device, torch.bfloat16, train=True)
    x = _randn((b, t, c), device, torch.bfloat16)
    grad = _randn((b, t, c), device, torch.bfloat16, seed=2)
    return _workload(model, ("x",), (x,), train=True, grad=grad)


def _resnet(device: torch.device, tiny: bool) -> Workload:
    n, ch, hw = (2, 8, 8) if tiny else (32, 64, 56)
    model = _finish(models.ResNetBasicBlock(ch), device, torch.bfloat16, channels_last=True)
    x = _randn((n, ch, hw, hw), device, torch.bfloat16).contiguous(memory_format=torch.channels_last)
    return _workload(model, ("x",), (x,))


def _softmax(device: torch.device, tiny: bool) -> Workload:
    rows, cols = (16, 64) if tiny else (8192, 4096)
    model = _finish(models.SoftmaxWithBias(cols), device, torch.bfloat16)
    return _workload(model, ("x",), (_randn((rows, cols), device, torch.bfloat16),))


def _llama(device: torch.device, tiny: bool) -> Workload:
    b, t, c, h, hidden = (2, 16, 32, 2, 64) if tiny else (4, 1024, 2048, 16, 5632)
    model = _finish(models.LlamaBlock(c, h, hidden, max_seq=t), device, torch.bfloat16)
    return _workload(model, ("x",), (_randn((b, t, c), device, torch.bfloat16),))


def _emb_ce(device: torch.device, tiny: bool) -> Workload:
    vocab, dim, b, t = (128, 32, 2, 16) if tiny else (32768, 768, 8, 512)
    model = _finish(models.EmbeddingLossHead(vocab, dim), device, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, vocab, (b, t), generator=gen).to(device)
    targets = torch.randint(0, vocab, (b, t), generator=gen).to(device)
    return _workload(model, ("idx", "targets"), (idx, targets))


def _sdpa(device: torch.device, tiny: bool) -> Workload:
    b, t, c, h = (2, 16, 32, 2) if tiny else (8, 1024, 1024, 16)
    model = _finish(models.QKNormMaskedAttention(c, h), device, torch.bfloat16)
    x = _randn((b, t, c), device, torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=gen)
    keep = (torch.arange(t)[None, :] < lengths[:, None]).to(device)
    return _workload(model, ("x", "keep"), (x, keep))


CASES: dict[str, Case] = {c.name: c for c in (
    Case("mlp_fp32", "MLP block 64×1024→4096→1024, GELU, residual LayerNorm, fp32 inference (launch-bound)",
         _mlp),
    Case("gpt2_block_bf16", "GPT-2 block (C=768, 12 heads, causal SDPA), B=8 T=1024, bf16 inference", _gpt2),
    Case("gpt2_block_bf16_train", "GPT-2 block training step, forward + backward, B=4 T=1024, bf16",
         _gpt2_train, train=True),
    Case("resnet_block_bf16_cl", "ResNet basic block 64ch 56×56, N=32, channels-last bf16, eval BatchNorm",
         _resnet),
    Case("softmax_bias_bf16", "softmax(x·0.125 + bias) over 8192×4096, bf16 (memory-bound)", _softmax),
    Case("llama_block_bf16", "Llama block: RMSNorm, RoPE, causal SDPA, SwiGLU; C=2048 B=4 T=1024, bf16",
         _llama),
    Case("embedding_ce_bf16", "Embedding + LayerNorm + tied LM head + cross-entropy, V=32768 C=768, "
         "8×512 tokens, bf16", _emb_ce),
    Case("sdpa_qknorm_mask_bf16", "Attention with QK RMS-norm and key-padding mask through SDPA, "
         "C=1024 16 heads, B=8 T=1024, bf16", _sdpa),
)}


def get_case(name: str) -> Case:
    """The case called ``name``. Raises ``KeyError`` listing the known names."""
    try:
        return CASES[name]
    except KeyError:
        raise KeyError(f"unknown benchmark case {name!r}; known: {', '.join(CASES)}") from None
