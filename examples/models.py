"""Model blocks with random weights for Tilesmith's examples and benchmark suite (no downloads).

Each block is an ordinary ``torch.nn.Module``; :func:`randomize_` gives every parameter and buffer
non-trivial random values (norm weights near 1, biases and running statistics small but non-zero), so
that no output is constant or independent of a weight (a known way for wrong kernels to pass checks:
https://github.com/AI-Hypercomputer/accelerator-agents/pull/50, zero-initialized weights made 19 baselines
constant).

Shapes below use ``B`` batch, ``T`` sequence length, ``C`` model width, ``H`` heads, ``D = C / H``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "EmbedLinearRMSNorm",
    "EmbeddingBagSum",
    "EmbeddingLossHead",
    "GPT2Block",
    "GroupNormSiLU",
    "Int8WeightOnlyLinear",
    "LlamaBlock",
    "MLPBlock",
    "PermutedSum",
    "QKNormMaskedAttention",
    "RMSNorm",
    "ResNetBasicBlock",
    "ResidualLayerNorm",
    "RowSoftmax",
    "SoftmaxWithBias",
    "apply_rotary",
    "randomize_",
    "rotary_tables",
]


class MLPBlock(nn.Module):
    """``LayerNorm(x + fc2(gelu(fc1(x))))``: a transformer MLP with a residual LayerNorm.

    Input ``x``: ``[N, dim]``; output the same shape and dtype.
    """

    def __init__(self, dim: int = 1024, hidden: int = 4096) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.ln = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x + self.fc2(F.gelu(self.fc1(x))))


class GPT2Block(nn.Module):
    """A GPT-2 transformer block: pre-LayerNorm causal self-attention (SDPA) and a tanh-GELU MLP.

    Input ``x``: ``[B, T, dim]``; output the same shape and dtype. ``dim`` must be divisible by ``heads``.
    """

    def __init__(self, dim: int = 768, heads: int = 12) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"GPT2Block: dim={dim} is not divisible by heads={heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class ResNetBasicBlock(nn.Module):
    """ResNet basic block: ``relu(x + bn2(conv2(relu(bn1(conv1(x))))))`` with 3×3 convolutions.

    Input ``x``: ``[N, channels, H, W]`` (use ``memory_format=torch.channels_last`` for the fast path);
    output the same shape. Use in ``eval()`` mode for inference (BatchNorm reads running statistics).
    """

    def __init__(self, channels: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class SoftmaxWithBias(nn.Module):
    """Memory-bound row softmax with a learned bias: ``softmax(x * scale + bias, dim=-1)``.

    Input ``x``: ``[rows, cols]``; output the same shape and dtype.
    """

    def __init__(self, cols: int = 4096, scale: float = 0.125) -> None:
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.zeros(cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * self.scale + self.bias, dim=-1)


class RMSNorm(nn.Module):
    """Llama RMSNorm: ``x / sqrt(mean(x², -1) + eps) * weight``, computed in fp32, returned in ``x.dtype``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``[seq_len, head_dim]`` (fp32) of rotary position embedding (RoPE)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [B, H, T, D]`` with ``cos``/``sin [T, D]`` ("rotate half" convention, as in Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class LlamaBlock(nn.Module):
    """A Llama decoder block: RMSNorm, rotary-embedded causal attention (SDPA), RMSNorm, SwiGLU MLP.

    Input ``x``: ``[B, T, dim]`` with ``T <= max_seq``; output the same shape and dtype.
    """

    def __init__(self, dim: int = 2048, heads: int = 16, hidden: int = 5632, max_seq: int = 2048) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"LlamaBlock: dim={dim} is not divisible by heads={heads}")
        self.heads = heads
        self.attn_norm = RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        cos, sin = rotary_tables(max_seq, dim // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        cos, sin = self.cos[:t], self.sin[:t]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.wo(y)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class EmbeddingLossHead(nn.Module):
    """Token embedding, final LayerNorm, tied LM head and mean cross-entropy (computed in fp32).

    Inputs: ``idx`` and ``targets``, int64 ``[B, T]`` in ``[0, vocab)``. Output: a 0-d fp32 loss.
    """

    def __init__(self, vocab: int = 32768, dim: int = 768) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.ln = nn.LayerNorm(dim)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.wte(idx))
        logits = h @ self.wte.weight.t()
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class QKNormMaskedAttention(nn.Module):
    """Self-attention with per-head RMS QK-norm and a key-padding mask, through SDPA.

    Inputs: ``x [B, T, dim]`` and ``keep [B, T]`` (bool, True = attend to this key; keep at least one key
    per row, or that row's output is NaN). Output ``[B, T, dim]`` in ``x.dtype``.
    """

    def __init__(self, dim: int = 1024, heads: int = 16) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"QKNormMaskedAttention: dim={dim} is not divisible by heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = RMSNorm(dim // heads)
        self.k_norm = RMSNorm(dim // heads)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class RowSoftmax(nn.Module):
    """Row softmax with no parameters: ``softmax(x, -1)``; with ``two=True`` the sum of two softmaxes of the
    same rows at two temperatures, ``softmax(x, -1) + softmax(x * 0.5, -1)`` (one read of ``x`` if fused).

    Input ``x``: ``[rows, cols]``; output the same shape and dtype.
    """

    def __init__(self, two: bool = False) -> None:
        super().__init__()
        self.two = two

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.softmax(x, dim=-1)
        return y + torch.softmax(x * 0.5, dim=-1) if self.two else y


class ResidualLayerNorm(nn.Module):
    """Pre-norm residual stream step: ``h = x + residual``; returns ``(LayerNorm(h), h)``.

    Inputs ``x``, ``residual``: ``[rows, dim]``; outputs two tensors of that shape and dtype.
    """

    def __init__(self, dim: int = 4096) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + residual
        return self.ln(h), h


class Int8WeightOnlyLinear(nn.Module):
    """gpt-fast's int8 weight-only linear layer plus a residual: ``r + (x @ W.to(x.dtype).T) * scales``.

    ``weight`` (int8 ``[out, in]``) and ``scales`` (``[out]``, floating) are buffers, as in gpt-fast's
    ``WeightOnlyInt8Linear``, so ``torch.compile`` sees them as module state rather than parameters. They are
    set by symmetric per-row quantization of a seeded ``N(0, 1/in)`` matrix (``scales = absmax / 127``), so
    :func:`randomize_` must not be applied afterwards (it would overwrite ``scales``).

    Inputs: ``x [..., in]`` and ``r [..., out]`` (bf16 for decode: ``[1, in]``); output ``[..., out]``.
    """

    def __init__(self, in_features: int = 14336, out_features: int = 4096, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)
        scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return r + F.linear(x, self.weight.to(dtype=x.dtype)) * self.scales


class GroupNormSiLU(nn.Module):
    """``silu(GroupNorm(groups, channels)(x))``, the normalization step of diffusion U-Nets and VAEs.

    Input ``x``: ``[N, channels, H, W]``; output the same shape and dtype.
    """

    def __init__(self, channels: int = 512, groups: int = 32) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(x))


