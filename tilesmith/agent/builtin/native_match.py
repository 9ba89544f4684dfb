"""Recognising, in a captured FX program, a graph whose whole computation one native kernel performs.

Matching is by semantics: ops, argument structure, dtypes, shapes and strides from the FX annotations
(:mod:`tilesmith.fx_text`), never kernel names. A graph matches only when *every* operation in it belongs to the
pattern and its outputs are exactly the pattern's outputs (the common benchmark case: one graph, one
pattern), so the rewrite can replace the whole body of ``call`` and nothing of Inductor's work is lost.

Patterns (``T`` one of fp32 / bf16 / fp16; row tensors must have unit inner stride and leading dimensions
that collapse into one row stride; outputs must be contiguous):

``int8_linear``
    ``mm(x2d, permute(convert(w_i8, bf16), [1, 0]))`` with ``x`` bf16 ``[..., K]`` (at most 16 rows; an
    ``x.view(M, K)`` and a ``view`` of the product back to ``[..., N]`` allowed), ``w`` int8 ``[N, K]``, then
    optionally ``* scale`` (a graph input with N elements), ``+ bias`` (N elements), ``+ residual`` (the
    output's shape), in that order (the two additions in either order).
``softmax``
    ``softmax(pre(x), -1)`` — the decomposed ``amax / sub / exp / sum / div`` chain or ``aten._softmax`` —
    where ``pre`` is an optional scalar ``*``/``/``, then an optional ``+ bias`` broadcast over rows, with
    optional upcasts to fp32; or ``softmax(pre(a)) + softmax(pre(b))``; output dtype = input dtype.
``norm``
    ``h = x (+ r)``; RMSNorm ``h * rsqrt(mean(h^2, -1) + eps)`` (then ``* w`` before or after the downcast, or
    no weight) or LayerNorm ``(h - mean) * rsqrt(var + eps)`` from ``var_mean(correction=0)`` (then ``* w``,
    ``+ b``); returning the normalized rows, optionally with ``h``; rows of at most :data:`NORM_MAX_D`.
``group_norm``
    ``silu(group_norm(x, G, w, b, eps))`` over contiguous NCHW ``x`` (SiLU and the affine parts optional):
    :mod:`.native_match_groupnorm`. Shared pieces (:class:`NoMatch`, :class:`NativePlan`, the walker) live in
    :mod:`.native_match_base`.

Refused (with the reason in :class:`NoMatch`): dynamic shapes, module constants, any extra operation or
output, other dtypes, non-row layouts, too many rows (int8) or too-wide rows (norm).
"""

from __future__ import annotations

import math
from typing import Any

from tilesmith.agent.builtin.native_match_base import (_CONVERT, _VIEWS, FLOATS, INT8_MAX_M, NONE, NORM_MAX_D,
                                                       TORCH_NAME, Arg, NativePlan, NoMatch, _last_dim, _lit,
                                                       _row_input, _rsqrt_of_eps_add, _unclone, _upcast_source,
                                                       _vector_input, _Walk)
from tilesmith.agent.builtin.native_match_groupnorm import match_group_norm
from tilesmith.fx_text import DType, FxTextError, Meta, Ref, parse_fx

__all__ = ["FLOATS", "INT8_MAX_M", "NORM_MAX_D", "TORCH_NAME", "Arg", "NativePlan", "NoMatch", "match_program"]


def match_program(fx_program: str) -> NativePlan:
    """The :class:`NativePlan` of the first family whose pattern is the whole graph.

    Raises:
        NoMatch: no family matches (message: the graph-level reason, or one reason per family).
    """
    try:
        g = parse_fx(fx_program)
    except FxTextError as exc:
        raise NoMatch(str(exc)) from None
    if g.dynamic:
        raise NoMatch("dynamic shapes (symbolic sizes or SymInt inputs): the kernels are matched to static shapes")
    if any(n.kind == "attr" for n in g.nodes.values()):
        raise NoMatch("the graph reads module constants (self.<attr>)")
    if any(n.kind == "other" for n in g.nodes.values()):
        raise NoMatch("the graph has statements that are not operator calls")
    devices = {g.nodes[p].meta.device for p in g.placeholders if g.nodes[p].meta is not None}
    if len(devices) > 1:
        raise NoMatch(f"inputs on several devices {sorted(devices)}")
    reasons = []
    for family, matcher in (("int8_linear", _match_int8), ("softmax", _match_softmax), ("norm", _match_norm),
                            ("group_norm", match_group_norm)):
        walk = _Walk(g)
        try:
            plan = matcher(walk)
            _check_whole_graph(walk)
            return plan
        except NoMatch as exc:
            reasons.append(f"{family}: {exc}")
    raise NoMatch("; ".join(reasons))


