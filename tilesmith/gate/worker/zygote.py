"""Worker side of the gate's fork server (``TILESMITH_GATE_FORKSERVER=1``): the zygote process.

``python -P -m tilesmith.gate.worker --device-type=cpu|cuda --zygote`` is started by
:mod:`tilesmith.gate.host.forkserver` exactly like a worker (same scrubbed environment, its own session and
private directory), but instead of serving requests it imports what a worker imports before ``ready``
(:func:`.core.prewarm`: torch, Inductor, the worker modules; no device context, no wrapper, no candidate code,
no audit hook) and then forks one fresh worker per request. :func:`serve` returns only in such a child, after
:func:`_become_worker` made it look to the rest of ``__main__.main`` like a process the host started itself.

Control channel: fd 0 is one end of an ``AF_UNIX``/``SOCK_SEQPACKET`` socket pair (one JSON object per
datagram). Host → zygote: ``{"op": "fork", "env": {...}, "cwd": "..."}`` carrying three descriptors with
``SCM_RIGHTS`` (the worker's protocol stdin, protocol stdout and log), and ``{"op": "watch", "pid": N}`` once the
host holds a pidfd of child ``N``. Zygote → host: ``ready``, ``forked`` (``pid``) or ``error`` (``message``), and
``exit`` (``pid``, ``code`` as :attr:`subprocess.Popen.returncode` would say it). Why descriptors over the
socket rather than named FIFOs in the worker's folder: nothing to create, open in the right order or clean up,
no blocking ``open``, and the host keeps the same pipe objects it has with ``subprocess``.

Reaping: a child is reaped only after the host said ``watch`` (until then it stays a zombie), so its pid cannot
be reused before the host holds a pidfd for it. The zygote exits when the host does (pidfd of its parent) or
closes the channel; a running child then goes on (it watches the host, not the zygote) and is reaped by init.

Errors: a refused fork (more than one thread in the zygote, CUDA's driver initialised, ``fork`` failing) answers
``error``; the host then starts that worker with ``subprocess`` instead.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import tempfile
import time
import traceback

MAX_MESSAGE = 1 << 20


def _send(ctl: socket.socket, **message: object) -> None:
    ctl.send(json.dumps(message).encode())


#: ``CUDA_ERROR_NOT_INITIALIZED``: what every driver call but ``cuInit``/``cuDriverGetVersion`` answers before ``cuInit``.
_CUDA_NOT_INITIALIZED = 3


def cuda_driver_initialised() -> bool:
    """Whether CUDA's driver was initialised (``cuInit``) in this process: a child forked after that could not use
    CUDA (``CUDA_ERROR_NOT_INITIALIZED`` or worse), one forked before can.

    Not whether ``libcuda`` is merely loaded: ``import torch`` loads it without initialising it (the initialiser of
    the CUDA 13 wheels' ``libcublasLt.so.13`` opens ``libcuda.so.1``: ``LD_DEBUG=libs python -c "import torch"``,
    torch 2.11.0+cu130), so on a GPU machine every zygote has it mapped. The probe looks the library up with
    ``RTLD_NOLOAD`` (never loads it) and asks ``cuCtxGetCurrent``, which initialises nothing and answers
    ``CUDA_ERROR_NOT_INITIALIZED`` until ``cuInit`` ran (CUDA Driver API, "Initialization"). A library without
    that symbol counts as initialised (refuse rather than guess)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False  # not loaded: nothing can have initialised it
    try:
        probe = lib.cuCtxGetCurrent
    except AttributeError:
        return True
    probe.restype = ctypes.c_int
    probe.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    context = ctypes.c_void_p()
    return probe(ctypes.byref(context)) != _CUDA_NOT_INITIALIZED


def _refusal() -> str | None:
    """Why forking now would be unsafe, or ``None``."""
    tasks = os.listdir("/proc/self/task")
    if len(tasks) != 1:
        names: dict[str, int] = {}
        for tid in tasks:
            try:
                with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as handle:
                    name = handle.read().strip()
            except OSError:
                name = "?"
            names[name] = names.get(name, 0) + 1
        which = ", ".join(f"{n} ×{c}" if c > 1 else n for n, c in sorted(names.items()))
        return f"the zygote has {len(tasks)} threads ({which}; a fork copies none of them, but maybe their locks)"
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        return "CUDA is initialised in the zygote"
    if cuda_driver_initialised():
        return "CUDA's driver is initialised in the zygote (cuInit ran)"
    return None


def serve(device_type: str) -> int:
    """Prewarm, announce ``ready`` on the control socket, then fork workers on request until the host goes.

    Returns the host's pidfd, only in a forked child (set up by :func:`_become_worker`); the zygote itself
    ends with ``os._exit``."""
    ctl = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    host = os.getppid()
    host_fd = os.pidfd_open(host)
    if os.getppid() != host:  # the host ended before the pidfd was opened: that pid may be another process
        os._exit(0)
    from tilesmith.gate.worker.confine import protect_zygote
    from tilesmith.gate.worker.core import prewarm

    protect_zygote()
    started = time.perf_counter()
    prewarm(device_type)
    _send(ctl, op="ready", pid=os.getpid(), seconds=round(time.perf_counter() - started, 3), refusal=_refusal())
    watched: set[int] = set()
    while True:
        ready, _, _ = select.select([ctl, host_fd], [], [], 0.05)
        if host_fd in ready:
            os._exit(0)
        if ctl in ready:
            try:
                data, fds, _, _ = socket.recv_fds(ctl, MAX_MESSAGE, 3)
            except OSError:
                os._exit(0)
            if not data:
                os._exit(0)
            request = json.loads(data)
            if request.get("op") == "watch":
                watched.add(int(request["pid"]))
            elif request.get("op") == "fork":
                if _fork(ctl, request, fds, host_fd):
                    return host_fd
            for fd in fds:
                os.close(fd)
        for pid in list(watched):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                watched.discard(pid)
                continue
            if done:
                watched.discard(pid)
                _send(ctl, op="exit", pid=pid, code=os.waitstatus_to_exitcode(status))


