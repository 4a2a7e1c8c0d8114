"""Issue 25, RL items: group size, non-finite rewards and weights, the prompt file a resume counts into, the log's
consumed samples, prompt-file validation, response length vs --seq-length, which flag an error names."""

from __future__ import annotations

import json
import math
import os

import pytest

import rl_composer
from megatron_ext.env.rewards import WeightFile, override_weights
from megatron_ext.rl.env import DIGIT_REWARDS, Rubric, digit_tasks, write_prompts
from megatron_ext.rl.types import Reward
from tests.unit.test_rl_composer import TINY, _run


def _prompts(tmp_path, n, name="prompts.jsonl", seed=7):
    path = str(tmp_path / name)
    write_prompts(path, digit_tasks("train", n, seed=seed))
    return path


def _main_error(capsys, *flags):
    code = rl_composer.main(list(flags))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_group_size_one_is_refused_for_grpo_but_allowed_for_the_sft_warmup(tmp_path, capsys):
    prompts = _prompts(tmp_path, 2)
    flags = TINY + ["--rl-prompts", prompts, "--grpo-group-size", "1", "--dry-run"]
    code, err = _main_error(capsys, *flags)
    assert code == 2 and "--grpo-group-size 1" in err and "advantage 0" in err and "--rl-sft-warmup" in err
    code, _ = _main_error(capsys, *flags, "--rl-sft-warmup")
    assert code == 0


@pytest.mark.parametrize("weights", ["exact=nan", "exact=inf", "char_accuracy=-inf"])
def test_non_finite_digit_reward_weights_are_refused(tmp_path, capsys, weights):
    code, err = _main_error(capsys, *TINY, "--rl-prompts", _prompts(tmp_path, 2), "--rl-reward-weights", weights)
    assert code == 2 and "--rl-reward-weights" in err and "finite" in err


def test_non_finite_env_reward_weights_are_refused(tmp_path):
    path = tmp_path / "w.json"
    path.write_text('{"weights": {"correctness": NaN}}')
    with pytest.raises(ValueError, match=r"w.json: weights.correctness must be a finite number, got nan"):
        WeightFile(str(path))
    with pytest.raises(ValueError, match=r"--env-reward-weight 'style=inf'.*finite"):
        override_weights(WeightFile(None).current(), ["style=inf"])
    with pytest.raises(ValueError, match="finite"):
        Rubric(DIGIT_REWARDS, {"exact": math.nan})


def test_malformed_env_reward_weights_json_names_the_file(tmp_path):
    path = tmp_path / "weights.json"
    path.write_text('{"weights": {"correctness": 1,}}')
    with pytest.raises(ValueError) as e:
        WeightFile(str(path))
    assert str(e.value).startswith(f"--env-reward-weights {path}: invalid JSON")


def test_a_non_finite_reward_is_a_sample_error():
    from megatron_ext.rl.rollout import _as_reward

    nan_part = Rubric({"exact": lambda t, m: float("nan")}, {"exact": 1.0}).score({}, [])
    for reward in (_as_reward(nan_part), _as_reward(Reward({"exact": 1.0}, math.inf))):
        assert reward.total == 0.0 and "non-finite reward" in reward.error


@pytest.mark.parametrize("line, problem", [
    ({"id": "a", "op": "double", "input": "12", "answer": "24"}, "unknown op 'double'"),
    ({"id": "a", "op": "reverse", "input": "1x2", "answer": "2x1"}, "input '1x2' is not a non-empty string of digits"),
])
def test_prompt_files_are_validated_when_read(tmp_path, capsys, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(line) + "\n")
    code, err = _main_error(capsys, *TINY, "--rl-prompts", str(path))
    assert code == 2 and f"--rl-prompts {path}:1: {problem}" in err
    code, err = _main_error(capsys, *TINY, "--rl-prompts", _prompts(tmp_path, 2), "--rl-eval-prompts", str(path))
    assert code == 2 and f"--rl-eval-prompts {path}:1: {problem}" in err


def test_a_missing_eval_prompt_file_names_its_flag(tmp_path, capsys):
    missing = str(tmp_path / "heldout.jsonl")
    code, err = _main_error(capsys, *TINY, "--rl-prompts", _prompts(tmp_path, 2), "--rl-eval-prompts", missing)
    assert code == 2 and err.startswith(f"error: --rl-eval-prompts {missing}: cannot read")


def test_response_budget_longer_than_the_sequence_is_refused_at_start(tmp_path, capsys):
    code, err = _main_error(capsys, *TINY, "--rl-prompts", _prompts(tmp_path, 2), "--grpo-max-response-length", "200")
    assert code == 2
    assert "--grpo-max-response-length 200" in err and "more than --seq-length 64" in err


def test_prompt_file_identity_tells_ids_from_contents():
    from megatron_ext.rl.prompt_identity import prompt_file_change, prompt_identity

    tasks = digit_tasks("train", 4, seed=7)
    same = prompt_identity(tasks)
    assert prompt_file_change(same, prompt_identity([dict(t) for t in tasks])) is None
    assert prompt_file_change(None, same) is None  # a checkpoint from before the record
    assert "ids differ" in prompt_file_change(same, prompt_identity(tasks[::-1]))
    edited = [dict(t) for t in tasks]
    edited[2]["input"] = "9999"
    assert "contents differ" in prompt_file_change(same, prompt_identity(edited))


@pytest.mark.slow
def test_resume_on_another_prompt_file_is_refused_unless_asked(tmp_path):
    """One run: 2 steps of 2 prompts x 4 samples. Its log line counts the 8 trained samples per step; resuming it on
    a regenerated file (same count, other prompts) is refused, and --rl-new-prompts starts that file from its first
    prompt."""
    first, save = _prompts(tmp_path, 6), str(tmp_path / "ckpt")
    p = _run(TINY + ["--rl-prompts", first, "--train-iters", "3", "--exit-interval", "2", "--save", save])
    assert "consumed samples:            8" in p.stdout and "consumed samples:           16" in p.stdout
    other = _prompts(tmp_path, 6, "other.jsonl", seed=8)
    flags = TINY + ["--rl-prompts", other, "--train-iters", "3", "--load", save, "--save", save]
    p = _run(flags, check=False)
    assert p.returncode == 1
    assert "--rl-prompts is not the prompt file" in p.stderr and "--rl-new-prompts" in p.stderr
    assert "Traceback" not in p.stderr
    p = _run(flags + ["--rl-new-prompts"])
    assert "this file starts at its first prompt" in p.stdout and "RL state: cursor 0/6" in p.stdout
    assert "consumed samples:           24" in p.stdout


def test_a_run_whose_every_step_is_skipped_does_not_exit_0(tmp_path):
    p = _run(TINY + ["--rl-prompts", _prompts(tmp_path, 4), "--train-iters", "2", "--inject-nan-iterations", "1", "2",
                     "--save", str(tmp_path / "ckpt")], check=False)
    assert p.returncode == 1 and "all 2 RL steps of this run were skipped" in p.stderr
    # 2 prompts x 4 samples trained per step: the log line counts them, not --global-batch-size (4)
    assert "consumed samples:            8" in p.stdout and "consumed samples:           16" in p.stdout
    assert not os.path.exists(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")
