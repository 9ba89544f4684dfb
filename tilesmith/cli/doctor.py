"""``tilesmith doctor``: can this machine optimize, and if not, what to do about it.

Checks, in order: settings (every ``TILESMITH_*`` variable parses; a set one that no setting reads is a warning),
torch, the CUDA device, Triton, the
cache root (writable), the optimizer model (``--model`` or ``TILESMITH_MODEL``), then the LLM pieces:
CLIProxyAPI executable, user config, auth-dir accounts, provider variables (names only, never values) and,
unless ``--no-proxy``, whether the private proxy starts and which models it lists.

Severity: ``error`` means the main job cannot optimize (``tilesmith.compile`` would fall back to plain
``torch.compile`` or not run at all) — the exit code is then 1; ``warn`` works with a caveat; ``info`` is
context. LLM pieces are errors only when the chosen model needs them (not for ``tilesmith/builtin``).
Every problem carries a remedy. Output passes through :func:`tilesmith.secrets.redact`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from tilesmith import settings
from tilesmith.cli import llm_adapter
from tilesmith.secrets import redact

BUILTIN = "tilesmith/builtin"


@dataclass(frozen=True)
class Check:
    """One line of the doctor's answer."""

    name: str
    status: str
    """``ok``, ``info``, ``warn`` or ``error``."""
    detail: str
    remedy: str = ""


def run_checks(model: str | None = None, *, start_proxy: bool = True, proxy_timeout_s: float = 30.0,
               root: Path | None = None) -> list[Check]:
    """All checks for ``model`` (``None``: ``TILESMITH_MODEL``). Never raises."""
    checks: list[Check] = []
    checks += _settings_checks()
    torch_mod = _torch_check(checks)
    _device_checks(checks, torch_mod)
    _triton_check(checks, torch_mod)
    _cache_check(checks, root)
    chosen = _model_check(checks, model)
    _llm_checks(checks, chosen, start_proxy=start_proxy, timeout_s=proxy_timeout_s)
    return checks


def _settings_checks() -> list[Check]:
    bad = []
    for name in settings.REGISTRY:
        try:
            settings.get(name)
        except ValueError as exc:
            bad.append(Check("settings", "error", str(exc), f"fix or unset {name}"))
    parsed = bad or [Check("settings", "ok", f"{len(settings.REGISTRY)} TILESMITH_* settings parse")]
    return parsed + _unknown_settings()


