"""The private compiler caches of gate workers: seeding a new worker's, and the template of the original's kernels.

Every worker has its own ``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``, ``TMPDIR`` and CUDA/NVRTC kernel caches
(:func:`tilesmith.gate.host.process.private_environment`). A new one is seeded with copies of the CPU ISA
probes of this process's cache, symbolic links to its precompiled headers (:func:`share_precompiled_headers`), and a verified copy of the cache template the trusted worker's caches give
right after it loaded the original (:func:`make_cache_template`), so a candidate's unchanged kernels are cache hits.
Nothing is hard-linked: a worker's Landlock write rules (:mod:`tilesmith.gate.worker.confine`) check the path a
file is opened by, and a hard link in its folder would be a writable path to a shared file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tilesmith.errors import WorkerError

#: Sub-directories of a worker's private directory that hold its compiler caches and temporary files. Besides
#: Inductor's, Triton's and ``tempfile``'s: the CUDA driver's JIT cache (``CUDA_CACHE_PATH``, else ``~/.nv``) and
#: ATen's NVRTC kernel cache (``PYTORCH_KERNEL_CACHE_PATH``, else ``~/.cache/torch/kernels``), which a worker could
#: not write in the user's home (its writes are confined to its folder) and must not share with later workers.
PRIVATE_CACHE_DIRS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "TMPDIR": "tmp",
                      "CUDA_CACHE_PATH": "nv", "PYTORCH_KERNEL_CACHE_PATH": "torch-kernels"}


class CacheTemplateAltered(WorkerError):
    """The gate's cache template differs from what :func:`make_cache_template` recorded (message names the remedy)."""


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
    return copied + share_precompiled_headers(worker_dir)


_TEMPLATE_SUBDIRS = (PRIVATE_CACHE_DIRS["TORCHINDUCTOR_CACHE_DIR"], PRIVATE_CACHE_DIRS["TRITON_CACHE_DIR"])
#: SHA-256 of every file of each template (``str(template)`` → relative path → digest), recorded by
#: :func:`make_cache_template` and kept in this process's memory, out of every worker's reach.
_TEMPLATE_DIGESTS: dict[str, dict[str, str]] = {}


def make_cache_template(worker: Any, template: Path) -> Path | None:
    """Copy the compiler caches of a worker that has initialized but imported no candidate yet (only the
    trusted original wrapper and its compiled kernels are in them) to ``template`` and record the SHA-256 of each
    file; later workers start from a verified copy (:func:`copy_cache_template`) instead of recompiling the
    original's kernels (CPU: the C++ kernels, seconds each; CUDA: every Triton kernel). Returns ``template``, or
    ``None`` when the worker has already seen a candidate or copying failed (later workers then compile for
    themselves).
    """
    if worker.saw:
        return None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".template-", dir=template.parent))
        for sub in _TEMPLATE_SUBDIRS:
            if (worker.dir / sub).is_dir():
                shutil.copytree(worker.dir / sub, tmp / sub, symlinks=False)
        digests = {rel: hashlib.sha256((tmp / rel).read_bytes()).hexdigest() for rel in _template_files(tmp)}
        os.replace(tmp, template)
        _TEMPLATE_DIGESTS[str(template)] = digests
        return template
    except OSError:
        return None


def _template_files(template: Path) -> list[str]:
    """Relative paths of the files (symbolic links included) beneath the template's cache sub-directories."""
    found = []
    for sub in _TEMPLATE_SUBDIRS:
        for path, _dirs, files in os.walk(template / sub):
            found += [os.path.relpath(os.path.join(path, name), template) for name in files]
    return sorted(found)


