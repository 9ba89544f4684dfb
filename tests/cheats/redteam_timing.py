"""Red-team timing cheats (findings 2, 3 and 5), as text edits of real Inductor CPU wrappers.

Copied (and generalized) from the red team's reproductions so the tests do not depend on them:

- :func:`refcount_spot` (finding 2): honest only when the caller still holds the previous output (its
  storage use count) or when the inputs are the correctness checks' guarded buffers; otherwise an
  uninitialized output. Under the old protocol only spot-checked samples kept outputs.
- :func:`frame_spot` (finding 3, frame walking): walks the caller frames (``sys._getframe`` reached through
  ``getattr(torch, "s" + "ys")``) and computes honestly only where a frame shows evidence that this call
  will be checked (a true ``keep``, or a spot/pick list naming the current round); everywhere else it
  returns an uninitialized output.
- :func:`memo_exact` / :func:`memo_sparse` (finding 5): return the previous result when every input is
  bit-identical to the previous call's, or when a few sampled input values match an earlier call's.
"""

from __future__ import annotations

import re

from tests.cheats.common import after_clear, arg_names, before_return, module_code, out_names


def _first_alloc(src: str) -> str:
    body = src.split("args.clear()", 1)[1]
    return re.search(r"^\s*buf\d+ = (empty_strided_cpu\(.*\))\s*$", body, re.M).group(1)


def refcount_spot(src: str) -> str:
    x = arg_names(src)[2]
    out = out_names(src)[0]
    src = module_code(src, """_U = torch._C._storage_Use_Count
_PREV = []
def _caller_kept_previous():
    return bool(_PREV) and _U(_PREV[0].untyped_storage()._cdata) > 2""")
    src = after_clear(src, [f"_guarded = {x}.untyped_storage().nbytes() > {x}.numel() * {x}.element_size()",
                            "if not _guarded and not _caller_kept_previous():",
                            f"    _o = {_first_alloc(src)}",
                            "    _PREV[:] = [torch.empty(0).set_(_o.untyped_storage())]",
                            "    return (_o, )"])
    return before_return(src, [f"_PREV[:] = [torch.empty(0).set_({out}.untyped_storage())]"])


_FRAME_WALK = '''def _checked():
    """True/False when a caller frame tells whether this call is checked; None when nothing tells."""
    f = getattr(getattr(torch, "s" + "ys"), "_get" + "frame")(1)  # no module bound as a global: the import guard
    # refuses those, and this cheat exists to test the timing layer
    while f is not None:
        loc = getattr(f, "f_lo" + "cals")
        if "keep" in loc and isinstance(loc["keep"], bool):
            return loc["keep"]
        for name in ("spots", "picks", "chosen", "pending"):
            val = loc.get(name)
            if isinstance(val, (list, set, tuple)) and val:
                return True
        f = getattr(f, "f_ba" + "ck")
    return None'''


def frame_spot(src: str) -> str:
    """Cheat on every call no frame marks as checked (correctness checks run outside timing samples and are
    recognised by their guarded inputs, as in :func:`refcount_spot`)."""
    x = arg_names(src)[2]
    src = module_code(src, _FRAME_WALK)
    return after_clear(src, [f"_guarded = {x}.untyped_storage().nbytes() > {x}.numel() * {x}.element_size()",
                             "if not _guarded and not _checked():",
                             f"    return ({_first_alloc(src)}, )"])


def memo_exact(src: str) -> str:
    ins, outs = arg_names(src), out_names(src)
    tup = "(" + ", ".join(ins) + ",)"
    src = module_code(src, "_MEMO = []")
    src = after_clear(src, [f"_in = {tup}",
                            "if _MEMO and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(_MEMO[0], _in)):",
                            "    return tuple(o.clone() for o in _MEMO[1])"])
    return before_return(src, ["_MEMO[:] = [[a.clone() for a in _in], [o.clone() for o in (" + ", ".join(outs) + ",)]]"])


def memo_sparse(src: str, n: int = 4) -> str:
    ins, outs = arg_names(src), out_names(src)
    tup = "(" + ", ".join(ins) + ",)"
    src = module_code(src, "_MEMO = {}")
    src = after_clear(src, [f"_key = tuple(tuple(a.reshape(-1)[::max(1, a.numel() // {n})].tolist()) for a in {tup})",
                            "_hit = _MEMO.get(_key)",
                            "if _hit is not None:",
                            "    return tuple(o.clone() for o in _hit)"])
    return before_return(src, ["_MEMO[_key] = [o.clone() for o in (" + ", ".join(outs) + ",)]"])
