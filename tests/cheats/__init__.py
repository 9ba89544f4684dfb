"""Cheating candidates for the gate's cheat suite, derived from real Inductor wrappers by text edits.

``cpu.py`` edits CPU wrappers captured in test mode (run in CI); ``gpu.py`` edits CUDA wrappers
(run on the H200 by ``tests/gpu/test_gate_gpu.py``). Every cheat names the check id the gate must
reject it with — the *right* reason, not just any rejection.
"""
