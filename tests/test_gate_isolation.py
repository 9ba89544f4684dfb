"""Worker isolation: every worker gets private Inductor/Triton caches and temporary files (red-team
finding 1: a candidate rewrote the original wrapper's file in the shared Inductor cache), the CPU ISA
probes and the original's compiled kernels are seeded by copy, and nothing a worker writes reaches the
user's cache or another worker."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests import gate_support as gs
from tests.cheats import redteam_isolation as rt
from tilesmith.gate.host import caches, process
from tilesmith.records import Candidate


def test_private_environment_points_every_cache_into_the_worker_folder(tmp_path):
    env = process.private_environment(tmp_path)
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TMPDIR"):
        assert Path(env[name]).parent == tmp_path
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"


def test_isa_probes_are_found_by_content_and_copied(tmp_path, monkeypatch):
    from torch._inductor import cpu_vec_isa

    probe = cpu_vec_isa.VecISA._avx_code
    shared = tmp_path / "shared"
    for sub, stem, text, built in (("ab", "cabprobe", probe, True), ("cd", "ccdkernel", "int main() {}", True),
                                   ("ef", "cefunbuilt", probe, False)):
        (shared / sub).mkdir(parents=True)
        (shared / sub / f"{stem}.cpp").write_text(text)
        if built:
            (shared / sub / f"{stem}.so").write_bytes(b"\x7fELF")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    found = caches._scan_isa_probe_files()
    assert found == (("ab", "cabprobe.cpp"), ("ab", "cabprobe.so"))
    monkeypatch.setattr(caches, "_isa_probe_files", lambda: found)
    worker_dir = tmp_path / "w"
    (worker_dir / "inductor").mkdir(parents=True)
    assert caches.seed_private_cache(worker_dir) >= 2
    copied = worker_dir / "inductor" / "ab" / "cabprobe.so"
    assert copied.read_bytes() == b"\x7fELF"
    assert copied.stat().st_ino != (shared / "ab" / "cabprobe.so").stat().st_ino  # a copy, not a link


def test_cache_template_is_copied_not_linked(tmp_path):
    class Fresh:
        saw: set[str] = set()
        dir = tmp_path / "w1"

    (Fresh.dir / "inductor" / "xy").mkdir(parents=True)
    (Fresh.dir / "inductor" / "xy" / "orig.py").write_text("call = None\n")
    template = caches.make_cache_template(Fresh, tmp_path / "template")  # type: ignore[arg-type]
    assert template == tmp_path / "template"
    target = tmp_path / "w2"
    assert caches.copy_cache_template(template, target) == 1
    (target / "inductor" / "xy" / "orig.py").write_text("tampered\n")
    assert (template / "inductor" / "xy" / "orig.py").read_text() == "call = None\n"
    Fresh.saw = {"sha"}
    assert caches.make_cache_template(Fresh, tmp_path / "template2") is None  # saw a candidate: never



@pytest.mark.parametrize("change", ["rewrite", "remove", "add"])
def test_an_altered_cache_template_seeds_no_worker(tmp_path, change):
    """Red team 17b: native code copied a poisoned library over the template's copy of an original kernel. The
    template's digests are kept in the host's memory; a template that differs from them (a file rewritten, gone or
    added) is refused with the remedy, and the altered file is never copied."""
    class Trusted:
        saw: set[str] = set()
        dir = tmp_path / "trusted"

    (Trusted.dir / "inductor" / "ab").mkdir(parents=True)
    (Trusted.dir / "inductor" / "ab" / "kernel.so").write_bytes(b"\x7fELF original")
    (Trusted.dir / "inductor" / "ab" / "orig.py").write_text("call = None\n")
    template = caches.make_cache_template(Trusted, tmp_path / "template")  # type: ignore[arg-type]
    assert caches.copy_cache_template(template, tmp_path / "w1") == 2
    kernel = template / "inductor" / "ab" / "kernel.so"
    if change == "rewrite":
        kernel.write_bytes(b"\x7fELF poisoned")
    elif change == "remove":
        kernel.unlink()
    else:
        (template / "inductor" / "cd").mkdir()
        (template / "inductor" / "cd" / "planted.so").write_bytes(b"\x7fELF")
    with pytest.raises(caches.CacheTemplateAltered, match="Close the gate and start a new one"):
        caches.copy_cache_template(template, tmp_path / "w2")
    assert change == "add" or not (tmp_path / "w2" / "inductor" / "ab" / "kernel.so").exists()
    assert not (tmp_path / "w2" / "inductor" / "cd").exists()


def test_precompiled_headers_are_shared_by_symbolic_link(tmp_path, monkeypatch):
    """A hard link in the worker's folder is a writable path to the host's header under Landlock's path rules (red
    team 17b); a symbolic link is checked at its target, outside the folder (and a worker whose writes are not
    confined removes it: the next test)."""
    import tempfile

    from torch._inductor import codecache

    headers = Path(tempfile.mkdtemp(prefix="share-headers-", dir=tempfile.gettempdir())) / "precompiled_headers"
    try:
        headers.mkdir()
        (headers / "cabc.h").write_text("#include <x.h>\n")
        (headers / "cabc.h.gch").write_bytes(b"gch")
        monkeypatch.setattr(codecache, "_HEADER_DIR", str(headers))
        rel = os.path.relpath(headers, tempfile.gettempdir())
        assert caches.share_precompiled_headers(tmp_path / "w1") == 2
        for name in ("cabc.h", "cabc.h.gch"):
            link = tmp_path / "w1" / "tmp" / rel / name
            assert link.is_symlink() and os.readlink(link) == str((headers / name).resolve())
        assert (headers / "cabc.h.gch").stat().st_nlink == 1
    finally:
        import shutil

        shutil.rmtree(headers.parent, ignore_errors=True)


def test_a_worker_whose_writes_are_not_confined_drops_links_to_shared_files(tmp_path, monkeypatch):
    from tilesmith.gate.worker import confine

    folder, shared = tmp_path / "w", tmp_path / "shared.h.gch"
    (folder / "tmp" / "hdr").mkdir(parents=True)
    shared.write_bytes(b"gch")
    (folder / "tmp" / "own.h").write_text("own")
    (folder / "tmp" / "hdr" / "shared.h.gch").symlink_to(shared)
    (folder / "tmp" / "hdr" / "own-link.h").symlink_to(folder / "tmp" / "own.h")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # not beneath the folder: not the worker's own, left alone
    assert confine._drop_outside_links((str(folder),)) == ""
    monkeypatch.setenv("TMPDIR", str(folder / "tmp"))
    assert confine._drop_outside_links((str(folder),)) == ", 1 links to shared files removed"
    assert not (folder / "tmp" / "hdr" / "shared.h.gch").is_symlink() and shared.exists()
    assert (folder / "tmp" / "hdr" / "own-link.h").is_symlink()


def test_copied_triton_cache_groups_point_into_the_new_worker(tmp_path, monkeypatch):
    """Triton's group files hold absolute paths; a copied template must not send a candidate worker's cache
    hits into the trusted worker's folder (the H200 rejected every edited CUDA candidate for it)."""
    class Trusted:
        saw: set[str] = set()
        dir = tmp_path / "trusted"

    key = Trusted.dir / "triton" / "KEY123"
    key.mkdir(parents=True)
    (key / "k.json").write_text("{}")
    (key / "k.cubin").write_bytes(b"\0cubin")
    gone = str(tmp_path / "elsewhere" / "k.ptx")  # a child without a file beside the group: left alone
    (key / "__grp__k.json").write_text(json.dumps({"child_paths": {"k.json": str(key / "k.json"),
                                                                  "k.cubin": str(key / "k.cubin"),
                                                                  "k.ptx": gone}}))
    template = caches.make_cache_template(Trusted, tmp_path / "template")  # type: ignore[arg-type]
    target = tmp_path / "w2"
    caches.copy_cache_template(template, target)
    children = json.loads((target / "triton" / "KEY123" / "__grp__k.json").read_text())["child_paths"]
    assert children == {"k.json": str(target / "triton" / "KEY123" / "k.json"),
                        "k.cubin": str(target / "triton" / "KEY123" / "k.cubin"), "k.ptx": gone}
    assert str(Trusted.dir) in (template / "triton" / "KEY123" / "__grp__k.json").read_text()  # template kept
    cache = pytest.importorskip("triton.runtime.cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(target / "triton"))
    group = cache.FileCacheManager("KEY123").get_group("k.json")  # what a cache hit in the worker opens
    assert group and all(path.startswith(str(target) + os.sep) for path in group.values()), group


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.fixture(scope="module")
def ln(tmp_path_factory):
    from tilesmith.gate import Gate

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILESMITH_ALLOW_CPU", "1")
        mp.setenv("TILESMITH_GATE_RUN_TIMEOUT_S", "60")
        mp.setattr("tilesmith.gate.host.gate.scan", lambda source: [])  # the isolation must hold without the scan
        torch.manual_seed(0)
        cap = gs.capture(gs.LinearLN(), torch.randn(32, 64))[0]
        root = tmp_path_factory.mktemp("isolation")
        problem = gs.make_problem(cap, root / "snapshot", label="150a7e00 (ln)")
        gate = Gate(problem, reference=cap.ref_fn, profiles_dir=root / "profiles", timing_pairs=6)
        yield gate, cap
        gate.close()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_worker_runs_with_private_caches_seeded_from_the_template(ln):
    gate, _ = ln
    worker = gate._take_worker()
    try:
        # A forked worker's /proc environ is the zygote's starting one (TILESMITH_GATE_FORKSERVER): it was given
        # worker.environ as os.environ; the original loaded from its own cache below shows Inductor used it.
        env = worker.environ if type(worker.proc).__name__ == "ForkedProcess" else _environ_of(worker.pid)
        for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TMPDIR"):
            assert Path(env[name]).parent == worker.dir, name
        assert env["TORCHINDUCTOR_CACHE_DIR"] != os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        # the original wrapper was written to and loaded from the worker's own cache
        assert any(p.read_text() == gate.problem.original_source
                   for p in (worker.dir / "inductor").rglob("*.py"))
    finally:
        worker.kill()
    assert not worker.dir.exists()
    assert gate._template is not None and (gate._template / "inductor").is_dir()


def test_cache_poisoning_candidate_is_blocked_and_shared_caches_stay_intact(ln):
    """Red-team finding 1 (t10_cache_poison): PyCodeCache.write(original) + codecache.write_atomic."""
    from torch._inductor.codecache import PyCodeCache

    gate, cap = ln
    _, shared_path = PyCodeCache.write(cap.source)  # this process's (the user's) cache file of the original
    before = Path(shared_path).read_text()
    template_files = {p: p.read_bytes() for p in gate._template.rglob("*") if p.is_file()} if gate._template else {}
    verdict = gate.evaluate(Candidate(source=rt.tamper_original_in_cache(cap.source), proposer="redteam:t10"))
    assert "audit_file_write" in [f.check for f in verdict.failures], verdict.reasons
    assert verdict.status == "rejected_global_state"
    assert Path(shared_path).read_text() == before
    assert "TAMPERED_BY_CANDIDATE" not in before
    for path, data in template_files.items():
        assert path.read_bytes() == data, path


def test_writing_into_the_users_cache_folder_is_blocked(ln, tmp_path):
    gate, cap = ln
    shared = tmp_path / "users-inductor-cache"
    shared.mkdir()
    verdict = gate.evaluate(Candidate(source=rt.write_into_shared_cache(cap.source, str(shared)),
                                      proposer="redteam:t10b"))
    assert "audit_file_write" in [f.check for f in verdict.failures], verdict.reasons
    assert list(shared.rglob("*")) == []
