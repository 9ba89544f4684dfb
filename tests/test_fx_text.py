"""The one FX-text parser (``tilesmith/fx_text.py``) on the 13 real FX programs captured on the H200
(``tests/fixtures/inductor-h200/*.fx.txt``): every node's kind, dtype, shape, stride and device, the graph's
use counts and dynamic flag, and the roofline cost model's bytes and FLOPs are what the two parsers it replaced
(``agent/builtin/native_fx.py`` and ``roofline/cost.py``'s own reader) read. The golden file
``tests/fixtures/fx_text_golden.json`` was written by those parsers before they were merged (commit of this
test's parent)."""

from __future__ import annotations

import json

import pytest
from fixture_paths import FIXTURES, H200

from tilesmith.fx_text import FxTextError, parse_fx
from tilesmith.roofline import RooflineParseError, graph_cost
from tilesmith.roofline.cost import _itemsize

GOLDEN = json.loads((FIXTURES / "fx_text_golden.json").read_text(encoding="utf-8"))
PROGRAMS = sorted(p.name for p in H200.glob("*.fx.txt"))


def test_the_golden_file_covers_every_captured_program():
    assert len(PROGRAMS) == 13
    assert sorted(GOLDEN) == PROGRAMS


@pytest.mark.parametrize("name", PROGRAMS)
def test_nodes_read_as_the_native_matchers_old_parser_read_them(name):
    graph = parse_fx((H200 / name).read_text(encoding="utf-8"))
    want = GOLDEN[name]
    got = {n.name: [n.kind, None if n.meta is None else
                    [n.meta.dtype, list(n.meta.shape), list(n.meta.stride), n.meta.device]]
           for n in graph.nodes.values()}
    assert got == want["native"]
    assert graph.users == want["users"]
    assert graph.dynamic is want["dynamic"]
    assert bool(graph.symbolic) is want["dynamic"]  # these programs: dynamic only through symbolic sizes


@pytest.mark.parametrize("name", PROGRAMS)
def test_metas_and_costs_as_the_roofline_parser_read_them(name):
    text = (H200 / name).read_text(encoding="utf-8")
    want = GOLDEN[name]
    if want["cost"] == "error":
        assert want["cost_meta"] == "error"
        with pytest.raises(RooflineParseError, match="dynamic shapes"):
            graph_cost(text)
        return
    graph = parse_fx(text)
    got = {n.name: None if n.meta is None else
           [n.meta.dtype, list(n.meta.shape), list(n.meta.stride), _itemsize(n.meta.dtype)]
           for n in graph.nodes.values()}
    assert got == want["cost_meta"]
    cost = graph_cost(text)
    assert [cost.bytes_read, cost.bytes_written, [list(x) for x in cost.flops_by_dtype],
            [list(x) for x in cost.flop_ops]] == want["cost"]


def test_the_comparison_can_fail():
    """A changed annotation changes what the parser reads (so the tests above can fail)."""
    name = "mlp_fp32_infer__00.fx.txt"
    text = (H200 / name).read_text(encoding="utf-8").replace('"f32[', '"bf16[', 1)
    graph = parse_fx(text)
    got = {n.name: [n.kind, None if n.meta is None else
                    [n.meta.dtype, list(n.meta.shape), list(n.meta.stride), n.meta.device]]
           for n in graph.nodes.values()}
    assert got != GOLDEN[name]["native"]


def test_text_without_forward_is_an_error():
    with pytest.raises(FxTextError, match="forward"):
        parse_fx("x = 1\n")
