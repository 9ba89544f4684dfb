"""One gate phase in one worker: load the candidate, check correctness, time it against the baseline.

The first measurement and the confirmation are both a :func:`run_phase`, in different workers, with
different seeds (so different random, zero-with-permuted-integers and high-magnitude inputs, a different
timing pool and a different random schedule). The Gate decides from the returned :class:`PhaseResult`.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from tilesmith.gate.host import answers, checks, timing
from tilesmith.gate.inputs import accumulates, make_variant, scale_ladder
from tilesmith.gate.host.process import WorkerCrashed, WorkerProcess, WorkerProtocolError, WorkerTimedOut, process_cpu_ms
from tilesmith.gate.host.reference import RefResult, write_inputs
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
    quiesce: Callable[[], None] = lambda: None
    """Called right before the timing request: waits for the spare worker's start-up to finish."""
    static_input_idxs: tuple[int, ...] = ()
    """Inputs kept at one address across the calls of a timing sample (``GateProblem.static_input_idxs``)."""


@dataclass
class PhaseResult:
    name: str
    failures: list[CheckFailure] = field(default_factory=list)
    timing: Timing | None = None
    record: dict[str, Any] = field(default_factory=dict)


class HighScale:
    """Chooses (and remembers across phases) the largest high-magnitude scale the reference survives; also
    holds the input-variant policy of the graph (``duplicates``: the original scatters with accumulation,
    see :func:`tilesmith.gate.inputs.accumulates`)."""

    def __init__(self, base: list[Any], source: str = "") -> None:
        self.ladder = scale_ladder(base)
        self.start = 0
        self.duplicates = accumulates(source)

    def variant(self, base: list[Any], reference: Any, seed: int,
                notes: dict[str, str] | None = None) -> tuple[list[Any], RefResult, float] | None:
        _, plain, vary = checked_variant(base, "random", seed, reference, self, {} if notes is None else notes)
        limit = _nonfinite(plain)
        for i in range(self.start, len(self.ladder)):
            values = make_variant(base, "high_magnitude", seed, self.ladder[i], vary=vary,
                                  duplicates=self.duplicates)
            try:
                ref = reference.run(values, seed)
            except Exception:  # noqa: BLE001 - the original rejects these magnitudes: try a smaller scale
                continue
            if _nonfinite(ref) <= limit:
                self.start = i
                return values, ref, self.ladder[i]
        self.start = len(self.ladder)
        return None


def checked_variant(base: list[Any], variant: str, seed: int, reference: Any, policy: HighScale,
                    notes: dict[str, str], scale: float = 1.0) -> tuple[list[Any], RefResult, bool]:
    """``(inputs, reference result, varied)`` for ``variant``: the varied integer/boolean/NaN-Inf values
    when the original accepts them, else (noted in ``notes``) the conservative ``vary=False`` variant.

    Raises:
        Exception: whatever the reference raises on the conservative variant too.
    """
    values = make_variant(base, variant, seed, scale, vary=True, duplicates=policy.duplicates)
    try:
        return values, reference.run(values, seed), True
    except Exception as exc:  # noqa: BLE001 - the original rejects the varied values: fall back
        notes[f"{variant}:{seed}"] = (f"the original wrapper raised {type(exc).__name__} on varied integer/boolean "
                                      f"inputs or moved NaN/Inf; used permuted captured values instead")
    values = make_variant(base, variant, seed, scale, vary=False)
    return values, reference.run(values, seed), False


def _nonfinite(ref: RefResult) -> int:
    return sum(int((~torch.isfinite(o)).sum()) for o in ref.outputs
               if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex()))


def run_phase(name: str, worker: WorkerProcess, *, candidate_source: str, incumbent_source: str | None,
              base: list[Any], reference: Any, scale: HighScale, cfg: PhaseConfig, files_dir: Path,
              seed_key: str) -> PhaseResult:
    """Run one phase; worker failures (crash, hang, protocol) become failures, never exceptions."""
    result = PhaseResult(name)
    rec = result.record
    rec.update(name=name, worker_pid=worker.pid)
    try:
        _run(result, worker, candidate_source, incumbent_source, base, reference, scale, cfg, files_dir, seed_key)
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


