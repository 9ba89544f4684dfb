"""LLM agent runtime, no process started: availability checks, private proxy config, agency rule, redaction."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from tilesmith.agent.llm import check_availability
from tilesmith.agent.llm.launches import check_agency, launch_sequence
from tilesmith.agent.llm.prompts import system_prompt
from tilesmith.agent.llm.proxy_config import (
    SERVER_KEYS,
    build_private_config,
    env_provider_sections,
    route_model,
    write_private_config,
)
from tilesmith.agent.llm.redact import proxy_env, tool_env
from tilesmith.secrets import Redactor

FIXTURES = Path(__file__).parent / "fixtures" / "inductor-h200"


def _exe(folder: Path, name: str = "cli-proxy-api") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An environment with nothing configured: empty PATH folder, a fresh HOME, no Homebrew."""
    (tmp_path / "bin").mkdir()
    return {"PATH": str(tmp_path / "bin"), "HOME": str(tmp_path / "home"), "HOMEBREW_PREFIX": str(tmp_path / "brew")}


# -- check_availability ------------------------------------------------------------------------------
def test_availability_without_model_name_is_missing_model(env):
    avail = check_availability(None, env)
    assert not avail.ok and avail.kind == "missing_model"
    assert "TILESMITH_MODEL" in avail.message and "agent_model" in avail.message


def test_availability_prefers_agent_model_over_tilesmith_model(env, tmp_path):
    _exe(tmp_path / "bin")
    env.update(TILESMITH_MODEL="from-env", OPENAI_API_KEY="sk-openai-abcdef123")
    assert check_availability("from-arg", env).model == "from-arg"
    assert check_availability(None, env).model == "from-env"


def test_availability_without_executable_is_missing_proxy_naming_the_variable(env):
    env["OPENAI_API_KEY"] = "sk-openai-abcdef123"
    avail = check_availability("gpt-x", env)
    assert not avail.ok and avail.kind == "missing_proxy"
    assert "TILESMITH_CLIPROXYAPI_EXECUTABLE" in avail.message and "cliproxyapi" in avail.message


def test_availability_with_explicit_executable_that_does_not_exist_is_missing_proxy(env, tmp_path):
    env.update(TILESMITH_CLIPROXYAPI_EXECUTABLE=str(tmp_path / "nope"), OPENAI_API_KEY="sk-openai-abcdef123")
    avail = check_availability("gpt-x", env)
    assert avail.kind == "missing_proxy" and str(tmp_path / "nope") in avail.message


def test_availability_finds_homebrew_name_on_path(env, tmp_path):
    exe = _exe(tmp_path / "bin", "cliproxyapi")
    env["ANTHROPIC_API_KEY"] = "sk-ant-abcdef123456"
    avail = check_availability("claude-x", env)
    assert avail.ok and avail.executable == str(exe.resolve())
    assert avail.credential_sources == ("env:ANTHROPIC_API_KEY",)


def test_availability_without_credentials_is_missing_credentials(env, tmp_path):
    _exe(tmp_path / "bin")
    avail = check_availability("gpt-x", env)
    assert not avail.ok and avail.kind == "missing_credentials"
    assert "TILESMITH_API_BASE_URL" in avail.message and "-login" in avail.message
    assert avail.diagnostic("ab" * 32).graph_key == "ab" * 32


def test_availability_tilesmith_api_key_without_base_url_is_missing_credentials(env, tmp_path):
    _exe(tmp_path / "bin")
    env["TILESMITH_API_KEY"] = "sk-compat-abcdef123"
    avail = check_availability("m", env)
    assert avail.kind == "missing_credentials" and "TILESMITH_API_BASE_URL" in avail.message
    assert "sk-compat-abcdef123" not in avail.message


def test_availability_counts_oauth_account_files_in_auth_dir(env, tmp_path):
    _exe(tmp_path / "bin")
    auth = tmp_path / "home" / ".cli-proxy-api"
    auth.mkdir(parents=True)
    (auth / "claude-me@example.com.json").write_text("{}")
    avail = check_availability("claude-x", env)
    assert avail.ok and avail.credential_sources == ("auth-dir:1 account file",)


def test_availability_reads_homebrew_config_provider_sections(env, tmp_path):
    _exe(tmp_path / "bin")
    conf = tmp_path / "brew" / "etc" / "cliproxyapi.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text(yaml.safe_dump({"claude-api-key": [{"api-key": "sk-ant-in-config-123"}], "port": 8317}))
    avail = check_availability("claude-x", env)
    assert avail.ok and avail.config == str(conf) and avail.credential_sources == ("config:claude-api-key",)


