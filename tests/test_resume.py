"""Stopping and resuming pretraining: a stop signal saves the exact position and the resumed run ends with the
uninterrupted one's weights, checkpoints survive a kill or a full disk mid-write, numbered ones are kept as asked,
a checkpoint runs no code when loaded, and resumes that would not be exact or would overwrite another run are
refused in one line. (Several ranks: test_distributed.py; every data route: test_data_routes.py.)"""
import argparse
import builtins
import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import (REPO, TINY, assert_same_state, assert_trained, exit_message, load, loss_hook, pretrain,
                      sends_signal_at, write_imagefolder)
import main_pretrain
from sce import UserError, checkpoint, entry, outdir, timing
from sce.epoch import estimate_due, log_epoch
from sce.optim import build_optimizer
from sce.preemption import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.usefixtures("in_process")  # conftest: one thread, signal handlers restored
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def test_resume_equals_uninterrupted_run(small, tmp_path, capsys):
    # a lambda schedule (warmup then cosine) is a function of the step: it resumes with the run
    lam = ["--lambda-schedule", "cosine", "--lambda-end", "0.9", "--lambda-warmup-steps", "2",
           "--lambda-warmup-start", "0.1"]
    pretrain(small, tmp_path / "a", "--epochs", 2, *lam)
    capsys.readouterr()
    pretrain(small, tmp_path / "b", "--epochs", 2, "--stop-after-epochs", 1, "--save-freq", 1, *lam)
    first = capsys.readouterr().out
    assert "stopping after 1 epoch" in first
    assert load(tmp_path / "b" / "checkpoint_last.pth")["epoch"] == 1
    # what a kill between the save of checkpoint_last.pth and its line in log.txt left: the rerun writes the line
    (tmp_path / "b" / "log.txt").write_text("".join(open(tmp_path / "b" / "log.txt").readlines()[:-1]))
    pretrain(small, tmp_path / "b", "--epochs", 2, "--save-freq", 1, *lam)
    again = capsys.readouterr().out
    assert "resuming from" in again and "log.txt lacks epoch 1" in again
    # the resumed invocation's estimate (after epoch 2, its first) counts the first invocation's time too
    estimate, first_wall = (json.load(open(tmp_path / "b" / "estimate.json")),
                            json.loads(open(tmp_path / "b" / "timing.txt").readline())["wall_s"])
    assert estimate["earlier_s"] == first_wall > 0
    assert estimate["stage_s"] == pytest.approx(first_wall + estimate["wall_s"] + estimate["left_s"])
    a, b = load(tmp_path / "a" / "checkpoint_last.pth"), load(tmp_path / "b" / "checkpoint_last.pth")
    assert a["epoch"] == b["epoch"] == 2 and a["step"] == b["step"] == 4
    assert_same_state(a["model"], b["model"])
    # the online probe resumes exactly: its head and its optimizer's state
    assert_same_state(a["online_probe"]["head"], b["online_probe"]["head"])
    adam = [{k: v for k, v in s.items()} for s in (a["online_probe"]["optimizer"]["state"].values())]
    adam_b = list(b["online_probe"]["optimizer"]["state"].values())
    assert all(torch.equal(x[k], y[k]) for x, y in zip(adam, adam_b) for k in x) and len(adam) == 2
    # ... and never touches the method: without it, the same weights to the bit
    pretrain(small, tmp_path / "c", "--epochs", 2, *lam, "--no-online-probe")
    c = load(tmp_path / "c" / "checkpoint_last.pth")
    assert_same_state(a["model"], c["model"])
    assert c["online_probe"] is None and "online_train_top1" not in open(tmp_path / "c" / "log.txt").read()
    assert_trained(tmp_path / "a")
    assert int(a["model"]["queue_ptr"]) == 0  # 4 steps x 8 keys wrap a 32-key queue
    assert os.path.exists(tmp_path / "a" / "checkpoint_0002.pth")  # last epoch always numbered
    # progress line and TensorBoard scalars
    assert re.search(r"\] loss \d+\.\d+ lr \S+ m \S+ online \d+\.\d% \d+\.\d img/s data \d+% skipped 0 "
                     r"eta \d+:\d\d:\d\d", first)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "a")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/momentum", "train/images_per_s", "train/data_wait_share",
            "train/lambda", "train/skipped_steps", "terms/infonce", "terms/ressl", "terms/ceil",
            "online/train_top1"} <= tags
    lambdas = [e.value for e in events.Scalars("train/lambda")]  # steps 0-3: warmup 0.1, 0.5, then cosine to 0.9
    assert lambdas == pytest.approx([0.1, 0.3, 0.5, 0.9])
    assert "views" in events.Tags()["images"]  # the augmented views, at the start of the run
    # the resolved settings and one JSON line per epoch, also across the resume
    assert json.load(open(tmp_path / "b" / "args.json"))["lambda_schedule"] == "cosine"
    for run in "ab":
        epochs = [json.loads(line) for line in open(tmp_path / run / "log.txt")]
        assert [e["epoch"] for e in epochs] == [1, 2]
        assert {"loss", "infonce", "ressl", "ceil", "lr", "momentum", "lambda", "images_per_s",
                "skipped_steps", "online_train_top1"} <= epochs[0].keys()
        assert all(0 <= e["online_train_top1"] <= 100 for e in epochs)
    assert open(tmp_path / "a" / "log.txt").read().count("loss") == 2


