"""Import layering: the LM step lives in the library, benchmarks and tools do not import tests, no import cycles."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def test_library_benchmarks_and_tools_do_not_import_tests():
    offenders = {os.path.relpath(p, ROOT): sorted(m for m in _imports(p) if m == "tests" or m.startswith("tests."))
                 for folder in ("megatron_ext", "benchmarks", "tools") for p in _py_files(folder)}
    assert not {k: v for k, v in offenders.items() if v}


def test_stages_does_not_import_arguments():
    """arguments.py imports training/stages.py to add the stage flags; the reverse import would be a cycle."""
    assert not {m for m in _imports(os.path.join(ROOT, "megatron_ext", "training", "stages.py"))
                if m.startswith("megatron_ext.arguments")}


def test_entry_script_trains_with_the_library_step():
    code = ("import pretrain_composer as e, megatron_ext.training.lm as lm; "
            "print(e.forward_step is lm.forward_step, e.train_data_iterator is lm.train_data_iterator)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.stdout.split() == ["True", "True"], out.stderr
    tree = ast.parse(open(os.path.join(ROOT, "pretrain_composer.py")).read())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert defined == {"main"}