def _unknown_settings() -> list[Check]:
    """A warning per set ``TILESMITH_*`` variable that no setting reads: a misspelled name (``TILESMITH_ALLOW_CPUS``,
    ``TILESMITH_OPTIMISE``) is otherwise ignored without a word. ``TILESMITH_BENCH_*`` belong to bench/."""
    import difflib

    known = {*settings.REGISTRY, *settings.ALIASES, *settings.DEPRECATED, *settings.PROVIDER_KEY_VARIABLES}
    checks = []
    for name in sorted(os.environ):
        if not name.startswith("TILESMITH_") or name in known or name.startswith("TILESMITH_BENCH_"):
            continue
        close = difflib.get_close_matches(name, sorted(settings.REGISTRY), n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        checks.append(Check("settings", "warn", f"{name} is set but Tilesmith reads no such variable{hint}; "
                            "it has no effect",
                            f"rename it{' to ' + close[0] if close else ''} or unset it (docs/env_vars.md lists "
                            "every variable)"))
    return checks


def _torch_check(checks: list[Check]) -> Any:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        checks.append(Check("torch", "error", f"torch cannot be imported ({type(exc).__name__}: {exc})",
                            "install a CUDA build of PyTorch (https://pytorch.org/get-started/locally/)"))
        return None
    cuda = getattr(torch.version, "cuda", None)
    checks.append(Check("torch", "ok", f"torch {torch.__version__}" + (f", built for CUDA {cuda}" if cuda
                                                                       else ", CPU-only build")))
    return torch


def _device_checks(checks: list[Check], torch: Any) -> None:
    allow_cpu = _setting("TILESMITH_ALLOW_CPU", False)
    if torch is None:
        return
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        count = 0
    if count == 0:
        why = ("this torch is a CPU-only build" if not getattr(torch.version, "cuda", None)
               else "no CUDA device is visible (driver missing, CUDA_VISIBLE_DEVICES empty, or no GPU)")
        if allow_cpu:
            checks.append(Check("cuda device", "warn", f"{why}; TILESMITH_ALLOW_CPU=1 makes CPU graphs eligible "
                                "(test mode: host-clock timings, not meant for real optimization)",
                                "run on an NVIDIA GPU for real speedups"))
        else:
            checks.append(Check("cuda device", "error", f"{why}: every graph stays on ordinary Inductor",
                                "run on a machine with an NVIDIA GPU and a CUDA build of torch, or set "
                                "TILESMITH_ALLOW_CPU=1 for CPU test mode"))
        return
    for index in range(count):
        try:
            name = torch.cuda.get_device_name(index)
            major, minor = torch.cuda.get_device_capability(index)
            mem = torch.cuda.get_device_properties(index).total_memory / 2**30
        except Exception as exc:  # noqa: BLE001
            checks.append(Check("cuda device", "error", f"cuda:{index} cannot be queried ({exc})",
                                "check the NVIDIA driver with nvidia-smi"))
            continue
        status = "ok" if major >= 7 else "warn"
        remedy = "" if major >= 7 else "Triton needs compute capability 7.0 or newer; use a newer GPU"
        checks.append(Check("cuda device", status, f"cuda:{index} {name}, compute capability {major}.{minor}, "
                            f"{mem:.0f} GiB", remedy))
    if count > 1:
        checks.append(Check("cuda device", "info", f"{count} GPUs: each graph is optimized on the device it "
                            "runs on; multi-GPU graphs stay on Inductor"))


def _triton_check(checks: list[Check], torch: Any) -> None:
    has_cuda = bool(torch is not None and torch.cuda.is_available())
    try:
        import triton

        checks.append(Check("triton", "ok", f"triton {getattr(triton, '__version__', 'unknown')}"))
    except Exception as exc:  # noqa: BLE001
        checks.append(Check("triton", "error" if has_cuda else "info",
                            f"triton cannot be imported ({type(exc).__name__}: {exc})",
                            "install the Triton version your torch pins (pip install triton)" if has_cuda else ""))


def _cache_check(checks: list[Check], root: Path | None) -> None:
    root = Path(root) if root is not None else settings.cache_root()
    probe_dir = root
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    try:
        if not probe_dir.is_dir():
            raise NotADirectoryError(f"{probe_dir} is not a folder")
        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".tilesmith-doctor-"):
            pass
    except OSError as exc:
        checks.append(Check("cache root", "error", f"{root} is not writable ({exc}): runs, attempts and gate "
                            "reports cannot be kept", "set TILESMITH_CACHE_DIR to a writable folder"))
        return
    free = shutil.disk_usage(probe_dir).free / 2**30
    status = "ok" if free >= 1 else "warn"
    checks.append(Check("cache root", status, f"{root} (writable, {free:.1f} GiB free)",
                        "" if status == "ok" else "free disk space or move TILESMITH_CACHE_DIR"))


def _model_check(checks: list[Check], model: str | None) -> str | None:
    chosen = model or _setting("TILESMITH_MODEL", None)
    if not chosen:
        # The main job (examples/main_job.py) uses the built-in agent when TILESMITH_MODEL is unset, so it can
        # still optimize; only a tilesmith.compile() call without agent_model= falls back.
        checks.append(Check("model", "warn", "TILESMITH_MODEL is unset: tilesmith.compile() without agent_model= "
                            f"falls back to plain torch.compile; the main job uses {BUILTIN}",
                            f"pass agent_model=... or set TILESMITH_MODEL ({BUILTIN} needs no keys and no "
                            "proxy; an LLM model must be one the proxy lists)"))
        return BUILTIN
    source = "--model" if model else "TILESMITH_MODEL"
    from tilesmith.agent import check_model_name

    try:
        check_model_name(chosen, source)
    except ValueError as exc:
        checks.append(Check("model", "error", str(exc), f"use {BUILTIN} or a model the proxy lists"))
        return None
    if chosen == BUILTIN:
        checks.append(Check("model", "ok", f"{BUILTIN} (built-in agent, no LLM) from {source}"))
    else:
        checks.append(Check("model", "ok", f"{chosen!r} from {source}, served through the private CLIProxyAPI"))
    return chosen


