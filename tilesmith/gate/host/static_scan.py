"""Static scan of a candidate wrapper for clear cheats, before any of its code runs.

A scanner is a pattern chase (GPU MODE's red-team conclusion, https://github.com/gpu-mode/reference-kernels/issues/162); the structural defences
are the isolated worker, the host-side comparison and statistics, and the runtime identity/state
checks. The scan exists to reject the obvious cases early with a message an agent can act on, and it is
tuned to accept every wrapper Inductor generates (tests run it over the H200 fixtures and CPU wrappers).

Python is scanned with :mod:`ast`: the wrapper itself and every Triton kernel source string passed to
``async_compile.triton(...)`` (Inductor imports those strings as Python modules, so their top-level
code runs on the host). C++/CUDA strings (``async_compile.cpp_pybinding``/``cuda``, ``load_inline``)
get a regular-expression scan for threads, processes, files, sockets and dynamic loading.
Each rule (the tables in :mod:`tilesmith.gate.host.static_rules`) carries its ``# Rationale:``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from tilesmith._ast import dotted_name as _dotted
from tilesmith.gate.host.static_rules import (  # noqa: F401 (RULE_RATIONALE is public here)
    ALLOWED_IMPORT_FROM, BLOCKED_ATTRS, BROAD_EXCEPTIONS, CACHE_CLASS, DUNDER_ATTRS, FORBIDDEN_BUILTINS,
    GLOBAL_STATE_NAMES, INDIRECT_BUILTINS, LOAD_SAVE, MODULE_ALIASES_DEFAULT, MODULE_BY_NAME, MODULE_RULES,
    NAME_ACCESS_BUILTINS, NATIVE_PATTERNS, OS_ALLOWED, REEXPORTED, RULE_RATIONALE, TRITON_ROOTS,
)
from tilesmith.records import CheckFailure


@dataclass(frozen=True)
class Finding:
    rule: str
    line: int
    detail: str




class _Scanner(ast.NodeVisitor):
    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self.aliases = set(MODULE_ALIASES_DEFAULT)
        self.os_names = {"os"}  # names bound to the os module (`import os as o`, `from torch import os`)
        self.native_strings: list[tuple[int, str]] = []
        self.python_strings: list[tuple[int, str]] = []

    def add(self, rule: str, node: ast.AST, detail: str) -> None:
        self.findings.append(Finding(rule, getattr(node, "lineno", 0), detail))

    # imports -------------------------------------------------------------------------------------------
    def _check_module(self, name: str, node: ast.AST, names: list[str] | None = None) -> None:
        root = name.split(".")[0]
        if root == "ctypes" and names is not None and all(n.startswith("c_") for n in names):
            return
        for module, rule in MODULE_RULES:
            if name == module or name.startswith(module + ".") or root == module:
                self.add(rule, node, f"imports {name}")
                return
        for part in name.split(".")[1:]:
            if self._check_name(part, node, f"imports {name}"):
                return

    def _check_name(self, name: str, node: ast.AST, context: str) -> bool:
        """Flag an attribute/imported name that is blocked wherever it is reached; True if flagged."""
        if name in REEXPORTED:
            self.add(REEXPORTED[name], node, f"{context}: reaches module {name!r}")
        elif name in BLOCKED_ATTRS:
            rule, what = BLOCKED_ATTRS[name]
            self.add(rule, node, f"{context}: {name!r} {what}")
        elif CACHE_CLASS.fullmatch(name):
            self.add("static_file_access", node, f"{context}: {name!r} writes Inductor's shared compile cache")
        elif name in DUNDER_ATTRS:
            self.add("static_introspection", node, f"{context}: uses {name}")
        elif name in GLOBAL_STATE_NAMES:
            self.add("static_global_state", node, f"{context}: reaches {name!r}, which changes global state")
        else:
            return False
        return True

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._check_module(alias.name, node)
            self.aliases.add((alias.asname or alias.name).split(".")[0])
            if alias.name == "os" and alias.asname:
                self.os_names.add(alias.asname)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if _is_cpp_wrapper_import(node):
            return  # checked as a whole by _cpp_wrapper_findings
        if node.level == 0 and node.names and all((module, a.name) in ALLOWED_IMPORT_FROM and a.asname is None
                                                  for a in node.names):
            self.generic_visit(node)
            return
        before = len(self.findings)
        self._check_module(module, node, [a.name for a in node.names])
        for alias in node.names:
            full = f"{module}.{alias.name}"
            if alias.name == "*":
                self.add("static_dynamic_access", node, f"from {module} import *: star imports hide which names "
                         "are used; import each name")
                continue
            if len(self.findings) == before and module.split(".")[0] != "ctypes":
                self._check_module(full, node, [alias.name])
            if len(self.findings) == before and alias.name in MODULE_BY_NAME:
                self.add(MODULE_BY_NAME[alias.name], node, f"imports module {alias.name!r} from {module} (the "
                         f"same module as `import {alias.name}`)")
            elif len(self.findings) == before and alias.name in LOAD_SAVE and module.split(".")[0] != "triton":
                self.add("static_file_access", node, f"imports {full} (file I/O)")
            if alias.name in GLOBAL_STATE_NAMES:
                self.add("static_global_state", node, f"imports {full}")
            if module == "os" and alias.name not in OS_ALLOWED:
                self.add(_os_rule(alias.name), node, f"imports os.{alias.name}")
            if alias.name == "os":
                self.os_names.add(alias.asname or alias.name)
            if module.split(".")[0] in {"torch", "triton"}:
                self.aliases.add(alias.asname or alias.name)
        self.generic_visit(node)

    # calls and attributes ----------------------------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in FORBIDDEN_BUILTINS:
            rule = FORBIDDEN_BUILTINS[func.id]
            allowed = func.id == "globals" and _is_async_compile_wait_arg(node, self._parents)
            if rule and not allowed:
                self.add(rule, node, f"calls {func.id}()")
        if isinstance(func, ast.Name) and func.id in NAME_ACCESS_BUILTINS:
            self._check_getattr(node, func.id)
        dotted = _dotted(func)
        if dotted:
            last = dotted.split(".")[-1]
            if last in GLOBAL_STATE_NAMES:
                self.add("static_global_state", node, f"calls {dotted}()")
            if dotted.split(".")[0] in self.os_names and len(dotted.split(".")) > 1 and \
                    dotted.split(".")[1] not in OS_ALLOWED:
                self.add(_os_rule(dotted.split(".")[1]), node, f"calls {dotted}()")
            if dotted.startswith("tempfile."):
                self.add("static_file_access", node, f"calls {dotted}()")
            if last == "triton" and dotted.endswith("async_compile.triton"):
                self._collect_strings(node, python=True)
            elif (dotted.startswith("async_compile.") and last not in {"wait", "triton"}) or \
                    last in {"load_inline", "compile_inline", "load_cuda_inline"}:
                self._collect_strings(node, python=False)
        self.generic_visit(node)

    def _check_getattr(self, node: ast.Call, builtin: str) -> None:
        """getattr/hasattr/setattr/delattr: the name must be a literal, and is checked like `obj.name`."""
        shown = f"{builtin}({_source(node.args[0]) if node.args else ''}, ...)"
        name_node = node.args[1] if len(node.args) > 1 else None
        if isinstance(name_node, ast.Constant) and isinstance(name_node.value, str):
            name = name_node.value
            self._check_name(name, node, f"{builtin}(..., {name!r})")
            if name not in OS_ALLOWED and _dotted(node.args[0]) in self.os_names:
                self.add(_os_rule(name), node, f"{builtin}(os, {name!r})")
            return
        folded = _fold_str(name_node) if name_node is not None else None
        hint = f" (= {folded!r})" if folded is not None else ""
        self.add("static_dynamic_access", node, f"{shown} computes the attribute name{hint}; write the attribute "
                 "out literally")
        if folded is not None:
            self._check_name(folded, node, f"{builtin}(..., {folded!r})")
            if folded not in OS_ALLOWED and _dotted(node.args[0]) in self.os_names:
                self.add(_os_rule(folded), node, f"{builtin}(os, {folded!r})")

    def _collect_strings(self, node: ast.Call, python: bool) -> None:
        values = list(node.args) + [k.value for k in node.keywords]
        for value in values:
            for sub in ast.walk(value):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and "\n" in sub.value:
                    (self.python_strings if python else self.native_strings).append((sub.lineno, sub.value))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = _dotted(node)
        shown = dotted or f"<expression>.{node.attr}"
        if node.attr in DUNDER_ATTRS:
            self.add("static_introspection", node, f"uses .{node.attr}")
        else:
            self._check_name(node.attr, node, f"uses {shown}" if dotted else f"uses .{node.attr}")
        # os reached under any name: `os.kill`, `o.kill` after `import os as o`, `torch.os.kill`
        via_os = (isinstance(node.value, ast.Name) and node.value.id in self.os_names) or \
            (isinstance(node.value, ast.Attribute) and node.value.attr == "os")
        if via_os and node.attr not in OS_ALLOWED:
            self.add(_os_rule(node.attr), node, f"uses {shown}")
        if node.attr in LOAD_SAVE and not _is_triton(dotted):
            self.add("static_file_access", node, f"uses {shown} (file I/O; only Triton's tl.load is allowed)")
        if dotted and dotted.split(".")[-1] in GLOBAL_STATE_NAMES and isinstance(node.ctx, (ast.Store, ast.Del)):
            self.add("static_global_state", node, f"sets {dotted}")
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        # vars(torch)["sys"], globals()["os"], torch.__dict__["s" + "ys"]: the key is the attribute reached
        value = node.value
        namespace = (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and
                     value.func.id in {"vars", "globals", "locals"}) or \
            (isinstance(value, ast.Attribute) and value.attr == "__dict__")
        key = _fold_str(node.slice) if namespace else None
        if key is not None:
            self._check_name(key, node, f"namespace lookup [{key!r}]")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        parent = self._parent(node)
        if node.id in DUNDER_ATTRS:  # `__builtins__["getattr"]`: the module's builtins namespace
            self.add("static_introspection", node, f"uses {node.id}")
        if node.id in INDIRECT_BUILTINS and not isinstance(node.ctx, ast.Load):
            self.add("static_dynamic_access", node, f"rebinds the builtin name {node.id!r}")
        elif node.id in INDIRECT_BUILTINS and not (isinstance(parent, ast.Call) and parent.func is node):
            self.add("static_dynamic_access", node, f"uses the builtin {node.id} as a value; call it directly "
                     "with literal arguments (or not at all)")
        if node.id in self.os_names and isinstance(node.ctx, ast.Load) and \
                not (isinstance(parent, ast.Attribute) and parent.value is node):
            self.add("static_file_access", node, f"passes the os module {node.id!r} around; use os.path/os.sep "
                     "directly")

    # assignments ---------------------------------------------------------------------------------------
    def _check_target(self, target: ast.AST, node: ast.AST, verb: str) -> None:
        for sub in ast.walk(target):
            if isinstance(sub, (ast.Attribute, ast.Subscript)) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                root = _root_name(sub)
                if root in self.aliases:
                    dotted = _dotted(sub) or root
                    rule = "static_global_state" if dotted.startswith("torch.backends") else "static_monkeypatch"
                    self.add(rule, node, f"{verb} {dotted}")

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._check_target(target, node, "assigns to")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_target(node.target, node, "assigns to")
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check_target(node.target, node, "assigns to")
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._check_target(target, node, "deletes")
        self.generic_visit(node)

    # exceptions ------------------------------------------------------------------------------------------
    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        names = _handler_names(node.type)
        if node.type is None or names & BROAD_EXCEPTIONS:
            shown = "bare except" if node.type is None else f"except {', '.join(sorted(names))}"
            self.add("static_try_except", node, f"{shown} — broad handler")
        self.generic_visit(node)

    # parent links for context checks -------------------------------------------------------------------
    _parents: dict[int, ast.AST] = {}

    def _parent(self, node: ast.AST) -> ast.AST | None:
        return self._parents.get(id(node))


_OS_PROCESS = ("system", "popen", "fork", "forkpty", "kill", "killpg", "_exit", "abort", "exec", "spawn",
               "posix_spawn", "setsid", "setpgid", "nice", "sched_setaffinity", "wait", "register_at_fork")


def _os_rule(name: str) -> str:
    """os.<name>: process control (fork, kill, exec…), else file or environment access."""
    return "static_process_control" if name.startswith(_OS_PROCESS) else "static_file_access"


def _handler_names(node: ast.AST | None) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Tuple):
        return set().union(*(_handler_names(e) for e in node.elts))
    dotted = _dotted(node)
    return {dotted} if dotted else set()




def _fold_str(node: ast.AST) -> str | None:
    """The value of a string expression built from literals (`"s" + "ys"`, f-strings of literals), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _fold_str(node.left), _fold_str(node.right)
        return left + right if left is not None and right is not None else None
    if isinstance(node, ast.JoinedStr):
        parts = [_fold_str(v) for v in node.values]
        return "".join(p for p in parts if p is not None) if all(p is not None for p in parts) else None
    return None


