"""Tilesmith benchmark suite: see bench/suite.py and docs/benchmarks.md."""
