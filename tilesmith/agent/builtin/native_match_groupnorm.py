"""Recognising ``silu(group_norm(x, G, w, b, eps))`` in a captured FX program (native family ``group_norm``).

The FX program Inductor receives decomposes GroupNorm into (``x`` NCHW ``[N, C, *spatial]``, ``HW`` the
product of the spatial sizes, 16-bit inputs upcast to fp32 first)::

    v = view(xf, [N, G, C/G, HW]);  var, mean = var_mean(v, [2, 3], correction=0, keepdim=True)
    rstd = rsqrt(var + eps)
    affine (weight, optionally bias):   s = rstd * view(w, [1, G, C/G, 1]);  t = -mean * s (+ view(b, ...))
                                        y = xf * bcast(s) + bcast(t)   (bcast: as_strided [N, C] + unsqueezes)
      or (the CUDA graphs of torch 2.11): y = view((v - mean) * rstd, x.shape) * unsqueeze(w) (+ unsqueeze(b))
    no weight:                          y = view((v - mean) * rstd, x.shape) (+ unsqueeze(b) broadcast)

then optionally SiLU — ``y / (1 + exp(-y))``, ``y * sigmoid(y)`` or ``aten.silu`` — and a downcast to x's
dtype. A downcast of ``y`` to x's 16-bit dtype before the SiLU (the ``y * sigmoid(y)`` form in bf16) is
``round_before_silu``; upcasts of an fp32 value (no-ops) are looked through.

Plan: ``group_norm.group_norm(x, weight, bias, num_groups, eps, silu, round_before_silu, variant)``; bytes
moved: x read once, the output written once, weight and bias read once.

Refused (:class:`NoMatch`, with the reason): x not a contiguous NCHW graph input (channels-last and other
strides: the kernel reads each group as one contiguous span), groups of 2^30 elements or more, an output of
another dtype, any other operation or output (checked by ``match_program``'s whole-graph rule).
"""

from __future__ import annotations

import math
from typing import Any

from tilesmith.agent.builtin.native_match_base import (_CONVERT, _VIEWS, FLOATS, NONE, Arg, NativePlan, NoMatch,
                                                       _lit, _rsqrt_of_eps_add, _unclone, _upcast_source,
                                                       _vector_input, _Walk)
from tilesmith.fx_text import DType, Meta, Ref

#: Largest group (C / G * HW elements) the kernels take (``csrc/group_norm_bind.cpp``: ``kMaxGroup``).
GROUP_NORM_MAX_GROUP = 1 << 30
_VAR_MEAN = "aten.var_mean.correction"
_BROADCASTS = ("aten.unsqueeze.default", "aten.expand.default", *_VIEWS)


