"""Flags of the agentic environment, and their translation into the typed `EpisodeConfig` (flags at the edge).

`add_env_args` adds an "agentic environment" group to any parser (tools/run_episode.py; the RL entry point passes
it to `megatron_ext.arguments.parse_args(extra=(add_env_args,))`); `episode_config(args)` makes the config once.
"""

from __future__ import annotations

import argparse
import sys

from megatron_ext.env.episode import EpisodeConfig
from megatron_ext.env.rewards import WeightFile, override_weights
from megatron_ext.env.sandbox import BubblewrapConfig, Limits, sandbox_line
from megatron_ext.env.tools import TOOL_DECLARATIONS, declared_kind


def add_env_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("agentic environment")
    g.add_argument("--env-reward-weights", default=None,
                   help="JSON reward weights file, re-read when it changes (megatron_ext/env/rewards.py)")
    g.add_argument("--env-reward-weight", action="append", default=[], metavar="NAME=VALUE",
                   help="override one reward weight (repeatable), e.g. --env-reward-weight style=-0.05")
    g.add_argument("--env-summarize-at", type=int, default=None,
                   help="context tokens past which the agent summarises and continues from the summary")
    g.add_argument("--env-memory-gb", type=float, default=4.0,
                   help="memory total of a sandbox's processes (cgroup; also each process's address-space limit); "
                        "files the workspace holds count toward it (the workspace is a tmpfs)")
    g.add_argument("--env-disk-gb", type=float, default=4.0,
                   help="disk total of an episode's workspace plus /tmp (a size-bounded tmpfs); 0: unbounded")
    g.add_argument("--env-cpus", type=float, default=2.0,
                   help="CPU bandwidth of a sandbox in cores, all its processes together (cgroup); 0: unbounded")
    g.add_argument("--env-max-processes", type=int, default=256, help="process limit of a sandbox (pids cgroup)")
    g.add_argument("--env-cpu-s", type=int, default=120, help="CPU-seconds limit of each sandboxed process")
    g.add_argument("--env-allow-weaker-sandbox", action="store_true",
                   help="start sandboxes even when a configured limit or protection cannot be enforced on this "
                        "machine (no cgroup controller, not root for the tmpfs, no libseccomp); the start-up line "
                        "says which hold")
    g.add_argument("--env-output-kb", type=int, default=1024, help="captured output of one command, in KiB")
    g.add_argument("--env-sandbox-dir", default=None, help="host folder for sandbox copies (default: temp dir)")
    g.add_argument("--env-concurrency", type=int, default=8,
                   help="RL rollouts: environment calls (sandbox start, a turn's tool calls, grading) a rank or "
                        "rollout worker runs at once, one thread each, over different episodes; they mostly wait on "
                        "sandboxed processes, so overlapping them keeps generation from waiting on their sum "
                        "(1: one after another). The swarm environment runs its calls one at a time")
    _add_agent_prompt_flags(g)


def _add_agent_prompt_flags(group):
    group.add_argument("--env-tool-declarations", default=None, choices=TOOL_DECLARATIONS,
                       help="how the tools are declared to the model: full descriptions, or compact (a few words "
                            "each; the same names, parameters, types and required lists). Default: what the "
                            "checkpoint (--load, local:CKPT) records, else full; recorded in saved checkpoints "
                            "(docs/agent-prompt.md)")


def add_agent_prompt_args(parser: argparse.ArgumentParser):
    """pretrain_composer.py: the agent-prompt options its --sft data was rendered with, recorded in the checkpoint
    so that RL, tools/run_eval.py and tools/run_episode.py render episodes the way the model was trained."""
    _add_agent_prompt_flags(parser.add_argument_group("agent prompt (--sft; recorded in the checkpoint)"))


