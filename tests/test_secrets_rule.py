"""The secret rule (tilesmith.secrets): names, URL passwords, redaction, and what the gate's workers and the LLM
agent's tools get (red team 18: DATABASE_URL, a proxy URL with a password and GH_PAT passed the name rule)."""

from __future__ import annotations

import pytest

from tilesmith import secrets
from tilesmith.gate.host.process import worker_environment

ENV = {"DATABASE_URL": "postgres://admin:hunter2rt18@db.internal:5432/prod",
       "HTTPS_PROXY": "http://alice:s3cr3tpass@proxy.corp:3128",
       "GH_PAT": "ghp_0123456789abcdefghij", "DB_PASS": "correct-horse-battery",
       "SENTRY_DSN": "https://0123456789abcdef@o1.ingest.sentry.io/1",
       "PATH": "/usr/bin:/bin", "PYTHONPATH": "/opt/x", "NO_PROXY": "localhost,127.0.0.1",
       "PIP_INDEX_URL": "https://pypi.org/simple", "BYPASS_MODE": "on-by-default", "HOME": "/root"}
SECRET = {"DATABASE_URL", "HTTPS_PROXY", "GH_PAT", "DB_PASS", "SENTRY_DSN"}


@pytest.mark.parametrize("name", sorted(ENV))
def test_which_variables_are_secret(name):
    assert secrets.is_secret(name, ENV[name]) == (name in SECRET)


def test_a_worker_gets_none_of_them():
    env = worker_environment(dict(ENV), device_type="cpu")
    assert not SECRET & set(env)
    assert {"PATH", "NO_PROXY", "PIP_INDEX_URL", "BYPASS_MODE", "HOME"} <= set(env)
    assert not any(v in " ".join(env.values()) for v in ("hunter2rt18", "s3cr3tpass", "ghp_0123456789"))


def test_redaction_removes_url_passwords_even_of_values_it_was_not_given():
    text = "connect postgres://bob:pw-not-in-env@db:5432/x failed; see http://example.com/a:b and " + ENV["GH_PAT"]
    out = secrets.redact(text, ENV)
    assert "pw-not-in-env" not in out and "bob:" not in out and ENV["GH_PAT"] not in out
    assert "postgres://<redacted>@db:5432/x" in out and "http://example.com/a:b" in out
