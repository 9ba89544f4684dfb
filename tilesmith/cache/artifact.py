"""The record stored per cache key, its on-disk manifest and its content hash.

An entry ``<root>/artifacts/<key[:2]>/<key>/`` holds::

    artifact.json          manifest: metadata, per-file SHA-256 and sizes, and ``content_hash``
    wrapper.py             the accepted wrapper source (canonical: no machine-specific paths)
    reports/<name>         the gate's host reports of the accepting evaluation(s) (profiles/*.json, *.txt)
    files/<name>           extra build products cached with the artifact (e.g. a compiled CUDA C++ kernel)

``content_hash`` is the SHA-256 of the manifest's canonical JSON (sorted keys, no whitespace) without the
``content_hash`` field itself. The manifest lists the SHA-256 and size of every file, so the one hash
covers every byte of the entry: a truncated or edited file, a truncated manifest or a manifest edited
without recomputing the hash are all detected (see :func:`verify_entry`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

FORMAT = 1
"""Manifest format version; an entry with another version is treated as a miss, not as corruption."""

MANIFEST = "artifact.json"
WRAPPER = "wrapper.py"

_KEY_RE = re.compile(r"^[0-9a-f]{64}$")


def check_key(key: str) -> str:
    """Return ``key`` when it is a 64-character lower-case hex SHA-256, else raise ``ValueError``.

    Raises:
        ValueError: naming the bad key and the expected form (a programming error in the caller).
    """
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ValueError(f"artifact cache key must be 64 lower-case hex characters (a SHA-256), got {key!r}")
    return key


def _check_member_name(name: str, what: str) -> str:
    """Reject names that could escape the entry folder (absolute, ``..``, empty parts, backslashes)."""
    pure = PurePosixPath(name)
    if (not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in name.split("/"))
            or pure.is_absolute()):
        raise ValueError(f"artifact {what} name {name!r} must be a relative path without '..' or '.' parts")
    return name


@dataclass(frozen=True)
class Artifact:
    """An accepted wrapper and the evidence it was accepted with, as reused on a cache hit.

    Units: milliseconds per call (``_ms``); ``speedup`` and ``speedup_ci`` are ratios Inductor/Tilesmith
    from the gate's confirmation (median of per-pair ratios and its bootstrap 95 % interval, see
    :class:`tilesmith.records.Timing`). Every number was computed by the host gate of the run named in
    ``origin_run_id``, in ``environment``.

    ``reports`` are ``(file name, text)`` pairs, normally ``("e0003.json", ...)`` and ``("e0003.txt",
    ...)`` copied from the accepting track's ``profiles/`` (see :func:`reports_from_track`); a bare JSON
    text is accepted too and named after its ``evaluation_id``/``id`` field (else ``report_<i>.json``),
    and a :class:`~pathlib.Path` is read. ``files`` are
    ``(relative name, bytes)`` build products kept with the artifact. ``content_hash`` is filled by
    :class:`~tilesmith.cache.ArtifactStore` (``put`` and ``get``) and ignored by equality.

    Raises:
        ValueError: a non-finite or non-positive time/speedup, a malformed interval or a report/file
            name that is absolute or contains ``..``.
    """

    source: str
    speedup: float
    speedup_ci: tuple[float, float]
    torch_inductor_ms: float
    tilesmith_ms: float
    environment: dict[str, Any] = field(default_factory=dict)
    """``torch``, ``triton``, ``cuda``, ``device_name`` … (see :func:`environment_snapshot`)."""
    graph_name: str = ""
    kind: str = "inference"
    reports: tuple[tuple[str, str], ...] = ()
    proposer: str = ""
    """Who wrote the accepted source, e.g. ``"builtin:cudagraph"`` or ``"llm:main"``."""
    loops_accepted: int = 1
    roofline_floor_ms: float | None = None
    origin_run_id: str | None = None
    created_utc: str = ""
    files: tuple[tuple[str, bytes], ...] = ()
    note: str = ""
    content_hash: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("speedup", "torch_inductor_ms", "tilesmith_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Artifact.{name} must be a finite positive number, got {value!r}")
        ci = tuple(self.speedup_ci)
        if len(ci) != 2 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in ci) or ci[0] > ci[1]:
            raise ValueError(f"Artifact.speedup_ci must be (low, high) with low <= high, got {self.speedup_ci!r}")
        object.__setattr__(self, "speedup_ci", (float(ci[0]), float(ci[1])))
        # JSON-safe environment: primitives stay, anything else (a torch.version object…) becomes text
        object.__setattr__(self, "environment", {
            str(k): v if v is None or isinstance(v, (str, int, float, bool)) else str(v)
            for k, v in dict(self.environment).items()})
        floor = self.roofline_floor_ms
        if floor is not None and (not isinstance(floor, (int, float)) or not math.isfinite(floor) or floor <= 0):
            object.__setattr__(self, "roofline_floor_ms", None)  # informative only; absent, never a sentinel
        reports = _normalize_reports(self.reports)
        files = tuple((str(n), bytes(b)) for n, b in self.files)
        for name, _ in reports:
            _check_member_name(name, "report")
        for name, _ in files:
            _check_member_name(name, "file")
        for what, names in (("report", [n for n, _ in reports]), ("file", [n for n, _ in files])):
            if len(set(names)) != len(names):
                raise ValueError(f"Artifact has duplicate {what} names: {sorted(names)}")
        object.__setattr__(self, "reports", reports)
        object.__setattr__(self, "files", files)


def _normalize_reports(reports) -> tuple[tuple[str, str], ...]:
    out = []
    for i, item in enumerate(reports):
        if isinstance(item, Path):
            out.append((item.name, item.read_text(encoding="utf-8", errors="replace")))
        elif isinstance(item, str):
            name = f"report_{i:02d}.json"
            try:
                doc = json.loads(item)
                ident = doc.get("evaluation_id") or doc.get("id") if isinstance(doc, dict) else None
                if isinstance(ident, str) and re.match(r"^[A-Za-z0-9_.-]{1,64}$", ident):
                    name = f"{ident}.json"
            except ValueError:
                name = f"report_{i:02d}.txt"
            out.append((name, item))
        else:
            name, text = item
            out.append((str(name), str(text)))
    # keep names unique even when two bare texts carry the same id
    seen: dict[str, int] = {}
    unique = []
    for name, text in out:
        if name in seen:
            seen[name] += 1
            stem, dot, ext = name.rpartition(".")
            name = f"{stem}_{seen[name]}.{ext}" if dot else f"{name}_{seen[name]}"
        else:
            seen[name] = 0
        unique.append((name, text))
    return tuple(unique)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(value: Any) -> bytes:
    """The byte form hashed for ``content_hash``: sorted keys, no whitespace, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def entry_files(artifact: Artifact) -> dict[str, bytes]:
    """Relative path → bytes of every file an entry holds besides the manifest."""
    out = {WRAPPER: artifact.source.encode("utf-8")}
    for name, text in artifact.reports:
        out[f"reports/{name}"] = text.encode("utf-8")
    for name, data in artifact.files:
        out[f"files/{name}"] = data
    return out


