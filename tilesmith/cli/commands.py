"""``tilesmith runs``, ``tilesmith show`` and ``tilesmith cache``: read-only views of the cache root
(except ``cache prune``). Each function returns the process exit code and writes to the given stream."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO

from tilesmith.cli import _format as fmt
from tilesmith.cli.rundata import RunData, TargetNotFound, TrackData, cpu_gate_text, list_runs, number, resolve


def cmd_runs(root: Path, out: TextIO, *, as_json: bool = False, limit: int | None = None) -> int:
    """List runs, newest first: id, creation time, model, graphs, installed graphs, best speedup."""
    runs = list_runs(root)[:limit] if limit else list_runs(root)
    if as_json:
        json.dump([_run_summary(r) for r in runs], out, indent=2)
        out.write("\n")
        return 0
    if not runs:
        out.write(f"no runs under {root / 'runs'} (set TILESMITH_CACHE_DIR or pass --root to look elsewhere)\n")
        return 0
    rows = []
    for r in runs:
        ineligible = r.ineligible_graphs
        graphs = f"{len(r.tracks)}" + (f" (+{ineligible} ineligible)" if ineligible else "")
        rows.append([r.run_id, r.created, r.model, graphs, str(len(r.installed)), fmt.speedup(r.best_speedup)])
    out.write(fmt.table(["RUN ID", "CREATED (UTC)", "MODEL", "GRAPHS", "INSTALLED", "BEST"], rows) + "\n")
    return 0


def _run_summary(r: RunData) -> dict[str, Any]:
    return {"run_id": r.run_id, "created_utc": r.created, "agent_model": r.model, "path": str(r.path),
            "graphs": len(r.tracks), "installed": len(r.installed), "best_speedup": r.best_speedup,
            "problems": list(r.problems)}


def cmd_show(root: Path, target: str, out: TextIO, *, as_json: bool = False) -> int:
    """Describe a run (all its tracks) or one track: eligibility diagnostics, loops, every evaluation's
    verdict and reasons, the final speedup. Exit code 2 when ``target`` matches nothing."""
    try:
        run, track = resolve(root, target)
    except TargetNotFound as exc:
        out.write(f"tilesmith show: {exc}\n")
        return 2
    tracks = [track] if track is not None else list(run.tracks)
    if as_json:
        doc = {"run": {**run.doc, "path": str(run.path), "problems": list(run.problems)},
               "tracks": [{**t.doc, "path": str(t.path), "cache": t.cache, "problems": list(t.problems),
                           "diagnostics": run.diagnostics_of(t), "gate_reports": [str(p) for p in t.gate_reports]}
                          for t in tracks]}
        json.dump(doc, out, indent=2, default=str)
        out.write("\n")
        return 0
    _write_run_header(run, out, diagnostics=track is None)
    if track is None and not tracks:
        out.write("\nno eligible graph was optimized in this run (see the diagnostics above)\n")
    for t in tracks:
        out.write("\n")
        _write_track(t, out, detailed=track is not None, diagnostics=run.diagnostics_of(t),
                     ended=run.process_ended if t.status == "optimizing" else None)
    return 0


def _write_run_header(run: RunData, out: TextIO, *, diagnostics: bool) -> None:
    d = run.doc
    out.write(f"run {run.run_id}  created {run.created}\n")
    budget = d.get("max_model_calls")
    parts = [f"model {run.model}", f"agency {d.get('agency', '-')}", f"loops {d.get('loops', '-')}",
             f"max_model_calls {'unlimited' if budget is None else budget}"]
    if number(d.get("min_improvement")) is not None:
        parts.append(f"min_improvement {100 * d['min_improvement']:g} %")
    out.write("  " + "  ".join(parts) + "\n")
    cpu_bar = cpu_gate_text(d)
    if cpu_bar:
        out.write(f"  {cpu_bar}\n")
    env = [f"{label} {d[k]}" for k, label in (("torch", "torch"), ("triton", "triton"), ("cuda", "CUDA"),
                                               ("device_name", "device")) if d.get(k)]
    if env:
        out.write("  " + "  ".join(env) + "\n")
    out.write(f"  folder {run.path}\n")
    for problem in run.problems:
        out.write(f"  problem: {problem}\n")
    if diagnostics:
        untracked = run.untracked_diagnostics
        if untracked:
            out.write("diagnostics (graphs left on Inductor before a track was created, run-level notes):\n")
            for x in untracked:
                out.write(_diag_line(x) + "\n")


def _diag_line(x: dict[str, Any]) -> str:
    where = f" ({x['graph_name']})" if x.get("graph_name") else ""
    return fmt.wrap(f"[{x.get('kind', '?')}]{where} {x.get('message', '')}", indent="  ")


def _write_track(t: TrackData, out: TextIO, *, detailed: bool, diagnostics: list[dict[str, Any]],
                 ended: str | None = None) -> None:
    """``ended``: for a track still ``optimizing``, that its run's process is gone (it never decided)."""
    d = t.doc
    status = t.status if ended is None else f"{t.status}, never decided: its {ended} (killed or interrupted)"
    out.write(f"graph {t.label}  {d.get('kind', '?')}  {status}\n")
    out.write(f"  key {t.key}\n" if detailed else "")
    loops = f"{d.get('loops_accepted', '-')}/{d.get('loops_requested', '-')}"
    evals = t.evaluations()
    out.write(f"  loops accepted {loops}  turns {d.get('turns', '-')}  evaluations {len(evals)}\n")
    for problem in t.problems:
        out.write(f"  problem: {problem}\n")
    ver = d.get("verification")
    if isinstance(ver, dict):
        out.write(f"  uninstalled by production verification on call {ver.get('failed_call', '?')} since install "
                  f"({ver.get('check', '?')}): {str(ver.get('detail', ''))[:300]}\n")
    bench = t.benchmark
    if bench:
        floor = number(bench.get("roofline_floor_ms"))
        tile = number(bench.get("tilesmith_ms"))
        floor_text = "roofline floor -"
        if floor:
            floor_text = f"roofline floor {fmt.ms(floor)} ms" + (f" ({tile / floor:.1f}x the floor)" if tile else "")
        out.write(f"  Inductor {fmt.ms(number(bench.get('torch_inductor_ms')))} ms  Tilesmith {fmt.ms(tile)} ms  "
                  f"speedup {fmt.speedup(number(bench.get('speedup')), bench.get('speedup_ci'))}  {floor_text}  "
                  f"source {bench.get('source', '-')}\n")
    else:
        out.write("  no wrapper installed: the graph runs on ordinary Inductor\n")
    if t.cache:
        c = t.cache
        out.write(f"  artifact-cache hit: {c.get('artifact_dir', '-')} (content hash {str(c.get('content_hash'))[:16]}…, "
                  f"accepted in run {c.get('origin_run_id') or '-'} by {c.get('proposer') or '-'})\n")
    if evals:
        rows = []
        for e in evals:
            rows.append([e.id, "-" if e.attempt is None else str(e.attempt), e.proposer or "-", e.status,
                         fmt.speedup(e.speedup), fmt.speedup(e.confirmation_speedup)])
        body = fmt.table(["EVAL", "ATTEMPT", "PROPOSER", "VERDICT", "SPEEDUP", "CONFIRMED"], rows)
        out.write("  " + body.replace("\n", "\n  ") + "\n")
        for e in evals:
            shown = e.reasons if detailed else e.reasons[:2]
            for reason in shown:
                out.write(fmt.wrap(f"{e.id}: {reason}", indent="    ") + "\n")
            if len(e.reasons) > len(shown):
                out.write(f"    {e.id}: … {len(e.reasons) - len(shown)} more (tilesmith show {t.key[:12]})\n")
            if detailed and e.report is not None:
                out.write(f"    {e.id}: report {e.report}\n")
    named = {e.report for e in evals if e.report is not None}
    others = [p for p in t.gate_reports if p not in named]
    if others and detailed:
        out.write("  other gate reports (e.g. an artifact-cache re-check):\n")
        for p in others:
            out.write(f"    {p}\n")
    elif others:
        out.write(f"  {len(others)} other gate report(s) in {t.path / 'profiles'} (tilesmith show {t.key[:12]})\n")
    for x in diagnostics:
        out.write(_diag_line(x) + "\n")


