"""The private proxy lifecycle against the real CLIProxyAPI binary (and, where noted, the stand-in).

Marked ``proxy``: skipped only when the binary is absent (build it with scripts/build-cliproxyapi.sh).
Facts checked here are the ones the launcher relies on: which config section each provider variable
produces (read back from ``/v1/models``), that the user's providers and routing survive the copy, that
a busy port is retried, that a startup failure that exits 0 is reported, that the keep-alive password
opens nothing else, and that the proxy does not outlive a killed interpreter.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import yaml
from fake_upstream import MISSING_BINARY, ScriptedUpstream, real_proxy_binary, write_standin_executable

from tilesmith.agent.llm import ProxyStartError
from tilesmith.agent.llm.proxy import PrivateProxy, free_port, sweep_stale_private_dirs

REAL = real_proxy_binary()
needs_binary = pytest.mark.skipif(REAL is None, reason=MISSING_BINARY)
KEY = "sk-upstream-test-0123456789abcdef"


def _env(tmp_path: Path, **values: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path / "home"), **values}


def _models(proxy: PrivateProxy) -> list[dict]:
    resp = httpx.get(proxy.base_url + "/models", headers={"Authorization": f"Bearer {proxy.client_key}"},
                     trust_env=False, timeout=5)
    resp.raise_for_status()
    return resp.json()["data"]


def _private_config(proxy: PrivateProxy) -> dict:
    return yaml.safe_load((proxy.private_dir / "config.yaml").read_text())


@pytest.mark.proxy
@needs_binary
@pytest.mark.parametrize(("variable", "model", "section", "owner"), [
    ("ANTHROPIC_API_KEY", "claude-sonnet-4-5-20250929", "claude-api-key", "anthropic"),
    ("GEMINI_API_KEY", "gemini-2.5-pro", "gemini-api-key", "google"),
    ("GOOGLE_API_KEY", "gemini-2.5-flash", "gemini-api-key", "google"),
    ("VERTEX_API_KEY", "gemini-2.5-pro", "vertex-api-key", "google"),
    ("XAI_API_KEY", "grok-3-mini", "xai-api-key", "xai"),
    ("OPENAI_API_KEY", "gpt-4.1-mini", "openai-compatibility", "openai"),
    ("OPENROUTER_API_KEY", "moonshotai/kimi-k2", "openai-compatibility", "openrouter"),
    ("TILESMITH_API_KEY", "my-endpoint-model", "openai-compatibility", "tilesmith"),
])
def test_each_provider_variable_configures_the_proxy_to_offer_the_model(tmp_path, variable, model, section, owner):
    extra = {"TILESMITH_API_BASE_URL": "http://127.0.0.1:9/v1"} if variable == "TILESMITH_API_KEY" else {}
    environ = _env(tmp_path, **{variable: "k-test-0123456789"}, **extra)
    proxy = PrivateProxy(executable=REAL, model=model, environ=environ)
    try:
        proxy.start()
        listed = {m["id"]: m.get("owned_by") for m in _models(proxy)}
        config = _private_config(proxy)
    finally:
        proxy.stop()
    assert listed.get(model) == owner
    assert set(listed.values()) == {owner}
    assert [k for k in config if k.endswith("-api-key") or k == "openai-compatibility"] == [section]


@pytest.mark.proxy
@needs_binary
def test_user_config_is_copied_with_providers_and_routing_kept_and_server_settings_replaced(tmp_path):
    with ScriptedUpstream(api_key=KEY, models=("user-model",)) as upstream:
        user = {"host": "", "port": 8317, "api-keys": ["your-api-key-1"], "debug": True,
                "remote-management": {"secret-key": "plain-management-secret", "allow-remote": True},
                "routing": {"strategy": "fill-first"}, "request-retry": 2, "max-retry-interval": 7,
                "openai-compatibility": [{"name": "mine", "base-url": upstream.base_url,
                                          "api-key-entries": [{"api-key": KEY}],
                                          "models": [{"name": "user-model", "alias": "mine-alias"}]}]}
        path = tmp_path / "cliproxyapi.conf"
        path.write_text(yaml.safe_dump(user))
        before = path.read_bytes()
        proxy = PrivateProxy(executable=REAL, model="mine-alias", environ=_env(tmp_path), user_config=path)
        try:
            proxy.start()
            listed = {m["id"]: m.get("owned_by") for m in _models(proxy)}
            config = _private_config(proxy)
            reply = httpx.post(proxy.base_url + "/chat/completions", trust_env=False, timeout=10,
                               headers={"Authorization": f"Bearer {proxy.client_key}"},
                               json={"model": "mine-alias", "messages": [{"role": "user", "content": "hi"}]})
        finally:
            proxy.stop()
    assert listed == {"mine-alias": "mine"}
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "done"
    assert upstream.chat_requests()[0]["model"] == "user-model"  # alias resolved by the user's entry
    assert config["routing"] == {"strategy": "fill-first"} and config["request-retry"] == 2
    assert config["max-retry-interval"] == 7 and config["openai-compatibility"] == user["openai-compatibility"]
    assert config["host"] == "127.0.0.1" and config["port"] == proxy.port and config["debug"] is False
    assert config["api-keys"] == [proxy.client_key] and config["remote-management"]["secret-key"] == ""
    assert path.read_bytes() == before  # the user's file is never touched


@pytest.mark.parametrize("which", [pytest.param("real", marks=[pytest.mark.proxy, needs_binary]), "standin"])
def test_busy_port_is_retried_on_another_port(tmp_path, which):
    exe = REAL if which == "real" else str(write_standin_executable(tmp_path / "standin"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        ports = iter([busy.getsockname()[1]])
        proxy = PrivateProxy(executable=exe, model="m", environ=_env(tmp_path, OPENAI_API_KEY="k-test-0123456789"),
                             port_picker=lambda: next(ports, None) or free_port())
        try:
            proxy.start()
            assert proxy.port != busy.getsockname()[1] and proxy.port_conflicts == 1
            assert [m["id"] for m in _models(proxy)] == ["m"]
        finally:
            proxy.stop()


@pytest.mark.proxy
@needs_binary
def test_real_proxy_that_fails_to_load_its_config_exits_0_and_is_reported(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("routing: oops\nclaude-api-key:\n  - api-key: k-test-0123456789\n")
    proxy = PrivateProxy(executable=REAL, model="claude-x", environ=_env(tmp_path), user_config=path,
                         start_timeout_s=20)
    started = time.monotonic()
    with pytest.raises(ProxyStartError) as info:
        proxy.start()
    proxy.stop()
    assert info.value.diagnostic.kind == "proxy_failed"
    assert "exited during startup with code 0" in str(info.value) and "failed to load config" in str(info.value)
    assert time.monotonic() - started < 20


@pytest.mark.proxy
@needs_binary
def test_keep_alive_password_opens_no_management_api(tmp_path):
    proxy = PrivateProxy(executable=REAL, model="m", environ=_env(tmp_path, OPENAI_API_KEY="k-test-0123456789"))
    try:
        proxy.start()
        password = proxy._password
        base = proxy.base_url.removesuffix("/v1")
        with httpx.Client(trust_env=False, timeout=5) as client:
            assert client.get(base + "/keep-alive", headers={"Authorization": f"Bearer {password}"}).status_code == 200
            for path in ("/v0/management/config", "/v0/management/openai-compatibility", "/v0/management/api-keys"):
                for header in ({"Authorization": f"Bearer {password}"}, {"X-Management-Key": password}):
                    assert client.get(base + path, headers=header).status_code in (401, 403, 404)
            assert client.get(base + "/v1/models", headers={"Authorization": "Bearer wrong-key"}).status_code == 401
    finally:
        proxy.stop()


@pytest.mark.proxy
@needs_binary
def test_private_proxy_writes_nothing_outside_its_private_dir(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    proxy = PrivateProxy(executable=REAL, model="m", environ=_env(tmp_path, OPENAI_API_KEY="k-test-0123456789"))
    try:
        proxy.start()
        httpx.post(proxy.base_url + "/chat/completions", trust_env=False, timeout=5,  # an error request: error log
                   headers={"Authorization": f"Bearer {proxy.client_key}"}, json={"model": "nope", "messages": []})
        private = proxy.private_dir
        assert list(home.iterdir()) == [] and not (tmp_path / "logs").exists()
        assert any((private / "logs").iterdir())  # the proxy's error log landed in the private logs/ folder
    finally:
        proxy.stop()
    assert not private.exists()


@pytest.mark.slow
@pytest.mark.proxy
@needs_binary
def test_proxy_exits_by_itself_when_the_interpreter_that_started_it_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys
        from tilesmith.agent.llm.proxy import PrivateProxy
        p = PrivateProxy(executable={REAL!r}, model="m",
                         environ={{"PATH": "/usr/bin:/bin", "HOME": {str(tmp_path)!r},
                                  "OPENAI_API_KEY": "k-test-0123456789"}})
        p.start()
        print(p.pid, p.private_dir, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1], check=False)
    pid_text, private = out.stdout.split()
    pid = int(pid_text)
    assert (Path(private) / "config.yaml").exists()  # nobody could clean up: the interpreter was killed
    sweep_stale_private_dirs()  # what the next start does: the dir (and the secrets in it) goes
    assert not Path(private).exists()
    deadline = time.monotonic() + 30  # CLIProxyAPI's keep-alive timeout is 10 s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        os.kill(pid, 9)
        pytest.fail("the orphaned proxy was still running 30 s after its parent was killed")


@pytest.mark.parametrize("which", [pytest.param("real", marks=[pytest.mark.proxy, needs_binary]), "standin"])
def test_proxy_stops_at_normal_interpreter_exit_without_close(tmp_path, which):
    exe = REAL if which == "real" else str(write_standin_executable(tmp_path / "standin"))
    script = textwrap.dedent(f"""
        from tilesmith.agent.llm.proxy import PrivateProxy
        p = PrivateProxy(executable={exe!r}, model="m",
                         environ={{"PATH": "/usr/bin:/bin", "HOME": {str(tmp_path)!r},
                                  "OPENAI_API_KEY": "k-test-0123456789"}})
        p.start()
        print(p.pid, p.private_dir, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1], check=True)
    pid_text, private = out.stdout.split()
    try:
        os.kill(int(pid_text), 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive and not Path(private).exists()
