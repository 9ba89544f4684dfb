"""Where one ``Gate.evaluate`` spends its wall time (issue 19): reports numbers, asserts nothing.

    python bench/gate_cost.py --out $OUT/gate_cost.json [--graphs small,medium] [--repeats 2] [--profile]

CUDA when available, CPU test mode otherwise (``TILESMITH_ALLOW_CPU=1`` is set here). Graphs:

- ``small``: ``(x @ a) @ b`` (tests/gate_support.py ``Chain``; CPU 512×768, CUDA 8192×4096, or ``--small-shape
  M,N``), an identical candidate (rejected) and the reassociated one ``x @ (a @ b)`` (5–7× faster on the CPU; on
  CUDA ``2MN² / (N³ + MN²)``× fewer FLOP, 1.33× at 8192×4096, 1.6× at 4096×1024): accepted after the confirmation;
- ``medium``: a softmax whose output is ``--medium-mib`` MiB of fp32 (default 32), identical candidate only.

Per evaluation: the verdict, ``wall_s``, each phase's step seconds from the gate's profile JSON, and with
``--profile`` the host's cProfile (top functions by cumulative time) in the JSON and on stdout. Wall times on a
shared machine depend on its load: compare runs interleaved, not one against a number from another day.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TILESMITH_ALLOW_CPU", "1")
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from tests import gate_support as gs  # noqa: E402
from tilesmith.gate import Gate  # noqa: E402
from tilesmith.records import Candidate  # noqa: E402


class Softmax(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


def _phases(gate: Gate, verdict: Any) -> list[dict[str, Any]]:
    folder = getattr(gate, "profiles_dir", None)
    try:
        record = json.loads((Path(folder) / f"{verdict.evaluation_id}.json").read_text())
    except (OSError, TypeError, ValueError, AttributeError):
        return []
    return [{"name": p.get("name"), **{k: v for k, v in p.items() if k.endswith("_s")}}
            for p in record.get("phases", [])]


def _profile_text(prof: cProfile.Profile, lines: int) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(lines)
    return s.getvalue()


def run_graph(name: str, cap: gs.Captured, cands: list[tuple[str, str]], work: Path, repeats: int,
              profile: bool, spares: int | None = None) -> dict[str, Any]:
    t0 = time.monotonic()
    gate = Gate(gs.make_problem(cap, work / name / "snap", label=f"c05710{len(name):02d} ({name})"),
                profiles_dir=work / name / "profiles", spares=spares)
    out: dict[str, Any] = {"gate_start_s": round(time.monotonic() - t0, 3), "evaluations": []}
    try:
        for rep in range(repeats):
            for kind, source in cands:
                prof = cProfile.Profile() if profile else None
                t1 = time.monotonic()
                if prof:
                    prof.enable()
                v = gate.evaluate(Candidate(source=source, proposer="gate_cost"))
                if prof:
                    prof.disable()
                row = {"repeat": rep, "kind": kind, "status": v.status, "wall_s": round(time.monotonic() - t1, 3),
                       "confirmation": v.confirmation is not None, "phases": _phases(gate, v)}
                if prof:
                    row["profile"] = _profile_text(prof, 45)
                out["evaluations"].append(row)
                print(f"{name} {kind}: {v.status} {row['wall_s']} s {json.dumps(row['phases'])}", flush=True)
                if prof:
                    print(row["profile"], flush=True)
    finally:
        gate.close()
    by_kind: dict[str, list[float]] = {}
    for row in out["evaluations"]:
        by_kind.setdefault(row["kind"], []).append(row["wall_s"])
    out["summary"] = {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "n": len(v)}
                      for k, v in by_kind.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--graphs", default="small,medium")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--medium-mib", type=int, default=32)
    ap.add_argument("--small-shape", default=None, metavar="M,N",
                    help="the chain's x rows and width (default: CUDA 8192,4096 (~5 ms a call on an H200), CPU 512,768)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--spares", type=int, default=None, help="Gate(spares=): spare candidate workers (default: the gate's)")
    ap.add_argument("--late-init", action="store_true",
                    help="CUDA spares get their init only when taken (Gate.early_init off: the behaviour before session 15)")
    a = ap.parse_args()
    Gate.early_init = not a.late_init
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.mkdtemp(prefix="gate_cost-"))
    results: dict[str, Any] = {"device": dev, "torch": torch.__version__, "graphs": {}}
    torch.manual_seed(2)
    for name in a.graphs.split(","):
        if name == "small":
            m, n = (8192, 4096) if dev == "cuda" else (512, 768)
            if a.small_shape:
                m, n = (int(v) for v in a.small_shape.split(","))
            cap = gs.capture(gs.Chain(n).to(dev), torch.randn(m, n, device=dev))[0]
            cands = [("identical", cap.source), ("faster", gs.reassociate_chain(cap.source))]
        elif name == "medium":
            rows = a.medium_mib * 2**20 // 4 // 4096
            cap = gs.capture(Softmax(), torch.randn(rows, 4096, device=dev))[0]
            cands = [("identical", cap.source)]
        else:
            raise SystemExit(f"unknown graph {name!r}: use small and/or medium")
        results["graphs"][name] = run_graph(name, cap, cands, work, a.repeats, a.profile, a.spares)
        a.out.write_text(json.dumps(results, indent=1))
    for name, r in results["graphs"].items():
        print(name, "gate start", r["gate_start_s"], "s", json.dumps(r["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