def cmd_cache_list(root: Path, out: TextIO, *, verify: bool = False, as_json: bool = False) -> int:
    """List artifact-store entries (most recently used first) with sizes and ages."""
    from tilesmith.cache import ArtifactStore

    store = ArtifactStore(root, enabled=True)
    entries = store.entries(verify=verify)
    quarantined = store.quarantined()
    now = time.time()
    if as_json:
        json.dump([{"key": e.key, "path": str(e.path), "graph_name": e.graph_name, "speedup": e.speedup,
                    "size_bytes": e.size_bytes, "created_utc": e.created_utc, "age_s": e.age_s(now),
                    "valid": e.valid, "problem": e.problem, "quarantined": False} for e in entries]
                  + [{"key": q.key, "path": str(q.path), "graph_name": q.graph_name, "quarantined": True,
                      "source_sha256": q.source_sha256, "reason": q.reason, "created_utc": q.created_utc,
                      "run_id": q.run_id} for q in quarantined], out, indent=2)
        out.write("\n")
        return 0
    if quarantined:
        _write_quarantined(quarantined, out)
    if not entries:
        out.write(f"artifact cache {store.dir} is empty\n")
        return 0
    rows = []
    for e in entries:
        state = {True: "ok", False: "CORRUPTED", None: "-"}[e.valid]
        rows.append([e.key[:16], e.graph_name or "-", fmt.speedup(e.speedup), fmt.human_bytes(e.size_bytes),
                     fmt.human_age(e.age_s(now)), state if verify else (e.problem and "CORRUPTED" or "")])
    out.write(fmt.table(["KEY", "GRAPH", "SPEEDUP", "SIZE", "LAST USED", "CHECK" if verify else ""], rows) + "\n")
    total = sum(e.size_bytes for e in entries)
    out.write(f"{len(entries)} entries, {fmt.human_bytes(total)} in {store.dir}\n")
    bad = [e for e in entries if e.valid is False]
    if bad:
        out.write(f"{len(bad)} corrupted entr{'y' if len(bad) == 1 else 'ies'}: they are ignored; "
                  f"`tilesmith cache prune` deletes them\n")
    return 0