def _check_whole_graph(walk: _Walk) -> None:
    extra = [n for n in walk.g.calls() if n.name not in walk.used]
    if extra:
        shown = ", ".join(f"{n.name} = {n.op or 'getitem'}" for n in extra[:4])
        raise NoMatch(f"the graph computes more than the pattern ({len(extra)} more: {shown})")
    outs = [v for v in walk.g.returned if isinstance(v, Ref)]
    if len({o.name for o in outs}) != len(walk.g.returned):
        raise NoMatch("an output is returned twice or is not a tensor")
    for out in outs:
        meta = walk.meta(out)
        if not meta.is_contiguous():
            raise NoMatch(f"output {out.name} is not contiguous (strides {list(meta.stride)})")


# ---------------------------------------------------------------------------------------------- int8

def _match_int8(walk: _Walk) -> NativePlan:
    out_ref = walk.single_output()
    out = walk.call(out_ref)
    out_meta = walk.meta(out_ref)
    if out_meta.dtype not in FLOATS:
        raise NoMatch(f"output dtype {out_meta.dtype}")
    n = out_meta.shape[-1] if out_meta.shape else 0
    scale = bias = residual = None
    seen_mul = False
    node = out
    while node.op != "aten.mm.default":
        if node.op in ("aten.add.Tensor", "aten.mul.Tensor"):
            if walk.meta(Ref(node.name)).shape != out_meta.shape:
                raise NoMatch(f"{node.name} is not on the output's shape")
            if node.op == "aten.mul.Tensor":
                if seen_mul:
                    raise NoMatch("more than one multiplication in the epilogue")
                side, other = walk.split(node, lambda v: _vector_input(walk, v, n))
                scale, seen_mul = side, True
            else:
                if seen_mul:
                    raise NoMatch("an addition before the scale multiplication ((x @ W.T + b) * s)")
                side, other = walk.split(node, lambda v: walk.input_index(v) is not None)
                meta = walk.meta(side)
                if meta.shape == out_meta.shape and residual is None:
                    _row_input(walk, side, "the residual")
                    residual = side
                elif _vector_input(walk, side, n) and bias is None:
                    bias = side
                else:
                    raise NoMatch(f"{node.name} adds a tensor that is neither a bias [N] nor a residual")
                if meta.dtype not in FLOATS:
                    raise NoMatch(f"{side.name} has dtype {meta.dtype}")
            node = walk.call(other)
        elif node.op in _VIEWS and walk.is_call(node.args[0], "aten.mm.default"):
            node = walk.call(node.args[0])
        else:
            raise NoMatch(f"{node.name} = {node.op} is not part of the linear's epilogue")
    mm = node
    mm_meta = walk.meta(Ref(mm.name))
    if mm_meta.dtype != "bf16" or len(mm_meta.shape) != 2 or mm_meta.shape[1] != n:
        raise NoMatch(f"the matrix product is {mm_meta.dtype}{list(mm_meta.shape)}, not bf16 [M, N]")
    m_rows, k = mm_meta.shape[0], walk.meta(mm.args[0]).shape[-1]
    x_ref = mm.args[0]
    if walk.is_call(x_ref, *_VIEWS):
        view = walk.call(x_ref)
        x_ref = view.args[0]
    x_idx, x_meta = _row_input(walk, x_ref, "x")
    if x_meta.dtype != "bf16" or x_meta.shape[-1] != k or math.prod(x_meta.shape[:-1]) != m_rows:
        raise NoMatch(f"x is {x_meta.dtype}{list(x_meta.shape)}, not bf16 [.., {k}] with {m_rows} rows")
    w_idx, w_meta = _weight(walk, mm.args[1], n, k)
    if not 1 <= m_rows <= INT8_MAX_M:
        raise NoMatch(f"{m_rows} rows of x (the kernels take decode shapes: at most {INT8_MAX_M})")
    if math.prod(out_meta.shape) != m_rows * n:
        raise NoMatch("the output is not the product's [M, N] elements")
    args = (Arg(input=x_idx), Arg(input=w_idx),
            *(Arg(input=walk.input_index(v)) if v is not None else NONE for v in (scale, bias, residual)),
            Arg(literal=TORCH_NAME[out_meta.dtype]), Arg(literal="0"))
    extras = [(scale, " * scale"), (bias, " + bias"), (residual, " + residual")]
    moved = x_meta.nbytes + w_meta.nbytes + out_meta.nbytes + sum(walk.meta(v).nbytes for v, _ in extras if v is not None)
    desc = (f"int8 weight-only linear out[{m_rows}x{n}] = bf16(x @ W.T)" + "".join(t for v, t in extras if v is not None)
            + f" (K={k}, W int8 [{n}, {k}], out {out_meta.dtype})")
    return NativePlan("int8_linear", "int8_linear", args, (None,), desc, moved)


