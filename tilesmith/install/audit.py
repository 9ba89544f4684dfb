"""The gate worker's audit rules in the user's process, while an installed wrapper is imported or called.

A candidate can tell the gate's worker from the user's process (its ``__file__`` or working directory contains
``tilesmith-gate-``), behave under the gate and, in the user's process only, run a shell command through
``torch._inductor.cpp_builder.run_compile_cmd`` or write a file through ``logging.FileHandler`` (the red team of
2026-12-05, docs/gate.md "Threat model"). The worker's PEP 578 hook (:mod:`tilesmith.gate.worker.audit`) blocks
those only inside the worker. This module applies the same rules (:mod:`tilesmith.gate.auditrules`) in the user's
process:

* :func:`ensure_hook` adds **one** process-wide ``sys.addaudithook`` hook, the first time Tilesmith installs a
  wrapper (PEP 578: it cannot be removed). It judges an event (only the kinds the rules judge: one set lookup
  filters the rest) in two cases. **Armed thread**: :func:`watching` (the wrapper's import,
  :mod:`tilesmith.install.installer`) and the verified entry (every call, checked or not,
  :func:`tilesmith.install.verify.guard`) set the calling thread's :class:`Watch` in :data:`LOCAL`. **Code origin**:
  on any other thread, or outside any call, a frame of an installed wrapper's code is on the stack
  (:meth:`ProductionRules.owner`: one dictionary lookup per frame). Rule: what the wrapper's code does is judged
  wherever and whenever it runs. Why: the red team's round 2 ran wrapper code where no thread was armed — a task on
  a pool thread waited for within the call (R6), a logging handler or warnings hook run later by the user's code
  (R7), a ``__del__`` at interpreter exit (R5). A data loader's file I/O and the user's own compilations carry no
  wrapper frame and are never judged. At exit, :func:`_at_exit` disarms the wrapper's ``__del__`` methods and
  generators before CPython clears the hooks (:mod:`tilesmith.install.exitguard`).
* An event is judged with the worker's attribution rule (*direct*: the first frame outside the standard library is
  the wrapper's; *anywhere*: a frame of the wrapper is on the stack). **Candidate frames** are frames whose code file
  is an installed wrapper's file or a module that Python code executed (``exec``) from Inductor's cache folder under
  a wrapper: the kernel modules Inductor loads for it (Triton kernels) and anything else it loads through
  ``PyCodeCache``. Each belongs to its wrapper's :class:`Watch` (:attr:`ProductionRules.owners`).
* A refused event raises ``PermissionError`` inside the event (the side effect does not happen) and is recorded on
  the wrapper's :class:`Watch`; the caller uninstalls the graph (``verification_failed``, docs/verification.md).

What is refused (the worker's events; ``check`` ids of :data:`tilesmith.gate.protocol.AUDIT_CHECKS`):

* ``audit_file_write`` (anywhere): writes, renames, removals, ``mkdir`` and ``chmod`` outside Inductor's cache
  folder (``TORCHINDUCTOR_CACHE_DIR`` or its default), Triton's (``TRITON_CACHE_DIR``, ``~/.triton``) and
  Tilesmith's (its cache root, ``TILESMITH_KERNEL_DIR``); inside them, a write by the wrapper's own code (honest
  wrappers write only through Inductor) and a write over a file that existed before (the user's cached originals
  and kernels: red-team finding 1, in the user's caches; ``*.lock`` files and a replaced ``*.best_config``
  excepted, as in the worker). Temporary folders a library creates under ``tempfile.gettempdir()`` while armed
  (``tempfile.mkdtemp``: Inductor's precompiled-header step) are writable, with what is inside them.
* ``audit_process``: every process started by the wrapper's code (direct); processes started by a library that are
  not a known compiler at a system path with safe arguments (anywhere: ``run_compile_cmd('sh ...')``,
  ``g++ -wrapper``: :mod:`tilesmith.gate.toolargs`), ``os.system``, ``fork``, signals (to this process too: in the
  user's process a signal is not just a crash of a worker).
* ``audit_network`` (anywhere), ``audit_native`` (direct ``ctypes`` and ``mmap``), ``audit_introspection``
  (direct ``sys._getframe``, ``compile``/``exec``, ``code.__new__``...; anywhere ``gc`` walks, tracing,
  ``sys._current_frames``, ``sys.addaudithook``).

Reads are not restricted (the user's process reads what it likes, and what is read can only leave through a
write, a process or the network, which are).

Cost: docs/verification.md ("Cost"); ``bench/prod_audit_cost.py`` measures it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from tilesmith.gate import auditrules, pools
from tilesmith.gate.auditrules import CANDIDATE, LIBRARY, TRANSPARENT

_MAX_CREATED = 100_000
"""Files created while armed that stay writable (temporary files renamed into place); beyond this, new ones are
still allowed but not remembered."""


POOL_WAIT_S = 0.05
"""Longest wait (s) for work queued in Inductor's compile pool to start before a look
(:func:`tilesmith.gate.pools.foreign_work`)."""


class Watch:
    """One installed wrapper's audit state: what its code was refused (``records``: dicts with ``check``,
    ``event``, ``detail``, ``line``, ``function``, ``file``). ``label``: the graph's label, for messages."""

    __slots__ = ("label", "records", "_seen", "cwd")

    def __init__(self, label: str) -> None:
        self.label = label
        self.records: list[dict[str, Any]] = []
        self._seen: set[tuple[str, str]] = set()
        self.cwd: tuple[str, frozenset[str]] | None = None
        """During the wrapper's import only: the working directory and the names in it just before (see
        :func:`importing`)."""

    def add(self, check: str, event: str, detail: str, frame: Any, origin: Any = None) -> None:
        """Record a refusal: ``frame`` the wrapper's frame it is attributed to, ``origin`` the frame that raised the
        event (named in the message when it is another one: a library, or a finalizer that ran meanwhile)."""
        key = (check, detail)
        if key in self._seen or len(self.records) >= auditrules.MAX_RECORDS:
            return
        self._seen.add(key)
        code = frame.f_code
        by = origin.f_code if origin is not None and origin is not frame else None
        self.records.append({"check": check, "event": event, "detail": detail[:300], "line": frame.f_lineno,
                             "function": code.co_name[:80], "file": os.path.basename(code.co_filename),
                             "origin": f"{by.co_name} in {_short_file(by.co_filename)}"[:120] if by else None})

    def summary(self) -> tuple[str, str] | None:
        """``(check, detail)`` for a failure message: the first record, where it was raised, and how many more."""
        if not self.records:
            return None
        first = self.records[0]
        more = len(self.records) - 1
        origin = f" through {first['origin']}" if first.get("origin") else ""
        return first["check"], (f"{first['detail']} (raised at line {first['line']} of {first['file']}, in "
                                f"{first['function']}{origin}; blocked: PermissionError inside the event"
                                + (f"; {more} more refused event(s)" if more else "") + ")")