def _run(result: PhaseResult, worker: WorkerProcess, candidate_source: str, incumbent_source: str | None,
         base: list[Any], reference: Any, scale: HighScale, cfg: PhaseConfig, files_dir: Path, seed_key: str) -> None:
    rec = result.record
    # 1. load
    # The incumbent (already accepted) first: its namespace joins the watched baselines before any
    # candidate code is imported, so a candidate patching the incumbent's kernels is seen.
    for module, source in (("inc", incumbent_source), ("cand", candidate_source)):
        if source is None:
            continue
        t0 = time.monotonic()
        what = "candidate" if module == "cand" else "incumbent"
        answer = worker.request("load", cfg.worker_timeout_s, f"loading the {what} (import, kernel compilation)",
                                name=module, source=source, baseline=module == "inc")
        worker.saw.add(hashlib.sha256(source.encode()).hexdigest())
        rec[f"load_{module}_s"] = round(time.monotonic() - t0, 3)
        result.failures += answers.failures_from_answer(answer, f"importing the {what}")
        if not answer.get("ok"):
            err = answer.get("error", {})
            tail = " | ".join(str(err.get("traceback", "")).strip().splitlines()[-6:])[:1200]
            who = "candidate" if module == "cand" else "incumbent (previously accepted candidate)"
            result.failures.append(CheckFailure("load_error", f"importing the {who} failed: {err.get('type')}: "
                                                              f"{str(err.get('message', ''))[:800]}. Traceback tail "
                                                              f"(worker): {tail}"))
            return
        result.failures += answers.global_failures(answer.get("facts", {}), f"importing the {module} module")
        if result.failures:
            return
    # 2. correctness
    seeds = {v: derive_seed(seed_key, v) for v in ("normal", "random", "random_b", "zero", "high_magnitude", "pool",
                                                   *checks.EXTRA_RANDOM)}
    notes: dict[str, str] = {}
    values = {"normal": make_variant(base, "normal", seeds["normal"])}
    refs = {"normal": reference.run(values["normal"], seeds["normal"])}
    for key in ("random", "random_b", *checks.EXTRA_RANDOM):
        values[key], refs[key], _ = checked_variant(base, "random", seeds[key], reference, scale, notes)
    try:
        values["zero"], refs["zero"], _ = checked_variant(base, "zero", seeds["zero"], reference, scale, notes)
    except Exception as exc:  # noqa: BLE001 - the original itself rejects all-zero inputs: skip that variant
        rec["zero_note"] = f"skipped: the original wrapper raised {type(exc).__name__} on all-zero inputs"
    high = scale.variant(base, reference, seeds["high_magnitude"], notes)
    if high is not None:
        values["high_magnitude"], refs["high_magnitude"], rec["high_magnitude_scale"] = high
        noise = {"high_magnitude": checks.reference_noise(reference, values["high_magnitude"],
                                                          refs["high_magnitude"], seeds["high_magnitude"])}
    else:
        rec["high_magnitude_scale"] = None
        rec["high_magnitude_note"] = "skipped: the reference overflows at every scale ≥ 4"
    rec["seeds"] = seeds
    rec["variant_notes"] = notes  # the same dict: the timing pool's note (if any) lands here too
    files = {}
    for k, v in values.items():
        files[k] = files_dir / f"{name_tag(result.name)}_{k}.pt"
        write_inputs(v, files[k])
    plan = checks.build_plan(files, worker.dir, seeds, name_tag(result.name), cfg.expected_bytes)
    budget = cfg.run_timeout_s + 20 * cfg.ref_call_ms / 1e3 * len(plan.steps)
    answer = worker.request("check", budget, "the correctness checks", steps=plan.steps,
                            save_held=plan.save_held, expected=cfg.expected)
    ctx = checks.CheckContext(refs, cfg.mutated_input_idxs, cfg.tf32, noise if high is not None else {})
    result.failures += answers.failures_from_answer(answer, "the correctness checks")
    result.failures += checks.interpret(plan, answer, ctx, cfg.expected_bytes)
    rec["steps"] = [{k: s.get(k) for k in ("label", "module", "wall_ms", "error", "inputs_changed",
                                           "guard_violations", "async_changed", "threads_new", "state_changes",
                                           "identity_changes", "lifetime_changed", "save_refused")}
                    for s in answer.get("steps", [])]
    for f in files.values():
        _unlink(f)
    if result.failures:
        return
    # 3. timing
    pool_values = [values["normal"], checked_variant(base, "random", seeds["pool"], reference, scale, notes)[0]]
    pool_files = []
    for i, v in enumerate(pool_values):
        pool_files.append(files_dir / f"{name_tag(result.name)}_pool{i}.pt")
        write_inputs(v, pool_files[-1])
    arms = ["inc", "cand", "orig"] if incumbent_source is not None else ["orig", "cand"]
    sched = timing.make_schedule(arms, pool_values, cfg.pairs, derive_seed(seed_key, "schedule"),
                                 static=cfg.static_input_idxs)
    per_sample = max(cfg.max_sample_ms, 2 * cfg.ref_call_ms)
    predicted_s = (cfg.pairs * len(arms) * (per_sample + 2.0) + 40 * cfg.ref_call_ms * len(arms)) / 1e3
    spot_path = worker.dir / f"{name_tag(result.name)}_spots.pt"
    cfg.quiesce()
    cpu0 = process_cpu_ms(worker.pid)
    t0 = time.monotonic()
    answer = timing.run_samples(worker, sched, pool_files, target_ms=cfg.target_ms, max_sample_ms=cfg.max_sample_ms,
                                flush=timing.flush_bytes(cfg.device), expected=cfg.expected,
                                start_timeout_s=cfg.run_timeout_s + 3 * predicted_s,
                                sample_timeout_s=cfg.run_timeout_s + 3 * per_sample / 1e3, spot_path=spot_path)
    host_wall_ms = (time.monotonic() - t0) * 1e3
    cpu1 = process_cpu_ms(worker.pid)
    host_cpu_ms = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    rec["timing_spots"] = [list(p) for p in sched.picks]
    rec["timing_k_limits"] = answer.get("k_limits")
    rec["timing_static_inputs"] = list(sched.static)
    for p in pool_files:
        _unlink(p)
    result.failures += answers.failures_from_answer(answer, "the timed calls")
    if not answer.get("ok"):
        err = answer.get("error", {})
        result.failures.append(CheckFailure("oom" if err.get("oom") else "exception",
                                            f"a timed call raised {err.get('type')}: {str(err.get('message'))[:600]}"))
        return
    rec["timing_raw"] = {k: answer.get(k) for k in ("calls_per_sample", "estimates_ms", "walls_ms", "method")}
    rec["timing_host_wall_ms"] = host_wall_ms
    result.failures += answers.global_failures(answer, "the timed calls")
    inconsistent = timing.consistency_failure(answer, host_wall_ms, host_cpu_ms)
    if inconsistent:
        result.failures.append(inconsistent)
    result.failures += timing.spot_failures(answer, sched, pool_values, reference, refs["normal"], cfg.tf32,
                                            cfg.uses_rng)
    if result.failures:
        return
    result.timing = timing.build_timing(answer, sched, "inc" if incumbent_source is not None else "orig",
                                        derive_seed(seed_key, "bootstrap"))
    rec["timing"] = result.timing


def name_tag(name: str) -> str:
    return "".join(c for c in name if c.isalnum())[:16] or "phase"


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


STATUS_ORDER = (
    ("rejected_static", lambda c: c.startswith("static_")),
    ("rejected_global_state", lambda c: c.startswith("audit_")),  # the cause of any load error/exception it made
    ("rejected_load", lambda c: c == "load_error"),
    ("rejected_timeout", lambda c: c == "timeout"),
    ("rejected_crash", lambda c: c in {"crash", "protocol", "exception", "oom", "output_too_large"}),
    ("rejected_global_state", lambda c: c in {"background_thread", "global_state", "monkeypatch", "rng_state",
                                              "stream_state"}),
    ("rejected_incorrect", lambda c: True),
)


def status_for(failures: list[CheckFailure]) -> str:
    """The verdict status for a non-empty failure list (the most fundamental failure wins)."""
    for status, matches in STATUS_ORDER:
        if any(matches(f.check) for f in failures):
            return status
    raise ValueError("status_for needs at least one failure")


__all__ = ["HighScale", "PhaseConfig", "PhaseResult", "derive_seed", "run_phase", "status_for"]
