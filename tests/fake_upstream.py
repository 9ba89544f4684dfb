"""Scripted OpenAI-compatible upstream on loopback, and a stand-in for the CLIProxyAPI binary.

Two test helpers live here (tests only; nothing in ``tilesmith`` imports this module):

* :class:`ScriptedUpstream` — a ``ThreadingHTTPServer`` on ``127.0.0.1`` that answers
  ``POST /v1/chat/completions`` from a script (tool calls or final text, JSON or server-sent events
  when the request has ``"stream": true``), lists models on ``GET /v1/models``, checks the bearer key
  it was given, records every request body, and can be told to fail the next requests with an HTTP
  status (to exercise transport retries). The wire format follows the OpenAI chat-completions API
  (``chat.completion`` and ``chat.completion.chunk`` objects; tool-call deltas carry ``index``).

* :class:`TurnScript` — a responder that plays a scripted Tilesmith agent turn by turn (reads the turn
  number and attempt path from the turn message, the step from the conversation length).

* A **stand-in proxy**: ``python tests/fake_upstream.py standin-proxy -config FILE [-password PW]
  [-local-model]`` serves what Tilesmith uses from CLIProxyAPI — ``/healthz``, ``/v1/models``,
  ``/v1/chat/completions`` (forwarded to the ``openai-compatibility`` entry that lists the model),
  ``/keep-alive`` with the 10 s dead-man switch — with the same client-key check, the same
  "logs an error and exits 0" behaviour on a busy port, and the same stdout banner. It lets the rest
  of the suite run without the real binary; :func:`write_standin_executable` makes an executable
  file to point ``TILESMITH_CLIPROXYAPI_EXECUTABLE`` at.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib import error as urlerror
from urllib import request as urlrequest

__all__ = [
    "MISSING_BINARY",
    "Reply",
    "ScriptedUpstream",
    "TurnScript",
    "files_containing",
    "final",
    "real_proxy_binary",
    "tool_call",
    "tool_calls",
    "write_standin_executable",
]


@dataclass
class Reply:
    """One scripted assistant message: optional text and zero or more tool calls."""

    content: str | None = None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    prompt_tokens: int = 11
    completion_tokens: int = 7


def tool_call(name: str, **args: Any) -> Reply:
    """A reply with one tool call ``name(**args)``."""
    return Reply(calls=[(name, args)])


def tool_calls(*calls: tuple[str, dict[str, Any]]) -> Reply:
    """A reply with several tool calls in one message (the agent runs them concurrently)."""
    return Reply(calls=list(calls))


def final(text: str = "done") -> Reply:
    """A final answer (no tool calls): ends the agent's turn."""
    return Reply(content=text)


Responder = Callable[[dict[str, Any]], Reply]


def _completion(reply: Reply, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.calls:
        message["tool_calls"] = [
            {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}
            for name, args in reply.calls
        ]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if reply.calls else "stop"}],
        "usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                  "total_tokens": reply.prompt_tokens + reply.completion_tokens},
    }


def _chunks(reply: Reply, model: str, include_usage: bool) -> list[dict[str, Any]]:
    cid = f"chatcmpl-{uuid.uuid4().hex[:12]}"
    base = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    out = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    if reply.content:
        half = len(reply.content) // 2
        for piece in (reply.content[:half], reply.content[half:]):
            if piece:
                out.append({**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
    for i, (name, args) in enumerate(reply.calls):
        text = json.dumps(args)
        cut = len(text) // 2
        out.append({**base, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
             "function": {"name": name, "arguments": text[:cut]}}]}, "finish_reason": None}]})
        out.append({**base, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, "function": {"arguments": text[cut:]}}]}, "finish_reason": None}]})
    usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
             "total_tokens": reply.prompt_tokens + reply.completion_tokens}
    last = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls" if reply.calls else "stop"}]}
    if include_usage:
        out.append(last)
        out.append({**base, "choices": [], "usage": usage})
    else:
        out.append({**last, "usage": usage})
    return out


