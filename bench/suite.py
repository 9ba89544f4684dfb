"""Tilesmith benchmark suite: real model graphs under eager, the four ``torch.compile`` modes (default,
max-autotune-no-cudagraphs, reduce-overhead, max-autotune) and Tilesmith, timed interleaved in one process per
case, with roofline floors from limits measured in the same run.

Usage (repository root)::

    python bench/suite.py --out /tmp/bench                      # every case, built-in agent
    python bench/suite.py --cases part1 --out /tmp/bench        # a named subset (see --list), or case names
    python bench/suite.py --cases part2 --out /tmp/bench --resume   # add cases to an earlier run's results
    python bench/suite.py --merge a/results.json b/results.json --out docs/benchmarks   # combine runs
    python bench/suite.py --agent gpt-5.5 --out /tmp/bench      # an LLM through the private proxy
    TILESMITH_ALLOW_CPU=1 python bench/suite.py --tiny --device cpu --out /tmp/bench   # harness check

One subprocess measures the device limits (``--limits`` reuses a file, ``--resume`` the one in ``--out``), then one subprocess per case compiles
and times all arms (``bench/harness.py``); the suite rewrites ``results.json``, ``results.md`` and
``results.png`` in ``--out`` after every case, and keeps per-case logs in ``--out``/logs.

Budget (``--budget-s``, seconds of this invocation): a case starts only when its ``estimate_s``
(``bench/cases.py``) fits in what is left; otherwise it is recorded as ``skipped`` and later, smaller cases are
still tried. A running case gets at most the time left (and ``--timeout-per-case``): ``GRACE_S`` before that
limit it is signalled to stop compiling and report the arms it has (``bench/harness.py``, "Deadline"), and at
the limit it is killed. A case so stopped whose results hold every arm it was asked for, all rounds and the
ratios (``bench.report.measured``) is ``done`` with a ``note`` saying it was stopped after its measurement;
otherwise it is ``killed_budget`` when the suite budget ran out, else ``timeout``. The same rule applies to the
cases of results files read by ``--resume`` and ``--merge`` (``bench.report.settle``), so files from before it,
which say ``timeout`` for such cases, count the same. With ``--resume``, cases that are ``done``/``error``/
``timeout`` in ``--out``/results.json are kept and not run again, while ``skipped``/``killed_budget`` ones are
retried, so repeated invocations of the same command fill in a suite that does not fit one device command.

Each case's process writes its progress (``bench/harness.py``: phases, arms, rounds, the deadline signal) and
Tilesmith's log messages to ``--out``/logs/<case>.log, unbuffered, so a case killed at its limit leaves what it
printed until then.

Exit status: 0 when every selected case ran or was skipped for the budget (arms may still have failed, see the
report), 1 when the limits could not be measured, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from bench import report  # noqa: E402
from bench.arms import ARMS  # noqa: E402
from bench.cases import CASES, SUBSETS, expand_names  # noqa: E402

HARNESS = Path(__file__).resolve().parent / "harness.py"
FORMAT = 2
RETRY_STATUSES = ("skipped", "killed_budget")
"""Case statuses that ``--resume`` runs again."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Tilesmith benchmark suite (one process per case).")
    parser.add_argument("--cases", default=None,
                        help="comma-separated case and subset names (default: all; with --tiny: mlp_fp32). "
                             f"Subsets: {', '.join(SUBSETS)}; see --list")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms (default: {','.join(ARMS)})")
    parser.add_argument("--agent", default="tilesmith/builtin",
                        help="agent_model of the Tilesmith arm: 'tilesmith/builtin', a model the proxy lists, or "
                             "'py:module:attr' (an OptimizerFactory, e.g. py:bench.optimizers:NoOpFactory)")
    parser.add_argument("--agency", default=None, choices=("low", "medium", "high"))
    parser.add_argument("--loops", type=int, default=None)
    parser.add_argument("--max-model-calls", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per case (default: 18; cpu: 6)")
    parser.add_argument("--calls-per-round", type=int, default=None,
                        help="timed calls per arm and round (default: 5; cpu: 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the round orders")
    parser.add_argument("--graph-budget-s", type=float, default=None,
                        help="sets TILESMITH_GRAPH_BUDGET_S (seconds of first-call optimization per graph) for "
                             "the cases; default: the environment's or Tilesmith's default")
    parser.add_argument("--optimize", choices=("inline", "background"), default=None,
                        help="TILESMITH_OPTIMIZE for the Tilesmith arm (default: the environment's, else inline); "
                             "with background its first call returns on Inductor and decided_s is when the "
                             "optimization ended")
    parser.add_argument("--tilesmith-cache", choices=("fresh", "shared"), default="fresh",
                        help="fresh (default): each case's Tilesmith arm gets an empty TILESMITH_CACHE_DIR under "
                             "--out/tilesmith-cache/<case> (its first call optimizes instead of reusing an artifact, "
                             "and its run folder stays there); shared: the environment's TILESMITH_CACHE_DIR")
    parser.add_argument("--out", type=Path, default=None, help="output folder (required unless --tiny or --list; "
                        "docs/benchmarks is written only by the lead's committed run)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu needs --tiny: test mode)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: harness correctness, not speed")
    parser.add_argument("--limits", type=Path, default=None,
                        help="reuse a limits.json measured earlier on this device instead of measuring")
    parser.add_argument("--timeout-per-case", type=float, default=420.0,
                        help="seconds before a case is stopped (default 420)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget of this invocation (module docstring: estimates, skipping)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the finished cases of --out/results.json; run only the others")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="RESULTS_JSON",
                        help="combine results.json files (a later file's case replaces an earlier one's) into --out")
    parser.add_argument("--list", action="store_true", help="list the cases, subsets and estimates, and exit")
    args = parser.parse_args(argv)
    if args.list:
        return args
    if args.out is None:
        if not args.tiny:
            parser.error("give --out (e.g. /tmp/bench); the committed docs/benchmarks files are the lead's")
        args.out = _REPO / ".cache/bench-tiny"
    if args.merge:
        return args
    try:
        names = expand_names(args.cases or ("mlp_fp32" if args.tiny else ",".join(CASES)))
    except KeyError as exc:
        parser.error(str(exc.args[0]))
    arms = [a for a in args.arms.split(",") if a]
    bad_arms = [a for a in arms if a not in ARMS]
    if bad_arms or not arms:
        parser.error(f"unknown arm(s) {bad_arms or '(none given)'}; arms: {', '.join(ARMS)}")
    if args.device == "cpu" and not args.tiny:
        parser.error("--device cpu is a harness test mode: add --tiny")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device here: run the suite on a GPU machine, or check the harness on the CPU "
                         "with TILESMITH_ALLOW_CPU=1 python bench/suite.py --tiny --device cpu")
    args.case_names, args.arm_names = names, arms
    return args


