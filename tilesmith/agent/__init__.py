"""Optimizers: what proposes candidates (``builtin/`` without an LLM, ``llm/`` through the proxy).

:func:`make_factory` picks the run's :class:`~tilesmith.agent.protocol.OptimizerFactory` from
``agent_model``: ``"tilesmith/builtin"`` is the built-in agent, any other string is a model served by the
private CLIProxyAPI, and an object with ``for_graph``/``close`` is used as given (scripted optimizers,
custom search strategies).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BUILTIN_MODEL = "tilesmith/builtin"


def is_factory(value: Any) -> bool:
    """True for an object usable as an ``OptimizerFactory`` (has ``for_graph`` and ``close``)."""
    return callable(getattr(value, "for_graph", None)) and callable(getattr(value, "close", None))


def make_factory(options: Any, run_dir: Path) -> Any:
    """The optimizer factory for a run's options (``tilesmith.pipeline.RunOptions``)."""
    from tilesmith import settings

    if is_factory(options.agent_model):
        return options.agent_model
    if options.agent_model == BUILTIN_MODEL:
        from tilesmith.agent.builtin import BuiltinOptimizerFactory

        return BuiltinOptimizerFactory(agency=options.agency, max_model_calls=options.max_model_calls)
    from tilesmith.agent.llm import LLMOptimizerFactory

    return LLMOptimizerFactory(agent_model=options.agent_model, agency=options.agency,
                               max_model_calls=options.max_model_calls, run_dir=run_dir,
                               debug=settings.get("TILESMITH_DEBUG"))