def _llm_checks(checks: list[Check], model: str | None, *, start_proxy: bool, timeout_s: float) -> None:
    needed = bool(model) and model != BUILTIN
    miss = "error" if needed else "info"
    suffix = "" if needed else " (only needed for LLM models)"
    pieces = _discover()
    exe = pieces.get("executable")
    if exe:
        checks.append(Check("cliproxyapi", "ok", f"executable {exe}"))
    else:
        checks.append(Check("cliproxyapi", miss, f"{pieces.get('executable_note', 'CLIProxyAPI not found')}{suffix}",
                            "install CLIProxyAPI (brew install cliproxyapi, or scripts/build-cliproxyapi.sh) "
                            "and put it on PATH or set TILESMITH_CLIPROXYAPI_EXECUTABLE" if needed else ""))
    config, config_problem = pieces.get("config"), pieces.get("config_problem")
    if config_problem:
        checks.append(Check("proxy config", miss, config_problem + suffix,
                            "fix or unset TILESMITH_CLIPROXYAPI_CONFIG" if needed else ""))
    else:
        checks.append(Check("proxy config", "ok" if config else "info",
                            f"user config {config} (providers and routing are copied per run)" if config
                            else "no user CLIProxyAPI config (optional: provider variables or accounts suffice)"))
    auth_dir, accounts = pieces.get("auth_dir"), pieces.get("accounts", ())
    if accounts:
        by_provider: dict[str, int] = {}
        for path in accounts:
            provider = Path(path).stem.split("-", 1)[0] or "unknown"
            by_provider[provider] = by_provider.get(provider, 0) + 1
        listed = ", ".join(f"{p}: {n}" for p, n in sorted(by_provider.items()))
        checks.append(Check("accounts", "ok", f"{len(accounts)} account file(s) in {auth_dir} ({listed})"))
    else:
        checks.append(Check("accounts", "info", f"no account files in {auth_dir}"))
    names = [n for n in settings.PROVIDER_KEY_VARIABLES if os.environ.get(n)]
    if names:
        checks.append(Check("provider variables", "ok", "set: " + ", ".join(names) + " (values not shown)"))
    else:
        checks.append(Check("provider variables", "info", "none of " + ", ".join(settings.PROVIDER_KEY_VARIABLES)
                            + " is set"))
    if os.environ.get("TILESMITH_API_KEY") and not os.environ.get("TILESMITH_API_BASE_URL"):
        checks.append(Check("provider variables", miss, "TILESMITH_API_KEY is set without TILESMITH_API_BASE_URL",
                            "export TILESMITH_API_BASE_URL=https://host/v1 for your OpenAI-compatible endpoint"))
    if not needed:
        return
    avail, why = llm_adapter.availability(model)
    if avail is None:
        checks.append(Check("llm agent", "warn", f"could not ask the LLM runtime ({why}); the checks above are "
                            "file-system only", "reinstall Tilesmith from its checkout with its dependencies (pip install <checkout>)"))
        usable = bool(exe) and (bool(accounts) or bool(names) or bool(config))
        if not usable:
            checks.append(Check("llm agent", "error", "the LLM agent lacks an executable or credentials",
                                "see the remedies above"))
            return
    elif not getattr(avail, "ok", False):
        checks.append(Check("llm agent", "error", f"[{getattr(avail, 'kind', '?')}] {getattr(avail, 'message', '')}",
                            "supply the missing piece named above"))
        return
    else:
        sources = ", ".join(getattr(avail, "credential_sources", ()) or ()) or "found"
        checks.append(Check("llm agent", "ok", f"credentials: {sources}"))
    if not start_proxy:
        checks.append(Check("proxy", "info", "not started (--no-proxy)"))
        return
    result = llm_adapter.probe_proxy(model, timeout_s=timeout_s)
    if result is None:
        checks.append(Check("proxy", "warn", "this Tilesmith's LLM runtime offers no proxy probe; start not tested",
                            "run a small tilesmith.compile() to test the proxy end to end"))
    elif not result.started or result.error:
        checks.append(Check("proxy", "error", f"the private proxy did not start or answer: {result.error}",
                            "run the executable by hand with your config to see its log; check the port is "
                            "free and the config is valid YAML"))
    elif model not in result.models:
        shown = ", ".join(result.models[:20]) or "none"
        checks.append(Check("proxy", "error", f"proxy started but does not list {model!r}; it lists: {shown}",
                            "pick one of the listed models (agent_model= or TILESMITH_MODEL)"))
    else:
        started = f"started ({result.detail})" if result.detail else "started"
        shown = ", ".join(result.models[:20]) + (f", … ({len(result.models) - 20} more)" if len(result.models) > 20 else "")
        checks.append(Check("proxy", "ok", f"{started}; lists {len(result.models)} models including {model!r}: "
                            f"{shown}"))


