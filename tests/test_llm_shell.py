"""The LLM agent's sandboxed gpu_shell, read_exact_source, skills, live trace and output-token cap, end to end:
Tilesmith → private proxy (stand-in, and the real CLIProxyAPI where marked ``proxy``) → scripted upstream.

The shell needs bubblewrap (``bwrap``) able to create namespaces; those tests skip with the sandbox's own reason
otherwise. The graph is a CPU wrapper of ATen calls (runs in test mode without compiling), with a real snapshot
of its inputs, played by :class:`FakeSession` (marker gate: ``# speed: x`` lines decide, tests/fake_session.py).
"""

from __future__ import annotations

import base64
import io
import json
import os
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
    write_standin_executable,
)

from tilesmith.agent.llm import LLMOptimizerFactory
from tilesmith.agent.llm.sandbox import prepare

UPSTREAM_KEY = "sk-upstream-shell-test-0123456789abcdef"
MODEL = "scripted-model"
_REAL = real_proxy_binary()
_SANDBOX, _STATUS = prepare(os.environ, [])
needs_sandbox = pytest.mark.skipif(_SANDBOX is None, reason=f"no working bubblewrap sandbox: {_STATUS.reason}")

CPU_WRAPPER = '''\
import torch
aten = torch.ops.aten


def call(args):
    arg0_1, = args
    args.clear()
    buf0 = aten.add.Tensor(arg0_1, 1.0)
    buf1 = aten.mul.Tensor(buf0, 2.0)
    return (buf1, )
'''


@pytest.fixture(scope="module")
def standin_exe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_standin_executable(tmp_path_factory.mktemp("standin")))


@pytest.fixture(params=["standin", pytest.param("real", marks=[
    pytest.mark.proxy, pytest.mark.skipif(_REAL is None, reason=MISSING_BINARY)])])
def proxy_exe(request: pytest.FixtureRequest, standin_exe: str) -> str:
    return standin_exe if request.param == "standin" else str(_REAL)


def cpu_session(tmp_path: Path, **kw) -> FakeSession:
    """A FakeSession on CPU_WRAPPER with a real snapshot (inputs.pt, constants.pt) outside the track."""
    import torch

    from tilesmith.track import snapshot

    session = FakeSession(tmp_path / "run" / "track", source=CPU_WRAPPER, **kw)
    snap = tmp_path / "snapshot"
    snap.mkdir()
    snapshot.write_snapshot(snap, [torch.randn(1024)], {})
    session.snapshot_dir = snap
    return session


def make_env(upstream: ScriptedUpstream, exe: str, home: Path, **extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TILESMITH_API_KEY": UPSTREAM_KEY,
            "TILESMITH_API_BASE_URL": upstream.base_url, "TILESMITH_CLIPROXYAPI_EXECUTABLE": exe,
            "TILESMITH_SKILLS": "", "TORCHINDUCTOR_VEC_ISA_OK": "1", **extra}


def run(tmp_path: Path, upstream: ScriptedUpstream, exe: str, session: FakeSession, *, debug: bool = True,
        **extra: str) -> tuple[FakeSession, LLMOptimizerFactory, str | None]:
    factory = LLMOptimizerFactory(agent_model=MODEL, run_dir=tmp_path / "run", debug=debug,
                                  environ=make_env(upstream, exe, tmp_path / "home", **extra))
    try:
        optimizer = factory.for_graph(session)
        optimizer.optimize(session)
        return session, factory, optimizer.stop_reason
    finally:
        factory.close()


def say(text: str):
    return lambda path: final(text)


def shell(command: str, timeout_seconds: int = 120):
    return lambda path: tool_call("gpu_shell", command=command, timeout_seconds=timeout_seconds)


