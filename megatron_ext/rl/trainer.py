"""The colocated RL loop: generate -> score -> reference -> train -> publish weights, each prompt once.

    ledger --admit P prompts--> generate (engine replicas, G samples each) --> environments score --> groups
      --> all ranks hold every group --> [reference pass: k1 into the reward] --> advantages
      --> this DP rank's groups packed into THD micro-batches --> train_step (GRPO loss) x --grpo-iterations
      --> weights version + 1 (the engine runs on the trainer's own parameters) --> trained_groups.jsonl
      --> checkpoint (model, optimizer, RNG and the ledger in one atomic publish)

Generation replicas are the ranks that cooperate on one request (a tensor- and expert-parallel group); groups are
dealt to replicas round-robin and to data-parallel ranks for training the same way. Everything else (schedules,
optimizer, clipping, NaN skipping, checkpoints) is the pretraining step's (training/step.py, checkpointing.py).
With `RLConfig.fleet` (--rl-rollout-workers N) generation runs on Ray rollout workers instead: rank 0's
orchestrator (orchestrator.py) hands each step the groups of its slot, generated while earlier steps trained, with
staleness bounded by admission control; the weights of every step are published to the workers (workers.py).
The loss, batches and accounting are the same.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megatron_ext import platform
from megatron_ext.mtp import distill
from megatron_ext.rl import forward as rl_forward
from megatron_ext.rl.advantage import is_zero_advantage
from megatron_ext.rl.batch import micro_batches, rows_needed
from megatron_ext.rl.env import Environment
from megatron_ext.rl.ledger import EVAL, Ledger
from megatron_ext.rl.loss import LossConfig, aggregation_weights
from megatron_ext.rl.prompt_identity import prompt_file_change, prompt_identity
from megatron_ext.rl.rollout import EpisodeConfig, GenerateFn, Sampling, reference_groups, run_groups
from megatron_ext.rl.types import Group, TrainingSample
from megatron_ext.training import checkpointing
from megatron_ext.training.checkpointing import load_checkpoint, load_weights, read_tracker, save_checkpoint
from megatron_ext.training.loop import SigtermWatcher, TrainingAborted, TrainingLogger, inject_nan, print_args
from megatron_ext.training.step import build_model, build_scheduler, run_schedule, setup_model_and_optimizer, \
    train_step
from megatron_ext.rl.workers import FleetConfig


@dataclass
class RLConfig:
    group_size: int
    prompts_per_step: int
    iterations: int
    max_response_length: int
    aggregation: str
    std_normalize: bool
    loss: LossConfig
    sampling: Sampling
    max_turns: int = 1
    routing_replay: bool = False
    log_dir: Optional[str] = None
    reference_load: Optional[str] = None
    eval_tasks: list = field(default_factory=list)
    eval_interval: int = 0
    eval_samples: int = 4
    eval_temperature: float = 1.0
    sft_warmup: bool = False
    fleet: Optional["FleetConfig"] = None  # generation on Ray rollout workers (asynchronous); None: colocated
    speculative: bool = False  # MTP speculative decoding of rollouts (lossless); acceptance logged per step
    speculative_depth: Optional[int] = None  # MTP layers drafting (None: all)
    speculative_policy: str = "always"  # "auto": a batch not expected to gain from drafting decodes plainly
    prefix_cache_mb: float = 0  # multi-turn episodes: finished turns' caches kept for the next turn (0: off)
    remote_servers: list = field(default_factory=list)  # SGLang-native servers generating instead of the ranks
    remote_weights_dir: Optional[str] = None  # where each step's weights go for the servers to reload
    new_prompts: bool = False  # resume on a different prompt file: its cursor starts at 0 (--rl-new-prompts)


def _replica_ranks() -> tuple[int, int]:
    """(this rank's generation replica, number of replicas): ranks of one TP x EP block run the same request."""
    ranks = set(dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()))
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        ranks |= set(dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()))
    leader = min(ranks)
    leaders = [None] * dist.get_world_size()
    dist.all_gather_object(leaders, leader)
    order = sorted(set(leaders))
    return order.index(leader), len(order)


def generate_groups(tasks: list[dict], make_env, generate: GenerateFn, cfg: EpisodeConfig, std_normalize: bool,
                    seed: int, per_rank: bool = False) -> list[Group]:
    """Every task's group, on every rank: each replica generates its share (tasks i with i % R == replica); with
    `per_rank` (remote servers generate: no engine replicas) every rank is a replica of its own."""
    replica, replicas = (dist.get_rank(), dist.get_world_size()) if per_rank else _replica_ranks()
    mine = [t for i, t in enumerate(tasks) if i % replicas == replica]
    sampling = Sampling(**{**vars(cfg.sampling), "seed": seed + 100_003 * replica})
    local = run_groups(mine, make_env, generate, EpisodeConfig(cfg.group_size, sampling, cfg.max_turns,
                                                                cfg.max_response_length), std_normalize) if mine else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (replica, local))
    by_id = {}
    for _, groups in gathered:
        for g in groups:
            by_id.setdefault(g.prompt_id, g)
    return [by_id[t["id"]] for t in tasks]


