"""Sampling settings and the trainer's log-probabilities: at --rl-temperature T the trainer scores tokens under
the distribution the sampler drew them from (logits / T); truncated sampling (top-k / top-p) is refused."""

from __future__ import annotations

import numpy as np
import pytest

import rl_composer
from megatron_ext.rl.env import digit_tasks, write_prompts
from tests.unit.test_rl_resume import TINY, _jsonl, run


def test_trainer_log_probabilities_follow_the_sampling_temperature(tmp_path):
    prompts, logs = str(tmp_path / "prompts.jsonl"), str(tmp_path / "logs")
    write_prompts(prompts, digit_tasks("train", 2, seed=5))
    rc, out, err = run(TINY + ["--rl-prompts", prompts, "--rl-log-dir", logs, "--train-iters", "1",
                               "--rl-temperature", "0.5"], tmp_path)
    assert rc == 0, out[-2000:] + err[-2000:]
    line = next(x for x in out.splitlines() if "trainer_logprob: " in x)
    trainer = float(line.split("trainer_logprob: ")[1].split()[0])
    mismatch = float(line.split("mismatch_max: ")[1].split()[0])
    rollouts = _jsonl(f"{logs}/rollouts.jsonl")
    mask = np.concatenate([r["loss_mask"] for r in rollouts]).astype(bool)
    sampled = np.concatenate([r["sampled_logprobs"] for r in rollouts])[mask]
    raw = np.concatenate([r["logprobs"] for r in rollouts])[mask]
    assert abs(sampled.mean() - raw.mean()) > 1e-2 and np.abs(sampled - raw).max() > 0.1  # T changes q
    # same weights (first step, on-policy): the trainer's log-probabilities are the sampler's log q at T = 0.5
    assert trainer == pytest.approx(sampled.mean(), abs=1e-4)
    assert mismatch < 1e-4


@pytest.mark.parametrize("flag", [["--rl-top-k", "5"], ["--rl-top-p", "0.9"]])
def test_truncated_sampling_is_refused_for_training(tmp_path, capsys, flag):
    prompts = str(tmp_path / "prompts.jsonl")
    write_prompts(prompts, digit_tasks("train", 2, seed=5))
    assert rl_composer.main(TINY + ["--rl-prompts", prompts, *flag]) == 2
    err = capsys.readouterr().err
    assert f"{flag[0]} " in err and "train with --rl-top-k 0 --rl-top-p 1" in err
