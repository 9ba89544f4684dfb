"""The outer LangGraph loop: one graph's optimization as a sequence of agent turns decided by the host.

Graph: ``START → turn → (again → turn | done → END)``. One ``turn`` node run is one agent turn (the graph's
sandboxed shell, when offered, lives for all its turns):

1. stop first if :meth:`Session.stop_reason` is set (loops done, ``TILESMITH_MAX_TURNS``,
   ``TILESMITH_GRAPH_TIMEOUT_S``) or the run's model-call budget is spent;
2. :meth:`Session.new_turn` copies the most recently evaluated source into a new ring slot;
3. a fresh deep agent (:func:`build_agent`) gets a message with the turn status, recent verdicts and
   the attempt's source, and works until its final answer — which ends only the turn;
4. if the attempt changed after its last evaluation, the **host** evaluates it (the agent's words are
   never taken as a result);
5. route: stop on a budget/proxy/model failure or when the agent "gave up"; otherwise the next turn
   (the session's stop rule ends the loop once ``loops`` candidates were accepted).

Stop rule (documented in docs/agent.md): the session's rule, plus — here — the budget running out, the
proxy failing after its one restart, a model error that a retry cannot fix (HTTP 4xx other than
408/409/429), two consecutive turns that end in other agent errors, and :data:`GIVE_UP_TURNS`
consecutive turns in which the agent neither changed nor evaluated the attempt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from langchain_core.messages import HumanMessage
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, StateGraph
from langsmith import tracing_context

from tilesmith.agent.llm.budget import BudgetedChatOpenAI, ModelCallBudget
from tilesmith.agent.llm.prompts import system_prompt, turn_message
from tilesmith.agent.llm.sandbox import Sandbox
from tilesmith.agent.llm.shell import GraphShell
from tilesmith.agent.llm.skills import Skill
from tilesmith.agent.llm.tools import TurnState, make_tools
from tilesmith.agent.llm.tracing import LiveTrace, TraceRecorder
from tilesmith.agent.protocol import Session, StopOptimization
from tilesmith.errors import BudgetExhausted, ProxyError
from tilesmith.secrets import Redactor

GIVE_UP_TURNS = 2
"""Consecutive turns without any change or evaluation after which the agent is taken to have given up."""
ERROR_TURNS = 2
"""Consecutive turns ending in a (retryable) agent error after which the loop stops."""
AGENT_RECURSION_LIMIT = 9_999
"""deepagents' own runaway guard on graph steps inside one turn (``create_deep_agent`` binds 9_999)."""
_OUTER_RECURSION_LIMIT = 100_000
"""Graph steps of the outer loop: one per turn, far above any session's turn limit (not a step limit)."""

_FS_TOOLS = ["ls", "read_file", "write_file", "edit_file", "glob", "grep"]


@dataclass
class AgentRuntime:
    """What every graph's loop of one run shares (built by the factory)."""

    chat_model: BudgetedChatOpenAI
    budget: ModelCallBudget
    redactor: Redactor
    agency: str
    proposer: str
    min_improvement: float
    debug: bool
    profile: Callable[[Session, Path], str]
    sandbox: Sandbox | None = None
    """The run's working sandbox for ``gpu_shell``; ``None``: no shell tool."""
    shell_unavailable: str | None = None
    """Why the shell is not offered although ``TILESMITH_GPU_SHELL`` asks for it (each graph notes it)."""
    skills: tuple[Skill, ...] = ()
    live_sink: Callable[[str], None] | None = None
    """Where :class:`~.tracing.LiveTrace` lines go (``None``: no live trace)."""


def build_agent(runtime: AgentRuntime, state: TurnState, shell: GraphShell | None = None) -> Any:
    """The deep agent of one turn: one shared chat model, file tools rooted at the track folder
    (virtual paths, writes allowed only to this turn's attempt), the host tools, and ``gpu_shell`` when the
    graph has a sandboxed shell.

    deepagents' side files (evicted tool results, summarized history, blobs) are routed to in-memory
    state, so they never land in the track folder.
    """
    from deepagents import FilesystemMiddleware, FilesystemPermission, create_deep_agent
    from deepagents.backends import CompositeBackend, FilesystemBackend, StateBackend

    workspace = Path(state.session.workspace)
    backend = CompositeBackend(
        default=FilesystemBackend(root_dir=workspace, virtual_mode=True),
        routes={"/large_tool_results/": StateBackend(), "/conversation_history/": StateBackend(),
                "/blobs/": StateBackend()},
    )
    permissions = [
        FilesystemPermission(operations=["write"], paths=[state.attempt_virtual], mode="allow"),
        FilesystemPermission(operations=["write"], paths=["/**"], mode="deny"),
    ]
    tools = make_tools(state, profile=lambda path: runtime.profile(state.session, path), shell=shell)
    return create_deep_agent(
        model=runtime.chat_model,
        tools=tools,
        system_prompt=system_prompt(runtime.agency, state.attempt_virtual, runtime.min_improvement,
                                    shell_help=shell.help(state.attempt_virtual) if shell else None,
                                    skills=runtime.skills),
        middleware=[FilesystemMiddleware(backend=backend, tools=list(_FS_TOOLS))],
        backend=backend,
        permissions=permissions,
        name="main",
    )


