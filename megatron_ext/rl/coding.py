"""The agentic coding environment (megatron_ext/env/) as an RL environment family (`rl_composer.py --rl-env coding`).

`CodingEnvFactory` is what data_provider hands the trainer: calling it makes one `CodingRLEnv` per episode, a thin
adapter of `megatron_ext.env.token_env.CodingEnv` onto the RL `Environment` protocol (reset/step on token ids, and
`score()` as an RL `Reward`: the coding Score's raw parts, its weighted total, its grading error). The tokenizer
renders prompts and observations with the Kimi-K2 chat template and `<|im_end|>` ends a model turn.

Reward weights come from `--env-reward-weights FILE` (re-read when it changes) and `--env-reward-weight NAME=W`
overrides. The trainer calls `factory.read_weights(step)` on rank 0 before a step's rollouts and hands the result
to every rank's `factory.use_weights(config)`, so a change of the file is logged once with the step it took effect
at and all ranks score a step with the same weights.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Callable, Optional

from megatron_ext.data.sft import IM_END, render_chat
from megatron_ext.env.arguments import episode_config
from megatron_ext.env.episode import SYSTEM_PROMPT
from megatron_ext.env.rewards import WeightFile, override_weights
from megatron_ext.env.tasks import load_tasks
from megatron_ext.env.token_env import CodingEnv
from megatron_ext.env.tools import TOOL_SCHEMAS, declarations
from megatron_ext.rl.types import Reward


def read_coding_tasks(path: str, flag: str = "--rl-prompts") -> list[dict]:
    """Every task of a suite (.jsonl, or a .json task / list) as task records with absolute paths; ids unique."""
    try:
        return [t.to_json() for t in load_tasks(path)]
    except ValueError as e:
        raise ValueError(f"{flag}: {e} (a coding task suite: tools/mine_tasks.py --out, megatron_ext/env/tasks.py)") \
            from None


class CodingRLEnv:
    """One coding episode on token ids: the RL Environment protocol over CodingEnv."""

    def __init__(self, env: CodingEnv):
        self.env = env

    def reset(self, task: dict) -> list[int]:
        return self.env.reset(task)

    def step(self, model_tokens: list[int]):
        return self.env.step(model_tokens)  # a StepResult; `restart` set when self-summarisation closes a sequence

    def score(self) -> Reward:
        """Grades (hidden tests in a fresh sandbox) and frees the sandbox; never raises: a failure is total 0."""
        s = self.env.score()
        return Reward(dict(s.parts), float(s.total), s.error)

    def close(self):
        """Kill the episode's processes and remove its sandbox copy (the rollout loop calls it when it fails)."""
        self.env.close()


class CodingEnvFactory:
    """Makes a CodingRLEnv per episode; holds the tokenizer, the episode config and the reward weights file."""

    system_prompt, tools = SYSTEM_PROMPT, TOOL_SCHEMAS  # what an episode's first prompt declares

    def __init__(self, args, tokenizer, log: Callable[[str], None] = print):
        self.tokenizer = tokenizer
        self.weight_file = WeightFile(args.env_reward_weights, log_fn=log)
        self.overrides = list(args.env_reward_weight)
        self.config = dataclasses.replace(episode_config(args), count_tokens=lambda s: len(tokenizer.encode(s)))
        # rollout.run_groups runs this many environment calls of different episodes at once (--env-concurrency)
        self.concurrency = getattr(args, "env_concurrency", 1)
        self.use_weights(self.read_weights(0))
        self.stop_token_ids = (tokenizer.token_id(IM_END),)

    def read_weights(self, step: int) -> dict:
        """The weights in force from `step` on: the file (re-read when it changed; the change is logged with the
        step) with the --env-reward-weight overrides."""
        return override_weights(self.weight_file.current(step), self.overrides)

    def use_weights(self, config: dict):
        self.config = dataclasses.replace(self.config, weights=copy.deepcopy(config))

    def prompt_length(self, task: dict) -> int:
        """Tokens of a task's first prompt (what CodingEnv.reset renders), without starting a sandbox."""
        messages = [{"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": task["instruction"]}]
        tools = declarations(self.tools, self.config.tool_declarations)
        return len(render_chat(self.tokenizer, messages, tools=tools, add_generation_prompt=True).ids)

    def __call__(self) -> CodingRLEnv:
        return CodingRLEnv(CodingEnv(self.tokenizer, self.config))


def coding_data_provider(args, log: Optional[Callable[[str], None]] = None, factory_class=CodingEnvFactory):
    """Tasks (--rl-prompts, --rl-eval-prompts suites) and the environment factory of the coding family (or of a
    family built on it: factory_class(args, tokenizer, log=...), e.g. the swarm's)."""
    from megatron_ext.data.tokenizers import build_tokenizer

    if not args.tokenizer_model:
        raise ValueError(f"--rl-env {args.rl_env} needs --tokenizer-model PATH (a tokenizer with the chat template's special "
                         "tokens, e.g. from tools/train_tokenizer.py)")
    tasks = read_coding_tasks(args.rl_prompts)
    eval_tasks = read_coding_tasks(args.rl_eval_prompts, "--rl-eval-prompts") if args.rl_eval_prompts else []
    rank0 = os.environ.get("RANK", "0") == "0"
    log = log or (print if rank0 else (lambda *a, **k: None))
    factory = factory_class(args, build_tokenizer(args.tokenizer_type, args.tokenizer_model), log=log)
    longest = max(tasks + eval_tasks, key=factory.prompt_length)
    need = factory.prompt_length(longest) + args.grpo_max_response_length
    if need > args.seq_length:
        raise ValueError(f"task {longest['id']}: its prompt ({factory.prompt_length(longest)} tokens) and "
                         f"--grpo-max-response-length {args.grpo_max_response_length} need {need} positions, more "
                         f"than --seq-length {args.seq_length}: raise --seq-length (tool observations need room too)")
    return tasks, eval_tasks, factory
