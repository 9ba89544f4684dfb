"""The agent's profile_attempt tool: per-kernel times measured in a subprocess (CPU here, CUDA on the H200)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tilesmith.agent.llm.profiling import profile_source

FIXTURES = Path(__file__).parent / "fixtures" / "inductor-h200"

CPU_WRAPPER = '''
import torch

def get_args():
    return [torch.randn(64, 128), torch.randn(128, 32)]

def call(args):
    a, b = args
    args.clear()
    return (torch.tanh(torch.mm(a, b)),)
'''


def test_profile_reports_per_op_times_of_a_cpu_wrapper(tmp_path):
    path = tmp_path / "attempt_01.py"
    path.write_text(CPU_WRAPPER)
    text = profile_source(path, None, timeout_s=120)
    assert text.startswith("per-kernel CPU time over 10 calls"), text
    assert "aten::mm" in text and "aten::tanh" in text and "total us/call" in text


def test_profile_of_a_crashing_attempt_returns_the_error_text(tmp_path):
    path = tmp_path / "attempt_01.py"
    path.write_text("raise RuntimeError('kernel exploded at line 7')\n")
    text = profile_source(path, None, timeout_s=120)
    assert text.startswith("profiling failed (exit code 1)") and "kernel exploded at line 7" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profile_reports_triton_and_extern_kernel_times_of_a_real_inductor_wrapper(tmp_path):
    path = tmp_path / "attempt_00.py"
    shutil.copy(FIXTURES / "mlp_fp32_infer__00.wrapper.py", path)
    text = profile_source(path, None, timeout_s=600)
    assert text.startswith("per-kernel device time over 10 calls"), text
    assert "triton_poi_fused_addmm_gelu_0" in text and "triton_per_fused_add_addmm_native_layer_norm_1" in text
