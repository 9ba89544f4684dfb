#!/usr/bin/env bash
# Create the development/CI virtual environment: torch (pinned, constraints/dev.txt) and Tilesmith with
# its dev extras, editable.
#
#   scripts/install-dev.sh [PYTHON] [VENV]        # defaults: python3 .venv
#
# Disk: PyPI's torch 2.11.0 wheel is the CUDA build; with its nvidia-* wheels it is ~5 GB installed. One
# `pip install torch` call downloads every wheel before it installs any (and pip's cache keeps a copy of each);
# that single call failed on a CI machine with "[Errno 28] No space left on device". Here the CUDA wheels go
# in one pip call each, with no pip cache, so the peak is the install plus the largest single wheel
# (measured in a fresh-clone .ci/run, df every 5 s: 5.6 GB at the peak, 5.1 GB after).
set -euo pipefail
PYTHON="${1:-python3}"
VENV="${2:-.venv}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONSTRAINTS="$REPO_ROOT/constraints/dev.txt"
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

echo "free disk before install: $(df -h "$REPO_ROOT" | awk 'NR==2 {print $4}')"
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# The CUDA runtime wheels torch 2.11.0 links against (and Triton), one at a time; their own
# dependencies are among these names, so --no-deps loses nothing.
for pkg in $(grep -E '^(nvidia-|cuda-|triton==)' "$CONSTRAINTS" | cut -d= -f1); do
    "$PY" -m pip install -q --no-deps -c "$CONSTRAINTS" "$pkg"
done
"$PY" -m pip install -q -c "$CONSTRAINTS" torch -e "$REPO_ROOT[dev]"
echo "free disk after install: $(df -h "$REPO_ROOT" | awk 'NR==2 {print $4}')"
