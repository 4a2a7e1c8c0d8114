"""rl_composer.py with Ray rollout workers (--rl-rollout-workers): the asynchronous loop end to end, exactly-once
accounting with a rollout worker killed (kill -9) mid-run and with the trainer killed and resumed (the workers
are restarted with it), staleness within --rl-max-staleness on every trained token."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from megatron_ext.rl.env import digit_tasks
from megatron_ext.rl.ledger import trained_counts
from tests.unit.test_rl_composer import TINY, _jsonl, _prompts, _run

ASYNC = ["--rl-rollout-workers", "2", "--rl-max-staleness", "1"]


def _ray_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "raylet|gcs_server|ray::"], capture_output=True, text=True).stdout
    return {int(x) for x in out.split()}


@pytest.fixture
def no_ray_left():
    """After the test, no Ray process that was not there before it (other jobs on the machine may run Ray);
    a killed session's processes take a moment to go."""
    before = _ray_pids()

    def check():
        deadline = time.time() + 20
        while _ray_pids() - before and time.time() < deadline:
            time.sleep(0.5)
        assert not _ray_pids() - before, f"Ray processes left behind: {_ray_pids() - before}"
    return check


def _check_staleness(logs, K):
    for r in _jsonl(os.path.join(logs, "trained_groups.jsonl")):
        # trained at step s by the weights of version s - 1; sampled by versions s - 1 - K .. s - 1
        assert all(r["step"] - 1 - K <= v <= r["step"] - 1 for v in r["policy_versions"]), r


@pytest.mark.slow
def test_async_run_survives_a_killed_worker_and_trains_each_prompt_once(tmp_path, no_ray_left):
    prompts, logs = _prompts(tmp_path, 10), str(tmp_path / "logs")
    p = _run(TINY + ASYNC + ["--rl-prompts", prompts, "--rl-log-dir", logs, "--train-iters", "100"],
             fault="worker:1")
    out = p.stdout
    assert "asynchronous RL: 2 rollout workers, --rl-max-staleness 1" in out
    assert "importance correction of stale tokens: tis (--rl-importance-sampling)" in out
    assert "worker 0 lost" in out and "prompt(s) requeued, worker restarted" in out
    assert "all 10 prompts of --rl-prompts trained once: stopping at iteration 5" in out
    for name in ("staleness mean", "staleness max", "samples spanning versions", "queue in flight",
                 "seconds gate blocked", "trainer idle fraction", "worker utilisation", "publish seconds",
                 "publish bytes"):
        assert name + ":" in out, name
    staleness = [float(line.split("staleness max: ")[1].split()[0]) for line in out.splitlines()
                 if "staleness max" in line]
    assert len(staleness) == 5 and max(staleness) <= 1
    assert trained_counts(logs) == {t["id"]: 1 for t in digit_tasks("train", 10, seed=7)}
    _check_staleness(logs, 1)
    assert len(_jsonl(os.path.join(logs, "rollouts.jsonl"))) == 10 * 4
    no_ray_left()


@pytest.mark.slow
def test_async_exactly_once_across_trainer_kills_and_resumes(tmp_path, no_ray_left):
    prompts, logs, save = _prompts(tmp_path, 10), str(tmp_path / "logs"), str(tmp_path / "ckpt")
    flags = TINY + ASYNC + ["--rl-prompts", prompts, "--rl-log-dir", logs, "--train-iters", "100", "--save", save,
                            "--load", save, "--save-interval", "1"]
    for fault in ("generating:1", "trained:3"):
        p = _run(flags, fault=fault, check=False)
        assert p.returncode == -9, (fault, p.returncode, p.stderr[-2000:])
        no_ray_left()  # the trainer's session took its local Ray instance with it
    p = _run(flags)
    assert "all 10 prompts of --rl-prompts trained once" in p.stdout
    assert trained_counts(logs) == {t["id"]: 1 for t in digit_tasks("train", 10, seed=7)}
    steps = [r["step"] for r in _jsonl(os.path.join(logs, "trained_groups.jsonl"))]
    assert steps == sorted(steps)
    _check_staleness(logs, 1)
    no_ray_left()


def _refused(argv, capsys, world_size=1, monkeypatch=None):
    """rl_composer.main in this process (its flag checks run before any process group or Ray): (exit status,
    stderr)."""
    import rl_composer

    if monkeypatch is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
    code = rl_composer.main(argv)
    return code, capsys.readouterr().err


def test_worker_flags_are_validated(tmp_path, capsys):
    code, err = _refused(TINY + ["--rl-prompts", _prompts(tmp_path, 2), "--rl-max-staleness", "2"], capsys)
    assert code == 2 and "add --rl-rollout-workers N" in err
    code, err = _refused(TINY + ["--rl-prompts", _prompts(tmp_path, 2), "--rl-rollout-workers", "2",
                                 "--rl-sft-warmup"], capsys)
    assert code == 2 and "drop --rl-rollout-workers" in err


