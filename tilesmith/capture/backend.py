"""The ``torch.compile`` backend that sees every Inductor graph.

``TilesmithBackend`` is ``compile_fx`` with a custom ``inner_compile``: PyTorch still runs Dynamo,
AOTAutograd and Inductor; the wrapper only observes what ``compile_fx_inner`` returns (inference,
training forward, and the training backward, which AOTAutograd compiles lazily at the first
``.backward()`` through the same ``inner_compile`` closure) and hands it to a sink.

Caches (torch 2.11's ``torch/_inductor/codecache.py`` and ``torch/_functorch/_aot_autograd/autograd_cache.py``): Inductor's FX graph cache, its generated-code caches and the
AOTAutograd cache all stay on. ``inner_compile`` still runs on an FX-cache hit and gets the wrapper source,
but a warm AOTAutograd cache hands back a ``CompiledFxGraph`` without calling ``inner_compile`` at all. Those
graphs are seen through ``CompiledFxGraph.post_compile``, which both paths call once per graph: the backend
wraps it (one class-level wrapper per process, active only inside a Tilesmith backend call through a
``ContextVar`` and silent inside ``inner_compile``, which reports its graph itself) and reports what an
AOTAutograd cache hit loaded, with :data:`AOT_CACHE_HIT` set in the kwargs. On a torch without that method
the backend falls back to turning the AOTAutograd cache off inside its own call, so no graph slips past.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tilesmith")

#: Keys of ``torch.compile(..., options=...)`` that configure Tilesmith rather than Inductor.
TILESMITH_OPTION_KEYS = ("agent_model", "agency", "loops", "max_model_calls")

#: Set (``True``) in the kwargs the sink gets for a graph an AOTAutograd cache hit loaded: there was no
#: ``inner_compile`` call, ``fx_program`` is Inductor's stored graph text *after* its post-grad passes (the
#: ``inner_compile`` path prints the graph before them, so the agent's header and the roofline floor read a
#: slightly different graph on a warm start) and ``example_inputs`` are AOTAutograd's arguments (for a backward
#: graph, the forward's), not the graph's own inputs.
AOT_CACHE_HIT = "tilesmith_aot_cache_hit"

GraphSink = Callable[[Any, str, Any, dict[str, Any]], None]
"""Called as ``sink(compiled, fx_program, example_inputs, inner_kwargs)`` for every compiled graph."""


class _Call:
    """One backend call: its sink, whether ``inner_compile`` is running, and what was reported."""

    def __init__(self, sink: GraphSink):
        self.sink = sink
        self.inner_depth = 0
        self.reported: list[Any] = []  # the objects themselves: an id could be reused once one is freed

    def report(self, compiled: Any, fx_program: str, example_inputs: Any, kwargs: dict[str, Any]) -> None:
        if any(seen is compiled for seen in self.reported):
            return
        self.reported.append(compiled)
        try:
            self.sink(compiled, fx_program, example_inputs, kwargs)
        except Exception:  # noqa: BLE001 - observing must never break the user's compile
            log.exception("tilesmith: capture failed; the graph stays on ordinary Inductor")


_ACTIVE: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("tilesmith_backend_call", default=None)
_HOOK_LOCK = threading.Lock()


class TilesmithBackend:
    """A ``torch.compile`` backend: ``compile_fx`` with an ``inner_compile`` that reports to ``sink``.

    Accepts ``mode=``/``options=`` exactly like ``torch.compile``'s Inductor backend: ``mode`` becomes
    ``torch._inductor.list_mode_options(mode)`` config patches and ``options`` is merged on top (minus
    the Tilesmith keys in :data:`TILESMITH_OPTION_KEYS`).
    """

    def __init__(self, sink: GraphSink, *, mode: str | None = None, options: dict[str, Any] | None = None):
        self._sink = sink
        self._mode = mode
        self._options = dict(options or {})
        self.__name__ = "tilesmith"

    def __call__(self, gm: Any, example_inputs: Any, mode: str | None = None,
                 options: dict[str, Any] | None = None, **_: Any) -> Any:
        import contextlib

        import torch
        from torch._inductor.compile_fx import compile_fx

        patches = config_patches(mode or self._mode, {**self._options, **(options or {})})
        call = _Call(self._sink)
        token = _ACTIVE.set(call)
        try:
            # Without the post_compile hook an AOTAutograd cache hit would hide the graph: turn that cache off.
            aot_cache = (contextlib.nullcontext() if install_post_compile_hook()
                         else torch._functorch.config.patch(enable_autograd_cache=False))
            with aot_cache:
                return compile_fx(gm, example_inputs, inner_compile=self._inner_compile,
                                  config_patches=patches or None)
        finally:
            _ACTIVE.reset(token)

    def _inner_compile(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx_inner

        # Inductor's post-grad passes mutate gm in place (torch/_inductor/compile_fx.py): print it first.
        fx_program = _readable(gm)
        from tilesmith.capture.fxgraph import FX_MODULE_KEY, serialize

        fx_module = serialize(gm, example_inputs, kwargs)  # before the passes, for the configuration generator
        call = _ACTIVE.get()
        if call is None:  # the training backward, compiled lazily after the backend call returned
            call = _Call(self._sink)
        call.inner_depth += 1
        try:
            compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        finally:
            call.inner_depth -= 1
        call.report(compiled, fx_program, example_inputs, {**kwargs, FX_MODULE_KEY: fx_module})
        return compiled


def install_post_compile_hook() -> bool:
    """Wrap ``CompiledFxGraph.post_compile`` once per process so AOTAutograd cache hits reach the sink.

    Returns whether the hook is in place (``False`` on a torch without ``CompiledFxGraph.post_compile``).
    The wrapper calls the original first and only then looks at the graph; outside a Tilesmith backend call,
    or inside ``inner_compile``, it does nothing else.
    """
    from tilesmith._compat import compiled_fx_graph_type

    cfx = compiled_fx_graph_type()
    original = getattr(cfx, "post_compile", None) if cfx is not None else None
    if original is None:
        return False
    if getattr(original, "_tilesmith_hook", False):
        return True
    with _HOOK_LOCK:
        original = cfx.post_compile
        if getattr(original, "_tilesmith_hook", False):
            return True

        @functools.wraps(original)
        def post_compile(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            call = _ACTIVE.get()
            if call is not None and call.inner_depth == 0:
                try:
                    _report_cache_hit(call, self, args, kwargs)
                except Exception:  # noqa: BLE001 - observing must never break the user's compile
                    log.exception("tilesmith: capture of an AOTAutograd cache hit failed; it stays on Inductor")
            return result

        post_compile._tilesmith_hook = True  # type: ignore[attr-defined]
        cfx.post_compile = post_compile
    return True


def _report_cache_hit(call: _Call, compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Report a graph that an AOTAutograd cache hit loaded (``post_compile(example_inputs, constants,
    graph_kwargs)`` on torch 2.11; read defensively, other versions pass other positions)."""
    example_inputs = kwargs.get("example_inputs", args[0] if args else None)
    graph_kwargs = kwargs.get("graph_kwargs", args[2] if len(args) > 2 else None)
    merged = dict(getattr(compiled, "fx_kwargs", None) or {})
    if isinstance(graph_kwargs, dict):
        merged.update(graph_kwargs)
    merged[AOT_CACHE_HIT] = True
    fx_program = str(getattr(compiled, "inductor_post_grad_graph_str", "") or
                     getattr(compiled, "runnable_graph_str", "") or "")
    call.report(compiled, fx_program, example_inputs, merged)


def config_patches(mode: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """Inductor config patches for ``mode``/``options`` as ``torch.compile(backend="inductor")`` builds them."""
    import torch

    if mode and options:
        msg = "Either mode or options can be specified, but both can't be specified at the same time."
        raise RuntimeError(msg)
    patches: dict[str, Any] = {}
    if mode and mode != "default":
        patches.update(torch._inductor.list_mode_options(mode))
    patches.update({k: v for k, v in options.items() if k not in TILESMITH_OPTION_KEYS})
    return patches


def _readable(gm: Any) -> str:
    try:
        return gm.print_readable(print_output=False, include_stride=True, include_device=True)
    except TypeError:  # older torch without include_stride/include_device
        return gm.print_readable(print_output=False)
    except Exception:  # noqa: BLE001
        return str(getattr(gm, "code", ""))
