"""Timing integrity (red-team findings 2, 3 and 5): a candidate cannot tell spot-checked timed calls from
others, and cannot reuse results across the calls of a sample.

Two layers:

- In-process: the worker's timing handler (:func:`tilesmith.gate.worker.timing.run_timing`) runs in its own
  thread (so a frame walk from the candidate sees only worker frames, as in the real worker process) and
  the host driver (:func:`tilesmith.gate.host.timing.run_timing`) talks to it through queues; here one worker
  holds both arms (in the gate the original's arm is in the trusted worker). Candidates are plain Python
  callables; these tests do not depend on audit hooks or on timing.
- Real gate (CPU test mode): the red team's wrapper edits (tests/cheats/redteam_timing.py) are rejected.
"""

from __future__ import annotations

import queue
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.cheats import redteam_timing as rt
from tilesmith.gate.host import spots, stats, timing
from tilesmith.gate.host.reference import RefResult
from tilesmith.gate.host.timing import choose_k
from tilesmith.gate.inputs import call_values, distinct_capacity, fill_set, roll_finite_
from tilesmith.gate.worker.timing import run_timing
from tilesmith.gate.worker import outside

ROUNDS = 30
K = 4


def _reference(args: list[Any]) -> tuple[torch.Tensor]:
    w, x = args
    args.clear()
    return (torch.mm(x, w) + 1.0,)


class _ThreadWorker:
    """The worker side in a thread of this process, reached through ``request`` like a WorkerProcess."""

    def __init__(self, fns: dict[str, Any], pool: dict[str, list[Any]], expected: list[dict[str, Any]],
                 device: str = "cpu") -> None:
        self.fake = SimpleNamespace(device=torch.device(device), expected=expected,
                                    modules={n: SimpleNamespace(fn=f) for n, f in fns.items()},
                                    inputs=lambda path: pool[path])
        self.pid, self.role, self.label, self.stopped = 0, "candidate", "thread worker", False
        # The real worker's baseline (core._take_baselines): processes already in the session (this pytest's, when
        # it shares a terminal session with other jobs) are not ones a candidate started.
        self.fake.base_processes = outside.session_processes()
        # The host's side shares this process: its first sequential look (the bootstrap in stats.decide) starts a
        # thread, which the worker side would count as the candidate's (a real worker is another process). Start it
        # now, before the run's baseline, so this file passes alone as well as after other tests.
        stats.decide([1.0] * 10, [1.0] * 10, 30, 0.02, seed=0)
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            msg = self.inbox.get()
            if msg is None:
                return
            try:
                answer = run_timing(self.fake, msg)
            except Exception as exc:  # noqa: BLE001 - reported like the real worker does
                answer = {"ok": False, "error": {"type": type(exc).__name__, "message": str(exc)}}
            self.outbox.put(answer)

    def request(self, op: str, timeout_s: float, what: str, **fields: Any) -> dict[str, Any]:
        self.inbox.put({"op": op, **fields})
        return self.outbox.get(timeout=120)

    def alive(self) -> bool:
        return True

    def stop(self) -> bool:
        return True

    def resume(self) -> None:
        pass

    def close(self) -> None:
        self.inbox.put(None)
        self.thread.join(timeout=30)


