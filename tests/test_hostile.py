"""What a hostile but fair user found (issue 25): crashes with loader workers end, runs are not
overwritten or rewritten when refused, a full disk is one line, every numeric flag is finite and in
range, a mid-epoch resume with other inputs is refused, --epochs below the checkpoint is an error."""
import errno
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

from conftest import REPO, load, run_script, sends_signal_at, write_imagefolder
import main_pretrain
from sce import UserError, checkpoint

pytestmark = pytest.mark.usefixtures("in_process")  # conftest: one thread, signal handlers restored

TINY = ["--arch", "resnet18", "--small-input", "--crop-size", "16", "--batch-size", "8", "--queue-size", "32",
        "--proj-hidden-dims", "32", "--proj-dim", "16", "--print-freq", "1"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """16 images: 2 steps per epoch."""
    return write_imagefolder(tmp_path_factory.mktemp("hostile") / "small", num_classes=2, per_class=8, size=20,
                             splits=("",))


def alive(pid):
    """Running, not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------- 1. a crash with loader workers ends

# main_pretrain.py as its __main__ runs it (cli.run), with a failure injected where argv[1] says; the
# failure prints the loader's worker pids first
CRASH = """
import multiprocessing, os, signal, sys, torch
sys.path.insert(0, os.getcwd())
import main_pretrain
from sce import cli
where, sys.argv = sys.argv[1], ["main_pretrain.py"] + sys.argv[2:]

def fail(*args, **kwargs):
    print("FAILING workers", *[p.pid for p in multiprocessing.active_children()], flush=True)
    if where == "preempted":
        os.kill(os.getpid(), signal.SIGUSR1)
        return real_loss(*args, **kwargs)
    raise RuntimeError("unexpected pos") if where == "checkpoint" else RuntimeError("injected failure")

if where in ("training", "preempted"):
    real = main_pretrain.build_criterion
    def build(*a):
        global real_loss
        real_loss = real(*a)
        return fail
    main_pretrain.build_criterion = build
elif where == "knn":
    main_pretrain.knn_monitor = fail
elif where == "checkpoint":
    torch.save = fail
cli.run(main_pretrain.main)
"""


@pytest.mark.parametrize("where,code", [("training", 1), ("knn", 1), ("checkpoint", 1), ("preempted", 75)])
def test_a_crash_with_loader_workers_exits_at_once(small, tmp_path, where, code):
    args = ["--data", small, "--output-dir", tmp_path / "out", "--epochs", "2", "--workers", "2",
            "--knn-data", write_imagefolder(tmp_path / "knn", 2, 2, 20), "--knn-max-train", "4"] + TINY
    proc = subprocess.Popen([sys.executable, "-c", CRASH, where] + [str(a) for a in args], cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, failed = [], []
    reader = threading.Thread(target=lambda: [(lines.append(line), line.startswith("FAILING") and failed.append(
        (time.time(), [int(p) for p in line.split()[2:]]))) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        deadline = time.time() + 240
        while not failed and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert failed, "".join(lines)[-3000:]
        failed_at, workers = failed[0]
        assert workers, "the loader had no worker processes"
        returncode = proc.wait(failed_at + 30 - time.time())
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        left = [pid for pid in [proc.pid] + (failed[0][1] if failed else []) if alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    reader.join(10)
    output = "".join(lines)
    assert returncode == code, f"exit {returncode} (None: still running 30 s after the failure)\n{output[-3000:]}"
    assert not left, f"processes left running: {left}"
    if where == "checkpoint":
        assert "error: could not write checkpoint" in output and "Traceback" not in output


# ---------------------------------------------------------------- in-process runs

def pretrain(data, out, *extra):
    main_pretrain.main(["--data", data, "--output-dir", str(out), "--epochs", "1", "--workers", "0"] + TINY
                       + [str(e) for e in extra])


@pytest.fixture(scope="module")
def stopped(small, tmp_path_factory):
    """A run preempted at step 1 of its 2-step epoch 0: OUT/checkpoint_last.pth and args.json."""
    out = tmp_path_factory.mktemp("hostile") / "stopped"
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(main_pretrain, "build_criterion", sends_signal_at(signal.SIGUSR1, 1))
        with pytest.raises(SystemExit):
            pretrain(small, out)
    for s, handler in saved.items():
        signal.signal(s, handler)
    assert load(out / "checkpoint_last.pth")["step_in_epoch"] == 1
    return out


def copy_run(stopped, to):
    shutil.copytree(stopped, to)
    return to


# ---------------------------------------------------------------- 3. another run's checkpoints are kept

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


# ---------------------------------------------------------------- 4. a refused command leaves args.json

def test_a_refused_resume_leaves_args_json_alone(small, stopped, tmp_path):
    out = copy_run(stopped, tmp_path / "out")
    before = (out / "args.json").read_text()
    with pytest.raises(UserError, match="--arch resnet18"):
        pretrain(small, out, "--arch", "resnet34")
    with pytest.raises(UserError, match="would overwrite"):
        pretrain(small, out, "--resume", "none")
    assert (out / "args.json").read_text() == before


# ---------------------------------------------------------------- 5. a full disk is one line

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


# ---------------------------------------------------------------- 7. every numeric flag finite and in range

@pytest.mark.parametrize("extra,match", [
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--tau", "nan"], "--tau must be a finite number"),
    (["--tau-m", "nan"], "--tau-m must be a finite number"),
    (["--lambda", "nan"], "--lambda must be a finite number"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number"),
    (["--min-scale", "nan"], "--min-scale must be a finite number"),
    (["--warmup-epochs", "nan"], "--warmup-epochs must be a finite number"),
    (["--knn-t", "nan"], "--knn-t must be a finite number"),
    (["--ema-momentum", "nan"], "--ema-momentum must be a finite number"),
    (["--loss-coeffs", "1", "nan", "1"], "--loss-coeffs must be a finite number"),
    (["--local-crop-sizes", "8", "--local-crop-scales", "0.1", "nan"], "--local-crop-scales must be a finite"),
    (["--max-nonfinite-steps", "-1"], "--max-nonfinite-steps must be >= 0"),
    (["--bn-splits", "0"], "--bn-splits must be positive"),
    (["--shuffle-bn", "--bn-splits", "-4"], "--bn-splits must be positive"),
    (["--max-bad-images", "-2"], "--max-bad-images must be -1"),
])
def test_bad_numbers_are_one_line_at_start(extra, match):
    with pytest.raises(UserError, match=match) as err:
        main_pretrain.parse_args(["--data", "somewhere", "--epochs", "1"] + TINY + extra)
    assert "\n" not in str(err.value)


def test_nan_flags_of_the_evaluation_scripts_are_refused_at_start(tmp_path):
    import main_lincls
    import main_lowshot
    base = ["--data", str(tmp_path / "missing"), "--pretrained", str(tmp_path / "missing.pth"),
            "--output-dir", str(tmp_path / "o")]
    with pytest.raises(UserError, match="--lr must be a finite number"):
        main_lincls.main(base + ["--lr", "nan"])
    with pytest.raises(UserError, match="--costs must be a finite number"):
        main_lowshot.main(base + ["--costs", "1", "nan"])
    proc = run_script(["detection/train_torchvision.py", "--train-images", "i", "--train-ann", "a", "--val-images",
                       "i", "--val-ann", "a", "--output-dir", str(tmp_path / "d"), "--lr", "nan"], check=False)
    assert proc.returncode == 1 and proc.stderr.strip() == "error: --lr must be a finite number (got nan)"


# ---------------------------------------------------------------- 10. mid-epoch resume with other inputs

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
    older = load(out / "checkpoint_last.pth")  # a checkpoint from before the dataset size was recorded
    older.pop("num_images", None)
    older.pop("data_id", None)
    torch.save(older, out / "checkpoint_last.pth")
    with pytest.raises(UserError, match="step 1 of epoch 1, which now has 1 step"):
        pretrain(eight, out)


# ---------------------------------------------------------------- 12. --epochs below the checkpoint

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
