"""The LLM agent end to end: Tilesmith → private proxy → scripted OpenAI-compatible upstream on loopback.

Every test runs against the stand-in proxy (tests/fake_upstream.py, always available) and, where marked
``proxy``, against the real CLIProxyAPI binary too (skipped only when the binary is absent). The proxy is
configured only through TILESMITH_API_KEY + TILESMITH_API_BASE_URL; a :class:`FakeSession` plays the
pipeline with a deterministic gate (``# speed: x`` markers, see tests/fake_session.py).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time
from pathlib import Path

import pytest
from fake_session import FakeSession
from fake_upstream import (
    MISSING_BINARY,
    ScriptedUpstream,
    TurnScript,
    files_containing,
    final,
    real_proxy_binary,
    tool_call,
    tool_calls,
    write_standin_executable,
)

from tilesmith.agent.llm import LLMOptimizerFactory, ProxyStartError, UnknownModelError

UPSTREAM_KEY = "sk-upstream-test-0123456789abcdef"
MODEL = "scripted-model"
_REAL = real_proxy_binary()


@pytest.fixture(scope="module")
def standin_exe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_standin_executable(tmp_path_factory.mktemp("standin")))


@pytest.fixture(params=["standin", pytest.param("real", marks=[
    pytest.mark.proxy, pytest.mark.skipif(_REAL is None, reason=MISSING_BINARY)])])
def proxy_exe(request: pytest.FixtureRequest, standin_exe: str) -> str:
    return standin_exe if request.param == "standin" else str(_REAL)


def make_env(upstream: ScriptedUpstream, exe: str, home: Path, **extra: str) -> dict[str, str]:
    """The factory's environment. gpu_shell is off unless a test turns it on (tests/test_llm_shell.py does): the
    tests here assert exact note lists, and a machine without bubblewrap would add a shell_unavailable note."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TILESMITH_API_KEY": UPSTREAM_KEY,
            "TILESMITH_API_BASE_URL": upstream.base_url, "TILESMITH_CLIPROXYAPI_EXECUTABLE": exe,
            "TILESMITH_GPU_SHELL": "0", **extra}


def edit(old: str, new: str):
    return lambda path: tool_call("edit_file", file_path=path, old_string=old, new_string=new)


def evaluate(note: str = ""):
    return lambda path: tool_call("evaluate_attempt", note=note)


def say(text: str):
    return lambda path: final(text)


def run(tmp_path: Path, upstream: ScriptedUpstream, exe: str, *, loops: int = 1, agency: str = "medium",
        max_model_calls: int | None = None, debug: bool = False, streaming: bool = False, max_turns: int = 10,
        session: FakeSession | None = None) -> tuple[FakeSession, LLMOptimizerFactory, str | None]:
    session = session or FakeSession(tmp_path / "track", loops=loops, agency=agency, max_turns=max_turns)
    factory = LLMOptimizerFactory(agent_model=MODEL, agency=agency, max_model_calls=max_model_calls,
                                  run_dir=tmp_path, debug=debug, streaming=streaming,
                                  environ=make_env(upstream, exe, tmp_path / "home"))
    try:
        optimizer = factory.for_graph(session)
        optimizer.optimize(session)
        return session, factory, optimizer.stop_reason
    finally:
        factory.close()


TWO_LOOPS = [
    [edit("def call(args):", "# speed: 0.9\ndef call(args):"), evaluate("slower first"),
     edit("# speed: 0.9", "# speed: 1.5"), evaluate("faster"), say("turn 1 done")],
    [edit("# speed: 1.5", "# speed: 2.0"), say("changed; please evaluate")],
]


