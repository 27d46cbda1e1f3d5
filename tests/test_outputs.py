"""What the runs leave on disk is never lost: a finished probe run again keeps its result, a probe refuses another
trunk or other data, one run per output folder, a checkpoint write leaves a live writer's file alone, a kNN lost
between the last checkpoint and log.txt is completed by the rerun, and the probe saves on a stop signal and
resumes exactly."""
import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY, load, write_imagefolder
import main_lincls
import main_lowshot
import main_pretrain
from sce import UserError, outdir
from sce.builder import build_trunk

pytestmark = pytest.mark.usefixtures("in_process")  # conftest: one thread, signal handlers restored


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("outputs") / "data", 3, 8, 16)  # 24 images: 3 steps of 8


def probe(data, pretrained, out, *extra):
    main_lincls.main(["--data", data, "--pretrained", pretrained, "--crop-size", "16", "--batch-size", "8",
                      "--epochs", "1", "--lr", "1", "--print-freq", "1", "--workers", "0", "--output-dir", str(out)]
                     + [str(e) for e in extra])


def results(out, name="linear"):
    with open(os.path.join(out, f"results_{name}.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def probed(data, pretrained, tmp_path_factory):
    """A finished 1-epoch probe; a temporary file of a live writer (this process's parent) and one of a dead
    writer were in its folder before it saved."""
    out = tmp_path_factory.mktemp("outputs") / "probe"
    os.makedirs(out)
    (out / f".checkpoint_last.pth.tmp{os.getppid()}").write_bytes(b"a write in progress")
    (out / f".checkpoint_last.pth.tmp{2 ** 30}").write_bytes(b"left by a writer killed mid-write")
    (out / f".timing.txt.tmp{2 ** 30}").write_text("left by a writer killed mid-write")  # sce.write_file's too
    probe(data, pretrained, out)
    return out


def test_a_finished_probe_run_again_keeps_its_result(data, pretrained, probed, tmp_path, capsys):
    out = shutil.copytree(probed, tmp_path / "probe")
    first = results(out)
    assert first["acc1"] is not None
    os.remove(out / "results_linear.json")  # e.g. a kill between the last save and the results
    capsys.readouterr()
    probe(data, pretrained, out, "--resume", "auto")
    assert "is already complete (1 epochs)" in capsys.readouterr().out
    again = results(out)
    assert (again["acc1"], again["acc5"], again["best_acc1"]) == (first["acc1"], first["acc5"], first["best_acc1"])
    assert load(out / "checkpoint_last.pth")["epoch"] == 1
    # the live writer's temporary file is left alone, the dead writer's is gone
    assert sorted(p.name for p in out.glob(".checkpoint_last.pth.tmp*")) == [f".checkpoint_last.pth.tmp{os.getppid()}"]
    assert not list(out.glob(".timing.txt.tmp*"))


def test_a_probe_refuses_another_trunk_other_data_or_a_fresh_start(data, pretrained, probed, tmp_path):
    out = shutil.copytree(probed, tmp_path / "probe")
    torch.manual_seed(1)
    other = str(tmp_path / "other.pth")
    torch.save(build_trunk("resnet18", True)[0].state_dict(), other)
    before = (out / "checkpoint_last.pth").read_bytes(), (out / "results_linear.json").read_bytes()
    with pytest.raises(UserError, match="is a probe of another trunk than") as err:
        probe(data, other, out, "--resume", "auto")
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="is a probe on other data"):
        probe(write_imagefolder(tmp_path / "data2", 3, 8, 16), pretrained, out)
    with pytest.raises(UserError, match="exists and --resume none would overwrite it"):
        probe(data, pretrained, out, "--resume", "none")
    with pytest.raises(UserError, match="holds the evaluation of another trunk"):
        probe(data, other, out, "--knn", "--arch", "resnet18")
    assert ((out / "checkpoint_last.pth").read_bytes(), (out / "results_linear.json").read_bytes()) == before
    probe(data, pretrained, out, "--knn", "--knn-k", "5")  # the same trunk and data: another classifier is fine
    assert 0 <= results(out, "knn")["acc1"] <= 100
    os.symlink(data, tmp_path / "link")
    probe(str(tmp_path / "link"), pretrained, out)  # the same data by a link to it: the probe, complete, reported
    assert results(out)["acc1"] == json.loads(before[1])["acc1"]


def test_one_run_per_output_folder(data, pretrained, tmp_path):
    out = tmp_path / "out"
    os.makedirs(out)
    held = outdir.Lock(str(out))  # another run: a descriptor of its own on the lock file
    try:
        holder = rf"is in use by another run \(PID {os.getpid()} on "
        with pytest.raises(UserError, match=holder) as err:
            main_pretrain.main(["--data", data, "--epochs", "1", "--output-dir", str(out)] + TINY)
        assert "\n" not in str(err.value)
        with pytest.raises(UserError, match=holder):
            probe(data, pretrained, out)
        os.makedirs(tmp_path / "VOC2007")  # a folder: the lock is checked before its files are
        with pytest.raises(UserError, match=holder):
            main_lowshot.main(["--data", str(tmp_path / "VOC2007"), "--pretrained", pretrained,
                               "--output-dir", str(out)])
        assert sorted(os.listdir(out)) == [".lock"]  # nothing written
    finally:
        held.release()
    probe(data, pretrained, out, "--knn", "--knn-k", "5")  # released: the folder is free again


def test_a_run_taking_its_folder_removes_what_killed_writers_left(tmp_path):
    """A checkpoint's second name (.NAME.linkPID) or temporary file left by a kill -9 is removed as soon as a run
    holds the folder (outdir.Lock), though it may write nothing there (a complete run), also when the PID runs again
    as another process (started after the file was written); a live writer's file stays."""
    out = tmp_path
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])  # a process that started before the file it writes
    try:
        time.sleep(0.1)
        names = {"gone": f".checkpoint_0002.pth.link{dead.pid}", "reused": f".checkpoint_0003.pth.link{live.pid}",
                 "temporary": f".checkpoint_last.pth.tmp{dead.pid}", "probe": f".write_test{dead.pid}",
                 "live": f".checkpoint_0004.pth.link{live.pid}"}
        for name in names.values():
            (out / name).write_bytes(b"PK")
        hour_ago = time.time() - 3600  # written before `live` started: by another process of that PID
        os.utime(out / names["reused"], (hour_ago, hour_ago))
        outdir.Lock(str(out)).release()
        assert sorted(os.listdir(out)) == sorted([".lock", names["live"]])
    finally:
        live.kill()
        live.wait()


