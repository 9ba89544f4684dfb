"""The benchmark suite's harness on CPU: cases build, graphs are captured and costed, arms are timed interleaved
the same way, ratios and intervals are computed, failing arms are reported, reports are written. Correctness of
the harness, not speed (CPU test mode)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import harness, report, stats, suite  # noqa: E402
from bench.arms import ARMS, MODES, load_agent, read_tracks  # noqa: E402
from bench.cases import CASES, SUBSETS, expand_names, get_case  # noqa: E402
from bench.harness import capture_graphs, cost_graphs, max_rel_error, summarize, time_block  # noqa: E402
from tilesmith.roofline import DeviceLimits  # noqa: E402

LIMITS = DeviceLimits("cpu", "cpu", copy_gbps=10.0, matmul_bf16_tflops=0.01, matmul_fp32_tflops=0.01,
                      method="host_clock")
OLD_CASES = {"mlp_fp32", "gpt2_block_bf16", "gpt2_block_bf16_train", "resnet_block_bf16_cl", "softmax_bias_bf16",
             "llama_block_bf16", "embedding_ce_bf16", "sdpa_qknorm_mask_bf16"}
NOOP = "py:bench.optimizers:NoOpFactory"


def _limits_file(tmp_path: Path) -> Path:
    path = tmp_path / "fake-limits.json"
    path.write_text(json.dumps({"limits": dataclasses.asdict(LIMITS), "environment": {"torch": "x"}}))
    return path


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, TILESMITH_ALLOW_CPU="1", TILESMITH_CACHE_DIR=str(tmp_path / "ts-cache"))


# ------------------------------------------------------------------------------------------- cases

def test_suite_has_the_required_cases_and_subsets_partition_them():
    assert len(CASES) >= 12 and OLD_CASES <= set(CASES)
    assert {"softmax_fp32_long", "layernorm_residual_bf16", "int8_gemv_bf16", "groupnorm_silu_bf16",
            "embed_rmsnorm_small_bf16", "permuted_sum_fp32", "gather_bag_bf16", "mlp_train_bf16"} <= set(CASES)
    assert {c.name for c in CASES.values() if c.train} == {"gpt2_block_bf16_train", "mlp_train_bf16"}
    parts = [cases for name, cases in SUBSETS.items() if name.startswith("part")]
    assert sorted(itertools.chain(*parts)) == sorted(CASES)  # every case in exactly one part
    for part in parts:  # one 10-minute device command each, with room for the limits and the start
        assert sum(CASES[n].estimate_s for n in part) <= 540


def test_expand_names_takes_subsets_and_cases_in_order_without_repeats():
    assert expand_names("mlp_fp32,quick,int8_gemv_bf16") == ["mlp_fp32", *SUBSETS["quick"]]
    with pytest.raises(KeyError, match="subsets: part1"):
        expand_names("nope")
    with pytest.raises(KeyError, match="mlp_fp32"):
        get_case("nope")


@pytest.mark.parametrize("name", sorted(CASES))
def test_tiny_case_runs_eagerly_with_finite_outputs_and_few_kilobytes(name):
    workload = get_case(name).build(torch.device("cpu"), True)
    assert sum(t.numel() * t.element_size() for t in workload.inputs) <= 8192
    assert sum(t.numel() * t.element_size() for t in [*workload.model.parameters(), *workload.model.buffers()]) \
        <= 64 * 1024
    if workload.train:
        out = workload.model(*workload.inputs)
        out.backward(workload.grad)
        assert all(p.grad is not None for p in workload.model.parameters())
    else:
        with torch.no_grad():
            out = workload.model(*workload.inputs)
    for o in out if isinstance(out, tuple) else (out,):
        assert torch.isfinite(o.float()).all()
    assert set(workload.shapes) and all("[" in s for s in workload.shapes.values())


def test_int8_gemv_keeps_int8_weights_and_scales_as_buffers():
    workload = get_case("int8_gemv_bf16").build(torch.device("cpu"), True)
    model = workload.model
    assert not list(model.parameters())
    assert model.weight.dtype == torch.int8 and model.scales.dtype == torch.bfloat16
    x, r = workload.inputs
    expected = r + (x.float() @ model.weight.float().T * model.scales.float()).to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(model(x, r), expected, rtol=2e-2, atol=2e-2)


def test_tiny_builds_are_seeded_and_repeatable():
    a = get_case("gpt2_block_bf16").build(torch.device("cpu"), True)
    b = get_case("gpt2_block_bf16").build(torch.device("cpu"), True)
    assert torch.equal(a.inputs[0], b.inputs[0])
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_capture_of_training_case_gives_forward_and_backward_with_floors():
    graphs = capture_graphs(get_case("gpt2_block_bf16_train").build(torch.device("cpu"), True))
    assert [g.kind for g in graphs] == ["forward", "backward"]
    rows, total = cost_graphs(graphs, LIMITS)
    assert all("error" not in r for r in rows)
    assert total["floor_ms"] == pytest.approx(sum(r["floor_ms"] for r in rows))
    assert rows[1]["flops"] == pytest.approx(2 * rows[0]["flops"], rel=0.05)  # backward ≈ 2× forward matmuls


# ----------------------------------------------------------------------------------------- timing

def test_time_block_prepares_before_every_call():
    calls: list[str] = []
    samples = time_block(lambda: calls.append("run"), lambda: calls.append("prep"), torch.device("cpu"), 4, None)
    assert len(samples) == 4 and all(s >= 0 for s in samples)
    assert calls == ["prep", "run"] * 4


def test_summarize_reports_median_and_nearest_rank_percentiles():
    s = summarize([float(v) for v in range(1, 11)], "host_clock")
    assert (s.median_ms, s.p10_ms, s.p90_ms, s.min_ms) == (5.5, 1.0, 9.0, 1.0)
    with pytest.raises(ValueError):
        summarize([], "host_clock")


def test_max_rel_error_flags_nan_positions_shapes_and_integer_changes():
    ref = [torch.tensor([1.0, 2.0, float("nan")])]
    assert max_rel_error([torch.tensor([1.0, 2.0, float("nan")])], ref) == 0.0
    assert max_rel_error([torch.tensor([1.0, float("nan"), 3.0])], ref) == math.inf
    assert max_rel_error([torch.tensor([1.0, 2.0])], ref) == math.inf
    assert max_rel_error([torch.tensor([3, 4])], [torch.tensor([3, 5])]) == math.inf
    close = max_rel_error([torch.tensor([3.0, 4.0])], [torch.tensor([3.0, 4.5])])
    assert close == pytest.approx(0.5 / math.hypot(3.0, 4.5))


def test_max_rel_error_in_chunks_equals_the_whole_norm():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(7, 13, generator=gen)
    got = ref + 0.01 * torch.randn(7, 13, generator=gen)
    whole = float(torch.linalg.vector_norm((got - ref).double()) / torch.linalg.vector_norm(ref.double()))
    assert max_rel_error([got], [ref], chunk=5) == pytest.approx(whole, rel=1e-12)
    bad = got.clone().reshape(-1)
    bad[-1] = float("inf")  # the last chunk holds the mismatch
    assert max_rel_error([bad.reshape(7, 13)], [ref], chunk=5) == math.inf


# ------------------------------------------------------------------------------------------ stats

def test_median_and_quantile_match_numpys_linear_method():
    np = pytest.importorskip("numpy")
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    assert stats.median(values) == pytest.approx(float(np.median(values)))
    for q in (0.0, 0.025, 0.25, 0.5, 0.975, 1.0):
        assert stats.quantile(sorted(values), q) == pytest.approx(float(np.quantile(values, q)))
    with pytest.raises(ValueError):
        stats.median([])


def test_ratio_stats_finds_a_known_ratio_and_skips_missing_rounds():
    candidate = [1.0 + 0.01 * ((7 * i) % 11) for i in range(30)]
    baseline = [2.0 * c * (1.0 + 0.005 * ((3 * i) % 5 - 2)) for i, c in enumerate(candidate)]
    baseline[4] = None  # a round the baseline missed
    r = stats.ratio_stats(baseline, candidate)
    assert r["n"] == 29
    assert r["ci"][0] <= r["ratio"] <= r["ci"][1]
    assert 1.98 < r["ci"][0] and r["ci"][1] < 2.02 and r["ratio"] == pytest.approx(2.0, abs=0.01)
    assert stats.ratio_stats([None, 1.0], [1.0, None]) is None
    same = stats.ratio_stats([1.0] * 5, [1.0] * 5)
    assert same == {"ratio": 1.0, "ci": [1.0, 1.0], "n": 5}


def test_bootstrap_interval_is_seeded_and_agrees_with_the_gates_numpy_bootstrap():
    pytest.importorskip("numpy")
    from tilesmith.gate.host.stats import paired_speedup

    gen = torch.Generator().manual_seed(1)
    cand = (1.0 + 0.05 * torch.rand(200, generator=gen)).tolist()
    base = [c * (1.1 + 0.04 * float(u)) for c, u in zip(cand, torch.rand(200, generator=gen), strict=True)]
    ours = stats.ratio_stats(base, cand)
    assert ours == stats.ratio_stats(base, cand)  # same seed, same interval
    gate = paired_speedup(base, cand)
    assert ours["ratio"] == pytest.approx(gate.speedup, rel=1e-12)
    width = gate.ci_high - gate.ci_low
    assert abs(ours["ci"][0] - gate.ci_low) < 0.25 * width and abs(ours["ci"][1] - gate.ci_high) < 0.25 * width


def test_round_orders_put_every_arm_in_every_position_once_per_cycle():
    names = list(ARMS)
    orders = stats.round_orders(names, 2 * len(names) + 1, seed=0)
    assert all(sorted(o) == sorted(names) for o in orders)
    for cycle in (orders[:len(names)], orders[len(names):2 * len(names)]):
        for pos in range(len(names)):
            assert sorted(o[pos] for o in cycle) == sorted(names)
    assert orders[0] != orders[len(names)]  # the next cycle reshuffles
    assert stats.round_orders(names, 3, seed=5) == stats.round_orders(names, 3, seed=5)


def test_geomean_ignores_missing_values():
    assert stats.geomean([1.21, 1.0, None, float("nan")]) == pytest.approx(1.1)
    assert stats.geomean([]) is None


def _arm(ms_rounds, first_call=None, status="ok"):
    valid = [m for m in ms_rounds if m is not None]
    return {"status": status, "first_call_s": first_call, "compile_s": first_call,
            "timing": {"median_ms": stats.median(valid) if valid else None, "round_ms": ms_rounds}}


def test_compare_picks_the_best_mode_and_the_first_call_ratio():
    arms = {"eager": _arm([4.0, 4.2, 4.1]), "inductor": _arm([2.0, 2.1, 2.0], 3.0),
            "max-autotune-no-cudagraphs": _arm([1.5, 1.6, 1.4], 20.0), "reduce-overhead": _arm([1.8, 1.9, 1.7], 2.0),
            "max-autotune": _arm([1.0, 1.0, 1.0], 8.0, status="error"), "tilesmith": _arm([1.2, 1.6, 1.4], 25.0)}
    out = harness.compare(arms)
    assert out["best_mode"] == "max-autotune-no-cudagraphs"  # max-autotune failed: not a candidate
    assert out["tilesmith_vs_best"] == stats.ratio_stats([1.5, 1.6, 1.4], [1.2, 1.6, 1.4])
    assert out["tilesmith_vs_best"]["ratio"] == pytest.approx(1.0)
    assert set(out["tilesmith_vs"]) == {"eager", "inductor", "max-autotune-no-cudagraphs", "reduce-overhead"}
    assert out["first_call_over_max_autotune_nc"] == pytest.approx(25.0 / 20.0)
    assert out["over_inductor"]["eager"]["ratio"] == pytest.approx(2.0 / 4.1, rel=0.03)
    assert set(MODES) < set(ARMS)


# --------------------------------------------------------------------------------- case in-process

class _FailsAtCall:
    def __init__(self, model, n):
        self.model, self.n, self.calls = model, n, 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError(f"boom at call {self.n}")
        return self.model(*args)


def _fake_build(arm, model, inputs, options):
    """Arms without torch.compile: eager-like callables, one failing to build, one failing during the rounds,
    one computing something else."""
    if arm == "max-autotune-no-cudagraphs":
        raise RuntimeError("no autotuning today")
    if arm == "reduce-overhead":
        return _FailsAtCall(model, 6), None  # first call + 1 warm-up + warm-up round (3) + round 1's first call
    if arm == "max-autotune":
        return (lambda *a: model(*a) + 1.0), None
    return model, None


def test_run_case_interleaves_rounds_and_reports_failing_arms(tmp_path):
    out = tmp_path / "case.json"
    result = harness.run_case("softmax_fp32_long", torch.device("cpu"), LIMITS,
                              {"tiny": True, "rounds": 7, "calls_per_round": 3, "warmup": 1}, out, build=_fake_build)
    assert json.loads(out.read_text())["status"] == "done"
    arms = result["arms"]
    assert arms["max-autotune-no-cudagraphs"]["status"] == "error"
    assert arms["max-autotune-no-cudagraphs"]["failed_in"] == "build"
    assert "no autotuning today" in arms["max-autotune-no-cudagraphs"]["error"]
    assert arms["reduce-overhead"]["status"] == "error" and arms["reduce-overhead"]["failed_in"] == "round 1"
    ok = ["eager", "inductor", "max-autotune", "tilesmith"]
    assert all(arms[a]["status"] == "ok" for a in ok)
    assert len(result["rounds"]) == 7
    for entry in result["rounds"]:
        assert set(entry["order"]) == set(ok) | {"reduce-overhead"}
        assert set(entry["ms"]) == set(ok)
    for a in ok:
        timing = arms[a]["timing"]
        assert len(timing["round_ms"]) == 7 and timing["n"] == 7 * 3
        assert timing["median_ms"] == pytest.approx(stats.median(timing["round_ms"]))
    assert arms["eager"]["max_rel_err"] == 0.0 and arms["tilesmith"]["max_rel_err"] == 0.0
    assert arms["max-autotune"]["max_rel_err"] > 0.1  # softmax + 1: caught by the check, not by the timing
    cmp = result["comparison"]
    assert cmp["best_mode"] in ("inductor", "max-autotune")
    assert set(cmp["tilesmith_vs"]) == {"eager", "inductor", "max-autotune"}
    assert cmp["tilesmith_vs_best"]["n"] == 7
    assert result["method"]["rounds"] == 7 and result["method"]["timer"] == "host_clock"
    assert result["graphs"] and result["floor"]["floor_ms"] > 0


def test_run_case_training_compares_gradients_of_every_arm(tmp_path):
    def build(arm, model, inputs, options):
        if arm == "inductor":  # doubles the loss: gradients differ from eager's
            return (lambda *a: 2.0 * model(*a)), None
        return model, None

    result = harness.run_case("mlp_train_bf16", torch.device("cpu"), LIMITS,
                              {"tiny": True, "rounds": 2, "calls_per_round": 2, "warmup": 0,
                               "arms": ["eager", "inductor", "tilesmith"]}, None, build=build)
    assert list(result["arms"]) == ["eager", "inductor", "tilesmith"]
    assert result["arms"]["tilesmith"]["max_rel_err"] == 0.0
    assert result["arms"]["inductor"]["max_rel_err"] > 0.5


# ---------------------------------------------------------------------------------------- Tilesmith

def test_load_agent_imports_a_factory_class_and_passes_names_through():
    factory = load_agent(NOOP)
    assert callable(factory.for_graph) and callable(factory.close)
    assert load_agent("tilesmith/builtin") == "tilesmith/builtin"
    with pytest.raises(ValueError, match="py:<module>:<attribute>"):
        load_agent("py:bench.optimizers")


def test_read_tracks_keeps_evaluations_winner_and_non_evaluation_profiles(tmp_path):
    track = tmp_path / ("a" * 64)
    (track / "profiles").mkdir(parents=True)
    (track / "track.json").write_text(json.dumps({
        "graph_key": "a" * 64, "graph_name": "0_inference", "kind": "inference", "status": "installed",
        "evaluations": [{"id": "e0001", "proposer": "builtin:config", "status": "rejected_slower", "speedup": 0.9},
                        {"id": "e0002", "proposer": "builtin:cudagraph", "status": "accepted", "speedup": 1.5,
                         "confirmation_speedup": 1.4, "reasons": []}],
        "benchmark": {"speedup": 1.4, "speedup_ci": [1.3, 1.5]}, "diagnostics": []}))
    (track / "profiles" / "e0001.json").write_text("{}")
    (track / "profiles" / "screen_0001.json").write_text(json.dumps({"variants": [{"name": "max_autotune"}]}))
    (tmp_path / "run.json").write_text("{}")
    (tracks,) = [read_tracks(tmp_path)]
    (t,) = tracks
    assert t["winner"] == "builtin:cudagraph" and t["status"] == "installed"
    assert [e["proposer"] for e in t["evaluations"]] == ["builtin:config", "builtin:cudagraph"]
    assert t["other_profiles"] == {"screen_0001.json": {"variants": [{"name": "max_autotune"}]}}


# ------------------------------------------------------------------------------------------ report

def _fake_case(name, ratios_best, ratio_default, first_ratio=1.2, installed=True):
    ts = [1.0, 1.0, 1.0]
    arms = {"eager": _arm([4.0] * 3), "inductor": _arm([ratio_default] * 3, 2.0),
            "max-autotune-no-cudagraphs": _arm([ratios_best] * 3, 10.0), "reduce-overhead": _arm([9.0] * 3, 1.0),
            "max-autotune": {"status": "error", "error": "RuntimeError: boom", "failed_in": "first_call"},
            "tilesmith": _arm(ts, 10.0 * first_ratio)}
    arms["tilesmith"]["tracks"] = [{"graph_name": "0_inference", "status": "installed" if installed else
                                    "kept_inductor", "winner": "builtin:cudagraph" if installed else None,
                                    "evaluations": [{"proposer": "builtin:cudagraph", "status": "accepted",
                                                     "speedup": 1.5}],
                                    "benchmark": {"speedup": 1.5, "speedup_ci": [1.4, 1.6]}, "other_profiles": {}}]
    case = {"case": name, "status": "done", "estimate_s": 60, "process_s": 50.0, "floor": {"floor_ms": 0.5,
            "bound": "memory"}, "graphs": [{"name": "0_inference", "bytes_read": 2e6, "bytes_written": 1e6,
                                            "flops": 0, "floor_ms": 0.5}], "arms": arms,
            "method": {"rounds": 3, "calls_per_round": 5, "timer": "cuda_event", "flush_bytes": 1}}
    case["comparison"] = harness.compare(arms)
    return case


def _fake_result():
    return {"command": "python bench/suite.py", "created_utc": "t", "options": {"agent": "tilesmith/builtin"},
            "limits": {"device_name": "FakeGPU", "copy_gbps": 4000.0, "matmul_bf16_tflops": 800.0,
                       "matmul_fp32_tflops": 50.0},
            "environment": {"torch": "x"},
            "cases": [_fake_case("a", 1.21, 1.3), _fake_case("b", 1.0, 1.2, first_ratio=2.0, installed=False),
                      {"case": "c", "status": "skipped", "arms": {}, "error": "skipped: estimated 60 s"}]}


def test_summary_gives_geomeans_worst_case_and_targets():
    s = report.summary(_fake_result())
    assert s["geomean_tilesmith_vs_best"] == pytest.approx(1.1)
    assert s["geomean_tilesmith_vs_default"] == pytest.approx(math.sqrt(1.3 * 1.2))
    assert s["min_tilesmith_vs_best"] == ["b", pytest.approx(1.0)]
    assert s["max_first_call_over_max_autotune_nc"] == ["b", pytest.approx(2.0)]
    assert s["cases_not_done"] == ["c"] and s["graphs_installed"] == 1 and s["graphs_tracked"] == 2
    assert s["targets_met"] == {"min_vs_best": True, "geomean_vs_best": True, "geomean_vs_default": False,
                                "max_first_call_ratio": False}


def test_markdown_reports_best_mode_intervals_failures_and_tilesmith_tracks():
    text = report.markdown(_fake_result())
    row = next(line for line in text.splitlines() if line.startswith("| a |") and "max-autotune-nc |" in line)
    assert "1.210× [1.21, 1.21]" in row  # tilesmith vs the best mode (max-autotune-nc, 1.21 ms vs 1.0 ms)
    assert "error" in row  # max-autotune failed
    assert "a / max-autotune: failed in first_call: RuntimeError: boom" in text
    assert "| a | 0_inference | installed | builtin:cudagraph | 1.500 [1.400, 1.600] |" in text
    assert "| c | skipped |" in text and "skipped: estimated 60 s" in text
    assert "geometric mean 1.100×" in text and "**not met**" in text


def test_markdown_flags_a_time_below_the_roofline_floor():
    result = _fake_result()
    result["cases"][0]["floor"]["floor_ms"] = 1.25  # tilesmith's 1.0 ms is now below the floor
    text = report.markdown(result)
    assert "a / tilesmith: median time is 0.80× the roofline floor" in text
    assert "a / inductor: median time" not in text


def test_chart_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "c.png"
    report.chart(_fake_result(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------- suite

def test_parse_args_rejects_unknown_cases_arms_and_cpu_without_tiny(tmp_path):
    for argv in (["--cases", "nope", "--tiny"], ["--device", "cpu", "--out", str(tmp_path)],
                 ["--arms", "eager,warp-speed", "--tiny"]):
        with pytest.raises(SystemExit):
            suite.parse_args(argv)
    args = suite.parse_args(["--tiny", "--device", "cpu"])
    assert args.case_names == ["mlp_fp32"] and args.out.name == "bench-tiny" and args.arm_names == list(ARMS)
    args = suite.parse_args(["--tiny", "--device", "cpu", "--cases", "quick"])
    assert args.case_names == list(SUBSETS["quick"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages on a machine without CUDA")
def test_parse_args_without_cuda_or_out_explains_what_to_do(capsys):
    with pytest.raises(SystemExit):
        suite.parse_args(["--tiny"])
    assert "no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        suite.parse_args([])
    assert "give --out" in capsys.readouterr().err


def test_child_env_enables_cpu_test_mode_repo_imports_and_the_graph_budget():
    env = suite.child_env("cpu", graph_budget_s=90)
    assert env["TILESMITH_ALLOW_CPU"] == "1" and env["TILESMITH_GRAPH_BUDGET_S"] == "90"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    assert suite.child_env("cuda").get("TILESMITH_ALLOW_CPU") == os.environ.get("TILESMITH_ALLOW_CPU")


def test_merge_combines_parts_and_keeps_measured_cases_over_skipped_ones(tmp_path):
    first, second = _fake_result(), _fake_result()
    second["cases"] = [{"case": "a", "status": "skipped", "arms": {}}, _fake_case("c", 1.0, 1.0)]
    paths = [tmp_path / "1.json", tmp_path / "2.json"]
    for path, doc in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(doc))
    merged = suite.merge(paths)
    assert [c["case"] for c in merged["cases"]] == ["a", "b", "c"]
    assert merged["cases"][0]["status"] == "done" and merged["cases"][2]["status"] == "done"
    assert len(merged["parts"]) == 2 and merged["limits"]["device_name"] == "FakeGPU"


def test_spent_budget_skips_cases_and_resume_keeps_finished_ones(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    previous = _fake_result()
    previous["cases"] = [_fake_case("mlp_fp32", 1.0, 1.0), {"case": "softmax_fp32_long", "status": "skipped",
                                                            "arms": {}}]
    (out / "results.json").write_text(json.dumps(previous))
    cmd = [sys.executable, str(REPO / "bench" / "suite.py"), "--tiny", "--device", "cpu", "--cases",
           "mlp_fp32,softmax_fp32_long,int8_gemv_bf16", "--budget-s", "0", "--limits", str(_limits_file(tmp_path)),
           "--out", str(out), "--resume"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    assert [c["case"] for c in result["cases"]] == ["mlp_fp32", "softmax_fp32_long", "int8_gemv_bf16"]
    assert result["cases"][0]["status"] == "done"  # kept from the earlier run
    assert [c["status"] for c in result["cases"][1:]] == ["skipped", "skipped"]
    assert result["cases"][1]["error"].startswith("skipped: estimated")
    assert len(result["invocations"]) == 1 and "skipped: estimated" in (out / "results.md").read_text()


@pytest.mark.slow
def test_tiny_cpu_suite_runs_two_cases_interleaved_and_writes_the_reports(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "bench" / "suite.py"), "--tiny", "--device", "cpu", "--cases",
           "mlp_fp32,mlp_train_bf16", "--agent", NOOP, "--rounds", "6", "--limits", str(_limits_file(tmp_path)),
           "--out", str(out)]
    env = _env(tmp_path) | {"TILESMITH_PRESTART_WORKER": "0"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    assert result["format"] == suite.FORMAT and result["options"]["agent"] == NOOP
    assert [c["case"] for c in result["cases"]] == ["mlp_fp32", "mlp_train_bf16"]
    for case in result["cases"]:
        assert case["status"] == "done" and case["floor"]["floor_ms"] > 0 and case["process_s"] > 0
        assert list(case["arms"]) == list(ARMS)
        assert len(case["rounds"]) == 6 and all(sorted(r["order"]) == sorted(ARMS) for r in case["rounds"])
        for arm, entry in case["arms"].items():
            assert entry["status"] == "ok", (arm, entry)
            assert entry["timing"]["method"] == "host_clock" and len(entry["timing"]["round_ms"]) == 6
            assert entry["max_rel_err"] < (1e-4 if not case["train"] else 2e-2)
            assert arm == "eager" or entry["compile_s"] > 0
            assert not entry.get("recompiles_while_timed")
        assert case["comparison"]["tilesmith_vs_best"]["n"] == 6
        tracks = case["arms"]["tilesmith"]["tracks"]
        assert len(tracks) == (2 if case["train"] else 1)
        assert all(t["evaluations"][0]["proposer"] == "bench:noop" for t in tracks)
    assert result["summary"]["cases_compared"] == 2
    md = (out / "results.md").read_text()
    assert "| mlp_fp32 |" in md and re.search(r"\| mlp_train_bf16 \| \d+_backward \|", md)  # AOT ids count per process
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "logs" / "mlp_fp32.log").exists()
    assert not (tmp_path / "ts-cache" / "runs").exists() or any((tmp_path / "ts-cache" / "runs").iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_suite_times_cuda_graph_arms_with_events_and_checks_gradients(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "suite.py"), "--cases", "mlp_fp32,mlp_train_bf16",
                           "--arms", "eager,inductor,reduce-overhead", "--rounds", "6", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["limits"]["method"] == "cuda_event"
    inference, train = result["cases"]
    (graph,) = inference["graphs"]
    assert graph["flops"] == 2 * 2 * 64 * 4096 * 1024
    for case in (inference, train):
        assert case["method"]["timer"] == "cuda_event" and len(case["rounds"]) == 6
        for arm in ("eager", "inductor", "reduce-overhead"):
            entry = case["arms"][arm]
            assert entry["status"] == "ok", entry
            assert entry["timing"]["n"] == 6 * 5 and not entry.get("recompiles_while_timed")
            assert entry["max_rel_err"] < (1e-3 if not case["train"] else 3e-2)  # gradients of CUDA-graph replays too


def test_deadline_during_a_compile_keeps_the_compiled_arms_and_skips_the_rest(monkeypatch):
    monkeypatch.setitem(harness._DEADLINE, "hit", False)

    def build(arm, model, inputs, options):
        if arm == "reduce-overhead":  # the suite's SIGUSR1 arrives while this arm compiles
            harness._on_deadline(0, None)
        return model, None

    result = harness.run_case("softmax_fp32_long", torch.device("cpu"), LIMITS,
                              {"tiny": True, "rounds": 3, "calls_per_round": 2, "warmup": 0}, None, build=build)
    arms = result["arms"]
    assert arms["reduce-overhead"]["status"] == "error" and "deadline" in arms["reduce-overhead"]["error"]
    assert all(arms[a]["failed_in"] == "not compiled" for a in ("max-autotune", "tilesmith"))
    assert all(arms[a]["status"] == "ok" for a in ("eager", "inductor", "max-autotune-no-cudagraphs"))
    assert len(result["rounds"]) == 3 and result["interrupted"] == "while compiling reduce-overhead"
    assert result["comparison"]["best_mode"] in ("inductor", "max-autotune-no-cudagraphs")


def test_run_signals_before_the_limit_kills_what_ignores_it_and_its_children(tmp_path):
    polite = ("import signal, sys, time\n"
              "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(0))\n"
              "time.sleep(30)\n")
    code, _, signalled = suite._run([sys.executable, "-c", polite], tmp_path / "a.log", 4.0, {}, grace_s=2.0)
    assert (code, signalled) == (0, True)
    pid_file = tmp_path / "child.pid"
    stubborn = ("import signal, subprocess, sys, time\n"
                "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
                f"p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
                "time.sleep(30)\n")
    code, _, signalled = suite._run([sys.executable, "-c", stubborn], tmp_path / "b.log", 3.0, {}, grace_s=1.0)
    assert (code, signalled) == (None, True)
    child = Path(f"/proc/{pid_file.read_text()}/stat")
    for _ in range(50):  # killed with the group; init reaps it
        if not child.exists() or child.read_text().split(") ")[1][0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the case's child process outlived it")


def test_markdown_explains_a_case_below_the_best_mode_with_the_gates_reasons():
    result = _fake_result()
    case = _fake_case("slow", 0.8, 1.0, installed=False)
    case["arms"]["tilesmith"]["tracks"][0]["evaluations"] = [
        {"proposer": "builtin:config", "status": "rejected_slower", "speedup": 0.97, "reasons": ["slower: 0.97"]}]
    result["cases"].append(case)
    text = report.markdown(result)
    section = text.split("## Cases below 0.98× of the best mode")[1].split("\n## ")[0]
    assert "**slow**: 0.800×" in section and "builtin:config → rejected_slower 0.970× (slower: 0.97)" in section
    assert "**a**" not in section  # 1.21× is not a miss


# ------------------------------------------------------------------------ cases stopped at their limit

def _measured_case(name):
    """A case whose harness measured every arm it was asked for: all six timed, the comparison computed."""
    case = _fake_case(name, 1.1, 1.3)
    case["arms"]["max-autotune"] = _arm([1.5] * 3, 9.0)
    case["method"]["compile_order"] = list(ARMS)
    case["comparison"] = harness.compare(case["arms"])
    return case


def _cut_case(name):
    """A case the deadline cut while the Tilesmith arm compiled: five arms timed, Tilesmith not."""
    case = _measured_case(name)
    case["arms"]["tilesmith"] = {"status": "error", "failed_in": "first_call",
                                 "error": "CaseDeadline: the suite's deadline for this case (SIGUSR1)"}
    case["interrupted"] = "while compiling tilesmith"
    case["comparison"] = harness.compare(case["arms"])
    return case


def _old_stopped(case, status="timeout"):
    """``case`` as older suites wrote a case stopped at its limit (docs/benchmarks/results-2026-12-04.json)."""
    case.update(status=status, error="stopped 45 s before its 170 s limit (--timeout-per-case): interrupted; the "
                                     "arms compiled by then were measured")
    return case


def _suite_args(tmp_path, *more):
    return suite.parse_args(["--tiny", "--device", "cpu", "--out", str(tmp_path / "out"),
                             "--limits", str(_limits_file(tmp_path)), *more])


@pytest.mark.parametrize("outcome", [(0, True), (None, True)], ids=["signalled-then-exited", "killed-at-limit"])
def test_case_stopped_after_every_arm_was_measured_counts_as_done(tmp_path, monkeypatch, outcome):
    def fake_run(cmd, log, timeout, env, grace_s=0.0):
        out = Path(cmd[cmd.index("--out") + 1])
        name = cmd[cmd.index("--case") + 1]
        out.write_text(json.dumps(_measured_case(name) if name == "softmax_fp32_long" else _cut_case(name)))
        return (*outcome[:1], "", outcome[1])

    monkeypatch.setattr(suite, "_run", fake_run)
    args = _suite_args(tmp_path, "--timeout-per-case", "170")
    (tmp_path / "out").mkdir()
    started = time.perf_counter()
    whole = suite._one_case("softmax_fp32_long", args, tmp_path / "out", {}, {}, started)
    cut = suite._one_case("layernorm_residual_bf16", args, tmp_path / "out", {}, {}, started)
    assert whole["status"] == "done" and "error" not in whole
    assert whole["note"].startswith("stopped at its limit after every arm was measured")
    assert "170 s limit (--timeout-per-case)" in whole["note"]
    assert cut["status"] == "timeout" and "note" not in cut and "170 s limit (--timeout-per-case)" in cut["error"]
    assert ("while compiling tilesmith" in cut["error"]) == (outcome[0] is not None)  # killed: maybe mid-rounds
    s = report.summary({"cases": [whole, cut]})
    assert s["cases_not_done"] == ["layernorm_residual_bf16"] and s["cases_compared"] == 1
    text = report.markdown({"cases": [whole, cut], "limits": {}})
    assert "not done: layernorm_residual_bf16." in text
    assert "- softmax_fp32_long: stopped at its limit after every arm was measured" in text


def test_measured_needs_every_requested_arm_timed_the_rounds_whole_and_the_ratios():
    assert report.measured(_measured_case("a"))
    assert not report.measured(_cut_case("a"))
    rounds_cut = _measured_case("a") | {"interrupted": "after round 2 of 18"}
    assert not report.measured(rounds_cut)
    no_ratios = _measured_case("a")
    del no_ratios["comparison"]  # killed before the harness compared the arms
    assert not report.measured(no_ratios)
    fewer = _cut_case("a")  # only the arms it was asked for count
    fewer["method"]["compile_order"] = [a for a in ARMS if a != "tilesmith"]
    del fewer["interrupted"]
    assert report.measured(fewer)


def test_merge_reads_old_results_with_measured_timeout_cases_as_done(tmp_path):
    first, second = _fake_result(), _fake_result()
    first["cases"] = [_old_stopped(_measured_case("softmax_fp32_long")), _old_stopped(_cut_case("layernorm"))]
    second["cases"] = [_old_stopped(_measured_case("int8_gemv_bf16"), "killed_budget"),
                       {"case": "softmax_fp32_long", "status": "skipped", "arms": {}}]
    paths = [tmp_path / "1.json", tmp_path / "2.json"]
    for path, doc in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(doc))
    merged = suite.merge(paths)
    by_name = {c["case"]: c for c in merged["cases"]}
    assert by_name["softmax_fp32_long"]["status"] == "done"  # measured: the later skipped entry does not replace it
    assert by_name["int8_gemv_bf16"]["status"] == "done"
    assert "stopped 45 s before its 170 s limit" in by_name["softmax_fp32_long"]["note"]
    assert "error" not in by_name["softmax_fp32_long"]
    assert by_name["layernorm"]["status"] == "timeout"
    paths = suite.write_outputs(merged, tmp_path / "out")
    assert merged["summary"]["cases_not_done"] == ["layernorm"] and merged["summary"]["cases_compared"] == 2
    assert "not done: layernorm." in paths["markdown"].read_text()


def test_resume_keeps_measured_cases_whatever_their_old_status_and_retries_the_cut_ones(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    previous = _fake_result()
    previous["cases"] = [_old_stopped(_measured_case("softmax_fp32_long")),
                         _old_stopped(_measured_case("layernorm_residual_bf16"), "killed_budget"),
                         _old_stopped(_cut_case("int8_gemv_bf16"), "killed_budget")]
    (out / "results.json").write_text(json.dumps(previous))
    args = _suite_args(tmp_path, "--resume", "--budget-s", "0", "--cases",
                       "softmax_fp32_long,layernorm_residual_bf16,int8_gemv_bf16")
    result = suite.run_suite(args)
    statuses = {c["case"]: c["status"] for c in result["cases"]}
    # a budget of 0 s skips every case it runs: only the cut one was run again
    assert statuses == {"softmax_fp32_long": "done", "layernorm_residual_bf16": "done", "int8_gemv_bf16": "skipped"}


# ------------------------------------------------------------------------------------ per-case logs

def test_run_log_keeps_what_the_case_printed_before_it_was_killed(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # as when the suite is started without gpu-suite.sh
    script = ("import signal, time\n"
              "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
              "print('eager: ok, first call 0.1 s')\n"
              "time.sleep(30)\n")
    log = tmp_path / "case.log"
    code, tail, _ = suite._run([sys.executable, "-c", script], log, 3.0, suite.child_env("cpu"), grace_s=1.0)
    assert code is None
    assert "eager: ok, first call 0.1 s" in log.read_text() and "eager: ok" in tail


def test_case_log_holds_the_harness_output(tmp_path):
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "limits.json").write_text(_limits_file(tmp_path).read_text())
    args = _suite_args(tmp_path, "--arms", "eager", "--tilesmith-cache", "shared")
    options = {"arms": ["eager"], "tiny": True, "rounds": 2, "calls_per_round": 1, "seed": 0}
    case = suite._one_case("mlp_fp32", args, out, suite.child_env("cpu"), options, time.perf_counter())
    assert case["status"] == "done", case
    text = (out / "logs" / "mlp_fp32.log").read_text()
    for line in ("case mlp_fp32", "captured 1 graph", "eager: ok", "round 2/2", "done"):
        assert line in text, text
