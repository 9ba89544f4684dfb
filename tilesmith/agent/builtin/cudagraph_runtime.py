"""Runtime of the ``cudagraph`` generator, embedded verbatim into the candidate wrapper it writes.

Everything between the ``BEGIN EMBEDDED`` and ``END EMBEDDED`` markers is copied into the candidate source
(see :func:`tilesmith.agent.builtin.cudagraph.embedded_runtime`), so a candidate is an ordinary,
self-contained Inductor module that needs nothing from Tilesmith at run time. It lives in its own module so
that it is linted, documented and unit-tested like the rest of the package (``tests/test_builtin_runtime.py``
drives it on CPU with a simulated graph; ``tests/gpu/test_builtin_gpu.py`` with real CUDA graphs).

The replacement ``call(args)`` keeps the callable ABI of Inductor's ``call``:

- it takes the argument list and clears it;
- it returns the same number of outputs with the same sizes, strides and dtypes;
- outputs that are inputs in the original are the caller's input tensor objects, outputs that are views of
  inputs are views of the caller's tensors, and inputs the original writes into (buffers Inductor reuses
  in place, ``# reuse`` in the wrapper) end up written the same way;
- every other output is fresh memory the caller owns: a later replay never overwrites it.

Input staging (how one graph with fixed addresses serves calls with changing tensors):

- An input whose ``data_ptr`` was the same on the previous call (typically a parameter) is *pinned*: the
  graph reads that address directly. A replay happens only when the arriving tensor is at exactly the
  captured address (and has the captured sizes and strides), so the bytes the graph reads are that
  tensor's bytes, whichever tensor object it is: no copy is needed, also when a new tensor arrives at the
  same address. The captured tensor is kept referenced, so while it lives no other allocation takes that
  address.
- Every other tensor input (and every input the body writes into) is copied into a buffer this object owns
  before each replay; written inputs are copied back afterwards.
- A pinned input arriving at a different address triggers a re-capture with that input staged (it is
  *demoted*); a staged input that kept one address for ``PROMOTE_AFTER`` consecutive calls
  (``REPROMOTE_AFTER`` once demoted) is promoted to pinned by a re-capture. After ``MAX_CAPTURES`` graphs, a
  call that does not fit gets one last graph that stages every input (it fits any addresses); promotions still
  happen after that, up to ``HARD_CAP`` captures in all. So a caller whose addresses churn for a while (a
  gate's correctness checks, a data loader warming up) and then settle (parameters, a steady loop) still ends
  on a graph that reads its stable inputs in place.

Calls: the first call runs the original body eagerly (it compiles and autotunes the Triton kernels); the
second captures (warm-up on a side stream, then capture into a private memory pool) and replays. A capture
that fails raises: the gate has then rejected the candidate in its worker before it could be installed.
Calls are not serialized with a lock (no ``threading`` in candidates): like Inductor's own wrappers, one
graph is called from one thread at a time.
"""

# BEGIN EMBEDDED
import torch


def _ts_reinterpret():
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    fn = getattr(guards, "_reinterpret_tensor", None)
    if fn is not None:
        return fn
    return lambda base, size, stride, offset: torch.as_strided(base, size, stride, offset)


def _ts_assert_size_stride():
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    fn = getattr(guards, "assert_size_stride", None)
    if fn is not None:
        return fn

    def check(t, size, stride):
        if tuple(t.size()) != tuple(size) or tuple(t.stride()) != tuple(stride):
            raise AssertionError(f"expected size {tuple(size)} stride {tuple(stride)}, got "
                                 f"size {tuple(t.size())} stride {tuple(t.stride())}")
    return check


_ts_reinterpret_tensor = _ts_reinterpret()
_ts_check_size_stride = _ts_assert_size_stride()


