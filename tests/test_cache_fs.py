"""The artifact store's filesystem check (tilesmith/cache/fs.py): shared POSIX filesystems pass, object-store
mounts and filesystems whose folder rename replaces a non-empty target are refused by ``put`` with a diagnostic."""

from __future__ import annotations

import errno
import os

from tests.test_cache_store import KEY, make_artifact
from tilesmith.cache import ArtifactStore
from tilesmith.cache import fs as fs_mod

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
31 27 0:40 / /shared rw,relatime - nfs4 filer:/export rw,vers=4.2
32 31 0:41 / /shared/buckets/models rw - fuse.gcsfuse models rw,user_id=0
33 27 0:42 / /mnt/with\\040space rw - lustre 10.0.0.1@tcp:/fs rw
"""


def test_the_longest_mount_point_prefix_names_the_filesystem():
    assert fs_mod.mount_of("/shared/cache/tilesmith", MOUNTINFO) == ("nfs4", "/shared")
    assert fs_mod.mount_of("/shared/buckets/models/ts", MOUNTINFO) == ("fuse.gcsfuse", "/shared/buckets/models")
    assert fs_mod.mount_of("/shared/bucketsX", MOUNTINFO) == ("nfs4", "/shared")  # a prefix of a name is not a mount
    assert fs_mod.mount_of("/mnt/with space/x", MOUNTINFO) == ("lustre", "/mnt/with space")
    assert fs_mod.mount_of("/home/user", MOUNTINFO) == ("ext4", "/")


def test_a_local_folder_passes_the_rename_probe_and_leaves_nothing_behind(tmp_path):
    result = fs_mod.check(tmp_path / "root")
    assert result.supported and result.reason == "" and result.fs_type != "unknown"
    assert list((tmp_path / "root").iterdir()) == []


def test_an_object_store_mount_is_refused_by_put_with_a_remedy(tmp_path, monkeypatch):
    monkeypatch.setattr(fs_mod, "mount_of", lambda path, mountinfo=None: ("fuse.gcsfuse", "/buckets/ts"))
    monkeypatch.setattr(fs_mod, "_SEEN", {})
    store = ArtifactStore(tmp_path, enabled=True)
    assert store.put(KEY, make_artifact()) is None
    (problem,) = store.take_problems()
    assert problem.kind == "cache_unsupported_fs" and "fuse.gcsfuse" in problem.message
    assert "TILESMITH_CACHE_DIR" in problem.message and KEY[:12] in problem.message
    assert not (tmp_path / "artifacts").exists()


def test_a_filesystem_whose_folder_rename_replaces_a_full_target_is_refused(tmp_path, monkeypatch):
    real_rename = os.rename

    def replacing_rename(src, dst):  # what a non-atomic emulation does: drop the target, then move
        if os.path.basename(str(dst)) == "b":
            import shutil

            shutil.rmtree(dst)
        return real_rename(src, dst)

    monkeypatch.setattr(fs_mod, "_SEEN", {})
    monkeypatch.setattr(fs_mod.os, "rename", replacing_rename)
    result = fs_mod.check(tmp_path)
    assert not result.supported and "non-empty folder" in result.reason


def test_a_filesystem_without_folder_rename_is_refused(tmp_path, monkeypatch):
    def no_rename(src, dst):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fs_mod, "_SEEN", {})
    monkeypatch.setattr(fs_mod.os, "rename", no_rename)
    result = fs_mod.check(tmp_path)
    assert not result.supported and "ENOSYS" in result.reason


def test_a_retransmitted_rename_that_already_happened_returns_the_entry(tmp_path, monkeypatch):
    from tilesmith.cache import store as store_mod

    real_rename = os.rename

    def nfs_retransmit(src, dst):  # the server performed it, the client was told ENOENT
        real_rename(src, dst)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    store = ArtifactStore(tmp_path, enabled=True)
    fs_mod.check(tmp_path)  # memoize the probe with the real rename
    monkeypatch.setattr(store_mod.os, "rename", nfs_retransmit)
    stored = store.put(KEY, make_artifact())
    assert stored is not None and store.take_problems() == ()
    assert ArtifactStore(tmp_path, enabled=True).get(KEY) == stored