def tool_results(upstream: ScriptedUpstream, name: str | None = None) -> list[str]:
    """Tool-result messages the agent sent back, in order (from the last request, which holds the whole turn)."""
    out, seen = [], set()
    for request in upstream.chat_requests():
        names = {}
        for message in request["messages"]:
            for call in message.get("tool_calls") or []:
                names[call["id"]] = call["function"]["name"]
            if message["role"] == "tool" and message.get("tool_call_id") not in seen:
                seen.add(message.get("tool_call_id"))
                if name is None or names.get(message.get("tool_call_id")) == name:
                    out.append(message["content"])
    return out


def runner_report(text: str) -> dict:
    """The JSON line runner.py printed, out of a gpu_shell result."""
    line = next(x for x in text.splitlines() if x.startswith("{") and '"device"' in x)
    return json.loads(line)


@needs_sandbox
def test_agent_times_a_variant_in_the_shell_reads_exact_source_edits_and_gets_a_candidate_accepted(
        tmp_path, proxy_exe):
    holder: dict = {}

    def edit_from_exact_read(path: str):
        exact = tool_results(holder["upstream"], "read_exact_source")[-1]
        assert exact.startswith("def call(args):\n") and "\n    args.clear()\n" in exact  # no gutters
        return tool_call("edit_file", file_path=path, old_string=exact, new_string="# speed: 1.5\n" + exact)

    turn = [
        shell("python runner.py --time --iters 5"),
        shell("cp candidate.py variant.py && sed -i 's/aten.mul.Tensor(buf0, 2.0)/aten.add.Tensor(buf0, buf0)/' "
              "variant.py && python runner.py variant.py --time --iters 5"),
        shell("sed -i 's/^import torch$/import torch  # shell edit/' candidate.py && python runner.py"),
        lambda p: tool_call("read_exact_source", file_path=p, start_line=10, line_count=6),
        edit_from_exact_read,
        lambda p: tool_call("evaluate_attempt", note="variant timed in the shell"),
        lambda p: final("accepted"),
    ]
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript([turn])) as upstream:
        holder["upstream"] = upstream
        session, factory, stop = run(tmp_path, upstream, proxy_exe, cpu_session(tmp_path))
        names = {t["function"]["name"] for t in upstream.chat_requests()[0]["tools"]}
        system = upstream.chat_requests()[0]["messages"][0]["content"]
        shell_out = tool_results(upstream, "gpu_shell")
    assert {"gpu_shell", "read_exact_source"} <= names and "## GPU shell" in system
    timed = runner_report(shell_out[0])
    assert timed["device"] == "cpu" and timed["matches_baseline"] is True and timed["file"] == "candidate.py"
    assert timed["baseline_ms"] > 0 and timed["candidate_ms"] > 0 and timed["iters"] == 5
    variant = runner_report(shell_out[1])  # x*2 == x+x: same values, timed against the baseline
    assert variant["file"] == "variant.py" and variant["matches_baseline"] is True and variant["speedup"] > 0
    assert "candidate.py changed: copied to /attempts/attempt_01.py" in shell_out[2]
    assert runner_report(shell_out[2])["matches_baseline"] is True
    assert [v.status for v in session.verdicts] == ["accepted"] and stop == "session:loops_done"
    accepted = session.incumbent_source()
    assert "import torch  # shell edit" in accepted and "# speed: 1.5\ndef call(args):" in accepted
    assert (session.workspace / "shell" / "variant.py").is_file()  # the shell workspace persists in the track
    assert files_containing(tmp_path / "run", [UPSTREAM_KEY, *factory.proxy.secrets()]) == []


