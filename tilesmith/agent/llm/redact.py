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
* :class:`Redactor` and :func:`secret_values` — the one secret rule, in :mod:`tilesmith.secrets`.
"""

from __future__ import annotations

from collections.abc import Mapping

from tilesmith.secrets import is_secret, secret_values

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
        if not allowed or is_secret(name, value):
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