def test_async_run_under_torchrun(tmp_path, no_ray_left):
    """The asynchronous path as users launch it: torchrun (its launcher variables reach the Ray workers, which must
    not join the trainer's rendezvous). Each prompt trained once, staleness logged and within the bound, Ray gone
    afterwards."""
    import sys

    from tests.unit.test_rl_composer import ENV, ROOT

    prompts, logs = _prompts(tmp_path, 6), str(tmp_path / "logs")
    cmd = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone",
           "rl_composer.py", *TINY, *ASYNC, "--rl-prompts", prompts, "--rl-log-dir", logs, "--train-iters", "100"]
    p = subprocess.run(cmd, cwd=ROOT, env={**ENV, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    assert "asynchronous RL: 2 rollout workers, --rl-max-staleness 1" in out
    assert "importance correction of stale tokens: tis (--rl-importance-sampling)" in out
    assert "all 6 prompts of --rl-prompts trained once: stopping at iteration 3" in out
    staleness = [float(line.split("staleness max: ")[1].split()[0]) for line in out.splitlines()
                 if "staleness max" in line]
    assert len(staleness) == 3 and max(staleness) <= 1
    assert trained_counts(logs) == {t["id"]: 1 for t in digit_tasks("train", 6, seed=7)}
    _check_staleness(logs, 1)
    no_ray_left()


@pytest.mark.slow  # 23 s; the batch itself: test_worker_batching.py, test_engine_continuous.py, test_rl_continuous.py
def test_async_run_with_continuous_batching_workers(tmp_path, no_ray_left):
    """--rl-continuous-batching: each worker runs 3 requests at once in one continuous decode batch; every prompt
    is trained once within the staleness bound. Misuse is refused before anything starts."""
    prompts, logs = _prompts(tmp_path, 8), str(tmp_path / "logs")
    flags = ["--rl-requests-per-worker", "3", "--rl-worker-concurrency", "3", "--rl-continuous-batching"]
    p = _run(TINY + ["--rl-rollout-workers", "1", "--rl-max-staleness", "2", "--rl-prompts", prompts,
                     "--rl-log-dir", logs, "--train-iters", "100", "--rl-prompts-per-request", "1"] + flags)
    out = p.stdout
    assert "asynchronous RL: 1 rollout workers, up to 3 request(s) at once per worker in one continuous decode " \
           "batch(es), --rl-max-staleness 2" in out
    assert "all 8 prompts of --rl-prompts trained once" in out
    assert trained_counts(logs) == {t["id"]: 1 for t in digit_tasks("train", 8, seed=7)}
    _check_staleness(logs, 2)
    no_ray_left()
    p = _run(TINY + ["--rl-prompts", prompts, "--rl-continuous-batching"], check=False)
    assert p.returncode == 2 and "--rl-continuous-batching applies to Ray rollout workers" in p.stderr


@pytest.mark.slow
def test_async_workers_behind_a_tensor_parallel_trainer(tmp_path, no_ray_left):
    """TP=2 trainer (no rank holds the full weights), 2 Ray workers: each version goes to --rl-remote-weights-dir as a
    checkpoint every rank writes its shards of, and the one-rank workers load and reshard it. The first step's
    samples come from version 0 on the workers and are scored by the trainer's version 0: their log-probabilities
    agree (the workers really hold the trainer's weights); each prompt trained once, staleness within the bound."""
    prompts, logs, weights = _prompts(tmp_path, 6), str(tmp_path / "logs"), str(tmp_path / "weights")
    p = _run(TINY + ASYNC + ["--rl-prompts", prompts, "--rl-log-dir", logs, "--train-iters", "100",
                             "--tensor-model-parallel-size", "2", "--sequence-parallel",
                             "--rl-remote-weights-dir", weights], nproc=2)
    out = p.stdout
    assert "all 6 prompts of --rl-prompts trained once: stopping at iteration 3" in out
    first = [x for x in out.splitlines() if " iteration        1/" in x][0]
    assert float(first.split("staleness max: ")[1].split()[0]) == 0
    assert float(first.split("mismatch_max: ")[1].split()[0]) < 1e-4
    assert trained_counts(logs) == {t["id"]: 1 for t in digit_tasks("train", 6, seed=7)}
    _check_staleness(logs, 1)
    assert sorted(os.listdir(weights)) == ["v1", "v2", "v3"]  # the versions a worker may still be loading
    no_ray_left()


def test_tensor_parallel_workers_need_a_weights_dir(tmp_path, capsys, monkeypatch):
    code, err = _refused(TINY + ASYNC + ["--rl-prompts", _prompts(tmp_path, 2), "--tensor-model-parallel-size", "2",
                                         "--sequence-parallel"], capsys, world_size=2, monkeypatch=monkeypatch)
    assert code == 2 and "add --rl-remote-weights-dir DIR" in err