# shuffle-BN draws from the global RNG; --amp fp16 saves and resumes a GradScaler
@pytest.mark.parametrize("extra", [[], ["--shuffle-bn", "--bn-splits", "2", "--amp", "fp16"]])
def test_sigusr1_saves_mid_epoch_and_resumes_exactly(small, tmp_path, monkeypatch, extra):
    # fp16's GradScaler without its autocast: CPU fp16 convolutions have no fast kernel here (11 s a step, not
    # 0.2) and bf16 ones are ~10x slower than fp32; the scaler's state is what a resume must carry
    monkeypatch.setitem(main_pretrain.cli.AMP, "fp16", None)
    pretrain(small, tmp_path / "ref", "--epochs", 2, *extra)
    # the epochs' checkpoints are written in the background: slowed here, epoch 1's is still being written when
    # the stop comes (at epoch 2's first step); the stop waits for it, then saves its own
    real, saves, split_so_far = checkpoint.save_atomic, [], []

    def slow(state, path, second=None):
        logged = open(os.path.join(os.path.dirname(path), "log.txt")).read().count("\n") if os.path.isfile(
            os.path.join(os.path.dirname(path), "log.txt")) else 0
        time.sleep(0.5)
        real(state, path, second)
        saves.append((state["epoch"], state["step_in_epoch"], logged))
        if state["step_in_epoch"]:  # what a kill -9 here would leave of the split: up to epoch 1's end
            split_so_far.extend(json.loads(line)["epochs"] for line in open(tmp_path / "run" / "timing.txt"))
    with monkeypatch.context() as m:
        m.setattr(main_pretrain.losses, "criterion", sends_signal_at(signal.SIGUSR1, 3))  # epoch 1, step 0
        m.setattr(checkpoint, "save_atomic", slow)
        with pytest.raises(SystemExit) as stop:
            pretrain(small, tmp_path / "run", "--epochs", 2, *extra)
    assert stop.value.code == PREEMPTED_EXIT_CODE
    assert saves == [(1, 0, 0), (1, 1, 1)]  # epoch 1's line of log.txt once its checkpoint was on disk
    assert split_so_far == [[0, 1]]  # timing.txt's line of the invocation, written at epoch 1's end
    ckpt = load(tmp_path / "run" / "checkpoint_last.pth")
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["step"]) == (1, 1, 3)
    assert (ckpt["scaler"] is not None) == ("fp16" in extra)
    assert len(open(tmp_path / "run" / "timing.txt").readlines()) == 1  # replaced at the end, not added to
    pretrain(small, tmp_path / "run", "--epochs", 2, *extra)
    assert [json.loads(line)["epochs"] for line in open(tmp_path / "run" / "timing.txt")] == [[0, 1], [1, 2]]
    a, b = load(tmp_path / "ref" / "checkpoint_last.pth"), load(tmp_path / "run" / "checkpoint_last.pth")
    assert a["step"] == b["step"] == 4 and int(b["model"]["queue_ptr"]) == 0
    assert_same_state(a["model"], b["model"])
    assert_same_state(a["optimizer"]["state"][0], b["optimizer"]["state"][0])
    assert a["scaler"] == b["scaler"]  # scale and growth tracker: the resumed scaler counted every step
    # the resumed epoch's line of log.txt averages the whole epoch, its steps before the stop included
    lines = [[json.loads(line) for line in open(tmp_path / run / "log.txt")] for run in ("ref", "run")]
    terms = ("epoch", "loss", "infonce", "ressl", "ceil", "skipped_steps")
    assert [[line[k] for k in terms] for line in lines[0]] == [[line[k] for k in terms] for line in lines[1]]


