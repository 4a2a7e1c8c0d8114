"""The learning-rate schedule of an RL run counts RL steps (--train-iters), however many optimizer steps
--grpo-iterations takes over each batch of rollouts."""

from __future__ import annotations

import pytest

from tests.unit.test_rl_resume import TINY, run
from megatron_ext.rl.env import digit_tasks, write_prompts


def test_grpo_iterations_two_keeps_the_schedule_over_the_whole_run(tmp_path):
    prompts = str(tmp_path / "prompts.jsonl")
    write_prompts(prompts, digit_tasks("train", 8, seed=3))
    lr, low = 5e-4, 1e-5
    rc, out, err = run(TINY + ["--rl-prompts", prompts, "--grpo-iterations", "2", "--train-iters", "4",
                               "--lr", str(lr), "--min-lr", str(low), "--lr-decay-style", "linear"], tmp_path)
    assert rc == 0, out[-2000:] + err[-2000:]
    logged = [float(line.split("learning rate: ")[1].split()[0]) for line in out.splitlines()
              if "learning rate: " in line]
    # Megatron logs the rate after the step's scheduler increment: step n shows lr(n / train_iters)
    assert logged == pytest.approx([low + (lr - low) * (1 - n / 4) for n in (1, 2, 3, 4)], rel=1e-4)
