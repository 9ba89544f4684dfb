"""Trusted reference outputs: from the user's own Inductor callable in the host, or from a trusted worker.

:class:`HostReference` calls ``ref_fn`` (the original compiled callable, living in the user's process)
on a fresh device copy of an input list, inside a saved-and-restored RNG state seeded per call, so the
user's generator state is untouched. :class:`WorkerReference` runs the original wrapper source in a
dedicated worker into which no candidate code is ever imported (used when there is no ``ref_fn``, e.g.
from the artifact cache or the CLI). :class:`ScreenedReference` routes input lists with invented
integer/boolean values away from the user's process into such a worker. All return a :class:`RefResult` with CPU copies of the outputs and
the same structural facts the candidate worker reports.

Also here: :func:`write_inputs` (host → worker files) and :func:`load_outputs` (worker → host files,
size-checked before ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tilesmith.errors import WorkerError
from tilesmith.gate.layout import clone_layout, output_facts


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


def to_device(value: Any, device: torch.device) -> Any:
    """Copy of ``value`` on ``device`` with identical size, stride and storage offset."""
    return clone_layout(value, device)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Element-wise identical, NaN equal to NaN (compared on the device; no host copy)."""
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return bool(torch.equal(a, b))


def _cpu_copy(value: Any) -> Any:
    if type(value) is torch.Tensor:
        return value.detach().contiguous().cpu()
    return value


class HostReference:
    """Reference from ``ref_fn(args: list) -> tuple`` in the host process (trusted)."""

    def __init__(self, ref_fn: Callable[[list[Any]], Any], device: torch.device, mutated: tuple[int, ...]) -> None:
        self.ref_fn, self.device, self.mutated = ref_fn, device, mutated

    def run(self, values: list[Any], seed: int, repeat: int = 1) -> RefResult:
        """Outputs of the ``repeat``-th call after seeding the generators with ``seed``."""
        args = [to_device(v, self.device) for v in values]
        cpu_state = torch.get_rng_state()
        cuda_state = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        try:
            torch.default_generator.manual_seed(int(seed))
            if cuda_state is not None:
                torch.cuda.default_generators[self.device.index or 0].manual_seed(int(seed))
            with torch.no_grad():
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                for _ in range(max(0, repeat - 1)):
                    self.ref_fn(list(args))
                before = {i: a.clone() for i, a in enumerate(args)
                          if isinstance(a, torch.Tensor) and i not in self.mutated}
                t0 = time.perf_counter()
                outs = self.ref_fn(list(args))
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                wall = (time.perf_counter() - t0) * 1e3
        finally:
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, self.device)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        facts = output_facts(outs, args)
        mutated = {i: _cpu_copy(args[i]) for i in self.mutated if i < len(args)}
        clobbered = tuple(i for i, b in before.items() if not _same_values(args[i], b))
        return RefResult([_cpu_copy(o) for o in outs], facts, mutated, wall, clobbered)

    def close(self) -> None:
        pass


class WorkerReference:
    """Reference from the original source in a dedicated worker that never imports candidate code."""

    def __init__(self, worker: Any, files_dir: Path, timeout_s: float) -> None:
        self.worker, self.dir, self.timeout_s = worker, files_dir, timeout_s
        self._n = 0

    def run(self, values: list[Any], seed: int, repeat: int = 1) -> RefResult:
        self._n += 1
        inputs = self.dir / f"ref_in_{self._n}.pt"
        outputs = self.dir / f"ref_out_{self._n}.pt"
        write_inputs(values, inputs)
        step = {"module": "orig", "inputs": str(inputs), "seed": int(seed), "save": str(outputs),
                "guard_allocations": False, "label": "reference", "repeat": int(repeat)}
        answer = self.worker.request("check", self.timeout_s, "a reference run of the original wrapper",
                                     steps=[step], reference_only=True)
        facts = answer.get("steps", [{}])[0] if answer.get("ok") else {}
        if "error" in facts or not answer.get("ok"):
            raise WorkerError(f"the original wrapper failed in the reference worker: "
                              f"{(facts.get('error') or answer.get('error') or {}).get('message', 'unknown')}")
        data = load_outputs(outputs, 1 << 40)
        os.unlink(inputs)
        os.unlink(outputs)
        mutated = {int(i): t for i, t in data["mutated_inputs"]}
        clobbered = tuple(int(c["index"]) for c in facts.get("inputs_changed", []) if c.get("in_view"))
        return RefResult(list(data["outputs"]), facts["outputs"], mutated, float(facts.get("wall_ms", 0.0)),
                         clobbered)

    def close(self) -> None:
        self.worker.kill()


