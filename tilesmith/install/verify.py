"""Production verification: installed wrappers are shadow-checked in the user's process (issue 15, item 4).

:func:`guard` wraps the boxed callable that :func:`tilesmith.install.installer.install` swaps in. An unchecked call costs a
counter increment and one comparison, (``state=on``) two reads of the thread's mode-stack depths before and after
the wrapper (:func:`tilesmith.gate.modes.depths`: a mode left pushed uninstalls it at once, popped), and (``audit=on``) arms the calling thread for the production audit hook
(:mod:`tilesmith.install.audit`: the gate worker's audit rules; a thread-local read, two stores and a slot read). A
*checked* call (the first ``first`` calls after install, then each call with probability ``1/every`` — raised so that
checks cost about ``budget`` of the graph's own time — and the first call after ``interval`` seconds without a check;
``TILESMITH_VERIFY``, :class:`tilesmith.settings.VerifyPolicy`):

1. takes copies of the call's inputs (before the installed wrapper runs: Inductor's ``call`` clears its argument
   list and deletes inputs it no longer needs) and the CPU and device RNG states;
2. runs the original Inductor callable on the copies, then puts the RNG states back, so both draw the same
   random numbers (the gate requires identical random streams from the same seed, docs/gate.md);
3. runs the installed wrapper on the caller's own tensors and argument list (a CUDA-graph candidate still sees
   the addresses it pinned);
4. compares, with the gate's functions and tolerances (:mod:`tilesmith.gate.host.compare`): output structure
   (count, types, shapes, dtypes, devices, strides, aliasing), output values, inputs written in place (as the
   original writes them; the others must be unchanged), the RNG states after both, the process's OS threads
   (:mod:`tilesmith.install.threads`) and the gate's side-effect snapshot taken before the wrapper's import
   (:class:`tilesmith.gate.sidefx.ProductionSnapshot`: attribute identities of the namespaces the wrapper names,
   ``torch.backends.*`` values, the denormal probe). An elementwise value failure is judged once more against the original's
   own rounding sensitivity on these inputs (the gate's high-magnitude rule), since real activations can be
   larger than the gate's normal inputs; graphs that write inputs are judged elementwise only;
5. and, first of all, whether the audit hook refused an event of the wrapper's during its run; last, work of its own
   left in Inductor's compile pool (:mod:`tilesmith.gate.pools`) and the bytes it keeps across checked calls
   (:mod:`tilesmith.install.leaks`, ``memory_leak``: allocator bytes and CPython blocks). Also: fresh outputs still
   referenced by the wrapper at return beyond the original's (:mod:`tilesmith.gate.retained`, ``output_retained``)
   and, from the paired times of both runs, a wrapper clearly slower than the original in production
   (:mod:`tilesmith.install.retime`, ``slower_in_production``).

On a mismatch (or an exception from the installed wrapper) the graph is uninstalled at once (what follows a verdict
is :class:`tilesmith.install.failure.Failure`, a mixin of :class:`Verifier`): the call returns the
original's outputs (aliases of inputs mapped back to the caller's tensors, inputs restored, RNG states set as the
original left them), the graph and its identical twins run on Inductor from then on, the artifact is quarantined
in the cache (:meth:`tilesmith.cache.ArtifactStore.quarantine`), and a ``verification_failed`` diagnostic names
the graph, the call number and what differed. Nothing raises into the user's call: a fault inside the judging
itself serves the original's outputs too and uninstalls the graph without quarantine (``verification_error``:
unjudged outputs are never returned); a check that cannot run (CUDA-graph capture in progress, too little free device memory for the copies) is skipped with one
``verification_skipped`` diagnostic per reason. An exception from the wrapper on an *unchecked* call still
uninstalls and quarantines it, but is re-raised: its inputs are consumed and no copy exists. An event the audit
refused on an unchecked call uninstalls and quarantines it too; the original serves the call when the argument list
is intact, else the exception (usually the refusal's ``PermissionError``) is re-raised, or, when the wrapper caught
it and returned, its outputs are returned (unjudged, as on any unchecked call; the side effect did not happen).
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from tilesmith import settings
from tilesmith.context import RunContext
from tilesmith.gate import modes, retained, torchstate
from tilesmith.gate.sidefx import ProductionSnapshot
from tilesmith.gate.window import StateWindow
from tilesmith.gate.host.compare import check_values, compare_output, compare_structure, tolerance_for
from tilesmith.install.shadow import (
    PERTURB_ULPS,
    is_oom,
    output_facts,
    perturbed,
    rng_equal,
    rng_restore,
    rng_state,
    same_bits,
    tf32_in_effect,
)
from tilesmith.install import audit
from tilesmith.install.failure import Failure, Problem as _Problem, Shadow as _Shadow
from tilesmith.install.leaks import LeakWatch
from tilesmith.install.quarantine import quarantine  # noqa: F401 - tilesmith.install.installer uses verify.quarantine
from tilesmith.install.retime import Retime, Stopwatch
from tilesmith.install.schedule import CLOCK, Schedule
from tilesmith.install.threads import ThreadCensus, warm_intra_op_pool
from tilesmith.settings import VerifyPolicy
from tilesmith.track.snapshot import copy_input


@dataclass(frozen=True)
class Preparation:
    """What :func:`prepare` recorded just before the candidate's import: the policy, the thread baseline, the
    side-effect baseline, the wrapper's audit :class:`~tilesmith.install.audit.Watch` (``None``: ``audit=off``) and
    the ids of foreign work already running in Inductor's compile pool (:func:`tilesmith.gate.pools.foreign_work`)."""

    policy: VerifyPolicy
    census: ThreadCensus | None
    snapshot: ProductionSnapshot | None = None
    watch: audit.Watch | None = None
    pool_base: frozenset[int] = frozenset()


