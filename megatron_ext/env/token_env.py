"""The coding environment at the token level: what the RL core's environment interface consumes.

``reset(task) -> prompt ids`` (system prompt, instruction and the tool declarations rendered with the Kimi-K2
chat template, ending in an open assistant turn); ``step(model ids) -> StepResult(observation ids, done)``: the
model's turn is parsed back into a message (`parse_assistant`), its tool calls run in the episode's sandbox, and
the observation is exactly the tokens to append before the next model turn (the tool messages and the next
assistant header, preceded by ``<|im_end|>`` when the model's turn was cut before closing itself); ``score()``
grades and returns the reward parts and total (a grading failure gives total 0 and the error, never an exception). An episode is one token sequence (model tokens are never
re-tokenised, environment tokens are rendered once), or, with self-summarisation, a chain of sequences: a step
with ``restart`` closes the current sequence after the model's summary and gives the prompt of the next; every
sequence of the chain shares the episode's final reward.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Optional

from megatron_ext.data.sft import IM_END, parse_assistant, render_chat
from megatron_ext.env.episode import EpisodeConfig, EpisodeResult, Session
from megatron_ext.env.rewards import Score
from megatron_ext.env.tasks import Task, task_from_dict
from megatron_ext.env.tools import TOOL_SCHEMAS, declarations


@dataclass
class StepResult:
    observation: list[int]  # tokens to append before the next model turn (empty when done)
    done: bool
    restart: bool = False   # self-summarisation closed the sequence: observation is the prompt of a new one


class CodingEnv:
    """One episode at a time over a Session; `score()` also frees the sandbox. A subclass changes the episode kind
    by overriding `tools` (the declarations rendered into prompts) and `new_session` (megatron_ext/env/swarm.py)."""

    tools = TOOL_SCHEMAS

    def __init__(self, tokenizer, config: Optional[EpisodeConfig] = None, task_dir: str = "."):
        self.tokenizer, self.config, self.task_dir = tokenizer, config or EpisodeConfig(), task_dir
        self.session: Optional[Session] = None
        self.result: Optional[EpisodeResult] = None
        self.im_end = tokenizer.token_id(IM_END)

    def reset(self, task) -> list[int]:
        """task: a Task, or a task record (relative paths resolved against task_dir)."""
        if self.session is not None:
            self.session.close()
        if not isinstance(task, Task):
            task = task_from_dict(task, self.task_dir, f"task {task.get('id', '?') if isinstance(task, dict) else ''}")
        self.session, self.result = self.new_session(task), None
        return self._prompt()

    def new_session(self, task: Task) -> Session:
        return Session(task, self.config)

    def _prompt(self) -> list[int]:
        tools = declarations(self.tools, self.config.tool_declarations)
        return render_chat(self.tokenizer, self.session.messages, tools=tools, add_generation_prompt=True).ids

    def step(self, model_tokens: list[int]) -> StepResult:
        if self.session is None or self.session.done:
            raise RuntimeError("step() needs an open episode: call reset(task) first")
        model_tokens = [int(t) for t in model_tokens]
        tool_messages = self.session.apply(parse_assistant(self.tokenizer, model_tokens))
        if self.session.done:
            return StepResult([], True)
        if self.session.restarted:
            return StepResult(self._prompt(), False, restart=True)
        close = [] if model_tokens and model_tokens[-1] == self.im_end else [self.im_end]
        return StepResult(close + render_chat(self.tokenizer, tool_messages, add_generation_prompt=True).ids, False)

    def score(self) -> Score:
        if self.session is None:
            raise RuntimeError("score() needs an episode: call reset(task) first")
        try:
            self.result = self.session.finish()
        except Exception as e:  # grading that fails scores this sample 0 with the error; the run goes on
            self.session.close()
            return Score({}, {}, 0.0, 0.0, error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
        reward = self.result.reward
        return Score({k: v for k, v in reward.items() if k in reward["weights"]}, reward["weights"],
                     reward["total"], reward["length_x"])

    def close(self):
        if self.session is not None:
            self.session.close()