def test_a_second_ctrl_c_while_the_stop_saves_leaves_at_once_in_one_line(small, tmp_path, monkeypatch, capsys):
    """Ctrl-C, then Ctrl-C again while the stop's checkpoint is written: the run leaves at once, exit 130 and one
    line, no traceback, not waiting for that save; the checkpoint before it is kept."""
    real, released = checkpoint.save_atomic, threading.Event()

    def stuck(state, path, second=None):  # the stop's save: Ctrl-C again while it is being written
        if not state["step_in_epoch"]:
            return real(state, path, second)
        os.kill(os.getpid(), signal.SIGINT)
        released.wait(60)  # never written (a process that left takes this thread with it)
    monkeypatch.setattr(main_pretrain.losses, "criterion", sends_signal_at(signal.SIGINT, 3))  # epoch 2's first step
    monkeypatch.setattr(checkpoint, "save_atomic", stuck)
    monkeypatch.setattr(timing, "STARTED", timing.STARTED)  # entry.run sets this process's start
    try:
        with pytest.raises(SystemExit) as left:
            entry.run(lambda: pretrain(small, tmp_path, "--epochs", 2))
    finally:
        released.set()
    assert left.value.code == INTERRUPTED_EXIT_CODE == 130
    out, err = capsys.readouterr()
    assert ("=> interrupted again: leaving at once, without waiting for the checkpoint being written (it is dropped, "
            "the previous one is kept); run the same command again to continue from that one (exiting with code 130)"
            in out) and "Traceback" not in out + err
    ckpt = load(tmp_path / "checkpoint_last.pth")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (1, 0)


def test_the_estimate_waits_for_a_whole_epoch():
    # on an H200 the rest of an epoch resumed at step 180 of 195 (15 steps and the CUDA graph's warm-up) read as an
    # epoch at 12,064 images/s where whole ones ran at 34,000: the stage estimated at 12.6 min for 4.9
    assert estimate_due(1, 0, 195, 200) and not estimate_due(2, 0, 195, 200)  # a fresh run: after epoch 1
    assert estimate_due(24, 23 * 195, 195, 200)  # resumed at an epoch's end: after the first epoch it runs
    assert not estimate_due(24, 23 * 195 + 180, 195, 200) and estimate_due(25, 23 * 195 + 180, 195, 200)
    assert estimate_due(200, 199 * 195 + 5, 195, 200)  # resumed within the last epoch: none other comes


def test_stop_requests_are_checked_every_print_freq_steps(small, tmp_path, monkeypatch):
    # --print-freq 2 with 2 steps an epoch: no check after step 1 of the epoch, so the run saves at its end
    with monkeypatch.context() as m:
        m.setattr(main_pretrain.losses, "criterion", sends_signal_at(signal.SIGUSR1, 3))  # epoch 1, step 0
        with pytest.raises(SystemExit) as stop:
            pretrain(small, tmp_path / "run", "--epochs", 3, "--print-freq", 2)
    assert stop.value.code == PREEMPTED_EXIT_CODE
    ckpt = load(tmp_path / "run" / "checkpoint_last.pth")
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["step"]) == (2, 0, 4)
    assert_trained(tmp_path / "run")


