"""The correctness protocol: which calls the worker makes, and how the host judges what it reports.

One check request runs these steps in the candidate's worker (``cand`` = candidate, ``orig`` = the
original wrapper loaded in the same worker; every call gets fresh guarded inputs unless noted):

==  =============================================================  ===========================================
#   step                                                           exposes
==  =============================================================  ===========================================
1   poison the allocator, ``cand(normal)``; outputs held            uninitialized / stale-reference memory
2   same input buffers refilled in place, ``cand(random)``           caches keyed on pointers or shapes;
                                                                    outputs sharing storage across calls
3   ``orig(normal)`` after the candidate (same seed as 1)           RNG consumption differing from the original
4   ``orig(zero)`` then 5 ``cand(zero)`` (reference first)           both orders; skip-work-on-zero shortcuts
6   poison the allocator, ``cand(high_magnitude)``                   overflow, lower precision
7,8 ``cand(random_b)`` twice on identical inputs                     nondeterministic races
end outputs of step 1 saved after all later calls                   outputs overwritten by later calls
==  =============================================================  ===========================================

Every candidate step also reports: output types/layouts/aliasing, inputs whose bytes changed (inside or
outside their logical elements), writes past the end of any buffer the wrapper allocated, outputs that
changed after ``call`` returned (work left on another stream or thread), new threads, global-state and
function-identity changes. The host compares every saved output with its own reference outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tilesmith.gate.compare import compare_output, compare_structure, passes, tolerance_for
from tilesmith.gate.protocol import POISON_BYTES
from tilesmith.gate.reference import OutputTooLarge, RefResult, load_outputs
from tilesmith.records import CheckFailure

P0, P1 = POISON_BYTES


@dataclass
class Plan:
    steps: list[dict[str, Any]]
    save_held: dict[str, str]
    #: (reference key, variant name, save path, poison byte, where-text) for every saved output file
    compared: list[tuple[str, str, str, int, str]] = field(default_factory=list)
    #: (candidate step, original step, variant): same inputs and seed, so RNG states must agree after
    rng_pairs: list[tuple[int, int, str]] = field(default_factory=list)
    determinism: tuple[str, str] | None = None


def build_plan(files: dict[str, Path], out_dir: Path, seeds: dict[str, int], tag: str) -> Plan:
    """The step list above for variant files ``files`` (``normal``, ``random``, ``random_b`` and, when
    their reference could be computed, ``zero`` and ``high_magnitude``). Every step carries ``ref`` (the
    key of its reference in :class:`CheckContext.refs`) and ``variant`` (the name reports use)."""
    def out(name: str) -> str:
        return str(out_dir / f"{tag}_{name}.pt")

    def step(label: str, module: str, ref: str, **extra: Any) -> dict[str, Any]:
        variant = "random" if ref == "random_b" else ref
        return {"label": label, "module": module, "inputs": str(files[ref]), "seed": seeds[ref], "ref": ref,
                "variant": variant, **extra}

    plan = Plan([], {"first": out("first")})
    plan.compared.append(("normal", "normal", out("first"), P0, "first call's outputs, read after every later call"))
    plan.steps.append(step("first call on freshly poisoned memory", "cand", "normal", poison=True, poison_byte=P0,
                           keep_inputs_as="A", hold_as="first"))
    plan.steps.append(step("second call with the same input buffers refilled", "cand", "random", refresh="A",
                           poison_byte=P1, save=out("random"), compare_storage_with=["first"]))
    plan.compared.append(("random", "random", out("random"), P1, "second call, same input buffers refilled in place"))
    plan.steps.append(step("original wrapper after the candidate", "orig", "normal", guard_allocations=False))
    plan.rng_pairs.append((0, 2, "normal"))
    if "zero" in files:
        plan.steps.append(step("original wrapper before the candidate", "orig", "zero", guard_allocations=False))
        plan.steps.append(step("candidate right after the original", "cand", "zero", poison_byte=P0,
                               save=out("zero")))
        plan.rng_pairs.append((len(plan.steps) - 1, len(plan.steps) - 2, "zero"))
        plan.compared.append(("zero", "zero", out("zero"), P0, "called right after the original"))
    if "high_magnitude" in files:
        plan.steps.append(step("call on high-magnitude inputs, freshly poisoned memory", "cand", "high_magnitude",
                               poison=True, poison_byte=P1, save=out("high")))
        plan.compared.append(("high_magnitude", "high_magnitude", out("high"), P1, "freshly poisoned memory"))
    plan.steps.append(step("determinism run 1", "cand", "random_b", poison_byte=P0, save=out("rb1")))
    plan.steps.append(step("determinism run 2 (identical inputs)", "cand", "random_b", poison_byte=P1,
                           save=out("rb2")))
    plan.compared += [("random_b", "random", out("rb1"), P0, "determinism run 1"),
                      ("random_b", "random", out("rb2"), P1, "determinism run 2")]
    plan.determinism = (out("rb1"), out("rb2"))
    return plan


@dataclass
class CheckContext:
    refs: dict[str, RefResult]
    """Reference per variant name; ``random`` entries for determinism runs use key ``random_b``."""
    mutated_input_idxs: tuple[int, ...]
    tf32: bool

    @property
    def clobbered_idxs(self) -> frozenset[int]:
        """Inputs the original itself overwrites as dead scratch memory (see ``RefResult.clobbered``)."""
        return frozenset(i for ref in self.refs.values() for i in ref.clobbered)


def step_failures(facts: dict[str, Any], ref: RefResult | None, ctx: CheckContext, where: str,
                  variant: str | None) -> list[CheckFailure]:
    """Failures visible in one candidate step's facts (structure, inputs, guards, threads, state)."""
    fails: list[CheckFailure] = []
    if "error" in facts:
        err = facts["error"]
        check = "oom" if err.get("oom") else "exception"
        tail = err.get("traceback", "").strip().splitlines()[-6:]
        fails.append(CheckFailure(check, f"call raised {err.get('type')}: {err.get('message', '')[:600]} ({where}). "
                                         f"Traceback tail (worker): {' | '.join(tail)[:800]}", variant=variant))
    if ref is not None and facts.get("outputs"):
        fails += compare_structure(ref.facts, facts["outputs"], where=where, variant=variant)
    for change in facts.get("inputs_changed", []):
        i = change["index"]
        if change.get("in_view") and i not in ctx.mutated_input_idxs and i not in ctx.clobbered_idxs:
            fails.append(CheckFailure("input_mutated", f"input {i} was modified by the call ({where}); the original "
                                                       f"leaves it unchanged. Write results to new buffers.",
                                      input_index=i, variant=variant))
        if change.get("outside_view"):
            fails.append(CheckFailure("out_of_bounds_write", f"bytes of input {i}'s storage outside its elements "
                                                             f"(offset prefix, stride gaps or past its end) were "
                                                             f"written ({where}); check kernel bounds/masks.",
                                      input_index=i, variant=variant))
    for hit in facts.get("guard_violations", []):
        owner = hit.get("output_index")
        fails.append(CheckFailure("out_of_bounds_write",
                                  f"a kernel wrote past the end of a {hit['dtype'].removeprefix('torch.')} "
                                  f"buffer of shape {hit['shape']} allocated by the wrapper"
                                  f"{f' (output {owner})' if owner is not None else ''} ({where}); fix the kernel's "
                                  f"bounds or masks.", output_index=owner, variant=variant))
    for i in facts.get("async_changed", []):
        fails.append(CheckFailure("async_after_return",
                                  f"output {i} changed after call returned ({where}): work was still running on "
                                  f"another stream or thread. All work must be complete (or ordered on the "
                                  f"current stream) when call returns.", output_index=i, variant=variant))
    fails += global_failures(facts, where)
    for other, count in facts.get("shares_storage_with", {}).items():
        if count:
            fails.append(CheckFailure("output_storage_shared",
                                      f"outputs of this call share storage with the outputs of the {other} call "
                                      f"({where}): every call must return new buffers the caller owns "
                                      f"(a static output buffer is overwritten by the next call).", variant=variant))
    if facts.get("lifetime_changed"):
        fails.append(CheckFailure("output_lifetime",
                                  f"outputs {facts['lifetime_changed']} of the first call changed during later calls: "
                                  f"the candidate reuses output memory the caller still holds.",
                                  output_index=facts["lifetime_changed"][0]))
    if facts.get("save_refused") and not any(f.check in _STRUCTURAL for f in fails):
        fails.append(CheckFailure("output_type", f"outputs rejected before transfer ({where}): "
                                                 f"{facts['save_refused']}", variant=variant))
    return fails