def test_availability_explicit_config_that_is_missing_is_reported(env, tmp_path):
    _exe(tmp_path / "bin")
    env.update(TILESMITH_CLIPROXYAPI_CONFIG=str(tmp_path / "missing.yaml"), OPENAI_API_KEY="sk-openai-abcdef123")
    avail = check_availability("gpt-x", env)
    assert avail.kind == "missing_proxy" and "TILESMITH_CLIPROXYAPI_CONFIG" in avail.message


def test_availability_invalid_yaml_config_names_the_file(env, tmp_path):
    _exe(tmp_path / "bin")
    bad = tmp_path / "bad.yaml"
    bad.write_text("routing: [unclosed\n")
    env.update(TILESMITH_CLIPROXYAPI_CONFIG=str(bad), OPENAI_API_KEY="sk-openai-abcdef123")
    avail = check_availability("gpt-x", env)
    assert avail.kind == "missing_proxy" and str(bad) in avail.message and "line" in avail.message


# -- provider variables → config sections ----------------------------------------------------------
@pytest.mark.parametrize(("variable", "model", "section", "expected"), [
    ("ANTHROPIC_API_KEY", "claude-sonnet-4-5", "claude-api-key", {"api-key": "k-0123456789"}),
    ("GEMINI_API_KEY", "gemini-2.5-pro", "gemini-api-key", {"api-key": "k-0123456789"}),
    ("GOOGLE_API_KEY", "gemini-2.5-pro", "gemini-api-key", {"api-key": "k-0123456789"}),
    ("VERTEX_API_KEY", "gemini-2.5-pro", "vertex-api-key", {"api-key": "k-0123456789"}),
    ("XAI_API_KEY", "grok-3-mini", "xai-api-key", {"api-key": "k-0123456789", "base-url": "https://api.x.ai/v1"}),
    ("OPENAI_API_KEY", "gpt-4.1-mini", "openai-compatibility",
     {"name": "openai", "base-url": "https://api.openai.com/v1", "api-key-entries": [{"api-key": "k-0123456789"}],
      "models": [{"name": "gpt-4.1-mini"}]}),
    ("OPENROUTER_API_KEY", "moonshotai/kimi-k2", "openai-compatibility",
     {"name": "openrouter", "base-url": "https://openrouter.ai/api/v1",
      "api-key-entries": [{"api-key": "k-0123456789"}], "models": [{"name": "moonshotai/kimi-k2"}]}),
])
def test_each_provider_variable_writes_its_section(variable, model, section, expected):
    sections = env_provider_sections({variable: "k-0123456789"}, model)
    assert sections == {section: [expected]}


def test_tilesmith_api_pair_writes_openai_compatibility_entry_with_the_requested_model():
    sections = env_provider_sections({"TILESMITH_API_KEY": "k-0123456789",
                                      "TILESMITH_API_BASE_URL": "http://127.0.0.1:9/v1/"}, "my-model")
    assert sections == {"openai-compatibility": [{"name": "tilesmith", "base-url": "http://127.0.0.1:9/v1",
                                                  "api-key-entries": [{"api-key": "k-0123456789"}],
                                                  "models": [{"name": "my-model"}]}]}


def test_gemini_and_google_with_the_same_key_make_one_entry():
    sections = env_provider_sections({"GEMINI_API_KEY": "k-0123456789", "GOOGLE_API_KEY": "k-0123456789"}, "gemini-x")
    assert sections == {"gemini-api-key": [{"api-key": "k-0123456789"}]}


def test_route_model_precedence():
    both = {"OPENAI_API_KEY": "o-0123456789", "ANTHROPIC_API_KEY": "a-0123456789", "OPENROUTER_API_KEY": "r-0123456789"}
    assert route_model("claude-sonnet-4-5", both) == "ANTHROPIC_API_KEY"
    assert route_model("gpt-5", both) == "OPENAI_API_KEY"
    assert route_model("vendor/model", both) == "OPENROUTER_API_KEY"
    assert route_model("claude-sonnet-4-5", {**both, "TILESMITH_API_KEY": "t-0123456789",
                                             "TILESMITH_API_BASE_URL": "http://x/v1"}) == "TILESMITH_API_KEY"
    assert route_model("gpt-5", {"ANTHROPIC_API_KEY": "a-0123456789"}) is None


