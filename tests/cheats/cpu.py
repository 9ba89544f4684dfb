"""CPU cheating candidates, each a text edit of a real Inductor CPU wrapper captured in test mode.

Graphs (see tests/gate_support.py): ``ln`` = LinearLN inference (inputs: weight, bias, x[32, 64],
ln weight, ln bias; one output [32, 64]); ``train`` = the same model's training forward (returns the
LayerNorm output plus saved activations, some of which are its own inputs); ``log`` = LogScale
inference (NaN wherever x < 0).

Cheats whose plain form the static scan already rejects also appear in an obfuscated form (names built
from strings, reached through ``getattr``/``vars``). The hardened scan refuses those too
(``static_dynamic_access``); their tests switch the scan off (``gate_support.runtime_checks_only``) so the
runtime checks keep a regression test of their own.
"""

from __future__ import annotations

import re

from tests.cheats.common import Cheat, after_clear, arg_names, before_return, module_code, out_names, replace_body


def _x(src: str) -> str:
    """The activation input ([32, 64] in LinearLN/LogScale): the third argument of the LN graph."""
    names = arg_names(src)
    return names[2] if len(names) > 2 else names[0]


def _out(src: str) -> str:
    return out_names(src)[0]


def stale_empty(src: str) -> str:
    # KernelBench PR #82 / Sakana: skip the work, return torch.empty and hope it holds the reference's
    # freed result.
    return replace_body(src, [f"out = torch.empty_like({_x(src)})", "return (out, )"])


def uninitialized(src: str) -> str:
    return replace_body(src, ["buf99 = empty_strided_cpu((32, 64), (64, 1), torch.float32)", "return (buf99, )"])


def partial_write(src: str) -> str:
    out = _out(src)
    return before_return(src, ["buf99 = empty_strided_cpu((32, 64), (64, 1), torch.float32)",
                               f"buf99[:16].copy_({out}[:16])"], "buf99, ")


def oob_write(src: str) -> str:
    # The fused C++ kernel's row loop runs one row past the end (32 → 33 rows).
    new = re.sub(r"x0<static_cast<int64_t>\(32L\)", "x0<static_cast<int64_t>(33L)", src)
    assert new != src, "row loop bound not found"
    return new


def cache_by_pointer(src: str) -> str:
    x, out = _x(src), _out(src)
    src = module_code(src, "_RESULTS = {}")
    src = after_clear(src, [f"_key = {x}.data_ptr()", "if _key in _RESULTS:",
                            "    return (_RESULTS[_key].clone(), )"])
    return before_return(src, [f"_RESULTS[_key] = {out}.clone()"])


def cache_by_shape(src: str) -> str:
    x, out = _x(src), _out(src)
    src = module_code(src, "_RESULTS = {}")
    src = after_clear(src, [f"_key = tuple({x}.shape)", "if _key in _RESULTS:",
                            "    return (_RESULTS[_key].clone(), )"])
    return before_return(src, [f"_RESULTS[_key] = {out}.clone()"])


def skip_when_zero(src: str) -> str:
    return after_clear(src, [f"if not bool({_x(src)}.any()):", "    return (torch.zeros((32, 64)), )"])


def lower_precision(src: str) -> str:
    # Round the matmul result through bfloat16 (a precision downgrade of the extern addmm).
    match = re.search(r"^([ \t]*)extern_kernels\.addmm\(.*out=(buf\d+)\)[ \t]*$", src, re.M)
    assert match, "addmm line not found"
    indent, buf = match.group(1), match.group(2)
    line = f"\n{indent}{buf}.copy_({buf}.to(torch.bfloat16))"
    return src[: match.end()] + line + src[match.end():]


def mutate_input(src: str) -> str:
    # Keep a reference: the wrapper `del`s its argument names after their last use.
    src = after_clear(src, [f"_x_in = {_x(src)}"])
    return before_return(src, ["_x_in.zero_()"])


def wrong_strides(src: str) -> str:
    return before_return(src, [], f"{_out(src)}.t().contiguous().t(), ")


def alias_input(src: str) -> str:
    x, out = _x(src), _out(src)
    src = after_clear(src, [f"_x_in = {x}"])
    return before_return(src, [f"_x_in.copy_({out})"], "_x_in, ")


def alias_clone(src: str) -> str:
    # Training forward: the original returns some inputs themselves as saved activations; return copies.
    outs = out_names(src)
    args = set(arg_names(src))
    new = [f"{o}.clone()" if o in args else o for o in outs]
    assert new != outs, "no returned input in this graph"
    return before_return(src, [], ", ".join(new) + ", ")


def nan_mask(src: str) -> str:
    return before_return(src, [f"torch.nan_to_num_({_out(src)}, nan=0.0)"])


def try_except_fallback(src: str) -> str:
    out = _out(src)
    return before_return(src, ["try:", f"    _fast = {out}.mul(1.0)", "except Exception:", f"    _fast = {out}"],
                         "_fast, ")


def tf32_static(src: str) -> str:
    return module_code(src, "torch.backends.cuda.matmul.allow_tf32 = True")


