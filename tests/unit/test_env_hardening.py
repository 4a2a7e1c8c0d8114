"""Sandbox hardening (issue 23): the host's secrets, root-only files and kernel interfaces stay out of reach, and
memory and disk are bounded for the sandbox as a whole, not per process."""

from __future__ import annotations

import argparse
import os

import pytest

from megatron_ext.env import sandbox as sandbox_module
from megatron_ext.env.arguments import add_env_args, episode_config
from megatron_ext.env.sandbox import BubblewrapConfig, BubblewrapSandbox, Limits, SandboxError, sandbox_line

FAST = Limits(cpu_s=10, wall_s=20.0, memory_bytes=512 << 20, processes=64, file_bytes=1 << 20,
              output_bytes=64 << 10, disk_bytes=16 << 20, cpus=1.0)
ROOT = os.geteuid() == 0


@pytest.fixture
def box(tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "a.py").write_text("A = 1\n")
    sandbox = BubblewrapSandbox(str(tmp_path / "repo"), BubblewrapConfig(limits=FAST, base_dir=str(tmp_path / "b")))
    yield sandbox
    sandbox.close()


def test_planted_secret_is_not_visible_inside(monkeypatch, tmp_path):
    monkeypatch.setenv("PLANTED_HF_TOKEN", "hf_planted_secret_value")
    with BubblewrapSandbox(None, BubblewrapConfig(limits=FAST, base_dir=str(tmp_path / "b"))) as box:
        r = box.exec("env; echo ---; tr '\\0' '\\n' < /proc/1/environ; echo ---; tr '\\0' '\\n' < /proc/self/environ; "
                     "for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ; done 2>/dev/null; echo end")
        init = box.exec("tr '\\0' '\\n' < /proc/1/environ")
    assert "end" in r.output and "PATH=" in r.output, r.describe()  # environments were read
    assert "hf_planted_secret_value" not in r.output and "PLANTED_HF_TOKEN" not in r.output
    assert init.ok and set(init.output.split()) <= {"PWD=/"}, init.output  # bwrap (PID 1) got nothing of ours


@pytest.mark.skipif(not ROOT, reason="root-only files matter when the trainer runs as root")
def test_root_only_files_are_unreadable_when_the_host_is_root(tmp_path):
    bound = tmp_path / "bound"
    bound.mkdir()
    secret = bound / "key"
    secret.write_text("root-only key material\n")
    os.chmod(secret, 0o600)
    config = BubblewrapConfig(limits=FAST, base_dir=str(tmp_path / "b"), ro_binds=(str(bound),))
    with BubblewrapSandbox(None, config) as box:
        r = box.exec(f"cat {secret}; cat /etc/shadow; ls {bound}; echo uid=$(id -u)")
        assert "host uid 65534 (not root)" in box.enforced
    assert "key" in r.output.split() and "uid=1000" in r.output, r.describe()  # the file is there, not readable
    assert "root-only key material" not in r.output and "root:" not in r.output
    assert r.output.count("Permission denied") == 2


def test_nested_user_namespaces_and_mounts_are_refused(box):
    r = box.exec("unshare -Urm sh -c 'mount -t tmpfs none /tmp && echo mounted-in-userns'; "
                 "unshare -m true && echo unshared-mount-ns; "
                 "python -c 'import os; os.unshare(os.CLONE_NEWUSER); print(\"python-unshared\")'; "
                 "mount -t tmpfs none /tmp && echo mounted; echo end")
    assert "end" in r.output, r.describe()
    for success in ("mounted-in-userns", "unshared-mount-ns", "python-unshared", "\nmounted"):
        assert success not in r.output, r.describe()
    assert "Operation not permitted" in r.output
    assert "no nested user namespaces" in box.enforced and "seccomp" in box.enforced


PTRACE = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
          "r = libc.ptrace(16, 1, 0, 0); print('ptrace', r, os.strerror(ctypes.get_errno())); "
          "r = libc.syscall(250, 0, 0, 0, 0, 0); print('keyctl', r, os.strerror(ctypes.get_errno())); "
          "r = libc.syscall(321, 0, 0, 0); print('bpf', r, os.strerror(ctypes.get_errno()))")


