"""The bubblewrap sandbox the agent's ``gpu_shell`` commands run in.

Tilesmith does not build its own sandbox: every command runs under bubblewrap (``bwrap``, Debian/Ubuntu package
``bubblewrap``; ``TILESMITH_BWRAP`` or ``bwrap`` on ``PATH``) with

* **namespaces**: new mount, PID, IPC, UTS, cgroup and **network** namespaces (``--unshare-net``: only a loopback
  device of its own, so neither the private proxy on the host's loopback nor the internet can be reached), a new
  session (``--new-session``), all capabilities dropped (``--cap-drop ALL``), killed with the host process
  (``--die-with-parent``); a user namespace too when not run as root (bwrap's own rule);
* **files** (an allow-list; nothing else of the host exists inside): read-only ``/usr``, ``/bin``, ``/sbin``,
  ``/lib*`` (symlinks kept as symlinks), ``/sys``, a few ``/etc`` files the loader and compilers read
  (:data:`ETC_FILES`), the Python environment (``sys.prefix``, ``sys.base_prefix``, the folders holding ``torch``
  and ``triton``), existing ``LD_LIBRARY_PATH`` folders and the toolchains the environment names
  (:data:`TOOLCHAIN_VARS`: ``CC=/opt/gcc/bin/gcc`` shows ``/opt/gcc``); a fresh ``/dev`` plus the ``/dev/nvidia*``
  devices when
  present (the GPU stays visible); a fresh ``/proc``; a per-command ``/tmp`` (tmpfs). Writable: the graph's shell
  workspace (``/workspace``), its cache folder (``/cache``) and ``/tmp``, minus the read-only files bound over
  them; the sandbox's own root is remounted read-only. No
  bound folder may contain the user's home, the proxy's auth dir, the Tilesmith cache root or the
  CLIProxyAPI config (:func:`check_mounts`): the shell never sees ``~/.cli-proxy-api`` or the user's files;
* **environment**: ``--clearenv``, then only :func:`sandbox_env` (``PATH``, ``HOME=/cache/home``, caches under
  ``/cache``, locale, CUDA/Triton/Torch variables that pass :func:`~.redact.tool_env`, none secret);
* **limits**: wall clock (the host kills the sandbox at the deadline), CPU seconds (``ulimit -t``: the wall-clock
  limit times the host's cores), file size (``ulimit -f``: :data:`FILE_SIZE_LIMIT_BYTES`), no core dumps, and
  output: stdout and stderr go to host files and only their last :data:`MAX_OUTPUT_BYTES` are returned.

:func:`probe` runs a trivial command once per process (per bwrap path); when it fails, :class:`SandboxStatus`
says why and the shell tool is not offered.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

from tilesmith._proc import kill_group
from tilesmith.agent.llm.redact import tool_env

MAX_OUTPUT_BYTES = 64 * 1024
"""Bytes of stdout and of stderr returned per command: the last ones (tilesmith-ai 0.1.4's shell cap)."""
FILE_SIZE_LIMIT_BYTES = 1 << 30
"""Largest file a command may write (``ulimit -f``), its captured output included."""
PROBE_TIMEOUT_S = 30.0

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/passwd",
             "/etc/group", "/etc/nsswitch.conf", "/etc/localtime", "/etc/os-release", "/etc/hosts")
_DEVICE_GLOBS = ("nvidia*", "nvidia-caps", "dri")
TOOLCHAIN_VARS = ("CC", "CXX", "CUDAHOSTCXX", "CUDA_HOME", "CUDA_PATH", "TRITON_PTXAS_PATH", "TRITON_CUOBJDUMP_PATH",
                  "TRITON_NVDISASM_PATH")
