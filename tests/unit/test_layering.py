"""Import layering: the LM step lives in the library, benchmarks and tools do not import tests, no import cycles
inside megatron_ext, and no subpackage reaching into another's private names.

The package graph is read from source with ast (nothing is imported), counting every import at any depth: a lazy
import inside a function still ties the two files together, it only hides the cycle from import time.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from collections import deque

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "megatron_ext"

def _imports(path: str) -> set[str]:
    """Every module name a file imports, at any depth (lazy imports inside functions included)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _py_files(folder: str):
    for base, _, files in os.walk(os.path.join(ROOT, folder)):
        yield from (os.path.join(base, f) for f in files if f.endswith(".py"))


@dataclasses.dataclass(frozen=True)
class _Use:
    """One reference from a file to a megatron_ext module: an import (name=None) or a name taken from it."""

    src: str
    dst: str
    name: str | None
    line: int
    text: str

    @property
    def target(self) -> str:
        return f"{self.dst}.{self.name}" if self.name else self.dst

    def where(self) -> str:
        return f"{os.path.relpath(_modules()[self.src], ROOT)}:{self.line}: {self.text}"


_MODULES: dict[str, dict[str, str]] = {}
_GRAPHS: dict[str, dict[str, list[_Use]]] = {}


def _modules() -> dict[str, str]:
    """Module name -> file, for every .py under the package (a namespace folder like rl/ counts as a package)."""
    if ROOT not in _MODULES:
        _MODULES[ROOT] = {}
        for path in _py_files(PACKAGE):
            parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            _MODULES[ROOT][".".join(parts)] = path
    return _MODULES[ROOT]


def _owner(dotted: str) -> tuple[str, str | None] | None:
    """Split a dotted reference into (the longest megatron_ext module it names, the next component or None)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in _modules():
            return module, (parts[cut] if cut < len(parts) else None)
    return None


def _private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _uses(module: str) -> list[_Use]:
    """Every megatron_ext module this module imports, and every name it takes from one, with the line.

    `from pkg import x` is an import of pkg.x when that is a module, else of pkg taking the name x; relative imports
    resolve against the file's package; `alias._name` on an imported module is taken like `from module import _name`.
    """
    path = _modules()[module]
    with open(path) as f:
        source = f.read()
    lines, tree = source.splitlines(), ast.parse(source, path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    uses: list[_Use] = []
    bound: dict[str, str] = {}

    def add(dotted: str, node: ast.AST, name: str | None = None):
        owner = _owner(dotted)
        if owner is not None:
            target, rest = owner
            uses.append(_Use(module, target, name if name is not None else rest, node.lineno,
                             lines[node.lineno - 1].strip()))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
                if alias.asname:
                    bound[alias.asname] = alias.name
                elif alias.name.split(".")[0] == PACKAGE:
                    bound[PACKAGE] = PACKAGE
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in _modules():
                    add(full, node)
                    bound[alias.asname or alias.name] = full
                else:
                    add(base, node, alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            head, _, tail = (dotted or "").partition(".")
            if head in bound and tail:
                owner = _owner(f"{bound[head]}.{tail}")
                if owner and _private(owner[1]):
                    add(f"{bound[head]}.{tail}", node)
    return list(dict.fromkeys(uses))


def _graph() -> dict[str, list[_Use]]:
    if ROOT not in _GRAPHS:
        _GRAPHS[ROOT] = {m: [u for u in _uses(m) if u.dst != m] for m in sorted(_modules())}
    return _GRAPHS[ROOT]


def _cycles(graph: dict[str, list[_Use]]) -> dict[frozenset[str], list[list[_Use]]]:
    """Strongly connected components of two or more modules, each with the shortest cycle through every member."""
    succ = {m: sorted({u.dst for u in uses}) for m, uses in graph.items()}
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def strongconnect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(frozenset(comp))

    for v in succ:
        if v not in index:
            strongconnect(v)

    found = {}
    for comp in comps:
        cycles, seen = [], set()
        for start in sorted(comp):
            prev, queue = {start: None}, deque([start])
            closing = None
            while queue and closing is None:
                v = queue.popleft()
                for u in graph[v]:
                    if u.dst == start:
                        closing = u
                        break
                    if u.dst in comp and u.dst not in prev:
                        prev[u.dst] = u
                        queue.append(u.dst)
            path = [closing]
            while path[0].src != start:
                path.insert(0, prev[path[0].src])
            if frozenset(e.src for e in path) not in seen:
                seen.add(frozenset(e.src for e in path))
                cycles.append(path)
        found[comp] = cycles
    return found


def _subpackage(module: str) -> str:
    """The layer unit a module belongs to: megatron_ext.rl.trainer -> rl, a top-level module is its own unit."""
    return module.split(".")[1] if module != PACKAGE else PACKAGE


def _private_uses(graph: dict[str, list[_Use]]) -> list[_Use]:
    """Private names, and private modules, that one subpackage takes from another."""
    return [u for uses in graph.values() for u in uses if _subpackage(u.src) != _subpackage(u.dst)
            and (_private(u.name) or u.name is None and _private(u.dst.rpartition(".")[2]))]


def test_library_benchmarks_and_tools_do_not_import_tests():
    offenders = {os.path.relpath(p, ROOT): sorted(m for m in _imports(p) if m == "tests" or m.startswith("tests."))
                 for folder in ("megatron_ext", "benchmarks", "tools") for p in _py_files(folder)}
    assert not {k: v for k, v in offenders.items() if v}


def test_stages_does_not_import_arguments():
    """arguments.py imports training/stages.py to add the stage flags; the reverse import would be a cycle."""
    assert not {m for m in _imports(os.path.join(ROOT, "megatron_ext", "training", "stages.py"))
                if m.startswith("megatron_ext.arguments")}


def test_no_import_cycle_in_the_package():
    """The package reads top-down (entry scripts -> rl/, eval/ -> env/, convert/ -> arguments -> inference/ ->
    training/ -> models/ -> data/ -> platform); a cycle means a change on either side silently needs the other."""
    cycles = _cycles(_graph())
    report = []
    for comp, paths in sorted(cycles.items(), key=lambda kv: sorted(kv[0])):
        report.append("cycle among " + ", ".join(sorted(comp)) + ":")
        for path in paths:
            report.append("  " + " -> ".join([path[0].src] + [u.dst for u in path]))
            report.extend(f"      {u.where()}" for u in path)
    if cycles:
        pytest.fail("import cycles in megatron_ext:\n" + "\n".join(report), pytrace=False)


def test_no_subpackage_imports_another_subpackages_private_names():
    """A leading underscore is the owner's licence to change it; a caller in another subpackage needs a public name."""
    found = list(_private_uses(_graph()))
    if found:
        pytest.fail("private names taken across subpackages:\n" + "\n".join(
            f"  {u.src} takes {u.target}\n      {u.where()}" for u in found), pytrace=False)


