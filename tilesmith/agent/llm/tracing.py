"""Per-turn structured agent traces (``TILESMITH_DEBUG=1``): ``<track>/traces/turn_<n>.jsonl``.

One JSON object per line, in the order events happened. Every line has ``event``, ``t`` (seconds since
the turn began) and ``turn``. Model and tool events also carry ``run_id``/``parent_run_id`` (to rebuild
the call tree) and ``agent`` (``"main"`` or the subagent's name, from LangGraph's ``lc_agent_name``
metadata).

=====================  ==============================================================================
event                  fields
=====================  ==============================================================================
``turn_start``         ``attempt`` (virtual path), ``loops_accepted``, ``budget_remaining``
``model_start``        ``agent``, ``call`` (1-based model invocation number in the turn), ``model``,
                       ``messages`` (role, content, tool_calls, tool_call_id, name), ``tools`` (names)
``model_end``          ``agent``, ``content``, ``tool_calls``, ``usage`` (input/output/total tokens)
``model_error``        ``agent``, ``error``
``tool_start``         ``agent``, ``tool``, ``input``
``tool_end``           ``tool``, ``output``
``tool_error``         ``error``
``evaluation``         ``by`` (``tool:<agent>`` or ``host:end_of_turn``), ``status``, ``summary``,
                       ``report``
``turn_end``           ``outcome``, ``model_calls``, ``tokens`` (sum of this turn's usage)
=====================  ==============================================================================

Every string goes through the run's :class:`~tilesmith.secrets.Redactor` before it is written,
so provider keys and the proxy's client key never reach the file; skill texts (:mod:`.skills`) are written as a
placeholder naming the skill and its sha256. :class:`LiveTrace` is the console counterpart (tool calls only).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler

from tilesmith.secrets import Redactor


_MAX_TEXT = 200_000
"""Longest string kept per field (characters); longer ones are cut with a marker."""


def _text(value: Any) -> Any:
    if isinstance(value, str) and len(value) > _MAX_TEXT:
        return value[:_MAX_TEXT] + f"… [{len(value) - _MAX_TEXT} characters cut]"
    return value


def _message(msg: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": getattr(msg, "type", type(msg).__name__), "content": getattr(msg, "content", "")}
    calls = getattr(msg, "tool_calls", None)
    if calls:
        out["tool_calls"] = [{"name": c.get("name"), "args": c.get("args"), "id": c.get("id")} for c in calls]
    for attr in ("tool_call_id", "name"):
        value = getattr(msg, attr, None)
        if value:
            out[attr] = value
    return out


class TraceRecorder(BaseCallbackHandler):
    """Callback handler writing one turn's events to ``path`` (created on first write).

    Thread-safe (subagents and parallel tools call back from worker threads); ``run_inline`` keeps the
    order of events as they happen.
    """

    run_inline = True
    raise_error = False

    def __init__(self, path: Path, turn: int, redactor: Redactor, elide: Sequence[tuple[str, str]] = ()) -> None:
        self.path = Path(path)
        self.turn = turn
        self.redactor = redactor
        self.elide = tuple((text, placeholder) for text, placeholder in elide if text)
        """``(text, placeholder)`` pairs: skill texts are recorded as their placeholders."""
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._agents: dict[UUID, str] = {}
        self.model_calls = 0
        self.tokens = {"input": 0, "output": 0, "total": 0}

    def _scrub(self, value: Any) -> Any:
        if isinstance(value, str):
            for text, placeholder in self.elide:
                if text in value:
                    value = value.replace(text, placeholder)
            return self.redactor(_text(value))
        if isinstance(value, dict):
            return {self._scrub(str(k)): self._scrub(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._scrub(v) for v in value]
        if isinstance(value, (int, float, bool)) or value is None:
            return value
        return self.redactor(_text(str(value)))

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "t": round(time.monotonic() - self._t0, 4), "turn": self.turn, **fields}
        line = json.dumps(self._scrub(record), ensure_ascii=False, default=str)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")

    @staticmethod
    def _agent(metadata: dict[str, Any] | None) -> str:
        name = (metadata or {}).get("lc_agent_name")
        return str(name) if name else "unknown"

    # -- model events ---------------------------------------------------------------------------
    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[Any]], *, run_id: UUID,
                            parent_run_id: UUID | None = None, tags: list[str] | None = None,
                            metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        agent = self._agent(metadata)
        with self._lock:
            self._agents[run_id] = agent
            self.model_calls += 1
            call = self.model_calls
        params = kwargs.get("invocation_params") or {}
        tools = [t.get("function", {}).get("name") or t.get("name") for t in params.get("tools") or []
                 if isinstance(t, dict)]
        self.write("model_start", run_id=str(run_id), parent_run_id=str(parent_run_id) if parent_run_id else None,
                   agent=agent, call=call, model=params.get("model") or params.get("model_name"),
                   messages=[_message(m) for batch in messages for m in batch], tools=tools)

    def on_llm_end(self, response: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        agent = self._agents.get(run_id, "unknown")
        try:
            message = response.generations[0][0].message
        except (AttributeError, IndexError):
            message = None
        usage = dict(getattr(message, "usage_metadata", None) or {})
        with self._lock:
            self.tokens["input"] += int(usage.get("input_tokens") or 0)
            self.tokens["output"] += int(usage.get("output_tokens") or 0)
            self.tokens["total"] += int(usage.get("total_tokens") or 0)
        fields = _message(message) if message is not None else {}
        self.write("model_end", run_id=str(run_id), agent=agent, content=fields.get("content"),
                   tool_calls=fields.get("tool_calls", []),
                   usage={k: usage.get(k) for k in ("input_tokens", "output_tokens", "total_tokens")})

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self.write("model_error", run_id=str(run_id), agent=self._agents.get(run_id, "unknown"),
                   error=f"{type(error).__name__}: {error}")

    # -- tool events ----------------------------------------------------------------------------
    def on_tool_start(self, serialized: dict[str, Any], input_str: str, *, run_id: UUID,
                      parent_run_id: UUID | None = None, metadata: dict[str, Any] | None = None,
                      inputs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.write("tool_start", run_id=str(run_id), parent_run_id=str(parent_run_id) if parent_run_id else None,
                   agent=self._agent(metadata), tool=(serialized or {}).get("name") or kwargs.get("name"),
                   input=inputs if inputs is not None else input_str)

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        content = getattr(output, "content", None)
        if content is None:
            content = str(output)
        self.write("tool_end", run_id=str(run_id), tool=getattr(output, "name", None) or kwargs.get("name"),
                   output=content)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self.write("tool_error", run_id=str(run_id), error=f"{type(error).__name__}: {error}")


LIVE_ARGS_CHARS = 1000
"""Characters of a tool call's arguments shown in the live trace (0.1.4 cuts at 1,000 too)."""
_LIVE_RESULT_CHARS = 160


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"… [{len(text) - limit} characters cut]"


