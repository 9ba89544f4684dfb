"""Every environment variable Tilesmith reads, in one registry.

Each setting has a name, a default, a parser and a one-line description; ``docs/env_vars.md`` is checked
against :data:`REGISTRY` by the test suite, so the documentation cannot drift from the code.

Reading a setting never caches: tests and users may change ``os.environ`` between ``compile()`` calls, and
a :class:`~tilesmith.track.run.Run` snapshots what it needs when it is created.

Errors: an unparsable value raises :class:`tilesmith.errors.SettingsError` (a ``ValueError``) naming the
variable, the value and the accepted form: a typo must never silently change behaviour.

Renamed settings keep their old name as a deprecated alias (:attr:`Setting.deprecated_names`): it is read
only when the new name is unset, with a ``FutureWarning`` (shown by default) naming the new one.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tilesmith.errors import SettingsError


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, default (as text), parser and meaning."""

    name: str
    default: str | None
    parse: Callable[[str], Any]
    description: str
    secret: bool = False
    deprecated_names: tuple[str, ...] = ()
    """Old names still read (with a ``FutureWarning``) when ``name`` is unset."""


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _number(text: str, form: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"not a number; expected {form}") from None


def _integer(text: str, form: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"not a whole number; expected {form}") from None


def _fraction(text: str) -> float:
    value = _number(text, "a fraction in [0, 1), for example 0.02 for 2 %")
    if not math.isfinite(value) or not 0.0 <= value < 1.0:
        raise ValueError("expected a finite fraction in [0, 1), for example 0.02 for 2 %")
    return value


def _positive_float(text: str) -> float:
    value = _number(text, "a positive number of seconds, for example 600")
    if not math.isfinite(value) or value <= 0:
        raise ValueError("expected a positive number of seconds, for example 600")
    return value


def _positive_int(text: str) -> int:
    value = _integer(text, "a positive integer, for example 30")
    if value <= 0:
        raise ValueError("expected a positive integer, for example 30")
    return value


MIN_GATE_PAIRS = 10
"""Fewest paired samples a gate phase may take: the sequential test's first look
(:data:`tilesmith.gate.host.stats.LOOK_EVERY`). With fewer, the bootstrap interval of the median collapses onto
the few ratios there are (one pair: the interval is that pair's ratio), so one noisy sample could pass a phase."""


def _gate_pairs(text: str) -> int:
    form = f"an integer >= {MIN_GATE_PAIRS} (fewer pairs make the gate's interval meaningless), for example 30"
    value = _integer(text, form)
    if value < MIN_GATE_PAIRS:
        raise ValueError(f"expected {form}")
    return value


def _nonnegative_int(text: str) -> int:
    value = _integer(text, "an integer >= 0, for example 2")
    if value < 0:
        raise ValueError("expected an integer >= 0, for example 2")
    return value


def _text(text: str) -> str:
    return text


def _model_name(text: str) -> str:
    from tilesmith.agent import check_model_name  # its rule: a misspelt built-in agent (stdlib-only module)

    check_model_name(text, "TILESMITH_MODEL")
    return text


def _progress(text: str) -> str:
    value = text.strip().lower()
    if value not in {"auto", "on", "off"}:
        raise ValueError("expected auto, on or off")
    return value


def _path_list(text: str) -> tuple[str, ...]:
    """``os.pathsep``-separated paths (empty entries dropped); ``""`` is the empty list."""
    return tuple(part.strip() for part in text.split(os.pathsep) if part.strip())


def _distributed(text: str) -> str:
    value = text.strip().lower()
    if value not in {"auto", "off"}:
        raise ValueError("expected auto or off")
    return value


def _leader_mode(text: str) -> str:
    value = text.strip().lower()
    if value not in {"inline", "background"}:
        raise ValueError("expected inline or background")
    return value


def _recheck(text: str) -> str:
    value = text.strip().lower()
    if value not in {"blocking", "background"}:
        raise ValueError("expected blocking or background")
    return value


