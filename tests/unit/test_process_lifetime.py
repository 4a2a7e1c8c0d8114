"""Issue 25 item 10: after kill -9 of a trainer, none of its helper processes stays alive (megatron_ext/lifetime.py).

The script below makes the helpers a trainer has: Megatron-Core's checkpoint writer's spawned Manager server (the
350 MB process left behind after kill -9 of rl_composer.py) with its resource tracker, and a forked worker that
inherited the trainer's flag-only SIGTERM handler (a checkpoint writer caught mid-save)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRAINER = textwrap.dedent("""
    import multiprocessing as mp
    import os
    import signal
    import time

    import megatron_ext  # noqa: F401


    def writer():
        time.sleep(600)


    if __name__ == "__main__":
        signal.signal(signal.SIGTERM, lambda *a: None)  # as training/loop.py's _Sigterm: remember, do not exit
        from megatron.core.dist_checkpointing.strategies.filesystem_async import _get_write_results_queue

        _get_write_results_queue()  # spawns the Manager server, as the first checkpoint save does
        mp.get_context("fork").Process(target=writer, daemon=False).start()
        print("ready", flush=True)
        time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _tree(root: int) -> list[int]:
    """Every process in the session of `root` other than it."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != root:
            try:
                if os.getsid(int(name)) == root and _alive(int(name)):
                    out.append(int(name))
            except (ProcessLookupError, PermissionError):
                pass
    return out


def test_helpers_die_with_a_killed_trainer(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen([sys.executable, "-W", "ignore", str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert proc.stdout.readline().strip() == "ready"
        helpers = _tree(proc.pid)
        assert len(helpers) >= 3, helpers  # Manager server, resource tracker, forked writer
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 20
        while time.time() < deadline and any(_alive(p) for p in helpers):
            time.sleep(0.2)
        assert not [p for p in helpers if _alive(p)]
    finally:
        for pid in _tree(proc.pid):
            os.kill(pid, signal.SIGKILL)