def _cleanup_trackers():
    """Forward-only passes leave MoE/MTP loss trackers filled; the training step's logging must not see them."""
    clear_aux_losses_tracker()
    if "values" in MTPLossLoggingHelper.tracker:
        MTPLossLoggingHelper.clean_loss_in_tracker()
    distill.pop_metrics(1)


def logprob_pass(model, mbs: list[dict], args, routing_replay: bool,
                 temperature: float = 1.0) -> list[Optional[torch.Tensor]]:
    """Per micro-batch, this rank's label log-probabilities [1, T_local] under the sampling temperature (None off
    the last pipeline stage)."""
    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        out = run_schedule(partial(rl_forward.logprob_forward_step, routing_replay=routing_replay,
                                    temperature=temperature), iter(mbs),
                            model, args, len(mbs), forward_only=True)
    for chunk in model:
        chunk.train()
    _cleanup_trackers()
    if not parallel_state.is_pipeline_last_stage():
        return [None] * len(mbs)
    return [o["logprobs"] for o in out]


def reference_logprobs(reference, mbs: list[dict], args, temperature: float = 1.0) -> list[Optional[torch.Tensor]]:
    """log p_ref under the reference model's own routing, never the sampler's replayed experts: the KL penalty is
    to the reference policy, and an MoE policy's distribution includes its router's choices; replaying the
    sampler's experts would score the tokens with a mixture of the two models (docs/design-notes.md, issue 24)."""
    return logprob_pass([reference], mbs, args, routing_replay=False, temperature=temperature)


def k1_sums(mbs: list[dict], ref: list[Optional[torch.Tensor]], num_samples: int) -> np.ndarray:
    """Sum over each sample's model tokens of k1 = log p_sampler - log p_ref, every rank the same."""
    # on the process group's device (NCCL takes no host tensors); padding (id -1) adds 0 to sample 0, without a
    # data-dependent boolean index (a host sync)
    total = torch.zeros(num_samples, dtype=torch.float64, device=platform.device())
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        for mb, lp in zip(mbs, ref):
            batch, _, _, _ = rl_forward.local_batch(mb)
            ids, mask = batch["sample_ids"].view(-1), batch["loss_mask"].view(-1)
            k1 = (batch["sampler_logprobs"].view(-1).double() - lp.view(-1).double().to(ids.device)) * mask
            total.index_add_(0, ids.clamp(min=0).to(total.device), (k1 * (ids >= 0)).to(total.device))
    dist.all_reduce(total)  # data-parallel ranks hold different samples, CP ranks different tokens
    return total.cpu().numpy()


def group_metrics(groups: list[Group]) -> dict[str, float]:
    """Step metrics; rewards and their parts per episode (a self-summarisation chain counts once)."""
    rewards = np.concatenate([g.episode_rewards() for g in groups])
    firsts = [r for g in groups for r in g.rollouts if r.sequence_index == 0]
    adv = np.array([a for g in groups for a in g.advantages])
    lengths = np.array([r.response_length for g in groups for r in g.rollouts])
    out = {"reward mean": float(rewards.mean()), "reward std": float(rewards.std()),
           "zero-advantage groups": float(np.mean([is_zero_advantage(g.rewards) for g in groups])),
           "advantage mean": float(adv.mean()), "advantage abs mean": float(np.abs(adv).mean()),
           "response length mean": float(lengths.mean()), "response length max": float(lengths.max()),
           "truncation rate": float(np.mean([r.finish_reason == "length" for g in groups for r in g.rollouts])),
           "reward errors": float(np.mean([r.reward.error is not None for r in firsts])),
           "sequences per episode": sum(len(g.rollouts) for g in groups) / len(firsts)}
    parts = sorted({k for r in firsts for k in r.reward.parts})
    for name in parts:
        out[f"reward {name}"] = float(np.mean([r.reward.parts.get(name, 0.0) for r in firsts]))
    return out


def resume_own_save(args: argparse.Namespace) -> str:
    """Where this run starts, decided before anything loads, and the log line saying it.

    A run whose --save already holds a checkpoint resumes from it, whatever --load and --finetune say: a SLURM
    requeue reruns the same command, and the run's own checkpoint carries the optimizer, schedule, RNG, ledger
    and the reference policy's source (the --load it first started from). Otherwise the run starts from --load
    (weights only with --finetune) or from initialisation."""
    saved = read_tracker(args.save) if args.save else None
    if saved is not None:
        first = args.load
        args.load, args.finetune = args.save, False
        args.mtp_attach = False  # MTP layers attached at the run's start are in its own checkpoints
        same = first is not None and os.path.abspath(first) == os.path.abspath(args.save)
        start = "" if same else f"; --load {first} is not read (the run's checkpoint names its reference policy)" \
            if first else ""
        return f"RL: resuming this run from its own --save {args.save} (iteration {saved}){start}"
    if args.load:
        what = "weights only, iteration 0" if args.finetune else "weights, optimizer and iteration"
        where = f"; nothing under --save {args.save} yet" if args.save else ""
        return f"RL: starting from --load {args.load} ({what}){where}"
    return "RL: starting from the initialised model (no --load, nothing under --save)"