def _write_quarantined(quarantined: list[Any], out: TextIO) -> None:
    rows = [[q.key[:16], q.graph_name or "-", q.source_sha256[:12], q.created_utc or "-",
             (q.reason[:90] + "…") if len(q.reason) > 90 else q.reason] for q in quarantined]
    out.write(f"{len(quarantined)} quarantined wrapper{'s' if len(quarantined) != 1 else ''} (failed production "
              "verification; never served again):\n")
    out.write(fmt.table(["KEY", "GRAPH", "WRAPPER SHA", "QUARANTINED", "REASON"], rows) + "\n\n")


def cmd_cache_prune(root: Path, out: TextIO, *, max_age: str | None, max_size: str | None,
                    dry_run: bool = False) -> int:
    """Delete corrupted entries, entries unused for longer than ``max_age`` and the least recently used
    beyond ``max_size``. Exit code 2 for an unparsable limit, 1 when deletion failed."""
    from tilesmith.cache import ArtifactStore

    try:
        age_s = fmt.parse_duration(max_age) if max_age is not None else None
        size_b = fmt.parse_size(max_size) if max_size is not None else None
    except ValueError as exc:
        out.write(f"tilesmith cache prune: {exc}\n")
        return 2
    store = ArtifactStore(root, enabled=True)
    now = time.time()
    try:
        result = store.prune(max_age_s=age_s, max_bytes=size_b, dry_run=dry_run, now=now)
    except OSError as exc:
        out.write(f"tilesmith cache prune: could not delete from {store.dir}: {exc}. Remedy: check the folder's "
                  f"permissions.\n")
        return 1
    verb = "would remove" if dry_run else "removed"
    for e in result.removed:
        if e.valid is False:
            why = "corrupted"
        elif age_s is not None and e.age_s(now) > age_s:
            why = f"unused for {fmt.human_age(e.age_s(now))}, over --max-age {max_age}"
        else:
            why = f"least recently used, over --max-size {max_size}"
        out.write(f"{verb} {e.key[:16]} {e.graph_name or '-'} {fmt.human_bytes(e.size_bytes)} ({why})\n")
    out.write(f"{verb} {len(result.removed)} entries ({fmt.human_bytes(result.freed_bytes)}) and "
              f"{result.leftovers_removed} leftover folders; kept {len(result.kept)} entries "
              f"({fmt.human_bytes(sum(e.size_bytes for e in result.kept))})\n")
    return 0
