"""The RL package reuses the training loop's pieces through their public names only."""

from __future__ import annotations

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_rl_imports_no_private_name_from_training():
    private = []
    for path in glob.glob(os.path.join(ROOT, "megatron_ext", "rl", "*.py")) + [os.path.join(ROOT, "rl_composer.py")]:
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_ext.training"):
                private += [f"{os.path.basename(path)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and isinstance(node.value, ast.Name) and node.value.id in ("checkpointing", "loop", "step"):
                private.append(f"{os.path.basename(path)}: {node.value.id}.{node.attr}")
    assert private == []