class EmbedLinearRMSNorm(nn.Module):
    """``RMSNorm(e + proj(e))`` with ``e = Embedding(idx)``: a small, launch-bound front of a language model.

    Input ``idx``: int64 ``[B, T]`` in ``[0, vocab)``; output ``[B, T, dim]`` in the module's dtype.
    """

    def __init__(self, vocab: int = 8192, dim: int = 1024) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm = RMSNorm(dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        e = self.emb(idx)
        return self.norm(e + self.proj(e))


class PermutedSum(nn.Module):
    """A strided reduction: ``x.permute(1, 0, 2).sum(dim=1)``, i.e. the sum over ``x``'s outermost dim read
    through a permuted view (stride ``B·C`` elements between the reduced elements), accumulated in fp32.

    Input ``x``: ``[A, B, C]``; output ``[B, C]`` in fp32.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(1, 0, 2).float().sum(dim=1)


class EmbeddingBagSum(nn.Module):
    """Embedding-bag style gather: ``Σ_j table[idx[i, j]] · w[i, j]`` over each bag, accumulated in fp32.

    Inputs: ``idx`` int64 ``[bags, bag_size]`` in ``[0, rows)``, ``w`` ``[bags, bag_size]`` per-sample weights
    (the table's dtype). Output ``[bags, dim]`` fp32.
    """

    def __init__(self, rows: int = 262144, dim: int = 128) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(rows, dim))

    def forward(self, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows = torch.index_select(self.table, 0, idx.flatten()).view(*idx.shape, -1)
        return (rows.float() * w.float()[..., None]).sum(dim=1)


@torch.no_grad()
def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every floating parameter and buffer of ``module`` with seeded random values, in place.

    Matrices and convolution kernels: ``N(0, 1/fan_in)``; 1-d ``weight``/``*_var`` (norm scales, running
    variances): ``1 + U(0, 0.2)``, 1-d others (biases, running means): ``N(0, 0.05²)``. Embeddings:
    ``N(0, 0.02²)`` (GPT-2's initialisation). RoPE tables (``cos``/``sin``) are left as they are. Returns ``module``.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        leaf = name.rsplit(".", 1)[-1]
        if not tensor.is_floating_point() or leaf in ("cos", "sin"):
            continue
        if tensor.dim() >= 2:
            if isinstance(_owner(module, name), nn.Embedding):
                values = 0.02 * torch.randn(tensor.shape, generator=gen)
            else:
                values = torch.randn(tensor.shape, generator=gen) / math.sqrt(tensor[0].numel())
        elif leaf == "weight" or leaf.endswith("_var"):
            values = 1.0 + 0.2 * torch.rand(tensor.shape, generator=gen)
        else:
            values = 0.05 * torch.randn(tensor.shape, generator=gen)
        tensor.copy_(values.to(tensor.dtype))
    return module


def _owner(root: nn.Module, name: str) -> nn.Module:
    path = name.rsplit(".", 1)[0] if "." in name else ""
    return root.get_submodule(path) if path else root
