"""A worker's confinement: what native candidate code cannot do to other processes (the host, the trusted worker,
other candidates, the fork server's zygote) and to files outside the worker's folder, whatever it spells.

Why: native code (a C++ kernel built through Inductor's C++ path, ``load_inline``, a CUDA kernel) raises no audit
events and passes any name-based scan with another spelling. Red team 17 (tests/test_gate_redteam17.py) had a
candidate's C++ kernel open ``/proc/<ppid>/mem`` with ``openat`` and ``pwrite`` into the zygote, and every worker
forked after it, the trusted reference worker included, inherited the change. The same access reaches any process
of the same user that the kernel lets it trace: the user's process (its environment holds the provider keys), the
trusted worker (which times the original), sibling candidates.

How: at its start, before any candidate code exists in it, every worker enters a **Landlock** domain of its own
(Linux ≥ 5.13 with Landlock enabled; unprivileged, after ``PR_SET_NO_NEW_PRIVS``). Landlock lets a process of a
domain ptrace-access only processes in the same domain or one nested in it (kernel documentation, "Landlock:
unprivileged access control", https://docs.kernel.org/userspace-api/landlock.html, section "Ptrace
restrictions"), and ``/proc/<pid>/mem``, ``/proc/<pid>/environ``, ``process_vm_readv``/``writev`` and ``ptrace``
all go through that check. Each worker's domain is its own, and the host and the zygote are in none, so a candidate
reaches none of them, even as root (the check is Landlock's, not a capability's). Children of the worker
(compilers, ``ptxas``) inherit its domain.

Writes (red team 17b: a candidate's C++ kernel appended to the precompiled headers hard-linked into its folder,
which were the host's, and copied a poisoned kernel library over the gate's cache template, a sibling of its folder,
which later workers loaded): the ruleset *handles* the write-ish filesystem rights (same documentation, "Filesystem
flags": ``WRITE_FILE``, ``REMOVE_DIR``/``REMOVE_FILE``, every ``MAKE_*``, ``REFER`` from ABI 2, ``TRUNCATE`` from
ABI 3) and allows them only beneath the worker's own folder (:func:`worker_folders`: its working directory, where
the host puts its Inductor/Triton/CUDA caches and ``TMPDIR``), plus ``WRITE_FILE``/``TRUNCATE`` beneath ``/dev``
(``/dev/null``, the ``/dev/nvidia*`` devices CUDA opens read-write) and all of them but ``REFER`` beneath
``/dev/shm`` (POSIX shared memory and semaphores). Reading, listing and executing are not handled: everything stays readable as before.
Landlock checks the path a file is opened by, not the file: a hard link into the folder would stay writable, so the
host links nothing there (the shared precompiled headers are symbolic links, whose targets are checked where they
are: :func:`tilesmith.gate.host.caches.share_precompiled_headers`), and a candidate cannot make one (``REFER`` is
allowed only inside the folder, so linking or moving a file in from outside is refused, ``EXDEV``). Already-open
descriptors (the protocol pipes, the log) are not affected. Without ``TRUNCATE`` (ABI 2) a file outside can still be
truncated to a shorter length; the report says so.
Landlock does not handle ``chmod``/``chown``/``utime``/extended attributes: those stay possible on the user's files.

Where the kernel has Landlock ABI ≥ 6 the domain is also scoped: no signals to, and no connections to abstract Unix
sockets of, processes outside it. And a seccomp filter refuses ``setsid``/``setpgid`` (:func:`_no_new_session`), so
every process the worker starts stays in its session and process group, where the host counts, stops and kills.

Without Landlock ABI ≥ 2 (kernels before 5.19, Landlock not in the kernel's LSM list) the worker makes itself
non-dumpable (``PR_SET_DUMPABLE`` 0): other processes of the same user can then not trace it unless they hold
``CAP_SYS_PTRACE`` (root does), and the fork server's zygote does the same (:func:`protect_zygote`); its writes are
not confined, so it removes the symbolic links to shared files from its folder first (:func:`_drop_outside_links`);
the seccomp filter does not need Landlock and is installed there too.
The result is in the worker's ``ready`` greeting (``environment.worker.confinement`` of the gate's report). What
that does not cover is said in docs/gate.md ("What native code can still do").
"""