_PROBE = r'''
import base64, json, os, socket, sys
paths = json.loads(sys.argv[1])
ports = json.loads(sys.argv[2])
out = {"env": base64.b64encode(json.dumps(dict(os.environ)).encode()).decode(),
       "exists": {p: os.path.exists(p) for p in paths["read"]}, "writes": {}, "sockets": {}}
for p in paths["write"]:
    try:
        with open(p, "w") as f:
            f.write("x")
        out["writes"][p] = "written"
    except OSError as exc:
        out["writes"][p] = type(exc).__name__
for host, port in ports:
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, port))
        out["sockets"][f"{host}:{port}"] = "connected"
    except OSError as exc:
        out["sockets"][f"{host}:{port}"] = type(exc).__name__
    finally:
        s.close()
listing = []
for root in ("/", "/workspace", "/cache", "/tmp"):
    listing.append(sorted(os.listdir(root)))
cmdlines = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            cmdlines.append(open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"))
        except OSError:
            pass
out["listing"] = base64.b64encode(json.dumps([listing, cmdlines]).encode()).decode()
print(json.dumps(out))
'''


@pytest.fixture
def outside_home(tmp_path):
    """A user home outside /tmp (the sandbox's /tmp is its own, which would hide any /tmp path anyway)."""
    import shutil
    import uuid

    home = Path(__file__).resolve().parents[1] / ".cache" / f"test-shell-home-{uuid.uuid4().hex[:8]}"
    home.mkdir(parents=True)
    yield home
    shutil.rmtree(home, ignore_errors=True)


@needs_sandbox
def test_shell_has_no_secret_no_user_files_no_network_and_writes_only_its_workspace(tmp_path, proxy_exe,
                                                                                  monkeypatch, outside_home):
    home = outside_home
    (home / ".cli-proxy-api").mkdir(parents=True)
    account = home / ".cli-proxy-api" / "notes.txt"
    account.write_text("oauth-refresh-token-SECRET-998877665544")
    user_file = home / "private.txt"
    user_file.write_text("user-private-SECRET-112233445566")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-host-secret-000111222")
    monkeypatch.setenv("SOME_SERVICE_TOKEN", "tok-host-secret-222333444555")
    session = cpu_session(tmp_path)
    outside = tmp_path / "outside.txt"
    holder: dict = {}

    def probe(path: str):
        factory_proxy = holder["factory"].proxy
        upstream = holder["upstream"]
        read = [str(account), str(user_file), str(home), str(factory_proxy.private_dir), str(tmp_path / "run"),
                str(session.workspace / "attempts"), str(Path.home() / ".cli-proxy-api"), str(Path(__file__).resolve())]
        write = [str(outside), str(home / "planted.txt"), "/usr/tilesmith-probe", "/etc/tilesmith-probe",
                 "/workspace/baseline.py",
                 "/workspace/runner.py", "/workspace/inputs/inputs.pt", "/workspace/inputs/new.pt",
                 str(session.workspace / "attempts" / "attempt_00.py"), "/workspace/mine.txt", "/tmp/scratch"]
        ports = [["127.0.0.1", factory_proxy.port], ["127.0.0.1", int(upstream.base_url.split(":")[2].split("/")[0])],
                 ["1.1.1.1", 80]]
        (session.workspace / "shell").mkdir(exist_ok=True)
        (session.workspace / "shell" / "probe.py").write_text(_PROBE)
        command = f"python probe.py '{json.dumps({'read': read, 'write': write})}' '{json.dumps(ports)}'"
        return tool_call("gpu_shell", command=command, timeout_seconds=60)

    turns = [[probe, say("probed")], [say("nothing")], [say("nothing")]]
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript(turns)) as upstream:
        holder["upstream"] = upstream
        factory = LLMOptimizerFactory(agent_model=MODEL, run_dir=tmp_path / "run", debug=True,
                                      environ=make_env(upstream, proxy_exe, home,
                                                       OPENAI_API_KEY="sk-openai-host-secret-000111222",
                                                       SOME_SERVICE_TOKEN="tok-host-secret-222333444555"))
        holder["factory"] = factory
        try:
            factory.for_graph(session).optimize(session)
            proxy_secrets = factory.proxy.secrets()
        finally:
            factory.close()
        (result,) = tool_results(upstream, "gpu_shell")
    report = json.loads(next(x for x in result.splitlines() if x.startswith("{")))
    secrets = {UPSTREAM_KEY, "sk-openai-host-secret-000111222", "tok-host-secret-222333444555",
               "oauth-refresh-token-SECRET-998877665544", "user-private-SECRET-112233445566", *proxy_secrets}
    assert len(proxy_secrets) >= 3
    env = json.loads(base64.b64decode(report["env"]))  # base64: the host's redactor cannot have hidden a leak
    assert not set(env.values()) & secrets and not any(s in v for s in secrets for v in env.values())
    assert not {"TILESMITH_API_KEY", "OPENAI_API_KEY", "SOME_SERVICE_TOKEN", "TILESMITH_API_BASE_URL"} & set(env)
    assert env["HOME"] == "/cache/home"
    assert not any(report["exists"].values()), report["exists"]
    listing = base64.b64decode(report["listing"]).decode()
    assert not any(s in listing for s in secrets)
    writes = report["writes"]
    assert writes.pop("/workspace/mine.txt") == "written" and writes.pop("/tmp/scratch") == "written"
    assert set(writes.values()) <= {"OSError", "PermissionError", "FileNotFoundError"}, writes
    assert not outside.exists() and not Path("/usr/tilesmith-probe").exists()
    assert not Path("/etc/tilesmith-probe").exists() and not (home / "planted.txt").exists()
    assert (session.workspace / "attempts" / "attempt_00.py").read_text() != "x"
    assert (session.workspace / "shell" / "mine.txt").read_text() == "x"
    assert all(v != "connected" for v in report["sockets"].values()), report["sockets"]
    assert files_containing(tmp_path / "run", sorted(secrets)) == []