def tf32_runtime(src: str) -> str:
    return after_clear(src, ['getattr(torch, "set_float32_" + "matmul_precision")("medium")'])


def rng_static(src: str) -> str:
    return after_clear(src, ["torch.manual_seed(0)"])


def rng_runtime(src: str) -> str:
    return after_clear(src, ['getattr(torch, "manual" + "_seed")(1234)'])


def tensor_subclass(src: str) -> str:
    src = module_code(src, "class _LazyTensor(torch.Tensor):\n    pass")
    return before_return(src, [], f"{_out(src)}.as_subclass(_LazyTensor), ")


def expanded_view(src: str) -> str:
    return before_return(src, [], f"{_out(src)}[:1].expand(32, 64), ")


def thread_static(src: str) -> str:
    src = src.replace("import torch\n", "import torch\nimport threading\n", 1)
    return before_return(src, [f"threading.Thread(target={_out(src)}.add_, args=(0,)).start()"])


def thread_runtime(src: str) -> str:
    out = _out(src)
    # Modules reached as attributes and only functions bound: the import guard (docs/gate.md, "Imports") refuses
    # ``import time``, and a module bound as a global; this cheat exercises the runtime check behind it.
    src = module_code(src, '_Thread = getattr(torch.cuda, "thre" + "ading").Thread\n'
                           '_sleep = torch._inductor.utils.time.sleep')
    return before_return(src, [f"_t = _Thread(target=lambda o={out}: (_sleep(1.5), o.add_(1.0)), "
                               f"daemon=True)", "_t.start()"])


def timer_static(src: str) -> str:
    return module_code(src, "import time\ntime.perf_counter_ns = lambda: 0")


def timer_runtime(src: str) -> str:
    # ``time`` reached as an attribute (the import guard refuses ``import time``): the identity check must catch it.
    return module_code(src, 'vars(torch._inductor.utils.time)["perf_counter_" + "ns"] = lambda: 0')


def static_output_buffer(src: str) -> str:
    out = _out(src)
    src = module_code(src, "_STATIC = []")
    return before_return(src, ["if not _STATIC:", f"    _STATIC.append({out}.clone())", "else:",
                               f"    _STATIC[0].copy_({out})"], "_STATIC[0], ")


def drift_after_checks(src: str) -> str:
    # llm.c PR #852: correct for the first calls (the correctness checks make ~22), wrong later (the timed calls).
    out = _out(src)
    src = module_code(src, "_CALLS = [0]")
    return before_return(src, ["_CALLS[0] += 1", "if _CALLS[0] > 40:", f"    {out}.mul_(1.01)"])


def exec_static(src: str) -> str:
    return after_clear(src, ['exec("pass")'])


def harness_patch(src: str) -> str:
    # Reach the worker's own module through a re-export of sys and replace one of its functions.
    return module_code(src, '_s = getattr(torch, "s" + "ys")\n'
                            'vars(_s.modules["tilesmith.gate.worker.core"])["describe"] = lambda exc: {}')


def baseline_sabotage(src: str) -> str:
    # Find the original wrapper's module in the same worker and slow its kernels down (a fake speedup).
    return module_code(src, """_CHEAT_MARK = True
import time as _t
_s = getattr(torch, "s" + "ys")
for _n, _m in list(_s.modules.items()):
    if _n.startswith("torch._inductor.runtime.compile_tasks.") and not hasattr(_m, "_CHEAT_MARK"):
        for _k, _v in list(vars(_m).items()):
            if _k.startswith("cpp_fused"):
                vars(_m)[_k] = (lambda f: (lambda *a: (_t.sleep(0.002), f(*a))[1]))(_v)""")


def native_thread_at_import(src: str) -> str:
    # Red team (issue 15, "contention"): a thread started through the low-level module, invisible to
    # threading.enumerate, that would burn CPU while the original's samples run. Only the OS sees it.
    # ``_thread.start_new_thread`` reached as threading's private alias, only functions bound (the import guard
    # refuses ``import _thread``; docs/gate.md, "Imports").
    return module_code(src, '_start = getattr(torch.cuda.threading, "_start_" + "new_thread")\n'
                            "_sleep = torch._inductor.utils.time.sleep\n"
                            "_start(lambda: [_sleep(0.0005) for _ in iter(int, 1)], ())")


def native_thread_at_first_call(src: str) -> str:
    # The same, started lazily from the first call (after the import's checks), through a re-export.
    # Only the function is bound (the import guard refuses ``__import__("_thread")`` and a module global).
    src = module_code(src, '_LOW_START = getattr(getattr(torch.cuda, "thre" + "ading"), "_start_" + "new_thread")\n'
                           '_STARTED = []')
    return after_clear(src, ["if not _STARTED:", "    _STARTED.append(_LOW_START(lambda: [None for _ in iter(int, 1)], ()))"])


