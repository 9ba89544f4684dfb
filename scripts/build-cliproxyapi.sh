#!/usr/bin/env bash
# Build the CLIProxyAPI server binary that the real-proxy tests (pytest -m proxy) run against.
#
#   scripts/build-cliproxyapi.sh [OUTDIR]        # default OUTDIR: <repo>/.cache/bin
#
# Pinned to github.com/router-for-me/CLIProxyAPI/v7 v7.2.140. Idempotent: when OUTDIR/cli-proxy-api
# exists and reports "CLIProxyAPI Version: 7.2.140" nothing is rebuilt. Needs Go >= 1.26 (go.mod says
# `go 1.26.0`) and access to the Go module proxy. `go install …@v7.2.140` is not used: it asks the proxy
# for the module's version list (deprecation check), which the proxy refuses here with 403; fetching
# the one pinned version with `go mod download` and building from the module cache works.
# Tests find the binary through TILESMITH_CLIPROXYAPI_EXECUTABLE or <repo>/.cache/bin/cli-proxy-api.
set -euo pipefail

VERSION="7.2.140"
MODULE="github.com/router-for-me/CLIProxyAPI/v7"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${1:-$REPO_ROOT/.cache/bin}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"   # absolute: the build below runs from inside the module cache
OUT="$OUTDIR/cli-proxy-api"

banner() { "$1" -h 2>&1 | sed -n 1p || true; }   # first line: "CLIProxyAPI Version: X, Commit: …"

if [[ -x "$OUT" ]] && [[ "$(banner "$OUT")" == "CLIProxyAPI Version: $VERSION,"* ]]; then
    echo "cli-proxy-api $VERSION already built: $OUT"
    exit 0
fi

command -v go >/dev/null 2>&1 || { echo "error: go not found (Go >= 1.26 is needed to build CLIProxyAPI $VERSION)" >&2; exit 1; }

# Run a go command with its ~100 "go: downloading <module> <version>" progress lines dropped; every other
# line of its stderr (errors included) is printed after it ends, and its exit status is kept.
quiet_go() {
    local log status=0
    log="$(mktemp)"
    "$@" 2>"$log" || status=$?
    grep -v '^go: downloading ' "$log" >&2 || true
    rm -f "$log"
    return "$status"
}

mkdir -p "$OUTDIR"
echo "building cli-proxy-api $VERSION (downloads its Go modules on the first build)"
quiet_go go mod download "$MODULE@v$VERSION"
# The module cache escapes upper-case letters as !lower (CLIProxyAPI -> !c!l!i!proxy!a!p!i).
ESCAPED="$(printf '%s' "$MODULE" | sed -E 's/([A-Z])/!\L\1/g')"
SRC="$(go env GOMODCACHE)/$ESCAPED@v$VERSION"
[[ -d "$SRC/cmd/server" ]] || { echo "error: $SRC/cmd/server not found after go mod download" >&2; exit 1; }

TMP_OUT="$(mktemp "$OUTDIR/.cli-proxy-api.XXXXXX")"
trap 'rm -f "$TMP_OUT"' EXIT
(cd "$SRC" && CGO_ENABLED=0 GOFLAGS=-mod=mod quiet_go go build -trimpath \
    -ldflags "-s -w -X main.Version=$VERSION" -o "$TMP_OUT" ./cmd/server)
chmod 0755 "$TMP_OUT"
mv -f "$TMP_OUT" "$OUT"
trap - EXIT
[[ "$(banner "$OUT")" == "CLIProxyAPI Version: $VERSION,"* ]] || { echo "error: $OUT does not report version $VERSION" >&2; exit 1; }
echo "built $OUT ($(banner "$OUT"))"