_STRUCTURAL = {"output_count", "output_type", "shape_mismatch", "dtype_mismatch", "exception", "oom"}


def global_failures(facts: dict[str, Any], where: str) -> list[CheckFailure]:
    """Threads, global state, current stream and replaced functions, from any worker answer."""
    fails: list[CheckFailure] = []
    if facts.get("threads_new"):
        fails.append(CheckFailure("background_thread",
                                  f"new threads alive after {where}: {', '.join(facts['threads_new'][:4])}. "
                                  f"A wrapper must not start threads."))
    changes = dict(facts.get("state_changes", {}))
    stream = {k: v for k, v in changes.items() if k.startswith(("cuda.current_stream", "cuda.current_device"))}
    other = {k: v for k, v in changes.items() if k not in stream}
    if stream:
        fails.append(CheckFailure("stream_state", f"{where} changed the current CUDA stream/device "
                                                  f"({_fmt_changes(stream)}); restore it (use "
                                                  f"`with torch.cuda.stream(s)`)."))
    if other:
        fails.append(CheckFailure("global_state", f"{where} changed process-global settings: {_fmt_changes(other)}. "
                                                  f"Leave the user's numeric and runtime flags unchanged."))
    if facts.get("identity_changes"):
        names = facts["identity_changes"]
        fails.append(CheckFailure("monkeypatch", f"{where} replaced {len(names)} function(s) or class attribute(s): "
                                                 f"{', '.join(names[:6])}. Do not patch torch, triton, time or the "
                                                 f"harness."))
    return fails