@pytest.fixture(scope="module")
def stopped(small, tmp_path_factory):
    """A run preempted at step 1 of its 2-step epoch 0: OUT/checkpoint_last.pth and args.json."""
    out = tmp_path_factory.mktemp("hostile") / "stopped"
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(main_pretrain.losses, "criterion", sends_signal_at(signal.SIGUSR1, 1))
        with pytest.raises(SystemExit):
            pretrain(small, out)
    for s, handler in saved.items():
        signal.signal(s, handler)
    assert load(out / "checkpoint_last.pth")["step_in_epoch"] == 1
    return out


def copy_run(stopped, to):
    shutil.copytree(stopped, to)
    return to


def test_resume_into_a_folder_holding_another_run_is_refused(small, stopped, tmp_path):
    other, out = copy_run(stopped, tmp_path / "other"), copy_run(stopped, tmp_path / "out")
    (out / "checkpoint_last.pth").write_bytes(b"another run's checkpoint")  # not read: only kept
    before = (out / "checkpoint_last.pth").read_bytes()
    with pytest.raises(UserError, match="would overwrite") as err:
        pretrain(small, out, "--resume", other / "checkpoint_last.pth")
    assert "\n" not in str(err.value) and (out / "checkpoint_last.pth").read_bytes() == before
    pretrain(small, other, "--resume", other / "checkpoint_last.pth")  # its own checkpoint, named: fine
    assert load(other / "checkpoint_last.pth")["epoch"] == 1
    pretrain(small, tmp_path / "fresh", "--resume", stopped / "checkpoint_last.pth")  # a new folder: fine
    assert load(tmp_path / "fresh" / "checkpoint_last.pth")["epoch"] == 1


def test_a_refused_resume_leaves_args_json_alone(small, stopped, tmp_path):
    out = copy_run(stopped, tmp_path / "out")
    before = (out / "args.json").read_text()
    with pytest.raises(UserError, match="--arch resnet18"):
        pretrain(small, out, "--arch", "resnet34")
    with pytest.raises(UserError, match="would overwrite"):
        pretrain(small, out, "--resume", "none")
    assert (out / "args.json").read_text() == before


def test_a_mid_epoch_resume_with_another_seed_or_dataset_is_refused(small, stopped, tmp_path):
    out = copy_run(stopped, tmp_path / "out")
    eight = write_imagefolder(tmp_path / "eight", num_classes=2, per_class=4, size=20, splits=("",))  # 1 step
    with pytest.raises(UserError, match="mid-epoch with --seed 0") as err:
        pretrain(small, out, "--seed", "1")
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="mid-epoch on 16 images") as err:
        pretrain(eight, out)
    assert "\n" not in str(err.value)
    other = write_imagefolder(tmp_path / "other", num_classes=2, per_class=8, size=20, splits=("",))
    os.rename(os.path.join(other, "class_1"), os.path.join(other, "class_b"))
    with pytest.raises(UserError, match=r"mid-epoch on other data \(other files, labels or pixels\)") as err:
        pretrain(other, out)  # 16 images too: the same size, other files
    assert "\n" not in str(err.value)
    earlier = load(out / "checkpoint_last.pth")  # stopped mid-epoch by a version that drew orders from seed + epoch
    earlier.pop("data_order")
    torch.save(earlier, tmp_path / "earlier.pth")
    with pytest.raises(UserError, match="mid-epoch under an earlier version, which drew the epoch's order otherwise"):
        pretrain(small, tmp_path / "resumed", "--resume", tmp_path / "earlier.pth")