def copy_cache_template(template: Path, worker_dir: Path) -> int:
    """Copy a :func:`make_cache_template` folder into a new worker's private directory (copies, never
    links: a worker cannot change what the next one loads), with Triton's group files pointed at the copy
    (:func:`relink_triton_groups`). Returns the number of files copied.

    Each file is read once, its SHA-256 compared with the one recorded when the template was made, and written into
    the worker's folder only when it matches, so what a worker loads is what the trusted worker compiled. Workers
    cannot write the template (their Landlock write rules); this check holds also where that confinement is missing.

    Raises:
        CacheTemplateAltered: a file of the template changed, vanished or appeared since it was made (the worker's
            copy is then incomplete: it must not be used, and something wrote outside its worker's folder).
    """
    expected = _TEMPLATE_DIGESTS.get(str(template))
    present = _template_files(template)
    if expected is None:  # a template this process did not make (tests): taken as it is
        expected = {rel: "" for rel in present}
    changed = sorted(set(present) ^ set(expected))
    copied = 0
    for rel, digest in expected.items():
        try:
            content = (template / rel).read_bytes()
        except OSError:
            changed.append(rel)
            continue
        if digest and hashlib.sha256(content).hexdigest() != digest:
            changed.append(rel)
            continue
        target = worker_dir / rel
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
            shutil.copystat(template / rel, target)
            copied += 1
        except OSError:  # a full disk: no partial file (the worker compiles that kernel itself)
            target.unlink(missing_ok=True)
    if changed:
        raise CacheTemplateAltered(
            f"the gate's cache template {template} changed after the trusted worker's caches were copied into it "
            f"({len(changed)} files, e.g. {changed[0]}): something wrote outside its worker's folder, so no worker is "
            "seeded from it and this gate's results cannot be trusted. Close the gate and start a new one; see "
            "environment.worker.confinement in its report (writes are confined with Landlock ABI >= 2; docs/gate.md, "
            "'What native code can still do').")
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


def share_precompiled_headers(worker_dir: Path) -> int:
    """Symbolic links to this process's precompiled C++ headers in the worker's private temporary directory.

    torch 2.11 keeps precompiled headers (``cpp_prefix.h``, ~120 MB ``.gch`` per compiler/flag set) in
    ``<tempfile.gettempdir()>/torchinductor_<user>/precompiled_headers`` (``codecache._HEADER_DIR``, fixed
    at import, not under ``TORCHINDUCTOR_CACHE_DIR``); with the worker's private ``TMPDIR`` it would
    rebuild one (~10-20 s of CPU) before its first C++ kernel. Inductor finds an existing header by its path
    (``os.path.exists``, which follows the link) and the compiler reads it through the link; its lock files and any
    header it builds are real files of the worker's folder. Why links, and only symbolic ones: Landlock checks the
    path a file is opened by after following symbolic links, so the shared header stays read-only to the worker (its
    writes are confined to its folder), whereas a hard link in its folder was a writable path to the host's file
    (red team 17b: native code appended to it); copies would cost 124 MB and 0.03-0.2 s per header and worker, and
    which header a worker will use is not known ahead (the CI VM's folder held 16: 1.9 GB, 2.6 s to copy; 32 links:
    2 ms). A worker whose writes are not confined (no Landlock
    ABI ≥ 2, or its write rules failed) removes these links itself at start, before any candidate code exists, and
    builds its own headers (:mod:`tilesmith.gate.worker.confine`, which alone knows how it is confined). Returns the
    number of links.
    """
    try:
        from torch._inductor import codecache

        header_dir = getattr(codecache, "_HEADER_DIR", None)
        if not header_dir or not os.path.isdir(header_dir):
            return 0
        rel = os.path.relpath(header_dir, tempfile.gettempdir())
        if rel.startswith(".."):
            return 0
        target = worker_dir / PRIVATE_CACHE_DIRS["TMPDIR"] / rel
        linked = 0
        for entry in os.scandir(header_dir):
            if entry.is_file(follow_symlinks=False) and entry.name.endswith((".h", ".h.gch")):
                target.mkdir(parents=True, exist_ok=True)
                os.symlink(os.path.realpath(entry.path), target / entry.name)
                linked += 1
        return linked
    except Exception:  # noqa: BLE001 - no headers, other torch: the worker builds its own
        return 0
