"""RL flags (Megatron-LM's train_rl.py names where the meaning is the same) and their translation into the typed
configs the RL components take; nothing below rl_composer.py reads `args`."""

from __future__ import annotations

import argparse

from megatron_ext.arguments import ArgumentError
from megatron_ext.rl.loss import AGGREGATIONS, IS_MODES, KL_ESTIMATORS, LossConfig
from megatron_ext.rl.rollout import Sampling

RL_ENVS = ("digits", "coding", "swarm")


def add_rl_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("rl", "GRPO as in the Composer 2 recipe (rl_composer.py)")
    g.add_argument("--rl-env", default="digits", choices=RL_ENVS,
                   help="environment family: digits (tools/make_rl_prompts.py prompts) or coding (repository tasks "
                        "of megatron_ext/env, tools/mine_tasks.py; needs --tokenizer-model, takes the --env-* flags) or "
                        "swarm (coding tasks for an orchestrator with sub-agents; also the --swarm-* flags)")
    g.add_argument("--rl-prompts", default=None, help="JSONL prompt file, one task with a unique 'id' per line "
                                                      "(tools/make_rl_prompts.py; coding: a task suite from "
                                                      "tools/mine_tasks.py); each id is trained on once")
    g.add_argument("--rl-new-prompts", action="store_true",
                   help="resume (--load) on a different --rl-prompts file than the checkpoint was trained on: the "
                        "model and optimizer continue, the new file is taken from its first prompt (without this "
                        "flag such a resume is refused, as the saved cursor would skip the new file's prompts)")
    g.add_argument("--rl-log-dir", default=None,
                   help="write trained_groups.jsonl, rollouts.jsonl and eval.jsonl here")
    g.add_argument("--grpo-group-size", type=int, default=8, help="samples per prompt (G)")
    g.add_argument("--grpo-prompts-per-step", type=int, default=8, help="prompts (groups) per RL step")
    g.add_argument("--grpo-iterations", type=int, default=1,
                   help="optimizer steps per batch of rollouts (> 1: PPO clipping against the pre-step policy)")
    g.add_argument("--grpo-max-response-length", type=int, default=16,
                   help="generation budget (model tokens per episode); also L_max of the constant aggregation")
    g.add_argument("--grpo-kl-beta", type=float, default=0.001, help="weight of the KL to the reference (0: none, "
                                                                       "no reference model)")
    g.add_argument("--rl-kl-estimator", default="k1", choices=KL_ESTIMATORS,
                   help="k1 enters the reward (the recipe); k2/k3 enter the loss")
    g.add_argument("--grpo-clamp-eps-lower", type=float, default=0.2, help="PPO ratio clip below 1")
    g.add_argument("--grpo-clamp-eps-upper", type=float, default=0.2, help="PPO ratio clip above 1")
    g.add_argument("--grpo-entropy-term-weight", type=float, default=0.0, help="entropy bonus weight")
    g.add_argument("--rl-loss-aggregation", default="constant", choices=AGGREGATIONS,
                   help="constant: token sums / --grpo-max-response-length (Dr.GRPO); token-mean; sequence-mean")
    g.add_argument("--rl-advantage-std-normalize", action="store_true",
                   help="divide advantages by the group's reward std (GRPO; off in the recipe)")
    g.add_argument("--rl-importance-sampling", default=None, choices=IS_MODES,
                   help="correction to the sampler's log-probabilities: truncated (TIS), IcePop band mask, "
                        "sequence-level truncated (default: tis with --rl-max-staleness > 0, where tokens come "
                        "from older weights; none when rollouts are on-policy)")
    g.add_argument("--rl-importance-sampling-truncation-coef", type=float, default=2.0,
                   help="cap C of the TIS and sequence-level weights")
    g.add_argument("--rl-icepop-band", type=float, nargs=2, default=[0.5, 2.0], metavar=("LOW", "HIGH"),
                   help="IcePop: tokens whose ratio lies outside [LOW, HIGH] leave the gradient")
    g.add_argument("--rl-routing-replay", action="store_true",
                   help="train with the experts the sampler chose (Megatron-Core RouterReplay)")
    g.add_argument("--rl-temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--rl-top-k", type=int, default=0, help="sampling top-k (0: off)")
    g.add_argument("--rl-top-p", type=float, default=1.0, help="sampling top-p")
    g.add_argument("--rl-max-turns", type=int, default=None,
                   help="model turns per episode (default: 1 for digits; coding: the tasks' max_turns)")
    g.add_argument("--rl-reward-weights", default="",
                   help="NAME=W,... weights of the digit reward parts (exact, char_accuracy); coding: "
                        "--env-reward-weights FILE / --env-reward-weight NAME=W")
    g.add_argument("--rl-reference-load", default=None,
                   help="checkpoint of the KL reference policy (default: the --load a run starts from)")
    g.add_argument("--rl-eval-prompts", default=None, help="held-out JSONL prompts, evaluated every "
                                                           "--rl-eval-interval steps")
    g.add_argument("--rl-eval-interval", type=int, default=0, help="steps between held-out evaluations (0: off)")
    g.add_argument("--rl-eval-samples", type=int, default=4, help="samples per held-out prompt (pass@K's K)")
    g.add_argument("--rl-eval-temperature", type=float, default=1.0, help="held-out sampling temperature")
    g.add_argument("--rl-sft-warmup", action="store_true",
                   help="train on the prompts' reference answers instead of sampling (supervised warm-up)")
    s = parser.add_argument_group("rl generation", "how rollouts are decoded")
    s.add_argument("--rl-speculative", action="store_true",
                   help="decode rollouts with MTP speculative decoding: lossless (the policy's own distribution; "
                        "greedy gives the same tokens), logprobs/versions/routing of every token as without it; "
                        "needs --mtp-num-layers >= 1 (the MTP layers keep learning by detached self-distillation); "
                        "the acceptance (accepted / proposed drafts) is logged each step as 'mtp acceptance'")
    s.add_argument("--rl-speculative-depth", type=int, default=None,
                   help="MTP layers drafting with --rl-speculative (default: all of them)")
    s.add_argument("--rl-speculative-policy", choices=("auto", "always"), default=None,
                   help="with --rl-speculative: 'auto' (default) decodes a generation call plainly (the same "
                        "tokens) when drafting is not expected to pay at its batch size: draft, verify and plain "
                        "step costs measured once per batch-size bucket, acceptance observed since the step began, "
                        "the decision logged when it changes; 'always' drafts in every call")
    s.add_argument("--rl-remote-servers", nargs="+", default=None, metavar="URL",
                   help="generate on these SGLang-native inference servers (tools/serve.py, or SGLang with "
                        "--enable-return-routed-experts) instead of the trainer's ranks; token ids in and out, "
                        "requests spread over the servers; after every step the weights are published to "
                        "--rl-remote-weights-dir and each server reloads them (POST /update_weights_from_disk)")
    s.add_argument("--rl-remote-weights-dir", default=None,
                   help="directory every server can read (shared storage): each step's weights go to "
                        "DIR/v<version> as a weights-only checkpoint; older versions are removed. With "
                        "--rl-rollout-workers (needed at TP/EP > 1) the Ray workers load each version from there "
                        "instead of the object store")
    a = parser.add_argument_group("rl-async", "asynchronous RL: generation on Ray rollout workers (orchestrator.py)")
    a.add_argument("--rl-rollout-workers", type=int, default=0,
                   help="rollout worker processes (Ray actors, each an inference engine replica plus environments); "
                        "with --rl-remote-servers: request slots spread over the servers (asynchronous over them, "
                        "environments on rank 0's threads, no Ray); 0: generate colocated on the trainer's ranks "
                        "(or synchronously on the remote servers)")
    a.add_argument("--rl-max-staleness", type=int, default=0,
                   help="admission control: a prompt does not start while the step that will train it is more than "
                        "this many weight versions ahead of the newest published (0: synchronous)")
    a.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (`ray start --head` prints it; 'auto' finds a local one); default: "
                        "start a local Ray instance inside the run")
    a.add_argument("--rl-prompts-per-request", type=int, default=0,
                   help="prompts a worker generates in one engine batch (0: prompts per step / (2 x workers))")
    a.add_argument("--rl-requests-per-worker", type=int, default=2,
                   help="requests dispatched and not finished per worker. A Ray worker runs them one after "
                        "another: 2 keeps the next one queued (no gap while the trainer trains), 1 binds each prompt "
                        "to the first free worker (none waits behind a long rollout: better under long-tailed "
                        "lengths). With --rl-remote-servers a slot's requests run together in its server's batch, "
                        "so more means more concurrency (benchmarks/rl_async_sim.py, docs/benchmarks.md)")
    a.add_argument("--rl-worker-concurrency", type=int, default=1,
                   help="requests a Ray rollout worker runs at once, their turns decoded together in one engine "
                        "batch (the rest of --rl-requests-per-worker wait in its queue). 1: one after another. "
                        "More keeps the engine's batch full while one request's long tail finishes "
                        "(docs/benchmarks.md, issue 29)")
    a.add_argument("--rl-continuous-batching", action="store_true",
                   help="a Ray rollout worker decodes its running requests' turns in one continuous batch: a turn "
                        "joins the decode batch at the next step and returns as soon as its own rows finish, "
                        "instead of static per-turn batches that end with their longest row (docs/rl-worker-"
                        "batching.md). It pays with --rl-worker-concurrency > 1")
    a.add_argument("--rl-prefix-cache-mb", type=float, default=1024.0,
                   help="multi-turn episodes: MB of finished turns' latent caches the local engine keeps, so that "
                        "an episode's next turn prefills only its new tokens (the sampled turn's last token and the "
                        "tool output) instead of the whole conversation again (the same tokens and log-"
                        "probabilities; docs/benchmarks.md, session 33); oldest dropped first; 0: off. Not used "
                        "with --rl-speculative or for Kimi Linear hybrids")
    a.add_argument("--rl-rollout-timeout", type=float, default=600.0,
                   help="seconds a worker may work on one request before it is killed, replaced and its prompts "
                        "requeued")
    a.add_argument("--rl-env-timeout", type=float, default=300.0,
                   help="seconds an environment call (step, score) may take; a hung one ends its episode with an "
                        "error reward (0: no limit)")
    a.add_argument("--rl-publish-full", action="store_true",
                   help="publish every tensor each step (default: only the tensors that changed, when fewer bytes)")