def _short_file(path: str) -> str:
    """``cpp_builder.py``; ``logging/__init__.py`` for a package's ``__init__``."""
    name = os.path.basename(path)
    return f"{os.path.basename(os.path.dirname(path))}/{name}" if name == "__init__.py" else name


class _Local(threading.local):
    watch: Watch | None = None
    judging: Watch | None = None


LOCAL = _Local()
"""The per-thread arming: ``LOCAL.watch`` is the :class:`Watch` of the wrapper running on this thread, or ``None``."""


class ProductionRules(auditrules.Rules):
    """The worker's rules in the user's process: candidate frames are installed wrappers' files (and the modules
    executed from Inductor's cache while one was armed); writable are the compiler and Tilesmith caches."""

    check_reads = False
    refusal = ("tilesmith: {event} is not allowed in an installed wrapper ({check}); production verification "
               "blocked it and uninstalls the wrapper")

    def __init__(self) -> None:
        self.candidates: set[str] = set()
        self.owners: dict[str, Watch] = {}
        """Candidate code file (as compiled, and its real path) → the :class:`Watch` of the wrapper it belongs to."""
        self.exiting = False
        self.snapshot_env()
        self.kinds: dict[str, int] = {}
        self.stdlib = auditrules.stdlib_roots()
        self.site = tuple({os.path.realpath(p) for p in auditrules.site_dirs()})
        self.own = {os.path.realpath(__file__), os.path.realpath(auditrules.__file__)}
        self.created: set[str] = set()
        self.fresh: set[str] = set()
        self._roots_key: tuple[Any, ...] | None = None
        self._roots: tuple[str, ...] = ()
        self._inductor = ""

    # -- candidate files ------------------------------------------------------------------------------------
    def add_candidate(self, filename: str, watch: Watch | None = None) -> None:
        for name in {filename, os.path.realpath(filename)}:
            self.candidates.add(name)
            self.kinds.pop(name, None)
            if watch is not None:
                self.owners.setdefault(name, watch)

    def note_code(self, args: tuple[Any, ...], watch: Watch) -> None:
        """An ``exec`` under a wrapper (armed, or with its code on the stack): a module executed from Inductor's cache
        folder becomes a candidate file of ``watch``'s wrapper."""
        filename = getattr(args[0] if args else None, "co_filename", None)
        if isinstance(filename, str) and filename not in self.candidates and not filename.startswith("<"):
            self.roots()
            if auditrules.under(os.path.realpath(filename), (self._inductor,)):
                self.add_candidate(filename, watch)

    def owner(self, frame: Any, direct: bool = False) -> Watch | None:
        """The :class:`Watch` of the installed wrapper whose code is on the stack from ``frame`` outward (the
        innermost such frame), else ``None``: one dictionary lookup per frame. ``direct``: stop at the first frame
        outside the standard library (events refused only when the wrapper raised them itself: a short walk)."""
        get, kind = self.owners.get, self.kind
        while frame is not None:
            name = frame.f_code.co_filename
            watch = get(name)
            if watch is not None:
                return watch
            if direct and kind(name) != TRANSPARENT:
                return None
            frame = frame.f_back
        return None

    @staticmethod
    def walk_for(event: str, args: tuple[Any, ...]) -> int:
        """How far a thread where no wrapper runs must look for the wrapper's frames: 0 (never refused here:
        reads, listings), 1 (*direct* events: to the first frame outside the standard library), 2 (the stack).
        Rationale: a walk materializes every frame (CPython 3.11: ~0.4 µs a frame); a data loader's reads and
        torch's ``sys._getframe``/``exec`` calls must not pay for a whole stack."""
        if event == "open":
            mode = args[1] if len(args) > 1 else None
            if mode is None:
                flags = args[2] if len(args) > 2 else None
                return 2 if flags.__class__ is not int or flags & _WRITE_FLAGS else 0
            return 0 if mode in _READ_MODES else 2
        if event in auditrules.LISTING:
            return 0
        if event in _DIRECT_ONLY or event.startswith(auditrules.NATIVE_PREFIXES):
            return 1
        return 2

    def kind(self, filename: str) -> int:
        kind = self.kinds.get(filename)
        if kind is None:
            if filename in self.candidates:
                kind = CANDIDATE
            elif filename.startswith("<"):
                kind = TRANSPARENT
            else:
                real = os.path.realpath(filename)
                if real in self.candidates:
                    kind = CANDIDATE
                elif real in self.own or auditrules.is_stdlib(real, self.stdlib, self.site):
                    kind = TRANSPARENT
                else:
                    kind = LIBRARY
            self.kinds[filename] = kind
        return kind

    # -- paths ----------------------------------------------------------------------------------------------
    def roots(self) -> tuple[str, ...]:
        """Real paths of the folders a library may write into under a wrapper (re-read when their variables
        change): Inductor's cache, Triton's caches, Tilesmith's cache root and native kernel folder."""
        env = os.environ
        key = tuple(env.get(n) for n in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TILESMITH_CACHE_DIR",
                                         "XDG_CACHE_HOME", "TILESMITH_KERNEL_DIR", "HOME"))
        if key != self._roots_key:
            from tilesmith import settings

            inductor = env.get("TORCHINDUCTOR_CACHE_DIR")
            if not inductor:
                from torch._inductor.runtime.cache_dir_utils import default_cache_dir

                inductor = default_cache_dir()
            # Inductor's precompiled headers (C++ wrapper) live where ``codecache._HEADER_DIR`` was resolved when torch
            # was imported, which is not the cache folder when TORCHINDUCTOR_CACHE_DIR was set later (torch 2.11).
            codecache = sys.modules.get("torch._inductor.codecache")
            headers = getattr(codecache, "_HEADER_DIR", None)
            found = [inductor, env.get("TRITON_CACHE_DIR"), os.path.join(os.path.expanduser("~"), ".triton"),
                     str(settings.cache_root()), env.get("TILESMITH_KERNEL_DIR"),
                     headers if isinstance(headers, str) else None]
            real = [os.path.realpath(p) for p in found if p]
            self._inductor = real[0]
            self._roots = tuple(r for r in real if r not in ("/", os.path.realpath(os.path.expanduser("~"))))
            self._roots_key = key
        return self._roots

    def writable(self, path: str | None, event: str = "open", direct: bool = True) -> bool:
        if path == "" or path == "/dev/null":
            return True
        if path is None:
            return False
        if self.fresh and auditrules.under(path, tuple(self.fresh)):
            return True
        if event == "os.mkdir" and not direct:
            parent, name = os.path.split(path)
            if parent == os.path.realpath(tempfile.gettempdir()) and name.startswith(tempfile.gettempprefix()):
                self.fresh.add(path)  # tempfile.mkdtemp by a library (Inductor's precompiled-header step)
                return True
        if not direct:
            cwd = getattr(getattr(LOCAL, "judging", None), "cwd", None)
            if cwd is not None and os.path.split(path)[0] == cwd[0] and os.path.basename(path) not in cwd[1]:
                # During an import a library may create (and remove) files that did not exist in the working
                # directory before it: torch 2.11's C++ build (codecache._precompile_header, cpp_wrapper) leaves
                # scratch files such as ``header.hpp`` there. Files that existed before stay read-only.
                return True
        if event == "os.mkdir" and not direct and os.path.isdir(path):
            # makedirs(exist_ok=True) by a library changes nothing, wherever it is: Inductor's C++ build
            # (cpp_builder._create_if_dir_not_exist) calls it on its output folder, the working directory included.
            return True
        if not auditrules.under(path, self.roots()):
            return False
        if direct:
            return False  # honest wrappers write only through Inductor
        if path in self.created or path.endswith(".lock") or path.endswith(".best_config"):
            return True
        if os.path.lexists(path):
            return False  # a file of the user's caches that existed before: read-only (red-team finding 1)
        if len(self.created) < _MAX_CREATED:
            self.created.add(path)
        return True

    def own_signal(self, event: str, args: tuple[Any, ...]) -> bool:
        return False  # in the user's process every signal counts

    def process_detail(self, event: str, args: tuple[Any, ...], how: str) -> str:
        """``subprocess.Popen of 'sh' (started by a library; argv ['sh', '-c', 'id'])``, ``os.system of 'id'``."""
        try:
            if event == "subprocess.Popen":
                argv = auditrules.popen_argv(args)
                argv = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv)
                name = os.path.basename(os.fsdecode(argv[0]).split()[0])
                shown = repr([os.fsdecode(a) for a in argv[:6]])[:160]
                return f"{event} of {name!r} ({how.strip(' ()') + '; ' if how else ''}argv {shown})"
            if event in ("os.system", "os.exec", "os.spawn", "os.posix_spawn"):
                return f"{event} of {os.fsdecode(args[0])!r:.160}"
        except Exception:  # noqa: BLE001 - odd arguments: the generic form
            pass
        return super().process_detail(event, args, how)

    def record(self, check: str, event: str, detail: str, frame: Any) -> None:  # pragma: no cover - unused
        raise NotImplementedError("production records go to a Watch (judge_for)")

    def origin(self, frame: Any, where: Any) -> Any:
        """The frame to name as the event's origin: the innermost library frame between the event and the wrapper's
        frame (``run_compile_cmd``), else the innermost frame (``logging``'s ``_open``)."""
        inner, walk = frame, frame
        while walk is not None and walk is not where:
            if self.kind(walk.f_code.co_filename) == LIBRARY:
                return walk
            walk = walk.f_back
        return inner

    def judge_for(self, watch: Watch, event: str, args: tuple[Any, ...], frame: Any) -> None:
        found = self.decide(event, args, frame)
        if found is None:
            return
        check, detail, where = found
        watch.add(check, event, detail, where, self.origin(frame, where))
        raise PermissionError(self.refusal.format(event=event, check=check))


