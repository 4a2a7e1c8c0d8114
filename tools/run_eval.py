"""Evaluate an agent on a task suite: K passes per task, a report with plots; or compare runs; or codebase NLL.

    python tools/run_eval.py --tasks SUITE --agent script:DIR --passes 2 --out runs/eval/oracle
    python tools/run_eval.py --tasks SUITE --agent endpoint:http://127.0.0.1:8000 --model NAME --passes 4 \
        --concurrency 8 --price-input 0.5 --price-cached-input 0.05 --price-output 2.5 --out runs/eval/k25
    python tools/run_eval.py --tasks builtin:NAME --agent local:CKPT --serve-arg=--tokenizer-model \
        --serve-arg=DIR --out runs/eval/ours          # the checkpoint is served in this process
    python tools/run_eval.py --tasks SUITE --agent-mode swarm --agent endpoint:URL --model NAME \
        --swarm-subagent-policy endpoint:URL2 --swarm-max-subagents 4 --out runs/eval/swarm
    python tools/run_eval.py --compare runs/eval/k25 runs/eval/ours --out runs/eval/k25-vs-ours
    python tools/run_eval.py nll ...                  # codebase NLL (megatron_ext/eval/nll.py)
    python tools/run_eval.py --tasks SUITE --list [--filter 'pkg-1.0:pkg/mod.py::*']   # the task ids, nothing run
    python tools/run_eval.py --validate TASKS...      # check task files against docs/task.schema.json

SUITE: a .json/.jsonl task file (megatron_ext/env/tasks.py), a directory of them (or of */task.json), or
builtin:NAME; SUITE#ID is one task of it. --filter GLOB (repeatable) and --task-ids ID,ID narrow the suite (the
selection is part of the run: resume with the same). --max-turns overrides every task's max_turns and
--episode-timeout-s bounds an episode's wall clock (status episode_timeout; both pinned in run.json).
script:DIR holds DIR/<task id>.json, the environment's ACTIONS.json format (no file: no actions; files that name no
task are listed in a warning). Nothing is written to --out until the agent is ready. A --passes below what the run
holds runs nothing new and keeps every stored pass in the summary (it says so).
The run directory gets one file per finished episode as it finishes (RUN/episodes/), then episodes.jsonl,
summary.json, report.md and report.html. With --agent-mode swarm the agent is an orchestrator that delegates
to sub-agents (megatron_ext/env/swarm.py; sub-agents from --swarm-subagent-policy: script:DIR with
DIR/<task id>.json = {name: actions}, script:SCRIPTS.json, endpoint:URL or local:CKPT); the summary and report
add critical steps, total steps and the swarm's statistics, and --compare of a swarm run against a single-agent run
on the same suite shows the accuracy and the critical-step and wall-clock differences.
Running the same command again resumes: finished episodes are kept
(also after kill -9); with other price flags it only rewrites the summary and report. Exit status: 0 when every
episode ran, 1 when some could not run (resume to retry them; a task whose test command cannot be started is one
of them, named), 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import sys

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))

from megatron_ext.env.agents import AgentError  # noqa: E402
from megatron_ext.env.arguments import (add_env_args, add_swarm_args, checkpoint_agent_prompt,  # noqa: E402
                                       episode_config, swarm_config)
from megatron_ext.env.tasks import TaskError  # noqa: E402
from megatron_ext.eval.agents import endpoint_factory, make_factory, swarm_setup  # noqa: E402
from megatron_ext.eval.harness import RunDir, RunError, run_suite, token_counter  # noqa: E402
from megatron_ext.eval.tasks import load_suite, select_tasks  # noqa: E402
from megatron_ext.eval.usage import Prices  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", help="SUITE: task file, directory of task files, or builtin:NAME")
    p.add_argument("--agent", help="script:DIR | endpoint:URL | local:CKPT")
    p.add_argument("--agent-mode", default="single", choices=("single", "swarm"),
                   help="swarm: the agent is an orchestrator with sub-agents (the --swarm-* flags)")
    p.add_argument("--model", default=None, help="model name sent to the endpoint")
    p.add_argument("--passes", type=int, default=1, help="episodes per task (K)")
    p.add_argument("--list", action="store_true", help="print the (selected) task ids of --tasks and exit")
    p.add_argument("--filter", action="append", default=[], metavar="GLOB",
                   help="only tasks whose id matches GLOB (fnmatch; repeatable: any of them)")
    p.add_argument("--task-ids", default=None, metavar="ID,ID", help="only these tasks (comma-separated ids)")
    p.add_argument("--validate", nargs="+", metavar="TASKS",
                   help="check task files or directories against the task schema and exit (0: all valid)")
    p.add_argument("--max-turns", type=int, default=None, help="override every task's max_turns")
    p.add_argument("--episode-timeout-s", type=float, default=None,
                   help="end an episode at the agent's first turn after this many seconds (graded as it stands)")
    p.add_argument("--concurrency", type=int, default=1, help="episodes run at once")
    p.add_argument("--out", help="run directory (resumed when it holds this run); with --compare: where the "
                                 "comparison report goes")
    p.add_argument("--compare", nargs="+", metavar="RUN", help="compare finished runs (the first is the baseline)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per model turn")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (passes differ when > 0)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra tools/serve.py flag (local: agents)")
    p.add_argument("--count-tokenizer", default=None,
                   help="tokenizer directory/file to count tokens with (default: the --tokenizer-model of a local "
                        "agent, else an estimate of 4 bytes a token)")
    g = p.add_argument_group("prices (currency units per million tokens; cost is reported when any is given)")
    g.add_argument("--price-input", type=float, default=0.0, help="uncached prompt tokens")
    g.add_argument("--price-cached-input", type=float, default=None,
                   help="prompt tokens read from a prefix cache (default: --price-input)")
    g.add_argument("--price-output", type=float, default=0.0, help="generated tokens")
    add_env_args(p)
    add_swarm_args(p)
    return p


SWARM_PINNED = ("swarm_subagent_policy", "swarm_max_subagents", "swarm_subagent_max_turns",
                "swarm_subagent_max_tokens", "swarm_subagent_timeout_s", "swarm_subagent_tokens_per_turn",
                "swarm_subagent_temperature")


def swarm_manifest(args) -> dict | None:
    """The swarm settings run.json pins (a resumed run must use the same), None for a single agent."""
    if args.agent_mode != "swarm":
        return None
    return {k[len("swarm_"):]: getattr(args, k) for k in SWARM_PINNED}


def serve_local(checkpoint: str, serve_args: list):
    """tools/serve.py's model service for `checkpoint`, in this process on a free loopback port: (url, stop)."""
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import serve as serve_tool

    from megatron_ext.arguments import parse_args
    from megatron_ext.inference.server import serve
    from megatron_ext.training.initialize import destroy

    if not os.path.isdir(checkpoint):
        raise AgentError(f"--agent local:{checkpoint}: not a checkpoint directory")
    args = parse_args(["--load", checkpoint, "--use-checkpoint-args", *serve_args, "--mock-data"],
                      description="run_eval local agent", extra=(serve_tool._serve_args,))
    args.finetune = True  # serving needs weights only
    service = serve_tool.build_service(args)
    if service.peers is not None:
        destroy()
        raise AgentError("--agent local: serves on one process; for a model-parallel checkpoint start "
                         "tools/serve.py under torchrun and use --agent endpoint:URL")
    httpd = serve(service, "127.0.0.1", 0)

    def stop():
        httpd.shutdown()
        destroy()

    return f"http://127.0.0.1:{httpd.server_address[1]}", stop


