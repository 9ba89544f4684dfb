"""The worker's request handlers (runs only inside ``python -m tilesmith.gate.worker``).

Every function the worker relies on while candidate code is loaded (clocks, events, synchronize,
``torch.save``/``torch.load``, thread listing) is bound in :data:`T` before any candidate is imported,
so replacing ``time.perf_counter_ns`` or ``torch.cuda.Event.elapsed_time`` in the candidate changes
nothing the worker measures; the identity check then reports the replacement.
"""

from __future__ import annotations

import functools
import os
import platform
import resource
import signal
import sys
import threading
import time
import traceback
from types import SimpleNamespace
from typing import Any

import torch

from tilesmith.gate import layout, protocol, torchstate
from tilesmith.gate.worker import audit
from tilesmith.gate.worker import runtime as worker_runtime
from tilesmith.gate.worker import timing as worker_timing
from tilesmith.gate.worker.runtime import GuardedAllocator, InputSet

T = SimpleNamespace(
    perf_ns=time.perf_counter_ns,
    cpu_ns=functools.partial(time.clock_gettime_ns, time.CLOCK_PROCESS_CPUTIME_ID),
    save=torch.save,
    load=torch.load,
    threads=threading.enumerate,
    write=os.write,
    cuda_sync=torch.cuda.synchronize,
    Event=torch.cuda.Event,
    event_record=torch.cuda.Event.record,
    event_sync=torch.cuda.Event.synchronize,
    elapsed=torch.cuda.Event.elapsed_time,
    manual_seed=torch.manual_seed,
    no_grad=torch.no_grad,
    mem_get_info=torch.cuda.mem_get_info,
)


def _NO_INSTANCE_RUN() -> None:  # noqa: N802 - a sentinel with a stable identity
    """Stands for "no instance-level ``run``" in identity snapshots of kernel objects."""


class Loaded:
    """One wrapper module loaded in this worker."""

    def __init__(self, name: str, module: Any, fn: Any, trusted: bool) -> None:
        self.name, self.module, self.fn, self.trusted = name, module, fn, trusted
        self.namespace: dict[str, Any] = vars(module)


