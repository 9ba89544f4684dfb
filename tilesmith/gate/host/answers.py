"""The one place the host reads a worker's answer for failures: audit records, threads and processes, global
state, replaced functions (every worker answer may carry them, whatever the request was).

:func:`failures_from_answer` turns the worker audit hook's records (:mod:`tilesmith.gate.worker.audit`) into
``audit_*`` failures, :func:`global_failures` the global facts (``threads_new``, ``state_changes``,
``identity_changes``, ``pool_work``) and :func:`answer_failures` does both. Worker-reported text is quoted with
:func:`tilesmith.gate.host.process.untrusted_text` before it reaches a message.
"""

from __future__ import annotations

from typing import Any

from tilesmith.gate.host.process import untrusted_text
from tilesmith.gate.protocol import AUDIT_CHECKS, OUTSIDE_CLOCK
from tilesmith.records import CheckFailure

_REMEDY = {
    "audit_introspection": "A wrapper must not inspect frames, the garbage collector, tracing hooks or code objects, "
                           "nor create code at run time.",
    "audit_file_write": "A wrapper may write only through Inductor into the worker's own cache, never elsewhere and "
                        "never over the original's files.",
    "audit_file_read": "A wrapper must not read files outside the Python installation and its own cache.",
    "audit_process": "A wrapper must not start, signal or re-environment processes (Inductor's own compiler runs "
                     "are allowed).",
    "audit_network": "A wrapper must not use the network.",
    "audit_native": "A wrapper must not use ctypes or mmap.",
}


def _collect(answer: Any, out: list[Any], key: str = "audit", kind: type = dict) -> None:
    if isinstance(answer, dict):
        records = answer.get(key)
        if isinstance(records, list):
            out.extend(r for r in records if isinstance(r, kind))
        for inner in ("facts", "steps"):
            _collect(answer.get(inner), out, key, kind)
    elif isinstance(answer, list):
        for item in answer:
            _collect(item, out, key, kind)


def import_failures(answer: Any, where: str) -> list[CheckFailure]:
    """One ``import_not_allowed`` failure for the imports the worker's guard refused anywhere in ``answer``
    (:mod:`tilesmith.gate.worker.imports`; module names are candidate text, quoted)."""
    refused: list[str] = []
    _collect(answer, refused, "imports_refused", str)
    refused = list(dict.fromkeys(refused))
    if not refused:
        return []
    return [CheckFailure("import_not_allowed",
                         f"{where}: the candidate's code imported module(s) that the original wrapper does not import "
                         f"and the gate's allow-list does not hold: "
                         f"{', '.join(untrusted_text(r, 160) for r in refused[:6])}; refused. Import only what the "
                         f"original imports (the same modules, the same names from them) or what the allow-list "
                         f"holds: {ALLOW_TEXT} (docs/gate.md, \"Imports\").")]


#: The worker's allow-list (tilesmith/gate/worker/imports.py ``ALLOWED``/``ALLOWED_NAMES``), as the remedy quotes it.
ALLOW_TEXT = ("torch, torch._inductor.*, torch._C.*, torch._dynamo.testing, torch.profiler, torch.cuda.*, triton.*, "
              "math, cmath, `from tilesmith.kernels.runtime import native_module`")


def failures_from_answer(answer: Any, where: str) -> list[CheckFailure]:
    """CheckFailures (``audit_*``) for every audit record anywhere in a worker answer (facts, steps), and
    ``import_not_allowed`` for refused imports (:func:`import_failures`).

    The detail and the function name come from the candidate's own actions, so they are quoted with
    :func:`tilesmith.gate.host.process.untrusted_text`.
    """
    records: list[dict[str, Any]] = []
    _collect(answer, records)
    fails = import_failures(answer, where)
    seen = set()
    for r in records:
        check = str(r.get("check"))
        if check not in AUDIT_CHECKS:
            continue
        key = (check, str(r.get("detail")))
        if key in seen:
            continue
        seen.add(key)
        event, detail = untrusted_text(r.get("event"), 60), untrusted_text(r.get("detail"), 160)
        fails.append(CheckFailure(check, f"{where}: the candidate's code (line {r.get('line')!s:.8} of the wrapper, "
                                         f"function {untrusted_text(r.get('function'), 60)}) raised the audit event "
                                         f"{event}: {detail}; it was blocked. {_REMEDY[check]}"))
    return fails


