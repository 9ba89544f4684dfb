"""One phase of an evaluation: load the candidate in a fresh worker, check its correctness against the trusted
worker's references, time it against the baseline.

The first measurement and the confirmation are both a :func:`run_phase`, in different fresh candidate workers,
with different seeds (so different random, zero and high-magnitude inputs, a different timing pool and a
different random schedule). The original runs only in the trusted worker: references (outputs, RNG states) and
the original's timing arm. Candidate-side facts include the OS's count of the worker process's threads and of
the other processes in its session, compared with the trusted worker's (``os_threads``). The Gate decides from
the returned :class:`PhaseResult`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tilesmith.gate.host import answers, checks, spots, timing
from tilesmith.gate.host.memory import (INPUT_COPIES, OUTPUT_COPIES, MemoryPlan, growth_failure, oom_check,
                                        oom_message)
from tilesmith.gate.host.process import WorkerCrashed, WorkerProcess, WorkerProtocolError, WorkerTimedOut
from tilesmith.gate.host.reference import ReferenceRejected, RefResult, TrustedReference
from tilesmith.gate.inputs import recipe
from tilesmith.records import CheckFailure, Timing


def derive_seed(*parts: object) -> int:
    """Stable 31-bit seed from text parts (hashlib, not ``hash()``: that differs between processes)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class PhaseConfig:
    device: torch.device
    pairs: int
    worker_timeout_s: float
    run_timeout_s: float
    tf32: bool
    uses_rng: bool
    mutated_input_idxs: tuple[int, ...]
    expected: list[dict[str, Any]]
    expected_bytes: int
    ref_call_ms: float
    target_ms: float
    max_sample_ms: float
    base: list[Any]
    """The first call's inputs as the host sees them (memory-mapped): only their kinds are used (schedules)."""
    memory: MemoryPlan
    min_improvement: float = 0.02
    untrusted: Callable[[], list[Any]] = list
    """Every untrusted worker of the gate alive now (stopped while another arm is timed)."""
    trusted_counts: Callable[[], tuple[int, int]] = lambda: (0, 0)
    """The trusted worker's (threads, other processes in its session) so far, the bound for ``os_threads``."""
    static_input_idxs: tuple[int, ...] = ()
    """Inputs kept at one address (one buffer) across the calls of a timing sample."""
    sequential: bool = True
    allowance: float = 0.0
    """Per-process bias allowance of the rule (:data:`tilesmith.gate.host.stats.CPU_PROCESS_ALLOWANCE` on the CPU)."""
    control: bool = False
    """Time the baseline's code in the candidate's own worker too (arm ``ctl``) and decide on candidate vs that
    control (:func:`tilesmith.gate.host.stats.decide_controlled`); :attr:`tilesmith.gate.Gate.control` sets it."""


@dataclass
class PhaseResult:
    name: str
    failures: list[CheckFailure] = field(default_factory=list)
    timing: Timing | None = None
    decision: str | None = None
    """The sequential test's decision (``pass``/``slower``/``marginal``), ``None`` when the run used every pair."""
    record: dict[str, Any] = field(default_factory=dict)


class Variants:
    """The input-variant policy of a graph across phases: the high-magnitude scales to try (largest first,
    from the trusted worker: :func:`tilesmith.gate.inputs.scale_ladder`, and remembered: a scale the original
    overflowed at is not tried again) and ``duplicates`` (the original scatters with accumulation)."""

    def __init__(self, ladder: list[float], duplicates: bool) -> None:
        self.ladder, self.duplicates, self.start = list(ladder), bool(duplicates), 0


#: Reference keys of a phase and the variant each is made from.
RANDOM_KEYS = ("random", "random_b", *checks.EXTRA_RANDOM)


def _spec(variant: str, seed: int, policy: Variants, vary: bool = True, scale: float = 1.0) -> dict[str, Any]:
    return recipe(variant, seed, scale, vary=vary, duplicates=policy.duplicates and vary)


