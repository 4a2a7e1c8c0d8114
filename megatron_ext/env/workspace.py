"""Host-side handling of a workspace the agent shaped: snapshots, copies, diffs, removal and restoring files.

Everything here runs in the trainer's process on content an adversary controls, so nothing trusts it: walks are
iterative (a 1500-deep tree cannot exhaust Python's recursion limit) and bounded in depth, entries and path
length; only regular files and symlinks are read or copied (a FIFO would block the host forever, a device or
socket has no content to grade); file contents are held in memory only up to a size cap, larger files are
streamed through a hash; diff measures fall back to a linear count when quadratic matching could take seconds.
Content that breaks a bound raises `WorkspaceError`, which grading turns into a wrong answer, never an
infrastructure error.
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from typing import Iterator, Optional

PATH_MAX = 4000   # below Linux's 4096, so every path built here can be opened by name


class WorkspaceError(RuntimeError):
    """The workspace's content breaks a bound of host-side handling (too deep, too many entries, too long paths);
    the message says which. Caused by the agent, so grading scores the episode wrong."""


@dataclass(frozen=True)
class WalkLimits:
    max_depth: int = 64                # folders below the root
    max_entries: int = 200_000         # files, links, folders and other entries in all
    max_file_bytes: Optional[int] = 4 << 20   # larger files are hashed, not held (None: hold every file)
    max_held_bytes: Optional[int] = 64 << 20  # file contents a snapshot holds in all; past it files are hashed


AGENT = WalkLimits()
TRUSTED = WalkLimits(max_depth=10_000, max_entries=10_000_000, max_file_bytes=None,
                     max_held_bytes=None)  # a task's own repository


@contextlib.contextmanager
def agent_content(what: str):
    """Turn OS errors that the workspace's content causes (a full disk, a file made unreadable) into
    WorkspaceError: the agent's doing, scored as a wrong answer."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG, errno.ELOOP,
                       errno.ENXIO, errno.EFBIG):
            raise WorkspaceError(f"{what}: {e.strerror} ({e.filename})") from None
        raise


def walk(folder: str, limits: WalkLimits = AGENT, skip_top_git: bool = True) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of every entry under folder, folders before their contents, without recursion or
    following symlinks; raises WorkspaceError past a bound."""
    stack, seen = [("", 0)], 0
    while stack:
        rel, depth = stack.pop()
        path = os.path.join(folder, rel) if rel else folder
        try:
            with agent_content("listing the workspace"):
                entries = sorted(os.scandir(path), key=lambda e: e.name)
        except (NotADirectoryError, FileNotFoundError):
            continue
        for entry in entries:
            if skip_top_git and not rel and entry.name == ".git":
                continue
            seen += 1
            if seen > limits.max_entries:
                raise WorkspaceError(f"the workspace has more than {limits.max_entries} entries")
            child = os.path.join(rel, entry.name) if rel else entry.name
            if len(folder) + len(child) + 1 > PATH_MAX:
                raise WorkspaceError(f"a path in the workspace is longer than {PATH_MAX} characters")
            st = entry.stat(follow_symlinks=False)
            yield child, st
            if stat.S_ISDIR(st.st_mode):
                if depth + 1 > limits.max_depth:
                    raise WorkspaceError(f"the workspace is nested deeper than {limits.max_depth} folders "
                                         f"({child[:200]}...)")
                stack.append((child, depth + 1))


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _open_regular(path: str):
    """A regular file opened for reading, never blocking on a FIFO swapped in at the last moment."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise WorkspaceError(f"{path}: not a regular file")
    return os.fdopen(fd, "rb", buffering=0)


