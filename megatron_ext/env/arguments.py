"""Flags of the agentic environment, and their translation into the typed `EpisodeConfig` (flags at the edge).

`add_env_args` adds an "agentic environment" group to any parser (tools/run_episode.py; the RL entry point passes
it to `megatron_ext.arguments.parse_args(extra=(add_env_args,))`); `episode_config(args)` makes the config once.
"""

from __future__ import annotations

import argparse

from megatron_ext.env.episode import EpisodeConfig
from megatron_ext.env.rewards import WeightFile, override_weights
from megatron_ext.env.sandbox import BubblewrapConfig, Limits


def add_env_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("agentic environment")
    g.add_argument("--env-reward-weights", default=None,
                   help="JSON reward weights file, re-read when it changes (megatron_ext/env/rewards.py)")
    g.add_argument("--env-reward-weight", action="append", default=[], metavar="NAME=VALUE",
                   help="override one reward weight (repeatable), e.g. --env-reward-weight style=-0.05")
    g.add_argument("--env-summarize-at", type=int, default=None,
                   help="context tokens past which the agent summarises and continues from the summary")
    g.add_argument("--env-memory-gb", type=float, default=4.0, help="address-space limit of sandboxed processes")
    g.add_argument("--env-max-processes", type=int, default=256, help="process limit of a sandbox")
    g.add_argument("--env-cpu-s", type=int, default=120, help="CPU-seconds limit of each sandboxed process")
    g.add_argument("--env-output-kb", type=int, default=1024, help="captured output of one command, in KiB")
    g.add_argument("--env-sandbox-dir", default=None, help="host folder for sandbox copies (default: temp dir)")


def episode_config(args: argparse.Namespace, step: int = 0) -> EpisodeConfig:
    """The EpisodeConfig the flags describe; raises ValueError naming the flag on a bad value."""
    for flag, value in (("--env-memory-gb", args.env_memory_gb), ("--env-max-processes", args.env_max_processes),
                        ("--env-cpu-s", args.env_cpu_s), ("--env-output-kb", args.env_output_kb)):
        if value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    if args.env_summarize_at is not None and args.env_summarize_at <= 0:
        raise ValueError(f"--env-summarize-at must be positive, got {args.env_summarize_at}")
    weights = override_weights(WeightFile(args.env_reward_weights).current(step), args.env_reward_weight)
    limits = Limits(cpu_s=args.env_cpu_s, memory_bytes=int(args.env_memory_gb * (1 << 30)),
                    processes=args.env_max_processes, output_bytes=args.env_output_kb << 10)
    return EpisodeConfig(sandbox=BubblewrapConfig(limits=limits, base_dir=args.env_sandbox_dir), weights=weights,
                         summarize_at=args.env_summarize_at)