@dataclass(frozen=True)
class VerifyPolicy:
    """Parsed ``TILESMITH_VERIFY``: how installed wrappers are shadow-checked in the user's process
    (:mod:`tilesmith.install.verify`; docs/verification.md gives the defaults' measurements).

    ``first``: the first this many calls after install are all checked. ``every``: afterwards each call is
    checked with probability ``1/every`` (a private random draw, so the checked calls cannot be predicted from a
    call count); ``None`` = no sampled checks. ``budget``: the sampled checks' cost is held at about this
    fraction of the graph's own time by raising the mean gap above ``every`` (``None`` = no cap; the graph's time
    per call is the smaller of its measured time on checked calls and the wall time per call between checks).
    ``interval_s``: the first call after this many seconds without a check is checked (``None`` = never).
    ``threads``: the OS thread census of the user's process is part of every check. ``state``: the gate's
    side-effect snapshot (attribute identities, ``torch.backends`` values, the denormal probe) is re-checked on
    every check (:class:`tilesmith.gate.sidefx.ProductionSnapshot`). ``audit``: the gate worker's audit rules apply
    to the installed wrapper's import and every call, and its work left in Inductor's compile pool is looked for
    (:mod:`tilesmith.install.audit`, :mod:`tilesmith.gate.pools`). ``memory``: the bytes a wrapper keeps across
    checked calls are judged (:mod:`tilesmith.install.leaks`: allocator bytes and CPython's allocated blocks).
    ``retained``: fresh outputs may have no other reference at return than the original's have
    (:mod:`tilesmith.gate.retained`, ``output_retained``). ``retime``: the paired times of the original and the
    installed wrapper on checked calls uninstall a wrapper clearly slower in production
    (:mod:`tilesmith.install.retime`, ``slower_in_production``).
    """

    first: int = 8
    every: int | None = 100
    budget: float | None = 0.01
    interval_s: float | None = 60.0
    threads: bool = True
    state: bool = True
    audit: bool = True
    memory: bool = True
    retained: bool = True
    retime: bool = True


VERIFY_DEFAULT = ("first=8,every=100,budget=0.01,interval=60,threads=on,state=on,audit=on,memory=on,retained=on,"
                  "retime=on")
_VERIFY_FORMS = ("'off'; 'on' (the defaults, " + VERIFY_DEFAULT + "); or comma-separated fields, each optional: "
                 "first=<calls, integer >= 0>, every=<calls, integer >= 1, or off>, budget=<fraction in (0, 1), "
                 "or off>, interval=<seconds > 0, or off>, threads=<on|off>, state=<on|off>, audit=<on|off>, memory=<on|off>, retained=<on|off>, "
                 "retime=<on|off>; "
                 "e.g. 'first=8,every=1000,interval=30'")


def _verify(text: str) -> VerifyPolicy | None:
    """``TILESMITH_VERIFY`` → :class:`VerifyPolicy`, or ``None`` for ``off``."""
    value = text.strip().lower()
    if value in {"off", "0", "false", "no"}:
        return None
    if value in {"on", "1", "true", "yes", "default"}:
        return VerifyPolicy()
    fields: dict[str, Any] = {}
    for part in value.split(","):
        name, eq, raw = (x.strip() for x in part.partition("="))
        if not eq or not name or not raw:
            raise ValueError(f"{part.strip()!r} is not a name=value field; expected {_VERIFY_FORMS}")
        if name in fields:
            raise ValueError(f"field {name!r} is given twice; expected {_VERIFY_FORMS}")
        off = raw in {"off", "none", "never"}
        try:
            if name == "first":
                fields[name] = int(raw)
                ok = fields[name] >= 0
            elif name == "every":
                fields[name] = None if off else int(raw)
                ok = off or fields[name] >= 1
            elif name == "budget":
                fields[name] = None if off else float(raw)
                ok = off or (math.isfinite(fields[name]) and 0.0 < fields[name] < 1.0)
            elif name == "interval":
                fields["interval_s"] = None if off else float(raw)
                ok = off or (math.isfinite(fields["interval_s"]) and fields["interval_s"] > 0)
            elif name in ("threads", "state", "audit", "memory", "retained", "retime"):
                fields[name], ok = _bool(raw), True
            else:
                raise ValueError(f"unknown field {name!r}")
        except ValueError as exc:
            raise ValueError(f"{part.strip()!r}: {exc}; expected {_VERIFY_FORMS}") from None
        if not ok:
            raise ValueError(f"{part.strip()!r} is out of range; expected {_VERIFY_FORMS}")
    return VerifyPolicy(**fields)


