"""Progress display: start and end lines only off a terminal, in-place status on one, logging always, secrets redacted."""

from __future__ import annotations

import io
import logging
import os
import pty

import pytest

from tilesmith.progress import Progress
from tilesmith.secrets import redact

LABEL = "1a2b3c4d (0_inference)"


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def drive(progress: Progress, clock: FakeClock) -> None:
    progress.graph_started(LABEL)
    clock.t += 42
    progress.update(LABEL, loop=1, loops=2, turn=3, calls_used=12, calls_budget=70, best_speedup=1.31)
    progress.update(LABEL, loop=1, loops=2, turn=3, calls_used=12, calls_budget=70, best_speedup=1.31)
    clock.t += 18
    progress.graph_finished(LABEL, "installed, 1.31x")


def test_auto_mode_off_a_terminal_prints_only_each_graphs_start_and_end(caplog):
    out = io.StringIO()
    clock = FakeClock()
    with caplog.at_level(logging.DEBUG, logger="tilesmith"):
        drive(Progress(stream=out, mode="auto", clock=clock), clock)
    assert out.getvalue().splitlines() == [
        f"tilesmith {LABEL}: optimizing its first call (TILESMITH_PROGRESS=off silences this)",
        f"tilesmith {LABEL}: installed, 1.31x (1:00)"]  # no status updates
    off = io.StringIO()
    drive(Progress(stream=off, mode="off", clock=clock), clock)
    assert off.getvalue() == ""
    messages = [r.getMessage() for r in caplog.records if r.name == "tilesmith.progress"]
    assert messages[0] == f"optimizing {LABEL}"
    assert "loop 1/2 turn 3 calls 12/70 best 1.31x 0:42" in messages[1]
    assert messages[-1] == f"tilesmith {LABEL}: installed, 1.31x (1:00)"
    levels = {r.getMessage(): r.levelno for r in caplog.records}
    assert levels[messages[-1]] == logging.INFO and levels[messages[1]] == logging.DEBUG


def test_on_mode_off_a_terminal_writes_one_line_per_change():
    out = io.StringIO()
    clock = FakeClock()
    drive(Progress(stream=out, mode="on", clock=clock), clock)
    lines = out.getvalue().splitlines()
    assert lines == [
        f"tilesmith {LABEL} best - 0:00",
        f"tilesmith {LABEL} loop 1/2 turn 3 calls 12/70 best 1.31x 0:42",  # the repeated update is not re-printed
        f"tilesmith {LABEL}: installed, 1.31x (1:00)",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_auto_mode_on_a_real_terminal_rewrites_the_status_line_in_place():
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", encoding="utf-8", closefd=True) as tty:
            clock = FakeClock()
            progress = Progress(stream=tty, mode="auto", clock=clock)
            assert progress.enabled()
            drive(progress, clock)
        written = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            written += chunk
            if b"installed" in written and written.endswith(b"\n"):
                break
    finally:
        os.close(master)
    text = written.decode().replace("\r\n", "\n")
    assert text.count("\r\x1b[2K") == 4  # start, two updates, finish: each erases the previous status
    assert text.endswith(f"tilesmith {LABEL}: installed, 1.31x (1:00)\n")
    assert text.count("\n") == 1  # only the finished line stays


def test_off_mode_and_env_variable_silence_the_display(monkeypatch, caplog):
    monkeypatch.setenv("TILESMITH_PROGRESS", "off")
    out = io.StringIO()
    out.isatty = lambda: True  # even on a "terminal"
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger="tilesmith"):
        drive(Progress(stream=out, clock=clock), clock)
    assert out.getvalue() == ""
    assert any("installed" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("TILESMITH_PROGRESS", "on")  # read at every call, not cached
    Progress(stream=out, clock=clock).message("starting the private proxy")
    assert out.getvalue() == "\r\x1b[2Ktilesmith: starting the private proxy\n"


def test_unlimited_budget_and_other_graphs_are_shown():
    out = io.StringIO()
    clock = FakeClock()
    p = Progress(stream=out, mode="on", clock=clock)
    p.graph_started("aaaa1111 (0_forward)")
    p.graph_started("bbbb2222 (0_backward)")
    p.update("bbbb2222 (0_backward)", turn=1, calls_used=5, calls_budget=None)
    assert out.getvalue().splitlines()[-1] == "tilesmith bbbb2222 (0_backward) turn 1 calls 5/∞ best - 0:00 (+1 more graph)"
    p.graph_finished("bbbb2222 (0_backward)", "kept Inductor: no candidate cleared 2 %")
    assert out.getvalue().splitlines()[-1] == "tilesmith aaaa1111 (0_forward) best - 0:00"


def test_secret_values_never_reach_display_or_logs(monkeypatch, caplog):
    secret = "sk-test-0123456789abcdef"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    out = io.StringIO()
    clock = FakeClock()
    p = Progress(stream=out, mode="on", clock=clock)
    with caplog.at_level(logging.DEBUG, logger="tilesmith"):
        p.graph_started(f"label {secret}")
        p.update(f"label {secret}", turn=1)
        p.graph_finished(f"label {secret}", f"proxy refused key {secret}")
        p.message(f"key is {secret}")
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert secret not in out.getvalue() and secret not in logged
    assert "<redacted>" in out.getvalue() and "<redacted>" in logged
    assert redact(f"a{secret}b") == "a<redacted>b"


def test_invalid_mode_is_rejected():
    with pytest.raises(ValueError, match="auto"):
        Progress(mode="loud")


def test_one_secret_rule_covers_provider_keys_credential_names_and_bearer_shapes():
    from tilesmith.secrets import secret_values

    env = {"OPENAI_API_KEY": "sk-provider-0123456789", "MY_SERVICE_TOKEN": "tok-0123456789abcdef",
           "DB_PASSWORD": "short", "PATH": "/usr/bin:/bin-0123456789"}
    assert secret_values(env) == ("sk-provider-0123456789", "tok-0123456789abcdef")  # ≥ 8 chars, credential names
    text = "a sk-provider-0123456789 b tok-0123456789abcdef c short d /usr/bin:/bin-0123456789 e sk-abcdefghijklmnop0"
    assert redact(text, env) == "a <redacted> b <redacted> c short d /usr/bin:/bin-0123456789 e <redacted>"
