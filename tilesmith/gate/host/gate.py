"""The host-owned gate: decides whether a candidate wrapper is installed.

A candidate is accepted only when, in the host:

1. the static scan finds nothing (:mod:`tilesmith.gate.host.static_scan`);
2. a first measurement in a fresh candidate worker passes every correctness check against the original
   Inductor wrapper on normal, random, zero and high-magnitude inputs (:mod:`tilesmith.gate.host.checks`) and
   its paired timing clears the rule of :mod:`tilesmith.gate.host.stats` (median per-pair speedup ≥
   1 + ``min_improvement`` and the bootstrap interval's low end > 1, looked at sequentially);
3. a confirmation in a **fresh worker that never ran the measurement's calls**, with new seeds (new inputs,
   new schedule), passes the same correctness checks and clears the same rule.

Usage (the pipeline)::

    gate = Gate(problem, min_improvement=0.02, profiles_dir=track / "profiles")
    verdict = gate.evaluate(Candidate(source=..., proposer="builtin:cudagraph"), incumbent=None)
    verdict = gate.evaluate(cand2, incumbent=accepted_candidate)   # must beat the incumbent
    verdict = gate.recheck(cached_candidate)                        # cache hit: checks + one measurement
    gate.close()

Processes (docs/gate.md, "Workers"): one **trusted worker** per gate, started once, loads the original wrapper
and nothing else, ever: it makes every reference output and times the original's arm for every candidate.
Every phase of every candidate runs in a fresh **candidate worker** taken from spares started ahead (the first
ones with the trusted worker, the next after each take: their start is never on the critical path once the gate
is warm); the confirmation's worker imports the candidate while the measurement runs (it is stopped while
anything is timed). An accepted incumbent, candidate code too, runs in its own **incumbent worker**, kept while
it stays the incumbent. Not thread-safe: use one Gate from one thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import torch

from tilesmith import settings
from tilesmith.errors import WorkerError
from tilesmith.gate import torchstate
from tilesmith.gate.host import report as reports
from tilesmith.gate.host import standby, stats, timing, verdicts
from tilesmith.gate.host.compare import TOLERANCES
from tilesmith.gate.host.memory import MemoryPlan, plan_from
from tilesmith.gate.host.phase import PhaseConfig, PhaseResult, Variants, run_phase, status_for
from tilesmith.gate.host.problem import GateProblem
from tilesmith.gate.host.caches import make_cache_template
from tilesmith.gate.host.process import WorkerProcess
from tilesmith.gate.host.reference import RefResult, TrustedReference
from tilesmith.gate.host.static_scan import findings_to_failures, scan
from tilesmith.gate.host.timing import SAMPLE_MAX_MS, SAMPLE_TARGET_MS
from tilesmith.gate.inputs import accumulates, recipe
from tilesmith.records import Candidate, CheckFailure, Verdict

def _cleanup(workers: list[WorkerProcess], directory: str) -> None:
    for worker in list(workers):
        worker.kill()
    workers.clear()
    shutil.rmtree(directory, ignore_errors=True)


class Gate:
    """Evaluates candidate wrappers for one graph. See the module docstring for the acceptance rule.

    Args:
        problem: the graph, its first call's inputs (``snapshot_dir/inputs.pt``) and the trusted original.
        reference: accepted for compatibility and not called: the reference outputs come from the gate's
            trusted worker (the original wrapper alone in its own process), so the user's process does no
            device work for the gate.
        min_improvement: fraction (0.02 = 2 %); ``None`` reads ``TILESMITH_MIN_IMPROVEMENT``.
        profiles_dir: where ``<eval-id>.json``/``.txt`` reports go; ``None`` writes none.
        timing_pairs: the most paired samples per phase (the sequential test may stop earlier); ``None`` reads
            ``TILESMITH_GATE_PAIRS``.
        sample_target_ms: minimum duration of one timing sample; ``None``: 1 ms (CUDA), 5 ms (CPU).
        spares: candidate workers kept started ahead of need; ``None``: 4 on CUDA, 1 on the CPU (test mode). Each
            is an interpreter with torch imported (and on CUDA, where the inputs are small, a device context with
            the inputs); 4 because an accepted candidate takes two fresh workers (measurement, confirmation) and a
            worker's start takes longer than an evaluation (H100 host, 2026-12-06: back-to-back candidates,
            accepted ones 10.0 s median with 2 spares, 5.7–6.4 s with 4; docs/h200-runs.md, session 15).

    Raises:
        ValueError: a CPU graph without ``TILESMITH_ALLOW_CPU=1``, an invalid ``min_improvement``, or
            inputs.pt that does not match the graph (the message names the input index).
        tilesmith.errors.SettingsError: a gate setting holds an invalid value.
        tilesmith.errors.WorkerError: the original wrapper cannot run in the trusted worker (the message says
            why); a graph too large for the memory left is not an error: see :attr:`memory_problem`.
    """

    early_init: bool = True
    """CUDA: send spares their ``init`` as soon as they start where their device copies fit
    (:meth:`_early_init_fits`), not when a gate takes them (before session 15, which put a device context's creation
    on the path of every measurement). ``bench/gate_cost.py --late-init`` turns it off to compare."""

    def __init__(self, problem: GateProblem, reference: Callable[[list[Any]], Any] | None = None,
                 min_improvement: float | None = None, profiles_dir: Path | str | None = None, *,
                 timing_pairs: int | None = None, sample_target_ms: float | None = None,
                 spares: int | None = None) -> None:
        self.problem = problem
        self.label = problem.label
        graph = problem.graph
        self.device = torch.device(graph.device)
        if self.device.type == "cpu" and not settings.get("TILESMITH_ALLOW_CPU"):
            raise ValueError(f"{self.label}: the graph runs on the CPU; the gate handles CPU graphs only in test mode "
                             f"(set TILESMITH_ALLOW_CPU=1)")
        if self.device.type not in {"cpu", "cuda"}:
            raise ValueError(f"{self.label}: device {graph.device!r} is not supported (cuda:N or cpu)")
        value = settings.get("TILESMITH_MIN_IMPROVEMENT") if min_improvement is None else float(min_improvement)
        if not (math.isfinite(value) and 0.0 <= value < 1.0):
            raise ValueError(f"{self.label}: min_improvement={value!r} must be a fraction in [0, 1), e.g. 0.02")
        self.min_improvement = value
        self.pairs = int(timing_pairs or settings.get("TILESMITH_GATE_PAIRS"))
        self.start_timeout_s = float(settings.get("TILESMITH_WORKER_START_TIMEOUT_S"))
        self.worker_timeout_s = float(settings.get("TILESMITH_WORKER_TIMEOUT_S"))
        self.run_timeout_s = float(settings.get("TILESMITH_GATE_RUN_TIMEOUT_S"))
        self.profiles_dir = Path(profiles_dir) if profiles_dir is not None else None
        self.target_ms = float(sample_target_ms or SAMPLE_TARGET_MS[self.device.type])
        self.max_sample_ms = max(SAMPLE_MAX_MS[self.device.type], 4 * self.target_ms)
        self.spare_count = int(spares if spares is not None else (4 if self.device.type == "cuda" else 1))
        self.allowance = stats.CPU_PROCESS_ALLOWANCE if self.device.type == "cpu" else 0.0
        self.control = self.device.type == "cuda"
        """Decide on the candidate against the baseline's code timed in the candidate's own process (arm ``ctl``;
        :func:`tilesmith.gate.host.stats.decide_controlled`); the baseline in its own process guards the pass.
        On for CUDA since 2026-12-07: calibrated on an H100 (``bench/gate_calibration.py --control``, MLP block
        0.47 ms) with 0 of 145 A/A gates accepted and 52 of 53 at a true 5 % gain, where the cross-process rule
        alone had accepted 1 of 124 A/A and 48 of 60 (80 %) on the H200 (session 7): the candidate processes ran
        the same code 1.004–1.019× faster than the trusted worker, a bias the in-process arm does not see
        (docs/gate.md). Off in CPU test mode, whose per-process allowance covers that bias."""
        self.preload = self.device.type == "cuda"
        self.second_trusted = True
        """The confirmation is timed against a second trusted worker (the original only, too), so measurement and
        confirmation compare independent pairs of processes: a speed factor that belongs to a process rather
        than to the code (measured up to ±10 % on the CPU CI VM) cannot lean both phases the same way."""
        self._second: WorkerProcess | None = None
        """Whether the confirmation's worker imports the candidate while the measurement runs (CUDA: the host
        has cores to spare; CPU test mode: no — on a small machine a wasted import, for every candidate the
        measurement rejects, costs more than the overlap gains)."""
        self.base_inputs = problem.load_inputs()
        self.constants_path = problem.constants_path if problem.constants_path.is_file() else None
        self.flags = torchstate.numeric_flags()
        self.watch = torchstate.wrapper_namespaces(problem.original_source)
        self.dir = tempfile.mkdtemp(prefix="tilesmith-gate-")
        os.chmod(self.dir, 0o700)
        self.files = Path(self.dir) / "files"
        self.files.mkdir(mode=0o700)
        self.original_path = self.files / "original.py"
        self.original_path.write_text(problem.original_source, encoding="utf-8")
        self._workers: list[WorkerProcess] = []
        self._finalizer = weakref.finalize(self, _cleanup, self._workers, self.dir)
        self._counter = 0
        self._spares: list[WorkerProcess] = []
        self._incumbent: tuple[str, WorkerProcess] | None = None
        self._template: Path | None = None  # compiler caches of the trusted worker (the original's kernels only)
        self._worker_info: dict[str, Any] | None = None
        self._trusted_counts = (0, 0)
        self.expected: list[dict[str, Any]] = []
        self.fsize_limit = 0
        self.original_effects: tuple[str, ...] = ()
        self.original_imports: dict[str, Any] = {}
        """What the original imported in the trusted worker (modules, names, module objects it binds): a
        candidate worker refuses any other import of candidate code beyond the allow-list (docs/gate.md,
        "Imports")."""
        """What loading and warming up the original changed in the trusted worker (attribute identities, state
        keys); candidate workers do not report those (the original's own import changes them the same way)."""
        self.memory_problem: str | None = None
        """Why this graph cannot be evaluated in the memory left (``evaluate`` then answers ``gate_memory``)."""
        early: list[WorkerProcess] = []
        try:
            self._trusted = self._start_worker("trusted")
            # The other workers' interpreter starts (torch's import, seconds) overlap the trusted worker's init;
            # they get their init, and the original's compiled kernels, once the trusted worker has made them.
            early = [self._spawn("trusted")] if self.second_trusted else []
            early += [self._spawn("candidate") for _ in range(self.spare_count)]
            init = self._ready(self._trusted, "the trusted worker")
            self.original_effects = tuple(str(n) for n in init.get("original_effects") or ())
            self.original_imports = dict(init.get("original_imports") or {})
            self.memory: MemoryPlan = plan_from(str(self.device), init)
            self.reference = TrustedReference(self._trusted, self._trusted.dir, self.worker_timeout_s)
            self.captured: RefResult = self.reference.run(recipe("normal", 0), seed=0)
            self.expected = self.captured.expected_specs()
            mutated_bytes = sum(int(t.numel() * t.element_size()) for t in self.captured.mutated.values())
            self.reference.expected_bytes = self.captured.total_bytes() + mutated_bytes
            self.fsize_limit = max(1 << 30, 8 * self.captured.total_bytes(),
                                   timing.spot_file_limit(self.reference.expected_bytes))
            self.uses_rng = bool(init.get("uses_rng"))
            self.tf32 = self._uses_tf32()
            self.policy = Variants(list(init.get("scale_ladder") or []), accumulates(problem.original_source))
            self._observe_trusted()
            self._confirming: TrustedReference | None = None
            if not self.memory.fits:
                self.memory_problem = self.memory.message(self.label)
                for worker in early:
                    worker.kill()
            else:
                # The confirmation's trusted worker (see _confirmation_reference) and the spares, started above.
                self._second = self._arm(early.pop(0)) if self.second_trusted else None
                self._spares = [self._arm(worker) for worker in early]
                self._top_up()
        except BaseException:
            self.close()
            raise

    # -- public ---------------------------------------------------------------------------------------
    def evaluate(self, candidate: Candidate, incumbent: Candidate | None = None) -> Verdict:
        """Decide on ``candidate``; with ``incumbent`` it must beat that accepted candidate (timing pairs
        candidate vs incumbent, and the original is timed as a third arm for ``speedup_vs_original``).

        Returns a :class:`Verdict` for every candidate-caused outcome (including crashes and hangs), and
        ``gate_memory`` when the graph cannot be evaluated in the memory left.

        Raises:
            tilesmith.errors.WorkerError: the gate itself cannot work (a fresh worker cannot start, the
                trusted worker fails); the message names the graph.
        """
        return self._evaluate(candidate, incumbent, recheck=False)

    def recheck(self, candidate: Candidate) -> Verdict:
        """Artifact-cache hit: full correctness checks on this run's inputs plus one paired measurement
        against the original (no confirmation). Accepted when correct and the measurement clears the
        same rule; ``rejected_marginal``/``rejected_slower`` when it no longer pays off here."""
        return self._evaluate(candidate, None, recheck=True)

    def close(self) -> None:
        """Kill every worker and remove the gate's temporary files. Idempotent."""
        self._spares = []
        self._incumbent = None
        self._finalizer()

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- workers --------------------------------------------------------------------------------------
    def _start_worker(self, role: str) -> WorkerProcess:
        # The gate's first worker (the trusted one) may be a worker started ahead of need (tilesmith.compile()).
        return self._arm(self._spawn(role, adopt=role == "trusted"))

    def _spawn(self, role: str, *, adopt: bool = False) -> WorkerProcess:
        """A started worker process for ``role`` (with ``adopt``, the standby worker when one matches), not yet
        sent its ``init``."""
        if not self._finalizer.alive:
            raise WorkerError(f"{self.label}: the gate is closed")
        for dead in [w for w in self._workers if not w.alive()]:
            dead.kill()  # reaps it and removes its folder(s), also outside the gate's (an adopted standby's)
        self._workers[:] = [w for w in self._workers if w.alive()]
        label = f"{self.label} {role} worker"
        worker = standby.adopt(label, self.device.type) if adopt else None
        if worker is None:
            worker = WorkerProcess(Path(self.dir), label=label, template=self._template, device_type=self.device.type)
        worker.role = role
        self._workers.append(worker)
        return worker

    def _arm(self, worker: WorkerProcess) -> WorkerProcess:
        """Give a spawned worker what its ``init`` needs (the original's compiled kernels when it started before
        the template existed, the gate's fields) and send that ``init`` where it may run now."""
        role = worker.role
        if not worker.templated and self._template is not None:
            worker.seed_template(self._template)
        worker.init_fields = dict(
            role=role, device=str(self.device), flags=self.flags, watch=self.watch,
            constants=str(self.constants_path) if self.constants_path else None,
            inputs_to_check=list(self.problem.graph.inputs_to_check),
            mutated_input_idxs=list(self.problem.graph.mutated_input_idxs),
            original_path=str(self.original_path) if role == "trusted" else None,
            ignore_effects=list(self.original_effects), allowed_imports=self.original_imports,
            base_inputs=str(self.problem.inputs_path), expected=self.expected,
            fsize_limit=self.fsize_limit if role != "trusted" else 0)
        # A CUDA spare gets its ``init`` (device context, inputs on the device) now where its device copies fit
        # easily (_early_init_fits), else only when it is taken. Until a gate sends it wrapper code it runs only
        # Tilesmith's worker code, and may do so while arms are timed (Quiescence runs it on other CPUs than the
        # timed workers'), so back-to-back evaluations wait neither for its interpreter nor for its context.
        if role == "trusted" or self.device.type != "cuda" or self._early_init_fits():
            self._send_init(worker)
        return worker

    @staticmethod
    def _send_init(worker: WorkerProcess) -> None:
        if worker.init_rid is None:
            worker.init_rid = worker.send("init", **worker.init_fields)

    def _early_init_fits(self) -> bool:
        """CUDA: whether spares may get their ``init`` (device context, inputs on the device) as soon as they are
        started rather than when taken: where :attr:`early_init` is on and their device copies fit easily (each
        spare's context and two copies of the inputs, all spares together within a quarter of what the memory plan
        leaves free beyond one candidate worker's needs). Otherwise (graphs of gigabytes) as before."""
        plan = getattr(self, "memory", None)
        if not self.early_init or plan is None or self.memory_problem is not None:
            return False
        return plan.spares_fit(self.spare_count)

    def _ready(self, worker: WorkerProcess, what: str) -> dict[str, Any]:
        if worker.init_answer is not None:
            return worker.init_answer
        self._send_init(worker)
        answer = worker.receive(worker.init_rid, self.worker_timeout_s,
                                f"initialization of {what} (loading the inputs{' and the original wrapper' if worker.role == 'trusted' else ''})")
        if not answer.get("ok"):
            worker.kill()
            err = answer.get("error", {})
            raise WorkerError(f"{self.label}: {what} could not start: {err.get('type')}: "
                              f"{str(err.get('message'))[:500]}. Check that the graph's inputs.pt/constants.pt "
                              f"match the wrapper.")
        worker.init_answer = answer
        worker.init_done_at = time.monotonic()
        if worker.role == "trusted" and self._template is None:  # only the original's compiled kernels
            self._template = make_cache_template(worker, Path(self.dir) / "cache-template")
        if worker.role == "trusted":
            self._worker_info = {**(worker.ready_info or {}), **answer}
        return answer

    def _top_up(self) -> None:
        """Start spare candidate workers up to :attr:`spare_count` (their start runs alongside other work; they
        are stopped while anything is timed)."""
        self._spares = [w for w in self._spares if w.alive()]
        while len(self._spares) < self.spare_count:
            self._spares.append(self._start_worker("candidate"))

    def _take_worker(self, *, top_up: bool = True) -> WorkerProcess:
        """A started, initialized candidate worker that has never imported any candidate; with ``top_up``,
        also starts the next spare."""
        for attempt in range(2):
            self._spares = [w for w in self._spares if w.alive()]
            worker = self._spares.pop(0) if self._spares else self._start_worker("candidate")
            if top_up:
                self._top_up()
            try:
                self._ready(worker, "a fresh gate worker")
                return worker
            except WorkerError:
                worker.kill()
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    def _incumbent_worker(self, incumbent: Candidate) -> tuple[WorkerProcess | None, list[CheckFailure]]:
        """The worker holding ``incumbent`` (loaded once per incumbent; candidate code, so armed and checked)."""
        digest = hashlib.sha256(incumbent.source.encode()).hexdigest()
        if self._incumbent is not None and self._incumbent[0] == digest and self._incumbent[1].alive():
            return self._incumbent[1], []
        if self._incumbent is not None:
            self._incumbent[1].kill()
            self._incumbent = None
        worker = self._take_worker()
        worker.label = worker.label.replace("candidate worker", "incumbent worker")
        from tilesmith.gate.host import answers

        try:
            answer = worker.request("load", self.worker_timeout_s, "loading the incumbent", name="inc",
                                    source=incumbent.source)
        except WorkerError as exc:
            worker.kill()
            return None, [CheckFailure("load_error", f"the incumbent (previously accepted candidate) could not be "
                                                     f"loaded in its worker: {exc}")]
        fails = answers.failures_from_answer(answer, "importing the incumbent")
        if not answer.get("ok"):
            err = answer.get("error", {})
            fails.append(CheckFailure("load_error", f"importing the incumbent (previously accepted candidate) failed: "
                                                    f"{err.get('type')}: {str(err.get('message', ''))[:800]}"))
        fails += answers.global_failures(answer.get("facts", {}), "importing the incumbent")
        if fails:
            worker.kill()
            return None, fails
        worker.saw.add(digest)
        self._incumbent = (digest, worker)
        return worker, []

    def _untrusted(self) -> list[WorkerProcess]:
        return [w for w in self._workers if w.role != "trusted" and w.alive()]

    def _observe_trusted(self) -> tuple[int, int]:
        """The trusted workers' (threads, session processes) now, kept as the running maximum: the bound a
        candidate's worker may not exceed (``os_threads``)."""
        for worker in (self._trusted, self._second):
            if worker is not None and worker.init_answer is not None and worker.alive():
                threads, others = worker.os_counts()
                self._trusted_counts = (max(self._trusted_counts[0], threads), max(self._trusted_counts[1], others))
        return self._trusted_counts

    def _confirmation_reference(self) -> TrustedReference:
        """The reference (and original's timing arm) for a confirmation: the second trusted worker when it
        runs, else the first."""
        if self._confirming is not None and self._confirming.worker.alive():
            return self._confirming
        worker = self._second
        if worker is None or not worker.alive():
            return self.reference
        try:
            self._ready(worker, "the second trusted worker")
        except WorkerError:
            worker.kill()
            self._second = None
            return self.reference
        self._confirming = TrustedReference(worker, worker.dir, self.worker_timeout_s, self.reference.expected_bytes)
        return self._confirming

    # -- evaluation -----------------------------------------------------------------------------------
    def _next_id(self) -> str:
        self._counter += 1
        eval_id = reports.next_evaluation_id(self.profiles_dir, self._counter)
        self._counter = int(eval_id[1:])
        return eval_id

    def _config(self) -> PhaseConfig:
        return PhaseConfig(
            device=self.device, pairs=self.pairs, worker_timeout_s=self.worker_timeout_s,
            run_timeout_s=self.run_timeout_s, tf32=self.tf32, uses_rng=self.uses_rng,
            mutated_input_idxs=tuple(self.problem.graph.mutated_input_idxs), expected=self.expected,
            expected_bytes=self.captured.total_bytes() + sum(int(t.numel() * t.element_size())
                                                             for t in self.captured.mutated.values()),
            ref_call_ms=self.captured.wall_ms, target_ms=self.target_ms, max_sample_ms=self.max_sample_ms,
            base=self.base_inputs, memory=self.memory, min_improvement=self.min_improvement,
            untrusted=self._untrusted, trusted_counts=self._observe_trusted,
            static_input_idxs=self.problem.static_input_idxs, allowance=self.allowance, control=self.control)

    def _phase(self, name: str, worker: WorkerProcess, candidate: Candidate, incumbent: WorkerProcess | None,
               eval_id: str, load_rid: int | None = None, on_loaded: Callable[[], None] | None = None,
               baseline: str | None = None) -> PhaseResult:
        """``baseline``: the incumbent's source when ``incumbent`` holds one (the in-process control's code)."""
        reference = self._confirmation_reference() if name == "confirmation" else self.reference
        baseline = self.problem.original_source if incumbent is None else baseline
        return run_phase(name, worker, candidate_source=candidate.source, reference=reference,
                         policy=self.policy, cfg=self._config(), files_dir=self.files,
                         seed_key=f"{eval_id}:{name}", incumbent=incumbent, load_rid=load_rid, on_loaded=on_loaded,
                         baseline_source=baseline)

    def _evaluate(self, candidate: Candidate, incumbent: Candidate | None, recheck: bool) -> Verdict:
        started = time.monotonic()
        eval_id = self._next_id()
        phases: list[PhaseResult] = []
        static = findings_to_failures(scan(candidate.source))
        if static:
            verdict = self._reject("rejected_static", static, None, None, "static scan")
        elif self.memory_problem is not None:
            verdict = Verdict(False, "gate_memory", (self.memory_problem,))
        else:
            verdict = self._decide(candidate, incumbent, recheck, eval_id, phases)
        verdict = Verdict(accepted=verdict.accepted, status=verdict.status, reasons=verdict.reasons,
                          failures=verdict.failures, timing=verdict.timing, confirmation=verdict.confirmation,
                          report_path=None, evaluation_id=eval_id, wall_s=round(time.monotonic() - started, 3))
        path = self._write_report(eval_id, candidate, incumbent, verdict, phases, static, recheck)
        if path is not None:
            verdict = Verdict(**{**verdict.__dict__, "report_path": str(path)})
        return verdict

    def _decide(self, candidate: Candidate, incumbent: Candidate | None, recheck: bool, eval_id: str,
                phases: list[PhaseResult]) -> Verdict:
        standby.settle(self.start_timeout_s)  # a standby of another compile() must not start during samples
        inc_worker = None
        if incumbent is not None:
            inc_worker, fails = self._incumbent_worker(incumbent)
            if fails:
                return self._reject(status_for(fails), fails, None, None, "incumbent")
        first_worker = self._take_worker(top_up=not recheck)
        preload: dict[str, Any] = {}
        baseline = incumbent.source if incumbent is not None else None

        def start_confirmation() -> None:
            # The confirmation's fresh worker imports the candidate (and compiles its kernels) while the
            # measurement runs its checks; it is stopped while anything is timed.
            if recheck:
                return
            worker = self._spares.pop(0) if self._spares else self._start_worker("candidate")
            self._send_init(worker)
            preload["worker"] = worker
            preload["rid"] = worker.send("load", name="cand", source=candidate.source)

        first = self._phase("measurement", first_worker, candidate, inc_worker, eval_id,
                            on_loaded=start_confirmation if self.preload else None, baseline=baseline)
        phases.append(first)
        try:
            if first.failures:
                return self._reject(status_for(first.failures), first.failures, None, None, "measurement")
            assert first.timing is not None
            verdict1 = self._classify(first)
            if verdict1 != "pass":
                return self._slow(verdict1, first.timing, None, "measurement")
            if recheck:
                return Verdict(True, "accepted", (), timing=first.timing)
            second_worker = preload.pop("worker", None)
            rid = preload.pop("rid", None)
            if second_worker is None or not second_worker.alive():
                second_worker, rid = self._take_worker(), None
            else:
                self._ready(second_worker, "a fresh gate worker")
            self._top_up()
            second = self._phase("confirmation", second_worker, candidate, inc_worker, eval_id, load_rid=rid,
                                 baseline=baseline)
            phases.append(second)
            if second.failures:
                return self._reject(status_for(second.failures), second.failures, first.timing, None,
                                    "confirmation")
            assert second.timing is not None
            if self._classify(second) != "pass":
                return self._slow("unconfirmed", first.timing, second.timing, "confirmation")
            return Verdict(True, "accepted", (), timing=first.timing, confirmation=second.timing)
        finally:
            leftover = preload.get("worker")
            if leftover is not None:
                leftover.kill()

    def _classify(self, phase: PhaseResult) -> str:
        return verdicts.classify(phase, self.min_improvement, self.allowance)

    def _reject(self, status: str, failures: list[CheckFailure], timing: Any, confirmation: Any,
                phase: str) -> Verdict:
        return verdicts.reject(self.label, status, failures, timing, confirmation, phase)

    def _slow(self, kind: str, timing: Any, confirmation: Any, phase: str) -> Verdict:
        return verdicts.slow(self.label, kind, timing, confirmation, phase, min_improvement=self.min_improvement,
                             allowance=self.allowance, pairs=self.pairs)

    # -- facts about the graph ------------------------------------------------------------------------
    def _uses_tf32(self) -> bool:
        if self.device.type != "cuda":
            return False
        f = self.flags
        source = self.problem.original_source

        def tf32(leaf: str, parent: str) -> bool:
            value = f.get(leaf)
            if value in (None, "none"):
                value = f.get(parent)
            if value in (None, "none"):
                value = f.get("fp32_precision")
            return value == "tf32"

        has_mm = bool(re.search(r"extern_kernels\.(mm|addmm|bmm|baddbmm)|triton_tem_|aten\.(mm|addmm|bmm)|_scaled_mm",
                                source))
        has_conv = "convolution" in source
        return (has_mm and tf32("cuda.matmul.fp32_precision", "fp32_precision")) or \
            (has_conv and tf32("cudnn.conv.fp32_precision", "cudnn.fp32_precision"))

    # -- reports --------------------------------------------------------------------------------------
    def _write_report(self, eval_id: str, candidate: Candidate, incumbent: Candidate | None, verdict: Verdict,
                      phases: list[PhaseResult], static: list[CheckFailure], recheck: bool) -> Path | None:
        if self.profiles_dir is None:
            return None
        report = {
            "format": reports.REPORT_FORMAT, "evaluation_id": eval_id, "kind": "recheck" if recheck else "evaluate",
            "label": self.label, "graph_name": self.problem.graph.name, "device": str(self.device),
            "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "proposer": candidate.proposer, "attempt": candidate.attempt, "note": candidate.note,
            "candidate_sha256": hashlib.sha256(candidate.source.encode()).hexdigest(),
            "incumbent_sha256": hashlib.sha256(incumbent.source.encode()).hexdigest() if incumbent else None,
            "verdict": reports.verdict_dict(verdict),
            "static_scan": static,
            "phases": [p.record for p in phases],
            "settings": {"min_improvement": self.min_improvement, "timing_pairs": self.pairs,
                         "sequential_looks": stats.looks(self.pairs), "look_alpha": stats.look_alpha(self.pairs),
                         "sample_target_ms": self.target_ms, "max_sample_ms": self.max_sample_ms,
                         "worker_start_timeout_s": self.start_timeout_s, "worker_timeout_s": self.worker_timeout_s,
                         "run_timeout_s": self.run_timeout_s, "tf32_tolerances": self.tf32,
                         "uses_rng": self.uses_rng, "flags": self.flags},
            "reference": {"source": "trusted worker", "trusted_pid": self._trusted.pid,
                          "second_trusted_pid": self._second.pid if self._second is not None else None,
                          "runs": self.reference.runs + (self._confirming.runs if self._confirming else 0), "call_ms": self.captured.wall_ms,
                          "outputs": self.captured.facts, "os_counts": list(self._trusted_counts)},
            "memory": dataclasses.asdict(self.memory) | {"minimum": self.memory.minimum,
                                                          "held_budget": self.memory.held_budget},
            "tolerances": {k: v.__dict__ for k, v in TOLERANCES.items()},
            "environment": reports.environment(self.device, self._worker_info),
        }
        return reports.write(self.profiles_dir, eval_id, report)