def test_ptrace_of_pid_1_and_other_kernel_interfaces_are_refused(box):
    import platform
    if platform.machine() != "x86_64":
        pytest.skip("the syscall numbers below are x86_64's")
    r = box.exec(f"python -c \"{PTRACE}\"")
    assert r.ok, r.describe()
    assert r.output.splitlines() == ["ptrace -1 Operation not permitted", "keyctl -1 Operation not permitted",
                                     "bpf -1 Operation not permitted"]


MEMORY_HOG = ("for i in 1 2 3 4; do python -c 'import time; b = b\"x\" * (300 << 20); time.sleep(6); "
              "print(\"held\", len(b))' & done; wait; echo end")


def test_memory_is_bounded_for_the_sandbox_in_total(box):
    assert "memory 0.5 GiB total (cgroup)" in box.enforced
    r = box.exec(MEMORY_HOG, timeout_s=60)
    assert "end" in r.output, r.describe()
    # 4 x 300 MB, each under the per-process 512 MiB: all four used to be held at once (1.2 GB)
    assert r.output.count("held") <= 1, r.describe()


def test_disk_is_bounded_for_the_episode_in_total(box):
    r = box.exec("for i in $(seq 1 40); do head -c 1000000 /dev/zero > f$i 2>/dev/null || { echo full at $i; break; };"
                 " done; head -c 1000000 /dev/zero > /tmp/t 2>/dev/null || echo tmp full; "
                 "python -c \"\nimport os\nn = 0\ntry:\n    while True:\n        open(f'e{n}', 'w').close(); n += 1\n"
                 "except OSError as e:\n    print('empty files', n, e.strerror)\"", timeout_s=60)
    assert "full at" in r.output and "tmp full" in r.output, r.describe()
    full_at = int(r.output.split("full at ")[1].split()[0])
    assert full_at <= 17  # 1 MB files into 16 MiB
    files = int(r.output.split("empty files ")[1].split()[0])
    assert files < 20000 and "No space left on device" in r.output
    used = sum(os.path.getsize(os.path.join(box.workspace, f)) for f in os.listdir(box.workspace))
    assert used <= FAST.disk_bytes


def test_a_limit_that_cannot_be_enforced_refuses_the_sandbox(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox_module, "_cgroup_parents", lambda: ({}, False))
    config = BubblewrapConfig(limits=FAST, base_dir=str(tmp_path / "b"))
    with pytest.raises(SandboxError) as e:
        BubblewrapSandbox(None, config)
    assert "--env-memory-gb" in str(e.value) and "--env-cpus" in str(e.value) and \
        "--env-allow-weaker-sandbox" in str(e.value)
    assert os.listdir(tmp_path / "b") == []  # nothing left behind
    weaker = BubblewrapConfig(limits=FAST, base_dir=str(tmp_path / "b"), allow_weaker=True)
    line = sandbox_line(weaker)
    assert "NOT enforced" in line and "memory: no memory cgroup controller" in line
    with BubblewrapSandbox(None, weaker) as box:
        assert box.exec("echo runs").output == "runs\n"


def test_flags_configure_the_totals_and_print_what_is_enforced(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_env_args(p)
    args = p.parse_args(["--env-memory-gb", "2", "--env-disk-gb", "0.5", "--env-cpus", "1.5",
                         "--env-sandbox-dir", str(tmp_path)])
    limits = episode_config(args).sandbox.limits
    assert (limits.memory_bytes, limits.disk_bytes, limits.cpus) == (2 << 30, 512 << 20, 1.5)
    line = capsys.readouterr().err
    assert line.startswith("sandbox: enforced ") and "disk 0.5 GiB (tmpfs)" in line and "memory 2 GiB total" in line
    with pytest.raises(ValueError, match="--env-disk-gb must be >= 0"):
        episode_config(p.parse_args(["--env-disk-gb", "-1"]))
