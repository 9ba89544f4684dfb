"""One rank of tests/test_distributed.py, run by ``torchrun --nproc-per-node 3`` or by that test's own launcher.

Usage: python tests/dist_job.py train|kill OUT_DIR      (TS_DEVICE=cuda: one GPU per rank, NCCL; train only)

``train``: DDP training of :class:`tests.models.MulSum` (gloo, CPU test mode) through ``tilesmith.compile`` with a
scripted optimizer that leaves one file per session in ``OUT_DIR/sessions`` and rewrites the forward graph's
multiply-sum loop into a BLAS matmul; the same steps in eager DDP; writes ``OUT_DIR/rank<r>.json`` with graph
states, installed-source hashes gathered from every rank, benchmarks, diagnostics and the largest parameter
difference from eager DDP.

``kill``: inference only (no collective after initialisation); the leader's optimizer signals
``OUT_DIR/optimizing`` and then blocks until the test kills the leader; the other ranks write their
``rank<r>.json`` once their graph's decision is final. With ``TS_STORE_PORT`` set the ranks rendezvous through a
TCPStore the test process hosts, as torchrun's agent hosts one (a dead rank does not take the store with it).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tilesmith  # noqa: E402
from tests.models import MulSum, has_mulsum_loop, mm_instead_of_loop  # noqa: E402
from tests.scripted import ScriptedFactory, comment  # noqa: E402
from tilesmith.coord import devices  # noqa: E402

STEPS = 4


CUDA = os.environ.get("TS_DEVICE") == "cuda"
"""``TS_DEVICE=cuda``: one GPU per rank (``cuda:LOCAL_RANK``), NCCL for the model, a CUDA model and the built-in
agent's whole-call CUDA-graph rewrite as the scripted edit (tests/gpu/test_distributed_gpu.py)."""


def _init() -> None:
    if CUDA:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    backend = "nccl" if CUDA else "gloo"
    port = os.environ.get("TS_STORE_PORT")
    if port:
        store = dist.TCPStore("127.0.0.1", int(port), is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend)


def _edit(text: str) -> str:
    if CUDA:
        from tilesmith.agent.builtin.cudagraph import cudagraph_source
        from tilesmith.capture.source import strip_fx_header

        wrapper = strip_fx_header(text)
        try:
            return text.replace(wrapper, cudagraph_source(wrapper))  # the graph's own device (its _DeviceGuard)
        except Exception:  # noqa: BLE001 - the rewrite does not apply to this graph: propose a no-op
            return comment("noop")(text)
    return mm_instead_of_loop(text) if has_mulsum_loop(text) else comment("noop")(text)


def _model() -> tuple[torch.nn.Module, int]:
    """The model on this rank's device and its input width."""
    if not CUDA:
        return MulSum(), 512
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).cuda(), 256


def _installed(compiled: object) -> dict[str, str]:
    """graph name → SHA-256 of the device-neutral source installed in this process."""
    run = tilesmith.api._run_of(compiled)
    out = {}
    for handle in run.handles:
        if handle.state == "installed" and handle.installed_source:
            index = devices.device_index(handle.graph.device)
            out[handle.graph.name] = devices.source_sha256(devices.neutral(handle.installed_source, index))
    return out


def _report(compiled: object) -> dict[str, object]:
    run = tilesmith.api._run_of(compiled)
    return {
        "rank": dist.get_rank(),
        "states": {h.graph.name: h.state for h in run.handles},
        "keys": {h.graph.name: h.key for h in run.handles},
        "benchmarks": [{"graph": r.graph_name, "source": r.source, "measured_by_rank": r.measured_by_rank,
                        "speedup": r.speedup, "extras": [list(x) for x in r.extras]}
                       for r in tilesmith.benchmarks(compiled)],
        "diagnostics": [[d.kind, d.message] for d in tilesmith.diagnostics(compiled)],
        "installed": _installed(compiled),
    }


def train(out: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base, width = _model()
    eager, mine = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own batches
    device = next(base.parameters()).device
    batches = [torch.randn(64, width, generator=gen).to(device) for _ in range(STEPS)]
    factory = ScriptedFactory(edits=[_edit], session_dir=str(out / "sessions"))
    compiled = tilesmith.compile(mine, example_inputs=(batches[0],), agent_model=factory)

    def step(model, opt, x):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return float(loss)

    opt_c = torch.optim.SGD(mine.parameters(), lr=0.5)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.5)
    started = time.monotonic()
    losses = [step(compiled, opt_c, batches[0])]
    first_step_s = time.monotonic() - started
    finished = tilesmith.wait(compiled, timeout_s=420)  # every graph's job-wide decision applied on this rank
    losses += [step(compiled, opt_c, x) for x in batches[1:]]
    eager_losses = [step(eager, opt_e, x) for x in batches]
    pairs = list(zip(mine.parameters(), eager.parameters(), base.parameters(), strict=True))
    diff = max(float((a - b).abs().max()) for a, b, _ in pairs)
    moved = max(float((a - c).abs().max()) for a, _, c in pairs)
    report = _report(compiled)
    gathered: list[object] = [None] * world
    cpu_group = dist.new_group(backend="gloo") if CUDA else None  # the test's own exchange, off the NCCL group
    dist.all_gather_object(gathered, report["installed"], group=cpu_group)
    report.update(finished=finished, first_step_s=first_step_s, losses=losses, eager_losses=eager_losses,
                  max_param_diff=diff, gathered_installed=gathered, sessions_here=len(factory.sessions),
                  moved=moved)
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()


def kill(out: Path) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MulSum().eval()
    x = torch.randn(64, 512)

    def blocking(text: str) -> str:  # the leader's optimizer: signal, then hang until killed
        (out / "optimizing").write_text(str(os.getpid()))
        time.sleep(3600)
        return text

    factory = ScriptedFactory(edits=[blocking], session_dir=str(out / "sessions"))
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=factory)
    with torch.no_grad():
        first = compiled(x)
        first_returned = time.time()
        after_first = [h.state for h in tilesmith.api._run_of(compiled).handles]
        finished = tilesmith.wait(compiled, timeout_s=300)
        decided = time.time()
        again = compiled(x)
        ref = model(x)
    report = _report(compiled)
    report.update(finished=finished, first_returned=first_returned, decided=decided, after_first=after_first,
                  max_err=max(float((first - ref).abs().max()), float((again - ref).abs().max())))
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    sys.stdout.flush()
    os._exit(0)  # the leader is dead: no barrier, no process-group teardown


if __name__ == "__main__":
    mode, folder = sys.argv[1], Path(sys.argv[2])
    _init()
    {"train": train, "kill": kill}[mode](folder)
