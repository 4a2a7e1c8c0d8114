"""The gpu flag group: Megatron-LM names, validation that names the fix, and what reaches Megatron-Core."""

import argparse

import pytest

from megatron_ext import gpu
from megatron_ext.arguments import ArgumentError, parse_args
from megatron_ext.models.provider import transformer_config


def _fail(msg):
    raise ArgumentError(msg)


@pytest.mark.parametrize("flags, message", [
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"),
    (["--use-distributed-optimizer", "--overlap-param-gather"], "and --overlap-grad-reduce"),
    (["--recompute-granularity", "full"], "needs --recompute-method uniform|block and --recompute-num-layers"),
    (["--recompute-method", "uniform", "--recompute-num-layers", "1"], "need --recompute-granularity full"),
    (["--recompute-modules", "moe"], "--recompute-modules needs --recompute-granularity selective"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe", "--num-experts", "0"], "need an MoE"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "0"], ">= 1"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm needs --transformer-impl transformer_engine"),
    (["--moe-permute-fusion"], "--moe-permute-fusion needs --transformer-impl transformer_engine"),
    (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"], "fusion-impl te needs --transformer-impl"),
    (["--moe-shared-expert-overlap", "--moe-token-dispatcher-type", "allgather"], "alltoall only, not allgather"),
    (["--moe-shared-expert-overlap", "--recompute-granularity", "selective", "--recompute-modules", "shared_experts"],
     "cannot be combined with --recompute-modules shared_experts"),
    (["--moe-token-dispatcher-type", "flex"], "flex needs --transformer-impl transformer_engine"),
    (["--tp-comm-overlap"], "first MLA projection \\(q_down_proj\\) switches the model's tp_comm_overlap off"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe_act"], "moe_act needs --moe-grouped-gemm"),
    (["--pipeline-model-parallel-size", "3"], "set --decoder-first-pipeline-num-layers"),
    (["--decoder-first-pipeline-num-layers", "1"], "need --pipeline-model-parallel-size > 1"),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"],
     "stage 0 would hold only dense layers"),
])
def test_bad_combinations_name_the_fix(flags, message):
    with pytest.raises(ArgumentError, match=message.replace("|", r"\|").replace("+", r"\+")):
        parse_args(["--model", "tiny", *flags], world_size=int(flags[flags.index("--pipeline-model-parallel-size") + 1]) if "--pipeline-model-parallel-size" in flags else 1)


def test_flags_reach_megatron_core():
    args = parse_args(["--model", "tiny", "--use-distributed-optimizer", "--overlap-grad-reduce",
                       "--overlap-param-gather", "--recompute-granularity", "selective", "--recompute-modules",
                       "mla_up_proj", "moe", "layernorm"], world_size=1)
    config = transformer_config(args)
    assert config.recompute_granularity == "selective"
    assert config.recompute_modules == ["mla_up_proj", "moe", "layernorm"]
    assert gpu.ddp_config_kwargs(args) == {"overlap_grad_reduce": True, "overlap_param_gather": True}
    # the CPU path runs none of the fused kernels
    assert not (config.bias_activation_fusion or config.bias_dropout_fusion or config.apply_rope_fusion
                or config.gradient_accumulation_fusion)
    args = parse_args(["--model", "tiny", "--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "1"], world_size=1)
    config = transformer_config(args)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "uniform", 1)


def test_uneven_pipeline_split():
    assert gpu.pipeline_layers(61, 16, 3, 2) == [3] + [4] * 14 + [2]
    assert gpu.pipeline_layers(61, 8, 5, None) == [5] + [8] * 7
    assert gpu.pipeline_layers(4, 2, 1, None) == [1, 3]
    assert gpu.pipeline_layers(4, 1, None, None) == [4]
    with pytest.raises(ValueError, match="does not split"):
        gpu.pipeline_layers(61, 16, None, None)
    with pytest.raises(ValueError, match="must sum to --num-layers"):
        gpu.pipeline_layers(4, 2, 1, 1)
    args = parse_args(["--model", "kimi-k2.5", "--pipeline-model-parallel-size", "16", "--expert-model-parallel-size",
                       "8", "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "2"],
                      world_size=128)
    config = transformer_config(args)
    assert (config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage) == (3, 2)


def test_fp8_recipes_the_gpu_cannot_run_are_refused():
    hopper, blackwell, ada, ampere = (9, 0), (10, 0), (8, 9), (8, 0)
    assert "needs a GPU of compute capability 10.0" in gpu.fp8_support_error("mxfp8", hopper)
    assert "blockwise or tensorwise on Hopper" in gpu.fp8_support_error("mxfp8", hopper)
    assert gpu.fp8_support_error("mxfp8", blackwell) is None
    assert gpu.fp8_support_error("blockwise", hopper) is None
    assert "9.0" in gpu.fp8_support_error("blockwise", ada)
    assert gpu.fp8_support_error("delayed", ada) is None
    assert "drop --fp8-format" in gpu.fp8_support_error("tensorwise", ampere)
    assert gpu.fp8_support_error("mxfp8", None) is None  # no GPU to ask: the TE check refuses FP8 there anyway
    args = parse_args(["--model", "tiny"], world_size=1)
    args = argparse.Namespace(**{**vars(args), "fp8_format": "hybrid", "fp8_recipe": "mxfp8"})
    with pytest.raises(ArgumentError, match="--fp8-recipe mxfp8 needs"):
        gpu.validate_gpu_args(args, _fail, capability=hopper)
    gpu.validate_gpu_args(args, _fail, capability=blackwell)
    assert gpu.transformer_config_kwargs(args)["moe_router_padding_for_fp8"] is True


@pytest.fixture
def te_gpu(monkeypatch):
    """This process as a GPU node with Transformer Engine, for deriving the config (nothing is built)."""
    from megatron_ext import platform

    monkeypatch.setattr(platform, "bridge_needed", lambda: False)
    monkeypatch.setattr(platform, "te_available", lambda: True)
    monkeypatch.setattr(gpu, "compute_capability", lambda: (9, 0))


def _te_args(preset, *flags):
    args = parse_args(["--model", preset, *flags], world_size=1)
    args.transformer_impl = "transformer_engine"
    return args


@pytest.mark.parametrize("preset", sorted(__import__("megatron_ext.models.presets", fromlist=["PRESETS"]).PRESETS))
def test_every_preset_builds_its_te_config(preset, te_gpu, monkeypatch):
    """MLATransformerConfig refuses apply_rope_fusion without YaRN (Kimi Linear's presets): derived per preset."""
    from megatron_ext import platform

    monkeypatch.setattr(platform, "grad_accum_fusion_kernel", lambda: True)
    args = _te_args(preset)
    config = transformer_config(args)
    assert config.apply_rope_fusion == (args.arch.rope_type == "yarn")
    assert config.bias_activation_fusion and config.gradient_accumulation_fusion
    assert not transformer_config(_te_args(preset, "--no-rope-fusion")).apply_rope_fusion
    assert not gpu.rope_fusion(args, te=False)  # the local backend has no fused kernel


def test_gradient_accumulation_fusion_only_with_apex_kernel(te_gpu, monkeypatch, capsys):
    from megatron_ext import platform

    args = _te_args("tiny")
    monkeypatch.setattr(platform, "grad_accum_fusion_kernel", lambda: False)
    assert gpu.transformer_config_kwargs(args)["gradient_accumulation_fusion"] is False
    assert "gradient-accumulation fusion off: apex's fused_weight_gradient_mlp_cuda does not import" in \
        capsys.readouterr().out
    monkeypatch.setattr(platform, "grad_accum_fusion_kernel", lambda: True)
    assert gpu.transformer_config_kwargs(args)["gradient_accumulation_fusion"] is True
    args.gradient_accumulation_fusion = False  # --no-gradient-accumulation-fusion
    assert gpu.transformer_config_kwargs(args)["gradient_accumulation_fusion"] is False


def test_local_context_parallel_mla_up_proj_recompute_is_refused_at_parse_time():
    flags = ["--model", "tiny", "--transformer-impl", "local", "--context-parallel-size", "2",
             "--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj", "moe"]
    with pytest.raises(ArgumentError, match="mla_up_proj with --context-parallel-size 2 needs --transformer-impl "
                                            "transformer_engine.*drop mla_up_proj from --recompute-modules"):
        parse_args(flags, world_size=2)
    args = parse_args(flags[:-2] + ["moe"], world_size=2)  # the fix the message names
    assert args.recompute_modules == ["moe"]


def test_machine_checks_wait_for_the_machine():
    """The K2.5 flag files name the TE backend; a dry run on a host machine checks the flags, a real run here
    refuses early."""
    flags = ["--model", "tiny", "--transformer-impl", "transformer_engine"]
    assert parse_args(flags + ["--dry-run"], world_size=1).transformer_impl == "transformer_engine"
    with pytest.raises(ArgumentError, match="needs Transformer Engine and CUDA; use --transformer-impl local"):
        parse_args(flags, world_size=1)
