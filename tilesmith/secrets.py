"""The one rule for what is a secret, and its redaction (gate reports, progress lines and logs, the CLI, the
LLM runtime's traces and tool environments all use it).

A secret is the value of a provider-key variable (:data:`tilesmith.settings.PROVIDER_KEY_VARIABLES`) or of any
environment variable whose name says it is a credential (:data:`SECRET_NAME`: ``KEY``, ``TOKEN``, ``SECRET``,
``PASSWORD``, ``CREDENTIAL``, ``AUTH``, ``COOKIE``, ``SESSION``, ``DSN``, a ``PAT`` or ``PASS`` word …) or whose
value holds a URL with a password (:data:`URL_CREDENTIALS`: ``DATABASE_URL=postgres://user:pw@host``,
``HTTPS_PROXY=http://user:pw@proxy``), at least :data:`MIN_SECRET_LEN` characters long once stripped, plus any
value a component registers (the private proxy's per-run client key and password). Redaction replaces each with
``<redacted>``, longest first, and also anything shaped like a bearer key (:data:`BEARER_KEY`: ``sk-``/``pk-``/
``ak-``/``key-`` followed by ≥ 16 key characters) or like a URL's ``user:password@``.

Red team 18: ``DATABASE_URL``, ``HTTPS_PROXY`` with a password and ``GH_PAT`` passed the name rule of the time, so
they reached the gate's workers, and a candidate that raised the value got it quoted in the verdict text.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Mapping

from tilesmith.settings import PROVIDER_KEY_VARIABLES

REDACTED = "<redacted>"
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE|SESSION|DSN|(?:^|_)(?:PAT|PASS)(?:_|$)",
                         re.IGNORECASE)
MIN_SECRET_LEN = 8
"""Shorter values are not treated as secrets: they would mangle ordinary words, and real keys are far longer."""
BEARER_KEY = re.compile(r"\b(sk|pk|ak|key)-[A-Za-z0-9_\-]{16,}")
#: ``scheme://user:password@``: the credentials part of a URL (RFC 3986 "userinfo" with a password).
URL_CREDENTIALS = re.compile(r"(?<=://)[^/\s:@]+:[^/\s@]+@")


def is_secret_name(name: str) -> bool:
    """Whether an environment variable of this name holds a credential (provider key or credential-like name)."""
    return name in PROVIDER_KEY_VARIABLES or bool(SECRET_NAME.search(name))


def is_secret(name: str, value: str) -> bool:
    """Whether the variable ``name=value`` holds a credential: its name says so, or its value has a URL password."""
    return is_secret_name(name) or bool(URL_CREDENTIALS.search(value or ""))


def secret_values(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The secret values of ``environ`` (default ``os.environ``), stripped, in first-seen order, no duplicates."""
    env = os.environ if environ is None else environ
    out = [value.strip() for name, value in env.items()
           if value and len(value.strip()) >= MIN_SECRET_LEN and is_secret(name, value)]
    return tuple(dict.fromkeys(out))


class Redactor:
    """Replaces every registered secret value in a text with ``<redacted>`` (thread-safe), longest first so a
    secret that contains another is removed whole, then every :data:`BEARER_KEY`-shaped string. Values shorter
    than :data:`MIN_SECRET_LEN` are ignored."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: tuple[str, ...] = ()
        self.add(*values)

    def add(self, *values: str) -> None:
        with self._lock:
            merged = set(self._values)
            merged.update(v.strip() for v in values if v and len(v.strip()) >= MIN_SECRET_LEN)
            self._values = tuple(sorted(merged, key=len, reverse=True))

    @property
    def values(self) -> tuple[str, ...]:
        return self._values

    def __call__(self, text: str) -> str:
        for value in self._values:
            if value in text:
                text = text.replace(value, REDACTED)
        return URL_CREDENTIALS.sub(REDACTED + "@", BEARER_KEY.sub(REDACTED, text))


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """``text`` with the secrets of ``environ`` (default: the current ``os.environ``, read at each call) and every
    bearer-key-shaped string replaced by ``<redacted>``."""
    return Redactor(secret_values(environ))(text)