def _discover() -> dict[str, Any]:
    """Executable, config and auth dir via ``tilesmith.agent.llm.discovery``, else minimal own lookup."""
    out: dict[str, Any] = {}
    try:
        from tilesmith.agent.llm import discovery as d

        out["executable"], out["executable_note"] = d.find_executable()
        config, problem = d.find_user_config()
        out["config"], out["config_problem"] = (str(config) if config else None), problem
        auth_dir = d.find_auth_dir()
        out["auth_dir"], out["accounts"] = str(auth_dir), tuple(str(p) for p in d.auth_account_files(auth_dir))
        return out
    except Exception:  # noqa: BLE001 - runtime missing or broken: fall back to the documented rules
        pass
    explicit = _setting("TILESMITH_CLIPROXYAPI_EXECUTABLE", None)
    if explicit:
        ok = Path(explicit).expanduser().is_file() and os.access(Path(explicit).expanduser(), os.X_OK)
        out["executable"] = str(Path(explicit).expanduser()) if ok else None
        out["executable_note"] = f"TILESMITH_CLIPROXYAPI_EXECUTABLE={explicit} is not an executable file"
    else:
        found = shutil.which("cliproxyapi") or shutil.which("cli-proxy-api")
        out["executable"] = found
        out["executable_note"] = "CLIProxyAPI not found (no cliproxyapi or cli-proxy-api on PATH)"
    cfg = _setting("TILESMITH_CLIPROXYAPI_CONFIG", None)
    if cfg and not Path(cfg).expanduser().is_file():
        out["config_problem"] = f"TILESMITH_CLIPROXYAPI_CONFIG={cfg} does not exist"
    out["config"] = cfg if cfg and Path(cfg).expanduser().is_file() else None
    auth = Path(_setting("TILESMITH_CLIPROXYAPI_AUTH_DIR", None) or Path.home() / ".cli-proxy-api").expanduser()
    out["auth_dir"] = str(auth)
    out["accounts"] = tuple(str(p) for p in sorted(auth.glob("*.json"))) if auth.is_dir() else ()
    return out


def _setting(name: str, default: Any) -> Any:
    try:
        value = settings.get(name)
    except ValueError:
        return default  # reported by the settings check
    return default if value is None else value


_MARK = {"ok": "ok", "info": "--", "warn": "WARN", "error": "ERROR"}


def cmd_doctor(out: TextIO, *, model: str | None = None, start_proxy: bool = True, as_json: bool = False,
               root: Path | None = None, proxy_timeout_s: float = 30.0) -> int:
    """Print the checks; exit code 1 when any is an error (the main job cannot optimize), else 0."""
    checks = run_checks(model, start_proxy=start_proxy, root=root, proxy_timeout_s=proxy_timeout_s)
    errors = [c for c in checks if c.status == "error"]
    if as_json:
        items = [{k: redact(v) for k, v in asdict(c).items()} for c in checks]
        out.write(json.dumps({"ok": not errors, "checks": items}, indent=2) + "\n")
        return 1 if errors else 0
    width = max(len(c.name) for c in checks)
    columns = max(80, shutil.get_terminal_size((100, 20)).columns)
    hang = " " * (2 + 5 + 2 + width + 2)
    out.write(f"tilesmith doctor (python {sys.version.split()[0]})\n")
    for c in checks:
        head = f"  {_MARK[c.status]:<5}  {c.name:<{width}}  "
        # redact before wrapping: a wrapped line could split a secret
        out.write(textwrap.fill(redact(c.detail), columns, initial_indent=head, subsequent_indent=hang,
                                break_long_words=False, break_on_hyphens=False) + "\n")
        if c.remedy and c.status in {"warn", "error"}:
            out.write(textwrap.fill("remedy: " + redact(c.remedy), columns, initial_indent=hang,
                                    subsequent_indent=hang + "  ", break_long_words=False,
                                    break_on_hyphens=False) + "\n")
    if errors:
        out.write(f"\n{len(errors)} problem(s) stop optimization; fix them as the remedies say.\n")
    else:
        warns = sum(c.status == "warn" for c in checks)
        out.write("\nready to optimize" + (f" ({warns} warning(s))" if warns else "") + ".\n")
    return 1 if errors else 0