class PhaseInputs:
    """The recipes of one phase and their references, computed in the trusted worker in two requests."""

    def __init__(self, reference: TrustedReference, policy: Variants, seeds: dict[str, int]) -> None:
        self.reference, self.policy, self.seeds = reference, policy, seeds
        self.recipes: dict[str, dict[str, Any]] = {}
        self.refs: dict[str, RefResult] = {}
        self.notes: dict[str, str] = {}
        self.noise: dict[str, list[Any]] = {}
        self.high_scale: float | None = None
        self.pool: list[dict[str, Any]] = []
        self._first: Any = None

    def submit(self) -> None:
        """First request (sent before the candidate's import finishes, so both overlap): every varied variant,
        the pool's random set, and the non-finite count of the original at every high-magnitude scale."""
        s, p = self.seeds, self.policy
        wanted = {"normal": _spec("normal", s["normal"], p)}
        wanted.update({k: _spec("random", s[k], p) for k in RANDOM_KEYS})
        wanted["zero"] = _spec("zero", s["zero"], p)
        wanted["pool"] = _spec("random", s["pool"], p)
        self._wanted = wanted
        runs = [{"inputs": spec, "seed": s.get(k, s["pool"]), "save": k != "pool"} for k, spec in wanted.items()]
        self._rungs = [(i, _spec("high_magnitude", s["high_magnitude"], p, scale=scale))
                       for i, scale in enumerate(p.ladder) if i >= p.start]
        runs += [{"inputs": spec, "seed": s["high_magnitude"], "save": False} for _, spec in self._rungs]
        self._first = self.reference.submit(runs)

    def collect(self) -> None:
        """Second request: conservative fall-backs for what the original rejected, the chosen high-magnitude
        scale's outputs and its noise estimate (two rounding-level perturbations)."""
        results = self.reference.collect(self._first)
        keys = list(self._wanted)
        firsts = dict(zip(keys, results[:len(keys)]))
        rungs = results[len(keys):]
        s, p = self.seeds, self.policy
        retry: dict[str, dict[str, Any]] = {}
        for key, result in firsts.items():
            if isinstance(result, ReferenceRejected):
                if key == "normal":
                    raise result  # the original fails on the captured inputs: the gate itself cannot work
                variant = "zero" if key == "zero" else "random"
                retry[key] = _spec(variant, s.get(key, s["pool"]), p, vary=False)
                self.notes[f"{key}:{s.get(key, s['pool'])}"] = (
                    f"the original wrapper raised on varied integer/boolean inputs or moved NaN/Inf ({result}); used "
                    f"permuted captured values instead")
            else:
                self.recipes[key] = self._wanted[key]
                if key != "pool":
                    self.refs[key] = result
        limit = firsts["random"].nonfinite if isinstance(firsts["random"], RefResult) else None
        chosen = None
        for (i, spec), result in zip(self._rungs, rungs):
            if isinstance(result, RefResult) and (limit is None or result.nonfinite <= limit):
                chosen = (i, spec)
                break
        runs = [{"inputs": spec, "seed": s.get(k, s["pool"]), "save": k != "pool"} for k, spec in retry.items()]
        if chosen is not None:
            p.start = chosen[0]
            self.high_scale = p.ladder[chosen[0]]
            high = chosen[1]
            runs.append({"inputs": high, "seed": s["high_magnitude"]})
            for r in range(checks.NOISE_RUNS):
                runs.append({"inputs": {**high, "perturb": s["high_magnitude"] + 7919 * (r + 1)},
                             "seed": s["high_magnitude"]})
        else:
            p.start = len(p.ladder)
        second = self.reference.collect(self.reference.submit(runs)) if runs else []
        for (key, spec), result in zip(retry.items(), second):
            if isinstance(result, ReferenceRejected):
                if key in ("zero",):
                    self.notes["zero"] = f"skipped: the original wrapper raised on all-zero inputs ({result})"
                    continue
                raise result
            self.recipes[key] = spec
            if key != "pool":
                self.refs[key] = result
        if chosen is not None:
            high_ref, noisy = second[len(retry)], second[len(retry) + 1:]
            if isinstance(high_ref, RefResult):
                self.recipes["high_magnitude"], self.refs["high_magnitude"] = chosen[1], high_ref
                self.noise["high_magnitude"] = checks.noise_from(high_ref, [n for n in noisy if isinstance(n, RefResult)])
            else:
                self.high_scale = None
        self.pool = [self.recipes["normal"], self.recipes["pool"]]


