"""A code corpus from source trees on this machine, as JSONL for tools/preprocess_data.py.

Every Python installation carries a real, permissively licensed code corpus: its standard library (and whatever
is in site-packages). The demo trains on it so that nothing has to be downloaded. Output is deterministic for a
given tree (files in sorted path order, the first of exact duplicates kept), so corpora, tokenizers and datasets
built from it are reproducible.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from email.parser import HeaderParser
from typing import Iterable, Optional, Sequence

from megatron_ext.atomic import Discard, atomic_output

LANGUAGES = {
    ".py": "Python", ".pyi": "Python", ".c": "C", ".h": "C", ".cc": "C++", ".cpp": "C++", ".cxx": "C++",
    ".hpp": "C++", ".cu": "CUDA", ".rs": "Rust", ".go": "Go", ".java": "Java", ".js": "JavaScript",
    ".mjs": "JavaScript", ".ts": "TypeScript", ".sh": "Shell", ".bash": "Shell", ".rb": "Ruby", ".pl": "Perl",
    ".lua": "Lua", ".sql": "SQL", ".toml": "TOML", ".yaml": "YAML", ".yml": "YAML", ".md": "Markdown",
    ".rst": "reStructuredText", ".tcl": "Tcl", ".f90": "Fortran", ".pyx": "Cython", ".pxd": "Cython",
}
DEFAULT_EXCLUDE = ("__pycache__", ".git", "site-packages", "dist-packages", "*.egg-info", "node_modules")

_SPDX = re.compile(rb"SPDX-License-Identifier:\s*([A-Za-z0-9.+\-() ]+?)\s*(?:\*/|-->|$)", re.MULTILINE)
_LICENSE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "LICENSE.rst", "COPYING", "COPYING.txt", "LICENCE")
# Phrases that identify the common licences in their own text (first few KB of a LICENSE file).
_LICENSE_PHRASES = (
    ("PYTHON SOFTWARE FOUNDATION LICENSE", "PSF-2.0"),
    ("Apache License", "Apache-2.0"),
    ("GNU LESSER GENERAL PUBLIC LICENSE", "LGPL"),
    ("GNU GENERAL PUBLIC LICENSE", "GPL"),
    ("Mozilla Public License", "MPL-2.0"),
    ("Permission is hereby granted, free of charge", "MIT"),
    ("Redistribution and use in source and binary forms", "BSD"),
    ("This is free and unencumbered software released into the public domain", "Unlicense"),
)


def stdlib_dir() -> str:
    """The running interpreter's standard library: the default corpus."""
    return sysconfig.get_paths()["stdlib"]


@dataclass
class CorpusStats:
    files_seen: int = 0
    written: int = 0
    bytes_written: int = 0
    duplicates: int = 0
    too_small: int = 0
    too_large: int = 0
    not_text: int = 0
    languages: Counter = field(default_factory=Counter)
    licenses: Counter = field(default_factory=Counter)

    def lines(self) -> list[str]:
        out = [f"{self.written:,} files ({self.bytes_written / 1e6:.1f} MB) written of {self.files_seen:,} seen; "
               f"skipped {self.duplicates} exact duplicates, {self.too_small} too small, {self.too_large} too "
               f"large, {self.not_text} not UTF-8 text"]
        out.append("languages: " + ", ".join(f"{k} {v}" for k, v in self.languages.most_common()))
        out.append("licenses: " + ", ".join(f"{k} {v}" for k, v in self.licenses.most_common()))
        return out


def _excluded(rel: str, patterns: Sequence[str]) -> bool:
    parts = rel.split(os.sep)
    return any(fnmatch.fnmatch(part, pat) for part in parts for pat in patterns) or \
        any(fnmatch.fnmatch(rel, pat) for pat in patterns)


def iter_source_files(roots: Sequence[str], extensions: Iterable[str], exclude: Sequence[str]):
    """(root, relative path) of every matching file, roots in the given order, paths sorted within each root."""
    extensions = {e.lower() for e in extensions}
    for root in roots:
        root = os.path.abspath(root)
        if os.path.isfile(root):
            yield os.path.dirname(root), os.path.basename(root)
            continue
        found = []
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            dirnames[:] = [d for d in dirnames if not _excluded(os.path.normpath(os.path.join(rel_dir, d)), exclude)]
            for name in filenames:
                rel = os.path.normpath(os.path.join(rel_dir, name))
                if os.path.splitext(name)[1].lower() in extensions and not _excluded(rel, exclude):
                    found.append(rel)
        for rel in sorted(found):
            yield root, rel


def classify_license_text(text: str) -> str:
    for phrase, name in _LICENSE_PHRASES:
        if phrase.lower() in text.lower():
            return name
    return "other"


