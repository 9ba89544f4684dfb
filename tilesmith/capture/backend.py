"""The ``torch.compile`` backend that sees every Inductor graph.

``TilesmithBackend`` is ``compile_fx`` with a custom ``inner_compile``: PyTorch still runs Dynamo,
AOTAutograd and Inductor; the wrapper only observes what ``compile_fx_inner`` returns (inference,
training forward, and the training backward, which AOTAutograd compiles lazily at the first
``.backward()`` through the same ``inner_compile`` closure) and hands it to a sink.

Caches (research/inductor.md §4): Inductor's FX graph cache and generated-code caches stay on
(``inner_compile`` still runs on an FX-cache hit and gets the wrapper source). Only the AOTAutograd cache is
turned off, inside this backend call: a warm AOTAutograd cache returns a compiled graph without calling
``inner_compile`` at all, so the graph would slip past Tilesmith.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tilesmith")

#: Keys of ``torch.compile(..., options=...)`` that configure Tilesmith rather than Inductor.
TILESMITH_OPTION_KEYS = ("agent_model", "agency", "loops", "max_model_calls")

GraphSink = Callable[[Any, str, Any, dict[str, Any]], None]
"""Called as ``sink(compiled, fx_program, example_inputs, inner_kwargs)`` for every compiled graph."""


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
        import torch
        from torch._inductor.compile_fx import compile_fx

        patches = config_patches(mode or self._mode, {**self._options, **(options or {})})
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=self._inner_compile,
                              config_patches=patches or None)

    def _inner_compile(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx_inner

        # Inductor's post-grad passes mutate gm in place: print it first (research/inductor.md §1.1).
        fx_program = _readable(gm)
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        try:
            self._sink(compiled, fx_program, example_inputs, kwargs)
        except Exception:  # noqa: BLE001 - observing must never break the user's compile
            log.exception("tilesmith: capture failed; the graph stays on ordinary Inductor")
        return compiled


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
