"""Which processes a library may start under candidate code: a known compiler, at a system path, with arguments that
cannot run another program or load code into the compiler.

The audit rules (:mod:`tilesmith.gate.auditrules`) let a library start a compiler under candidate code: Inductor
builds C++ kernels and precompiled headers at a wrapper's import (``g++``, ``openssl sha512``), Triton builds its
launcher (``cc``) and runs ``ptxas``. The 2026-12-05 red team's second round (R2) ran
``torch._inductor.cpp_builder.run_compile_cmd("g++ -wrapper /bin/sh,-c,<cmd> ...")``: ``g++`` started ``sh`` as its
child, in the gate's worker and in the user's process; and the old name test took ``x-g++`` for a compiler. The rule
here (:func:`problem`, ``None`` when the command may run):

* **The program** (``argv[0]``, found on ``PATH`` when it has no folder) is a known tool by its exact name
  (:data:`COMPILERS`), optionally versioned (``g++-12``) or with a target triple of at least two parts
  (``x86_64-linux-gnu-g++-12``), and its real path lies in a system or toolchain folder (:func:`tool_roots`:
  ``/usr``, ``/bin``, ``/sbin``, ``/opt``, ``CUDA_HOME``..., and the Python installation, whose site-packages hold
  Triton's bundled ``ptxas``): never a file in a temporary or working folder that a candidate may have written.
* **Its arguments** pass an allowlist per tool family (:func:`_gcc`, :func:`_linker`, ...). Refused everywhere:
  response files (``@file``: arguments the check does not see). GCC/Clang: options that run other programs or load
  code into the compiler (``-wrapper``, ``-B``, ``-fplugin*``, ``-specs``, ``--sysroot``, ``-fuse-ld=<path>``,
  ``--ld-path``, ``-Wp,``, ``-Xpreprocessor``, linker plugins), and anything not on the list (captured from torch
  2.11's ``cpp_builder`` on CPU: every kernel build, the ISA probes, the precompiled-header step; Triton's launcher
  build). Files the command writes (``-o``, ``-MF``) are returned for the caller's write rule.
* **Its environment**: variables that make a compiler or the dynamic loader run or load other code
  (:data:`RISKY_ENV`: ``LD_PRELOAD``, ``GCC_EXEC_PREFIX``, ``COMPILER_PATH``, ``PATH``...) must have the values the
  process had when the hook was added (the Popen event's ``env``, or the current environment).

Standard library only (the gate worker imports it before torch).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from typing import Any

#: Executables a library may start under candidate code, by exact name. Rationale: torch 2.11 ``cpp_builder``
#: (``g++``/``c++``/``clang++``/``icpx``, ``openssl sha512`` for the precompiled header), Triton (``cc``/``gcc``/
#: ``clang`` for its launcher, ``ptxas``/``nvlink``/``fatbinary``/``cuobjdump``/``nvdisasm``, ``ldconfig -p``),
#: ``ctypes.util.find_library`` (``gcc``, ``ld``), CUTLASS/ROCm builds (``nvcc``, ``hipcc``), Inductor's AOT packaging
#: (``objcopy``, ``ar``).
COMPILERS = frozenset({"g++", "gcc", "c++", "cc", "clang", "clang++", "icx", "icpx", "nvcc", "hipcc", "ptxas",
                       "ptxas-blackwell", "nvlink", "fatbinary", "cuobjdump", "nvdisasm", "ld", "ld.lld", "ld.gold",
                       "ld.bfd", "objcopy", "ar", "ldconfig", "ccache", "openssl"})
_GCC = frozenset({"g++", "gcc", "c++", "cc", "clang", "clang++", "icx", "icpx", "hipcc"})
_LD = frozenset({"ld", "ld.lld", "ld.gold", "ld.bfd"})
_CUDA_TOOLS = frozenset({"ptxas", "ptxas-blackwell", "nvlink", "fatbinary", "cuobjdump", "nvdisasm"})
_NAME = re.compile(r"(?:[A-Za-z0-9_]+-[A-Za-z0-9_]+(?:-[A-Za-z0-9_]+){0,3}-)?(?P<tool>[A-Za-z0-9_.+-]+?)"
                   r"(?:-\d+(?:\.\d+)*)?")

#: Environment variables that make a compiler run other programs (``GCC_EXEC_PREFIX``, ``COMPILER_PATH``, ``PATH``:
#: where ``gcc`` finds ``cc1``, ``as`` and ``ld``) or make any program load code (``LD_PRELOAD``, ``LD_AUDIT``,
#: ``LD_LIBRARY_PATH``).
RISKY_ENV = ("LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", "GCC_EXEC_PREFIX", "COMPILER_PATH", "PATH")

# -- GCC/Clang options (torch 2.11 cpp_builder, Triton's launcher build, ctypes.util.find_library) ----------------
_GCC_FLAGS = frozenset({"-c", "-S", "-E", "-P", "-shared", "-fPIC", "-fpic", "-pthread", "-fopenmp", "-rdynamic",
                        "-static", "-static-libgcc", "-static-libstdc++", "-w", "-v", "--version", "-dM", "-pedantic",
                        "-M", "-MM", "-MD", "-MMD", "-MP", "-pipe", "-pie", "-no-pie", "-", "-dumpversion",
                        "-dumpfullversion", "-dumpmachine", "-fsyntax-only"})
_GCC_VALUE = frozenset({"-I", "-L", "-D", "-U", "-l", "-isystem", "-iquote", "-idirafter", "-include", "-MT", "-MQ",
                        "-x", "-o", "-MF", "-Xlinker", "-Xassembler"})
_GCC_JOINED = re.compile(r"-(?:[DUIL]|l|isystem|iquote|idirafter|O[0-3sgz]?$|Ofast$|std=[\w+]+$|g[\w]*$"
                         r"|W(?!l,|a,|p,)[\w=+-]*$|f(?!plugin|use-ld|profile|dump|callgraph|stack-usage)(?:no-)?[\w+-]+"
                         r"(?:=[\w.,+:-]*)?$|m[\w.=,+-]+$|fuse-ld=(?:bfd|gold|lld|mold)$)")
_LANGS = frozenset({"c", "c++", "c-header", "c++-header", "cuda", "assembler", "assembler-with-cpp", "none"})
_LD_FLAGS = frozenset({"--as-needed", "--no-as-needed", "--enable-new-dtags", "--disable-new-dtags",
                       "--export-dynamic", "-E", "--start-group", "--end-group", "--whole-archive",
                       "--no-whole-archive", "--gc-sections", "-Bsymbolic", "-Bsymbolic-functions", "-Bstatic",
                       "-Bdynamic", "-t", "--trace", "-shared", "--no-undefined", "--allow-shlib-undefined", "-s",
                       "--strip-all", "-v", "--version", "-pie", "-no-pie", "--eh-frame-hdr"})
_LD_VALUE = frozenset({"-rpath", "-rpath-link", "-soname", "-z", "-L", "-l", "-o", "-m", "--exclude-libs",
                       "--hash-style", "--build-id", "-h"})
_LD_JOINED = re.compile(r"-(?:rpath=|rpath-link=|soname=|-exclude-libs=|-hash-style=|-build-id|[Ll]|O\d$|z)")
_CUDA_REFUSED = ("@", "-optf", "--options-file")
_NVCC_REFUSED = ("-run", "--run", "-ccbin", "--compiler-bindir", "-optf", "--options-file", "-Xcompiler",
                 "--compiler-options", "-Xlinker", "--linker-options", "-Xnvlink", "--dependency-output")


def tool_roots() -> tuple[str, ...]:
    """Real paths of folders where a trusted tool may live: system folders, the CUDA/ROCm toolkits and the Python
    installation (Triton's bundled ``ptxas``, conda's compilers). Not temporary folders, not the home directory."""
    roots = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/opt", "/nix/store", sys.base_prefix, sys.prefix,
             sys.exec_prefix]
    roots += [os.environ[n] for n in ("CUDA_HOME", "CUDA_PATH", "ROCM_PATH") if os.environ.get(n)]
    # site-packages folders by their real paths: a virtual environment's may link elsewhere (Triton's ptxas)
    roots += [p for p in sys.path if isinstance(p, str) and ("site-packages" in p or "dist-packages" in p)]
    real = {os.path.realpath(r) for r in roots if r}
    bad = {"/", os.path.realpath(os.path.expanduser("~")), os.path.realpath("/tmp"), os.path.realpath("/var/tmp")}
    return tuple(r for r in real if r not in bad)


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + os.sep) for r in roots)


def tool_name(program: str) -> str | None:
    """The known tool ``program`` (a path or a name) names: ``g++`` for ``/usr/bin/x86_64-linux-gnu-g++-12``;
    ``None`` for ``x-g++``, ``evil-g++``, ``sh``."""
    base = os.path.basename(program)
    if base in COMPILERS:
        return base
    m = _NAME.fullmatch(base)
    return m.group("tool") if m and m.group("tool") in COMPILERS else None


def resolve(program: str, env: Any = None) -> str | None:
    """The real path of the executable ``program`` runs (searched on the Popen's ``PATH`` when it has no folder)."""
    if os.sep not in program:
        path = (env.get("PATH") if isinstance(env, dict) else None) or os.environ.get("PATH")
        found = shutil.which(program, path=path)
        if found is None:
            return None
        program = found
    return os.path.realpath(program)


def problem(argv: Any, env: Any = None, baseline: dict[str, str | None] | None = None,
            roots: tuple[str, ...] | None = None) -> tuple[str | None, list[str]]:
    """``(why the command may not run, or None; the files it writes)`` for a process a library starts under
    candidate code (``argv``: a Popen event's argument list or string; ``env``: its ``env``; ``baseline``: the risky
    variables' values when the hook was added)."""
    try:
        argv = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv)
        argv = [os.fsdecode(a) for a in argv]
        if len(argv) == 1 and " " in argv[0]:
            return "a command line in one string (run through a shell or split by nobody)", []
        program = argv[0]
    except (TypeError, IndexError, ValueError):
        return "not a command", []
    name = tool_name(program)
    if name is None:
        return "not a compiler", []
    real = resolve(program, env)
    if real is None or not _under(real, roots if roots is not None else tool_roots()):
        return f"{program!r} is not a system compiler ({real or 'not found'})", []
    if baseline is not None:
        current = env if isinstance(env, dict) else os.environ
        for key in RISKY_ENV:
            if current.get(key) != baseline.get(key):
                return f"its environment changes {key}", []
    args = argv[1:]
    if any(a.startswith("@") for a in args):
        return "a response file (@file)", []
    if name in _GCC:
        return _gcc(args, env, baseline, roots)
    if name in _LD:
        return _linker(args)
    if name in _CUDA_TOOLS:
        bad = [a for a in args if a.startswith(_CUDA_REFUSED)]
        return (f"option {bad[0]!r}" if bad else None), _outputs(args, ("-o", "--output-file"))
    if name == "nvcc":
        bad = [a for a in args if a.split("=")[0] in _NVCC_REFUSED or a.startswith(("-ccbin", "-Xcompiler"))]
        return (f"option {bad[0]!r}" if bad else None), _outputs(args, ("-o", "--output-file"))
    if name in ("ar", "objcopy"):
        bad = [a for a in args if a.startswith("--plugin")]
        return (f"option {bad[0]!r}" if bad else None), []
    if name == "ldconfig":
        return (None if args == ["-p"] else "ldconfig other than 'ldconfig -p'"), []
    if name == "openssl":
        return (None if len(args) == 2 and args[0] == "sha512" else "openssl other than 'openssl sha512 <file>'"), []
    if name == "ccache":
        return problem(args, env, baseline, roots) if args else ("ccache without a compiler", [])
    return None, []


