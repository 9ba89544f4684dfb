"""How tensors travel from gate workers to the host (tilesmith/gate/worker/bindings.py, host/reference.py): the
workers save without CRC-32; the host reads every file into memory of its own (never memory-mapped: a process
still holding the file open could change what the host compares, or truncate it under the mapping and kill the
user's process with SIGBUS). CPU; the page-locked device-to-host copy runs on CUDA only (docs/h200-runs.md,
2026-12-04).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
import torch

from tilesmith.errors import WorkerError
from tilesmith.gate.host.reference import OutputTooLarge, load_checked, load_outputs
from tilesmith.gate.worker.bindings import compact_cpu


def _save(path, outputs, crc: bool = True) -> None:
    from torch.utils.serialization import config

    old = config.save.compute_crc32
    config.save.compute_crc32 = crc
    try:
        torch.save({"outputs": outputs, "mutated_inputs": []}, path)
    finally:
        config.save.compute_crc32 = old


def _overwrite_data(path, value: bytes) -> int:
    """Overwrite, in place (same inode, as a process holding the file open would), every data record."""
    with zipfile.ZipFile(path) as zf:
        records = [(zi.header_offset, zi) for zi in zf.infolist() if "/data/" in zi.filename]
    changed = 0
    with open(path, "r+b") as handle:
        for offset, info in records:
            handle.seek(offset + 26)
            name_len, extra_len = int.from_bytes(handle.read(2), "little"), int.from_bytes(handle.read(2), "little")
            handle.seek(offset + 30 + name_len + extra_len)
            handle.write(value * info.file_size)
            changed += info.file_size
    return changed


def test_loaded_tensors_do_not_change_when_the_file_is_rewritten_or_truncated_after_the_load(tmp_path):
    path = tmp_path / "out.pt"
    expected = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    _save(path, [expected.clone(), None], crc=False)
    data = load_outputs(path, expected_bytes=expected.numel() * 4)
    assert _overwrite_data(path, b"\x00") >= expected.numel() * 4
    got = data["outputs"][0]
    assert data["outputs"][1] is None
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # the file really changed: a fresh load sees the zeros
    assert float(load_outputs(path, expected_bytes=expected.numel() * 4)["outputs"][0].abs().sum()) == 0.0
    with open(path, "r+b") as handle:  # truncated under the host: what was read stays, and no signal arrives
        handle.truncate(0)
    torch.testing.assert_close(got * 2, expected * 2, rtol=0, atol=0)
    with pytest.raises(WorkerError):
        load_outputs(path, expected_bytes=expected.numel() * 4)


def test_files_without_crc_load_and_files_too_large_or_unreadable_are_refused(tmp_path):
    path = tmp_path / "out.pt"
    t = torch.randn(100_000)
    _save(path, [t], crc=False)
    torch.testing.assert_close(load_outputs(path, expected_bytes=400_000)["outputs"][0], t, rtol=0, atol=0)
    with pytest.raises(OutputTooLarge):
        load_checked(path, expected_bytes=200_000, tensors=1)
    (tmp_path / "junk.pt").write_bytes(b"not a zip file at all" * 10)
    with pytest.raises(WorkerError, match="not a plain tensor file"):
        load_checked(tmp_path / "junk.pt", expected_bytes=400_000)


def test_compact_cpu_copies_only_the_elements_of_a_strided_view():
    base = torch.randn(16, 16)
    view = base.t()[2:5]
    out = compact_cpu(view)
    assert out.is_contiguous() and out.untyped_storage().nbytes() == view.numel() * 4
    torch.testing.assert_close(out, view, rtol=0, atol=0)


def test_a_gate_worker_saves_without_crc():
    """The worker's start (core._warm_serialization) turns torch.save's CRC-32 off in its own process only."""
    code = ("from tilesmith.gate.worker.bindings import fast_saves\n"
            "from torch.utils.serialization import config\n"
            "before = config.save.compute_crc32\n"
            "fast_saves()\n"
            "print(before, config.save.compute_crc32)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "False"]
    from torch.utils.serialization import config

    assert config.save.compute_crc32 is True  # this process (the host's side) is untouched
