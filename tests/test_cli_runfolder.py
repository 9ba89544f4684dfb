"""A realistic run folder for the CLI and report tests, written by the pipeline's own writers.

``build_root(root)`` writes two runs under ``root/runs`` with :class:`tilesmith.track.run.RunFolder` and
:class:`~tilesmith.track.run.Track` (the classes the pipeline uses), real Inductor wrappers captured on the
H200 (tests/fixtures/inductor-h200/), verdicts built from :mod:`tilesmith.records`, gate reports
(``profiles/<eval-id>.json`` holding ``dataclasses.asdict(Verdict)`` under ``"verdict"``, plus a ``.txt``
summary) and, for the cache-hit track, ``cache.json`` written by the artifact store.

The tests in this module check that the fixture follows docs/layout.md, so that it cannot drift from the
documented format unnoticed.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict
from pathlib import Path

from tilesmith.cache import Artifact, ArtifactStore
from tilesmith.records import CapturedGraph, CheckFailure, Diagnostic, TensorSpec, Timing, Verdict
from tilesmith.track.run import RunFolder, Track

FIXTURES = Path(__file__).parent / "fixtures" / "inductor-h200"
RUN_NEW = "20261130T061500Z-1a2b3c4d"
RUN_OLD = "20261129T220000Z-9f8e7d6c"


def key_of(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def graph(case: str, name: str, kind: str) -> CapturedGraph:
    wrapper = (FIXTURES / f"{case}.wrapper.py").read_text()
    fx = (FIXTURES / f"{case}.fx.txt").read_text()
    return CapturedGraph(name=name, kind=kind, source=wrapper, canonical_source=wrapper, fx_program=fx,
                         inputs=(TensorSpec((64, 1024), (1024, 1), "torch.float32", "cuda:0"),),
                         output_strides=(("1024", "1"),), mutated_input_idxs=(), inputs_to_check=(0,),
                         device="cuda:0", inductor_key="fabc" + "0" * 48)


def timing(rng: random.Random, base_ms: float, cand_ms: float, n: int = 30, *, original: float | None = None) -> Timing:
    base = tuple(round(rng.lognormvariate(0, 0.03) * base_ms, 6) for _ in range(n))
    cand = tuple(round(rng.lognormvariate(0, 0.03) * cand_ms, 6) for _ in range(n))
    ratios = sorted(b / c for b, c in zip(base, cand))
    med = ratios[n // 2]
    orig = tuple(round(rng.lognormvariate(0, 0.03) * original, 6) for _ in range(n)) if original else None
    return Timing(method="cuda_event", calls_per_sample=10, baseline_ms=base, candidate_ms=cand, speedup=med,
                  ci_low=ratios[int(n * 0.3)], ci_high=ratios[int(n * 0.7)], original_ms=orig,
                  baseline_label="incumbent" if original else "inductor",
                  speedup_vs_original=(sorted(o / c for o, c in zip(orig, cand))[n // 2] if orig else None))


def evaluate(track: Track, eid: str, attempt: int, proposer: str, verdict: Verdict) -> Verdict:
    track.profiles.mkdir(parents=True, exist_ok=True)
    report = track.profiles / f"{eid}.json"
    verdict = Verdict(**{**asdict(verdict), "failures": verdict.failures, "timing": verdict.timing,
                         "confirmation": verdict.confirmation, "report_path": str(report), "evaluation_id": eid})
    doc = {"format": 1, "evaluation_id": eid, "label": track.label, "proposer": proposer, "attempt": attempt,
           "verdict": asdict(verdict),
           "environment": {"torch": "2.11.0+cu130", "triton": "3.6.0", "gpu": "NVIDIA H200", "driver": "580.95"}}
    report.write_text(json.dumps(doc, indent=1))
    (track.profiles / f"{eid}.txt").write_text(f"{eid} {proposer}: {verdict.summary()}\n")
    track.ring.push(f"# attempt evaluated as {eid}\n" + track.graph.canonical_source)
    track.update(turns=track.state["turns"] + 1)
    track.record_evaluation(eid, attempt, proposer, verdict)
    return verdict


def benchmark(t: Timing, *, source: str, floor: float | None, loops: int) -> dict:
    base = sorted(t.original_ms or t.baseline_ms)
    cand = sorted(t.candidate_ms)
    ratios = sorted(b / c for b, c in zip(t.original_ms or t.baseline_ms, t.candidate_ms))
    n = len(ratios)
    return {"torch_inductor_ms": base[n // 2], "tilesmith_ms": cand[n // 2],
            "speedup": ratios[n // 2], "speedup_ci": [ratios[int(n * 0.3)], ratios[int(n * 0.7)]],
            "roofline_floor_ms": floor, "source": source, "loops_accepted": loops, "method": t.method}


def build_root(root: Path) -> dict[str, object]:
    """Write the two demo runs under ``root``; return ids and keys for assertions."""
    rng = random.Random(7)
    meta = {"created_utc": "2026-11-30T06:15:00Z", "agent_model": "tilesmith/builtin", "agency": "medium",
            "loops": 2, "max_model_calls": None, "min_improvement": 0.02, "torch": "2.11.0+cu130",
            "triton": "3.6.0", "device_name": "NVIDIA H200", "pid": 4242, "host": "gpu-node-1"}
    run = RunFolder(root, RUN_NEW, meta)
    run.add_diagnostic(Diagnostic("dynamic_shape", "graph 5e5e5e5e (3_inference) has a SymInt input s77 "
                                  "(dynamic shapes); it stays on ordinary Inductor. Remedy: compile with "
                                  "dynamic=False.", "5e5e5e5e" + "0" * 56, "3_inference"))

    # 1. installed after two loops, with rejections on the way
    g1 = graph("softmax_bias_bf16_infer__06", "0_inference", "inference")
    t1 = Track(run, g1, key_of("softmax"), loops=2)
    t1.create()
    evaluate(t1, "e0001", 1, "builtin:launch_config", Verdict(
        False, "rejected_incorrect", ("output 0: value mismatch at [12, 4081]: expected 0.0312 got 0.0 "
                                      "(variant zero); <script>alert(1)</script>",),
        failures=(CheckFailure("value_mismatch", "output 0 differs", output_index=0, variant="zero"),)))
    v2 = evaluate(t1, "e0002", 2, "builtin:launch_config", Verdict(
        True, "accepted", (), timing=timing(rng, 0.210, 0.170), confirmation=timing(rng, 0.210, 0.171)))
    evaluate(t1, "e0003", 3, "builtin:wrapper_cleanup", Verdict(
        False, "rejected_marginal", ("speedup 1.006 below the 2 % threshold",),
        timing=timing(rng, 0.171, 0.170, original=0.210)))
    evaluate(t1, "e0004", 4, "builtin:launch_config", Verdict(
        True, "accepted", (), timing=timing(rng, 0.170, 0.150, original=0.210),
        confirmation=timing(rng, 0.170, 0.149, original=0.210)))
    final = timing(rng, 0.170, 0.149, original=0.210)
    t1.update(status="installed", benchmark=benchmark(final, source="optimizer", floor=0.062, loops=2))
    del v2

    # 2. kept on Inductor
    g2 = graph("mlp_fp32_infer__00", "1_forward", "forward")
    t2 = Track(run, g2, key_of("mlp"), loops=2)
    t2.create()
    evaluate(t2, "e0001", 1, "builtin:cudagraph", Verdict(
        False, "rejected_slower", ("candidate 3.1 % slower than Inductor",), timing=timing(rng, 0.090, 0.093)))
    evaluate(t2, "e0002", 2, "builtin:launch_config", Verdict(
        False, "rejected_crash", ("worker died with SIGSEGV while loading the candidate",)))
    diag = Diagnostic("no_improvement", f"graph {t2.label}: no candidate passed the gate after 2 turns.",
                      t2.key, "1_forward")
    run.add_diagnostic(diag)
    t2.add_diagnostic(diag)
    t2.update(status="kept_inductor")

    # 3. artifact-cache hit
    g3 = graph("mlp_fp32_infer__00", "2_inference", "inference")
    t3 = Track(run, g3, key_of("mlp-cached"), loops=2)
    t3.create()
    store = ArtifactStore(root, enabled=True)
    art = store.put(t3.key, Artifact(source=g3.canonical_source, speedup=1.8, speedup_ci=(1.7, 1.9),
                                     torch_inductor_ms=0.090, tilesmith_ms=0.050, graph_name="2_inference",
                                     origin_run_id=RUN_OLD, proposer="builtin:cudagraph",
                                     environment={"torch": "2.11.0+cu130", "gpu": "NVIDIA H200"}))
    store.write_cache_json(t3.folder, t3.key, art)
    hit = timing(rng, 0.090, 0.051)
    t3.update(status="cache_hit", benchmark=benchmark(hit, source="cache", floor=None, loops=0))

    # an older run with one installed graph
    old = RunFolder(root, RUN_OLD, {**meta, "created_utc": "2026-11-29T22:00:00Z", "agent_model": "gpt-5.5",
                                    "loops": 1, "max_model_calls": 70})
    t4 = Track(old, g3, key_of("mlp-cached"), loops=1)
    t4.create()
    evaluate(t4, "e0001", 1, "llm:main", Verdict(True, "accepted", (), timing=timing(rng, 0.090, 0.050),
                                                 confirmation=timing(rng, 0.090, 0.050)))
    t4.update(status="installed", benchmark=benchmark(hit, source="optimizer", floor=0.02, loops=1))
    old.save()
    run.save()
    return {"run": RUN_NEW, "old_run": RUN_OLD, "installed": t1.key, "kept": t2.key, "cached": t3.key}


# -- the fixture follows docs/layout.md -----------------------------------------------------------------

def _layout_example(name: str) -> dict:
    text = (Path(__file__).resolve().parents[1] / "docs" / "layout.md").read_text()
    block = re.search(rf"### `{re.escape(name)}`\n```json\n(.*?)```", text, re.S)[1]
    block = block.replace("[...]", "[]").replace('"..."', '"x"')
    return json.loads(block)


def test_fixture_run_json_has_every_documented_field(tmp_path):
    build_root(tmp_path)
    documented = _layout_example("run.json")
    doc = json.loads((tmp_path / "runs" / RUN_NEW / "run.json").read_text())
    assert set(documented) - {"diagnostics"} <= set(doc)
    assert set(documented["diagnostics"][0]) <= set(doc["diagnostics"][0])


def test_fixture_track_json_has_every_documented_field(tmp_path):
    ids = build_root(tmp_path)
    documented = _layout_example("track.json")
    doc = json.loads((tmp_path / "runs" / RUN_NEW / ids["installed"] / "track.json").read_text())
    assert set(documented) <= set(doc)
    assert set(documented["evaluations"][0]) <= set(doc["evaluations"][0])
    assert set(documented["benchmark"]) <= set(doc["benchmark"])
    track = tmp_path / "runs" / RUN_NEW / ids["installed"]
    assert sorted(p.name for p in (track / "attempts").iterdir()) == [f"attempt_0{i}.py" for i in range(5)]
    assert (track / "program.fx.txt").is_file() and (track / "profiles" / "e0004.json").is_file()
    assert (tmp_path / "runs" / RUN_NEW / ids["cached"] / "cache.json").is_file()
