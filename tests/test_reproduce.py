"""benchmarks/reproduction/reproduce.sh: the baselines table's small and medium datasets from their official files
(written here in each format, a few images each): SMOKE=1 runs the whole script, its commands are RECIPES.md's settings,
bad input is one line, and a signal reaches the running stage instead of orphaning it."""
import collections
import glob
import importlib.util
import json
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from conftest import REPO, python2_pickle, write_cifar, write_imagefolder, write_stl10, write_tiny_imagenet
import main_pretrain
from sce import UserError
from sce.data import build_dataset
from test_recipes import COMMANDS

PARTS = ["startup", "compiling", "steps", "epoch_ends", "knn", "evaluation", "exit"]  # sce.timing's

SCRIPT = os.path.join(REPO, "benchmarks", "reproduction", "reproduce.sh")
ENV = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
WRITERS = {"cifar10": lambda root: write_cifar(root, 10, per_batch=4),  # 20 train, 4 test
           "cifar100": lambda root: write_cifar(root, 100, per_batch=16),
           "stl10": lambda root: write_stl10(root),  # 8 train + 8 unlabeled, 4 test
           "tiny-imagenet": lambda root: write_tiny_imagenet(os.path.join(root, "tiny-imagenet-200"))}
FOUND = {"cifar10": "CIFAR-10's python batches in cifar-10-batches-py/",
         "cifar100": "CIFAR-100's python batches in cifar-100-python/",
         "stl10": "STL-10's binaries in stl10_binary/", "tiny-imagenet": "Tiny-ImageNet's folders"}


def reproduce(dataset, data, out, timeout=300, **env):
    return subprocess.run(["bash", SCRIPT, dataset, str(data), str(out)], capture_output=True, text=True,
                          timeout=timeout, env=dict(ENV, **env))


def commands(stdout):
    """{(method, stage): argv} of a DRY_RUN's '=== METHOD STAGE: CMD' lines."""
    found = {}
    for method, stage, cmd in re.findall(r"^=== (\w+) (pretrain|linear): (.*)$", stdout, re.M):
        found[method, stage] = shlex.split(cmd)[2:]  # without PYTHON SCRIPT
    return found


def test_commands_are_recipes_settings(tmp_path):
    """DRY_RUN=1: each dataset's pretraining commands are RECIPES.md's line for it (SCE with Table 10's best
    temperatures; MoCo v2 and ReSSL with the same setting and their own temperatures), on its official layout.
    CIFAR-10's with PYTHON unset and no `python` on PATH (only python3, as on many systems)."""
    keys = ["arch", "small_input", "crop_size", "batch_size", "epochs", "lr", "weight_decay", "warmup_epochs",
            "queue_size", "proj_dim", "proj_hidden_dims", "proj_last_bn", "ema_momentum", "ema_schedule", "bn_splits",
            "shuffle_bn"]
    own = {"sce": None, "moco": ["--method", "moco", "--tau", "0.2"],
           "ressl": ["--method", "ressl", "--tau", "0.1", "--tau-m", "0.04"]}
    bin_dir = tmp_path / "bin"
    os.makedirs(bin_dir)
    (bin_dir / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    os.chmod(bin_dir / "python3", 0o755)
    python3_only = dict({k: v for k, v in ENV.items() if k != "PYTHON"}, PATH=f"{bin_dir}:/usr/bin:/bin")
    runs = {}
    for dataset in WRITERS:  # the four at once: each script's start takes seconds
        WRITERS[dataset](str(tmp_path / dataset))
        command = ["bash", SCRIPT, dataset, str(tmp_path / dataset), str(tmp_path / "out" / dataset)]
        runs[dataset] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         env=dict(python3_only if dataset == "cifar10" else ENV, DRY_RUN="1"))
    for dataset, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        found = commands(stdout)
        assert sorted(found) == sorted((m, s) for m in own for s in ("pretrain", "linear"))
        recipe = next(c for c in COMMANDS if f"--dataset {dataset} " in " ".join(c))
        for method, flags in own.items():
            args = main_pretrain.parse_args(found[method, "pretrain"])
            expected = main_pretrain.parse_args(recipe + (flags or []))
            assert args.dataset == dataset and args.knn_data == args.data and args.method == method
            for key in keys + ["tau"] + (["tau_m"] if method != "moco" else []):
                assert getattr(args, key) == getattr(expected, key), (dataset, method, key)
        assert found["sce", "linear"][:4] == ["--dataset", dataset, "--data", found["sce", "pretrain"][3]]
        assert ("=== sce pretrain: python3 main_pretrain.py" in stdout) == (dataset == "cifar10")


