#!/usr/bin/env bash
# Bubblewrap (bwrap) for machines where it is not installed and cannot be (the H200 has no network).
#
#   scripts/bwrap-bundle.sh download [DIR]          # here (Debian/Ubuntu, network): the .deb files into DIR
#                                                   #   (default .device/bwrap-debs, which the device tool carries)
#   scripts/bwrap-bundle.sh install [DIR] [DEST]    # there: unpack them into DEST (default /tmp/tilesmith-bwrap)
#                                                   #   and print the line to export TILESMITH_BWRAP=DEST/bwrap
#
# The bundle is bubblewrap and the libraries it links (libcap2, libselinux1, libpcre2-8-0), from this machine's
# apt sources (Debian 12 here: bwrap 0.8.0, needs glibc >= 2.34). `install` unpacks with `dpkg -x` (or Python's
# ar/tar reader where dpkg is missing), then writes DEST/bwrap: it runs the unpacked binary as is when the host's
# libraries suffice, else with DEST's libraries on LD_LIBRARY_PATH (the sandbox itself starts with --clearenv, so
# that variable never reaches commands inside). scripts/gpu-suite.sh runs `install` when .device/bwrap-debs exists.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(bubblewrap libcap2 libselinux1 libpcre2-8-0)
cmd="${1:-}"; shift || true
case "$cmd" in
  download)
    dir="${1:-.device/bwrap-debs}"; mkdir -p "$dir"; dir="$(cd "$dir" && pwd)"
    (cd "$dir" && apt-get download "${PACKAGES[@]}")
    ls -l "$dir"/*.deb ;;
  install)
    dir="${1:-.device/bwrap-debs}"; dest="${2:-/tmp/tilesmith-bwrap}"
    compgen -G "$dir/*.deb" >/dev/null || { echo "no .deb files in $dir (run: $0 download)" >&2; exit 1; }
    mkdir -p "$dest/root"; dest="$(cd "$dest" && pwd)"
    for deb in "$dir"/*.deb; do
      if command -v dpkg >/dev/null 2>&1; then
        dpkg -x "$deb" "$dest/root"
      else  # a .deb is an ar archive holding data.tar.*
        python3 - "$deb" "$dest/root" <<'PY'
import io, sys, tarfile
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"!<arch>\n", "not a .deb (ar) file"
pos = 8
while pos < len(data):
    name, size = data[pos:pos + 16].decode().strip().rstrip("/"), int(data[pos + 48:pos + 58].decode().strip())
    body = data[pos + 60:pos + 60 + size]
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(body)).extractall(sys.argv[2])
    pos += 60 + size + (size % 2)
PY
      fi
    done
    bin="$dest/root/usr/bin/bwrap"
    [[ -x "$bin" ]] || { echo "bwrap not found in the unpacked packages ($bin)" >&2; exit 1; }
    libs="$dest/root/lib/x86_64-linux-gnu:$dest/root/usr/lib/x86_64-linux-gnu"
    if "$bin" --version >/dev/null 2>&1; then
      printf '#!/bin/sh\nexec %q "$@"\n' "$bin" > "$dest/bwrap"
    else
      printf '#!/bin/sh\nLD_LIBRARY_PATH=%q${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %q "$@"\n' "$libs" "$bin" > "$dest/bwrap"
    fi
    chmod +x "$dest/bwrap"
    "$dest/bwrap" --version
    echo "export TILESMITH_BWRAP=$dest/bwrap" ;;
  *)
    echo "usage: $0 download [DIR] | install [DIR] [DEST]" >&2; exit 2 ;;
esac
