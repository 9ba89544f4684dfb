#!/usr/bin/env bash
# The GPU test suite and the benchmarks, in one call on a CUDA machine (the H200 through the device tool).
#
#   scripts/gpu-suite.sh [tests] [main] [overhead] [kernels] [cache] [bench] [calib] [llm] [verify] [fork]   # default: tests main overhead
#   scripts/gpu-suite.sh verify                 # production verification: GPU tests + bench/verify_cost.py (< 4 min)
#   GPU_TESTS="tests/gpu/test_gate_gpu.py" scripts/gpu-suite.sh tests              # a subset of the GPU tests
#   PYTEST_ARGS="--timeout 150 --maxfail 8" scripts/gpu-suite.sh tests verify      # extra pytest arguments
#   scripts/gpu-suite.sh bench                  # the benchmark suite, fresh, within 530 s (docs/benchmarks.md)
#   BENCH_RESUME=1 scripts/gpu-suite.sh bench   # continue it in the next call (cases the budget skipped)
#   BENCH_CASES=part2 BENCH_BUDGET_S=300 BENCH_ARGS="--rounds 30" scripts/gpu-suite.sh bench
#   FORK_REPEATS=2 scripts/gpu-suite.sh fork     # the fork server's CUDA zygote, worker starts and gate cost, on/off interleaved
#   CALIB_ARGS="--aa 200 --gain 50" scripts/gpu-suite.sh calib
#   CACHE_RECHECK=background CACHE_REPEATS=2 scripts/gpu-suite.sh cache                # default: both modes, 3 pairs
#   CACHE_RECHECK=background CACHE_ARGS="--profile" scripts/gpu-suite.sh cache         # extra bench/cache_hit.py args
#
# Results go to $OUT (the device tool's output folder) or ./gpu-out. Wheels for packages missing on the
# machine (the LLM stack) travel in .device/whl and are installed to /tmp/site first when present; a
# CLIProxyAPI binary travels as .device/cli-proxy-api.gz; bubblewrap for the agent's gpu_shell as the .deb files in
# .device/bwrap-debs (scripts/bwrap-bundle.sh download), unpacked to /tmp/tilesmith-bwrap (TILESMITH_BWRAP).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-gpu}"
export TILESMITH_CACHE_DIR="${TILESMITH_CACHE_DIR:-/tmp/tilesmith-gpu}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if [[ -z "${SKIP_WHEELS:-}" ]] && compgen -G ".device/whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .device/whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [[ -z "${SKIP_WHEELS:-}" && -f .device/cli-proxy-api.gz ]]; then
  mkdir -p .cache/bin && gunzip -c .device/cli-proxy-api.gz > .cache/bin/cli-proxy-api && chmod +x .cache/bin/cli-proxy-api
fi
if [[ -z "${TILESMITH_BWRAP:-}" ]] && ! command -v bwrap >/dev/null 2>&1 && compgen -G ".device/bwrap-debs/*.deb" >/dev/null; then
  scripts/bwrap-bundle.sh install .device/bwrap-debs /tmp/tilesmith-bwrap && export TILESMITH_BWRAP=/tmp/tilesmith-bwrap/bwrap