def _fmt_changes(changes: dict[str, list[Any]]) -> str:
    return ", ".join(f"{k}: {a!r} → {b!r}" for k, (a, b) in list(changes.items())[:6])


def interpret(plan: Plan, answer: dict[str, Any], ctx: CheckContext, expected_bytes: int) -> list[CheckFailure]:
    """All failures of one check request: step facts, RNG, then saved outputs against the references."""
    steps = answer.get("steps", [])
    fails: list[CheckFailure] = []
    if not answer.get("ok", False):
        err = answer.get("error", {})
        tail = " | ".join(str(err.get("traceback", "")).strip().splitlines()[-6:])[:1200]
        return [CheckFailure("exception", f"the correctness checks failed in the worker: {err.get('type')}: "
                                          f"{str(err.get('message', ''))[:600]}. Traceback tail (worker): {tail}")]
    for i, facts in enumerate(steps):
        if facts.get("held"):
            fails += step_failures(facts, None, ctx, "first call", "normal")
            continue
        if facts.get("module") != "cand":
            if "error" in facts:  # the original failing in the candidate's worker: the candidate broke the process
                fails.append(CheckFailure("exception", f"the original wrapper failed in the same worker after the "
                                                       f"candidate ran: {facts['error'].get('message', '')[:400]}"))
            continue
        planned = plan.steps[i] if i < len(plan.steps) else {}
        ref = ctx.refs.get(planned.get("ref", "normal"))
        fails += step_failures(facts, ref, ctx, str(facts.get("label")), planned.get("variant"))
    for a, b, variant in plan.rng_pairs:
        if a < len(steps) and b < len(steps) and "rng" in steps[a] and "rng" in steps[b] \
                and steps[a]["rng"] != steps[b]["rng"]:
            fails.append(CheckFailure("rng_state", f"after a call on the '{variant}' inputs with the same seed, the "
                                                   f"candidate leaves the random generators in a different state "
                                                   f"than the original (reseeding or extra random draws).",
                                      variant=variant))
    if answer.get("fatal") or any(f.check in _STRUCTURAL for f in fails):
        return _dedupe(fails)
    fails += _compare_saved(plan, ctx, expected_bytes)
    return _dedupe(fails)


def _compare_saved(plan: Plan, ctx: CheckContext, expected_bytes: int) -> list[CheckFailure]:
    fails: list[CheckFailure] = []
    loaded: dict[str, list[Any]] = {}
    for key, variant, path, poison, where in plan.compared:
        ref = ctx.refs[key]
        try:
            data = load_outputs(Path(path), expected_bytes, len(ref.outputs) + len(ctx.mutated_input_idxs))
        except OutputTooLarge as exc:
            fails.append(CheckFailure("output_too_large", f"{exc} ({where})", variant=variant))
            continue
        except Exception as exc:  # noqa: BLE001 - missing or malformed file: structural failure already reported
            fails.append(CheckFailure("protocol", f"outputs of '{where}' could not be read: {exc}", variant=variant))
            continue
        loaded[path] = data["outputs"]
        others = {k: r for k, r in ctx.refs.items() if k != key}
        for i, (expected, got) in enumerate(zip(ref.outputs, data["outputs"])):
            if isinstance(expected, torch.Tensor) and (got is None or got.shape != expected.shape
                                                       or got.dtype != expected.dtype):
                continue  # structure failures come from the step facts
            if "after every later call" in where and _aliases_input(ref.facts[i]):
                continue  # a returned input was refilled by the next call; its identity is checked structurally
            other_vals = {k: r.outputs[i] for k, r in others.items() if i < len(r.outputs)}
            failure = compare_output(i, expected, got if isinstance(expected, torch.Tensor) else expected,
                                     variant=variant, tf32=ctx.tf32, poison_byte=poison, others=other_vals, where=where)
            if failure is not None:
                fails.append(failure)
        for idx, value in data.get("mutated_inputs", []):
            expected = ref.mutated.get(int(idx))
            if expected is not None and not passes(expected, value, tolerance_for(expected.dtype, ctx.tf32)):
                fails.append(CheckFailure("input_mutation_mismatch",
                                          f"input {idx} is mutated by the original; the candidate's final value "
                                          f"differs ({where})", input_index=int(idx), variant=variant))
    if plan.determinism and all(p in loaded for p in plan.determinism):
        first, second = (loaded[p] for p in plan.determinism)
        for i, (x, y) in enumerate(zip(first, second)):
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and \
                    not passes(x, y, tolerance_for(x.dtype, ctx.tf32)):
                fails.append(CheckFailure("nondeterministic",
                                          f"output {i}: two calls on identical inputs returned results that differ "
                                          f"beyond tolerance (a race between threads, blocks or streams).",
                                          output_index=i, variant="random"))
    return fails


def _aliases_input(fact: dict[str, Any]) -> bool:
    return fact.get("input_identity") is not None or fact.get("input_storage") is not None


def _dedupe(fails: list[CheckFailure]) -> list[CheckFailure]:
    seen: set[tuple[Any, ...]] = set()
    out = []
    for f in fails:
        key = (f.check, f.output_index, f.input_index)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out
