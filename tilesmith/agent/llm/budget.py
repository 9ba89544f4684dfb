"""The exact model-call budget (``max_model_calls``) and the one chat model that enforces it.

Counting point: one LangChain chat-model invocation is one call of ``_generate``, ``_agenerate``,
``_stream`` or ``_astream`` on the model object. ``BaseChatModel`` (langchain-core 1.8,
``language_models/chat_models.py``, ``_generate_with_cache``) calls exactly one of them per
``invoke``/``ainvoke``/``stream`` — ``_stream`` when streaming is on, ``_generate`` otherwise — and
``ChatOpenAI`` (langchain-openai 1.7.4) does not call one from another. So :class:`BudgetedChatOpenAI`
takes one permit at the top of each, before any request is sent:

* ``N`` permits ``N`` invocations; the ``N+1``-st raises :class:`~tilesmith.errors.BudgetExhausted`
  without contacting the proxy;
* the main agent, every subagent (``task``) and deepagents' summarization share the one model object,
  hence the one budget; parallel ``task`` calls are serialized by the budget's lock;
* transport retries (the OpenAI client's ``max_retries``, the proxy-restart resend in
  :mod:`.transport`) happen inside one invocation and are not counted; tools, gate evaluations and
  graph transitions never reach the model.

Scope: one :class:`ModelCallBudget` per ``tilesmith.compile()`` run, shared by every graph's agent (a
cost cap the user sets once). ``limit=None`` means no limit.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_openai import ChatOpenAI
from pydantic import PrivateAttr

from tilesmith.errors import BudgetExhausted

_LOCAL = threading.local()


class ModelCallBudget:
    """Thread-safe counter of model invocations against an optional exact limit."""

    def __init__(self, limit: int | None) -> None:
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            raise ValueError(f"max_model_calls must be None or an integer >= 0, got {limit!r}")
        self.limit = limit
        self.used = 0
        self.by_agent: Counter[str] = Counter()
        self.blocked = 0
        """Invocations refused because the budget was spent."""
        self._lock = threading.Lock()

    def remaining(self) -> int | None:
        """Permits left (``None`` when unlimited)."""
        with self._lock:
            return None if self.limit is None else max(0, self.limit - self.used)

    def exhausted(self) -> bool:
        return self.remaining() == 0

    def acquire(self, agent: str) -> int:
        """Take one permit for ``agent``; return the 1-based number of this invocation in the run.

        Raises:
            BudgetExhausted: ``limit`` invocations were already made; nothing is sent.
        """
        with self._lock:
            if self.limit is not None and self.used >= self.limit:
                self.blocked += 1
                raise BudgetExhausted(f"max_model_calls={self.limit} is spent: {self.used} model invocations were "
                                      f"made and invocation {self.used + 1} was blocked before any request")
            self.used += 1
            self.by_agent[agent] += 1
            return self.used


def _agent_name(run_manager: Any) -> str:
    """``lc_agent_name`` of the calling agent: from the run manager, else from the ambient runnable config
    (core passes no run manager to ``_stream``)."""
    metadata = getattr(run_manager, "metadata", None) or {}
    name = metadata.get("lc_agent_name") if isinstance(metadata, dict) else None
    if not name:
        try:
            from langchain_core.runnables.config import ensure_config

            name = (ensure_config().get("metadata") or {}).get("lc_agent_name")
        except Exception:  # noqa: BLE001 - outside a runnable
            name = None
    return str(name) if name else "unknown"


class BudgetedChatOpenAI(ChatOpenAI):
    """``ChatOpenAI`` that takes a permit from a shared :class:`ModelCallBudget` per invocation.

    Construct it, then call :meth:`bind_budget`. Everything else is ``ChatOpenAI`` unchanged.
    """

    _budget: ModelCallBudget | None = PrivateAttr(default=None)

    def bind_budget(self, budget: ModelCallBudget) -> BudgetedChatOpenAI:
        self._budget = budget
        return self

    @property
    def budget(self) -> ModelCallBudget | None:
        return self._budget

    def _permit(self, run_manager: Any) -> None:
        if getattr(_LOCAL, "inside", False):  # a nested call inside one invocation: already counted
            return
        if self._budget is not None:
            self._budget.acquire(_agent_name(run_manager))

    def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
        self._permit(run_manager)
        outer = getattr(_LOCAL, "inside", False)
        _LOCAL.inside = True
        try:
            return super()._generate(messages, stop=stop, run_manager=run_manager, **kwargs)
        finally:
            _LOCAL.inside = outer

    async def _agenerate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
        self._permit(run_manager)
        return await super()._agenerate(messages, stop=stop, run_manager=run_manager, **kwargs)

    def _stream(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Iterator[Any]:
        self._permit(run_manager)
        yield from super()._stream(messages, stop=stop, run_manager=run_manager, **kwargs)

    async def _astream(self, messages: Any, stop: Any = None, run_manager: Any = None,
                       **kwargs: Any) -> AsyncIterator[Any]:
        self._permit(run_manager)
        async for chunk in super()._astream(messages, stop=stop, run_manager=run_manager, **kwargs):
            yield chunk
