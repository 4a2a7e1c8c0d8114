"""A killed RL run resumes when the same command is run again (a SLURM requeue): from the run's own --save, not the
--load it started from, with every prompt trained and logged exactly once, also after a kill before the first
checkpoint. The kills are kill -9 of the whole process tree from outside (torchrun and its ranks included)."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import tempfile
import time

import pytest

from megatron_ext.rl.env import digit_tasks, write_prompts
from megatron_ext.rl.ledger import trained_counts
from megatron_ext.training.checkpointing import read_tracker

from tests.unit.test_rl_composer import ENV, ROOT, TINY, _jsonl, command


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def kill_tree(pid: int):
    """kill -9 every process under `pid` and every process group they lead or belong to (torchrun may start its
    ranks in sessions of their own)."""
    procs = _descendants(pid)
    groups = set()
    for p in procs:
        try:
            groups.add(os.getpgid(p))
        except ProcessLookupError:
            pass
    for g in groups - {os.getpgid(0)}:
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(flags, tmp_path, fault=None, nproc=1, timeout=600):
    """rl_composer.py with `flags`; with `fault` (POINT:ITERATION) the run is killed -9, whole tree, once every rank
    reached that point. Returns (returncode, stdout, stderr)."""
    env = dict(ENV)
    env.pop("MEGATRON_EXT_RL_FAULT", None)
    marker = str(tmp_path / f"fault-{time.monotonic_ns()}")
    if fault:
        env.update(MEGATRON_EXT_RL_FAULT=fault, MEGATRON_EXT_RL_FAULT_WAIT=marker)
    cmd = command(flags, nproc)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if fault and len(glob.glob(marker + ".*")) >= nproc:
                    kill_tree(proc.pid)
                    break
                time.sleep(0.2)
        finally:
            kill_tree(proc.pid)
            proc.wait()
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read()


def _requeued_run(tmp_path, kills, nproc=1):
    """SFT warm-up checkpoint, then one RL command (--load SFT --finetune --save RL) killed at each of `kills` and
    run again after each; returns the logs directory, the RL --save and the last run's stdout."""
    prompts, heldout = str(tmp_path / "prompts.jsonl"), str(tmp_path / "heldout.jsonl")
    write_prompts(prompts, digit_tasks("train", 10, seed=7))
    write_prompts(heldout, digit_tasks("heldout", 2, seed=7))
    sft, save, logs = str(tmp_path / "sft"), str(tmp_path / "rl"), str(tmp_path / "logs")
    rc, out, err = run(TINY + ["--rl-prompts", prompts, "--rl-sft-warmup", "--train-iters", "1", "--save", sft],
                       tmp_path)
    assert rc == 0, out[-2000:] + err[-2000:]
    flags = TINY + ["--rl-prompts", prompts, "--load", sft, "--finetune", "--save", save, "--save-interval", "2",
                    "--rl-log-dir", logs, "--train-iters", "100", "--rl-eval-prompts", heldout,
                    "--rl-eval-interval", "1", "--rl-eval-samples", "1"]
    for k, fault in enumerate(kills):
        rc, out, err = run(flags, tmp_path, fault=fault, nproc=nproc)
        assert rc == -9, (fault, rc, out[-2000:], err[-2000:])
        if k == 0:
            assert f"RL: starting from --load {sft} (weights only, iteration 0)" in out
    rc, out, err = run(flags, tmp_path, nproc=nproc)
    assert rc == 0, out[-2000:] + err[-2000:]
    return logs, save, sft, out


def _assert_exactly_once(logs, save):
    counts = trained_counts(logs)
    assert counts == {t["id"]: 1 for t in digit_tasks("train", 10, seed=7)}
    trained = _jsonl(os.path.join(logs, "trained_groups.jsonl"))
    assert [r["step"] for r in trained] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    rollouts = _jsonl(os.path.join(logs, "rollouts.jsonl"))
    assert len(rollouts) == 10 * 4 and sorted({(r["prompt_id"], r["sample_index"]) for r in rollouts}) == \
        sorted((t["id"], i) for t in digit_tasks("train", 10, seed=7) for i in range(4))
    assert [e["iteration"] for e in _jsonl(os.path.join(logs, "eval.jsonl"))] == [0, 1, 2, 3, 4, 5]
    assert read_tracker(save) == 5


def test_same_command_resumes_from_its_own_save_after_kills_before_and_after_the_first_checkpoint(tmp_path):
    # killed in step 1 (trained and logged, nothing saved yet), then in step 3 (checkpoint 2 exists)
    logs, save, sft, out = _requeued_run(tmp_path, ["trained:1", "trained:3"])
    assert f"RL: resuming this run from its own --save {save} (iteration 2); --load {sft} is not read" in out
    assert "RL state: cursor 4/10" in out
    _assert_exactly_once(logs, save)


@pytest.mark.slow
def test_same_command_resumes_a_killed_torchrun_run(tmp_path):
    logs, save, sft, out = _requeued_run(tmp_path, ["generating:0", "trained:3", "trained:5"], nproc=2)
    assert f"RL: resuming this run from its own --save {save} (iteration 4)" in out
    _assert_exactly_once(logs, save)
