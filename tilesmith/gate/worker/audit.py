"""PEP 578 audit hook of a gate worker: what candidate code may not do inside the worker process.

:func:`install` runs first thing in ``python -m tilesmith.gate.worker`` (before torch is imported, long
before any candidate), adds one ``sys.addaudithook`` hook (PEP 578: it cannot be removed) and returns an
:class:`Audit` handle. The hook does nothing until :meth:`Audit.arm`, which the worker calls right before
it imports the candidate; from then on every audited event raised **from candidate code** is recorded
(and, by raising :class:`PermissionError` inside the event, blocked). The worker drains the records into
every answer (``facts["audit"]``); the host turns them into failures with :func:`tilesmith.gate.host.answers.failures_from_answer`.

The events, the attribution rule and the decision are shared with production verification's hook in the user's
process (:mod:`tilesmith.gate.auditrules`); this module says what they mean in a worker. What "from candidate
code" means (the attribution rule):

* a **candidate frame** is a frame whose code file lies under the worker's private directory and did not
  exist when the worker armed the hook: the candidate wrapper and every kernel module Inductor wrote for
  it. The original wrapper and the incumbent (loaded before arming) are trusted files.
* **transparent** frames are the standard library (``sysconfig`` stdlib, not site-packages), frozen
  modules and pseudo-files such as ``<string>``; every other frame (torch, Triton, numpy, tilesmith) is a
  **library** frame.
* *direct*: walking outward from the event, the first frame that is not transparent is a candidate
  frame — the candidate raised the event itself or through the standard library (``inspect.stack``,
  ``subprocess.run``, ``open``). Used where libraries legitimately raise the same event under the
  candidate's import or call (torch and Triton call ``sys._getframe``, ``exec``, ``compile``, start
  compilers, load libraries).
* *anywhere*: some candidate frame is on the stack — for what no library does on a wrapper's behalf
  (writing outside the private directory, reading private files, sockets, tracing, ``gc`` walks).
  This is what catches laundering through a library (``numpy.loadtxt``, ``codecache.write_atomic``).

Check ids (``CheckFailure.check``) and events (CPython 3.11/3.12 audit events table):

* ``audit_introspection`` — direct: ``sys._getframe``, ``sys._getframemodulename``, access to
  ``tb_frame``/``gi_frame``/``cr_frame``/``ag_frame``/``__code__`` (``object.__getattr__``), assigning a
  function's ``__code__`` (``object.__setattr__``/``__delattr__``), ``code.__new__`` (``code.replace``),
  ``function.__new__``, ``compile``/``exec``/``eval``/``marshal.loads`` outside an ``import``; anywhere:
  ``sys._current_frames``, ``sys._current_exceptions``, ``gc.get_objects``/``get_referrers``/
  ``get_referents``, ``sys.settrace``/``sys.setprofile``, ``sys.monitoring.*``, ``sys.addaudithook``.
* ``audit_file_write`` — anywhere: ``open`` for writing, remove/rename/link/chmod/mkdir/rmtree/copy
  events on a path outside the worker's private directory, or on a file that existed there before the
  candidate was imported (the original wrapper, its compiled kernels; Inductor's ``*.lock`` files
  and autotuning results, ``*.best_config`` replaced through Inductor rather than by candidate code, excepted).
* ``audit_file_read`` — anywhere: ``open`` for reading or listing a directory outside the private
  directory, the Python installation, imported packages, system directories (``/usr``, ``/lib*``,
  ``/etc``, ``/opt``, ``/bin``, ``/sbin``, ``/sys``, ``/dev``, ``/proc`` except other processes'
  ``/proc/<pid>``), ``CUDA_HOME`` and the folders passed to :func:`install` (the worker passes Tilesmith's
  native kernel directory, ``TILESMITH_KERNEL_DIR``: prebuilt kernels a candidate loads read-only);
  ``sys.path`` entries may be listed (import scanning).
* ``audit_process`` — direct: ``subprocess.Popen``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn``,
  ``os.putenv``/``os.unsetenv``; anywhere: ``os.system``, ``os.fork``, ``os.forkpty``, ``os.kill``,
  ``os.killpg`` (signals to the worker itself excepted: they can only crash it) and a ``subprocess.Popen`` started by a library under
  candidate code that is not a known compiler at a system path with arguments that cannot run another program
  (:mod:`tilesmith.gate.toolargs`: ``g++ -wrapper``, ``-B``, plugins, ``x-g++`` are refused).
* ``audit_network`` — anywhere: sockets, name lookups, ``urllib``/``http.client``/``ftplib``/mail clients.
* ``audit_native`` — direct: every ``ctypes.*`` event and ``mmap.__new__``.

Once armed, the hook judges every thread until the process ends; the worker ends without interpreter finalization
(``__main__.leave``), so no candidate ``__del__`` runs after the hooks are cleared.

Not covered (see docs/gate.md, threat model): native code (C++ kernels, ``load_inline``) does not raise audit
events; a library callable run on a thread the candidate started carries no candidate frame; frame access laundered through a library that walks frames
itself (the *direct* events) is not attributed; telling the gate from the user's process apart by
looking at ``sys.modules``, the environment or the working directory raises no event at all.

This module is imported by the worker before torch: it imports only the standard library (and the stdlib-only
:mod:`tilesmith.gate.auditrules`) at module level.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tilesmith.gate.auditrules import (
    CANDIDATE as _CANDIDATE,
    LIBRARY as _LIBRARY,
    MAX_RECORDS as _MAX_RECORDS,
    TRANSPARENT as _TRANSPARENT,
    Rules,
    is_stdlib,
    site_dirs as _site_dirs,
    stdlib_roots,
    under as _under,
)

_SYSTEM_READ_ROOTS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/bin", "/sbin", "/sys", "/dev",
                      "/proc", "/nix/store")


class _State(Rules):
    """Everything the hook needs; reachable only from the hook's closure and the Audit handle. The decision itself
    is :meth:`tilesmith.gate.auditrules.Rules.judge`; this class says what a candidate frame, a writable path and a
    readable path are in a worker."""

    def __init__(self, private_dir: str, readable: tuple[str, ...] = ()) -> None:
        self.private = os.path.realpath(private_dir)
        self.extra_readable = tuple(os.path.realpath(p) for p in readable if p)
        self.armed = False
        self.busy: set[int] = set()
        self.records: list[dict[str, Any]] = []
        self.seen: set[tuple[str, str]] = set()
        self.trusted: frozenset[str] = frozenset()
        self.kinds: dict[str, int] = {}
        self.readable: tuple[str, ...] = ()
        self.listable: frozenset[str] = frozenset()
        self.stdlib: tuple[str, ...] = ()
        self.site: tuple[str, ...] = ()
        self.own_file = os.path.realpath(__file__)
        self.pid = str(os.getpid())

    # -- setup -------------------------------------------------------------------------------------
    def arm(self) -> None:
        trusted = set()
        for root, dirs, files in os.walk(self.private):
            trusted.add(os.path.realpath(root))
            trusted.update(os.path.realpath(os.path.join(root, f)) for f in files)
        self.trusted = frozenset(trusted)
        self.stdlib = stdlib_roots()
        self.site = tuple({os.path.realpath(p) for p in _site_dirs()})
        roots = {self.private, *self.stdlib, *self.site, *_SYSTEM_READ_ROOTS, *self.extra_readable}
        for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                       os.path.dirname(os.path.dirname(sys.executable))):
            roots.add(os.path.realpath(prefix))
        for name in ("CUDA_HOME", "CUDA_PATH", "ROCM_PATH"):
            if os.environ.get(name):
                roots.add(os.path.realpath(os.environ[name]))
        for name, module in list(sys.modules.items()):
            if "." in name or module is None:
                continue
            for entry in list(getattr(module, "__path__", None) or []):
                roots.add(os.path.realpath(entry))
            file = getattr(module, "__file__", None)
            if isinstance(file, str) and not getattr(module, "__path__", None):
                roots.add(os.path.realpath(file))
        # Rationale: "/" or a home directory as a prefix would allow reading everything below it.
        self.readable = tuple(r for r in roots if r not in ("/", os.path.expanduser("~")))
        self.listable = frozenset(os.path.realpath(p or ".") for p in sys.path if isinstance(p, str))
        self.kinds = {}
        self.snapshot_env()
        self.armed = True

    # -- frames ------------------------------------------------------------------------------------
    def kind(self, filename: str) -> int:
        kind = self.kinds.get(filename)
        if kind is None:
            if filename.startswith("<"):
                kind = _TRANSPARENT
            else:
                real = os.path.realpath(filename)
                if _under(real, (self.private,)) and real not in self.trusted:
                    kind = _CANDIDATE
                elif real == self.own_file or is_stdlib(real, self.stdlib, self.site):
                    kind = _TRANSPARENT
                else:
                    kind = _LIBRARY
            self.kinds[filename] = kind
        return kind

    def direct_frame(self, frame: Any, through_imports: bool = False) -> Any:
        """The subject frame of an import request made at ``frame``: walking outward over the standard library,
        the first other frame when it is a candidate frame (before :meth:`arm`: any file of the private
        directory, the trusted worker's original); else ``None``. Stops at the first library frame (cheap:
        called for every ``import`` statement, :mod:`tilesmith.gate.worker.imports`). Without
        ``through_imports`` a frame of the import machinery also stops it: the request is then made by a module
        body being imported (or by the machinery itself), and the import that started it was judged already."""
        while frame is not None:
            name = frame.f_code.co_filename
            if not through_imports and name.startswith("<frozen importlib"):
                return None
            kind = self.kind(name)
            if kind == _CANDIDATE:
                return frame
            if kind == _LIBRARY:
                return None
            frame = frame.f_back
        return None

    # -- paths -------------------------------------------------------------------------------------
    def writable(self, path: str | None, event: str = "open", direct: bool = True) -> bool:
        if path == "":
            return True
        if path is None:
            return False
        if path in ("/dev/null",):
            return True
        if not _under(path, (self.private,)):
            return False
        if event == "os.mkdir" and os.path.isdir(path):
            return True  # makedirs(exist_ok=True) of an existing (trusted) folder: fails, changes nothing
        # Rationale: Inductor's autotuner atomically replaces a kernel's ``.best_config`` (a rename onto the
        # template's copy) when a candidate's first call runs that kernel on CUDA (seen on the H200); through a
        # library that is allowed. Every other trusted file (the original wrapper, kernel sources, binaries)
        # stays read-only, also through ``write_atomic`` (red-team finding 1). Nothing written here outlives
        # the worker: later workers start from the template taken before any candidate was imported.
        return (path not in self.trusted or path.endswith(".lock")
                or (not direct and path.endswith(".best_config")))

    def readable_path(self, path: str | None) -> bool:
        if path is None or path == "":
            return True  # a descriptor opened earlier (under the same rules), a pipe or a socket
        if path.startswith("/proc/"):
            head = path.split(os.sep)[2]
            if head.isdigit() and head != self.pid:
                return False
        # A sys.path entry itself (importlib.metadata opens each one as a possible zip archive, including
        # setuptools' editable ``__editable__.<name>.finder.__path_hook__`` entry): code is imported from there.
        return _under(path, self.readable) or path in self.listable or self.package_metadata(path)

    def package_metadata(self, path: str) -> bool:
        """A file or folder of installed-package metadata (``<entry>/<name>.dist-info/...`` or ``.egg-info``)
        directly under a ``sys.path`` entry. Rationale: ``importlib.metadata.entry_points()`` (called by
        libraries at import, e.g. plugin discovery) reads every such folder on ``sys.path``; an editable
        install of the user's own package leaves ``<checkout>/<name>.egg-info`` beside its sources, which
        CI found outside the Python installation."""
        parent, name = os.path.split(path)
        while parent and parent not in self.listable:
            parent, name = os.path.split(parent)
            if parent in ("", os.sep):
                return False
        return name.endswith((".dist-info", ".egg-info"))

    def listable_path(self, path: str | None) -> bool:
        return path in self.listable or self.readable_path(path)

    # -- records -----------------------------------------------------------------------------------
    def record(self, check: str, event: str, detail: str, frame: Any) -> None:
        key = (check, detail)
        if key in self.seen or len(self.records) >= _MAX_RECORDS:
            return
        self.seen.add(key)
        code = frame.f_code
        self.records.append({"check": check, "event": event, "detail": detail[:300],
                             "line": frame.f_lineno, "function": code.co_name[:80]})


class Audit:
    """Handle the worker keeps: :meth:`arm` before the candidate's import, :meth:`drain` into every answer."""

    def __init__(self, state: _State) -> None:
        self._state = state
        self._arm = state.arm
        self._records = state.records
        self._seen = state.seen

    def arm(self) -> None:
        """Snapshot the trusted files of the private directory and start judging events."""
        self._arm()

    def guard_imports(self, guard: Any) -> None:
        """Install ``guard`` (:class:`tilesmith.gate.worker.imports.ImportGuard`), attributing its import
        requests to candidate frames by the *direct* rule (:meth:`_State.direct_frame`)."""
        guard.install(self._state.direct_frame)

    def drain(self) -> list[dict[str, Any]]:
        """The records since the last drain (each: check, event, detail, candidate line and function)."""
        out = list(self._records)
        del self._records[:]
        self._seen.clear()
        return out


def install(private_dir: str, readable: tuple[str, ...] = ()) -> Audit:
    """Add the worker's audit hook (once per process; it stays for the process's life).

    ``readable``: extra folders candidate code may read through libraries (never write): the worker passes
    Tilesmith's native kernel directory (``TILESMITH_KERNEL_DIR``), which ``tilesmith.kernels.runtime``
    reads when a candidate loads a prebuilt kernel.
    """
    import _thread

    state = _State(private_dir, readable)
    getframe = sys._getframe
    ident = _thread.get_ident

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if not state.armed:
            return
        me = ident()
        if me in state.busy:
            return
        state.busy.add(me)
        try:
            state.judge(event, args, getframe(1))
        finally:
            state.busy.discard(me)

    sys.addaudithook(hook)
    return Audit(state)