def _source(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_triton(dotted: str | None) -> bool:
    """`tl.load` / `triton.language.load`: Triton's memory load, the only legitimate `load`."""
    return dotted in {f"{root}.load" for root in TRITON_ROOTS}


def _alias_closure(tree: ast.AST, aliases: set[str], os_names: set[str]) -> None:
    """Add names bound to a module alias by plain assignment (`_t = time`, `o = os`, `cu = torch.cuda`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update((a.asname or a.name).split(".")[0] for a in node.names)
            os_names.update(a.asname for a in node.names if a.name == "os" and a.asname)
        elif isinstance(node, ast.ImportFrom):
            os_names.update(a.asname or a.name for a in node.names if a.name == "os")
    assigns = [n for n in ast.walk(tree)
               if isinstance(n, ast.Assign) and isinstance(n.value, (ast.Name, ast.Attribute))]
    changed = True
    while changed:
        changed = False
        for node in assigns:
            root = _root_name(node.value)
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            for group, member in ((aliases, root in aliases or root in os_names),
                                  (os_names, isinstance(node.value, ast.Name) and node.value.id in os_names)):
                if member and not names <= group:
                    group.update(names)
                    changed = True


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node.id if isinstance(node, ast.Name) else None


def _is_async_compile_wait_arg(node: ast.Call, parents: dict[int, ast.AST]) -> bool:
    parent = parents.get(id(node))
    return isinstance(parent, ast.Call) and _dotted(parent.func) == "async_compile.wait" and not node.args


def _scan_python(source: str, base_line: int, label: str) -> tuple[list[Finding], _Scanner | None]:
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return [Finding("static_syntax", base_line + (exc.lineno or 1) - 1, f"{label}: {exc.msg}")], None
    scanner = _Scanner()
    # Rationale: a module alias passed on by assignment (`_t = time; _t.perf_counter = ...`) is the module.
    _alias_closure(tree, scanner.aliases, scanner.os_names)
    scanner._parents = {id(child): parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    scanner.visit(tree)
    for f in scanner.findings:
        object.__setattr__(f, "line", base_line + f.line - 1)
    return scanner.findings, scanner


# Rationale: Inductor's CPU C++ host wrapper (cpp_wrapper=True, the built-in agent's configuration generator)
# loads its C++ source with exactly one module-level `CppWrapperCodeCache.load_pybinding(...)` call. That is the
# same compile-and-load path as the `async_compile.cpp_pybinding` every CPU wrapper uses (its C++ text is scanned
# by the native patterns below like any kernel string); every other use of Inductor's code caches stays blocked.
_CPP_WRAPPER_MODULE, _CPP_WRAPPER_CLASS = "torch._inductor.codecache", "CppWrapperCodeCache"


def _is_cpp_wrapper_import(node: ast.ImportFrom) -> bool:
    return (node.module == _CPP_WRAPPER_MODULE and node.level == 0 and len(node.names) == 1 and
            node.names[0].name == _CPP_WRAPPER_CLASS and node.names[0].asname is None)


def _cpp_wrapper_findings(tree: ast.Module) -> tuple[list[Finding], list[tuple[int, str]]]:
    """``(findings, native strings)`` for the allowed ``CppWrapperCodeCache`` import: it must sit at module level
    and be used only as ``name = CppWrapperCodeCache.load_pybinding(..., device_type="cpu", ...)`` statements at
    module level whose code arguments are string literals or names bound once, at module level, to one; those
    strings are returned for the native-source patterns."""
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and _is_cpp_wrapper_import(n)]
    if not imports:
        return [], []
    found = [Finding("static_file_access", n.lineno, f"imports {_CPP_WRAPPER_MODULE}.{_CPP_WRAPPER_CLASS} "
                     "outside the module level") for n in imports if n not in tree.body]
    bindings: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bindings.setdefault(node.id, []).append(node)
    strings: dict[str, str] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) and \
                isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            strings[stmt.targets[0].id] = stmt.value.value
    allowed: set[int] = set()
    native: list[tuple[int, str]] = []
    for stmt in tree.body:
        call = stmt.value if isinstance(stmt, ast.Assign) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and
                call.func.attr == "load_pybinding" and isinstance(call.func.value, ast.Name) and
                call.func.value.id == _CPP_WRAPPER_CLASS):
            continue
        if not any(k.arg == "device_type" and isinstance(k.value, ast.Constant) and k.value.value == "cpu"
                   for k in call.keywords) or call.args:
            continue
        texts: list[str] = []
        for kw in call.keywords:
            if kw.arg not in ("main_code", "kernel_code"):
                continue
            value = kw.value
            if isinstance(value, ast.Constant) and isinstance(value.value, (str, type(None))):
                texts.append(value.value or "")
            elif isinstance(value, ast.Name) and value.id in strings and len(bindings.get(value.id, ())) == 1:
                texts.append(strings[value.id])
            else:
                texts = []
                found.append(Finding("static_file_access", call.lineno, f"{_CPP_WRAPPER_CLASS}.load_pybinding's "
                                     f"{kw.arg} must be a string literal or a name bound once to one"))
                break
        else:
            allowed.add(id(call.func.value))
            native += [(call.lineno, t) for t in texts]
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == _CPP_WRAPPER_CLASS and id(node) not in allowed:
            found.append(Finding("static_file_access", node.lineno, f"uses {_CPP_WRAPPER_CLASS} other than in a "
                                 "module-level `x = CppWrapperCodeCache.load_pybinding(..., device_type='cpu')`"))
    return found, native


def scan(source: str) -> list[Finding]:
    """All findings for a candidate source (empty list: nothing suspicious)."""
    findings, scanner = _scan_python(source, 1, "wrapper")
    if scanner is None:
        return findings
    tree = ast.parse(source)
    cpp_findings, cpp_strings = _cpp_wrapper_findings(tree)
    findings += cpp_findings
    scanner.native_strings += cpp_strings
    if not any((isinstance(n, ast.FunctionDef) and n.name == "call") or
               (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "call" for t in n.targets))
               for n in tree.body):
        findings.append(Finding("static_entry_point", 1, "no top-level `call` (def call(args) or call = runner.call)"))
    for line, text in scanner.python_strings:
        sub, _ = _scan_python(text, line, "Triton kernel source")
        findings.extend(sub)
    for line, text in scanner.native_strings:
        stripped = _strip_c_comments(text)
        for pattern, rule, what in NATIVE_PATTERNS:
            match = pattern.search(stripped)
            if match:
                findings.append(Finding(rule, line, f"native source {what} ({match.group(0).strip()})"))
    unique: dict[tuple[str, int], Finding] = {}
    for f in findings:
        unique.setdefault((f.rule, f.line), f)
    return list(unique.values())


def _strip_c_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def findings_to_failures(findings: list[Finding]) -> list[CheckFailure]:
    """One :class:`CheckFailure` per finding (first 20), each with the rule's reason."""
    out = []
    for f in findings[:20]:
        why = RULE_RATIONALE.get(f.rule, "")
        out.append(CheckFailure(f.rule, f"line {f.line}: {f.detail} ({f.rule}: {why})"))
    return out
