"""The ``tilesmith`` command (console script ``tilesmith.cli.main:main``).

::

    tilesmith doctor [--model M] [--no-proxy] [--json]
    tilesmith runs [--json] [--limit N]
    tilesmith show <run-or-track> [--json]
    tilesmith cache [list] [--verify] [--json]
    tilesmith cache prune [--max-age 7d] [--max-size 2G] [--dry-run]
    tilesmith report <run> [-o report.html]

``--root`` (before or after the command) overrides the cache root, which is otherwise
``TILESMITH_CACHE_DIR``, ``$XDG_CACHE_HOME/tilesmith`` or ``~/.cache/tilesmith``. The command line reads
run folders and the artifact store; it never runs a model. Exit codes: 0 success, 1 a problem the
command reports (doctor found errors, a write failed), 2 usage errors or a run/track that does not exist.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from tilesmith import __version__, settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tilesmith", description="Inspect Tilesmith runs, the artifact cache "
                                     "and this machine's set-up.")
    parser.add_argument("--version", action="version", version=f"tilesmith {__version__}")
    root_help = ("cache root holding runs/ and artifacts/ (default: TILESMITH_CACHE_DIR, else "
                 "$XDG_CACHE_HOME/tilesmith, else ~/.cache/tilesmith)")
    parser.add_argument("--root", type=Path, default=None, help=root_help)
    # The same option after the command (`tilesmith runs --root DIR`); SUPPRESS keeps a --root given before the
    # command when none follows it.
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--root", type=Path, default=argparse.SUPPRESS, help=root_help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("doctor", parents=[after],
                       help="check the GPU, torch/Triton, the model and the LLM proxy set-up")
    p.add_argument("--model", help="model to check (default: TILESMITH_MODEL)")
    p.add_argument("--no-proxy", action="store_true", help="do not start the private proxy to list its models")
    p.add_argument("--proxy-timeout", type=float, default=30.0, metavar="S",
                   help="seconds to wait for the proxy to answer (default 30)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("runs", parents=[after], help="list runs: id, time, model, graphs, installed, best speedup")
    p.add_argument("--json", action="store_true")
    p.add_argument("--limit", type=int, default=None, help="show only the N newest runs")

    p = sub.add_parser("show", parents=[after], help="describe a run or one of its tracks")
    p.add_argument("target", help="run id (or unique prefix, or 'latest'), <run>/<key-prefix>, a graph key "
                                  "prefix, or a run/track folder")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("cache", parents=[after], help="list or prune the artifact cache")
    cache_sub = p.add_subparsers(dest="cache_command", metavar="ACTION")
    p.add_argument("--verify", action="store_true", help="check every entry's content hash while listing")
    p.add_argument("--json", action="store_true")
    lp = cache_sub.add_parser("list", parents=[after], help="list entries (default action)")
    lp.add_argument("--verify", action="store_true", help="check every entry's content hash")
    lp.add_argument("--json", action="store_true")
    pp = cache_sub.add_parser("prune", parents=[after], help="delete corrupted, old or least recently used entries")
    pp.add_argument("--max-age", help="delete entries unused for longer than this (e.g. 30d, 12h)")
    pp.add_argument("--max-size", help="then delete least recently used entries until the store is at most "
                                       "this size (e.g. 2G, 500MiB)")
    pp.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")

    p = sub.add_parser("report", parents=[after], help="write a self-contained HTML report with plots for a run")
    p.add_argument("target", help="run id (or unique prefix, or 'latest') or run folder")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="output file (default: <run folder>/report.html)")
    return parser


def main(argv: list[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    out = out or sys.stdout
    parser = build_parser()
    args = parser.parse_args(argv)
    root = args.root if args.root is not None else settings.cache_root()
    try:
        return _dispatch(args, root, out)
    except BrokenPipeError:  # e.g. `tilesmith runs | head`
        return 0


def _dispatch(args: argparse.Namespace, root: Path, out: TextIO) -> int:
    from tilesmith.cli import commands

    if args.command == "doctor":
        from tilesmith.cli.doctor import cmd_doctor

        return cmd_doctor(out, model=args.model, start_proxy=not args.no_proxy, as_json=args.json,
                          root=args.root, proxy_timeout_s=args.proxy_timeout)
    if args.command == "runs":
        return commands.cmd_runs(root, out, as_json=args.json, limit=args.limit)
    if args.command == "show":
        return commands.cmd_show(root, args.target, out, as_json=args.json)
    if args.command == "cache":
        if args.cache_command == "prune":
            return commands.cmd_cache_prune(root, out, max_age=args.max_age, max_size=args.max_size,
                                            dry_run=args.dry_run)
        return commands.cmd_cache_list(root, out, verify=args.verify, as_json=args.json)
    if args.command == "report":
        return _report(root, args.target, args.output, out)
    raise AssertionError(args.command)  # pragma: no cover - argparse restricts the choices


def _report(root: Path, target: str, output: Path | None, out: TextIO) -> int:
    from tilesmith.cli.rundata import TargetNotFound, resolve

    try:
        run, _track = resolve(root, target)
    except TargetNotFound as exc:
        out.write(f"tilesmith report: {exc}\n")
        return 2
    try:
        from tilesmith.cli.report import write_report
    except ImportError as exc:  # pragma: no cover - matplotlib is a dev/report extra
        out.write(f"tilesmith report: {exc}; install matplotlib (the report extra: pip install '<checkout>[report]')\n")
        return 1
    target_path = output or run.path / "report.html"
    try:
        write_report(run, target_path)
    except ImportError as exc:
        out.write(f"tilesmith report: {exc}; install matplotlib (the report extra: pip install '<checkout>[report]')\n")
        return 1
    except OSError as exc:
        out.write(f"tilesmith report: cannot write {target_path}: {exc}. Remedy: pass -o with a writable path.\n")
        return 1
    out.write(f"wrote {target_path}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
