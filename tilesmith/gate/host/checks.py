"""The correctness protocol: which calls the candidate's worker makes, and how the host judges what it reports.

One check request runs these steps in the candidate's worker (``cand`` = candidate; the original never runs
in that process: its reference outputs and RNG states come from the trusted worker, on the same inputs made
from the same recipes; every call gets fresh guarded inputs unless noted):

==  =============================================================  ===========================================
#   step                                                           exposes
==  =============================================================  ===========================================
1   poison the allocator, ``cand(normal)``; outputs held            uninitialized / stale-reference memory;
                                                                    RNG consumption (vs the original's state
                                                                    after the same seed, trusted worker)
2   same input buffers refilled in place, ``cand(random)``           caches keyed on pointers or shapes;
                                                                    outputs sharing storage across calls
3   ``cand(zero)``                                                   skip-work-on-zero shortcuts; RNG
4   poison the allocator, ``cand(high_magnitude)``                   overflow, lower precision
5,6 ``cand(random_b)`` twice on identical inputs                     nondeterministic races
7.. ``held_calls`` (≤ 16) more candidate calls, inputs refilled in    a ring of static output buffers (any ring
    the buffers of step 1 from four more ``random`` sets and the     of ≤ 16 slots reuses a held output);
    earlier ones, every call's outputs held                          more draws of integer/boolean/NaN-Inf
                                                                     values
end outputs of step 1 and of every held call saved after all later  outputs overwritten by later calls
    calls, compared with their references
==  =============================================================  ===========================================

The horizon is finite: a candidate that misbehaves only after more calls than the checks and the timing
samples make (a call-count time bomb) cannot be excluded by testing; docs/gate.md lists it as a residual risk.

Every candidate step also reports: output types/layouts/aliasing, inputs whose bytes changed (inside or
outside their logical elements), writes past the end of any buffer the wrapper allocated, outputs that
changed after ``call`` returned (work left on another stream or thread), new threads, global-state and
function-identity changes. The host compares every saved output with the trusted worker's reference outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tilesmith.gate import retained
from tilesmith.gate.host.answers import global_failures
from tilesmith.gate.host.compare import compare_output, compare_structure, passes, tolerance_for
from tilesmith.gate.protocol import POISON_BYTES
from tilesmith.gate.host.reference import OutputTooLarge, RefResult, load_outputs
from tilesmith.records import CheckFailure

P0, P1 = POISON_BYTES

#: Extra candidate calls whose outputs stay held until the end of the check request (step 9..): more than
#: any small ring of static output buffers. The red team's ring had 8 slots against 6 calls (finding 8).
HELD_CALLS = 16
#: Held outputs (and their snapshots) may take at most this many bytes in the worker; graphs with larger
#: outputs get fewer held calls (at least :data:`MIN_HELD_CALLS`).
HELD_BYTES_BUDGET = 8 * 1024 ** 3
MIN_HELD_CALLS = 4
#: More ``random`` input sets (own seeds) the held calls cycle through, so integer/boolean values and moved
#: NaN/±Inf positions are drawn several more times per phase (a shortcut taken only for some draws of a
#: mask or position is caught with high probability).
EXTRA_RANDOM = ("random_c", "random_d", "random_e", "random_f")


def held_calls(output_bytes: int, budget_bytes: int | None = None) -> int:
    """Number of held calls for a graph whose outputs take ``output_bytes`` (each held call keeps its outputs
    and a snapshot of them: 2× that), within ``budget_bytes`` (default :data:`HELD_BYTES_BUDGET`; the gate's
    memory plan passes what the device has free, :mod:`tilesmith.gate.host.memory`), at least
    :data:`MIN_HELD_CALLS`."""
    if output_bytes <= 0:
        return HELD_CALLS
    budget = HELD_BYTES_BUDGET if budget_bytes is None else min(HELD_BYTES_BUDGET, budget_bytes)
    return max(MIN_HELD_CALLS, min(HELD_CALLS, budget // (2 * output_bytes)))


@dataclass
class Plan:
    steps: list[dict[str, Any]]
    save_held: dict[str, str]
    #: (reference key, variant name, save path, poison byte, where-text) for every saved output file
    compared: list[tuple[str, str, str, int, str]] = field(default_factory=list)
    #: (candidate step, reference key, variant): same inputs and seed as that reference run in the trusted
    #: worker, so the generators must be in the same state afterwards
    rng_pairs: list[tuple[int, str, str]] = field(default_factory=list)
    determinism: tuple[str, str] | None = None


def build_plan(recipes: dict[str, dict[str, Any]], out_dir: Path, seeds: dict[str, int], tag: str,
               output_bytes: int = 0, held_budget: int | None = None, poison_budget: int | None = None) -> Plan:
    """The step list above for the input ``recipes`` (``normal``, ``random``, ``random_b``… and, when their
    reference could be computed, ``zero`` and ``high_magnitude``). Every step carries ``ref`` (the key of its
    reference in :class:`CheckContext.refs`) and ``variant`` (the name reports use). ``output_bytes`` (the
    reference outputs' size) and ``held_budget`` bound the number of held calls (:func:`held_calls`);
    ``poison_budget`` bounds the poisoned blocks (bytes)."""
    def out(name: str) -> str:
        return str(out_dir / f"{tag}_{name}.pt")

    def step(label: str, ref: str, **extra: Any) -> dict[str, Any]:
        variant = step_variant(ref)
        return {"label": label, "module": "cand", "inputs": recipes[ref], "seed": seeds[ref], "ref": ref,
                "variant": variant, **({"poison_budget": poison_budget} if poison_budget else {}), **extra}

    plan = Plan([], {"first": out("first")})
    plan.compared.append(("normal", "normal", out("first"), P0, "first call's outputs, read after every later call"))
    plan.steps.append(step("first call on freshly poisoned memory", "normal", poison=True, poison_byte=P0,
                           keep_inputs_as="A", hold_as="first"))
    plan.rng_pairs.append((0, "normal", "normal"))
    plan.steps.append(step("second call with the same input buffers refilled", "random", refresh="A",
                           poison_byte=P1, save=out("random"), compare_storage_with=["first"]))
    plan.compared.append(("random", "random", out("random"), P1, "second call, same input buffers refilled in place"))
    if "zero" in recipes:
        plan.steps.append(step("call on zero inputs", "zero", poison_byte=P0, save=out("zero")))
        plan.rng_pairs.append((len(plan.steps) - 1, "zero", "zero"))
        plan.compared.append(("zero", "zero", out("zero"), P0, "zero inputs"))
    if "high_magnitude" in recipes:
        plan.steps.append(step("call on high-magnitude inputs, freshly poisoned memory", "high_magnitude",
                               poison=True, poison_byte=P1, save=out("high")))
        plan.compared.append(("high_magnitude", "high_magnitude", out("high"), P1, "freshly poisoned memory"))
    plan.steps.append(step("determinism run 1", "random_b", poison_byte=P0, save=out("rb1")))
    plan.steps.append(step("determinism run 2 (identical inputs)", "random_b", poison_byte=P1, save=out("rb2")))
    plan.compared += [("random_b", "random", out("rb1"), P0, "determinism run 1"),
                      ("random_b", "random", out("rb2"), P1, "determinism run 2")]
    plan.determinism = (out("rb1"), out("rb2"))
    cycle = [k for k in (*EXTRA_RANDOM, "random", "random_b", "normal") if k in recipes]
    held = ["first"]
    for j in range(held_calls(output_bytes, held_budget)):
        ref, name = cycle[j % len(cycle)], f"held{j + 1}"
        byte = (P0, P1)[j % 2]
        plan.steps.append(step(f"held call {j + 1} (outputs of every earlier call held)", ref, refresh="A",
                               poison_byte=byte, hold_as=name, compare_storage_with=list(held)))
        plan.save_held[name] = out(name)
        plan.compared.append((ref, step_variant(ref), out(name), byte,
                              f"held call {j + 1}'s outputs, read after every later call"))
        held.append(name)
    return plan


def step_variant(ref: str) -> str:
    """The variant name reports use for reference key ``ref`` (``random_b``… are ``random`` inputs)."""
    return "random" if ref.startswith("random") else ref


@dataclass
class CheckContext:
    refs: dict[str, RefResult]
    """Reference per variant name; ``random`` entries for determinism runs use key ``random_b``."""
    mutated_input_idxs: tuple[int, ...]
    tf32: bool
    noise: dict[str, list[Any]] = field(default_factory=dict)
    """Per reference key, per output: the reference's rounding sensitivity (:func:`reference_noise`)."""

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
        found = retained.hidden(facts.get("retained"), ref.retained)
        if found:
            fails.append(CheckFailure("output_retained", retained.message(found, where),
                                      output_index=found[0][0], variant=variant))
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
                                  f"outputs {facts['lifetime_changed']} of the {where} changed during later calls "
                                  f"while the caller still held them: the candidate reuses output memory (a static "
                                  f"buffer or a ring of them) that belongs to the caller.",
                                  output_index=facts["lifetime_changed"][0]))
    if facts.get("save_refused") and not any(f.check in _STRUCTURAL for f in fails):
        fails.append(CheckFailure("output_type", f"outputs rejected before transfer ({where}): "
                                                 f"{facts['save_refused']}", variant=variant))
    return fails


