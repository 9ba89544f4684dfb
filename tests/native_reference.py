"""Reference implementations of the native kernels' Python functions, in plain torch (fp64 arithmetic).

Same names and signatures as the extension modules built from ``tilesmith/kernels/csrc`` (so a CPU test can
stand one in for ``native_module(...)`` and run a rewritten wrapper), with the kernels' documented
semantics: int8 linear rounds the dot product to bf16 before the epilogue; the norm rounds ``x + r`` to the
input dtype; group_norm rounds before the SiLU only when asked (``round_before_silu``); everything else is computed in float64 and rounded once to the output dtype.
"""

from __future__ import annotations

import torch


def int8_linear(x, w, scale=None, bias=None, residual=None, out_dtype=None, variant=0):
    acc = (x.double() @ w.double().T).to(torch.bfloat16).double()
    if scale is not None:
        acc = acc * scale.double().reshape(-1)
    if bias is not None:
        acc = acc + bias.double().reshape(-1)
    if residual is not None:
        acc = acc + residual.double()
    return acc.to(out_dtype or torch.bfloat16)


def softmax(a, b=None, scale_a=1.0, bias_a=None, scale_b=1.0, bias_b=None, variant=0):
    def one(t, scale, bias):
        v = t.double() * scale
        if bias is not None:
            v = v + bias.double().reshape(-1)
        return torch.softmax(v, dim=-1)

    out = one(a, scale_a, bias_a)
    if b is not None:
        out = out + one(b, scale_b, bias_b)
    return out.to(a.dtype).contiguous()


def _sum(x, residual):
    return x if residual is None else (x + residual)  # in the input dtype, as the FX program's add


def rms_norm(x, residual=None, weight=None, eps=1e-6, round_before_weight=False, return_sum=False):
    h = _sum(x, residual)
    hd = h.double()
    y = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        if round_before_weight:
            y = y.to(x.dtype).double()
        y = y * weight.double()
    out = [y.to(x.dtype).contiguous()]
    if return_sum:
        out.append(h.contiguous())
    return out


def layer_norm(x, residual=None, weight=None, bias=None, eps=1e-5, return_sum=False):
    h = _sum(x, residual)
    hd = h.double()
    mean = hd.mean(-1, keepdim=True)
    var = (hd - mean).pow(2).mean(-1, keepdim=True)
    y = (hd - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    out = [y.to(x.dtype).contiguous()]
    if return_sum:
        out.append(h.contiguous())
    return out


def group_norm(x, weight=None, bias=None, num_groups=32, eps=1e-5, silu=True, round_before_silu=False, variant=0):
    n, c = x.shape[0], x.shape[1]
    grouped = x.double().reshape(n, num_groups, -1)
    mean = grouped.mean(-1, keepdim=True)
    var = (grouped - mean).pow(2).mean(-1, keepdim=True)
    y = ((grouped - mean) * torch.rsqrt(var + eps)).reshape(x.shape)
    per_channel = (1, c) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.double().reshape(per_channel)
    if bias is not None:
        y = y + bias.double().reshape(per_channel)
    if round_before_silu:
        y = y.to(x.dtype).double()
    if silu:
        y = y * torch.sigmoid(y)
    return y.to(x.dtype).contiguous()