@pytest.mark.parametrize("streaming", [False, True], ids=["json", "sse"])
def test_e2e_rejected_then_accepted_and_two_loops_need_two_accepted_candidates(tmp_path, proxy_exe, streaming):
    script = TurnScript(TWO_LOOPS)
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=script) as upstream:
        session, factory, stop = run(tmp_path, upstream, proxy_exe, loops=2, streaming=streaming, debug=True)
    assert [v.status for v in session.verdicts] == ["rejected_slower", "accepted", "accepted"]
    assert session.accepted_loops == 2 and stop == "session:loops_done" and session.turns_used == 2
    assert "# speed: 2.0" in session.incumbent_source()
    # turn 2's agent only edited and answered: the host evaluated the attempt at the end of the turn
    trace2 = [json.loads(x) for x in (session.workspace / "traces" / "turn_002.jsonl").read_text().splitlines()]
    assert [e["by"] for e in trace2 if e["event"] == "evaluation"] == ["host:end_of_turn"]
    requests = upstream.chat_requests()
    assert len(requests) == 7 == factory.budget.used
    assert {r["model"] for r in requests} == {MODEL}
    assert {bool(r.get("stream")) for r in requests} == {streaming}
    assert {h.get("authorization") for h in upstream.headers} == {f"Bearer {UPSTREAM_KEY}"}
    assert all(r.get("tools") for r in requests)  # tool calling went through the proxy both ways


def test_final_answer_ends_only_the_turn_and_two_idle_turns_mean_the_agent_gave_up(tmp_path, standin_exe):
    script = TurnScript([[say("nothing to do")], [say("still nothing")]])
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=script) as upstream:
        session, _, stop = run(tmp_path, upstream, standin_exe)
    assert session.turns_used == 2 and session.verdicts == []
    assert stop == "agent_gave_up" and session.note_kinds() == ["agent_gave_up"]


def test_session_turn_limit_ends_the_loop(tmp_path, standin_exe):
    turns = [[edit("def call(args):", f"# speed: 0.{5 + i}\ndef call(args):"), say("tried")] for i in range(3)]
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript(turns)) as upstream:
        session, _, stop = run(tmp_path, upstream, standin_exe, max_turns=3)
    assert stop == "session:max_turns" and session.turns_used == 3
    assert [v.status for v in session.verdicts] == ["rejected_slower"] * 3


def test_budget_exhausted_without_a_win_notes_it_and_keeps_inductor(tmp_path, proxy_exe):
    looping = [edit("def call(args):", "# speed: 0.5\ndef call(args):")] + [evaluate("again")] * 20
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript([looping] * 5)) as upstream:
        session, factory, stop = run(tmp_path, upstream, proxy_exe, max_model_calls=3)
    assert len(upstream.chat_requests()) == 3 and factory.budget.used == 3 and factory.budget.blocked == 1
    assert factory.calls_used() == (3, 3)
    assert stop == "budget" and session.accepted_loops == 0
    note = next(d for d in session.notes if d.kind == "budget_exhausted")
    assert "max_model_calls=3" in note.message and "keeps ordinary Inductor" in note.message


def test_budget_is_shared_by_every_graph_of_one_run(tmp_path, standin_exe):
    looping = [edit("def call(args):", "# speed: 0.5\ndef call(args):")] + [evaluate()] * 20
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript([looping] * 5)) as upstream:
        factory = LLMOptimizerFactory(agent_model=MODEL, max_model_calls=4,
                                      environ=make_env(upstream, standin_exe, tmp_path / "home"))
        try:
            first = FakeSession(tmp_path / "g1", graph_key="11" * 32)
            factory.for_graph(first).optimize(first)
            second = FakeSession(tmp_path / "g2", graph_key="22" * 32)
            factory.for_graph(second).optimize(second)
        finally:
            factory.close()
    assert len(upstream.chat_requests()) == 4
    assert second.turns_used == 0 and second.note_kinds() == ["budget_exhausted"]


def test_budget_70_permits_70_invocations_counting_parallel_subagents(tmp_path, proxy_exe):
    task = ("task", {"description": "profile the kernels", "subagent_type": "general-purpose"})
    script = TurnScript([[lambda p: tool_calls(task, task)] + [evaluate()] * 200],
                        subagent=[lambda p: tool_call("read_fx_program")] * 200)
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=script) as upstream:
        _session, factory, stop = run(tmp_path, upstream, proxy_exe, max_model_calls=70)
    assert len(upstream.chat_requests()) == 70 == factory.budget.used
    assert factory.budget.blocked >= 1 and stop == "budget"
    assert factory.budget.by_agent["general-purpose"] >= 2 and factory.budget.by_agent["main"] >= 1
    assert sum(factory.budget.by_agent.values()) == 70
    assert sum(1 for who, _, _ in script.calls if who == "subagent") == factory.budget.by_agent["general-purpose"]