def _stderr(line: str):
    print(line, file=sys.stderr, flush=True)


def _flag_value(argv: list, flag: str):
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def run_compare(args) -> int:
    from megatron_ext.eval.compare import build, compare
    from megatron_ext.eval.outputs import load_summary

    if len(args.compare) < 2:
        print("error: --compare needs at least two run directories", file=sys.stderr)
        return 2
    try:
        runs = [(os.path.basename(os.path.normpath(r)) or r, load_summary(r)) for r in args.compare]
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    empty = [r for r, (_, s) in zip(args.compare, runs) if s["accuracy"] is None]
    if empty:
        print(f"error: --compare: {empty} have no finished episodes (resume them first)", file=sys.stderr)
        return 2
    names = [n for n, _ in runs]
    if len(set(names)) < len(names):
        runs = [(os.path.normpath(r), s) for r, (_, s) in zip(args.compare, runs)]
    result = compare(runs)
    doc = build(runs, result)
    if args.out:
        import json

        from megatron_ext.atomic import atomic_output

        with atomic_output(os.path.join(args.out, "compare.json")) as f:
            json.dump(result, f, indent=1)
        doc.write(args.out, "compare")
        print(f"wrote {args.out}/compare.md, compare.html, compare.json", file=sys.stderr)
    print(doc.markdown("compare_figures"))
    return 0


def selected(suite: list, args) -> list:
    ids = [i.strip() for i in (args.task_ids or "").split(",") if i.strip()]
    return select_tasks(suite, args.filter, ids)


