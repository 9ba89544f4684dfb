"""The ``cudagraph`` generator's runtime, driven on CPU with a simulated CUDA graph.

``SimulatedGraphCall`` replaces the three CUDA-only steps of ``_TilesmithCUDAGraphCall`` (side-stream
warm-up, capture, replay) with their CPU meaning: "capture" runs the body once on the static inputs and
keeps its results; "replay" runs the body again on the same static inputs and copies every result into
the tensors kept at capture, which is exactly what a graph replay does to fixed addresses. Everything else
(input staging, pinning, promotion, re-capture, output plan, copy-back of written inputs) is the real code
the candidate embeds. The real CUDA path runs in ``tests/gpu/test_builtin_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fixture_paths import fixture
from tilesmith.agent.builtin.cudagraph import cudagraph_source



@pytest.fixture(scope="module", autouse=True)
def _fast_cpu_probe():
    from tilesmith import _compat

    getattr(_compat, "fast_cpu_isa_probe", lambda: None)()


def load(source: str):
    from torch._inductor.codecache import PyCodeCache

    key, path = PyCodeCache.write(source)
    return PyCodeCache.load_by_key_path(key, path, [], {})  # attrs={} → a fresh module every time


def simulate(module, *, fail_capture: bool = False):
    """Make the module's graph runtime simulate CUDA graphs on CPU (see the module docstring)."""
    base = module._TilesmithCUDAGraphCall

    def tensors(result):
        outs, staging = result
        return [t for t in outs if isinstance(t, torch.Tensor)] + ([staging] if staging is not None else [])

    class SimulatedGraphCall(base):
        def _warm_up(self, fn):
            return fn()

        def _record(self, fn):
            if fail_capture:
                raise RuntimeError("operation not permitted when stream is capturing")
            result = fn()
            return (fn, result), result

        def _replay_graph(self):
            fn, recorded = self._graph
            for old, new in zip(tensors(recorded), tensors(fn())):
                old.copy_(new)

    runtime = module._tilesmith_cudagraph
    runtime.__class__ = SimulatedGraphCall
    return runtime


def candidate_and_original(name: str, **kw):
    source = fixture(f"{name}.wrapper.py").read_text()
    original = load(source)
    candidate = load(cudagraph_source(source, allow_cpu=True))
    return original, candidate, simulate(candidate, **kw)


def same(a, b) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and torch.allclose(a, b, rtol=1e-6, atol=1e-6))


def fresh_like(tensors):
    return [torch.randn_like(t) if t.is_floating_point() else t.clone() for t in tensors]


@pytest.mark.parametrize("name", ["cpu_mlp_infer", "cpu_mlp_train_fwd", "cpu_mlp_train_bwd"])
def test_replayed_outputs_match_the_original_with_fresh_and_repeated_inputs(name):
    original, candidate, runtime = candidate_and_original(name)
    base = original.get_args()
    schedule = ["fresh", "fresh", "same", "same", "same", "same", "fresh", "same"]
    args = base
    for step in schedule:
        args = fresh_like(base) if step == "fresh" else args
        expected = original.call([t.clone() for t in args])
        passed = list(args)
        got = candidate.call(passed)
        assert passed == [], "call(args) must clear the list it receives"
        assert len(got) == len(expected)
        for k, (g, e) in enumerate(zip(got, expected)):
            assert same(g, e), (name, step, k)
    assert runtime.replays >= 6 and runtime.captures >= 1


def test_training_forward_returns_the_callers_input_objects_and_fresh_activations():
    original, candidate, runtime = candidate_and_original("cpu_mlp_train_fwd")
    args = original.get_args()
    first = candidate.call(list(args))
    held = [t.clone() for t in candidate.call(list(args))]
    out = candidate.call(list(args))  # a replay
    assert runtime.replays >= 1
    for position, index in ((1, 0), (2, 2), (3, 3), (4, 5)):  # primals_1/3/4/6 are returned as saved inputs
        assert out[position] is args[index]
    assert out[0].untyped_storage().data_ptr() not in {a.untyped_storage().data_ptr() for a in args}
    # a later replay with other activations must not overwrite what the caller already holds
    replayed = candidate.call(fresh_like(args))
    for k in (0, 5, 6, 7, 8, 9):
        assert torch.equal(out[k], held[k]) and not torch.equal(replayed[k], held[k])
    assert len(first) == 10