def test_a_retried_transport_error_counts_as_one_invocation(tmp_path, proxy_exe):
    script = TurnScript([[edit("def call(args):", "# speed: 1.5\ndef call(args):"), evaluate(), say("done")]])
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=script) as upstream:
        upstream.failures = [503]  # the first chat request fails; the OpenAI client retries it
        session, factory, _ = run(tmp_path, upstream, proxy_exe)
    assert len(upstream.chat_requests()) == 4 and factory.budget.used == 3
    assert session.accepted_loops == 1


def test_agency_low_launch_change_is_rejected_by_the_host_before_the_gate(tmp_path, standin_exe):
    remove_launch = edit("    triton_poi_fused_mul_1.run(buf0, buf1, 1024, stream=stream0)\n", "")
    # a change inside the second kernel's source (the marker line sits in the Triton string)
    tune = edit("tmp0 * 2.0, None)\n", "tmp0 * 2.0, None)\n# speed: 1.3\n")
    restore = edit("    return (buf1, )", "    triton_poi_fused_mul_1.run(buf0, buf1, 1024, stream=stream0)\n"
                                        "    return (buf1, )")
    script = TurnScript([[remove_launch, evaluate("fused"), restore, tune, evaluate("tuned"), say("ok")]])
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=script) as upstream:
        session, _, _ = run(tmp_path, upstream, standin_exe, agency="low", debug=True)
        tool_results = [m["content"] for r in upstream.chat_requests() for m in r["messages"] if m["role"] == "tool"]
    assert any(t.startswith("REJECTED by the host before the gate (rejected_policy)") and "launch 1" in t
               for t in tool_results)
    assert [v.status for v in session.verdicts] == ["accepted"]  # the rejected source never reached the gate
    assert all("triton_poi_fused_mul_1.run(" in s for s in session.evaluated_sources)


def test_file_tools_can_write_only_this_turns_attempt(tmp_path, standin_exe):
    script = TurnScript([[lambda p: tool_call("write_file", file_path="/program.fx.txt", content="hacked"),
                          lambda p: tool_call("edit_file", file_path="/attempts/attempt_00.py",
                                              old_string="def call(args):", new_string="# speed: 9\ndef call(args):"),
                          lambda p: tool_call("write_file", file_path="/../outside.txt", content="x"),
                          say("done")]] * 2)
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=script) as upstream:
        session, _, _ = run(tmp_path, upstream, standin_exe)
        results = [m["content"] for m in upstream.chat_requests()[3]["messages"] if m["role"] == "tool"]
    assert (session.workspace / "program.fx.txt").read_text() != "hacked"
    assert "# speed: 9" not in (session.workspace / "attempts" / "attempt_00.py").read_text()
    assert not (tmp_path / "outside.txt").exists()
    assert len(results) == 3 and all(r.startswith("Error:") for r in results)
    assert "permission denied" in results[0] and "permission denied" in results[1] and "traversal" in results[2]


def test_tools_offered_with_the_shell_off_are_file_tools_task_and_host_tools(tmp_path, standin_exe):
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript([[say("x")]] * 2)) as upstream:
        session, _, _ = run(tmp_path, upstream, standin_exe)
        request = upstream.chat_requests()[0]
        names = {t["function"]["name"] for t in request["tools"]}
    assert names == {"ls", "read_file", "write_file", "edit_file", "glob", "grep", "task", "evaluate_attempt",
                     "profile_attempt", "read_fx_program", "read_exact_source"}
    assert "There is no shell tool" in request["messages"][0]["content"]
    assert session.note_kinds() == ["agent_gave_up"]  # TILESMITH_GPU_SHELL=0: no shell_unavailable note


