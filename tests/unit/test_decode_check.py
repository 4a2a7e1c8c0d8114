"""benchmarks/decode_throughput.py --check (issue 32 item 4): the recorded-figures parser and the comparison."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("decode_throughput",
                                                  os.path.join(ROOT, "benchmarks", "decode_throughput.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLE = """## Decode speed

| date | machine | measurement | result | goal |
|---|---|---|---|---|
| 2026-11-30 | VM | (b) MTP speculative | 0.77x, acceptance 0.611 | >= 1.8x |

| date | machine | command | ratio | paired runs | notes |
|---|---|---|---|---|---|
| 2026-11-30 | VM | `python benchmarks/decode_throughput.py --only a --threads 2` | (a) 1.60x | 1.40-1.80 | x |
| 2026-12-01 | VM | `nice -n 10 python benchmarks/decode_throughput.py --only a --threads 2 --repeats 9` | (a) 1.50x | 1.38-1.64 | y |
| 2026-12-01 | VM | `python benchmarks/decode_throughput.py --only a --threads 1` | (a) 2.50x | 2.40-2.60 | other options |
| 2026-12-01 | VM | `python benchmarks/decode_throughput.py --threads 2` | (b) 0.51x | 0.44-0.58 | z |

Some prose | with a bar.
"""


def test_recorded_figures_are_parsed_from_tables_with_command_ratio_and_paired_columns(bench):
    rows = bench.recorded_figures(TABLE)
    assert [(date, fig.kind, fig.median, fig.lo, fig.hi) for date, _, fig in rows] == [
        ("2026-11-30", "a", 1.60, 1.40, 1.80), ("2026-12-01", "a", 1.50, 1.38, 1.64),
        ("2026-12-01", "a", 2.50, 2.40, 2.60), ("2026-12-01", "b", 0.51, 0.44, 0.58)]
    assert rows[1][1].startswith("nice -n 10 python benchmarks/decode_throughput.py")


def test_check_compares_with_the_last_figure_of_the_same_options(bench):
    options = bench.options_of("python benchmarks/decode_throughput.py --threads 2 --check")
    figures = [bench.Figure("a", 1.20, 1.10, 1.30), bench.Figure("b", 0.95, 0.90, 1.02)]
    lines, fell = bench.compare(figures, options, TABLE)
    # (a): the last --threads 2 record (1.50x, 1.38-1.64), not the --threads 1 one nor the older 1.60x
    assert "recorded 2026-12-01 1.50x" in lines[0] and "MOVED DOWN by 0.30x" in lines[0] and fell
    assert "recorded 2026-12-01 0.51x" in lines[1] and "moved up by 0.44x" in lines[1]
    lines, fell = bench.compare([bench.Figure("a", 1.45, 1.3, 1.6)], options, TABLE)
    assert "within the recorded paired-run range" in lines[0] and not fell
    lines, fell = bench.compare([bench.Figure("b", 1.0, 0.9, 1.1)],
                                bench.options_of("python benchmarks/decode_throughput.py --num-layers 16"), TABLE)
    assert lines == ["check (b): no recorded figure for these options"] and not fell


def test_check_refuses_a_command_that_is_not_this_benchmark(bench):
    with pytest.raises(ValueError, match="not a decode_throughput.py command"):
        bench.options_of("python benchmarks/kda.py --repeats 1")


def test_a_deeper_stand_in_trains_at_a_lower_learning_rate_unless_told(bench):
    """At the 4-layer recipe's 1e-2 a 16-layer stand-in averaged lm loss 3.43 over its training (1.55 at 3e-3) and
    its MTP accepted 0.19 of its drafts (0.64), so (b) with --num-layers 16 measured a barely trained model;
    --train-lr still wins."""
    lr = [bench.stand_in_lr(bench.parser().parse_args(argv)) for argv in (
        ["--only", "b"], ["--only", "b", "--num-layers", "4"], ["--only", "b", "--num-layers", "16"],
        ["--only", "b", "--num-layers", "16", "--train-lr", "1e-2"])]
    assert lr == [1e-2, 1e-2, 3e-3, 1e-2]


def test_op_counts_are_per_decoded_token_and_do_not_depend_on_the_length(bench):
    """`--only ops`: the count excludes the prompt's forward and first token, so it is the same for 5 and 9 new
    tokens, and it holds the decode step's matrix products; a one-token forward and a verify are counted alike."""
    import torch

    from megatron_ext.arguments import parse_args
    from megatron_ext.inference.engine import InferenceEngine
    from megatron_ext.testing import init_layout_invariant_
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.step import build_model

    args = parse_args(["--model", "tiny", "--mock-data", "--mtp-num-layers", "0"], world_size=1)
    initialize_distributed(args)
    try:
        model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=3))[0]
        engine = InferenceEngine(model.eval())
        prompt = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(0)).tolist()
        short, short_kinds = bench.op_counts(engine, [prompt], 5)
        long, long_kinds = bench.op_counts(engine, [prompt], 9)
        step, verify = bench.forward_op_count(engine, 1), bench.forward_op_count(engine, 2)
    finally:
        destroy()
    # a decode step is one forward of one token plus the sampling; a verify of 1 + 1 tokens is one forward too
    assert step < short < step + 40
    assert step <= verify < 1.5 * step
    assert short == pytest.approx(sum(short_kinds.values()))
    assert long == pytest.approx(short)
    # attention projections of every layer, the dense MLP, the output layer: at least a few per layer
    assert short_kinds["aten::linear"] >= 3 * args.num_layers
    assert 50 < short < 2000


