"""The private per-run CLIProxyAPI config: the user's provider and routing settings plus exported keys.

Source of the field names: CLIProxyAPI v7.2.140 ``internal/config/config.go`` and
``config.example.yaml`` (https://github.com/router-for-me/CLIProxyAPI), checked against the binary by
``tests/test_proxy_real.py``.

What is kept from the user's YAML: everything except the keys in :data:`SERVER_KEYS`, which Tilesmith
replaces (host, port, client key, management) or turns off (logging to files, request logs, pprof,
plugins, usage statistics, cooldown files, the control-panel download). Retry and cooldown settings are
kept when the user set them; otherwise :data:`ROUTING_DEFAULTS` apply.

Provider variables (values are secrets: they are written only into the 0600 config file inside the
run's 0700 private directory, never logged):

=====================================  =========================================================
variable                               section written
=====================================  =========================================================
``ANTHROPIC_API_KEY``                  ``claude-api-key: [{api-key}]`` (built-in Claude catalog)
``GEMINI_API_KEY`` / ``GOOGLE_API_KEY``  ``gemini-api-key: [{api-key}]`` (built-in Gemini catalog)
``VERTEX_API_KEY``                     ``vertex-api-key: [{api-key}]`` (built-in Vertex catalog)
``XAI_API_KEY``                        ``xai-api-key: [{api-key, base-url: https://api.x.ai/v1}]``
``OPENAI_API_KEY``                     ``openai-compatibility: [{name: openai, base-url:
                                       https://api.openai.com/v1, api-key-entries, models}]``
``OPENROUTER_API_KEY``                 ``openai-compatibility: [{name: openrouter, base-url:
                                       https://openrouter.ai/api/v1, api-key-entries, models}]``
``TILESMITH_API_KEY`` + ``_BASE_URL``  ``openai-compatibility: [{name: tilesmith, base-url, ...}]``
=====================================  =========================================================

``openai-compatibility`` entries only serve the models they list, so the requested model is listed in
exactly one of them, chosen by :func:`route_model`; a native section that would also serve it gets the
model in ``excluded-models`` so one route answers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from tilesmith.errors import ProxyError

OPENAI_BASE_URL = "https://api.openai.com/v1"
OPENROUTER_BASE_URL = "https://openrouter.ai/api/v1"
XAI_BASE_URL = "https://api.x.ai/v1"

PROVIDER_SECTIONS = (
    "gemini-api-key", "interactions-api-key", "codex-api-key", "xai-api-key", "claude-api-key",
    "openai-compatibility", "vertex-api-key",
)
"""Top-level YAML keys that hold provider credentials (lists of entries)."""

SERVER_KEYS = (
    "host", "port", "tls", "remote-management", "api-keys", "auth-dir", "debug", "pprof", "commercial-mode",
    "logging-to-file", "logs-max-total-size-mb", "error-logs-max-files", "request-log",
    "usage-statistics-enabled", "redis-usage-queue-retention-seconds", "plugins", "save-cooldown-status",
    "ws-auth", "home",
)
"""Keys of the user's YAML that Tilesmith drops and replaces: server, management, logging, storage."""

ROUTING_DEFAULTS: dict[str, Any] = {
    "request-retry": 0,                    # the OpenAI client owns retries (inside one invocation)
    "max-retry-interval": 0,
    "disable-cooling": True,               # one key: no 60 s blackout after one 5xx/429
    "transient-error-cooldown-seconds": -1,
}
"""Applied only when the user's YAML does not set them."""

_NATIVE_FAMILIES = (
    ("claude", ("ANTHROPIC_API_KEY",), "claude-api-key"),
    ("gemini", ("GEMINI_API_KEY", "GOOGLE_API_KEY"), "gemini-api-key"),
    ("gemini", ("VERTEX_API_KEY",), "vertex-api-key"),
    ("grok", ("XAI_API_KEY",), "xai-api-key"),
)


def load_user_config(path: Path) -> dict[str, Any]:
    """Parse the user's CLIProxyAPI YAML (an empty file is an empty mapping).

    Raises:
        ProxyError: the file cannot be read or is not a YAML mapping (message names the file).
    """
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ProxyError(f"cannot read CLIProxyAPI config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ProxyError(f"CLIProxyAPI config {path} is not valid YAML{where}; fix it or unset "
                         "TILESMITH_CLIPROXYAPI_CONFIG") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ProxyError(f"CLIProxyAPI config {path} is not a YAML mapping")
    return data


def _value(env: dict[str, str], name: str) -> str | None:
    raw = env.get(name)
    return raw.strip() if raw and raw.strip() else None


def env_credential_sources(environ: dict[str, str]) -> list[str]:
    """Names (never values) of the provider variables set, as ``"env:NAME"``.

    Raises:
        ProxyError: ``TILESMITH_API_KEY`` without ``TILESMITH_API_BASE_URL`` or the reverse.
    """
    names = [f"env:{n}" for n in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY",
                                  "XAI_API_KEY", "VERTEX_API_KEY", "OPENROUTER_API_KEY") if _value(environ, n)]
    key, url = _value(environ, "TILESMITH_API_KEY"), _value(environ, "TILESMITH_API_BASE_URL")
    if key and not url:
        raise ProxyError("TILESMITH_API_KEY is set but TILESMITH_API_BASE_URL is not: set it to the endpoint's "
                         "base URL including /v1 (e.g. http://localhost:8000/v1)")
    if url and not key:
        raise ProxyError("TILESMITH_API_BASE_URL is set but TILESMITH_API_KEY is not: set the endpoint's key "
                         "(any non-empty value for an endpoint without authentication)")
    if key and url:
        names.append("env:TILESMITH_API_KEY")
    return names


