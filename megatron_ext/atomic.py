"""Outputs that appear only when complete, and never at the expense of files a tool did not write.

Every tool writes to a temporary name next to its target and renames on success (a rename within one file system
is atomic), so a failure, Ctrl-C or empty result leaves an older output untouched. A tool that writes several files
into a directory the user names stages them in a fresh temporary directory and then moves only those files in:
whatever else the directory holds stays where it is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


class Discard(Exception):
    """Raise inside `atomic_output` to drop what was written (e.g. nothing matched) without replacing the target."""


def current_umask() -> int:
    """The process umask, read without changing it (os.umask sets it, racing other threads' file creation)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(path: str, mode: str = "w", encoding: str | None = "utf-8"):
    """Open a temporary sibling of `path` for writing; rename it onto `path` when the block completes. On an
    exception (including `Discard`, which is swallowed) the temporary file is removed and `path` is untouched."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp's 0600 would make outputs private to their writer
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Discard:
        os.remove(tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def staging_dir(target: str) -> str:
    """A fresh empty directory on the same file system as directory `target` (inside it when it exists, else
    next to it), for `publish_dir` to move from."""
    target = os.path.abspath(target)
    if os.path.isdir(target):
        return tempfile.mkdtemp(prefix=".staging.", dir=target)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix="." + os.path.basename(target) + ".", suffix=".tmp", dir=parent)


def existing_entries(target: str) -> list[str]:
    """What directory `target` holds (nothing when it does not exist); refuses a path that is not a directory."""
    if not os.path.exists(target):
        return []
    if not os.path.isdir(target):
        raise NotADirectoryError(f"{target} exists and is not a directory")
    return sorted(os.listdir(target))


def publish_dir(staging: str, target: str) -> list[str]:
    """Move every file of `staging` into `target` (replacing same-named files only) and remove `staging`.
    A missing target is created by renaming the staging directory itself. Returns the names moved."""
    target = os.path.abspath(target)
    names = sorted(os.listdir(staging))
    if not os.path.exists(target):
        os.replace(staging, target)
        return names
    for name in names:
        dest = os.path.join(target, name)
        if os.path.isdir(dest) and not os.path.islink(dest):
            raise IsADirectoryError(f"{dest} is a directory; it would be replaced by a file of the same name")
    for name in names:
        os.replace(os.path.join(staging, name), os.path.join(target, name))
    os.rmdir(staging)
    return names


def remove_staging(staging: str):
    shutil.rmtree(staging, ignore_errors=True)
