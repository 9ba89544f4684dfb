"""``LLMOptimizerFactory``: the LLM agent's :class:`~tilesmith.agent.protocol.OptimizerFactory`.

One factory per ``tilesmith.compile()`` run. It owns the run's shared resources:

* the private CLIProxyAPI (:class:`~.proxy.PrivateProxy`), started lazily by the first
  :meth:`LLMOptimizerFactory.for_graph` and stopped by :meth:`LLMOptimizerFactory.close`, by garbage
  collection of the factory (``weakref.finalize``) or at interpreter exit;
* the one ``ChatOpenAI`` (:class:`~.budget.BudgetedChatOpenAI`, Chat Completions API, no Responses
  API, streaming off) that every graph's main agent and subagents use;
* the exact model-call budget (:class:`~.budget.ModelCallBudget`), one per run.

Errors the pipeline should catch around ``for_graph``: :class:`~.errors.AgentUnavailable` (subclasses
:class:`~.errors.UnknownModelError` — kind ``"unknown_model"`` — and :class:`~.errors.ProxyStartError`
— kind ``"proxy_failed"``), each carrying ``.diagnostic``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path

from tilesmith import progress, settings
from tilesmith.agent.llm.budget import BudgetedChatOpenAI, ModelCallBudget
from tilesmith.agent.llm.discovery import check_availability, find_auth_dir, find_user_config, resolve_model
from tilesmith.agent.llm.errors import AgentUnavailable, ProxyStartError, UnknownModelError
from tilesmith.agent.llm.loop import AgentRuntime, run_outer_loop
from tilesmith.agent.llm.profiling import profile_source
from tilesmith.agent.llm.proxy import PrivateProxy
from tilesmith.agent.llm.proxy_config import load_user_config
from tilesmith.agent.llm.sandbox import prepare as prepare_sandbox
from tilesmith.agent.llm.skills import load_skills
from tilesmith.agent.llm.transport import PLACEHOLDER_KEY, http_clients
from tilesmith.agent.protocol import Session
from tilesmith.errors import ProxyError, SettingsError
from tilesmith.records import Diagnostic

AGENCIES = ("low", "medium", "high")


def _stop_proxy(holder: dict) -> None:
    proxy = holder.get("proxy")
    if proxy is not None:
        proxy.stop()


class LLMOptimizer:
    """The optimizer of one graph: runs :func:`~.loop.run_outer_loop` against the session."""

    def __init__(self, factory: LLMOptimizerFactory, runtime: AgentRuntime) -> None:
        self.name = f"llm:{factory.model}"
        self._factory = factory
        self._runtime = runtime
        self.stop_reason: str | None = None

    def optimize(self, session: Session) -> None:
        """Run agent turns until the stop rule ends them (see :mod:`.loop`); never raises for agent,
        model or proxy failures — they become :meth:`Session.note` diagnostics."""
        self._factory._current_session = session
        try:
            self.stop_reason = run_outer_loop(session, self._runtime)
        finally:
            self._factory._current_session = None


class LLMOptimizerFactory:
    """Makes one :class:`LLMOptimizer` per graph and owns the run's proxy, chat model and budget.

    Args:
        agent_model: model id the proxy must list; ``None`` uses ``TILESMITH_MODEL``.
        agency: ``"low"``, ``"medium"`` (default) or ``"high"``.
        max_model_calls: exact budget of model invocations for the whole run (all graphs, main agents
            and subagents); ``None`` = no limit.
        run_dir: the run folder (``runs/<run-id>/``); nothing secret is written there.
        debug: keep per-turn traces under each track's ``traces/``; ``None`` reads ``TILESMITH_DEBUG``.
        environ: environment snapshot (default: a copy of ``os.environ`` taken now).
        streaming: request server-sent events from the proxy (tests of the streaming path only; the
            product runs with streaming off).

    Raises:
        ValueError: agency not in low/medium/high, or a negative/non-integer ``max_model_calls``.
    """

    name = "llm"

    def __init__(self, agent_model: str | None = None, agency: str = "medium", max_model_calls: int | None = None,
                 run_dir: str | Path | None = None, debug: bool | None = None, *,
                 environ: Mapping[str, str] | None = None, streaming: bool = False,
                 start_timeout_s: float | None = None) -> None:
        if agency not in AGENCIES:
            raise ValueError(f"agency must be one of {', '.join(AGENCIES)}; got {agency!r}")
        self._environ = dict(os.environ if environ is None else environ)
        self.model = resolve_model(agent_model, self._environ)
        self.agency = agency
        self.budget = ModelCallBudget(max_model_calls)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.debug = bool(settings.get("TILESMITH_DEBUG", self._environ) if debug is None else debug)
        self.streaming = streaming
        self._start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._holder: dict = {}
        self._finalizer = weakref.finalize(self, _stop_proxy, self._holder)
        self._runtime: AgentRuntime | None = None
        self._unavailable: AgentUnavailable | None = None
        self._current_session: Session | None = None
        self._closed = False

    @property
    def proxy(self) -> PrivateProxy | None:
        """The run's proxy once started (``None`` before the first ``for_graph``)."""
        return self._holder.get("proxy")

    # -- OptimizerFactory -----------------------------------------------------------------------
    def for_graph(self, session: Session) -> LLMOptimizer:
        """Start the proxy if this is the run's first graph, check the model, return the graph's optimizer.

        Raises:
            UnknownModelError: the proxy does not list the model (diagnostic ``unknown_model`` lists
                the models it offers).
            ProxyStartError: the proxy could not start (diagnostic ``proxy_failed``).
            AgentUnavailable: no model name, executable or credentials (diagnostic ``missing_*``).
        """
        with self._lock:
            if self._closed:
                raise ProxyError("this LLMOptimizerFactory was closed")
            if self._unavailable is not None:
                raise self._with_graph(self._unavailable, session)
            if self._runtime is None:
                try:
                    self._runtime = self._start()
                except AgentUnavailable as exc:
                    self._unavailable = exc
                    raise self._with_graph(exc, session) from None
            return LLMOptimizer(self, self._runtime)

    def calls_used(self) -> tuple[int, int | None]:
        """``(model invocations used so far in this run, max_model_calls or None)`` for the progress display."""
        return self.budget.used, self.budget.limit

    def close(self) -> None:
        """Stop the proxy and delete its private directory (idempotent)."""
        with self._lock:
            self._closed = True
            self._finalizer()

    # -- internals ------------------------------------------------------------------------------
    @staticmethod
    def _with_graph(exc: AgentUnavailable, session: Session) -> AgentUnavailable:
        d = exc.diagnostic
        diag = Diagnostic(kind=d.kind, message=d.message, graph_key=getattr(session, "graph_key", None),
                          graph_name=getattr(getattr(session, "graph", None), "name", None))
        if isinstance(exc, UnknownModelError):
            return UnknownModelError(diag, exc.offered)
        if isinstance(exc, ProxyStartError):
            return ProxyStartError(diag)
        return AgentUnavailable(diag)

    def _start(self) -> AgentRuntime:
        avail = check_availability(self.model, self._environ)
        if not avail.ok:
            raise AgentUnavailable(avail.diagnostic())
        assert avail.executable is not None and self.model is not None
        try:
            skills = load_skills(self._environ)
        except SettingsError as exc:
            raise AgentUnavailable(Diagnostic(kind="invalid_skills", message=str(exc))) from None
        config_path, _ = find_user_config(self._environ)
        user_cfg = load_user_config(config_path) if config_path is not None else None
        auth_dir = find_auth_dir(self._environ, user_cfg)
        proxy = PrivateProxy(executable=avail.executable, model=self.model, environ=self._environ,
                             user_config=config_path, auth_dir=auth_dir,
                             start_timeout_s=self._start_timeout_s)
        self._holder["proxy"] = proxy
        note_restart = weakref.WeakMethod(self._note_restart)  # the finalizer's holder must not keep us alive
        proxy.on_restart = lambda message: (method := note_restart()) is not None and method(message)
        proxy.start()  # ProxyStartError carries its diagnostic
        if self.model not in proxy.models:
            offered = proxy.models
            shown = ", ".join(offered[:60]) + (f", … ({len(offered)} in all)" if len(offered) > 60 else "")
            message = (f"The private CLIProxyAPI does not offer model {self.model!r}. It offers: "
                       f"{shown or 'no models (check the credentials and the config)'}. Pass one of them as "
                       "agent_model= or TILESMITH_MODEL, or add the model to your CLIProxyAPI config.")
            proxy.stop()
            raise UnknownModelError(Diagnostic(kind="unknown_model", message=message), offered)
        timeout_s = settings.get("TILESMITH_AGENT_REQUEST_TIMEOUT_S", self._environ)
        sync_client, async_client = http_clients(proxy, timeout_s)
        chat = BudgetedChatOpenAI(
            model=self.model, base_url=proxy.base_url, api_key=PLACEHOLDER_KEY, use_responses_api=False,
            streaming=self.streaming, disable_streaming=not self.streaming, stream_usage=True,
            max_retries=settings.get("TILESMITH_AGENT_MAX_RETRIES", self._environ), timeout=timeout_s,
            max_tokens=settings.get("TILESMITH_MAX_OUTPUT_TOKENS", self._environ),
            http_client=sync_client, http_async_client=async_client,
            organization=None, openai_proxy=None,  # OPENAI_ORG_ID/OPENAI_PROXY of the shell do not apply
        ).bind_budget(self.budget)
        worker_timeout = settings.get("TILESMITH_WORKER_TIMEOUT_S", self._environ)
        sandbox, unavailable = None, None
        if settings.get("TILESMITH_GPU_SHELL", self._environ):
            forbidden = [Path.home(), self._environ.get("HOME"), auth_dir, config_path, proxy.private_dir,
                         settings.cache_root(self._environ)]
            sandbox, status = prepare_sandbox(self._environ, [str(p) for p in forbidden if p])
            unavailable = None if status.ok else status.reason
        debug = self.debug
        return AgentRuntime(
            chat_model=chat, budget=self.budget, redactor=proxy.redactor, agency=self.agency,
            proposer=f"llm:{self.model}", min_improvement=settings.get("TILESMITH_MIN_IMPROVEMENT", self._environ),
            debug=self.debug,
            profile=lambda session, path: profile_source(path, getattr(session, "graph", None), worker_timeout),
            sandbox=sandbox, shell_unavailable=unavailable, skills=skills,
            live_sink=lambda text: progress.default().trace(text, force=debug),
        )

    def _note_restart(self, message: str) -> None:
        session = self._current_session
        if session is not None:
            session.note("proxy_restarted", message)
