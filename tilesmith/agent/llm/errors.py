"""Exceptions of the LLM agent runtime that carry a ready :class:`~tilesmith.records.Diagnostic`.

The pipeline catches :class:`AgentUnavailable` around ``factory.for_graph(session)`` and records
``exc.diagnostic``; the graph then stays on ordinary Inductor (or whatever fallback the pipeline picks).
"""

from __future__ import annotations

from tilesmith.errors import ProxyError, TilesmithError
from tilesmith.records import Diagnostic


class AgentUnavailable(TilesmithError):
    """The LLM agent cannot optimize this run's graphs; :attr:`diagnostic` says why and what to do."""

    def __init__(self, diagnostic: Diagnostic) -> None:
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


class UnknownModelError(AgentUnavailable):
    """The proxy does not list the requested model (diagnostic kind ``"unknown_model"``).

    :attr:`offered` holds the model ids ``/v1/models`` returned, sorted.
    """

    def __init__(self, diagnostic: Diagnostic, offered: tuple[str, ...]) -> None:
        super().__init__(diagnostic)
        self.offered = offered


class ProxyStartError(AgentUnavailable, ProxyError):
    """The private CLIProxyAPI did not start or answer (diagnostic kind ``"proxy_failed"``)."""
