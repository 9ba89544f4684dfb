"""PEP 578 audit hook of a gate worker: what candidate code may not do inside the worker process.

:func:`install` runs first thing in ``python -m tilesmith.gate.worker`` (before torch is imported, long
before any candidate), adds one ``sys.addaudithook`` hook (PEP 578: it cannot be removed) and returns an
:class:`Audit` handle. The hook does nothing until :meth:`Audit.arm`, which the worker calls right before
it imports the candidate; from then on every audited event raised **from candidate code** is recorded
(and, by raising :class:`PermissionError` inside the event, blocked). The worker drains the records into
every answer (``facts["audit"]``); the host turns them into failures with :func:`tilesmith.gate.host.answers.failures_from_answer`.

What "from candidate code" means (the attribution rule):

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
  candidate code that is not a compiler (``g++``, ``gcc``, ``clang``, ``nvcc``, ``ptxas``, ``ld``, ...).
* ``audit_network`` — anywhere: sockets, name lookups, ``urllib``/``http.client``/``ftplib``/mail clients.
* ``audit_native`` — direct: every ``ctypes.*`` event and ``mmap.__new__``.

Not covered (see docs/gate.md, threat model): native code (C++ kernels, ``load_inline``, compilers'
arguments) does not raise audit events; frame access laundered through a library that walks frames
itself (the *direct* events) is not attributed; telling the gate from the user's process apart by
looking at ``sys.modules``, the environment or the working directory raises no event at all.

This module is imported by the worker before torch: it imports only the standard library (and the stdlib-only
:mod:`tilesmith.gate.protocol`) at module level.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

_MAX_RECORDS = 24

# -- events -------------------------------------------------------------------------------------------
_DIRECT_INTROSPECTION = {"sys._getframe", "sys._getframemodulename", "object.__getattr__", "object.__setattr__",
                         "object.__delattr__", "code.__new__", "function.__new__", "compile", "exec",
                         "marshal.loads", "marshal.load"}
_ANYWHERE_INTROSPECTION = {"sys._current_frames", "sys._current_exceptions", "gc.get_objects", "gc.get_referrers",
                           "gc.get_referents", "sys.settrace", "sys.setprofile", "sys.addaudithook",
                           "sys.monitoring.register_callback", "sys.monitoring.use_tool_id",
                           "sys.monitoring.set_events", "sys.monitoring.set_local_events"}
_FRAME_ATTRS = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "__code__", "f_back", "f_locals", "f_globals"}
_IMPORT_CODE_EVENTS = {"compile", "exec", "marshal.loads", "marshal.load"}
# event -> indexes of the path arguments that must stay writable
_MUTATING = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,),
             "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,), "os.mkdir": (0,),
             "os.chflags": (0,), "os.lchflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
             "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copymode": (1,), "shutil.copystat": (1,),
             "shutil.copytree": (1,), "shutil.move": (0, 1), "shutil.chown": (0,), "shutil.make_archive": (0,),
             "shutil.unpack_archive": (1,)}
_LISTING = {"os.listdir": 0, "os.scandir": 0, "glob.glob": 0, "glob.glob/2": 0}
_DIRECT_PROCESS = {"subprocess.Popen", "os.exec", "os.spawn", "os.posix_spawn", "os.putenv", "os.unsetenv",
                   "os.startfile", "pty.spawn"}
_ANYWHERE_PROCESS = {"os.system", "os.fork", "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill"}
_NETWORK = {"socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo", "socket.gethostbyname",
            "socket.gethostbyaddr", "socket.getnameinfo", "socket.sendto", "socket.sendmsg", "socket.socketpair",
            "urllib.Request", "http.client.connect", "http.client.send", "ftplib.connect", "smtplib.connect",
            "poplib.connect", "imaplib.open", "nntplib.connect", "telnetlib.Telnet.open", "webbrowser.open"}
_NATIVE_PREFIXES = ("ctypes.", "_ctypes.")
_NATIVE = {"mmap.__new__"}

#: Executables a library may start under candidate code (Inductor's C++ build, Triton's ptxas/cc).
#: Rationale: torch 2.11 ``cpp_builder._run_compile_cmd`` and Triton's nvidia backend spawn these while the
#: candidate's kernels compile at import; their arguments are not checked (native code is a residual risk).
#: ``openssl``: torch 2.11 ``codecache._precompile_header`` hashes the preprocessed header with ``openssl sha512``
#: at the first C++ kernel build of a process, which in a candidate worker is the candidate's (the original is
#: never loaded there).
_COMPILERS = {"g++", "gcc", "c++", "cc", "clang", "clang++", "icx", "icpx", "nvcc", "ptxas", "nvlink", "fatbinary",
              "cuobjdump", "nvdisasm", "ld", "ld.lld", "ld.gold", "objcopy", "ar", "hipcc", "ldconfig", "ccache",
              "openssl"}

_VERSION_SUFFIX = re.compile(r"-\d+(\.\d+)*$")

_SYSTEM_READ_ROOTS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/bin", "/sbin", "/sys", "/dev",
                      "/proc", "/nix/store")

_CANDIDATE, _TRANSPARENT, _LIBRARY = 1, 2, 3


def _is_compiler(args: Any) -> bool:
    """``g++``, ``/usr/bin/gcc-12``, ``x86_64-linux-gnu-g++``, ``ptxas-blackwell``: a known compiler tool; or
    ``openssl sha512 <file>``, the checksum torch 2.11's ``codecache._precompile_header`` takes of a precompiled
    C++ header (Inductor's C++ host wrapper builds one), and nothing else openssl can do."""
    try:
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        name = os.path.basename(os.fsdecode(argv[0]).split()[0])
    except (TypeError, IndexError, ValueError):
        return False
    if name == "openssl":
        return len(argv) == 3 and os.fsdecode(argv[1]) == "sha512"
    name = _VERSION_SUFFIX.sub("", name)
    parts = name.split("-")
    return name in _COMPILERS or parts[0] in _COMPILERS or parts[-1] in _COMPILERS


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + os.sep) for r in roots)


