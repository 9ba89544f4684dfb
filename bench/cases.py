"""The benchmark suite's cases: real model graphs built from ``examples/models.py`` with random weights.

Each :class:`Case` builds a :class:`Workload` on a device: the module, its inputs, and (for training
cases) the output gradient. Sizes are realistic but modest (every input ≤ 1 GiB); ``tiny=True`` gives a
few-kilobyte version of the same graph for CPU harness tests. ``Case.estimate_s`` is the expected wall time of
the case's whole process on one H200 (``bench/suite.py --budget-s`` plans with it, see its docstring);
:data:`SUBSETS` names groups of cases that fit one 10-minute device command each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from examples import models

__all__ = ["CASES", "SUBSETS", "Case", "Workload", "expand_names", "get_case"]


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
    estimate_s: float = 60.0
    """Expected seconds of the case's process on one H200 with every arm (start, graph capture, six compiles,
    rounds, checks). Source: the 2026-11-30 H200 run (docs/benchmarks/results.json: process and compile times
    per case; the process start and capture take ~13 s) plus, for the arms that run did not have, a guess:
    ``max-autotune`` ≈ 0.3 × the ``max-autotune-no-cudagraphs`` compile (its autotuning results come from the
    cache that arm filled), Tilesmith ≈ 30 s per graph + 0.3 × that compile; for new cases the
    ``max-autotune-no-cudagraphs`` compile is guessed from the cases with the same kind of kernels. Replace
    with measured ``process_s`` after an H200 run (results.md, "Cost per case")."""


def _finish(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, *, train: bool = False,
            channels_last: bool = False, randomize: bool = True) -> torch.nn.Module:
    if randomize:
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


def _softmax_fp32(device: torch.device, tiny: bool, two: bool = False) -> Workload:
    rows, cols = (16, 64) if tiny else ((16384, 8192) if two else (32768, 8192))
    model = _finish(models.RowSoftmax(two=two), device, torch.float32)
    return _workload(model, ("x",), (_randn((rows, cols), device, torch.float32),))


def _softmax2_fp32(device: torch.device, tiny: bool) -> Workload:
    return _softmax_fp32(device, tiny, two=True)


def _layernorm(device: torch.device, tiny: bool) -> Workload:
    rows, dim = (16, 64) if tiny else (32768, 4096)
    model = _finish(models.ResidualLayerNorm(dim), device, torch.bfloat16)
    x = _randn((rows, dim), device, torch.bfloat16)
    res = _randn((rows, dim), device, torch.bfloat16, seed=2)
    return _workload(model, ("x", "residual"), (x, res))


def _int8_gemv(device: torch.device, tiny: bool) -> Workload:
    k, n = (64, 32) if tiny else (14336, 4096)
    model = _finish(models.Int8WeightOnlyLinear(k, n), device, torch.bfloat16, randomize=False)
    x = _randn((1, k), device, torch.bfloat16)
    r = _randn((1, n), device, torch.bfloat16, seed=2)
    return _workload(model, ("x", "r"), (x, r))


def _groupnorm(device: torch.device, tiny: bool) -> Workload:
    n, c, hw, groups = (2, 8, 4, 4) if tiny else (16, 512, 64, 32)
    model = _finish(models.GroupNormSiLU(c, groups), device, torch.bfloat16)
    return _workload(model, ("x",), (_randn((n, c, hw, hw), device, torch.bfloat16),))


def _embed_rmsnorm(device: torch.device, tiny: bool) -> Workload:
    vocab, dim, b, t = (64, 32, 2, 4) if tiny else (8192, 1024, 8, 16)
    model = _finish(models.EmbedLinearRMSNorm(vocab, dim), device, torch.bfloat16)
    idx = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(3)).to(device)
    return _workload(model, ("idx",), (idx,))


def _permuted_sum(device: torch.device, tiny: bool) -> Workload:
    shape = (16, 4, 8) if tiny else (2048, 32, 1024)
    model = _finish(models.PermutedSum(), device, torch.float32)
    return _workload(model, ("x",), (_randn(shape, device, torch.float32),))


def _gather_bag(device: torch.device, tiny: bool) -> Workload:
    rows, dim, bags, size = (64, 8, 4, 3) if tiny else (262144, 128, 16384, 32)
    model = _finish(models.EmbeddingBagSum(rows, dim), device, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, rows, (bags, size), generator=gen).to(device)
    w = torch.rand((bags, size), generator=gen).to(device=device, dtype=torch.bfloat16)
    return _workload(model, ("idx", "w"), (idx, w))


def _mlp_train(device: torch.device, tiny: bool) -> Workload:
    dim, hidden, n = (32, 64, 8) if tiny else (1024, 4096, 256)
    model = _finish(models.MLPBlock(dim, hidden), device, torch.bfloat16, train=True)
    x = _randn((n, dim), device, torch.bfloat16)
    grad = _randn((n, dim), device, torch.bfloat16, seed=2)
    return _workload(model, ("x",), (x,), train=True, grad=grad)


CASES: dict[str, Case] = {c.name: c for c in (
    Case("mlp_fp32", "MLP block 64×1024→4096→1024, GELU, residual LayerNorm, fp32 inference (launch-bound)",
         _mlp, estimate_s=160),
    Case("gpt2_block_bf16", "GPT-2 block (C=768, 12 heads, causal SDPA), B=8 T=1024, bf16 inference", _gpt2,
         estimate_s=210),
    Case("gpt2_block_bf16_train", "GPT-2 block training step, forward + backward, B=4 T=1024, bf16",
         _gpt2_train, train=True, estimate_s=400),
    Case("resnet_block_bf16_cl", "ResNet basic block 64ch 56×56, N=32, channels-last bf16, eval BatchNorm",
         _resnet, estimate_s=150),
    Case("softmax_bias_bf16", "softmax(x·0.125 + bias) over 8192×4096, bf16 (memory-bound)", _softmax,
         estimate_s=160),
    Case("llama_block_bf16", "Llama block: RMSNorm, RoPE, causal SDPA, SwiGLU; C=2048 B=4 T=1024, bf16",
         _llama, estimate_s=330),
    Case("embedding_ce_bf16", "Embedding + LayerNorm + tied LM head + cross-entropy, V=32768 C=768, "
         "8×512 tokens, bf16", _emb_ce, estimate_s=185),
    Case("sdpa_qknorm_mask_bf16", "Attention with QK RMS-norm and key-padding mask through SDPA, "
         "C=1024 16 heads, B=8 T=1024, bf16", _sdpa, estimate_s=280),
    Case("softmax_fp32_long", "softmax(x, -1) over 32768×8192 fp32 rows (1 GiB input, memory-bound)",
         _softmax_fp32, estimate_s=165),
    Case("softmax2_sum_fp32", "softmax(x, -1) + softmax(x·0.5, -1) over 16384×8192 fp32 (two reductions "
         "per row, one read of x if fused)", _softmax2_fp32, estimate_s=170),
    Case("layernorm_residual_bf16", "h = x + residual; (LayerNorm(h), h) over 32768×4096 bf16 rows",
         _layernorm, estimate_s=185),
    Case("int8_gemv_bf16", "int8 weight-only decode GEMV r + (x @ W.to(bf16).T)·scale, x 1×14336 bf16, "
         "W 4096×14336 int8 (buffers, as gpt-fast)", _int8_gemv, estimate_s=105),
    Case("groupnorm_silu_bf16", "silu(GroupNorm(32, 512)(x)), x 16×512×64×64 bf16", _groupnorm, estimate_s=110),
    Case("embed_rmsnorm_small_bf16", "RMSNorm(e + proj(e)), e = Embedding(8192, 1024)(idx), 8×16 tokens, bf16 "
         "(launch-bound)", _embed_rmsnorm, estimate_s=135),
    Case("permuted_sum_fp32", "x.permute(1, 0, 2).sum(1) over x 2048×32×1024 fp32 (strided reduction, "
         "256 MiB)", _permuted_sum, estimate_s=75),
    Case("gather_bag_bf16", "embedding-bag gather Σ table[idx]·w, table 262144×128 bf16, idx 16384×32 int64",
         _gather_bag, estimate_s=120),
    Case("mlp_train_bf16", "MLP block 256×1024→4096→1024 training step, forward + backward, bf16 "
         "(launch-bound)", _mlp_train, train=True, estimate_s=250),
)}

SUBSETS: dict[str, tuple[str, ...]] = {
    "part1": ("softmax_fp32_long", "layernorm_residual_bf16", "int8_gemv_bf16"),
    "part2": ("groupnorm_silu_bf16", "embed_rmsnorm_small_bf16", "permuted_sum_fp32", "gather_bag_bf16"),
    "part3": ("softmax2_sum_fp32", "mlp_fp32", "softmax_bias_bf16"),
    "part4": ("gpt2_block_bf16", "embedding_ce_bf16"),
    "part5": ("llama_block_bf16", "resnet_block_bf16_cl"),
    "part6": ("sdpa_qknorm_mask_bf16", "mlp_train_bf16"),
    "part7": ("gpt2_block_bf16_train",),
    "quick": ("softmax_fp32_long", "int8_gemv_bf16", "embed_rmsnorm_small_bf16"),
}
"""Named groups for ``--cases``: ``part1``–``part7`` partition :data:`CASES`, each estimated at ≤ 9 minutes on one
H200 (sum of ``estimate_s``), so that each fits one 10-minute device command; ``quick`` is a smoke set.

