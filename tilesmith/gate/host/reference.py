"""Trusted reference outputs: the original wrapper run in the gate's trusted worker, never next to candidate code.

:class:`TrustedReference` asks the trusted worker (``role=trusted``: it loads the original Inductor wrapper
and nothing else, ever; :mod:`tilesmith.gate.worker.reference`) to run the original on input lists it makes
itself from recipes (:func:`tilesmith.gate.inputs.recipe`), so no input values travel between processes and
nothing is staged through host memory. The outputs come back in a ``torch.save`` file that the host reads with
:func:`load_outputs` (size-checked before ``torch.load(weights_only=True)``); facts (layout, clobbered inputs,
RNG digest, non-finite count, wall time) come in the JSON answer. The user's own compiled callable is not
called: the user's process does no device work for the gate, and an invented integer input that the original
would reject with a device-side assert can only break the trusted worker (which the gate then replaces).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tilesmith.errors import WorkerError


@dataclass
class RefResult:
    """Reference outputs for one input list (CPU copies, contiguous) and their structural facts."""

    outputs: list[Any]
    facts: list[dict[str, Any]]
    mutated: dict[int, torch.Tensor] = field(default_factory=dict)
    wall_ms: float = 0.0
    clobbered: tuple[int, ...] = ()
    """Inputs outside ``mutated_input_idxs`` whose values the original itself changed: Inductor reuses a
    dead input's memory for an intermediate buffer (``buf2 = addmm_1; del addmm_1  # reuse``, common in
    training backward graphs). Their contents after a call are unspecified, so a candidate may change them too."""
    rng: str | None = None
    """Digest of the generators' state after the call (the trusted worker's), for the RNG check."""
    nonfinite: int = 0
    """NaN/±Inf elements in the floating outputs (chooses the high-magnitude scale)."""
    retained: dict[str, Any] | None = None
    """The original's hidden-reference counts at return (:mod:`tilesmith.gate.retained`), what candidates may
    not exceed."""

    def expected_specs(self) -> list[dict[str, Any]]:
        """What the worker checks outputs against before saving them (kind, shape, dtype, bytes)."""
        specs = []
        for fact, out in zip(self.facts, self.outputs):
            spec = {"kind": fact["kind"]}
            if fact["kind"] == "tensor":
                spec.update(shape=fact["shape"], dtype=fact["dtype"],
                            nbytes=int(out.numel() * out.element_size()) if isinstance(out, torch.Tensor) else 0)
            specs.append(spec)
        return specs

    def total_bytes(self) -> int:
        return sum(int(o.numel() * o.element_size()) for o in self.outputs if isinstance(o, torch.Tensor))


class ReferenceRejected(WorkerError):
    """The original wrapper raised on these inputs (the message is the trusted worker's, quoted)."""


class TrustedReference:
    """Reference runs in the trusted worker. ``expected_bytes``: the bound for one output file (the original's
    output bytes plus mutated inputs; checked before reading). Not thread-safe."""

    def __init__(self, worker: Any, files_dir: Path, timeout_s: float, expected_bytes: int = 1 << 40) -> None:
        self.worker, self.dir, self.timeout_s, self.expected_bytes = worker, files_dir, timeout_s, expected_bytes
        self._numbers = itertools.count(1)
        self.runs = 0

    def submit(self, runs: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
        """Send one ``ref`` request (each run: ``inputs`` recipe or ``timing`` call, ``seed``, ``repeat``, ``save``:
        bool) without waiting; :meth:`collect` reads the answer. Returns a ticket."""
        prepared = []
        for run in runs:
            run = dict(run)
            if run.pop("save", True):
                run["save"] = str(self.dir / f"ref_{next(self._numbers)}.pt")
            prepared.append(run)
        self.runs += len(prepared)
        return self.worker.send("ref", runs=prepared), prepared

    def collect(self, ticket: tuple[int, list[dict[str, Any]]],
                what: str = "reference runs of the original wrapper") -> list[RefResult | ReferenceRejected]:
        """The results of a :meth:`submit`, in order; a run the original raised on is a :class:`ReferenceRejected`.

        Raises:
            WorkerError: the trusted worker crashed, hung or answered outside the protocol (the gate replaces it).
        """
        rid, prepared = ticket
        answer = self.worker.receive(rid, self.timeout_s + 5.0 * len(prepared), what)
        if not answer.get("ok"):
            err = answer.get("error") or {}
            raise WorkerError(f"the trusted worker failed during {what}: {err.get('type')}: {err.get('message')}")
        facts_list = answer.get("runs") or []
        if len(facts_list) != len(prepared):
            raise WorkerError(f"the trusted worker answered {len(facts_list)} of {len(prepared)} reference runs")
        results: list[RefResult | ReferenceRejected] = []
        for run, facts in zip(prepared, facts_list):
            if "error" in facts:
                err = facts["error"]
                results.append(ReferenceRejected(f"{err.get('type')}: {str(err.get('message'))[:400]}"))
                continue
            outputs: list[Any] = []
            mutated: dict[int, torch.Tensor] = {}
            if run.get("save"):
                data = load_outputs(Path(run["save"]), self.expected_bytes)
                _unlink(Path(run["save"]))
                outputs = list(data["outputs"])
                mutated = {int(i): t for i, t in data["mutated_inputs"]}
            results.append(RefResult(outputs, list(facts.get("outputs") or []), mutated,
                                     float(facts.get("wall_ms", 0.0)), tuple(int(c) for c in facts.get("clobbered") or ()),
                                     facts.get("rng"), int(facts.get("nonfinite", 0)), facts.get("retained")))
        return results

    def run(self, spec: dict[str, Any], seed: int, repeat: int = 1, save: bool = True) -> RefResult:
        """One reference run of recipe ``spec`` from RNG ``seed`` (the ``repeat``-th call's outputs).

        Raises:
            ReferenceRejected: the original raised on these inputs.
            WorkerError: the trusted worker failed.
        """
        result = self.collect(self.submit([{"inputs": spec, "seed": int(seed), "repeat": int(repeat), "save": save}]))[0]
        if isinstance(result, ReferenceRejected):
            raise result
        return result


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


#: Allowance over the raw tensor bytes for torch.save's zip container and pickle (per file, per tensor).
_FILE_OVERHEAD, _PER_TENSOR_OVERHEAD = 64 * 1024, 4 * 1024


def load_checked(path: Path, expected_bytes: int, tensors: int = 64) -> Any:
    """``torch.load(weights_only=True)`` of a worker-written file after checking what it is and what it holds.

    The file is opened without following a link and without blocking (``O_NOFOLLOW | O_NONBLOCK``) and must be a
    regular file (red team 18: a candidate made the name a link to the host's standard input, a FIFO would block the
    user's process); its size, taken from that descriptor, is checked before a byte is read; and its zip directory
    must list only *stored* records whose sizes add up to no more than that limit (``torch.save`` writes them stored;
    a deflated record would inflate past the size check: 33 KiB became 32 MiB). The load reads the same descriptor.

    Raises:
        WorkerError: the file is missing, a link or not a regular file, or not a plain tensor file;
            :class:`OutputTooLarge` when it, or what it would inflate to, is larger than ``expected_bytes`` plus
            container overhead.
    """
    import stat
    import zipfile

    limit = expected_bytes + _FILE_OVERHEAD + _PER_TENSOR_OVERHEAD * tensors
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise WorkerError(f"worker output file {path} is missing or a link ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise WorkerError(f"worker output file {path} is not a regular file")
        if info.st_size > limit:
            raise OutputTooLarge(f"worker output file holds {info.st_size} bytes; the original's outputs need at most "
                                 f"{limit} bytes with container overhead", info.st_size, limit)
        with os.fdopen(os.dup(fd), "rb") as handle:
            try:
                records = zipfile.ZipFile(handle).infolist()
            except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
                raise WorkerError(f"worker output file {path} is not a plain tensor file: {type(exc).__name__}") from None
        if any(r.compress_type != zipfile.ZIP_STORED for r in records):
            raise WorkerError(f"worker output file {path} has compressed records (torch.save writes them stored)")
        inflated = sum(int(r.file_size) for r in records)
        if inflated > limit:
            raise OutputTooLarge(f"worker output file would load {inflated} bytes; the original's outputs need at "
                                 f"most {limit} bytes with container overhead", inflated, limit)
        source: Any = f"/proc/self/fd/{fd}" if os.path.exists(f"/proc/self/fd/{fd}") else path
        try:
            return torch.load(source, weights_only=True, map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - anything unreadable is the worker's fault
            raise WorkerError(f"worker output file {path} is not a plain tensor file: {type(exc).__name__}") from None
    finally:
        os.close(fd)


def load_outputs(path: Path, expected_bytes: int, tensors: int = 64) -> dict[str, Any]:
    """Read a worker's ``{"outputs": [...], "mutated_inputs": [[i, tensor], ...]}`` file (see :func:`load_checked`).

    Raises:
        WorkerError: missing, too large, or not that mapping of plain tensors/None.
    """
    data = load_checked(path, expected_bytes, tensors)
    if not isinstance(data, dict) or not isinstance(data.get("outputs"), list):
        raise WorkerError(f"worker output file {path} does not hold an outputs mapping")
    for item in data["outputs"]:
        if item is not None and type(item) is not torch.Tensor and not isinstance(item, (int, float, bool)):
            raise WorkerError(f"worker output file {path} holds a {type(item).__name__}, not a tensor")
    data.setdefault("mutated_inputs", [])
    return data


class OutputTooLarge(WorkerError):
    """A worker wrote an output file larger than the reference's outputs allow."""

    def __init__(self, message: str, size: int, limit: int) -> None:
        super().__init__(message)
        self.size, self.limit = size, limit
