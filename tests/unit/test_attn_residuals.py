"""Attention Residuals: the depth mixture, its zero-query limit, training, resuming, serving, flag checks."""

import argparse
import os

import pytest
import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

import pretrain_composer as entry
from megatron_ext.arguments import ArgumentError, parse_args
from megatron_ext.convert.hf import ConversionError
from megatron_ext.convert.streaming import export_hf
from megatron_ext.inference.engine import InferenceEngine
from megatron_ext.models.attn_residuals import DepthSources, resolve_block_size
from megatron_ext.models.presets import parameter_counts
from megatron_ext.models.te_layout import te_spec_on_cpu
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.checkpointing import (CheckpointError, checkpoint_arch, load_checkpoint, read_tracker,
                                                 save_checkpoint)
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.lm import forward_step, train_data_iterator
from megatron_ext.training.step import build_model, setup_model_and_optimizer, train_step
from tests.tb import scalars

MODES = {"full": ["--attention-residuals", "full"], "block": ["--attention-residuals", "block",
                                                                  "--attn-res-block-size", "3"]}


def _reference_mix(sources, query, eps):
    """The paper's formula written out: softmax over sources of query . RMSNorm(v), weights times v."""
    v = torch.stack(sources)
    k = F.rms_norm(v, (v.size(-1),), eps=eps)
    alpha = torch.softmax(torch.einsum("d,nsbd->nsb", query, k), dim=0)
    return torch.einsum("nsb,nsbd->sbd", alpha, v)