def run_phase(name: str, worker: WorkerProcess, *, candidate_source: str, reference: TrustedReference,
              policy: Variants, cfg: PhaseConfig, files_dir: Path, seed_key: str,
              incumbent: WorkerProcess | None = None, load_rid: int | None = None,
              on_loaded: Callable[[], None] | None = None, baseline_source: str | None = None) -> PhaseResult:
    """Run one phase; worker failures (crash, hang, protocol) become failures, never exceptions. ``load_rid``:
    the candidate's ``load`` request was already sent to ``worker`` (a preloaded confirmation worker);
    ``on_loaded`` is called once the candidate imported cleanly (the gate then preloads the confirmation);
    ``baseline_source``: the baseline's code (the original, or the incumbent), loaded into ``worker`` as the
    in-process control arm when ``cfg.control``."""
    result = PhaseResult(name)
    rec = result.record
    rec.update(name=name, worker_pid=worker.pid, trusted_pid=reference.worker.pid,
               incumbent_pid=incumbent.pid if incumbent is not None else None)
    try:
        _run(result, worker, candidate_source, reference, policy, cfg, files_dir, seed_key, incumbent, load_rid,
             on_loaded, baseline_source if cfg.control else None)
    except WorkerTimedOut as exc:
        result.failures.append(CheckFailure("timeout", f"{exc} (phase {name}); the worker was killed. Look for an "
                                                       f"infinite loop, a deadlock or a kernel that never ends; "
                                                       f"the limit is set by TILESMITH_GATE_RUN_TIMEOUT_S / "
                                                       f"TILESMITH_WORKER_TIMEOUT_S."))
    except WorkerCrashed as exc:
        tail = " | ".join(exc.log_tail.strip().splitlines()[-8:])[:1500]
        hint = " (file size limit: an output far larger than the original's)" if exc.returncode == -25 else ""
        result.failures.append(CheckFailure("crash", f"the worker process died: {exc}{hint} (phase {name}). "
                                                     f"Worker log tail: {tail}"))
    except WorkerProtocolError as exc:
        result.failures.append(CheckFailure("protocol", f"{exc} (phase {name}): the candidate wrote to the "
                                                        f"harness's channel or broke it."))
    finally:
        worker.kill()
        rec["failures"] = result.failures
    return result


def _os_failures(worker: WorkerProcess, cfg: PhaseConfig, where: str, rec: dict[str, Any]) -> list[CheckFailure]:
    threads, others = worker.os_counts()
    rec.setdefault("os_counts", []).append({"after": where, "threads": threads, "processes": others})
    bound_threads, bound_others = cfg.trusted_counts()
    if threads <= bound_threads and others <= bound_others:
        return []
    what = []
    if threads > bound_threads:
        what.append(f"{threads} threads (the trusted worker running the original has {bound_threads})")
    if others > bound_others:
        what.append(f"{others} other processes in its session (the trusted worker's: {bound_others})")
    return [CheckFailure("os_threads", f"after {where} the candidate's worker process has {' and '.join(what)}, as "
                                       f"the operating system counts them (/proc/<pid>/task and the session's "
                                       f"processes: native threads and daemons included). A wrapper must not start "
                                       f"threads or processes that outlive its import or its calls.")]