_SETTINGS = (
    Setting("TILESMITH_MODEL", None, _model_name,
            "Optimizer model when compile() gets no agent_model: a model the proxy lists, or "
            "'tilesmith/builtin' for the built-in agent (no LLM, no keys)."),
    Setting("TILESMITH_CACHE_DIR", None, _text,
            "Root of runs/ and the artifact store. Default: $XDG_CACHE_HOME/tilesmith, else "
            "~/.cache/tilesmith."),
    Setting("TILESMITH_ALLOW_CPU", "0", _bool,
            "Test mode: CPU graphs become eligible and the host clock replaces CUDA events, so the "
            "whole pipeline runs without a GPU. Never meant for real optimization."),
    Setting("TILESMITH_MIN_IMPROVEMENT", "0.02", _fraction,
            "Smallest speedup the gate accepts, as a fraction: 0.02 means the candidate must be at "
            "least 2 % faster in the first measurement and again in the fresh confirmation."),
    Setting("TILESMITH_DEBUG", "0", _bool,
            "Keep per-turn structured agent traces under the track's traces/ folder."),
    Setting("TILESMITH_PROGRESS", "auto", _progress,
            "Progress display on stderr: auto (a live status line on a terminal; elsewhere one line when a graph's "
            "optimization starts and one when it ends), on (every change) or off."),
    Setting("TILESMITH_WORKER_START_TIMEOUT_S", "180", _positive_float,
            "Seconds a gate worker may take to start (import torch, create its CUDA context)."),
    Setting("TILESMITH_WORKER_TIMEOUT_S", "300", _positive_float,
            "Seconds a gate worker may take to initialize and to load a candidate (import it and compile "
            "its kernels) before it is killed and the candidate rejected; check and timing requests use "
            "TILESMITH_GATE_RUN_TIMEOUT_S."),
    Setting("TILESMITH_GRAPH_TIMEOUT_S", "1800", _positive_float,
            "Wall-clock seconds one graph's optimization may take in total (all its turns and gate "
            "evaluations); the loop stops after the turn that crosses it. Formerly TILESMITH_TURN_TIMEOUT_S, "
            "still read (deprecated) when this is unset.", deprecated_names=("TILESMITH_TURN_TIMEOUT_S",)),
    Setting("TILESMITH_GRAPH_BUDGET_S", "120", _positive_float,
            "Seconds the built-in agent may spend on one graph's first-call optimization: the search worker "
            "(measurements, configuration compiles and screens) plus gate evaluations. Past it the agent stops "
            "with the best accepted candidate so far and a builtin_budget diagnostic naming what it skipped. "
            "Checked before each evaluation starts (one in progress finishes); not counted: Inductor's own "
            "compile of the first call and the gate's start (its trusted worker), so a first call takes longer."),
    Setting("TILESMITH_MAX_TURNS", "40", _positive_int,
            "Agent turns per graph before the loop stops (the stop rule when max_model_calls is "
            "None; each turn ends with the agent's final answer)."),
    Setting("TILESMITH_CLIPROXYAPI_EXECUTABLE", None, _text,
            "Path of the CLIProxyAPI binary; else 'cliproxyapi' or 'cli-proxy-api' on PATH."),
    Setting("TILESMITH_CLIPROXYAPI_AUTH_DIR", None, _text,
            "CLIProxyAPI auth directory with OAuth account files; default ~/.cli-proxy-api."),
    Setting("TILESMITH_CLIPROXYAPI_CONFIG", None, _text,
            "User CLIProxyAPI YAML whose provider and routing sections are copied per run; default "
            "Homebrew's $(brew --prefix)/etc/cliproxyapi.conf."),
    Setting("TILESMITH_API_KEY", None, _text,
            "Key of an OpenAI-compatible endpoint, used with TILESMITH_API_BASE_URL.", secret=True),
    Setting("TILESMITH_API_BASE_URL", None, _text,
            "Base URL (with /v1) of the OpenAI-compatible endpoint for TILESMITH_API_KEY."),
    Setting("TILESMITH_CLIPROXYAPI_START_TIMEOUT_S", "30", _positive_float,
            "Seconds the private CLIProxyAPI may take to answer /healthz and /v1/models after it is "
            "started (per attempt; a busy port is retried on another one)."),
    Setting("TILESMITH_AGENT_REQUEST_TIMEOUT_S", "600", _positive_float,
            "Seconds one model request through the proxy may take (the OpenAI client's read timeout)."),
    Setting("TILESMITH_AGENT_MAX_RETRIES", "2", _nonnegative_int,
            "Transport retries (connection errors, 408/409/429/5xx) inside one model invocation; "
            "they never count against max_model_calls."),
    Setting("TILESMITH_ARTIFACT_CACHE", "1", _bool,
            "Reuse accepted wrappers from the artifact store (<root>/artifacts) and store new ones; 0 "
            "neither reads nor writes it, so every graph is optimized afresh."),
    Setting("TILESMITH_CACHE_RECHECK", "blocking", _recheck,
            "How an artifact-cache hit is re-checked before install: 'blocking' inside the graph's first "
            "call (the artifact serves that call's successors at once); 'background' in a thread while the "
            "graph keeps running on Inductor, with the reference from a trusted worker, installed when the "
            "re-check passes (tilesmith.wait(model) waits for it). Only the first call's latency differs."),
    Setting("TILESMITH_OPTIMIZE", "inline", _leader_mode,
            "Where a graph's first-call optimization runs: 'inline' inside its first call (that call returns "
            "once the optimizer and the gate are done, the winner installed for the next call); 'background' "
            "in a thread while the graph runs on Inductor, with the reference from a trusted worker, installed "
            "when the gate and its confirmation accept (tilesmith.wait(model) waits for it). Gate timing then "
            "shares the GPU with the user's own work, which widens intervals (never a false accept: the rule "
            "needs the interval above the bound). Single-process runs; under torch.distributed "
            "TILESMITH_DIST_LEADER decides."),
    Setting("TILESMITH_PRESTART_WORKER", "1", _bool,
            "Start one gate worker at tilesmith.compile() (when a graph may be eligible: a CUDA device, or "
            "CPU test mode) so that its Python start and torch import overlap with compilation; the first "
            "gate adopts it. 0: gate workers start only when a gate needs one."),
    Setting("TILESMITH_GATE_FORKSERVER", "0", _bool,
            "Start gate workers by forking them from a zygote process that imported torch and Inductor once "
            "(per process and device type; it never runs candidate code or creates a device context) instead of "
            "starting Python for each: a fresh worker in milliseconds rather than seconds. Prototype; 0 starts "
            "every worker with subprocess. Any failure of the fork server falls back to subprocess "
            "(docs/gate.md, \"Workers\")."),
    Setting("TILESMITH_GATE_WRITABLE", "", _path_list,
            "Extra folders (os.pathsep-separated) a gate worker may write beneath, besides its own private folder, "
            "/dev and /dev/shm (the worker's Landlock write rules, docs/gate.md \"What native code can still do\"). "
            "For a CUDA, driver or compiler stack that writes somewhere else: the worker log then shows "
            "'Permission denied' for that path. Candidate code can write there too."),
    Setting("TILESMITH_GATE_PAIRS", "30", _gate_pairs,
            "Paired timing samples (baseline and candidate, order randomized per pair) in each gate phase: "
            "the first measurement and the fresh confirmation each take this many. At least 10 (the sequential "
            "test's first look; with fewer the interval collapses onto the few ratios, and one noisy pair could "
            "pass)."),
    Setting("TILESMITH_NATIVE_KERNELS", "1", _bool,
            "Let the built-in agent's 'native_kernels' generator propose hand-written CUDA C++ kernels for the "
            "patterns it recognizes (int8 decode GEMV, row softmax, residual + RMSNorm/LayerNorm), building them "
            "on first use with torch.utils.cpp_extension; 0 never builds or proposes them."),
    Setting("TILESMITH_KERNEL_DIR", None, _text,
            "Folder of the native kernel builds (one per source/compiler/GPU/torch key, built once per machine "
            "and reused by later processes). Default: <TILESMITH_CACHE_DIR root>/kernels. Gate workers get it "
            "(read-only) as the one TILESMITH_* variable passed to them."),
    Setting("TILESMITH_MAX_OUTPUT_TOKENS", "8192", _positive_int,
            "Most tokens one model response may have (sent as the request's max_completion_tokens; "
            "tilesmith-ai 0.1.4's setting and default). A whole-file write_file of a large wrapper needs "
            "more."),
    Setting("TILESMITH_GPU_SHELL", "1", _bool,
            "Offer the LLM agent the gpu_shell tool: commands in a bubblewrap sandbox in the graph's shell "
            "workspace (no network, no secrets, writes only there). 0: never. When the sandbox cannot run, "
            "the tool is not offered and a shell_unavailable diagnostic says why."),
    Setting("TILESMITH_BWRAP", None, _text,
            "Path of the bubblewrap (bwrap) executable for gpu_shell; else 'bwrap' on PATH "
            "(scripts/bwrap-bundle.sh unpacks the Debian package where it is not installed)."),
    Setting("TILESMITH_SKILLS", None, _path_list,
            "Trusted skill files (Markdown) appended to the LLM agent's system prompt, separated by the "
            "path separator (':'); a folder means its SKILL.md; empty: no skills. Unset: the default list "
            "of docs/agent.md, the files that exist. 8 MiB in all."),
    Setting("TILESMITH_DISTRIBUTED", "auto", _distributed,
            "Under torch.distributed with more than one rank: 'auto' optimizes each graph once for the job (its "
            "leader, the lowest rank with the same versions and GPU model, runs optimizer and gate; every other "
            "rank re-checks and installs the same wrapper, or all keep Inductor; docs/distributed.md); 'off' lets "
            "every rank optimize on its own (ranks may then install different wrappers)."),
    Setting("TILESMITH_DIST_LEADER", "inline", _leader_mode,
            "Where a graph's leader optimizes under torch.distributed: 'inline' in the graph's first call, as "
            "in a single process (the other ranks then wait for it in their next collective: keep the process "
            "group's timeout above the optimization time); 'background' in a thread while the leader, too, "
            "runs Inductor (reference from a trusted worker; timing shares the GPU with training)."),
    Setting("TILESMITH_DIST_TIMEOUT_S", "2400", _positive_float,
            "Seconds a rank waits for another rank's part of a graph's decision (the leader's optimization, "
            "the other ranks' re-checks) before every rank keeps Inductor for that graph; the default covers "
            "TILESMITH_GRAPH_TIMEOUT_S (1800 s) plus compilation and gate time. Waiting happens in a background "
            "thread: the graph runs on Inductor meanwhile."),
    Setting("TILESMITH_DIST_LIVENESS_S", "60", _positive_float,
            "Seconds without a heartbeat (each rank beats once a second through the store) after which a rank "
            "that has not answered is presumed dead, and every rank keeps Inductor for the graphs it was "
            "deciding or re-checking (dist_leader_lost / dist_rank_lost diagnostics)."),
    Setting("TILESMITH_VERIFY", "on", _verify,
            "Production verification of installed wrappers in the user's process (docs/verification.md): a "
            "checked call also runs the original Inductor wrapper on copies of its inputs and compares outputs "
            "with the gate's tolerances, RNG use, the process's OS threads and global state, and the bytes the "
            "wrapper keeps; the gate's audit rules apply to the wrapper's import and every call; on a mismatch or "
            "a refused event the graph is uninstalled (that call returns the original's outputs) and its artifact "
            "quarantined. 'off', 'on' "
            f"({VERIFY_DEFAULT}) or fields first=, every=, budget=, interval= (seconds), threads=, state=, audit=, "
            "memory=, retained=, retime=."),
    Setting("TILESMITH_GATE_RUN_TIMEOUT_S", "120", _positive_float,
            "Seconds one gate check or timing request may take once the candidate is loaded (extended "
            "automatically for graphs whose original call is slow); past it the worker is killed and the "
            "candidate rejected as a hang."),
)