def sft_agent_prompt(args: argparse.Namespace, log=print):
    """--sft: the tool declarations the chat data declares (tools/build_agent_sft.py writes them into every line)
    decide --env-tool-declarations when it is not given; a flag that contradicts the data is an error (a checkpoint
    recording one form while trained on the other would make every later episode render the wrong one)."""
    if not getattr(args, "sft", False) or not args.data_path:
        return
    from megatron_ext.data.sft import iter_conversations

    found = {}
    for number, record, _ in iter_conversations(args.data_path[0]):
        kind = declared_kind(record.get("tools")) if record else None
        if kind is not None:
            found.setdefault(kind, number)
    if len(found) > 1:
        raise ValueError(f"--data-path {args.data_path[0]}: line {found['full']} declares the full tools and line "
                         f"{found['compact']} the compact ones; build the data with one --env-tool-declarations")
    if not found:
        return
    kind = next(iter(found))
    if args.env_tool_declarations is None:
        args.env_tool_declarations = kind
        log(f"--env-tool-declarations {kind}: as the --sft data declares its tools (recorded in the checkpoint)")
    elif args.env_tool_declarations != kind:
        raise ValueError(f"--env-tool-declarations {args.env_tool_declarations}, but --data-path "
                         f"{args.data_path[0]} declares the {kind} tools (line {found[kind]}); drop the flag or "
                         f"rebuild the data with tools/build_agent_sft.py --env-tool-declarations "
                         f"{args.env_tool_declarations}")


def checkpoint_agent_prompt(args: argparse.Namespace, checkpoint: str, where: str, log=print) -> str:
    """Apply the agent-prompt options a checkpoint records: a flag not given takes the checkpoint's value (older
    checkpoints record none: full); an explicit flag that disagrees wins, with a warning that the model is
    prompted unlike its training. Returns the tool declarations in force. CheckpointError when unreadable."""
    from megatron_ext.training.checkpointing import checkpoint_args

    ckpt, recorded = checkpoint_args(checkpoint, where)
    trained = recorded.get("env_tool_declarations") or "full"
    given = args.env_tool_declarations
    if given is None:
        args.env_tool_declarations = trained
        log(f"{where}: --env-tool-declarations {trained} (recorded in {ckpt})")
    elif given != trained:
        print(f"WARNING: {where}: --env-tool-declarations {given} is given, but {ckpt} was trained with "
              f"{trained}: episodes declare their tools unlike the model's training (the flag wins; drop it to "
              "use the checkpoint's)", file=sys.stderr, flush=True)
    return args.env_tool_declarations


