"""Which native-kernel error paths segfault on this machine (each in its own process), and does a minimal
load_inline extension's TORCH_CHECK throw crash too (toolchain) or not."""
import subprocess, sys, os, textwrap
CASES = {
 "rows17": "m.int8_linear(torch.empty(17,1024,device='cuda',dtype=torch.bfloat16), torch.zeros(64,1024,device='cuda',dtype=torch.int8), None, None, None, torch.bfloat16, 0)",
 "rows17_kernel": "m.int8_linear_kernel(torch.empty(17,1024,device='cuda',dtype=torch.bfloat16), torch.zeros(64,1024,device='cuda',dtype=torch.int8), 0)",
 "half": "m.int8_linear(torch.empty(1,1024,device='cuda',dtype=torch.half), torch.zeros(64,1024,device='cuda',dtype=torch.int8), None, None, None, torch.bfloat16, 0)",
 "cpu": "m.int8_linear(torch.empty(1,1024,dtype=torch.bfloat16), torch.zeros(64,1024,device='cuda',dtype=torch.int8))",
}
PRE = "import torch\nfrom tilesmith.kernels.build import ensure_built\nb = ensure_built('int8_linear', 'cuda:0')\nm = b.module\n"
for name, call in CASES.items():
    code = PRE + f"try:\n    {call}\n    print('NO-RAISE')\nexcept Exception as e:\n    print('RAISED', type(e).__name__, str(e)[:120])\n"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    print(name, "rc", p.returncode, p.stdout.strip()[-300:], p.stderr.strip()[-300:] if p.returncode else "")
INLINE = textwrap.dedent('''
    import torch
    from torch.utils.cpp_extension import load_inline
    src = "#include <torch/extension.h>\\nvoid boom(int64_t n) { TORCH_CHECK(n < 1, \\"boom \\", n); }\\n"
    m = load_inline("ts_throw_probe", cpp_sources=[src], functions=["boom"], extra_cflags=["-O3", "-std=c++17"],
                    build_directory=__import__("tempfile").mkdtemp(), verbose=False)
    try:
        m.boom(3); print("NO-RAISE")
    except Exception as e:
        print("RAISED", type(e).__name__, str(e)[:80])
''')
p = subprocess.run([sys.executable, "-c", INLINE], capture_output=True, text=True, timeout=200)
print("inline_probe rc", p.returncode, p.stdout.strip()[-300:], p.stderr.strip()[-600:] if p.returncode else "")
for tool in (["g++", "--version"], ["c++", "--version"], ["nvcc", "--version"]):
    try:
        print(tool[0], subprocess.run(tool, capture_output=True, text=True).stdout.splitlines()[0:1])
    except Exception as e:
        print(tool[0], e)
import torch; print("torch cxx abi", torch._C._GLIBCXX_USE_CXX11_ABI, torch.__config__.show().splitlines()[1:4])