def _run(result: PhaseResult, worker: WorkerProcess, candidate_source: str, reference: TrustedReference,
         policy: Variants, cfg: PhaseConfig, files_dir: Path, seed_key: str, incumbent: WorkerProcess | None,
         load_rid: int | None, on_loaded: Callable[[], None] | None, control_source: str | None = None) -> None:
    rec = result.record
    seeds = {v: derive_seed(seed_key, v) for v in ("normal", *RANDOM_KEYS, "zero", "high_magnitude", "pool")}
    rec["seeds"] = seeds
    # 1. load (the trusted worker computes the references meanwhile)
    t0 = time.monotonic()
    if load_rid is None:
        load_rid = worker.send("load", name="cand", source=candidate_source)
    worker.saw.add(hashlib.sha256(candidate_source.encode()).hexdigest())
    phase_inputs = PhaseInputs(reference, policy, seeds)
    phase_inputs.submit()
    answer = worker.receive(load_rid, cfg.worker_timeout_s, "loading the candidate (import, kernel compilation)")
    rec["load_s"] = round(time.monotonic() - t0, 3)
    result.failures += answers.failures_from_answer(answer, "importing the candidate")
    if not answer.get("ok"):
        err = answer.get("error", {})
        tail = " | ".join(str(err.get("traceback", "")).strip().splitlines()[-6:])[:1200]
        result.failures.append(CheckFailure("load_error", f"importing the candidate failed: {err.get('type')}: "
                                                          f"{str(err.get('message', ''))[:800]}. Traceback tail "
                                                          f"(worker): {tail}"))
        phase_inputs.collect()  # the trusted worker's answer must be read before its next request
        return
    result.failures += answers.global_failures(answer.get("facts", {}), "importing the cand module")
    result.failures += _os_failures(worker, cfg, "its import", rec)
    before_import = (worker.init_answer or {}).get("memory")
    after_import = answer.get("memory")
    grown = growth_failure(before_import, after_import, cfg.memory, "after its import")
    result.failures += [grown] if grown is not None else []
    if not result.failures and on_loaded is not None:
        on_loaded()
    t1 = time.monotonic()
    phase_inputs.collect()
    rec["references_s"] = round(time.monotonic() - t1, 3)
    rec["variant_notes"] = phase_inputs.notes
    rec["high_magnitude_scale"] = phase_inputs.high_scale
    if phase_inputs.high_scale is None:
        rec["high_magnitude_note"] = "skipped: the reference overflows at every scale ≥ 4"
    if result.failures:
        return
    # 2. correctness
    t1 = time.monotonic()
    plan = checks.build_plan(phase_inputs.recipes, worker.dir, seeds, name_tag(result.name), cfg.expected_bytes,
                             held_budget=cfg.memory.held_budget, poison_budget=cfg.memory.poison_budget)
    budget = cfg.run_timeout_s + 20 * cfg.ref_call_ms / 1e3 * len(plan.steps)
    answer = worker.request("check", budget, "the correctness checks", steps=plan.steps, save_held=plan.save_held,
                            expected=cfg.expected)
    ctx = checks.CheckContext(phase_inputs.refs, cfg.mutated_input_idxs, cfg.tf32, phase_inputs.noise)
    result.failures += answers.failures_from_answer(answer, "the correctness checks")
    result.failures += checks.interpret(plan, answer, ctx, cfg.expected_bytes)
    result.failures += _os_failures(worker, cfg, "its calls (correctness checks)", rec)
    # CPU: the worker's malloc keeps freed chunks below its mmap threshold (process.CPU_THREAD_ENV), so the resident
    # set still holds what the checks themselves held: the held calls' outputs and snapshots, the poisoned blocks,
    # the input copies (host/memory.py's counts). CUDA's allocated bytes drop when tensors are freed.
    retained = 0 if cfg.memory.device.startswith("cuda") else int(
        (2 * len(plan.save_held) + OUTPUT_COPIES + 4) * cfg.expected_bytes + INPUT_COPIES * cfg.memory.input_bytes)
    grown = growth_failure(after_import, answer.get("memory"), cfg.memory, "after its correctness calls (the held "
                                                                          "outputs released)", retained=retained)
    result.failures += [grown] if grown is not None else []
    rec["checks_s"] = round(time.monotonic() - t1, 3)
    rec["held_calls"] = len(plan.save_held) - 1
    rec["steps"] = [{k: s.get(k) for k in ("label", "module", "wall_ms", "error", "inputs_changed",
                                           "guard_violations", "async_changed", "threads_new", "state_changes",
                                           "identity_changes", "lifetime_changed", "save_refused")}
                    for s in answer.get("steps", [])]
    for f in list(result.failures):
        if f.check == "oom":
            step = next((s for s in answer.get("steps", []) if (s.get("error") or {}).get("oom")), {})
            result.failures[result.failures.index(f)] = CheckFailure(
                oom_check(str((step.get("error") or {}).get("message", "")), cfg.memory),
                f"{f.message}; the worker {oom_message(step.get('error') or {}, step.get('memory'))}; the "
                       f"gate's plan for this graph: {cfg.memory.minimum / 2**30:.2f} GiB minimum, "
                       f"{cfg.memory.free / 2**30:.2f} GiB free at the start", output_index=f.output_index,
                variant=f.variant)
    if result.failures:
        return
    # 3. timing
    t1 = time.monotonic()
    arms = ["inc", "cand", "orig"] if incumbent is not None else ["orig", "cand"]
    holders = {"orig": reference.worker, "cand": worker, **({"inc": incumbent} if incumbent is not None else {})}
    if control_source is not None:
        # The baseline's code in the candidate's own process: imported after the candidate's checks, so that
        # those ran on the candidate alone; the rule then compares two arms that share every process factor.
        answer = worker.request("load", cfg.worker_timeout_s, "loading the in-process control (the baseline's "
                                "code)", name="ctl", source=control_copy(control_source))
        if not answer.get("ok"):
            err = answer.get("error", {})
            why = f"{err.get('type')}: {str(err.get('message', ''))[:600]}"
            result.failures.append(CheckFailure("load_error", f"the baseline's own code failed to import in the "
                                                              f"candidate's process after the candidate: {why}"))
            return
        result.failures += answers.global_failures(answer.get("facts", {}), "importing the control")
        if result.failures:
            return
        arms.append("ctl")
        holders["ctl"] = worker
        rec["control_load_s"] = round(time.monotonic() - t1, 3)
    sched = timing.make_schedule(arms, [cfg.base, cfg.base], cfg.pairs, derive_seed(seed_key, "schedule"),
                                 static=cfg.static_input_idxs, output_bytes=cfg.expected_bytes)
    per_sample = max(cfg.max_sample_ms, 2 * cfg.ref_call_ms)
    predicted = timing.predicted_s(cfg.pairs, len(arms), per_sample, cfg.ref_call_ms)
    run = timing.TimingRun(holders=holders, untrusted=cfg.untrusted(), pool=phase_inputs.pool, target_ms=cfg.target_ms,
                           max_sample_ms=cfg.max_sample_ms, flush=timing.flush_bytes(cfg.device), expected=cfg.expected,
                           start_timeout_s=cfg.run_timeout_s + 3 * predicted,
                           sample_timeout_s=cfg.run_timeout_s + 3 * per_sample / 1e3, spot_dir=worker.dir,
                           baseline="inc" if incumbent is not None else "orig", min_improvement=cfg.min_improvement,
                           decision_seed=derive_seed(seed_key, "bootstrap"), sequential=cfg.sequential,
                           allowance=cfg.allowance, control="ctl" if "ctl" in holders else None)
    answer = timing.run_timing(run, sched)
    rec["timing_s"] = round(time.monotonic() - t1, 3)
    rec["timing_spots"] = [list(p) for p in sched.picks]
    rec["timing_k_limits"] = answer.get("k_limits")
    rec["timing_static_inputs"] = list(sched.static)
    rec["timing_rounds_run"] = answer.get("rounds_run")
    rec["timing_decision"] = answer.get("decision")
    rec["quiescence_failed_stops"] = answer.get("failed_stops")
    result.failures += answers.failures_from_answer(answer, "the timed calls")
    if not answer.get("ok"):
        err = answer.get("error", {})
        check = oom_check(str(err.get("message", "")), cfg.memory) if err.get("oom") else "exception"
        detail = f"; the worker {oom_message(err, None)}" if err.get("oom") else ""
        result.failures.append(CheckFailure(check, f"a timed call raised {err.get('type')}: "
                                                   f"{str(err.get('message'))[:600]}{detail}"))
        return
    rec["timing_raw"] = {k: answer.get(k) for k in ("calls_per_sample", "estimates_ms", "walls_ms", "method",
                                                    "host_ms", "host_cpu_ms", "kernel_cpu")}
    result.failures += answers.global_failures(answer, "the timed calls")
    result.failures += _os_failures(worker, cfg, "its timed calls", rec)
    inconsistent = timing.consistency_failure(answer)
    if inconsistent:
        result.failures.append(inconsistent)
    t2 = time.monotonic()
    result.failures += spots.spot_failures(answer, sched, phase_inputs.pool, reference, phase_inputs.refs["normal"],
                                            cfg.tf32, cfg.uses_rng)
    rec["spot_checks_s"] = round(time.monotonic() - t2, 3)
    for spot in (answer.get("spots") or {}).values():
        if spot.get("spot_path"):
            _unlink(Path(spot["spot_path"]))
    if result.failures:
        return
    result.timing = timing.build_timing(answer, sched, "inc" if incumbent is not None else "orig",
                                        derive_seed(seed_key, "bootstrap"), control="ctl" if "ctl" in holders else None)
    result.decision = answer.get("decision")
    rec["timing"] = result.timing


