"""The LLM agent runtime: a private CLIProxyAPI, one deepagents agent per graph, an outer LangGraph loop.

Public interface (used by the pipeline)::

    from tilesmith.agent.llm import LLMOptimizerFactory, check_availability, Availability, AgentUnavailable
    avail = check_availability(agent_model)            # cheap; no process started
    factory = LLMOptimizerFactory(agent_model=..., agency=..., max_model_calls=..., run_dir=..., debug=...)
    optimizer = factory.for_graph(session)             # may raise AgentUnavailable (.diagnostic)
    optimizer.optimize(session)
    factory.close()

Importing this package does not import deepagents or langchain; they load with the factory module.
See docs/agent.md for the lifecycle, the budget, the stop rule and the traces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tilesmith.agent.llm.discovery import Availability, check_availability
from tilesmith.agent.llm.errors import AgentUnavailable, ProxyStartError, UnknownModelError

if TYPE_CHECKING:
    from tilesmith.agent.llm.factory import LLMOptimizer, LLMOptimizerFactory

__all__ = [
    "AgentUnavailable",
    "Availability",
    "LLMOptimizer",
    "LLMOptimizerFactory",
    "ProxyStartError",
    "UnknownModelError",
    "check_availability",
]


def __getattr__(name: str) -> Any:
    if name in ("LLMOptimizerFactory", "LLMOptimizer"):
        from tilesmith.agent.llm import factory

        return getattr(factory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
