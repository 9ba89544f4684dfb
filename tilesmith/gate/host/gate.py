"""The host-owned gate: decides whether a candidate wrapper is installed.

A candidate is accepted only when, in the host:

1. the static scan finds nothing (:mod:`tilesmith.gate.host.static_scan`);
2. a first measurement in an isolated worker passes every correctness check against the original
   Inductor wrapper on normal, random, zero and high-magnitude inputs (:mod:`tilesmith.gate.host.checks`)
   and its paired timing clears the rule of :mod:`tilesmith.gate.host.stats`
   (median per-pair speedup ≥ 1 + ``min_improvement`` and bootstrap 95 % CI low > 1);
3. a confirmation in a **fresh worker that never imported the candidate**, with new seeds (new inputs,
   new schedule), passes the same correctness checks and clears the same rule.

Usage (the pipeline)::

    gate = Gate(problem, reference=ref_fn, min_improvement=0.02, profiles_dir=track / "profiles")
    verdict = gate.evaluate(Candidate(source=..., proposer="builtin:cudagraph"), incumbent=None)
    verdict = gate.evaluate(cand2, incumbent=accepted_candidate)   # must beat the incumbent
    verdict = gate.recheck(cached_candidate)                        # cache hit: checks + one measurement
    gate.close()

Workers: one spare worker is always being started (interpreter, CUDA context, constants, the original
wrapper loaded and warmed up), so an evaluation does not wait for start-up. Every worker serves exactly
one phase of one candidate and is then killed. Not thread-safe: use one Gate from one thread.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import tempfile
import time
import weakref
from datetime import datetime, UTC
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from tilesmith import settings
from tilesmith.errors import WorkerError
from tilesmith.gate import torchstate
from tilesmith.gate.host import report as reports
from tilesmith.gate.host import standby, stats
from tilesmith.gate.host.compare import TOLERANCES
from tilesmith.gate.host.phase import HighScale, PhaseConfig, PhaseResult, run_phase, status_for
from tilesmith.gate.host.problem import GateProblem
from tilesmith.gate.host.process import WorkerProcess, make_cache_template, redact
from tilesmith.gate.host.reference import HostReference, RefResult, ScreenedReference, WorkerReference, to_device
from tilesmith.gate.host.static_scan import findings_to_failures, scan
from tilesmith.gate.host.timing import SAMPLE_MAX_MS, SAMPLE_TARGET_MS
from tilesmith.records import Candidate, CheckFailure, Verdict

_RNG_HINT = re.compile(r"inductor_seeds|inductor_random|inductor_randint|\brandn?\b|randint|randperm|bernoulli|"
                       r"dropout|native_dropout|normal_|uniform_|exponential_")
_MAX_REASONS = 8


def _cleanup(workers: list[WorkerProcess], directory: str) -> None:
    for worker in list(workers):
        worker.kill()
    workers.clear()
    shutil.rmtree(directory, ignore_errors=True)


class Gate:
    """Evaluates candidate wrappers for one graph. See the module docstring for the acceptance rule.

    Args:
        problem: the graph, its first call's inputs (``snapshot_dir/inputs.pt``) and the trusted original.
        reference: the original Inductor callable in this process (``ref_fn(args: list) -> tuple``, frees
            its list); ``None`` runs the original source in a trusted worker instead.
        min_improvement: fraction (0.02 = 2 %); ``None`` reads ``TILESMITH_MIN_IMPROVEMENT``.
        profiles_dir: where ``<eval-id>.json``/``.txt`` reports go; ``None`` writes none.
        timing_pairs: paired samples per phase; ``None`` reads ``TILESMITH_GATE_PAIRS``.
        sample_target_ms: minimum duration of one timing sample; ``None``: 1 ms (CUDA), 5 ms (CPU).

    Raises:
        ValueError: a CPU graph without ``TILESMITH_ALLOW_CPU=1``, an invalid ``min_improvement``, or
            inputs.pt that does not match the graph (the message names the input index).
        tilesmith.errors.SettingsError: a gate setting holds an invalid value.
        tilesmith.errors.WorkerError: the original wrapper cannot run (reference worker failure).
    """

    def __init__(self, problem: GateProblem, reference: Callable[[list[Any]], Any] | None = None,
                 min_improvement: float | None = None, profiles_dir: Path | str | None = None, *,
                 timing_pairs: int | None = None, sample_target_ms: float | None = None) -> None:
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
        self.base_inputs = problem.load_inputs()
        self.constants_path = problem.constants_path if problem.constants_path.is_file() else None
        self.flags = torchstate.numeric_flags()
        self.dir = tempfile.mkdtemp(prefix="tilesmith-gate-")
        os.chmod(self.dir, 0o700)
        self.files = Path(self.dir) / "files"
        self.files.mkdir(mode=0o700)
        self.original_path = self.files / "original.py"
        self.original_path.write_text(problem.original_source, encoding="utf-8")
        self._workers: list[WorkerProcess] = []
        self._finalizer = weakref.finalize(self, _cleanup, self._workers, self.dir)
        self._counter = 0
        self._spare: WorkerProcess | None = None
        self._template: Path | None = None  # compiler caches of a fresh worker (original's kernels only)
        self._worker_info: dict[str, Any] | None = None
        self.expected: list[dict[str, Any]] = []
        self.fsize_limit = 0
        try:
            if reference is not None:
                host = HostReference(reference, self.device, tuple(graph.mutated_input_idxs))
                self.reference: Any = ScreenedReference(host, self.base_inputs, self._trusted_worker, self.files,
                                                        self.worker_timeout_s)
            else:
                self.reference = WorkerReference(self._start_worker("reference"), self.files, self.worker_timeout_s)
                self._ready(self.reference.worker, "the trusted reference worker")
            self.captured: RefResult = self.reference.run(self.base_inputs, seed=0)
            self.expected = self.captured.expected_specs()
            self.fsize_limit = max(1 << 30, 8 * self.captured.total_bytes())
            self.uses_rng = self._detect_rng(reference)
            self.tf32 = self._uses_tf32()
            self.scale = HighScale(self.base_inputs, problem.original_source)
            self._spare = self._start_worker("candidate")
        except BaseException:
            self.close()
            raise

    # -- public ---------------------------------------------------------------------------------------
    def evaluate(self, candidate: Candidate, incumbent: Candidate | None = None) -> Verdict:
        """Decide on ``candidate``; with ``incumbent`` it must beat that accepted candidate (timing pairs
        candidate vs incumbent, and the original is timed as a third arm for ``speedup_vs_original``).

        Returns a :class:`Verdict` for every candidate-caused outcome (including crashes and hangs).

        Raises:
            tilesmith.errors.WorkerError: the gate itself cannot work (a fresh worker cannot start or
                cannot run the original wrapper twice in a row); the message names the graph.
        """
        return self._evaluate(candidate, incumbent, recheck=False)

    def recheck(self, candidate: Candidate) -> Verdict:
        """Artifact-cache hit: full correctness checks on this run's inputs plus one paired measurement
        against the original (no confirmation). Accepted when correct and the measurement clears the
        same rule; ``rejected_marginal``/``rejected_slower`` when it no longer pays off here."""
        return self._evaluate(candidate, None, recheck=True)

    def close(self) -> None:
        """Kill every worker and remove the gate's temporary files. Idempotent."""
        self._spare = None
        self._finalizer()

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- workers --------------------------------------------------------------------------------------
    def _start_worker(self, role: str) -> WorkerProcess:
        if not self._finalizer.alive:
            raise WorkerError(f"{self.label}: the gate is closed")
        for dead in [w for w in self._workers if not w.alive()]:
            dead.kill()  # reaps it and removes its folder(s), also outside the gate's (an adopted standby's)
        self._workers[:] = [w for w in self._workers if w.alive()]
        label = f"{self.label} {role} worker"
        # Before a cache template exists (the gate's first worker), a worker started ahead of need may be taken.
        worker = standby.adopt(label, self.device.type) if self._template is None else None
        if worker is None:
            worker = WorkerProcess(Path(self.dir), label=label, template=self._template, device_type=self.device.type)
        self._workers.append(worker)
        worker.init_rid = worker.send(  # type: ignore[attr-defined]
            "init", device=str(self.device), flags=self.flags,
            constants=str(self.constants_path) if self.constants_path else None,
            inputs_to_check=list(self.problem.graph.inputs_to_check),
            mutated_input_idxs=list(self.problem.graph.mutated_input_idxs),
            original_path=str(self.original_path), warmup_inputs=str(self.problem.inputs_path),
            expected=self.expected, fsize_limit=self.fsize_limit)
        return worker

    def _ready(self, worker: WorkerProcess, what: str) -> dict[str, Any]:
        cached = getattr(worker, "init_answer", None)
        if cached is not None:
            return cached
        answer = worker.receive(worker.init_rid, self.worker_timeout_s,  # type: ignore[attr-defined]
                                f"initialization of {what} (loading the original wrapper)")
        if not answer.get("ok"):
            worker.kill()
            err = answer.get("error", {})
            raise WorkerError(f"{self.label}: {what} could not run the original wrapper: {err.get('type')}: "
                              f"{str(err.get('message'))[:500]}. Check that the graph's inputs.pt/constants.pt "
                              f"match the wrapper.")
        worker.init_answer = answer  # type: ignore[attr-defined]
        if self._template is None:  # before any candidate: only the original's compiled kernels are in it
            self._template = make_cache_template(worker, Path(self.dir) / "cache-template")
        self._worker_info = {**(worker.ready_info or {}), **answer}
        return answer

    def _trusted_worker(self) -> WorkerProcess:
        """A started, initialized worker for reference runs only (no candidate is ever loaded into it)."""
        worker = self._start_worker("reference")
        try:
            self._ready(worker, "the trusted reference worker")
        except WorkerError:
            worker.kill()
            raise
        return worker

    def _take_worker(self, *, spare: bool = True) -> WorkerProcess:
        """A started, initialized worker that has never imported any candidate; with ``spare``, also starts the
        next one (for the confirmation or the next evaluation). A cache re-check is one phase and usually the
        gate's last: it starts no spare, which would compete with the re-check for the CPU and be waited for
        before timing (``_quiesce``); a later phase then starts its worker on demand."""
        for attempt in range(2):
            ready = self._spare
            worker = ready if ready is not None and ready.alive() else self._start_worker("candidate")
            self._spare = self._start_worker("candidate") if spare else None
            try:
                self._ready(worker, "a fresh gate worker")
                return worker
            except WorkerError:
                worker.kill()
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    def _quiesce(self) -> None:
        """Wait until the spare worker (and a standby worker, :mod:`tilesmith.gate.host.standby`) has finished
        starting, so it does not compete with timing samples."""
        standby.settle(self.start_timeout_s)
        spare = self._spare
        if spare is None or getattr(spare, "init_answer", None) is not None:
            return
        try:
            self._ready(spare, "the spare gate worker")
        except WorkerError:
            spare.kill()
            self._spare = None

    # -- evaluation -----------------------------------------------------------------------------------
    def _next_id(self) -> str:
        self._counter += 1
        eval_id = reports.next_evaluation_id(self.profiles_dir, self._counter)
        self._counter = int(eval_id[1:])
        return eval_id

    def _config(self) -> PhaseConfig:
        return PhaseConfig(device=self.device, pairs=self.pairs, worker_timeout_s=self.worker_timeout_s,
                           run_timeout_s=self.run_timeout_s, tf32=self.tf32, uses_rng=self.uses_rng,
                           mutated_input_idxs=tuple(self.problem.graph.mutated_input_idxs), expected=self.expected,
                           expected_bytes=self.captured.total_bytes() + sum(
                               int(t.numel() * t.element_size()) for t in self.captured.mutated.values()),
                           ref_call_ms=max(self.captured.wall_ms, 0.01), target_ms=self.target_ms,
                           max_sample_ms=self.max_sample_ms, quiesce=self._quiesce,
                           static_input_idxs=self.problem.static_input_idxs)

    def _phase(self, name: str, candidate: Candidate, incumbent: Candidate | None, eval_id: str, *,
               spare: bool = True) -> PhaseResult:
        worker = self._take_worker(spare=spare)
        return run_phase(name, worker, candidate_source=candidate.source,
                         incumbent_source=incumbent.source if incumbent is not None else None,
                         base=self.base_inputs, reference=self.reference, scale=self.scale, cfg=self._config(),
                         files_dir=self.files, seed_key=f"{self.label}/{eval_id}/{name}")

    def _evaluate(self, candidate: Candidate, incumbent: Candidate | None, recheck: bool) -> Verdict:
        if not self._finalizer.alive:
            raise WorkerError(f"{self.label}: the gate is closed; build a new Gate")
        started = time.monotonic()
        eval_id = self._next_id()
        phases: list[PhaseResult] = []
        static = findings_to_failures(scan(candidate.source))
        if static:
            verdict = self._reject("rejected_static", static, None, None, "static scan")
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
        first = self._phase("measurement", candidate, incumbent, eval_id, spare=not recheck)
        phases.append(first)
        if first.failures:
            return self._reject(status_for(first.failures), first.failures, None, None, "measurement")
        assert first.timing is not None
        st1 = stats.PairedStats(first.timing.speedup, first.timing.ci_low, first.timing.ci_high,
                                len(first.timing.baseline_ms))
        verdict1 = stats.classify(st1, self.min_improvement)
        if verdict1 != "pass":
            return self._slow(verdict1, first.timing, None, "measurement")
        if recheck:
            return Verdict(True, "accepted", (), timing=first.timing)
        second = self._phase("confirmation", candidate, incumbent, eval_id)
        phases.append(second)
        if second.failures:
            return self._reject(status_for(second.failures), second.failures, first.timing, None, "confirmation")
        assert second.timing is not None
        st2 = stats.PairedStats(second.timing.speedup, second.timing.ci_low, second.timing.ci_high,
                                len(second.timing.baseline_ms))
        if not stats.passes(st2, self.min_improvement):
            return self._slow("unconfirmed", first.timing, second.timing, "confirmation")
        return Verdict(True, "accepted", (), timing=first.timing, confirmation=second.timing)

    def _reject(self, status: str, failures: list[CheckFailure], timing: Any, confirmation: Any,
                phase: str) -> Verdict:
        failures = [dataclasses.replace(f, message=redact(f.message)) for f in failures]
        reasons = tuple(f"{self.label}: [{phase}] {f.check}: {f.message}" for f in failures[:_MAX_REASONS])
        if len(failures) > _MAX_REASONS:
            reasons += (f"{self.label}: … and {len(failures) - _MAX_REASONS} more failed checks (see the report)",)
        return Verdict(False, status, reasons, tuple(failures), timing=timing, confirmation=confirmation)  # type: ignore[arg-type]

    def _slow(self, kind: str, timing: Any, confirmation: Any, phase: str) -> Verdict:
        t = confirmation if confirmation is not None else timing
        bar = 1.0 + self.min_improvement
        baseline = "the accepted incumbent" if t.baseline_label == "incumbent" else "the original Inductor wrapper"
        text = (f"{self.label}: [{phase}] speedup over {baseline} is {t.speedup:.4f} (95% CI {t.ci_low:.4f}"
                f"–{t.ci_high:.4f}, {len(t.baseline_ms)} paired samples of {t.calls_per_sample} calls); "
                f"acceptance needs a median ≥ {bar:.4f} and a CI lower bound > 1")
        if kind == "slower":
            status, text = "rejected_slower", text + ". The candidate is slower."
        elif kind == "unconfirmed":
            status, text = "rejected_unconfirmed", text + (f" in a fresh process too; the first measurement gave "
                                                           f"{timing.speedup:.4f} but the confirmation did not.")
        else:
            status, text = "rejected_marginal", text + ". The gain (if any) is too small to confirm."
        return Verdict(False, status, (text,), timing=timing, confirmation=confirmation)  # type: ignore[arg-type]

    # -- facts about the graph ------------------------------------------------------------------------
    def _detect_rng(self, reference: Callable[[list[Any]], Any] | None) -> bool:
        if reference is None:
            return bool(_RNG_HINT.search(self.problem.original_source))
        state = torch.get_rng_state()
        cuda_state = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        try:
            torch.default_generator.manual_seed(12345)
            if cuda_state is not None:
                torch.cuda.default_generators[self.device.index or 0].manual_seed(12345)
            before = (torch.get_rng_state().clone(), torch.cuda.get_rng_state(self.device).clone()
                      if cuda_state is not None else None)
            args = [to_device(v, self.device) for v in self.base_inputs]
            with torch.no_grad():
                reference(list(args))
            after = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda_state is not None else None)
            cuda_changed = before[1] is not None and not torch.equal(before[1], after[1])
            return not torch.equal(before[0], after[0]) or cuda_changed
        finally:
            torch.set_rng_state(state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, self.device)

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
        import hashlib

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
                         "sample_target_ms": self.target_ms, "max_sample_ms": self.max_sample_ms,
                         "worker_start_timeout_s": self.start_timeout_s, "worker_timeout_s": self.worker_timeout_s,
                         "run_timeout_s": self.run_timeout_s, "tf32_tolerances": self.tf32,
                         "uses_rng": self.uses_rng, "flags": self.flags},
            "reference": {"source": "host callable" if isinstance(self.reference, ScreenedReference) else "trusted worker",
                          "runs_in_trusted_worker": getattr(self.reference, "screened", 0),
                          "call_ms": self.captured.wall_ms, "outputs": self.captured.facts},
            "tolerances": {k: v.__dict__ for k, v in TOLERANCES.items()},
            "environment": reports.environment(self.device, self._worker_info),
        }
        return reports.write(self.profiles_dir, eval_id, report)
