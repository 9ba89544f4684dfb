"""Tilesmith's native CUDA C++ kernels against their bandwidth floor and torch.compile, at the issue's shapes.

    python bench/kernels.py --out kernels.json [--rounds 25] [--calls 20] [--fresh-build]

One run (a few minutes on the H200):

1. measures the device's copy bandwidth (``tilesmith.roofline.measure_device_limits``: a device-to-device
   copy, bytes read + bytes written, CUDA events) — the floor of every kernel below is the bytes it must move
   divided by this figure;
2. builds the four kernel families in parallel (first build time, or the time to load an existing build;
   ``--fresh-build`` builds into a new kernel directory), then loads them in a second Python process and
   reports that process's cached-load time;
3. checks each kernel against a float64 reference at the timed shape;
4. times, per pattern, the native kernel, ``torch.compile`` (default) and ``torch.compile(mode=
   "max-autotune-no-cudagraphs")`` of the same function — L2 flushed before every call (``--flush``: ``clean``,
   a 256 MiB read, and ``dirty``, a 256 MiB write, which leaves modified lines the timed call must write back;
   interleaved with each other and the arms, the first decides the criteria: :func:`make_flush`; with both, the
   native kernel's dirty/clean ratio is reported too) and only the call between the CUDA events; the arms
   interleaved in rounds whose order rotates; each arm's round value is the median of its calls; the reported
   ratios are medians of per-round ratios with a 95 % percentile-bootstrap interval
   (``tilesmith.gate.host.stats.paired_speedup``);
5. prints a short table last and writes everything to ``--out`` (JSON).

Patterns (the issue's shapes): int8 weight-only GEMV ``r + (x @ W.to(bf16).T) * scale`` with x 1×14336 bf16,
W 4096×14336 int8; two fused fp32 softmaxes ``softmax(a) + softmax(b)`` over 32768×8192; residual + RMSNorm
(returning the normalized rows and ``x + r``) and residual + LayerNorm over 32768×4096 bf16;
``silu(GroupNorm(32, 512)(x))`` over x 16×512×64×64 bf16 (the suite's ``groupnorm_silu_bf16``; forced variants
``native_register_256`` (4), ``native_looped`` (2), ``native_scalar`` (3)).
Criteria from the issue, reported in ``criteria``: each native kernel ≤ 1.3× its floor; the int8 GEMV ≥ 2×
faster than max-autotune-no-cudagraphs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

BF = torch.bfloat16
FLUSH_BYTES = 256 << 20


def _fresh(fn: Any, tag: str) -> Any:
    """A copy of ``fn`` with its own code object, so each torch.compile arm has its own Dynamo cache entry."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def int8_gemv(x, w, s, r):
    return r + (x @ w.to(torch.bfloat16).T) * s


def two_softmax(a, b):
    return torch.softmax(a, -1) + torch.softmax(b, -1)


def rms_residual(x, r, w):
    h = x + r
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w, h


def ln_residual(x, r, w, b):
    return torch.nn.functional.layer_norm(x + r, (x.shape[-1],), w, b, 1e-5)


def gn_silu(x, w, b):
    return torch.nn.functional.silu(torch.nn.functional.group_norm(x, 32, w, b, 1e-5))