def test_traces_are_written_only_with_debug_and_name_the_agent_of_each_call(tmp_path, standin_exe):
    task = ("task", {"description": "look at the FX program", "subagent_type": "general-purpose"})
    turns = [[lambda p: tool_calls(task), edit("def call(args):", "# speed: 1.5\ndef call(args):"), say("done")]]
    sub = [lambda p: tool_call("read_fx_program"), lambda p: final("it adds and multiplies")]
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript(turns, subagent=sub)) as upstream:
        session, _, _ = run(tmp_path / "on", upstream, standin_exe, debug=True)
    events = [json.loads(x) for x in (session.workspace / "traces" / "turn_001.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "model_start"]
    assert [e["agent"] for e in starts] == ["main", "general-purpose", "general-purpose", "main", "main"]
    ends = [e for e in events if e["event"] == "model_end"]
    assert all(e["usage"]["total_tokens"] == 18 for e in ends)
    assert events[0]["event"] == "turn_start" and events[-1]["event"] == "turn_end"
    assert events[-1]["model_calls"] == 5 and events[-1]["tokens"]["total"] == 90
    assert any(e["event"] == "tool_start" and e["tool"] == "read_fx_program" for e in events)
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript(turns, subagent=sub)) as upstream:
        quiet, _, _ = run(tmp_path / "off", upstream, standin_exe, debug=False)
    assert not (quiet.workspace / "traces").exists()


def test_no_secret_in_run_folder_traces_or_tool_environment(tmp_path, standin_exe, monkeypatch):
    monkeypatch.setenv("TILESMITH_API_KEY", UPSTREAM_KEY)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-host-secret-000111")
    monkeypatch.setenv("SOME_SERVICE_TOKEN", "tok-host-secret-222333444")
    dump = tmp_path / "tool_env.json"
    spy = f"import json, os\njson.dump(dict(os.environ), open({str(dump)!r}, 'w'))\nraise SystemExit(3)\n"
    turns = [[lambda p: tool_call("write_file", file_path=p, content=spy), lambda p: tool_call("profile_attempt"),
              say("done")], [say("nothing")], [say("nothing")]]
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript(turns)) as upstream:
        session, factory, _ = run(tmp_path, upstream, standin_exe, debug=True)
        proxy_secrets = factory.proxy.secrets()
    secrets = {UPSTREAM_KEY, "sk-openai-host-secret-000111", "tok-host-secret-222333444", *proxy_secrets}
    assert len(proxy_secrets) >= 3  # client key, keep-alive password, the upstream key in the config
    assert files_containing(tmp_path, sorted(secrets)) == []
    assert (session.workspace / "traces" / "turn_001.jsonl").exists()
    child_env = json.loads(dump.read_text())  # the profiling subprocess really ran the attempt
    assert not set(child_env.values()) & secrets
    assert not {"TILESMITH_API_KEY", "OPENAI_API_KEY", "SOME_SERVICE_TOKEN"} & set(child_env)


def user_config(tmp_path: Path, upstream: ScriptedUpstream, **extra: object) -> Path:
    """A user CLIProxyAPI YAML serving MODEL from the scripted upstream."""
    import yaml

    path = tmp_path / "user-cliproxyapi.yaml"
    path.write_text(yaml.safe_dump({
        "host": "", "port": 8317, "api-keys": ["your-api-key-1"],
        "openai-compatibility": [{"name": "mine", "base-url": upstream.base_url,
                                  "api-key-entries": [{"api-key": UPSTREAM_KEY}], "models": [{"name": MODEL}]}],
        **extra}))
    return path


def test_unknown_model_lists_the_models_the_proxy_offers(tmp_path, proxy_exe):
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,)) as upstream:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path / "home"),
               "TILESMITH_CLIPROXYAPI_EXECUTABLE": proxy_exe,
               "TILESMITH_CLIPROXYAPI_CONFIG": str(user_config(tmp_path, upstream))}
        factory = LLMOptimizerFactory(agent_model="no-such-model", environ=env)
        session = FakeSession(tmp_path / "track")
        try:
            with pytest.raises(UnknownModelError) as info:
                factory.for_graph(session)
            pid = factory.proxy.pid
            with pytest.raises(UnknownModelError):  # later graphs get the same answer without a new start
                factory.for_graph(session)
            assert factory.proxy.pid == pid
        finally:
            factory.close()
    d = info.value.diagnostic
    assert d.kind == "unknown_model" and "'no-such-model'" in d.message and MODEL in d.message
    assert d.graph_key == session.graph_key and info.value.offered == (MODEL,)
    assert not _alive(pid)
    assert upstream.chat_requests() == []