def test_the_checker_sees_lazy_relative_and_from_package_imports(tmp_path, monkeypatch):
    """The graph must count the forms that hide a cycle: a function-level import, `from pkg import module`, a
    relative import, and a private name reached as an attribute of an imported module."""
    pkg = tmp_path / PACKAGE
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("def f():\n    from megatron_ext.b import y\n    return y\n")
    (pkg / "b" / "y.py").write_text("from ..a import x\nfrom . import z\n")
    (pkg / "b" / "z.py").write_text("")
    (pkg / "a" / "_impl.py").write_text("")
    (pkg / "c.py").write_text("import megatron_ext.a.x as ax\nfrom megatron_ext.a import _impl\n"
                              "v = ax._hidden\nw = ax.public\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    graph = _graph()
    assert list(_cycles(graph)) == [frozenset({"megatron_ext.a.x", "megatron_ext.b.y"})]
    assert {u.dst for u in graph["megatron_ext.b.y"]} == {"megatron_ext.a.x", "megatron_ext.b.z"}
    assert sorted((u.src, u.dst, u.name) for u in _private_uses(graph)) == [
        ("megatron_ext.c", "megatron_ext.a._impl", None), ("megatron_ext.c", "megatron_ext.a.x", "_hidden")]


def test_entry_script_trains_with_the_library_step():
    code = ("import pretrain_composer as e, megatron_ext.training.lm as lm; "
            "print(e.forward_step is lm.forward_step, e.train_data_iterator is lm.train_data_iterator)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.stdout.split() == ["True", "True"], out.stderr
    tree = ast.parse(open(os.path.join(ROOT, "pretrain_composer.py")).read())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert defined == {"main"}
