"""The static scan's rule tables: the modules, builtins, attributes and native-code patterns a candidate wrapper may
not use, each with its ``# Rationale:``. :mod:`tilesmith.gate.host.static_scan` walks the wrapper and applies them;
the tables live here so that the scanner reads as logic and the rules as data.
"""

from __future__ import annotations

import re

# Rationale: threads, processes, signals and async loops let work continue after `call` returns, outside
# every timing sample and after the outputs were checked (thread injection: https://deep-reinforce.com/defense_kernel_hack.html).
CONCURRENCY_MODULES = {"threading", "_thread", "multiprocessing", "concurrent", "subprocess", "asyncio",
                        "signal", "sched", "torch.multiprocessing", "queue"}
# Rationale: raw memory access (ctypes beyond its scalar types, cffi, mmap) bypasses every runtime check:
# it can patch interpreter state, read the harness's memory or forge results. Inductor wrappers import
# only `from ctypes import c_void_p, c_long, c_int`.
NATIVE_MODULES = {"ctypes", "cffi", "mmap", "_ctypes"}
# Rationale: introspection reaches the harness's frames, modules and objects (gc.get_objects,
# sys._getframe, inspect) — the route to replacing its functions or reading the reference's results.
INTROSPECTION_MODULES = {"gc", "inspect", "sys", "importlib", "builtins", "__main__", "tilesmith", "dis",
                          "types", "code", "codeop", "runpy", "pkgutil", "weakref", "atexit", "faulthandler",
                          "tracemalloc", "pdb", "resource"}
# Rationale: a wrapper computes from its arguments; reading files outside its module (other runs, keys,
# cached results) or writing them (result caches across processes) has no legitimate use.
FILE_MODULES = {"pathlib", "shutil", "glob", "io", "pickle", "marshal", "shelve", "dbm", "sqlite3", "zipfile",
                 "tarfile", "fileinput", "csv", "pandas", "polars", "pyarrow", "h5py", "joblib", "dill",
                 "cloudpickle", "safetensors", "scipy.io", "numpy.lib.npyio", "numpy.lib.format",
                 "torch.serialization", "torch.hub", "torch.package", "torch._inductor.codecache",
                 "torch._inductor.runtime.cache_dir_utils"}
# Rationale: no network access from a wrapper (exfiltration, remote results).
NETWORK_MODULES = {"socket", "ssl", "http", "urllib", "urllib3", "requests", "httpx", "ftplib", "smtplib",
                    "xmlrpc", "aiohttp", "websocket", "websockets", "telnetlib", "paramiko"}

# Rationale: torch and other packages re-export modules (torch.sys, torch.cuda.threading, torch.os); an
# attribute path through one of these is the same as importing it.
# Every attribute of a chain is checked, the last one included (`s = torch.cuda.sys`).
REEXPORTED = {**{m: "static_concurrency" for m in ("threading", "_thread", "multiprocessing", "subprocess",
                                                    "signal", "asyncio", "concurrent")},
               **{m: "static_native_memory" for m in ("ctypes", "_ctypes", "cffi", "mmap")},
               **{m: "static_introspection" for m in ("sys", "gc", "inspect", "importlib", "builtins", "runpy",
                                                      "pdb", "faulthandler", "tracemalloc", "weakref", "atexit")},
               **{m: "static_file_access" for m in ("pathlib", "shutil", "pickle", "marshal", "tempfile")},
               **{m: "static_network" for m in ("socket", "urllib", "urllib3", "requests")}}