def build_manifest(key: str, artifact: Artifact, files: dict[str, bytes]) -> dict[str, Any]:
    """The manifest dict (with ``content_hash``) for ``artifact`` stored under ``key``."""
    body: dict[str, Any] = {
        "format": FORMAT,
        "key": key,
        "graph_name": artifact.graph_name,
        "kind": artifact.kind,
        "speedup": artifact.speedup,
        "speedup_ci": list(artifact.speedup_ci),
        "torch_inductor_ms": artifact.torch_inductor_ms,
        "tilesmith_ms": artifact.tilesmith_ms,
        "roofline_floor_ms": artifact.roofline_floor_ms,
        "environment": artifact.environment,
        "proposer": artifact.proposer,
        "loops_accepted": artifact.loops_accepted,
        "origin_run_id": artifact.origin_run_id,
        "created_utc": artifact.created_utc,
        "note": artifact.note,
        "reports": [n for n, _ in artifact.reports],
        "extra_files": [n for n, _ in artifact.files],
        "files": {name: {"sha256": _sha256(data), "bytes": len(data)} for name, data in sorted(files.items())},
    }
    body["content_hash"] = _sha256(canonical_json(body))
    return body


class EntryInvalid(Exception):
    """An entry failed verification; the message says which file or field and how."""


