"""The PEP 578 audit rules shared by the gate's worker and production verification: event tables and the decision.

Two hooks apply these rules to code Tilesmith did not write: the gate worker's (:mod:`tilesmith.gate.worker.audit`,
armed before a candidate's import in ``python -m tilesmith.gate.worker``) and the user's process's
(:mod:`tilesmith.install.audit`, armed per thread while an installed wrapper is imported or called). Each subclasses
:class:`Rules` with its own notion of a candidate frame and of the files candidate code may write; the events, the
attribution rule and the order of the decision are defined once, here.

The attribution rule (frames are classified by :meth:`Rules.kind`: ``CANDIDATE``, ``TRANSPARENT`` — the standard
library, frozen modules, pseudo-files such as ``<string>`` — or ``LIBRARY``, everything else):

* *direct*: walking outward from the event, the first frame that is not transparent is a candidate frame: the
  candidate raised the event itself or through the standard library (``inspect.stack``, ``subprocess.run``,
  ``open``). Used where libraries legitimately raise the same event on a wrapper's behalf (torch and Triton call
  ``sys._getframe``, ``exec``, ``compile``, start compilers, load libraries).
* *anywhere*: some candidate frame is on the stack: for what no library does on a wrapper's behalf (writing
  outside the allowed folders, sockets, tracing, ``gc`` walks). This catches laundering through a library
  (``numpy.savetxt``, ``codecache.write_atomic``, ``cpp_builder.run_compile_cmd``).

A process a library starts under candidate code runs only when it is a known compiler at a system path whose
arguments and environment cannot make it run another program or load code, and whose outputs the write rule allows
(:meth:`Rules.library_process`, :mod:`tilesmith.gate.toolargs`).

Event names: the CPython 3.11/3.12 audit events table (https://docs.python.org/3/library/audit_events.html).
Check ids: :data:`tilesmith.gate.protocol.AUDIT_CHECKS`.

Imported by the worker before torch: standard library only.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tilesmith.gate import toolargs

MAX_RECORDS = 24
"""Records one hook keeps per drain (the worker) or per installed wrapper (production)."""

# -- events -------------------------------------------------------------------------------------------
DIRECT_INTROSPECTION = frozenset({
    "sys._getframe", "sys._getframemodulename", "object.__getattr__", "object.__setattr__", "object.__delattr__",
    "code.__new__", "function.__new__", "compile", "exec", "marshal.loads", "marshal.load"})
ANYWHERE_INTROSPECTION = frozenset({
    "sys._current_frames", "sys._current_exceptions", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "sys.settrace", "sys.setprofile", "sys.addaudithook", "sys.monitoring.register_callback",
    "sys.monitoring.use_tool_id", "sys.monitoring.set_events", "sys.monitoring.set_local_events"})
FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "__code__", "f_back", "f_locals",
                         "f_globals"})
IMPORT_CODE_EVENTS = frozenset({"compile", "exec", "marshal.loads", "marshal.load"})
MUTATING = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (0, 1),
            "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,), "os.mkdir": (0,),
            "os.chflags": (0,), "os.lchflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
            "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copymode": (1,), "shutil.copystat": (1,),
            "shutil.copytree": (1,), "shutil.move": (0, 1), "shutil.chown": (0,), "shutil.make_archive": (0,),
            "shutil.unpack_archive": (1,)}
"""Event → indexes of its path arguments that must stay writable. A symbolic link's target too (red team 18: a
link in the private folder to a file outside it turned a later write through that name into a write outside)."""
LISTING = {"os.listdir": 0, "os.scandir": 0, "glob.glob": 0, "glob.glob/2": 0}
DIRECT_PROCESS = frozenset({"subprocess.Popen", "os.exec", "os.spawn", "os.posix_spawn", "os.putenv", "os.unsetenv",
                            "os.startfile", "pty.spawn"})
ANYWHERE_PROCESS = frozenset({"os.system", "os.fork", "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill"})
NETWORK = frozenset({
    "socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo", "socket.gethostbyname",
    "socket.gethostbyaddr", "socket.getnameinfo", "socket.sendto", "socket.sendmsg", "socket.socketpair",
    "urllib.Request", "http.client.connect", "http.client.send", "ftplib.connect", "smtplib.connect",
    "poplib.connect", "imaplib.open", "nntplib.connect", "telnetlib.Telnet.open", "webbrowser.open"})
NATIVE_PREFIXES = ("ctypes.", "_ctypes.")
NATIVE = frozenset({"mmap.__new__"})

JUDGED = frozenset(DIRECT_INTROSPECTION | ANYWHERE_INTROSPECTION | {"open"} | set(MUTATING) | set(LISTING)
                   | DIRECT_PROCESS | ANYWHERE_PROCESS | NETWORK | NATIVE)
"""Every event :meth:`Rules.judge` may act on, besides the ``ctypes.*`` prefixes: a hook returns at once for the
rest (``builtins.id``, ``import``, ``os.listxattr``...)."""

CANDIDATE, TRANSPARENT, LIBRARY = 1, 2, 3


def is_compiler(args: Any, env: Any = None) -> bool:
    """A known compiler at a system path whose arguments cannot run another program (:mod:`tilesmith.gate.toolargs`;
    ``env``: the Popen's environment)."""
    return toolargs.problem(args, env)[0] is None


def popen_argv(args: tuple[Any, ...]) -> Any:
    """The argument list of a ``subprocess.Popen`` event (``(executable, args, cwd, env)``)."""
    return args[1] if len(args) > 1 and args[1] else args[0]


def under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + os.sep) for r in roots)