def child_env(device: str, graph_budget_s: float | None = None, optimize: str | None = None) -> dict[str, str]:
    """Environment of the subprocesses: the repository importable; Python's output unbuffered (their stdout is
    a log file, block-buffered otherwise, and a process killed at its limit would lose what it printed last);
    CPU test mode when ``device`` is cpu; ``TILESMITH_GRAPH_BUDGET_S`` when ``graph_budget_s`` is given,
    ``TILESMITH_OPTIMIZE`` when ``optimize`` is."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p)
    if device == "cpu":
        env["TILESMITH_ALLOW_CPU"] = "1"
        env.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
    if graph_budget_s is not None:
        env["TILESMITH_GRAPH_BUDGET_S"] = f"{graph_budget_s:g}"
    if optimize is not None:
        env["TILESMITH_OPTIMIZE"] = optimize
    return env


GRACE_S = 45.0
"""Seconds between the deadline signal (SIGUSR1) and the kill: enough for the rounds and checks of the arms
that were compiled (``bench/harness.py``, "Deadline")."""


def _run(cmd: list[str], log: Path, timeout: float, env: dict[str, str], grace_s: float = 0.0,
         ) -> tuple[int | None, str, bool]:
    """Run ``cmd`` with stdout+stderr to ``log``. With ``grace_s``, SIGUSR1 is sent ``grace_s`` before
    ``timeout`` (the harness then stops compiling and reports what it has). Returns (exit code or None when it
    was killed at ``timeout``, log tail, whether the signal was sent). The process group is killed at the end
    either way, so no compile or gate worker outlives its case; the leader is reaped only after that, so the
    group id cannot have been reused."""
    signalled = killed = False
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=_REPO,
                                start_new_session=True)
        try:
            exited = _wait_unreaped(proc.pid, max(1.0, timeout - grace_s) if grace_s else timeout)
            if not exited and grace_s:
                signalled = True
                proc.send_signal(signal.SIGUSR1)
                exited = _wait_unreaped(proc.pid, grace_s)
            killed = not exited
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the case's own group: its compile and gate workers
            except (ProcessLookupError, PermissionError):
                pass
            code: int | None = proc.wait()
    tail = log.read_text(errors="replace")[-2000:]
    return (None if killed else code), tail, signalled


def _wait_unreaped(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for child ``pid`` to exit without reaping it (``waitid`` with ``WNOWAIT``)."""
    deadline = time.monotonic() + timeout
    while True:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _measure_limits(args: argparse.Namespace, out: Path, env: dict[str, str]) -> dict[str, Any] | str:
    """The limits document (``{"limits", "environment"}``), or an error message."""
    path = out / "limits.json"
    reuse = args.limits if args.limits is not None else (path if args.resume and path.exists() else None)
    if reuse is not None:
        try:
            return json.loads(Path(reuse).read_text())
        except (OSError, ValueError) as exc:
            return f"reading the limits file {reuse} failed: {exc}"
    code, tail, _ = _run([sys.executable, str(HARNESS), "limits", "--device", args.device, "--out", str(path)],
                         out / "logs" / "limits.log", 180.0, env)
    if code != 0 or not path.exists():
        return f"measuring device limits failed (exit {code}): {tail[-800:]}"
    return json.loads(path.read_text())


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = child_env(args.device, args.graph_budget_s, args.optimize)
    started = time.perf_counter()
    command = " ".join(shlex.quote(a) for a in ["python", "bench/suite.py", *sys.argv[1:]])
    options = {"agent": args.agent, "agency": args.agency, "loops": args.loops, "max_model_calls": args.max_model_calls,
               "arms": args.arm_names, "tiny": args.tiny, "rounds": args.rounds,
               "calls_per_round": args.calls_per_round, "seed": args.seed, "graph_budget_s": args.graph_budget_s,
               "optimize": args.optimize,
               "tilesmith_cache": args.tilesmith_cache}
    previous = _load_results(out / "results.json") if args.resume else None
    kept = {c["case"]: c for c in (previous or {}).get("cases", []) if c.get("status") not in RETRY_STATUSES}
    result: dict[str, Any] = previous if previous else {"format": FORMAT, "created_utc": _now(), "cases": []}
    result.setdefault("invocations", []).append({"command": command, "started_utc": _now(), "options": options,
                                                 "device": args.device})
    result.update(command=command, options=options)
    measured = _measure_limits(args, out, env)
    if isinstance(measured, str):
        result["error"] = measured
        return result
    result.pop("error", None)
    result.setdefault("limits", measured["limits"])
    result.setdefault("environment", measured["environment"])
    (out / "limits.json").write_text(json.dumps(measured, indent=1))
    lim = measured["limits"]
    todo = [n for n in args.case_names if n not in kept]
    print(f"limits: copy {lim['copy_gbps']:.0f} GB/s, bf16 {lim['matmul_bf16_tflops']:.1f} TFLOP/s, "
          f"fp32 {lim['matmul_fp32_tflops']:.1f} TFLOP/s; {len(todo)} case(s) to run, estimated "
          f"{sum(CASES[n].estimate_s for n in todo):.0f} s" + (f" (kept {len(kept)})" if kept else ""), flush=True)
    harness_options = {k: v for k, v in options.items() if k not in ("graph_budget_s", "tilesmith_cache", "optimize")}
    for name in todo:
        case = _one_case(name, args, out, env, harness_options, started)
        kept[name] = case
        result["cases"] = _ordered(kept, result.get("cases", []), args.case_names)
        result["wall_s"] = time.perf_counter() - started
        result["invocations"][-1]["wall_s"] = result["wall_s"]
        _print_case(case)
        write_outputs(result, out)  # after every case: a killed suite still leaves its finished cases
    result["cases"] = _ordered(kept, result.get("cases", []), args.case_names)
    result["wall_s"] = time.perf_counter() - started
    result["invocations"][-1]["wall_s"] = result["wall_s"]
    return result


