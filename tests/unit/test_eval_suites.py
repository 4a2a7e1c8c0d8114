"""Built-in suites: pinned sdists fetched (here from a local folder), verified by sha256, mined once, cached; the
same inputs give the same tasks; clear errors offline, on a wrong file and on an unknown name. The real suite
(network, minutes) is materialized by the slow test at the end."""

from __future__ import annotations

import io
import json
import os
import tarfile

import pytest

from megatron_ext.env.tasks import load_tasks
from megatron_ext.eval import suites

CODE = '''"""Small text helpers."""


def shout(text):
    """Upper case with an exclamation mark."""
    loud = text.upper()
    return loud + "!"


def count_words(text):
    words = text.split()
    return len(words)


def untested(x):
    y = x + 1
    return y
'''
TESTS = '''from texty import count_words, shout


def test_shout():
    assert shout("hi") == "HI!"


def test_count():
    assert count_words("a b  c") == 3


def test_passes_anyway():
    assert 1 + 1 == 2
'''


def _sdist(folder, name="texty", version="0.1") -> tuple[str, str]:
    """A PyPI-style sdist (NAME-VERSION/ top folder) built in the test; returns (filename, sha256)."""
    filename = f"{name}-{version}.tar.gz"
    path = os.path.join(folder, filename)
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for rel, text in ((f"{name}.py", CODE), ("tests/test_texty.py", TESTS), ("setup.py", "")):
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-{version}/{rel}")
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return filename, suites.sha256_file(path)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("sdists"))
    filename, digest = _sdist(folder)
    pin = suites.Sdist("texty", "0.1", digest, filename, max_tasks=5)
    registry = {"texty": suites.Suite("test suite", ((pin, 5),)), "texty-1": suites.Suite("first task", ((pin, 1),))}
    return folder, pin, registry


@pytest.fixture(scope="module")
def built(local, tmp_path_factory):
    folder, _, registry = local
    cache = str(tmp_path_factory.mktemp("cache"))
    return cache, suites.materialize("texty", cache, sdist_dir=folder, suites=registry, log=lambda m: None)


def test_materialize_mines_verified_tasks(built):
    cache, path = built
    assert path == os.path.join(cache, "built", "texty.jsonl")
    tasks = load_tasks(path)  # the environment's own loader: paths resolve, hidden tests outside the repo
    assert [t.id for t in tasks] == ["texty-0.1:texty.py::shout", "texty-0.1:texty.py::count_words"]
    shout = tasks[0]
    assert shout.metadata["fail_to_pass"] == ["tests/test_texty.py::test_shout"]
    assert shout.metadata["reference_diff_lines"] == 3  # episode.diff_lines: the stub out, two body lines in
    assert "raise NotImplementedError" in open(os.path.join(shout.repo, "texty.py")).read()
    assert not os.path.exists(os.path.join(shout.repo, "tests"))
    assert os.path.isfile(os.path.join(shout.hidden_tests, "tests", "test_texty.py"))
    assert os.path.isfile(os.path.join(cache, "sdists", "texty-0.1.tar.gz"))


def test_built_suite_runs_through_the_episode_code(built, tmp_path):
    """The relocated paths work where it matters: an oracle restoring the body scores 1, a no-op 0."""
    from megatron_ext.env.agents import ScriptAgent
    from megatron_ext.env.episode import EpisodeConfig, run_episode
    from megatron_ext.env.sandbox import BubblewrapConfig

    shout = load_tasks(built[1])[0]
    body = '    loud = text.upper()\n    return loud + "!"\n'
    oracle = [{"name": "edit_file", "arguments": {"path": "texty.py", "old_text": "    raise NotImplementedError\n",
                                                  "new_text": body}}]
    config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes")))
    played = run_episode(shout, ScriptAgent(oracle), config)
    assert played.reward["correctness"] == 1.0
    assert played.grading["diff_lines"] == shout.metadata["reference_diff_lines"]  # ratio 1.0 for the oracle
    assert run_episode(shout, ScriptAgent([]), config).reward["correctness"] == 0.0


