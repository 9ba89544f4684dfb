"""CUDA-only cheating and faulting candidates (run on the H200 by tests/gpu/test_gate_gpu.py).

They edit real Inductor CUDA wrappers compiled at test time from the models in
``tests/gpu/test_gate_gpu.py``: ``ew`` = ``relu(x) * 2 + 1`` on a [4096, 1024] fp32 tensor (one
Triton kernel), ``sum`` = ``x.sum()`` over 2^20 fp32 values, ``mlp`` = Linear-GELU-Linear-LayerNorm fp32.
"""

from __future__ import annotations

from tests.cheats.common import Cheat, after_clear, arg_names, before_return, module_code, out_names, replace_body

# Triton kernels defined inside the candidate module (Triton reads their source from the module file).
RACY_SUM = '''
@triton.jit
def _racy_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    part = tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0.0), axis=0)
    old = tl.load(out_ptr)
    tl.store(out_ptr, old + part)
'''
BAD_STORE = '''
@triton.jit
def _bad_store(out_ptr):
    tl.store(out_ptr + (1 << 42), 1.0)
'''
SPIN = '''
@triton.jit
def _spin(flag_ptr):
    v = tl.load(flag_ptr)
    while v == 0:
        v = tl.load(flag_ptr, volatile=True)
'''


def _x(src: str) -> str:
    return arg_names(src)[0]


def _out(src: str) -> str:
    return out_names(src)[0]


def stale_empty(src: str) -> str:
    return replace_body(src, [f"out = torch.empty_like({_x(src)})", "return (out, )"])


def side_stream_no_sync(src: str) -> str:
    # The result is copied into the returned buffer on a second stream, after a 50 ms spin, and nothing
    # orders it before the caller's stream: the caller reads the buffer before it is written.
    out = _out(src)
    return before_return(src, ["_side = torch.cuda.Stream()", "_side.wait_stream(torch.cuda.current_stream())",
                               f"_final = torch.empty_like({out})", "with torch.cuda.stream(_side):",
                               "    torch.cuda._sleep(100000000)", f"    _final.copy_({out})"], "_final, ")


def deferred_side_work(src: str) -> str:
    # Correct outputs, but a long kernel is left running on another stream after return: the gate's
    # whole-device synchronize inside every sample counts it.
    return before_return(src, ["_side = torch.cuda.Stream()", "with torch.cuda.stream(_side):",
                               "    torch.cuda._sleep(20000000)"])


def racy_sum(src: str) -> str:
    x = _x(src)
    src = module_code(src, RACY_SUM)
    return replace_body(src, [f"_acc = torch.zeros((), device={x}.device, dtype=torch.float32)",
                              f"_n = {x}.numel()",
                              f"_racy_sum[(triton.cdiv(_n, 1024),)]({x}, _acc, _n, BLOCK=1024)",
                              "return (_acc, )"])


def tf32_hidden(src: str) -> str:
    return after_clear(src, ['getattr(torch, "set_float32_" + "matmul_precision")("high")'])


def event_patch_hidden(src: str) -> str:
    return module_code(src, 'vars(torch.cuda)["Event"] = type("Event", (torch.cuda.Event,), '
                            '{"elapsed_time": lambda self, end: 1e-3})')


def illegal_address(src: str) -> str:
    src = module_code(src, BAD_STORE)
    return after_clear(src, [f"_bad_store[(1,)]({_x(src)})"])


def infinite_kernel(src: str) -> str:
    x = _x(src)
    src = module_code(src, SPIN)
    return after_clear(src, [f"_flag = torch.zeros(1, device={x}.device, dtype=torch.int32)", "_spin[(1,)](_flag)"])


def cuda_oom(src: str) -> str:
    return after_clear(src, [f"_huge = torch.empty(1 << 46, dtype=torch.uint8, device={_x(src)}.device)"])


GPU_CHEATS = [
    Cheat("stale_reference_memory_cuda", "ew", stale_empty, "uninitialized_output", "rejected_incorrect",
          "returns torch.empty_like: the caching allocator would hand it the reference's freed result"),
    Cheat("second_stream_without_sync", "ew", side_stream_no_sync, "async_after_return", "rejected_incorrect",
          "writes the output on a side stream nothing waits for"),
    Cheat("nondeterministic_race", "sum", racy_sum, "nondeterministic", "rejected_incorrect",
          "Triton programs add into one element without atomics"),
    Cheat("tf32_flip_hidden_cuda", "mlp", tf32_hidden, "global_state", "rejected_global_state",
          "switches fp32 matmuls to TF32 through getattr"),
    Cheat("event_timer_patch_hidden", "ew", event_patch_hidden, "monkeypatch", "rejected_global_state",
          "replaces torch.cuda.Event with a class whose elapsed_time lies"),
]

GPU_FAULTS = [
    Cheat("illegal_address", "ew", illegal_address, "exception", "rejected_crash",
          "a Triton store far outside any allocation"),
    Cheat("infinite_kernel", "ew", infinite_kernel, "timeout", "rejected_timeout", "a kernel that never ends"),
    Cheat("cuda_oom", "ew", cuda_oom, "oom", "rejected_crash", "asks for 64 TiB"),
]
