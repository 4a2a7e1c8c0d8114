"""Issue 11: the tools never destroy data they did not write, and bad inputs are named.

Export into an occupied directory, outputs replaced only on success, imports that would repoint a training
checkpoint, serve's temporary import, HF checkpoints saved by transformers (MTP config without MTP tensors),
invalid config.json, NaN weights, and preprocess_data's empty inputs, speed line and very long documents.
"""

import io
import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_ext.convert.hf import ConversionError
from megatron_ext.convert.streaming import export_hf, import_hf
from megatron_ext.data import bpe
from megatron_ext.data import preprocess as pp
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.training.checkpointing import TRACKER, read_tracker
from megatron_ext.training.initialize import destroy
from tests.parity.hf_fixtures import add_shard, all_tensors, edit_config, make_hf_model, save_hf
from tests.unit.data_fixtures import load_tool, small_corpus, trained_tokenizer

QUIET = dict(log=lambda *a, **k: None)


def _import(hf_dir, save, **kw):
    try:
        return import_hf(hf_dir, save, **kw, **QUIET)
    finally:
        destroy()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf(make_hf_model("no_qlora_dense2"), str(tmp_path_factory.mktemp("hf") / "hf"))


@pytest.fixture(scope="module")
def megatron_ckpt(hf_dir, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("mg") / "mg")
    _import(hf_dir, save, dtype="fp32")
    return save


def _copy_hf(hf_dir, tmp_path):
    import shutil

    return shutil.copytree(hf_dir, str(tmp_path / "hf"))


def _export(load, out, **kw):
    try:
        return export_hf(load, out, **kw, **QUIET)
    finally:
        destroy()