def test_a_knn_lost_after_the_last_checkpoint_is_completed_by_the_rerun(data, tmp_path, monkeypatch, capsys):
    args = ["--data", data, "--knn-data", data, "--knn-k", "5", "--epochs", "1", "--output-dir", str(tmp_path)] + TINY

    def failing(*a, **k):
        raise RuntimeError("the kNN monitor failed")
    with monkeypatch.context() as m:
        m.setattr(main_pretrain.knn.Monitor, "__call__", failing)
        with pytest.raises(RuntimeError, match="the kNN monitor failed"):
            main_pretrain.main(args)
    assert load(tmp_path / "checkpoint_last.pth")["epoch"] == 1 and not (tmp_path / "log.txt").exists()
    capsys.readouterr()
    main_pretrain.main(args)
    out = capsys.readouterr().out
    assert "log.txt lacks epoch 1, whose checkpoint was saved: completing its line" in out
    assert "=> epoch 1: kNN top-1" in out and "already complete" in out
    lines = [json.loads(line) for line in open(tmp_path / "log.txt")]
    assert [e["epoch"] for e in lines] == [1] and 0 <= lines[0]["knn_top1"] <= 100 and lines[0]["skipped_steps"] == 0
    assert 0 <= lines[0]["online_top1"] <= 100 and 0 <= lines[0]["online_train_top1"] <= 100  # the online probe


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_probe_saves_on_a_stop_signal_and_resumes_exactly(data, pretrained, tmp_path, monkeypatch, signum):
    flags = ["--epochs", "2", "--schedule", "cosine", "--lr", "0.5", "--warmup-epochs", "1"]  # the lr moves each step
    probe(data, pretrained, tmp_path / "ref", *flags)
    real, calls = F.cross_entropy, [0]

    def signalling(*a, **k):  # the training loss only (validation sums)
        calls[0] += "reduction" not in k
        if calls[0] == 5 and "reduction" not in k:  # step 2 of epoch 2
            os.kill(os.getpid(), signum)
        return real(*a, **k)
    with monkeypatch.context() as m:
        m.setattr(F, "cross_entropy", signalling)
        with pytest.raises(SystemExit) as stop:
            probe(data, pretrained, tmp_path / "run", *flags)
    assert stop.value.code == 75
    saved = load(tmp_path / "run" / "checkpoint_last.pth")
    assert (saved["epoch"], saved["step_in_epoch"]) == (1, 2)
    if signum == signal.SIGTERM:  # within an epoch, another batch or seed would skip or repeat images: refused
        for flag, value in (("--batch-size", 4), ("--seed", 1)):
            with pytest.raises(UserError, match=rf"stopped mid-epoch with {flag} (8|0): resume it with the same "
                                                rf"value \(not {value}\), or from an epoch-end checkpoint"):
                probe(data, pretrained, tmp_path / "run", *flags, flag, value)
        # nor one more image in its folder (the checkpoint moved along with a copy of the data, one file added)
        more = shutil.copytree(data, tmp_path / "more")
        cls = sorted((more / "train").iterdir())[0]
        shutil.copy(sorted(cls.iterdir())[0], cls / "extra.png")
        moved = dict(saved, data=str(more))
        os.makedirs(tmp_path / "moved")
        torch.save(moved, tmp_path / "moved" / "checkpoint_last.pth")
        with pytest.raises(UserError, match=r"stopped mid-epoch on 24 images: resume it on the same data \(not 25"):
            probe(str(more), pretrained, tmp_path / "moved", *flags)
        # nor as many images, one moved to another class
        os.remove(cls / "extra.png")
        os.rename(sorted(cls.iterdir())[0], sorted((more / "train").iterdir())[1] / "moved.png")
        with pytest.raises(UserError, match=r"stopped mid-epoch on other data \(other files, labels or pixels\)"):
            probe(str(more), pretrained, tmp_path / "moved", *flags)
    probe(data, pretrained, tmp_path / "run", *flags)
    a, b = (load(tmp_path / run / "checkpoint_last.pth") for run in ("ref", "run"))
    assert torch.equal(a["model"]["fc.weight"], b["model"]["fc.weight"]) and a["acc1"] == b["acc1"]
    assert {k: v for k, v in results(tmp_path / "run").items() if k != "timing"} == \
        {k: v for k, v in results(tmp_path / "ref").items() if k != "timing"}
    # timing.txt: a line an invocation, the epochs it completed (the stopped one's, not the run's)
    assert [json.loads(line)["epochs"] for line in open(tmp_path / "run" / "timing.txt")] == [[0, 1], [1, 2]]