def test_stand_in_mtp_layers_are_a_measured_option_and_save_is_not(bench):
    """(b)'s stand-in with --mtp-num-layers 2 drafts two tokens a round: another measurement than the preset's one
    MTP layer, so --check must not compare the two; --save only keeps the checkpoint."""
    one = bench.options_of("python benchmarks/decode_throughput.py --only b --num-layers 16")
    two = bench.options_of("python benchmarks/decode_throughput.py --only b --num-layers 16 --mtp-num-layers 2")
    kept = bench.options_of("python benchmarks/decode_throughput.py --only b --num-layers 16 --save /tmp/x")
    together = bench.options_of("python benchmarks/decode_throughput.py --only b --num-layers 16 --batched")
    assert one != two and two["mtp_num_layers"] == 2 and kept == one
    assert together != one and together["batched"] and not one["batched"]  # another path: compared apart
    table = TABLE + ("\n| date | machine | command | ratio | paired runs |\n|---|---|---|---|---|\n"
                     "| 2026-12-05 | VM | `python benchmarks/decode_throughput.py --only b --num-layers 16 "
                     "--mtp-num-layers 2` | (b) 1.60x | 1.50-1.70 |\n")
    lines, _ = bench.compare([bench.Figure("b", 1.55, 1.4, 1.7)], two, table)
    assert "recorded 2026-12-05 1.60x" in lines[0]
    lines, _ = bench.compare([bench.Figure("b", 1.55, 1.4, 1.7)], one, table)
    assert lines == ["check (b): no recorded figure for these options"]


