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

import pytest

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
        import sys

        signal.signal(signal.SIGTERM, lambda *a: None)  # as training/loop.py's _Sigterm: remember, do not exit
        from megatron.core.dist_checkpointing.strategies.filesystem_async import _get_write_results_queue

        from megatron_ext.training.checkpointing import start_writer_queue

        if sys.argv[1] == "started":  # as initialize_distributed does for a run that saves
            assert start_writer_queue()
        _get_write_results_queue()  # else spawns the Manager server, as the first checkpoint save did
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


@pytest.mark.parametrize("queue", ["spawned", "started"])
def test_helpers_die_with_a_killed_trainer(tmp_path, queue):
    """`spawned`: the writer's Manager as Megatron-Core starts it; `started`: as `start_writer_queue` starts it at
    start-up (without the entry script's imports, so without megatron_ext.lifetime's watcher)."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen([sys.executable, "-W", "ignore", str(script), queue], cwd=ROOT, stdout=subprocess.PIPE,
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


SUPERVISED = textwrap.dedent("""
    import importlib.util
    import subprocess
    import sys
    import time

    spec = importlib.util.spec_from_file_location("lifetime", sys.argv[1])  # without the package's heavy imports
    lifetime = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lifetime)
    lifetime.supervise_descendants(interval=0.2)
    # an exec'd helper that starts its own child and ignores SIGTERM, as Ray's raylet agents
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                      f"{stubborn!r}]); {stubborn}"])
    time.sleep(2)
    print("ready", flush=True)
    time.sleep(600)
