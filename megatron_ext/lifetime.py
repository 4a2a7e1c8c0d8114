"""Helper processes die with the process that started them.

A trainer killed with SIGKILL cannot clean up, and Python's multiprocessing does not tie a child's life to its
parent's: Megatron-Core's checkpoint writer forks worker processes per save and keeps a spawned Manager server for
its results queue (megatron/core/dist_checkpointing/strategies/filesystem_async.py), and a kill -9 of the trainer
left that server (and a writer caught mid-save, which inherits the trainer's flag-only SIGTERM handler and so
outlives a SIGTERM too) running with its memory. `install()` runs when megatron_ext is imported, in the trainer and
in every spawned child (which imports the entry script's module, and with it this package):

* a child forked by the main thread gets the kernel's parent-death signal (prctl PR_SET_PDEATHSIG, SIGKILL); the
  kernel ties it to the forking thread, so a child forked by another thread, which may end first, gets the watcher
  below instead;
* a spawned multiprocessing child watches its parent from a daemon thread and exits when it is gone.

* a torchrun worker (a rank) watches torchrun and exits when it is gone: torchrun starts each rank in a session of
  its own, so a kill -9 of torchrun, or of the process group it runs in, left the ranks training (seen: a killed
  benchmark's two ranks trained on for a minute until stopped by hand), and a re-run command's new ranks would
  then write into the same --save as the orphans. (A SIGTERM or SIGINT reaches torchrun, which forwards it and
  waits for the ranks to save and exit; only then is it gone.)
* processes started by exec (Ray's local instance: its GCS and raylet die with the trainer, but the raylet's
  dashboard and runtime-env agents outlive it, their exit hung on the dead GCS, and catch SIGTERM) are reaped by a
  watcher process (`supervise_descendants`) that records the trainer's descendants and kills them when it dies.

Forked children keep the SIGTERM handler they inherit: a SLURM preemption signals every process of the job, and a
checkpoint writer must finish the save the trainer is about to make.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
_forking: dict = {}
_installed = False


def _prctl_parent_death(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int, interval: float = 1.0, why: str = ""):
    def watch():
        while os.getppid() == parent:
            time.sleep(interval)
        if why:
            os.write(2, f"megatron_ext: {why} (pid {parent}) is gone: exiting\n".encode())
        os._exit(1)  # no cleanup handlers: they would wait for the dead parent

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _before_fork():
    _forking["parent"] = os.getpid()
    _forking["main_thread"] = threading.current_thread() is threading.main_thread()


def _after_fork_in_child():
    parent = _forking.get("parent")
    if parent is None:
        return
    import signal

    if not (_forking.get("main_thread") and _prctl_parent_death(signal.SIGKILL)):
        _watch_parent(parent)
    elif os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def install():
    """Idempotent; Linux only (elsewhere nothing changes)."""
    global _installed
    if _installed or not sys.platform.startswith("linux"):
        return
    _installed = True
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    # A multiprocessing spawn child importing the entry script's modules (its sys.argv is the parent's by then).
    if "--multiprocessing-fork" in getattr(sys, "orig_argv", ()):
        _watch_parent(os.getppid())
    elif _started_by_torchrun():
        _watch_parent(os.getppid(), why="torchrun")


def _started_by_torchrun() -> bool:
    """This process is a rank torchrun started: its launcher variables are set and its parent is torchrun (a
    process the rank starts inherits the variables, not the parent)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "LOCAL_RANK" not in os.environ:
        return False
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(b"torchrun") or a in (b"torch.distributed.run", b"torch.distributed.launch")
               or a.endswith(b"torch/distributed/run.py") for a in argv)


_WATCHER = r"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: outlive the trainer's shutdown
trainer, me, known = int(sys.argv[1]), os.getpid(), {}


def stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), fields[19]  # state, parent, start time (tells a reused pid apart)
    except (OSError, IndexError, ValueError):
        return None


while (s := stat(trainer)) is not None and s[0] not in "ZX":
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (c := stat(int(name))) is not None:
            children.setdefault(c[1], []).append((int(name), c[2]))
    todo = [trainer]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            if pid != me:
                known[pid] = start
                todo.append(pid)
    time.sleep(float(sys.argv[2]))
for pid, start in known.items():
    if (s := stat(pid)) is not None and s[2] == start and s[0] not in "ZX":
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""
_watcher = None


def supervise_descendants(interval: float = 1.0):
    """Start (once) a watcher that kills this process's descendants, children of children included, when this
    process dies, however it dies. For helpers started by exec that the at-fork hook never sees; a descendant
    started less than `interval` before the death can escape."""
    global _watcher
    if _watcher is not None or not sys.platform.startswith("linux"):
        return
    import subprocess

    _watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, str(os.getpid()), str(interval)],
                                stdin=subprocess.DEVNULL, close_fds=True)


def run_tied(cmd: list, **popen_kwargs) -> int:
    """Run `cmd` as a child that does not outlive this process; its exit status.

    For drivers that start training phases (torchrun and the ranks under it) and wait for them. Without this a
    killed driver left its running phase behind, still writing into the --save that the re-run of the same command
    resumes from (seen: `kill` of benchmarks/agentic_learning.py left its RL torchrun training). Here:

    * SIGTERM or SIGINT sent to this process (a `kill`, Ctrl-C) is passed on to the child once, and the child is
      waited for, so a training phase saves and exits as it does when signalled directly; then this process exits
      with 128 + the signal instead of going on to the next phase. The child runs in a session of its own, so a
      signal to this process's group reaches it only through this forwarding (torchrun signalled twice stops waiting
      for its ranks' save).
    * A SIGKILL of this process takes the child with it (the kernel's parent-death signal, armed before exec); the
      ranks under a killed torchrun exit by themselves (see `install`).
    """
    import signal
    import subprocess

    parent = os.getpid()

    def arm():
        if _prctl_parent_death(signal.SIGKILL) and os.getppid() != parent:
            os._exit(1)  # the parent died before the signal was armed

    proc = subprocess.Popen(cmd, preexec_fn=arm, start_new_session=True, **popen_kwargs)
    received = []

    def forward(sig, frame):
        received.append(sig)
        if proc.poll() is None:
            proc.send_signal(sig)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        raise SystemExit(128 + received[0])
    return code
