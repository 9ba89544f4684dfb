"""``tilesmith doctor``: broken set-ups exit non-zero with a remedy; a working one exits 0; no secret leaks."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch

from tilesmith.cli.main import main

REPO = Path(__file__).resolve().parents[1]
SECRET = "sk-doctor-test-0123456789abcdef"


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A clean environment: own cache root, empty auth dir, no proxy on PATH, CPU test mode."""
    for name in list(os.environ):
        if name.startswith("TILESMITH_") and name not in {"TILESMITH_PROGRESS"}:
            monkeypatch.delenv(name)
    monkeypatch.setenv("TILESMITH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TILESMITH_CLIPROXYAPI_AUTH_DIR", str(tmp_path / "auth"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("TILESMITH_ALLOW_CPU", "1")
    return monkeypatch


def doctor(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["doctor", *args], out=out)
    return code, out.getvalue()


def lines_with(text: str, word: str) -> list[str]:
    return [line for line in text.splitlines() if word in line]


def test_builtin_agent_in_cpu_test_mode_is_ready(env):
    env.setenv("TILESMITH_MODEL", "tilesmith/builtin")
    code, text = doctor()
    assert code == 0, text
    assert "ready to optimize" in text
    assert "tilesmith/builtin (built-in agent, no LLM) from TILESMITH_MODEL" in text
    assert "ERROR" not in text
    # LLM pieces are context only for the built-in agent
    assert all(line.lstrip().startswith("--") for line in lines_with(text, "cliproxyapi "))


def test_missing_proxy_for_an_llm_model_fails_with_remedy(env):
    env.setenv("TILESMITH_MODEL", "gpt-5.5")
    env.setenv("TILESMITH_CLIPROXYAPI_EXECUTABLE", "/nonexistent/cli-proxy-api")
    code, text = doctor()
    assert code == 1
    error_lines = [line for line in text.splitlines() if line.lstrip().startswith("ERROR")]
    assert any("cliproxyapi" in line for line in error_lines)
    assert "remedy: install CLIProxyAPI" in " ".join(text.split())
    assert "problem(s) stop optimization" in text


def test_no_model_warns_names_both_ways_and_judges_the_main_job_with_the_builtin_agent(env):
    code, text = doctor()
    flat = " ".join(text.split())
    assert any("WARN" in line for line in lines_with(text, "model"))
    assert "TILESMITH_MODEL is unset" in flat and "agent_model=" in flat and "tilesmith/builtin" in flat
    assert code == 0  # the fixture's environment is otherwise ready (CPU test mode): the main job can optimize


def test_invalid_setting_fails_naming_the_variable(env):
    env.setenv("TILESMITH_MODEL", "tilesmith/builtin")
    env.setenv("TILESMITH_MIN_IMPROVEMENT", "5")
    code, text = doctor()
    assert code == 1 and "TILESMITH_MIN_IMPROVEMENT='5' is invalid" in " ".join(text.split())


def test_a_misspelt_variable_name_is_a_warning_with_the_right_spelling(env):
    """TILESMITH_OPTIMISE=background was ignored without a word (and doctor said every setting parsed)."""
    env.setenv("TILESMITH_MODEL", "tilesmith/builtin")
    env.setenv("TILESMITH_OPTIMISE", "background")
    env.setenv("TILESMITH_NO_SUCH_THING", "1")
    env.setenv("TILESMITH_BENCH_PROFILE", "/tmp/x")  # bench/'s own variable: not reported
    code, text = doctor()
    flat = " ".join(text.split())
    assert code == 0, text  # a warning: the run still works
    warned = [line for line in text.splitlines() if line.lstrip().startswith("WARN") and "settings" in line]
    assert len(warned) == 2, text
    assert "TILESMITH_OPTIMISE is set but Tilesmith reads no such variable (did you mean TILESMITH_OPTIMIZE?)" in flat
    assert "remedy: rename it to TILESMITH_OPTIMIZE or unset it" in flat
    assert "TILESMITH_NO_SUCH_THING is set but Tilesmith reads no such variable; it has no effect" in flat
    assert "TILESMITH_BENCH_PROFILE" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_no_gpu_without_cpu_test_mode_fails(env):
    env.setenv("TILESMITH_MODEL", "tilesmith/builtin")
    env.delenv("TILESMITH_ALLOW_CPU")
    code, text = doctor()
    flat = " ".join(text.split())
    assert code == 1 and "every graph stays on ordinary Inductor" in flat and "TILESMITH_ALLOW_CPU=1" in flat


def test_unwritable_cache_root_fails(env, tmp_path):
    env.setenv("TILESMITH_MODEL", "tilesmith/builtin")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    env.setenv("TILESMITH_CACHE_DIR", str(blocker / "cache"))
    code, text = doctor()
    assert code == 1 and "is not writable" in text and "remedy: set TILESMITH_CACHE_DIR" in text


def test_provider_variables_are_named_never_shown(env):
    env.setenv("TILESMITH_MODEL", "tilesmith/builtin")
    env.setenv("OPENAI_API_KEY", SECRET)
    env.setenv("TILESMITH_API_KEY", SECRET + "-2")
    code, text = doctor("--no-proxy")
    assert "OPENAI_API_KEY" in text and "TILESMITH_API_KEY" in text
    assert SECRET not in text
    # TILESMITH_API_KEY without its base URL is flagged
    assert "TILESMITH_API_KEY is set without TILESMITH_API_BASE_URL" in " ".join(text.split())
    code, text = doctor("--no-proxy", "--json")
    assert SECRET not in text and json.loads(text)["ok"] is True


def test_account_files_are_counted_by_provider(env, tmp_path):
    auth = tmp_path / "auth"
    auth.mkdir()
    (auth / "claude-user@example.com.json").write_text('{"access_token": "%s"}' % SECRET)
    (auth / "codex-a.json").write_text("{}")
    (auth / "codex-b.json").write_text("{}")
    env.setenv("TILESMITH_MODEL", "tilesmith/builtin")
    code, text = doctor("--no-proxy")
    assert code == 0 and "3 account file(s)" in text and "claude: 1, codex: 2" in text
    assert SECRET not in text


def _standin(tmp_path: Path) -> Path:
    from fake_upstream import write_standin_executable

    return write_standin_executable(tmp_path / "bin")


def test_proxy_probe_lists_the_model_through_the_private_proxy(env, tmp_path):
    exe = _standin(tmp_path)
    env.setenv("TILESMITH_CLIPROXYAPI_EXECUTABLE", str(exe))
    env.setenv("TILESMITH_API_KEY", SECRET)
    env.setenv("TILESMITH_API_BASE_URL", "http://127.0.0.1:9/v1")  # listing models sends no request upstream
    code, text = doctor("--model", "scripted-model", "--proxy-timeout", "60")
    assert code == 0, text
    assert "ok proxy started (CLIProxyAPI standin-0); lists 1 models including 'scripted-model': scripted-model" in " ".join(text.split())
    assert SECRET not in text


def test_proxy_that_exits_at_start_fails_with_remedy(env, tmp_path):
    exe = tmp_path / "bin" / "cli-proxy-api"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\necho '[error] failed to load config: boom'\nexit 0\n")
    exe.chmod(0o755)
    env.setenv("TILESMITH_CLIPROXYAPI_EXECUTABLE", str(exe))
    env.setenv("TILESMITH_API_KEY", SECRET)
    env.setenv("TILESMITH_API_BASE_URL", "http://127.0.0.1:9/v1")
    env.setenv("TILESMITH_MODEL", "scripted-model")
    code, text = doctor("--proxy-timeout", "20")
    flat = " ".join(text.split())
    assert code == 1
    assert "ERROR proxy" in flat and "did not start or answer" in flat and "remedy:" in flat


def _real_binary() -> Path | None:
    explicit = os.environ.get("TILESMITH_CLIPROXYAPI_EXECUTABLE")
    for candidate in (explicit, REPO / ".cache" / "bin" / "cli-proxy-api"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


BINARY = _real_binary()  # read before the env fixture clears TILESMITH_* variables


@pytest.mark.proxy
@pytest.mark.skipif(BINARY is None, reason="CLIProxyAPI binary absent (scripts/build-cliproxyapi.sh)")
def test_real_proxy_binary_lists_the_exported_model(env):
    env.setenv("TILESMITH_CLIPROXYAPI_EXECUTABLE", str(BINARY))
    env.setenv("TILESMITH_API_KEY", SECRET)
    env.setenv("TILESMITH_API_BASE_URL", "http://127.0.0.1:9/v1")
    code, text = doctor("--model", "doctor-model", "--proxy-timeout", "60")
    assert code == 0, text
    assert "including 'doctor-model'" in " ".join(text.split()) and SECRET not in text


def test_a_misspelt_builtin_agent_is_an_error_with_the_right_spelling(env):
    code, text = doctor("--model", "builtin", "--proxy-timeout", "5")
    (line,) = lines_with(text, "did you mean")
    flat = " ".join(text.split())
    assert code != 0 and "ERROR" in line and "did you mean 'tilesmith/builtin'" in flat

