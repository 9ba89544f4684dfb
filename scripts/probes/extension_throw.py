"""Which TORCH_CHECK messages crash an extension built here: integer streamed, to_string, plain ostringstream."""
import subprocess, sys, textwrap
SRC = r'''
#include <torch/extension.h>
#include <sstream>
void int_msg(int64_t n) { TORCH_CHECK(n < 1, "boom ", n); }
void str_msg(int64_t n) { TORCH_CHECK(n < 1, "boom ", std::to_string(n)); }
std::string stream_only(int64_t n) { std::ostringstream s; s << n; return s.str(); }
void plain_throw(int64_t n) { if (n > 0) throw std::runtime_error("plain " + std::to_string(n)); }
'''
BUILD = textwrap.dedent(f'''
    import torch, tempfile
    from torch.utils.cpp_extension import load_inline
    m = load_inline("ts_probe2", cpp_sources=[{SRC!r}], functions=["int_msg", "str_msg", "stream_only", "plain_throw"],
                    extra_cflags=["-O3", "-std=c++17"], build_directory="/tmp/probe2", verbose=False)
''')
import os; os.makedirs("/tmp/probe2", exist_ok=True)
p = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=200)
print("build rc", p.returncode, p.stderr[-400:] if p.returncode else "")
for call in ("m.stream_only(7)", "m.plain_throw(3)", "m.str_msg(3)", "m.int_msg(3)"):
    code = BUILD + f"try:\n    print('OK', {call})\nexcept Exception as e:\n    print('RAISED', type(e).__name__, str(e)[:60])\n"
    q = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    print(call, "rc", q.returncode, q.stdout.strip()[-200:])
