"""Every flag-validation rule gives an error that names the flag to fix."""

import pytest

from megatron_ext.arguments import ArgumentError, parse_args


def _parse(flags, world=1):
    return parse_args(["--model", "tiny", *flags], world_size=world)


@pytest.mark.parametrize("flags, world, names", [
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 3, ["world size 3", "--tensor-model-parallel-size"]),
    (["--expert-model-parallel-size", "3"], 3, ["--expert-model-parallel-size 3", "--num-experts 8"]),
    (["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"], 2,
     ["world size 2", "--expert-tensor-parallel-size"]),
    (["--sequence-parallel"], 1, ["--sequence-parallel", "--tensor-model-parallel-size > 1"]),
    (["--tensor-model-parallel-size", "2"], 2, ["--tensor-model-parallel-size 2", "add --sequence-parallel"]),
    (["--context-parallel-size", "2", "--seq-length", "66"], 2, ["--seq-length 66", "2 x --context-parallel-size"]),
    (["--context-parallel-size", "3"], 2, ["world size 2", "--context-parallel-size 3"]),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "4", "--sequence-parallel",
      "--seq-length", "76"], 8, ["--seq-length 76", "--tensor-model-parallel-size 4 x --context-parallel-size 2"]),
    (["--tensor-model-parallel-size", "0"], 1, ["--tensor-model-parallel-size must be >= 1"]),
    (["--tensor-model-parallel-size", "8", "--sequence-parallel"], 8, ["--num-attention-heads 4",
                                                                       "--tensor-model-parallel-size 8"]),
    (["--pipeline-model-parallel-size", "3"], 3, ["--num-layers 4", "--pipeline-model-parallel-size 3"]),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "63"], 2,
     ["--seq-length 63", "--sequence-parallel"]),
    (["--moe-router-topk", "9"], 1, ["--moe-router-topk 9", "--num-experts"]),
    (["--moe-router-score-function", "softmax"], 1, ["--moe-router-enable-expert-bias", "sigmoid"]),
    (["--first-k-dense-replace", "5"], 1, ["--first-k-dense-replace 5"]),
    (["--num-experts", "0", "--expert-model-parallel-size", "2"], 2, ["--expert-model-parallel-size 2",
                                                                      "--num-experts"]),
    (["--mtp-num-layers", "-1"], 1, ["--mtp-num-layers"]),
    (["--position-embedding-type", "alibi"], 1, ["--position-embedding-type"]),
    (["--fp8-format", "e4m3"], 1, ["--fp8-format"]),
    (["--transformer-impl", "transformer_engine"], 1, ["--transformer-impl transformer_engine"]),
    (["--seq-length", "4096"], 1, ["--seq-length 4096", "--max-position-embeddings"]),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, ["--global-batch-size 6", "--micro-batch-size 4"]),
])
def test_bad_combination_names_the_flag(flags, world, names):
    with pytest.raises(ArgumentError) as err:
        _parse(flags, world)
    for name in names:
        assert name in str(err.value)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(SystemExit):  # argparse's choices check
        parse_args(["--model", "nope"], world_size=1)


def test_preset_fields_and_overrides():
    args = _parse(["--hidden-size", "96", "--num-experts", "0", "--q-lora-rank", "0"])
    assert args.hidden_size == 96 and args.arch.hidden_size == 96
    assert args.arch.num_experts is None and args.arch.q_lora_rank is None
    assert args.num_layers == 4  # from the preset


def test_derived_sizes():
    args = _parse(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size", "2"], world=4)
    assert args.data_parallel_size == 2
    assert args.global_batch_size == 4
    assert args.expert_tensor_parallel_size == 2
    assert args.padded_vocab_size % (128 * 2) == 0
    ep = _parse(["--expert-model-parallel-size", "2"], world=2)
    assert ep.expert_tensor_parallel_size == 1 and ep.data_parallel_size == 2


def test_kimi_k25_preset_matches_reference():
    a = parse_args(["--model", "kimi-k2.5"], world_size=1).arch
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads) == (61, 7168, 18432, 64)
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim, a.v_head_dim) == (1536, 512, 128,
                                                                                                   64, 128)
    assert (a.num_experts, a.moe_router_topk, a.moe_ffn_hidden_size, a.moe_shared_expert_intermediate_size) == (
        384, 8, 2048, 2048)
    assert a.first_k_dense == 1 and a.moe_router_score_function == "sigmoid" and a.moe_router_enable_expert_bias
    assert a.moe_router_topk_scaling_factor == 2.827 and a.vocab_size == 163840
    assert (a.rotary_base, a.rotary_scaling_factor, a.original_max_position_embeddings) == (50000.0, 64.0, 4096)