fi
parts=("$@"); [[ ${#parts[@]} -eq 0 ]] && parts=(tests main overhead)
# pytest adds -q and -v up: a -v in PYTEST_ARGS would only cancel the default -q (session 14's log had dots only).
# PYTEST_ARGS is split on spaces: pass node ids through GPU_TESTS rather than -k "a or b".
QUIET=-q; [[ " ${PYTEST_ARGS:-} " =~ \ -v+\  ]] && QUIET=
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
for part in "${parts[@]}"; do
  echo "=== $part ($(date +%T))"
  case "$part" in
    tests)    "$PY" -m pytest $QUIET -ra -s -m gpu -p no:cacheprovider ${PYTEST_ARGS:-} ${GPU_TESTS:-tests/gpu tests/test_roofline.py \
                tests/test_bench_suite.py tests/test_llm_profiling.py} 2>&1 | tee "$OUT/gpu-tests.log" | grep -vE "^DEBUG" ; rc=$((rc|${PIPESTATUS[0]})) ;;
    main)     "$PY" examples/main_job.py 2>&1 | tee "$OUT/main-job.log"; rc=$((rc|${PIPESTATUS[0]})) ;;
    overhead) "$PY" bench/call_overhead.py 2>&1 | tee "$OUT/call-overhead.log"; rc=$((rc|${PIPESTATUS[0]})) ;;
    kernels)  "$PY" bench/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"; rc=$((rc|${PIPESTATUS[0]})) ;;
    cache)    for mode in ${CACHE_RECHECK:-blocking background}; do
                "$PY" bench/cache_hit.py --device cuda --repeats "${CACHE_REPEATS:-3}" --recheck "$mode" \
                  --out "$OUT/cache-hit-$mode${CACHE_TAG:-}" ${CACHE_ARGS:-} 2>&1 | tee "$OUT/cache-hit-$mode${CACHE_TAG:-}.log"; rc=$((rc|${PIPESTATUS[0]}))
              done ;;
    bench)    bout="${BENCH_OUT:-/tmp/tilesmith-bench}"   # survives between calls while the machine stays warm
              [[ -n "${BENCH_RESUME:-}" ]] || rm -rf "$bout"/results.json "$bout"/limits.json "$bout"/tilesmith-cache
              "$PY" bench/suite.py --out "$bout" ${BENCH_RESUME:+--resume} --budget-s "${BENCH_BUDGET_S:-530}" \
                --timeout-per-case "${BENCH_CASE_TIMEOUT_S:-420}" --cases "${BENCH_CASES:-part1,part2,part3,part4,part5,part6,part7}" \
                ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"; rc=$((rc|${PIPESTATUS[0]}))
              mkdir -p "$OUT/benchmarks/logs"
              cp "$bout"/results.json "$bout"/results.md "$bout"/limits.json "$OUT/benchmarks/" 2>/dev/null
              cp "$bout"/results.png "$OUT/benchmarks/" 2>/dev/null; cp "$bout"/logs/*.log "$OUT/benchmarks/logs/" 2>/dev/null
              ;;
    verify)   "$PY" -m pytest $QUIET -ra -s -m gpu -p no:cacheprovider ${PYTEST_ARGS:-} tests/gpu/test_verify_gpu.py 2>&1 | tee "$OUT/verify-tests.log" \
                | grep -vE "^DEBUG"; rc=$((rc|${PIPESTATUS[0]}))
              "$PY" bench/verify_cost.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/verify-cost.log"; rc=$((rc|${PIPESTATUS[0]})) ;;
    fork)     # the fork server on CUDA (issue 19): where the zygote initialises the driver, then worker starts and gate
              # cost with it on and off, interleaved (FORK_REPEATS pairs)
              { timeout 90 "$PY" scripts/probes/zygote_cuinit.py steps; PYTORCH_NVML_BASED_CUDA_CHECK=1 timeout 90 \
                  "$PY" scripts/probes/zygote_cuinit.py zygote; } 2>&1 | tee "$OUT/zygote-probe.log"
              for fs in 1 0; do TILESMITH_GATE_FORKSERVER=$fs timeout 150 "$PY" bench/worker_start.py --starts 3 \
                  --device-type cuda --out "$OUT/worker-start-fs$fs.json" 2>&1 | tee "$OUT/worker-start-fs$fs.log"; done
              for i in $(seq "${FORK_REPEATS:-2}"); do for fs in 1 0; do
                TILESMITH_GATE_FORKSERVER=$fs timeout 200 "$PY" bench/gate_cost.py --graphs small --small-shape 4096,1024 \
                  --repeats 3 --out "$OUT/gate-cost-fs$fs-$i.json" 2>&1 | tee "$OUT/gate-cost-fs$fs-$i.log"
              done; done ;;
    calib)    "$PY" bench/gate_calibration.py ${CALIB_ARGS:-} 2>&1 | tee "$OUT/gate-calibration.log"; rc=$((rc|${PIPESTATUS[0]})) ;;
    llm)      "$PY" -m pytest $QUIET -ra -s -m gpu -p no:cacheprovider ${PYTEST_ARGS:-} tests/gpu/test_llm_e2e_gpu.py tests/gpu/test_llm_shell_gpu.py 2>&1 | tee "$OUT/llm-e2e.log"; rc=$((rc|${PIPESTATUS[0]})) ;;
    *)        echo "unknown part $part"; rc=2 ;;
  esac
done
echo "=== done rc=$rc ($(date +%T))"
exit $rc