class LoopState(TypedDict, total=False):
    turn: int
    quiet_turns: int
    error_turns: int
    stop: str | None
    history: list[str]


def _cause_chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        out.append(cur)
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return out


def classify_error(exc: BaseException) -> tuple[str, str]:
    """``(outcome, message)`` for an exception out of an agent turn.

    Outcomes: ``budget_exhausted``, ``proxy_failed``, ``model_error`` (HTTP 4xx other than
    408/409/429: retrying cannot help), ``agent_error`` (anything else).
    """
    chain = _cause_chain(exc)
    for err in chain:
        if isinstance(err, BudgetExhausted):
            return "budget_exhausted", str(err)
    for err in chain:
        if isinstance(err, ProxyError):
            return "proxy_failed", str(err)
    for err in chain:
        status = getattr(err, "status_code", None)
        if isinstance(status, int) and 400 <= status < 500 and status not in (408, 409, 429):
            return "model_error", f"the proxy answered HTTP {status}: {err}"
    return "agent_error", f"{type(exc).__name__}: {exc}"


def run_outer_loop(session: Session, runtime: AgentRuntime) -> str:
    """Optimize one graph until the stop rule says so; return why it stopped.

    Returned reasons: ``"session:<reason>"`` (the session's stop rule), ``"budget"``, ``"proxy_failed"``,
    ``"model_error"``, ``"agent_error"``, ``"agent_gave_up"``, ``"outer_recursion_limit"``.
    Diagnostics for everything except the session's own stop go to :meth:`Session.note`.
    """
    shell = _open_shell(session, runtime)
    try:
        return _run_turns(session, runtime, shell)
    finally:
        if shell is not None:
            shell.close()


def _graph_label(session: Session) -> str:
    label = getattr(getattr(session, "track", None), "label", None)
    return str(label) if label else f"{str(session.graph_key)[:8]} ({session.graph.name})"


def _open_shell(session: Session, runtime: AgentRuntime) -> GraphShell | None:
    """The graph's shell (or ``None``, with a ``shell_unavailable`` note when one was asked for), and the
    agent's tools and skills in ``track.json`` (``agent``: skills by name and sha256, never their text)."""
    shell, reason = None, runtime.shell_unavailable
    if runtime.sandbox is not None:
        try:
            shell = GraphShell(runtime.sandbox, session, runtime.redactor)
        except OSError as exc:
            reason = f"the shell workspace could not be created ({type(exc).__name__}: {exc})"
    if reason:
        session.note("shell_unavailable", f"the agent works without gpu_shell: {reason}")
    update = getattr(getattr(session, "track", None), "update", None)
    if callable(update):
        update(agent={"gpu_shell": {"offered": shell is not None,
                                    "sandbox": runtime.sandbox.version if shell is not None and runtime.sandbox
                                    else None, "reason": reason},
                      "skills": [skill.metadata() for skill in runtime.skills]})
    return shell