# Rationale: these names have no use in a wrapper whatever object they are reached through (an alias, a
# re-export, a container), so they are flagged by name, not by path (red-team finding 10):
# - file I/O outside `open`: torch.serialization / torch.load / torch.save, Storage.from_file, numpy's
#   load/save/loadtxt/fromfile/tofile/memmap, pathlib-style read_text/write_bytes, shared-memory files;
# - Inductor's cache writers (codecache.write_atomic, PyCodeCache.write, FxGraphCache, cache_dir): a
#   candidate rewrote the ORIGINAL wrapper's cache file so every later process loaded a slowed copy;
# - the environment (os.environ / getenv / putenv under any spelling): provider keys live there;
# - frame, reference-count and import machinery: sys._getframe walks to the harness's `timed` frame,
#   torch._C._storage_Use_Count tells whether the caller kept an output (spot-check detection),
#   operator.attrgetter / importlib.import_module reach any name the scan cannot see.
BLOCKED_ATTRS: dict[str, tuple[str, str]] = {
    **{n: ("static_file_access", "reads or writes files") for n in (
        "serialization", "from_file", "fromfile", "tofile", "loadtxt", "savetxt", "genfromtxt", "fromregex",
        "savez", "savez_compressed", "memmap", "open_memmap", "npyio", "DataSource", "read_text", "read_bytes",
        "write_text", "write_bytes", "hub", "read_csv", "to_csv", "read_pickle", "to_pickle", "read_parquet",
        "to_parquet", "_share_filename_cpu_", "_new_shared_filename_cpu", "_share_fd_cpu_", "_new_shared_fd_cpu",
        "save_cache_artifacts", "load_cache_artifacts")},
    **{n: ("static_file_access", "writes Inductor's shared compile cache") for n in (
        "codecache", "write_atomic", "PyCodeCache", "cache_dir", "cache_dir_utils", "default_cache_dir")},
    **{n: ("static_file_access", "reads or changes environment variables") for n in (
        "environ", "environb", "getenv", "getenvb", "putenv", "unsetenv")},
    **{n: ("static_introspection", "inspects frames, reference counts or imports by name") for n in (
        "_getframe", "_current_frames", "getrefcount", "_storage_Use_Count", "_use_count", "get_referrers",
        "get_referents", "get_objects", "settrace", "setprofile", "attrgetter", "methodcaller", "import_module",
        "_import_dotted_name", "exec_module", "module_from_spec", "spec_from_file_location", "run_path",
        "run_module")},
    "ctypeslib": ("static_native_memory", "reaches raw memory"),
    # Rationale (red team, round 2): a dispatcher registration made at import (torch.library.Library(...)
    # .impl("addmm.out", slow_fn, "CPU")) is process-wide: it slowed only the ORIGINAL's extern kernel in the
    # worker (accepted at 1.8x) and every addmm in the user's process after install. Inductor's wrappers call
    # operators; they never register them.
    **{n: ("static_monkeypatch", "registers or overrides operator kernels in the dispatcher") for n in (
        "library", "Library", "custom_op", "triton_op", "register_kernel", "register_fake", "register_autograd",
        "register_torch_dispatch", "register_vmap", "impl_abstract", "_dispatch_library", "fallthrough_kernel",
        "_register_py_kernel_for_op")},
}
# Rationale: Inductor's cache classes (CppCodeCache, FxGraphCache, AOTAutogradCache, LocalCache, ...)
# write files shared with other processes and the user's later runs.
CACHE_CLASS = re.compile(r"\w*(CodeCache|GraphCache|AutogradCache|CacheBase|LocalCache|PersistentCache)$")
# Rationale: `load`/`save` are file I/O on torch, torch.jit, numpy, torch.utils.cpp_extension (which
# compiles files); inside kernels only Triton's `tl.load` is legitimate.
LOAD_SAVE = {"load", "save"}
TRITON_ROOTS = {"tl", "triton.language"}

# Rationale: the one Tilesmith name a candidate may import: the loader of Tilesmith's own prebuilt native
# kernels (``tilesmith/kernels/runtime.py``: it reads a finished build from the kernel directory, never
# builds, writes or starts a process; docs/gate.md, "Native kernels"). Only this exact `from ... import`
# form without an alias: it binds one function, never the `tilesmith` package, whose modules reach the
# harness. Everything else from `tilesmith` stays `static_introspection`.
ALLOWED_IMPORT_FROM = frozenset({("tilesmith.kernels.runtime", "native_module")})

MODULE_RULES = [(m, "static_concurrency") for m in CONCURRENCY_MODULES] + \
    [(m, "static_native_memory") for m in NATIVE_MODULES] + \
    [(m, "static_introspection") for m in INTROSPECTION_MODULES] + \
    [(m, "static_file_access") for m in FILE_MODULES] + \
    [(m, "static_network") for m in NETWORK_MODULES]

