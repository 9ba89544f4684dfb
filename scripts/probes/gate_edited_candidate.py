"""H200 probe (docs/h200-runs.md, 2026-12-02 call 4): why an edited CUDA candidate got audit_file_read at import; prints every failure in full. Run: PYTHONPATH=$PWD python3 scripts/probes/gate_edited_candidate.py"""
import os, sys, time, glob
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch
from tests import gate_support as gs
from tests.cheats.gpu import stale_empty
from tilesmith.gate import Gate
from tilesmith.gate.host import gate as gate_module
from tilesmith.records import Candidate
gate_module.scan = lambda source: []
class Ew(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2 + 1
torch.manual_seed(0)
t0 = time.time()
cap = gs.capture(Ew().cuda(), torch.randn(4096, 1024, device="cuda"))[0]
root = Path("/tmp/dg")
print("env TRITON_CACHE_DIR", os.environ.get("TRITON_CACHE_DIR"), "HOME", os.environ.get("HOME"), "CUDA_HOME", os.environ.get("CUDA_HOME"))
gate = Gate(gs.make_problem(cap, root / "snap", label="9a7e0000 (ew)"), reference=cap.ref_fn, profiles_dir=root / "profiles")
v = gate.evaluate(Candidate(source=stale_empty(cap.source), proposer="diag"))
print("status", v.status, "after", round(time.time() - t0, 1), "s")
for f in v.failures:
    print("FAILURE", f.check, "::", f.message)
for p in glob.glob(str(root / "profiles" / "**" / "*"), recursive=True):
    if os.path.isfile(p) and p.endswith((".json", ".txt", ".log")):
        text = open(p, errors="replace").read()
        for key in ("open for reading", "audit_file_read"):
            i = text.find(key)
            if i >= 0:
                print("IN", p, ":", text[max(0, i - 200): i + 600].replace("\n", " | "))
                break
gate.close()