def test_bad_input_is_one_line(tmp_path):
    def error(dataset, data, **env):
        proc = reproduce(dataset, data, tmp_path / "out", **env)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        return lines[0]
    assert "use cifar10, cifar100, stl10 or tiny-imagenet" in error("imagenet", tmp_path)
    (tmp_path / "empty").mkdir()
    assert ("holds none of stl10's layouts: expected stl10_binary/ (STL-10's binaries, as downloaded)"
            in error("stl10", tmp_path / "empty"))
    assert "or train/ and val/ class folders of image files" in error("cifar10", tmp_path / "empty")
    write_imagefolder(tmp_path / "folders", num_classes=2, per_class=2)
    assert "unknown method 'simclr'" in error("cifar10", tmp_path / "folders", METHODS="sce simclr")
    assert "METHODS is empty" in error("cifar10", tmp_path / "folders", METHODS=" ")
    folder = write_stl10(str(tmp_path / "stl"))
    with open(os.path.join(folder, "unlabeled_X.bin"), "r+b") as f:
        f.truncate(3 * 96 * 96 * 5 + 1000)  # a download cut off
    assert "unlabeled_X.bin is cut short" in error("stl10", tmp_path / "stl")


def test_the_up_front_check_reads_what_the_readme_says(tmp_path):
    """Every file of an official layout, each CIFAR batch's images against its labels, every val image Tiny-ImageNet
    lists: named in one line before any training (reproduce_tools.check, as reproduce.sh runs it)."""
    tools = importlib.util.module_from_spec(importlib.util.spec_from_file_location(
        "reproduce_tools", os.path.join(REPO, "benchmarks", "reproduction", "reproduce_tools.py")))
    tools.__spec__.loader.exec_module(tools)

    def error(dataset, data):
        with pytest.raises(UserError) as info:
            tools.check(dataset, str(data), str(tmp_path / "data.env"))
        assert "\n" not in str(info.value)
        return str(info.value)
    folder = write_cifar(str(tmp_path / "cifar"), 10)
    os.remove(os.path.join(folder, "data_batch_3"))
    assert "cifar-10-batches-py/data_batch_3 not found: CIFAR10 needs" in error("cifar10", tmp_path / "cifar")
    folder = write_cifar(str(tmp_path / "cifar90"), 10, per_batch=10)
    with open(os.path.join(folder, "test_batch"), "rb") as f:
        batch = pickle.load(f, encoding="latin1")
    with open(os.path.join(folder, "test_batch"), "wb") as f:
        f.write(python2_pickle(dict(batch, labels=batch["labels"][:9])))
    assert "test_batch holds 10 images for 9 labels: download CIFAR10 again" in error("cifar10", tmp_path / "cifar90")
    folder = write_cifar(str(tmp_path / "rows"), 10, per_batch=10)  # rows of 3000 bytes, as many as the labels
    with open(os.path.join(folder, "data_batch_2"), "wb") as f:
        f.write(python2_pickle({"data": np.zeros((10, 3000), np.uint8), "labels": list(range(10))}))
    short = ("data_batch_2 holds images of shape (10, 3000) and type uint8, not CIFAR's rows of 3072 bytes (N, 3072) "
             "uint8: download CIFAR10 again")
    assert short in error("cifar10", tmp_path / "rows")
    with pytest.raises(UserError, match=re.escape(short)):  # the scripts' reader: the same line
        build_dataset("cifar10", str(tmp_path / "rows"), "train")
    root = write_tiny_imagenet(str(tmp_path / "tiny" / "tiny-imagenet-200"))
    os.remove(os.path.join(root, "val", "images", "val_4.JPEG"))
    assert "val_4.JPEG, listed on line 5 of" in error("tiny-imagenet", tmp_path / "tiny")
    # whole files pass, and the check imports no torch (its 2-5 s before any stage)
    write_cifar(str(tmp_path / "whole"), 10, per_batch=10)
    probe = ("import runpy, sys\nsys.argv = ['reproduce_tools.py'] + sys.argv[1:]\n"
             "runpy.run_path('benchmarks/reproduction/reproduce_tools.py', run_name='__main__')\n"
             "print('torch' in sys.modules)")
    said = subprocess.run([sys.executable, "-c", probe, "check", "cifar10", str(tmp_path / "whole"),
                           str(tmp_path / "whole.env")], cwd=REPO, capture_output=True, text=True)
    assert said.returncode == 0 and said.stdout.splitlines()[-1] == "False", said.stdout + said.stderr