CHEATS = [
    # When the allocator hands back the reference's freed block the values are right and only the poisoned run tells;
    # when it does not (seen once, the 2-core machine under a second test run), the values are wrong at once.
    Cheat("stale_reference_memory", "ln", stale_empty, "uninitialized_output|value_mismatch", "rejected_incorrect",
          "returns torch.empty_like without computing (reference's freed memory)"),
    Cheat("uninitialized_output", "ln", uninitialized, "uninitialized_output", "rejected_incorrect",
          "returns a wrapper-allocated buffer nothing writes"),
    Cheat("partial_write", "ln", partial_write, "uninitialized_output", "rejected_incorrect",
          "writes only the first half of the output rows"),
    Cheat("write_past_end", "ln", oob_write, "out_of_bounds_write", "rejected_incorrect",
          "C++ kernel loop runs one row past the buffers' end"),
    Cheat("cache_by_pointer", "ln", cache_by_pointer, "stale_result", "rejected_incorrect",
          "returns a cached result keyed on the input's data_ptr"),
    Cheat("cache_by_shape", "ln", cache_by_shape, "stale_result", "rejected_incorrect",
          "returns a cached result keyed on the input's shape"),
    Cheat("skip_work_on_zero", "ln", skip_when_zero, "value_mismatch", "rejected_incorrect",
          "returns zeros when the activation is all zero"),
    Cheat("lower_precision", "ln", lower_precision, "precision_loss", "rejected_incorrect",
          "rounds the fp32 matmul through bfloat16"),
    Cheat("mutates_input", "ln", mutate_input, "input_mutated", "rejected_incorrect",
          "zeroes its activation input after use"),
    Cheat("wrong_strides", "ln", wrong_strides, "stride_mismatch", "rejected_incorrect",
          "returns a column-major output"),
    Cheat("output_aliases_input", "ln", alias_input, "alias_mismatch", "rejected_incorrect",
          "writes the result into an input and returns that input"),
    Cheat("saved_input_cloned", "train", alias_clone, "alias_mismatch", "rejected_incorrect",
          "returns copies where the training forward returns its inputs"),
    Cheat("nan_masking", "log", nan_mask, "nan_inf_mismatch", "rejected_incorrect",
          "replaces NaN by 0 in the output"),
    Cheat("try_except_fallback", "ln", try_except_fallback, "static_try_except", "rejected_static",
          "wraps a fast path in a broad try/except"),
    Cheat("tf32_flip_plain", "ln", tf32_static, "static_global_state", "rejected_static",
          "sets torch.backends.cuda.matmul.allow_tf32"),
    Cheat("tf32_flip_hidden", "ln", tf32_runtime, "global_state", "rejected_global_state",
          "calls set_float32_matmul_precision through getattr"),
    Cheat("rng_reseed_plain", "ln", rng_static, "static_global_state", "rejected_static",
          "calls torch.manual_seed"),
    Cheat("rng_reseed_hidden", "ln", rng_runtime, "rng_state", "rejected_global_state",
          "reseeds through getattr"),
    Cheat("tensor_subclass", "ln", tensor_subclass, "output_type", "rejected_incorrect",
          "returns a torch.Tensor subclass"),
    Cheat("lazy_expanded_view", "ln", expanded_view, "stride_mismatch", "rejected_incorrect",
          "returns a broadcast view instead of a materialized output"),
    Cheat("background_thread_plain", "ln", thread_static, "static_concurrency", "rejected_static",
          "imports threading"),
    Cheat("background_thread_hidden", "ln", thread_runtime, "background_thread", "rejected_global_state",
          "starts a thread (reached via torch.cuda's re-export) that writes the output later"),
    Cheat("timer_patch_plain", "ln", timer_static, "static_monkeypatch", "rejected_static",
          "assigns time.perf_counter_ns"),
    Cheat("timer_patch_hidden", "ln", timer_runtime, "monkeypatch", "rejected_global_state",
          "replaces time.perf_counter_ns through vars()"),
    Cheat("static_output_buffer", "ln", static_output_buffer, "output_storage_shared", "rejected_incorrect",
          "returns the same buffer on every call"),
    Cheat("drift_after_checks", "ln", drift_after_checks, "timing_output_mismatch", "rejected_incorrect",
          "correct for the first calls, wrong during timing"),
    Cheat("exec_hidden_code", "ln", exec_static, "static_introspection", "rejected_static",
          "runs code through exec"),
    Cheat("harness_patch", "ln", harness_patch, "monkeypatch", "rejected_global_state",
          "replaces a function of the gate worker itself"),
    Cheat("native_thread_at_import", "ln", native_thread_at_import, "os_threads", "rejected_global_state",
          "starts a thread through _thread at import (not in threading.enumerate)"),
    Cheat("native_thread_at_first_call", "ln", native_thread_at_first_call, "os_threads", "rejected_global_state",
          "starts a spinning _thread thread from its first call"),
]

#: The red team's reference sabotage (issue 15): looks for the original's kernels in the same process. The
#: original now never shares a process with candidate code, so it finds only the candidate's own kernels
#: (tests/test_gate_cheats.py: not accepted, and the trusted worker's original is untouched).
SABOTAGE = baseline_sabotage
