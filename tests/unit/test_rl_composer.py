"""rl_composer.py end to end on CPU: a short run whose logs are checked for content, and exactly-once accounting
of prompts across kill -9 at several points (mid-generation, after training before the save, mid-save)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from megatron_ext.rl.env import VOCAB, digit_tasks, write_prompts
from megatron_ext.rl.ledger import trained_counts
from megatron_ext.training.checkpointing import read_tracker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--model", "tiny", "--vocab-size", "32", "--seq-length", "64", "--micro-batch-size", "4",
        "--grpo-group-size", "4", "--grpo-prompts-per-step", "2", "--grpo-max-response-length", "8", "--lr", "1e-3"]
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def command(flags, nproc=1):
    """rl_composer.py with `flags`, under torchrun for more than one rank."""
    if nproc > 1:
        return [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                "--standalone", "rl_composer.py", *flags]
    return [sys.executable, "-W", "ignore", "rl_composer.py", *flags]


def _run(flags, fault=None, nproc=1, check=True):
    env = dict(ENV)
    env.pop("MEGATRON_EXT_RL_FAULT", None)
    if fault:
        env["MEGATRON_EXT_RL_FAULT"] = fault
    cmd = command(flags, nproc)
    # own session: a SIGKILLed trainer leaves checkpoint-writer children behind, which the group kill removes
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            proc.wait(timeout=600)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        p = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def _prompts(tmp_path, n):
    path = str(tmp_path / "prompts.jsonl")
    write_prompts(path, digit_tasks("train", n, seed=7))
    return path


def _jsonl(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("nproc", [1, 2], ids=["1rank", "dp2"])
def test_short_run_trains_each_group_once_with_parsed_rewards(tmp_path, nproc):
    prompts, logs = _prompts(tmp_path, 6), str(tmp_path / "logs")
    heldout = str(tmp_path / "heldout.jsonl")
    write_prompts(heldout, digit_tasks("heldout", 3, seed=7))
    p = _run(TINY + ["--rl-prompts", prompts, "--rl-log-dir", logs, "--train-iters", "10",
                     "--rl-eval-prompts", heldout, "--rl-eval-interval", "2", "--rl-eval-samples", "2",
                     "--rl-reward-weights", "exact=1,char_accuracy=0.5"], nproc=nproc)
    out = p.stdout
    # 6 prompts, 2 per step: three steps, then the file is exhausted (single epoch)
    assert "all 6 prompts of --rl-prompts trained once: stopping at iteration 3" in out
    for name in ("reward mean", "zero-advantage groups", "k1:", "k3:", "entropy", "mismatch_max",
                 "seconds generate", "tokens/s sampled", "response length mean", "truncation rate"):
        assert name in out, name
    trained = _jsonl(os.path.join(logs, "trained_groups.jsonl"))
    assert sorted(r["prompt_id"] for r in trained) == sorted(t["id"] for t in digit_tasks("train", 6, seed=7))
    assert [r["step"] for r in trained] == [1, 1, 2, 2, 3, 3]
    assert all(r["policy_versions"] == [r["step"] - 1] for r in trained)  # on-policy: sampled by the last weights
    rollouts = _jsonl(os.path.join(logs, "rollouts.jsonl"))
    assert len(rollouts) == 6 * 4
    tasks = {t["id"]: t for t in digit_tasks("train", 6, seed=7)}
    for r in rollouts:
        task = tasks[r["prompt_id"]]
        n_prompt = 3 + len(task["input"])
        assert r["token_ids"][:n_prompt] == [VOCAB.bos, VOCAB.ids[task["op"]]] + \
            VOCAB.encode_digits(task["input"]) + [VOCAB.eq]
        assert r["loss_mask"] == [0] * n_prompt + [1] * (len(r["token_ids"]) - n_prompt)
        assert all(lp <= 0 for lp in r["logprobs"]) and r["reward_error"] is None
        # the reward is recomputed from the logged tokens: parts parsed from the sampler's ids
        answer = r["token_ids"][n_prompt:]
        assert r["reward_parts"]["exact"] == float(VOCAB.eos in answer and VOCAB.decode(answer[:answer.index(VOCAB.eos)])
                                                   == task["answer"])
        assert r["reward"] == pytest.approx(r["reward_parts"]["exact"] + 0.5 * r["reward_parts"]["char_accuracy"])
    by_prompt = {}
    for r in rollouts:
        by_prompt.setdefault(r["prompt_id"], []).append(r["reward"])
    for g in trained:
        assert g["rewards"] == pytest.approx(by_prompt[g["prompt_id"]])
        # k1 in the reward (--grpo-kl-beta 0.001 by default): the advantages are auditable from the log
        penalised = [r - 0.001 * k for r, k in zip(g["rewards"], g["k1_sums"])]
        assert g["penalised_rewards"] == pytest.approx(penalised, abs=1e-12)
        assert g["advantages"] == pytest.approx([p - sum(penalised) / len(penalised) for p in penalised], abs=1e-12)
    assert max(abs(k) for g in trained for k in g["k1_sums"]) > 1e-3  # the policy moved from the reference
    evals = _jsonl(os.path.join(logs, "eval.jsonl"))
    assert [e["iteration"] for e in evals] == [0, 2]
    assert all(0 <= e["heldout success"] <= e["heldout pass@k"] <= 1 for e in evals)
    # sampler and trainer agree on log-probabilities (same weights, fp32)
    mismatch = [float(line.split("mismatch_max: ")[1].split()[0]) for line in out.splitlines() if "mismatch_max" in line]
    assert mismatch and max(mismatch) < 1e-4


def _exactly_once(tmp_path, faults):
    prompts, logs, save = _prompts(tmp_path, 10), str(tmp_path / "logs"), str(tmp_path / "ckpt")
    flags = TINY + ["--rl-prompts", prompts, "--rl-log-dir", logs, "--train-iters", "100", "--save", save,
                    "--load", save, "--save-interval", "1"]
    for fault in faults:
        p = _run(flags, fault=fault, check=False)
        assert p.returncode == -9, (fault, p.returncode, p.stderr[-2000:])
    p = _run(flags)
    assert "all 10 prompts of --rl-prompts trained once" in p.stdout
    counts = trained_counts(logs)
    assert counts == {t["id"]: 1 for t in digit_tasks("train", 10, seed=7)}
    steps = [r["step"] for r in _jsonl(os.path.join(logs, "trained_groups.jsonl"))]
    assert steps == sorted(steps) and read_tracker(save) == 5
    rollouts = _jsonl(os.path.join(logs, "rollouts.jsonl"))
    assert len(rollouts) == 10 * 4 and all(r["step"] <= 5 for r in rollouts)


# 28 s: `make test-all`. The same corner (a step trained and logged, killed before its checkpoint, trained again on
# resume, every prompt once) is test_rl_resume.py's second kill, which the default suite runs.
@pytest.mark.slow
def test_exactly_once_after_kill_between_training_and_save(tmp_path):
    # step 2 is trained and logged, then the process dies before its checkpoint: step 2 is trained again
    _exactly_once(tmp_path, ["trained:2"])


@pytest.mark.slow
def test_exactly_once_after_kills_mid_generation_and_mid_save(tmp_path):
    _exactly_once(tmp_path, ["generating:1", "trained:3", "saving:4"])


def test_routing_replay_trains_on_the_samplers_experts(tmp_path):
    """The engine records every token's experts; the trainer replays them. Same weights: the trainer's own top-k
    agrees with the replayed experts, and the log-probabilities agree as without replay."""
    p = _run(TINY + ["--rl-prompts", _prompts(tmp_path, 4), "--train-iters", "2", "--rl-routing-replay"])
    lines = [line for line in p.stdout.splitlines() if "routing replay agreement" in line]
    assert len(lines) == 2
    for line in lines:
        agreement = float(line.split("routing replay agreement: ")[1].split()[0])
        mismatch = float(line.split("mismatch_max: ")[1].split()[0])
        assert agreement > 0.999 and mismatch < 1e-4, line
