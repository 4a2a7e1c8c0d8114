"""Per-task test environments: the packages a repository's tests need, in a cached virtual environment that the
sandbox runs the agent's commands and grading with.

Why: a suite run with the harness's own interpreter sees whatever the harness happens to have installed. isodate
0.6.1 imports six and wcwidth 0.2.13's tox.ini addopts names ``--cov`` (pytest-cov): both mined 0 tasks because
the harness lacked them, not because their tests were unusable.

`requirements_for_tests(root)` reads what a source checkout says its tests need: the runtime dependencies
(``project.dependencies``, ``install_requires``), the test/dev extras and PEP 735 groups (pyproject.toml,
setup.cfg, setup.py literals), requirements files (requirements-test.txt, test-requirements.txt, ...), tox.ini
``[testenv] deps`` without factor conditions, and the pytest plugins an ``addopts`` needs (``--cov`` ->
pytest-cov, ``-p xdist`` -> pytest-xdist, ...). The package itself is never installed: the tests import the
workspace's copy, which is what the agent edits.

`build_environment(requirements, config)` makes ``ENV_DIR/<key>`` (key: a hash of the normalised requirements and
the interpreter's version) once: ``python -m venv --without-pip``, then the harness's pip installs into it
(``pip --python``). With a wheel directory, pip first puts wheels of everything into it (``pip wheel``: an
sdist-only dependency is built once, so no build backend is needed later) and then installs with ``--no-index
--find-links`` only from it, so the same environment can be rebuilt offline (``offline``: skip the download).
When the requirements bring no pytest, the harness's pytest and its dependencies are linked in (symlinks to the
harness's site-packages, bound read-only into the sandbox with the environment): the grader needs pytest, and
nothing else of the harness leaks in. The folder appears by rename only when complete; a failed build raises
`EnvBuildError` with pip's output tail.

`sandbox_for(config, environment)` is the sandbox configuration whose interpreter is the environment's.
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from typing import Optional

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

ENV_VERSION = 1
ENV_FILE = "megatron-environment.json"
EXTRAS = ("test", "tests", "testing", "dev")
REQUIREMENT_FILES = ("requirements-test.txt", "requirements-tests.txt", "requirements_test.txt",
                     "test-requirements.txt", "requirements_for_tests.txt", "requirements-dev.txt",
                     "dev-requirements.txt", "requirements/test.txt", "requirements/tests.txt",
                     "requirements/dev.txt")
ADDOPTS_PLUGINS = {"--cov": "pytest-cov", "--timeout": "pytest-timeout", "-n": "pytest-xdist",
                   "--numprocesses": "pytest-xdist", "--benchmark": "pytest-benchmark", "--mypy": "pytest-mypy",
                   "--flake8": "pytest-flake8", "--doctest-rst": "pytest-doctestplus",
                   "--doctest-plus": "pytest-doctestplus", "--reruns": "pytest-rerunfailures",
                   "--randomly": "pytest-randomly", "--asyncio-mode": "pytest-asyncio"}
P_PLUGINS = {"xdist": "pytest-xdist", "pytest_cov": "pytest-cov", "cov": "pytest-cov",
             "pytest_timeout": "pytest-timeout", "timeout": "pytest-timeout", "asyncio": "pytest-asyncio",
             "pytest_asyncio": "pytest-asyncio", "pytest_mock": "pytest-mock"}


class EnvBuildError(RuntimeError):
    """An environment could not be built; the message names the requirements and ends with pip's output."""