def snapshot(folder: str, limits: WalkLimits = AGENT) -> dict[str, tuple]:
    """relative path -> ("file", bytes) | ("big", size, sha256) | ("link", target) | ("special", kind) of every
    non-folder entry under folder except the top .git; files over limits.max_file_bytes are hashed, not held."""
    out, held = {}, 0
    for rel, st in walk(folder, limits):
        path = os.path.join(folder, rel)
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ("link", os.readlink(path))
        elif stat.S_ISREG(st.st_mode):
            with agent_content(f"reading {rel}"):
                if (limits.max_file_bytes is not None and st.st_size > limits.max_file_bytes) or \
                        (limits.max_held_bytes is not None and held + st.st_size > limits.max_held_bytes):
                    out[rel] = ("big", st.st_size, _digest(path))
                else:
                    with _open_regular(path) as f:
                        out[rel] = ("file", f.read())
                    held += len(out[rel][1])
        elif not stat.S_ISDIR(st.st_mode):
            out[rel] = ("special", "fifo" if stat.S_ISFIFO(st.st_mode) else
                        "socket" if stat.S_ISSOCK(st.st_mode) else "device")
    return out


def _identity(entry) -> Optional[tuple]:
    if entry is not None and entry[0] == "file":
        return ("big", len(entry[1]), hashlib.sha256(entry[1]).hexdigest())
    return entry


def changed_paths(before: dict, after: dict) -> list[str]:
    """Paths added, removed or changed between two snapshots (a held file and a hashed one compare by content)."""
    out = []
    for p in set(before) | set(after):
        a, b = before.get(p), after.get(p)
        if a != b and (a is None or b is None or a[0] == b[0] or _identity(a) != _identity(b)):
            out.append(p)
    return sorted(out)


MATCH_CELLS = 4_000_000   # (old lines x new lines) past which difflib's matching is replaced by a linear count