class _TilesmithCUDAGraphCall:
    """Replays an Inductor wrapper body from a CUDA graph (Tilesmith built-in generator ``cudagraph``).

    ``eager_call(args)`` is the original body (Inductor's ``Runner.call``); ``device`` the one CUDA device
    it runs on; ``written_inputs`` the input indices the body writes into (these are always staged in own
    buffers and copied back after each replay). See the module text above for the staging rules.
    """

    MAX_CAPTURES = 6
    HARD_CAP = 16
    PROMOTE_AFTER = 3
    REPROMOTE_AFTER = 16

    def __init__(self, eager_call, device, written_inputs=()):
        self.eager_call = eager_call
        self.device = torch.device(device)
        self.written = frozenset(int(i) for i in written_inputs)
        self.status = "eager: the first call runs the original body (kernel compilation and autotuning)"
        self.captures = 0
        self.replays = 0
        self._calls = 0
        self._prev_ptrs = None
        self._demoted = set()
        self._disabled = False
        self._final = False
        self._stage_all = False
        self._same = {}
        self._drop_graph()

    @property
    def pinned(self):
        """Input indices the current graph reads in place from the caller's tensors."""
        return tuple(i for i, _ in self._pinned_ptrs)

    @property
    def staged(self):
        """Input indices copied into own buffers before each replay."""
        return self._own

    # -- entry ----------------------------------------------------------------------------------
    def __call__(self, args):
        inputs = list(args)
        args.clear()
        return self._run(inputs)

    def _run(self, inputs):
        self._calls += 1
        ptrs = [t.data_ptr() if isinstance(t, torch.Tensor) else None for t in inputs]
        prev, self._prev_ptrs = self._prev_ptrs, ptrs
        same = self._same
        for i, p in enumerate(ptrs):  # consecutive calls each input arrived at the same address
            same[i] = same.get(i, 0) + 1 if p is not None and prev is not None and i < len(prev) and prev[i] == p else 0
        if self._disabled or self._calls == 1:
            return self.eager_call(inputs)
        if self._graph is not None:
            if len(inputs) == self._n_inputs:
                for i, size, stride in self._meta:
                    _ts_check_size_stride(inputs[i], size, stride)
            fits = self._fits(inputs, ptrs)
            if fits and (self.captures >= self.HARD_CAP or not self._promote()):
                return self._replay(inputs)
            if not fits:
                self._demoted.update(i for i, p in self._pinned_ptrs if i < len(ptrs) and ptrs[i] != p)
        if self.captures >= self.HARD_CAP or (self._graph is None and self.captures >= self.MAX_CAPTURES):
            return self.eager_call(inputs)
        if self.captures >= self.MAX_CAPTURES and not self._final and not self._fits(inputs, ptrs):
            # Captures used up and the pinned graph does not fit: one graph that stages every input (copied in
            # on each replay), which fits any addresses; later promotions may still pin settled inputs.
            self._final = self._stage_all = True
        # A capture failure propagates: the gate rejects such a candidate in its worker, with the reason,
        # instead of a broad handler silently keeping a slower path (the gate's static_try_except rule).
        self._capture(inputs, ptrs, prev)
        return self._replay(inputs)

    def _fits(self, inputs, ptrs):
        if len(inputs) != self._n_inputs:
            return False
        for i, p in self._pinned_ptrs:
            if ptrs[i] != p:
                return False
        for i, value in self._scalars:
            got = inputs[i]
            if type(got) is not type(value) or got != value:
                return False
        return True

    def _pinnable(self, i):
        """Input ``i`` may be read in place: not written by the body, and at one address long enough."""
        if i in self.written:
            return False
        need = self.REPROMOTE_AFTER if i in self._demoted else 1
        return self._same.get(i, 0) >= need

    def _promote(self):
        """True when a staged input has settled at one address and a re-capture should pin it."""
        for i in self._watch:
            need = self.REPROMOTE_AFTER if i in self._demoted else self.PROMOTE_AFTER
            if self._same.get(i, 0) >= need:
                return True
        return False

    # -- capture --------------------------------------------------------------------------------
    def _drop_graph(self):
        self._graph = None
        self._n_inputs = -1
        self._static = ()
        self._meta = ()
        self._pinned_ptrs = ()
        self._scalars = ()
        self._own = ()
        self._own_static = ()
        self._own_written = ()
        self._watch = ()
        self._plan = None
        self._keep = None
        self._groups = ()
        self._total = 0
        self._source = None
        self._spans = ()
        self._direct = None
        self._out = None
        self._container = tuple

    def _capture(self, inputs, ptrs, prev):
        self._drop_graph()
        self.captures += 1
        static, pinned, own, scalars = [], [], [], []
        for i, value in enumerate(inputs):
            if not isinstance(value, torch.Tensor):
                static.append(value)
                scalars.append((i, value))
            elif not self._stage_all and self._pinnable(i):
                static.append(value)
                pinned.append(i)
            else:
                static.append(torch.empty_strided(value.size(), value.stride(), dtype=value.dtype,
                                                  device=value.device))
                own.append(i)
        self._static = static
        self._n_inputs = len(inputs)
        self._pinned_ptrs = tuple((i, ptrs[i]) for i in pinned)
        self._scalars = tuple(scalars)
        self._own = tuple(own)
        self._own_static = [static[i] for i in own]
        self._own_written = tuple(i for i in own if i in self.written)
        self._watch = tuple(i for i in own if i not in self.written)
        self._stage_all = False
        self._meta = tuple((i, tuple(t.size()), tuple(t.stride())) for i, t in enumerate(inputs)
                           if isinstance(t, torch.Tensor))
        self._copy_in(inputs)
        warm = self._warm_up(lambda: self.eager_call(list(static)))

        def body():
            outs = self.eager_call(list(static))
            if self._plan is None:
                self._make_plan(outs, warm)
            return outs, self._gather(outs)

        self._graph, (outs, staging) = self._record(body)
        del warm
        self._keep = (outs, staging)  # the graph's output memory stays reserved while the graph lives
        self._finish_plan(outs, staging)
        self.status = (f"graph: capture {self.captures}, {len(pinned)} pinned and {len(own)} staged inputs, "
                       f"{len(self._plan)} outputs")

    def _warm_up(self, fn):
        """Run ``fn`` once on a side stream (what ``torch.cuda.graphs`` asks for before a capture)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(current)
        with torch.cuda.device(self.device), torch.cuda.stream(side):
            result = fn()
        current.wait_stream(side)
        self._side = side
        return result

    def _record(self, fn):
        """Capture ``fn`` into a new CUDA graph with a private memory pool; returns (graph, fn's result)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), stream=self._side,
                                  capture_error_mode="thread_local"):
                result = fn()
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        return graph, result

    def _replay_graph(self):
        with torch.cuda._DeviceGuard(self.device.index):
            self._graph.replay()

    # -- output plan ----------------------------------------------------------------------------
    def _make_plan(self, outs, warm):
        """Decide, per output, how each call returns it (see the module text); runs inside the capture."""
        plan, groups, by_storage = [], [], {}
        static = self._static
        storages = [(i, t.untyped_storage().data_ptr()) for i, t in enumerate(static) if isinstance(t, torch.Tensor)]
        for k, out in enumerate(outs):
            if not isinstance(out, torch.Tensor):
                plan.append(("value", out))
                continue
            same = [i for i, t in enumerate(static) if t is out]
            if same:
                plan.append(("input", same[0]))
                continue
            sptr = out.untyped_storage().data_ptr()
            alias = [i for i, p in storages if p == sptr and static[i].dtype == out.dtype]
            if alias:
                i = alias[0]
                plan.append(("input_view", i, tuple(out.size()), tuple(out.stride()),
                             out.storage_offset() - static[i].storage_offset()))
                continue
            if any(p == sptr for _, p in storages):
                raise RuntimeError(f"output {k} reinterprets an input with another dtype")
            before = warm[k] if isinstance(warm, (tuple, list)) and k < len(warm) else None
            if before is out:
                plan.append(("value", out))
                continue
            if isinstance(before, torch.Tensor) and before.untyped_storage().data_ptr() == sptr:
                plan.append(("static", out, tuple(out.size()), tuple(out.stride()), out.storage_offset()))
                continue
            if out.numel() == 0:
                plan.append(("empty", tuple(out.size()), tuple(out.stride()), out.dtype))
                continue
            itemsize = out.element_size()
            start = out.storage_offset() * itemsize
            extent = (sum((n - 1) * s for n, s in zip(out.size(), out.stride())) + 1) * itemsize
            if sptr not in by_storage:
                by_storage[sptr] = len(groups)
                groups.append({"outputs": [], "lo": start, "hi": start + extent})
            g = groups[by_storage[sptr]]
            g["outputs"].append(k)
            g["lo"], g["hi"] = min(g["lo"], start), max(g["hi"], start + extent)
            plan.append(("fresh", by_storage[sptr], start, tuple(out.size()), tuple(out.stride()), out.dtype))
        offset = 0
        for g in groups:
            g["lo"] -= g["lo"] % 16
            g["offset"] = offset
            offset += -(-(g["hi"] - g["lo"]) // 16) * 16
        self._plan, self._groups, self._total = plan, groups, offset
        self._container = list if isinstance(outs, list) else tuple

    def _group_view(self, outs, g):
        storage = outs[g["outputs"][0]].untyped_storage()
        view = torch.empty(0, dtype=torch.uint8, device=self.device)
        return view.set_(storage, g["lo"], (g["hi"] - g["lo"],), (1,))

    def _gather(self, outs):
        """Copy every fresh output group into one staging buffer (recorded into the graph), if several."""
        if len(self._groups) < 2:
            return None
        staging = torch.empty(self._total, dtype=torch.uint8, device=self.device)
        for g in self._groups:
            n = g["hi"] - g["lo"]
            staging[g["offset"]:g["offset"] + n].copy_(self._group_view(outs, g))
        return staging

    def _finish_plan(self, outs, staging):
        """Turn the plan into the flat lists the replay path walks (after the capture)."""
        template = [None] * len(self._plan)
        inputs_out, views_out, fresh_out, static_out, empty_out = [], [], [], [], []
        for k, entry in enumerate(self._plan):
            kind = entry[0]
            if kind == "value":
                template[k] = entry[1]
            elif kind == "input":
                inputs_out.append((k, entry[1]))
            elif kind == "input_view":
                views_out.append((k,) + tuple(entry[1:]))
            elif kind == "static":
                static_out.append((k,) + tuple(entry[1:]))
            elif kind == "empty":
                empty_out.append((k,) + tuple(entry[1:]))
            else:
                _, gi, start, size, stride, dtype = entry
                g = self._groups[gi]
                itemsize = torch.empty(0, dtype=dtype).element_size()
                fresh_out.append((k, dtype, size, stride, (start - g["lo"]) // itemsize, gi))
        direct = None
        if len(self._groups) == 1 and len(fresh_out) == 1:
            k = fresh_out[0][0]
            direct = (k, outs[k], self._plan[k][3], self._plan[k][4], self._plan[k][5])
            fresh_out = []
        elif len(self._groups) == 1:
            self._source = self._group_view(outs, self._groups[0])
        else:
            self._source = staging
        # One fresh allocation per storage group of the original outputs: outputs that shared a storage in the
        # original share one here, and no others (the gate compares aliasing between outputs).
        self._spans = tuple((g["offset"] if len(self._groups) > 1 else 0, g["hi"] - g["lo"],
                             -(-(g["hi"] - g["lo"]) // 16) * 16) for g in self._groups)
        self._direct = direct
        self._out = (template, tuple(inputs_out), tuple(views_out), tuple(fresh_out), None,
                     tuple(static_out), tuple(empty_out))

    # -- replay ---------------------------------------------------------------------------------
    def _copy_in(self, inputs):
        if self._own:
            torch._foreach_copy_(self._own_static, [inputs[i] for i in self._own])

    def _replay(self, inputs):
        self._copy_in(inputs)
        self._replay_graph()
        self.replays += 1
        if self._own_written:
            torch._foreach_copy_([inputs[i] for i in self._own_written],
                                 [self._static[i] for i in self._own_written])
        template, inputs_out, views_out, fresh_out, _, static_out, empty_out = self._out
        result = list(template)
        if self._direct is not None:
            k, src, size, stride, dtype = self._direct
            out = torch.empty_strided(size, stride, dtype=dtype, device=self.device)
            out.copy_(src)
            result[k] = out
        if fresh_out:
            groups = []
            for start, used, padded in self._spans:
                buf = torch.empty(padded, dtype=torch.uint8, device=self.device)
                buf[:used].copy_(self._source[start:start + used])
                groups.append(buf)
            for k, dtype, size, stride, offset, gi in fresh_out:
                base = groups[gi] if dtype == torch.uint8 else groups[gi].view(dtype)
                result[k] = _ts_reinterpret_tensor(base, size, stride, offset)
        for k, i in inputs_out:
            result[k] = inputs[i]
        for k, i, size, stride, delta in views_out:
            base = inputs[i]
            result[k] = _ts_reinterpret_tensor(base, size, stride, base.storage_offset() + delta)
        for k, t, size, stride, offset in static_out:
            result[k] = _ts_reinterpret_tensor(t, size, stride, offset)
        for k, size, stride, dtype in empty_out:
            result[k] = torch.empty_strided(size, stride, dtype=dtype, device=self.device)
        return self._container(result)
# END EMBEDDED