# ---- what the tests need ----------------------------------------------------------------------------------
def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _lines(text: str) -> list[str]:
    return [line.split(" #")[0].strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _requirement_file(root: str, rel: str, seen: set) -> list[str]:
    path = os.path.normpath(os.path.join(root, rel))
    if path in seen or not os.path.isfile(path):
        return []
    seen.add(path)
    out = []
    for line in _lines(_read(path)):
        if line.startswith(("-r ", "--requirement ", "-c ", "--constraint ")):
            if line.startswith(("-r", "--requirement")):
                out += _requirement_file(os.path.dirname(path), line.split(None, 1)[1], seen)
        elif not line.startswith("-"):
            out.append(line)
    return out


def _addopts_plugins(addopts) -> list[str]:
    if isinstance(addopts, list):
        addopts = " ".join(addopts)
    try:
        words = shlex.split(addopts or "")
    except ValueError:
        words = (addopts or "").split()
    out = []
    for i, word in enumerate(words):
        flag = word.split("=")[0]
        # a plugin's long options share its prefix: --cov-report, --cov-append are pytest-cov's
        owner = ADDOPTS_PLUGINS.get(flag) or next((v for k, v in ADDOPTS_PLUGINS.items()
                                                   if k.startswith("--") and flag.startswith(f"{k}-")), None)
        if owner:
            out.append(owner)
        elif word == "-p" and i + 1 < len(words) and not words[i + 1].startswith("no:"):
            out.append(P_PLUGINS.get(words[i + 1], words[i + 1].replace("_", "-")))
    return out


def _ini(path: str) -> Optional[configparser.RawConfigParser]:
    if not os.path.isfile(path):
        return None
    parser = configparser.RawConfigParser()
    try:
        parser.read(path, encoding="utf-8")
    except configparser.Error:
        return None
    return parser


def _setup_py(path: str) -> list[str]:
    """install_requires, tests_require and the test extras of a setup() call, where they are literals."""
    try:
        tree = ast.parse(_read(path))
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                try:
                    value = ast.literal_eval(kw.value)
                except ValueError:
                    continue
                if kw.arg in ("install_requires", "tests_require") and isinstance(value, (list, tuple)):
                    out += [v for v in value if isinstance(v, str)]
                elif kw.arg == "extras_require" and isinstance(value, dict):
                    for extra in EXTRAS:
                        v = value.get(extra, [])
                        out += [v] if isinstance(v, str) else [x for x in v if isinstance(x, str)]
    return out


def requirements_for_tests(root: str) -> tuple[list[str], list[str]]:
    """(requirements, where each group came from) for the tests of the source at root; deduplicated by name
    (the first spelling wins), markers evaluated for this interpreter, the package itself left out."""
    found: list[tuple[str, str]] = []
    own = set()
    pyproject = os.path.join(root, "pyproject.toml")
    if os.path.isfile(pyproject):
        try:
            data = tomllib.loads(_read(pyproject))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            data = {}
        project = data.get("project", {})
        if project.get("name"):
            own.add(canonicalize_name(project["name"]))
        found += [(r, "pyproject.toml [project] dependencies") for r in project.get("dependencies", [])]
        for extra in EXTRAS:
            found += [(r, f"pyproject.toml extra '{extra}'") for r in
                      project.get("optional-dependencies", {}).get(extra, [])]
            found += [(r, f"pyproject.toml group '{extra}'") for r in data.get("dependency-groups", {}).get(extra, [])
                      if isinstance(r, str)]
        found += [(r, "pyproject.toml [tool.pytest.ini_options] addopts") for r in
                  _addopts_plugins(data.get("tool", {}).get("pytest", {}).get("ini_options", {}).get("addopts"))]
    cfg = _ini(os.path.join(root, "setup.cfg"))
    if cfg:
        if cfg.has_option("metadata", "name"):
            own.add(canonicalize_name(cfg.get("metadata", "name")))
        if cfg.has_option("options", "install_requires"):
            found += [(r, "setup.cfg install_requires") for r in _lines(cfg.get("options", "install_requires"))]
        for extra in EXTRAS:
            if cfg.has_option("options.extras_require", extra):
                found += [(r, f"setup.cfg extra '{extra}'") for r in
                          _lines(cfg.get("options.extras_require", extra))]
        if cfg.has_option("tool:pytest", "addopts"):
            found += [(r, "setup.cfg [tool:pytest] addopts") for r in _addopts_plugins(cfg.get("tool:pytest",
                                                                                               "addopts"))]
    if os.path.isfile(os.path.join(root, "setup.py")):
        found += [(r, "setup.py") for r in _setup_py(os.path.join(root, "setup.py"))]
    for rel in REQUIREMENT_FILES:
        found += [(r, rel) for r in _requirement_file(root, rel, set())]
    tox = _ini(os.path.join(root, "tox.ini"))
    if tox:
        if tox.has_option("testenv", "deps"):
            for line in _lines(tox.get("testenv", "deps")):
                if line.startswith("-r"):
                    found += [(r, "tox.ini deps") for r in _requirement_file(root, line[2:].strip(), set())]
                elif "{" not in line and not re.match(r"^[\w,.!-]+:\s", line):  # factor-conditional lines differ
                    found.append((line, "tox.ini [testenv] deps"))
        if tox.has_option("pytest", "addopts"):
            found += [(r, "tox.ini [pytest] addopts") for r in _addopts_plugins(tox.get("pytest", "addopts"))]
    ini = _ini(os.path.join(root, "pytest.ini"))
    if ini and ini.has_option("pytest", "addopts"):
        found += [(r, "pytest.ini addopts") for r in _addopts_plugins(ini.get("pytest", "addopts"))]
    marker_env = default_environment()
    requirements, sources, names = [], [], set()
    for text, where in found:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        name = canonicalize_name(req.name)
        if name in names or name in own or req.url or (req.marker and not req.marker.evaluate(marker_env)):
            continue
        names.add(name)
        req.marker = None
        requirements.append(str(req))
        if where not in sources:
            sources.append(where)
    return requirements, sources


# ---- building ---------------------------------------------------------------------------------------------
@dataclass
class EnvConfig:
    root: str                            # where environments are cached, one folder per key
    wheel_dir: Optional[str] = None      # wheel cache: downloaded into, then installed from only
    offline: bool = False                # install from wheel_dir only, download nothing
    python: str = sys.executable         # the interpreter the environments are made from
    timeout_s: float = 900.0


def env_key(requirements: list[str], python: str = sys.executable) -> str:
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True,
                             text=True).stdout.strip()
    text = f"v{ENV_VERSION}\0{version}\0" + "\n".join(sorted(set(requirements)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _site_packages(venv: str) -> str:
    return sysconfig.get_path("purelib", "venv", vars={"base": venv, "platbase": venv})


def _pip(config: EnvConfig, args: list[str], what: str):
    r = subprocess.run([config.python, "-m", "pip", "--disable-pip-version-check", "--no-input", *args],
                       capture_output=True, text=True, timeout=config.timeout_s)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).rstrip().splitlines()[-15:])
        raise EnvBuildError(f"{what} failed (pip exit {r.returncode}); the end of pip's output:\n{tail}")