def invents_values(values: list[Any], base: list[Any]) -> bool:
    """True when an integer or boolean tensor in ``values`` holds values that differ from ``base``'s (the
    first real call's): the gate's varied masks, positions and indices (:mod:`tilesmith.gate.inputs`)."""
    for value, captured in zip(values, base):
        if (isinstance(value, torch.Tensor) and isinstance(captured, torch.Tensor)
                and not (value.is_floating_point() or value.is_complex())
                and (value.shape != captured.shape or not torch.equal(value.cpu(), captured.cpu()))):
            return True
    return False


class ScreenedReference:
    """A :class:`HostReference` that never runs invented integer/boolean values in the user's process.

    The gate varies masks, positions and indices within what looks like their valid domain, but only the
    graph knows the real one: an index the original reads out of bounds is a device-side assert on CUDA
    (which poisons the CUDA context for the rest of the process) and an unchecked read on CPU. So an input
    list whose integer/boolean values differ from the first real call's runs in a trusted worker (the
    original wrapper only, never a candidate), started on first need and replaced when such a run kills it;
    its outputs are the reference. Every other input list runs on the host's own callable.

    Raises (from :meth:`run`):
        tilesmith.errors.WorkerError: the original failed or crashed on invented values (the caller falls
            back to the captured integer values; see :func:`tilesmith.gate.host.phase.checked_variant`).
    """

    def __init__(self, host: HostReference, base: list[Any], start_worker: Callable[[], Any],
                 files_dir: Path, timeout_s: float) -> None:
        self.host, self.base, self.start_worker = host, base, start_worker
        self.dir, self.timeout_s = files_dir, timeout_s
        self.device, self.mutated = host.device, host.mutated
        self._trusted: WorkerReference | None = None
        self.screened = 0

    def run(self, values: list[Any], seed: int, repeat: int = 1) -> RefResult:
        if not invents_values(values, self.base):
            return self.host.run(values, seed, repeat)
        if self._trusted is None or not self._trusted.worker.alive():
            self._trusted = WorkerReference(self.start_worker(), self.dir, self.timeout_s)
        self.screened += 1
        try:
            return self._trusted.run(values, seed, repeat)
        except WorkerError:
            if not self._trusted.worker.alive():
                self._trusted = None
            raise

    def close(self) -> None:
        if self._trusted is not None:
            self._trusted.close()
            self._trusted = None


def write_inputs(values: list[Any], path: Path) -> None:
    """``torch.save`` an input list for a worker (CPU tensors with their layouts, scalars as they are)."""
    cpu = [v.detach().cpu() if isinstance(v, torch.Tensor) and v.device.type != "cpu" else v for v in values]
    torch.save(cpu, path)
    os.chmod(path, 0o600)


#: Allowance over the raw tensor bytes for torch.save's zip container and pickle (per file, per tensor).
_FILE_OVERHEAD, _PER_TENSOR_OVERHEAD = 64 * 1024, 4 * 1024


def load_checked(path: Path, expected_bytes: int, tensors: int = 64) -> Any:
    """``torch.load(weights_only=True)`` of a worker-written file after checking its size.

    Raises:
        WorkerError: the file is missing; :class:`OutputTooLarge` when it is larger than
            ``expected_bytes`` plus container overhead (checked before reading a byte of it).
    """
    try:
        size = Path(path).stat().st_size
    except OSError as exc:
        raise WorkerError(f"worker output file {path} is missing ({exc.strerror})") from None
    limit = expected_bytes + _FILE_OVERHEAD + _PER_TENSOR_OVERHEAD * tensors
    if size > limit:
        raise OutputTooLarge(f"worker output file holds {size} bytes; the original's outputs need at most "
                             f"{limit} bytes with container overhead", size, limit)
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - anything unreadable is the worker's fault
        raise WorkerError(f"worker output file {path} is not a plain tensor file: {type(exc).__name__}") from None


def load_outputs(path: Path, expected_bytes: int, tensors: int = 64) -> dict[str, Any]:
    """Read a worker's ``{"outputs": [...], "mutated_inputs": [[i, tensor], ...]}`` file (see :func:`load_checked`).

    Raises:
        WorkerError: missing, too large, or not that mapping of plain tensors/None.
    """
    data = load_checked(path, expected_bytes, tensors)
    if not isinstance(data, dict) or not isinstance(data.get("outputs"), list):
        raise WorkerError(f"worker output file {path} does not hold an outputs mapping")
    for item in data["outputs"]:
        if item is not None and type(item) is not torch.Tensor:
            raise WorkerError(f"worker output file {path} holds a {type(item).__name__}, not a tensor")
    data.setdefault("mutated_inputs", [])
    return data


class OutputTooLarge(WorkerError):
    """A worker wrote an output file larger than the reference's outputs allow."""

    def __init__(self, message: str, size: int, limit: int) -> None:
        super().__init__(message)
        self.size, self.limit = size, limit
