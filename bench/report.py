"""Turn the suite's JSON into a summary, a Markdown report and a PNG chart.

Reading the numbers (docs/benchmarks.md has the method):

- an arm's time is the median over rounds of its per-round median (ms per call, end to end);
- "tilesmith vs X" is the median over rounds of ``X_ms[r] / tilesmith_ms[r]`` (> 1: Tilesmith faster) with a
  95 % percentile-bootstrap interval; "best mode" is the ``torch.compile`` mode (default, max-autotune-no-cudagraphs,
  reduce-overhead, max-autotune) with the lowest median in that case;
- "× floor" is ``arm_ms / floor_ms``, the distance to the roofline floor (a lower bound, not a target).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.stats import geomean

ARM_LABELS = {
    "eager": "eager",
    "inductor": "default",
    "max-autotune-no-cudagraphs": "max-autotune-nc",
    "reduce-overhead": "reduce-overhead",
    "max-autotune": "max-autotune",
    "tilesmith": "tilesmith",
}

TARGETS = {"min_vs_best": 0.98, "geomean_vs_best": 1.10, "geomean_vs_default": 1.3, "max_first_call_ratio": 1.5}
"""Issue 13's goals: Tilesmith ≥ 0.98× the best mode on every case, geometric means ≥ 1.10× over the best mode and
≥ 1.3× over default Inductor, first call ≤ 1.5× the max-autotune-no-cudagraphs compile time."""


def arm_ms(case: dict[str, Any], arm: str) -> float | None:
    """Median per-call time of ``arm`` in ms (median over rounds), or ``None`` when it did not run or failed."""
    entry = case.get("arms", {}).get(arm) or {}
    if entry.get("status") != "ok":
        return None
    value = (entry.get("timing") or {}).get("median_ms")
    return float(value) if isinstance(value, (int, float)) else None


STOPPED = ("timeout", "killed_budget")
"""Statuses the suite gives a case its limit stopped (``bench/suite.py``); :func:`settle` makes a measured one
``done``."""

MEASURED_NOTE = ("stopped at its limit after every arm was measured: only work that follows the measurement was cut "
                 "(e.g. the optimizer's remaining background work, the process's exit)")


def measured(case: dict[str, Any]) -> bool:
    """Whether ``case`` holds the whole measurement it was asked for: every requested arm
    (``method.compile_order``; without it, the arms present) timed, the rounds not cut short (no ``interrupted``)
    and the ratios computed (``comparison``, which the harness writes only after the rounds and the checks)."""
    requested = (case.get("method") or {}).get("compile_order") or list(case.get("arms") or {})
    return (bool(requested) and bool(case.get("comparison")) and not case.get("interrupted")
            and all(arm_ms(case, arm) is not None for arm in requested))


def settle(case: dict[str, Any]) -> dict[str, Any]:
    """Apply the rule for cases stopped at their limit to ``case`` (in place; returned): one of :data:`STOPPED`
    that is :func:`measured` anyway is ``done``, with the suite's stop message moved from ``error`` into
    ``note``. The suite applies it to every case it records and every case it reads from a results file, so
    files written before the rule (which say ``timeout`` for such cases) count the same."""
    if case.get("status") in STOPPED and measured(case):
        stop = case.pop("error", None)
        case["status"] = "done"
        case["note"] = MEASURED_NOTE + (f" ({stop})" if stop else "")
    return case


def _cmp(case: dict[str, Any]) -> dict[str, Any]:
    return case.get("comparison") or {}


def vs(case: dict[str, Any], arm: str) -> dict[str, Any] | None:
    """Tilesmith's ratio over ``arm`` (``{"ratio", "ci", "n"}``), ``None`` when not measured."""
    return (_cmp(case).get("tilesmith_vs") or {}).get(arm)


def speedup_over_inductor(case: dict[str, Any], arm: str) -> float | None:
    """``arm``'s median per-round ratio over default Inductor (ratio of medians for results without rounds)."""
    entry = (_cmp(case).get("over_inductor") or {}).get(arm)
    if entry:
        return entry.get("ratio")
    base, ms = arm_ms(case, "inductor"), arm_ms(case, arm)
    return base / ms if base and ms else None