def test_explicit_endpoint_serving_a_claude_name_excludes_it_from_the_claude_section():
    env = {"ANTHROPIC_API_KEY": "a-0123456789", "TILESMITH_API_KEY": "t-0123456789",
           "TILESMITH_API_BASE_URL": "http://127.0.0.1:9/v1"}
    sections = env_provider_sections(env, "claude-sonnet-4-5")
    assert sections["claude-api-key"] == [{"api-key": "a-0123456789", "excluded-models": ["claude-sonnet-4-5"]}]
    assert sections["openai-compatibility"][0]["models"] == [{"name": "claude-sonnet-4-5"}]


def test_openai_key_is_not_given_a_model_another_provider_serves():
    sections = env_provider_sections({"OPENAI_API_KEY": "o-0123456789", "ANTHROPIC_API_KEY": "a-0123456789"},
                                     "claude-sonnet-4-5")
    assert "openai-compatibility" not in sections and "claude-api-key" in sections


# -- the private config -----------------------------------------------------------------------------
def test_private_config_keeps_providers_and_routing_and_replaces_server_settings(tmp_path):
    user = {
        "host": "", "port": 8317, "api-keys": ["your-api-key-1"], "auth-dir": "~/.cli-proxy-api",
        "remote-management": {"allow-remote": True, "secret-key": "hunter2hunter2", "disable-control-panel": False},
        "debug": True, "request-log": True, "logging-to-file": True, "pprof": {"enable": True, "addr": "0.0.0.0:1"},
        "routing": {"strategy": "fill-first", "session-affinity": True}, "request-retry": 3,
        "claude-api-key": [{"api-key": "sk-ant-user-123456", "priority": 2}],
        "openai-compatibility": [{"name": "mine", "base-url": "http://h/v1", "models": [{"name": "m"}]}],
        "oauth-model-alias": {"claude": [{"name": "a", "alias": "b"}]}, "proxy-url": "socks5://127.0.0.1:1080",
    }
    env_sections = env_provider_sections({"OPENAI_API_KEY": "sk-openai-0123456"}, "gpt-x")
    cfg = build_private_config(user, env_sections, port=40123, client_key="tsk-abc", auth_dir=tmp_path / "auth")
    assert cfg["host"] == "127.0.0.1" and cfg["port"] == 40123 and cfg["api-keys"] == ["tsk-abc"]
    assert cfg["auth-dir"] == str(tmp_path / "auth")
    assert cfg["remote-management"] == {"allow-remote": False, "secret-key": "", "disable-control-panel": True,
                                        "disable-auto-update-panel": True}
    assert cfg["debug"] is False and cfg["request-log"] is False and cfg["logging-to-file"] is False
    assert cfg["pprof"] == {"enable": False}
    assert cfg["routing"] == user["routing"] and cfg["request-retry"] == 3  # the user's routing and retry kept
    assert cfg["claude-api-key"] == user["claude-api-key"] and cfg["oauth-model-alias"] == user["oauth-model-alias"]
    assert cfg["proxy-url"] == "socks5://127.0.0.1:1080"
    assert [e["name"] for e in cfg["openai-compatibility"]] == ["mine", "openai"]
    assert cfg["disable-cooling"] is True and cfg["transient-error-cooldown-seconds"] == -1  # defaults filled in
    assert user["port"] == 8317 and len(user["openai-compatibility"]) == 1  # the user's mapping is not modified
    assert set(SERVER_KEYS) & set(cfg) <= {"host", "port", "api-keys", "auth-dir", "remote-management", "debug",
                                          "request-log", "logging-to-file", "usage-statistics-enabled",
                                          "save-cooldown-status", "pprof", "tls", "plugins"}