def patterns(mods: dict[str, Any]) -> list[dict[str, Any]]:
    """Name, function, inputs, native call, bytes and float64 reference of each timed pattern."""
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = "cuda"
    x = torch.randn(1, 14336, device=dev, generator=g).to(BF)
    w = torch.randint(-128, 128, (4096, 14336), device=dev, dtype=torch.int8, generator=g)
    s = (torch.rand(4096, device=dev, generator=g) * 0.02 + 1e-3).to(BF)
    r = torch.randn(1, 4096, device=dev, generator=g).to(BF)
    a = torch.randn(32768, 8192, device=dev, generator=g)
    b = torch.randn(32768, 8192, device=dev, generator=g)
    hx = torch.randn(32768, 4096, device=dev, generator=g).to(BF)
    hr = torch.randn(32768, 4096, device=dev, generator=g).to(BF)
    nw = (torch.rand(4096, device=dev, generator=g) + 0.5).to(BF)
    nb = torch.randn(4096, device=dev, generator=g).to(BF)
    gx = torch.randn(16, 512, 64, 64, device=dev, generator=g).to(BF)
    gw = (torch.rand(512, device=dev, generator=g) + 0.5).to(BF)
    gb = torch.randn(512, device=dev, generator=g).to(BF)
    i8, sm, nm, gn = mods["int8_linear"], mods["softmax"], mods["norm"], mods["group_norm"]

    def nbytes(*ts: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    def ref_int8() -> list[torch.Tensor]:
        acc = (x.double() @ w.double().T).to(BF).double()
        return [r.double() + acc * s.double()]

    def ref_rms() -> list[torch.Tensor]:
        h = hx + hr
        hd = h.double()
        y = (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF).double() * nw.double()
        return [y, h.double()]

    def ref_ln() -> list[torch.Tensor]:
        hd = (hx + hr).double()
        return [torch.nn.functional.layer_norm(hd, (4096,), nw.double(), nb.double(), 1e-5)]

    return [
        {"name": "int8_gemv", "shape": "x 1x14336 bf16, W 4096x14336 int8, scale/residual bf16",
         "fn": int8_gemv, "inputs": (x, w, s, r), "dtype": BF,
         "native": {"native": lambda: i8.int8_linear(x, w, s, None, r, BF, 0),
                    "native_fma": lambda: i8.int8_linear(x, w, s, None, r, BF, 1),
                    "native_fma_splitk": lambda: i8.int8_linear(x, w, s, None, r, BF, 4),
                    "native_mma": lambda: i8.int8_linear(x, w, s, None, r, BF, 2)},
         "kernel": i8.int8_linear_kernel(x, w, 0), "bytes": nbytes(x, w, s, r) + 4096 * 2, "ref": ref_int8},
        {"name": "two_softmax_fp32", "shape": "softmax(a) + softmax(b), 32768x8192 fp32", "fn": two_softmax,
         "inputs": (a, b), "dtype": torch.float32,
         "native": {"native": lambda: sm.softmax(a, b, 1.0, None, 1.0, None, 0),
                    "native_register": lambda: sm.softmax(a, b, 1.0, None, 1.0, None, 1),
                    "native_staged": lambda: sm.softmax(a, b, 1.0, None, 1.0, None, 3),
                    "native_looped": lambda: sm.softmax(a, b, 1.0, None, 1.0, None, 2)},
         "kernel": sm.softmax_kernel(a, b, 0),
         "bytes": nbytes(a, b, a), "ref": lambda: [torch.softmax(a.double(), -1) + torch.softmax(b.double(), -1)]},
        {"name": "residual_rmsnorm_bf16", "shape": "h = x + r; rmsnorm(h) * w; returns (out, h), 32768x4096 bf16",
         "fn": rms_residual, "inputs": (hx, hr, nw), "dtype": BF,
         "native": {"native": lambda: nm.rms_norm(hx, hr, nw, 1e-6, True, True, 0),
                    "native_v1": lambda: nm.rms_norm(hx, hr, nw, 1e-6, True, True, 1)}, "kernel": "packed",
         "bytes": nbytes(hx, hr, nw) + 2 * nbytes(hx), "ref": ref_rms},
        {"name": "residual_layernorm_bf16", "shape": "layer_norm(x + r, w, b), 32768x4096 bf16", "fn": ln_residual,
         "inputs": (hx, hr, nw, nb), "dtype": BF,
         "native": {"native": lambda: nm.layer_norm(hx, hr, nw, nb, 1e-5, False, 0),
                    "native_v1": lambda: nm.layer_norm(hx, hr, nw, nb, 1e-5, False, 1)}, "kernel": "packed",
         "bytes": nbytes(hx, hr, nw, nb) + nbytes(hx), "ref": ref_ln},
        {"name": "groupnorm_silu_bf16", "shape": "silu(GroupNorm(32, 512)(x)), x 16x512x64x64 bf16, affine bf16",
         "fn": gn_silu, "inputs": (gx, gw, gb), "dtype": BF,
         "native": {"native": lambda: gn.group_norm(gx, gw, gb, 32, 1e-5, True, False, 0),
                    "native_register_256": lambda: gn.group_norm(gx, gw, gb, 32, 1e-5, True, False, 4),
                    "native_looped": lambda: gn.group_norm(gx, gw, gb, 32, 1e-5, True, False, 2),
                    "native_scalar": lambda: gn.group_norm(gx, gw, gb, 32, 1e-5, True, False, 3)},
         "kernel": gn.group_norm_kernel(gx, 32, 0), "bytes": 2 * nbytes(gx) + nbytes(gw, gb),
         "ref": lambda: [gn_silu(gx.double(), gw.double(), gb.double())]},
    ]


def as_list(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def check(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """Max errors against the float64 reference and the verdict at the gate's tolerance for ``dtype``."""
    rtol, atol = (1.6e-2, 1e-2) if dtype == BF else (1e-4, 1e-5)
    worst_abs = worst_rel = 0.0
    ok = len(got) == len(want)
    for g_, w_ in zip(got, want, strict=False):
        diff = (g_.double() - w_).abs()
        scale = max(1.0, float(w_.abs().max()))
        worst_abs = max(worst_abs, float(diff.max()))
        worst_rel = max(worst_rel, float((diff / w_.abs().clamp_min(1e-30)).max()))
        ok = ok and bool((diff <= atol * scale + rtol * w_.abs()).all())
    return {"ok": ok, "max_abs_err": worst_abs, "max_rel_err": worst_rel, "rtol": rtol, "atol": atol}


def show(d: dict[str, float]) -> str:
    """A ratio record as ``median [low,high]``."""
    return f"{d['median']:.2f} [{d['ci_low']:.2f},{d['ci_high']:.2f}]"


def make_flush(mode: str):
    """The L2 flush run before every timed call. ``dirty``: zero a 256 MiB buffer (the suite's flush,
    bench/harness.py) — it leaves the L2 full of *modified* lines, which the timed call then writes back to DRAM
    while it streams its own bytes (up to the L2's size: 50 MB on an H100, a large share of a 58.7 MB GEMV's
    traffic, none of which the floor counts). ``clean``: read a 256 MiB buffer written once at set-up (a sum) —
    the L2 is then as cold but holds only clean lines, so the timed call moves only its own bytes, which is
    what the floor (bytes it must move / copy bandwidth) assumes."""
    buf = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    if mode == "dirty":
        return buf.zero_
    if mode == "clean":
        return lambda: buf.sum()
    raise ValueError(f"flush mode {mode!r}: clean or dirty")


def time_arms(arms: dict[str, Any], rounds: int, calls: int,
              flush_modes: list[str]) -> dict[str, dict[str, list[float]]]:
    """``{flush mode: {arm: per-round medians (ms)}}`` of single calls, the L2 flushed before each
    (:func:`make_flush`); in every round each flush mode and, within it, each arm, in orders that rotate per round,
    so both the arms and the flush modes are compared interleaved."""
    flushes = {mode: make_flush(mode) for mode in flush_modes}
    names = list(arms)
    for name in names:  # warm-up (compilation, autotuning, first-call allocations)
        for _ in range(3):
            arms[name]()
    torch.cuda.synchronize()
    per_round: dict[str, dict[str, list[float]]] = {m: {n: [] for n in names} for m in flush_modes}
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for i in range(rounds):
        for mode in flush_modes[i % len(flush_modes):] + flush_modes[:i % len(flush_modes)]:
            flush = flushes[mode]
            for name in names[i % len(names):] + names[:i % len(names)]:
                fn = arms[name]
                for start, end in events:
                    flush()
                    start.record()
                    fn()
                    end.record()
                torch.cuda.synchronize()
                times = sorted(s.elapsed_time(e) for s, e in events)
                per_round[mode][name].append(times[len(times) // 2])
    return per_round


def cached_load_in_second_process(keys: dict[str, str]) -> dict[str, Any]:
    """Import each build in a fresh interpreter (no compiler runs); seconds per family and torch import."""
    code = (
        "import json, sys, time\n"
        "t0 = time.perf_counter(); import torch; torch.cuda.init(); t1 = time.perf_counter()\n"
        "from tilesmith.kernels.runtime import native_module\n"
        "out = {'torch_import_s': t1 - t0}\n"
        "for family, key in json.loads(sys.argv[1]).items():\n"
        "    s = time.perf_counter(); native_module(family, key); out[family] = time.perf_counter() - s\n"
        "print(json.dumps(out))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(keys)], capture_output=True, text=True,
                          timeout=300, env=env, check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--calls", type=int, default=20, help="timed calls per arm per round (median taken)")
    ap.add_argument("--fresh-build", action="store_true", help="build into a new, empty kernel directory")
    ap.add_argument("--only", default="", help="comma-separated pattern names (default: all)")
    ap.add_argument("--flush", default="clean,dirty",
                    help="L2 flush modes before each call, comma-separated (make_flush); the first decides the "
                         "criteria, the others are reported beside it")
    args = ap.parse_args(argv)
    flushes = [f for f in args.flush.split(",") if f]
    for f in flushes:
        if f not in ("clean", "dirty"):
            ap.error(f"--flush {f!r}: clean or dirty")
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    if args.fresh_build:
        os.environ["TILESMITH_KERNEL_DIR"] = tempfile.mkdtemp(prefix="tilesmith-kernels-")
    from tilesmith.gate.host.stats import paired_speedup
    from tilesmith.kernels.build import ensure_built_many
    from tilesmith.kernels.runtime import FAMILIES, kernel_dir
    from tilesmith.roofline import measure_device_limits

    started = time.perf_counter()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "capability": list(torch.cuda.get_device_capability()), "kernel_dir": str(kernel_dir())}
    limits = measure_device_limits("cuda:0")
    result["copy_gbps"] = limits.copy_gbps
    print(f"copy bandwidth {limits.copy_gbps:.0f} GB/s (read + write) on {result['device']}", flush=True)

    t0 = time.perf_counter()
    builds = ensure_built_many(FAMILIES, "cuda:0")
    failed = {f: str(b) for f, b in builds.items() if isinstance(b, Exception)}
    if failed:
        for f, msg in failed.items():
            print(f"BUILD FAILED {f}: {msg}", file=sys.stderr)
        Path(args.out).write_text(json.dumps({**result, "build_errors": failed}, indent=1))
        return 1
    result["builds"] = {f: {"built": b.built, "seconds": b.seconds, "arch": b.key.arch, "key": b.key.key,
                            "nvcc": b.key.nvcc_version} for f, b in builds.items()}
    result["build_wall_s"] = time.perf_counter() - t0
    for f, b in builds.items():
        print(f"{f}: {'built' if b.built else 'loaded existing build'} in {b.seconds:.2f} s ({b.key.arch})", flush=True)
    result["cached_load_second_process_s"] = cached_load_in_second_process({f: b.key.key for f, b in builds.items()})
    print(f"second process, cached load: {result['cached_load_second_process_s']}", flush=True)

    mods = {f: b.module for f, b in builds.items()}
    only = {n for n in args.only.split(",") if n}
    rows = []
    result["patterns"] = []
    for pat in patterns(mods):
        if only and pat["name"] not in only:
            continue
        p0 = time.perf_counter()
        native = pat["native"]
        want = pat["ref"]()
        correctness = {name: check(as_list(call()), want, pat["dtype"]) for name, call in native.items()}
        del want
        compiled = {}
        compile_s = {}
        for arm, mode in (("inductor", None), ("max_autotune", "max-autotune-no-cudagraphs")):
            fn = torch.compile(_fresh(pat["fn"], arm), mode=mode) if mode else torch.compile(_fresh(pat["fn"], arm))
            c0 = time.perf_counter()
            with torch.no_grad():
                out = fn(*pat["inputs"])
            torch.cuda.synchronize()
            compile_s[arm] = time.perf_counter() - c0
            correctness[arm] = check(as_list(out), [t.double() for t in as_list(native["native"]())], pat["dtype"])
            compiled[arm] = (lambda f=fn, xs=pat["inputs"]: f(*xs))
        arms = {**native, **compiled}
        floor_ms = pat["bytes"] / (limits.copy_gbps * 1e9) * 1e3
        floor = [floor_ms] * args.rounds

        def ratio(num: list[float], den: list[float]) -> dict[str, float]:
            st = paired_speedup(num, den)
            return {"median": st.speedup, "ci_low": st.ci_low, "ci_high": st.ci_high}

        by_flush = {}
        with torch.no_grad():
            timed = time_arms(arms, args.rounds, args.calls, flushes)
        for mode, samples in timed.items():
            by_flush[mode] = {"median_ms": {k: sorted(v)[len(v) // 2] for k, v in samples.items()},
                              "samples_ms": samples,
                              "native_over_floor": ratio(samples["native"], floor),
                              "inductor_over_native": ratio(samples["inductor"], samples["native"]),
                              "max_autotune_over_native": ratio(samples["max_autotune"], samples["native"])}
            m = by_flush[mode]["median_ms"]
            print(f"{pat['name']} ({mode} L2): floor {floor_ms:.4f} ms, native {m['native']:.4f} ms "
                  f"({by_flush[mode]['native_over_floor']['median']:.2f}x), inductor {m['inductor']:.4f} ms, "
                  f"max-autotune {m['max_autotune']:.4f} ms", flush=True)
        if {"clean", "dirty"} <= set(timed):  # the flush's own effect, from interleaved rounds
            by_flush[flushes[0]]["native_dirty_over_clean"] = ratio(timed["dirty"]["native"], timed["clean"]["native"])
        entry = {"name": pat["name"], "shape": pat["shape"], "bytes": pat["bytes"], "floor_ms": floor_ms,
                 "kernel": pat["kernel"], "compile_s": compile_s, "correctness": correctness, "flush": flushes[0],
                 **by_flush[flushes[0]], "by_flush": {k: v for k, v in by_flush.items() if k != flushes[0]},
                 "wall_s": time.perf_counter() - p0}
        result["patterns"].append(entry)
        rows.append(entry)
        del compiled, arms
        torch._dynamo.reset()
        torch.cuda.empty_cache()

    crit = {}
    for e in rows:
        crit[f"{e['name']}: native <= 1.3x floor"] = e["native_over_floor"]["median"] <= 1.3
        crit[f"{e['name']}: correct"] = all(c["ok"] for c in e["correctness"].values())
    gemv = next((e for e in rows if e["name"] == "int8_gemv"), None)
    if gemv:
        crit["int8_gemv: >= 2x faster than max-autotune-no-cudagraphs"] = gemv["max_autotune_over_native"]["median"] >= 2
    result["criteria"] = crit
    result["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(result, indent=1))

    print(f"\nnative kernels vs floor and torch.compile ({result['device']}, copy {limits.copy_gbps:.0f} GB/s, "
          f"{args.rounds} rounds x {args.calls} calls, {flushes[0]} L2 flush; ratios: median of per-round ratios "
          f"[95% CI])")
    print(f"{'pattern':26s} {'floor ms':>9s} {'native ms':>10s} {'x floor':>18s} {'inductor ms':>12s} {'x native':>18s}"
          f" {'max-at ms':>10s} {'x native':>18s}  ok")
    for e in rows:
        m = e["median_ms"]
        ok = all(c["ok"] for c in e["correctness"].values())
        print(f"{e['name']:26s} {e['floor_ms']:9.4f} {m['native']:10.4f} {show(e['native_over_floor']):>18s} "
              f"{m['inductor']:12.4f} {show(e['inductor_over_native']):>18s} {m['max_autotune']:10.4f} "
              f"{show(e['max_autotune_over_native']):>18s}  {'yes' if ok else 'NO'}")
    for e in rows:
        if "native_dirty_over_clean" in e:
            print(f"{e['name']}: native after the dirty flush / after the clean flush = "
                  f"{show(e['native_dirty_over_clean'])}")
        for mode, other in e["by_flush"].items():
            print(f"{e['name']} with the {mode} flush: native {other['median_ms']['native']:.4f} ms = "
                  f"{show(other['native_over_floor'])} x floor")
        extra = ", ".join(f"{k} {v:.4f} ms" for k, v in e["median_ms"].items() if k.startswith("native_"))
        if extra:
            print(f"{e['name']}: auto picks {e['kernel']}; forced variants: {extra}")
    builds_line = ", ".join(f"{f} {'built' if b['built'] else 'loaded'} {b['seconds']:.1f} s"
                            for f, b in result["builds"].items())
    print(f"builds: {builds_line} (wall {result['build_wall_s']:.1f} s); second-process load: "
          f"{result['cached_load_second_process_s']}")
    print("criteria: " + "; ".join(f"{k}: {'PASS' if v else 'FAIL'}" for k, v in crit.items()))
    print(f"total {result['wall_s']:.0f} s; JSON: {args.out}")
    return 0 if all(e_ok for e_ok in (all(c["ok"] for c in e["correctness"].values()) for e in rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