def floor_ratio(case: dict[str, Any], arm: str) -> float | None:
    floor = (case.get("floor") or {}).get("floor_ms")
    ms = arm_ms(case, arm)
    return ms / floor if floor and ms else None


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Suite-level numbers: cases measured and skipped, geometric means of Tilesmith over the best mode and over
    default Inductor (over the cases where both ran), the worst case, the largest first-call ratio, graphs
    installed, and each of :data:`TARGETS` met or not (``None`` when nothing was measured)."""
    cases = result.get("cases") or []
    best = [(c["case"], r["ratio"]) for c in cases if (r := _cmp(c).get("tilesmith_vs_best"))]
    default = [(c["case"], r["ratio"]) for c in cases if (r := vs(c, "inductor"))]
    first = [(c["case"], r) for c in cases if (r := _cmp(c).get("first_call_over_max_autotune_nc"))]
    tracks = [t for c in cases for t in ((c.get("arms") or {}).get("tilesmith") or {}).get("tracks") or []]
    worst = min(best, key=lambda x: x[1]) if best else None
    slowest = max(first, key=lambda x: x[1]) if first else None
    out = {
        "cases": len(cases), "cases_compared": len(best),
        "cases_not_done": [c["case"] for c in cases if c.get("status") not in (None, "done")],
        "geomean_tilesmith_vs_best": geomean([r for _, r in best]),
        "geomean_tilesmith_vs_default": geomean([r for _, r in default]),
        "min_tilesmith_vs_best": list(worst) if worst else None,
        "cases_at_least_0.98_of_best": sum(r >= TARGETS["min_vs_best"] for _, r in best),
        "max_first_call_over_max_autotune_nc": list(slowest) if slowest else None,
        "graphs_tracked": len(tracks), "graphs_installed": sum(t.get("status") == "installed" for t in tracks),
    }
    out["targets_met"] = {
        "min_vs_best": None if worst is None else worst[1] >= TARGETS["min_vs_best"],
        "geomean_vs_best": None if not best else out["geomean_tilesmith_vs_best"] >= TARGETS["geomean_vs_best"],
        "geomean_vs_default": (None if not default
                               else out["geomean_tilesmith_vs_default"] >= TARGETS["geomean_vs_default"]),
        "max_first_call_ratio": None if slowest is None else slowest[1] <= TARGETS["max_first_call_ratio"],
    }
    return out


def _fmt(value: Any, spec: str = ".3f", suffix: str = "") -> str:
    if not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


def _ratio(entry: dict[str, Any] | None) -> str:
    if not entry or entry.get("ratio") is None:
        return "–"
    ci = entry.get("ci") or [None, None]
    return f"{_fmt(entry['ratio'], '.3f', '×')} [{_fmt(ci[0], '.2f')}, {_fmt(ci[1], '.2f')}]"


def _arm_cell(case: dict[str, Any], arm: str) -> str:
    entry = case.get("arms", {}).get(arm)
    if entry is None:
        return "not run"
    if entry.get("status") != "ok":
        return "error"
    return _fmt(arm_ms(case, arm), ".4f")


def _met(value: bool | None) -> str:
    return "not measured" if value is None else ("met" if value else "**not met**")


def _summary_lines(result: dict[str, Any], s: dict[str, Any]) -> list[str]:
    t = s["targets_met"]
    worst, slowest = s.get("min_tilesmith_vs_best"), s.get("max_first_call_over_max_autotune_nc")
    return [
        "## Summary", "",
        f"- Cases: {s['cases']}; compared (Tilesmith and a mode both ran): {s['cases_compared']}"
        + (f"; not done: {', '.join(s['cases_not_done'])}" if s["cases_not_done"] else "") + ".",
        f"- Tilesmith over the best mode: geometric mean {_fmt(s['geomean_tilesmith_vs_best'], '.3f', '×')} "
        f"(target ≥ {TARGETS['geomean_vs_best']}×: {_met(t['geomean_vs_best'])}); worst "
        + (f"{worst[1]:.3f}× on {worst[0]}" if worst else "–")
        + f"; ≥ {TARGETS['min_vs_best']}× on {s['cases_at_least_0.98_of_best']} of {s['cases_compared']} cases "
        f"(target: every case, {_met(t['min_vs_best'])}).",
        f"- Tilesmith over default Inductor: geometric mean {_fmt(s['geomean_tilesmith_vs_default'], '.3f', '×')} "
        f"(target ≥ {TARGETS['geomean_vs_default']}×: {_met(t['geomean_vs_default'])}).",
        "- Tilesmith's first call over max-autotune-no-cudagraphs' compile: largest "
        + (f"{slowest[1]:.2f}× on {slowest[0]}" if slowest else "–")
        + f" (target ≤ {TARGETS['max_first_call_ratio']}×: {_met(t['max_first_call_ratio'])}).",
        f"- Graphs Tilesmith installed: {s['graphs_installed']} of {s['graphs_tracked']} tracked.", ""]


def markdown(result: dict[str, Any]) -> str:
    """The whole report as Markdown (sections: summary, times, ratios, compile, Tilesmith, cost and notes,
    floors, errors)."""
    cases = result.get("cases") or []
    arms = [a for a in ARM_LABELS if any(a in c.get("arms", {}) for c in cases)]
    others = [a for a in arms if a != "tilesmith"]
    lim = result.get("limits") or {}
    env = result.get("environment") or {}
    method = next((c["method"] for c in cases if c.get("method")), {})
    lines = [
        "# Tilesmith benchmark suite results", "",
        f"Command: `{result.get('command', '')}`  ",
        f"Created (UTC): {result.get('created_utc', '')}; device: {lim.get('device_name', '?')} "
        f"(torch {env.get('torch', '?')}, Triton {env.get('triton', '?')}, CUDA {env.get('cuda', '?')}); "
        f"Tilesmith agent: `{(result.get('options') or {}).get('agent', '')}`.", "",
        f"Measured limits: copy {_fmt(lim.get('copy_gbps'), '.0f')} GB/s (read + write), "
        f"bf16 matmul {_fmt(lim.get('matmul_bf16_tflops'), '.4g')} TFLOP/s, fp32 matmul "
        f"{_fmt(lim.get('matmul_fp32_tflops'), '.4g')} TFLOP/s (TF32 {'on' if lim.get('allow_tf32') else 'off'}).", "",
        f"Method: all arms of a case in one process, each its own `torch.compile` of its own copy of the module; "
        f"{method.get('rounds', '?')} interleaved rounds (order shuffled per cycle, rotated per round) × "
        f"{method.get('calls_per_round', '?')} timed calls per arm ({method.get('timer', '?')}"
        + (", L2 flushed before each call" if method.get("flush_bytes") else ", no L2 flush")
        + "); an arm's time is the median over rounds of its per-round median; ratios are medians over rounds "
        "of per-round ratios with 95 % bootstrap intervals (docs/benchmarks.md).", "",
    ]
    lines += _summary_lines(result, result.get("summary") or summary(result))
    lines += ["## Time per call (ms; median over rounds; end to end; training cases: forward + backward)", "",
              "| case | floor ms (bound) | " + " | ".join(ARM_LABELS[a] for a in arms)
              + " | best mode | tilesmith vs best [95 % CI] | best × floor |",
              "|---|---|" + "---|" * len(arms) + "---|---|---|"]
    for case in cases:
        floor = case.get("floor") or {}
        best = _cmp(case).get("best_mode")
        best_ms = min((ms for a in arms if (ms := arm_ms(case, a)) is not None), default=None)
        floor_ms = floor.get("floor_ms")
        lines.append(
            f"| {case['case']} | {_fmt(floor_ms, '.4f')} ({floor.get('bound') or '?'}) | "
            + " | ".join(_arm_cell(case, a) for a in arms)
            + f" | {ARM_LABELS.get(best, '–') if best else '–'} | {_ratio(_cmp(case).get('tilesmith_vs_best'))}"
            + f" | {_fmt(best_ms / floor_ms if best_ms and floor_ms else None, '.2f', '×')} |")
    if "tilesmith" in arms:
        lines += ["", "## Tilesmith over each arm (median of per-round ratios [95 % CI]; > 1: Tilesmith faster)", "",
                  "| case | " + " | ".join(ARM_LABELS[a] for a in others) + " |", "|---|" + "---|" * len(others)]
        for case in cases:
            lines.append(f"| {case['case']} | " + " | ".join(_ratio(vs(case, a)) for a in others) + " |")
    lines += _compile_lines(cases, arms) + _tilesmith_lines(cases) + _miss_lines(cases)
    lines += _cost_lines(cases) + _note_lines(cases) + _floor_lines(cases)
    lines += _problem_lines(cases)
    return "\n".join(lines) + "\n"


def _compile_lines(cases: list[dict[str, Any]], arms: list[str]) -> list[str]:
    compiled = [a for a in arms if a != "eager"]
    lines = ["", "## Compile time: first call (s)", "",
             "| case | " + " | ".join(ARM_LABELS[a] for a in compiled)
             + " | tilesmith first call / max-autotune-nc compile | tilesmith decided | max rel. error vs eager |",
             "|---|" + "---|" * (len(compiled) + 3)]
    for case in cases:
        cells = []
        for a in compiled:
            entry = case.get("arms", {}).get(a) or {}
            cells.append(_fmt(entry.get("first_call_s") or entry.get("compile_s"), ".1f")
                         + ("" if entry.get("status") == "ok" or not entry else " (failed)"))
        errs = [e for a in compiled if (e := (case.get("arms", {}).get(a) or {}).get("max_rel_err")) is not None]
        worst = max((float(e) if not isinstance(e, str) else math.inf for e in errs), default=None)
        lines.append(f"| {case['case']} | " + " | ".join(cells)
                     + f" | {_fmt(_cmp(case).get('first_call_over_max_autotune_nc'), '.2f', '×')}"
                     + f" | {_fmt(((case.get('arms') or {}).get('tilesmith') or {}).get('decided_s'), '.1f')}"
                     + f" | {_fmt(worst, '.1e')} |")
    return lines


def _tilesmith_lines(cases: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## What Tilesmith did per graph (track.json; gate speedup is over the graph's Inductor wrapper)", "",
             "| case | graph | status | winner | gate speedup [95 % CI] | evaluations (proposer: status) | "
             "other records |", "|---|---|---|---|---|---|---|"]
    rows = 0
    for case in cases:
        entry = (case.get("arms") or {}).get("tilesmith") or {}
        extras = {r.get("graph_key"): r.get("extras") for r in entry.get("benchmarks") or []}
        for t in entry.get("tracks") or []:
            bench = t.get("benchmark") or {}
            more = extras.get(t.get("graph_key")) or []
            winner = (t.get("winner") or "–") + (" (" + ", ".join(f"{k}={v}" for k, v in more) + ")" if more else "")
            ci = bench.get("speedup_ci") or [None, None]
            gate = (f"{_fmt(bench.get('speedup'), '.3f')} [{_fmt(ci[0], '.3f')}, {_fmt(ci[1], '.3f')}]"
                    if bench else "–")
            evals = "; ".join(f"{e.get('proposer')}: {e.get('status')}"
                              + (f" {e['speedup']:.3f}" if isinstance(e.get("speedup"), (int, float)) else "")
                              for e in t.get("evaluations") or []) or "none"
            extra = ", ".join(t.get("other_profiles") or {}) or "–"
            lines.append(f"| {case['case']} | {t.get('graph_name')} | {t.get('status')} | {winner} "
                         f"| {gate} | {evals} | {extra} |")
            rows += 1
    if not rows:
        lines.append("| – | – | no track recorded | – | – | – | – |")
    return lines


def _miss_lines(cases: list[dict[str, Any]]) -> list[str]:
    """Cases where Tilesmith is below ``TARGETS["min_vs_best"]`` of the best mode: per graph what was tried and
    what the gate said (status, speedup, first reason of every evaluation)."""
    lines: list[str] = []
    for case in cases:
        best = _cmp(case).get("tilesmith_vs_best")
        if not best or best.get("ratio") is None or best["ratio"] >= TARGETS["min_vs_best"]:
            continue
        lines.append(f"- **{case['case']}**: {_ratio(best)} of {ARM_LABELS.get(_cmp(case).get('best_mode'), '?')}.")
        for t in ((case.get("arms") or {}).get("tilesmith") or {}).get("tracks") or []:
            tried = "; ".join(f"{e.get('proposer')} → {e.get('status')}"
                              + (f" {e['speedup']:.3f}×" if isinstance(e.get("speedup"), (int, float)) else "")
                              + (f" ({e['reasons'][0]})" if e.get("reasons") else "")
                              for e in t.get("evaluations") or []) or "nothing was evaluated"
            lines.append(f"  - {t.get('graph_name')} ({t.get('status')}): {tried}")
    if not lines:
        return []
    return ["", f"## Cases below {TARGETS['min_vs_best']}× of the best mode: what Tilesmith tried", "", *lines]


def _cost_lines(cases: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## Cost per case (s of wall time)", "",
             "| case | status | estimate | process | capture | compiles (all arms) | rounds | check |",
             "|---|---|---|---|---|---|---|---|"]
    for case in cases:
        compiles = sum(v for e in (case.get("arms") or {}).values()
                       if isinstance(v := e.get("first_call_s"), (int, float)))
        lines.append(f"| {case['case']} | {case.get('status', '?')} | {_fmt(case.get('estimate_s'), '.0f')} | "
                     f"{_fmt(case.get('process_s'), '.0f')} | {_fmt(case.get('capture_s'), '.1f')} | "
                     f"{_fmt(compiles or None, '.1f')} | {_fmt(case.get('rounds_s'), '.1f')} | "
                     f"{_fmt(case.get('check_s'), '.1f')} |")
    return lines


def _note_lines(cases: list[dict[str, Any]]) -> list[str]:
    """The cases' notes (e.g. a case stopped at its limit after every arm was measured: :func:`settle`)."""
    notes = [f"- {c['case']}: {c['note']}" for c in cases if c.get("note")]
    return ["", "Notes:", "", *notes] if notes else []


