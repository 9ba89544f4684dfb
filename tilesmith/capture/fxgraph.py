"""The FX graph Inductor compiled, serialized so that it can be compiled again in another process.

The built-in agent's configuration generator (:mod:`tilesmith.agent.builtin.configs`) compiles the *same*
graph again under other Inductor configurations (max-autotune, coordinate descent, reduction variants, the C++
wrapper) in its search worker, never in the user's process. That needs the graph as ``inner_compile`` received
it — before Inductor's post-grad passes, which rewrite the ``GraphModule`` in place (``torch/_inductor/compile_fx.py``:
``_recursive_post_grad_passes``) — together with the fake example inputs and the plain-data ``inner_compile``
keyword arguments.

Serialization is :class:`torch.fx._graph_pickler.GraphPickler`, the pickler Inductor itself uses to hand a graph
to a compile subprocess (``torch/_inductor/compile_fx_ext.py``, torch ≥ 2.7): fake tensors travel as metadata
(sizes, strides, dtype, device), real tensors held by the module (lifted constants) with their data. The payload
is only ever read by Tilesmith's own search worker; no candidate code sees it.

Nothing here raises into the user's compile: :func:`serialize` returns ``None`` (and the configuration generator
then says why it does not apply) when the graph cannot be pickled or its constants are too large.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tilesmith")

#: Key under which the backend hands the serialized graph to the capture sink (in the ``inner_compile`` kwargs).
FX_MODULE_KEY = "tilesmith_fx_module"
#: Largest total size of real tensors (module constants) serialized with a graph, in bytes. Beyond it the graph is
#: not serialized: copying that much on every compile would cost the user time for a generator that may not run.
MAX_CONSTANT_BYTES = 256 * 1024 * 1024
#: ``inner_compile`` keyword arguments kept (plain data that ``compile_fx_inner`` accepts again).
_KEPT_KWARGS = ("static_input_idxs", "is_backward", "is_inference", "graph_id", "layout_opt", "cpp_wrapper",
                "fx_wrapper", "aot_mode")


@dataclass(frozen=True)
class FxModule:
    """A serialized ``GraphModule`` with its fake example inputs (one ``GraphPickler`` payload).

    ``payload``: ``GraphPickler.dumps((gm, example_inputs))``. ``kwargs``: the kept ``inner_compile`` keyword
    arguments as ``(name, value)`` pairs (values are ``bool``/``int``/``str``/lists of ``int``).
    """

    payload: bytes = field(repr=False)
    kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    def kwargs_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.kwargs}


def _constant_bytes(gm: Any) -> int:
    import torch

    total = 0
    for value in list(getattr(gm, "_buffers", {}).values()) + list(getattr(gm, "_parameters", {}).values()):
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    for node in getattr(getattr(gm, "graph", None), "nodes", ()):
        if getattr(node, "op", None) == "get_attr":
            value = getattr(gm, str(node.target), None)
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def _plain(value: Any) -> Any:
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(int(v) for v in value)
    raise TypeError


def serialize(gm: Any, example_inputs: Any, kwargs: dict[str, Any]) -> FxModule | None:
    """``gm`` (before Inductor's passes) and its example inputs as an :class:`FxModule`, or ``None``.

    ``None`` when torch has no ``GraphPickler``, the graph holds more than :data:`MAX_CONSTANT_BYTES` of real
    tensors, or pickling fails (an op or metadata it cannot serialize). Never raises.
    """
    try:
        from torch.fx._graph_pickler import GraphPickler, Options
    except ImportError:
        return None
    try:
        if _constant_bytes(gm) > MAX_CONSTANT_BYTES:
            return None
        payload = GraphPickler.dumps((gm, list(example_inputs)), Options(ops_filter=None))
        kept = []
        for name in _KEPT_KWARGS:
            if name in kwargs:
                try:
                    kept.append((name, _plain(kwargs[name])))
                except TypeError:
                    continue
        return FxModule(payload=payload, kwargs=tuple(kept))
    except Exception as exc:  # noqa: BLE001 - observing must never break the user's compile
        log.debug("tilesmith: the FX graph could not be serialized (%s: %s)", type(exc).__name__, exc)
        return None


def load(payload: bytes) -> tuple[Any, list[Any], Any]:
    """``(gm, example_inputs, fake_mode)`` from an :attr:`FxModule.payload` (in Tilesmith's search worker).

    The example inputs are fake tensors of a fresh ``FakeTensorMode`` (returned third); compile under
    ``torch._guards.tracing(TracingContext(fake_mode))`` and inside that mode.

    Raises:
        Exception: whatever ``GraphPickler.loads`` raises for a payload of another torch version.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    fake_mode = FakeTensorMode()
    gm, inputs = GraphPickler.loads(payload, fake_mode)
    return gm, list(inputs), fake_mode



def store_root() -> Any:
    """Where :func:`save` keeps serialized graphs: ``<Inductor cache dir>/tilesmith-fxgraphs``, beside the
    AOTAutograd cache whose hits hide ``inner_compile`` (so the two live and are cleared together)."""
    from pathlib import Path

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "tilesmith-fxgraphs"


def _paths(root: Any, inductor_key: str) -> tuple[Any, Any]:
    from pathlib import Path

    safe = "".join(c for c in inductor_key if c.isalnum())[:128]
    folder = Path(root) / safe[:2]
    return folder / f"{safe}.fxpkl", folder / f"{safe}.json"


def save(module: FxModule, inductor_key: str | None, root: Any) -> None:
    """Keep ``module`` under ``root`` (:func:`store_root`) by Inductor's FX graph cache key, for a later process whose
    AOTAutograd cache hands back the same graph without calling ``inner_compile`` (:func:`lookup`).

    The payload is written as raw bytes and the kwargs as JSON; the host never unpickles either (only the search
    worker loads the payload). Never raises: a failed write only means a warm start cannot compile variants.
    """
    if not inductor_key:
        return
    import json

    from tilesmith._atomic import write_bytes_atomic

    payload_path, meta_path = _paths(root, inductor_key)
    try:
        payload_path.parent.mkdir(parents=True, exist_ok=True)
        if payload_path.exists() and meta_path.exists():
            return
        for path, data in ((payload_path, module.payload),
                           (meta_path, json.dumps(module.kwargs_dict()).encode("utf-8"))):
            write_bytes_atomic(path, data)
    except OSError as exc:
        log.debug("tilesmith: could not keep the FX graph for %s (%s)", inductor_key[:12], exc)


def lookup(inductor_key: str | None, root: Any) -> FxModule | None:
    """The :class:`FxModule` :func:`save` kept for ``inductor_key``, or ``None``. Never raises."""
    if not inductor_key:
        return None
    import json

    payload_path, meta_path = _paths(root, inductor_key)
    try:
        kwargs = json.loads(meta_path.read_text(encoding="utf-8"))
        payload = payload_path.read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(kwargs, dict):
        return None
    kept = []
    for name, value in kwargs.items():
        try:
            kept.append((str(name), _plain(value)))
        except TypeError:
            continue
    return FxModule(payload=payload, kwargs=tuple(kept))
