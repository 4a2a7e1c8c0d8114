"""The bubblewrap sandbox: each abuse is contained, the host is untouched, and the observation says what happened."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_ext.env.sandbox import BubblewrapConfig, BubblewrapSandbox, Limits, SandboxError, _cgroup_pids

FAST = Limits(cpu_s=5, wall_s=5.0, memory_bytes=1 << 30, processes=64, file_bytes=1 << 20, output_bytes=64 << 10)


@pytest.fixture
def repo(tmp_path):
    src = tmp_path / "repo"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return src


@pytest.fixture
def box(repo, tmp_path):
    sandbox = BubblewrapSandbox(str(repo), BubblewrapConfig(limits=FAST, base_dir=str(tmp_path / "boxes")))
    yield sandbox
    sandbox.close()


def test_copy_is_private_without_git_and_removed_on_close(box, repo):
    r = box.exec("ls -a; echo changed > pkg/mod.py; cat pkg/mod.py; id -u; hostname")
    assert r.ok, r.describe()
    lines = r.output.split()
    assert "pkg" in lines and ".git" not in lines
    assert "changed" in lines and "1000" in lines and "sandbox" in lines
    assert (repo / "pkg" / "mod.py").read_text() == "X = 1\n"  # the source is never modified
    assert box.read_file("pkg/mod.py") == b"changed\n"
    root = box.root
    box.close()
    assert not os.path.exists(root)
    with pytest.raises(SandboxError, match="closed"):
        box.exec("true")


def test_private_tmp_persists_between_commands_and_python_runs(box):
    assert box.exec("echo kept > /tmp/note").ok
    r = box.exec("cat /tmp/note; python -c 'import sys; print(sys.version_info[:2])'")
    assert r.ok, r.describe()
    assert "kept" in r.output and str(tuple(sys.version_info[:2])) in r.output


def test_fork_bomb_is_bounded(box):
    if not box.pids_cgroup and os.geteuid() == 0:
        pytest.skip("no pids cgroup can be made and RLIMIT_NPROC does not bind root: fork bombs are unbounded here")
    r = box.exec("bash -c ':(){ :|:& };:'; sleep 0.5; echo survived", timeout_s=2.0)
    assert "Resource temporarily unavailable" in r.output, r.describe()
    assert all(_cgroup_pids(f) == [] for f in box.cgroups)
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_infinite_loop_hits_the_wall_clock(box):
    r = box.exec("while :; do :; done", timeout_s=1.0)
    assert r.killed == "timeout" and r.exit_code is None
    assert 1.0 <= r.wall_s < 10.0
    assert "wall-clock limit" in r.describe()


def test_cpu_limit(tmp_path, repo):
    limits = Limits(cpu_s=1, wall_s=60.0, memory_bytes=1 << 30, processes=64)
    with BubblewrapSandbox(str(repo), BubblewrapConfig(limits=limits, base_dir=str(tmp_path / "b"))) as box:
        r = box.exec("while :; do :; done")
    assert r.killed is None  # the CPU limit ended it, not the wall clock (a loaded machine may take a while)
    assert r.exit_code in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL), r.describe()
    assert "SIGXCPU" in r.describe() or "SIGKILL" in r.describe()


def test_a_gigabyte_of_output_is_cut_and_killed(box):
    t = time.monotonic()
    r = box.exec("head -c 1000000000 /dev/zero | tr '\\0' x")
    assert r.killed == "output" and len(r.output) == FAST.output_bytes
    assert set(r.output) == {"x"}
    assert time.monotonic() - t < 30.0  # cut at 64 KiB, not after a gigabyte
    assert "output exceeded" in r.describe()


def test_file_size_limit(box):
    r = box.exec("head -c 10000000 /dev/zero > big; echo rc=$?")
    assert "rc=" in r.output and "rc=0" not in r.output
    assert os.path.getsize(os.path.join(box.workspace, "big")) <= FAST.file_bytes


def test_allocating_8_gb_fails(box):
    r = box.exec("python -c 'b = bytearray(8 << 30); print(len(b))'")
    assert r.exit_code not in (0, None) and "MemoryError" in r.output, r.describe()


def test_writing_etc_or_home_fails(box):
    home = os.path.expanduser("~")
    probe = f"megatron_env_probe_{os.getpid()}"
    r = box.exec(f"echo x > /etc/{probe}; echo y > {home}/{probe}; echo z > /{probe}; touch /usr/{probe}; "
                 "echo fine > $HOME/ok; cat $HOME/ok")
    assert r.output.count("Read-only file system") == 4, r.output
    assert "fine" in r.output  # $HOME inside is the private /tmp
    for path in (f"/etc/{probe}", f"{home}/{probe}", f"/{probe}", f"/usr/{probe}"):
        assert not os.path.exists(path)


def test_no_network_to_the_hosts_loopback(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.3)
    port = server.getsockname()[1]
    try:
        r = box.exec(f"bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected'")
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert "connected" not in r.output and "Connection refused" in r.output, r.output
    interfaces = [line.split(":")[0].strip() for line in box.exec("cat /proc/net/dev").output.splitlines()[2:]]
    assert interfaces == ["lo"]


def test_killing_the_parent_and_host_processes_fails(box):
    sentinel = subprocess.Popen(["sleep", "30"])
    try:
        r = box.exec(f"kill -9 {sentinel.pid}; kill -9 $PPID; kill -9 1; kill -9 -1; echo after")
        assert sentinel.poll() is None  # the host process lives
    finally:
        sentinel.kill()
        sentinel.wait()
    assert "after" in r.output and "No such process" in r.output  # the host's pids do not exist inside
    assert box.exec("echo still usable").output.startswith("still usable")


def test_background_processes_do_not_outlive_the_command(box):
    r = box.exec("(sleep 2; echo alive > /workspace/bg1) & "
                 "setsid sh -c 'sleep 2; echo alive > /workspace/bg2' & "
                 "nohup sh -c 'sleep 2; echo alive > /workspace/bg3' >/dev/null 2>&1 & echo started")
    assert r.ok and "started" in r.output and r.wall_s < 2.0  # the command did not wait for its children
    time.sleep(2.5)
    assert not any(os.path.exists(os.path.join(box.workspace, f"bg{i}")) for i in (1, 2, 3))
    assert all(_cgroup_pids(f) == [] for f in box.cgroups)


def test_symlinks_out_of_the_workspace(tmp_path, repo):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret\n")
    os.symlink(str(secret), str(repo / "leak"))  # a repository that ships a symlink out
    with BubblewrapSandbox(str(repo), BubblewrapConfig(limits=FAST, base_dir=str(tmp_path / "b"))) as box:
        r = box.exec(f"ln -s {secret} mine; cat leak mine; echo pwned > leak; echo pwned > mine")
        assert "host secret" not in r.output and "No such file" in r.output
        for name in ("leak", "mine", "../secret.txt", "/etc/passwd"):
            with pytest.raises(SandboxError, match="outside the workspace"):
                box.read_file(name)
            with pytest.raises(SandboxError, match="outside the workspace"):
                box.write_file(name, b"pwned")
    assert secret.read_text() == "host secret\n"


HOST_CRASH = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
    sandbox = importlib.util.module_from_spec(spec); sys.modules["sandbox"] = sandbox
    spec.loader.exec_module(sandbox)
    box = sandbox.BubblewrapSandbox(None, sandbox.BubblewrapConfig(base_dir=sys.argv[2]))
    print(box.root, flush=True)
    box.exec("(sleep 1.5; echo alive > /workspace/late) & sleep 60")
""")


def test_host_crash_kills_the_sandbox_and_the_next_one_sweeps(tmp_path):
    from megatron_ext.env import sandbox as module
    base = str(tmp_path / "b")
    host = subprocess.Popen([sys.executable, "-c", HOST_CRASH, module.__file__, base], stdout=subprocess.PIPE,
                            text=True)
    root = host.stdout.readline().strip()
    time.sleep(0.5)
    host.kill()  # SIGKILL: no finally, no atexit
    host.wait()
    time.sleep(2.0)
    assert os.path.isdir(root) and not os.path.exists(os.path.join(root, "workspace", "late"))
    BubblewrapSandbox(None, BubblewrapConfig(base_dir=base)).close()
    assert not os.path.exists(root) and os.listdir(base) == []


def test_tarball_source(tmp_path, repo):
    import tarfile
    archive = tmp_path / "repo-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(repo, arcname="repo-1.0")
    with BubblewrapSandbox(str(archive), BubblewrapConfig(limits=FAST, base_dir=str(tmp_path / "b"))) as box:
        assert box.read_file("pkg/mod.py") == b"X = 1\n"
        assert sorted(os.listdir(box.workspace)) == ["pkg"]
