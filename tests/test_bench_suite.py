"""The benchmark suite's harness on CPU: cases build, graphs are captured and costed, arms are timed the same
way, reports are written. Correctness of the harness, not speed (CPU test mode)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import report, suite  # noqa: E402
from bench.cases import CASES, get_case  # noqa: E402
from bench.harness import capture_graphs, cost_graphs, max_rel_error, summarize, time_calls  # noqa: E402
from tilesmith.roofline import DeviceLimits  # noqa: E402

LIMITS = DeviceLimits("cpu", "cpu", copy_gbps=10.0, matmul_bf16_tflops=0.01, matmul_fp32_tflops=0.01,
                      method="host_clock")


def test_suite_has_the_eight_required_cases():
    assert len(CASES) >= 8
    assert {"mlp_fp32", "gpt2_block_bf16", "gpt2_block_bf16_train", "resnet_block_bf16_cl", "softmax_bias_bf16",
            "llama_block_bf16", "embedding_ce_bf16", "sdpa_qknorm_mask_bf16"} <= set(CASES)
    assert [c.name for c in CASES.values() if c.train] == ["gpt2_block_bf16_train"]


def test_unknown_case_names_the_known_ones():
    with pytest.raises(KeyError, match="mlp_fp32"):
        get_case("nope")


@pytest.mark.parametrize("name", sorted(CASES))
def test_tiny_case_runs_eagerly_with_finite_outputs(name):
    workload = get_case(name).build(torch.device("cpu"), True)
    if workload.train:
        out = workload.model(*workload.inputs)
        out.backward(workload.grad)
        assert all(p.grad is not None for p in workload.model.parameters())
    else:
        with torch.no_grad():
            out = workload.model(*workload.inputs)
    assert torch.isfinite(out.float()).all()
    assert set(workload.shapes) and all("[" in s for s in workload.shapes.values())


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


def test_time_calls_prepares_before_every_call_and_clamps_the_count():
    calls: list[str] = []
    stats = time_calls(lambda: calls.append("run"), lambda: calls.append("prep"), torch.device("cpu"),
                       warmup=2, target_s=1e-9, min_calls=7, max_calls=9)
    assert stats.n == 7 and stats.method == "host_clock"
    assert calls == ["prep", "run"] * (2 + 7)
    many = time_calls(lambda: None, lambda: None, torch.device("cpu"), warmup=1, target_s=10.0, min_calls=1,
                      max_calls=5)
    assert many.n == 5


def test_summarize_reports_median_and_nearest_rank_percentiles():
    stats = summarize([float(v) for v in range(1, 11)], "host_clock")
    assert (stats.median_ms, stats.p10_ms, stats.p90_ms, stats.min_ms) == (5.5, 1.0, 9.0, 1.0)
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


def _fake_result() -> dict:
    def arm(ms, compile_s=1.0):
        return {"status": "ok", "compile_s": compile_s, "timing": {"median_ms": ms}, "max_rel_err": 1e-3}

    return {
        "command": "python bench/suite.py", "created_utc": "t", "options": {"agent": "tilesmith/builtin"},
        "limits": {"device_name": "FakeGPU", "copy_gbps": 4000.0, "matmul_bf16_tflops": 800.0,
                   "matmul_fp32_tflops": 50.0},
        "environment": {"torch": "x"},
        "cases": [{"case": "a", "floor": {"floor_ms": 0.5, "bound": "memory"},
                   "graphs": [{"name": "0_inference", "bytes_read": 2e6, "bytes_written": 1e6, "flops": 0,
                               "floor_ms": 0.5}],
                   "arms": {"eager": arm(4.0, None), "inductor": arm(2.0), "tilesmith": arm(1.6),
                            "reduce-overhead": {"status": "error", "error": "RuntimeError: boom"}}}],
    }


def test_markdown_reports_speedup_over_inductor_and_distance_to_floor():
    text = report.markdown(_fake_result())
    row = next(line for line in text.splitlines() if line.startswith("| a |"))
    assert "1.250×" in row  # inductor 2.0 ms / tilesmith 1.6 ms
    assert "4.00×" in row  # inductor 2.0 ms over the 0.5 ms floor
    assert "3.20×" in row  # best arm 1.6 ms over the floor
    assert "error" in row  # reduce-overhead failed
    assert "RuntimeError: boom" in text


def test_chart_writes_a_png(tmp_path):
    path = tmp_path / "c.png"
    report.chart(_fake_result(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_args_rejects_unknown_cases_and_cpu_without_tiny():
    with pytest.raises(SystemExit):
        suite.parse_args(["--cases", "nope"])
    with pytest.raises(SystemExit):
        suite.parse_args(["--device", "cpu"])
    with pytest.raises(SystemExit):
        suite.parse_args(["--arms", "eager,warp-speed"])
    args = suite.parse_args(["--tiny", "--device", "cpu"])
    assert args.case_names == ["mlp_fp32"] and args.out.name == "bench-tiny"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_parse_args_without_cuda_points_to_the_cpu_harness_mode(capsys):
    with pytest.raises(SystemExit):
        suite.parse_args(["--tiny"])
    assert "no CUDA device" in capsys.readouterr().err


def test_child_env_enables_cpu_test_mode_and_repo_imports():
    env = suite.child_env("cpu")
    assert env["TILESMITH_ALLOW_CPU"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    assert suite.child_env("cuda").get("TILESMITH_ALLOW_CPU") == os.environ.get("TILESMITH_ALLOW_CPU")


@pytest.mark.slow
def test_tiny_cpu_suite_writes_json_markdown_and_png(tmp_path):
    # Its own cache root: the tilesmith arm's run folder and artifacts go there, never to ~/.cache/tilesmith.
    env = dict(os.environ, TILESMITH_ALLOW_CPU="1", TILESMITH_CACHE_DIR=str(tmp_path / "ts"))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "suite.py"), "--tiny", "--device", "cpu",
                           "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    (case,) = result["cases"]
    assert case["case"] == "mlp_fp32" and case["floor"]["floor_ms"] > 0
    assert set(case["arms"]) == set(suite.ARMS)
    for arm in ("eager", "inductor", "max-autotune-no-cudagraphs", "reduce-overhead"):
        entry = case["arms"][arm]
        assert entry["status"] == "ok", entry
        assert entry["timing"]["method"] == "host_clock" and entry["timing"]["n"] >= 5
        assert entry["max_rel_err"] < 1e-4
    assert case["arms"]["inductor"]["compile_s"] > 0
    assert "tilesmith" in case["arms"]  # it may fail until the pipeline lands; it must be reported either way
    md = (tmp_path / "results.md").read_text()
    assert "| mlp_fp32 |" in md
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "logs" / "mlp_fp32.log").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_suite_times_arms_with_cuda_events_and_costs_the_graph(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "suite.py"), "--cases", "mlp_fp32",
                           "--arms", "eager,inductor,reduce-overhead", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["limits"]["method"] == "cuda_event"
    (case,) = result["cases"]
    (graph,) = case["graphs"]
    assert graph["flops"] == 2 * 2 * 64 * 4096 * 1024
    for arm in ("eager", "inductor", "reduce-overhead"):
        entry = case["arms"][arm]
        assert entry["status"] == "ok", entry
        assert entry["timing"]["method"] == "cuda_event" and entry["timing"]["n"] >= 20
        assert entry["max_rel_err"] < 1e-3


def test_markdown_flags_a_time_below_the_roofline_floor():
    result = _fake_result()
    result["cases"][0]["floor"]["floor_ms"] = 1.8  # tilesmith's 1.6 ms is now below the floor
    text = report.markdown(result)
    assert "a / tilesmith: median time is 0.89× the roofline floor" in text
    assert "a / inductor: median time" not in text


def test_spent_budget_skips_cases_but_still_writes_the_report(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "suite.py"), "--tiny", "--device", "cpu",
                           "--cases", "mlp_fp32,softmax_bias_bf16", "--budget-s", "0", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, TILESMITH_CACHE_DIR=str(tmp_path / "ts")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert [c["case"] for c in result["cases"]] == ["mlp_fp32", "softmax_bias_bf16"]
    assert all(c["error"].startswith("skipped: suite budget") for c in result["cases"])
    assert "skipped: suite budget" in (tmp_path / "results.md").read_text()
