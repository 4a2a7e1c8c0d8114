"""--bf16 (every K2.5 flag file uses it): bf16 weights and activations, fp32 master weights, and an inference
engine that reads the bf16 model.

Both precisions start from the same weights (the fp32 run's weights are rounded to bf16 values), so the differences
measured are those of bf16 arithmetic alone. Tolerances: bf16 keeps 8 significant bits (relative step 2^-8 = 0.4%),
and a per-token loss near ln(1024) = 6.9 carries many such roundings. Measured on this tiny model: losses within
7e-4 nats, gradient norms within 0.6%, per-token logprobs within 2e-3; the bounds below leave 3-7x headroom. A
bf16 logit alone (8 bits at |logit| ~ 1) moves a logprob by ~4e-3, and a broken dtype path (lost fp32 master weights,
bf16 softmax) by far more.
"""

import pytest
import torch

from megatron_ext.arguments import parse_args
from megatron_ext.inference.engine import InferenceEngine, SamplingParams
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.lm import forward_step, train_data_iterator
from megatron_ext.training.step import build_model, setup_model_and_optimizer, train_step

FLAGS = ["--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
         "--seed", "5"]
LOSS_ATOL = 5e-3  # nats per token, bf16 vs fp32 compute
GRAD_NORM_RTOL = 0.02
LOGPROB_ATOL = 1e-2  # per generated token, bf16 engine vs fp32 teacher-forced forward


@torch.no_grad()
def _bf16_valued_init(model, seed=3):
    init_layout_invariant_(model, seed=seed)
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).to(p.dtype))


def _train(flags, steps=2):
    args = parse_args(flags, world_size=1)
    initialize_distributed(args)
    try:
        model, optimizer = setup_model_and_optimizer(args, init_fn=_bf16_valued_init)
        results = [train_step(forward_step, train_data_iterator(args, i), model, optimizer, args, 1)
                   for i in range(steps)]
        dtypes = {p.dtype for p in model[0].parameters()}
        pairs = [(master.detach().clone(), param.detach().clone())  # (fp32 master, bf16 model weight)
                 for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                 for masters, params in zip(getattr(opt, "fp32_from_float16_groups", []),
                                            getattr(opt, "float16_groups", []))
                 for master, param in zip(masters, params)]
        return results, dtypes, pairs
    finally:
        destroy()


def bf16_params_of(flags):
    args = parse_args(flags + ["--bf16"], world_size=1)
    initialize_distributed(args)
    try:
        return [p for p in build_model(args, wrap_ddp=False)[0].parameters() if p.requires_grad]
    finally:
        destroy()


def test_bf16_training_matches_fp32_within_bf16_precision():
    fp32, fp32_dtypes, _ = _train(FLAGS)
    bf16, bf16_dtypes, pairs = _train(FLAGS + ["--bf16"])
    assert fp32_dtypes == {torch.float32} and bf16_dtypes == {torch.bfloat16}
    # every bf16 weight has an fp32 master, and after the updates it is exactly the master's rounding
    assert len(pairs) == len(list(p for p in bf16_params_of(FLAGS)))
    assert all(m.dtype == torch.float32 and p.dtype == torch.bfloat16 for m, p in pairs)
    assert all(torch.equal(m.to(torch.bfloat16), p) for m, p in pairs)
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m, _ in pairs)  # sub-bf16 updates kept
    for step, (a, b) in enumerate(zip(fp32, bf16)):
        assert not a["skipped"] and not b["skipped"]
        for name in ("lm loss", "mtp_1 loss"):
            assert b["losses"][name] == pytest.approx(a["losses"][name], abs=LOSS_ATOL), (step, name)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=GRAD_NORM_RTOL), step


def test_bf16_engine_logprobs_match_fp32_forward():
    """The engine on a bf16 model generates with logprobs close to the fp32 model's teacher-forced ones, and its
    logits are fp32 (sampling and logprobs are computed in fp32/fp64, not bf16)."""
    args32 = parse_args(["--model", "tiny", "--mock-data"], world_size=1)
    args16 = parse_args(["--model", "tiny", "--mock-data", "--bf16"], world_size=1)
    initialize_distributed(args32)
    try:
        m32 = build_model(args32, wrap_ddp=False, init_fn=_bf16_valued_init)[0].eval()
        m16 = build_model(args16, wrap_ddp=False, init_fn=_bf16_valued_init)[0].eval()
        assert {p.dtype for p in m16.parameters()} == {torch.bfloat16}
        eng = InferenceEngine(m16)
        assert eng.dtype == torch.bfloat16
        prompt = torch.randint(0, 1024, (7,), generator=torch.Generator().manual_seed(2)).tolist()
        out = eng.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=4))[0]
        ids = prompt + out.token_ids
        with torch.no_grad():
            losses = m32(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1).unsqueeze(0), None,
                         labels=torch.tensor([ids[1:]]))[0]
        expected = (-losses[len(prompt) - 1:]).tolist()
        assert out.logprobs == pytest.approx(expected, abs=LOGPROB_ATOL)
        assert max(abs(a - b) for a, b in zip(out.logprobs, expected)) > 0  # it did run in bf16
        cache = eng.new_cache(len(eng.layers), 1, len(prompt))
        logits = eng.forward(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0), cache, torch.tensor([0]))
        assert logits.dtype == torch.float32
    finally:
        destroy()