def test_depth_sources_follow_the_paper():
    g = torch.Generator().manual_seed(0)
    outs = [torch.randn(5, 2, 16, generator=g) * (i + 1) for i in range(8)]
    query = torch.randn(16, generator=g)
    full = DepthSources(outs[0], None, 1e-6)
    block = DepthSources(outs[0], 3, 1e-6)
    for n, v in enumerate(outs[1:], start=1):
        full.add(v)
        block.add(v)
        # full: every output; block: the embedding, sums of completed blocks of 3, the partial sum when begun
        assert len(full.sources()) == n + 1
        sums = [outs[0]] + [sum(outs[1 + 3 * b:4 + 3 * b]) for b in range(n // 3)]
        if n % 3:
            sums.append(sum(outs[1 + 3 * (n // 3):1 + n]))
        assert len(block.sources()) == len(sums)
        for got, want in zip(block.sources(), sums):
            torch.testing.assert_close(got, want)
        for sources in (full, block):
            torch.testing.assert_close(sources.mix(query), _reference_mix(sources.sources(), query, 1e-6))


def test_zero_query_is_the_uniform_average():
    """alpha = softmax(0) = 1/n for each of the n sources present."""
    g = torch.Generator().manual_seed(1)
    outs = [torch.randn(4, 3, 8, generator=g, dtype=torch.float64) * 10 ** i for i in range(6)]
    for block_size in (None, 2):
        sources = DepthSources(outs[0], block_size, 1e-6)
        for k in range(1, len(outs)):
            sources.add(outs[k])
            present = sources.sources()
            average = sum(present) / len(present)
            torch.testing.assert_close(sources.mix(torch.zeros(8, dtype=torch.float64)), average,
                                       rtol=1e-14, atol=0)
            # ... which is the standard residual stream v_0 + ... + v_k over the number of sources
            torch.testing.assert_close(average * len(present), sum(outs[:k + 1]), rtol=1e-14, atol=0)


@pytest.fixture
def single_rank():
    args = parse_args(["--model", "tiny"], world_size=1)
    initialize_distributed(args)
    yield
    destroy()


def _model(flags):
    args = parse_args(["--model", "tiny", "--mock-data", *flags], world_size=1)
    return args, build_model(args, wrap_ddp=False)[0]


def _logits(model, tokens):
    """Logits, or per-token losses against shifted tokens when the model has MTP layers (it then needs labels)."""
    model.eval()
    labels = tokens.roll(-1, 1) if model.config.mtp_num_layers else None
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.size(1)).expand_as(tokens), None, labels=labels)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_zero_queries_compute_the_standard_pre_norm_transformer(mode, single_rank):
    """With zero queries and norm epsilon 0, the weights of a plain model give the same logits with AttnRes; any
    non-zero query changes them."""
    flags = ["--mtp-num-layers", "0", "--norm-epsilon", "0", "--seq-length", "32"]
    _, plain = _model(flags)
    init_layout_invariant_(plain, seed=5)
    args, attn_res = _model(flags + MODES[mode])
    missing, unexpected = attn_res.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected
    assert sorted(k for k in missing if not k.endswith("_extra_state")) == sorted(
        [f"decoder.layers.{i}.attn_res.{q}_query" for i in range(4) for q in ("attention", "mlp")]
        + ["decoder.final_attn_res.query"])
    assert all(float(p.abs().max()) == 0 for n, p in attn_res.named_parameters() if "attn_res" in n)
    tokens = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    want = _logits(plain, tokens)
    torch.testing.assert_close(_logits(attn_res, tokens), want, rtol=0, atol=2e-6)
    with torch.no_grad():
        attn_res.decoder.layers[2].attn_res.mlp_query.normal_(0, 1.0)
    assert float((_logits(attn_res, tokens) - want).abs().max()) > 1e-3
    # counted by the dry run's formula: one query per sublayer and one for the final norm
    total, _ = parameter_counts(args.arch.replace(vocab_size=args.padded_vocab_size))
    assert sum(p.numel() for p in attn_res.parameters()) == total
    assert total - parameter_counts(args.arch.replace(vocab_size=args.padded_vocab_size,
                                                      attention_residuals=None))[0] == 9 * args.hidden_size


def test_gradients_reach_the_queries_and_checkpoint_keys_match_both_backends(single_rank):
    args, model = _model(MODES["block"])
    model.train()
    tokens = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, torch.arange(64).expand_as(tokens), None, labels=tokens.roll(-1, 1)).mean()
    loss.backward()
    queries = {n: p for n, p in model.named_parameters() if "attn_res" in n}
    first = queries.pop("decoder.layers.0.attn_res.attention_query")  # softmax over the embedding alone
    assert first.grad is not None and float(first.grad.abs().max()) == 0
    assert len(queries) == 8 and all(float(p.grad.abs().max()) > 0 for p in queries.values())
    assert all(getattr(p, "sequence_parallel", None) is False for p in queries.values())  # SP off here

    def keys(m):
        sharded = m.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
        return {v.key for v in sharded.values() if not isinstance(v, ShardedObject)}

    te_args = argparse.Namespace(**{**vars(args), "transformer_impl": "transformer_engine"})
    with te_spec_on_cpu():
        te = build_model(te_args, wrap_ddp=False)[0]
    assert keys(model) == keys(te)
    assert {"decoder.final_attn_res.query", "decoder.layers.0.attn_res.attention_query"} <= keys(model)
    # the TE spec's identity pre-MLP norm (fused into linear_fc1) is hooked just the same
    assert type(te.decoder.layers[0].pre_mlp_layernorm).__name__ == "IdentityOp"
    for m in (model, te):  # the same values under the same checkpoint keys, queries non-zero
        init_layout_invariant_(m, seed=2)
    assert float(te.decoder.final_attn_res.query.abs().max()) > 0
    torch.testing.assert_close(_logits(te, tokens), _logits(model, tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("preset, mode", [("tiny", "full"), ("tiny", "block"), ("tiny-kimi-linear", "block")])
def test_cached_decoding_equals_the_full_forward(preset, mode, single_rank):
    """Prefill, then one token at a time with the latent KV cache (and KDA states in the hybrid): the logits of
    Megatron-Core's uncached forward, with non-zero queries (layout-invariant init draws them)."""
    _, model = _model(MODES[mode] + ["--model", preset])
    init_layout_invariant_(model, seed=3)
    assert float(model.decoder.final_attn_res.query.abs().max()) > 0
    model.eval()
    eng = InferenceEngine(model)
    ids = torch.randint(0, 1024, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = eng.new_cache(len(eng.layers), 1, 32)
    parts = [eng.forward(torch.tensor([ids[:12]]), torch.arange(12).unsqueeze(0), cache, torch.tensor([0]))[0]]
    for t in range(12, len(ids)):
        parts.append(eng.forward(torch.tensor([[ids[t]]]), torch.tensor([[t]]), cache, torch.tensor([t]))[0])
    tokens = torch.tensor([ids])
    with torch.no_grad():
        hidden = model.decoder(model.embedding(tokens, torch.arange(len(ids)).unsqueeze(0)), attention_mask=None)
        want = model.output_layer(hidden)[0][:, 0].float()
    torch.testing.assert_close(torch.cat(parts), want, rtol=1e-5, atol=1e-5)
    assert model.decoder._attn_res_sources is None  # nothing kept between forwards


TINY = ["--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
        "--seq-length", "32", "--log-interval", "4", "--attention-residuals", "block"]


def _run(tmp_path, name, *flags):
    tb = str(tmp_path / f"tb_{name}")
    code = entry.main(TINY + ["--tensorboard-dir", tb, *flags])
    return code, scalars(tb) if os.path.isdir(tb) else {}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_training_steps_reduce_the_loss_and_move_the_queries(mode):
    """The library's train step (Megatron-Core schedule, DDP, optimizer) on one repeated batch: the loss falls."""
    args = parse_args(TINY[:-2] + MODES[mode] + ["--lr", "1e-2", "--train-iters", "12"], world_size=1)
    initialize_distributed(args)
    try:
        model, optimizer = setup_model_and_optimizer(args)
        losses = [train_step(forward_step, train_data_iterator(args, 0), model, optimizer, args, 2)["losses"]
                  ["lm loss"] for _ in range(12)]
        queries = [p for n, p in model[0].named_parameters() if "attn_res" in n]
    finally:
        destroy()
    assert losses[-1] < losses[0] - 1.0, losses
    assert len(queries) == 9 and sum(float(q.abs().max()) > 1e-3 for q in queries) >= 8


def test_resumes_exactly(tmp_path):
    """pretrain_composer.py --attention-residuals block: 4 + 4 resumed steps equal 8 steps (the queries and their
    optimizer state are in the checkpoint)."""
    save = str(tmp_path / "ckpt")
    common = ["--train-iters", "8", "--lr-warmup-iters", "2"]
    code, full = _run(tmp_path, "full", *common)
    assert code == 0
    code, _ = _run(tmp_path, "first", *common, "--save", save, "--save-interval", "4", "--exit-interval", "4")
    assert code == 0 and read_tracker(save) == 4
    code, resumed = _run(tmp_path, "resumed", *common, "--save", save, "--load", save)
    assert code == 0
    for step in (5, 6, 7, 8):
        assert resumed["lm loss"][step] == full["lm loss"][step], step
        assert resumed["grad-norm"][step] == full["grad-norm"][step], step


def test_checkpoint_round_trip_and_architecture_check(tmp_path, single_rank):
    args, model = _model(MODES["block"] + ["--no-save-optim"])
    init_layout_invariant_(model, seed=7)
    save_checkpoint(argparse.Namespace(**{**vars(args), "save": str(tmp_path)}), 1, [model], None, None)
    load_args = argparse.Namespace(**{**vars(args), "load": str(tmp_path), "finetune": True})
    back = build_model(load_args, wrap_ddp=False)
    load_checkpoint(load_args, back, None, None, log=lambda *a, **k: None)
    for (name, p), (_, q) in zip(model.named_parameters(), back[0].named_parameters()):
        assert torch.equal(p, q), name
    assert float(back[0].decoder.final_attn_res.query.abs().max()) > 0
    assert checkpoint_arch(str(tmp_path)).attention_residuals == "block"  # what --use-checkpoint-args restores
    plain_args, plain = _model([])
    plain_args = argparse.Namespace(**{**vars(plain_args), "load": str(tmp_path), "finetune": True})
    with pytest.raises(CheckpointError, match="--attention-residuals None here, block in the checkpoint"):
        load_checkpoint(plain_args, [plain], None, None, log=lambda *a, **k: None)
    # no Hugging Face model type has them: export says so instead of dropping the queries
    with pytest.raises(ConversionError, match="uses --attention-residuals block, which no Hugging Face model type"):
        export_hf(str(tmp_path), str(tmp_path / "hf"), log=lambda *a, **k: None)


@pytest.mark.parametrize("flags, world, message", [
    (["--attention-residuals", "block", "--pipeline-model-parallel-size", "2"], 2,
     "--attention-residuals block does not support --pipeline-model-parallel-size 2"),
    (["--attention-residuals", "full", "--attn-res-block-size", "4"], 1,
     "--attn-res-block-size 4 applies to --attention-residuals block"),
    (["--attn-res-block-size", "4"], 1, "--attn-res-block-size 4 needs --attention-residuals block"),
    (["--attention-residuals", "dense"], 1, "--attention-residuals 'dense': choose full, block or none"),
    (["--attention-residuals", "block", "--attn-res-block-size", "-1"], 1, "--attn-res-block-size must be >= 0"),
    (["--attention-residuals", "full", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], 1, "does not support --recompute-granularity full"),
    (["--attention-residuals", "full", "--recompute-granularity", "selective", "--recompute-modules",
      "layernorm"], 1, "does not support --recompute-modules layernorm"),
])
def test_bad_flag_combinations_are_refused(flags, world, message):
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(["--model", "tiny", *flags], world_size=world)


def test_none_turns_it_off_and_block_size_defaults_to_eight_blocks():
    assert parse_args(["--attention-residuals", "none"], world_size=1).arch.attention_residuals is None
    assert resolve_block_size("block", 0, 27) == 7  # 54 sublayers in about 8 blocks
    assert resolve_block_size("block", 4, 27) == 4 and resolve_block_size("full", 0, 27) is None


def test_every_tensor_stays_on_the_device():
    """The meta device as the GPU (a host tensor meeting a device tensor raises): queries, sources and mixtures
    live on the model's device; dense, as Megatron-Core's MoE dispatcher has ops without meta kernels."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_ext.models.provider import model_provider
    from megatron_ext.mtp import distill
    from megatron_ext.testing import meta_device_as_gpu

    args = parse_args(["--model", "tiny", "--mock-data", "--num-experts", "0", "--seq-length", "32",
                       "--micro-batch-size", "2", *MODES["block"]], world_size=1)
    initialize_distributed(args)
    try:
        with meta_device_as_gpu():
            with torch.device("meta"):
                model = model_provider(args)
            output, loss_func = entry.forward_step(entry.train_data_iterator(args, 0), model)
            loss_func(output)[0].backward()
        queries = [p for n, p in model.named_parameters() if "attn_res" in n]
        assert len(queries) == 9 and all(p.device.type == "meta" and p.grad.device.type == "meta" for p in queries)
        assert output.device.type == "meta"
    finally:
        distill._METRICS.clear()
        MTPLossLoggingHelper.tracker.clear()
        clear_aux_losses_tracker()
        destroy()
