"""The private compiler caches of gate workers: seeding a new worker's, and the template of the original's kernels.

Every worker has its own ``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR`` and ``TMPDIR``
(:func:`tilesmith.gate.host.process.private_environment`). A new one is seeded with copies of the CPU ISA
probes of this process's cache, hard links to its precompiled headers, and a copy of the cache template the
trusted worker's caches give right after it loaded the original (:func:`make_cache_template`), so a
candidate's unchanged kernels are cache hits.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

#: Sub-directories of a worker's private directory that hold its compiler caches and temporary files.
PRIVATE_CACHE_DIRS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "TMPDIR": "tmp"}


def private_folder(prefix: str, parent: Path | None = None) -> Path:
    """A new folder only this user can enter (0700), under ``parent`` (the system's temporary folder when
    ``None``), holding the empty :data:`PRIVATE_CACHE_DIRS` sub-directories: a worker's, or the fork server's
    zygote's (it is started like a worker)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(folder, 0o700)
    for sub in PRIVATE_CACHE_DIRS.values():
        (folder / sub).mkdir(mode=0o700)
    return folder


_ISA_PROBES: tuple[tuple[str, str], ...] = ()


def _isa_probe_files() -> tuple[tuple[str, str], ...]:
    """:func:`_scan_isa_probe_files`, remembered once it has found some (an empty answer is not kept: a worker
    started before this process's first C++ compile, e.g. the standby worker, must not stop later ones from
    being seeded)."""
    global _ISA_PROBES
    if not _ISA_PROBES:
        _ISA_PROBES = _scan_isa_probe_files()
    return _ISA_PROBES


def _scan_isa_probe_files() -> tuple[tuple[str, str], ...]:
    """``(relative dir, file name)`` of the CPU vector-ISA probe sources and libraries in this process's
    Inductor cache. torch 2.11 writes each probe as ``<cache>/<key[1:3]>/<key>.cpp`` and builds
    ``<key>.so`` next to it (``cpu_vec_isa.VecISA.check_build``; the key also hashes compile flags that
    some ISAs change on the fly), so the probes are found by content: small ``.cpp`` files whose text is
    one of the ``VecISA`` classes' ``*_code`` strings, with a built ``.so``. Empty when torch has no such
    probes or none was built here."""
    found: list[tuple[str, str]] = []
    try:
        from torch._inductor import codecache, cpu_vec_isa

        codes = {getattr(c, a).strip() for c in vars(cpu_vec_isa).values() if isinstance(c, type)
                 and issubclass(c, cpu_vec_isa.VecISA) for a in dir(c)
                 if a.endswith("_code") and isinstance(getattr(c, a, None), str)}
        root = codecache.cache_dir()
        limit = max((len(c) for c in codes), default=0) + 256
        for sub in os.scandir(root):
            if not (sub.is_dir() and len(sub.name) == 2):
                continue
            for entry in os.scandir(sub.path):
                if not entry.name.endswith(".cpp") or entry.stat().st_size > limit:
                    continue
                stem = entry.name[: -len(".cpp")]
                if not os.path.isfile(os.path.join(sub.path, stem + ".so")):
                    continue
                with open(entry.path, encoding="utf-8", errors="replace") as handle:
                    if handle.read().strip() in codes:
                        found += [(sub.name, entry.name), (sub.name, stem + ".so")]
    except Exception:  # noqa: BLE001 - other torch versions or an unreadable cache: no seeding
        return ()
    return tuple(sorted(found))


def seed_private_cache(worker_dir: Path) -> int:
    """Copy the CPU vector-ISA probe files of this process's Inductor cache into a worker's private one.

    Why: ``tilesmith._compat.fast_cpu_isa_probe`` (test mode, ``TORCHINDUCTOR_VEC_ISA_OK=1``) skips
    Inductor's ~12 s of ``python -c`` ISA probes only when the probe library already exists in the cache;
    a private cache starts empty. Copies, never links: what the worker writes never reaches this cache.
    Returns the number of files copied (0 when nothing was built here, e.g. on a GPU-only host).
    """
    try:
        from torch._inductor import codecache

        root = Path(codecache.cache_dir())
    except Exception:  # noqa: BLE001
        return 0
    target = worker_dir / PRIVATE_CACHE_DIRS["TORCHINDUCTOR_CACHE_DIR"]
    copied = 0
    for rel, name in _isa_probe_files():
        try:
            (target / rel).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel / name, target / rel / name)
            copied += 1
        except OSError:
            continue
    return copied + _link_precompiled_headers(worker_dir)


_TEMPLATE_SUBDIRS = (PRIVATE_CACHE_DIRS["TORCHINDUCTOR_CACHE_DIR"], PRIVATE_CACHE_DIRS["TRITON_CACHE_DIR"])