def test_backward_writes_the_reused_saved_activation_exactly_like_the_original():
    original, candidate, runtime = candidate_and_original("cpu_mlp_train_bwd")
    base = original.get_args()
    for _ in range(4):
        args = fresh_like(base)
        ref_args = [t.clone() for t in args]
        expected = original.call(list(ref_args))
        got = candidate.call(list(args))
        assert torch.equal(args[6], ref_args[6]), "addmm_1 is reused in place by the body"
        assert all(same(g, e) for g, e in zip(got, expected))
    assert runtime.written == frozenset({6}) and 6 in runtime.staged


HAND_WRITTEN = '''
import torch
assert_size_stride = torch._C._dynamo.guards.assert_size_stride
reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
_const = torch.arange(3.0)

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def call(self, args):
        arg0_1, arg1_1, arg2_1 = args
        args.clear()
        assert_size_stride(arg0_1, (4, 8), (8, 1))
        assert_size_stride(arg1_1, (8, ), (1, ))
        assert_size_stride(arg2_1, (4, 8), (8, 1))
        buf0 = torch.empty_strided((2, 4, 8), (32, 8, 1), dtype=torch.float32)
        torch.mul(arg0_1, arg1_1, out=reinterpret_tensor(buf0, (4, 8), (8, 1), 0))
        torch.add(arg0_1, arg1_1, out=reinterpret_tensor(buf0, (4, 8), (8, 1), 32))
        buf2 = arg2_1; del arg2_1  # reuse
        buf2.mul_(2.0)
        return (reinterpret_tensor(buf0, (4, 8), (8, 1), 0), reinterpret_tensor(buf0, (4, 8), (8, 1), 32),
                arg1_1, reinterpret_tensor(arg0_1, (8, 4), (1, 8), 0), _const, buf2, )

runner = Runner(partitions=[])
call = runner.call
'''


def hand_written(**kw):
    original = load(HAND_WRITTEN)
    candidate = load(cudagraph_source(HAND_WRITTEN, device="cpu", allow_cpu=True))
    return original, candidate, simulate(candidate, **kw)


def hand_args():
    return [torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)]


def test_output_plan_preserves_every_kind_of_aliasing_of_the_original():
    original, candidate, runtime = hand_written()
    weight = torch.randn(8)
    for step in range(5):
        args = [torch.randn(4, 8), weight, torch.randn(4, 8)]
        ref = [t.clone() for t in args]
        expected = original.call(list(ref))
        got = candidate.call(list(args))
        assert all(same(g, e) for g, e in zip(got, expected)), step
        assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()  # one buffer, two views
        assert got[1].storage_offset() - got[0].storage_offset() == 32
        assert got[2] is weight                                                          # returned input
        assert got[3].untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()  # view of an input
        assert got[4] is candidate._const                                                 # module constant
        assert got[5] is args[2] and torch.equal(args[2], ref[2])                         # reused input, written
        assert not got[0]._is_view() and not got[3]._is_view()
    assert runtime.captures == 1 and runtime.pinned == (1,)


def test_pinned_input_is_read_in_place_also_through_a_new_tensor_at_the_same_address():
    original, candidate, runtime = hand_written()
    x, weight = torch.randn(4, 8), torch.randn(8)
    held = []  # inputs 0 and 2 kept alive, so each call gets new addresses (a freed one could be reused and pinned)
    for _ in range(3):
        held += [x.clone(), torch.randn(4, 8)]
        candidate.call([held[-2], weight, held[-1]])
    assert runtime.pinned == (1,) and runtime.captures == 1
    weight.mul_(3.0)                    # e.g. an optimizer step, in place
    alias = weight.detach()             # a different tensor object at the same address
    assert alias is not weight and alias.data_ptr() == weight.data_ptr()
    got = candidate.call([x.clone(), alias, torch.randn(4, 8)])
    expected = original.call([x.clone(), alias.clone(), torch.randn(4, 8)])
    assert same(got[0], expected[0]) and same(got[1], expected[1])
    assert runtime.captures == 1 and got[2] is alias


