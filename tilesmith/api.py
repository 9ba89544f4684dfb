"""Public API: :func:`compile`, :func:`benchmarks`, :func:`diagnostics`, and the ``"tilesmith"`` backend.

``tilesmith.compile`` returns an ordinary ``torch.compile`` callable. Dynamo, AOTAutograd and Inductor
run as usual; Tilesmith observes each Inductor graph, and at an eligible graph's first real call optimizes
it (pipeline module docstring). When a required piece is missing it falls back to plain
``torch.compile(...)`` and leaves a diagnostic naming the piece and how to supply it, checked in this order:
example inputs, a CUDA tensor among them (or CPU test mode), an optimizer (``agent_model`` or
``TILESMITH_MODEL``), and for an LLM model the agent stack, the CLIProxyAPI executable and credentials.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

from tilesmith import settings
from tilesmith._text import sentence
from tilesmith.errors import TilesmithWarning
from tilesmith.records import BenchmarkRecord, Diagnostic

AGENCY_LEVELS = ("low", "medium", "high")

_RUNS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_BACKEND_RUNS: dict[tuple[Any, ...], Any] = {}
_LOCK = threading.Lock()


def compile(  # noqa: A001 - mirrors torch.compile on purpose
    model: Any,
    example_inputs: tuple[Any, ...] | list[Any] | None = None,
    agent_model: Any = None,
    agency: str = "medium",
    loops: int = 1,
    max_model_calls: int | None = None,
    *,
    sandbox: str | None = None,
    chip: str | None = None,
    **torch_compile_kwargs: Any,
) -> Any:
    """Compile ``model`` with ``torch.compile`` and let Tilesmith optimize its Inductor graphs.

    Args:
        model: an ``nn.Module`` or function, exactly as ``torch.compile`` takes it.
        example_inputs: tuple or list with at least one CUDA tensor (any shapes/dtypes; CPU tensors in CPU test
            mode, ``TILESMITH_ALLOW_CPU=1``); used to check that the model will run on a GPU. The gate uses the
            *first real call's* inputs, not these.
        agent_model: optimizer: a model the private CLIProxyAPI lists (e.g. ``"gpt-5.5"``),
            ``"tilesmith/builtin"`` for the built-in agent (no LLM, no keys), or an object with
            ``for_graph``/``close`` (an ``OptimizerFactory``). Overrides ``TILESMITH_MODEL``.
        agency: ``"low"`` (local tuning inside the existing kernels), ``"medium"`` (may restructure the
            wrapper, buffers, fusion) or ``"high"`` (may redesign the algorithm).
        loops: number of accepted optimization cycles per graph (≥ 1).
        max_model_calls: exact budget of LLM invocations for this run (``None``: no limit).
        sandbox: where the agent's shell and the gate run: ``None`` or ``"local"`` (this machine; the shell is
            a bubblewrap sandbox, docs/agent.md). tilesmith-ai 0.1.4's ``"computesdk"`` (a remote GPU service)
            is not supported.
        chip: optional GPU model the run must use, e.g. ``"H200"``; checked against the name of the device of
            the first CUDA tensor in ``example_inputs`` (rules: :mod:`tilesmith.chip`).
        **torch_compile_kwargs: passed to ``torch.compile`` (``mode``, ``options``, ``fullgraph``,
            ``dynamic``, ``disable``).

    Returns:
        The ``torch.compile`` callable: same call signature, same outputs, works with ``.backward()``. Where a
        piece is missing (module docstring) that is plain ``torch.compile``'s, with a diagnostic and a
        :class:`~tilesmith.errors.TilesmithWarning`.

    Side effect: when a graph may be eligible (CUDA already initialized in this process, or CPU test mode) it
    starts one gate worker process at once (``TILESMITH_PRESTART_WORKER``, :mod:`tilesmith.gate.host.standby`), so
    that the worker's torch import overlaps with Dynamo's compile; the first gate adopts it.

    Raises:
        TypeError: an argument has the wrong type (message names the allowed types).
        ValueError: ``agency`` not in low/medium/high, ``loops`` < 1, negative ``max_model_calls``, an
            ``agent_model`` that misspells the built-in agent (``"builtin"``, ``"tilesmith/bultin"``), a
            ``backend`` keyword (Tilesmith is the backend), an unsupported ``sandbox``, or a ``chip`` that does
            not match the local GPU (``chip='H100' does not match local execution device 'NVIDIA H200'``).
        tilesmith.errors.SettingsError: an invalid ``TILESMITH_*`` environment value.
    """
    import torch

    _validate(example_inputs, agent_model, agency, loops, max_model_calls, torch_compile_kwargs)
    _validate_placement(sandbox, chip, example_inputs)
    settings.check_all()
    from tilesmith.pipeline import LiveRun, RunOptions

    chosen = agent_model if agent_model is not None else settings.get("TILESMITH_MODEL")
    _check_skills(chosen)
    allow_cpu = settings.get("TILESMITH_ALLOW_CPU")
    options = RunOptions(agent_model=chosen, agency=agency, loops=loops, max_model_calls=max_model_calls,
                         allow_cpu=allow_cpu, min_improvement=settings.get("TILESMITH_MIN_IMPROVEMENT"),
                         compile_mode=torch_compile_kwargs.get("mode"))
    run = LiveRun(options)
    if chip is not None:
        run.folder.metadata["chip"] = chip
    missing = _missing_piece(example_inputs, chosen, allow_cpu)
    if missing is not None:
        compiled = torch.compile(model, **torch_compile_kwargs)
        run.diagnose(*missing)
        warnings.warn(f"tilesmith.compile falls back to plain torch.compile ({missing[0]}): {missing[1]}",
                      TilesmithWarning, stacklevel=2)
    else:
        if allow_cpu:
            from tilesmith._compat import fast_cpu_isa_probe

            fast_cpu_isa_probe()
        from tilesmith.capture.backend import TilesmithBackend

        compiled = torch.compile(model, backend=TilesmithBackend(run.on_compiled), **torch_compile_kwargs)
        if allow_cpu or torch.cuda.is_initialized():  # a graph may be eligible; CUDA state is left as it is
            from tilesmith.gate.host import standby

            # its torch import overlaps with Dynamo's compile at the first call
            standby.prestart("cuda" if torch.cuda.is_initialized() else "cpu")
    _register(compiled, run)
    return compiled


def benchmarks(model: Any) -> tuple[BenchmarkRecord, ...]:
    """Inductor-vs-Tilesmith records, one per installed graph of ``model`` (a ``tilesmith.compile`` result).

    Empty before the first call, after a fallback, and for objects Tilesmith did not compile (those also warn,
    :class:`~tilesmith.errors.TilesmithWarning`: pass what ``tilesmith.compile`` returned); with
    ``TILESMITH_CACHE_RECHECK=background`` a graph reused from the artifact cache appears only once its
    re-check has installed it (``tilesmith.wait(model)`` waits; a ``cache_rechecking`` diagnostic says one is
    running), and with ``TILESMITH_OPTIMIZE=background`` an optimized graph once its gate accepted
    (``optimizing_in_background``). Times are in milliseconds per call, measured by the host gate's confirmation
    (paired samples,
    median of ratios); for a cache hit, by the re-check's own measurement on this run's inputs (the artifact's
    stored numbers are in the track's ``cache.json``). Under ``torch.distributed`` every rank lists the graphs the
    job installed, with the numbers of the graph's leader, whose global rank is ``measured_by_rank``
    (docs/distributed.md); a follower's own re-check is in ``extras`` (``recheck_status``, ``recheck_speedup``).
    """
    run = _run_of(model, "benchmarks")
    return tuple(run.benchmarks) if run is not None else ()


def wait(model: Any, timeout_s: float | None = None) -> bool:
    """Wait until background re-checks and optimizations of ``model``'s graphs have finished (installed or not).

    Only ``TILESMITH_CACHE_RECHECK=background`` (artifact-cache re-checks) and ``TILESMITH_OPTIMIZE=background``
    (first-call optimizations) start such threads; under ``torch.distributed`` this also
    waits until the job's decision on each of this rank's graphs is applied here (docs/distributed.md; a local
    wait, no collective); otherwise there is nothing to wait for.
    ``timeout_s`` is in seconds (``None``: no limit). Returns True when none is still running, False on
    timeout; never raises for objects Tilesmith did not compile (True, with a
    :class:`~tilesmith.errors.TilesmithWarning`).

    Raises:
        TypeError: ``timeout_s`` is neither ``None`` nor a number of seconds (e.g. the string ``"5"``).
        ValueError: ``timeout_s`` is negative or NaN.
    """
    if timeout_s is not None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"tilesmith.wait: timeout_s must be None (no limit) or a number of seconds, got "
                            f"{type(timeout_s).__name__} {timeout_s!r}")
        if not timeout_s >= 0:
            raise ValueError(f"tilesmith.wait: timeout_s must be >= 0 seconds (or None: no limit), got {timeout_s!r}")
    run = _run_of(model, "wait")
    return True if run is None else run.wait(timeout_s)


def diagnostics(model: Any) -> tuple[Diagnostic, ...]:
    """Why graphs of ``model`` were or were not optimized (``kind``, ``message``, graph key and name). Empty, with a
    :class:`~tilesmith.errors.TilesmithWarning`, for an object Tilesmith did not compile (e.g. the eager model
    rather than what ``tilesmith.compile`` returned)."""
    run = _run_of(model, "diagnostics")
    return tuple(run.diagnostics) if run is not None else ()


def tilesmith_backend(gm: Any, example_inputs: Any, mode: str | None = None,
                      options: dict[str, Any] | None = None) -> Any:
    """The ``torch.compile(model, backend="tilesmith")`` entry point (registered as an entry point).

    Tilesmith settings may be given in ``options`` as ``agent_model``, ``agency``, ``loops``,
    ``max_model_calls`` (the rest are Inductor options). Graphs compiled with the same settings share one
    run; ``tilesmith.diagnostics(m)``/``benchmarks(m)`` find it from the compiled module.
    """
    from tilesmith.capture.backend import TilesmithBackend
    from tilesmith.pipeline import LiveRun, RunOptions

    settings.check_all()
    opts = dict(options or {})
    chosen = opts.get("agent_model") or settings.get("TILESMITH_MODEL")
    agency, loops, budget = opts.get("agency", "medium"), opts.get("loops", 1), opts.get("max_model_calls")
    _validate(None, chosen, agency, loops, budget, {})
    key = _backend_key(mode, opts)
    with _LOCK:
        run = _BACKEND_RUNS.get(key)
        if run is None:
            allow_cpu = settings.get("TILESMITH_ALLOW_CPU")
            run = LiveRun(RunOptions(agent_model=chosen, agency=agency, loops=loops, max_model_calls=budget,
                                     allow_cpu=allow_cpu, min_improvement=settings.get("TILESMITH_MIN_IMPROVEMENT"),
                                     compile_mode=mode))
            missing = _missing_piece(None, chosen, allow_cpu, check_inputs=False)
            if missing is not None:
                run.diagnose(*missing)
                warnings.warn(f"the tilesmith backend falls back to plain Inductor ({missing[0]}): {missing[1]}",
                              TilesmithWarning, stacklevel=2)
            _BACKEND_RUNS[key] = run
    if run.diagnostics and run.diagnostics[0].kind in _FALLBACK_KINDS:
        return TilesmithBackend(lambda *a: None)(gm, example_inputs, mode=mode, options=opts)
    return TilesmithBackend(run.on_compiled)(gm, example_inputs, mode=mode, options=opts)


# -- validation and fallback ----------------------------------------------------------------------------

_FALLBACK_KINDS = {"missing_example_inputs", "no_cuda_device", "missing_model", "missing_proxy",
                   "missing_credentials"}


def _validate(example_inputs: Any, agent_model: Any, agency: Any, loops: Any, max_model_calls: Any,
              torch_compile_kwargs: dict[str, Any]) -> None:
    from tilesmith.agent import check_model_name, is_factory

    if example_inputs is not None and not isinstance(example_inputs, tuple | list):
        msg = ("example_inputs must be a tuple or list of the model's inputs, e.g. (x,), or None; "
               f"got {type(example_inputs).__name__}")
        raise TypeError(msg)
    if agent_model is not None and not isinstance(agent_model, str) and not is_factory(agent_model):
        msg = ("agent_model must be a model name (str), 'tilesmith/builtin', or an OptimizerFactory, "
               f"got {type(agent_model).__name__}")
        raise TypeError(msg)
    if isinstance(agent_model, str) and not agent_model.strip():
        msg = "agent_model must not be empty: give a model the proxy lists, or 'tilesmith/builtin'"
        raise ValueError(msg)
    if isinstance(agent_model, str):
        check_model_name(agent_model, "agent_model")
    if not isinstance(agency, str):
        msg = f"agency must be one of {AGENCY_LEVELS}, got {type(agency).__name__}"
        raise TypeError(msg)
    if agency not in AGENCY_LEVELS:
        msg = f"agency must be one of {AGENCY_LEVELS}, got {agency!r}"
        raise ValueError(msg)
    _require_int("loops", loops, 1, "an int >= 1 (accepted optimization cycles)")
    if max_model_calls is not None:
        _require_int("max_model_calls", max_model_calls, 0, "None (no limit) or an int >= 0")
    if "backend" in torch_compile_kwargs:
        msg = ("tilesmith.compile does not take backend=: Tilesmith is the backend (it wraps Inductor). "
               "Use torch.compile(model, backend='tilesmith') for the registered backend instead.")
        raise ValueError(msg)


SANDBOXES = (None, "local")
"""``sandbox=`` values Tilesmith supports (0.1.4 also took ``"computesdk"``, a remote service)."""


def _require_int(name: str, value: Any, minimum: int, meaning: str) -> None:
    """Raise TypeError for a non-int (bools are not ints here) and ValueError below ``minimum``, naming ``meaning``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {meaning}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be {meaning}, got {value}")


def _validate_placement(sandbox: Any, chip: Any, example_inputs: Any) -> None:
    if sandbox is not None and not isinstance(sandbox, str):
        raise TypeError(f"sandbox must be None or 'local', got {type(sandbox).__name__}")
    if sandbox not in SANDBOXES:
        remote = (" ComputeSDK is a remote GPU service this build does not reach; the agent's shell runs in a "
                  "local bubblewrap sandbox instead.") if sandbox == "computesdk" else ""
        raise ValueError(f"sandbox={sandbox!r} is not supported: use sandbox=None or sandbox='local' (this "
                         f"machine's GPU).{remote}")
    if chip is None:
        return
    if not isinstance(chip, str):
        raise TypeError(f"chip must be None or a GPU model name such as 'H200', got {type(chip).__name__}")
    if not chip.strip():
        raise ValueError("chip must not be empty: pass a GPU model name such as 'H200', or chip=None")
    from tilesmith.chip import check_chip

    check_chip(chip, example_inputs)


def _check_skills(model: Any) -> None:
    """Read the LLM agent's skills now so that a bad ``TILESMITH_SKILLS`` fails at compile() (SettingsError)."""
    from tilesmith.agent import BUILTIN_MODEL

    if isinstance(model, str) and model != BUILTIN_MODEL:
        from tilesmith.agent.llm.skills import load_skills

        load_skills()


def _missing_piece(example_inputs: Any, model: Any, allow_cpu: bool, *, check_inputs: bool = True
                   ) -> tuple[str, str] | None:
    """``(kind, message)`` for the first missing piece, in the module docstring's order, or ``None``."""
    import torch

    from tilesmith.agent import BUILTIN_MODEL, is_factory

    if check_inputs:
        if not example_inputs:
            return ("missing_example_inputs", "tilesmith.compile got no example_inputs, so it cannot tell that "
                    "the model runs on a GPU; using plain torch.compile. Remedy: pass "
                    "example_inputs=(x,) with at least one CUDA tensor.")
        tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        if "cuda" not in devices and not (allow_cpu and devices):
            cuda = "CUDA is available" if torch.cuda.is_available() else "this machine has no CUDA device"
            return ("no_cuda_device", f"example_inputs hold no CUDA tensor (devices: {sorted(devices) or 'none'}; "
                    f"{cuda}); Tilesmith optimizes CUDA graphs, so this is plain torch.compile. Remedy: move "
                    "the model and inputs to a CUDA device (TILESMITH_ALLOW_CPU=1 is a test mode only).")
    if model is None:
        return ("missing_model", "no optimizer model was chosen; using plain torch.compile. Remedy: pass "
                "agent_model='<model the proxy lists>' or set TILESMITH_MODEL, or use "
                f"agent_model='{BUILTIN_MODEL}' for the built-in agent (no LLM, no keys).")
    if is_factory(model) or model == BUILTIN_MODEL:
        return None
    try:
        from tilesmith.agent.llm import check_availability
    except ImportError as exc:  # the agent stack (deepagents, langchain-openai) is not installed
        return ("missing_proxy", f"the LLM agent stack cannot be imported ({exc}); using plain torch.compile. "
                "Remedy: reinstall Tilesmith from its checkout with its dependencies (pip install <checkout>; "
                "PyPI's tilesmith-ai is another project), or use "
                f"agent_model='{BUILTIN_MODEL}'.")
    availability = check_availability(model)
    if not availability.ok:  # name what was asked for and what happens now
        return (availability.kind, f"agent_model {model!r}: {sentence(availability.message)} The model runs on "
                "plain torch.compile (no graph is optimized).")
    return None


# -- finding a model's run ------------------------------------------------------------------------------

def _register(compiled: Any, run: Any) -> None:
    try:
        _RUNS[compiled] = run
        weakref.finalize(compiled, run.close)
    except TypeError:  # not weak-referenceable: keep it alive with the object instead
        setattr(compiled, "_tilesmith_run", run)


def _run_of(model: Any, asked: str | None = None) -> Any:
    """The run of a Tilesmith-compiled ``model``; ``None`` otherwise, with a :class:`TilesmithWarning` when
    ``asked`` (the public function's name) — a user who passes the eager model instead of what
    ``tilesmith.compile`` returned would otherwise read an empty answer as "nothing to report"."""
    try:
        run = _RUNS.get(model)
    except TypeError:
        run = None
    if run is None:
        run = getattr(model, "_tilesmith_run", None)
    if run is None:
        run = _backend_run_of(model)
    if run is None and asked is not None:
        warnings.warn(f"tilesmith.{asked}() got a {type(model).__name__} that Tilesmith did not compile, so it "
                      f"answers as for a model with nothing to report; pass the callable tilesmith.compile(...) "
                      f"returned (or torch.compile(..., backend='tilesmith')'s), not the original model",
                      TilesmithWarning, stacklevel=3)
    return run


def _backend_key(mode: str | None, options: dict[str, Any]) -> tuple[Any, ...]:
    return (mode, tuple(sorted((k, repr(v)) for k, v in options.items())))


def _backend_run_of(model: Any) -> Any:
    """The run of a ``torch.compile(m, backend="tilesmith", ...)`` result, found through Dynamo's wrappers."""
    seen: set[int] = set()
    frontier = [getattr(model, "dynamo_ctx", None), model]
    for _ in range(12):
        nxt = []
        for obj in frontier:
            if obj is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            if getattr(obj, "compiler_fn", None) is not None and getattr(obj, "kwargs", None) is not None:
                fn = obj.compiler_fn
                if getattr(fn, "__name__", "") == "tilesmith_backend":
                    kwargs = obj.kwargs
                    return _BACKEND_RUNS.get(_backend_key(kwargs.get("mode"), dict(kwargs.get("options") or {})))
            for attr in ("callback", "_torchdynamo_orig_backend", "_torchdynamo_orig_callable", "compiler_fn",
                         "_inner_convert", "unconfigured_compiler_fn", "dynamo_ctx"):
                nxt.append(getattr(obj, attr, None))
        frontier = nxt
    return None
