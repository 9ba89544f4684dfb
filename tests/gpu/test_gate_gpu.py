"""The gate on a real GPU (run on the H200: ``scripts/gpu-suite.sh tests`` or
``python -m pytest -q -m gpu tests/gpu/test_gate_gpu.py``).

CUDA-only cheats and faults, CUDA-event timing, the acceptance path with a truly faster candidate, the
incumbent's three-arm timing, and real Inductor CUDA wrappers (Triton kernels, extern matmuls, bf16)
passing every check unedited.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests import gate_support as gs
from tests.cheats.gpu import GPU_CHEATS, GPU_FAULTS, deferred_side_work
from tilesmith.records import Candidate

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class Elementwise(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2 + 1


class SumAll(torch.nn.Module):
    def forward(self, x):
        return x.sum()


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)
        self.ln = torch.nn.LayerNorm(1024)

    def forward(self, x):
        return self.ln(self.fc2(torch.nn.functional.gelu(self.fc1(x))) + x)


class SoftmaxBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(4096, dtype=torch.bfloat16))

    def forward(self, x):
        return torch.softmax(x * 0.125 + self.bias, dim=-1) * torch.sigmoid(x)


def _cuda(model, *shape, dtype=torch.float32):
    torch.manual_seed(0)
    model = model.cuda()
    return gs.capture(model, torch.randn(*shape, device="cuda", dtype=dtype))[0]


@pytest.fixture(scope="module")
def graphs():
    return {"ew": _cuda(Elementwise(), 4096, 1024), "sum": _cuda(SumAll(), 1 << 20),
            "mlp": _cuda(MLP(), 64, 1024), "softmax": _cuda(SoftmaxBias(), 8192, 4096, dtype=torch.bfloat16),
            "chain": _cuda(gs.Chain(n=4096, k=8), 2048, 4096)}


@pytest.fixture(scope="module")
def gates(graphs, tmp_path_factory):
    from tilesmith.gate import Gate

    root = tmp_path_factory.mktemp("gpu-gates")
    opened = {}

    def get(name):
        if name not in opened:
            cap = graphs[name]
            opened[name] = Gate(gs.make_problem(cap, root / name / "snap", label=f"9a7e0000 ({name})"),
                                reference=cap.ref_fn, profiles_dir=root / name / "profiles")
        return opened[name]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILESMITH_GATE_RUN_TIMEOUT_S", "30")
        yield get
    for gate in opened.values():
        gate.close()


@pytest.mark.parametrize("name", ["ew", "sum", "mlp", "softmax"])
def test_unedited_cuda_wrapper_passes_every_check_and_is_not_accepted(name, gates, graphs):
    verdict = gates(name).evaluate(Candidate(source=graphs[name].source, proposer="control"))
    assert verdict.failures == (), verdict.reasons
    assert verdict.timing.method == "cuda_event"
    assert not verdict.accepted, verdict.summary()  # A/A: identical code must not look 2 % faster twice


@pytest.mark.parametrize("cheat", GPU_CHEATS, ids=lambda c: c.name)
def test_cuda_cheat_is_rejected_for_its_reason(cheat, gates, graphs, monkeypatch):
    if cheat.status != "rejected_static":  # obfuscated on purpose: the runtime check must catch it by itself
        gs.runtime_checks_only(monkeypatch)
    verdict = gates(cheat.graph).evaluate(Candidate(source=cheat.make(graphs[cheat.graph].source),
                                                    proposer=f"cheat:{cheat.name}", note=cheat.what))
    assert cheat.check in [f.check for f in verdict.failures], (verdict.status, verdict.reasons)
    assert verdict.status == cheat.status, verdict.reasons


def test_work_left_on_another_stream_is_counted_in_the_samples(gates, graphs):
    verdict = gates("ew").evaluate(Candidate(source=deferred_side_work(graphs["ew"].source), proposer="cheat"))
    assert verdict.failures == (), verdict.reasons
    assert verdict.status == "rejected_slower", verdict.summary()
    assert verdict.timing.speedup < 0.5  # the 10 ms spin on the side stream is inside every sample


@pytest.mark.parametrize("fault", GPU_FAULTS, ids=lambda c: c.name)
def test_cuda_fault_costs_only_the_candidate(fault, gates, graphs, monkeypatch):
    gs.runtime_checks_only(monkeypatch)  # the fault must reach run time even where the static scan would refuse it
    cap = graphs[fault.graph]
    verdict = gates(fault.graph).evaluate(Candidate(source=fault.make(cap.source), proposer=f"fault:{fault.name}"))
    assert verdict.status == fault.status, verdict.reasons
    assert fault.check in [f.check for f in verdict.failures], verdict.reasons
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in cap.inputs]
    out = cap.ref_fn(list(args))[0]
    torch.cuda.synchronize()  # the host's CUDA context is healthy
    assert torch.isfinite(out).all()


def test_illegal_address_reason_names_it(gates, graphs):
    fault = GPU_FAULTS[0]
    verdict = gates("ew").evaluate(Candidate(source=fault.make(graphs["ew"].source), proposer="fault"))
    assert "illegal memory access" in " ".join(verdict.reasons).lower()


def test_gate_evaluates_normally_after_cuda_faults(gates, graphs):
    verdict = gates("ew").evaluate(Candidate(source=graphs["ew"].source, proposer="control"))
    assert verdict.failures == (), verdict.reasons


def test_truly_faster_cuda_candidate_is_accepted_with_event_timing(gates, graphs):
    better = gs.reassociate_chain(graphs["chain"].source)
    verdict = gates("chain").evaluate(Candidate(source=better, proposer="scripted"))
    assert verdict.status == "accepted", verdict.reasons
    for t in (verdict.timing, verdict.confirmation):
        assert t.method == "cuda_event" and t.speedup > 1.5 and t.ci_low > 1.0
        assert len(t.baseline_ms) == 30
    report = json.loads(open(verdict.report_path).read())
    env = report["environment"]
    assert env["device_name"] and env["driver"] and env["cuda"]
    assert report["phases"][0]["worker_pid"] != report["phases"][1]["worker_pid"]


def test_incumbent_baseline_with_original_as_third_arm(gates, graphs):
    better = gs.reassociate_chain(graphs["chain"].source)
    verdict = gates("chain").evaluate(Candidate(source=better + "\n# again\n", proposer="scripted"),
                                      incumbent=Candidate(source=better, proposer="scripted"))
    assert verdict.failures == (), verdict.reasons
    assert not verdict.accepted
    t = verdict.timing
    assert t.baseline_label == "incumbent" and t.speedup_vs_original > 1.5
    assert len(t.original_ms) == len(t.candidate_ms) and t.speedup_vs_original_ci[0] > 1.0
