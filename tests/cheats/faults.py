"""Crashing and hanging candidates for the fault suite (edits of the LinearLN CPU wrapper).

Names of process-control functions are built from strings. The hardened static scan refuses that
(``static_dynamic_access``); the fault tests switch the scan off (``gate_support.runtime_checks_only``)
because the point is to show the worker isolation holds when a fault reaches run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

from tests.cheats.common import after_clear, before_return, module_code


@dataclass(frozen=True)
class Fault:
    name: str
    make: Callable[[str], str]
    status: str
    check: str


def segfault(src: str) -> str:
    # SIGSEGV delivered to the worker (the same death as a null-pointer dereference in a kernel).
    return after_clear(src, ['getattr(os, "ki" + "ll")(os.getpid(), 11)'])


def hard_exit(src: str) -> str:
    return after_clear(src, ['getattr(os, "_" + "exit")(3)'])


def import_error(src: str) -> str:
    # A module that does not exist, under a package the import guard admits (docs/gate.md, "Imports"), so that the
    # import itself fails (a name outside the allow-list would be refused first: import_not_allowed).
    return src.replace("import torch\n", "import torch\nimport torch._inductor.tilesmith_no_such_module_xyz\n", 1)


def raise_at_import(src: str) -> str:
    return module_code(src, 'raise RuntimeError("broken at import")')


def python_infinite_loop(src: str) -> str:
    return after_clear(src, ["while True:", "    pass"])


def sleep_hang(src: str) -> str:
    # ``time`` reached as an attribute: the import guard refuses ``import time`` (docs/gate.md, "Imports").
    return after_clear(src, ["torch._inductor.utils.time.sleep(3600)"])


def hang_at_import(src: str) -> str:
    return module_code(src, "torch._inductor.utils.time.sleep(3600)")


def huge_output(src: str) -> str:
    # 256 MiB of float32 instead of an 8 KiB output.
    return before_return(src, [], "torch.empty(2 ** 26), ")


def out_of_memory(src: str) -> str:
    return after_clear(src, ["_huge = torch.empty(2 ** 50, dtype=torch.uint8)"])


def system_exit(src: str) -> str:
    return after_clear(src, ["raise SystemExit(7)"])


def stdout_spam(src: str) -> str:
    # Not a failure: printing (even megabytes) must not disturb the harness's protocol channel.
    return module_code(src, 'print("{\\"id\\": 1, \\"ok\\": true}\\n" * 20000)')


FAULTS = [
    Fault("segfault", segfault, "rejected_crash", "crash"),
    Fault("os_exit", hard_exit, "rejected_crash", "crash"),
    Fault("import_error", import_error, "rejected_load", "load_error"),
    Fault("raise_at_import", raise_at_import, "rejected_load", "load_error"),
    Fault("python_infinite_loop", python_infinite_loop, "rejected_timeout", "timeout"),
    Fault("sleep_hang", sleep_hang, "rejected_timeout", "timeout"),
    Fault("hang_at_import", hang_at_import, "rejected_timeout", "timeout"),
    Fault("huge_output", huge_output, "rejected_incorrect", "shape_mismatch"),
    Fault("out_of_memory", out_of_memory, "rejected_crash", "oom"),
    Fault("system_exit", system_exit, "rejected_crash", "exception"),
]
