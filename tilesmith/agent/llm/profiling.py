"""Per-kernel times of an attempt, measured in a separate process (the agent's ``profile_attempt`` tool).

The gate package has no profiling entry point yet, so this is a minimal one: a fresh Python process
(environment from :func:`~tilesmith.agent.llm.redact.tool_env`: no secrets, working directory a
temporary folder) imports the attempt file, builds inputs with the wrapper's own ``get_args()`` (which
Inductor writes with ``rand_strided``) or, failing that, from the graph's
:class:`~tilesmith.records.TensorSpec` list, runs ``call`` :data:`WARMUP` times, then
:data:`PROFILED` times under ``torch.profiler`` and reports, per kernel, calls and device time
(``self_device_time_total``, microseconds; CPU time when no CUDA device is used, test mode).

These numbers are a guide for the agent only: every number a user sees comes from the gate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tilesmith.agent.llm.redact import tool_env
from tilesmith.records import CapturedGraph, ScalarSpec, TensorSpec

WARMUP = 3
PROFILED = 10
TOP = 20

_SCRIPT = r'''
import importlib.util, json, sys
import torch
path, specs_path, out_path, warmup, runs, top = sys.argv[1:7]
spec = importlib.util.spec_from_file_location("tilesmith_attempt_profile", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
def make_inputs():
    if hasattr(mod, "get_args"):
        try:
            return list(mod.get_args())
        except Exception:
            pass
    out = []
    for s in json.load(open(specs_path)):
        if s["kind"] == "scalar":
            out.append(s["value"]); continue
        dtype = getattr(torch, s["dtype"].replace("torch.", ""))
        t = torch.empty_strided(s["shape"], s["stride"], dtype=dtype, device=s["device"])
        if dtype.is_floating_point or dtype.is_complex:
            t.normal_()
        else:
            t.zero_()
        out.append(t)
    return out
inputs = make_inputs()
cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs)
def once():
    mod.call(list(inputs))
for _ in range(int(warmup)):
    once()
if cuda:
    torch.cuda.synchronize()
acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
with torch.profiler.profile(activities=acts) as prof:
    for _ in range(int(runs)):
        once()
    if cuda:
        torch.cuda.synchronize()
rows = []
for e in prof.key_averages():
    dev = float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)
    cpu = float(getattr(e, "self_cpu_time_total", 0.0) or 0.0)
    rows.append({"name": e.key, "calls": int(e.count), "device_us": dev, "cpu_us": cpu})
key = "device_us" if cuda else "cpu_us"
rows = [r for r in rows if r[key] > 0]
rows.sort(key=lambda r: r[key], reverse=True)
json.dump({"device": "cuda" if cuda else "cpu", "runs": int(runs), "rows": rows[: int(top)],
           "total_us": sum(r[key] for r in rows)}, open(out_path, "w"))
'''


def _specs(graph: CapturedGraph | None) -> list[dict]:
    out: list[dict] = []
    for spec in (graph.inputs if graph is not None else ()):
        if isinstance(spec, TensorSpec):
            out.append({"kind": "tensor", "shape": list(spec.shape), "stride": list(spec.stride),
                        "dtype": spec.dtype, "device": spec.device})
        elif isinstance(spec, ScalarSpec):
            out.append({"kind": "scalar", "value": spec.value})
    return out


def profile_source(attempt_path: Path, graph: CapturedGraph | None, timeout_s: float) -> str:
    """Profile the wrapper at ``attempt_path`` in a subprocess; return a readable per-kernel table.

    Never raises for candidate problems: a crash, timeout or import error comes back as text (the last
    lines of the subprocess's stderr) so the agent can act on it.
    """
    with tempfile.TemporaryDirectory(prefix="tilesmith-profile-") as tmp:
        specs_path, out_path = Path(tmp) / "specs.json", Path(tmp) / "profile.json"
        specs_path.write_text(json.dumps(_specs(graph)))
        cmd = [sys.executable, "-c", _SCRIPT, str(attempt_path), str(specs_path), str(out_path),
               str(WARMUP), str(PROFILED), str(TOP)]
        try:
            proc = subprocess.run(cmd, cwd=tmp, env=tool_env(os.environ), capture_output=True, text=True,  # noqa: S603
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return f"profiling failed: the attempt did not finish {WARMUP + PROFILED} calls within {timeout_s:g} s"
        if proc.returncode != 0 or not out_path.exists():
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
            return f"profiling failed (exit code {proc.returncode}):\n{tail}"
        data = json.loads(out_path.read_text())
    key = "device_us" if data["device"] == "cuda" else "cpu_us"
    runs = max(1, int(data["runs"]))
    total = float(data["total_us"]) or 1.0
    lines = [f"per-kernel {'device' if key == 'device_us' else 'CPU'} time over {runs} calls of call(args) "
             f"(torch.profiler, random inputs; a guide only — the gate measures):",
             f"{'us/call':>10} {'share':>6} {'launches/call':>13}  kernel"]
    for row in data["rows"]:
        share = 100.0 * row[key] / total
        lines.append(f"{row[key] / runs:10.2f} {share:5.1f}% {row['calls'] / runs:13.1f}  {row['name']}")
    lines.append(f"{float(data['total_us']) / runs:10.2f} total us/call")
    return "\n".join(lines)