# ---- 1. export never deletes what it did not write ---------------------------------------------------------
def test_export_refuses_an_occupied_directory_and_overwrite_keeps_other_files(megatron_ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text("{}")
    with pytest.raises(ConversionError, match=r"--hf-dir .*out is not empty \(config.json, notes.txt\).*--overwrite"):
        _export(megatron_ckpt, str(out))
    assert sorted(os.listdir(out)) == ["config.json", "notes.txt"] and (out / "config.json").read_text() == "{}"
    _export(megatron_ckpt, str(out), overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(os.listdir(out)) == sorted({"notes.txt", "config.json", "model.safetensors.index.json",
                                              *index.values()})
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no staging directory left behind


def test_export_tool_with_hf_dir_dot_keeps_the_working_directory(megatron_ckpt, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print('precious')")
    monkeypatch.chdir(work)
    tool = load_tool("convert_checkpoint")
    assert tool.main(["export", "--load", megatron_ckpt, "--hf-dir", "."]) == 2
    assert "is not empty (train.py)" in capsys.readouterr().err
    assert os.listdir(work) == ["train.py"]
    fresh = tmp_path / "fresh" / "hf"
    assert tool.main(["export", "--load", megatron_ckpt, "--hf-dir", str(fresh)]) == 0
    assert "config.json" in os.listdir(fresh) and os.listdir(tmp_path / "fresh") == ["hf"]


# ---- 2. outputs are replaced only by complete, non-empty results --------------------------------------------
def test_build_corpus_with_no_match_leaves_the_output_alone(tmp_path, capsys):
    output = tmp_path / "corpus.jsonl"
    output.write_text('{"text": "earlier corpus"}\n')
    empty = tmp_path / "src"
    empty.mkdir()
    (empty / "notes.bin").write_bytes(b"\0" * 100)
    assert load_tool("build_corpus").main(["--input", str(empty), "--output", str(output)]) == 1
    assert "no files matched" in capsys.readouterr().err
    assert output.read_text() == '{"text": "earlier corpus"}\n'
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl", "src"]


def test_build_sft_data_failures_leave_the_output_alone(tmp_path, capsys):
    output = tmp_path / "sft.jsonl"
    output.write_text("earlier\n")
    no_functions = tmp_path / "c.jsonl"
    no_functions.write_text(json.dumps({"text": "x = 1\n", "path": "lib/x.py"}) + "\n")
    tool = load_tool("build_sft_data")
    assert tool.main(["--input", str(no_functions), "--output", str(output)]) == 1
    assert "gave no conversations" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": 'def f():\n    "Doc."\n    return 1\n', "path": "a/m.py"}) + "\n{oops\n")
    assert tool.main(["--input", str(bad), "--output", str(output)]) == 1
    assert f"{bad}:2: not JSON" in capsys.readouterr().err
    assert output.read_text() == "earlier\n"
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "c.jsonl", "sft.jsonl"]


def test_tokenizer_save_is_all_or_nothing(tmp_path, monkeypatch):
    out = tmp_path / "tok"
    tok = bpe.train_bpe(iter(["def f(x):\n    return x + 1\n"] * 50), 400)
    out.mkdir()
    (out / "README").write_text("keep")

    def broken(*a, **k):
        raise ValueError("disk full")

    monkeypatch.setattr(bpe, "write_tiktoken_ranks", broken)
    with pytest.raises(ValueError, match="disk full"):
        bpe.save(tok, str(out), tiktoken=True)
    assert os.listdir(out) == ["README"]  # tokenizer.json was not published without its companions
    monkeypatch.undo()
    bpe.save(tok, str(out), tiktoken=True)
    assert sorted(os.listdir(out)) == ["README", "tiktoken.model", "tokenizer.json", "tokenizer_config.json"]


# ---- 4. serve --hf-dir: the temporary import goes; a named one is reused --------------------------------------
def test_serve_removes_its_temporary_import_on_sigterm(hf_dir, tmp_path, monkeypatch):
    tool = load_tool("serve")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    seen = []

    def serving(argv):  # stands in for the server: the import exists while it runs, then SIGTERM arrives
        target = argv[argv.index("--load") + 1]
        seen.append(target)
        assert read_tracker(target) == "release"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        return 0

    monkeypatch.setattr(tool, "_serve", serving)
    with pytest.raises(SystemExit) as e:
        tool.main(["--hf-dir", hf_dir])
    assert e.value.code == 128 + signal.SIGTERM
    assert seen and seen[0].startswith(str(tmp_path)) and not os.path.exists(seen[0])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    monkeypatch.setattr(tool, "_serve", lambda argv: seen.append(argv[argv.index("--load") + 1]) or 0)
    assert tool.main(["--hf-dir", hf_dir]) == 0
    assert not os.path.exists(seen[-1]) and os.listdir(tmp_path) == []


def test_serve_reuses_a_named_import_and_refuses_a_foreign_one(hf_dir, tmp_path, monkeypatch, capsys):
    tool = load_tool("serve")
    save = str(tmp_path / "imported")
    target, cleanup = tool.prepare_hf_checkpoint(hf_dir, save, **QUIET)
    assert target == save and cleanup is None and read_tracker(save) == "release"
    stamp = os.path.getmtime(os.path.join(save, "release", "common.pt"))
    lines = []
    assert tool.prepare_hf_checkpoint(hf_dir, save, log=lines.append) == (save, None)
    assert lines == [f"reusing the import of {hf_dir} in {save}"]
    assert os.path.getmtime(os.path.join(save, "release", "common.pt")) == stamp
    changed = _copy_hf(hf_dir, tmp_path)
    edit_config(changed, rms_norm_eps=1e-6)
    with pytest.raises(ConversionError, match=f"holds an import of {hf_dir} that does not match --hf-dir {changed}"):
        tool.prepare_hf_checkpoint(changed, save, **QUIET)
    monkeypatch.setattr(tool, "_serve", lambda argv: 0)
    assert tool.main(["--hf-dir", changed, "--save", save]) == 2
    assert "does not match" in capsys.readouterr().err


def test_import_checksums_its_files_while_writing(hf_dir, tmp_path, monkeypatch):
    from megatron_ext.training import checkpointing

    read_back = []
    original = checkpointing.file_crc32
    monkeypatch.setattr(checkpointing, "file_crc32", lambda path: read_back.append(path) or original(path))
    save = str(tmp_path / "mg")
    _import(hf_dir, save)
    ckpt = os.path.join(save, "release")
    files = checkpointing.read_manifest(ckpt)
    data = [rel for rel in files if rel.endswith(".distcp")]
    assert len(data) > 10 and all(files[rel]["crc32"] == f"{original(os.path.join(ckpt, rel)):08x}" for rel in data)
    assert not [p for p in read_back if p.endswith(".distcp")]
    assert not [n for n in os.listdir(ckpt) if n.endswith(checkpointing.CHECKSUM_SIDECAR)]


# ---- 6. importing next to training checkpoints --------------------------------------------------------------
def test_import_into_a_training_checkpoint_directory_is_refused_unless_overwrite(hf_dir, tmp_path):
    save = tmp_path / "run"
    (save / "iter_0000040").mkdir(parents=True)
    (save / TRACKER).write_text("40")
    with pytest.raises(ConversionError, match=r"holds training checkpoints \(latest: iteration 40\).*--overwrite"):
        _import(hf_dir, str(save))
    assert read_tracker(str(save)) == 40 and sorted(os.listdir(save)) == sorted([TRACKER, "iter_0000040"])
    _import(hf_dir, str(save), overwrite=True)
    assert read_tracker(str(save)) == "release" and os.path.isdir(save / "iter_0000040")
    with pytest.raises(ConversionError, match="already holds an imported checkpoint"):
        _import(hf_dir, str(save))


# ---- 8. checkpoints saved by transformers, bad config.json, NaN weights --------------------------------------
def test_mtp_declared_but_absent_imports_without_mtp(hf_dir, tmp_path):
    hf = _copy_hf(hf_dir, tmp_path)
    edit_config(hf, num_nextn_predict_layers=1)  # what DeepseekV3Config.save_pretrained writes, with no MTP tensors
    lines = []
    summary = import_hf(hf, str(tmp_path / "mg"), log=lines.append)
    destroy()
    assert summary["mtp_layers"] == 0
    assert [line for line in lines if "MTP" in line] == [
        f"config.json declares 1 MTP layer(s) (num_nextn_predict_layers) but {hf} holds none of their tensors "
        "(transformers' save_pretrained drops them): importing without MTP layers"]


def test_no_mtp_skips_present_mtp_layers(hf_dir, tmp_path):
    hf = _copy_hf(hf_dir, tmp_path)
    tensors = all_tensors(hf)
    last = "model.layers.2."
    mtp = {k.replace(last, "model.layers.3."): torch.zeros_like(v) for k, v in tensors.items() if k.startswith(last)}
    mtp.update({f"model.layers.3.{n}": torch.ones(64) for n in ("enorm.weight", "hnorm.weight",
                                                                 "shared_head.norm.weight")})
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    mtp["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    mtp["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    add_shard(hf, mtp)
    edit_config(hf, num_nextn_predict_layers=1)
    assert _import(hf, str(tmp_path / "with"))["mtp_layers"] == 1
    lines = []
    summary = import_hf(hf, str(tmp_path / "without"), no_mtp=True, log=lines.append)
    destroy()
    assert summary["mtp_layers"] == 0
    assert f"--no-mtp: skipping the 1 MTP layer(s) ({len(mtp)} tensors)" in lines


def test_invalid_config_json_names_the_file(hf_dir, tmp_path):
    hf = _copy_hf(hf_dir, tmp_path)
    with open(os.path.join(hf, "config.json"), "a") as f:
        f.write("\n}}")
    with pytest.raises(ConversionError, match=rf"{hf}/config.json is not valid JSON: Extra data: line \d+"):
        _import(hf, str(tmp_path / "mg"))
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        f.write("{")
    edit_path = os.path.join(hf, "config.json")
    json.dump(json.load(open(os.path.join(hf_dir, "config.json"))), open(edit_path, "w"))
    with pytest.raises(ConversionError, match=rf"{hf}/model.safetensors.index.json is not valid JSON"):
        _import(hf, str(tmp_path / "mg"))


def test_nan_weights_are_reported_with_tensor_and_file(hf_dir, tmp_path):
    hf = _copy_hf(hf_dir, tmp_path)
    index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))["weight_map"]
    name = "model.layers.1.self_attn.o_proj.weight"
    path = os.path.join(hf, index[name])
    shard = load_file(path)
    shard[name][3, :2] = float("nan")
    save_file(shard, path, metadata={"format": "pt"})
    save = str(tmp_path / "mg")
    with pytest.raises(ConversionError, match=rf"tensor {name} in {path} has 2 NaN/Inf value\(s\)"):
        _import(hf, save)
    assert not os.path.exists(save) or TRACKER not in os.listdir(save)


# ---- 12. preprocess_data: empty input, one speed, long documents -------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    return trained_tokenizer(d, small_corpus(d))


@pytest.mark.parametrize("content, detail", [("", "the file is empty"), ("\n\n", "2 blank lines"),
                                             ('{"text": ""}\n', "1 documents with empty text")])
def test_preprocess_input_without_documents_fails_naming_the_file(tokenizer, tmp_path, content, detail, capsys):
    corpus = tmp_path / "in.jsonl"
    corpus.write_text(content)
    prefix = str(tmp_path / "out")
    tool = load_tool("preprocess_data")
    assert tool.main(["--input", str(corpus), "--output-prefix", prefix, "--tokenizer-model", tokenizer]) == 1
    err = capsys.readouterr().err
    assert f"{corpus}: no documents to write ({detail})" in err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_preprocess_reports_one_throughput(tokenizer, tmp_path, capsys):
    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(50)))
    tool = load_tool("preprocess_data")
    assert tool.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "o"), "--tokenizer-model",
                      tokenizer]) == 0
    out = capsys.readouterr()
    assert (out.out + out.err).count("docs/s") == 1 and (out.out + out.err).count("MB/s") == 1