def writes(mode: Any, flags: Any) -> bool:
    """True when an ``open`` event's mode or flags can change the file."""
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    if isinstance(flags, int):
        return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
    return False


def short(args: tuple[Any, ...]) -> str:
    """``repr(args)``, at most 200 characters (a candidate object's ``__repr__`` may raise)."""
    try:
        text = repr(args)
    except Exception:  # noqa: BLE001 - a candidate object's __repr__ may raise
        text = "<unprintable arguments>"
    return text[:200]


def stdlib_roots() -> tuple[str, ...]:
    """The real paths of the base interpreter's standard library (``stdlib``, ``platstdlib``)."""
    import sysconfig

    base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
                                     "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix})
    return tuple({os.path.realpath(base[k]) for k in ("stdlib", "platstdlib") if base.get(k)})


def site_dirs() -> list[str]:
    """Site-packages folders: the ``site`` module's and every ``sys.path`` entry named like one."""
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


def is_stdlib(real: str, stdlib: tuple[str, ...], site: tuple[str, ...]) -> bool:
    """A real path of the standard library proper (not a site-packages folder inside it)."""
    return under(real, stdlib) and not under(real, site) and "-packages" + os.sep not in real


class Rules:
    """The decision, given a hook's own notion of candidate frames and writable paths.

    Subclasses define :meth:`kind`, :meth:`writable`, :meth:`readable_path` and :meth:`record`; they may turn
    read checks off (``check_reads``: production does not restrict what a wrapper reads) and override
    :meth:`own_signal` and :meth:`process_detail`.
    """

    check_reads = True
    env_baseline: dict[str, str | None] | None = None
    """The compiler-relevant environment when the hook was added (:data:`tilesmith.gate.toolargs.RISKY_ENV`): a
    compiler a library starts must see the same (``snapshot_env``)."""
    _tool_roots: tuple[str, ...] | None = None

    def snapshot_env(self) -> None:
        self.env_baseline = {k: os.environ.get(k) for k in toolargs.RISKY_ENV}
    refusal = "tilesmith gate: {event} is not allowed in a candidate wrapper ({check})"

    def kind(self, filename: str) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def writable(self, path: str | None, event: str = "open", direct: bool = True) -> bool:  # pragma: no cover
        raise NotImplementedError

    def readable_path(self, path: str | None) -> bool:
        return True

    def listable_path(self, path: str | None) -> bool:
        return self.readable_path(path)

    def record(self, check: str, event: str, detail: str, frame: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- frames ------------------------------------------------------------------------------------
    def attribute(self, frame: Any) -> tuple[bool, bool, Any]:
        """(direct, via_import, first candidate frame or None)."""
        direct: bool | None = None
        via_import = False
        while frame is not None:
            code = frame.f_code
            kind = self.kind(code.co_filename)
            if kind == CANDIDATE:
                return (True if direct is None else direct), via_import, frame
            if kind == LIBRARY and direct is None:
                direct = False
            if direct is None and code.co_filename.startswith("<frozen importlib"):
                via_import = True
            frame = frame.f_back
        return False, via_import, None

    # -- paths -------------------------------------------------------------------------------------
    @staticmethod
    def resolve(value: Any) -> str | None:
        """The real path; ``""`` for a descriptor that is not a file path (a pipe, a socket): wrapping an
        already-open descriptor (``open(fd)``, subprocess pipes) is not a new file access."""
        try:
            if isinstance(value, int):
                target = os.readlink(f"/proc/self/fd/{value}")
                return target if target.startswith("/") else ""
            return os.path.realpath(os.fsdecode(value))
        except (TypeError, ValueError, OSError):
            return None

    # -- the decision ------------------------------------------------------------------------------
    def judge(self, event: str, args: tuple[Any, ...], frame: Any) -> None:
        """Record and block (``PermissionError``) ``event`` when the rules refuse it; else return."""
        found = self.decide(event, args, frame)
        if found is None:
            return
        check, detail, where = found
        self.record(check, event, detail, where)
        raise PermissionError(self.refusal.format(event=event, check=check))

    def decide(self, event: str, args: tuple[Any, ...], frame: Any) -> tuple[str, str, Any] | None:
        """``(check id, detail, first candidate frame)`` when ``event`` raised at ``frame`` is refused."""
        check = detail = None
        if event in DIRECT_INTROSPECTION:
            if event in ("object.__getattr__", "object.__setattr__", "object.__delattr__"):
                name = args[1] if len(args) > 1 else None
                if event == "object.__getattr__" and name not in FRAME_ATTRS:
                    return None
                detail = f"{event} {name!r}"
            direct, via_import, where = self.attribute(frame)
            if not direct or (via_import and event in IMPORT_CODE_EVENTS):
                return None
            check, detail = "audit_introspection", detail or event
        elif event in ANYWHERE_INTROSPECTION:
            _, _, where = self.attribute(frame)
            check, detail = "audit_introspection", event
        elif event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            write = writes(mode, flags)
            if not write and not self.check_reads:
                return None
            direct, _, where = self.attribute(frame)
            if where is None:
                return None
            real = self.resolve(path)
            if write and real and os.path.isdir(real):
                write = False  # a folder's descriptor (locks, fsync) writes no content: judged as a read
            if write and not self.writable(real, "open", bool(direct)):
                check, detail = "audit_file_write", f"open for writing {real or path!r}"
            elif not write and self.check_reads and not self.readable_path(real):
                check, detail = "audit_file_read", f"open for reading {real or path!r}"
        elif event in MUTATING:
            direct, _, where = self.attribute(frame)
            if where is None:
                return None
            for i in MUTATING[event]:
                if i < len(args) and args[i] is not None:
                    real = self.resolve(args[i])
                    if not self.writable(real, event, bool(direct)):
                        check, detail = "audit_file_write", f"{event} {real or args[i]!r}"
                        break
        elif event in LISTING:
            if not self.check_reads:
                return None
            _, _, where = self.attribute(frame)
            if where is None:
                return None
            real = self.resolve(args[0] if args and args[0] is not None else ".")
            if not self.listable_path(real):
                check, detail = "audit_file_read", f"{event} {real!r}"
        elif event in DIRECT_PROCESS:
            direct, _, where = self.attribute(frame)
            if where is None:
                return None
            if direct:
                check, detail = "audit_process", self.process_detail(event, args, "")
            elif event == "subprocess.Popen":
                check, detail = self.library_process(args)
        elif event in ANYWHERE_PROCESS:
            if self.own_signal(event, args):
                return None
            _, _, where = self.attribute(frame)
            check, detail = "audit_process", self.process_detail(event, args, "")
        elif event in NETWORK:
            _, _, where = self.attribute(frame)
            check, detail = "audit_network", f"{event} {short(args)}"
        elif event.startswith(NATIVE_PREFIXES) or event in NATIVE:
            direct, _, where = self.attribute(frame)
            if not direct:
                return None
            check, detail = "audit_native", f"{event} {short(args)}"
        else:
            return None
        if check is None or where is None:
            return None
        return check, detail or event, where

    def library_process(self, args: tuple[Any, ...]) -> tuple[str | None, str | None]:
        """A ``subprocess.Popen`` a library started under candidate code: ``(check, detail)`` when refused, else
        ``(None, None)``. Allowed: a known compiler at a system path, with arguments and an environment that cannot
        run another program or load code (:func:`tilesmith.gate.toolargs.problem`), whose output files
        (``-o``, ``-MF``) the write rule allows (:meth:`writable`, as a library's write)."""
        env = args[3] if len(args) > 3 else None
        if self._tool_roots is None:
            self._tool_roots = toolargs.tool_roots()
        why, outputs = toolargs.problem(popen_argv(args), env, self.env_baseline, self._tool_roots)
        if why is not None:
            return "audit_process", self.process_detail("subprocess.Popen", args, f" (started by a library; {why})")
        cwd = args[2] if len(args) > 2 and args[2] else None
        for out in outputs:
            real = self.resolve(os.path.join(os.fsdecode(cwd), out) if cwd else out)
            if real and not self.writable(real, "open", False):
                return "audit_file_write", f"a compiler's output {real!r} ({short(args)[:120]})"
        return None, None

    def process_detail(self, event: str, args: tuple[Any, ...], how: str) -> str:
        """The detail of an ``audit_process`` record (the worker's form: the event, how, the arguments)."""
        return f"{event}{how} {short(args)}"

    def own_signal(self, event: str, args: tuple[Any, ...]) -> bool:
        """True for a signal the process sends itself (the worker allows it: at worst it dies, a crash)."""
        try:
            if event == "os.kill":
                return args[0] in (0, os.getpid())
            if event == "os.killpg":
                return args[0] in (0, os.getpgid(0))
            return event == "signal.pthread_kill"
        except (IndexError, OSError):
            return False