def diff_lines(old: str, new: str) -> int:
    """Lines a unified diff of old -> new adds plus lines it removes (how mined tasks count reference_diff_lines).

    Common head and tail lines are skipped first (linear); difflib matches what is left only when that is small,
    since its matching is quadratic in repeated lines (300k blank lines took seconds); otherwise the count is the
    multiset difference of the lines, the same figure for any edit that does not move lines."""
    a, b = old.splitlines(), new.splitlines()
    head = 0
    while head < len(a) and head < len(b) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < len(a) - head and tail < len(b) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    a, b = a[head:len(a) - tail], b[head:len(b) - tail]
    if len(a) * len(b) <= MATCH_CELLS:
        matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
        return sum((i2 - i1) + (j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal")
    ca, cb = collections.Counter(a), collections.Counter(b)
    return sum((ca - cb).values()) + sum((cb - ca).values())


def _text(entry) -> Optional[str]:
    if entry is None:
        return ""
    if entry[0] != "file" or b"\0" in entry[1][:8192]:
        return None
    try:
        return entry[1].decode()
    except UnicodeDecodeError:
        return None


def remove_tree(path: str):
    """Remove path and everything under it, at any depth and without recursion: each folder met is first moved
    up to the top folder under a fresh name, so no path ever grows deeper than two levels."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        queue, counter = [], 0
        for name in _names(top, None):
            queue.append(name) if _is_dir(top, name) else os.unlink(name, dir_fd=top)
        while queue:
            name = queue.pop()
            fd = _open_dir(top, name)
            try:
                for child in _names(fd, (top, name)):
                    if _is_dir(fd, child):
                        while True:
                            counter += 1
                            fresh = f".rm-{counter}"
                            try:
                                os.lstat(fresh, dir_fd=top)
                            except FileNotFoundError:
                                break
                        os.rename(child, fresh, src_dir_fd=fd, dst_dir_fd=top)
                        queue.append(fresh)
                    else:
                        os.unlink(child, dir_fd=fd)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)


def _is_dir(fd: int, name: str) -> bool:
    return stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode)


def _open_dir(top: int, name: str) -> int:
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
    except PermissionError:  # a folder the sandbox made unreadable (a non-root host cannot bypass its mode)
        os.chmod(name, 0o700, dir_fd=top, follow_symlinks=False)
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)


def _names(fd: int, parent) -> list[str]:
    if parent is not None and os.geteuid() != 0:
        os.chmod(parent[1], 0o700, dir_fd=parent[0], follow_symlinks=False)  # unlinking needs write permission
    return sorted(os.listdir(fd))


def copy_tree(source: str, dest: str, limits: WalkLimits = AGENT, owner: Optional[tuple] = None,
              skip_git: bool = True):
    """Copy folder source into the existing folder dest: folders, regular files (content and mode) and symlinks
    (never followed); FIFOs, sockets and devices are left out; .git folders are skipped. owner=(uid, gid) makes
    every copied entry theirs (the sandbox's unprivileged host user)."""
    with agent_content("copying the workspace"):
        _copy_tree(source, dest, limits, owner, skip_git)


def _copy_tree(source: str, dest: str, limits: WalkLimits, owner: Optional[tuple], skip_git: bool):
    for rel, st in walk(source, limits, skip_top_git=False):
        if skip_git and ".git" in rel.split(os.sep):
            continue
        src, dst = os.path.join(source, rel), os.path.join(dest, rel)
        if stat.S_ISDIR(st.st_mode):
            os.makedirs(dst, exist_ok=True)
            os.chmod(dst, stat.S_IMODE(st.st_mode) | 0o700)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(src), dst)
        elif stat.S_ISREG(st.st_mode):
            with _open_regular(src) as fin, open(dst, "wb") as fout:
                while chunk := fin.read(1 << 20):
                    fout.write(chunk)
            os.chmod(dst, stat.S_IMODE(st.st_mode) | 0o600)
        else:
            continue
        if owner is not None:
            os.lchown(dst, *owner)


def chown_tree(folder: str, owner: tuple):
    """Make folder and everything under it belong to owner=(uid, gid), symlinks themselves, not their targets."""
    os.lchown(folder, *owner)
    for rel, _ in walk(folder, TRUSTED, skip_top_git=False):
        os.lchown(os.path.join(folder, rel), *owner)


def clear_path(root: str, rel: str) -> str:
    """The host path of root/rel, made safe to write as a regular file: any symlink or file standing where a folder
    of the path should be, and whatever occupies the path itself, is removed first. Host-side writes into a
    workspace the agent shaped (restoring files, laying hidden tests over it) go through here, so a symlink the
    agent planted can never redirect them outside the workspace."""
    parts = os.path.normpath(rel).split(os.sep)
    if os.path.isabs(rel) or ".." in parts:
        raise ValueError(f"{rel}: not a path inside the workspace")
    current = root
    for name in parts[:-1]:
        current = os.path.join(current, name)
        if os.path.islink(current) or (os.path.lexists(current) and not os.path.isdir(current)):
            os.unlink(current)
        if not os.path.lexists(current):
            os.mkdir(current)
            os.chmod(current, 0o755)  # whatever the umask: the sandbox may run as another host uid
    path = os.path.join(current, parts[-1])
    if os.path.lexists(path):
        remove_tree(path)  # a file, link, FIFO, socket or device node, or a folder of any depth
    return path


def _restore(workspace: str, rel: str, entry):
    with agent_content(f"restoring {rel}"):  # a workspace the agent filled to its disk limit
        path = clear_path(workspace, rel)
        if entry is None or entry[0] not in ("file", "link"):
            return
        if entry[0] == "link":
            os.symlink(entry[1], path)
        else:
            with open(path, "wb") as f:
                os.fchmod(f.fileno(), 0o644)  # readable by the sandbox's uid under any umask, writable by none
                f.write(entry[1])


def overlay(folder: str, workspace: str):
    """Copy every file under folder into workspace at the same relative path (see clear_path)."""
    for rel, entry in sorted(snapshot(folder, TRUSTED).items()):
        _restore(workspace, rel, entry)