def list_tasks(args) -> int:
    """--list: the selected task ids, one a line (with the source and category when the task records them)."""
    if not args.tasks:
        print("error: --list needs --tasks SUITE", file=sys.stderr)
        return 2
    try:
        tasks = selected(load_suite(args.tasks), args)
    except TaskError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for t in tasks:
        extra = " ".join(str(t.metadata[k]) for k in ("source", "category") if t.metadata.get(k))
        print(f"{t.id}\t{extra}" if extra else t.id)
    print(f"{len(tasks)} tasks", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["nll"]:
        from megatron_ext.eval.nll import main as nll_main

        return nll_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    if args.compare:
        return run_compare(args)
    if args.validate:
        from megatron_ext.eval.schema import validate_paths

        return validate_paths(args.validate)
    if args.list:
        return list_tasks(args)
    missing = [f for f, v in (("--tasks", args.tasks), ("--agent", args.agent), ("--out", args.out)) if not v]
    if missing:
        print(f"error: {', '.join(missing)} required (or --compare RUN_A RUN_B ...)", file=sys.stderr)
        return 2
    for flag, value in (("--passes", args.passes), ("--concurrency", args.concurrency),
                        ("--max-tokens", args.max_tokens), ("--max-turns", args.max_turns)):
        if value is not None and value < 1:
            print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    if args.episode_timeout_s is not None and args.episode_timeout_s <= 0:
        print(f"error: --episode-timeout-s must be > 0, got {args.episode_timeout_s}", file=sys.stderr)
        return 2
    if args.agent_mode != "swarm" and args.swarm_subagent_policy:
        print("error: --swarm-subagent-policy needs --agent-mode swarm", file=sys.stderr)
        return 2
    prices = Prices(args.price_input, args.price_input if args.price_cached_input is None else args.price_cached_input,
                    args.price_output)
    if min(prices.input, prices.cached_input, prices.output) < 0:
        print("error: --price-* must be >= 0", file=sys.stderr)
        return 2
    stop, swarm = None, None
    try:
        suite = load_suite(args.tasks)
        tasks = selected(suite, args)
        if args.max_turns is not None:
            tasks = [dataclasses.replace(t, max_turns=args.max_turns) for t in tasks]
        if args.agent.startswith("local:"):
            checkpoint_agent_prompt(args, args.agent[len("local:"):], f"--agent {args.agent}", log=_stderr)
        config = episode_config(args)
        tokenizer = args.count_tokenizer or (_flag_value(args.serve_arg, "--tokenizer-model")
                                             if args.agent.startswith("local:") else None)
        config.count_tokens, counter = token_counter(tokenizer)
        run = RunDir(args.out)
        swarm_cfg = swarm_config(args) if args.agent_mode == "swarm" else None
        limits = {"max_turns": args.max_turns, "episode_timeout_s": args.episode_timeout_s}
        manifest = {"suite_spec": args.tasks, "agent": args.agent, "model": args.model,
                    "agent_mode": args.agent_mode, "swarm": swarm_manifest(args),
                    "tool_declarations": config.tool_declarations,
                    "task_ids": [t.id for t in tasks], "passes": args.passes,
                    "limits": limits if any(v is not None for v in limits.values()) else None,
                    "sampling": {"temperature": args.temperature, "max_tokens": args.max_tokens},
                    "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        run.check(manifest)  # refuse another run's directory before starting anything
        endpoint = {"model": args.model, **manifest["sampling"]}  # the sampling run.json pins is what the agent gets
        url = None
        if args.agent.startswith("local:"):
            url, stop = serve_local(args.agent[len("local:"):], args.serve_arg)
            factory = endpoint_factory(url, **endpoint)
        else:
            factory = make_factory(args.agent, tasks, suite_ids=[t.id for t in suite], **endpoint)
        if swarm_cfg is not None:
            sub = {"model": args.model, "max_tokens": args.swarm_subagent_tokens_per_turn,
                   "temperature": args.swarm_subagent_temperature}
            if (args.swarm_subagent_policy or "").startswith("local:"):
                sub["serve_args"] = tuple(args.serve_arg)
            swarm = swarm_setup(args.swarm_subagent_policy, tasks, swarm_cfg, agent_url=url,
                                agent_checkpoint=args.agent[len("local:"):] if url else None, **sub)
        passes = run.start(manifest)  # the agent is ready: from here on the directory is this run's
    except (TaskError, AgentError, RunError, ValueError, OSError, RuntimeError) as e:  # RuntimeError: checkpoints
        if stop is not None:
            stop()
        print(f"error: {e}", file=sys.stderr)
        return 2
    from megatron_ext.eval.outputs import publish

    if passes > args.passes:
        print(f"note: --out {args.out} holds {passes} passes per task; --passes {args.passes} runs no new pass and "
              f"the summary keeps all {passes} (a fresh --out evaluates {args.passes})", file=sys.stderr)
    try:
        outcome = run_suite(tasks, factory, run, passes, args.concurrency, config, swarm=swarm,
                            episode_timeout_s=args.episode_timeout_s)
    finally:
        if swarm is not None:
            swarm.close()
        if stop is not None:
            stop()
    summary = publish(run, tasks, passes, prices, counter)
    if summary["accuracy"] is not None:
        low, high = summary["accuracy_ci"]
        eff = summary["efficiency"]
        print(f"accuracy {summary['accuracy']:.3f} [{low:.3f}, {high:.3f}] over {summary['episodes']} episodes "
              f"(statuses: {', '.join(f'{k} {v}' for k, v in sorted(summary['statuses'].items()))}); steps per "
              f"episode {eff['total_steps']:.2f} total, {eff['critical_steps']:.2f} critical; wall-clock "
              f"{eff['wall_s']:.1f} s per episode; report: {os.path.join(args.out, 'report.html')}")
    if outcome["failed"]:
        print(f"{len(outcome['failed'])} episodes could not run (resume to retry): {outcome['failed'][:5]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
