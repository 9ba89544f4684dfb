"""The main job: Tilesmith on two real models with random weights, then its benchmarks and diagnostics.

    python examples/main_job.py            # (the README's `make demo` runs this)

Models (examples/models.py, no downloads): a 64×1024→4096→1024 fp32 MLP block with GELU and a residual
LayerNorm (launch-bound: default Inductor is slower than eager on it), and a GPT-2-style transformer block in
bf16 (batch 8, 256 tokens, 768 wide). The optimizer is ``TILESMITH_MODEL`` when set, else the built-in
agent (``tilesmith/builtin``: no LLM, no keys), so this runs on a fresh GPU machine with nothing configured.

On a machine without CUDA it runs the same pipeline on CPU tensors in Tilesmith's CPU test mode
(``TILESMITH_ALLOW_CPU=1``, set here unless you set it yourself; ``TILESMITH_ALLOW_CPU=0`` shows the plain
``torch.compile`` fallback and its diagnostics instead): the built-in agent's configuration generator compiles
each graph again under other Inductor configurations (the C++ host wrapper, C++ GEMM templates) and the gate gives
a real verdict. CPU timings are a test of the pipeline, not a benchmark.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tilesmith  # noqa: E402
from examples.models import GPT2Block, MLPBlock, randomize_  # noqa: E402


def cases(device: str) -> list[tuple[str, torch.nn.Module, torch.Tensor]]:
    mlp = randomize_(MLPBlock()).to(device).eval()
    gpt2 = randomize_(GPT2Block()).to(device=device, dtype=torch.bfloat16).eval()
    return [
        ("mlp_fp32", mlp, torch.randn(64, 1024, device=device)),
        ("gpt2_block_bf16", gpt2, torch.randn(8, 256, 768, device=device, dtype=torch.bfloat16)),
    ]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TILESMITH_ALLOW_CPU", "1")
        print(f"no CUDA device: CPU test mode TILESMITH_ALLOW_CPU={os.environ['TILESMITH_ALLOW_CPU']} "
              "(pipeline check, not a benchmark)")
    agent = os.environ.get("TILESMITH_MODEL") or "tilesmith/builtin"
    print(f"tilesmith {tilesmith.__version__} | torch {torch.__version__} | device {device}"
          + (f" ({torch.cuda.get_device_name(0)})" if device == "cuda" else "") + f" | optimizer {agent}")
    failures = 0
    for name, model, x in cases(device):
        compiled = tilesmith.compile(model, example_inputs=(x,), agent_model=agent)
        started = time.perf_counter()
        with torch.no_grad():
            out = compiled(x)  # first call: Inductor compiles, then Tilesmith optimizes each graph
            expected = model(x)
            again = compiled(x)  # later calls run the installed wrapper (or Inductor's)
        elapsed = time.perf_counter() - started
        # Relative L2 error against eager: fp32 lands far under 1e-4, bf16 between 1e-3 and 1e-2
        # (bf16 keeps 8 mantissa bits: 2^-8 ≈ 4e-3 per rounding, a few roundings per element).
        tol = 2e-2 if x.dtype == torch.bfloat16 else 1e-4
        ok = all(_rel_err(y, expected) < tol for y in (out, again))
        failures += not ok
        print(f"\n== {name}: first call {elapsed:.1f} s, outputs {'match eager' if ok else 'DIFFER from eager'}")
        records = tilesmith.benchmarks(compiled)
        for r in records:
            lo, hi = r.speedup_ci
            floor = f", roofline floor {r.roofline_floor_ms:.4f} ms" if r.roofline_floor_ms else ""
            print(f"  benchmark {r.graph_name} [{r.graph_key[:8]}]: torch_inductor_ms={r.torch_inductor_ms:.4f} "
                  f"tilesmith_ms={r.tilesmith_ms:.4f} speedup={r.speedup:.3f} (95% CI {lo:.3f}-{hi:.3f}){floor}")
        if not records:
            print("  benchmarks: none installed")
        for d in tilesmith.diagnostics(compiled):
            where = f" [{d.graph_key[:8]}]" if d.graph_key else ""
            print(f"  diagnostic {d.kind}{where}: {d.message}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