def test_an_epoch_end_resume_on_data_of_other_classes_starts_the_probe_afresh(small, stopped, tmp_path, capsys):
    """As many classes, other ones (class_1 renamed): the probe's head would carry on with other labels."""
    out = tmp_path / "out"
    os.makedirs(out)
    ended = load(stopped / "checkpoint_last.pth")
    ended.update(epoch=1, step=2, step_in_epoch=0)  # epoch 1's end: other data may follow
    torch.save(ended, out / "checkpoint_last.pth")
    assert ended["online_probe"]["classes"] == ["class_0", "class_1"]
    other = write_imagefolder(tmp_path / "other", num_classes=2, per_class=4, size=20, splits=("",))
    os.rename(os.path.join(other, "class_1"), os.path.join(other, "class_b"))
    pretrain(other, out, "--epochs", 2)
    assert ("online probe learned other classes than this data's (other classes of as many: 'class_1', not "
            "'class_b'): it starts afresh") in capsys.readouterr().out
    probe = load(out / "checkpoint_last.pth")["online_probe"]
    assert probe["classes"] == ["class_0", "class_b"]
    assert not torch.equal(probe["head"]["weight"], ended["online_probe"]["head"]["weight"])


@pytest.mark.parametrize("saved,said", [
    (["a", "b"], None), (["a", "c"], "other classes of as many: 'c', not 'b'"), (["a", "b", "c"], "3 classes, not 2"),
    (None, "its classes are not recorded (an earlier version)")])
def test_the_online_probe_resumes_only_on_the_classes_it_learned(tmp_path, capsys, saved, said):
    """saved: the checkpoint's probe's classes (None: a checkpoint of before they were recorded); this run's: a, b."""
    from sce.resume import resume, run_state
    from sce.step import OnlineProbe
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer("sgd", model, 0.1, 0.0)
    args = argparse.Namespace(resume="auto", output_dir=str(tmp_path), batch_size=4, epochs=2, method="moco")
    before = OnlineProbe(8, len(saved or "ab"), "cpu", classes=saved)
    before.head.weight.data.fill_(1.0)
    state = run_state(model, optimizer, None, args, epoch=1, step_in_epoch=0, global_step=2, probe=before)
    if saved is None:
        del state["online_probe"]["classes"]
    checkpoint.save(state, str(tmp_path))
    probe = OnlineProbe(8, 2, "cpu", classes=["a", "b"])
    resume(args, model, optimizer, None, rank=0, probe=probe)
    out = capsys.readouterr().out
    assert probe.restored == (said is None) and bool((probe.head.weight == 1).all()) == (said is None)
    assert (f"online probe learned other classes than this data's ({said}): it starts afresh" in out) == bool(said)


def test_epochs_below_the_checkpoint_is_an_error_and_equal_is_complete(small, stopped, tmp_path, capsys):
    out = tmp_path / "out"
    os.makedirs(out)
    done = load(stopped / "checkpoint_last.pth")
    done.update(epoch=2, step=4, step_in_epoch=0)  # a finished 2-epoch run
    torch.save(done, out / "checkpoint_last.pth")
    before = (out / "checkpoint_last.pth").read_bytes()
    with pytest.raises(UserError, match="is at epoch 2, --epochs 1 is below it") as err:
        pretrain(small, out, "--epochs", 1)
    assert "\n" not in str(err.value)
    capsys.readouterr()
    pretrain(small, out, "--epochs", 2)
    assert "already complete" in capsys.readouterr().out
    assert (out / "checkpoint_last.pth").read_bytes() == before and not (out / "log.txt").exists()


@pytest.mark.parametrize("saved,gpus,note", [
    (8, 4, "=> note: checkpoint saved the CUDA random state of 8 GPUs, this run has 4: continuing, but not bit-exact"),
    (8, None, "=> note: checkpoint saved the CUDA random state of 8 GPUs, this run has none: continuing, but not "
              "bit-exact"),
    (2, 2, None), (0, None, None)])
def test_resume_notes_a_cuda_random_state_it_cannot_restore(tmp_path, monkeypatch, capsys, saved, gpus, note):
    """saved: CUDA random states in the checkpoint (one per GPU); gpus: this run's GPUs (None: no CUDA)."""
    from sce import checkpoint
    from sce.resume import Resumed, resume, run_state
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer("sgd", model, 0.1, 0.0)
    args = argparse.Namespace(resume="auto", output_dir=str(tmp_path), batch_size=4, epochs=2, method="moco")
    state = run_state(model, optimizer, None, args, epoch=1, step_in_epoch=0, global_step=2)
    state["rng"]["cuda"] = [torch.zeros(16, dtype=torch.uint8) for _ in range(saved)]
    checkpoint.save(state, str(tmp_path))
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus is not None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus or 0)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    assert resume(args, model, optimizer, None, rank=0) == Resumed(epoch=1, step_in_epoch=0)
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("=> note")]
    assert notes == ([note] if note else [])
    assert len(restored) == (saved == gpus)