_STRUCTURAL = {"output_count", "output_type", "shape_mismatch", "dtype_mismatch", "exception", "oom"}


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
            name = str(facts["held"])
            fails += step_failures(facts, None, ctx, "first call" if name == "first" else f"held call {name[4:]}",
                                   None)
            continue
        planned = plan.steps[i] if i < len(plan.steps) else {}
        ref = ctx.refs.get(planned.get("ref", "normal"))
        fails += step_failures(facts, ref, ctx, str(facts.get("label")), planned.get("variant"))
    for a, key, variant in plan.rng_pairs:
        expected_rng = ctx.refs[key].rng if key in ctx.refs else None
        if a < len(steps) and "rng" in steps[a] and expected_rng and steps[a]["rng"] != expected_rng:
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
        if plan.determinism and path in plan.determinism:
            loaded[path] = data["outputs"]
        others = {k: r for k, r in ctx.refs.items() if k != key}
        for i, (expected, got) in enumerate(zip(ref.outputs, data["outputs"])):
            if isinstance(expected, torch.Tensor) and (got is None or got.shape != expected.shape
                                                       or got.dtype != expected.dtype):
                continue  # structure failures come from the step facts
            if "after every later call" in where and _aliases_input(ref.facts[i]):
                continue  # a returned input was refilled by the next call; its identity is checked structurally
            other_vals = {k: r.outputs[i] for k, r in others.items() if i < len(r.outputs)}
            noise = ctx.noise.get(key, [])
            failure = compare_output(i, expected, got if isinstance(expected, torch.Tensor) else expected,
                                     variant=variant, tf32=ctx.tf32, poison_byte=poison, others=other_vals, where=where,
                                     noise=noise[i] if i < len(noise) else None)
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