from __future__ import annotations

import ctypes
import os

#: Landlock system call numbers: the same on x86-64 and arm64 (the generic table), Linux ≥ 5.13.
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
#: Landlock filesystem rights (linux/landlock.h, "Filesystem flags") the worker's ruleset handles, i.e. refuses
#: except beneath a folder a rule names: writing (``WRITE_FILE``), removing (``REMOVE_DIR``, ``REMOVE_FILE``) and
#: creating (``MAKE_CHAR`` … ``MAKE_SYM``, bits 6-12). ``EXECUTE``, ``READ_FILE``, ``READ_DIR`` (bits 0, 2, 3) and
#: ``IOCTL_DEV`` (ABI 5; CUDA's driver talks to ``/dev/nvidia*`` through ioctls) are not handled: unchanged.
_FS_WRITE_FILE = 1 << 1
_FS_REMOVE = (1 << 4) | (1 << 5)
_FS_MAKE = sum(1 << bit for bit in range(6, 13))
#: ``LANDLOCK_ACCESS_FS_REFER`` (ABI 2): moving or linking a file to another directory. A domain that handles any
#: filesystem right refuses that everywhere (``EXDEV``) unless REFER is handled and allowed; Triton renames its
#: built launcher out of a temporary sub-directory of ``TMPDIR`` into its cache (seen on the H100: "Invalid
#: cross-device link", every CUDA worker failed to start while REFER was not allowed anywhere). Allowed beneath the
#: worker's folder, where both are; nowhere else, so no file from outside can be linked or moved into the folder.
_ACCESS_FS_REFER = 1 << 13
#: ``LANDLOCK_ACCESS_FS_TRUNCATE`` (ABI 3): ``truncate``/``ftruncate``/``O_TRUNC``. Before ABI 3 not handled.
_FS_TRUNCATE = 1 << 14
_PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 4, 38