def config_credential_sources(user_cfg: dict[str, Any]) -> list[str]:
    """``"config:<section>"`` for each provider section of the user's YAML with at least one entry."""
    return [f"config:{s}" for s in PROVIDER_SECTIONS if isinstance(user_cfg.get(s), list) and user_cfg.get(s)]


def route_model(model: str, environ: dict[str, str]) -> str | None:
    """Which provider variable serves ``model`` when several are exported.

    Order: ``TILESMITH_API_KEY`` (the user's explicit endpoint); the native family by name prefix
    (``claude*`` → Anthropic, ``gemini*`` → Gemini, then Vertex, ``grok*`` → xAI) when its key is set;
    ``OPENROUTER_API_KEY`` for ``vendor/model`` names; ``OPENAI_API_KEY``; ``OPENROUTER_API_KEY``.
    Returns the variable name, or ``None`` when no exported key serves it (the user's YAML or
    accounts may still).
    """
    if _value(environ, "TILESMITH_API_KEY") and _value(environ, "TILESMITH_API_BASE_URL"):
        return "TILESMITH_API_KEY"
    lowered = model.lower()
    for prefix, variables, _section in _NATIVE_FAMILIES:
        if lowered.startswith(prefix):
            for var in variables:
                if _value(environ, var):
                    return var
    if "/" in model and _value(environ, "OPENROUTER_API_KEY"):
        return "OPENROUTER_API_KEY"
    if _value(environ, "OPENAI_API_KEY"):
        return "OPENAI_API_KEY"
    if _value(environ, "OPENROUTER_API_KEY"):
        return "OPENROUTER_API_KEY"
    return None


def env_provider_sections(environ: dict[str, str], model: str) -> dict[str, list[dict[str, Any]]]:
    """Config sections for the exported provider variables (see the module table).

    Raises:
        ProxyError: incomplete ``TILESMITH_API_*`` pair.
    """
    env_credential_sources(environ)  # validates the TILESMITH_API_* pair
    route = route_model(model, environ)
    sections: dict[str, list[dict[str, Any]]] = {}

    def native(section: str, entry: dict[str, Any], variable: str) -> None:
        family = next(p for p, v, s in _NATIVE_FAMILIES if s == section and variable in v)
        if route not in (None, variable) and model.lower().startswith(family):
            entry["excluded-models"] = [model]
        sections.setdefault(section, []).append(entry)

    if key := _value(environ, "ANTHROPIC_API_KEY"):
        native("claude-api-key", {"api-key": key}, "ANTHROPIC_API_KEY")
    gemini: dict[str, str] = {}  # key value -> first variable holding it (both set to one key: one entry)
    for variable in ("GEMINI_API_KEY", "GOOGLE_API_KEY"):
        if (key := _value(environ, variable)) and key not in gemini:
            gemini[key] = variable
    for key, variable in gemini.items():
        native("gemini-api-key", {"api-key": key}, variable)
    if key := _value(environ, "VERTEX_API_KEY"):
        native("vertex-api-key", {"api-key": key}, "VERTEX_API_KEY")
    if key := _value(environ, "XAI_API_KEY"):
        native("xai-api-key", {"api-key": key, "base-url": XAI_BASE_URL}, "XAI_API_KEY")

    compat = (
        ("OPENAI_API_KEY", "openai", OPENAI_BASE_URL),
        ("OPENROUTER_API_KEY", "openrouter", OPENROUTER_BASE_URL),
        ("TILESMITH_API_KEY", "tilesmith", _value(environ, "TILESMITH_API_BASE_URL")),
    )
    for variable, name, base_url in compat:
        key = _value(environ, variable)
        if key and base_url and route == variable:
            sections.setdefault("openai-compatibility", []).append({
                "name": name, "base-url": base_url.rstrip("/"), "api-key-entries": [{"api-key": key}],
                "models": [{"name": model}],
            })
    return sections


def build_private_config(user_cfg: dict[str, Any] | None, env_sections: dict[str, list[dict[str, Any]]], *,
                         port: int, client_key: str, auth_dir: Path) -> dict[str, Any]:
    """The YAML mapping the private proxy runs with.

    Args:
        user_cfg: the user's YAML (``None`` when there is none); not modified.
        env_sections: :func:`env_provider_sections`; entries are appended after the user's.
        port: loopback port to bind.
        client_key: the random per-run key clients must present (never one of CLIProxyAPI's
            ``your-api-key-N`` templates, which would put the proxy in safe mode).
        auth_dir: directory of OAuth account files (the user's, or an empty private one).
    """
    cfg: dict[str, Any] = {k: v for k, v in (user_cfg or {}).items() if k not in SERVER_KEYS}
    for section, entries in env_sections.items():
        existing = cfg.get(section)
        cfg[section] = (list(existing) if isinstance(existing, list) else []) + [dict(e) for e in entries]
    for key, value in ROUTING_DEFAULTS.items():
        cfg.setdefault(key, value)
    cfg.update({
        "host": "127.0.0.1",
        "port": int(port),
        "api-keys": [client_key],
        "auth-dir": str(auth_dir),
        "remote-management": {"allow-remote": False, "secret-key": "", "disable-control-panel": True,
                              "disable-auto-update-panel": True},
        "debug": False,
        "request-log": False,
        "logging-to-file": False,
        "usage-statistics-enabled": False,
        "save-cooldown-status": False,
        "pprof": {"enable": False},
        "tls": {"enable": False},
        "plugins": {"enabled": False},
    })
    return cfg


def write_private_config(cfg: dict[str, Any], path: Path) -> None:
    """Write ``cfg`` as YAML to ``path`` with mode 0600 (created exclusively or replaced)."""
    text = yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(path, 0o600)
