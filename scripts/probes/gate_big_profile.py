"""Where a gate evaluation of a big-tensor graph spends its time (host cProfile + the phase records).

    python scripts/probes/gate_big_profile.py --out $OUT/gate-big-profile.txt [--n 32768 --d 4096]

Evaluates an identical candidate of h = x + r; (LayerNorm(h), h) (bf16, the suite's layernorm_residual_bf16 shape)
with the production gate and prints the host's cumulative profile, the phase seconds of the report, and the
speed of torch.save/torch.load of one output-sized tensor in the gate's temp folder and in /dev/shm.
"""
from __future__ import annotations

import argparse
import cProfile
import glob
import io
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from tests import gate_support as gs  # noqa: E402
from tilesmith.gate import Gate  # noqa: E402
from tilesmith.records import Candidate  # noqa: E402


class LNR(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + r
        return self.ln(h), h


def io_speed(folder: str, t: torch.Tensor) -> str:
    if not os.path.isdir(folder):
        return f"{folder}: absent"
    total, _, free = shutil.disk_usage(folder)
    path = os.path.join(folder, "probe.pt")
    try:
        t0 = time.perf_counter(); torch.save({"o": [t.cpu()]}, path); t1 = time.perf_counter()
        torch.load(path, weights_only=True); t2 = time.perf_counter()
        os.unlink(path)
        return f"{folder}: free {free / 2**30:.1f} GiB of {total / 2**30:.1f}; save {t1 - t0:.3f} s, load {t2 - t1:.3f} s"
    except Exception as exc:  # noqa: BLE001
        return f"{folder}: free {free / 2**30:.1f} GiB; failed: {type(exc).__name__}: {exc}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    x = torch.randn(a.n, a.d, device=dev, dtype=dtype)
    r = torch.randn(a.n, a.d, device=dev, dtype=dtype)
    lines = [io_speed(tempfile.gettempdir(), x), io_speed("/dev/shm", x)]
    t0 = time.perf_counter(); y = x.cpu(); lines.append(f"D2H {x.numel() * x.element_size() / 2**20:.0f} MiB: "
                                                         f"{time.perf_counter() - t0:.3f} s")
    t0 = time.perf_counter(); y.double().abs().sum(); lines.append(f"host .double().abs().sum(): {time.perf_counter() - t0:.3f} s "
                                                                  f"({torch.get_num_threads()} threads)")
    print("\n".join(lines), flush=True)
    cap = gs.capture(LNR(a.d).to(dev).eval(), x, r)[0]
    del x, r, y
    work = Path(tempfile.mkdtemp())
    t0 = time.monotonic()
    with Gate(gs.make_problem(cap, work / "snap", label="deadbeef (lnr)"), profiles_dir=work / "profiles") as gate:
        lines.append(f"gate start {time.monotonic() - t0:.1f} s")
        prof = cProfile.Profile()
        prof.enable()
        v = gate.evaluate(Candidate(source=cap.source, proposer="probe"))
        prof.disable()
        lines.append(f"verdict {v.status} wall {v.wall_s} s")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)
    rep = json.load(open(glob.glob(str(work / "profiles" / "*.json"))[0]))
    for ph in rep["phases"]:
        lines.append(f"{ph['name']}: " + json.dumps({k: v for k, v in ph.items() if k.endswith('_s')}))
    lines.append(f"reference runs: {rep.get('reference', {}).get('runs')}")
    text = "\n".join(lines) + "\n" + s.getvalue()
    a.out.write_text(text)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