#: ``LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET`` and ``LANDLOCK_SCOPE_SIGNAL`` (ABI 6): no connecting to abstract Unix
#: sockets of, and no signals to, processes outside the domain. Red team 17b: a candidate's C++ kernel sent
#: ``kill(getppid(), SIGUSR1)`` to the host (the user's process).
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in linux/landlock.h
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def landlock_abi() -> int | None:
    """The kernel's Landlock ABI version, or ``None`` when Landlock is missing or disabled (asks, changes nothing)."""
    libc = _libc()
    if libc is None or os.uname().sysname != "Linux":
        return None
    abi = libc.syscall(ctypes.c_long(_SYS_CREATE_RULESET), None, ctypes.c_size_t(0),
                       ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return int(abi) if abi >= 1 else None


def _prctl(libc: ctypes.CDLL, option: int, value: int, pointer: object = None) -> bool:
    """``prctl(option, value, pointer or 0, 0, 0) == 0`` (``pointer``: a ctypes ``byref``)."""
    third = ctypes.c_ulong(0) if pointer is None else pointer
    return libc.prctl(ctypes.c_int(option), ctypes.c_ulong(value), third, ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0


def _set_dumpable(libc: ctypes.CDLL, value: int) -> bool:
    return _prctl(libc, _PR_SET_DUMPABLE, value)


def write_rights(abi: int) -> int:
    """The write-ish filesystem rights a worker's ruleset handles on a kernel of Landlock ABI ``abi`` (≥ 2)."""
    return _FS_WRITE_FILE | _FS_REMOVE | _FS_MAKE | _ACCESS_FS_REFER | (_FS_TRUNCATE if abi >= 3 else 0)


def worker_folders() -> tuple[str, ...]:
    """The folders a worker may write beneath: its working directory, the private 0700 folder the host made for it,
    which holds its Inductor, Triton and CUDA caches, its ``TMPDIR``, its log and the files it writes for the host
    (:func:`tilesmith.gate.host.process.private_environment`), plus the user's ``TILESMITH_GATE_WRITABLE`` folders
    (passed on by :func:`tilesmith.gate.host.process.worker_environment`; for a stack that writes elsewhere)."""
    from tilesmith import settings

    extra = settings.get("TILESMITH_GATE_WRITABLE") or ()
    return (os.path.realpath(os.getcwd()),) + tuple(os.path.realpath(p) for p in extra if os.path.isdir(p))


def _rules(abi: int, folders: tuple[str, ...]) -> list[tuple[str, int, bool]]:
    """``(path, allowed rights, required)`` of the ruleset: the worker's folders (every handled right; required),
    ``/dev`` (opening devices for writing: ``/dev/null``, CUDA's ``/dev/nvidia*``, ``/dev/pts``) and ``/dev/shm``
    (POSIX shared memory and semaphores: ``shm_open``, ``sem_open``; Python's ``multiprocessing``, Intel OpenMP;
    every right but REFER: nothing moves between it and the worker's folder)."""
    full = write_rights(abi)
    return ([(folder, full, True) for folder in folders]
            + [("/dev", _FS_WRITE_FILE | (_FS_TRUNCATE if abi >= 3 else 0), False),
               ("/dev/shm", full & ~_ACCESS_FS_REFER, False)])


def confine(writable: tuple[str, ...] | None = None) -> str:
    """Enter a new Landlock domain whose writes stay beneath ``writable`` (default :func:`worker_folders`), else
    become non-dumpable. Returns what was done, for the worker's ``ready`` greeting and the gate's report:
    ``"landlock abi N (…), writes only beneath the worker's folder, …"``, ``"landlock abi N …, writes not confined
    (…)"``, ``"non-dumpable (…)"`` or ``"none (…)"``. Never raises."""
    folders = worker_folders() if writable is None else tuple(writable)
    libc = _libc()
    if libc is None:
        return "none (no C library through ctypes)" + _drop_outside_links(folders)
    abi = landlock_abi()
    why = "Landlock is not available" if abi is None else f"Landlock ABI {abi} has no REFER right (needs ABI 2)"
    if abi is not None and abi >= 2:
        scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
        if not _prctl(libc, _PR_SET_NO_NEW_PRIVS, 1):
            why = f"PR_SET_NO_NEW_PRIVS failed (errno {ctypes.get_errno()})"
        else:
            failed = _restrict(libc, abi, scoped, _rules(abi, folders))
            if failed is None:
                return (f"landlock abi {abi}" + (" (signals scoped)" if scoped else "")
                        + ", writes only beneath the worker's folder"
                        + ("" if abi >= 3 else " (not truncation: no TRUNCATE right before Landlock ABI 3)")
                        + _no_new_session(libc))
            # The write rules could not be set up: the domain of before (ptrace, scope; REFER allowed everywhere).
            why = failed
            if _restrict(libc, abi, scoped, [("/", _ACCESS_FS_REFER, True)], handled=_ACCESS_FS_REFER) is None:
                return (f"landlock abi {abi}" + (" (signals scoped)" if scoped else "")
                        + f", writes not confined ({failed})" + _drop_outside_links(folders) + _no_new_session(libc))
    links = _drop_outside_links(folders)
    if _set_dumpable(libc, 0):
        return f"non-dumpable ({why})" + links + _no_new_session(libc)
    return f"none ({why}; PR_SET_DUMPABLE failed)" + links + _no_new_session(libc)


def _restrict(libc: ctypes.CDLL, abi: int, scoped: int, rules: list[tuple[str, int, bool]],
              handled: int | None = None) -> str | None:
    """Create a ruleset handling ``handled`` (default :func:`write_rights`) and ``scoped``, allow each rule's rights
    beneath its path (a missing optional path is skipped) and enter it; ``None`` on success, else why not (then
    nothing changed: the ruleset is entered last)."""
    attr = _RulesetAttr(write_rights(abi) if handled is None else handled, 0, scoped)
    size = ctypes.sizeof(attr) if abi >= 6 else 8  # older kernels take only the fields they know
    fd = libc.syscall(ctypes.c_long(_SYS_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size),
                      ctypes.c_uint32(0))
    if fd < 0:
        return f"landlock_create_ruleset failed (errno {ctypes.get_errno()})"
    try:
        for path, rights, required in rules:
            error = _add_rule(libc, fd, path, rights)
            if error and required:
                return f"landlock_add_rule for {path} failed ({error})"
        if libc.syscall(ctypes.c_long(_SYS_RESTRICT_SELF), ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            return f"landlock_restrict_self failed (errno {ctypes.get_errno()})"
        return None
    finally:
        os.close(fd)


def _add_rule(libc: ctypes.CDLL, ruleset_fd: int, path: str, rights: int) -> str | None:
    """Allow ``rights`` beneath ``path`` in the ruleset; ``None``, else the error."""
    try:
        parent = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        return f"{exc.strerror}"
    try:
        rule = _PathBeneathAttr(rights, parent)
        if libc.syscall(ctypes.c_long(_SYS_ADD_RULE), ctypes.c_int(ruleset_fd), ctypes.c_int(_RULE_PATH_BENEATH),
                        ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            return f"errno {ctypes.get_errno()}"
        return None
    finally:
        os.close(parent)


def _drop_outside_links(folders: tuple[str, ...]) -> str:
    """Where writes are not confined: remove every symbolic link in the worker's private ``TMPDIR`` (only when that is
    beneath ``folders``: the host made it) that leads outside ``folders``. The host links its precompiled headers there
    (:func:`tilesmith.gate.host.caches.share_precompiled_headers`), and writing through such a link would change the
    shared file. Runs before any candidate code exists; the worker then builds its own headers. Returns a suffix for
    :func:`confine` (empty when nothing was removed)."""
    roots = tuple(os.path.realpath(f) + os.sep for f in folders)
    tmp = os.path.realpath(os.environ.get("TMPDIR") or "/")
    if not tmp.startswith(roots):
        return ""
    removed = 0
    for path, _dirs, files in os.walk(tmp):
        for name in files:
            link = os.path.join(path, name)
            if os.path.islink(link) and not os.path.realpath(link).startswith(roots):
                try:
                    os.unlink(link)
                    removed += 1
                except OSError:
                    continue
    return f", {removed} links to shared files removed" if removed else ""


# -- seccomp: no new session or process group ------------------------------------------------------------------
#: (audit arch, setsid, setpgid) of the native ABI; other machines get no filter.
_SECCOMP_ABI = {"x86_64": (0xC000003E, 112, 109), "aarch64": (0xC00000B7, 157, 154)}
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW, _RET_EPERM = 0x7FFF0000, 0x00050000 | 1
_X32_SYSCALL_BIT = 0x40000000


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _no_new_session(libc: ctypes.CDLL) -> str:
    """A seccomp filter answering ``setsid`` and ``setpgid`` with ``EPERM`` (and every system call of a foreign ABI,
    x32 or 32-bit, through which those could be spelled), so that nothing the worker starts leaves its session and
    process group: the host's count of the session's processes, the group's SIGSTOP while the original is timed
    and the group's SIGKILL at the end all reach it. Red team 17b: a candidate's C++ kernel forked a helper that
    called ``setsid`` and did the wrapper's work while the worker slept (CPU test mode times the worker's CPU time;
    accepted), and another outlived the gate. The worker itself got its session from the host (``subprocess``'s
    ``start_new_session``) or the zygote child's ``setsid`` before this. Returns a suffix for :func:`confine`."""
    abi = _SECCOMP_ABI.get(os.uname().machine)
    if abi is None:
        return ", no seccomp filter on this machine type"
    arch, setsid, setpgid = abi
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    program = [(ld, 0, 0, 4),                  # 0: seccomp_data.arch
               (jeq, 1, 0, arch),              # 1: native ABI → 3
               (ret, 0, 0, _RET_EPERM),        # 2: foreign ABI: refused
               (ld, 0, 0, 0),                  # 3: seccomp_data.nr
               (jge, 3, 0, _X32_SYSCALL_BIT),  # 4: x32 numbers → 8
               (jeq, 2, 0, setsid),            # 5: → 8
               (jeq, 1, 0, setpgid),           # 6: → 8
               (ret, 0, 0, _RET_ALLOW),        # 7
               (ret, 0, 0, _RET_EPERM)]        # 8
    if not _load_filter(libc, program):
        return f", seccomp filter refused (errno {ctypes.get_errno()})"
    return ", no new sessions (seccomp)"


def _load_filter(libc: ctypes.CDLL, program: list[tuple[int, int, int, int]]) -> bool:
    """Install the classic-BPF ``program`` (``(code, jt, jf, k)`` rows) as a seccomp filter of this process (and its
    future children), after ``PR_SET_NO_NEW_PRIVS``, which an unprivileged filter needs; whether both worked."""
    filters = (_SockFilter * len(program))(*[_SockFilter(*op) for op in program])
    prog = _SockFprog(len(program), filters)
    return _prctl(libc, _PR_SET_NO_NEW_PRIVS, 1) and _prctl(libc, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER,
                                                            ctypes.byref(prog))


def protect_zygote() -> str:
    """The fork server's zygote: with Landlock, nothing (each forked worker enters its own domain, which keeps it
    away from the zygote; the zygote itself must stay outside any domain, or its children would share one and
    could reach each other); without, non-dumpable like the workers."""
    if landlock_abi() is not None:
        return "none needed (workers enter their own Landlock domains)"
    libc = _libc()
    return "non-dumpable" if libc is not None and _set_dumpable(libc, 0) else "none"


# -- seccomp: no new processes while a candidate is timed ----------------------------------------------------------
#: (audit arch, fork, vfork, clone, clone3) of the native ABI (arm64 has no fork/vfork calls: numbers no call has).
_PROCESS_CALLS = {"x86_64": (0xC000003E, 57, 58, 56, 435), "aarch64": (0xC00000B7, 0xFFFFFFFF, 0xFFFFFFFE, 220, 435)}
_CLONE_THREAD = 0x00010000
_RET_ENOSYS = 0x00050000 | 38


def no_new_processes() -> str:
    """A seccomp filter, for the rest of this process's life, that refuses every way to start a process (``fork``,
    ``vfork``, ``clone`` without ``CLONE_THREAD``) with ``EPERM``, and answers ``clone3`` (whose flags a filter
    cannot read) with ``ENOSYS``, so that the C library falls back to ``clone`` for threads. Threads stay possible
    (the gate counts them from ``/proc``). Installed by a candidate worker after its timing warm-up
    (:mod:`.timing`): no legitimate wrapper starts a process per call, and compilers have run by then.

    Why: red team 18: a candidate's C++ kernel ``vfork``-ed a child on every call that computed the outputs in the
    shared memory and exited before the call returned, so the gate's process count never saw it, and CPU test mode's
    clock (the worker's own CPU time) did not include it: accepted at 5.16×. A process started while timed is work
    the clock may not see, whatever the device. Returns what was done, for the timing answer. Never raises."""
    calls = _PROCESS_CALLS.get(os.uname().machine)
    libc = _libc()
    if calls is None or libc is None:
        return "not refused (no seccomp filter on this machine type)"
    arch, fork, vfork, clone, clone3 = calls
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    program = [(ld, 0, 0, 4),                  # 0: seccomp_data.arch
               (jeq, 1, 0, arch),              # 1: native ABI → 3
               (ret, 0, 0, _RET_EPERM),        # 2: foreign ABI (refused already by the session filter)
               (ld, 0, 0, 0),                  # 3: seccomp_data.nr
               (jeq, 6, 0, clone3),            # 4: → 11
               (jeq, 6, 0, fork),              # 5: → 12
               (jeq, 5, 0, vfork),             # 6: → 12
               (jeq, 1, 0, clone),             # 7: → 9
               (ret, 0, 0, _RET_ALLOW),        # 8
               (ld, 0, 0, 16),                 # 9: low word of args[0] (clone's flags)
               (jset, 2, 1, _CLONE_THREAD),    # 10: a thread → 13, else → 12
               (ret, 0, 0, _RET_ENOSYS),       # 11
               (ret, 0, 0, _RET_EPERM),        # 12
               (ret, 0, 0, _RET_ALLOW)]        # 13
    if not _load_filter(libc, program):
        return f"not refused (seccomp filter refused, errno {ctypes.get_errno()})"
    return "refused (seccomp)"
