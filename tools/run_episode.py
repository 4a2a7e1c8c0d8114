"""Run one agentic coding episode and print its transcript and reward parts as JSON.

    python tools/run_episode.py --task TASK.json --agent script:ACTIONS.json
    python tools/run_episode.py --task SUITE.jsonl#ID --agent endpoint:http://127.0.0.1:8000
    python tools/run_episode.py --task TASK.json --agent local:CKPT [--serve-arg=--tokenizer-model --serve-arg=DIR]

ACTIONS.json is a JSON list of tool calls, {"name": "run_command", "arguments": {"command": "..."}}, played in
order, then finish. The output's "reward" object holds every part ("correctness", "tests_fraction", "style",
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
from megatron_ext.env.arguments import add_env_args, episode_config  # noqa: E402
from megatron_ext.env.episode import run_episode  # noqa: E402
from megatron_ext.env.sandbox import SandboxError  # noqa: E402
from megatron_ext.env.tasks import TaskError, load_task  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, help="TASK.json, or SUITE.jsonl#ID (or a one-task .jsonl)")
    p.add_argument("--agent", required=True, help="script:ACTIONS.json | endpoint:URL | local:CKPT")
    p.add_argument("--model", default=None, help="model name sent to the endpoint")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per model turn")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--serve-arg", action="append", default=[], help="extra tools/serve.py flag (local: agents)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    add_env_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        task = load_task(args.task)
        config = episode_config(args)
        config.sandbox.limits.wall_s = task.command_timeout_s
        kwargs = {"max_tokens": args.max_tokens, "temperature": args.temperature, "model": args.model}
        if args.agent.startswith("local:"):
            kwargs["serve_args"] = tuple(args.serve_arg)
        agent = make_agent(args.agent, **({} if args.agent.startswith("script:") else kwargs))
    except (TaskError, AgentError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run_episode(task, agent, config)
    except SandboxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        agent.close()
    text = json.dumps(result.to_json(), indent=1, ensure_ascii=False)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