def _one_case(name: str, args: argparse.Namespace, out: Path, env: dict[str, str], options: dict[str, Any],
              started: float) -> dict[str, Any]:
    estimate = 1.0 if args.tiny else CASES[name].estimate_s  # tiny cases: skipped only once the budget is spent
    left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - started)
    if left is not None and left < min(estimate, args.timeout_per_case):
        return {"case": name, "status": "skipped", "arms": {}, "estimate_s": CASES[name].estimate_s,
                "error": f"skipped: estimated {estimate:.0f} s, {max(left, 0):.0f} s left of the suite budget of "
                         f"{args.budget_s:.0f} s (run again with --resume to fill it in)"}
    timeout = args.timeout_per_case if left is None else min(args.timeout_per_case, left)
    grace = min(GRACE_S, timeout / 3)
    case_json = out / f"case_{name}.json"
    case_json.unlink(missing_ok=True)
    if args.tilesmith_cache == "fresh":
        cache = out / "tilesmith-cache" / name
        shutil.rmtree(cache, ignore_errors=True)
        env = dict(env, TILESMITH_CACHE_DIR=str(cache))
    t0 = time.perf_counter()
    code, tail, signalled = _run([sys.executable, str(HARNESS), "case", "--case", name, "--device", args.device,
                                  "--limits", str(out / "limits.json"), "--out", str(case_json),
                                  "--options", json.dumps(options)],
                                 out / "logs" / f"{name}.log", timeout, env, grace_s=grace)
    case = _load(case_json) or {"case": name, "arms": {}}
    case_json.unlink(missing_ok=True)
    by_budget = left is not None and timeout >= left
    why = "the suite budget ran out" if by_budget else "--timeout-per-case"
    if code is None or signalled:
        case["status"] = "killed_budget" if by_budget else "timeout"
        stop = (f"killed at its {timeout:.0f} s limit" if code is None
                else f"stopped {grace:.0f} s before its {timeout:.0f} s limit") + f" ({why})"
        case["error"] = stop + ("; the phases it finished are kept" if code is None
                                else f": {case['interrupted']}; the arms compiled by then were measured"
                                if case.get("interrupted") else "")
        report.settle(case)
    elif code != 0:
        case["status"] = "error"
        case["error"] = f"case process exited with {code}: {tail[-800:]}"
    else:
        case.setdefault("status", "done")
    case["process_s"] = time.perf_counter() - t0
    return case