#: Perturbed reference runs per noise estimate (elementwise maximum of their deviations).
NOISE_RUNS = 2


def noise_from(ref: RefResult, others: list[RefResult]) -> list[Any]:
    """Per output, ``max_r |other_r − ref|`` over the reference runs on rounding-level perturbations of the same
    inputs (:func:`tilesmith.gate.inputs.perturbed`, :data:`NOISE_RUNS` of them, same RNG seed, made in the
    trusted worker); ``None`` for non-floating outputs. Fewer runs than asked (the original rejected a
    perturbed input) give no noise (the strict tolerance applies)."""
    noise: list[Any] = [None] * len(ref.outputs)
    if len(others) < NOISE_RUNS:
        return noise
    for other in others:
        for i, (a, b) in enumerate(zip(ref.outputs, other.outputs)):
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
                    (a.is_floating_point() or a.is_complex()):
                d = (_real64(b) - _real64(a)).abs()
                d = torch.where(torch.isnan(d) & torch.isnan(_real64(a)) & torch.isnan(_real64(b)), 0.0, d)
                d = torch.nan_to_num(d, nan=float("inf"))
                noise[i] = d if noise[i] is None else torch.maximum(noise[i], d)
    return [None if n is None else n.reshape(ref.outputs[i].shape + ((2,) if ref.outputs[i].is_complex() else ()))
            for i, n in enumerate(noise)]


def _real64(t: torch.Tensor) -> torch.Tensor:
    return (torch.view_as_real(t) if t.is_complex() else t).double()


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