def make_cache_template(worker: Any, template: Path) -> Path | None:
    """Copy the compiler caches of a worker that has initialized but imported no candidate yet (only the
    trusted original wrapper and its compiled kernels are in them) to ``template``; later workers start
    from a copy (:func:`copy_cache_template`) instead of recompiling the original's kernels (CPU: the
    C++ kernels, seconds each; CUDA: every Triton kernel). Returns ``template``, or ``None`` when the
    worker has already seen a candidate or copying failed (later workers then compile for themselves).
    """
    if worker.saw:
        return None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".template-", dir=template.parent))
        for sub in _TEMPLATE_SUBDIRS:
            if (worker.dir / sub).is_dir():
                shutil.copytree(worker.dir / sub, tmp / sub, symlinks=False)
        os.replace(tmp, template)
        return template
    except OSError:
        return None


def copy_cache_template(template: Path, worker_dir: Path) -> int:
    """Copy a :func:`make_cache_template` folder into a new worker's private directory (copies, never
    links: a worker cannot change what the next one loads), with Triton's group files pointed at the copy
    (:func:`relink_triton_groups`). Returns the number of files copied."""
    copied = 0
    for sub in _TEMPLATE_SUBDIRS:
        if not (template / sub).is_dir():
            continue
        try:
            shutil.copytree(template / sub, worker_dir / sub, symlinks=False, dirs_exist_ok=True)
            copied += sum(len(files) for _, _, files in os.walk(worker_dir / sub))
        except OSError:
            continue
    relink_triton_groups(worker_dir / PRIVATE_CACHE_DIRS["TRITON_CACHE_DIR"])
    return copied


def relink_triton_groups(triton_dir: Path) -> int:
    """Point every ``__grp__*.json`` of a copied Triton cache at the files beside it; returns how many changed.

    Triton (3.6 ``runtime/cache.py``, ``FileCacheManager.put_group``) records a compiled kernel's files as
    absolute paths in ``<key>/__grp__<name>.json`` (``{"child_paths": {file name: absolute path}}``) and a
    cache hit opens those paths. A copied template's group files name the trusted worker's folder, so a
    candidate worker's import of an unchanged kernel opened a file outside its private directory and the audit
    rejected every edited CUDA candidate (``audit_file_read``; seen on the H200, 2026-12-02). A child path is
    rewritten only when a file of that name exists in the group file's own folder; others are left as they are
    (Triton then recompiles the kernel, it never fails).
    """
    import json

    changed = 0
    if not triton_dir.is_dir():
        return 0
    for group in triton_dir.glob("*/__grp__*.json"):
        try:
            data = json.loads(group.read_text())
            children = data.get("child_paths")
            if not isinstance(children, dict):
                continue
            fixed = {name: (str(group.parent / os.path.basename(path))
                            if isinstance(path, str) and (group.parent / os.path.basename(path)).is_file() else path)
                     for name, path in children.items()}
            if fixed != children:
                data["child_paths"] = fixed
                group.write_text(json.dumps(data))
                changed += 1
        except (OSError, ValueError):
            continue
    return changed


def _link_precompiled_headers(worker_dir: Path) -> int:
    """Hard-link this process's precompiled C++ headers into the worker's private temporary directory.

    torch 2.11 keeps precompiled headers (``cpp_prefix.h``, ~120 MB ``.gch`` per compiler/flag set) in
    ``<tempfile.gettempdir()>/torchinductor_<user>/precompiled_headers`` (``codecache._HEADER_DIR``, fixed
    at import, not under ``TORCHINDUCTOR_CACHE_DIR``); with the worker's private ``TMPDIR`` it would
    rebuild one (~10-20 s of CPU) before its first C++ kernel. Links cost nothing; Python code in the
    worker cannot write to them (audit hook: files that existed before the candidate's import are
    read-only to it); native code could, as it could write to the original folder — a documented
    residual risk. Nothing is copied when linking fails (another file system): the worker rebuilds.
    """
    try:
        import tempfile as _tempfile

        from torch._inductor import codecache

        header_dir = getattr(codecache, "_HEADER_DIR", None)
        if not header_dir or not os.path.isdir(header_dir):
            return 0
        rel = os.path.relpath(header_dir, _tempfile.gettempdir())
        if rel.startswith(".."):
            return 0
        target = worker_dir / PRIVATE_CACHE_DIRS["TMPDIR"] / rel
        linked = 0
        for entry in os.scandir(header_dir):
            if entry.is_file(follow_symlinks=False) and entry.name.endswith((".h", ".h.gch")):
                target.mkdir(parents=True, exist_ok=True)
                os.link(entry.path, target / entry.name)
                linked += 1
        return linked
    except Exception:  # noqa: BLE001 - no headers, other torch, other file system: the worker builds its own
        return 0