def _ordered(kept: dict[str, dict[str, Any]], previous: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Cases in suite order: earlier results first in their order, then this invocation's names."""
    order = [c["case"] for c in previous] + [n for n in names if n not in {c["case"] for c in previous}]
    order += [n for n in kept if n not in order]
    return [kept[n] for n in order if n in kept]


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _load_results(path: Path) -> dict[str, Any] | None:
    """A results file with its cases settled (``bench.report.settle``: a stopped but measured case is ``done``,
    whichever suite version wrote the file), or ``None`` when it cannot be read."""
    doc = _load(path)
    for case in (doc or {}).get("cases", []):
        report.settle(case)
    return doc


def _print_case(case: dict[str, Any]) -> None:
    cells = []
    for arm in ARMS:
        if arm in case.get("arms", {}):
            ms = report.arm_ms(case, arm)
            cells.append(f"{arm}={ms:.4f}ms" if ms else f"{arm}=–")
    vs = (case.get("comparison") or {}).get("tilesmith_vs_best") or {}
    best = (case.get("comparison") or {}).get("best_mode")
    tail = f" tilesmith over best ({best})={vs['ratio']:.3f}×" if vs.get("ratio") else ""
    print(f"{case['case']}: {case.get('status')} {case.get('process_s', 0):.0f} s " + " ".join(cells) + tail,
          flush=True)


def merge(paths: list[Path]) -> dict[str, Any]:
    """One results document from several: cases by name, settled (``bench.report.settle``; a later file's case
    replaces an earlier one's unless it is skipped or killed_budget), limits and environment of the first file,
    every file's invocations and limits under ``parts``."""
    merged: dict[str, Any] = {"format": FORMAT, "created_utc": _now(), "cases": [], "parts": [], "invocations": []}
    cases: dict[str, dict[str, Any]] = {}
    for path in paths:
        doc = _load_results(path)
        if doc is None:
            raise ValueError(f"--merge: cannot read {path} as JSON")
        merged.setdefault("limits", doc.get("limits"))
        merged.setdefault("environment", doc.get("environment"))
        merged.setdefault("options", doc.get("options"))
        merged["parts"].append({"file": str(path), "command": doc.get("command"), "limits": doc.get("limits"),
                                "wall_s": doc.get("wall_s")})
        merged["invocations"] += doc.get("invocations", [])
        for case in doc.get("cases", []):
            if case["case"] in cases and case.get("status") in RETRY_STATUSES:
                continue  # a skipped case never replaces a measured one
            cases[case["case"]] = case
    merged["cases"] = [cases[n] for n in CASES if n in cases] + [c for n, c in cases.items() if n not in CASES]
    merged["command"] = "python bench/suite.py --merge " + " ".join(shlex.quote(str(p)) for p in paths)
    merged["wall_s"] = sum(p.get("wall_s") or 0 for p in merged["parts"])
    return merged


def write_outputs(result: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and ``results.png`` into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    result["summary"] = report.summary(result)
    paths = {"json": out / "results.json", "markdown": out / "results.md", "chart": out / "results.png"}
    paths["json"].write_text(json.dumps(result, indent=1))
    if "error" in result and not result["cases"]:
        paths["markdown"].write_text(f"# Tilesmith benchmark suite\n\nThe suite did not run: {result['error']}\n")
        return {k: v for k, v in paths.items() if k != "chart"}
    paths["markdown"].write_text(report.markdown(result))
    try:
        report.chart(result, paths["chart"])
    except ImportError as exc:  # matplotlib is a dev/report extra
        print(f"no chart: {exc}", flush=True)
        paths.pop("chart")
    return paths


def _list() -> None:
    for case in CASES.values():
        print(f"{case.name:26s} ~{case.estimate_s:4.0f} s  {case.description}")
    for name, members in SUBSETS.items():
        print(f"subset {name}: ~{sum(CASES[n].estimate_s for n in members):.0f} s: {', '.join(members)}")
    print(f"all cases: ~{sum(c.estimate_s for c in CASES.values()):.0f} s on one H200 (estimates, bench/cases.py)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        _list()
        return 0
    if args.merge:
        try:
            result = merge(args.merge)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
    else:
        result = run_suite(args)
    paths = write_outputs(result, args.out)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if result.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