REGISTRY: dict[str, Setting] = {}
#: Deprecated name → the setting that replaced it.
DEPRECATED: dict[str, str] = {}
for _s in _SETTINGS:
    if _s.name in REGISTRY or _s.name in DEPRECATED:  # pragma: no cover - guards edits to the table above
        raise RuntimeError(f"duplicate setting {_s.name}")
    REGISTRY[_s.name] = _s
    for _old in _s.deprecated_names:
        if _old in REGISTRY or _old in DEPRECATED:  # pragma: no cover
            raise RuntimeError(f"duplicate setting {_old}")
        DEPRECATED[_old] = _s.name

#: Other names a setting answers to (alias -> registered name): tilesmith-ai 0.1.4's names. When both are set,
#: the registered name wins; an invalid alias value is reported under the alias's name.
ALIASES: dict[str, str] = {
    "TILESMITH_TIMEOUT": "TILESMITH_AGENT_REQUEST_TIMEOUT_S",
}
for _alias, _target in ALIASES.items():
    if _target not in REGISTRY or _alias in REGISTRY:  # pragma: no cover - guards edits to the table above
        raise RuntimeError(f"bad alias {_alias} -> {_target}")

#: Provider variables converted into the private proxy config (values are secrets, never logged).
PROVIDER_KEY_VARIABLES = (
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
    "XAI_API_KEY",
    "VERTEX_API_KEY",
    "OPENROUTER_API_KEY",
    "TILESMITH_API_KEY",
)


