"""tilesmith.compile(sandbox=, chip=) (tilesmith-ai 0.1.4's arguments), chip matching, TILESMITH_SKILLS and the
settings aliases (TILESMITH_TIMEOUT)."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

import tilesmith
from tilesmith import chip as chip_module
from tilesmith import settings
from tilesmith.chip import chip_matches
from tilesmith.errors import SettingsError


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("TILESMITH_CACHE_DIR", str(tmp_path / "ts"))
    monkeypatch.delenv("TILESMITH_SKILLS", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(("requested", "device", "match"), [
    ("H200", "NVIDIA H200", True),
    ("h200", "NVIDIA H200 NVL", True),
    ("H200!", "NVIDIA H200", True),
    ("h200-141gb", "NVIDIA H200", True),
    ("H100", "NVIDIA H200", False),
    ("H20", "NVIDIA H200", False),
    ("A100", "NVIDIA A100-SXM4-80GB", True),
    ("RTX 4090", "NVIDIA GeForce RTX 4090", True),
    ("rtx4090", "NVIDIA GeForce RTX 4090", True),
    ("RTX 4080", "NVIDIA GeForce RTX 4090", False),
    ("L40S", "NVIDIA L40S", True),
    ("L40", "NVIDIA L40S", False),
    ("NVIDIA", "NVIDIA H200", False),
    ("B200", "NVIDIA B200", True),
])
def test_chip_matches_the_gpu_model_token(requested, device, match):
    assert chip_matches(requested, device) is match


def test_sandbox_computesdk_and_unknown_values_are_refused_naming_what_is_supported():
    model = torch.nn.Linear(2, 2)
    for value in ("computesdk", "docker"):
        with pytest.raises(ValueError, match=r"sandbox=None or sandbox='local'") as info:
            tilesmith.compile(model, example_inputs=(torch.randn(1, 2),), agent_model="tilesmith/builtin",
                              sandbox=value)
        assert (value == "computesdk") == ("ComputeSDK is a remote GPU service" in str(info.value))
    with pytest.raises(TypeError, match="sandbox must be None or 'local'"):
        tilesmith.compile(model, example_inputs=(torch.randn(1, 2),), agent_model="tilesmith/builtin", sandbox=1)


def test_chip_must_match_the_local_gpu_with_0_1_4s_error(monkeypatch):
    model = torch.nn.Linear(2, 2)
    x = torch.randn(1, 2)
    with pytest.raises(ValueError, match=r"chip='H200' cannot be checked: example_inputs hold no CUDA tensor"):
        tilesmith.compile(model, example_inputs=(x,), agent_model="tilesmith/builtin", chip="H200")
    with pytest.raises(ValueError, match="chip must not be empty"):
        tilesmith.compile(model, example_inputs=(x,), agent_model="tilesmith/builtin", chip=" ")
    with pytest.raises(TypeError, match="chip must be None or a GPU model name"):
        tilesmith.compile(model, example_inputs=(x,), agent_model="tilesmith/builtin", chip=200)
    monkeypatch.setattr(chip_module, "local_device_name", lambda inputs: "NVIDIA H200")
    with pytest.raises(ValueError, match=r"chip='H100' does not match local execution device 'NVIDIA H200'"):
        tilesmith.compile(model, example_inputs=(x,), agent_model="tilesmith/builtin", chip="H100")
    compiled = tilesmith.compile(model, example_inputs=(x,), agent_model="tilesmith/builtin", chip="H200",
                                 sandbox="local")
    assert callable(compiled)


def test_tilesmith_timeout_is_an_alias_of_the_model_request_timeout():
    name = "TILESMITH_AGENT_REQUEST_TIMEOUT_S"
    assert settings.get(name, {}) == 600
    assert settings.get(name, {"TILESMITH_TIMEOUT": "1200"}) == 1200
    assert settings.get(name, {"TILESMITH_TIMEOUT": "1200", name: "30"}) == 30  # the registered name wins
    with pytest.raises(SettingsError, match=r"TILESMITH_TIMEOUT='abc' \(an alias of TILESMITH_AGENT_REQUEST_TIME"):
        settings.get(name, {"TILESMITH_TIMEOUT": "abc"})
    with pytest.raises(SettingsError, match="TILESMITH_TIMEOUT"):
        settings.check_all({"TILESMITH_TIMEOUT": "-5"})
    assert settings.get("TILESMITH_MAX_OUTPUT_TOKENS", {}) == 8192
    with pytest.raises(SettingsError, match="TILESMITH_MAX_OUTPUT_TOKENS"):
        settings.get("TILESMITH_MAX_OUTPUT_TOKENS", {"TILESMITH_MAX_OUTPUT_TOKENS": "0"})


def test_skills_default_list_explicit_paths_cap_and_compile_time_errors(tmp_path, monkeypatch):
    from tilesmith.agent.llm import skills

    home = tmp_path / "home"
    default = home / ".codex" / "skills" / "high-performance-triton" / "SKILL.md"
    default.parent.mkdir(parents=True)
    default.write_text("triton advice\n")
    loaded = skills.load_skills({"HOME": str(home)})
    assert [(s.name, s.sha256) for s in loaded] == [("high-performance-triton/SKILL.md",
                                                     hashlib.sha256(b"triton advice\n").hexdigest())]
    assert skills.load_skills({"HOME": str(home), "TILESMITH_SKILLS": ""}) == ()
    extra = tmp_path / "extra.md"
    extra.write_text("more\n")
    listed = os.pathsep.join([str(extra), str(default.parent)])
    both = skills.load_skills({"HOME": str(home), "TILESMITH_SKILLS": listed})
    assert [s.name for s in both] == [f"{tmp_path.name}/extra.md", "high-performance-triton/SKILL.md"]
    assert both[0].metadata() == {"name": f"{tmp_path.name}/extra.md", "sha256": hashlib.sha256(b"more\n").hexdigest(),
                                  "bytes": 5}
    with pytest.raises(SettingsError, match=r"TILESMITH_SKILLS: cannot read skill .*missing\.md"):
        skills.load_skills({"TILESMITH_SKILLS": str(tmp_path / "missing.md")})
    monkeypatch.setattr(skills, "MAX_SKILL_BYTES", 8)
    with pytest.raises(SettingsError, match="exceed 8 bytes in all"):
        skills.load_skills({"TILESMITH_SKILLS": os.pathsep.join([str(extra), str(extra)])})
    monkeypatch.setenv("TILESMITH_SKILLS", str(tmp_path / "missing.md"))
    with pytest.raises(SettingsError, match="TILESMITH_SKILLS"):  # a bad list fails at compile(), not in a graph
        tilesmith.compile(torch.nn.Linear(2, 2), example_inputs=(torch.randn(1, 2),), agent_model="some-model")
    tilesmith.compile(torch.nn.Linear(2, 2), example_inputs=(torch.randn(1, 2),), agent_model="tilesmith/builtin")