def validate_rl_args(args: argparse.Namespace):
    def fail(msg):
        raise ArgumentError(msg)

    if not args.rl_prompts and not args.dry_run:
        fail("rl_composer.py needs --rl-prompts FILE (tools/make_rl_prompts.py writes one)")
    for flag in ("grpo_group_size", "grpo_prompts_per_step", "grpo_iterations", "grpo_max_response_length",
                 "rl_max_turns", "rl_eval_samples"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.grpo_group_size is not None and args.grpo_group_size < 2 and not args.rl_sft_warmup:
        fail(f"--grpo-group-size {args.grpo_group_size}: GRPO's advantages are rewards minus the group's mean, so a "
             "group of one sample has advantage 0 and trains nothing; use --grpo-group-size >= 2 (1 only with "
             "--rl-sft-warmup)")
    if args.grpo_kl_beta < 0:
        fail("--grpo-kl-beta must be >= 0")
    if args.rl_remote_servers and not args.rl_remote_weights_dir:
        fail("--rl-remote-servers needs --rl-remote-weights-dir DIR (a directory the servers can read) to publish "
             "each step's weights")
    if args.rl_remote_weights_dir and not args.rl_remote_servers and not args.rl_rollout_workers:
        fail("--rl-remote-weights-dir is only used with --rl-remote-servers URL [URL ...] or --rl-rollout-workers N")
    bad = [u for u in args.rl_remote_servers or () if not u.startswith(("http://", "https://"))]
    if bad:
        fail(f"--rl-remote-servers takes http(s):// URLs, got {bad}")
    if (args.pipeline_model_parallel_size > 1 or args.context_parallel_size > 1) and not args.rl_remote_servers:
        fail("colocated generation runs the inference engine on every rank's model, which needs "
             "--pipeline-model-parallel-size 1 and --context-parallel-size 1 (the RL training step itself supports "
             "PP/CP; or generate on --rl-remote-servers)")
    if args.rl_importance_sampling == "sequence" and args.context_parallel_size > 1:
        fail("--rl-importance-sampling sequence needs whole samples on a rank: --context-parallel-size 1")
    if args.rl_routing_replay and not args.arch.num_experts:
        fail("--rl-routing-replay needs an MoE model (--num-experts > 0)")
    if args.rl_eval_interval and not args.rl_eval_prompts:
        fail("--rl-eval-interval needs --rl-eval-prompts FILE")
    if args.rl_env in ("coding", "swarm"):
        if args.rl_sft_warmup:
            fail("--rl-sft-warmup needs reference answers as tokens; the coding environment has none (its tasks carry "
                 "a reference diff, not a transcript): drop --rl-sft-warmup or use --rl-env digits")
        if args.rl_reward_weights:
            fail(f"--rl-reward-weights names digit reward parts; for --rl-env {args.rl_env} use "
                 "--env-reward-weights FILE or --env-reward-weight NAME=W")
    mtp = args.arch.mtp_num_layers or 0
    if args.rl_speculative and not mtp:
        fail("--rl-speculative drafts with the MTP layers: the model needs --mtp-num-layers >= 1")
    if args.rl_prefix_cache_mb < 0:
        fail(f"--rl-prefix-cache-mb is a size in MB (0: off), got {args.rl_prefix_cache_mb:g}")
    if args.rl_speculative_policy is not None and not args.rl_speculative:
        fail("--rl-speculative-policy needs --rl-speculative")
    if args.rl_speculative_policy is not None and args.rl_remote_servers:
        fail("--rl-speculative-policy applies to rollouts generated here; remote servers decide for themselves "
             "(tools/serve.py --speculation auto|always)")
    if args.rl_speculative_depth is not None:
        if not args.rl_speculative:
            fail("--rl-speculative-depth needs --rl-speculative")
        if not 1 <= args.rl_speculative_depth <= mtp:
            fail(f"--rl-speculative-depth must be between 1 and --mtp-num-layers ({mtp}), got "
                 f"{args.rl_speculative_depth}")
    if args.rl_rollout_workers < 0 or args.rl_max_staleness < 0 or args.rl_prompts_per_request < 0:
        fail("--rl-rollout-workers, --rl-max-staleness and --rl-prompts-per-request must be >= 0")
    if args.rl_requests_per_worker < 1:
        fail(f"--rl-requests-per-worker must be >= 1, got {args.rl_requests_per_worker}")
    if not 1 <= args.rl_worker_concurrency <= args.rl_requests_per_worker:
        fail(f"--rl-worker-concurrency {args.rl_worker_concurrency} must be between 1 and --rl-requests-per-worker "
             f"({args.rl_requests_per_worker}): a worker cannot run more requests than it is given")
    if args.rl_worker_concurrency > 1 and (args.rl_remote_servers or not args.rl_rollout_workers):
        fail("--rl-worker-concurrency applies to Ray rollout workers (--rl-rollout-workers without "
             "--rl-remote-servers; a remote server batches a slot's requests itself: raise --rl-requests-per-worker)")
    if args.rl_continuous_batching:
        if args.rl_remote_servers or not args.rl_rollout_workers:
            fail("--rl-continuous-batching applies to Ray rollout workers (--rl-rollout-workers without "
                 "--rl-remote-servers; a remote server batches continuously itself)")
        if args.rl_speculative:
            fail("--rl-continuous-batching decodes without MTP speculation: drop --rl-speculative or "
                 "--rl-continuous-batching")
    if args.rl_rollout_workers:
        if args.rl_sft_warmup:
            fail("--rl-sft-warmup trains on reference answers, nothing to generate: drop --rl-rollout-workers")
        if args.rl_remote_servers:  # the asynchronous fleet over the servers (remote_fleet.py): no Ray
            if args.rl_rollout_workers < len(args.rl_remote_servers):
                fail(f"--rl-rollout-workers {args.rl_rollout_workers} with {len(args.rl_remote_servers)} "
                     "--rl-remote-servers: give at least one request slot per server (e.g. --rl-rollout-workers "
                     f"{2 * len(args.rl_remote_servers)})")
            if args.ray_address:
                fail("--ray-address is unused with --rl-remote-servers: the servers generate and the environments "
                     "run on rank 0's threads; drop --ray-address")
        elif (args.tensor_model_parallel_size > 1 or args.expert_model_parallel_size > 1) and \
                not args.rl_remote_weights_dir:
            fail("--rl-rollout-workers with --tensor-model-parallel-size / --expert-model-parallel-size > 1: no rank "
                 "holds the full weights, so each step's are published as a checkpoint the workers load and "
                 "reshard: add --rl-remote-weights-dir DIR (storage the workers can read)")
    elif args.ray_address or args.rl_max_staleness:
        fail("--ray-address and --rl-max-staleness apply to rollout workers: add --rl-rollout-workers N")
    if args.rl_temperature <= 0:
        fail("--rl-temperature must be positive: RL samples; greedy decoding gives every group one answer")
    if (args.rl_top_k or args.rl_top_p < 1.0) and not args.rl_sft_warmup:
        fail(f"--rl-top-k {args.rl_top_k} / --rl-top-p {args.rl_top_p}: a truncated sampling distribution gives "
             "the excluded tokens no probability, so the trainer's log-probabilities (and the importance ratio and "
             "KL) would not be the sampler's; train with --rl-top-k 0 --rl-top-p 1 (--rl-temperature is supported: "
             "the trainer divides its logits by it)")


def loss_config(args: argparse.Namespace) -> LossConfig:
    try:
        return LossConfig(kl_beta=args.grpo_kl_beta, kl_estimator=args.rl_kl_estimator,
                          clamp_eps_lower=args.grpo_clamp_eps_lower, clamp_eps_upper=args.grpo_clamp_eps_upper,
                          importance_sampling=importance_sampling(args),
                          is_truncation_coef=args.rl_importance_sampling_truncation_coef,
                          icepop_low=args.rl_icepop_band[0], icepop_high=args.rl_icepop_band[1],
                          entropy_weight=args.grpo_entropy_term_weight)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def importance_sampling(args: argparse.Namespace) -> str:
    """--rl-importance-sampling, or its default: TIS when samples may be stale (docs/design-notes.md, issue 24)."""
    if args.rl_importance_sampling is not None:
        return args.rl_importance_sampling
    return "tis" if args.rl_max_staleness > 0 else "none"


def fleet_config(args: argparse.Namespace):
    from megatron_ext.rl.workers import FleetConfig

    if not args.rl_rollout_workers:
        return None
    return FleetConfig(workers=args.rl_rollout_workers, max_staleness=args.rl_max_staleness,
                       ray_address=args.ray_address, prompts_per_request=args.rl_prompts_per_request,
                       requests_per_worker=args.rl_requests_per_worker, concurrency=args.rl_worker_concurrency,
                       continuous_batching=args.rl_continuous_batching,
                       request_timeout_s=args.rl_rollout_timeout, env_timeout_s=args.rl_env_timeout,
                       delta=not args.rl_publish_full)


def sampling_config(args: argparse.Namespace, stop_token_ids: tuple[int, ...]) -> Sampling:
    return Sampling(max_tokens=args.grpo_max_response_length, temperature=args.rl_temperature, top_k=args.rl_top_k,
                    top_p=args.rl_top_p, stop_token_ids=stop_token_ids, return_routing=args.rl_routing_replay)