class RLTrainer:
    def __init__(self, args: argparse.Namespace, cfg: RLConfig, tasks: list[dict], make_env: Callable[[], Environment],
                 generate: Optional[GenerateFn] = None, log=print, backend_factory=None):
        self.args, self.cfg, self.tasks, self.make_env, self.log = args, cfg, tasks, make_env, log
        self.by_id = {t["id"]: t for t in tasks}
        self.temperature = 1.0 if cfg.sft_warmup else cfg.sampling.temperature
        self.rank = dist.get_rank()
        self.model, self.optimizer = setup_model_and_optimizer(args)
        self.scheduler = build_scheduler(args, self.optimizer)
        self.ledger = Ledger([t["id"] for t in tasks], cfg.log_dir, writer=self.rank == 0)
        self.reference = None
        if cfg.loss.kl_beta:
            self.reference = build_model(args, wrap_ddp=False)[0]
            self._copy_weights(self.model, self.reference)  # the initial policy, unless loaded below
        self.iteration, self.reference_source = 0, "init"
        self.consumed_samples = 0  # trained sequences (groups x samples), what the log line counts
        log(resume_own_save(args), flush=True)
        if args.load:
            self.iteration, common = load_checkpoint(args, self.model, self.optimizer, self.scheduler, log=log)
            state = common.get("rl_state")
            if state is not None and self.iteration > 0:
                self.reference_source = state.get("reference", "init")
                self.consumed_samples = int(state.get("consumed_samples", 0))
                if not self._prompts_changed(state):  # else --rl-new-prompts: the new file from its first prompt
                    self.ledger.load_state_dict(state)
                log(f"RL state: cursor {self.ledger.cursor}/{len(tasks)}, {len(self.ledger.in_flight)} prompts in "
                    f"flight, {len(self.ledger.pending)} finished groups pending")
            elif common:  # a run starting from a (pretrained / SFT) checkpoint: that is the reference
                self.reference_source = args.load
        if self.rank == 0:  # also at iteration 0: a run killed before its first checkpoint left lines behind
            dropped = self.ledger.reconcile(self.iteration)
            if any(dropped.values()):
                log(f"RL logs: removed the lines of steps after iteration {self.iteration} (not in the checkpoint "
                    "resumed from): " + ", ".join(f"{n} {k}" for k, n in dropped.items() if n), flush=True)
        if cfg.reference_load:
            self.reference_source = cfg.reference_load
        if self.reference is not None:
            if self.reference_source != "init":
                load_weights(args, [self.reference], self.reference_source, log=log)
            for p in self.reference.parameters():
                p.requires_grad_(False)
        self.generate = generate
        self.engine = None
        if generate is None and cfg.remote_servers:
            from megatron_ext.rl.remote import RemoteGenerate

            self.generate = RemoteGenerate(cfg.remote_servers, speculative=cfg.speculative, failover=True)
            self._publish_remote()  # the servers start from the trainer's weights and version
        elif generate is None:
            from megatron_ext.inference.engine import InferenceEngine
            from megatron_ext.rl.rollout import EngineGenerate

            self.engine = InferenceEngine(self.model[0], weights_version=self.iteration)
            self.generate = EngineGenerate(self.engine, speculative=cfg.speculative,
                                           draft_depth=cfg.speculative_depth,
                                           speculation_policy=cfg.speculative_policy)
            if cfg.max_turns > 1 and not cfg.speculative:  # a turn continues the last one's cache
                self.engine.enable_prefix_store(cfg.prefix_cache_mb)
        self.orchestrator = self.fleet = None
        if cfg.fleet is not None:
            if self._fleet_by_path() and not cfg.remote_servers:  # Ray workers' first weights: DIR/v<iteration>
                self._publish_remote(reload=lambda path: None)
            self._start_fleet(cfg.fleet, backend_factory)
        dp = parallel_state.get_data_parallel_world_size()
        cp = parallel_state.get_context_parallel_world_size()
        self.pad_multiple = 2 * cp if cp > 1 else 1
        self.dp, self.dp_rank, self.cp = dp, parallel_state.get_data_parallel_rank(), cp

    def _prompts_changed(self, state: dict) -> bool:
        """Whether --rl-prompts is not the file the checkpoint's cursor counts into; refused unless
        --rl-new-prompts."""
        change = prompt_file_change(state.get("prompts"), prompt_identity(self.tasks))
        if change is None:
            return False
        if not self.cfg.new_prompts:
            raise checkpointing.CheckpointError(
                f"--rl-prompts is not the prompt file {self.args.load} was trained on: {change}. Its cursor "
                f"({state.get('cursor')} prompts taken) would skip prompts of this file. Resume with the same file, "
                "or pass --rl-new-prompts to continue the model on this file from its first prompt")
        self.log(f"--rl-new-prompts: --rl-prompts differs from the checkpoint's ({change}); its cursor, prompts in "
                 "flight and untrained groups are dropped, this file starts at its first prompt")
        return True

    def _start_fleet(self, fc: FleetConfig, backend_factory):
        """Rank 0: Ray (local or --ray-address), the rollout workers and the orchestrator."""
        from megatron_ext.inference.engine import model_weights
        from megatron_ext.rl.orchestrator import Orchestrator, OrchestratorConfig
        from megatron_ext.rl.workers import RayFleet, WorkerConfig, start_ray

        cfg = self.cfg
        if self.rank != 0:
            return
        episode = EpisodeConfig(cfg.group_size, cfg.sampling, cfg.max_turns, cfg.max_response_length)
        wcfg = WorkerConfig(episode, cfg.std_normalize, fc.env_timeout_s, continuous_batching=fc.continuous_batching)
        if cfg.remote_servers:  # request slots on the servers; the weights travel as DIR/v<version> (publish_weights)
            from megatron_ext.rl.remote_fleet import RemoteFleet

            weights = dict  # the servers reload by path: the orchestrator never hands tensors over
            self.fleet = RemoteFleet(cfg.remote_servers, fc.workers, wcfg, self.make_env, self._remote_path,
                                     speculative=cfg.speculative, log=self.log)
        else:
            start_ray(fc.ray_address, num_cpus=max(2, fc.workers + 1), log=self.log)
            weights = partial(model_weights, self.model[0])
            self.fleet = RayFleet(fc.workers, wcfg, backend_factory, self.make_env, self.iteration, weights,
                                  delta=fc.delta, num_gpus=1.0 if torch.cuda.is_available() else 0.0, log=self.log,
                                  path_of=self._remote_path if self._fleet_by_path() else None,
                                  concurrency=fc.concurrency)
        ocfg = OrchestratorConfig(cfg.prompts_per_step, fc.max_staleness, fc.per_request(cfg.prompts_per_step),
                                  requests_per_worker=fc.requests_per_worker,
                                  request_timeout_s=fc.request_timeout_s, seed=self.args.seed)
        self.orchestrator = Orchestrator(ocfg, self.fleet, self.ledger, self.by_id, self.iteration, weights,
                                         log=self.log)
        where = f" over {len(cfg.remote_servers)} remote server(s)" if cfg.remote_servers else ""
        if fc.concurrency > 1 or fc.continuous_batching:
            where += (f", up to {fc.concurrency} request(s) at once per worker in "
                      f"{'one continuous' if fc.continuous_batching else 'static per-turn'} decode batch(es)")
        self.log(f"asynchronous RL: {fc.workers} rollout workers{where}, --rl-max-staleness {fc.max_staleness}, "
                 f"{ocfg.prompts_per_request} prompt(s) per request, importance correction of stale tokens: "
                 f"{cfg.loss.importance_sampling} (--rl-importance-sampling)", flush=True)

    def _fleet_batch(self):
        """The orchestrator's groups for this step (rank 0), on every rank; "stop" when a SIGTERM arrived while
        rank 0 waited for them."""
        from megatron_ext.rl.orchestrator import Stopped

        box = [None]
        if self.rank == 0:
            sigterm = getattr(self, "_sigterm", None)
            try:
                box[0] = self.orchestrator.next_batch(self.iteration, stop=lambda: bool(sigterm and sigterm.received))
            except Stopped:
                box[0] = "stop"
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self):
        if self.fleet is not None:
            self.fleet.close()
            if not self.cfg.remote_servers:
                import ray

                ray.shutdown()
            self.fleet = self.orchestrator = None

    @staticmethod
    @torch.no_grad()
    def _copy_weights(src: list, dst):
        s = getattr(src[0], "module", src[0]).state_dict()
        getattr(dst, "module", dst).load_state_dict(s, strict=True)

    # ---- one step ----------------------------------------------------------------------------------------------
    def _samples(self, groups: list[Group]) -> list[TrainingSample]:
        tempered = self.temperature != 1.0  # the sampler's log q under the distribution it drew from
        return [TrainingSample.from_rollout(r, a, gi, tempered) for gi, g in enumerate(groups)
                for r, a in zip(g.rollouts, g.advantages)]

    def _micro_batches(self, samples: list[TrainingSample]):
        args, cfg = self.args, self.cfg
        weights = aggregation_weights(cfg.aggregation, [s.loss_mask for s in samples], cfg.max_response_length,
                                      episodes=cfg.prompts_per_step * cfg.group_size)
        ids = list(range(len(samples)))
        per_rank = [ids[d::self.dp] for d in range(self.dp)]  # samples dealt round-robin: balanced ranks
        nmb = max(rows_needed([samples[i] for i in r], args.seq_length, args.micro_batch_size, self.pad_multiple)
                  for r in per_rank)
        mine = per_rank[self.dp_rank]
        routing_shape = None
        if cfg.routing_replay:
            shapes = [samples[i].routing.shape[1:] for i in mine if samples[i].routing is not None]
            routing_shape = shapes[0] if shapes else self._routing_shape()
        mbs = micro_batches([samples[i] for i in mine], [weights[i] for i in mine], args.seq_length,
                            args.micro_batch_size, 0, nmb, self.pad_multiple, mine, routing_shape)
        return mbs, nmb

    def _routing_shape(self):
        cfgm = getattr(self.model[0], "module", self.model[0]).config
        layers = sum(cfgm.moe_layer_freq) if isinstance(cfgm.moe_layer_freq, list) else cfgm.num_layers
        return (layers, cfgm.moe_router_topk)

    def step(self) -> Optional[dict]:
        """One RL step as its phases: rollouts (colocated, fleet or remote, one interface) -> reference pass and
        advantages -> train (--grpo-iterations optimizer steps) -> publish the weights and log the groups.
        None when every prompt is trained; {"stopped": True} when a SIGTERM arrived while waiting for rollouts."""
        timers: dict[str, float] = {}
        t_step = time.perf_counter()
        engine = getattr(self, "engine", None)
        prefilled = engine.prefill_tokens if engine is not None else 0
        batch = self._rollouts()
        if batch is None or batch == "stop":
            return None if batch is None else {"stopped": True}
        groups, source = batch
        fleet = self.cfg.fleet is not None
        timers["generate"] = time.perf_counter() - t_step
        sampled_tokens = sum(r.response_length for g in groups for r in g.rollouts)

        t = time.perf_counter()
        samples, mbs, nmb, scored = self._reference_and_advantages(groups)
        timers["reference"] = time.perf_counter() - t
        metrics = {**scored, **group_metrics(groups), **({} if fleet else source)}
        store = getattr(engine, "prefix_store", None)
        if store is not None:  # this rank's prompt tokens that continued a finished turn's cache (not prefilled)
            reused, store.reused_tokens = store.reused_tokens, 0
            metrics["prefix reuse"] = reused / max(reused + engine.prefill_tokens - prefilled, 1)

        t = time.perf_counter()
        results = self._train(mbs, nmb)
        metrics.update(rl_forward.pop_metrics())
        timers["train"] = time.perf_counter() - t

        t = time.perf_counter()
        self.iteration += 1
        metrics.update(self.publish_weights())
        timers["weight update"] = time.perf_counter() - t
        self.ledger.log_trained(self.iteration, groups)
        _fault("trained", self.iteration)  # logged as trained, not yet saved

        trained_tokens = sum(int(s.loss_mask.sum()) for s in samples)
        metrics.update({f"seconds {k}": v for k, v in timers.items()})
        metrics["tokens/s sampled"] = sampled_tokens / max(timers["generate"], 1e-9)
        metrics["tokens/s trained"] = trained_tokens / max(timers["train"], 1e-9)
        metrics["groups"] = float(len(groups))
        if fleet:
            metrics.update(source)
            metrics["trainer idle fraction"] = timers["generate"] / max(time.perf_counter() - t_step, 1e-9)
        last = results[-1]
        self.consumed_samples += len(samples)
        return {"losses": {**last["losses"], **metrics}, "grad_norm": last["grad_norm"],
                "skipped": any(r["skipped"] for r in results), "consumed_samples": self.consumed_samples}

    def _rollouts(self):
        """The step's groups on every rank and their source's metrics: from the asynchronous fleet, else the
        groups pending from a checkpoint plus this step's admitted prompts (reference answers in the SFT warm-up,
        generated by the engine replicas or remote servers otherwise); rollouts are logged as they arrive.
        None: nothing left to train; "stop": a SIGTERM arrived while rank 0 waited for the fleet."""
        args, cfg = self.args, self.cfg
        if cfg.fleet is not None:
            if self.fleet is not None and _fault_armed("worker", self.iteration):
                os.kill(self.fleet.worker_pid(0), signal.SIGKILL)  # kill -9 a rollout worker mid-rollout
            out = self._fleet_batch()
            if out is None or out == "stop":
                return out
            groups, fleet_metrics = out
            _fault("generating", self.iteration)  # groups finished, not trained
            self.ledger.log_rollouts(self.iteration + 1, groups)
            return groups, dict(fleet_metrics)
        admitted = self.ledger.admit(cfg.prompts_per_step)
        groups = list(self.ledger.take(len(self.ledger.pending)))  # pending from a checkpoint train first
        speculation = {}
        if admitted and cfg.sft_warmup:
            new = reference_groups([self.by_id[p] for p in admitted], self.make_env)
            for g in new:
                self.ledger.finish(g)
            groups += self.ledger.take(len(new))
        elif admitted:
            tasks = [self.by_id[p] for p in admitted]
            self._sync_reward_weights(self.iteration + 1)
            episode = EpisodeConfig(cfg.group_size, cfg.sampling, cfg.max_turns, cfg.max_response_length)
            self._speculation()  # drafts of evaluations in between do not count
            new = generate_groups(tasks, self.make_env, self.generate, episode, cfg.std_normalize,
                                  seed=args.seed * 1_000_003 + self.iteration * 7919, per_rank=bool(cfg.remote_servers))
            speculation = self._speculation()
            _fault("generating", self.iteration)  # groups generated, still in flight
            for g in new:
                self.ledger.finish(g)
            self.ledger.take(len(new))
            self.ledger.log_rollouts(self.iteration + 1, new)
            groups += new
        return (groups, speculation) if groups else None

    def _reference_and_advantages(self, groups: list[Group]):
        """(samples, this rank's micro-batches, micro-batch count, metrics): with a reference policy its
        log-probabilities go into the micro-batches, and with the k1 estimator the KL is folded into each group's
        rewards and advantages first (the micro-batches are then rebuilt with the new advantages)."""
        cfg = self.cfg
        samples = self._samples(groups)
        mbs, nmb = self._micro_batches(samples)
        metrics = {}
        if self.reference is None or cfg.sft_warmup:
            return samples, mbs, nmb, metrics
        ref = reference_logprobs(self.reference, mbs, self.args, self.temperature)
        if cfg.loss.kl_estimator == "k1":
            sums = k1_sums(mbs, ref, len(samples))
            k = 0
            for g in groups:  # the KL of a chained episode is summed over its sequences
                n = len(g.rollouts)
                g.set_kl_penalty(sums[k:k + n], cfg.loss.kl_beta, cfg.std_normalize)
                k += n
            metrics["k1 sequence sum"] = float(np.mean(sums))
            samples = self._samples(groups)
            mbs, nmb = self._micro_batches(samples)
        for mb, lp in zip(mbs, ref):
            if lp is not None:
                mb["ref_logprobs"] = lp
        return samples, mbs, nmb, metrics

    def _train(self, mbs: list[dict], nmb: int) -> list[dict]:
        """--grpo-iterations optimizer steps over the micro-batches (PPO-clipped against the pre-step policy when
        more than one); the schedule advances once, counting RL steps. Returns each step's train_step result."""
        args, cfg = self.args, self.cfg
        if cfg.iterations > 1:
            for mb, lp in zip(mbs, logprob_pass(self.model, mbs, args, cfg.routing_replay, self.temperature)):
                if lp is not None:
                    mb["old_logprobs"] = lp
        scale = float(nmb * self.dp * self.cp)
        step_fn = partial(rl_forward.forward_step, cfg.loss, scale, routing_replay=cfg.routing_replay,
                          temperature=self.temperature)
        if self.iteration + 1 in args.inject_nan_iterations:
            step_fn = inject_nan(step_fn)
        results = [train_step(step_fn, iter(mbs), self.model, self.optimizer, args, nmb)
                   for _ in range(cfg.iterations)]
        if not all(r["skipped"] for r in results):
            # the schedule counts RL steps (--train-iters): the k optimizer steps over one batch share its rate
            self.scheduler.step(increment=args.global_batch_size)
        return results

    def _speculation(self) -> dict[str, float]:
        """MTP drafts accepted / proposed since the last call, over every generation replica or remote request
        ('mtp acceptance'), and tokens per main-model forward; empty without --rl-speculative or when nothing
        was drafted."""
        pop = getattr(self.generate, "pop_speculation", None)
        if not self.cfg.speculative or pop is None:
            return {}
        counts = pop()
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        total = torch.tensor([counts["accepted"], counts["drafted"], counts["tokens"], counts["main_forwards"]],
                             dtype=torch.float64, device=device)
        dist.all_reduce(total)  # each engine replica's ranks count the same drafts: the ratios are unchanged
        accepted, drafted, tokens, forwards = total.tolist()
        if not drafted:  # every call of the step decoded plainly (--rl-speculative-policy auto stepped aside)
            return {}
        return {"mtp acceptance": accepted / max(drafted, 1.0), "mtp tokens per forward": tokens / max(forwards, 1.0)}

    def _sync_reward_weights(self, step: int):
        """An environment factory with editable reward weights (`read_weights(step)`, `use_weights(config)`: the
        coding family's weights file) takes them before the step's rollouts are scored: rank 0 reads (a change is
        logged with the step it takes effect at), every rank scores the step with the same weights."""
        if not hasattr(self.make_env, "read_weights"):
            return
        box = [self.make_env.read_weights(step) if self.rank == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        self.make_env.use_weights(box[0])

    def publish_weights(self) -> dict[str, float]:
        """Hand the new weights to the engine (in place; colocated it runs on the trainer's own parameters, so
        only the version moves) and tag later tokens with the new version; with rollout workers, publish them
        to the fleet; with remote servers, as a versioned directory they reload. Every rank calls it: with
        --overlap-param-gather the parameters are gathered first, or rollouts would see one-step-stale shards."""
        with checkpointing.params_gathered(self.model):
            return self._publish_weights()

    def _publish_weights(self) -> dict[str, float]:
        stats = {}
        if self.engine is not None:
            self.engine.update_weights(self.model, version=self.iteration)
        if self._fleet_by_path():  # the fleet hears of the directory once every rank wrote its shards
            self._publish_remote(reload=lambda path: stats.update(self.orchestrator.publish(self.iteration)))
            return stats
        if self.engine is None and self.cfg.remote_servers:
            self._publish_remote()
        if self.orchestrator is not None:
            stats.update(self.orchestrator.publish(self.iteration))
        return stats

    def _remote_path(self, version: int) -> str:
        return os.path.join(self.cfg.remote_weights_dir, f"v{version}")

    def _fleet_by_path(self) -> bool:
        """Whether the asynchronous fleet takes each version as a checkpoint directory (remote servers, or Ray
        workers behind a trainer with TP/EP > 1, whose weights no single rank holds): --rl-remote-weights-dir."""
        return self.cfg.fleet is not None and bool(self.cfg.remote_weights_dir)

    def _publish_remote(self, reload: Optional[Callable[[str], None]] = None):
        """A weights-only checkpoint of this version under --rl-remote-weights-dir/v<version> (every rank writes its
        shards), then every server loads it and reports the version (rank 0 asks, through `reload` when given: the
        asynchronous fleet's publication; all ranks learn the outcome and a failure stops the run naming the
        servers); older versions' directories are removed."""
        import copy
        import shutil

        from megatron_ext.rl.orchestrator import WorkerFailure
        from megatron_ext.rl.remote import RemoteServerError

        root = self._remote_path(self.iteration)
        wargs = copy.copy(self.args)
        wargs.save, wargs.no_save_optim = root, True
        save_checkpoint(wargs, self.iteration, self.model, None, None)
        box = [None]
        if self.rank == 0:
            try:
                (reload or (lambda path: self.generate.reload(path, self.iteration)))(root)
            except (RemoteServerError, WorkerFailure) as e:
                box[0] = str(e)
            # servers have loaded this version when reload returns; Ray workers load theirs at their next swap,
            # so the two versions before it stay for a worker still loading one
            keep = 1 if self.cfg.remote_servers or self.cfg.fleet is None else 3
            for name in os.listdir(self.cfg.remote_weights_dir):
                if name.startswith("v") and name[1:].isdigit() and int(name[1:]) <= self.iteration - keep:
                    shutil.rmtree(os.path.join(self.cfg.remote_weights_dir, name), ignore_errors=True)
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise TrainingAborted(f"publishing weights version {self.iteration} to --rl-remote-servers failed: "
                                  f"{box[0]}")

    # ---- evaluation ----------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out success: K samples per task; mean success and pass@K with 95% (Wilson) intervals."""
        cfg = self.cfg
        sampling = Sampling(**{**vars(cfg.sampling), "temperature": cfg.eval_temperature, "return_routing": False})
        episode = EpisodeConfig(cfg.eval_samples, sampling, cfg.max_turns, cfg.max_response_length)
        groups = generate_groups(cfg.eval_tasks, self.make_env, self.generate, episode, False,
                                 seed=12345 + self.args.seed, per_rank=bool(cfg.remote_servers))
        success = np.array([[_success(r) for r in g.rollouts if r.sequence_index == 0] for g in groups],
                           dtype=np.float64)  # one per episode: a chain's sequences share its reward
        out = {"heldout success": float(success.mean()), "heldout pass@k": float(success.max(1).mean())}
        n_s, n_p = success.size, len(groups)
        out["heldout success ci"] = _wilson(out["heldout success"], n_s)
        out["heldout pass@k ci"] = _wilson(out["heldout pass@k"], n_p)
        return out

    # ---- the loop ------------------------------------------------------------------------------------------------
    def save(self):
        extra = {"rl_state": {**self.ledger.state_dict(), "reference": self.reference_source,
                              "prompts": prompt_identity(self.tasks), "consumed_samples": self.consumed_samples}}
        if _fault_armed("saving", self.iteration):  # every shard written, not yet published
            checkpointing.publish = lambda *a, **k: _fault("saving", self.iteration)
        save_checkpoint(self.args, self.iteration, self.model, self.optimizer, self.scheduler, extra=extra)

    def train(self) -> int:
        args, cfg, log = self.args, self.cfg, self.log
        print_args(args, log)
        logger = TrainingLogger(args, log)
        sigterm = self._sigterm = SigtermWatcher()
        saved_at = self.iteration if args.load else None
        skipped_total = skipped_in_row = steps = 0
        eval_log = os.path.join(cfg.log_dir, EVAL) if cfg.log_dir and self.rank == 0 else None
        try:
            if cfg.eval_tasks and cfg.eval_interval and self.iteration == 0:
                self._eval(logger, eval_log)
            while self.iteration < args.train_iters:
                t0 = time.perf_counter()
                result = self.step()
                if result is not None and result.get("stopped"):
                    log(f"SIGTERM received while waiting for rollouts: saving a checkpoint at iteration "
                        f"{self.iteration} and exiting", flush=True)
                    break
                if result is None:
                    log(f"all {len(self.tasks)} prompts of --rl-prompts trained once: stopping at iteration "
                        f"{self.iteration}", flush=True)
                    break
                steps += 1
                skipped_in_row = skipped_in_row + 1 if result["skipped"] else 0
                skipped_total += int(result["skipped"])
                logger.step(self.iteration, result, time.perf_counter() - t0, self.optimizer.param_groups[0]["lr"],
                            skipped_total)
                if self.orchestrator is not None and logger.writer is not None:
                    logger.writer.add_histogram("staleness", self.orchestrator.last_staleness, self.iteration)
                if skipped_in_row >= args.max_skipped:
                    raise TrainingAborted(
                        f"iteration {self.iteration}: {skipped_in_row} consecutive RL steps had a NaN/Inf loss or "
                        f"gradient norm (--max-skipped {args.max_skipped}); resume from the last checkpoint with a "
                        "lower --lr, or look at these steps' rollouts in --rl-log-dir")
                if cfg.eval_tasks and cfg.eval_interval and self.iteration % cfg.eval_interval == 0:
                    self._eval(logger, eval_log)
                if args.save and args.save_interval and self.iteration % args.save_interval == 0:
                    self.save()
                    saved_at = self.iteration
                if sigterm.any_rank():
                    log(f"SIGTERM received: saving a checkpoint at iteration {self.iteration} and exiting", flush=True)
                    break
                if args.exit_interval and self.iteration % args.exit_interval == 0:
                    break
            if steps and skipped_total == steps:
                raise TrainingAborted(
                    f"all {steps} RL steps of this run were skipped for a NaN/Inf loss or gradient norm: nothing was "
                    "trained (no final checkpoint written); look at the steps' rollouts and rewards in --rl-log-dir, "
                    "or lower --lr")
            if args.save and saved_at != self.iteration:
                self.save()
            return self.iteration
        finally:
            sigterm.restore()
            logger.close()
            self.close()

    def _eval(self, logger, eval_log):
        result = self.evaluate()
        parts = [f" held-out evaluation at iteration {self.iteration}"] + \
                [f"{k}: {v:.4f}" if not isinstance(v, list) else f"{k}: [{v[0]:.3f}, {v[1]:.3f}]"
                 for k, v in result.items()]
        self.log(" | ".join(parts), flush=True)
        for k, v in result.items():
            if not isinstance(v, list):
                logger.scalar(k, v, self.iteration)
        if eval_log:
            with open(eval_log, "a") as f:
                f.write(json.dumps({"iteration": self.iteration, **result}) + "\n")


FAULT_ENV = "MEGATRON_EXT_RL_FAULT"
FAULT_WAIT_ENV = "MEGATRON_EXT_RL_FAULT_WAIT"


def _fault_armed(point: str, iteration: int) -> bool:
    """The one switch of every fault-injection point (see _fault): set by the exactly-once tests only."""
    return os.environ.get(FAULT_ENV) == f"{point}:{iteration}"


def _fault(point: str, iteration: int):
    """Fault injection for the exactly-once tests: MEGATRON_EXT_RL_FAULT=POINT:ITERATION kills this process
    (SIGKILL, nothing flushed or cleaned up) when it reaches POINT while at ITERATION (POINT `worker`: rank 0
    kills rollout worker 0 instead, at the start of that step). With MEGATRON_EXT_RL_FAULT_WAIT=FILE it writes FILE
    and waits there instead, for the test to kill -9 the whole process tree (torchrun and every rank) from outside,
    as a SLURM preemption or a node failure does."""
    if not _fault_armed(point, iteration):
        return
    marker = os.environ.get(FAULT_WAIT_ENV)
    if not marker:
        os.kill(os.getpid(), signal.SIGKILL)
    with open(f"{marker}.{os.getpid()}", "w") as f:
        f.write(f"{point}:{iteration}\n")
    while True:
        time.sleep(60)


def _success(rollout) -> float:
    parts = rollout.reward.parts
    if rollout.reward.error is not None:
        return 0.0
    return float(parts.get("exact", parts.get("correctness", rollout.reward.total > 0)) >= 1.0)


def _wilson(p: float, n: int, z: float = 1.96) -> list[float]:
    if n == 0:
        return [0.0, 1.0]
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]