def launch(data, out, dataset="cifar10"):
    """reproduce.sh SMOKE=1 of SCE, started."""
    return subprocess.Popen(["bash", SCRIPT, dataset, str(data), str(out)], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(ENV, SMOKE="1", METHODS="sce"))


def training(proc, out):
    """Once its pretraining stage is about to train (its stop handler installed)."""
    log, deadline = out / "sce.pretrain.log", time.time() + 120
    while not (log.exists() and "=> sce on " in log.read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)


def running(out):
    return subprocess.run(["pgrep", "-f", str(out)], capture_output=True).returncode == 0


def test_smoke_run_stopped_and_continued(tmp_path):
    """Two SMOKE=1 invocations side by side. One, on STL-10's official files: SIGTERM to the script (not its group)
    reaches its pretraining, which saves and stops; the script exits with its code and says how to continue, and
    the same command continues the stopped epoch, estimates each stage's time once the first epoch is done, runs the
    linear probe and writes the table, a line per epoch of each stage shown. The other, on an ImageFolder: while it
    runs a second invocation into its OUT_DIR is refused; killed outright (SIGKILL: no trap runs), its running stage
    notices within seconds, saves and stops: nothing trains on orphaned. Run again, the finished one runs nothing and
    its table holds every method finished in OUT_DIR."""
    write_stl10(str(tmp_path / "stl"), train=40, test=20)  # SMOKE: 4 train, 2 val images of each class; 5 steps
    write_imagefolder(tmp_path / "large", num_classes=10, per_class=16, size=16)  # 20 steps: time to notice a kill
    killed, stopped = launch(tmp_path / "large", tmp_path / "kill"), launch(tmp_path / "stl", tmp_path / "term",
                                                                           "stl10")
    training(stopped, tmp_path / "term")
    stopped.send_signal(signal.SIGTERM)
    _, err = stopped.communicate(timeout=60)
    assert stopped.returncode == 75 and "interrupted: run the same command again to continue" in err
    training(killed, tmp_path / "kill")
    second = reproduce("cifar10", tmp_path / "large", tmp_path / "kill", SMOKE="1", METHODS="sce")
    assert second.returncode == 1 and f"is in use by another reproduce.sh (PID {killed.pid})" in second.stderr
    killed.kill()
    said, _ = killed.communicate()
    assert "=> cifar10: image files in train/ and val/ class folders" in said
    # its OUT_DIR is free at once, whatever its orphaned stage still does (it held no descriptor of the lock)
    rerun = reproduce("cifar10", tmp_path / "large", tmp_path / "kill", SMOKE="1", METHODS="sce", DRY_RUN="1")
    assert rerun.returncode == 0, rerun.stderr
    deadline = time.time() + 30
    while running(tmp_path / "term") or running(tmp_path / "kill"):
        assert time.time() < deadline, "a stage still runs"
        time.sleep(0.2)
    for out in ("term", "kill"):
        assert "=> preempted: saved epoch 0 step" in (tmp_path / out / "sce.pretrain.log").read_text(), out

    done = reproduce("stl10", tmp_path / "stl", tmp_path / "term", SMOKE="1", METHODS="sce")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "=> resuming from" in (tmp_path / "term" / "sce.pretrain.log").read_text()
    assert f"=> stl10: {FOUND['stl10']}" in done.stdout
    assert "=> SMOKE: 40 train / 20 val images of stl10's first 10 classes" in done.stdout
    assert re.search(r"^   Epoch \[1/1\]\[5/5\] loss .*\n   => epoch 1: kNN top-1 ", done.stdout, re.M)  # pretraining
    # the estimate from the running stage after its first epoch: one pretraining process, no restart
    assert done.stdout.count("=== sce pretrain") == 1
    assert re.search(r"^   => estimate after epoch 1: .*\n"
                     r"=> estimated time of each stage on this machine: sce pretrain [\d.]+ min, "
                     r"sce linear [\d.]+ min; [\d.]+ min in all", done.stdout, re.M)
    assert re.search(r"^   Epoch 1/1: Acc@1 ", done.stdout, re.M)  # the linear probe's epoch
    # the same command again: every stage is done, nothing runs again; a method finished in OUT_DIR by another
    # invocation (here ReSSL, a copy of the SCE run standing for one) is in the table too
    shutil.copytree(tmp_path / "term" / "sce", tmp_path / "term" / "ressl")
    again = reproduce("stl10", tmp_path / "stl", tmp_path / "term", SMOKE="1", METHODS="sce")
    assert again.returncode == 0 and "===" not in again.stdout and "| SCE |" in again.stdout
    results = json.load(open(tmp_path / "term" / "results.json"))
    assert sorted(results["methods"]) == ["ressl", "sce"]
    row = results["methods"]["sce"]
    assert results["dataset"] == "stl10" and row["paper_linear_top1"] == 89.94
    assert 0 <= row["linear_top1"] <= 100 and 0 <= row["knn_top1"] <= 100 and row["pretrain_s"] > 0
    last = json.loads(open(tmp_path / "term" / "sce" / "log.txt").read().splitlines()[-1])
    assert row["knn_top1"] == last["knn_top1"]
    table = open(tmp_path / "term" / "results.md").read()
    assert f"| SCE | {row['linear_top1']:.2f} / {row['linear_best_top1']:.2f} | {row['knn_top1']:.2f} | 89.94 |" \
        in table and "| ReSSL | " in table
    for png in ("curves.png", "time_split.png"):  # the table's figures, beside it
        assert open(tmp_path / "term" / png, "rb").read(8) == b"\x89PNG\r\n\x1a\n", png
        assert f"term/{png}" in again.stdout
    # each stage's wall time split (sce.timing): the parts add up to its processes' wall time, which is the stage's
    # as the script measured it from outside (two invocations of the pretraining: the stopped one's split too)
    measured = {}
    for line in open(tmp_path / "term" / "times").read().splitlines():
        name, ms = line.rsplit(" ", 1)
        measured[name] = measured.get(name, 0) + int(ms) / 1000
    for stage in ("pretrain", "linear"):
        split = row["split"][stage]
        # each part and the wall rounded to 0.1 s in the row: up to 0.05 s off each
        assert sum(split[p] for p in PARTS) == pytest.approx(split["wall"], abs=0.05 * (len(PARTS) + 1)), (stage, split)
        # within 5%, or 2 s on a loaded machine (the process's start is read from /proc, the script's from outside)
        assert split["wall"] == pytest.approx(measured[f"sce {stage}"], rel=0.05, abs=2.0), (stage, split, measured)
        assert split["steps"] > 0 and f"| SCE {stage} | {split['wall']:.1f} | " in table
    assert row["split"]["pretrain"]["knn"] > 0 and row["split"]["linear"]["evaluation"] > 0
    # start-up in parts (sce.timing.mark), which add up to it: where a GPU's 13-16 s of start-up a stage go
    for stage, parts in (("sce", ["imports", "data", "model and kNN data", "resume and TensorBoard", "rest"]),
                         ("sce/linear", ["imports", "trunk", "data", "rest"])):
        for line in open(tmp_path / "term" / stage / "timing.txt"):
            timed = json.loads(line)
            assert list(timed["startup_parts"]) == parts
            assert sum(timed["startup_parts"].values()) == pytest.approx(timed["startup_s"], abs=0.01)
    # an OUT_DIR holds one dataset from one DATA_DIR, SMOKE's or not: another is refused in one line, before
    # anything runs
    other = reproduce("cifar10", tmp_path / "large", tmp_path / "term", SMOKE="1", METHODS="sce")
    assert other.returncode == 1 and other.stderr.count("\n") == 1 and "===" not in other.stdout
    assert (f"holds the runs of stl10 {tmp_path / 'stl'} (SMOKE=1), not of cifar10 {tmp_path / 'large'} (SMOKE=1)"
            in other.stderr)
    real = reproduce("stl10", tmp_path / "stl", tmp_path / "term", METHODS="sce", DRY_RUN="1")  # SMOKE's, not real
    assert real.returncode == 1 and f"not of stl10 {tmp_path / 'stl'}: pass that DATASET" in real.stderr


