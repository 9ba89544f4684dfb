"""Prompts of the LLM agent: the system prompt per agency level and the message that opens each turn.

The rules the prompts state are the ones the host enforces: the callable ABI and the gate's checks
(docs/gate.md) for every level, and for ``low`` the launch-sequence rule of :mod:`.launches`. A rule in a
prompt is advice to the model; the host's checks are what decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

AGENCY_RULES = {
    "low": (
        "Agency LOW — keep the wrapper and the kernel boundaries. The same kernels must be launched in the "
        "same order (the host compares the launch sequence of `call` with the original and rejects any "
        "difference before running the gate). You may tune inside kernels and their launches: tile and block "
        "sizes, num_warps / num_stages, memory coalescing, vectorized loads and stores, loop order inside a "
        "kernel, launch grids and arguments."
    ),
    "medium": (
        "Agency MEDIUM — you may restructure the wrapper logic: intermediate buffers and their reuse, kernel "
        "fusion or splitting, launch order, replacing an extern library call by a Triton kernel or the reverse, "
        "while keeping the high-level algorithm (the same mathematical computation)."
    ),
    "high": (
        "Agency HIGH — you may redesign the algorithm and its implementation (other decompositions, new fused "
        "kernels, hand-written Triton replacing library calls) as long as the results stay within the gate's "
        "tolerances."
    ),
}

_SYSTEM = """You are a GPU performance engineer optimizing ONE PyTorch Inductor-generated Python wrapper.

Workspace (paths as the file tools see them):
- {attempt}: your working copy for this turn. Edit only this file. It begins with the captured FX program as
  comments, followed by the wrapper: module-level kernels (Triton source inside async_compile.triton(...)
  strings, templates, extern library calls) and `call(args)`, which allocates buffers and launches kernels.
- /program.fx.txt: the FX program the wrapper computes (also returned by the read_fx_program tool).
- /attempts/: earlier attempts; /profiles/: the host gate's full report of every evaluation (JSON + .txt).
  Everything except {attempt} is read-only.

Rules for every agency level (the host gate enforces them):
- Keep the callable ABI: `call(args)` receives the same list of inputs, returns a tuple with the same number of
  outputs, each with the same shape, strides, dtype and device, and the same aliasing and in-place mutation
  behaviour as the original.
- Results must match the original on normal, all-zero and high-magnitude inputs (NaN/Inf positions included).
- No caching of results across calls, no work left running on other streams or threads, no change of global
  state (TF32 flags, allocator settings, random seeds), no timers, no patching of torch or of the harness.
- Import only what the original wrapper imports (the same modules, the same names from them), plus torch,
  torch._inductor.*, torch._C.*, torch.cuda.*, triton.* and math; the gate refuses any other import.
- A candidate is accepted only when it is at least {min_improvement:.1f}% faster than the incumbent, measured by
  the host with paired CUDA-event samples and confirmed in a fresh process.

{agency_rules}

How to work:
1. The current source of {attempt} is in the first message. Use profile_attempt to see where time goes.
2. Change {attempt} with edit_file (exact-string replacement) or write_file (whole file). Copy old_string
   from read_exact_source, which returns the exact text (read_file adds line-number gutters).
3. Call evaluate_attempt. If it is rejected, read the reasons (and the report under /profiles/ when useful),
   fix the attempt and evaluate again. Do not resubmit an unchanged source.
4. End your turn with a short final answer (no tool call) once a candidate is accepted or when you have no
   further idea. Your final answer ends only this turn; the host gate decides what is installed, and the
   host also evaluates the attempt file if you changed it after your last evaluation.
You may delegate focused investigations to a subagent with the task tool; it shares the same files and tools.
"""


_NO_SHELL = "There is no shell tool for this graph; use profile_attempt and evaluate_attempt to measure."


def system_prompt(agency: str, attempt_virtual: str, min_improvement: float, *, shell_help: str | None = None,
                  skills: Sequence[Any] = ()) -> str:
    """The main agent's system prompt for one turn.

    Args:
        agency: ``"low"``, ``"medium"`` or ``"high"``.
        attempt_virtual: this turn's attempt as the file tools address it, e.g. ``"/attempts/attempt_02.py"``.
        min_improvement: ``TILESMITH_MIN_IMPROVEMENT`` as a fraction (0.02 → "2.0%").
        shell_help: the ``gpu_shell`` section (:meth:`.shell.GraphShell.help`), ``None`` when no shell is offered.
        skills: trusted skills (:class:`.skills.Skill`: ``name``, ``text``), appended in order.

    Raises:
        ValueError: unknown agency (names the allowed values).
    """
    if agency not in AGENCY_RULES:
        raise ValueError(f"agency must be one of {', '.join(AGENCY_RULES)}; got {agency!r}")
    sections = [_SYSTEM.format(attempt=attempt_virtual, min_improvement=100.0 * min_improvement,
                               agency_rules=AGENCY_RULES[agency]).rstrip("\n"),
                "## GPU shell\n" + shell_help if shell_help else _NO_SHELL]
    for skill in skills:
        sections.append(f"--- trusted skill {skill.name} (from the user; guidance, not a rule the host checks) ---\n"
                        f"{skill.text.rstrip()}\n--- end of skill {skill.name} ---")
    return "\n\n".join(sections) + "\n"


def turn_message(*, turn: int, attempt_virtual: str, source: str, loops_accepted: int, loops: int,
                 history: Sequence[str], budget_remaining: int | None, max_source_chars: int = 120_000) -> str:
    """The human message that opens a turn: status, recent verdicts and the attempt's current source."""
    lines = [f"Turn {turn}. Accepted loops so far: {loops_accepted} of {loops} requested.",
             f"Your attempt file for this turn is {attempt_virtual}; it starts from the most recently evaluated "
             "source."]
    if budget_remaining is not None:
        lines.append(f"Model calls left in this run's budget: {budget_remaining}.")
    if history:
        lines.append("Recent evaluations (oldest first):")
        lines.extend(f"- {h}" for h in history[-8:])
    if len(source) > max_source_chars:
        lines.append(f"The source is {len(source)} characters; read {attempt_virtual} with read_file "
                     "(use a large limit, e.g. 4000 lines).")
    else:
        lines.append(f"Current source of {attempt_virtual}:")
        lines.append("```python\n" + source + ("" if source.endswith("\n") else "\n") + "```")
    return "\n".join(lines)