def test_proxy_that_logs_an_error_and_exits_0_is_reported_as_such(tmp_path):
    exe = tmp_path / "bin" / "cli-proxy-api"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\necho 'CLIProxyAPI Version: 9.9.9, Commit: none'\n"
                   "echo '[2026-01-01] [--------] [error] [main.go:531] failed to load config: boom'\nexit 0\n")
    exe.chmod(0o755)
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,)) as upstream:
        factory = LLMOptimizerFactory(agent_model=MODEL, environ=make_env(upstream, str(exe), tmp_path / "home"),
                                      start_timeout_s=20)
        started = time.monotonic()
        try:
            with pytest.raises(ProxyStartError) as info:
                factory.for_graph(FakeSession(tmp_path / "track"))
        finally:
            factory.close()
    message = info.value.diagnostic.message
    assert info.value.diagnostic.kind == "proxy_failed"
    assert "exited during startup with code 0" in message and "failed to load config: boom" in message
    assert time.monotonic() - started < 20  # reported on exit, not after the readiness deadline


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child counts as gone
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def test_proxy_killed_mid_run_is_restarted_once_and_the_run_completes(tmp_path, proxy_exe):
    holder: dict = {}

    def kill_on_second(number: int, body: dict) -> None:
        if number == 2:
            os.kill(holder["factory"].proxy.pid, signal.SIGKILL)
            time.sleep(0.2)

    script = TurnScript([[edit("def call(args):", "# speed: 1.5\ndef call(args):"), evaluate(), say("done")]])
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=script) as upstream:
        upstream.on_request = kill_on_second
        session = FakeSession(tmp_path / "track")
        factory = LLMOptimizerFactory(agent_model=MODEL, environ=make_env(upstream, proxy_exe, tmp_path / "home"))
        holder["factory"] = factory
        try:
            factory.for_graph(session).optimize(session)
            assert factory.proxy.restarts == 1
        finally:
            factory.close()
    assert session.accepted_loops == 1 and factory.budget.used == 3
    assert session.note_kinds() == ["proxy_restarted"]


def test_proxy_dying_twice_stops_the_graph_with_proxy_failed(tmp_path, standin_exe):
    holder: dict = {}

    def kill(number: int, body: dict) -> None:
        if number in (2, 3):
            os.kill(holder["factory"].proxy.pid, signal.SIGKILL)
            time.sleep(0.2)

    script = TurnScript([[edit("def call(args):", "# speed: 0.5\ndef call(args):")] + [evaluate()] * 10])
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=script) as upstream:
        upstream.on_request = kill
        session = FakeSession(tmp_path / "track")
        factory = LLMOptimizerFactory(agent_model=MODEL, environ=make_env(
            upstream, standin_exe, tmp_path / "home", TILESMITH_AGENT_MAX_RETRIES="3"))
        holder["factory"] = factory
        try:
            optimizer = factory.for_graph(session)
            optimizer.optimize(session)
        finally:
            factory.close()
    assert optimizer.stop_reason == "proxy_failed"
    assert session.note_kinds() == ["proxy_restarted", "proxy_failed"]
    assert "after 1 restart" in session.notes[-1].message


def test_close_and_garbage_collection_stop_the_proxy_and_delete_its_private_dir(tmp_path, standin_exe):
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,)) as upstream:
        env = make_env(upstream, standin_exe, tmp_path / "home")
        closed = LLMOptimizerFactory(agent_model=MODEL, environ=env)
        closed.for_graph(FakeSession(tmp_path / "a"))
        pid, private = closed.proxy.pid, closed.proxy.private_dir
        assert _alive(pid) and private.is_dir() and (private.stat().st_mode & 0o777) == 0o700
        closed.close()
        assert not _alive(pid) and not private.exists()

        dropped = LLMOptimizerFactory(agent_model=MODEL, environ=env)
        dropped.for_graph(FakeSession(tmp_path / "b"))
        pid, private = dropped.proxy.pid, dropped.proxy.private_dir
        del dropped
        gc.collect()
        assert not _alive(pid) and not private.exists()