def prepare(source: str | None = None, label: str = "") -> Preparation | None:
    """Read ``TILESMITH_VERIFY`` and take the thread and side-effect baselines; call it *before* importing the
    candidate (inside :func:`importing`). ``source``: the wrapper about to be imported (the side-effect baseline
    watches the namespaces it names; ``None``: no side-effect check); ``label``: the graph's label, for messages.

    Returns ``None`` when verification is off (``TILESMITH_VERIFY=off``) or the policy checks nothing. Starts
    the verification clock thread first (so it is part of the baseline) and brings the intra-op pool to full size.

    Raises:
        SettingsError: ``TILESMITH_VERIFY`` is invalid (``tilesmith.compile`` checks it up front).
    """
    policy = settings.get("TILESMITH_VERIFY")
    if policy is None or (policy.first == 0 and policy.every is None and policy.interval_s is None):
        return None
    own = CLOCK.ensure_started() if policy.interval_s is not None else None
    census = None
    if policy.threads:
        warm_intra_op_pool()
        census = ThreadCensus(own=(own,) if own else ())
    snapshot = None
    if policy.state and source is not None:
        snapshot = ProductionSnapshot()
        snapshot.baseline(torchstate.wrapper_namespaces(source))
    watch = pool_base = None
    if policy.audit:
        audit.ensure_hook()
        watch, pool_base = audit.Watch(label), audit.pool_baseline()
    return Preparation(policy, census, snapshot, watch, pool_base or frozenset())


def guard(run: RunContext, handle: Any, track: Any, fn: Any, module: Any, source: str,
          prep: Preparation | None) -> Any:
    """The callable to swap in for ``handle``: ``fn`` itself when ``prep`` is ``None``, else a verified entry.

    ``run``: the live run (:class:`~tilesmith.context.RunContext`: diagnostics, benchmarks; the twins from its
    ``handles`` when it has them); ``track``: the graph's track (its ``track.json`` records an uninstall) or
    ``None``; ``module``: the loaded wrapper (its file attributes threads to it); ``source``: the installed wrapper
    text (what is quarantined).
    """
    if prep is None:
        return fn
    verifier = Verifier(run, handle, track, fn, module, source, prep)
    state = verifier
    depths = modes.depths if prep.snapshot is not None else modes.no_depths  # the state policy: R4's mode stacks
    if prep.watch is None:
        def verified_call(args: list[Any]) -> Any:
            state.calls += 1
            if state.calls < state.next_check:
                stacks = depths()
                try:  # free unless it raises (zero-cost exception handling, Python >= 3.11)
                    out = fn(args)
                except Exception as exc:
                    if not state.unchecked_failure(exc, args):
                        raise
                    return state.original(args)
                if depths() != stacks:
                    return state.unchecked_modes(stacks, out, args)
                return out
            return state.checked_call(args)
    else:
        local, watch = audit.LOCAL, prep.watch

        def verified_call(args: list[Any]) -> Any:
            state.calls += 1
            if state.calls < state.next_check:
                if watch.records:  # refused outside its calls (a thread, a hook it left): not run again
                    return state.refused_between_calls(args)
                previous, stacks = local.watch, depths()
                local.watch = watch  # the audit hook judges this thread's events while the wrapper runs
                try:
                    out = fn(args)
                except Exception as exc:
                    local.watch = previous
                    if not state.unchecked_failure(exc, args):
                        raise
                    return state.original(args)
                finally:
                    local.watch = previous
                if watch.records:
                    return state.unchecked_refused(out, args)
                if depths() != stacks:
                    return state.unchecked_modes(stacks, out, args)
                return out
            return state.checked_call(args)

    verified_call._boxed_call = True  # type: ignore[attr-defined]
    verified_call._tilesmith_verifier = verifier  # type: ignore[attr-defined]
    if prep.policy.interval_s is not None:
        CLOCK.add(verifier)
    return verified_call