@needs_sandbox
def test_shell_limits_time_output_and_never_follows_links_the_shell_leaves(tmp_path):
    from tilesmith.secrets import Redactor
    from tilesmith.agent.llm.sandbox import MAX_OUTPUT_BYTES
    from tilesmith.agent.llm.shell import GraphShell

    session = cpu_session(tmp_path)
    attempt = session.new_turn()
    original = attempt.read_text()
    victim = tmp_path / "host-file.txt"
    victim.write_text("host data")
    gs = GraphShell(_SANDBOX, session, Redactor())
    try:
        slow = gs.run("sleep 30; echo never", 2, attempt, "/attempts/attempt_01.py")
        assert slow.startswith("killed after") and "never" not in slow
        loud = gs.run(f"head -c {3 * MAX_OUTPUT_BYTES} /dev/zero | tr '\\0' a; echo END", 30, attempt, "/a")
        assert f"({3 * MAX_OUTPUT_BYTES + 4} bytes, last {MAX_OUTPUT_BYTES} shown)" in loud
        assert "aEND\n--- stderr (0 bytes) ---" in loud
        assert len(loud) < MAX_OUTPUT_BYTES + 300
        big = gs.run(": <<'EOF'\n" + "x" * 300_000 + "\nEOF\necho big-ok", 30, attempt, "/a")  # > one argv's 128 KiB
        assert big.startswith("exit code 0") and "big-ok" in big
        limits = gs.run("ulimit -t; ulimit -f; ulimit -c", 30, attempt, "/a")
        cpu, fsize, core = limits.split("---\n")[1].split()[:3]
        assert int(cpu) >= 30 and int(fsize) == 1024 * 1024 and core == "0"
        gone = gs.run("rm candidate.py", 30, attempt, "/attempts/attempt_01.py")
        assert "candidate.py was deleted; /attempts/attempt_01.py is unchanged" in gone
        link = gs.run(f"ln -sf {victim} candidate.py", 30, attempt, "/a")
        assert "is unchanged" in link and attempt.read_text() == original
        again = gs.run("head -c 40 candidate.py", 30, attempt, "/a")  # the host replaced the link, not its target
        assert victim.read_text() == "host data" and "graph()" in again
        fifo = gs.run("mkfifo pipe && mkdir -p sub && mkfifo sub/pipe2 && echo made", 30, attempt, "/a")
        assert "removed 2 FIFO/socket file(s)" in fifo and "made" in fifo
        assert not (gs.folder / "pipe").exists() and (gs.folder / "sub").is_dir()
        bad = gs.run("true", 0, attempt, "/a")
        assert bad.startswith("timeout_seconds must be an integer from 1 to 1200")
    finally:
        gs.close()
    assert not gs.cache.exists()