def check_all(environ: dict[str, str] | None = None) -> None:
    """Parse every registered ``TILESMITH_*`` variable that is set, so a bad value fails at ``compile()``
    rather than inside a graph's first call.

    Raises:
        SettingsError: the first variable whose value its parser rejects (names the variable and its default).
    """
    env = os.environ if environ is None else environ
    for name, setting in REGISTRY.items():
        if name in env or any(old in env for old in setting.deprecated_names):
            get(name, env)
    for alias, target in ALIASES.items():
        if alias in env and target not in env:
            get(target, env)


def get(name: str, environ: dict[str, str] | None = None) -> Any:
    """Return the parsed value of setting ``name`` (its default when unset; ``None`` if no default).

    When ``name`` itself is unset, a set alias of it (:data:`ALIASES`) supplies the value.

    Raises:
        KeyError: ``name`` is not a registered setting.
        SettingsError: the variable is set to a value its parser rejects.
    """
    setting = REGISTRY[name]
    env = os.environ if environ is None else environ
    raw, source = env.get(name), name
    if raw is None:
        for alias, target in ALIASES.items():
            if target == name and alias in env:
                raw, source = env[alias], alias
                break
    if raw is None:
        for old in setting.deprecated_names:
            if env.get(old) is not None:
                raw, source = env[old], old
                warnings.warn(f"{old} is deprecated: it was renamed {name} (same meaning and value); "
                              f"set {name} instead.", FutureWarning, stacklevel=2)
                break
    if raw is None:
        raw = setting.default
    if raw is None:
        return None
    try:
        return setting.parse(raw)
    except ValueError as exc:
        shown, why = ("<hidden>", "rejected") if setting.secret else (repr(raw), str(exc))
        via = f" (an alias of {name})" if source in ALIASES else ""
        msg = f"{source}={shown}{via} is invalid: {why}. Unset it to use the default ({setting.default!r})."
        raise SettingsError(msg) from None


def cache_root(environ: dict[str, str] | None = None) -> Path:
    """Root folder for runs and artifacts.

    Order: ``TILESMITH_CACHE_DIR``; ``$XDG_CACHE_HOME/tilesmith``; ``~/.cache/tilesmith``.
    """
    env = os.environ if environ is None else environ
    explicit = env.get("TILESMITH_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "tilesmith"
    return Path.home() / ".cache" / "tilesmith"