# Rationale: a blocked module imported by its last name from any package is the same module
# (`from torch import sys`, `from torch.cuda import threading`: red-team finding 10).
MODULE_BY_NAME = {m: rule for m, rule in MODULE_RULES if "." not in m}

# Rationale: these builtins run or reach code and objects the scan cannot see (exec/eval/compile/__import__)
# or rebind attributes of shared modules (setattr/delattr); globals()/locals() expose namespaces.
FORBIDDEN_BUILTINS = {"exec": "static_introspection", "eval": "static_introspection",
                       "compile": "static_introspection", "__import__": "static_introspection",
                       "globals": "static_introspection", "locals": "static_introspection",
                       "vars": "static_dynamic_access", "breakpoint": "static_introspection",
                       "input": "static_introspection",
                       "setattr": "static_monkeypatch", "delattr": "static_monkeypatch",
                       "open": "static_file_access", "exit": "static_process_control",
                       "quit": "static_process_control"}
# Rationale: attribute names computed at run time (`getattr(torch, "s" + "ys")`), namespaces read as
# dicts (`vars(torch)["sys"]`), star imports, and these builtins passed around as values
# (`g = getattr`, `functools.reduce(getattr, ...)`) hide from the scan which names a wrapper reaches.
# Inductor writes every attribute out literally; nothing it generates uses any of them.
NAME_ACCESS_BUILTINS = {"getattr", "hasattr", "setattr", "delattr"}
INDIRECT_BUILTINS = {"getattr", "hasattr", "setattr", "delattr", "vars", "globals", "locals", "dir", "eval",
                      "exec", "compile", "__import__", "open", "breakpoint", "input", "exit", "quit"}

# Rationale: frame, code and namespace attributes are how a candidate reaches the caller (the harness)
# or rewrites functions in place.
DUNDER_ATTRS = {"__dict__", "__globals__", "__code__", "__closure__", "__builtins__", "__subclasses__",
                 "__bases__", "__mro__", "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "tb_frame",
                 "gi_frame", "cr_frame", "ag_frame", "__getattribute__", "__setattr__", "__class__", "__kwdefaults__",
                 "__defaults__", "__self__", "__func__", "__wrapped__", "__getattr__", "__import__", "__loader__",
                 "__spec__", "__traceback__", "__objclass__", "gi_code", "cr_code"}
# Rationale: os is imported by every wrapper but only these names are harmless; process control
# (fork, kill, _exit, exec*, system) and file/environment access are not.
OS_ALLOWED = {"path", "sep", "linesep", "name", "cpu_count", "getpid"}
# Rationale: global numeric and runtime state belongs to the user; flipping it makes the original
# slower or less precise for everything else in the process (TF32, matmul precision, reduced-precision
# reductions, determinism, SDPA backends, RNG seeds, allocator settings, the current stream).
GLOBAL_STATE_NAMES = {"set_float32_matmul_precision", "allow_tf32", "fp32_precision",
                       "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction",
                       "allow_fp16_accumulation", "use_deterministic_algorithms", "set_deterministic_debug_mode",
                       "manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all",
                       "set_default_dtype", "set_default_device", "set_default_tensor_type", "set_num_threads",
                       "set_num_interop_threads", "set_flush_denormal", "set_per_process_memory_fraction",
                       "_set_allocator_settings", "_accelerator_setAllocatorSettings", "change_current_allocator",
                       "set_allocator_settings", "set_stream", "set_sync_debug_mode", "enable_flash_sdp",
                       "enable_mem_efficient_sdp", "enable_math_sdp", "enable_cudnn_sdp", "set_grad_enabled",
                       "set_printoptions", "set_warn_always", "_set_cudnn_enabled", "set_rng_state_offset",
                       "_set_persisting_l2_cache_size", "cudaDeviceSetLimit", "load_library"}
# Rationale: names the wrapper receives as modules or shared helpers; assigning to their attributes
# monkeypatches code the original wrapper, the harness or the user's program also runs.
MODULE_ALIASES_DEFAULT = {"torch", "triton", "tl", "time", "math", "os", "random", "tempfile", "aten",
                           "inductor_ops", "extern_kernels", "async_compile", "triton_helpers", "triton_heuristics",
                           "libdevice", "tl_math", "np", "numpy", "cmath", "_quantized"}