def _outputs(args: list[str], flags: tuple[str, ...]) -> list[str]:
    out = []
    for i, a in enumerate(args):
        if a in flags and i + 1 < len(args):
            out.append(args[i + 1])
        elif a.startswith("-o") and len(a) > 2 and "-o" in flags:
            out.append(a[2:])
    return out


def _gcc(args: list[str], env: Any, baseline: Any, roots: Any) -> tuple[str | None, list[str]]:
    """GCC/Clang driver arguments: every option on the allowlist; ``-Wl,``/``-Xlinker`` items pass :func:`_linker`."""
    writes: list[str] = []
    linker: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("-") or a == "-":
            i += 1
            continue  # an input file (or standard input)
        if a in _GCC_VALUE:
            if i + 1 >= len(args):
                return f"option {a!r} without its value", writes
            value = args[i + 1]
            if a == "-x" and value not in _LANGS:
                return f"-x {value!r}", writes
            if a in ("-o", "-MF"):
                writes.append(value)
            elif a == "-Xlinker":
                linker.append(value)
            elif a == "-Xassembler" and (value.startswith("@") or "/" in value):
                return f"-Xassembler {value!r}", writes
            i += 2
            continue
        if a.startswith("-Wl,"):
            linker += a[4:].split(",")
        elif a.startswith("-Wa,"):
            if any(p.startswith("@") or "/" in p for p in a[4:].split(",")):
                return f"option {a!r}", writes
        elif a.startswith("-o") and len(a) > 2:
            writes.append(a[2:])
        elif a.startswith("-MF") and len(a) > 3:
            writes.append(a[3:])
        elif a not in _GCC_FLAGS and not _GCC_JOINED.match(a):
            return f"option {a!r} (not on the compiler allowlist: it may run another program or load code)", writes
        i += 1
    if linker:
        why, more = _linker(linker)
        if why is not None:
            return f"linker {why}", writes
        writes += more
    return None, writes


def _linker(args: list[str]) -> tuple[str | None, list[str]]:
    """Linker arguments (``ld`` or ``-Wl,``/``-Xlinker`` items): no plugins, no option outside the allowlist."""
    writes: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("-"):
            i += 1
            continue
        if a in _LD_VALUE:
            if a == "-o" and i + 1 < len(args):
                writes.append(args[i + 1])
            i += 2
            continue
        if a not in _LD_FLAGS and not _LD_JOINED.match(a):
            return f"option {a!r} (not on the linker allowlist: plugins load code)", writes
        i += 1
    return None, writes
