"""Process helpers shared by the stages that start helper processes in their own session (the built-in
agent's search worker, the LLM agent's sandboxed shell)."""

from __future__ import annotations

import os
import signal
import subprocess


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (started with ``start_new_session=True``: its children included)
    and reap it; a group that is already gone or not ours is ignored."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
        pass
