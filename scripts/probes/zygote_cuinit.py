"""Which step of a CUDA zygote's start initialises CUDA's driver (cuInit) or starts a thread, so that the fork
server refuses to fork (tilesmith.gate.worker.zygote._refusal). Prints, after each import, the process's threads
and what ``cuCtxGetCurrent`` answers (3 = CUDA_ERROR_NOT_INITIALIZED: cuInit has not run).

    python3 scripts/probes/zygote_cuinit.py steps    # torch, Inductor's modules, Triton, torch.cuda.is_available()
    python3 scripts/probes/zygote_cuinit.py zygote   # the zygote's own start: protect_zygote, prewarm, _refusal
"""
import os, importlib, sys
for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"): os.environ[k] = "1"
def threads():
    return [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
import ctypes
def cuinit():
    try: lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError: return "not loaded"
    c = ctypes.c_void_p(); return lib.cuCtxGetCurrent(ctypes.byref(c))
def st(tag): print(f"{tag}: threads={threads()} cuCtxGetCurrent={cuinit()}", flush=True)
st("start")
import torch; st("torch")
mode = sys.argv[1]
if mode == "steps":
    for n in ["torch._inductor.codecache", "torch._inductor.async_compile", "torch._inductor.utils",
              "torch._inductor.runtime.triton_heuristics", "triton"]:
        importlib.import_module(n); st(n)
    print("is_available", torch.cuda.is_available()); st("is_available")
else:
    from tilesmith.gate.worker.confine import protect_zygote
    protect_zygote(); st("protect_zygote")
    from tilesmith.gate.worker.core import prewarm
    prewarm("cuda"); st("prewarm")
    from tilesmith.gate.worker.zygote import _refusal
    print("refusal:", _refusal())
