"""Keeping secrets out of child environments, traces and messages.

Secrets are provider keys (:data:`tilesmith.settings.PROVIDER_KEY_VARIABLES`), the private proxy's
per-run client key and keep-alive password, and any environment value whose *name* says it is a
credential (``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ``*CREDENTIAL*``).

* :func:`tool_env` — environment for subprocesses the agent's tools start (profiling): an allowlist of
  what Python, PyTorch, Triton and CUDA need, minus anything secret-looking.
* :func:`proxy_env` — environment for the CLIProxyAPI child: ``PATH``, locale, TLS roots and outbound
  proxy settings only; ``HOME``/``TMPDIR`` point into the private run directory. CLIProxyAPI's storage
  and mode switches (``PGSTORE_*``, ``GITSTORE_*``, ``OBJECTSTORE_*``, ``HOME_JWT``, ``DEPLOY``,
  ``WRITABLE_PATH``, ``MANAGEMENT_*``) are therefore never passed.
* :class:`Redactor` — replaces known secret values in any text with ``<redacted>``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping

from tilesmith.settings import PROVIDER_KEY_VARIABLES

REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE|SESSION", re.IGNORECASE)
_MIN_SECRET_LEN = 8
"""Shorter values are not treated as secrets (they would mangle ordinary words); real keys are far longer."""

_TOOL_ENV_EXACT = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP", "SHELL",
    "PYTHONPATH", "PYTHONHASHSEED", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH", "LIBRARY_PATH",
    "CPATH", "CC", "CXX", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "XDG_CACHE_HOME", "TILESMITH_ALLOW_CPU",
    "TILESMITH_CACHE_DIR",
})
_TOOL_ENV_PREFIXES = ("LC_", "CUDA", "NVIDIA_", "NCCL_", "TORCH", "TRITON_", "PYTORCH_", "HIP_", "ROCM_")

_PROXY_ENV_EXACT = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ", "SSL_CERT_FILE", "SSL_CERT_DIR", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
    "NO_PROXY", "http_proxy", "https_proxy", "all_proxy", "no_proxy",
})


def secret_values(environ: Mapping[str, str]) -> tuple[str, ...]:
    """Values of provider variables and of variables whose name looks like a credential."""
    out: list[str] = []
    for name, value in environ.items():
        if not value or len(value.strip()) < _MIN_SECRET_LEN:
            continue
        if name in PROVIDER_KEY_VARIABLES or _SECRET_NAME.search(name):
            out.append(value.strip())
    return tuple(dict.fromkeys(out))


def tool_env(environ: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a tool subprocess: allowlisted names only, no credential names, no secret values.

    Args:
        environ: the host environment (usually ``os.environ``).
        extra: values to set on top (checked like the rest).
    """
    secrets = set(secret_values(environ))
    out: dict[str, str] = {}
    merged = {**environ, **(extra or {})}
    for name, value in merged.items():
        allowed = name in _TOOL_ENV_EXACT or name.startswith(_TOOL_ENV_PREFIXES)
        if not allowed or _SECRET_NAME.search(name) or name in PROVIDER_KEY_VARIABLES:
            continue
        if any(s in value for s in secrets):
            continue
        out[name] = value
    return out


def proxy_env(environ: Mapping[str, str], *, home: str, tmpdir: str) -> dict[str, str]:
    """Environment for the CLIProxyAPI child process (see the module docstring)."""
    out = {name: environ[name] for name in _PROXY_ENV_EXACT if environ.get(name)}
    out.setdefault("PATH", "/usr/bin:/bin")
    out["HOME"] = home
    out["TMPDIR"] = tmpdir
    return out


class Redactor:
    """Replaces every registered secret value in a text with ``<redacted>`` (thread-safe).

    Values shorter than 8 characters are ignored. Longer values are replaced first, so a secret that
    contains another is removed whole.
    """

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: tuple[str, ...] = ()
        self.add(*values)

    def add(self, *values: str) -> None:
        with self._lock:
            merged = set(self._values)
            merged.update(v.strip() for v in values if v and len(v.strip()) >= _MIN_SECRET_LEN)
            self._values = tuple(sorted(merged, key=len, reverse=True))

    @property
    def values(self) -> tuple[str, ...]:
        return self._values

    def __call__(self, text: str) -> str:
        for value in self._values:
            if value in text:
                text = text.replace(value, REDACTED)
        return text

    def contains_secret(self, text: str) -> bool:
        return any(v in text for v in self._values)
