"""Time from asking for a gate worker to its ``ready`` greeting: ``subprocess`` start vs the fork server
(``TILESMITH_GATE_FORKSERVER``), interleaved; reports numbers, asserts nothing.

    python bench/worker_start.py [--starts 5] [--device-type cpu] [--out FILE.json]

The zygote is started and waited for first (its own start, reported separately, is what one ``subprocess``
worker costs). Each sample: ``WorkerProcess(...)`` constructed, then ``wait_ready``; killed right after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--device-type", default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from tilesmith.gate.host import forkserver
    from tilesmith.gate.host.process import WorkerProcess

    folder = Path(tempfile.mkdtemp(prefix="worker-start-"))
    WorkerProcess(folder, label="host warm-up", device_type=args.device_type).kill()  # host-side imports
    t0 = time.perf_counter()
    ok = forkserver.prepare(args.device_type, timeout_s=600)
    zygote_s = time.perf_counter() - t0
    samples: dict[str, list[float]] = {"subprocess": [], "fork": []}
    for _ in range(args.starts):
        for mode in ("subprocess", "fork"):
            os.environ["TILESMITH_GATE_FORKSERVER"] = "1" if mode == "fork" else "0"
            t0 = time.perf_counter()
            worker = WorkerProcess(folder, label=mode, device_type=args.device_type)
            info = worker.wait_ready(600)
            samples[mode].append(time.perf_counter() - t0)
            assert bool(info.get("forked")) == (mode == "fork"), info
            worker.kill()
    result = {"zygote_ready": ok, "zygote_start_s": round(zygote_s, 3),
              **{mode: {"median_s": round(statistics.median(v), 4), "samples_s": [round(x, 4) for x in v]}
                 for mode, v in samples.items()}}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    forkserver.shutdown()


if __name__ == "__main__":
    main()
