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


def _watch_parent(parent: int, interval: float = 1.0):
    def watch():
        while os.getppid() == parent:
            time.sleep(interval)
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