@pytest.mark.parametrize("argv, message", [
    (["--only", "b", "--load", "CKPT", "--mtp-num-layers", "2"], "with --load the checkpoint is measured as it is"),
    (["--only", "b", "--load", "CKPT", "--save", "DIR"], "with --load the checkpoint is measured as it is"),
    (["--only", "b", "--mtp-num-layers", "0"], "needs at least one MTP layer"),
])
def test_stand_in_options_that_cannot_apply_are_refused_before_any_work(bench, argv, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(argv)


def test_save_refuses_a_directory_that_already_holds_a_checkpoint(bench, tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1000")
    with pytest.raises(SystemExit, match="already holds a checkpoint"):
        bench.trained_stand_in(bench.parser().parse_args(["--only", "b", "--save", str(tmp_path)]), str(tmp_path))


def test_the_stand_in_trains_over_every_position_it_decodes(bench, monkeypatch, tmp_path):
    """(b)'s default prompts (32 tokens) and new tokens (64) reach position 96: a stand-in trained at the preset's
    64 decoded past what it had learned, where its drafts and its own tokens left the progression (acceptance
    0.42 past position 80, 1.0 below 64). The training length is the next power of two that holds both, with
    1024 tokens a step."""
    lengths = [bench.stand_in_seq_length(bench.parser().parse_args(argv)) for argv in (
        ["--only", "b"], ["--only", "b", "--prompt-length", "16", "--tokens", "48"],
        ["--only", "b", "--prompt-length", "100", "--tokens", "200"])]
    assert lengths == [128, 64, 512]
    assert [bench.stand_in_global_batch(s) for s in (64, 128, 512)] == [16, 8, 8]
    seen = []
    monkeypatch.setattr(bench.entry, "main", lambda argv: seen.append(argv) or 0)
    monkeypatch.setattr(bench, "destroy", lambda: None)
    bench.trained_stand_in(bench.parser().parse_args(["--only", "b", "--train-iters", "30"]), str(tmp_path))
    argv = seen[0]
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert flags["--seq-length"] == "128" and flags["--global-batch-size"] == "8"
    assert flags["--micro-batch-size"] == "8" and flags["--log-interval"] == "3"


def test_the_floor_times_the_engines_kernels_and_the_table_names_what_it_picks(bench, monkeypatch):
    """`--only floor`: the floor is timed three ways over the same matrices (the engine's own kernel choice,
    F.linear, reading alone), and the per-shape table (x86 with oneDNN only) has a row per shape and row count,
    each naming the kernel `platform.linear` picks for that weight."""
    from megatron_ext import platform
    from megatron_ext.arguments import parse_args
    from megatron_ext.inference.engine import InferenceEngine
    from megatron_ext.testing import init_layout_invariant_
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.step import build_model

    args = parse_args(["--model", "tiny", "--mock-data", "--mtp-num-layers", "0"], world_size=1)
    initialize_distributed(args)
    try:
        model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=3))[0]
        engine = InferenceEngine(model.eval())
        weights = engine.decode_weights()
        mb, ms = bench.weight_read_floor(engine, repeats=2)
        # the output layer is the biggest weight: above the threshold picks oneDNN, the rest F.linear
        biggest = max(w.numel() for w in weights) * 4
        monkeypatch.setattr(platform, "ONEDNN_LINEAR_MIN_BYTES", biggest)
        monkeypatch.setattr(platform, "CPU_LINEAR_CHOICE", "onednn")  # whatever this CPU measured
        table = bench.product_table(engine, rows=(1,), repeats=1)
    finally:
        destroy()
    assert mb == pytest.approx(sum(w.numel() * w.element_size() for w in weights) / 1e6)
    # each rotation reads other routed experts (as steps routed elsewhere), the same bytes and shapes
    other = engine.decode_weights(1)
    assert [w.shape for w in other] == [w.shape for w in weights]
    moved = {w.data_ptr() for w in other} - {w.data_ptr() for w in weights}
    moe = [m for m in model.decoder.layers if getattr(m.mlp, "router", None) is not None]
    assert len(moved) == 2 * sum(min(m.mlp.router.topk, len(engine._experts[id(m.mlp)])) for m in moe) > 0
    assert set(ms) == {"engine", "F.linear", "read"} and all(v > 0 for v in ms.values())
    words = bench.floor_words(mb, ms)
    assert f"{ms['engine']:.2f} ms per token as the engine's one-row products" in words
    if not platform._onednn_linear_available():
        assert table == []
        return
    shapes = {tuple(w.shape) for w in weights}
    rows = table[2:]
    assert len(rows) == len(shapes)
    picks = {tuple(int(n) for n in r.split("|")[1].split(" x ")): r.split("|")[7].strip() for r in rows}
    assert picks == {s: "oneDNN" if s[0] * s[1] * 4 >= biggest else "F.linear" for s in shapes}
    assert list(picks.values()).count("oneDNN") >= 1
