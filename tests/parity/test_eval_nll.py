"""Codebase NLL of our checkpoint (inference engine) against a direct transformers computation.

A random tiny DeepSeek-V3 is imported into a Megatron checkpoint and exported back to Hugging Face; the NLL that
`python -m megatron_ext.eval.nll --load` reports must equal, to 1e-4 relative, the sum of -log p that transformers
gives on the exported model when each token is predicted from exactly the context the rolling window promises,
computed here token by token (one forward per token)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_ext.convert.streaming import export_hf, import_hf
from megatron_ext.data import bpe
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.eval import nll
from megatron_ext.training.initialize import destroy
from tests.parity.hf_fixtures import make_hf_model, save_hf
from tests.unit.data_fixtures import ROOT, read_texts, small_corpus

VOCAB = 384
CONTEXT, STRIDE = 48, 20
RTOL = 1e-4
SOURCES = {"pkg/mod.py": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n    return a + b\n\n\nclass Box:\n    def __init__(self):"
                         "\n        self.items = []\n\n    def put(self, x):\n        self.items.append(x * 2)\n" * 3,
           "pkg/small.py": "x = 1\n",
           "README.md": "not scored by default\n",
           "bin.py": b"\xff\xfe\x00binary".decode("latin-1")}


def build_inputs(root) -> dict:
    """A tokenizer, the tiny model imported (ckpt) and exported back (exported), and a repository to score."""
    tok_dir = str(root / "tokenizer")
    bpe.save(bpe.train_bpe(read_texts(small_corpus(str(root))), VOCAB), tok_dir)
    model = make_hf_model("qlora_groups", vocab_size=VOCAB)
    hf_dir = save_hf(model, str(root / "hf"))
    ckpt = str(root / "mg")
    import_hf(hf_dir, ckpt, log=lambda *a, **k: None)
    destroy()
    exported = str(root / "exported")
    export_hf(ckpt, exported, log=lambda *a, **k: None)
    destroy()
    repo = root / "repo"
    for rel, text in SOURCES.items():
        os.makedirs(repo / os.path.dirname(rel), exist_ok=True)
        data = text.encode("latin-1") if rel == "bin.py" else text.encode()
        (repo / rel).write_bytes(data)
    return {"tok": tok_dir, "ckpt": ckpt, "exported": exported, "repo": str(repo), "root": root}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return build_inputs(tmp_path_factory.mktemp("nll"))


def _context_start(t: int) -> int:
    """The first position a target at position t sees, as the module docstring states it: 0 before position L,
    else the start k*S of the first window whose end k*S + L passes t."""
    if t < CONTEXT:
        return 0
    k = -(-(t - CONTEXT + 1) // STRIDE)  # ceil
    return k * STRIDE


def _direct_nll(hf_dir: str, ids: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for t in range(1, len(ids)):
            context = ids[_context_start(t): t]
            assert 1 <= len(context) <= CONTEXT - 1 and (t < CONTEXT or len(context) >= CONTEXT - STRIDE)
            logits = model(torch.tensor([context])).logits[0, -1, :VOCAB].double()
            total -= float(torch.log_softmax(logits, -1)[ids[t]])
    return total


def test_checkpoint_nll_equals_transformers_by_hand(setup, tmp_path):
    out = str(tmp_path / "nll.json")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "megatron_ext.eval.nll", "--load", setup["ckpt"], "--tokenizer-model",
                          setup["tok"], "--repo", setup["repo"], "--context-length", str(CONTEXT), "--stride",
                          str(STRIDE), "--nll-chunk", "16", "--out", out], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[1/3] bin.py" not in run.stderr and "pkg/mod.py:" in run.stderr  # progress lines
    report = json.load(open(out))
    assert sorted(report["files"]) == ["pkg/mod.py", "pkg/small.py"]
    assert report["skipped"] == [{"path": "bin.py", "reason": "not UTF-8 text"}]
    tok = build_tokenizer(None, setup["tok"])
    boundary = tok.bos if tok.bos is not None else tok.eod
    assert report["boundary_token"] == boundary and (report["context_length"], report["stride"]) == (CONTEXT, STRIDE)
    total = 0.0
    for rel in ("pkg/mod.py", "pkg/small.py"):
        text = SOURCES[rel]
        ids = [boundary] + tok.encode(text)
        if rel == "pkg/mod.py":
            assert len(ids) > 3 * CONTEXT  # several windows
        want = _direct_nll(setup["exported"], ids)
        got = report["files"][rel]
        assert got["tokens"] == len(ids) - 1 and got["bytes"] == len(text.encode())
        print(f"NLL parity {rel}: ours {got['nll_nats']:.6f}, direct {want:.6f}, "
              f"relative error {abs(got['nll_nats'] - want) / want:.2e}")
        assert abs(got["nll_nats"] - want) <= RTOL * abs(want), (rel, got["nll_nats"], want)
        assert got["bits_per_byte"] == pytest.approx(want / len(text.encode()) / 0.6931471805599453, rel=RTOL)
        total += want
    assert abs(report["total"]["nll_nats"] - total) <= RTOL * total
    assert report["total"]["nll_per_token"] == pytest.approx(report["total"]["nll_nats"] / report["total"]["tokens"])
    setup["checkpoint_report"] = report


def test_hf_dir_gives_the_same_figures(setup, tmp_path, capsys):
    """--hf-dir on the exported model (the tokenizer passed explicitly: the fixture ships none)."""
    out = str(tmp_path / "hf.json")
    assert nll.main(["--hf-dir", setup["exported"], "--tokenizer-model", setup["tok"], "--repo", setup["repo"],
                     "--context-length", str(CONTEXT), "--stride", str(STRIDE), "--out", out, "--device", "cpu"]) == 0
    report = json.load(open(out))
    ours = setup.get("checkpoint_report")
    if ours is None:
        pytest.skip("needs the checkpoint test's report")
    for rel, fig in ours["files"].items():
        assert report["files"][rel]["tokens"] == fig["tokens"]
        assert report["files"][rel]["nll_nats"] == pytest.approx(fig["nll_nats"], rel=RTOL)
    assert "total:" in capsys.readouterr().out


def test_checkpoint_flag_errors(setup, capsys):
    base = ["--load", setup["ckpt"], "--repo", setup["repo"]]
    assert nll.main(base) == 2
    assert "--load needs --tokenizer-model PATH" in capsys.readouterr().err
    assert nll.main(base + ["--tokenizer-model", setup["tok"], "--context-length", "8", "--stride", "8"]) == 2
    assert "--stride 8 must be between 1 and context length - 1 = 7" in capsys.readouterr().err
    assert nll.main(["--load", str(setup["root"] / "missing"), "--repo", setup["repo"]]) == 2
    assert "missing does not exist" in capsys.readouterr().err