def _weight(walk: _Walk, value: Any, n: int, k: int) -> tuple[int, Meta]:
    """``permute(convert(w, bf16), [1, 0])`` (or ``t``) of an int8 ``[N, K]`` graph input."""
    perm = walk.call(value, "aten.permute.default", "aten.t.default")
    if perm.op == "aten.permute.default" and tuple(perm.args[1:2]) != ((1, 0),):
        raise NoMatch(f"the weight is permuted by {perm.args[1:2]}, not [1, 0]")
    conv = walk.call(perm.args[0], _CONVERT)
    if tuple(conv.args[1:2]) != (DType("bf16"),):
        raise NoMatch("the weight is not converted to bf16")
    idx = walk.input_index(conv.args[0])
    if idx is None:
        raise NoMatch("the int8 weight is not a graph input")
    meta = walk.meta(conv.args[0])
    if meta.dtype != "i8" or meta.shape != (n, k):
        raise NoMatch(f"the weight is {meta.dtype}{list(meta.shape)}, not i8 [{n}, {k}]")
    if k > 1 and meta.stride[1] != 1:
        raise NoMatch(f"the weight has strides {list(meta.stride)} (needs unit stride along K)")
    return idx, meta


# ------------------------------------------------------------------------------------------- softmax

def _softmax_input(walk: _Walk, value: Any) -> tuple[Any, float]:
    """``(t, c)``: the chain ending at ``value`` is ``softmax(c * t)`` over the last dimension.

    ``c`` is 1 except for the form Inductor's pre-grad pass writes for ``softmax(x / c)`` /
    ``softmax(x * c)`` without a bias: ``exp((t - amax(t)) / c)`` (equal to the softmax of ``t / c`` for c > 0).
    """
    if walk.is_call(value, "aten._softmax.default"):
        node = walk.call(value)
        t = node.args[0]
        if not _last_dim(node.args[1] if len(node.args) > 1 else None, len(walk.meta(t).shape)) or \
                (len(node.args) > 2 and node.args[2] is not False):
            raise NoMatch("aten._softmax over another dimension or with half_to_float")
        return t, 1.0
    div = walk.call(value, "aten.div.Tensor")
    exp = walk.call(div.args[0], "aten.exp.default")
    total = walk.call(div.args[1], "aten.sum.dim_IntList")
    post = 1.0
    inner = exp.args[0]
    if walk.is_call(inner, "aten.div.Tensor", "aten.mul.Tensor"):
        scaled = walk.call(inner)
        c = scaled.args[1] if len(scaled.args) > 1 else None
        if not isinstance(c, (int, float)) or isinstance(c, bool) or c <= 0:
            raise NoMatch(f"{scaled.name} scales the centred logits by {c!r} (a positive constant is required)")
        post = 1.0 / float(c) if scaled.op == "aten.div.Tensor" else float(c)
        inner = scaled.args[0]
    sub = walk.call(inner, "aten.sub.Tensor")
    t = sub.args[0]
    amax = walk.call(sub.args[1], "aten.amax.default")
    ndim = len(walk.meta(t).shape)
    for red, arg in ((total, div.args[0]), (amax, t)):
        keep = red.args[2] if len(red.args) > 2 else red.kwargs.get("keepdim")
        if red.args[0] != arg or not _last_dim(red.args[1] if len(red.args) > 1 else None, ndim) or keep is not True:
            raise NoMatch(f"{red.name} is not a keepdim reduction over the last dimension of the softmax input")
    return t, post