_READ_MODES = frozenset({"r", "rb", "rt", "br", "tr"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_DIRECT_ONLY = ((auditrules.DIRECT_INTROSPECTION | auditrules.NATIVE | auditrules.DIRECT_PROCESS)
                - {"subprocess.Popen", "exec"})
"""Events refused only when the wrapper's code raises them itself (a library's ``Popen`` is judged anywhere; ``exec`` walks
the whole stack: a module executed under the wrapper's code becomes its code, :meth:`ProductionRules.note_code`)."""

_RULES: ProductionRules | None = None
_BUSY = Watch("(judging)")
"""``LOCAL.judging`` while the hook looks for a wrapper's frame (before it knows which)."""
_SETUP = threading.Lock()


def ensure_hook() -> ProductionRules:
    """Add the process's production audit hook if it is not there yet (once per process) and return its rules.

    The hook judges an event when the thread is armed for a wrapper (:func:`watching`: its import or a call) **or**
    when code of an installed wrapper is on the thread's stack (:meth:`ProductionRules.owner`), on any thread at any
    time: a finalizer, an ``atexit`` or ``weakref.finalize`` callback, a logging handler or warnings hook the wrapper
    registered, a task it left in a pool (the red team's R5-R7). Only the events the rules judge get that far
    (:data:`tilesmith.gate.auditrules.JUDGED`): for the rest the hook returns after one set lookup."""
    global _RULES
    with _SETUP:
        if _RULES is not None:
            return _RULES
        rules = ProductionRules()
        rules.roots()
        local = LOCAL
        judged = auditrules.JUDGED
        native = auditrules.NATIVE_PREFIXES
        getframe = sys._getframe
        owners = rules.owners
        owner = rules.owner
        walk_for = rules.walk_for

        def hook(event: str, args: tuple[Any, ...]) -> None:
            if event not in judged and not event.startswith(native):
                return
            if local.judging is not None:
                return  # events the judgement itself raises (sys._getframe included) are not judged
            watch = local.watch
            if watch is None and not owners:
                return
            if watch is None:
                reach = walk_for(event, args)
                if not reach:
                    return
            local.judging = _BUSY
            try:
                frame = getframe(1)
                if watch is None:
                    watch = owner(frame, reach == 1)
                    if watch is None:
                        return
                local.judging = watch
                if event == "exec":
                    rules.note_code(args, watch)
                rules.judge_for(watch, event, args, frame)
            except PermissionError:
                raise
            except Exception:  # noqa: BLE001 - a fault of the judgement must not break the user's call
                pass
            finally:
                local.judging = None

        sys.addaudithook(hook)
        atexit.register(_at_exit, rules)
        _RULES = rules
        return rules


def _at_exit(rules: ProductionRules) -> None:
    """Last ``atexit`` callback of the process (registered before any wrapper's import, so it runs after theirs):
    CPython 3.11 clears the audit hooks after the ``atexit`` callbacks and *before* it tears the modules down, so a
    wrapper's ``__del__`` or a suspended generator's ``finally`` would then run unaudited. They are made harmless
    here, while the hook still judges (:mod:`tilesmith.install.exitguard`)."""
    rules.exiting = True
    from tilesmith.install import exitguard

    try:
        exitguard.disarm(set(rules.owners))
    except Exception:  # noqa: BLE001 - never break the process's exit
        pass


def add_wrapper_file(filename: str | None, watch: Watch | None = None) -> None:
    """Mark ``filename`` (an installed wrapper's ``__file__``) as candidate code of ``watch``'s wrapper."""
    if filename:
        ensure_hook().add_candidate(filename, watch)


@contextlib.contextmanager
def watching(watch: Watch) -> Iterator[Watch]:
    """Arm the calling thread for ``watch`` (an import or a call of an installed wrapper) and disarm it after."""
    ensure_hook()
    previous = LOCAL.watch
    LOCAL.watch = watch
    try:
        yield watch
    finally:
        LOCAL.watch = previous


# -- the import and the compile pool (:mod:`tilesmith.install.verify`, :mod:`tilesmith.install.installer`) ----------
@contextlib.contextmanager
def importing(prep: Any) -> Any:
    """Arm the audit hook for the wrapper's import on this thread (nothing when ``prep`` has no watch)."""
    if prep is None or prep.watch is None:
        yield
        return
    prep.watch.cwd = _cwd_names()
    try:
        with watching(prep.watch):
            yield
    finally:
        prep.watch.cwd = None


#: A working directory with more entries than this is not listed at import (its new files are then refused).
CWD_LIST_MAX = 100_000


def _cwd_names() -> tuple[str, frozenset[str]] | None:
    """The working directory (real path) and the names in it, or ``None`` when it cannot be listed or is huge."""
    try:
        cwd = os.path.realpath(os.getcwd())
        with os.scandir(cwd) as entries:
            names = []
            for entry in entries:
                names.append(entry.name)
                if len(names) > CWD_LIST_MAX:
                    return None
        return cwd, frozenset(names)
    except OSError:
        return None


def import_findings(prep: Any, module: Any = None) -> tuple[str, str] | None:
    """``(check, detail)`` for what the wrapper's import did that the audit refused, or for work of its own it left
    running in Inductor's compile pool; ``None`` when nothing. ``module``: the loaded wrapper (its file becomes
    candidate code for the hook)."""
    if prep is None or prep.watch is None:
        return None
    if module is not None:
        add_wrapper_file(getattr(module, "__file__", None), prep.watch)
    found = prep.watch.summary()
    if found is None:
        found = pool_problem(prep.pool_base, "its import")
    return found


def pool_baseline() -> frozenset[int]:
    """The ids of foreign work already running in Inductor's compile pool (taken before a wrapper's import)."""
    return frozenset(pools.foreign_work())


def pool_problem(base: frozenset[int], when: str) -> tuple[str, str] | None:
    """``("compile_pool", ...)`` when work that is not Inductor's runs in Inductor's compile pool and did not run
    there at install (``base``)."""
    work = {k: v for k, v in pools.foreign_work(wait_s=POOL_WAIT_S).items() if k not in base}
    if not work:
        return None
    return "compile_pool", (f"{len(work)} task(s) that are not Inductor's run in Inductor's compile thread pool "
                            f"after {when}: {'; '.join(list(work.values())[:4])} (a wrapper must not submit work "
                            "to Inductor's pool: it outlives the call, no check sees it, and it can keep the "
                            "process from exiting; uninstalling does not stop it)")