"""Variables naming a compiler or toolkit by absolute path; its folder (the parent of a ``bin`` folder) is shown
read-only. Why: Triton compiles its launcher with ``$CC``, and on the H200 image ``CC=/opt/gcc/bin/gcc``; without
``/opt/gcc`` inside, every Triton kernel the agent timed in the shell failed (``FileNotFoundError``, 2026-12-02)."""
_OVERRIDDEN = frozenset({"HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "TEMP", "TMP", "PYTHONPATH", "VIRTUAL_ENV",
                         "CONDA_PREFIX", "XDG_CACHE_HOME", "TILESMITH_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                         "TRITON_CACHE_DIR", "TRITON_HOME", "PATH"})


@dataclass(frozen=True)
class Mounts:
    """Host paths the sandbox shows (all at the same path inside). ``symlinks``: ``(target, path)``."""

    read_only: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    symlinks: tuple[tuple[str, str], ...] = ()
    python_paths: tuple[str, ...] = ()
    """Folders holding torch/triton, put on ``PYTHONPATH`` inside (they may come from the host's PYTHONPATH)."""


@dataclass(frozen=True)
class SandboxStatus:
    """Whether ``gpu_shell`` can be offered; ``reason`` says why not (for the ``shell_unavailable`` diagnostic)."""

    ok: bool
    bwrap: str | None
    reason: str = ""
    version: str = ""


@dataclass(frozen=True)
class ShellResult:
    """One command's outcome. Times in seconds; ``exit_code`` ``None`` when it was killed at the deadline."""

    exit_code: int | None
    duration_s: float
    timed_out: bool
    stdout: str
    stderr: str
    stdout_bytes: int
    stderr_bytes: int


@dataclass(frozen=True)
class Sandbox:
    """A working bubblewrap setup for one run: the executable, the host mounts and the base environment."""

    bwrap: str
    mounts: Mounts
    env: Mapping[str, str] = field(default_factory=dict)
    version: str = ""

    def argv(self, workspace: Path, cache: Path, read_only: Sequence[tuple[Path, str]], command_file: Path,
             timeout_s: float) -> list[str]:
        """The full ``bwrap … -- bash …`` command line that runs the script in ``command_file``.

        Args:
            workspace: host folder shown read-write at ``/workspace`` (the working directory).
            cache: host folder shown read-write at ``/cache``.
            read_only: ``(host path, path inside)`` pairs bound read-only after the workspace, e.g. the
                baseline over ``/workspace/baseline.py`` (the inside path must already exist in the workspace).
            command_file: host file holding the agent's command, shown read-only at :data:`COMMAND_PATH` and run
                by bash (a file, not an argument: one argument may not exceed 128 KiB, and a heredoc writing a
                whole wrapper is larger).
            timeout_s: wall-clock limit; sets the CPU-time limit (times the host's cores).
        """
        args = [self.bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
                "--unshare-uts", "--unshare-net", "--unshare-cgroup-try", "--cap-drop", "ALL", "--clearenv"]
        for target, link in self.mounts.symlinks:
            args += ["--symlink", target, link]
        # /tmp first: a folder of the allow-list under the host's /tmp (a virtual environment or a toolchain
        # unpacked there) is then bound on top of the fresh tmpfs instead of being hidden by it.
        args += ["--tmpfs", "/tmp"]
        for path in self.mounts.read_only:
            args += ["--ro-bind", path, path]
        args += ["--dev", "/dev"]
        for path in self.mounts.devices:
            args += ["--dev-bind", path, path]
        args += ["--proc", "/proc", "--bind", str(workspace), "/workspace", "--bind", str(cache), "/cache"]
        for host, inside in read_only:
            args += ["--ro-bind", str(host), inside]
        args += ["--ro-bind", str(command_file), COMMAND_PATH]
        args += ["--remount-ro", "/"]  # the sandbox's own root (a tmpfs holding the mount points) is read-only too
        for name, value in self.env.items():
            args += ["--setenv", name, value]
        args += ["--chdir", "/workspace", "--", "bash", "-c", _LIMITS, "tilesmith-shell",
                 str(max(1, int(timeout_s * max(1, os.cpu_count() or 1)) + 5)), str(FILE_SIZE_LIMIT_BYTES // 1024)]
        return args

    def run(self, workspace: Path, cache: Path, read_only: Sequence[tuple[Path, str]], command: str,
            timeout_s: float) -> ShellResult:
        """Run ``command`` in the sandbox; kill it (the whole PID namespace) at ``timeout_s`` seconds.

        Never raises for the command's own failures; ``OSError`` only when bwrap cannot be started at all.
        """
        with tempfile.TemporaryDirectory(prefix="tilesmith-shell-out-") as tmp:
            out_path, err_path, cmd_path = Path(tmp) / "stdout", Path(tmp) / "stderr", Path(tmp) / "command.sh"
            cmd_path.write_text(command, encoding="utf-8")
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                started = time.monotonic()
                proc = subprocess.Popen(self.argv(workspace, cache, read_only, cmd_path, timeout_s),  # noqa: S603
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                        close_fds=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
                timed_out = False
                try:
                    code: int | None = proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out, code = True, None
                    kill_group(proc)
                duration = time.monotonic() - started
            stdout, n_out = _tail(out_path)
            stderr, n_err = _tail(err_path)
        return ShellResult(code, duration, timed_out, stdout, stderr, n_out, n_err)


COMMAND_PATH = "/.tilesmith/command.sh"
"""Where the agent's command file is shown (read-only) inside the sandbox."""
# ulimit inside the sandbox (bash counts -f in KiB), then the agent's command file; $1 CPU seconds, $2 file KiB.
_LIMITS = f'ulimit -c 0 && ulimit -t "$1" && ulimit -f "$2" && exec bash {COMMAND_PATH}'


def _tail(path: Path) -> tuple[str, int]:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        if size > MAX_OUTPUT_BYTES:
            handle.seek(size - MAX_OUTPUT_BYTES)
        data = handle.read(MAX_OUTPUT_BYTES)
    return data.decode("utf-8", errors="replace"), size


# -- what the sandbox shows -------------------------------------------------------------------------------------

def _contains(folder: str, path: str) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (both made absolute and resolved)."""
    f, p = os.path.realpath(folder), os.path.realpath(path)
    return p == f or p.startswith(f.rstrip("/") + "/")


def check_mounts(mounts: Mounts, forbidden: Iterable[str | Path]) -> str | None:
    """``None``, or why the mounts are unsafe: a bound folder containing one of ``forbidden``."""
    for folder in mounts.read_only + mounts.python_paths:
        for secret in forbidden:
            if secret and _contains(folder, str(secret)):
                return (f"the folder {folder} the sandbox would show read-only contains {secret}, which the shell "
                        "must never see (move the Python environment out of it, or set TILESMITH_GPU_SHELL=0)")
    return None


def _under_any(path: str, folders: Iterable[str]) -> bool:
    return any(_contains(f, path) for f in folders)


def _package_parent(name: str) -> str | None:
    try:
        spec = find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(getattr(spec, "submodule_search_locations", None) or []) if spec else []
    return str(Path(locations[0]).resolve().parent) if locations else None


def host_mounts(environ: Mapping[str, str]) -> Mounts:
    """The allow-list of the module docstring for this host and interpreter."""
    read_only: list[str] = []
    symlinks: list[tuple[str, str]] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            symlinks.append((os.readlink(path), path))
        elif os.path.isdir(path):
            read_only.append(path)
    read_only += [p for p in ETC_FILES if os.path.exists(p)]
    read_only += sorted(str(p) for p in Path("/etc").glob("python3*"))
    read_only.append("/sys")
    python_paths: list[str] = []
    for pkg in ("torch", "triton"):
        parent = _package_parent(pkg)
        if parent and parent not in python_paths:
            python_paths.append(parent)
    env_dirs = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                str(Path(sys.executable).resolve().parent.parent), *python_paths]
    env_dirs += [d for d in (environ.get("LD_LIBRARY_PATH") or "").split(os.pathsep) if d and os.path.isdir(d)]
    env_dirs += toolchain_dirs(environ)
    for folder in env_dirs:
        real = os.path.realpath(folder)
        if os.path.isdir(real) and not _under_any(real, read_only):
            read_only = [p for p in read_only if not _contains(real, p)] + [real]
    devices = sorted({str(p) for g in _DEVICE_GLOBS for p in Path("/dev").glob(g)})
    return Mounts(read_only=tuple(read_only), devices=tuple(devices), symlinks=tuple(symlinks),
                  python_paths=tuple(python_paths))


def toolchain_dirs(environ: Mapping[str, str]) -> list[str]:
    """Folders of the toolchains :data:`TOOLCHAIN_VARS` name: for a file, its folder, or that folder's parent when
    it is a ``bin`` folder (so ``lib``/``libexec`` beside it come along); for a folder, itself; both for the path
    as written and for its target when it is a link. Skipped: relative paths, missing ones, ``/`` and any folder
    holding the user's home (the shell must never see it)."""
    home = os.path.realpath(os.path.expanduser("~"))
    out: list[str] = []
    for name in TOOLCHAIN_VARS:
        value = (environ.get(name) or "").strip()
        if not value or not os.path.isabs(value) or not os.path.exists(value):
            continue
        for path in dict.fromkeys((os.path.abspath(value), os.path.realpath(value))):
            folder = path if os.path.isdir(path) else os.path.dirname(path)
            if os.path.basename(folder) == "bin":
                folder = os.path.dirname(folder)
            if folder in ("", "/") or _contains(folder, home) or folder in out:
                continue
            out.append(folder)
    return out


def sandbox_env(environ: Mapping[str, str], mounts: Mounts) -> dict[str, str]:
    """The environment inside: non-secret CUDA/Torch/Triton/locale variables, then Tilesmith's fixed values."""
    passed = {k: v for k, v in tool_env(environ).items() if k not in _OVERRIDDEN}
    bin_dir = os.path.dirname(sys.executable)
    path = [bin_dir, os.path.join(sys.prefix, "bin"), "/usr/local/cuda/bin", "/usr/local/sbin", "/usr/local/bin",
            "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
    passed.update({
        "PATH": ":".join(dict.fromkeys(path)),
        "HOME": "/cache/home", "TMPDIR": "/tmp", "XDG_CACHE_HOME": "/cache/xdg",
        "TORCHINDUCTOR_CACHE_DIR": "/cache/inductor", "TRITON_CACHE_DIR": "/cache/triton",
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1", "PYTHONUNBUFFERED": "1",
        "LANG": passed.get("LANG", "C.UTF-8"),
    })
    if mounts.python_paths:
        passed["PYTHONPATH"] = ":".join(mounts.python_paths)
    return passed


# -- availability --------------------------------------------------------------------------------------------

_PROBES: dict[tuple[str, tuple[str, ...]], SandboxStatus] = {}
_PROBE_LOCK = threading.Lock()


def find_bwrap(environ: Mapping[str, str]) -> str | None:
    """``TILESMITH_BWRAP`` when set (must be executable), else ``bwrap`` on ``PATH``."""
    explicit = environ.get("TILESMITH_BWRAP")
    if explicit:
        return explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None
    return shutil.which("bwrap", path=environ.get("PATH") or os.defpath)


def prepare(environ: Mapping[str, str], forbidden: Sequence[str | Path]) -> tuple[Sandbox | None, SandboxStatus]:
    """Find bwrap, plan the mounts, check them against ``forbidden`` and probe once.

    Returns ``(sandbox, status)``; ``sandbox`` is ``None`` unless ``status.ok``.
    """
    explicit = environ.get("TILESMITH_BWRAP")
    bwrap = find_bwrap(environ)
    if bwrap is None:
        where = (f"TILESMITH_BWRAP={explicit} is not an executable file" if explicit else
                 "bubblewrap (bwrap) is not on PATH")
        return None, SandboxStatus(False, None, f"{where}. Remedy: apt-get install bubblewrap, or unpack it with "
                                                "scripts/bwrap-bundle.sh and set TILESMITH_BWRAP.")
    mounts = host_mounts(environ)
    unsafe = check_mounts(mounts, forbidden)
    if unsafe:
        return None, SandboxStatus(False, bwrap, unsafe)
    sandbox = Sandbox(bwrap=bwrap, mounts=mounts, env=sandbox_env(environ, mounts))
    status = probe(sandbox)
    if not status.ok:
        return None, status
    return Sandbox(bwrap=bwrap, mounts=mounts, env=sandbox.env, version=status.version), status


def probe(sandbox: Sandbox) -> SandboxStatus:
    """Run ``python -c`` in the sandbox once per (bwrap, mounts); cached for the process."""
    key = (sandbox.bwrap, sandbox.mounts.read_only + sandbox.mounts.devices)
    with _PROBE_LOCK:
        cached = _PROBES.get(key)
        if cached is not None:
            return cached
        try:
            version = subprocess.run([sandbox.bwrap, "--version"], capture_output=True, text=True,  # noqa: S603
                                     timeout=10, check=False).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            status = SandboxStatus(False, sandbox.bwrap, f"{sandbox.bwrap} cannot be run ({exc})")
            _PROBES[key] = status
            return status
        with tempfile.TemporaryDirectory(prefix="tilesmith-probe-") as tmp:
            ws, cache = Path(tmp) / "ws", Path(tmp) / "cache"
            ws.mkdir()
            cache.mkdir()
            result = sandbox.run(ws, cache, (), f"exec {sys.executable} -c 'print(\"sandbox-ok\")'", PROBE_TIMEOUT_S)
        if result.exit_code == 0 and "sandbox-ok" in result.stdout:
            status = SandboxStatus(True, sandbox.bwrap, version=version or "bwrap")
        else:
            why = (result.stderr or result.stdout).strip().splitlines()[-3:] or [f"exit code {result.exit_code}"]
            status = SandboxStatus(False, sandbox.bwrap, f"{sandbox.bwrap} cannot start the sandbox: "
                                   f"{' | '.join(why)[:600]}. Remedy: run as root, or allow unprivileged user "
                                   "namespaces (sysctl kernel.unprivileged_userns_clone=1 / "
                                   "kernel.apparmor_restrict_unprivileged_userns=0), or set TILESMITH_GPU_SHELL=0.")
        _PROBES[key] = status
        return status