CONTROL_MARK = "\n# tilesmith: the in-process control arm (the baseline's code, timed beside the candidate)\n"


def control_copy(source: str) -> str:
    """The baseline's source with :data:`CONTROL_MARK` appended: another Inductor code-cache key, so the control
    is a module of its own (never the candidate's module when their sources are equal, never an entry the
    candidate could have put in the code cache under the baseline's key); its kernels are the same cache hits."""
    return source + CONTROL_MARK


def name_tag(name: str) -> str:
    return "".join(c for c in name if c.isalnum())[:16] or "phase"


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


STATUS_ORDER = (
    ("rejected_static", lambda c: c.startswith("static_")),
    # the cause of any load error/exception it made (a refused import raises ImportError at the candidate's import)
    ("rejected_global_state", lambda c: c.startswith("audit_") or c == "import_not_allowed"),
    ("rejected_load", lambda c: c == "load_error"),
    ("rejected_timeout", lambda c: c == "timeout"),
    ("gate_memory", lambda c: c == "gate_memory"),  # the memory the gate left was not enough
    ("rejected_crash", lambda c: c in {"crash", "protocol", "exception", "oom", "output_too_large"}),
    ("rejected_global_state", lambda c: c in {"background_thread", "global_state", "monkeypatch", "rng_state",
                                              "stream_state", "os_threads", "memory_growth",
                                              "compile_pool", "outside_clock"}),
    ("rejected_incorrect", lambda c: True),
)


def status_for(failures: list[CheckFailure]) -> str:
    """The verdict status for a non-empty failure list (the most fundamental failure wins)."""
    for status, matches in STATUS_ORDER:
        if any(matches(f.check) for f in failures):
            return status
    raise ValueError("status_for needs at least one failure")


__all__ = ["PhaseConfig", "PhaseResult", "Variants", "derive_seed", "run_phase", "status_for"]