def episode_config(args: argparse.Namespace, step: int = 0, check_sandbox: bool = True) -> EpisodeConfig:
    """The EpisodeConfig the flags describe; raises ValueError naming the flag on a bad value. check_sandbox:
    start one sandbox now and print the start-up line saying which limits hold (SandboxError, naming the flags,
    when one cannot be enforced and --env-allow-weaker-sandbox is not given)."""
    for flag, value in (("--env-memory-gb", args.env_memory_gb), ("--env-max-processes", args.env_max_processes),
                        ("--env-cpu-s", args.env_cpu_s), ("--env-output-kb", args.env_output_kb),
                        ("--env-concurrency", getattr(args, "env_concurrency", 1))):
        if value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    for flag, value in (("--env-disk-gb", args.env_disk_gb), ("--env-cpus", args.env_cpus)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0 (0: unbounded), got {value}")
    if args.env_summarize_at is not None and args.env_summarize_at <= 0:
        raise ValueError(f"--env-summarize-at must be positive, got {args.env_summarize_at}")
    weights = override_weights(WeightFile(args.env_reward_weights).current(step), args.env_reward_weight)
    limits = Limits(cpu_s=args.env_cpu_s, memory_bytes=int(args.env_memory_gb * (1 << 30)),
                    processes=args.env_max_processes, output_bytes=args.env_output_kb << 10,
                    disk_bytes=int(args.env_disk_gb * (1 << 30)), cpus=args.env_cpus)
    sandbox = BubblewrapConfig(limits=limits, base_dir=args.env_sandbox_dir,
                               allow_weaker=args.env_allow_weaker_sandbox)
    if check_sandbox:
        print(sandbox_line(sandbox), file=sys.stderr, flush=True)
    return EpisodeConfig(sandbox=sandbox, weights=weights, summarize_at=args.env_summarize_at,
                         tool_declarations=args.env_tool_declarations or "full")


def add_swarm_args(parser: argparse.ArgumentParser):
    """Flags of the agent swarm (megatron_ext/env/swarm.py): sub-agents, their policy, the PARL reward schedule."""
    g = parser.add_argument_group("agent swarm")
    g.add_argument("--swarm-subagent-policy", default=None,
                   help="where sub-agent turns come from: endpoint:URL (an OpenAI-compatible server of a frozen "
                        "checkpoint), local:CKPT (tools/serve.py started for the run), script:SCRIPTS.json "
                        "({name: actions}), or pinned (rl_composer.py: the policy's weights at a pinned version, in "
                        "a local engine copy), or fleet (rl_composer.py with --rl-remote-servers: the run's inference "
                        "servers, the policy's newest published weights, turns sent concurrently)")
    g.add_argument("--swarm-max-subagents", type=int, default=4,
                   help="most sub-agents an orchestrator may create (and run at once)")
    g.add_argument("--swarm-subagent-max-turns", type=int, default=20, help="turns of one sub-agent assignment")
    g.add_argument("--swarm-subagent-max-tokens", type=int, default=32768,
                   help="context token budget of one sub-agent assignment")
    g.add_argument("--swarm-subagent-timeout-s", type=float, default=600.0,
                   help="wall-clock limit of one sub-agent assignment (assign_task's timeout_s may lower it)")
    g.add_argument("--swarm-subagent-tokens-per-turn", type=int, default=1024,
                   help="generated tokens per sub-agent turn (endpoint/local/pinned policies)")
    g.add_argument("--swarm-subagent-temperature", type=float, default=1.0, help="sub-agent sampling temperature")
    g.add_argument("--swarm-subagent-pin-interval", type=int, default=0,
                   help="pinned policy: copy the current weights into the sub-agents' engine every N RL steps "
                        "(0: keep the version the run started from)")
    g.add_argument("--swarm-parallel-reward-weight", type=float, default=0.1,
                   help="lambda_1 of r_parallel at step 0 (rewards instantiating sub-agents)")
    g.add_argument("--swarm-finish-reward-weight", type=float, default=0.1,
                   help="lambda_2 of r_finish at step 0 (rewards sub-agents that finish their sub-task)")
    g.add_argument("--swarm-reward-anneal-steps", type=int, default=100,
                   help="RL steps over which both lambdas anneal to 0 (0: constant)")
    g.add_argument("--swarm-reward-anneal", default="linear", choices=("linear", "cosine"),
                   help="shape of the lambdas' annealing")


def swarm_config(args: argparse.Namespace):
    """The SwarmConfig the flags describe; raises ValueError naming the flag on a bad value."""
    from megatron_ext.env.swarm import ParlSchedule, SwarmConfig

    for flag in ("swarm_parallel_reward_weight", "swarm_finish_reward_weight"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    for flag in ("swarm_subagent_tokens_per_turn", "swarm_subagent_pin_interval"):
        if getattr(args, flag) < (1 if flag.endswith("per_turn") else 0):
            raise ValueError(f"--{flag.replace('_', '-')} is out of range: {getattr(args, flag)}")
    schedule = ParlSchedule(args.swarm_parallel_reward_weight, args.swarm_finish_reward_weight,
                            args.swarm_reward_anneal_steps, args.swarm_reward_anneal)
    return SwarmConfig(max_subagents=args.swarm_max_subagents, subagent_max_turns=args.swarm_subagent_max_turns,
                       subagent_max_tokens=args.swarm_subagent_max_tokens,
                       subagent_timeout_s=args.swarm_subagent_timeout_s, schedule=schedule)
