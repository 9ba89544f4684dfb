#!/usr/bin/env bash
# What the H200 (no network) needs beside this checkout for the LLM part of scripts/gpu-suite.sh, into .device/
# (gitignored; name it in the device tool's `carry`):
#   .device/whl/              wheels (CPython 3.12, manylinux x86_64) of the packages in this checkout's .venv that the
#                             machine's image lacks (the image's package list: $IMAGE_LIST, one name per line, or the
#                             "Packages:" line of the device library's list of machine kinds, $KINDS_MD)
#   .device/cli-proxy-api.gz  the CLIProxyAPI binary `make proxy` built
#   .device/bwrap-debs/       bubblewrap for the agent's gpu_shell (scripts/bwrap-bundle.sh download)
# Usage: scripts/device-bundle.sh   (after `make install proxy`; needs network; ~25 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
KINDS="${KINDS_MD:-../.library/device/KINDS.md}"
list="$(mktemp)"; trap 'rm -f "$list"' EXIT
if [[ -n "${IMAGE_LIST:-}" ]]; then
  tr 'A-Z_' 'a-z-' < "$IMAGE_LIST" | sort -u > "$list"
else
  grep -o 'Packages: .*' "$KINDS" | head -1 | sed 's/Packages: //; s/\.$//' | tr ',' '\n' | sed 's/^ *//' \
    | tr 'A-Z_' 'a-z-' | sort -u > "$list"
fi
mapfile -t want < <("$PY" -m pip list --format=freeze 2>/dev/null | sed 's/==/ /' \
  | awk '{n=tolower($1); gsub("_","-",n); print n, $2}' | sort | join -v1 - "$list" \
  | grep -v '^nvidia-\|^tilesmith' | awk '{print $1 "==" $2}')
mkdir -p .device/whl
plat=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64 \
         manylinux_2_35_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .device/whl "${want[@]}"
gzip -c .cache/bin/cli-proxy-api > .device/cli-proxy-api.gz
scripts/bwrap-bundle.sh download .device/bwrap-debs >/dev/null
echo "wheels: $(ls .device/whl | wc -l) ($(du -sh .device | cut -f1) in .device)"