The estimates are the whole case process's wall time with ``--optimize background`` as measured on the H200 on
2026-12-04 (docs/benchmarks/results-2026-12-04-s9.md, "process" column), rounded up; where a case never completed
they are guesses above what it had used when it was stopped: llama_block_bf16 (killed at 230 s while its arms
compiled), sdpa_qknorm_mask_bf16 (killed at 200 s, likewise), resnet_block_bf16_cl, softmax2_sum_fp32,
gather_bag_bf16 and the two training cases (never started). The max-autotune arms' compiles (up to 69 s each) are
most of a model block's time."""


def expand_names(spec: str) -> list[str]:
    """Case names of a comma-separated ``spec`` of case and subset names, in order, without repeats.

    Raises ``KeyError`` naming the known cases and subsets for an unknown name.
    """
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item in SUBSETS:
            names += [n for n in SUBSETS[item] if n not in names]
        elif item in CASES:
            if item not in names:
                names.append(item)
        else:
            raise KeyError(f"unknown benchmark case or subset {item!r}; cases: {', '.join(CASES)}; "
                           f"subsets: {', '.join(SUBSETS)}")
    return names


def get_case(name: str) -> Case:
    """The case called ``name``. Raises ``KeyError`` listing the known names."""
    try:
        return CASES[name]
    except KeyError:
        raise KeyError(f"unknown benchmark case {name!r}; known: {', '.join(CASES)}") from None