class Worker:
    def __init__(self, out_fd: int, auditor: Any = None) -> None:
        self.out_fd = out_fd
        self.auditor = auditor
        """:class:`tilesmith.gate.worker.audit.Audit` (armed before the candidate's import), or ``None`` in unit tests."""
        self.base_signals: dict[str, str] = {}
        self.base_modules: dict[str, Any] = {}
        self.device = torch.device("cpu")
        self.modules: dict[str, Loaded] = {}
        self.constants: dict[str, Any] = {}
        self.inputs_to_check: list[int] = []
        self.mutated: list[int] = []
        self.expected: list[dict[str, Any]] = []
        self.base_state: dict[str, Any] = {}
        self.base_ids: dict[str, Any] = {}
        self.base_threads: set[int] = set()
        self.held: dict[str, tuple[Any, list[Any], InputSet]] = {}
        self.live: dict[str, InputSet] = {}
        self.file_cache: dict[str, list[Any]] = {}
        self.allocator: GuardedAllocator | None = None
        self.validate = True

    # -- transport ---------------------------------------------------------------------------------
    def send(self, message: dict[str, Any]) -> None:
        data = protocol.dumps(message)
        while data:
            written = T.write(self.out_fd, data)
            data = data[written:]

    def announce(self) -> None:
        info = {"type": "ready", "pid": os.getpid(), "python": platform.python_version(),
                "torch": torch.__version__, "protocol": protocol.PROTOCOL_VERSION}
        self.send(info)

    def handle(self, line: bytes) -> bool:
        try:
            msg = protocol.loads(line)
        except ValueError as exc:
            self.send({"id": None, "ok": False, "error": {"type": "ProtocolError", "message": str(exc)}})
            return True
        op, rid = msg.get("op"), msg.get("id")
        if op == "exit":
            self.send({"id": rid, "ok": True})
            return False
        handler = {"init": self.op_init, "load": self.op_load, "check": self.op_check,
                   "time": self.op_time}.get(str(op))
        if handler is None:
            self.send({"id": rid, "ok": False, "error": {"type": "ProtocolError", "message": f"unknown op {op!r}"}})
            return True
        try:
            answer = handler(msg)
        except BaseException as exc:  # noqa: BLE001 - candidate code may raise anything, even SystemExit
            answer = {"ok": False, "error": describe(exc), "fatal": _cuda_broken(self.device)}
        if self.auditor is not None:  # events after the last facts (or an answer without facts): never lost
            left = self.auditor.drain()
            if left:
                answer["audit"] = list(answer.get("audit") or []) + left
        answer["id"] = rid
        self.send(answer)
        return not answer.get("fatal", False)

    # -- init ----------------------------------------------------------------------------------------
    def op_init(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.device = torch.device(msg["device"])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.empty(1, device=self.device)
        else:
            _fast_cpu_probe()
        flag_failures = torchstate.apply_flags(msg.get("flags", {}))
        if self.device.type == "cpu":  # after the host's flags; with process.CPU_THREAD_ENV (CPU-time samples)
            torch.set_num_threads(1)
        self.inputs_to_check = list(msg.get("inputs_to_check", []))
        self.mutated = list(msg.get("mutated_input_idxs", []))
        self.expected = list(msg.get("expected", []))
        if msg.get("constants"):
            loaded = T.load(msg["constants"], weights_only=True, map_location="cpu")
            self.constants = {k: layout.clone_layout(v, self.device) for k, v in loaded.items()}
        t0 = T.perf_ns()
        with open(msg["original_path"], encoding="utf-8") as handle:
            original = handle.read()
        self.modules["orig"] = self._load_module("orig", original, trusted=True)
        load_s = (T.perf_ns() - t0) / 1e9
        values = self.inputs(msg["warmup_inputs"])
        t0 = T.perf_ns()
        with T.no_grad():
            for _ in range(2):
                self.modules["orig"].fn(InputSet(values, self.device, guarded=False).args())
        worker_runtime.sync(self.device)
        warm_s = (T.perf_ns() - t0) / 1e9
        self.allocator = GuardedAllocator(self.device)
        limit = int(msg.get("fsize_limit", 0))
        if limit > 0:
            try:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
            except (ValueError, OSError):
                pass
        _warm_serialization(self.device)
        torchstate.install_tripwires()
        self._take_baselines()
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else platform.processor()
        triton_version = getattr(sys.modules.get("triton"), "__version__", None)
        return {"ok": True, "load_s": load_s, "warm_s": warm_s, "flag_failures": flag_failures,
                "device_name": name, "torch": torch.__version__, "triton": triton_version,
                "state": self.base_state}

    def _take_baselines(self) -> None:
        self.base_state = torchstate.state_snapshot(str(self.device))
        self.base_ids = torchstate.identity_snapshot(self._watched_namespaces())
        self.base_threads = {t.ident for t in T.threads() if t.ident is not None}
        self.base_signals = _signal_handlers()
        self.base_modules = {n: m for n, m in list(sys.modules.items()) if n.startswith("tilesmith")}

    def _watched_namespaces(self) -> list[tuple[str, dict[str, Any]]]:
        spaces = [("worker.__main__", vars(sys.modules["__main__"])), ("worker_core", globals()),
                  ("worker_runtime", vars(worker_runtime)), ("torchstate", vars(torchstate)),
                  ("protocol", vars(protocol)), ("T", vars(T)), ("worker_timing", vars(worker_timing)),
                  ("audit", vars(audit))]
        for loaded in self.modules.values():
            if loaded.trusted:
                spaces.append((f"module[{loaded.name}]", loaded.namespace))
                kernels: dict[str, Any] = {}
                for attr, obj in list(loaded.namespace.items()):
                    # The Runner class, and an instance-level `run` on every kernel object (Triton
                    # launchers): replacing either would slow or change the baseline.
                    if isinstance(obj, type):
                        spaces.append((f"module[{loaded.name}].{attr}", dict(vars(obj))))
                    elif hasattr(type(obj), "run") and hasattr(obj, "__dict__"):
                        kernels[f"{attr}.run"] = vars(obj).get("run", _NO_INSTANCE_RUN)
                spaces.append((f"module[{loaded.name}]", kernels))
        return spaces

    # -- load ----------------------------------------------------------------------------------------
    def _load_module(self, name: str, source: str, trusted: bool) -> Loaded:
        from torch._inductor.codecache import PyCodeCache

        key, path = PyCodeCache.write(source)
        module = PyCodeCache.load_by_key_path(key, path, None, dict(self.constants))
        fn = module.call
        try:
            from torch._inductor.utils import align_inputs_from_check_idxs

            fn = align_inputs_from_check_idxs(fn, self.inputs_to_check, set(self.mutated))
        except Exception:  # noqa: BLE001 - older torch: call unwrapped
            pass
        return Loaded(name, module, fn, trusted)

    def op_load(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Import a wrapper. ``baseline: true`` (the incumbent, loaded before the candidate) makes its
        namespace part of what the baselines watch, and the baselines are retaken after its import."""
        name = str(msg["name"])
        if not msg.get("baseline", False) and self.auditor is not None:
            self.auditor.arm()  # every file in the private dir now is trusted; what appears later is not
        t0 = T.perf_ns()
        try:
            loaded = self._load_module(name, msg["source"], trusted=bool(msg.get("baseline", False)))
        except BaseException as exc:  # noqa: BLE001
            return {"ok": False, "error": describe(exc), "fatal": _cuda_broken(self.device),
                    "facts": self._global_facts()}
        self.modules[name] = loaded
        facts = self._global_facts()
        if loaded.trusted:
            self._take_baselines()
        return {"ok": True, "load_s": (T.perf_ns() - t0) / 1e9, "facts": facts}

    def _global_facts(self) -> dict[str, Any]:
        now_threads = [t for t in T.threads() if t.ident not in self.base_threads and t.is_alive()]
        changes = torchstate.diff_state(self.base_state, torchstate.state_snapshot(str(self.device)))
        if self.base_signals:
            # A signal handler receives the interrupted frame: frame access without any audit event.
            now = _signal_handlers()
            changes.update({k: [self.base_signals.get(k), v] for k, v in now.items() if self.base_signals.get(k) != v})
        identity = torchstate.diff_identities(self.base_ids, torchstate.identity_snapshot(self._watched_namespaces()))
        # A module replaced in sys.modules would be picked up by any later `from tilesmith... import`.
        identity += [f"sys.modules[{n!r}]" for n, m in self.base_modules.items() if sys.modules.get(n) is not m]
        return {
            "audit": self.auditor.drain() if self.auditor is not None else [],
            "state_changes": changes,
            "identity_changes": identity,
            "threads_new": [f"{t.name} (daemon={t.daemon})" for t in now_threads],
        }

    # -- check ---------------------------------------------------------------------------------------
    def inputs(self, path: str) -> list[Any]:
        if path not in self.file_cache:
            values = T.load(path, weights_only=True, map_location="cpu")
            if not isinstance(values, list):
                raise TypeError(f"{path} does not hold a list")
            self.file_cache[path] = values
        return self.file_cache[path]

    def op_check(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("expected") is not None:
            self.expected = list(msg["expected"])
        self.validate = not msg.get("reference_only", False)
        results = []
        for step in msg["steps"]:
            facts = self._run_step(step)
            results.append(facts)
            if facts.get("fatal"):
                return {"ok": True, "steps": results, "fatal": True}
        for name, path in msg.get("save_held", {}).items():
            if name not in self.held:  # the holding step failed; its failure is already reported
                continue
            outs, snaps, iset = self.held[name]
            # Outputs that are (views of) inputs change when those input buffers are refilled: not judged.
            aliased = worker_runtime.input_aliased(outs, iset.values)
            fact = {"held": name, "lifetime_changed": worker_runtime.changed_since(outs, snaps, aliased)}
            fact.update(self._save(outs, [], path))
            results.append(fact)
        self.held.clear()
        self.live.clear()
        self.file_cache.clear()
        return {"ok": True, "steps": results}

    def _run_step(self, step: dict[str, Any]) -> dict[str, Any]:
        loaded = self.modules[step["module"]]
        values = self.inputs(step["inputs"])
        if step.get("refresh"):
            iset = self.live[step["refresh"]]
            iset.refresh(values)
        else:
            iset = InputSet(values, self.device, guarded=True)
        if step.get("keep_inputs_as"):
            self.live[step["keep_inputs_as"]] = iset
        poison = int(step.get("poison_byte", protocol.POISON_BYTES[0]))
        assert self.allocator is not None
        self.allocator.reset(poison)
        saved = self.allocator.install(loaded.namespace) if step.get("guard_allocations", True) else {}
        args = iset.args()
        iset.arm()
        facts: dict[str, Any] = {"label": step.get("label"), "module": loaded.name}
        T.manual_seed(int(step["seed"]))
        if step.get("poison"):  # last thing before the call: nothing else may take the poisoned blocks
            worker_runtime.poison_allocator(self.device, [e.get("nbytes", 0) for e in self.expected], poison)
        outs: Any = None
        snaps: list[Any] = []
        t0 = T.perf_ns()
        try:
            with T.no_grad():
                for _ in range(max(0, int(step.get("repeat", 1)) - 1)):
                    loaded.fn(iset.args())
                outs = loaded.fn(args)
            snaps = worker_runtime.snapshot_outputs(outs, self._snapshot_limit())
            worker_runtime.sync(self.device)
        except BaseException as exc:  # noqa: BLE001
            facts["error"] = describe(exc)
            if _cuda_broken(self.device):
                facts["fatal"] = True
                return facts
        finally:
            GuardedAllocator.uninstall(loaded.namespace, saved)
        facts["wall_ms"] = (T.perf_ns() - t0) / 1e6
        facts["outputs"] = layout.output_facts(outs, iset.values) if "error" not in facts else []
        if "error" not in facts:
            facts["async_changed"] = worker_runtime.changed_since(outs, snaps)
            facts["guard_violations"] = self.allocator.violations(list(outs) if isinstance(outs, (list, tuple)) else [])
        facts["inputs_changed"] = iset.changes()
        facts["rng"] = worker_runtime.rng_digest(self.device)
        facts.update(self._global_facts())
        if "error" in facts:
            return facts
        for other in step.get("compare_storage_with", []):
            if other in self.held:
                held_outs, _, held_inputs = self.held[other]
                inputs = worker_runtime.storage_ptrs(iset.values) | worker_runtime.storage_ptrs(held_inputs.values)
                shared = (worker_runtime.storage_ptrs(held_outs) & worker_runtime.storage_ptrs(outs)) - inputs
                facts.setdefault("shares_storage_with", {})[other] = len(shared)
        if step.get("hold_as"):
            self.held[step["hold_as"]] = (outs, snaps, iset)
        if step.get("save"):
            mutated = [(i, iset.values[i]) for i in self.mutated if i < len(iset.values)]
            facts.update(self._save(outs, mutated, step["save"]))
        return facts

    def _snapshot_limit(self) -> int:
        return 4 * sum(int(e.get("nbytes", 0)) for e in self.expected) + (1 << 20)

    def _save(self, outs: Any, mutated: list[tuple[int, Any]], path: str) -> dict[str, Any]:
        """Write outputs (contiguous CPU copies) after checking them against the expected specs."""
        problem = _against_expected(outs, self.expected) if self.validate else None
        if problem:
            return {"save_refused": problem}
        tensors = [compact_cpu(o) if type(o) is torch.Tensor else None for o in outs]
        extra = [[i, compact_cpu(t)] for i, t in mutated if isinstance(t, torch.Tensor)]
        T.save({"outputs": tensors, "mutated_inputs": extra}, path)
        return {"saved": path}

    # -- timing --------------------------------------------------------------------------------------
    def op_time(self, msg: dict[str, Any]) -> dict[str, Any]:
        # Bound at import (before any candidate): a lazy import here would take whatever module a
        # candidate had put into sys.modules under that name.
        answer = worker_timing.run_timing(self, msg)
        answer.update(self._global_facts())
        self.file_cache.clear()
        return answer


def _signal_handlers() -> dict[str, str]:
    """``{"signal.SIGALRM": "<default>", ...}``: the identity of every signal's Python-level handler."""
    out = {}
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        name = getattr(sig, "name", str(sig))
        out[f"signal.{name}"] = handler.name if isinstance(handler, signal.Handlers) else \
            (f"{getattr(handler, '__module__', '?')}.{getattr(handler, '__qualname__', '?')}@{id(handler):x}"
             if handler is not None else "None")
    return out


def compact_cpu(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that owns exactly its elements (``torch.save`` writes whole storages, and a
    guarded buffer's storage includes its guard tail)."""
    return t.detach().to("cpu", copy=True).contiguous()


def _against_expected(outs: Any, expected: list[dict[str, Any]]) -> str | None:
    if not isinstance(outs, (list, tuple)):
        return f"the wrapper returned {type(outs).__name__}, not a tuple"
    if len(outs) != len(expected):
        return f"{len(outs)} outputs, expected {len(expected)}"
    for i, (o, e) in enumerate(zip(outs, expected)):
        if e.get("kind") != "tensor":
            continue
        if type(o) is not torch.Tensor:
            return f"output {i} is {type(o).__module__}.{type(o).__qualname__}, expected torch.Tensor"
        if list(o.shape) != list(e["shape"]) or str(o.dtype) != e["dtype"]:
            return f"output {i} is {list(o.shape)} {o.dtype}, expected {e['shape']} {e['dtype']}"
    return None


def describe(exc: BaseException) -> dict[str, Any]:
    """Exception type, message and the last frames of its traceback (worker-reported text)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = str(exc)
    oom = isinstance(exc, getattr(torch, "OutOfMemoryError", MemoryError)) or isinstance(exc, MemoryError) \
        or "out of memory" in message.lower() or "can't allocate memory" in message.lower()
    return {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": message[:4000],
            "traceback": tb[-6000:], "oom": bool(oom)}


def _cuda_broken(device: torch.device) -> bool:
    """True when the CUDA context is unusable (sticky error such as an illegal memory access)."""
    if device.type != "cuda":
        return False
    try:
        T.cuda_sync(device)
        return False
    except BaseException:  # noqa: BLE001
        return True


def _warm_serialization(device: torch.device) -> None:
    """Save and load once before the baselines: pickling caches ``__slotnames__`` on ``torch.Tensor``."""
    import io

    buffer = io.BytesIO()
    sample = torch.zeros(2, device=device)
    T.save({"outputs": [sample.cpu(), None], "mutated_inputs": [[0, sample.cpu()]]}, buffer)
    buffer.seek(0)
    T.load(buffer, weights_only=True, map_location="cpu")


def _fast_cpu_probe() -> None:
    """Pick Inductor's CPU vector ISA now (its probes start subprocesses) so evaluations do not pay it.

    Uses ``tilesmith._compat.fast_cpu_isa_probe`` when the package provides it (test mode).
    """
    try:
        from tilesmith import _compat  # type: ignore[attr-defined]

        probe = getattr(_compat, "fast_cpu_isa_probe", None)
        if probe is not None:
            probe()
    except Exception:  # noqa: BLE001
        pass
    try:
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.pick_vec_isa()
    except Exception:  # noqa: BLE001
        pass


worker_timing.bind(T, _against_expected, compact_cpu)
