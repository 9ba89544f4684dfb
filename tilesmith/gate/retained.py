"""Hidden references to a call's fresh outputs (``output_retained``): the gate worker and production verification.

The 2026-12-05 red team's R1 returned outputs from a ring of 64 static buffers: more slots than the gate's held
calls (``checks.HELD_CALLS``), so no held output was overwritten during the check, while outputs a user kept were
overwritten 64 calls later. The structural rule does not depend on the ring's size:

    at return, a fresh output (one whose storage is no input's storage) has no live reference other than the
    returned sequence and the outputs themselves.

:func:`call_measured` runs the wrapper and, with the result held in one local variable only, counts per tensor
output (``torch.Tensor`` exactly; ``None``, numbers and other objects are not judged, nor outputs sharing an
input's storage: training forwards return inputs as saved activations, and the caller holds its inputs):

* **storage** — ``torch._C._storage_Use_Count`` (the StorageImpl's C++ refcount) minus the distinct TensorImpls
  among the outputs and their ``_base`` chains that share this storage, minus 1 (the temporary Python storage
  object of the count itself). A view stashed anywhere (``keep.append(out.view(-1))``, ``out[:]``, the untyped
  storage object) is one more.
* **object** — ``sys.getrefcount`` of the output (and of each ``_base`` reached) minus its occurrences in the
  returned sequence (and, for a base, in the outputs) minus our own two references. The ring itself holding the
  returned tensor object is one more.
* **weak** — ``weakref.getweakrefcount`` of the output (a ring of weak references can find and overwrite outputs
  the caller still holds).
* **sequence** — ``sys.getrefcount`` of the returned list/tuple minus ours (a ring of returned lists).
* **resizable** — whether the storage is resizable: memory the allocator gave out is; ``torch.from_numpy`` /
  ``from_blob`` views of memory the wrapper keeps (a ring of numpy arrays) are not.

The figures are compared with the original Inductor wrapper's, measured the same way (the gate's trusted worker
on the same inputs; production: the original on the check's copies): a candidate's output fails when any count
exceeds the original's for the same output, or it is not resizable where the original's is. Judging relative to
the original keeps what Inductor legitimately does (CUDA-graph trees keep only weak storage references, which
none of these counts see; a cpp_wrapper returns the same plain tensors) from ever failing a faithful candidate.

Cost: a few reference counts and ``_base`` reads per output, ~9 µs for 5 outputs (docs/verification.md). Not seen:
weak *storage* references (``StorageWeakRef``; PyTorch exposes no weak count) and memory reached through raw
pointers (ctypes); the gate's held calls (``output_storage_shared``, ``output_lifetime``) cover rings of up to
``HELD_CALLS`` slots of any kind.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)
_getrefcount = sys.getrefcount
_weakcount = weakref.getweakrefcount
_Tensor = torch.Tensor
_SEQ = (list, tuple)


def available() -> bool:
    """Whether this torch exposes the storage refcount (``torch._C._storage_Use_Count``)."""
    return _use_count is not None


def call_measured(fn: Any, args: Any, own: Any = None) -> tuple[Any, dict[str, Any] | None]:
    """``fn(args)`` and its hidden-reference facts (:func:`_facts`), measured before anything else sees the result.

    ``args`` is the argument list the wrapper gets (Inductor clears it; the caller keeps the inputs elsewhere and
    passes them to :func:`_facts` through ``inputs_of``): the inputs are read from a copy of the list first.
    ``own``: ``storage data_ptr → TensorImpl ids (_cdata)`` the caller itself holds to storages the wrapper allocated (the gate
    worker's guarded allocator keeps each buffer's guard tail to read it after the call)."""
    inputs = list(args) if isinstance(args, list) else []
    out = fn(args)
    if _use_count is None:
        return out, None
    try:
        facts = _facts(out, inputs, own)
    except Exception:  # noqa: BLE001 - an odd output type: the structural checks report it
        facts = None
    return out, facts


def _facts(out: Any, inputs: list[Any], own: Any = None) -> dict[str, Any] | None:
    # ``out`` is referenced by call_measured's local and this frame's argument. A TensorImpl (StorageImpl) with
    # C++ owners besides its Python object holds one reference to that object (PyTorch's PyObject preservation:
    # one, however many owners), so a tensor that is the ``_base`` of a view has one more Python reference.
    if type(out) not in _SEQ:
        # A list/tuple subclass (or any other container) is not measured; recorded so that :func:`hidden`
        # flags it where the original's sequence was measured (a subclass would otherwise hide a kept output).
        return {"unjudged": type(out).__qualname__}
    sequence = _getrefcount(out) - 3  # call_measured's local, this argument, getrefcount's argument
    in_storages = {a.untyped_storage()._cdata for a in inputs if isinstance(a, _Tensor)}
    del inputs
    impls: dict[int, set[int]] = {}  # storage → distinct TensorImpls among the outputs and their bases
    based: set[int] = set()  # TensorImpls that are the _base of an output
    for o in out:
        if type(o) is _Tensor:
            impls.setdefault(o.untyped_storage()._cdata, set()).add(o._cdata)
            b = o._base
            while b is not None:  # the whole chain: ``view(dtype)`` starts a new one
                impls.setdefault(b.untyped_storage()._cdata, set()).add(b._cdata)
                based.add(b._cdata)
                b = b._base
            del b
    per: list[dict[str, int] | None] = []
    for o in out:
        if type(o) is not _Tensor:
            # A tensor subclass is not measured: recorded, flagged where the original's output was a plain tensor.
            per.append({"unjudged": type(o).__qualname__} if isinstance(o, _Tensor) else None)
            continue
        st = o.untyped_storage()
        key = st._cdata
        if key in in_storages:
            del st
            per.append(None)
            continue
        resizable = int(st.resizable())
        storage = _use_count(key) - 1 - len(impls[key])  # minus the storage's Python object and the TensorImpls
        if own is not None:
            storage -= len(set(own(st.data_ptr())) - impls[key])
        storage_object = _getrefcount(st) - 3  # st, the argument, the StorageImpl's own reference
        del st
        # o: the loop variable and getrefcount's argument, its places in the sequence, its views among them
        obj = _getrefcount(o) - 2 - sum(1 for p in out if p is o) - (o._cdata in based)
        b = o._base
        if b is not None:  # b: the local, the argument, o's reference, its places in the sequence
            obj += max(0, _getrefcount(b) - 3 - sum(1 for p in out if p is b))
        del b
        per.append({"storage": storage + storage_object, "object": obj, "weak": _weakcount(o),
                    "resizable": resizable})
    return {"sequence": sequence, "outputs": per}


def hidden(got: dict[str, Any] | None, ref: dict[str, Any] | None) -> list[tuple[int | None, str]]:
    """``(output index or None for the sequence, what)`` for every count of ``got`` above ``ref``'s (see the
    module text); nothing when either is unknown."""
    if not got or not ref:
        return []
    found: list[tuple[int | None, str]] = []
    if "unjudged" in ref:
        return found
    if "unjudged" in got:
        return [(None, f"a {got['unjudged']} was returned where the original returns a plain list or tuple, so "
                       "references to its outputs cannot be counted")]
    if got.get("sequence", 0) > max(0, ref.get("sequence", 0)):
        found.append((None, f"the returned {'sequence'} has {got['sequence']} other reference(s) "
                            f"(the original's: {max(0, ref.get('sequence', 0))})"))
    for i, (g, r) in enumerate(zip(got.get("outputs", []), ref.get("outputs", []))):
        if g is None or r is None or "unjudged" in r:
            continue
        if "unjudged" in g:
            found.append((i, f"a {g['unjudged']} was returned where the original returns a plain tensor, so "
                             "references to it cannot be counted"))
            continue
        parts = []
        for name, what in (("storage", "other tensor(s) or storage object(s) sharing its storage"),
                           ("object", "other reference(s) to the tensor object"),
                           ("weak", "weak reference(s) to the tensor object")):
            if g.get(name, 0) > max(0, r.get(name, 0)):
                parts.append(f"{g[name]} {what} (the original's: {max(0, r.get(name, 0))})")
        if r.get("resizable") and not g.get("resizable", 1):
            parts.append("its storage is not the allocator's (not resizable: memory the wrapper keeps, e.g. "
                         "torch.from_numpy or from_blob), the original's is")
        if parts:
            found.append((i, "; ".join(parts)))
    return found


def message(found: list[tuple[int | None, str]], where: str) -> str:
    """The ``output_retained`` text for :func:`hidden`'s findings."""
    head = "; ".join(f"{'the output sequence' if i is None else f'output {i}'}: {what}" for i, what in found[:4])
    return (f"at return, fresh outputs are still referenced by the wrapper ({where}): {head}. An output the caller "
            "keeps must be the caller's alone: a kept reference (a ring of static output buffers, a stashed view) "
            "lets a later call overwrite it.")
