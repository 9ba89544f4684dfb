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


#: Names a user may type for the built-in agent (compared lower-case, without spaces): not models any proxy serves.
_BUILTIN_LOOKALIKES = {"builtin", "built-in", "built_in", "tilesmith", "tilesmith-builtin", "tilesmith_builtin",
                       "tilesmith:builtin", "tilesmith.builtin"}


def check_model_name(name: str, source: str) -> None:
    """Refuse a model name that is a misspelling of the built-in agent's (``tilesmith/…`` other than
    ``tilesmith/builtin``, or a bare ``builtin``): it would otherwise be sent to the LLM proxy and fall back to
    plain torch.compile with only a ``missing_proxy`` diagnostic (new-user trial, session 19).

    Raises:
        ValueError: the message names ``source`` (the argument or variable) and the right spelling.
    """
    folded = name.strip().lower().replace(" ", "")
    if folded == BUILTIN_MODEL and name != BUILTIN_MODEL:
        raise ValueError(f"{source}={name!r}: the built-in agent is spelled {BUILTIN_MODEL!r} exactly")
    if folded != BUILTIN_MODEL and (folded.startswith("tilesmith/") or folded in _BUILTIN_LOOKALIKES):
        raise ValueError(f"{source}={name!r} is not a model Tilesmith knows: did you mean {BUILTIN_MODEL!r} (the "
                         f"built-in agent)? An LLM is named as the private proxy lists it, e.g. 'gpt-5.5'.")


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
