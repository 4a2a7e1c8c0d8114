"""pretrain_composer.py's loop on one rank: resume, checkpoint integrity, NaN skipping, SIGTERM, schedules."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import pretrain_composer as entry
from megatron_ext.arguments import parse_args
from megatron_ext.training import checkpointing
from megatron_ext.training.checkpointing import CheckpointError, checkpoint_dir, read_tracker
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_scheduler, setup_model_and_optimizer, train_step
from tests.tb import scalars

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
        "--seq-length", "32", "--log-interval", "4"]


def run(tmp_path, name, *flags):
    tb = str(tmp_path / f"tb_{name}")
    code = entry.main(TINY + ["--tensorboard-dir", tb, *flags])
    return code, scalars(tb) if os.path.isdir(tb) else {}


def test_resume_is_bit_exact(tmp_path):
    save = str(tmp_path / "ckpt")
    common = ["--train-iters", "8", "--lr-warmup-iters", "2", "--eval-interval", "4", "--eval-iters", "1"]
    code, full = run(tmp_path, "full", *common)
    assert code == 0
    code, _ = run(tmp_path, "first", *common, "--save", save, "--save-interval", "4", "--exit-interval", "4")
    assert code == 0 and read_tracker(save) == 4
    code, resumed = run(tmp_path, "resumed", *common, "--save", save, "--load", save, "--save-interval", "4")
    assert code == 0 and read_tracker(save) == 8
    for tag in ("lm loss", "mtp_1 loss", "seq_load_balancing_loss", "grad-norm", "learning-rate"):
        assert sorted(resumed[tag]) == [5, 6, 7, 8]
        for step in (5, 6, 7, 8):
            assert resumed[tag][step] == full[tag][step], (tag, step)
    assert resumed["lm loss validation"][8] == full["lm loss validation"][8]
    assert full["lm loss"][8] < full["lm loss"][1]


def test_kill_dash_nine_then_resume_continues_exactly(tmp_path):
    save, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb_killed")
    flags = TINY + ["--lr-decay-style", "constant", "--save", save, "--save-interval", "2"]
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "pretrain_composer.py", *flags, "--train-iters", "1000",
                             "--tensorboard-dir", tb], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 240
    while (read_tracker(save) or 0) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    # SIGKILL the whole process group, as a scheduler kills a job: checkpoint writer processes go too
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    start = read_tracker(save)
    assert start is not None and start >= 2
    code, resumed = run(tmp_path, "resumed", *flags, "--load", save, "--train-iters", str(start + 3))
    assert code == 0
    code, full = run(tmp_path, "full", *TINY, "--lr-decay-style", "constant", "--train-iters", str(start + 3))
    for step in range(start + 1, start + 4):
        assert resumed["lm loss"][step] == full["lm loss"][step]
        assert resumed["grad-norm"][step] == full["grad-norm"][step]


def test_interrupted_save_keeps_previous_latest(tmp_path):
    save = str(tmp_path / "ckpt")
    assert run(tmp_path, "a", "--train-iters", "2", "--save", save)[0] == 0
    # a crash half-way through saving iteration 4: a partial directory, the tracker untouched
    partial = checkpoint_dir(save, 4) + ".tmp"
    os.makedirs(partial)
    with open(os.path.join(partial, "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * 10)
    code, resumed = run(tmp_path, "b", "--train-iters", "3", "--save", save, "--load", save,
                        "--use-checkpoint-opt_param-scheduler")
    assert code == 0
    assert sorted(resumed["lm loss"]) == [3]
    assert read_tracker(save) == 3


def test_truncated_checkpoint_names_the_file(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    assert run(tmp_path, "a", "--train-iters", "2", "--save", save)[0] == 0
    ckpt = checkpoint_dir(save, 2)
    victim = os.path.join(ckpt, "__0_0.distcp")
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    code, _ = run(tmp_path, "b", "--train-iters", "3", "--load", save)
    assert code == 1
    err = capsys.readouterr().err
    assert victim in err and "truncated" in err
    with pytest.raises(CheckpointError, match="missing"):
        os.remove(victim)
        checkpointing.verify_checkpoint(ckpt)
    shutil.rmtree(ckpt)
    code, _ = run(tmp_path, "c", "--train-iters", "3", "--load", save)
    assert code == 1 and "does not exist" in capsys.readouterr().err


def test_corrupt_contents_are_reported(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    assert run(tmp_path, "a", "--train-iters", "1", "--save", save)[0] == 0
    common = os.path.join(checkpoint_dir(save, 1), "common.pt")
    size = os.path.getsize(common)
    with open(common, "r+b") as f:  # same size, garbage inside: only reading can tell
        f.write(b"\xff" * size)
    code, _ = run(tmp_path, "b", "--train-iters", "2", "--load", save)
    assert code == 1
    err = capsys.readouterr().err
    assert f"{common} is corrupt: CRC-32" in err  # the manifest's checksum sees it first
    code, _ = run(tmp_path, "c", "--train-iters", "2", "--load", save, "--skip-checkpoint-checksums")
    assert code == 1
    err = capsys.readouterr().err
    assert "cannot read the common state" in err and checkpoint_dir(save, 1) in err


def _optimizer_tensors(optimizer):
    return [v.clone() for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            for state in opt.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def test_nan_step_is_skipped_and_leaves_weights_alone():
    args = parse_args(TINY, world_size=1)
    initialize_distributed(args)
    try:
        model, optimizer = setup_model_and_optimizer(args)
        train_step(entry.forward_step, entry.train_data_iterator(args, 0), model, optimizer, args, 2)
        before = [p.detach().clone() for p in model[0].parameters()]
        state_before = _optimizer_tensors(optimizer)
        assert state_before

        def nan_step(data_iterator, m):
            out, loss_func = entry.forward_step(data_iterator, m)
            return out * float("nan"), loss_func

        result = train_step(nan_step, entry.train_data_iterator(args, 1), model, optimizer, args, 2)
        assert result["skipped"]
        assert all(torch.equal(a, p) for a, p in zip(before, model[0].parameters()))
        assert all(torch.equal(a, b) for a, b in zip(state_before, _optimizer_tensors(optimizer)))
        result = train_step(entry.forward_step, entry.train_data_iterator(args, 1), model, optimizer, args, 2)
        assert not result["skipped"]
    finally:
        destroy()


def test_nan_injection_counts_and_aborts(tmp_path, capsys):
    code, tb = run(tmp_path, "one", "--train-iters", "5", "--inject-nan-iterations", "3")
    assert code == 0
    assert 3 not in tb["lm loss"] and tb["skipped-iterations"][5] == 1
    code, _ = run(tmp_path, "many", "--train-iters", "8", "--inject-nan-iterations", "3", "4", "5",
                  "--max-skipped", "3")
    assert code == 1
    err = capsys.readouterr().err
    assert "iteration 5: 3 consecutive steps" in err and "--max-skipped 3" in err


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGUSR1, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGUSR1"])
def test_sigterm_saves_and_exits_zero(tmp_path, sig):
    """SIGUSR1 is SLURM's early warning (examples/slurm: --signal=USR1@900, forwarded by torchrun)."""
    save = str(tmp_path / "ckpt")
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-u", "pretrain_composer.py", *TINY, "--log-interval",
                             "1", "--train-iters", "100000", "--save", save], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith(" iteration        2/"):
            proc.send_signal(sig)
            break
    out = proc.stdout.read()
    assert proc.wait(timeout=120) == 0
    assert f"{sig.name} received: saving a checkpoint at iteration" in out
    saved = int(out.split("saving a checkpoint at iteration ")[1].split()[0])
    assert read_tracker(save) == saved >= 2
    checkpointing.verify_checkpoint(checkpoint_dir(save, saved))


