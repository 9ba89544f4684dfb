"""Find what the LLM agent needs — a model name, the CLIProxyAPI executable, credentials — without
starting anything.

:func:`check_availability` is what the pipeline calls before choosing the LLM agent: it reads the
environment, looks for files and parses the user's YAML, and answers an :class:`Availability` whose
``message`` names the missing piece and how to supply it. It never starts a process (Homebrew's prefix
is found from ``HOMEBREW_PREFIX`` and the standard prefixes, not by running ``brew --prefix``).

Detection rules (docs/agent.md, "Finding the pieces"):

* executable: ``TILESMITH_CLIPROXYAPI_EXECUTABLE``, else ``cliproxyapi`` then ``cli-proxy-api`` on ``PATH``;
* auth dir (OAuth account files): ``TILESMITH_CLIPROXYAPI_AUTH_DIR``, else ``~/.cli-proxy-api``;
* config: ``TILESMITH_CLIPROXYAPI_CONFIG``, else ``<prefix>/etc/cliproxyapi.conf`` for the Homebrew
  prefixes ``$HOMEBREW_PREFIX``, ``/opt/homebrew``, ``/usr/local``, ``/home/linuxbrew/.linuxbrew``;
* credentials: at least one of — a provider key variable (see :mod:`.proxy_config`), a ``*.json``
  account file in the auth dir, a provider entry in the config.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tilesmith import settings
from tilesmith.agent.llm.proxy_config import config_credential_sources, env_credential_sources, load_user_config
from tilesmith.errors import ProxyError
from tilesmith.records import Diagnostic

EXECUTABLE_NAMES = ("cliproxyapi", "cli-proxy-api")
"""Names searched on ``PATH``: Homebrew installs ``cliproxyapi``, release archives ``cli-proxy-api``."""

HOMEBREW_PREFIXES = ("/opt/homebrew", "/usr/local", "/home/linuxbrew/.linuxbrew")
"""Homebrew prefixes on Apple Silicon, Intel macOS and Linux (``brew --prefix`` answers one of these)."""

_INSTALL_HINT = ("install it with `brew install cliproxyapi`, a release archive from "
                 "github.com/router-for-me/CLIProxyAPI, or scripts/build-cliproxyapi.sh, then put it on PATH "
                 "or set TILESMITH_CLIPROXYAPI_EXECUTABLE to its path")

_CREDENTIALS_HINT = ("export a provider key (OPENAI_API_KEY, ANTHROPIC_API_KEY, GEMINI_API_KEY or GOOGLE_API_KEY, "
                     "XAI_API_KEY, VERTEX_API_KEY, OPENROUTER_API_KEY, or TILESMITH_API_KEY together with "
                     "TILESMITH_API_BASE_URL for any OpenAI-compatible endpoint), log in with CLIProxyAPI "
                     "(`cliproxyapi -claude-login`, `-codex-login` …) so account files appear in ~/.cli-proxy-api, "
                     "or point TILESMITH_CLIPROXYAPI_CONFIG at a CLIProxyAPI YAML with provider sections")


@dataclass(frozen=True)
class Availability:
    """Whether the LLM agent can run, and where its pieces are.

    ``kind`` is ``None`` when ``ok``; otherwise one of ``"missing_model"``, ``"missing_proxy"``,
    ``"missing_credentials"`` (stable diagnostic kinds). ``message`` is written for the user: it names
    the missing piece and how to supply it. Paths are absolute strings. No field ever holds a secret.
    """

    ok: bool
    kind: str | None
    message: str
    model: str | None = None
    executable: str | None = None
    config: str | None = None
    auth_dir: str | None = None
    credential_sources: tuple[str, ...] = ()
    """Where credentials were found, e.g. ``("env:ANTHROPIC_API_KEY", "auth-dir:2 account files")``."""

    def diagnostic(self, graph_key: str | None = None, graph_name: str | None = None) -> Diagnostic | None:
        """The :class:`Diagnostic` for an unavailable agent (``None`` when ``ok``)."""
        if self.ok:
            return None
        return Diagnostic(kind=self.kind or "missing_proxy", message=self.message, graph_key=graph_key,
                          graph_name=graph_name)


def resolve_model(agent_model: str | None, environ: dict[str, str] | None = None) -> str | None:
    """``agent_model`` when given (non-empty), else ``TILESMITH_MODEL``, else ``None``."""
    if agent_model is not None and str(agent_model).strip():
        return str(agent_model).strip()
    value = settings.get("TILESMITH_MODEL", environ)
    return value.strip() if value and value.strip() else None


def find_executable(environ: dict[str, str] | None = None) -> tuple[str | None, str]:
    """Return ``(absolute path or None, explanation)`` for the CLIProxyAPI executable."""
    env = os.environ if environ is None else environ
    explicit = settings.get("TILESMITH_CLIPROXYAPI_EXECUTABLE", env)
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            return None, f"TILESMITH_CLIPROXYAPI_EXECUTABLE={explicit} does not exist; {_INSTALL_HINT}"
        if not os.access(path, os.X_OK):
            return None, f"TILESMITH_CLIPROXYAPI_EXECUTABLE={explicit} is not executable (chmod +x it)"
        return str(path.resolve()), "TILESMITH_CLIPROXYAPI_EXECUTABLE"
    search_path = env.get("PATH", os.defpath)
    for name in EXECUTABLE_NAMES:
        found = shutil.which(name, path=search_path)
        if found:
            return str(Path(found).resolve()), f"{name} on PATH"
    return None, f"CLIProxyAPI not found (no {' or '.join(EXECUTABLE_NAMES)} on PATH); {_INSTALL_HINT}"


def find_auth_dir(environ: dict[str, str] | None = None, user_cfg: dict | None = None) -> Path:
    """The CLIProxyAPI auth dir (may not exist).

    Order: ``TILESMITH_CLIPROXYAPI_AUTH_DIR``; the ``auth-dir`` of the user's YAML; ``~/.cli-proxy-api``
    (CLIProxyAPI's own default, ``internal/config/config_defaults.go``).
    """
    env = os.environ if environ is None else environ
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()

    def expand(text: str) -> Path:
        return home / text[2:] if text.startswith("~/") else (home if text == "~" else Path(text))

    explicit = settings.get("TILESMITH_CLIPROXYAPI_AUTH_DIR", env)
    if explicit:
        return expand(explicit)
    configured = (user_cfg or {}).get("auth-dir")
    if isinstance(configured, str) and configured.strip():
        return expand(configured.strip())
    return home / ".cli-proxy-api"


def find_user_config(environ: dict[str, str] | None = None) -> tuple[Path | None, str | None]:
    """Return ``(path or None, problem or None)`` for the user's CLIProxyAPI YAML.

    An explicit ``TILESMITH_CLIPROXYAPI_CONFIG`` that does not exist is a problem (a typo must not be
    ignored); an absent Homebrew config is not.
    """
    env = os.environ if environ is None else environ
    explicit = settings.get("TILESMITH_CLIPROXYAPI_CONFIG", env)
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            return None, (f"TILESMITH_CLIPROXYAPI_CONFIG={explicit} does not exist; point it at a CLIProxyAPI "
                          "YAML or unset it")
        return path, None
    prefixes = [p for p in (env.get("HOMEBREW_PREFIX"),) if p] + list(HOMEBREW_PREFIXES)
    for prefix in prefixes:
        candidate = Path(prefix) / "etc" / "cliproxyapi.conf"
        if candidate.is_file():
            return candidate, None
    return None, None


def auth_account_files(auth_dir: Path) -> tuple[Path, ...]:
    """OAuth account files (``*.json``) directly in ``auth_dir``; empty when it does not exist."""
    try:
        return tuple(sorted(p for p in auth_dir.glob("*.json") if p.is_file()))
    except OSError:
        return ()


def check_availability(agent_model: str | None = None, environ: dict[str, str] | None = None) -> Availability:
    """Cheap check (no process started) that the LLM agent has a model name, an executable and credentials.

    Args:
        agent_model: the ``compile()`` argument; ``None`` falls back to ``TILESMITH_MODEL``.
        environ: environment to read (default ``os.environ``).

    Returns:
        :class:`Availability`. Whether the proxy actually offers the model is only known once it runs
        (:class:`~tilesmith.agent.llm.errors.UnknownModelError` from ``for_graph``).

    Raises:
        SettingsError: a ``TILESMITH_*`` variable holds an unparsable value.
    """
    env = dict(os.environ if environ is None else environ)
    model = resolve_model(agent_model, env)
    executable, exe_note = find_executable(env)
    config_path, config_problem = find_user_config(env)
    user_cfg: dict = {}
    config_error: str | None = None
    if config_path is not None:
        try:
            user_cfg = load_user_config(config_path)
        except ProxyError as exc:
            config_error = str(exc)
    auth_dir = find_auth_dir(env, user_cfg)
    common = {"model": model, "executable": executable, "config": str(config_path) if config_path else None,
              "auth_dir": str(auth_dir)}
    if model is None:
        return Availability(False, "missing_model",
                            "No optimizer model: pass agent_model=... to tilesmith.compile or set TILESMITH_MODEL "
                            "(a model your CLIProxyAPI lists, or 'tilesmith/builtin' for the built-in agent).",
                            **common)
    if executable is None:
        return Availability(False, "missing_proxy", exe_note, **common)
    if config_problem or config_error:
        return Availability(False, "missing_proxy", config_problem or config_error or "", **common)
    sources: list[str] = []
    try:
        sources.extend(env_credential_sources(env))
    except ProxyError as exc:
        return Availability(False, "missing_credentials", str(exc), **common)
    accounts = auth_account_files(auth_dir)
    if accounts:
        sources.append(f"auth-dir:{len(accounts)} account file{'s' if len(accounts) != 1 else ''}")
    sources.extend(config_credential_sources(user_cfg))
    if not sources:
        return Availability(False, "missing_credentials",
                            f"No model credentials for CLIProxyAPI: {_CREDENTIALS_HINT}.", **common)
    return Availability(True, None, f"LLM agent available: model {model!r} through {executable} "
                                    f"(credentials: {', '.join(sources)})",
                        credential_sources=tuple(sources), **common)