class ScriptedUpstream:
    """An OpenAI-compatible chat-completions server on loopback, answering from a script.

    ``responder`` receives each request body (a dict) and returns a :class:`Reply`; the default
    pops :attr:`queue` and answers ``final("done")`` once it is empty. Requests are recorded in
    :attr:`requests` (bodies) and :attr:`headers` (lower-cased header dicts) in arrival order.

    Use as a context manager; :attr:`base_url` includes ``/v1``.
    """

    def __init__(self, *, models: tuple[str, ...] = ("scripted-model",), api_key: str | None = None,
                 responder: Responder | None = None) -> None:
        self.models = models
        self.api_key = api_key
        self.responder: Responder = responder or self._from_queue
        self.queue: list[Reply] = []
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.failures: list[int] = []
        """HTTP statuses to answer the next chat requests with, one per request, before scripting."""
        self.lock = threading.Lock()
        self.on_request: Callable[[int, dict[str, Any]], None] | None = None
        """Called with (1-based request number, body) before answering; tests use it to kill things."""
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- script helpers -------------------------------------------------------------------------
    def _from_queue(self, body: dict[str, Any]) -> Reply:
        with self.lock:
            return self.queue.pop(0) if self.queue else final("done")

    def chat_requests(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if "messages" in r]

    # -- server ---------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def start(self) -> ScriptedUpstream:
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep test output clean
                return

            def _auth_ok(self) -> bool:
                if upstream.api_key is None:
                    return True
                return self.headers.get("Authorization", "") == f"Bearer {upstream.api_key}"

            def _json(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path.rstrip("/").endswith("/models"):
                    if not self._auth_ok():
                        self._json(401, {"error": {"message": "bad key", "type": "invalid_request_error"}})
                        return
                    self._json(200, {"object": "list", "data": [
                        {"id": m, "object": "model", "created": 0, "owned_by": "scripted"} for m in upstream.models]})
                    return
                self._json(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._json(404, {"error": {"message": "not found"}})
                    return
                with upstream.lock:
                    upstream.requests.append(body)
                    upstream.headers.append({k.lower(): v for k, v in self.headers.items()})
                    number = len(upstream.requests)
                    status = upstream.failures.pop(0) if upstream.failures else None
                if upstream.on_request is not None:
                    upstream.on_request(number, body)
                if not self._auth_ok():
                    self._json(401, {"error": {"message": "invalid api key", "type": "invalid_request_error"}})
                    return
                if status is not None:
                    self._json(status, {"error": {"message": f"scripted failure {status}", "type": "server_error"}})
                    return
                reply = upstream.responder(body)
                model = body.get("model", "scripted-model")
                if body.get("stream"):
                    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    for chunk in _chunks(reply, model, include_usage):
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self._json(200, _completion(reply, model))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="scripted-upstream", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> ScriptedUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class TurnScript:
    """A responder that plays a scripted Tilesmith agent.

    ``turns[i][k]`` is called with the turn's attempt path (as the file tools address it, e.g.
    ``/attempts/attempt_01.py``) and returns the reply for the main agent's ``k``-th model call of
    turn ``i + 1`` (the turn number is read from the turn message, the step from the number of assistant
    messages already in the conversation). ``subagent[k]`` answers a subagent's ``k``-th call (a request
    whose system prompt is not Tilesmith's). Past the end of a plan the reply is ``default``.
    """

    MAIN_MARK = "GPU performance engineer"

    def __init__(self, turns: list[list[Callable[[str], Reply]]], *,
                 subagent: list[Callable[[str], Reply]] | None = None, default: Reply | None = None) -> None:
        self.turns = turns
        self.subagent = subagent or []
        self.default = default or final("no further ideas")
        self.calls: list[tuple[str, int, int]] = []
        """(agent, turn, step) of every request answered, in order."""
        self._lock = threading.Lock()

    @staticmethod
    def _text(content: Any) -> str:
        if isinstance(content, list):
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return content or ""

    def __call__(self, body: dict[str, Any]) -> Reply:
        messages = body.get("messages") or []
        system = next((self._text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")), "")
        user = next((self._text(m.get("content")) for m in messages if m.get("role") == "user"), "")
        step = sum(1 for m in messages if m.get("role") == "assistant")
        turn_match = re.search(r"Turn (\d+)\.", user)
        turn = int(turn_match.group(1)) if turn_match else 0
        path_match = re.search(r"attempt file for this turn is (\S+?);", user)
        path = path_match.group(1) if path_match else ""
        if self.MAIN_MARK not in system:
            with self._lock:
                self.calls.append(("subagent", turn, step))
            plan = self.subagent
        else:
            with self._lock:
                self.calls.append(("main", turn, step))
            plan = self.turns[turn - 1] if 0 < turn <= len(self.turns) else []
        return plan[step](path) if step < len(plan) else self.default


# ---------------------------------------------------------------------------------------------
# Stand-in proxy (a process that behaves like `cli-proxy-api -config FILE` for what Tilesmith uses)
# ---------------------------------------------------------------------------------------------

_STANDIN_VERSION = "standin-0"


def _standin_models(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Map model id -> openai-compatibility entry (other provider sections list placeholder ids)."""
    out: dict[str, dict[str, Any]] = {}
    for entry in cfg.get("openai-compatibility") or []:
        if not entry.get("base-url"):
            continue
        prefix = (entry.get("prefix") or "").strip("/")
        for model in entry.get("models") or []:
            alias = model.get("alias") or model.get("name")
            name = f"{prefix}/{alias}" if prefix else alias
            out[name] = {**entry, "_upstream_model": model.get("name")}
    catalogs = {
        "claude-api-key": ("claude-sonnet-4-5-20250929",),
        "gemini-api-key": ("gemini-2.5-pro",),
        "vertex-api-key": ("gemini-2.5-pro",),
        "xai-api-key": ("grok-4",),
        "codex-api-key": ("gpt-5",),
    }
    for section, ids in catalogs.items():
        for entry in cfg.get(section) or []:
            names = [m.get("alias") or m.get("name") for m in (entry.get("models") or [])] or list(ids)
            for name in names:
                out.setdefault(name, {"_native": section})
    return out


def _standin_main(argv: list[str]) -> int:
    import yaml  # the test environment has PyYAML (a tilesmith dependency)

    args = {"-config": None, "-password": None}
    i = 0
    while i < len(argv):
        flag = "-" + argv[i].lstrip("-")
        if flag in args:
            args[flag] = argv[i + 1]
            i += 2
        elif flag == "-local-model":
            i += 1
        else:
            print(f"flag provided but not defined: {argv[i]}", flush=True)
            return 2
    print(f"CLIProxyAPI Version: {_STANDIN_VERSION}, Commit: none, BuiltAt: unknown", flush=True)
    try:
        cfg = yaml.safe_load(Path(args["-config"] or "config.yaml").read_text()) or {}
    except OSError as exc:
        print(f"[error] failed to load config: {exc}", flush=True)
        return 0
    host, port = cfg.get("host") or "0.0.0.0", int(cfg.get("port") or 8317)
    keys = set(cfg.get("api-keys") or [])
    models = _standin_models(cfg)
    password = args["-password"]
    last_ping = [time.monotonic()]
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: Any) -> None:
            return

        def _json(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _client_ok(self) -> bool:
            if not keys:
                return True
            auth = self.headers.get("Authorization", "")
            token = auth.split(" ", 1)[1] if auth.lower().startswith("bearer ") else auth
            return (token or self.headers.get("X-Api-Key", "")) in keys

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/healthz":
                self._json(200, {"status": "ok"})
            elif self.path == "/keep-alive" and password:
                auth = self.headers.get("Authorization", "")
                if auth != f"Bearer {password}":
                    self._json(401, {"error": "invalid password"})
                    return
                last_ping[0] = time.monotonic()
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                if not self._client_ok():
                    self._json(401, {"error": "Invalid API key"})
                    return
                self._json(200, {"object": "list", "data": [
                    {"id": m, "object": "model", "created": 0, "owned_by": "standin"} for m in sorted(models)]})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path != "/v1/chat/completions":
                self._json(404, {"error": "not found"})
                return
            if not self._client_ok():
                self._json(401, {"error": "Invalid API key"})
                return
            body = json.loads(raw or b"{}")
            entry = models.get(body.get("model", ""))
            if entry is None or "_native" in entry:
                self._json(400, {"error": {"message": f"unknown provider for model {body.get('model')}",
                                           "code": "model_not_found"}})
                return
            body["model"] = entry["_upstream_model"]
            key = ((entry.get("api-key-entries") or [{}])[0]).get("api-key", "")
            req = urlrequest.Request(entry["base-url"].rstrip("/") + "/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
            try:
                resp = urlrequest.urlopen(req, timeout=120)  # noqa: S310 - loopback test upstream
                status, ctype, data = resp.status, resp.headers.get("Content-Type", ""), resp.read()
            except urlerror.HTTPError as exc:
                status, ctype, data = exc.code, exc.headers.get("Content-Type", "application/json"), exc.read()
            self.send_response(status)
            self.send_header("Content-Type", ctype or "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        print(f"[error] proxy service exited with error: failed to start HTTP server: listen tcp "
              f"{host}:{port}: bind: address already in use ({exc})", flush=True)
        return 0
    server.daemon_threads = True
    print(f"API server started successfully on: {host}:{port}", flush=True)

    def watchdog() -> None:
        while not stop.wait(0.25):
            if password and time.monotonic() - last_ping[0] > 10.0:
                print("[warning] keep-alive endpoint idle for 10s, shutting down", flush=True)
                server.shutdown()
                return

    threading.Thread(target=watchdog, daemon=True).start()
    import signal

    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever()
    finally:
        stop.set()
        server.server_close()
    return 0


def write_standin_executable(folder: Path) -> Path:
    """Write an executable ``cli-proxy-api`` script in ``folder`` that runs the stand-in proxy."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cli-proxy-api"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} standin-proxy \"$@\"\n")
    path.chmod(0o755)
    return path


def real_proxy_binary() -> str | None:
    """The real CLIProxyAPI binary for ``@pytest.mark.proxy`` tests, or ``None`` when absent.

    Order: ``TILESMITH_CLIPROXYAPI_EXECUTABLE`` (when it is an executable file), then
    ``<repo>/.cache/bin/cli-proxy-api`` (what scripts/build-cliproxyapi.sh builds).
    """
    explicit = os.environ.get("TILESMITH_CLIPROXYAPI_EXECUTABLE")
    candidates = [Path(explicit)] if explicit else []
    candidates.append(Path(__file__).resolve().parents[1] / ".cache" / "bin" / "cli-proxy-api")
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


MISSING_BINARY = ("CLIProxyAPI binary absent: run scripts/build-cliproxyapi.sh (builds .cache/bin/cli-proxy-api) "
                  "or set TILESMITH_CLIPROXYAPI_EXECUTABLE")


def files_containing(root: Path, secrets: tuple[str, ...] | list[str]) -> list[str]:
    """Paths (relative to ``root``) of files under ``root`` whose bytes contain any of ``secrets``."""
    hits = []
    needles = [s.encode() for s in secrets if s]
    for path in sorted(Path(root).rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            if any(n in data for n in needles):
                hits.append(str(path.relative_to(root)))
    return hits


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "standin-proxy":
        sys.exit(_standin_main(sys.argv[2:]))
    print("usage: fake_upstream.py standin-proxy -config FILE [-password PW] [-local-model]", file=sys.stderr)
    sys.exit(2)