def test_unavailable_sandbox_means_no_shell_tool_and_a_diagnostic_that_says_why(tmp_path, standin_exe):
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript([[say("x")]] * 2)) as upstream:
        session, _, _ = run(tmp_path, upstream, standin_exe, cpu_session(tmp_path),
                            TILESMITH_BWRAP=str(tmp_path / "no-bwrap"))
        names = {t["function"]["name"] for t in upstream.chat_requests()[0]["tools"]}
    assert "gpu_shell" not in names and "read_exact_source" in names
    note = next(d for d in session.notes if d.kind == "shell_unavailable")
    assert "TILESMITH_BWRAP=" in note.message and "no-bwrap" in note.message and "bubblewrap" in note.message


def test_read_exact_source_returns_exact_lines_and_refuses_paths_outside_the_workspace(tmp_path):
    from tilesmith.agent.llm.tools import read_exact

    ws = tmp_path / "track"
    (ws / "attempts").mkdir(parents=True)
    (ws / "attempts" / "a.py").write_bytes(b"line1\n\tindented  \r\nline3")
    (tmp_path / "secret.txt").write_text("s")
    (ws / "link.txt").symlink_to(tmp_path / "secret.txt")
    assert read_exact(ws, "/attempts/a.py", 2, 2) == "\tindented  \r\nline3"
    assert read_exact(ws, "attempts/a.py") == "line1\n\tindented  \r\nline3"
    assert read_exact(ws, "/attempts/a.py", 4, 1).startswith("Error: /attempts/a.py has 3 lines")
    assert read_exact(ws, "/attempts/a.py", 1, 1001).startswith("Error: line_count must be an integer from 1")
    assert read_exact(ws, "/attempts/a.py", 0, 1).startswith("Error: start_line must be an integer at least 1")
    assert read_exact(ws, "/../secret.txt") == "Error: path traversal is not allowed"
    assert read_exact(ws, "/link.txt") == "Error: /link.txt is outside the workspace"


def test_live_trace_prints_every_tool_call_with_arguments_cut_at_1000_characters(tmp_path, standin_exe,
                                                                                monkeypatch):
    from tilesmith import progress

    stream = io.StringIO()
    monkeypatch.setattr(progress, "_default", progress.Progress(stream=stream))
    big = "x" * 5000
    turns = [[lambda p: tool_call("write_file", file_path="/notes.txt", content=big),
              lambda p: tool_call("read_fx_program"), say("done")]] * 2
    for mode, debug in (("auto", True), ("auto", False), ("off", True), ("on", False)):
        monkeypatch.setenv("TILESMITH_PROGRESS", mode)
        stream.seek(0)
        stream.truncate()
        with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript(turns)) as upstream:
            run(tmp_path / f"{mode}-{debug}", upstream, standin_exe, FakeSession(tmp_path / f"{mode}-{debug}" / "t"),
                debug=debug, TILESMITH_GPU_SHELL="0")
        lines = stream.getvalue().splitlines()
        if mode == "off" or (mode == "auto" and not debug):  # StringIO is no terminal: auto shows it only with debug
            assert lines == [], (mode, debug)
            continue
        write = next(x for x in lines if ": write_file(" in x)
        assert "turn 1 main: write_file(" in write and "characters cut]" in write
        assert len(write) < 1200 and big not in write
        assert any("read_fx_program({})" in x for x in lines)
        assert any(": read_fx_program -> graph():" in x for x in lines)