class _State:
    """Everything the hook needs; reachable only from the hook's closure and the Audit handle."""

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
        import sysconfig

        trusted = set()
        for root, dirs, files in os.walk(self.private):
            trusted.add(os.path.realpath(root))
            trusted.update(os.path.realpath(os.path.join(root, f)) for f in files)
        self.trusted = frozenset(trusted)
        base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
                                         "installed_base": sys.base_prefix,
                                         "installed_platbase": sys.base_exec_prefix})
        self.stdlib = tuple({os.path.realpath(base[k]) for k in ("stdlib", "platstdlib") if base.get(k)})
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
                elif real == self.own_file or (_under(real, self.stdlib) and not _under(real, self.site)
                                               and "-packages" + os.sep not in real):
                    kind = _TRANSPARENT
                else:
                    kind = _LIBRARY
            self.kinds[filename] = kind
        return kind

    def attribute(self, frame: Any) -> tuple[bool, bool, Any]:
        """(direct, via_import, first candidate frame or None)."""
        direct: bool | None = None
        via_import = False
        while frame is not None:
            code = frame.f_code
            kind = self.kind(code.co_filename)
            if kind == _CANDIDATE:
                return (True if direct is None else direct), via_import, frame
            if kind == _LIBRARY and direct is None:
                direct = False
            if direct is None and code.co_filename.startswith("<frozen importlib"):
                via_import = True
            frame = frame.f_back
        return False, via_import, None

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
    def resolve(self, value: Any) -> str | None:
        """The real path; ``""`` for a descriptor that is not a file path (a pipe, a socket): wrapping an
        already-open descriptor (``open(fd)``, subprocess pipes) is not a new file access."""
        try:
            if isinstance(value, int):
                target = os.readlink(f"/proc/self/fd/{value}")
                return target if target.startswith("/") else ""
            return os.path.realpath(os.fsdecode(value))
        except (TypeError, ValueError, OSError):
            return None

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

    # -- the decision ------------------------------------------------------------------------------
    def judge(self, event: str, args: tuple[Any, ...], frame: Any) -> None:
        check = detail = None
        if event in _DIRECT_INTROSPECTION:
            if event in ("object.__getattr__", "object.__setattr__", "object.__delattr__"):
                name = args[1] if len(args) > 1 else None
                if event == "object.__getattr__" and name not in _FRAME_ATTRS:
                    return
                detail = f"{event} {name!r}"
            direct, via_import, where = self.attribute(frame)
            if not direct or (via_import and event in _IMPORT_CODE_EVENTS):
                return
            check, detail = "audit_introspection", detail or event
        elif event in _ANYWHERE_INTROSPECTION:
            _, _, where = self.attribute(frame)
            check, detail = "audit_introspection", event
        elif event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            write = _writes(mode, flags)
            direct, _, where = self.attribute(frame)
            if where is None:
                return
            real = self.resolve(path)
            if write and real and os.path.isdir(real):
                write = False  # a folder's descriptor (locks, fsync) writes no content: judged as a read
            if write and not self.writable(real, "open", bool(direct)):
                check, detail = "audit_file_write", f"open for writing {real or path!r}"
            elif not write and not self.readable_path(real):
                check, detail = "audit_file_read", f"open for reading {real or path!r}"
        elif event in _MUTATING:
            direct, _, where = self.attribute(frame)
            if where is None:
                return
            for i in _MUTATING[event]:
                if i < len(args) and args[i] is not None:
                    real = self.resolve(args[i])
                    if not self.writable(real, event, bool(direct)):
                        check, detail = "audit_file_write", f"{event} {real or args[i]!r}"
                        break
        elif event in _LISTING:
            _, _, where = self.attribute(frame)
            if where is None:
                return
            real = self.resolve(args[0] if args and args[0] is not None else ".")
            if real not in self.listable and not self.readable_path(real):
                check, detail = "audit_file_read", f"{event} {real!r}"
        elif event in _DIRECT_PROCESS:
            direct, _, where = self.attribute(frame)
            if where is None:
                return
            if direct:
                check, detail = "audit_process", f"{event} {_short(args)}"
            elif event == "subprocess.Popen" and not _is_compiler(args[1] if len(args) > 1 and args[1] else args[0]):
                check, detail = "audit_process", f"{event} (started by a library) {_short(args)}"
        elif event in _ANYWHERE_PROCESS:
            if self.own_signal(event, args):
                return  # a signal to the worker itself: at worst it dies (a crash, judged as one)
            _, _, where = self.attribute(frame)
            check, detail = "audit_process", f"{event} {_short(args)}"
        elif event in _NETWORK:
            _, _, where = self.attribute(frame)
            check, detail = "audit_network", f"{event} {_short(args)}"
        elif event.startswith(_NATIVE_PREFIXES) or event in _NATIVE:
            direct, _, where = self.attribute(frame)
            if not direct:
                return
            check, detail = "audit_native", f"{event} {_short(args)}"
        else:
            return
        if check is None or where is None:
            return
        self.record(check, event, detail or event, where)
        raise PermissionError(f"tilesmith gate: {event} is not allowed in a candidate wrapper ({check})")

    def own_signal(self, event: str, args: tuple[Any, ...]) -> bool:
        try:
            if event == "os.kill":
                return args[0] in (0, os.getpid())
            if event == "os.killpg":
                return args[0] in (0, os.getpgid(0))
            return event == "signal.pthread_kill"
        except (IndexError, OSError):
            return False

    def record(self, check: str, event: str, detail: str, frame: Any) -> None:
        key = (check, detail)
        if key in self.seen or len(self.records) >= _MAX_RECORDS:
            return
        self.seen.add(key)
        code = frame.f_code
        self.records.append({"check": check, "event": event, "detail": detail[:300],
                             "line": frame.f_lineno, "function": code.co_name[:80]})


def _writes(mode: Any, flags: Any) -> bool:
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    if isinstance(flags, int):
        return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
    return False


def _short(args: tuple[Any, ...]) -> str:
    try:
        text = repr(args)
    except Exception:  # noqa: BLE001 - a candidate object's __repr__ may raise
        text = "<unprintable arguments>"
    return text[:200]


def _site_dirs() -> list[str]:
    import site

    dirs = []
    try:
        dirs += site.getsitepackages()
    except AttributeError:
        pass
    try:
        dirs.append(site.getusersitepackages())
    except AttributeError:
        pass
    dirs += [p for p in sys.path if isinstance(p, str) and ("site-packages" in p or "dist-packages" in p)]
    return dirs


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