def global_failures(facts: dict[str, Any], where: str) -> list[CheckFailure]:
    """Threads, global state, current stream and replaced functions, from any worker answer."""
    fails: list[CheckFailure] = []
    if facts.get("threads_new"):
        fails.append(CheckFailure("background_thread",
                                  f"new threads alive after {where}: {', '.join(facts['threads_new'][:4])}. "
                                  f"A wrapper must not start threads."))
    if facts.get("pool_work"):
        fails.append(CheckFailure("compile_pool", f"work that is not Inductor's runs in Inductor's compile thread pool "
                                                  f"after {where}: {untrusted_text(', '.join(facts['pool_work'][:4]), 300)}."
                                                  f" A wrapper must not submit work to Inductor's (or any) pool."))
    changes = dict(facts.get("state_changes", {}))
    outside = {k[len(OUTSIDE_CLOCK):]: v for k, v in changes.items() if k.startswith(OUTSIDE_CLOCK)}
    changes = {k: v for k, v in changes.items() if not k.startswith(OUTSIDE_CLOCK)}
    if outside:
        fails.append(CheckFailure("outside_clock", f"after {where} the candidate's worker had what could run its code "
                                                   f"between its calls, outside the timed samples: "
                                                   f"{_fmt_changes(outside)}. A wrapper's work happens inside its "
                                                   f"calls: no signal handlers, timers, descriptors that signal on "
                                                   f"I/O, threads that outlive a call, or processes."))
    stream = {k: v for k, v in changes.items() if k.startswith(("cuda.current_stream", "cuda.current_device"))}
    imports = {k: v for k, v in changes.items() if k.startswith(("sys.path", "sys.meta_path"))}
    other = {k: v for k, v in changes.items() if k not in stream and k not in imports}
    if stream:
        fails.append(CheckFailure("stream_state", f"{where} changed the current CUDA stream/device "
                                                  f"({_fmt_changes(stream)}); restore it (use "
                                                  f"`with torch.cuda.stream(s)`)."))
    if other:
        fails.append(CheckFailure("global_state", f"{where} changed process-global settings: {_fmt_changes(other)}. "
                                                  f"Leave the user's numeric and runtime flags unchanged (also "
                                                  f"those without a getter, such as flush-denormal mode, seen by "
                                                  f"their behaviour)."))
    if imports:
        fails.append(CheckFailure("global_state", f"{where} changed the import system: {_fmt_changes(imports)}. "
                                                  f"A wrapper is one file: leave sys.path, sys.meta_path and "
                                                  f"sys.path_hooks unchanged (code imported from elsewhere is not "
                                                  f"what the gate checked)."))
    if facts.get("identity_changes"):
        names = facts["identity_changes"]
        fails.append(CheckFailure("monkeypatch", f"{where} replaced {len(names)} function(s) or attribute(s): "
                                                 f"{', '.join(names[:6])}. Do not patch torch, triton, time, the "
                                                 f"harness or any module or namespace the original wrapper uses "
                                                 f"(extern_kernels, torch.ops, torch.backends)."))
    return fails


def _fmt_changes(changes: dict[str, list[Any]]) -> str:
    return ", ".join(f"{k}: {a!r} → {b!r}" for k, (a, b) in list(changes.items())[:6])


def answer_failures(answer: Any, where: str) -> list[CheckFailure]:
    """Audit failures anywhere in ``answer`` plus its global facts' failures (``where``: what was running)."""
    facts = answer.get("facts", answer) if isinstance(answer, dict) else {}
    return failures_from_answer(answer, where) + global_failures(facts if isinstance(facts, dict) else {}, where)