def test_sigterm_to_the_whole_process_group_after_a_save_still_saves(tmp_path):
    """torchrun (its workers run in their own sessions) and SLURM signal every process of a rank's group, not the
    rank alone: Megatron-Core's checkpoint writer keeps a helper process (the results queue's manager, made at the
    first save) in that group, and when the signal killed it the save the signal asks for failed (BrokenPipeError,
    `iter_N.tmp` left behind, the run's last steps lost; found when an RL run was stopped by SIGTERM to torchrun)."""
    save = str(tmp_path / "ckpt")
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-u", "pretrain_composer.py", *TINY, "--log-interval",
                             "1", "--train-iters", "100000", "--save", save, "--save-interval", "2"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith(" iteration        3/"):  # after the save at iteration 2 (the helper exists)
                os.killpg(proc.pid, signal.SIGTERM)
                break
        out = proc.stdout.read()
        assert proc.wait(timeout=120) == 0, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # a save for the signal, or (when the step it stopped at saved anyway) the exit after that save
    found = re.search(r"SIGTERM received: (?:saving a checkpoint at|exiting at) iteration (\d+)", out)
    assert found, out[-3000:]
    saved = int(found.group(1))
    assert read_tracker(save) == saved >= 3
    checkpointing.verify_checkpoint(checkpoint_dir(save, saved))
    assert not [n for n in os.listdir(save) if n.endswith(".tmp")]


