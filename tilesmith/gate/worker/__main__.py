"""Gate evaluation worker: ``python -m tilesmith.gate.worker --device-type=cuda|cpu`` (started by the host, never
imported by it; the device type picks what it imports ahead of ``init``: :func:`.core.prewarm`).

The only process in which candidate code is imported and run. It has its own CUDA context, a private
working directory holding its own Inductor/Triton caches and temporary files, and an environment without
secrets (those three the host sets when it starts the process: ``tilesmith/gate/host/process.py``); it
disables core dumps itself at start and sets a file-size limit at ``init`` when the host sends
``fsize_limit`` (both ``setrlimit``, best effort: a refusal leaves the limit as it was), and installs a PEP 578
audit hook (:mod:`tilesmith.gate.worker.audit`) before torch is imported, armed right before the candidate's
import. It
answers JSON requests (see :mod:`tilesmith.gate.protocol`):

``init``  apply the host's numeric flags, load the constants and the trusted original wrapper, warm it
          up, then snapshot global state, function identities and live threads (the baselines every
          later check compares against).
``load``  import a wrapper source through Inductor's ``PyCodeCache`` under a name (``cand``, ``inc``).
``check`` run a list of steps (module, input file, seed, poison, hold/save) and report facts per step:
          output types/layouts/aliasing, input bytes changed, guard tails hit, outputs changed after
          return, RNG digest, global-state and identity changes, new threads; outputs are saved with
          ``torch.save`` for the host to compare.
``time``  paired timing samples (:mod:`tilesmith.gate.worker.timing`).
``exit``  leave.

Nothing here decides anything: the host interprets the facts and compares the outputs itself.
"""

from __future__ import annotations

import os
import sys
import time


def _secure_stdio() -> tuple[object, int]:
    """Move the protocol to private descriptors; fd 0 becomes /dev/null and fd 1 the log (fd 2)."""
    proto_in_fd = os.dup(0)
    proto_out_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    return os.fdopen(proto_in_fd, "rb"), proto_out_fd


def _limit_resources() -> None:
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ValueError, OSError):
        pass


def _watch_parent(host_fd: int | None = None) -> None:
    """Exit when the host disappears (killed without closing the gate): a daemon thread polls the
    parent pid once a second (a worker forked by the zygote: the host's pidfd, since its parent is the zygote,
    whose end must not end it). Started before any baseline, so the thread check does not count it."""
    import select
    import threading
    import time

    parent, sleep, getppid, leave, wait = os.getppid(), time.sleep, os.getppid, os._exit, select.select

    def watch_pidfd() -> None:
        while not wait([host_fd], [], [], 1.0)[0]:
            pass
        leave(0)

    def watch_ppid() -> None:
        while getppid() == parent:
            sleep(1.0)
        leave(0)

    target = watch_ppid if host_fd is None else watch_pidfd
    threading.Thread(target=target, name="tilesmith-parent-watch", daemon=True).start()


def main() -> int:
    host_fd = None
    if "--zygote" in sys.argv[1:]:
        # The fork server (TILESMITH_GATE_FORKSERVER): returns only in a forked child, set up like a started worker.
        from tilesmith.gate.worker import zygote

        host_fd = zygote.serve(_device_type(sys.argv[1:]))
    proto_in, proto_out_fd = _secure_stdio()
    _limit_resources()
    # Before any other thread exists (every thread inherits the mask): no asynchronous signal reaches the worker, so
    # no handler can run candidate code between timing samples, outside the clock (red team 19; worker.outside).
    from tilesmith.gate.worker import outside

    outside.block_async_signals()
    # glibc's own signals 32 and 33 too, which its sigmask wrappers leave open (red team 20; worker.seal).
    from tilesmith.gate.worker import seal

    seal.block_glibc_signals()
    # Before any candidate code exists here: native code must not reach other processes (the host, the trusted
    # worker, the zygote) through ptrace-checked access such as /proc/<pid>/mem, nor write outside this worker's
    # folder, the working directory the host (or the zygote's child setup) gave it (tilesmith.gate.worker.confine).
    from tilesmith.gate.worker import confine

    confinement = confine.confine()
    # The audit hook goes in before torch (and long before any candidate) is imported; it judges events
    # only once armed, right before the candidate's import (tilesmith.gate.worker.audit). A forked worker
    # installs it here too, after the zygote imported torch: never in the zygote, whose hook would stay bound to
    # the zygote's folder and pid in every child (hooks cannot be removed); unarmed, a hook does nothing.
    from tilesmith.gate.worker import audit

    # Tilesmith's native kernel builds (tilesmith.kernels.runtime reads them when a candidate loads one):
    # readable, never writable (docs/gate.md, "Native kernels").
    kernel_dir = os.environ.get("TILESMITH_KERNEL_DIR", "")
    auditor = audit.install(os.getcwd(), readable=(kernel_dir,) if kernel_dir else ())
    _watch_parent(host_fd)
    from tilesmith.gate.worker.core import Worker, prewarm

    worker = Worker(proto_out_fd, auditor)
    device_type = _device_type(sys.argv[1:])
    started = time.perf_counter()
    prewarm(device_type)
    worker.announce(prewarm={"device_type": device_type, "seconds": round(time.perf_counter() - started, 3)},
                    confinement=confinement, **({"forked": True} if host_fd is not None else {}))
    for line in proto_in:  # type: ignore[attr-defined]
        if not line.strip():
            continue
        if not worker.handle(line):
            break
    return 0


def _device_type(argv: list[str]) -> str:
    """``--device-type=cpu`` (a CPU test-mode worker) or ``cuda`` (the default), from the host's command line."""
    for arg in argv:
        if arg.startswith("--device-type="):
            return "cpu" if arg.split("=", 1)[1] == "cpu" else "cuda"
    return "cuda"


def leave(code: int) -> None:
    """End the process without interpreter finalization. CPython 3.11 clears audit hooks after the ``atexit``
    callbacks and before the modules are torn down, so a candidate's ``__del__`` (or a generator's ``finally``) run
    by that teardown would run unaudited, after the last answer (the red team's R5); nothing a worker holds needs
    finalizing (its answers are written and flushed, its files are the host's to remove)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or replaced stream
            pass
    os._exit(code)


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - report it like Python would, then leave without finalization
        import traceback

        traceback.print_exc()
        status = 1
    leave(status)