class LicenseHints:
    """Where a file's licence is stated, nearest first: an SPDX line in the file, a LICENSE/COPYING file in its
    directory or an ancestor up to the corpus root (the standard library's is LICENSE.txt at its root), and for
    installed packages the distribution's metadata. A hint, not a legal determination."""

    def __init__(self):
        self._dirs: dict[str, Optional[str]] = {}
        self._dists: dict[str, dict[str, str]] = {}

    def hint(self, root: str, rel: str, head: bytes) -> str:
        m = _SPDX.search(head)
        if m:
            return m.group(1).decode("ascii", "replace").strip()
        directory = os.path.dirname(os.path.join(root, rel))
        while True:
            found = self._dir_license(directory)
            if found:
                return found
            if directory == root or os.path.dirname(directory) == directory:
                break
            directory = os.path.dirname(directory)
        return self._dist_licenses(root).get(rel.split(os.sep)[0], "unknown")

    def _dir_license(self, directory: str) -> Optional[str]:
        if directory not in self._dirs:
            self._dirs[directory] = None
            for name in _LICENSE_FILES:
                path = os.path.join(directory, name)
                if os.path.isfile(path):
                    with open(path, encoding="utf-8", errors="replace") as f:
                        self._dirs[directory] = classify_license_text(f.read(8192))
                    break
        return self._dirs[directory]

    def _dist_licenses(self, root: str) -> dict[str, str]:
        """Top-level package name -> licence, from the *.dist-info directories of a site-packages root."""
        if root in self._dists:
            return self._dists[root]
        out: dict[str, str] = {}
        try:
            entries = sorted(os.listdir(root))
        except OSError:
            entries = []
        for entry in entries:
            info = os.path.join(root, entry)
            if not entry.endswith(".dist-info") or not os.path.isdir(info):
                continue
            name = _dist_license(info)
            tops = _read_lines(os.path.join(info, "top_level.txt")) or [entry.split("-")[0]]
            for top in tops:
                out.setdefault(top, name)
        self._dists[root] = out
        return out


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.strip() for line in f if line.strip()]
    except OSError:
        return []


def _dist_license(info_dir: str) -> str:
    try:
        with open(os.path.join(info_dir, "METADATA"), encoding="utf-8", errors="replace") as f:
            meta = HeaderParser().parse(f)
    except OSError:
        return "unknown"
    if meta.get("License-Expression"):
        return meta["License-Expression"].strip()
    for classifier in meta.get_all("Classifier") or []:
        if classifier.startswith("License ::"):
            return classifier.split("::")[-1].strip()
    short = (meta.get("License") or "").strip().splitlines()
    if short and len(short[0]) <= 40:
        return short[0]
    return classify_license_text(meta.get("License") or "") if meta.get("License") else "unknown"


def build_corpus(roots: Sequence[str], output: str, extensions: Iterable[str] = tuple(LANGUAGES),
                 exclude: Sequence[str] = DEFAULT_EXCLUDE, min_bytes: int = 64, max_bytes: int = 1 << 20,
                 max_files: Optional[int] = None) -> CorpusStats:
    """Write one JSON object per kept file: text, path (relative to its root, prefixed with the root's name),
    language, license hint and content hash. Written to a temporary name and renamed when complete; when no file
    is kept, `output` is left as it was (stats.written == 0 tells the caller)."""
    stats, hints, seen = CorpusStats(), LicenseHints(), set()
    with atomic_output(output) as out:
        for root, rel in iter_source_files(roots, extensions, exclude):
            if max_files is not None and stats.written >= max_files:
                break
            stats.files_seen += 1
            path = os.path.join(root, rel)
            try:
                size = os.path.getsize(path)
            except OSError:
                stats.not_text += 1
                continue
            if size < min_bytes:
                stats.too_small += 1
                continue
            if size > max_bytes:
                stats.too_large += 1
                continue
            with open(path, "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                stats.not_text += 1
                continue
            if "\x00" in text:
                stats.not_text += 1
                continue
            digest = hashlib.sha256(raw).hexdigest()
            if digest in seen:
                stats.duplicates += 1
                continue
            seen.add(digest)
            language = LANGUAGES.get(os.path.splitext(rel)[1].lower(), "unknown")
            license_hint = hints.hint(root, rel, raw[:4096])
            record = {"text": text, "path": os.path.join(os.path.basename(root), rel), "language": language,
                      "license": license_hint, "sha256": digest}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            stats.written += 1
            stats.bytes_written += len(raw)
            stats.languages[language] += 1
            stats.licenses[license_hint] += 1
        if stats.written == 0:
            raise Discard  # nothing matched: an existing output stays as it was
    return stats
