"""What production verification does when an installed wrapper fails (:mod:`tilesmith.install.verify`).

:class:`Failure` is the part of :class:`tilesmith.install.verify.Verifier` that acts on a verdict: on a failed
checked call it serves the original's outputs (the caller's inputs and RNG states put back as the original leaves
them, a state window the wrapper changed restored), uninstalls the graph and its identical twins, quarantines the
artifact (:mod:`tilesmith.install.quarantine`) and records the diagnostic with its remedy (:data:`REMEDY`); on an
*unchecked* call it handles what the verified entry's fast path notices — an exception, an event the audit hook
refused during the call or outside it, a torch mode left pushed. :class:`Problem` (a verdict) and :class:`Shadow`
(one checked call's copies, RNG states and the original's outputs) are shared with the checking code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from tilesmith.gate import modes
from tilesmith.gate.window import StateWindow
from tilesmith.install.quarantine import quarantine
from tilesmith.install.shadow import is_oom, rng_restore, same_bits, to_caller
from tilesmith.records import GraphState

log = logging.getLogger("tilesmith")

REMEDY = {
    "thread_count": " If these threads are your program's own, set TILESMITH_VERIFY=threads=off "
                    "(docs/verification.md).",
    "audit": " If the refused event was your program's own (a finalizer or signal handler that ran during the "
             "wrapper's call), set TILESMITH_VERIFY=...,audit=off (docs/verification.md).",
    "compile_pool": " (TILESMITH_VERIFY=...,audit=off turns this check off.)",
    "output_retained": " (TILESMITH_VERIFY=...,retained=off turns this check off.)",
    "slower_in_production": " Both ran on the same inputs at the same moment; if this machine's load favours the "
                            "original, TILESMITH_VERIFY=...,retime=off turns this check off.",
    "memory_leak": " If your own threads allocate heavily while compiled code runs, set TILESMITH_VERIFY=...,"
                   "memory=off (docs/verification.md).",
}
"""The sentence added to a failure's diagnostic, per check (``audit`` for every ``audit_*`` check)."""


@dataclass
class Problem:
    """What a check found: the check's name (a diagnostic's ``check``) and the sentence that says what differed."""

    check: str
    detail: str


class Shadow:
    """One checked call's copies, RNG states and the original's outputs."""

    __slots__ = ("real", "copies", "pre_rng", "post_rng", "outputs", "window", "held", "original_s")

    def __init__(self, real: list[Any], copies: list[Any]):
        self.real, self.copies = real, copies
        self.pre_rng: Any = None
        self.post_rng: Any = None
        self.outputs: Any = None
        self.window: StateWindow | None = None
        self.held: Any = None  # the original's hidden-reference counts (tilesmith.gate.retained)
        self.original_s = 0.0


