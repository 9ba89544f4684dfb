"""Tilesmith: LLM-agent optimization of TorchInductor wrappers behind a host-owned gate.

Public surface: :func:`compile`, :func:`benchmarks`, :func:`diagnostics`, the records they return, and
the exception base class. Importing ``tilesmith`` loads neither the agent stack nor ``torch._inductor``.
"""

from tilesmith.api import benchmarks, compile, diagnostics, wait
from tilesmith.errors import TilesmithError
from tilesmith.records import BenchmarkRecord, Diagnostic

__version__ = "0.2.0"

__all__ = ["BenchmarkRecord", "Diagnostic", "TilesmithError", "__version__", "benchmarks", "compile", "diagnostics", "wait"]
