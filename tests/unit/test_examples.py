"""The flag files under examples/ parse and validate for the layouts they are written for, and the K2.5 ones use a
layout the planner says fits (with its 10 % headroom) on the cluster they name, close to its fastest."""

import glob
import os
import re

import pytest

from megatron_ext import planning
from megatron_ext.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K25 = sorted(glob.glob(os.path.join(ROOT, "examples", "kimi-k2.5", "*.args")))
SBATCH = os.path.join(ROOT, "examples", "slurm", "composer_stage.sbatch")


def _cluster(path) -> tuple[int, int, str]:
    """(nodes, GPUs per node, GPU) from the file's '# cluster: N nodes x G gpu' line."""
    m = re.search(r"^# cluster: (\d+) nodes x (\d+) (\w+)$", open(path).read(), re.M)
    assert m, f"{path} names no cluster ('# cluster: N nodes x G gpu')"
    return int(m.group(1)), int(m.group(2)), m.group(3)


def _world(path) -> int:
    if os.path.basename(os.path.dirname(path)) == "tiny":
        return 2
    nodes, per_node, _ = _cluster(path)
    return nodes * per_node


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "examples", "*", "*.args"))),
                         ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "examples")))
def test_flag_file_parses(path):
    family = os.path.basename(os.path.dirname(path))
    args = parse_args([f"@{path}", "--dry-run"], world_size=_world(path))
    stage = os.path.basename(path).split("-")[0].split(".")[0]
    assert args.stage == stage
    if family == "kimi-k2.5":
        assert args.arch.num_experts == 384 and args.context_parallel_size >= 2
        # the fast paths Megatron-Core 0.16.1 has for this model (issue 27 item 8)
        assert args.transformer_impl == "transformer_engine"
        assert args.moe_grouped_gemm and args.moe_permute_fusion and args.moe_shared_expert_overlap
        assert args.cross_entropy_loss_fusion and args.moe_token_dispatcher_type == "alltoall"


@pytest.mark.parametrize("path", K25, ids=os.path.basename)
def test_kimi_layout_fits_and_is_near_the_fastest(path):
    nodes, per_node, gpu_name = _cluster(path)
    args = parse_args([f"@{path}", "--dry-run"], world_size=nodes * per_node)
    mtp = args.arch.mtp_num_layers or (0 if args.stage == "pretrain" else 1)  # later stages load MTP layers
    model = args.arch.replace(mtp_num_layers=mtp)
    work = planning.Workload(args.seq_length, args.global_batch_size, args.micro_batch_size,
                             distributed_optimizer=args.use_distributed_optimizer,
                             overlap_dp=args.overlap_grad_reduce)
    gpu = planning.GPUS[gpu_name]
    chosen = planning.estimate(model, planning.layout_of(args), gpu, work)
    assert chosen.fits, f"{path}: {chosen.total_gib:.0f} GiB per GPU of {gpu.memory_gib}"
    best = planning.plan(model, gpu, nodes * per_node, work)[0]
    assert chosen.tokens_per_s >= 0.95 * best.tokens_per_s, (chosen.layout.describe(), best.layout.describe())


def test_sbatch_template_names_the_flag_files_cluster():
    text = open(SBATCH).read()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    per_node = int(re.search(r"^#SBATCH --gpus-per-node=(\d+)$", text, re.M).group(1))
    assert re.search(rf"--nproc-per-node {per_node}\b", text)
    assert {_cluster(p)[:2] for p in K25} == {(nodes, per_node)}
    assert all(_cluster(p)[2].upper() in text for p in K25)


def test_flags_after_a_file_override_it():
    path = os.path.join(ROOT, "examples", "tiny", "pretrain.args")
    args = parse_args([f"@{path}", "--dry-run", "--train-iters", "7"], world_size=1)
    assert args.train_iters == 7 and args.seq_length == 256


def test_sbatch_time_limit_warning_reaches_the_ranks_and_requeues(tmp_path):
    """SLURM's early SIGUSR1 to the batch script (B:) goes on to srun/torchrun, the job waits for the ranks' save
    and requeues itself; torchrun gets a shutdown timeout below the warning and forwards SIGUSR1."""
    import signal
    import subprocess
    import time

    text = open(SBATCH).read()
    lead = int(re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", text, re.M).group(1))
    timeout = int(re.search(r"SHUTDOWN_TIMEOUT:-(\d+)", text).group(1))
    assert 60 + timeout <= lead  # a step's worth of margin between torchrun's SIGKILL and the time limit
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\n[ "$1" = show ] && echo node1 || echo "scontrol $*" >> {log}\n')
    # srun runs the launcher; the launcher stands in for torchrun + ranks: on SIGUSR1 it "saves" and exits 0
    (bin_dir / "srun").write_text(f'#!/bin/bash\nshift\necho "$*" >> {log}\nexec "$@"\n')
    (bin_dir / "torchrun").write_text(f"#!/bin/bash\ntrap 'echo saved >> {log}; exit 0' USR1\n"
                                      "while true; do sleep 0.1; done\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node1",
               SLURM_JOB_NUM_NODES="1", SLURM_JOB_ID="42")
    proc = subprocess.Popen(["bash", SBATCH, "examples/kimi-k2.5/pretrain-32k.args"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for _ in range(100):
        if log.exists() and "torchrun" in log.read_text():
            break
        time.sleep(0.05)
    time.sleep(0.3)  # the trap is set right after srun starts
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    calls = log.read_text().splitlines()
    assert proc.returncode == 0, out
    assert "saving at the next step boundary, then requeueing" in out
    assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in calls[0]
    assert f"--shutdown-timeout {timeout}" in calls[0]
    assert calls[1:] == ["saved", "scontrol requeue 42"]