def test_sigkill_while_writing_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "checkpoint_last.pth"
    good = {"kind": "pretrain", "epoch": 3, "w": torch.arange(1000.0)}
    checkpoint.save_atomic(good, str(path))
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from sce import checkpoint; "
            "checkpoint.save_atomic({'w': torch.ones(50_000_000)}, sys.argv[2])")  # 200 MB
    proc = subprocess.Popen([sys.executable, "-c", code, REPO, str(path)], env=ENV)
    tmp = tmp_path / f".checkpoint_last.pth.tmp{proc.pid}"
    deadline = time.time() + 120
    while not (tmp.exists() and tmp.stat().st_size > 0):
        assert proc.poll() is None and time.time() < deadline, "the writer never started its temporary file"
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    assert tmp.exists() and tmp.stat().st_size < 200_000_000  # killed in the middle of the write
    ckpt = checkpoint.load(str(path))
    assert ckpt.keys() == good.keys() and ckpt["epoch"] == 3 and torch.equal(ckpt["w"], good["w"])
    checkpoint.save_atomic({"epoch": 4}, str(path))  # the next write also removes the dead writer's leftover
    assert checkpoint.load(str(path)) == {"epoch": 4} and not tmp.exists()


class FullDisk:
    """A file opened for writing on a full disk: created, but no byte of it written."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_disk_full_keeps_previous_checkpoint(small, tmp_path, monkeypatch, capsys):
    """The disk fills during a run: its checkpoint's error is the one line it ends with; the other files it writes
    (estimate.json, timing.txt, TensorBoard's events) each fail with a line of their own, never over that error, and
    leave no file empty or cut short."""
    out = tmp_path / "out"
    pretrain(small, out, "--epochs", 1)
    assert_trained(out)
    last = out / "checkpoint_last.pth"
    before, kept = last.read_bytes(), {name: (out / name).read_bytes() for name in ("log.txt", "timing.txt")}
    real_save, real_open, full = torch.save, open, []

    def full_disk(obj, f, *a, **k):
        time.sleep(0.5)  # the epoch's end goes on while its checkpoint is written (and fails)
        f.write(b"PK\x03\x04 partial")  # a few bytes land, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_disk_open(file, mode="r", *a, **k):  # from the resumed run's first step on, in `out`
        f = real_open(file, mode, *a, **k)
        return FullDisk(f) if full and os.fsdecode(file).startswith(str(out)) and set(mode) & set("wa") else f
    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.setattr(builtins, "open", full_disk_open)
    monkeypatch.setattr(io, "open", full_disk_open)  # TensorBoard's writer thread opens its file at each write
    monkeypatch.setattr(main_pretrain.losses, "criterion", loss_hook(lambda call, loss: full.append(call) or loss))
    thread_errors = []  # what would print a thread's traceback
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    capsys.readouterr()
    with pytest.raises(UserError) as err:
        pretrain(small, out, "--epochs", 2)
    message = str(err.value)
    assert "\n" not in message and f"could not write checkpoint {last}" in message
    assert "No space left on device" in message and "the previous checkpoint is kept" in message
    said, errors = capsys.readouterr()
    assert (f"=> could not write {out / 'timing.txt'} (No space left on device): this invocation's time split is not "
            "kept") in said and "=> could not write estimate.json (No space left on device)" in said
    assert f"=> TensorBoard could not write to {out} (No space left on device): no more of its events" in said
    assert "Traceback" not in said + errors and not thread_errors
    # log.txt and args.json: one line each, to end the run with (a rerun completes the epoch's line)
    with pytest.raises(UserError, match=f"could not write {out / 'log.txt'} \\(No space left on device\\): free "
                                        "some space and run the same command again, which completes its line"):
        log_epoch(argparse.Namespace(output_dir=str(out)), 2, {"loss": 1.0}, None, None)
    with pytest.raises(UserError, match=f"could not write {out / 'args.json'} \\(No space left on device\\)"):
        outdir.write_json(str(out / "args.json"), {})
    monkeypatch.undo()
    assert last.read_bytes() == before and checkpoint.load(str(last))["epoch"] == 1
    assert {name: (out / name).read_bytes() for name in kept} == kept
    assert not [f for f in os.listdir(out) if ".tmp" in f]


@pytest.mark.parametrize("script", ["main_pretrain.py", "main_lincls.py"])
def test_a_disk_full_as_tensorboard_starts_is_one_line(small, pretrained, tmp_path, monkeypatch, capsys, script):
    """TensorBoard's writer writes its first event in its constructor, from its own thread: on a full disk, one line
    and the run goes on, not the constructor's and the thread's tracebacks."""
    from tensorboard.compat.tensorflow_stub.io import gfile

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(gfile.LocalFileSystem, "write", full)
    monkeypatch.setattr(gfile.LocalFileSystem, "append", full)
    args = (["--data", small, "--epochs", "1"] + TINY if script == "main_pretrain.py" else
            ["--data", write_imagefolder(tmp_path / "data", 2, 4, 16), "--pretrained", pretrained, "--epochs", "1",
             "--batch-size", "4"])
    assert exit_message(script, *args, "--output-dir", tmp_path / "out") is None
    said, errors = capsys.readouterr()
    assert said.count(f"=> TensorBoard could not write to {tmp_path / 'out'} (No space left on device): no more of "
                      "its events in this run\n") == 1 and "Traceback" not in said + errors, said + errors


def killed_at_the_rename(monkeypatch, state, out, where):
    """checkpoint.save(state, out, numbered=True) killed at the first os.replace(src, dst) that `where` picks."""
    real_replace = os.replace

    def killed(src, dst):
        if where(src, dst):
            raise SystemExit("killed")  # not an Exception: nothing is cleaned up, as after a kill
        real_replace(src, dst)
    with monkeypatch.context() as m:
        m.setattr(os, "replace", killed)
        with pytest.raises(SystemExit):
            checkpoint.save(state, str(out), numbered=True)


def test_the_numbered_checkpoint_is_a_second_name_or_a_copy_that_fails_whole(tmp_path, monkeypatch):
    """The numbered checkpoint is checkpoint_last.pth's file under a second name (nothing written twice), made before
    checkpoint_last.pth is replaced (a kill between the two keeps both epochs), and keeps its bytes when the next save
    replaces checkpoint_last.pth. Where the file system has no hard links it is a copy (checkpoint.copy_atomic); that
    copy failing on a full disk: one line naming it, the previous checkpoint_last.pth kept, no numbered file and no
    temporary file left."""
    checkpoint.save({"epoch": 9}, str(tmp_path))
    last = tmp_path / "checkpoint_last.pth"
    killed_at_the_rename(monkeypatch, {"epoch": 10}, tmp_path, lambda src, dst: dst == str(last))
    numbered = tmp_path / "checkpoint_0010.pth"
    assert checkpoint.load(str(numbered))["epoch"] == 10 and checkpoint.load(str(last))["epoch"] == 9
    checkpoint.save({"epoch": 10}, str(tmp_path), numbered=True)  # the rerun's save; the dead one's temporary removed
    assert os.path.samefile(last, numbered) and sorted(os.listdir(tmp_path)) == [numbered.name, last.name]
    checkpoint.save({"epoch": 11}, str(tmp_path))
    assert checkpoint.load(str(numbered))["epoch"] == 10 and checkpoint.load(str(last))["epoch"] == 11
    numbered.unlink()

    def no_links(src, dst):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    def full_disk(src, dst, *a):
        dst.write(b"PK\x03\x04 partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(shutil, "copyfileobj", full_disk)
    with pytest.raises(UserError) as err:
        checkpoint.save({"epoch": 20}, str(tmp_path), numbered=True)
    message = str(err.value)
    assert "\n" not in message and f"could not write checkpoint {tmp_path / 'checkpoint_0020.pth'}" in message
    assert "No space left on device" in message
    assert checkpoint.load(str(last))["epoch"] == 11
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_last.pth"]


def test_a_second_name_left_by_a_kill_is_removed_as_the_next_run_starts(small, tmp_path, monkeypatch):
    """A kill -9 between the numbered checkpoint's link and its rename leaves .checkpoint_NNNN.pth.linkPID, a
    checkpoint's size: the next run removes it as it starts, as it does a dead writer's temporary file (a live
    process's is a save in progress: kept)."""
    out = tmp_path / "out"
    out.mkdir()
    killed_at_the_rename(monkeypatch, {"epoch": 2}, out, lambda src, dst: ".link" in src)
    dead = subprocess.Popen(["true"])
    dead.wait()
    os.rename(out / f".checkpoint_0002.pth.link{os.getpid()}", out / f".checkpoint_0002.pth.link{dead.pid}")
    live = out / f".checkpoint_0007.pth.link{os.getppid()}"
    live.write_bytes(b"")
    pretrain(small, out, "--epochs", 1, "--save-freq", 5)
    assert [f for f in os.listdir(out) if ".link" in f or ".tmp" in f] == [live.name]


def test_a_checkpoint_write_failing_otherwise_than_oserror_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint_last.pth"
    checkpoint.save_atomic({"epoch": 1}, str(path))

    def full_disk(obj, f, *a, **k):  # what torch.save raises when the disk fills under it
        f.write(b"PK\x03\x04 partial")
        raise RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file "
                           "data/12: file write failed\nunexpected pos 22347392 vs 22347280")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(UserError) as err:
        checkpoint.save_atomic({"epoch": 2}, str(path))
    message = str(err.value)
    assert "\n" not in message and f"could not write checkpoint {path}" in message
    assert "file write failed" in message and "the previous checkpoint is kept" in message
    assert re.search(r"; \d+ MiB free on its disk: free some space or pass another --output-dir\)", message)
    assert os.listdir(tmp_path) == ["checkpoint_last.pth"]  # no temporary file left to fill the disk
    monkeypatch.undo()
    assert checkpoint.load(str(path)) == {"epoch": 1}


def test_a_full_disk_stops_at_start_in_one_line(small, tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full)  # an empty file still fits on a full disk, its data does not
    with pytest.raises(UserError, match=r"is not writable \(No space left on device\)"):
        pretrain(small, tmp_path / "out")
    assert os.listdir(tmp_path / "out") == []


def test_keep_last_k_numbered_checkpoints(small, tmp_path):
    out = tmp_path / "out"
    pretrain(small, out, "--epochs", 3, "--save-freq", 1, "--keep-checkpoints", 2)
    assert_trained(out)
    assert sorted(f for f in os.listdir(out) if f.startswith("checkpoint_")) == [
        "checkpoint_0002.pth", "checkpoint_0003.pth", "checkpoint_last.pth"]
    assert load(out / "checkpoint_0002.pth")["epoch"] == 2 and load(out / "checkpoint_0003.pth")["epoch"] == 3


class Payload:
    """Unpickling this runs open(marker, 'w'): what a malicious checkpoint could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_checkpoint_load_runs_no_code(small, tmp_path):
    marker, evil = tmp_path / "pwned", tmp_path / "checkpoint_last.pth"
    torch.save({"kind": "pretrain", "epoch": 1, "payload": Payload(str(marker))}, evil)
    with pytest.raises(UserError) as err:
        checkpoint.load(str(evil))
    # torch's advice, a load that is not weights-only, would run the payload: not repeated
    message = str(err.value)
    assert message == f"{evil} is not read: it would call io.open (a pickle that runs code; nothing was run)"
    assert not marker.exists()
    with pytest.raises(UserError, match="is not read: it would call io.open"):
        pretrain(small, tmp_path, "--epochs", 1)  # --resume auto picks it up
    assert not marker.exists()
    torch.load(evil, weights_only=False)  # the payload is live: full unpickling would run it
    assert marker.exists()
