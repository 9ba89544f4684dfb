"""bench/gate_calibration.py --merge: pooling the A/A and 5 % trials of several device calls (one call is limited to
600 s, and 300 A/A gates of a 0.5 ms graph take ~570 s)."""

from __future__ import annotations

import json

import pytest

from bench import gate_calibration as gc


def _block(speedups, accepted, seconds, cross):
    return {"gates": len(speedups), "accepted": accepted, "first_phase_passed": accepted + 1,
            "median_speedup": sorted(speedups)[len(speedups) // 2], "median_speedup_per_worker": {"0": 1.0},
            "mean_pairs_per_gate": 20.0 if accepted == 0 else 30.0, "median_cross_process": cross,
            "cross_process_per_worker": {"0": cross}, "seconds": seconds, "seconds_per_gate": seconds / len(speedups),
            "speedups": speedups}


def _run(tmp_path, name, aa, gain, **over):
    data = {"device": "NVIDIA H200", "torch": "2.11.0", "pairs": 30, "looks": [10, 20, 30], "look_alpha": 1 / 60,
            "threshold": 0.02, "total_s": 500.0,
            "graphs": {"mlp_block_fp32": {"gate_start_s": 10.0, "original_call_ms": 0.47, "extra_work": {"amount": 1},
                                          "aa": aa, "gain5": gain, "gate_wall": [],
                                          "median_wall_s[identical]": None,
                                          "median_wall_s[5% faster than incumbent]": None}}}
    data.update(over)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_merge_pools_counts_and_recomputes_the_median_from_every_gate(tmp_path):
    a = _run(tmp_path, "a.json", _block([0.99, 1.0, 1.01], 0, 6.0, 1.004), _block([1.05, 1.06], 2, 6.0, 1.06))
    b = _run(tmp_path, "b.json", _block([0.90, 0.91, 0.92, 1.02], 1, 8.0, 1.010), _block([1.07], 0, 3.0, 1.05))
    merged = gc.merge([a, b])
    aa = merged["graphs"]["mlp_block_fp32"]["aa"]
    assert (aa["gates"], aa["accepted"], aa["first_phase_passed"]) == (7, 1, 3)
    assert aa["median_speedup"] == pytest.approx(0.99)  # of all seven, not a median of the two medians
    assert aa["seconds_per_gate"] == pytest.approx(14.0 / 7)
    assert aa["median_cross_process_per_run"] == [1.004, 1.010]
    gain = merged["graphs"]["mlp_block_fp32"]["gain5"]
    assert (gain["gates"], gain["accepted"]) == (3, 2)
    assert gain["mean_pairs_per_gate"] == pytest.approx((30.0 * 2 + 20.0 * 1) / 3)
    assert len(merged["graphs"]["mlp_block_fp32"]["runs"]) == 2 and merged["total_s"] == 1000.0
    gc.print_table(merged)  # the table prints a merged result too


def test_merge_refuses_runs_of_different_rule_settings(tmp_path):
    a = _run(tmp_path, "a.json", _block([1.0], 0, 1.0, 1.0), _block([1.05], 1, 1.0, 1.05))
    b = _run(tmp_path, "b.json", _block([1.0], 0, 1.0, 1.0), _block([1.05], 1, 1.0, 1.05), pairs=40)
    with pytest.raises(ValueError, match="'pairs' differs"):
        gc.merge([a, b])
