"""Run one agentic coding episode and print its transcript and reward parts as JSON.

    python tools/run_episode.py --task TASK.json --agent script:ACTIONS.json
    python tools/run_episode.py --task SUITE.jsonl#ID --agent endpoint:http://127.0.0.1:8000
    python tools/run_episode.py --task TASK.json --agent local:CKPT [--serve-arg=--tokenizer-model --serve-arg=DIR]
    python tools/run_episode.py --task TASK.json --agent-mode swarm --agent endpoint:URL \
        --swarm-subagent-policy endpoint:URL2 [--swarm-max-subagents 4]

ACTIONS.json is a JSON list of tool calls, {"name": "run_command", "arguments": {"command": "..."}}, played in
order, then finish (an entry that is a list of calls is one turn with several calls). With --agent-mode swarm
the agent is an orchestrator with the swarm tools (create_subagent, assign_task, wait, merge) and sub-agents from
--swarm-subagent-policy (endpoint:URL, local:CKPT or script:SCRIPTS.json, {name: actions}); the output adds
"critical_steps", "total_steps", "stages", "swarm" (sub-agent statistics) and "subagents" (their transcripts). The
output's "reward" object holds every part ("correctness", "tests_fraction", "style",
"communication", the penalties, "length") and the weighted "total"; the --env-* flags (megatron_ext/env/
arguments.py) set the sandbox limits, the reward weights and self-summarisation. The evaluation harness and RL use
the same episode code (megatron_ext/env/episode.py).
"""

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.env.agents import AgentError, make_agent  # noqa: E402
from megatron_ext.env.arguments import (add_env_args, add_swarm_args, checkpoint_agent_prompt,  # noqa: E402
                                       episode_config, swarm_config)
from megatron_ext.env.episode import run_episode  # noqa: E402
from megatron_ext.env.grading import GradingError  # noqa: E402
from megatron_ext.env.sandbox import SandboxError  # noqa: E402
from megatron_ext.env.swarm import make_subagent_policy, run_swarm_episode  # noqa: E402
from megatron_ext.env.tasks import TaskError, load_task  # noqa: E402
from megatron_ext.training.checkpointing import CheckpointError  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, help="TASK.json, or SUITE.jsonl#ID (or a one-task .jsonl)")
    p.add_argument("--agent", required=True, help="script:ACTIONS.json | endpoint:URL | local:CKPT")
    p.add_argument("--agent-mode", default="single", choices=("single", "swarm"),
                   help="swarm: the agent orchestrates sub-agents (the --swarm-* flags)")
    p.add_argument("--model", default=None, help="model name sent to the endpoint")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per model turn")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--serve-arg", action="append", default=[], help="extra tools/serve.py flag (local: agents)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    add_env_args(p)
    add_swarm_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        task = load_task(args.task)
        if args.agent.startswith("local:"):
            checkpoint_agent_prompt(args, args.agent[len("local:"):], f"--agent {args.agent}",
                                    log=lambda line: print(line, file=sys.stderr, flush=True))
        config = episode_config(args)
        config.sandbox.limits.wall_s = task.command_timeout_s
        kwargs = {"max_tokens": args.max_tokens, "temperature": args.temperature, "model": args.model}
        if args.agent.startswith("local:"):
            kwargs["serve_args"] = tuple(args.serve_arg)
        policy = None
        if args.agent_mode == "swarm":
            if not args.swarm_subagent_policy or args.swarm_subagent_policy == "pinned":
                raise ValueError("--agent-mode swarm needs --swarm-subagent-policy endpoint:URL, local:CKPT or "
                                 "script:SCRIPTS.json (pinned exists only inside rl_composer.py)")
            swarm = swarm_config(args)
            sub_kwargs = {"model": args.model, "max_tokens": args.swarm_subagent_tokens_per_turn,
                          "temperature": args.swarm_subagent_temperature}
            if args.swarm_subagent_policy.startswith("local:"):
                sub_kwargs["serve_args"] = tuple(args.serve_arg)
            policy = make_subagent_policy(args.swarm_subagent_policy,
                                          **({} if args.swarm_subagent_policy.startswith("script:") else sub_kwargs))
        try:
            agent = make_agent(args.agent, **({} if args.agent.startswith("script:") else kwargs))
        except BaseException:
            if policy is not None:  # a sub-agent server already started
                policy.close()
            raise
    except (TaskError, AgentError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if policy is not None:
            result = run_swarm_episode(task, agent, policy, config, swarm)
        else:
            result = run_episode(task, agent, config)
    except (SandboxError, GradingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        agent.close()
        if policy is not None:
            policy.close()
    text = json.dumps(result.to_json(), indent=1, ensure_ascii=False)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
