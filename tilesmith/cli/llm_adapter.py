"""The one place the command line touches the LLM runtime (``tilesmith.agent.llm``).

The proxy lifecycle is owned by ``tilesmith.agent.llm``. ``tilesmith doctor`` needs two things from it:

* :func:`availability` — ``check_availability(agent_model)`` (no process started);
* :func:`probe_proxy` — start the private proxy once, list its models, stop it.

Both degrade gracefully when the runtime (or one of its optional dependencies) is missing or older than
this command line: the caller gets ``None`` plus a reason instead of an exception, and ``doctor`` then
falls back to its own file-system checks.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProbeResult:
    """What starting the private proxy showed: ``models`` it lists, or ``error`` (never a secret)."""

    started: bool
    models: tuple[str, ...] = ()
    error: str | None = None
    detail: str = ""


def _llm_module() -> tuple[Any | None, str | None]:
    try:
        import tilesmith.agent.llm as llm
    except Exception as exc:  # noqa: BLE001 - any import failure means "runtime unavailable"
        return None, f"tilesmith.agent.llm could not be imported ({type(exc).__name__}: {exc})"
    return llm, None


def availability(agent_model: str | None) -> tuple[Any | None, str | None]:
    """``(Availability, None)`` from ``tilesmith.agent.llm.check_availability``, or ``(None, reason)``."""
    llm, problem = _llm_module()
    fn = getattr(llm, "check_availability", None) if llm is not None else None
    if fn is None:
        try:
            from tilesmith.agent.llm.discovery import check_availability as fn  # type: ignore[no-redef]
        except Exception as exc:  # noqa: BLE001
            return None, problem or f"check_availability is not available ({type(exc).__name__}: {exc})"
    try:
        return fn(agent_model), None
    except Exception as exc:  # noqa: BLE001 - e.g. SettingsError; reported by doctor's settings check too
        return None, f"check_availability failed: {type(exc).__name__}: {exc}"


def probe_proxy(agent_model: str | None, timeout_s: float = 30.0) -> ProbeResult | None:
    """Start the private proxy, list its models, stop it. ``None`` when the runtime offers no way to.

    Uses ``tilesmith.agent.llm.probe_proxy(agent_model=..., timeout_s=...)`` when the runtime offers it
    (an object with ``models`` and optionally ``error``); else starts
    ``tilesmith.agent.llm.proxy.PrivateProxy`` with the executable, config and auth dir that
    ``tilesmith.agent.llm.discovery`` finds, reads its ``models`` and stops it.
    """
    llm, _ = _llm_module()
    if llm is None:
        return None
    probe = getattr(llm, "probe_proxy", None)
    if callable(probe):
        try:
            result = _call_with_supported(probe, agent_model=agent_model, timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001
            return ProbeResult(False, error=f"{type(exc).__name__}: {exc}")
        models = tuple(str(m) for m in (getattr(result, "models", None) or ()))
        error = getattr(result, "error", None)
        started = bool(getattr(result, "started", error is None))
        return ProbeResult(started, models, str(error) if error else None, str(getattr(result, "detail", "") or ""))
    return _probe_private_proxy(agent_model, timeout_s)


def _probe_private_proxy(agent_model: str | None, timeout_s: float) -> ProbeResult | None:
    """Start ``tilesmith.agent.llm.proxy.PrivateProxy`` as a run would, read its model list, stop it."""
    import os

    try:
        from tilesmith.agent.llm import discovery
        from tilesmith.agent.llm.proxy import PrivateProxy
    except Exception:  # noqa: BLE001 - runtime absent or older: no probe
        return None
    try:
        executable, note = discovery.find_executable()
        if executable is None:
            return ProbeResult(False, error=note)
        config, problem = discovery.find_user_config()
        if problem:
            return ProbeResult(False, error=problem)
        proxy = _call_with_supported(PrivateProxy, executable=executable, model=agent_model or "",
                                     environ=dict(os.environ), user_config=config,
                                     auth_dir=discovery.find_auth_dir(), start_timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001
        return ProbeResult(False, error=f"{type(exc).__name__}: {exc}")
    try:
        proxy.start()
        models = tuple(str(m) for m in getattr(proxy, "models", ()) or ())
        version = getattr(proxy, "version", None)
        return ProbeResult(True, models, None, f"CLIProxyAPI {version}" if version else "")
    except Exception as exc:  # noqa: BLE001
        return ProbeResult(False, error=f"{type(exc).__name__}: {exc}")
    finally:
        try:
            proxy.stop()
        except Exception:  # noqa: BLE001
            pass


def _call_with_supported(fn: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature accepts."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(**kwargs)
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})