def test_private_config_file_is_owner_only(tmp_path):
    path = tmp_path / "config.yaml"
    write_private_config({"api-keys": ["tsk-x"]}, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert yaml.safe_load(path.read_text()) == {"api-keys": ["tsk-x"]}


# -- environments and redaction ---------------------------------------------------------------------
def test_tool_env_drops_secrets_and_unlisted_variables():
    host = {"PATH": "/usr/bin", "HOME": "/h", "OPENAI_API_KEY": "sk-openai-secret-1",
            "MY_SERVICE_TOKEN": "tok-123456789",
            "CUDA_VISIBLE_DEVICES": "0", "TORCHINDUCTOR_CACHE_DIR": "/c", "RANDOM_VAR": "x",
            "PYTHONPATH": "/p:sk-openai-secret-1", "TILESMITH_API_KEY": "sk-compat-secret-2"}
    env = tool_env(host)
    assert env == {"PATH": "/usr/bin", "HOME": "/h", "CUDA_VISIBLE_DEVICES": "0", "TORCHINDUCTOR_CACHE_DIR": "/c"}


def test_proxy_env_keeps_only_path_locale_tls_and_outbound_proxy():
    host = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "HTTPS_PROXY": "http://proxy:3128", "PGSTORE_DSN": "postgres://x",
            "GITSTORE_GIT_URL": "https://g", "HOME_JWT": "jwt", "DEPLOY": "cloud", "WRITABLE_PATH": "/w",
            "MANAGEMENT_PASSWORD": "pw-0123456789", "OPENAI_API_KEY": "sk-openai-secret-1", "HOME": "/real/home"}
    env = proxy_env(host, home="/priv/home", tmpdir="/priv/tmp")
    assert env == {"PATH": "/usr/bin", "LANG": "C.UTF-8", "HTTPS_PROXY": "http://proxy:3128", "HOME": "/priv/home",
                   "TMPDIR": "/priv/tmp"}


def test_redactor_replaces_longest_secret_first_and_ignores_short_values():
    red = Redactor(["abcdefgh", "abcdefgh-more-secret", "short"])
    assert red("x abcdefgh-more-secret y abcdefgh short") == "x <redacted> y <redacted> short"


# -- agency rule -------------------------------------------------------------------------------------
def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_launch_sequence_reads_triton_and_extern_launches_in_order():
    seq = launch_sequence(_fixture("mlp_fp32_infer__00.wrapper.py"))
    assert seq == ("extern_kernels.mm", "triton_poi_fused_addmm_gelu_0", "extern_kernels.mm",
                   "triton_per_fused_add_addmm_native_layer_norm_1")


def test_launch_sequence_reads_sdpa_op_calls():
    seq = launch_sequence(_fixture("gpt2_block_bf16_infer__03.wrapper.py"))
    assert "torch.ops.aten._scaled_dot_product_cudnn_attention.default" in seq and len(seq) == 9


def test_agency_low_accepts_tuning_inside_kernels():
    original = _fixture("mlp_fp32_infer__00.wrapper.py")
    tuned = original.replace("XBLOCK : tl.constexpr", "XBLOCK : tl.constexpr, ")  # kernel text changes only
    assert tuned != original and check_agency("low", original, tuned).ok


def test_agency_low_rejects_a_removed_launch_with_the_position():
    original = _fixture("mlp_fp32_infer__00.wrapper.py")
    fused = original.replace("triton_poi_fused_addmm_gelu_0.run(buf1, arg1_1, 262144, stream=stream0)", "pass")
    check = check_agency("low", original, fused)
    assert not check.ok
    assert any("launch 1 is 'extern_kernels.mm'" in r for r in check.reasons)
    assert check_agency("medium", original, fused).ok and check_agency("high", original, fused).ok


def test_agency_low_rejects_reordered_launches():
    original = _fixture("mlp_fp32_infer__00.wrapper.py")
    swapped = original.replace("extern_kernels.mm(arg2_1,", "extern_kernels.addmm(arg2_1,", 1)
    check = check_agency("low", original, swapped)
    assert not check.ok and "original order" in check.reasons[-1]


@pytest.mark.parametrize("agency", ["low", "medium", "high"])
def test_system_prompt_names_the_attempt_and_the_agency_rule(agency):
    text = system_prompt(agency, "/attempts/attempt_03.py", 0.02)
    assert "/attempts/attempt_03.py" in text and f"Agency {agency.upper()}" in text and "2.0%" in text


def test_system_prompt_rejects_unknown_agency():
    with pytest.raises(ValueError, match="low, medium, high"):
        system_prompt("extreme", "/attempts/attempt_01.py", 0.02)


def test_sweep_removes_only_private_dirs_whose_owner_process_is_gone(tmp_path):
    import subprocess
    import sys

    from tilesmith.agent.llm.proxy import sweep_stale_private_dirs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    stale, live, foreign = (tmp_path / f"tilesmith-proxy-{n}" for n in ("stale", "live", "noowner"))
    for folder in (stale, live, foreign):
        folder.mkdir()
        (folder / "config.yaml").write_text("api-keys: [x]\n")
    (stale / "owner").write_text(f"{dead}\n")
    (live / "owner").write_text(f"{os.getppid()}\n")
    assert sweep_stale_private_dirs(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and foreign.exists()