def test_cached_builds_are_offline_and_do_not_mine_again(built, local, monkeypatch):
    cache, path = built
    _, _, registry = local
    before = open(path).read()
    monkeypatch.setenv("MEGATRON_EXT_OFFLINE", "1")
    monkeypatch.delenv("MEGATRON_EXT_SDIST_DIR", raising=False)

    def no_mining(*a, **k):
        raise AssertionError("mined again")

    monkeypatch.setattr("megatron_ext.env.mining.Miner.mine", no_mining)
    assert suites.materialize("texty", cache, suites=registry, log=lambda m: None) == path
    assert open(path).read() == before
    # a smaller suite over the same package takes its first tasks from the same mining
    first = suites.materialize("texty-1", cache, suites=registry, log=lambda m: None)
    assert [t.id for t in load_tasks(first)] == ["texty-0.1:texty.py::shout"]


def test_same_inputs_same_tasks(built, local, tmp_path):
    folder, _, registry = local
    again = suites.materialize("texty", str(tmp_path / "other"), sdist_dir=folder, suites=registry,
                               log=lambda m: None)
    assert open(again).read() == open(built[1]).read()


def test_statistics(built):
    stats = suites.statistics_of(built[1])
    assert stats["packages"] == {"texty-0.1": {"tasks": 2, "median_changed_lines": 3,
                                               "median_instruction_chars": stats["overall"]["median_instruction_chars"]}}
    tasks = [json.loads(line) for line in open(built[1])]
    assert stats["overall"]["median_instruction_chars"] == sum(len(t["instruction"]) for t in tasks) / 2
    assert stats["cursorbench"] == {"median_changed_lines": 181, "median_instruction_chars": 390}
    table = suites.markdown("texty", stats)
    assert "| texty-0.1 | 2 | 3 |" in table and "| CursorBench (report) | - | 181 | 390 |" in table


def test_wrong_file_is_refused(local, tmp_path):
    _, pin, _ = local
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / pin.filename).write_bytes(b"not the release")
    with pytest.raises(suites.SuiteError, match="does not match the pinned " + pin.sha256):
        suites.fetch(pin, str(tmp_path / "cache"), sdist_dir=str(bad), log=lambda m: None)
    assert not os.path.exists(tmp_path / "cache" / "sdists" / pin.filename)


def test_offline_and_not_cached(local, tmp_path, monkeypatch):
    _, pin, registry = local
    monkeypatch.setenv("MEGATRON_EXT_OFFLINE", "1")
    monkeypatch.delenv("MEGATRON_EXT_SDIST_DIR", raising=False)
    with pytest.raises(suites.SuiteError) as e:
        suites.materialize("texty", str(tmp_path), suites=registry, log=lambda m: None)
    message = str(e.value)
    assert "texty-0.1.tar.gz" in message and "MEGATRON_EXT_SDIST_DIR" in message and pin.sha256 in message
    assert "pip download --no-deps --no-binary :all: texty==0.1" in message


def test_unknown_suite(tmp_path):
    with pytest.raises(suites.SuiteError, match="no built-in suite 'nope'.*pypi-small"):
        suites.materialize("nope", str(tmp_path))


def test_pins_are_well_formed():
    for suite in suites.SUITES.values():
        for sdist, take in suite.packages:
            assert len(sdist.sha256) == 64 and int(sdist.sha256, 16) >= 0
            assert sdist.filename.endswith(f"-{sdist.version}.tar.gz") and 1 <= take <= sdist.max_tasks


@pytest.mark.slow
def test_real_suite_materializes(tmp_path):
    """The pinned PyPI sdists (network unless cached in $MEGATRON_EXT_SDIST_DIR), mined here: the counts and
    statistics docs/eval-suites.md reports."""
    path = suites.materialize("pypi-small", str(tmp_path), log=lambda m: None)
    stats = suites.statistics_of(path)
    counts = {k: v["tasks"] for k, v in stats["packages"].items()}
    assert counts == {"cachetools-8.0.2": 8, "inflection-0.5.1": 8, "six-1.17.0": 4, "toolz-1.2.0": 8}
    assert len(load_tasks(path)) == 28