def _pre_ops(walk: _Walk, value: Any, d: int) -> tuple[int, Meta, float, int | None]:
    """``(input index, input meta, scale, bias index)`` of ``x * scale + bias`` (upcasts allowed)."""
    scale, bias, seen_mul = 1.0, None, False
    cur = value
    while walk.input_index(_unclone(walk, cur)) is None:
        node = walk.call(cur)
        if node.op == _CONVERT:
            if tuple(node.args[1:2]) != (DType("f32"),):
                raise NoMatch(f"{node.name} converts to {node.args[1:2]}, not float32")
            cur = node.args[0]
        elif node.op == "aten.add.Tensor" and not seen_mul and bias is None:
            side, cur = walk.split(node, lambda v: _vector_input(walk, v, d))
            bias = walk.input_index(side)
        elif node.op in ("aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar") and not seen_mul:
            side, cur = walk.split(node, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
            if node.op.startswith("aten.div") and (side != node.args[1] or side == 0):
                raise NoMatch(f"{node.name} divides by a tensor or by zero")
            scale = float(side) if node.op.startswith("aten.mul") else 1.0 / float(side)
            seen_mul = True
        else:
            raise NoMatch(f"{node.name} = {node.op} is not a supported softmax pre-op (x * scale + bias)")
    index, meta = _row_input(walk, cur, "the softmax input")
    if bias is not None and walk.meta(Ref(walk.g.placeholders[bias])).dtype != meta.dtype:
        raise NoMatch("the bias dtype differs from the input's")
    return index, meta, scale, bias


def _one_softmax(walk: _Walk, value: Any) -> tuple[int, Meta, float, int | None]:
    if walk.is_call(value, _CONVERT):
        value = walk.call(value).args[0]
    t, post = _softmax_input(walk, value)
    index, meta, scale, bias = _pre_ops(walk, t, walk.meta(t).shape[-1])
    if post != 1.0 and bias is not None:
        raise NoMatch("a scale applied after the bias (softmax((x + b) * c))")
    return index, meta, scale * post, bias


def _match_softmax(walk: _Walk) -> NativePlan:
    out_ref = walk.single_output()
    out_meta = walk.meta(out_ref)
    top = out_ref
    if walk.is_call(top, _CONVERT):
        top = walk.call(top).args[0]
    sides = []
    if walk.is_call(top, "aten.add.Tensor"):
        add = walk.call(top)
        sides = [_one_softmax(walk, add.args[0]), _one_softmax(walk, add.args[1])]
    else:
        sides = [_one_softmax(walk, out_ref)]
    metas = [s[1] for s in sides]
    if any(m.shape != metas[0].shape or m.dtype != metas[0].dtype for m in metas):
        raise NoMatch("the two softmax inputs differ in shape or dtype")
    dtype = metas[0].dtype
    if dtype not in FLOATS or out_meta.dtype != dtype or out_meta.shape != metas[0].shape:
        raise NoMatch(f"input {dtype}{list(metas[0].shape)} -> output {out_meta.dtype}{list(out_meta.shape)} (the "
                      "kernel keeps shape and dtype)")
    d = metas[0].shape[-1]
    a = sides[0]
    b = sides[1] if len(sides) > 1 else None
    args = (Arg(input=a[0]), Arg(input=b[0]) if b else NONE, _lit(a[2]),
            Arg(input=a[3]) if a[3] is not None else NONE, _lit(b[2] if b else 1.0),
            Arg(input=b[3]) if b and b[3] is not None else NONE, Arg(literal="0"))
    bias_bytes = sum(d * metas[0].nbytes // max(1, metas[0].numel) for s in sides if s[3] is not None)
    moved = sum(m.nbytes for m in metas) + out_meta.nbytes + bias_bytes

    def text(side: tuple[int, Meta, float, int | None], name: str) -> str:
        inner = name + (f" * {side[2]:g}" if side[2] != 1.0 else "") + (" + bias" if side[3] is not None else "")
        return f"softmax({inner})"

    desc = (" + ".join(text(s, n) for s, n in zip(sides, ("a", "b"), strict=False)) +
            f" over {math.prod(metas[0].shape[:-1])} rows of {d} ({dtype})")
    return NativePlan("softmax", "softmax", args, (None,), desc, moved)


# ---------------------------------------------------------------------------------------------- norm

def _match_norm(walk: _Walk) -> NativePlan:
    rs_ref, stat_ref, eps = _rsqrt_of_eps_add(walk)
    stat = walk.g.node(stat_ref)
    layer = stat is not None and stat.kind == "getitem"
    if layer:
        walk.used.add(stat.name)
        vm = walk.call(Ref(stat.source), "aten.var_mean.correction")
        if stat.index != 0 or vm.kwargs.get("correction", None) != 0 or vm.kwargs.get("keepdim") is not True:
            raise NoMatch("var_mean is not the biased (correction=0, keepdim) variance")
        hf = vm.args[0]
        dims = vm.args[1] if len(vm.args) > 1 else vm.kwargs.get("dim")
        means = [n for n in walk.g.nodes.values() if n.kind == "getitem" and n.source == vm.name and n.index == 1]
        if len(means) != 1:
            raise NoMatch("var_mean's mean is not used exactly once")
        walk.used.add(means[0].name)
        mean_name = means[0].name
    else:
        mean = walk.call(stat_ref, "aten.mean.dim")
        keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim")
        if keep is not True:
            raise NoMatch("mean without keepdim")
        sq = walk.call(mean.args[0], "aten.pow.Tensor_Scalar", "aten.mul.Tensor")
        if sq.op == "aten.pow.Tensor_Scalar" and sq.args[1:2] != (2,):
            raise NoMatch(f"{sq.name} is not a square")
        if sq.op == "aten.mul.Tensor" and sq.args[0] != sq.args[1]:
            raise NoMatch(f"{sq.name} is not a square")
        hf, dims = sq.args[0], mean.args[1] if len(mean.args) > 1 else None
    hf_meta = walk.meta(hf)
    if hf_meta.dtype != "f32" or not _last_dim(dims, len(hf_meta.shape)):
        raise NoMatch("the statistics are not fp32 over the last dimension")
    h, x_idx, r_idx, x_meta = _residual_sum(walk, hf)
    dtype, d = x_meta.dtype, x_meta.shape[-1]
    if d > NORM_MAX_D:
        raise NoMatch(f"rows of {d} elements (the kernels hold at most {NORM_MAX_D})")
    outs = list(walk.g.returned)
    if not outs or len(outs) > 2 or not all(isinstance(o, Ref) for o in outs):
        raise NoMatch("the graph returns neither the normalized rows nor them and the residual sum")
    if r_idx is not None and len(outs) == 2 and h not in outs:
        # Dynamo may keep `x + r` twice (once for the norm, once returned): the returned copy is h too.
        for i, o in enumerate(outs):
            node = walk.g.node(o)
            if node is not None and node.op == "aten.add.Tensor" and {walk.input_index(_unclone(walk, a))
                                                                       for a in node.args[:2]} == {x_idx, r_idx}:
                walk.used.add(node.name)
                outs[i] = h
                break
    normed = [o for o in outs if o != h]
    if len(normed) != 1 or (len(outs) == 2 and (h not in outs or r_idx is None)):
        raise NoMatch("the outputs are not the normalized rows (and the residual sum x + r)")
    cur, weight, bias, round_first = normed[0], None, None, False
    out_meta = walk.meta(cur)
    if out_meta.dtype != dtype or out_meta.shape != x_meta.shape:
        raise NoMatch(f"the output is {out_meta.dtype}{list(out_meta.shape)}, the input {dtype}{list(x_meta.shape)}")
    if walk.is_call(cur, _CONVERT):
        cur = walk.call(cur).args[0]
    if walk.is_call(cur, "aten.add.Tensor") and layer:
        side, cur = walk.split(walk.call(cur), lambda v: _vector_input(walk, v, d))
        bias = side
    if walk.is_call(cur, "aten.mul.Tensor") and any(_vector_input(walk, v, d) for v in walk.g.node(cur).args[:2]):
        side, cur = walk.split(walk.call(cur), lambda v: _vector_input(walk, v, d))
        weight = side
        if walk.is_call(cur, _CONVERT) and not layer:
            cur, round_first = walk.call(cur).args[0], True
    y = walk.call(cur, "aten.mul.Tensor")
    rs_side, centred = walk.split(y, lambda v: v == rs_ref)
    if layer:
        sub = walk.call(centred, "aten.sub.Tensor")
        if sub.args[:2] != (hf, Ref(mean_name)):
            raise NoMatch("the centring is not h - mean")
    elif centred != hf:
        raise NoMatch("the normalization does not scale h by the rsqrt")
    for v in (weight, bias):
        if v is not None and walk.meta(v).dtype != dtype:
            raise NoMatch("the weight or bias dtype differs from the input's")
    returns = tuple(1 if o == h else 0 for o in outs)
    ret_sum = len(outs) == 2
    idx = walk.input_index

    def opt(v: Any) -> Arg:
        return Arg(input=idx(v)) if v is not None else NONE

    r_arg = Arg(input=r_idx) if r_idx is not None else NONE
    if layer:
        args = (Arg(input=x_idx), r_arg, opt(weight), opt(bias), _lit(float(eps)), _lit(ret_sum))
    else:
        args = (Arg(input=x_idx), r_arg, opt(weight), _lit(float(eps)), _lit(round_first), _lit(ret_sum))
    vec = d * x_meta.nbytes // max(1, x_meta.numel)
    moved = x_meta.nbytes * (2 + (r_idx is not None) + ret_sum) + vec * ((weight is not None) + (bias is not None))
    name = "layer_norm" if layer else "rms_norm"
    desc = (f"{'residual add + ' if r_idx is not None else ''}{'LayerNorm' if layer else 'RMSNorm'} over "
            f"{math.prod(x_meta.shape[:-1])} rows of {d} ({dtype}, eps {float(eps):g}"
            f"{', weight' if weight is not None else ''}{', bias' if bias is not None else ''}"
            f"{', returns x + r' if ret_sum else ''})")
    return NativePlan("norm", name, args, returns, desc, moved)


def _residual_sum(walk: _Walk, hf: Any) -> tuple[Any, int, int | None, Meta]:
    """``(h, x index, r index, x meta)`` for ``hf = convert(h, f32)`` (or ``h`` in fp32), ``h = x (+ r)``."""
    h = _upcast_source(walk, hf)
    if walk.input_index(_unclone(walk, h)) is not None:
        x_idx, x_meta = _row_input(walk, h, "x")
        r_idx = None
    else:
        add = walk.call(h, "aten.add.Tensor")
        if walk.input_index(_unclone(walk, add.args[0])) is None or walk.input_index(_unclone(walk, add.args[1])) is None:
            raise NoMatch("h is not x + r of two graph inputs")
        x_idx, x_meta = _row_input(walk, add.args[0], "x")
        r_idx, r_meta = _row_input(walk, add.args[1], "the residual")
        if r_meta.shape != x_meta.shape or r_meta.dtype != x_meta.dtype or walk.meta(h).dtype != x_meta.dtype:
            raise NoMatch("x and the residual differ in shape or dtype")
    if x_meta.dtype not in FLOATS or (x_meta.dtype != "f32" and h == hf):
        raise NoMatch(f"input dtype {x_meta.dtype}")
    return h, x_idx, r_idx, x_meta