def _run_turns(session: Session, runtime: AgentRuntime, shell: GraphShell | None) -> str:
    workspace = Path(session.workspace)
    original = session.graph.canonical_source
    label = _graph_label(session)
    elide = [(skill.text.rstrip(), skill.placeholder()) for skill in runtime.skills]

    def turn_node(state: LoopState) -> LoopState:
        reason = session.stop_reason()
        if reason:
            return {"stop": f"session:{reason}"}
        if runtime.budget.exhausted():
            return {"stop": "budget"}
        try:
            attempt_path = Path(session.new_turn())
        except StopOptimization:
            return {"stop": f"session:{session.stop_reason() or 'stopped'}"}
        number = int(getattr(session, "turns_used", 0) or state.get("turn", 0) + 1)
        virtual = "/" + attempt_path.resolve().relative_to(workspace.resolve()).as_posix()
        start_text = attempt_path.read_text(encoding="utf-8")
        recorder = (TraceRecorder(workspace / "traces" / f"turn_{number:03d}.jsonl", number, runtime.redactor,
                                  elide) if runtime.debug else None)
        callbacks: list[Any] = [recorder] if recorder else []
        if runtime.live_sink is not None:
            callbacks.append(LiveTrace(label, number, runtime.redactor, runtime.live_sink))
        turn = TurnState(session=session, turn=number, attempt_path=attempt_path, attempt_virtual=virtual,
                         start_text=start_text, original_source=original, agency=runtime.agency,
                         proposer=runtime.proposer, on_event=recorder.write if recorder else None)
        used_before = runtime.budget.used
        if recorder:
            recorder.write("turn_start", attempt=virtual, loops_accepted=session.accepted_loops,
                           budget_remaining=runtime.budget.remaining())
        outcome, detail = "final_answer", ""
        try:
            agent = build_agent(runtime, turn, shell)
            message = turn_message(turn=number, attempt_virtual=virtual, source=start_text,
                                   loops_accepted=session.accepted_loops, loops=session.loops,
                                   history=state.get("history", []), budget_remaining=runtime.budget.remaining())
            agent.invoke({"messages": [HumanMessage(content=message)]},
                         config={"callbacks": callbacks,
                                 "recursion_limit": AGENT_RECURSION_LIMIT})
        except GraphRecursionError as exc:
            outcome = "agent_error"
            detail = f"the agent exceeded {AGENT_RECURSION_LIMIT} graph steps in one turn ({exc})"
        except Exception as exc:  # noqa: BLE001 - classified below; nothing may escape into the pipeline
            outcome, detail = classify_error(exc)
        detail = runtime.redactor(detail)
        if not turn.accepted and turn.changed_since_evaluation():
            turn.evaluate("host:end_of_turn", note="evaluated by the host at the end of the agent's turn")
        history = list(state.get("history", []))
        for verdict in turn.verdicts:
            history.append(f"turn {number}: {verdict.summary()}")
        for reason_text in turn.host_rejections:
            history.append(f"turn {number}: rejected_policy (host agency check): {reason_text[:300]}")
        quiet = 0 if turn.evaluated else state.get("quiet_turns", 0) + 1
        errors = state.get("error_turns", 0) + 1 if outcome == "agent_error" else 0
        if recorder:
            recorder.write("turn_end", outcome=outcome, detail=detail, model_calls=runtime.budget.used - used_before,
                           tokens=recorder.tokens, accepted=turn.accepted)
        stop: str | None = None
        if outcome == "budget_exhausted":
            stop = "budget"
        elif outcome in ("proxy_failed", "model_error"):
            stop = outcome
            session.note(outcome, detail)
        elif outcome == "agent_error" and errors >= ERROR_TURNS:
            stop = "agent_error"
            session.note("agent_error", f"{ERROR_TURNS} consecutive agent turns failed; last: {detail}")
        elif quiet >= GIVE_UP_TURNS and not session.stop_reason():
            stop = "agent_gave_up"
            session.note("agent_gave_up", f"the agent ended {GIVE_UP_TURNS} consecutive turns without changing or "
                                          "evaluating the attempt; optimization of this graph stopped")
        return {"turn": number, "quiet_turns": quiet, "error_turns": errors, "stop": stop, "history": history[-20:]}

    graph = StateGraph(LoopState)
    graph.add_node("turn", turn_node)
    graph.add_edge(START, "turn")
    graph.add_conditional_edges("turn", lambda s: "done" if s.get("stop") else "again", {"again": "turn", "done": END})
    app = graph.compile()
    try:
        with tracing_context(enabled=False):  # agent traffic goes to the proxy only, never to LangSmith
            final = app.invoke({"turn": 0, "quiet_turns": 0, "error_turns": 0, "stop": None, "history": []},
                               config={"recursion_limit": _OUTER_RECURSION_LIMIT})
        stop = str(final.get("stop") or "session:stopped")
    except GraphRecursionError:
        stop = "outer_recursion_limit"
        session.note("agent_error", f"the outer loop passed {_OUTER_RECURSION_LIMIT} turns")
    if stop == "budget":
        budget = runtime.budget
        kept = "; the graph keeps ordinary Inductor" if session.accepted_loops == 0 else ""
        session.note("budget_exhausted",
                     f"max_model_calls={budget.limit} is spent ({budget.used} model invocations in this run); "
                     f"{session.accepted_loops} of {session.loops} requested loops were accepted{kept}")
    return stop