def _pytest_closure() -> list[importlib.metadata.Distribution]:
    """pytest and the distributions it requires here, as installed in the harness."""
    marker_env = default_environment()
    out, todo, seen = [], ["pytest"], set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        out.append(dist)
        for text in dist.requires or []:
            req = Requirement(text)
            if not req.marker or req.marker.evaluate({**marker_env, "extra": ""}):
                todo.append(req.name)
    return out


def _link_pytest(venv: str) -> list[str]:
    """Link the harness's pytest (and what it requires) into venv's site-packages; the host folders linked
    into (to bind read-only in the sandbox)."""
    site = _site_packages(venv)
    if any(n.lower().startswith("pytest-") and n.endswith(".dist-info") for n in os.listdir(site)):
        return []
    folders = set()
    for dist in _pytest_closure():
        for top in sorted({str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}):
            source = os.path.abspath(str(dist.locate_file(top)))
            target = os.path.join(site, top)
            if os.path.exists(source) and not os.path.lexists(target):
                os.symlink(source, target)
                folders.add(os.path.dirname(source))
    return sorted(folders)


def _readable_by_all(folder: str):
    """The sandbox may run as another host uid (root trainers): whatever the umask was, it must read and run the
    environment (our own tree, built just now: a plain walk is safe)."""
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(top, name)
            if not os.path.islink(path):
                mode = os.stat(path).st_mode
                extra = 0o555 if stat.S_ISDIR(mode) or mode & 0o100 else 0o444
                os.chmod(path, stat.S_IMODE(mode) | extra)
    os.chmod(folder, stat.S_IMODE(os.stat(folder).st_mode) | 0o555)


def build_environment(requirements: list[str], config: EnvConfig, log=print) -> str:
    """The environment's folder (built now, or found in the cache)."""
    key = env_key(requirements, config.python)
    path = os.path.join(os.path.abspath(config.root), key)
    if os.path.isfile(os.path.join(path, ENV_FILE)):
        return path
    if config.offline and requirements and not config.wheel_dir:
        raise EnvBuildError(f"offline: no wheel directory to install {requirements} from (--wheel-dir)")
    os.makedirs(config.root, exist_ok=True)
    tmp = os.path.join(os.path.abspath(config.root), f".{key}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        r = subprocess.run([config.python, "-m", "venv", "--without-pip", tmp], capture_output=True, text=True)
        if r.returncode != 0:
            raise EnvBuildError(f"python -m venv failed: {r.stderr.strip()[-500:]}")
        python = os.path.join(tmp, "bin", "python")
        if requirements:
            what = f"installing {requirements}"
            if config.wheel_dir:
                if not config.offline:
                    _pip(config, ["wheel", "-q", "-w", config.wheel_dir, *requirements],
                         f"downloading (or building) wheels of {requirements} into {config.wheel_dir}")
                _pip(config, ["--python", python, "install", "-q", "--no-index", "--find-links", config.wheel_dir,
                              *requirements], what + f" from {config.wheel_dir}")
            else:
                _pip(config, ["--python", python, "install", "-q", *requirements], what)
        linked = _link_pytest(tmp)
        with open(os.path.join(tmp, ENV_FILE), "w") as f:
            json.dump({"version": ENV_VERSION, "key": key, "requirements": sorted(requirements),
                       "linked_from": linked}, f, indent=1)
        _readable_by_all(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process finished the same environment first
            if not os.path.isfile(os.path.join(path, ENV_FILE)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"environment {key}: {len(requirements)} requirements ({', '.join(requirements) or 'none'})")
    return path


def environment_info(environment: str) -> dict:
    with open(os.path.join(environment, ENV_FILE)) as f:
        return json.load(f)


def sandbox_for(config, environment: Optional[str]):
    """config (a BubblewrapConfig) with the environment's interpreter, and the folders its links point into bound
    read-only; config itself when environment is None."""
    if not environment:
        return config
    linked = tuple(environment_info(environment).get("linked_from", []))
    return dataclasses.replace(config, python=os.path.join(environment, "bin", "python"),
                               ro_binds=tuple(config.ro_binds) + linked)