""")


RANK = textwrap.dedent("""
    import importlib.util
    import os
    import sys
    import time

    spec = importlib.util.spec_from_file_location("lifetime", sys.argv[1])  # without the package's heavy imports
    lifetime = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lifetime)
    lifetime.install()  # what importing megatron_ext does in a rank
    with open(os.path.join(sys.argv[2], "rank" + os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
""")


def test_ranks_die_with_a_killed_torchrun(tmp_path):
    """torchrun starts each rank in a session of its own: a kill -9 of torchrun's process group (what killing a
    launcher script's tree reaches) used to leave the ranks running, training on into the --save a re-run uses."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script), os.path.join(ROOT, "megatron_ext", "lifetime.py"), str(tmp_path)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pids = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            pids = [int((tmp_path / f"rank{r}").read_text()) for r in range(2)
                    if (tmp_path / f"rank{r}").exists() and (tmp_path / f"rank{r}").read_text()]
        assert len(pids) == 2, proc.stderr.read() if proc.poll() is not None else "ranks did not start"
        assert all(os.getsid(p) != proc.pid for p in pids)  # the premise: outside torchrun's session
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], "ranks outlived torchrun"
        assert b"torchrun (pid" in proc.stderr.read()  # each rank said why it exits
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_exec_started_descendants_are_reaped_when_the_trainer_dies(tmp_path):
    script = tmp_path / "supervised.py"
    script.write_text(SUPERVISED)
    lifetime = os.path.join(ROOT, "megatron_ext", "lifetime.py")
    proc = subprocess.Popen([sys.executable, str(script), lifetime], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        helpers = _tree(proc.pid)
        assert len(helpers) == 3, helpers  # the watcher, the helper and its child
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(p) for p in helpers):
            time.sleep(0.1)
        assert not [p for p in helpers if _alive(p)]
    finally:
        for pid in _tree(proc.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_kill_9_of_an_asynchronous_rl_trainer_leaves_no_ray_process(tmp_path):
    """rl_composer.py with a local Ray instance and a rollout worker, killed with SIGKILL after its second step:
    its whole process tree (GCS, raylet and its agents, workers, checkpoint writer helpers) goes."""
    from megatron_ext.rl.env import digit_tasks, write_prompts
    from tests.unit.test_rl_composer import TINY

    prompts = str(tmp_path / "prompts.jsonl")
    write_prompts(prompts, digit_tasks("train", 40, seed=7))
    cmd = [sys.executable, "-W", "ignore", "rl_composer.py", *TINY, "--rl-prompts", prompts, "--train-iters", "20",
           "--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--rl-rollout-workers", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    try:
        for line in proc.stdout:
            if "iteration        2/" in line:
                break
        helpers = _tree(proc.pid)
        assert len(helpers) >= 6, helpers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 30
        while time.time() < deadline and any(_alive(p) for p in helpers):
            time.sleep(0.5)
        assert not [p for p in helpers if _alive(p)]
    finally:
        for pid in _tree(proc.pid):
            os.kill(pid, signal.SIGKILL)


DRIVER = textwrap.dedent("""
    import sys

    sys.path.insert(0, sys.argv[1])
    from megatron_ext.lifetime import run_tied

    code = run_tied([sys.executable, "-c", sys.argv[3], sys.argv[2]])
    open(sys.argv[2] + "/driver_went_on", "w").write(str(code))
""")

PHASE = textwrap.dedent("""
    import os, signal, sys, time
    out = sys.argv[1]
    signals = []
    signal.signal(signal.SIGTERM, lambda sig, frame: signals.append(sig))  # a trainer: remember, save, exit
    open(out + "/phase_pid", "w").write(str(os.getpid()))
    while not signals:
        time.sleep(0.05)
    time.sleep(1.0)  # the save
    open(out + "/phase_saved", "w").write(str(len(signals)))
""")


def _start_driver(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen([sys.executable, str(script), ROOT, str(tmp_path), PHASE], start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "phase_pid").exists() or not (tmp_path / "phase_pid").read_text():
        assert time.monotonic() < deadline and driver.poll() is None, "the phase did not start"
        time.sleep(0.05)
    return driver, int((tmp_path / "phase_pid").read_text())


@pytest.mark.parametrize("target", ["driver", "group"])
def test_a_signalled_driver_passes_sigterm_on_once_and_waits_for_the_save(tmp_path, target):
    """`kill` of a benchmark driver used to leave its training phase running into the --save its re-run resumes
    from. Now the phase gets the signal exactly once (also when the driver's whole group is signalled), saves, and
    the driver stops instead of starting the next phase."""
    driver, phase = _start_driver(tmp_path)
    try:
        assert os.getsid(phase) != os.getsid(driver.pid)  # signals reach it only through the driver
        if target == "driver":
            os.kill(driver.pid, signal.SIGTERM)
        else:
            os.killpg(driver.pid, signal.SIGTERM)
        assert driver.wait(timeout=30) == 128 + signal.SIGTERM
        assert (tmp_path / "phase_saved").read_text() == "1"  # the driver waited for the save; one signal
        assert not (tmp_path / "driver_went_on").exists()
    finally:
        if _alive(phase):
            os.kill(phase, signal.SIGKILL)
        driver.kill()


def test_a_killed_driver_takes_its_phase_with_it(tmp_path):
    driver, phase = _start_driver(tmp_path)
    try:
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 10
        while _alive(phase) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(phase), "the phase outlived its killed driver"
    finally:
        if _alive(phase):
            os.kill(phase, signal.SIGKILL)


START_UP = textwrap.dedent("""
    import os
    import sys

    from megatron.core.dist_checkpointing.strategies import filesystem_async as writer

    from megatron_ext.arguments import parse_args
    from megatron_ext.training.initialize import destroy, initialize_distributed

    flags = ["--model", "tiny", "--mock-data", "--train-iters", "1"]
    initialize_distributed(parse_args(flags, world_size=1))  # a run that does not save starts nothing
    print(writer._results_queue)
    destroy()
    initialize_distributed(parse_args([*flags, "--save", sys.argv[1]], world_size=1))
    queue = writer._results_queue
    destroy()  # (exiting with the process group up can abort in gloo's threads)
    assert writer._get_write_results_queue() is queue
    server = queue._manager._process
    with open(f"/proc/{server.pid}/status") as f:
        parent = int(next(line.split()[1] for line in f if line.startswith("PPid:")))
    with open(f"/proc/{server.pid}/cmdline", "rb") as f:
        spawned = b"--multiprocessing-fork" in f.read()
    queue.put({"rank": 0})
    print(spawned, parent == os.getpid(), queue.get(timeout=10))
""")


def test_a_run_that_saves_starts_the_checkpoint_writer_queue_at_start_up(tmp_path):
    """The first save no longer waits ~3.5 s for Megatron-Core to spawn the writer's Manager (whose child re-ran the
    entry script's imports): `initialize_distributed` starts it when the run has --save, spawned without the entry
    script, and the queue works."""
    script = tmp_path / "start_up.py"
    script.write_text(START_UP)
    out = subprocess.run([sys.executable, "-W", "ignore", str(script), str(tmp_path / "ckpt")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == ["None", "True True {'rank': 0}"]