def test_skills_reach_the_proxy_in_the_system_prompt_and_no_file(tmp_path, proxy_exe):
    skill_dir = tmp_path / "skills" / "triton-tips"
    skill_dir.mkdir(parents=True)
    (skill_dir / "SKILL.md").write_text("# Triton tips\nSKILL-TEXT-MARKER-4242: prefer num_warps=4.\n")
    other = tmp_path / "skills" / "notes.md"
    other.write_text("SKILL-TEXT-MARKER-4343 more advice\n")
    value = os.pathsep.join([str(skill_dir), str(other)])
    with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript([[say("x")]] * 2)) as upstream:
        run(tmp_path, upstream, proxy_exe, FakeSession(tmp_path / "run" / "t"), TILESMITH_SKILLS=value,
            TILESMITH_GPU_SHELL="0")
        system = upstream.chat_requests()[0]["messages"][0]["content"]
    assert system.index("SKILL-TEXT-MARKER-4242") < system.index("SKILL-TEXT-MARKER-4343")
    assert "trusted skill triton-tips/SKILL.md" in system and "trusted skill skills/notes.md" in system
    trace = (tmp_path / "run" / "t" / "traces" / "turn_001.jsonl").read_text()
    assert "[skill triton-tips/SKILL.md sha256=" in trace
    assert files_containing(tmp_path / "run", ["SKILL-TEXT-MARKER"]) == []


def test_max_output_tokens_reaches_the_upstream_and_tilesmith_timeout_sets_the_request_timeout(tmp_path, proxy_exe):
    bodies = []
    for extra in ({}, {"TILESMITH_MAX_OUTPUT_TOKENS": "1234", "TILESMITH_TIMEOUT": "777"}):
        with ScriptedUpstream(api_key=UPSTREAM_KEY, models=(MODEL,), responder=TurnScript([[say("x")]] * 2)) as up:
            _, factory, _ = run(tmp_path / str(len(bodies)), up, proxy_exe, FakeSession(tmp_path / str(len(bodies))),
                                TILESMITH_GPU_SHELL="0", **extra)
            bodies.append((up.chat_requests()[0], factory._runtime.chat_model.request_timeout))
    (default, default_timeout), (set_, set_timeout) = bodies
    assert default.get("max_completion_tokens", default.get("max_tokens")) == 8192
    assert set_.get("max_completion_tokens", set_.get("max_tokens")) == 1234
    assert default_timeout == 600 and set_timeout == 777


def test_toolchains_named_by_the_environment_are_shown_read_only_and_run_inside(tmp_path):
    """The H200 image sets CC=/opt/gcc/bin/gcc: Triton's launcher build inside the shell needs that folder."""
    from tilesmith.agent.llm.sandbox import host_mounts, prepare, toolchain_dirs

    root = tmp_path / "opt" / "gcc"
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "lib" / "marker.txt").write_text("toolchain lib")
    cc = root / "bin" / "gcc"
    cc.write_text("#!/bin/sh\necho fake-gcc $(cat \"$(dirname \"$0\")/../lib/marker.txt\")\n")
    cc.chmod(0o755)
    home_cc = Path(os.path.expanduser("~")) / "no-such-dir-tilesmith" / "bin" / "gcc"
    env = {**os.environ, "CC": str(cc), "CXX": "g++", "CUDA_HOME": str(home_cc.parent.parent)}
    assert toolchain_dirs(env) == [str(root)]  # relative and missing paths, and folders under home, are skipped
    assert str(root) in host_mounts(env).read_only
    sandbox, status = prepare(env, [])
    if sandbox is None:
        pytest.skip(f"no working bubblewrap sandbox: {status.reason}")
    workspace, cache = tmp_path / "ws", tmp_path / "cache"
    workspace.mkdir()
    cache.mkdir()
    result = sandbox.run(workspace, cache, [], '"$CC"; touch "$(dirname "$CC")/written" 2>/dev/null || echo ro', 30)
    assert result.exit_code == 0 and "fake-gcc toolchain lib" in result.stdout and "ro" in result.stdout, result
    assert not (root / "bin" / "written").exists()