def test_moved_pinned_input_recaptures_then_stable_inputs_are_promoted_then_all_staged_graph():
    original, candidate, runtime = hand_written()
    runtime.MAX_CAPTURES = 3
    weight = torch.randn(8)

    def check(args):
        expected = original.call([t.clone() for t in args])
        got = candidate.call(list(args))
        assert all(same(g, e) for g, e in zip(got[:5], expected[:5]))

    first = [torch.randn(4, 8), weight, torch.randn(4, 8)]  # kept alive: the second call's inputs 0 and 2 get new addresses
    check(first)
    check([torch.randn(4, 8), weight, torch.randn(4, 8)])
    assert runtime.captures == 1 and runtime.pinned == (1,)
    moved = weight.clone()
    check([torch.randn(4, 8), moved, torch.randn(4, 8)])  # the pinned address changed
    assert runtime.captures == 2 and 1 in runtime.staged and 1 in runtime._demoted
    x = torch.randn(4, 8)
    for _ in range(4):
        check([x, moved, torch.randn(4, 8)])                 # x keeps one address: promoted
    assert runtime.captures == 3 and 0 in runtime.pinned and 1 not in runtime.pinned
    replays = runtime.replays
    check([torch.randn(4, 8), moved, torch.randn(4, 8)])  # no captures left: one last graph staging everything
    assert runtime.captures == 4 and runtime.replays == replays + 1 and runtime.pinned == ()
    for _ in range(3):  # any addresses fit it: every later call replays, none re-captures or runs eagerly
        check([torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)])
    assert runtime.captures == 4 and runtime.replays == replays + 4


def test_failed_capture_raises_so_the_gate_rejects_the_candidate():
    original, candidate, runtime = hand_written(fail_capture=True)
    args = hand_args()
    expected = original.call([t.clone() for t in args])
    got = candidate.call(list(args))  # the first call runs the eager body (compiles kernels)
    assert all(same(g, e) for g, e in zip(got[:5], expected[:5]))
    with pytest.raises(RuntimeError):
        candidate.call(hand_args())  # the second call captures: the failure is not hidden
    assert runtime.replays == 0


def test_replay_checks_input_sizes_and_strides_like_the_original():
    _, candidate, _ = hand_written()
    for _ in range(2):
        candidate.call(hand_args())
    bad = hand_args()
    bad[0] = torch.randn(8, 4).t()
    with pytest.raises(AssertionError):
        candidate.call(bad)


def test_churning_addresses_then_stable_ones_end_on_a_pinned_graph():
    """The gate's protocol: correctness calls with fresh copies of every input, then timing calls whose inputs
    keep their addresses (refreshed in place). The runtime must end on a graph that reads them in place,
    not on a graph that copies every input (measured on the H200: 0.86x instead of 1.4x)."""
    original, candidate, runtime = hand_written()

    def check(args):
        expected = original.call([t.clone() for t in args])
        got = candidate.call(list(args))
        assert all(same(g, e) for g, e in zip(got[:5], expected[:5]))

    for _ in range(40):  # correctness: every input at a new address each call
        check([torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)])
    assert runtime.captures <= runtime.HARD_CAP
    stable = [torch.randn(4, 8), torch.randn(8)]
    for _ in range(runtime.REPROMOTE_AFTER + 4):  # timing: inputs 0 and 1 keep their addresses
        stable[0].copy_(torch.randn(4, 8))
        check([stable[0], stable[1], torch.randn(4, 8)])
    assert set(runtime.pinned) == {0, 1}, runtime.status
    assert runtime.staged == (2,)  # input 2 is written by the body: always staged and copied back
    replays = runtime.replays
    check([stable[0], stable[1], torch.randn(4, 8)])
    assert runtime.replays == replays + 1
