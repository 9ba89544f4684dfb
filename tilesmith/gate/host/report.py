"""Evaluation reports: ``profiles/<eval-id>.json`` (complete) and ``profiles/<eval-id>.txt`` (readable).

Everything in a report is computed or observed by the host. From the worker come only raw samples,
raw outputs (compared in the host, not stored) and worker-reported facts and error texts, which are
labelled as such. Every string is passed through :func:`tilesmith.secrets.redact` before it is
written, so a provider key that reached a message by any path is replaced by ``<redacted>``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

from tilesmith._atomic import write_json_atomic, write_text_atomic
from tilesmith.secrets import redact
from tilesmith.gate.host.stats import median
from tilesmith.records import Verdict

REPORT_FORMAT = 1
_EVAL_ID = re.compile(r"^e(\d{4,})\.json$")


@functools.cache
def driver_version() -> str | None:
    """The NVIDIA driver version (``"580.159.04"``), from NVML, ``/proc/driver/nvidia/version`` or
    ``nvidia-smi``, in that order; ``None`` when none answers. Host-side only, cached per process."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - NVML absent or unusable: try the next source
        pass
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        match = re.search(r"Kernel Module\s+(\S+)", text)
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
        first = out.stdout.strip().splitlines()
        return first[0].strip() if out.returncode == 0 and first else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device, worker_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """torch/Triton/Python versions, platform, device name, CUDA and driver versions (host-observed)."""
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "platform": platform.platform(), "device": str(device)}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = None
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        major, minor = torch.cuda.get_device_capability(device)
        env["capability"] = f"{major}.{minor}"
        env["driver"] = driver_version()
    else:
        env["device_name"] = platform.processor() or platform.machine()
        env["cpu_count"] = os.cpu_count()
    if worker_info:
        env["worker"] = {k: worker_info.get(k) for k in ("torch", "triton", "python", "device_name", "confinement")}
    return env


def next_evaluation_id(profiles_dir: Path | None, counter: int) -> str:
    """``e0000``-style id one above the highest existing report (or ``counter`` when there is no folder)."""
    if profiles_dir is None or not profiles_dir.is_dir():
        return f"e{counter:04d}"
    numbers = [int(m.group(1)) for p in profiles_dir.iterdir() if (m := _EVAL_ID.match(p.name))]
    return f"e{max(numbers + [counter - 1]) + 1:04d}"


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {str(k): _scrub(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrub(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _scrub(dataclasses.asdict(value))
    return value


def write(profiles_dir: Path, eval_id: str, report: dict[str, Any]) -> Path:
    """Write both files atomically (:mod:`tilesmith._atomic`); returns the JSON path."""
    profiles_dir.mkdir(parents=True, exist_ok=True)
    clean = _scrub(report)
    json_path = profiles_dir / f"{eval_id}.json"
    write_json_atomic(json_path, clean, indent=1, sort_keys=False, default=str)
    write_text_atomic(profiles_dir / f"{eval_id}.txt", redact(render_text(clean)))
    return json_path


def _timing_lines(name: str, t: dict[str, Any] | None) -> list[str]:
    if not t:
        return []
    base, cand = t.get("baseline_ms") or [], t.get("candidate_ms") or []
    lines = [f"  {name}: speedup {t['speedup']:.4f} (95% CI {t['ci_low']:.4f} .. {t['ci_high']:.4f}), "
             f"{len(base)} pairs × {t['calls_per_sample']} calls, {t['method']}",
             f"    {t.get('baseline_label', 'inductor')} median {median(base):.5f} ms/call, "
             f"candidate median {median(cand):.5f} ms/call"]
    if t.get("original_ms"):
        lines.append(f"    original Inductor median {median(t['original_ms']):.5f} ms/call, "
                     f"speedup vs original {t.get('speedup_vs_original') or float('nan'):.4f}")
    if t.get("control_ms"):
        lo, hi = t.get("speedup_vs_control_ci") or (float("nan"), float("nan"))
        lines.append(f"    in-process control (the baseline's code in the candidate's process) median "
                     f"{median(t['control_ms']):.5f} ms/call, speedup vs control "
                     f"{t.get('speedup_vs_control') or float('nan'):.4f} ({lo:.4f} .. {hi:.4f}): the rule's comparison")
    return lines


def render_text(report: dict[str, Any]) -> str:
    """Readable summary of a (scrubbed) report dict."""
    v = report.get("verdict", {})
    lines = [f"Tilesmith gate evaluation {report.get('evaluation_id')} — {report.get('label')}",
             f"candidate: {report.get('proposer')} {('(' + report['note'] + ')') if report.get('note') else ''}",
             f"verdict: {v.get('status')} ({'ACCEPTED' if v.get('accepted') else 'rejected'}), "
             f"wall {v.get('wall_s') or 0:.1f} s, min improvement {report.get('settings', {}).get('min_improvement')}"]
    for reason in v.get("reasons", []):
        lines.append(f"  - {reason}")
    for phase in report.get("phases", []):
        lines.append(f"phase {phase.get('name')}: worker pid {phase.get('worker_pid')}, "
                     f"{len(phase.get('failures', []))} failed checks")
        for f in phase.get("failures", [])[:12]:
            lines.append(f"    [{f.get('check')}] {f.get('message')}")
        lines += _timing_lines("timing", phase.get("timing"))
    env = report.get("environment", {})
    lines.append(f"environment: torch {env.get('torch')}, triton {env.get('triton')}, {env.get('device_name')}, "
                 f"driver {env.get('driver')}, python {env.get('python')}")
    return "\n".join(lines) + "\n"


def verdict_dict(verdict: Verdict) -> dict[str, Any]:
    data = dataclasses.asdict(verdict)
    for key in ("timing", "confirmation"):
        if data.get(key):
            data[key]["baseline_median_ms"] = median(data[key]["baseline_ms"])
            data[key]["candidate_median_ms"] = median(data[key]["candidate_ms"])
    return data