def match_group_norm(walk: _Walk) -> NativePlan:
    """The plan of a graph that is exactly ``[silu](group_norm(x, G, [w], [b], eps))`` (see the module doc).

    Raises:
        NoMatch: the reason the graph is not that pattern.
    """
    vms = [n for n in walk.g.calls() if n.op == _VAR_MEAN]
    if len(vms) != 1:
        raise NoMatch(f"{len(vms)} var_mean operations (the pattern has one)")
    vm = walk.call(Ref(vms[0].name))
    if vm.kwargs.get("correction") != 0 or vm.kwargs.get("keepdim") is not True:
        raise NoMatch("var_mean is not the biased (correction=0, keepdim) variance")
    grouped = vm.args[0]
    dims = vm.args[1] if len(vm.args) > 1 else vm.kwargs.get("dim")
    if len(walk.meta(grouped).shape) != 4 or tuple(d % 4 for d in dims or ()) != (2, 3):
        raise NoMatch("var_mean is not over the last two dimensions of a [N, G, C/G, HW] view")
    xf = walk.call(grouped, *_VIEWS).args[0]
    x_idx, x_meta, x_ref = _input(walk, xf)
    n, c = x_meta.shape[0], x_meta.shape[1]
    hw = math.prod(x_meta.shape[2:])
    g = walk.meta(grouped).shape[1]
    if walk.meta(grouped).shape != (n, g, c // max(1, g), hw) or c % g:
        raise NoMatch(f"the statistics view {list(walk.meta(grouped).shape)} is not [N, G, C/G, HW] of x "
                      f"{list(x_meta.shape)}")
    if (c // g) * hw >= GROUP_NORM_MAX_GROUP:
        raise NoMatch(f"groups of {(c // g) * hw} elements (the kernels take fewer than 2^30)")
    var, mean = _var_mean_items(walk, vm)
    rstd, eps = _rstd(walk, var)

    out = walk.single_output()
    out_meta = walk.meta(out)
    if out_meta.dtype != x_meta.dtype or out_meta.shape != x_meta.shape:
        raise NoMatch(f"the output is {out_meta.dtype}{list(out_meta.shape)}, x {x_meta.dtype}{list(x_meta.shape)} "
                      "(the kernel keeps shape and dtype)")
    y = out
    if walk.is_call(y, _CONVERT):
        conv = walk.call(y)
        if tuple(conv.args[1:2]) != (DType(x_meta.dtype),):
            raise NoMatch(f"the output conversion {conv.args[1:2]} is not to x's dtype")
        y = conv.args[0]
    y, silu, round_mid = _silu(walk, y, x_meta.dtype)
    ctx = _Ctx(walk, xf, grouped, mean, rstd, n, c, g, len(x_meta.shape))
    weight, bias = _affine(ctx, y)

    args = (Arg(input=x_idx), _opt(walk, weight), _opt(walk, bias), Arg(literal=str(g)), _lit(float(eps)),
            _lit(silu), _lit(round_mid), Arg(literal="0"))
    moved = x_meta.nbytes + out_meta.nbytes + sum(walk.meta(v).nbytes for v in (weight, bias) if v is not None)
    parts = [p for p, v in (("weight", weight), ("bias", bias)) if v is not None]
    desc = (f"{'silu(' if silu else ''}GroupNorm({g}, {c}){')' if silu else ''} over x {x_meta.dtype}"
            f"{list(x_meta.shape)} ({n * g} groups of {(c // g) * hw}, eps {float(eps):g}"
            f"{''.join(', ' + p for p in parts)}{', rounded before the SiLU' if round_mid else ''})")
    return NativePlan("group_norm", "group_norm", args, (None,), desc, moved)


class _Ctx:
    """What the affine forms are checked against."""

    def __init__(self, walk: _Walk, xf: Any, grouped: Any, mean: Ref, rstd: Ref, n: int, c: int, g: int, ndim: int):
        self.walk, self.xf, self.grouped, self.mean, self.rstd = walk, xf, grouped, mean, rstd
        self.n, self.c, self.g, self.ndim = n, c, g, ndim


def _opt(walk: _Walk, value: Any) -> Arg:
    return Arg(input=walk.input_index(value)) if value is not None else NONE


def _input(walk: _Walk, xf: Any) -> tuple[int, Meta, Any]:
    """``(index, meta, ref)`` of x, for ``xf = convert(x, f32)`` (16-bit x) or ``xf = x`` (fp32)."""
    x = _unclone(walk, _upcast_source(walk, xf))
    idx = walk.input_index(x)
    if idx is None:
        raise NoMatch("x is computed in the graph, not a graph input")
    meta = walk.meta(x)
    if meta.dtype not in FLOATS or (meta.dtype != "f32" and x == xf):
        raise NoMatch(f"input dtype {meta.dtype}")
    if len(meta.shape) < 2:
        raise NoMatch(f"x {list(meta.shape)} has no channel dimension")
    if not meta.is_contiguous():
        raise NoMatch(f"x {x.name} is not contiguous NCHW (sizes {list(meta.shape)}, strides {list(meta.stride)}): "
                      "the group_norm kernel reads each (n, g) group as one contiguous span (channels-last is not "
                      "supported yet)")
    return idx, meta, x


def _var_mean_items(walk: _Walk, vm: Any) -> tuple[Ref, Ref]:
    items = {}
    for node in walk.g.nodes.values():
        if node.kind == "getitem" and node.source == vm.name:
            if node.index in items:
                raise NoMatch(f"var_mean[{node.index}] is read twice")
            items[node.index] = node.name
            walk.used.add(node.name)
    if set(items) != {0, 1}:
        raise NoMatch("var_mean's variance and mean are not both used")
    return Ref(items[0]), Ref(items[1])


def _rstd(walk: _Walk, var: Ref) -> tuple[Ref, float]:
    rstd, stat, eps = _rsqrt_of_eps_add(walk)
    if stat != var:
        raise NoMatch("the rsqrt is not of var + eps")
    return rstd, eps


def _silu(walk: _Walk, y: Any, dtype: str) -> tuple[Any, bool, bool]:
    """``(pre-activation, silu, round_before_silu)`` for ``y``: one of the SiLU forms, or no activation."""
    t = None
    if walk.is_call(y, "aten.silu.default"):
        t = walk.call(y).args[0]
    elif walk.is_call(y, "aten.div.Tensor"):
        div = walk.call(y)
        t = div.args[0]
        den = walk.call(div.args[1], "aten.add.Tensor", "aten.add.Scalar")
        one, e = walk.split(den, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
        neg = walk.call(walk.call(e, "aten.exp.default").args[0], "aten.neg.default")
        if one != 1 or neg.args[0] != t:
            raise NoMatch(f"{div.name} is not y / (1 + exp(-y))")
    elif walk.is_call(y, "aten.mul.Tensor"):
        mul = walk.call(y)
        a, b = mul.args[0], mul.args[1]
        for left, right in ((a, b), (b, a)):
            if walk.is_call(right, "aten.sigmoid.default") and walk.g.node(right).args[0] == left:
                walk.call(right)
                t = left
                break
        else:
            return y, False, False  # a multiplication of the normalization itself (checked by _affine)
    else:
        return y, False, False
    rounded = False
    while walk.is_call(t, _CONVERT):
        conv = walk.call(t)
        target, src = conv.args[1] if len(conv.args) > 1 else None, conv.args[0]
        if target == DType("f32"):
            t = src  # an upcast (exact), or a no-op on an fp32 value
        elif target == DType(dtype) and dtype != "f32" and walk.meta(src).dtype == "f32":
            t, rounded = src, True
        else:
            raise NoMatch(f"{conv.name} converts the normalized value to {target}")
    return t, True, rounded


def _affine(ctx: _Ctx, y: Any) -> tuple[Any, Any]:
    """``(weight, bias)`` graph inputs (or ``None``) of the normalization ``y`` in one of its FX forms."""
    walk = ctx.walk
    add = walk.call(y, "aten.add.Tensor", "aten.mul.Tensor", *_VIEWS)
    if add.op in _VIEWS:  # no affine: view((v - mean) * rstd, x.shape)
        _centred(ctx, add)
        return None, None
    a, b = add.args[0], add.args[1]
    if add.op == "aten.mul.Tensor":  # weight only (the CUDA form): view(centred) * unsqueeze(w)
        if not (walk.is_call(a, *_VIEWS) or walk.is_call(b, *_VIEWS)):
            raise NoMatch(f"{add.name} = aten.mul.Tensor is not part of the GroupNorm decomposition (not the centred "
                          "normalization times a weight)")
        view, side = (a, b) if walk.is_call(a, *_VIEWS) else (b, a)
        _centred(ctx, walk.call(view))
        return _channel_vector(ctx, side, keep_dims=True), None
    if walk.is_call(a, *_VIEWS) or walk.is_call(b, *_VIEWS):  # bias only: view(...) + unsqueeze(b)
        view, side = (a, b) if walk.is_call(a, *_VIEWS) else (b, a)
        _centred(ctx, walk.call(view))
        return None, _channel_vector(ctx, side, keep_dims=True)
    for m_side, b_side in ((a, b), (b, a)):  # the CUDA form: view(centred) * unsqueeze(w) + unsqueeze(b)
        if _is_centred_times_weight(ctx, m_side):
            weight, _ = _affine(ctx, m_side)
            return weight, _channel_vector(ctx, b_side, keep_dims=True)
    mul_side, shift = (a, b) if _is_scale_mul(ctx, a) else (b, a)
    mul = walk.call(mul_side, "aten.mul.Tensor")
    scale = mul.args[1] if mul.args[0] == ctx.xf else mul.args[0]
    s_src = _per_group(ctx, scale)
    weight = None
    if s_src != ctx.rstd:
        s_mul = walk.call(s_src, "aten.mul.Tensor")
        w_view, other = walk.split(s_mul, lambda v: v != ctx.rstd)
        if other != ctx.rstd:
            raise NoMatch(f"{s_mul.name} is not rstd * weight")
        weight = _channel_vector(ctx, w_view, keep_dims=False)
    t_src = _per_group(ctx, shift)
    bias = None
    if walk.is_call(t_src, "aten.add.Tensor"):
        t_add = walk.call(t_src)
        ta, tb = t_add.args[0], t_add.args[1]
        b_view, t_src = (tb, ta) if walk.is_call(ta, "aten.mul.Tensor") else (ta, tb)
        bias = _channel_vector(ctx, b_view, keep_dims=False)
    t_mul = walk.call(t_src, "aten.mul.Tensor")
    neg_side, s_side = (t_mul.args[0], t_mul.args[1]) if walk.is_call(t_mul.args[0], "aten.neg.default") \
        else (t_mul.args[1], t_mul.args[0])
    neg = walk.call(neg_side, "aten.neg.default")
    if neg.args[0] != ctx.mean or s_side != s_src:
        raise NoMatch(f"{t_mul.name} is not -mean * scale")
    return weight, bias


def _is_centred_times_weight(ctx: _Ctx, value: Any) -> bool:
    node = ctx.walk.g.node(value)
    return (node is not None and node.op == "aten.mul.Tensor" and ctx.xf not in node.args[:2]
            and any(ctx.walk.is_call(v, *_VIEWS) for v in node.args[:2]))


def _is_scale_mul(ctx: _Ctx, value: Any) -> bool:
    node = ctx.walk.g.node(value)
    return node is not None and node.op == "aten.mul.Tensor" and ctx.xf in node.args[:2]


def _centred(ctx: _Ctx, view: Any) -> None:
    """``view`` is ``view((v - mean) * rstd, x.shape)`` (``rstd`` on either side)."""
    walk = ctx.walk
    mul = walk.call(view.args[0], "aten.mul.Tensor")
    _rs, centred = walk.split(mul, lambda v: v == ctx.rstd)
    sub = walk.call(centred, "aten.sub.Tensor")
    if tuple(sub.args[:2]) != (ctx.grouped, ctx.mean):
        raise NoMatch("the centring is not the grouped x minus the group mean")


def _per_group(ctx: _Ctx, value: Any) -> Any:
    """The [N, G, C/G, 1] (or [N, G, 1, 1]) tensor ``value`` broadcasts per channel over [N, C, *spatial]."""
    walk = ctx.walk
    meta = walk.meta(value)
    if meta.shape != (ctx.n, ctx.c) + (1,) * (ctx.ndim - 2):
        raise NoMatch(f"{getattr(value, 'name', value)} is not a per-(n, c) factor [N, C, 1...]")
    cur = value
    while walk.is_call(cur, "aten.unsqueeze.default"):
        cur = walk.call(cur).args[0]
    if walk.is_call(cur, "aten.as_strided.default"):
        node = walk.call(cur)
        if tuple(node.args[1:3]) != ((ctx.n, ctx.c), (ctx.c, 1)) or any(a not in (0, None) for a in node.args[3:4]):
            raise NoMatch(f"{node.name} is not the [N, C] view of the per-group factors")
        cur = node.args[0]
    elif walk.is_call(cur, *_VIEWS):
        cur = walk.call(cur).args[0]
    src = walk.meta(cur)
    if src.shape not in ((ctx.n, ctx.g, ctx.c // ctx.g, 1), (ctx.n, ctx.g, 1, 1)) or not src.is_contiguous():
        raise NoMatch(f"{getattr(cur, 'name', cur)} {list(src.shape)} is not a contiguous [N, G, C/G, 1] factor")
    return cur


def _channel_vector(ctx: _Ctx, value: Any, *, keep_dims: bool) -> Any:
    """The [C] graph input behind ``view(w, [1, G, C/G, 1])`` (``keep_dims``: ``unsqueeze``s to [1, C, 1...])."""
    walk = ctx.walk
    cur = value
    while walk.is_call(cur, *_BROADCASTS):
        cur = walk.call(cur).args[0]
    want = (1, ctx.c) + (1,) * (ctx.ndim - 2) if keep_dims else (1, ctx.g, ctx.c // ctx.g, 1)
    if cur == value or walk.meta(value).shape != want or not _vector_input(walk, cur, ctx.c):
        raise NoMatch(f"{getattr(value, 'name', value)} is not a [{ctx.c}] weight or bias input broadcast per "
                      "channel")
    return cur
