"""Regression tests for red-team findings 6–9 (CPU, real Gate): candidates that assume the captured integer /
boolean / ±Inf inputs, reuse a ring of static output buffers, or drop precision only at high magnitudes are
rejected with the right check id; the correctness plan holds ≥ 16 calls' outputs; an unedited wrapper of a
graph with masks, positions, accumulating indices and -inf padding passes every check on the varied inputs.

Not tested (documented residual risk, docs/gate.md): a call-count time bomb beyond the checked horizon
(``count_bomb`` in ``tests/cheats/redteam_variants.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import gate_support as gs
from tests.cheats import redteam_variants as rv
from tilesmith.gate.host import checks
from tilesmith.records import Candidate


class Mixed(torch.nn.Module):
    """Every input kind the variants now vary: a bool mask, a one-element position, accumulating indices and
    an additive -inf padding mask."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.table = torch.nn.Parameter(torch.randn(64, d))

    def forward(self, x, mask, pos, idx, pad):
        att = torch.softmax(x @ self.w + pad, dim=-1).masked_fill(~mask, 0.0) + self.table[pos]
        return att, torch.zeros(64, x.shape[1]).index_add(0, idx, x)


def _cases():
    torch.manual_seed(0)
    pad = torch.zeros(32, 64)
    pad[:, 48:] = float("-inf")
    mixed_pad = torch.zeros(16, 32)
    mixed_pad[:, 24:] = float("-inf")
    return {
        "mask": (rv.Masked(), (torch.randn(32, 64), torch.ones(32, 64, dtype=torch.bool))),
        "pos": (rv.Pos(), (torch.randn(8, 64), torch.tensor([5]))),
        "scatter": (rv.Scatter(), (torch.randn(64, 16), torch.randperm(128)[:64])),
        "inf": (rv.AddMask(), (torch.randn(32, 64), pad)),
        "ln": (gs.LinearLN(), (torch.randn(32, 64),)),
        "mixed": (Mixed(), (torch.randn(16, 32), torch.ones(16, 32, dtype=torch.bool), torch.tensor([7]),
                            torch.randperm(64)[:16], mixed_pad)),
    }


@pytest.fixture(scope="module")
def gates(tmp_path_factory):
    from tilesmith.gate import Gate

    opened: dict[str, tuple[object, gs.Captured]] = {}
    root: Path = tmp_path_factory.mktemp("variant-gates")
    cases = _cases()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILESMITH_ALLOW_CPU", "1")
        mp.setenv("TILESMITH_GATE_RUN_TIMEOUT_S", "60")

        def get(name: str):
            if name not in opened:
                model, args = cases[name]
                cap = gs.capture(model, *args)[0]
                problem = gs.make_problem(cap, root / name / "snapshot", label=f"c0ffee00 ({cap.graph.name})")
                opened[name] = (Gate(problem, reference=cap.ref_fn, profiles_dir=root / name / "profiles",
                                     timing_pairs=6), cap)
            return opened[name]

        yield get
        for gate, _ in opened.values():
            gate.close()


CHEATS = [
    # (graph, builder, expected check id) — findings 6 (mask, pos, scatter), 7 (inf), 8 (ring), 9 (precision)
    ("mask", rv.ignore_mask, "value_mismatch"),
    ("pos", rv.hardcode_pos, "value_mismatch"),
    ("scatter", rv.scatter_no_accumulate, "value_mismatch"),
    ("inf", rv.hardcode_padding, "value_mismatch"),
    ("ln", rv.ring_outputs, "output_storage_shared"),
    ("ln", rv.bf16_when_large, "precision_loss"),
]


@pytest.mark.parametrize("graph,make,check", CHEATS, ids=lambda v: getattr(v, "__name__", v))
def test_redteam_candidate_is_rejected_for_its_reason(gates, graph, make, check):
    gate, cap = gates(graph)
    source = make(cap.source)
    assert source != cap.source
    verdict = gate.evaluate(Candidate(source=source, proposer=f"redteam:{make.__name__}"))
    assert not verdict.accepted
    assert check in [f.check for f in verdict.failures], (verdict.status, verdict.reasons)
    assert verdict.status == "rejected_incorrect", verdict.reasons


def test_unedited_wrapper_passes_every_check_on_varied_masks_positions_indices_and_padding(gates):
    gate, cap = gates("mixed")
    verdict = gate.evaluate(Candidate(source=cap.source, proposer="control"))
    assert verdict.failures == (), verdict.reasons
    assert verdict.timing is not None


def test_correctness_plan_holds_the_outputs_of_at_least_sixteen_candidate_calls(tmp_path):
    recipes = {k: {"variant": k} for k in ("normal", "random", "random_b", "zero", "high_magnitude", *checks.EXTRA_RANDOM)}
    seeds = {k: i for i, k in enumerate(recipes)}
    plan = checks.build_plan(recipes, tmp_path, seeds, "t", output_bytes=1 << 20)
    held = [s for s in plan.steps if s["module"] == "cand" and s.get("hold_as")]
    assert len(held) >= 17  # the first call plus HELD_CALLS
    names = [s["hold_as"] for s in held]
    for i, step in enumerate(held[1:], start=1):
        assert step["compare_storage_with"] == names[:i]  # a ring of ≤ 16 slots shares storage with a held call
    assert set(plan.save_held) == set(names)
    assert {p for _, _, p, _, _ in plan.compared} >= set(plan.save_held.values())
    assert checks.held_calls(1 << 40) == checks.MIN_HELD_CALLS  # huge outputs: memory-bounded, still > 1
    assert checks.held_calls(1 << 20, budget_bytes=8 << 20) == checks.MIN_HELD_CALLS  # little free memory
    assert all(s["module"] == "cand" for s in plan.steps)  # the original never runs in the candidate's worker
