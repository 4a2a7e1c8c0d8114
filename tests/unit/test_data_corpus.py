"""tools/build_corpus.py: deterministic, deduplicated, size-filtered JSONL with language and licence hints."""

import json
import os
import subprocess
import sys

from megatron_ext.data.corpus import build_corpus, classify_license_text, stdlib_dir
from tests.unit.data_fixtures import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(path, content, mode="w"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as f:
        f.write(content)


def _tree(root):
    body = "def f():\n    return 42\n" * 5
    _write(f"{root}/proj/LICENSE", "MIT License\n\nPermission is hereby granted, free of charge, to any person")
    _write(f"{root}/proj/b/util.py", body)
    _write(f"{root}/proj/a/copy.py", body)  # exact duplicate of b/util.py: the first in path order stays
    _write(f"{root}/proj/a/spdx.c", "// SPDX-License-Identifier: Apache-2.0\nint main(void) { return 0; }\n" * 3)
    _write(f"{root}/proj/tiny.py", "x = 1\n")
    _write(f"{root}/proj/huge.py", "y = 2\n" * 1000)
    _write(f"{root}/proj/binary.py", b"\xff\xfe\x00 not utf-8 " * 20, "wb")
    _write(f"{root}/proj/__pycache__/cached.py", body + "# other\n")
    _write(f"{root}/proj/notes.bin", body)
    _write(f"{root}/site/pkg/mod.py", body + "# pkg\n")
    _write(f"{root}/site/pkg-1.0.dist-info/METADATA",
           "Metadata-Version: 2.1\nName: pkg\nLicense-Expression: BSD-3-Clause\n\n")
    _write(f"{root}/site/pkg-1.0.dist-info/top_level.txt", "pkg\n")


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_dedupe_filters_order_and_licence_hints(tmp_path):
    _tree(tmp_path)
    out = tmp_path / "out.jsonl"
    stats = build_corpus([str(tmp_path / "proj"), str(tmp_path / "site")], str(out), min_bytes=20, max_bytes=2000)
    recs = _records(out)
    assert [r["path"] for r in recs] == ["proj/a/copy.py", "proj/a/spdx.c", "site/pkg/mod.py"]
    assert (stats.written, stats.duplicates, stats.too_small, stats.too_large, stats.not_text) == (3, 1, 1, 1, 1)
    by_path = {r["path"]: r for r in recs}
    assert by_path["proj/a/copy.py"]["license"] == "MIT" and by_path["proj/a/copy.py"]["language"] == "Python"
    assert by_path["proj/a/spdx.c"]["license"] == "Apache-2.0" and by_path["proj/a/spdx.c"]["language"] == "C"
    assert by_path["site/pkg/mod.py"]["license"] == "BSD-3-Clause"
    with open(tmp_path / "proj/a/copy.py") as f:
        assert by_path["proj/a/copy.py"]["text"] == f.read()
    # deterministic: a second build is byte-identical
    again = tmp_path / "again.jsonl"
    build_corpus([str(tmp_path / "proj"), str(tmp_path / "site")], str(again), min_bytes=20, max_bytes=2000)
    assert out.read_bytes() == again.read_bytes()
    assert not os.path.exists(str(out) + ".tmp")


def test_license_text_classification():
    assert classify_license_text("Apache License\nVersion 2.0, January 2004") == "Apache-2.0"
    assert classify_license_text("PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2") == "PSF-2.0"
    assert classify_license_text("Redistribution and use in source and binary forms, with or without") == "BSD"
    assert classify_license_text("all rights reserved") == "other"


def test_cli_defaults_to_the_standard_library(tmp_path):
    out = tmp_path / "stdlib.jsonl"
    proc = subprocess.run([sys.executable, "tools/build_corpus.py", "--output", str(out), "--max-files", "5",
                           "--extensions", ".py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    recs = _records(out)
    assert len(recs) == 5 and all(r["language"] == "Python" for r in recs)
    assert recs == sorted(recs, key=lambda r: r["path"])
    assert all(r["path"].startswith(os.path.basename(stdlib_dir()) + "/") for r in recs)
    if os.path.isfile(os.path.join(stdlib_dir(), "LICENSE.txt")):  # CPython installs its licence there
        assert all(r["license"] == "PSF-2.0" for r in recs)


def test_cli_errors(tmp_path, capsys):
    tool = load_tool("build_corpus")
    assert tool.main(["--input", str(tmp_path / "missing"), "--output", str(tmp_path / "x.jsonl")]) == 2
    assert "--input" in capsys.readouterr().err
    (tmp_path / "only.txt").write_text("plain text, not code\n" * 10)
    assert tool.main(["--input", str(tmp_path), "--output", str(tmp_path / "x.jsonl")]) == 1
    assert "no files matched" in capsys.readouterr().err
