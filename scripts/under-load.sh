#!/usr/bin/env bash
# Run a command with N busy-loop CPU burner processes beside it (issue 19: the test suite must pass on a machine
# that is doing other work). The burners are killed when the command ends, however it ends.
#
#   scripts/under-load.sh [-n 2] -- make test
#   scripts/under-load.sh -n 2 -- env CI=true bash .ci/run       # a fresh clone's CI under load
set -uo pipefail
n=2
if [[ "${1:-}" == "-n" ]]; then n="$2"; shift 2; fi
[[ "${1:-}" == "--" ]] && shift
[[ $# -gt 0 ]] || { echo "usage: $0 [-n N] -- command..." >&2; exit 2; }
pids=()
for _ in $(seq "$n"); do python3 -c "while True: pass" & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
echo "under-load: $n burners (pids ${pids[*]}) beside: $*" >&2
start=$(date +%s)
"$@"; rc=$?
echo "under-load: rc=$rc after $(( $(date +%s) - start )) s with $n burners" >&2
exit $rc
