"""The agent swarm as an RL environment family (`rl_composer.py --rl-env swarm`): the orchestrator is the policy
being trained; its sub-agents are a frozen policy whose turns reach it only as `wait` observations.

Episodes are coding episodes (megatron_ext/rl/coding.py) whose Session is a `SwarmSession` and whose prompts
declare the swarm tools; everything else (token sequences, loss, exactly-once accounting, reward weights file) is
the coding family's. Only the orchestrator's tokens are model segments of a rollout, so only they are trained.

    orchestrator turn: trainer's engine (main thread) --> tool calls --> assign_task starts sub-agent threads
    sub-agent turns:   SubAgentPolicy (endpoint / local server / pinned engine copy) on their own threads, while
                       the orchestrator and the other episodes go on generating

The PARL lambdas of a step travel in the reward config (`read_weights(step)` adds a 'swarm' section; rank 0 reads,
the trainer broadcasts, every rank's `use_weights` takes it), so all ranks score a step with the same lambdas.
`--swarm-subagent-policy pinned` builds, once the trainer exists (`attach`), a second model holding the policy's
weights at the start version (re-pinned every --swarm-subagent-pin-interval steps) and an inference engine over
it: one engine per rank, so it needs tensor and expert parallel size 1. The asynchronous rollout fleet plugs in as
another `SubAgentPolicy` (env/swarm.py).
"""

from __future__ import annotations

from typing import Callable, Optional

from megatron_ext.env.arguments import swarm_config
from megatron_ext.env.episode import Session
from megatron_ext.env.swarm import (SWARM_SYSTEM_PROMPT, SWARM_TOOL_SCHEMAS, EnginePolicy, SubAgentPolicy,
                                    SwarmSession, make_subagent_policy)
from megatron_ext.env.tasks import Task
from megatron_ext.env.token_env import CodingEnv
from megatron_ext.rl.coding import CodingEnvFactory, CodingRLEnv, coding_data_provider


class SwarmCodingEnv(CodingEnv):
    tools = SWARM_TOOL_SCHEMAS

    def __init__(self, tokenizer, config, swarm, policy: SubAgentPolicy):
        super().__init__(tokenizer, config)
        self.swarm, self.policy = swarm, policy

    def new_session(self, task: Task) -> Session:
        return SwarmSession(task, self.config, self.swarm, self.policy)


class SwarmEnvFactory(CodingEnvFactory):
    """A CodingEnvFactory whose episodes are orchestrator episodes (SwarmCodingEnv) sharing one sub-agent policy."""

    system_prompt, tools = SWARM_SYSTEM_PROMPT, SWARM_TOOL_SCHEMAS

    def __init__(self, args, tokenizer, log: Callable[[str], None] = print, policy: Optional[SubAgentPolicy] = None):
        self.swarm = swarm_config(args)
        spec = args.swarm_subagent_policy
        if not spec and policy is None:
            raise ValueError("--rl-env swarm needs --swarm-subagent-policy (endpoint:URL, local:CKPT, "
                             "script:SCRIPTS.json or pinned)")
        if spec == "pinned" and (getattr(args, "tensor_model_parallel_size", 1) > 1 or
                                 getattr(args, "expert_model_parallel_size", 1) > 1):
            raise ValueError("--swarm-subagent-policy pinned runs a sub-agent engine on every rank by itself: it needs "
                             "--tensor-model-parallel-size 1 and --expert-model-parallel-size 1 (or serve a frozen "
                             "checkpoint and use endpoint:URL)")
        if spec == "fleet" and not getattr(args, "rl_remote_servers", None):
            raise ValueError("--swarm-subagent-policy fleet sends sub-agent turns to the run's inference servers: it "
                             "needs --rl-remote-servers URL ... (with Ray rollout workers the environments live in "
                             "the workers; use pinned or endpoint:URL there)")
        self.args, self.pin_interval, self.trainer, self.log = args, args.swarm_subagent_pin_interval, None, log
        self.policy_kwargs = {"max_tokens": args.swarm_subagent_tokens_per_turn,
                              "temperature": args.swarm_subagent_temperature}
        super().__init__(args, tokenizer, log=log)
        # one environment call at a time: a step may run sub-agents on a shared policy (a local engine is not
        # thread-safe)
        self.concurrency = 1
        self.policy = policy or (None if spec in ("pinned", "fleet") else
                                 make_subagent_policy(spec, **self.policy_kwargs))

    def read_weights(self, step: int) -> dict:
        config = super().read_weights(step)
        config["swarm"] = self.swarm.schedule.weights(step)
        return config

    def use_weights(self, config: dict):
        super().use_weights(config)
        policy = getattr(self, "policy", None)
        if isinstance(policy, EnginePolicy) and self.trainer is not None and self.pin_interval and \
                self.trainer.iteration - policy.version >= self.pin_interval:
            policy.pin(self.trainer.model, self.trainer.iteration)
            self.log(f"swarm: sub-agents re-pinned to the policy's weights at version {self.trainer.iteration}")

    def attach(self, trainer):
        """rl_composer.py calls this once the trainer (its model and version) exists: the pinned policy is built."""
        self.trainer = trainer
        if self.policy is not None:
            return
        if self.args.swarm_subagent_policy == "fleet":
            from megatron_ext.env.swarm import GeneratePolicy
            from megatron_ext.rl.remote import RemoteGenerate

            servers = trainer.cfg.remote_servers
            self.policy = GeneratePolicy(RemoteGenerate(servers, failover=True), self.tokenizer,
                                         self.args.seq_length, seed=self.args.seed, **self.policy_kwargs)
            self.log(f"swarm: sub-agent turns go to the {len(servers)} inference server(s) of --rl-remote-servers "
                     "(the policy's newest published weights), concurrently")
            return
        from megatron_ext.inference.engine import InferenceEngine
        from megatron_ext.training.step import build_model

        model = build_model(self.args, wrap_ddp=False)[0]
        for p in model.parameters():
            p.requires_grad_(False)
        engine = InferenceEngine(model, weights_version=trainer.iteration)
        engine.update_weights(trainer.model, version=trainer.iteration)
        self.policy = EnginePolicy(engine, self.tokenizer, **self.policy_kwargs)
        self.log(f"swarm: sub-agents run the policy's weights at version {trainer.iteration} in a local engine copy"
                 + (f", re-pinned every {self.pin_interval} steps" if self.pin_interval else ""))

    def __call__(self) -> CodingRLEnv:
        if self.policy is None:
            raise RuntimeError("--swarm-subagent-policy pinned: attach(trainer) first (rl_composer.py does)")
        return CodingRLEnv(SwarmCodingEnv(self.tokenizer, self.config, self.swarm, self.policy))


def swarm_data_provider(args, log: Optional[Callable[[str], None]] = None):
    """Tasks and the environment factory of the swarm family (coding task suites)."""
    return coding_data_provider(args, log, factory_class=SwarmEnvFactory)
