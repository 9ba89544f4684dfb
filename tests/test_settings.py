"""Settings registry: parsing, errors that name the variable, docs generated from the registry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tilesmith import settings
from tilesmith.errors import SettingsError

REPO = Path(__file__).resolve().parents[1]


def test_defaults_and_parsing():
    env = {}
    assert settings.get("TILESMITH_MIN_IMPROVEMENT", env) == 0.02
    assert settings.get("TILESMITH_ALLOW_CPU", env) is False
    assert settings.get("TILESMITH_MODEL", env) is None
    assert settings.get("TILESMITH_MIN_IMPROVEMENT", {"TILESMITH_MIN_IMPROVEMENT": "0.05"}) == 0.05
    assert settings.get("TILESMITH_ALLOW_CPU", {"TILESMITH_ALLOW_CPU": "yes"}) is True


@pytest.mark.parametrize("value", ["2%", "-0.1", "1.5", "nan", "inf", ""])
def test_invalid_min_improvement_names_variable_and_default(value):
    with pytest.raises(SettingsError, match=r"TILESMITH_MIN_IMPROVEMENT=.*0\.02"):
        settings.get("TILESMITH_MIN_IMPROVEMENT", {"TILESMITH_MIN_IMPROVEMENT": value})


def test_secret_values_are_hidden_in_errors(monkeypatch):
    setting = settings.Setting("X_SECRET", None, int, "x", secret=True)
    monkeypatch.setitem(settings.REGISTRY, "X_SECRET", setting)
    with pytest.raises(SettingsError) as info:
        settings.get("X_SECRET", {"X_SECRET": "sk-very-secret"})
    assert "sk-very-secret" not in str(info.value)


def test_cache_root_order():
    assert settings.cache_root({"TILESMITH_CACHE_DIR": "/a", "XDG_CACHE_HOME": "/b"}) == Path("/a")
    assert settings.cache_root({"XDG_CACHE_HOME": "/b"}) == Path("/b/tilesmith")
    assert settings.cache_root({}) == Path.home() / ".cache" / "tilesmith"


def test_env_docs_are_generated_from_the_registry():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_env_docs.py"), "--check"], cwd=REPO)
    assert proc.returncode == 0, "docs/env_vars.md is stale: run python scripts/gen_env_docs.py"


def test_compile_rejects_any_invalid_tilesmith_setting_up_front(monkeypatch):
    import torch

    import tilesmith

    monkeypatch.setenv("TILESMITH_GATE_PAIRS", "abc")
    with pytest.raises(SettingsError, match="TILESMITH_GATE_PAIRS"):
        tilesmith.compile(torch.nn.Linear(2, 2), example_inputs=(torch.randn(1, 2),), agent_model="tilesmith/builtin")


@pytest.mark.parametrize(("name", "value", "form"), [
    ("TILESMITH_GATE_PAIRS", "abc", "not a whole number; expected an integer >= 10"),
    ("TILESMITH_AGENT_MAX_RETRIES", "two", "not a whole number; expected an integer >= 0"),
    ("TILESMITH_GRAPH_TIMEOUT_S", "10m", "not a number; expected a positive number of seconds"),
    ("TILESMITH_MIN_IMPROVEMENT", "2%", "not a number; expected a fraction in [0, 1)"),
])
def test_unparsable_numbers_say_what_is_expected_not_pythons_conversion_error(name, value, form):
    with pytest.raises(SettingsError) as info:
        settings.get(name, {name: value})
    message = str(info.value)
    assert message.startswith(f"{name}={value!r} is invalid: {form}") and "invalid literal" not in message
    assert "could not convert" not in message


def test_graph_timeout_reads_its_deprecated_name_with_a_warning():
    assert settings.get("TILESMITH_GRAPH_TIMEOUT_S", {}) == 1800.0
    with pytest.warns(FutureWarning, match="TILESMITH_TURN_TIMEOUT_S is deprecated.*TILESMITH_GRAPH_TIMEOUT_S"):
        assert settings.get("TILESMITH_GRAPH_TIMEOUT_S", {"TILESMITH_TURN_TIMEOUT_S": "60"}) == 60.0
    both = {"TILESMITH_TURN_TIMEOUT_S": "60", "TILESMITH_GRAPH_TIMEOUT_S": "90"}
    assert settings.get("TILESMITH_GRAPH_TIMEOUT_S", both) == 90.0  # the new name wins, no warning needed
    assert settings.DEPRECATED == {"TILESMITH_TURN_TIMEOUT_S": "TILESMITH_GRAPH_TIMEOUT_S"}
    with pytest.raises(SettingsError, match=r"^TILESMITH_TURN_TIMEOUT_S='soon' is invalid"), \
            pytest.warns(FutureWarning):
        settings.check_all({"TILESMITH_TURN_TIMEOUT_S": "soon"})


def test_the_session_limit_honours_the_deprecated_name(monkeypatch, tmp_path):
    from tests.test_session import make_session

    monkeypatch.delenv("TILESMITH_GRAPH_TIMEOUT_S", raising=False)
    monkeypatch.setenv("TILESMITH_TURN_TIMEOUT_S", "1e-9")
    with pytest.warns(FutureWarning):
        session, *_ = make_session(tmp_path, time_limit_s=None)
    assert session.stop_reason() == "time_limit: TILESMITH_GRAPH_TIMEOUT_S elapsed"


@pytest.mark.parametrize("value", ["1", "2", "9"])
def test_gate_pairs_below_the_first_look_are_refused(value):
    """TILESMITH_GATE_PAIRS=1 was accepted: one pair's ratio is then its own interval, so a single sample 3 % faster
    by noise passed a phase (stats.decide([1.0], [0.97], 1, 0.02) == 'pass')."""
    from tilesmith.gate.host import stats

    assert settings.MIN_GATE_PAIRS == stats.LOOK_EVERY
    with pytest.raises(SettingsError) as info:
        settings.get("TILESMITH_GATE_PAIRS", {"TILESMITH_GATE_PAIRS": value})
    assert "expected an integer >= 10" in str(info.value) and "Unset it to use the default ('30')" in str(info.value)
    assert settings.get("TILESMITH_GATE_PAIRS", {"TILESMITH_GATE_PAIRS": "10"}) == 10


def test_descriptions_point_at_current_names_not_deprecated_ones():
    """TILESMITH_DIST_TIMEOUT_S's description (docs/env_vars.md) said its default covers TILESMITH_TURN_TIMEOUT_S,
    the deprecated name of TILESMITH_GRAPH_TIMEOUT_S; only the renamed setting itself may mention its old name."""
    for name, setting in settings.REGISTRY.items():
        for old in settings.DEPRECATED:
            if old in setting.description:
                assert old in setting.deprecated_names, f"{name}'s description names deprecated {old}"
