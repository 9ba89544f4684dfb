"""Exceptions Tilesmith raises. Verdicts and diagnostics are values, not exceptions.

::

    TilesmithError                     base of everything below
    ├── SettingsError (ValueError)     an environment variable holds an invalid value
    ├── ProxyError                     the private CLIProxyAPI process could not start or answer
    ├── BudgetExhausted                max_model_calls permits no further model invocation
    └── WorkerError                    a gate worker died, hung or broke protocol (host side only)

Argument errors of :func:`tilesmith.compile` are plain ``TypeError``/``ValueError``: they are caller
mistakes, and every message names the allowed values.
"""

from __future__ import annotations


class TilesmithError(Exception):
    """Base class of Tilesmith's exceptions."""


class SettingsError(TilesmithError, ValueError):
    """An environment variable holds a value its parser rejects."""


class ProxyError(TilesmithError):
    """The private CLIProxyAPI process could not be started, became unhealthy or refused a request."""


class BudgetExhausted(TilesmithError):
    """The exact model-call budget (``max_model_calls``) is spent; no request was sent."""


class WorkerError(TilesmithError):
    """A gate worker process died, hung or answered outside the protocol."""


class TilesmithWarning(UserWarning):
    """Warned (once per call site, Python's default filter) when ``tilesmith.compile`` falls back to plain
    ``torch.compile`` — the diagnostic says which piece was missing — or when ``tilesmith.diagnostics``,
    ``benchmarks`` or ``wait`` get an object Tilesmith did not compile. ``warnings.filterwarnings("ignore",
    category=tilesmith.errors.TilesmithWarning)`` silences both."""