class _Ref:
    """The trusted reference, in-process: rebuilds a timed call's inputs from the pool entry's values."""

    def __init__(self, pool: dict[str, list[Any]]) -> None:
        self.pool = pool

    def submit(self, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return runs

    def collect(self, runs: list[dict[str, Any]], what: str = "") -> list[RefResult]:
        out = []
        for run in runs:
            t = run["timing"]
            values = call_values(self.pool[t["pool"]], t["factors"], t["shift"], t["call"], t.get("static", ()))
            out.append(RefResult(list(_reference([v.clone() for v in values])), []))
        return out


def _pool_values() -> list[list[torch.Tensor]]:
    """Two input sets ``[w (16×16, the 'parameter'), x (8×16, the activation)]``, deterministic."""
    gen = torch.Generator().manual_seed(0)
    return [[torch.randn(16, 16, generator=gen), torch.randn(8, 16, generator=gen)] for _ in range(2)]


def _evaluate(cand: Any, tmp_path: Path, k: int = K, rounds: int = ROUNDS, static: tuple[int, ...] = (),
              device: str = "cpu", sequential: bool = False, worker_cls: type | None = None,
              workers: list[Any] | None = None) -> tuple[dict[str, Any], timing.Schedule, list[Any]]:
    """One timing run of ``cand`` against the reference; returns (answer, schedule, spot failures).
    ``static``: inputs kept in one buffer across the calls of a sample (as ``GateProblem.static_input_idxs``);
    ``worker_cls``: the worker (default :class:`_ThreadWorker`), appended to ``workers`` when given."""
    pool_values = _pool_values()
    pool = {f"pool{i}": v for i, v in enumerate(pool_values)}
    expected = [{"kind": "tensor", "shape": [8, 16], "dtype": "torch.float32", "nbytes": 8 * 16 * 4}]
    worker = (worker_cls or _ThreadWorker)({"orig": _reference, "cand": cand}, pool, expected, device)
    if workers is not None:
        workers.append(worker)
    try:
        sched = timing.make_schedule(["orig", "cand"], pool_values, rounds, seed=1, static=static)
        run = timing.TimingRun(holders={"orig": worker, "cand": worker}, untrusted=[], pool=list(pool),
                               target_ms=0.01, max_sample_ms=50.0, flush=1024, expected=expected,
                               start_timeout_s=60, sample_timeout_s=60, spot_dir=tmp_path, warmup_ms=0.0,
                               calls_per_sample=k, sequential=sequential)
        answer = timing.run_timing(run, sched)
    finally:
        worker.close()
    assert answer["ok"], answer
    ref_expected = RefResult(list(_reference([v.clone() for v in pool_values[0]])), [])
    fails = spots.spot_failures(answer, sched, list(pool), _Ref(pool), ref_expected, tf32=False, uses_rng=False)
    return answer, sched, fails


@pytest.fixture
def many_spots(monkeypatch):
    """Every candidate round is spot-checked (one call each, chosen after the sample): a cheat on a fixed
    fraction ≥ 1/K of the calls is caught with probability ≥ 1 - (1 - 1/K)^ROUNDS ≈ 1 - 2e-4."""
    monkeypatch.setattr(timing, "SPOT_CHECKS", ROUNDS)


def test_honest_candidate_passes_spot_checks_on_calls_chosen_after_each_sample(tmp_path, many_spots):
    answer, sched, fails = _evaluate(_reference, tmp_path)
    assert fails == []
    assert answer["calls_per_sample"] == K
    assert len(sched.picks) == ROUNDS  # every candidate round; the trusted original's arm is not spot-checked
    keys = [k for spot in answer["spots"].values() for k in spot["keys"]]
    assert sorted(keys) == sorted(list(p) for p in sched.picks)
    assert all(0 <= c < K for _, _, c in sched.picks)


class _Recording(_ThreadWorker):
    """A thread worker that records the phase (and the copies) of every timing request it gets."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, tuple[int, ...]]] = []

    def request(self, op: str, timeout_s: float, what: str, **fields: Any) -> dict[str, Any]:
        self.log.append((str(fields.get("phase")), tuple(fields.get("copy") or ())))
        return super().request(op, timeout_s, what, **fields)


@pytest.mark.parametrize("sequential", [False, True])
def test_every_sample_is_followed_by_its_release_and_copies_never_precede_a_sample(tmp_path, monkeypatch,
                                                                                    sequential):
    """A spot-check copy runs in the release right after the sample it checks, and *every* sample gets a
    release, picked or not: the steps a process goes through between two of its samples do not depend on which
    arm was picked (the copies used to run at the start of the worker's next sample). With the sequential
    test, the candidate's sample of a deciding round is kept until the look, and when the run stops there it is
    the always-checked last sample, copied by ``finish``."""
    monkeypatch.setattr(timing, "SPOT_CHECKS", 6)
    seen: list[Any] = []
    answer, sched, fails = _evaluate(_reference, tmp_path, sequential=sequential, worker_cls=_Recording, workers=seen)
    worker = seen[0]
    assert fails == []
    phases = [phase for phase, _ in worker.log]
    assert phases[:2] == ["prepare", "sets"] and phases[-1] == "finish"
    body = worker.log[2:-1]
    assert all(copy == () for phase, copy in body if phase == "sample")
    samples = [i for i, (phase, _) in enumerate(body) if phase == "sample"]
    assert len(samples) == 2 * answer["rounds_run"]
    # Each sample is released right after it, before anything else; only the last may wait for ``finish``.
    for i in samples[:-1]:
        assert body[i + 1][0] == "release", body[i:i + 2]
    assert samples[-1] == len(body) - 1 or body[samples[-1] + 1][0] == "release"
    copies = [c for phase, copy in body if phase == "release" for c in copy] + list(worker.log[-1][1])
    assert len(copies) == len(sched.picks) >= 2
    keys = [k for spot in answer["spots"].values() for k in spot["keys"]]
    assert sorted(keys) == sorted(list(p) for p in sched.picks)
    cand = sched.arms.index("cand")
    last_cand = max((r, i) for i, (r, a) in enumerate(
        [(r, a) for r in range(answer["rounds_run"]) for a in sched.rounds[r]["order"]]) if a == cand)[0]
    assert (last_cand, cand) in {(r, a) for r, a, _ in sched.picks}, "the last candidate sample was not checked"


def test_every_output_of_a_sample_stays_alive_until_the_sample_ends(tmp_path, many_spots):
    """What a candidate sees of its earlier outputs (alive or not, storage use count) depends only on the
    call's position in its sample, never on whether the host later checks that call (finding 2)."""
    seen: list[tuple[int, int]] = []
    alive: list[weakref.ref] = []

    def cand(args: list[Any]) -> tuple[torch.Tensor]:
        live = [r() for r in alive if r() is not None]
        count = torch._C._storage_Use_Count(live[-1].untyped_storage()._cdata) if live else 0
        seen.append((len(live), int(count)))
        del live
        out = _reference(args)
        alive.append(weakref.ref(out[0]))
        return out

    _, sched, fails = _evaluate(cand, tmp_path)
    assert fails == []
    timed = seen[-ROUNDS * K:]  # the warm-up calls come first
    for s in range(ROUNDS):
        sample = timed[s * K:(s + 1) * K]
        assert [n for n, _ in sample] == list(range(K)), "earlier outputs of the same sample were released"
        assert sample == timed[:K], f"sample {s} looked different to the candidate"


def test_refcount_spot_cheat_is_rejected(tmp_path, many_spots):
    """Finding 2: honest only while the caller holds the previous output (then only in checked samples)."""
    prev: list[torch.Tensor] = []

    def cand(args: list[Any]) -> tuple[torch.Tensor]:
        if not (prev and torch._C._storage_Use_Count(prev[0].untyped_storage()._cdata) > 2):
            args.clear()
            out = torch.empty(8, 16)
            prev[:] = [torch.empty(0).set_(out.untyped_storage())]
            return (out,)
        out = _reference(args)[0]
        prev[:] = [torch.empty(0).set_(out.untyped_storage())]
        return (out,)

    _, _, fails = _evaluate(cand, tmp_path)
    assert fails and fails[0].check == "timing_output_mismatch"


def test_frame_walking_finds_no_spot_choice_and_the_cheat_is_rejected(tmp_path, many_spots):
    """Finding 3: the red team's frame walk (a ``keep`` local, or a list of spots/picks) finds nothing that
    marks a timed call as checked, so a candidate that computes only when marked is wrong on every call."""
    namespace: dict[str, Any] = {"torch": torch}
    exec(rt._FRAME_WALK, namespace)  # noqa: S102 - the red team's walker, verbatim
    marks: list[Any] = []

    def cand(args: list[Any]) -> tuple[torch.Tensor]:
        marks.append(namespace["_checked"]())
        if not marks[-1]:
            args.clear()
            return (torch.empty(8, 16),)
        return _reference(args)

    _, _, fails = _evaluate(cand, tmp_path)
    assert set(marks) == {None}
    assert fails and fails[0].check == "timing_output_mismatch"


def test_frames_look_the_same_for_every_timed_call(tmp_path, many_spots):
    """The worker frames above a timed call (functions and their local names) are identical for every
    timed call, checked or not."""
    import sys

    views: list[tuple[Any, ...]] = []

    def cand(args: list[Any]) -> tuple[torch.Tensor]:
        f, view = sys._getframe(1), []
        while f is not None:
            view.append((f.f_code.co_name, tuple(sorted(f.f_locals))))
            f = f.f_back
        views.append(tuple(view))
        return _reference(args)

    _evaluate(cand, tmp_path)
    assert len(set(views[-ROUNDS * K:])) == 1


@pytest.mark.parametrize("static", [(), (0,)], ids=["all_distinct", "weight_static"])
def test_memo_across_the_calls_of_a_sample_never_hits(tmp_path, many_spots, static):
    """Finding 5: every call of a sample reads a different input set (bit-exact keys and keys from a few
    sampled values both miss), and no sample repeats an earlier sample's sets; also when the weight is a
    static input shared by the calls (the activation still differs per call)."""
    hits: list[tuple[bool, bool]] = []
    last: list[list[torch.Tensor]] = []
    keys: set[tuple[Any, ...]] = set()

    def cand(args: list[Any]) -> tuple[torch.Tensor]:
        exact = bool(last) and all(torch.equal(a, b) for a, b in zip(args, last[0]))
        key = tuple(tuple(a.reshape(-1)[:: max(1, a.numel() // 4)].tolist()) for a in args)
        hits.append((exact, key in keys))
        keys.add(key)
        last[:] = [[a.clone() for a in args]]
        return _reference(args)

    answer, _, fails = _evaluate(cand, tmp_path, static=static)
    assert fails == []
    assert answer["calls_per_sample"] == K and answer["static_inputs"] == list(static)
    timed = hits[-ROUNDS * K:]  # the warm-up calls (outside the samples) read one fixed set
    assert len(timed) == ROUNDS * K and not any(e or s for e, s in timed)


_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", _DEVICES)
def test_static_input_has_one_address_per_sample_others_k_and_the_host_rebuilds_every_call(tmp_path, many_spots,
                                                                                         device):
    """Parameters keep one buffer across the k calls of a sample (as in real use), activations get k
    buffers; every timed call's inputs, shared static ones included, are rebuilt by the host bit for bit."""
    calls: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []

    def cand(args: list[Any]) -> tuple[torch.Tensor]:
        w, x = args
        calls.append((w.data_ptr(), x.data_ptr(), w.cpu().clone(), x.cpu().clone()))
        return _reference(args)

    answer, sched, fails = _evaluate(cand, tmp_path, static=(0,), device=device)
    assert fails == [] and answer["calls_per_sample"] == K and sched.static == (0,)
    timed = calls[-ROUNDS * K:]  # the candidate's sample of round r holds its calls r·K … r·K + K − 1
    pool_values = _pool_values()
    for r, rnd in enumerate(sched.rounds):
        sample = timed[r * K:(r + 1) * K]
        assert len({w_ptr for w_ptr, _, _, _ in sample}) == 1, f"round {r}: the static input moved"
        assert len({x_ptr for _, x_ptr, _, _ in sample}) == K, f"round {r}: activations share a buffer"
        assert sample[0][0] not in {x_ptr for _, x_ptr, _, _ in sample}
        for c, (_, _, w, x) in enumerate(sample):
            host = call_values(pool_values[rnd["set"]], rnd["factors"], rnd["shift"], c, static=sched.static)
            assert torch.equal(host[0].view(torch.int32), w.view(torch.int32)), f"round {r}, call {c}: weight"
            assert torch.equal(host[1].view(torch.int32), x.view(torch.int32)), f"round {r}, call {c}: activation"
        assert not torch.equal(sample[0][3], sample[1][3])  # activations differ within the sample
    assert len({w_ptr for w_ptr, _, _, _ in timed}) == 1  # one buffer for the whole run, refreshed in place
    assert not torch.equal(timed[0][2], timed[-1][2])  # ... with values refreshed between samples


def test_memo_keyed_on_a_static_input_returns_stale_outputs_and_is_rejected(tmp_path, many_spots):
    """A cache keyed only on the (static) weight's address and values hits within a sample, but the
    activation differs on every call, so the hits are wrong results and the spot checks reject them."""
    memo: dict[tuple[Any, ...], torch.Tensor] = {}
    hits: list[bool] = []

    def cand(args: list[Any]) -> tuple[torch.Tensor]:
        w = args[0]
        key = (w.data_ptr(), tuple(w.reshape(-1)[:8].tolist()))
        hits.append(key in memo)
        if key in memo:
            args.clear()
            return (memo[key].clone(),)
        out = _reference(args)
        memo[key] = out[0].clone()
        return out

    _, _, fails = _evaluate(cand, tmp_path, static=(0,))
    timed = hits[-ROUNDS * K:]
    assert sum(timed) == ROUNDS * (K - 1)  # every call after the first of each sample: one weight, one address
    assert fails and fails[0].check == "timing_output_mismatch"


def test_graph_whose_only_floating_inputs_are_static_gets_one_call_per_sample(tmp_path, many_spots):
    """No non-static floating input varies: k calls would read identical inputs, so k falls back to 1."""
    seen: list[tuple[int, int]] = []

    def cand(args: list[Any]) -> tuple[torch.Tensor]:
        seen.append((args[0].data_ptr(), args[1].data_ptr()))
        return _reference(args)

    answer, sched, fails = _evaluate(cand, tmp_path, static=(0, 1))
    assert fails == []
    assert answer["calls_per_sample"] == 1 and answer["k_limits"]["by_distinct"] == 1
    assert distinct_capacity(_pool_values()[0], static=(0, 1)) == 1
    assert distinct_capacity(_pool_values()[0], static=(0,)) == 8 * 16


def test_fill_set_matches_the_host_rebuild_bit_for_bit_and_keeps_non_finite_positions():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 7, generator=gen)
    x[1, 2], x[4, 0] = float("-inf"), float("nan")
    strided = torch.randn(5, 9, generator=gen)[:, ::2]  # gaps in the storage
    idx = torch.randint(0, 5, (4,), generator=gen)
    source = [x, strided, idx, 3]
    target = [torch.empty_like(x), torch.as_strided(torch.empty(45), strided.shape, strided.stride()),
              torch.empty_like(idx), 3]
    fill_set(target, source, [2.0, -1.0, 1.0, 1.0], 5)
    host = call_values(source, [2.0, -1.0, 1.0, 1.0], 5, 0)
    for got, exp in zip(target[:3], host[:3]):
        torch.testing.assert_close(got, exp, rtol=0, atol=0, equal_nan=True)
    assert torch.isneginf(target[0][1, 2]) and torch.isnan(target[0][4, 0])
    assert torch.equal(target[2], idx)  # integer inputs are never changed
    assert not torch.equal(torch.nan_to_num(target[0]), torch.nan_to_num(x * 2))  # rolled


def test_roll_finite_keeps_the_multiset_of_values_and_is_exact_for_half_precision():
    x = torch.randn(100).to(torch.float16)
    y = x.clone()
    roll_finite_(y, 17)
    assert torch.equal(y.sort().values, x.sort().values)
    assert torch.equal(y, torch.roll(x, 17))


def test_k_is_capped_by_memory_and_by_the_number_of_distinct_input_sets():
    k, limits = choose_k([0.01, 0.02], target_ms=1.0, max_sample_ms=50.0, set_bytes=1000, out_bytes=1000,
                         budget_bytes=10_000, distinct=1000)
    assert (k, limits["by_time"], limits["by_memory"]) == (5, 100, 5)
    k, _ = choose_k([0.01], target_ms=1.0, max_sample_ms=50.0, set_bytes=10, out_bytes=10,
                    budget_bytes=1 << 30, distinct=distinct_capacity([torch.ones(50), torch.arange(9)]))
    assert k == 1  # only constant floats and integers: every set would be the same
    assert distinct_capacity([torch.randn(7), torch.arange(100)]) == 7


# --- the real gate (CPU test mode): the red team's wrapper edits --------------------------------------------

@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    from tests import gate_support as gs
    from tilesmith.gate import Gate

    torch.manual_seed(0)
    cap = gs.capture(gs.LinearLN(), torch.randn(32, 64))[0]
    root = tmp_path_factory.mktemp("timing-gate")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILESMITH_ALLOW_CPU", "1")
        mp.setenv("TILESMITH_GATE_RUN_TIMEOUT_S", "60")
        mp.setattr(timing, "SPOT_CHECKS", 8)
        # The static scan (and, where present, audit hooks) also reject these; switch the scan off so the
        # timing layer itself is what these tests check.
        mp.setattr("tilesmith.gate.host.gate.scan", lambda source: [])
        g = Gate(gs.make_problem(cap, root / "snapshot", label="c0ffee00 (timing)"), reference=cap.ref_fn,
                 profiles_dir=root / "profiles", timing_pairs=8)
        yield g, cap
        g.close()


#: Audit hooks (when present) may reject introspection before timing does; either is a right answer.
_TIMING_OR_AUDIT = {"timing_output_mismatch"}


@pytest.mark.parametrize("make", [rt.refcount_spot, rt.frame_spot], ids=["refcount_spot", "frame_spot"])
def test_real_gate_rejects_spot_aware_candidates(gate, make):
    from tilesmith.records import Candidate

    g, cap = gate
    verdict = g.evaluate(Candidate(source=make(cap.source), proposer=f"redteam:{make.__name__}"))
    assert not verdict.accepted
    checks = {f.check for f in verdict.failures}
    if not checks:  # every output is held, so the cheat believes every call is checked and computes honestly:
        assert verdict.status in {"rejected_slower", "rejected_marginal"}, verdict.reasons  # no fake gain left
        return
    # refcount_spot keeps a tensor on the output's storage to read its refcount: output_retained since R1
    assert checks & (_TIMING_OR_AUDIT | {"output_retained"}) or any(c.startswith("audit_") for c in checks), \
        verdict.reasons


@pytest.mark.parametrize("make", [rt.memo_exact, rt.memo_sparse], ids=["memo_exact", "memo_sparse"])
def test_real_gate_memo_candidates_gain_nothing(gate, make):
    """With distinct input sets per call the memo never hits: the candidate is honest and slower (or, if a
    sampled key ever collides, wrong); it is never accepted."""
    from tilesmith.records import Candidate

    g, cap = gate
    verdict = g.evaluate(Candidate(source=make(cap.source), proposer=f"redteam:{make.__name__}"))
    assert not verdict.accepted, verdict.reasons


def test_spot_checks_of_big_outputs_fit_the_byte_budget_and_the_workers_file_limit():
    rounds = 30
    looks = stats.looks(rounds)
    assert timing.spot_count(0, rounds) == timing.SPOT_CHECKS == timing.spot_count(1 << 20, rounds)
    big = 128 << 20  # one 8192×8192 bf16 output: its spot file overran the old limit (8× outputs) on the H200
    assert (timing.spot_count(big, rounds) + 1) * big <= timing.SPOT_BYTES
    n = timing.spot_count(400 << 20, rounds)
    assert len(looks) <= n < timing.SPOT_CHECKS and (n + 1) * (400 << 20) <= timing.SPOT_BYTES
    assert timing.spot_count(4 << 30, rounds) == len(looks)  # never fewer than one per look block
    for nbytes in (big, 1 << 30):
        sched = timing.make_schedule(["orig", "cand"], _pool_values(), rounds, seed=3, output_bytes=nbytes)
        cand = [r for r, a in sched.spots if a == 1]
        assert all(any(lo <= r < hi for r in cand) for lo, hi in zip([0, *looks[:-1]], looks)), cand
        written = (len(sched.spots) + 1) * nbytes  # + the last sample the host adds
        assert written + (16 << 20) <= timing.spot_file_limit(nbytes)