@pytest.mark.parametrize("style, extra", [("constant", []), ("linear", []), ("cosine", []),
                                          ("WSD", ["--lr-wsd-decay-iters", "4"])])
def test_schedules(style, extra):
    args = parse_args(TINY + ["--train-iters", "10", "--lr-warmup-iters", "2", "--min-lr", "1e-4",
                              "--lr-decay-style", style, *extra], world_size=1)
    initialize_distributed(args)
    try:
        model, optimizer = setup_model_and_optimizer(args)
        sched = build_scheduler(args, optimizer)
        lrs = []
        for _ in range(10):
            lrs.append(optimizer.param_groups[0]["lr"])
            sched.step(increment=args.global_batch_size)
        assert lrs[0] == 0.0 and lrs[1] == pytest.approx(1.5e-3) and lrs[2] == pytest.approx(3e-3)
        if style == "constant":
            assert lrs[-1] == pytest.approx(3e-3)
        else:
            assert 1e-4 <= lrs[-1] < 3e-3 and lrs == lrs[:3] + sorted(lrs[3:], reverse=True)
        if style == "WSD":
            assert lrs[5] == pytest.approx(3e-3)  # stable until the last 4 iterations
    finally:
        destroy()


def test_mtp_attach_adds_fresh_layers_to_a_checkpoint_without_them(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    assert run(tmp_path, "plain", "--train-iters", "2", "--mtp-num-layers", "0", "--save", save)[0] == 0
    code, _ = run(tmp_path, "refused", "--train-iters", "3", "--load", save)
    assert code == 1 and "--mtp-attach" in capsys.readouterr().err
    keep = "--use-checkpoint-opt_param-scheduler"  # --train-iters grows, so the default decay length changes
    code, tb = run(tmp_path, "attached", "--train-iters", "4", "--load", save, "--mtp-attach", keep)
    assert code == 0
    assert sorted(tb["mtp_1 distill loss"]) == [3, 4] and "mtp_1 top1 agreement" in tb
    code, _ = run(tmp_path, "twice", "--train-iters", "5", "--load", save, "--mtp-attach", "--save", save, keep)
    assert code == 0  # the checkpoint it saved at iteration 5 now has MTP layers: a second attach is refused
    code, _ = run(tmp_path, "again", "--train-iters", "6", "--load", save, "--mtp-attach", keep)
    assert code == 1 and "already has 1 MTP layer" in capsys.readouterr().err


def _first_step_losses(flags, leave_a_forward=False):
    args = parse_args(flags, world_size=1)
    initialize_distributed(args)
    try:
        model, optimizer = setup_model_and_optimizer(args)
        losses = train_step(entry.forward_step, entry.train_data_iterator(args, 0), model, optimizer, args, 1)["losses"]
        if leave_a_forward:  # a training-mode forward whose losses no step logs (a probe, an interrupted step)
            entry.forward_step(entry.train_data_iterator(args, 1), model[0])
        return losses
    finally:
        destroy()


def test_a_run_does_not_inherit_the_loss_trackers_of_an_earlier_run_in_the_same_process():
    """Megatron-Core's MTP and MoE loss trackers are process globals: a run that left them filled (and its process
    groups in them) must not add its losses to the next run's first logged step (benchmarks, notebooks and tests
    train several times in one process)."""
    flags = TINY + ["--mtp-num-layers", "1"]
    reference = _first_step_losses(flags, leave_a_forward=True)
    again = _first_step_losses(flags)
    assert {"lm loss", "mtp_1 loss", "seq_load_balancing_loss", "mtp_1 distill loss"} <= set(reference), reference
    assert again == reference