class LiveTrace(BaseCallbackHandler):
    """Console trace of every tool call while the agent works: one line when a tool starts (its arguments as
    JSON, cut at :data:`LIVE_ARGS_CHARS` characters) and one when it ends (the first line of its result).

    Lines go to ``sink`` (the factory passes :meth:`tilesmith.progress.Progress.trace`, which shows them per
    ``TILESMITH_PROGRESS``/``TILESMITH_DEBUG`` and logs them). Every line passes the run's redactor before it is
    cut, so no part of a secret is shown.
    """

    run_inline = True
    raise_error = False

    def __init__(self, label: str, turn: int, redactor: Redactor, sink: Any) -> None:
        self.label = label
        self.turn = turn
        self.redactor = redactor
        self.sink = sink
        self._names: dict[UUID, str] = {}
        self._lock = threading.Lock()

    def _emit(self, text: str) -> None:
        try:
            self.sink(text)
        except Exception:  # noqa: BLE001 - the display must never break the agent
            pass

    def on_tool_start(self, serialized: dict[str, Any], input_str: str, *, run_id: UUID,
                      metadata: dict[str, Any] | None = None, inputs: dict[str, Any] | None = None,
                      **kwargs: Any) -> None:
        name = str((serialized or {}).get("name") or kwargs.get("name") or "tool")
        with self._lock:
            self._names[run_id] = name
        args = json.dumps(inputs if inputs is not None else input_str, ensure_ascii=False, sort_keys=True,
                          default=str)
        agent = TraceRecorder._agent(metadata)
        self._emit(f"tilesmith {self.label} turn {self.turn} {agent}: {name}"
                   f"({_cut(self.redactor(args), LIVE_ARGS_CHARS)})")

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        with self._lock:
            name = self._names.pop(run_id, "tool")
        content = getattr(output, "content", None)
        text = str(output if content is None else content).strip()
        first = text.splitlines()[0] if text else "(empty)"
        self._emit(f"tilesmith {self.label} turn {self.turn}: {name} -> "
                   f"{_cut(self.redactor(first), _LIVE_RESULT_CHARS)}")

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        with self._lock:
            name = self._names.pop(run_id, "tool")
        self._emit(f"tilesmith {self.label} turn {self.turn}: {name} failed: "
                   f"{_cut(self.redactor(f'{type(error).__name__}: {error}'), _LIVE_RESULT_CHARS)}")
