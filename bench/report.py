"""Turn the suite's JSON into a Markdown table and a PNG chart.

Speedups are ratios of per-call medians, ``inductor_ms / arm_ms`` (>1: the arm is faster than default
Inductor). "× floor" is ``arm_ms / floor_ms``: how far an arm is from the roofline floor (1.0 would be
at the floor; the floor itself is a lower bound, not a target).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

ARM_LABELS = {
    "eager": "eager",
    "inductor": "inductor",
    "max-autotune-no-cudagraphs": "max-autotune-nc",
    "reduce-overhead": "reduce-overhead",
    "tilesmith": "tilesmith",
}


def arm_ms(case: dict[str, Any], arm: str) -> float | None:
    """Median per-call time of ``arm`` in ms, or ``None`` when it did not run or failed."""
    entry = case.get("arms", {}).get(arm) or {}
    if entry.get("status") != "ok":
        return None
    value = (entry.get("timing") or {}).get("median_ms")
    return float(value) if isinstance(value, (int, float)) else None


def speedup_over_inductor(case: dict[str, Any], arm: str) -> float | None:
    base, ms = arm_ms(case, "inductor"), arm_ms(case, arm)
    return base / ms if base and ms else None


def floor_ratio(case: dict[str, Any], arm: str) -> float | None:
    floor = (case.get("floor") or {}).get("floor_ms")
    ms = arm_ms(case, arm)
    return ms / floor if floor and ms else None


def _fmt(value: float | None, spec: str = ".3f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


def _arm_cell(case: dict[str, Any], arm: str) -> str:
    entry = case.get("arms", {}).get(arm)
    if entry is None:
        return "not run"
    if entry.get("status") != "ok":
        return "error"
    return _fmt(arm_ms(case, arm))


def markdown(result: dict[str, Any]) -> str:
    """The whole report as Markdown: device limits, times, compile times, Tilesmith per-graph records."""
    arms = [a for a in ARM_LABELS if any(a in c.get("arms", {}) for c in result["cases"])]
    lim = result.get("limits") or {}
    env = result.get("environment") or {}
    lines = [
        "# Tilesmith benchmark suite results", "",
        f"Command: `{result.get('command', '')}`  ",
        f"Created (UTC): {result.get('created_utc', '')}; device: {lim.get('device_name', '?')} "
        f"(torch {env.get('torch', '?')}, Triton {env.get('triton', '?')}, CUDA {env.get('cuda', '?')}); "
        f"Tilesmith agent: `{result.get('options', {}).get('agent', '')}`.", "",
        f"Measured limits: copy {_fmt(lim.get('copy_gbps'), '.0f')} GB/s (read + write), "
        f"bf16 matmul {_fmt(lim.get('matmul_bf16_tflops'), '.4g')} TFLOP/s, fp32 matmul "
        f"{_fmt(lim.get('matmul_fp32_tflops'), '.4g')} TFLOP/s (TF32 {'on' if lim.get('allow_tf32') else 'off'}).", "",
        "## Time per call (ms, median; end to end, L2 flushed; training cases: forward + backward)", "",
        "| case | floor ms (bound) | " + " | ".join(ARM_LABELS[a] for a in arms)
        + " | tilesmith vs inductor | inductor × floor | best arm × floor |",
        "|---|---|" + "---|" * len(arms) + "---|---|---|",
    ]
    for case in result["cases"]:
        floor = case.get("floor") or {}
        best = min((ms for a in arms if (ms := arm_ms(case, a)) is not None), default=None)
        floor_ms = floor.get("floor_ms")
        lines.append(
            f"| {case['case']} | {_fmt(floor_ms, '.4f')} ({floor.get('bound') or '?'}) | "
            + " | ".join(_arm_cell(case, a) for a in arms)
            + f" | {_fmt(speedup_over_inductor(case, 'tilesmith'), '.3f', '×')}"
            + f" | {_fmt(floor_ratio(case, 'inductor'), '.2f', '×')}"
            + f" | {_fmt(best / floor_ms if best and floor_ms else None, '.2f', '×')} |")
    lines += ["", "## Compile / optimization time of the first call (s)", "",
              "| case | " + " | ".join(ARM_LABELS[a] for a in arms if a != "eager") + " | max rel. error vs eager |",
              "|---|" + "---|" * (len([a for a in arms if a != "eager"]) + 1)]
    for case in result["cases"]:
        cells = []
        for a in arms:
            if a == "eager":
                continue
            entry = case.get("arms", {}).get(a) or {}
            cells.append(_fmt(entry.get("compile_s"), ".1f") if entry.get("status") == "ok" else "–")
        errs = [e for a in arms if (e := (case.get("arms", {}).get(a) or {}).get("max_rel_err")) is not None
                and a != "eager"]
        worst = max((float(e) if not isinstance(e, str) else math.inf for e in errs), default=None)
        lines.append(f"| {case['case']} | " + " | ".join(cells) + f" | {_fmt(worst, '.1e')} |")
    lines += ["", "## Graphs and floors", "",
              "| case | graph | MB read | MB written | GFLOP | floor ms |", "|---|---|---|---|---|---|"]
    for case in result["cases"]:
        for g in case.get("graphs") or []:
            lines.append(f"| {case['case']} | {g.get('name')} | {_fmt(_mb(g.get('bytes_read')), '.2f')} | "
                         f"{_fmt(_mb(g.get('bytes_written')), '.2f')} | {_fmt(_g(g.get('flops')), '.2f')} | "
                         f"{_fmt(g.get('floor_ms'), '.4f')} |")
    records = [(c["case"], r) for c in result["cases"]
               for r in ((c.get("arms", {}).get("tilesmith") or {}).get("benchmarks") or [])]
    lines += ["", "## Tilesmith per-graph records (host gate, confirmation run)", ""]
    if records:
        lines += ["| case | graph | inductor ms | tilesmith ms | speedup | 95 % CI | floor ms |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in records:
            ci = r.get("speedup_ci") or [None, None]
            lines.append(f"| {name} | {r.get('graph_name')} | {_fmt(r.get('torch_inductor_ms'), '.4f')} | "
                         f"{_fmt(r.get('tilesmith_ms'), '.4f')} | {_fmt(r.get('speedup'), '.3f')} | "
                         f"[{_fmt(ci[0], '.3f')}, {_fmt(ci[1], '.3f')}] | {_fmt(r.get('roofline_floor_ms'), '.4f')} |")
    else:
        lines.append("No graph was installed (see the diagnostics below and in the JSON).")
    problems = []
    for case in result["cases"]:
        if case.get("capture_error") or case.get("error"):
            problems.append(f"- {case['case']}: {case.get('capture_error') or case.get('error')}")
        for a, entry in (case.get("arms") or {}).items():
            ratio = floor_ratio(case, a)
            if ratio is not None and ratio < 1.0:
                problems.append(f"- {case['case']} / {a}: median time is {ratio:.2f}× the roofline floor, i.e. "
                                "below it: the timing or the floor is wrong (no implementation can beat the roofline)")
            if entry.get("status") != "ok":
                problems.append(f"- {case['case']} / {a}: {entry.get('error', entry.get('status'))}")
            for d in entry.get("diagnostics") or []:
                problems.append(f"- {case['case']} / {a} diagnostic `{d.get('kind')}`: {d.get('message')}")
    if problems:
        lines += ["", "## Errors and diagnostics", "", *problems]
    return "\n".join(lines) + "\n"


def _mb(value: Any) -> float | None:
    return value / 1e6 if isinstance(value, (int, float)) else None


def _g(value: Any) -> float | None:
    return value / 1e9 if isinstance(value, (int, float)) else None


def chart(result: dict[str, Any], path: Path) -> None:
    """Two panels: speedup over default Inductor per case and arm; time over the roofline floor (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in result["cases"]]
    names = [c["case"] for c in cases]
    arms = [a for a in ARM_LABELS if any(a in c.get("arms", {}) for c in cases)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, max(4.0, 0.6 * len(cases) + 2)))
    height = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        ys = [j + (i - (len(arms) - 1) / 2) * height for j in range(len(cases))]
        speed = [speedup_over_inductor(c, arm) or 0.0 for c in cases]
        dist = [floor_ratio(c, arm) or float("nan") for c in cases]
        left.barh(ys, speed, height=height, label=ARM_LABELS[arm])
        right.barh(ys, dist, height=height, label=ARM_LABELS[arm])
    for ax in (left, right):
        ax.set_yticks(range(len(cases)))
        ax.set_yticklabels(names)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_xlabel("speedup over torch.compile default (median time ratio, >1 faster)")
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
