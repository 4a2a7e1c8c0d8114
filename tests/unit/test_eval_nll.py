"""Codebase NLL: the rolling window against a hand-written schedule, file selection, error messages."""

import math
import os

import pytest
import torch

from megatron_ext.eval import nll


def test_windows_by_hand():
    # n=10, L=4, S=2: [0,4) scores 1..3, [2,6) scores 4..5, [4,8) 6..7, [6,10) 8..9
    assert [(w.start, w.end, w.first) for w in nll.windows(10, 4, 2)] == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    # S = L - 1: the cheapest schedule; a short tail window
    assert [(w.start, w.end, w.first) for w in nll.windows(9, 4, 3)] == [(0, 4, 1), (3, 7, 4), (6, 9, 7)]
    assert [(w.start, w.end, w.first) for w in nll.windows(3, 8, 4)] == [(0, 3, 1)]
    assert nll.windows(1, 4, 2) == []


@pytest.mark.parametrize("n,context,stride", [(10, 4, 2), (23, 5, 1), (23, 5, 4), (40, 8, 3), (7, 16, 8)])
def test_every_target_once_with_the_promised_context(n, context, stride):
    """A scorer that reports, for each target, how many tokens precede it in its window: every target 1..n-1 is
    scored once, with all of its prefix before position L and between L - S and L - 1 tokens after."""
    seen = []

    def scorer(ids, first):
        assert len(ids) <= context and first >= 1
        return torch.tensor([float(j) for j in range(first, len(ids))])  # context of target j = j tokens

    ids = list(range(100, 100 + n))
    contexts = nll.score_sequence(ids, context, stride, scorer).tolist()
    assert len(contexts) == n - 1
    for t, c in zip(range(1, n), contexts):
        seen.append(t)
        if t < context:
            assert c == t
        else:
            assert context - stride <= c <= context - 1
    assert seen == list(range(1, n))


def test_score_sequence_uses_the_exact_window_tokens():
    """log p(target) = -(target id) * 0.01 - (sum of the context ids) * 1e-6 for a toy scorer: the figure tells
    which tokens were in the context; compared with the hand-listed contexts of n=8, L=4, S=2."""
    def scorer(ids, first):
        return torch.tensor([-ids[j] * 0.01 - sum(ids[:j]) * 1e-6 for j in range(first, len(ids))],
                            dtype=torch.float64)

    ids = [5, 7, 11, 13, 17, 19, 23, 29]
    hand = {1: [5], 2: [5, 7], 3: [5, 7, 11], 4: [11, 13], 5: [11, 13, 17], 6: [17, 19], 7: [17, 19, 23]}
    want = [-ids[t] * 0.01 - sum(hand[t]) * 1e-6 for t in range(1, 8)]
    got = nll.score_sequence(ids, 4, 2, scorer).tolist()
    assert got == pytest.approx(want, abs=1e-12)


def test_window_arguments_are_checked():
    with pytest.raises(nll.NLLError, match="--stride 4 must be between 1 and context length - 1 = 3"):
        nll.windows(10, 4, 4)
    with pytest.raises(nll.NLLError, match="at least 2 tokens"):
        nll.windows(10, 1, 1)


def test_target_logprobs_normalise_over_the_tokenizer_ids_only():
    logits = torch.tensor([[0.0, 1.0, 2.0, 50.0], [3.0, 0.0, 0.0, 50.0]])  # column 3: an embedding padding row
    got = nll.target_logprobs(logits, torch.tensor([2, 0]), vocab_size=3)
    z0 = math.log(1 + math.e + math.e ** 2)
    z1 = math.log(math.e ** 3 + 2)
    assert got.tolist() == pytest.approx([2 - z0, 3 - z1], abs=1e-6)


def test_source_files_globs_and_skips(tmp_path):
    for rel in ("a.py", "pkg/b.py", "pkg/c.rs", "pkg/notes.txt", ".git/x.py", "node_modules/m.js",
                "pkg/tests/test_b.py"):
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    repo = str(tmp_path)
    assert nll.source_files(repo, list(nll.DEFAULT_INCLUDE), []) == ["a.py", "pkg/b.py", "pkg/c.rs",
                                                                      "pkg/tests/test_b.py"]
    assert nll.source_files(repo, ["*.py"], ["pkg/tests/*"]) == ["a.py", "pkg/b.py"]
    assert nll.source_files(repo, ["pkg/*.txt"], []) == ["pkg/notes.txt"]


def test_clear_errors(tmp_path, capsys):
    assert nll.main(["--repo", str(tmp_path)]) == 2
    assert "pass --load CKPT" in capsys.readouterr().err
    assert nll.main(["--load", str(tmp_path), "--hf-dir", str(tmp_path), "--repo", str(tmp_path)]) == 2
    assert "--load and --hf-dir exclude each other" in capsys.readouterr().err
    (tmp_path / "hf").mkdir()
    assert nll.main(["--hf-dir", str(tmp_path / "hf"), "--repo", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "--repo" in err and "is not a directory" in err
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "a.txt").write_text("hello")
    assert nll.main(["--hf-dir", str(tmp_path / "hf"), "--repo", str(tmp_path / "repo")]) == 2
    assert "no file matches --include" in capsys.readouterr().err
    (tmp_path / "repo" / "a.py").write_text("hello")
    assert nll.main(["--hf-dir", str(tmp_path / "hf"), "--repo", str(tmp_path / "repo")]) == 2
    assert "no config.json" in capsys.readouterr().err