def _floor_lines(cases: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## Graphs and floors", "", "| case | graph | MB read | MB written | GFLOP | floor ms |",
             "|---|---|---|---|---|---|"]
    for case in cases:
        for g in case.get("graphs") or []:
            lines.append(f"| {case['case']} | {g.get('name')} | {_fmt(_scaled(g.get('bytes_read'), 1e6), '.2f')} | "
                         f"{_fmt(_scaled(g.get('bytes_written'), 1e6), '.2f')} | "
                         f"{_fmt(_scaled(g.get('flops'), 1e9), '.2f')} | {_fmt(g.get('floor_ms'), '.4f')} |")
    return lines


def _problem_lines(cases: list[dict[str, Any]]) -> list[str]:
    problems = []
    for case in cases:
        if case.get("capture_error") or case.get("error"):
            problems.append(f"- {case['case']}: {case.get('capture_error') or case.get('error')}")
        for a, entry in (case.get("arms") or {}).items():
            ratio = floor_ratio(case, a)
            if ratio is not None and ratio < 1.0:
                problems.append(f"- {case['case']} / {a}: median time is {ratio:.2f}× the roofline floor, i.e. "
                                "below it: the timing or the floor is wrong (no implementation can beat the roofline)")
            if entry.get("status") not in ("ok", None):
                problems.append(f"- {case['case']} / {a}: failed in {entry.get('failed_in', '?')}: "
                                f"{entry.get('error', entry.get('status'))}")
            if entry.get("recompiles_while_timed"):
                problems.append(f"- {case['case']} / {a}: Dynamo compiled {entry['recompiles_while_timed']} graph(s) "
                                "while the arm was timed (a guard failed): its times include compilation")
            for d in entry.get("diagnostics") or []:
                problems.append(f"- {case['case']} / {a} diagnostic `{d.get('kind')}`: {d.get('message')}")
    return ["", "## Errors and diagnostics", "", *problems] if problems else []