def test_proxy_starts_lazily_at_the_first_graph_only(tmp_path, standin_exe):
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,)) as upstream:
        factory = LLMOptimizerFactory(agent_model=MODEL, environ=make_env(upstream, standin_exe, tmp_path / "home"))
        try:
            assert factory.proxy is None
            factory.for_graph(FakeSession(tmp_path / "a"))
            pid = factory.proxy.pid
            factory.for_graph(FakeSession(tmp_path / "b"))
            assert factory.proxy.pid == pid
        finally:
            factory.close()


def test_factory_rejects_unknown_agency_and_negative_budget():
    with pytest.raises(ValueError, match="low, medium, high"):
        LLMOptimizerFactory(agent_model=MODEL, agency="max", environ={})
    with pytest.raises(ValueError, match="max_model_calls"):
        LLMOptimizerFactory(agent_model=MODEL, max_model_calls=-1, environ={})


def test_budgeted_model_permits_exactly_n_invocations_and_sends_nothing_for_the_next(tmp_path):
    from tilesmith.agent.llm.budget import BudgetedChatOpenAI, ModelCallBudget
    from tilesmith.errors import BudgetExhausted

    with ScriptedUpstream(models=(MODEL,)) as upstream:
        budget = ModelCallBudget(70)
        model = BudgetedChatOpenAI(model=MODEL, base_url=upstream.base_url, api_key="x", use_responses_api=False,
                                   disable_streaming=True, max_retries=0).bind_budget(budget)
        streaming = BudgetedChatOpenAI(model=MODEL, base_url=upstream.base_url, api_key="x", use_responses_api=False,
                                       streaming=True, max_retries=0).bind_budget(budget)
        for _ in range(60):
            model.invoke("hi")
        for _ in range(5):
            streaming.invoke("hi")  # the SSE path: one permit per invocation too
        chunks = [list(model.stream("hi")) for _ in range(5)]
        with pytest.raises(BudgetExhausted, match="max_model_calls=70"):
            model.invoke("hi")
        with pytest.raises(BudgetExhausted):
            list(streaming.stream("hi"))
    assert len(upstream.chat_requests()) == 70 and budget.used == 70 and budget.blocked == 2
    assert sum(1 for r in upstream.chat_requests() if r.get("stream")) == 5 and all(chunks)


def test_upstream_rejecting_the_key_stops_the_graph_with_model_error(tmp_path, proxy_exe):
    with ScriptedUpstream(api_key="sk-the-right-key-0123456789", models=(MODEL,)) as upstream:
        session, factory, stop = run(tmp_path, upstream, proxy_exe)
    assert stop == "model_error" and session.turns_used == 1 and factory.budget.used == 1
    assert session.note_kinds() == ["model_error"] and "HTTP 401" in session.notes[0].message
    assert UPSTREAM_KEY not in session.notes[0].message


def test_two_turns_ending_in_server_errors_stop_with_agent_error(tmp_path, standin_exe):
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,)) as upstream:
        upstream.failures = [500] * 10
        session = FakeSession(tmp_path / "track")
        factory = LLMOptimizerFactory(agent_model=MODEL, environ=make_env(
            upstream, standin_exe, tmp_path / "home", TILESMITH_AGENT_MAX_RETRIES="0"))
        try:
            optimizer = factory.for_graph(session)
            optimizer.optimize(session)
        finally:
            factory.close()
    assert optimizer.stop_reason == "agent_error" and session.turns_used == 2
    assert len(upstream.chat_requests()) == 2 == factory.budget.used
    assert session.note_kinds() == ["agent_error"]


def test_agent_runs_send_nothing_to_langsmith_even_when_the_shell_enables_tracing(tmp_path, standin_exe, monkeypatch):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from langchain_core.tracers.langchain import wait_for_all_tracers

    seen: list[str] = []

    class Recorder(BaseHTTPRequestHandler):
        def log_message(self, *args):
            return

        def do_POST(self):  # noqa: N802
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_PATCH = do_POST  # noqa: N815

    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("LANGSMITH_TRACING", "true")
    monkeypatch.setenv("LANGSMITH_API_KEY", "lsv2-test-0123456789")
    monkeypatch.setenv("LANGSMITH_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript(TWO_LOOPS)) as upstream:
            session, _, _ = run(tmp_path, upstream, standin_exe, loops=2)
        wait_for_all_tracers()
    finally:
        server.shutdown()
        server.server_close()
    assert session.accepted_loops == 2 and seen == []