class Failure:
    """Mixin of :class:`tilesmith.install.verify.Verifier`: needs ``run``, ``handle``, ``track``, ``original``,
    ``source``, ``key``, ``label``, ``graph_name``, ``device``, ``mutated``, ``watch``, ``calls``, ``checks``,
    ``failed``, ``next_check`` and ``_said`` (a set of the skip reasons already reported)."""

    run: Any
    handle: Any
    track: Any
    original: Any
    source: str
    key: str
    label: str
    graph_name: str
    device: torch.device
    mutated: tuple[int, ...]
    watch: Any
    calls: int
    checks: int
    failed: bool
    next_check: int
    _said: set[str]

    def unchecked_failure(self, exc: Exception, args: list[Any]) -> bool:
        """The installed wrapper raised on an unchecked call: uninstall it (unless out of memory, which the
        original would likely hit too; an event the audit refused counts first, the exception is then usually its
        ``PermissionError``). True when the call can be served by the original instead (the argument list was not
        consumed yet); else the caller re-raises."""
        refused = self.watch.summary() if self.watch is not None else None
        if self.failed or (refused is None and is_oom(exc)):
            return False
        self._uninstall_logged(self.calls, Problem(*refused) if refused else Problem(
            "crash", f"the installed wrapper raised {type(exc).__name__}: {exc} on an unchecked call"))
        return bool(args)

    def unchecked_refused(self, outputs: Any, args: list[Any]) -> Any:
        """The audit refused an event of the wrapper's on an unchecked call and the wrapper returned anyway (it
        caught the ``PermissionError``): uninstall it; the original serves the call if the argument list is intact,
        else the wrapper's outputs are returned (unjudged, as on any unchecked call; the side effect did not happen)."""
        if not self.failed:
            self._uninstall_logged(self.calls, Problem(*self.watch.summary()))  # type: ignore[union-attr, misc]
        return self.original(args) if args else outputs

    def unchecked_modes(self, depths: tuple[int, int], outputs: Any, args: list[Any]) -> Any:
        """The wrapper's unchecked call changed the thread's mode-stack depths (R4: a dispatch mode left pushed makes
        every later call, the original's shadow included, wrong alike): pop what it pushed, uninstall and quarantine;
        the original serves the call if the argument list is intact."""
        done, n = "; ".join(modes.pop_to(depths)), self.calls
        if not self.failed:
            self._uninstall_logged(n, Problem("global_state", f"the installed wrapper changed this thread's torch mode "
                                              f"stacks on unchecked call {n} (depths {depths} before it): {done}"))
        return self.original(args) if args else outputs

    def refused_between_calls(self, args: list[Any]) -> Any:
        """The audit refused code of the wrapper's that ran outside its calls (on another thread, a hook it registered):
        uninstall it before it runs again; the original serves this call."""
        if not self.failed:
            self._uninstall_logged(self.calls, Problem(*self.watch.summary()))  # type: ignore[union-attr, misc]
        return self.original(args)

    def _uninstall_logged(self, n: int, problem: Problem, *, quarantine: bool = True) -> None:
        try:
            self.uninstall(n, problem, quarantine=quarantine)
        except Exception:  # noqa: BLE001 - the user's call goes on
            try:
                log.exception("tilesmith: uninstalling graph %s failed", self.label)
            except Exception:  # noqa: BLE001 - a logging handler the wrapper attached
                pass

    # -- failure ------------------------------------------------------------------------------------------
    def _serve_original(self, shadow: Shadow, outputs: Any) -> Any:
        """The original's outputs for this call, with the caller's inputs and RNG states as the original leaves
        them."""
        with torch.no_grad():
            for j, (r, c) in enumerate(zip(shadow.real, shadow.copies)):
                if isinstance(r, torch.Tensor) and isinstance(c, torch.Tensor) and r is not c and \
                        (j in self.mutated or not same_bits(r, c)):
                    try:
                        r.copy_(c)
                    except RuntimeError:  # e.g. an expanded (overlapping) input
                        log.warning("tilesmith: could not restore input %d of graph %s", j, self.label)
        rng_restore(shadow.post_rng, self.device)
        result = [to_caller(o, shadow) for o in shadow.outputs]
        return type(shadow.outputs)(result) if isinstance(shadow.outputs, tuple) else result

    def _fail(self, n: int, shadow: Shadow, outputs: Any, problem: Problem) -> Any:
        if shadow.window is not None and problem.check != "global_state":
            shadow.window.restore()  # a mode the wrapper pushed must not outlive it, whatever failed first
        result = self._serve_original(shadow, outputs)
        self._uninstall_logged(n, problem)  # the user's call still gets the original's outputs
        return result

    def uninstall(self, n: int, problem: Problem, *, quarantine: bool = True) -> None:
        """Put the original back for this graph and its twins, quarantine the artifact, record the diagnostic
        (``verification_error`` instead of ``verification_failed`` when ``quarantine`` is False: a fault of the
        check itself)."""
        from tilesmith.install.loader import swap
        from tilesmith.install.verify import verifier_of

        self.failed, self.next_check = True, 0
        run = self.run
        for h in list(getattr(run, "handles", [])) or [self.handle]:
            other = verifier_of(h)
            if h is self.handle or (h.key == self.key and other is not None and other.source == self.source):
                swap(h.compiled, h.original)
                h.state = GraphState.UNINSTALLED
                if other is not None:
                    other.failed, other.next_check = True, 0
        with run.lock:
            run.benchmarks[:] = [b for b in run.benchmarks if b.graph_key != self.key]
        if quarantine:
            where = self._quarantine(n, problem)
            remedy = REMEDY.get("audit" if problem.check.startswith("audit_") else problem.check, "")
            kind, head = "verification_failed", f"production verification failed on call {n} since install"
        else:
            kind, head = "verification_error", f"the production check of call {n} since install failed inside Tilesmith"
            where, remedy = "The artifact is not quarantined.", " Please report this with the run folder."
        message = (f"graph {self.label}: {head} ({problem.check}: {problem.detail}). The graph is uninstalled: this "
                   f"call returned the original Inductor wrapper's outputs and every later call runs on Inductor. "
                   f"{where}{remedy}")
        run.diagnose(kind, message, self.key, self.graph_name)
        if self.track is not None:
            self.track.update(status="uninstalled", verification={
                "failed_call": n, "check": problem.check, "detail": problem.detail, "checks_passed": self.checks})
        try:  # last: a logging handler the wrapper attached may raise (the audit refuses what it does)
            log.warning("tilesmith: %s", message)
        except Exception:  # noqa: BLE001
            pass

    def _quarantine(self, n: int, problem: Problem) -> str:
        return quarantine(self.run, self.key, self.source, self.graph_name,
                          f"production call {n}: {problem.check}: {problem.detail}")

    # -- diagnostics --------------------------------------------------------------------------------------
    def _say(self, kind: str, message: str, reason: str) -> None:
        if reason in self._said:
            return
        self._said.add(reason)
        try:
            self.run.diagnose(kind, message, self.key, self.graph_name)
        except Exception:  # noqa: BLE001
            log.debug("tilesmith: could not record %s", kind, exc_info=True)

    def _internal(self, n: int, shadow: Shadow, exc: BaseException) -> Any:
        """Judging failed inside Tilesmith: the outputs are unjudged, so the call gets the original's (correct by
        construction) and the graph runs on Inductor from now on; the artifact is not quarantined."""
        try:
            log.exception("tilesmith: production check of graph %s failed internally", self.label)
        except Exception:  # noqa: BLE001 - a logging handler the wrapper attached
            pass
        result = self._serve_original(shadow, None)
        self._uninstall_logged(n, Problem("internal_error", f"{type(exc).__name__}: {exc}"), quarantine=False)
        return result