def verifier_of(handle: Any) -> Verifier | None:
    """The :class:`Verifier` of ``handle``'s installed callable, if it has one."""
    return verifier_of_callable(getattr(handle.compiled, "current_callable", None))


def verifier_of_callable(fn: Any) -> Verifier | None:
    """The :class:`Verifier` behind a callable :func:`guard` returned (``None`` for any other callable)."""
    return getattr(fn, "_tilesmith_verifier", None)


def _copy(value: Any) -> Any:
    return copy_input(value)


class Verifier(Schedule, Failure):
    """Counters, schedule and checks of one installed graph (lives in the user's process).

    Read-only for callers: ``calls`` (calls since install), ``checks`` (passed checks), ``skipped``,
    ``failed`` (True once uninstalled), ``gap`` (current mean gap between sampled checks, calls),
    ``check_cost_s`` / ``call_s`` / ``spacing_s`` (running estimates: seconds a check adds, seconds the wrapper
    takes on a checked call, wall seconds per call between checks).
    """

    def __init__(self, run: RunContext, handle: Any, track: Any, fn: Any, module: Any, source: str, prep: Preparation):
        self.run, self.handle, self.track, self.fn, self.source = run, handle, track, fn, source
        self.policy, self.census, self.snapshot = prep.policy, prep.census, prep.snapshot
        self.original = handle.original
        self.key, self.label, self.graph_name = handle.key, handle.label, handle.graph.name
        self.mutated = tuple(handle.graph.mutated_input_idxs)
        self.device = torch.device(handle.graph.device)
        self.tf32 = tf32_in_effect(self.device, source)
        self.module = module
        self.watch, self.pool_base = prep.watch, prep.pool_base
        self.leaks = LeakWatch(self.device) if self.policy.memory else None
        self.retime = Retime() if self.policy.retime else None
        self.measure_refs = self.policy.retained and retained.available()
        file = getattr(module, "__file__", None)
        self.wrapper_files = (file,) if file else ()
        record = getattr(handle, "record", None)
        self.gate_call_s = float(getattr(record, "tilesmith_ms", 0.0) or 0.0) / 1e3
        self.calls = 0
        self.checks = 0
        self.skipped = 0
        self.failed = False
        self.gap = float(self.policy.every or 0)
        self.check_cost_s: float | None = None
        self.call_s: float | None = None
        self.spacing_s: float | None = None
        self._last_end, self._last_n = time.perf_counter(), 0
        self.last_check_at = time.monotonic()
        self.timed_pending = False
        self._said: set[str] = set()
        self._lock = threading.Lock()
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self.next_check = 1 if self.policy.first > 0 else self._sampled_next(0)

    # -- the checked call ---------------------------------------------------------------------------------
    def checked_call(self, args: list[Any]) -> Any:
        """Run one call with a shadow check (or route it to the original once uninstalled)."""
        if self.failed:
            return self.original(args)
        if not self._lock.acquire(blocking=False):
            return self.unchecked(args)  # another thread is checking this graph right now
        try:
            return self._check(args)
        finally:
            self._lock.release()

    def unchecked(self, args: list[Any]) -> Any:
        """An unchecked call outside the verified entry's fast path (a check skipped or running in another thread)."""
        if self.watch is not None and self.watch.records:  # refused outside its calls: not run again
            return self.refused_between_calls(args)
        stacks = modes.depths() if self.snapshot is not None else (0, 0)
        try:
            outputs = self._run(args)
        except Exception as exc:
            if not self.unchecked_failure(exc, args):
                raise
            return self.original(args)
        if self.watch is not None and self.watch.records:
            return self.unchecked_refused(outputs, args)
        if self.snapshot is not None and modes.depths() != stacks:
            return self.unchecked_modes(stacks, outputs, args)
        return outputs

    def _run(self, args: list[Any], measure: bool = False) -> Any:
        """The installed wrapper on ``args``, with this thread armed for its audit watch (``measure``: returns
        ``(outputs, hidden-reference counts)``, :func:`tilesmith.gate.retained.call_measured`)."""
        call = (lambda a: retained.call_measured(self.fn, a) if self.measure_refs else (self.fn(a), None)) \
            if measure else self.fn
        if self.watch is None:
            return call(args)
        previous = audit.LOCAL.watch
        audit.LOCAL.watch = self.watch
        try:
            return call(args)
        finally:
            audit.LOCAL.watch = previous

    def _check(self, args: list[Any]) -> Any:
        n = self.calls
        started = time.perf_counter()
        self._note_spacing(n, started)
        try:
            skip = self._skip_reason(args)
            shadow = None if skip else self._shadow(args)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the copies: skip this check
            skip, shadow = ("prepare", f"preparing the check failed ({type(exc).__name__}: {exc})"), None
        if shadow is None:
            self.skipped += 1
            self._say("verification_skipped", f"graph {self.label}: a production check was skipped on call {n} "
                      f"since install: {skip[1]}. The installed wrapper served the call unchecked (reported once "
                      "per reason).", skip[0])
            self._reschedule(n, None, None)
            return self.unchecked(args)
        if self.snapshot is not None:  # the state policy: also what changes while only the wrapper runs
            shadow.window = StateWindow(str(self.device), self.snapshot.classes.containers)
        before = self.leaks.before() if self.leaks is not None else None
        t0 = time.perf_counter()
        try:
            with Stopwatch(self.device) as watch:
                outputs, held = self._run(args, measure=True)
            self._sync()
        except Exception as exc:  # noqa: BLE001 - the wrapper's failure, not the user's
            refused = self.watch.summary() if self.watch is not None else None
            if refused is not None:
                return self._fail(n, shadow, None, _Problem(*refused))
            if is_oom(exc):
                self.skipped += 1
                self._say("verification_skipped", f"graph {self.label}: the installed wrapper ran out of memory "
                          f"on checked call {n} (the check's copies use memory too); this call returned the "
                          "original's outputs.", "oom")
                self._reschedule(n, None, None)
                return self._serve_original(shadow, None)
            return self._fail(n, shadow, None, _Problem("crash", f"the installed wrapper raised "
                                                                 f"{type(exc).__name__}: {exc}"))
        call_s = time.perf_counter() - t0
        try:
            if self.leaks is not None:
                self.leaks.after(before, outputs, shadow.real)
            if self.retime is not None:
                self.retime.add(shadow.original_s, watch.seconds())
            problem = self._judge(n, shadow, outputs, held)
        except Exception as exc:  # noqa: BLE001 - a bug in the check must not reach the user
            return self._internal(n, shadow, exc)
        if problem is not None:
            return self._fail(n, shadow, outputs, problem)
        self.checks += 1
        self._reschedule(n, time.perf_counter() - started - call_s, call_s)
        return outputs

    def _skip_reason(self, args: list[Any]) -> tuple[str, str] | None:
        """``(category, text)`` when this call cannot be checked, else ``None``."""
        if self.device.type != "cuda":
            return None
        if torch.cuda.is_current_stream_capturing():
            return "capture", "a CUDA graph is being captured on the current stream (a check synchronizes)"
        need = 2 * sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if need > free + cached:
            return "memory", (f"the input copies and outputs need about {need / 2**20:.0f} MiB and only "
                              f"{(free + cached) / 2**20:.0f} MiB of device memory is free")
        return None

    def _shadow(self, args: list[Any]) -> _Shadow:
        real = list(args)
        shadow = _Shadow(real, [_copy(a) for a in real])
        shadow.pre_rng = rng_state(self.device)
        try:
            with Stopwatch(self.device) as watch:
                if self.measure_refs:
                    shadow.outputs, shadow.held = retained.call_measured(self.original, list(shadow.copies))
                else:
                    shadow.outputs = self.original(list(shadow.copies))
        except BaseException:
            rng_restore(shadow.pre_rng, self.device)  # the wrapper then serves the call unchecked
            raise
        shadow.post_rng = rng_state(self.device)
        if not rng_equal(shadow.pre_rng, shadow.post_rng):
            rng_restore(shadow.pre_rng, self.device)  # the wrapper draws the same numbers as the original did
        self._sync()
        shadow.original_s = watch.seconds()
        return shadow

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # -- judging ------------------------------------------------------------------------------------------
    def _judge(self, n: int, shadow: _Shadow, outputs: Any, held: Any = None) -> _Problem | None:
        where = f"production call {n} since install"
        refused = self.watch.summary() if self.watch is not None else None
        if refused is not None:
            return _Problem(*refused)  # the wrapper went on after its PermissionError: the event counts first
        with torch.no_grad():
            expected = shadow.outputs
            structure = compare_structure(output_facts(expected, shadow.copies), output_facts(outputs, shadow.real),
                                          where=where, variant=None)
            if structure:
                return _Problem(structure[0].check, structure[0].message)
            found = retained.hidden(held, shadow.held)
            if found:
                return _Problem("output_retained", retained.message(found, where))
            noise: list[Any] | None = None
            for i, (e, g) in enumerate(zip(expected, outputs)):
                if not isinstance(e, torch.Tensor) or torch.equal(e, g):
                    continue  # bitwise equal (and NaN-free) passes every tolerance: one pass instead of ~20
                failure = compare_output(i, e, g, variant="production", tf32=self.tf32, poison_byte=None,
                                         others={}, where=where)
                if failure is None:
                    continue
                if failure.check in ("value_mismatch", "precision_loss") and e.is_floating_point() \
                        and not self.mutated:
                    noise = self._noise(shadow) if noise is None else noise
                    if noise[i] is not None and check_values(e, g, tolerance_for(e.dtype, self.tf32), None,
                                                             False, noise[i]) is None:
                        continue
                    failure_text = failure.message + (" It also exceeds the original's own rounding sensitivity "
                                                      "on these inputs (measured with inputs perturbed by "
                                                      f"{PERTURB_ULPS} ulps, ×16).")
                else:
                    failure_text = failure.message
                return _Problem(failure.check, failure_text)
            written = self._inputs_problem(shadow)
            if written is not None:
                return written
        changed = shadow.window.changes() if shadow.window is not None else []
        if changed:
            shadow.window.restore()
            return _Problem("global_state", f"process-global state changed while only the installed wrapper ran "
                                            f"(checked call {n}): {'; '.join(changed[:6])}; put back where it has "
                                            "a setter. (TILESMITH_VERIFY=...,state=off turns this check off.)")
        if not rng_equal(rng_state(self.device), shadow.post_rng):
            return _Problem("rng_state", "the random-number generator state after the installed wrapper differs "
                                         "from the state after the original on the same starting state: it "
                                         "draws different random numbers or a different amount of them")
        if self.census is not None:
            threads = self.census.unexplained(self.wrapper_files)
            if threads:
                return _Problem("thread_count", f"{len(threads)} new OS thread(s) since install "
                                                f"({len(self.census.baseline)} at install): " + "; ".join(threads[:4]))
        if self.snapshot is not None:
            changed = self.snapshot.changes()
            if changed:
                return _Problem("global_state", f"{len(changed)} process-global attribute(s) or setting(s) differ "
                                f"from their state before the wrapper was imported: {'; '.join(changed[:6])}. "
                                "(If your own code changed them after tilesmith.compile, set them before it or turn "
                                "this check off with TILESMITH_VERIFY=...,state=off.)")
        found = audit.pool_problem(self.pool_base, f"checked call {n}") if self.watch is not None else None
        if found is not None:
            return _Problem(*found)
        leak = self.leaks.problem(n, outputs, shadow.real) if self.leaks is not None else None
        if leak:
            return _Problem("memory_leak", leak)
        slow = self.retime.problem() if self.retime is not None else None
        return _Problem("slower_in_production", slow) if slow else None

    def _inputs_problem(self, shadow: _Shadow) -> _Problem | None:
        for j, (r, c) in enumerate(zip(shadow.real, shadow.copies)):
            if not isinstance(r, torch.Tensor) or not isinstance(c, torch.Tensor) or r is c:
                continue
            if j in self.mutated:
                report = check_values(c, r, tolerance_for(c.dtype, self.tf32))
                if report is not None:
                    return _Problem("input_mutation", f"input {j} ({str(c.dtype).removeprefix('torch.')} "
                                    f"{list(c.shape)}), which the graph writes in place, holds other values than "
                                    f"the original writes: {report.count} of {report.total} elements differ, first "
                                    f"at {list(report.worst_index)}: expected {report.expected}, got {report.got} "
                                    f"({report.detail})")
            elif not same_bits(r, c):
                return _Problem("input_mutated", f"input {j} ({str(c.dtype).removeprefix('torch.')} "
                                f"{list(c.shape)}) was changed by the installed wrapper; the original only reads it")
        return None

    def _noise(self, shadow: _Shadow) -> list[Any]:
        """``|original(perturbed inputs) − original(inputs)|`` per output (``None`` where not computable)."""
        inputs = [perturbed(c) for c in shadow.copies]
        now = rng_state(self.device)
        rng_restore(shadow.pre_rng, self.device)
        try:
            again = self.original(inputs)
        finally:
            rng_restore(now, self.device)
        return [(a.double() - e.double()).abs() if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor)
                and a.shape == e.shape and e.is_floating_point() else None for e, a in zip(shadow.outputs, again)]
