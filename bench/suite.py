"""Tilesmith benchmark suite: real model graphs under eager, Inductor default, max-autotune-no-cudagraphs,
reduce-overhead and Tilesmith, side by side, with roofline floors from limits measured in the same run.

Usage (repository root)::

    python bench/suite.py                                   # every case, built-in agent, docs/benchmarks/
    python bench/suite.py --cases mlp_fp32,gpt2_block_bf16  # a subset
    python bench/suite.py --agent gpt-5.5                   # an LLM through the private proxy
    TILESMITH_ALLOW_CPU=1 python bench/suite.py --tiny --device cpu --out /tmp/bench   # harness check

One subprocess measures the device limits, then one subprocess per case runs all arms
(``bench/harness.py``); the suite writes ``results.json``, ``results.md`` and ``results.png`` to
``--out`` and the per-case logs to ``--out``/logs. Exit status: 0 when every case ran (arms may still
have failed, see the report), 1 when the limits could not be measured, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from bench import report  # noqa: E402
from bench.cases import CASES  # noqa: E402

ARMS = ("eager", "inductor", "max-autotune-no-cudagraphs", "reduce-overhead", "tilesmith")
HARNESS = Path(__file__).resolve().parent / "harness.py"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Tilesmith benchmark suite (one process per case).")
    parser.add_argument("--cases", default=None,
                        help="comma-separated case names (default: all; with --tiny: mlp_fp32). "
                             f"Known: {', '.join(CASES)}")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms (default: {','.join(ARMS)})")
    parser.add_argument("--agent", default="tilesmith/builtin",
                        help="agent_model for the Tilesmith arm: 'tilesmith/builtin' or a model the proxy lists")
    parser.add_argument("--agency", default=None, choices=("low", "medium", "high"))
    parser.add_argument("--loops", type=int, default=None)
    parser.add_argument("--max-model-calls", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: docs/benchmarks; with --tiny: .cache/bench-tiny)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu needs --tiny: test mode)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: harness correctness, not speed")
    parser.add_argument("--timeout-per-case", type=float, default=300.0, help="seconds before a case is killed")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget of the whole suite: a running case is killed when it runs out "
                             "(its finished arms are kept) and later cases are reported as skipped")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    if args.list:
        return args
    names = [n for n in (args.cases or ("mlp_fp32" if args.tiny else ",".join(CASES))).split(",") if n]
    unknown = [n for n in names if n not in CASES]
    arms = [a for a in args.arms.split(",") if a]
    bad_arms = [a for a in arms if a not in ARMS]
    if unknown or bad_arms:
        parser.error(f"unknown case(s) {unknown} / arm(s) {bad_arms}; "
                     f"cases: {', '.join(CASES)}; arms: {', '.join(ARMS)}")
    if args.device == "cpu" and not args.tiny:
        parser.error("--device cpu is a harness test mode: add --tiny")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device here: run the suite on a GPU machine, or check the harness on the CPU "
                         "with TILESMITH_ALLOW_CPU=1 python bench/suite.py --tiny --device cpu")
    args.case_names, args.arm_names = names, arms
    if args.out is None:
        args.out = _REPO / (".cache/bench-tiny" if args.tiny else "docs/benchmarks")
    return args


def child_env(device: str) -> dict[str, str]:
    """Environment of the subprocesses: the repository importable; CPU test mode when ``device`` is cpu."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p)
    if device == "cpu":
        env["TILESMITH_ALLOW_CPU"] = "1"
        env.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
    return env


def _run(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> tuple[int | None, str]:
    """Run ``cmd`` with stdout+stderr to ``log``; returns (exit code or None on timeout, log tail)."""
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=_REPO,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the case's own process group: its compile workers and gate workers too
            proc.wait()
            code = None
    tail = log.read_text(errors="replace")[-2000:]
    return code, tail


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = args.out
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = child_env(args.device)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "format": 1, "created_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(shlex.quote(a) for a in ["python", "bench/suite.py", *sys.argv[1:]]),
        "options": {"agent": args.agent, "agency": args.agency, "loops": args.loops,
                    "max_model_calls": args.max_model_calls, "arms": args.arm_names, "tiny": args.tiny,
                    "device": args.device},
        "cases": [],
    }
    limits_path = out / "limits.json"
    code, tail = _run([sys.executable, str(HARNESS), "limits", "--device", args.device, "--out", str(limits_path)],
                      logs / "limits.log", 180.0, env)
    if code != 0 or not limits_path.exists():
        result["error"] = f"measuring device limits failed (exit {code}): {tail[-800:]}"
        return result
    measured = json.loads(limits_path.read_text())
    result["limits"], result["environment"] = measured["limits"], measured["environment"]
    lim = measured["limits"]
    print(f"limits: copy {lim['copy_gbps']:.0f} GB/s, bf16 {lim['matmul_bf16_tflops']:.1f} TFLOP/s, "
          f"fp32 {lim['matmul_fp32_tflops']:.1f} TFLOP/s", flush=True)
    options = {k: v for k, v in result["options"].items() if k != "device"}
    for name in args.case_names:
        timeout = args.timeout_per_case
        if args.budget_s is not None:
            timeout = min(timeout, args.budget_s - (time.perf_counter() - started))
        if args.budget_s is not None and timeout < 10:
            result["cases"].append({"case": name, "error": f"skipped: suite budget of {args.budget_s:.0f} s spent",
                                    "arms": {}})
            continue
        case_json = out / f"case_{name}.json"
        case_json.unlink(missing_ok=True)
        t0 = time.perf_counter()
        code, tail = _run([sys.executable, str(HARNESS), "case", "--case", name, "--device", args.device,
                           "--limits", str(limits_path), "--out", str(case_json), "--options", json.dumps(options)],
                          logs / f"{name}.log", timeout, env)
        case = json.loads(case_json.read_text()) if case_json.exists() else {"case": name, "arms": {}}
        if code is None:
            case["error"] = f"killed after {timeout:.0f} s (per-case timeout or suite budget; finished arms kept)"
        elif code != 0:
            case["error"] = f"case process exited with {code}: {tail[-800:]}"
        case["process_s"] = time.perf_counter() - t0
        result["cases"].append(case)
        case_json.unlink(missing_ok=True)
        print(f"{name}: {case['process_s']:.0f} s " + " ".join(
            f"{a}={report.arm_ms(case, a):.4f}ms" if report.arm_ms(case, a) else f"{a}=–" for a in args.arm_names),
            flush=True)
        result["wall_s"] = time.perf_counter() - started
        write_outputs(result, out)  # after every case: a killed suite still leaves its finished cases
    result["wall_s"] = time.perf_counter() - started
    return result


def write_outputs(result: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and ``results.png`` into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md", "chart": out / "results.png"}
    paths["json"].write_text(json.dumps(result, indent=1))
    if "error" in result and not result["cases"]:
        paths["markdown"].write_text(f"# Tilesmith benchmark suite\n\nThe suite did not run: {result['error']}\n")
        return {k: v for k, v in paths.items() if k != "chart"}
    paths["markdown"].write_text(report.markdown(result))
    report.chart(result, paths["chart"])
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for case in CASES.values():
            print(f"{case.name:24s} {case.description}")
        return 0
    result = run_suite(args)
    paths = write_outputs(result, args.out)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if result.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