def _scaled(value: Any, unit: float) -> float | None:
    return value / unit if isinstance(value, (int, float)) else None


def chart(result: dict[str, Any], path: Path) -> None:
    """Two panels: each arm's speedup over default Inductor per case (Tilesmith with its 95 % interval); time over
    the roofline floor (log scale). Needs matplotlib (the ``report`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(result.get("cases") or [])
    names = [c["case"] for c in cases]
    arms = [a for a in ARM_LABELS if any(a in c.get("arms", {}) for c in cases)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, max(4.0, 0.55 * len(cases) + 2)))
    height = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        ys = [j + (i - (len(arms) - 1) / 2) * height for j in range(len(cases))]
        speed = [speedup_over_inductor(c, arm) or 0.0 for c in cases]
        dist = [floor_ratio(c, arm) or float("nan") for c in cases]
        err = None
        if arm == "tilesmith":
            cis = [((_cmp(c).get("over_inductor") or {}).get(arm) or {}).get("ci") for c in cases]
            err = [[max(0.0, s - ci[0]) if ci else 0.0 for s, ci in zip(speed, cis, strict=True)],
                   [max(0.0, ci[1] - s) if ci else 0.0 for s, ci in zip(speed, cis, strict=True)]]
        left.barh(ys, speed, height=height, label=ARM_LABELS[arm], xerr=err)
        right.barh(ys, dist, height=height, label=ARM_LABELS[arm])
    for ax in (left, right):
        ax.set_yticks(range(len(cases)))
        ax.set_yticklabels(names)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_xlabel("speedup over torch.compile default (median of per-round ratios, >1 faster)")
    left.set_title("Speedup over Inductor default")
    right.set_xscale("log")
    right.axvline(1.0, color="black", linewidth=0.8)
    right.set_xlabel("time / roofline floor (1 = at the floor)")
    right.set_title("Distance to the roofline floor")
    handles, labels = left.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    else:
        left.text(0.5, 0.5, "no arm ran", transform=left.transAxes, ha="center")
    device = (result.get("limits") or {}).get("device_name", "")
    fig.suptitle(f"Tilesmith benchmark suite — {device}")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
