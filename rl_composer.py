"""Reinforcement learning (the Composer 2 GRPO variant) on Megatron-Core, rollouts colocated with training.

    python tools/make_rl_prompts.py --out data/rl
    # supervised warm-up on the reference answers, then RL from it
    python rl_composer.py --model tiny --vocab-size 32 --rl-prompts data/rl/train.jsonl --rl-sft-warmup \
        --train-iters 150 --lr 3e-3 --save ckpt/sft
    torchrun --nproc-per-node 2 rl_composer.py --model tiny --vocab-size 32 --load ckpt/sft --save ckpt/rl \
        --rl-prompts data/rl/train.jsonl --rl-eval-prompts data/rl/heldout.jsonl --rl-eval-interval 5 \
        --rl-log-dir logs/rl --train-iters 40
    # the agentic coding environment: repository tasks mined by tools/mine_tasks.py, graded in a sandbox
    python rl_composer.py --rl-env coding --rl-prompts tasks/tasks.jsonl --tokenizer-model TOKENIZER \
        --load ckpt/sft --finetune --grpo-max-response-length 4096 --seq-length 16384 --env-reward-weights weights.json
    # an agent swarm: the trained orchestrator delegates to frozen sub-agents (PARL, megatron_ext/env/swarm.py)
    python rl_composer.py --rl-env swarm --swarm-subagent-policy endpoint:http://HOST:PORT ... (coding flags)

    # asynchronous: generation on 2 Ray rollout workers (a local Ray instance; --ray-address joins a cluster),
    # samples at most one weight version behind the trainer, weights published to the workers every step
    torchrun --nproc-per-node 1 rl_composer.py --model tiny --vocab-size 32 --load ckpt/sft --save ckpt/rl \
        --rl-prompts data/rl/train.jsonl --rl-rollout-workers 2 --rl-max-staleness 1 --train-iters 40

Each prompt id of --rl-prompts is trained on exactly once, across kills and resumes (--rl-log-dir
trained_groups.jsonl). Flags: `python rl_composer.py --help`, group "rl".
"""

from __future__ import annotations

import sys

import torch

import megatron_ext  # noqa: F401  (installs the CPU bridges before Megatron-Core is used)
from megatron_ext.arguments import ArgumentError, parse_args
from megatron_ext.env.arguments import add_env_args, add_swarm_args, checkpoint_agent_prompt
from megatron_ext.models.provider import print_parameter_counts
from megatron_ext.rl.arguments import add_rl_args, fleet_config, loss_config, sampling_config, validate_rl_args
from megatron_ext.rl.env import (DEFAULT_DIGIT_WEIGHTS, DIGIT_REWARDS, VOCAB, DigitEnv, Rubric, parse_weights,
                                 prompt_tokens, read_prompts)
from megatron_ext.rl.coding import coding_data_provider
from megatron_ext.rl.orchestrator import WorkerFailure
from megatron_ext.rl.swarm import swarm_data_provider
from megatron_ext.rl.trainer import RLConfig, RLTrainer
from megatron_ext.training.checkpointing import CheckpointError, read_tracker
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.loop import TrainingAborted


def data_provider(args):
    """Tasks (prompt file, held-out file) and the environment factory of the --rl-env family."""
    if args.rl_env == "coding":
        return coding_data_provider(args)
    if args.rl_env == "swarm":
        return swarm_data_provider(args)
    tasks = read_prompts(args.rl_prompts)
    eval_tasks = read_prompts(args.rl_eval_prompts, "--rl-eval-prompts") if args.rl_eval_prompts else []
    longest = max(tasks + eval_tasks, key=lambda t: len(prompt_tokens(t)))
    need = len(prompt_tokens(longest)) + args.grpo_max_response_length
    if need > args.seq_length:
        raise ArgumentError(f"task {longest['id']}: its prompt ({len(prompt_tokens(longest))} tokens) and "
                            f"--grpo-max-response-length {args.grpo_max_response_length} need {need} positions, more "
                            f"than --seq-length {args.seq_length}: raise --seq-length or lower "
                            "--grpo-max-response-length")
    try:
        weights = {**DEFAULT_DIGIT_WEIGHTS, **parse_weights(args.rl_reward_weights)}
        rubric = Rubric(DIGIT_REWARDS, weights)
    except ValueError as e:
        raise ArgumentError(f"--rl-reward-weights: {e}") from None
    return tasks, eval_tasks, lambda: DigitEnv(rubric)