# Rationale: a broad handler can hide a failing fast path and silently switch to another implementation
# whose speed and results were never measured on the path that actually ran ("fallback to reference":
# https://cognition.ai/blog/kevin-32b, https://makora.com/blog/reward-hacks). A wrapper's failures must surface.
BROAD_EXCEPTIONS = {"Exception", "BaseException", "RuntimeError", "AssertionError", "torch.OutOfMemoryError"}
# Rationale: native code in strings: threads/processes/files/sockets/dynamic loading have no place in a
# kernel (OpenMP pragmas, which Inductor's CPU kernels use, are allowed).
NATIVE_PATTERNS = [
    (re.compile(r"\bstd::(thread|async|jthread)\b|\bpthread_create\b|\bthread\s*[({<]|\bclone[23]?\s*\("),
     "static_concurrency", "starts a thread"),
    # Rationale (red team, round 2): a native thread signalling the main thread (tgkill + a sigaction handler
    # that busy-waits) slowed only the original's samples and was accepted at 1.5x; native signal handling has
    # no place in a kernel.
    (re.compile(r"\b(sigaction|signal|sigqueue|tgkill|tkill|pthread_kill|setitimer|timer_create|alarm|syscall)"
                r"\s*\(|\bSYS_\w+|\bSIG(RTMIN|RTMAX|ALRM|VTALRM|PROF|USR[12])\b"), "static_process_control",
     "installs signal handlers or signals threads"),
    (re.compile(r"\b(fork|vfork|execv|execvp|execve|execl|system|popen|posix_spawn)\s*\("), "static_concurrency",
     "starts a process"),
    # Rationale (red team 17): the open variants and positioned I/O too (`openat` + `pwrite` on /proc/<pid>/mem).
    # Best effort, like every pattern here: a kernel's own process boundary is the worker's confinement
    # (tilesmith/gate/worker/confine.py), not this list.
    (re.compile(r"\b(fopen|freopen|std::[io]?fstream|open|open64|openat|openat64|openat2|creat|unlink|remove|rename|"
                r"pread|pread64|pwrite|pwrite64|pwritev2?)\s*\("), "static_file_access",
     "opens or changes files"),
    (re.compile(r"\b(socket|connect|getaddrinfo|gethostbyname)\s*\("), "static_network", "opens a socket"),
    (re.compile(r"\b(dlopen|dlsym|mprotect|ptrace|process_vm_writev|process_vm_readv)\s*\("), "static_native_memory",
     "loads code, changes memory protection or reaches another process's memory"),
    (re.compile(r"\bcudaStreamCreate\w*\s*\(|\bcudaDeviceSetLimit\s*\(|\bcudaCtxResetPersistingL2Cache\b|"
                r"\bcudaStreamSetAttribute\s*\(|\b(mkl_verbose|mkl_set_verbose|mkldnn_verbose|dnnl_set_verbose)\s*\("),
     "static_global_state", "changes CUDA streams or device limits, or a library's verbose mode"),
    (re.compile(r"\b(exit|_exit|abort|quick_exit|raise|kill|killpg)\s*\("), "static_process_control", "ends or signals "
     "the process"),
]

RULE_RATIONALE = {
    "static_syntax": "the source must parse as Python",
    "static_entry_point": "the pipeline installs the module's top-level `call(args)`; it must exist",
    "static_concurrency": "work continuing after `call` returns escapes timing and output checks",
    "static_native_memory": "raw memory access bypasses every runtime check",
    "static_introspection": "introspection reaches the harness's frames and modules",
    "static_file_access": "a wrapper computes from its arguments only; no files, caches or environment "
                          "variables",
    "static_network": "no network access from a wrapper",
    "static_process_control": "a wrapper must not end or signal its process",
    "static_monkeypatch": "shared modules' functions must not be replaced",
    "static_global_state": "the user's global numeric/runtime state must not change",
    "static_try_except": "broad exception handlers hide failing fast paths",
    "static_dynamic_access": "the scan must see every name a wrapper reaches: write attributes out literally "
                             "(torch.mm, not getattr(torch, 'm' + 'm') or vars(torch)['mm']), as Inductor does",
}