def verify_entry(entry_dir: Path, key: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Read and verify one entry folder; return its manifest and file contents.

    Raises:
        FileNotFoundError: the entry folder does not exist (a miss, or removed concurrently).
        EntryInvalid: truncated/unparsable manifest, wrong format or key, content-hash mismatch, a missing,
            extra-sized or altered file.
        OSError: the entry could not be read (permissions, I/O error).
    """
    manifest_path = entry_dir / MANIFEST
    if not entry_dir.is_dir():
        raise FileNotFoundError(str(entry_dir))
    try:
        raw = manifest_path.read_bytes()
    except FileNotFoundError:
        raise EntryInvalid(f"{MANIFEST} is missing") from None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EntryInvalid(f"{MANIFEST} is not valid JSON ({exc}); truncated or overwritten") from None
    if not isinstance(manifest, dict):
        raise EntryInvalid(f"{MANIFEST} is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise EntryInvalid(f"{MANIFEST} has format {manifest.get('format')!r}, this Tilesmith reads {FORMAT}")
    if manifest.get("key") != key:
        raise EntryInvalid(f"{MANIFEST} names key {str(manifest.get('key'))[:16]}…, not the folder's key")
    stored_hash = manifest.get("content_hash")
    body = {k: v for k, v in manifest.items() if k != "content_hash"}
    actual_hash = _sha256(canonical_json(body))
    if stored_hash != actual_hash:
        raise EntryInvalid(f"content hash mismatch: manifest says {str(stored_hash)[:16]}…, "
                           f"its content hashes to {actual_hash[:16]}…")
    listed = manifest.get("files")
    if not isinstance(listed, dict) or WRAPPER not in listed:
        raise EntryInvalid(f"{MANIFEST} lists no {WRAPPER}")
    contents: dict[str, bytes] = {}
    for name, meta in listed.items():
        _check_member_name(name, "file")
        try:
            data = (entry_dir / name).read_bytes()
        except FileNotFoundError:
            raise EntryInvalid(f"{name} is missing") from None
        if len(data) != meta.get("bytes") or _sha256(data) != meta.get("sha256"):
            raise EntryInvalid(f"{name} does not match its hash ({len(data)} bytes, manifest says "
                               f"{meta.get('bytes')}): truncated or modified")
        contents[name] = data
    return manifest, contents


def artifact_from_entry(manifest: dict[str, Any], contents: dict[str, bytes]) -> Artifact:
    """Rebuild the :class:`Artifact` from a verified manifest and its files."""
    reports = tuple((n, contents[f"reports/{n}"].decode("utf-8")) for n in manifest.get("reports", []))
    files = tuple((n, contents[f"files/{n}"]) for n in manifest.get("extra_files", []))
    return Artifact(
        source=contents[WRAPPER].decode("utf-8"),
        speedup=manifest["speedup"],
        speedup_ci=tuple(manifest["speedup_ci"]),
        torch_inductor_ms=manifest["torch_inductor_ms"],
        tilesmith_ms=manifest["tilesmith_ms"],
        environment=manifest.get("environment") or {},
        graph_name=manifest.get("graph_name", ""),
        kind=manifest.get("kind", "inference"),
        reports=reports,
        proposer=manifest.get("proposer", ""),
        loops_accepted=manifest.get("loops_accepted", 1),
        roofline_floor_ms=manifest.get("roofline_floor_ms"),
        origin_run_id=manifest.get("origin_run_id"),
        created_utc=manifest.get("created_utc", ""),
        files=files,
        note=manifest.get("note", ""),
        content_hash=manifest["content_hash"],
    )


def reports_from_track(track_dir: Path, evaluation_ids: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``(name, text)`` pairs of ``profiles/<id>.json`` and ``profiles/<id>.txt`` for each id that exists.

    Use it to fill :attr:`Artifact.reports` from the accepting evaluation(s) of a track.
    """
    out = []
    for eid in evaluation_ids:
        for suffix in (".json", ".txt"):
            path = Path(track_dir) / "profiles" / f"{eid}{suffix}"
            if path.is_file():
                out.append((path.name, path.read_text(encoding="utf-8", errors="replace")))
    return tuple(out)


def environment_snapshot(device: str | None = None) -> dict[str, Any]:
    """Versions and device the artifact was validated in: ``torch``, ``triton``, ``cuda``, ``device_name``,
    ``capability`` (``"9.0"``), ``python``. Missing pieces are ``None``; never raises.

    Imports torch (call it where torch is already loaded, e.g. in the pipeline).
    """
    import platform

    env: dict[str, Any] = {"python": platform.python_version(), "torch": None, "triton": None, "cuda": None,
                           "device_name": None, "capability": None}
    try:
        import torch

        env["torch"] = getattr(torch, "__version__", None)
        env["cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
        if device and str(device).startswith("cuda") and torch.cuda.is_available():
            env["device_name"] = torch.cuda.get_device_name(device)
            major, minor = torch.cuda.get_device_capability(device)
            env["capability"] = f"{major}.{minor}"
        elif device:
            env["device_name"] = platform.processor() or platform.machine() or "cpu"
    except Exception:  # noqa: BLE001 - a snapshot must never break the pipeline
        pass
    try:
        import triton

        env["triton"] = getattr(triton, "__version__", None)
    except Exception:  # noqa: BLE001
        pass
    return env