def rl_config(args, tasks, eval_tasks, make_env) -> RLConfig:
    if args.rl_env in ("coding", "swarm"):
        stop, turns = make_env.stop_token_ids, max(t["max_turns"] for t in tasks + eval_tasks)
    else:
        stop, turns = (VOCAB.eos,), 1
    return RLConfig(group_size=1 if args.rl_sft_warmup else args.grpo_group_size,
                    prompts_per_step=args.grpo_prompts_per_step, iterations=args.grpo_iterations,
                    max_response_length=args.grpo_max_response_length,
                    aggregation="token-mean" if args.rl_sft_warmup else args.rl_loss_aggregation,
                    std_normalize=args.rl_advantage_std_normalize, loss=loss_config(args),
                    sampling=sampling_config(args, stop), max_turns=args.rl_max_turns or turns,
                    routing_replay=args.rl_routing_replay, log_dir=args.rl_log_dir,
                    reference_load=args.rl_reference_load, eval_tasks=eval_tasks,
                    eval_interval=args.rl_eval_interval, eval_samples=args.rl_eval_samples,
                    eval_temperature=args.rl_eval_temperature, sft_warmup=args.rl_sft_warmup,
                    speculative=args.rl_speculative, speculative_depth=args.rl_speculative_depth,
                    speculative_policy=args.rl_speculative_policy or "auto",
                    prefix_cache_mb=args.rl_prefix_cache_mb,
                    remote_servers=args.rl_remote_servers or [], remote_weights_dir=args.rl_remote_weights_dir,
                    fleet=fleet_config(args), new_prompts=args.rl_new_prompts)


def main(argv=None):
    try:
        args = parse_args(argv, description=__doc__, extra=[add_rl_args, add_env_args, add_swarm_args])
        validate_rl_args(args)
        if args.dry_run:
            print_parameter_counts(args)
            return 0
        if args.rl_env == "digits" and args.padded_vocab_size < len(VOCAB):
            raise ArgumentError(f"--vocab-size {args.vocab_size} is smaller than the digit tasks' {len(VOCAB)} tokens")
        if args.arch.mtp_num_layers:
            args.mtp_detach_trunk = True  # the recipe: MTP learns by self-distillation, never moves the policy
        if args.load and args.rl_env in ("coding", "swarm") and read_tracker(args.load) is not None:
            checkpoint_agent_prompt(args, args.load, "rl_composer.py --load")
        tasks, eval_tasks, make_env = data_provider(args)
        cfg = rl_config(args, tasks, eval_tasks, make_env)
    except (ArgumentError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    initialize_distributed(args)
    log = print if torch.distributed.get_rank() == 0 else (lambda *a, **k: None)
    print_parameter_counts(args, log)
    try:
        backend = None
        if cfg.fleet is not None:  # each worker builds the trainer's model with the same provider, one process
            from megatron_ext.rl.workers import EngineBackendFactory, worker_model_args

            backend = EngineBackendFactory(worker_model_args(args), cfg.speculative, cfg.speculative_depth,
                                           cfg.speculative_policy,
                                           cfg.prefix_cache_mb if cfg.max_turns > 1 else 0)
        trainer = RLTrainer(args, cfg, tasks, make_env, log=log, backend_factory=backend)
        if hasattr(make_env, "attach"):  # the swarm's pinned sub-agent policy copies the trainer's weights
            make_env.attach(trainer)
        trainer.train()
    except (TrainingAborted, CheckpointError, WorkerFailure) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        destroy()
        return 1
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
