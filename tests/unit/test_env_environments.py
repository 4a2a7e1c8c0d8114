"""Per-task environments (issue 28, item 1): a package whose test extra names a dependency the harness lacks mines
a verified task only with its own environment, built offline from a local wheel directory, and the agent's
commands and grading then run with that environment's python."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zipfile

import pytest

from megatron_ext.env.agents import ScriptAgent
from megatron_ext.env.environments import EnvConfig, environment_info, requirements_for_tests
from megatron_ext.env.episode import EpisodeConfig, run_episode
from megatron_ext.env.mining import MineConfig, Miner, write_tasks
from megatron_ext.env.sandbox import BubblewrapConfig
from megatron_ext.env.tasks import load_tasks

DEP = "megatron_tinydep"  # a name no index or harness has


def make_wheel(folder, name: str, version: str, files: dict) -> str:
    """A pure-Python wheel written by hand (no build backend, no network)."""
    os.makedirs(folder, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {**files, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(t.encode())}" for p, t in files.items()] + [f"{dist}/RECORD,,"]
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        for p, t in files.items():
            z.writestr(p, t)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path


def make_package(root):
    (root / "usesdep").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pyproject.toml").write_text(f'[project]\nname = "usesdep"\nversion = "1.0"\n\n'
                                         f'[project.optional-dependencies]\ntest = ["{DEP}>=1.0"]\n')
    (root / "usesdep" / "__init__.py").write_text(
        "def scaled(x):\n    from megatron_tinydep import FACTOR\n    return x * FACTOR\n")
    (root / "tests" / "test_scaled.py").write_text(
        "from usesdep import scaled\n\n\ndef test_scaled():\n    assert scaled(3) == 21\n")


def test_requirements_from_extras_files_tox_and_addopts(tmp_path):
    (tmp_path / "setup.cfg").write_text("[metadata]\nname = pkg\n[options]\ninstall_requires =\n    six\n"
                                        "[tool:pytest]\naddopts = --cov=pkg -p xdist\n")
    (tmp_path / "requirements-test.txt").write_text("# test deps\n-r more.txt\nhypothesis>=6 ; python_version>'3'\n"
                                                    "-e .\n")
    (tmp_path / "more.txt").write_text("attrs\nsix==1.16\n")
    (tmp_path / "tox.ini").write_text("[testenv]\ndeps =\n    mock\n    py27: pathlib2\n    {toxinidir}\n"
                                      "[pytest]\naddopts = --timeout=10\n")
    (tmp_path / "setup.py").write_text("from setuptools import setup\nsetup(name='pkg', install_requires=['six'],"
                                       " extras_require={'test': ['pytest-mock'], 'docs': ['sphinx']})\n")
    reqs, sources = requirements_for_tests(str(tmp_path))
    assert reqs == ["six", "pytest-cov", "pytest-xdist", "pytest-mock", "attrs", "hypothesis>=6", "mock",
                    "pytest-timeout"], reqs
    assert "tox.ini [testenv] deps" in sources and "setup.cfg [tool:pytest] addopts" in sources


def test_mining_builds_an_offline_environment_and_episodes_use_it(tmp_path):
    source = tmp_path / "usesdep-1.0"
    make_package(source)
    wheels = tmp_path / "wheels"
    make_wheel(str(wheels), DEP, "1.0", {f"{DEP}/__init__.py": "FACTOR = 7\n"})
    sandbox = BubblewrapConfig(base_dir=str(tmp_path / "boxes"))
    out = tmp_path / "suite"
    # without its environment the reference suite cannot import the dependency: no task, the reason says why
    tasks, skipped = Miner(MineConfig(sandbox=sandbox), log=lambda m: None).mine(str(source), str(out))
    assert tasks == [] and f"missing: {DEP}" in skipped[0][1], skipped
    env = EnvConfig(str(tmp_path / "envs"), wheel_dir=str(wheels), offline=True)
    tasks, skipped = Miner(MineConfig(sandbox=sandbox, env=env), log=lambda m: None).mine(
        str(source), str(out), task_base=str(tmp_path))
    assert [t["id"] for t in tasks] == ["usesdep-1.0:usesdep/__init__.py::scaled"], skipped
    assert tasks[0]["metadata"]["fail_to_pass"] == ["tests/test_scaled.py::test_scaled"]
    folder = os.path.join(tmp_path, tasks[0]["environment"])
    assert environment_info(folder)["requirements"] == [f"{DEP}>=1.0"]
    assert os.path.isdir(os.path.join(folder, "lib", "python3.11", "site-packages", DEP))
    write_tasks(str(tmp_path / "suite.jsonl"), tasks)
    task = load_tasks(str(tmp_path / "suite.jsonl"))[0]
    assert task.environment == folder
    # the agent's commands and grading run with the environment's python (the harness has no such module)
    fix = "def scaled(x):\n    from megatron_tinydep import FACTOR\n    return x * FACTOR\n"
    config = EpisodeConfig(sandbox=sandbox, grading_cache_dir=str(tmp_path / "expected"))
    r = run_episode(task, ScriptAgent([
        {"name": "run_command", "arguments": {"command": f"python -c 'import {DEP}, sys; print(sys.prefix)'"}},
        {"name": "write_file", "arguments": {"path": "usesdep/__init__.py", "content": fix}}]), config)
    assert r.reward["correctness"] == 1.0 and r.grading["mode"] == "pytest ids", r.grading
    assert folder in json.dumps(r.messages), "the agent's python is not the environment's"
    wrong = run_episode(task, ScriptAgent([]), config)
    assert wrong.reward["correctness"] == 0.0


def test_offline_build_without_the_wheel_names_pip_output(tmp_path):
    from megatron_ext.env.environments import EnvBuildError, build_environment
    (tmp_path / "wheels").mkdir()
    with pytest.raises(EnvBuildError, match="megatron-nonexistent-dep"):
        build_environment(["megatron-nonexistent-dep"], EnvConfig(str(tmp_path / "envs"), str(tmp_path / "wheels"),
                                                                 offline=True))
    assert os.listdir(tmp_path / "envs") == []


@pytest.mark.slow
@pytest.mark.parametrize("package, needs", [("isodate==0.6.1", "six"), ("wcwidth==0.2.13", "pytest-cov==4.1.0")])
def test_real_packages_mine_with_their_environments(tmp_path, package, needs):
    """Network (PyPI): the two packages that mined 0 tasks with the harness's packages mine verified tasks with
    their own environments, the reference patch grades correct, and the environment rebuilds offline from the
    wheel directory. docs/design-notes.md (issue 28, item 1) has the figures of one run."""
    import subprocess
    import sys
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps", package,
                    "-d", str(tmp_path / "sdists")], check=True)
    [sdist] = os.listdir(tmp_path / "sdists")
    sandbox = BubblewrapConfig(base_dir=str(tmp_path / "boxes"))
    for offline in (False, True):
        env = EnvConfig(str(tmp_path / f"envs-{offline}"), wheel_dir=str(tmp_path / "wheels"), offline=offline)
        tasks, skipped = Miner(MineConfig(sandbox=sandbox, env=env, max_tasks=2), log=lambda m: None).mine(
            str(tmp_path / "sdists" / sdist), str(tmp_path / f"out-{offline}"), task_base=str(tmp_path))
        assert len(tasks) == 2, skipped
        assert needs in environment_info(os.path.join(tmp_path, tasks[0]["environment"]))["requirements"]
    write_tasks(str(tmp_path / "suite.jsonl"), tasks)
    task = load_tasks(str(tmp_path / "suite.jsonl"))[0]
    patch = task.metadata["reference_diff"]
    r = run_episode(task, ScriptAgent([{"name": "run_command", "arguments": {
        "command": "cat > /tmp/ref.patch << 'EOF'\n" + patch + "EOF\npatch -p1 < /tmp/ref.patch"}}]),
        EpisodeConfig(sandbox=sandbox))
    assert r.reward["correctness"] == 1.0, r.grading
