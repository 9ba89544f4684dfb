"""Process helpers shared by the stages that start helper processes in their own session (the built-in
agent's search worker, the LLM agent's sandboxed shell, the gate's workers) and by the gate's workers themselves
(stdlib only: both sides of the gate import it)."""

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


def session_processes(sid: int) -> list[int]:
    """Live processes other than ``sid`` whose session id is ``sid`` (a gate worker starts its own session), from
    ``/proc/*/stat`` (field 6). Zombies are not counted (they run nothing); ``[]`` without ``/proc``."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == int(sid):
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and int(fields[3]) == int(sid) and fields[0] != b"Z":
            found.append(int(entry))
    return found