def _fork(ctl: socket.socket, request: dict, fds: list[int], host_fd: int) -> bool:
    """Fork one worker; True in the child (set up), False in the zygote (answer sent, descriptors still to close)."""
    refusal = _refusal()
    if refusal is None and len(fds) != 3:
        refusal = f"{len(fds)} descriptors instead of 3"
    if refusal is not None:
        _send(ctl, op="error", message=refusal)
        return False
    done_r, done_w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(done_r)
        os.close(done_w)
        _send(ctl, op="error", message=f"fork failed: {exc}")
        return False
    if pid == 0:
        try:
            os.close(done_r)
            _become_worker(ctl, request, fds, (host_fd, done_w))
            os.write(done_w, b"1")  # set up, in its own session: the zygote's end (or group kill) no longer ends it
            os.close(done_w)
        except BaseException:  # noqa: BLE001 - never fall back into the zygote's loop
            traceback.print_exc()
            os._exit(127)
        return True
    os.close(done_w)
    try:
        ok = bool(select.select([done_r], [], [], 10.0)[0]) and os.read(done_r, 1) == b"1"
    finally:
        os.close(done_r)
    if not ok:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        _send(ctl, op="error", message="the forked child failed to set itself up (see the worker log)")
        return False
    _send(ctl, op="forked", pid=pid)
    return False


def _become_worker(ctl: socket.socket, request: dict, fds: list[int], keep: tuple[int, ...]) -> None:
    """In the child: its own session, the host's pipes as fds 0/1 and its log as fd 2, the zygote's control
    socket closed (a candidate cannot reach the zygote), the worker's environment (its private caches) in
    ``os.environ`` before anything reads it, its private folder as working directory."""
    os.setsid()
    stdin_r, stdout_w, log_fd = fds
    ctl.close()
    os.dup2(log_fd, 2)
    os.dup2(stdin_r, 0)
    os.dup2(stdout_w, 1)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in dict(request["env"]).items()})
    tempfile.tempdir = None  # tempfile caches TMPDIR once read: read it again, from the worker's environment
    _rebase_globals(os.getcwd(), str(request["cwd"]))
    os.chdir(str(request["cwd"]))
    sys.argv = [a for a in sys.argv if a != "--zygote"]
    leftover = [int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2 and int(fd) not in keep]
    for fd in leftover:  # the listing's own descriptor is closed already: these are inherited
        try:
            kind = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if kind.startswith(("socket:", "pipe:")):
            raise RuntimeError(f"zygote child inherited descriptor {fd} ({kind})")


def _rebase_globals(old: str, new: str) -> int:
    """Point paths computed at import under the zygote's folder into the worker's (same layout: ``inductor``,
    ``triton``, ``tmp``), e.g. Inductor's ``codecache._HEADER_DIR`` (precompiled headers, from ``TMPDIR`` at import)
    and Dynamo's ``package.DynamoCache._path_prefix`` (an attribute of a module-level object, from
    ``TORCHINDUCTOR_CACHE_DIR``). Without this a forked worker would write there: a cache shared by every forked
    worker, which the audit hook also refuses to candidate code. ``str`` and ``pathlib`` values only: the globals of
    loaded modules and the instance attributes of their module-level objects (one level; classes and modules are
    not entered). After a CUDA ``prewarm`` on torch 2.11, a search of every module's globals and their objects'
    attributes for the zygote's folders found those three, ``site``'s user paths (from ``HOME``) and
    ``tempfile.tempdir`` (reset by the caller). Returns how many were rebased."""
    from pathlib import PurePath

    prefix = old.rstrip(os.sep) + os.sep

    def rebase(namespace: dict) -> int:
        count = 0
        for name, value in list(namespace.items()):
            kind = type(value)  # not isinstance: it reads __class__, which some objects hook (deprecation warnings)
            path = issubclass(kind, PurePath)
            text = str(value) if path else value
            if (path or issubclass(kind, str)) and (text == old or text.startswith(prefix)):
                rebased = new + text[len(old):]
                namespace[name] = kind(rebased) if path else rebased
                count += 1
        return count

    count = 0
    seen: set[int] = set()
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        count += rebase(namespace)
        for value in list(namespace.values()):
            if issubclass(type(value), (type, type(sys))) or id(value) in seen:
                continue
            seen.add(id(value))
            try:
                attributes = object.__getattribute__(value, "__dict__")
            except (AttributeError, TypeError):
                continue
            if isinstance(attributes, dict):
                count += rebase(attributes)
    return count
