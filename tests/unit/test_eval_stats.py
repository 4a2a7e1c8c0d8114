"""The evaluation's statistics and token accounting against values computed by hand."""

from __future__ import annotations

import math

import pytest

from megatron_ext.env.episode import approx_tokens
from megatron_ext.eval.metrics import pass_ks
from megatron_ext.eval.plots import pareto_frontier
from megatron_ext.eval.stats import bootstrap_mean, fisher_exact, holm, paired_permutation, pass_at_k, wilson
from megatron_ext.eval.usage import Prices, episode_usage


def test_wilson_by_hand():
    # n = 4, p = 3/4, z = 1.96: centre (p + z^2/2n) / (1 + z^2/n) = 0.627529, half width
    # z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/4n^2) = 0.326886
    assert wilson(3, 4) == pytest.approx((0.300643, 0.954415), abs=1e-5)
    assert wilson(1, 2) == pytest.approx((0.094531, 0.905469), abs=1e-5)  # centre 0.5, half width 0.405469
    assert wilson(0, 5)[0] == 0.0 and wilson(5, 5)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="outside"):
        wilson(3, 2)


def test_bootstrap_over_two_tasks_is_their_range():
    # resampling 2 tasks: the mean is a (1/4), (a+b)/2 (1/2) or b (1/4): the 2.5th and 97.5th percentiles are a, b
    assert bootstrap_mean([0.5, 1.0]) == (0.5, 1.0)
    assert bootstrap_mean([0.25, 0.25, 0.25]) == (0.25, 0.25)
    low, high = bootstrap_mean([0, 1] * 50)
    assert 0.39 < low < 0.42 and 0.58 < high < 0.61  # ~ 0.5 -+ 1.96 * 0.05


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(4, 2, 3) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)
    assert pass_ks(1) == [1] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(8) == [1, 2, 4, 8]


def test_fisher_permutation_holm_by_hand():
    assert fisher_exact(2, 2, 0, 2) == pytest.approx(1 / 3)  # the two extreme tables, each 1/C(4,2)
    assert fisher_exact(3, 3, 0, 3) == pytest.approx(0.1)    # 2 / C(6,3)
    assert fisher_exact(1, 2, 1, 2) == pytest.approx(1.0)
    assert paired_permutation([1, 1, 1])[0] == 0.25           # 2 of 8 sign patterns reach |sum| 3
    p, method = paired_permutation([1, -1, 0, 0])
    assert p == 1.0 and "exact (4 sign patterns)" in method
    p, method = paired_permutation([1.0] * 20)
    assert p < 1e-3 and "Monte Carlo" in method
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


def test_episode_usage_splits_prompt_into_cached_and_new():
    segment = [{"role": "system", "content": "x" * 8}, {"role": "user", "content": "y" * 12},  # 2 + 3 tokens
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "a", "type": "function", "function": {"name": "ab", "arguments": "cd"}}]},  # 1
               {"role": "tool", "tool_call_id": "a", "content": "z" * 40},  # 10
               {"role": "assistant", "content": "w" * 20}]  # 5
    # turn 0: prompt 5 (all new), output 1; turn 1: prompt 16 of which 6 cached, output 5
    assert episode_usage([segment], [], approx_tokens) == {"input_tokens": 15, "cached_input_tokens": 6,
                                                          "output_tokens": 6}
    # a second segment restarts the conversation and the cache: prompt 5 new, output 5
    restart = [segment[0], segment[1], segment[4]]
    assert episode_usage([segment, restart], [], approx_tokens) == {"input_tokens": 20, "cached_input_tokens": 6,
                                                                   "output_tokens": 11}
    with_tools = episode_usage([segment], [{"name": "t" * 30}], approx_tokens)
    assert with_tools["input_tokens"] == 15 + approx_tokens('[{"name": "' + "t" * 30 + '"}]')
    assert Prices(1.0, 0.5, 4.0).cost({"input_tokens": 2e6, "cached_input_tokens": 1e6, "output_tokens": 1e6}) == 6.5


def test_pareto_frontier():
    # cheaper-and-better wins; (3, 0.5) is dominated by (2, 0.6)
    assert pareto_frontier([1, 2, 3, 4], [0.2, 0.6, 0.5, 0.9]) == [0, 1, 3]


def _record(task, k, correct, critical=None, diff=4, turns=3):
    record = {"task": task, "pass": k, "status": "finished", "wall_s": 2.0, "grading": {"diff_lines": diff},
              "reward": {"correctness": float(correct), "total": float(correct), "communication": 0.5},
              "counts": {"tool_calls": 2, "turns": turns, "thinking_tokens": 10, "tool_call_tokens": 5,
                         "tool_output_tokens": 7, "message_tokens": 1},
              "usage": {"input_tokens": 100, "cached_input_tokens": 50, "output_tokens": 16}}
    if critical is not None:
        record["critical_steps"] = critical
    return record


def test_summary_of_synthetic_episodes_reports_swarm_steps_and_partial_runs():
    from megatron_ext.env.tasks import Task
    from megatron_ext.eval.metrics import summarise

    tasks = [Task("a", "/r", "x" * 10, "true", 1, metadata={"reference_diff_lines": 8}),
             Task("b", "/r", "x" * 30, "true", 1), Task("c", "/r", "x", "true", 1)]
    records = [_record("a", 0, 1, critical=2), _record("a", 2, 0, critical=4, diff=12), _record("b", 1, 1, turns=5)]
    s = summarise(tasks, records, passes=3, prices=Prices(output=1e6))
    assert not s["complete"] and s["tasks_run"] == 2 and s["episodes"] == 3
    assert s["accuracy"] == pytest.approx((0.5 + 1.0) / 2)
    a = s["per_task"]["a"]
    assert a["pass_indices"] == [0, 2] and a["correct"] == [1, 0] and a["code_quality"]["diff_to_reference"] == 1.0
    assert a["efficiency"]["critical_steps"] == 3.0 and "critical_steps" not in s["per_task"]["b"]["efficiency"]
    assert s["efficiency"]["critical_steps"] == 3.0 and s["efficiency"]["turns"] == pytest.approx(11 / 3)
    assert s["efficiency"]["cost"] == 16.0 and s["efficiency"]["cost_total"] == 48.0
    assert s["pass_at_k"] == {"1": 0.75}  # task b has one pass: pass@k only up to the passes every task has
    assert s["per_task"]["c"]["passes"] == 0 and s["per_task"]["c"]["accuracy"] is None
    assert s["suite"]["median_instruction_chars"] == 10 and s["suite"]["tasks_with_reference_diff"] == 1
    from megatron_ext.eval.report import build

    md = build(s, "partial run").markdown("figs")
    assert "| critical steps (agent swarm) | 3.00 |" in md and "| turns (total steps) | 3.67 |" in md
    assert "| c | 0 | - | - | - |" in md and "complete: no" in md
    assert md.count("](figs/") == 3