def test_a_stop_between_stages_ends_the_script_before_the_next(tmp_path):
    """SIGTERM while no stage runs (here during the data check): no stage starts, the script says how to continue
    and exits 75; the same command then proceeds (DRY_RUN). A stage the signal ends before it can take it: 75 too."""
    write_imagefolder(tmp_path / "data", num_classes=2, per_class=2)
    python = tmp_path / "python"  # the interpreter, which signals the script as it checks the data
    python.write_text(f'#!/bin/bash\n[ "$2" = check ] && kill -TERM $PPID\nexec {sys.executable} "$@"\n')
    os.chmod(python, 0o755)
    stopped = reproduce("cifar10", tmp_path / "data", tmp_path / "out", METHODS="sce", PYTHON=str(python))
    assert stopped.returncode == 75 and "=> interrupted: run the same command again to continue" in stopped.stderr
    assert "===" not in stopped.stdout and not os.path.exists(tmp_path / "out" / "sce")
    again = reproduce("cifar10", tmp_path / "data", tmp_path / "out", METHODS="sce", DRY_RUN="1")
    assert again.returncode == 0 and "=== sce pretrain" in again.stdout
    # a stop while a stage is still in its imports (it dies of the signal, 143): an interruption too, exit 75
    python.write_text(f'#!/bin/bash\n[ "$1" = main_pretrain.py ] && {{ kill -TERM $PPID; sleep 30; }}\n'
                      f'exec {sys.executable} "$@"\n')
    early = reproduce("cifar10", tmp_path / "data", tmp_path / "early", METHODS="sce", PYTHON=str(python))
    assert early.returncode == 75 and "sce pretrain stopped (exit 143); interrupted: run the same" in early.stderr