class _Spy:
    """A tokenizer that records the longest text it was given."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def encode(self, text):
        self.longest = max(self.longest, len(text))
        return self.tok.encode(text)


@pytest.mark.parametrize("kind", ["HFTokenizer", "TikTokenizer"])
def test_long_documents_are_encoded_in_bounded_pieces_with_the_same_ids(tmp_path, kind):
    d = str(tmp_path)
    tok = build_tokenizer(kind, trained_tokenizer(d, small_corpus(d)))
    text = "".join(json.loads(line)["text"] for line in open(small_corpus(d)))[:60_000]
    text += " " + "x" * 5000 + "  two  spaces\n\n\n  indented\tword " + "é" * 10  # runs without boundaries
    spy = _Spy(tok)
    limit = 2048
    ids = pp.encode_bounded(spy, text, limit).tolist()
    assert spy.longest <= limit and len(ids) > 1000
    assert tok.decode(ids) == text  # lossless even where a boundary-free run forces a hard cut
    head = text[: text.index(" " + "x" * 5000)]  # ordinary text: cut only where the pre-tokeniser splits anyway
    assert pp.encode_bounded(tok, head, limit).tolist() == tok.encode(head)


def test_preprocess_one_line_document_larger_than_the_limit(tokenizer, tmp_path):
    corpus = tmp_path / "in.jsonl"
    body = "".join(f"def f{i}(x):\n    return x * {i}  # number {i}\n" for i in range(3000))
    corpus.write_text(json.dumps({"text": body}) + "\n")
    cfg = pp.PreprocessConfig(input=str(corpus), output_prefix=str(tmp_path / "o"), tokenizer_model=tokenizer,
                              max_encode_chars=4096)
    result = pp.preprocess(cfg, progress_stream=io.StringIO())
    tok = build_tokenizer("HFTokenizer", tokenizer)
    assert result.documents == 1 and result.tokens["text"] == len(tok.encode(body))