def test_smoke_reads_official_files_as_the_scripts_do(tmp_path):
    """SMOKE=1's small ImageFolder, written from an official layout with numpy and PIL alone (reproduce_tools.smoke:
    CIFAR's python batches, Tiny-ImageNet's val annotations), holds the images and labels sce.data reads."""
    tools = importlib.util.module_from_spec(importlib.util.spec_from_file_location(
        "reproduce_tools", os.path.join(REPO, "benchmarks", "reproduction", "reproduce_tools.py")))
    tools.__spec__.loader.exec_module(tools)
    smoke = tools.SMOKE_IMAGES
    write_cifar(str(tmp_path / "cifar"), 10, per_batch=3)
    write_tiny_imagenet(str(tmp_path / "tiny" / "tiny-imagenet-200"))
    for dataset, data in (("cifar10", tmp_path / "cifar"), ("tiny-imagenet", tmp_path / "tiny")):
        env, folder = tmp_path / f"{dataset}.env", tmp_path / f"{dataset}_smoke"
        tools.check(dataset, str(data), str(env), str(folder))
        root = tools.read_env(str(env))
        assert root["FORMAT"] == "imagefolder" and root["ROOT"] == str(folder)
        fmt, official_root, _ = tools.layout(dataset, str(data))  # the folder the scripts get as --data
        # the classes both splits hold (Tiny-ImageNet's val lacks the first: no empty class folder), 16 / 8 images each
        counts = {split: collections.Counter(build_dataset(fmt, official_root, split).targets) for split in smoke}
        both = [c for c in counts["train"] if c in counts["val"] and c < 10]
        for split in smoke:
            official = build_dataset(fmt, official_root, split)
            files = sorted(glob.glob(str(folder / split / "*" / "*.png")))
            assert len(build_dataset("imagefolder", str(folder), split)) == len(files)
            assert files and len(files) == sum(min(counts[split][c], smoke[split]) for c in both)
            for path in files:
                image, target = official[int(os.path.basename(path)[:-4])]
                assert os.path.basename(os.path.dirname(path)) == f"class_{target:03d}", (dataset, split, path)
                assert np.array_equal(np.asarray(Image.open(path)), np.asarray(image.convert("RGB"))), path


def test_every_kind_of_dataset_row_is_read_by_the_reproduction(tmp_path, monkeypatch):
    """reproduce_tools' layout takes each kind of row of sce.layouts.DATASETS (an official download, one with
    train/ and val/ folders, a folders row without a download: imagenet100's kind), and its recipe comes from
    sce/recipes.py, the numbers' one copy; a dataset without a row there is one line."""
    tools = importlib.util.module_from_spec(importlib.util.spec_from_file_location(
        "reproduce_tools", os.path.join(REPO, "benchmarks", "reproduction", "reproduce_tools.py")))
    tools.__spec__.loader.exec_module(tools)
    monkeypatch.setitem(tools.PAPER["sce"][1], "imagenet100", 0.0)  # as if the table had a folders dataset
    folders = write_imagefolder(tmp_path / "in100", num_classes=2, per_class=1)
    assert tools.layout("imagenet100", folders)[:2] == ("imagenet100", folders)
    with pytest.raises(UserError, match="has no train/ and val/ class folders"):
        tools.layout("imagenet100", str(tmp_path))
    assert tools.recipe_flags("imagenet100")[:2] == ["--arch", "resnet50"]  # its row, sce/recipes.py's
    monkeypatch.setitem(tools.PAPER["sce"][1], "imagefolder", 0.0)
    with pytest.raises(UserError, match="sce/recipes.py has no row for imagefolder"):
        tools.recipe_flags("imagefolder")
    assert tools.layout("tiny-imagenet", write_tiny_imagenet(str(tmp_path / "tiny")))[0] == "tiny-imagenet"
    assert "--tau 0.1 --tau-m 0.04" in " ".join(tools.recipe_flags("stl10"))
