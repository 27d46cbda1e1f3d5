"""The scripts' one-line errors (docs/health.md), each naming what to do, before anything is trained: flags out of
range or not finite, impossible settings, odd folders (loose images, an official download given without
--dataset, an empty train/, a malformed or incomplete Tiny-ImageNet val split), missing or foreign checkpoints,
resumes that conflict, unwritable output folders; and during a run, an unreadable image (an evaluation reads
every image; pretraining, past --max-bad-images) or a dataset no image of which reads. And what is not an error:
a stray .DS_Store beside Tiny-ImageNet's classes."""
import builtins
import errno
import io
import os
import pickle
import re

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import (TINY, class_image, exit_message, load, python2_pickle, run_script, write_cifar,
                      write_imagefolder, write_tiny_imagenet)
import main_lincls
import main_lowshot
import main_pretrain
from sce import UserError, cli, entry
from sce.builder import build_trunk
from sce.compiling import error_line
from sce.layouts import read_batch

pytestmark = pytest.mark.usefixtures("in_process")  # conftest: one thread, signal handlers restored



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("errors") / "data", 3, 8, 20)


def as_user_runs(main, argv):
    """The script's own entry (entry.run): what it exits with (None: it ran through; an error: its line)."""
    try:
        entry.run(lambda: main(argv))
    except SystemExit as done:
        return done.code
    return None


def one_line(main, argv, match):
    message = as_user_runs(main, argv)
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    assert match in message, message
    return message


def test_folders_without_class_folders(pretrained, tmp_path):
    loose = tmp_path / "loose"
    os.makedirs(loose)
    for i in range(3):
        Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(loose / f"{i}.jpg")
    one_line(main_pretrain.main, ["--data", str(loose), "--output-dir", str(tmp_path / "o1")] + TINY,
             "loose has no class folders (3 files or hidden folders): expected one sub-folder of images per class")
    official = write_cifar(str(tmp_path / "cifar"), 10)
    for data in (official, tmp_path / "cifar"):  # the batches' folder, or its parent
        one_line(main_pretrain.main, ["--data", str(data), "--output-dir", str(tmp_path / "o2")] + TINY,
                 "it holds cifar10's official files: pass --dataset cifar10")
    empty = write_imagefolder(tmp_path / "empty", 2, 2, 16, splits=("val",))
    os.makedirs(os.path.join(empty, "train"))
    one_line(main_lincls.main, ["--data", empty, "--pretrained", pretrained, "--knn", "--output-dir",
                                str(tmp_path / "o3")], "train has no class folders")


def test_tiny_imagenet_val_split(pretrained, tmp_path):
    root = write_tiny_imagenet(tmp_path / "tiny")
    (tmp_path / "tiny" / "train" / ".DS_Store").write_bytes(b"Finder's")  # not a class
    knn = ["--data", root, "--dataset", "tiny-imagenet", "--pretrained", pretrained, "--knn", "--knn-k", "5",
           "--workers", "0", "--output-dir", str(tmp_path / "knn")]
    assert as_user_runs(main_lincls.main, knn) is None  # read, classes and all
    listing = os.path.join(root, "val", "val_annotations.txt")
    lines = open(listing).read().splitlines()
    os.remove(os.path.join(root, "val", "images", "val_2.JPEG"))
    one_line(main_lincls.main, knn, "val_2.JPEG, listed on line 3 of")
    one_line(main_lincls.main, knn, "is missing (1 listed images are): restore it from the download, or remove its "
                                    "line from val_annotations.txt")
    with open(listing, "w") as f:
        f.write("\n".join(lines[:2] + ["val_2.JPEG n03 0 0 10 10"]) + "\n")  # spaces for tabs
    one_line(main_lincls.main, knn, "val_annotations.txt line 3 is not 'FILE<tab>WNID<tab>box'")


def test_a_dataset_of_unreadable_images_read_by_workers(tmp_path):
    data = tmp_path / "data"
    for c in range(2):
        os.makedirs(data / f"class_{c}")
        for i in range(8):
            (data / f"class_{c}" / f"{i}.png").write_bytes(b"not a picture")
    argv = ["--data", str(data), "--output-dir", str(tmp_path / "out"), "--epochs", "1"] + TINY + ["--workers", "2"]
    one_line(main_pretrain.main, argv, "no image of the dataset is readable (")


def test_a_file_that_is_no_checkpoint(tmp_path):
    data = write_imagefolder(tmp_path / "data", 2, 2, 16)
    (tmp_path / "notes.pth").write_text("hello, these are my notes\n")
    one_line(main_lincls.main, ["--data", data, "--pretrained", str(tmp_path / "notes.pth"), "--knn",
                                "--output-dir", str(tmp_path / "o")],
             "notes.pth is not a PyTorch checkpoint (it begins 'hello, these are my note', not as a file of "
             "torch.save)")
    # a file cut short: torch's reason, ended where a sentence ends (its third sentence would pass 200 characters)
    torch.save({"kind": "lincls", "model": {"w": torch.zeros(1000)}}, tmp_path / "cut.pth")
    whole = (tmp_path / "cut.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(whole[:len(whole) // 2])
    message = one_line(main_lincls.main, ["--data", data, "--pretrained", str(tmp_path / "cut.pth"), "--knn",
                                          "--output-dir", str(tmp_path / "o")], "cut.pth is not a readable PyTorch "
                       "checkpoint (PytorchStreamReader failed reading zip archive: failed finding central directory.")
    assert message.endswith(".)"), message
    sentences = "The first sentence says what failed. A second one says more. " * 2
    assert error_line(RuntimeError(sentences + "x" * 100)) == sentences.strip()  # cut after a sentence
    assert error_line(RuntimeError("a clause, " * 30)) == "a clause, " * 18 + "a clause..."  # else after a clause
    # a pickle of another writer (protocol 4): torch's reason, not its advice on weights_only cut short
    (tmp_path / "pickled.pth").write_bytes(pickle.dumps({"epoch": 1}, protocol=4))
    one_line(main_lincls.main, ["--data", data, "--pretrained", str(tmp_path / "pickled.pth"), "--knn",
                                "--output-dir", str(tmp_path / "o")], f"error: {tmp_path / 'pickled.pth'} is not a "
             "PyTorch checkpoint: a pickle torch.save did not write (Unsupported operand 149): pass the "
             "checkpoint_last.pth of a run")
    # a checkpoint of ours lacking what a resume reads (another version's): the keys named, no KeyError
    torch.save({"kind": "pretrain", "args": {}, "step_in_epoch": 1}, tmp_path / "older.pth")
    message = one_line(main_pretrain.main, ["--data", data, "--resume", str(tmp_path / "older.pth"), "--output-dir",
                                            str(tmp_path / "p")] + TINY + ["--batch-size", "4"],
                       "older.pth lacks model, optimizer, rng, ")
    assert "num_images, data_id: it was written by another version" in message


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
        main_pretrain.check_args(main_pretrain.parse_args(["--data", "somewhere", "--epochs", "1"] + TINY + extra))
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
    assert exit_message("detection/train_torchvision.py", "--train-images", "i", "--train-ann", "a", "--val-images",
                        "i", "--val-ann", "a", "--output-dir", tmp_path / "d", "--lr", "nan") \
        == "error: --lr must be a finite number (got nan)"  # what its __main__ passes to sys.exit: exit 1, one line


@pytest.mark.parametrize("flag,value,match", [
    ("--epochs", "0", "--epochs must be positive (got 0)"),  # was: 100 epochs
    ("--batch-size", "0", "--batch-size must be positive (got 0)"),  # was: 256
    ("--lr", "0", "--lr must be positive (got 0.0)"), ("--crop-size", "0", "--crop-size must be positive (got 0)"),
    ("--milestones", "0", "--milestones must be positive (got 0)"), ("--knn-k", "0", "--knn-k must be positive"),
    ("--logreg-max-iter", "0", "--logreg-max-iter must be positive"), ("--dist-timeout", "0", "must be positive"),
    ("--warmup-epochs", "-1", "--warmup-epochs must be >= 0"), ("--weight-decay", "-1", "--weight-decay must be >= 0"),
    ("--sgd-momentum", "1.5", "--sgd-momentum must lie in [0, 1]"), ("--workers", "-1", "--workers must be >= 0"),
    ("--val-fraction", "0", "--val-fraction must lie between 0 and 1, both excluded (got 0.0)"),
    ("--val-fraction", "1", "--val-fraction must lie between 0 and 1")])
def test_lincls_refuses_a_value_out_of_a_flags_range(flag, value, match, tmp_path):
    """Every number main_lincls.py takes, out of its range: one line before any work (0 is no default)."""
    import main_lincls
    with pytest.raises(UserError, match=re.escape(match)):
        main_lincls.main(["--data", str(tmp_path / "missing"), "--pretrained", str(tmp_path / "missing.pth"), flag,
                          value, "--output-dir", str(tmp_path / "o")])
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize("flag,value,match", [
    ("--runs", "0", "--runs must be positive"), ("--costs", "0", "--costs must be positive"),
    ("--batch-size", "0", "--batch-size must be positive"), ("--resize", "0", "--resize must be positive"),
    ("--crop-size", "0", "--crop-size must be positive"), ("--workers", "-1", "--workers must be >= 0"),
    ("--jobs", "0", "--jobs must be positive, or -1"), ("--cv-folds", "1", "--cv-folds must be at least 2 (got 1)"),
    ("--seed", "-1", "--seed must lie in")])
def test_lowshot_refuses_a_value_out_of_a_flags_range(flag, value, match, tmp_path):
    """Every number main_lowshot.py takes, out of its range (--cv-folds under the default --cost-selection too)."""
    import main_lowshot
    with pytest.raises(UserError, match=re.escape(match)):
        main_lowshot.main(["--data", str(tmp_path / "missing"), "--pretrained", str(tmp_path / "missing.pth"), flag,
                           value, "--output-dir", str(tmp_path / "o")])
    assert not os.path.exists(tmp_path / "o")


def one_line_error(args, match):
    """The script as users run it: non-zero exit, one line on stderr, no traceback."""
    proc = run_script(args, check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines and "error" in lines[-1] and match in lines[-1], proc.stderr[-2000:]


def user_error(argv, match):
    """Same checks in-process (no interpreter start): main() raises the UserError the script prints."""
    import main_pretrain
    with pytest.raises(UserError, match=match):
        main_pretrain.main(argv)


def test_bad_input_is_one_line(data, tmp_path, capsys):
    """As users run it: exit 1 with one line on stderr, no traceback; a flag argparse refuses: its usage, exit 2."""
    one_line_error(["main_pretrain.py", "--data", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "o")],
                   "does not exist")
    with pytest.raises(SystemExit) as stop:
        main_pretrain.main(["--data", data, "--online-aug", "extreme"])
    assert stop.value.code == 2 and "invalid choice: 'extreme'" in capsys.readouterr().err


@pytest.mark.parametrize("extra,match", [
    (["--arch", "resnet7"], "unknown arch"),
    (["--queue-size", "36"], "not a multiple"),
    (["--lambda", "1.5"], "--lambda"),
    (["--tau", "0"], "temperatures must be positive"),
    (["--tau-m", "-0.1"], "temperatures must be positive"),
    (["--batch-size", "100", "--queue-size", "100"], "fewer than one batch"),
    (["--shuffle-bn", "--bn-splits", "3"], "--bn-splits 3 must divide the batch of 8"),
    (["--shuffle-bn"], "--bn-splits 8 must divide the batch of 8 into chunks of at least 2"),
    (["--lambda-end", "1.5"], "must lie in \\[0, 1\\]"),
    (["--lambda-schedule", "cosine", "--method", "moco"], "need the SCE loss"),
    (["--loss-coeffs", "1", "0", "0", "--method", "moco"], "--loss-coeffs is a setting of --method sce, not of moco"),
    (["--mask-positive", "--method", "ressl"], "--mask-positive is a setting of --method sce, not of ressl"),
    (["--crop-size", "6"], "too small to blur"),
    (["--seed", "-1"], r"--seed must lie in \[0, 9223372036854775807\] \(got -1\)"),
    (["--seed", "99999999999999999999"], r"--seed must lie in \[0, 9223372036854775807\] \(got 9999"),
    (["--seed", str(2 ** 64)], r"--seed must lie in \[0, 9223372036854775807\]"),  # seed 0's order, before
    (["--print-freq", "0"], "--print-freq must be positive"),
    (["--workers", "-1"], "--workers must be >= 0"),
    (["--save-freq", "0"], "--save-freq must be positive"),
    (["--proj-hidden-dims", "32", "0"], "--proj-hidden-dims must be positive"),
    (["--ema-momentum", "1.5"], "--ema-momentum must lie in \\[0, 1\\]"),
    (["--min-scale", "1.5"], "need 0 < min <= max <= 1"),
    (["--local-crop-sizes", "8", "--local-crop-scales", "0.5", "0.1"], "need 0 < min <= max <= 1"),
    (["--knn-max-train", "0"], "--knn-max-train must be positive"),
])
def test_bad_flags(data, tmp_path, extra, match):
    user_error(["--data", data, "--epochs", "1", "--output-dir", str(tmp_path / "o")] + TINY + extra, match)


def test_settings_the_ranks_cannot_run(data):
    args = main_pretrain.parse_args(["--data", data] + TINY + ["--batch-size", "9", "--queue-size", "36"])
    with pytest.raises(UserError, match="--batch-size 9 is not divisible by the 2 ranks: use a multiple of 2"):
        main_pretrain.check_args(args, world_size=2)
    args = main_pretrain.parse_args(["--data", data, "--sync-bn"] + TINY)
    with pytest.raises(UserError, match="--sync-bn needs GPUs"):
        main_pretrain.check_args(args, world_size=2)


def test_bad_files(data, tmp_path):
    base = ["--epochs", "1"] + TINY
    os.makedirs(tmp_path / "empty" / "class_a")
    user_error(["--data", str(tmp_path / "empty"), "--output-dir", str(tmp_path / "o")] + base, "no images found")
    user_error(["--data", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o")] + base, "does not exist")
    os.makedirs(tmp_path / "knn" / "train" / "a")
    user_error(["--data", data, "--knn-data", str(tmp_path / "knn"), "--output-dir", str(tmp_path / "o")] + base,
               "has no val/ folder")
    blocker = tmp_path / "file"
    blocker.write_text("")
    user_error(["--data", data, "--output-dir", str(blocker / "sub")] + base, f"{blocker} is a file, not a folder")
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    user_error(["--data", data, "--output-dir", str(tmp_path / "j"), "--resume", str(junk)] + base,
               "is not a PyTorch checkpoint .it begins")
    main_pretrain.main(["--data", data, "--output-dir", str(tmp_path / "r18")] + base)
    other = [a if a != "resnet18" else "resnet34" for a in base]
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + other, "--arch resnet18")
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--queue-size", "64"], "--queue-size")
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--optimizer", "lars"],
               "--optimizer sgd")
    # the optimizer's saved state would silently keep the old weight decay; the objective may not change mid-run
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--wd", "1e-3"],
               "--weight-decay 1e-4, not 0.001")
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--method", "moco"], "--method sce")
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--tau-m", "0.05"], "--tau-m 0.07")
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--mask-positive"],
               "--mask-positive off, not on")  # a setting of its method's record
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--wd-exclude-bias-norm"],
               "--wd-exclude-bias-norm off, not on")
    mid = load(tmp_path / "r18" / "checkpoint_last.pth")
    mid["step_in_epoch"] = 1  # as a preempted run leaves it
    torch.save(mid, tmp_path / "mid.pth")
    user_error(["--data", data, "--output-dir", str(tmp_path / "m"), "--resume", str(tmp_path / "mid.pth")]
               + base + ["--batch-size", "4", "--queue-size", "32"], "stopped mid-epoch with --batch-size 8")
    # spelling out what the run applied (SGD: no exclusion) is the same setting
    main_pretrain.main(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--no-wd-exclude-bias-norm"])
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18"), "--resume", "none"] + base, "would overwrite")


def test_bad_inputs_name_the_file(pretrained, data, tmp_path):
    import main_lincls
    foreign = tmp_path / "foreign.pth"
    torch.save({"weights": torch.zeros(3)}, foreign)
    with pytest.raises(UserError, match=f"{re.escape(str(foreign))}.*no torchvision-style ResNet trunk"):
        main_lincls.main(["--data", data, "--pretrained", str(foreign), "--workers", "0"])
    with pytest.raises(UserError, match=f"{re.escape(pretrained)}.*resnet18.*--arch resnet50"):
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--arch", "resnet50", "--workers", "0"])
    one = write_imagefolder(tmp_path / "one", 1, 2, 16)
    with pytest.raises(UserError, match=f"{re.escape(os.path.join(one, 'train'))}.*single class"):
        main_lincls.main(["--data", one, "--pretrained", pretrained, "--workers", "0",
                          "--output-dir", str(tmp_path / "1")])
    with pytest.raises(UserError, match="not a main_lincls.py checkpoint"):
        main_lincls.main(["--data", data, "--resume", pretrained, "--workers", "0", "--output-dir", str(tmp_path)])
    with pytest.raises(UserError, match="--evaluate needs a trained head"):
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--evaluate", "--workers", "0",
                          "--output-dir", str(tmp_path)])
    odd = write_imagefolder(tmp_path / "odd", 3, 2, 16)
    os.rename(os.path.join(odd, "val", "class_2"), os.path.join(odd, "val", "class_9"))
    with pytest.raises(UserError, match="different classes .first difference: class_2.: both need the same"):
        main_lincls.main(["--data", odd, "--pretrained", pretrained, "--workers", "0",
                          "--output-dir", str(tmp_path / "2")])
    with pytest.raises(UserError, match="--metric map11 does not fit --dataset imagefolder"):
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--classifier", "logreg", "--metric", "map11",
                          "--workers", "0", "--output-dir", str(tmp_path)])
    for flag, value, match in [("--print-freq", "0", "positive"), ("--knn-t", "0", "positive"),
                               ("--lr", "-1", "positive"), ("--logreg-c", "-1", "positive")]:
        with pytest.raises(UserError, match=f"{flag} must be {match}"):
            main_lincls.main(["--data", data, "--pretrained", pretrained, flag, value, "--workers", "0"])
    with pytest.raises(UserError, match="voc07 is multi-label: use --classifier logreg"):
        main_lincls.main(["--data", data, "--dataset", "voc07", "--pretrained", pretrained, "--workers", "0",
                          "--output-dir", str(tmp_path)])
    # the head overflows after the first step; the non-finite loss is noted on the device and
    # reported at the next progress line, before anything is saved
    with pytest.raises(UserError, match=r"loss is (nan|inf) at epoch 1 step [2-6]: lower --lr"):
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--workers", "0", "--lr", "1e38",
                          "--batch-size", "4", "--epochs", "1", "--output-dir", str(tmp_path / "diverged")])
    assert not os.path.exists(tmp_path / "diverged" / "checkpoint_last.pth")


def spoil(folder, how):
    """A file of `folder` no reader takes: bytes that are no image, or a real JPEG cut in half (its
    header is fine: the device's decoder gets it)."""
    path = os.path.join(folder, "x.jpg")
    if how == "garbage":
        data = b"not an image"
    else:
        buffer = io.BytesIO()
        Image.fromarray(class_image(1, np.random.default_rng(1), 64)).save(buffer, "JPEG", quality=90)
        data = buffer.getvalue()[:buffer.getbuffer().nbytes // 2]
    with open(path, "wb") as f:
        f.write(data)
    return path


def assert_names(info, path):
    message = str(info.value)
    assert path in message and "fix or remove it" in message and "\n" not in message, message
    assert "--max-bad-images" not in message, message


@pytest.fixture(scope="module")
def imagenet_stem(tmp_path_factory):
    """A plain torchvision ResNet-18 state dict: an ImageNet-stem trunk, whose JPEGs --decode device reads."""
    path = tmp_path_factory.mktemp("stem") / "resnet18.pth"
    torch.save(build_trunk("resnet18", False)[0].state_dict(), path)
    return str(path)


PATHS = {  # main_lincls.py flags of each evaluation path
    "knn loader": ["--knn", "--preload", "off"],
    "knn workers": ["--knn", "--preload", "off", "--workers", "1"],
    "knn preloaded": ["--knn", "--preload", "device"],
    "knn decoded on the device": ["--knn", "--decode", "device", "--arch", "resnet18", "STEM"],
    "linear loader": ["--epochs", "1", "--batch-size", "12", "--preload", "off"],
    "logreg": ["--classifier", "logreg", "--logreg-c", "1"],
}


@pytest.mark.parametrize("how", ["garbage", "truncated"])
@pytest.mark.parametrize("path", list(PATHS))
def test_unreadable_image_in_evaluation_is_one_line(pretrained, imagenet_stem, tmp_path, path, how):
    data = write_imagefolder(tmp_path / "data", 3, 4, 16)
    bad = spoil(os.path.join(data, "train", "class_1"), how)
    flags = [f for f in PATHS[path] if f != "STEM"]
    trunk = imagenet_stem if "STEM" in PATHS[path] else pretrained
    with pytest.raises(UserError) as info:
        main_lincls.main(["--data", data, "--pretrained", trunk, "--crop-size", "16", "--workers", "0",
                          "--output-dir", str(tmp_path / "out")] + flags)
    assert_names(info, bad)


def test_unreadable_image_in_lowshot_is_one_line(pretrained, tmp_path):
    from test_lowshot import write_voc
    voc, _ = write_voc(tmp_path / "VOC2007", 8, 4, 16)
    bad = os.path.join(voc, "JPEGImages", "000002.jpg")
    with open(bad, "wb") as f:
        f.write(b"not an image")
    with pytest.raises(UserError) as info:
        main_lowshot.main(["--data", voc, "--pretrained", pretrained, "--workers", "1", "--shots", "full",
                           "--output-dir", str(tmp_path / "out")])
    assert_names(info, bad)


@pytest.mark.parametrize("preload", ["off", "device"])
def test_unreadable_image_in_the_knn_monitor_is_one_line(tmp_path, preload):
    data = write_imagefolder(tmp_path / "data", 2, 4, 16, splits=("",))
    knn = write_imagefolder(tmp_path / "knn", 2, 2, 16)
    bad = spoil(os.path.join(knn, "val", "class_0"), "truncated")
    with pytest.raises(UserError) as info:  # whatever --max-bad-images says: the monitor reads every image
        main_pretrain.main(["--data", data, "--knn-data", knn, "--epochs", "1", "--preload", preload,
                            "--max-bad-images", "5", "--output-dir", str(tmp_path / "out")] + TINY)
    assert_names(info, bad)
    assert "every image" in next(a.help for a in main_pretrain.parser._actions if "--knn-data" in a.option_strings)


def refuse_writes_under(monkeypatch, folder):
    """Writes under `folder` fail as on a read-only folder (the tests run as root, which permissions do not stop)."""
    real = builtins.open

    def guarded(file, mode="r", *args, **kwargs):
        if str(file).startswith(str(folder)) and set(mode) & set("wax+"):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real(file, mode, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", guarded)


def test_unwritable_output_dir_stops_at_start(pretrained, data, tmp_path, monkeypatch, capsys):
    from test_lowshot import write_voc
    voc, _ = write_voc(tmp_path / "VOC2007", 8, 4, 16)
    under_a_file = tmp_path / "file" / "out"
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=f"{under_a_file} cannot be made: {tmp_path / 'file'} is a file, not a folder: "
                                        "remove it, or pass another --output-dir"):
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--knn", "--workers", "0",
                          "--output-dir", str(under_a_file)])
    os.symlink(tmp_path / "gone", tmp_path / "link")  # a link to a folder not made yet, not "File exists"
    with pytest.raises(UserError, match=f"{tmp_path / 'link'} is a link to {tmp_path / 'gone'}, which does not exist: "
                                        "create that folder, or pass another --output-dir"):
        main_lowshot.main(["--data", voc, "--pretrained", pretrained, "--workers", "0", "--shots", "full",
                           "--output-dir", str(tmp_path / "link")])
    capsys.readouterr()
    refuse_writes_under(monkeypatch, tmp_path / "ro")
    os.makedirs(tmp_path / "ro")
    with pytest.raises(UserError, match="is not writable"):
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--knn", "--workers", "0",
                          "--output-dir", str(tmp_path / "ro")])
    assert "features" not in capsys.readouterr().out  # before any work


def test_a_checkpoint_path_that_is_a_directory_says_so(data, tmp_path):
    for flag in ("--pretrained", "--resume"):
        with pytest.raises(UserError, match=f"{re.escape(str(tmp_path))} is a directory.*"
                                            f"{re.escape(os.path.join(str(tmp_path), 'checkpoint_last.pth'))}"):
            main_lincls.main(["--data", data, flag, str(tmp_path), "--workers", "0",
                              "--output-dir", str(tmp_path / "out")])


def test_data_that_is_a_file_says_so(pretrained, data, tmp_path):
    """--data naming a checkpoint or an image: one line naming it, for each script (NotADirectoryError before), and
    the evaluation's output folder is not bound to it (a rerun with the right --data proceeds)."""
    line = f"data path '{pretrained}' is a file, not a folder: pass the folder that holds the dataset as --data DIR"
    out = str(tmp_path / "out")
    one_line(main_pretrain.main, ["--data", pretrained, "--output-dir", out] + TINY, line)
    one_line(main_lincls.main, ["--data", pretrained, "--pretrained", pretrained, "--knn", "--output-dir", out], line)
    one_line(main_lowshot.main, ["--data", pretrained, "--pretrained", pretrained, "--output-dir", out], line)
    assert not os.path.exists(os.path.join(out, "evaluated.json"))
    image = os.path.join(data, "train", "class_0", "0.png")
    one_line(main_pretrain.main, ["--data", image, "--output-dir", out, "--dataset", "cifar10"] + TINY,
             f"data path '{image}' is a file, not a folder")


def test_seeds_in_range_serve_every_use_and_others_are_one_line(tmp_path):
    """Every use of the seed takes the largest accepted one (torch's generators with an epoch added, the views' and
    the orders' hashes); main_lincls.py refuses beyond it, main_lowshot.py beyond 32 bits (scikit-learn's folds)."""
    from sce.data import samplers, views
    seed = cli.SEED_MAX
    torch.Generator().manual_seed(seed + 10 ** 6)
    assert samplers.order_seed(seed, 3) != samplers.order_seed(0, 3)
    assert not np.array_equal(views.uniforms(seed, 3, [0, 1], 0), views.uniforms(0, 3, [0, 1], 0))
    base = ["--data", str(tmp_path), "--pretrained", str(tmp_path / "missing.pth"), "--output-dir", str(tmp_path / "o")]
    one_line(main_lincls.main, base + ["--seed", str(2 ** 63)], "--seed must lie in [0, 9223372036854775807] (got")
    one_line(main_lowshot.main, base + ["--seed", str(2 ** 32)],
             "--seed must lie in [0, 4294967295] (scikit-learn's cross-validation takes 32-bit seeds) (got 4294967296)")


def test_the_knn_and_feature_lines_name_their_own_flags_and_files(pretrained, data, tmp_path, monkeypatch):
    """kNN's batches are not --batch-size's (the probe's), nor is its data --data; the feature cache is no
    checkpoint, and a first write that fails has no previous file to keep."""
    base = ["--data", data, "--pretrained", pretrained, "--output-dir", str(tmp_path / "o")]
    message = one_line(main_lincls.main, base + ["--knn", "--crop-size", str(10 ** 6)], "error: --classifier knn's "
                       f"batches of 256 images of {10 ** 6} px (--crop-size): their pixels in float32 need")
    assert message.endswith(": lower --crop-size"), message
    one_line(main_pretrain.main, ["--data", data, "--knn-data", str(tmp_path / "missing"), "--output-dir",
                                  str(tmp_path / "p")] + TINY, f"'{tmp_path / 'missing'}' does not exist: pass "
             "--knn-data DIR")

    def full(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch, "save", full)
    message = one_line(main_lincls.main, base + ["--classifier", "logreg", "--logreg-c", "1"],
                       f"error: could not write feature cache {tmp_path / 'o' / 'features_train_'}")
    assert message.endswith("; nothing was written") and "checkpoint" not in message, message


@pytest.mark.parametrize("label", [99, -1])
def test_cifar_labels_outside_its_classes_are_one_line(pretrained, tmp_path, label):
    """A CIFAR batch labelled outside 0-9: the file and the label named at start, not an IndexError mid-run."""
    folder = write_cifar(tmp_path / "cifar")
    batch = read_batch(folder / "data_batch_3")
    batch["labels"][2] = label
    (folder / "data_batch_3").write_bytes(python2_pickle(batch))
    one_line(main_lincls.main, ["--data", str(tmp_path / "cifar"), "--dataset", "cifar10", "--pretrained", pretrained,
                                "--epochs", "1", "--output-dir", str(tmp_path / "o")],
             f"error: {folder / 'data_batch_3'} holds the label {label}, not one of its 10 classes (0 to 9): download "
             "CIFAR10 again")


def test_official_files_refused_before_the_output_folder_is_made(pretrained, tmp_path):
    """A crafted CIFAR batch (its labels an int) as --data or --knn-data: one line, and no output folder (issue 61:
    main_pretrain.py left one holding its lock, main_lincls.py one bound to the data by its evaluated.json)."""
    good, bad = write_cifar(tmp_path / "good", per_batch=2), write_cifar(tmp_path / "bad", per_batch=2)
    (bad / "data_batch_2").write_bytes(pickle.dumps({"labels": 3, "data": np.zeros((1, 3072), np.uint8)}, protocol=2))
    line = (f"error: {bad / 'data_batch_2'} holds labels that are an int, not a list or a 1-d integer array: download "
            "CIFAR10 again")
    out = str(tmp_path / "out")
    one_line(main_pretrain.main, ["--data", str(tmp_path / "bad"), "--dataset", "cifar10", "--output-dir", out] + TINY,
             line)
    one_line(main_pretrain.main, ["--data", str(tmp_path / "good"), "--knn-data", str(tmp_path / "bad"), "--dataset",
                                  "cifar10", "--output-dir", out] + TINY, line)
    one_line(main_lincls.main, ["--data", str(tmp_path / "bad"), "--dataset", "cifar10", "--pretrained", pretrained,
                                "--knn", "--output-dir", out], line)
    assert not os.path.exists(out) and good.is_dir()


def test_sizes_that_cannot_fit_are_one_line(pretrained, data, tmp_path, capsys):
    """A batch, crop or queue whose tensors alone exceed all of the memory is refused at start, naming the flag and
    the figure; main_lincls.py's --workers is capped to the cores first, with its line."""
    base = ["--data", data, "--output-dir", str(tmp_path / "o")] + TINY
    one_line(main_pretrain.main, base + ["--crop-size", "1000000"], "--batch-size 8 with --crop-size 1000000: one "
             "step's views in float32 need 178813.9 GiB alone, more than all of this machine's memory (")
    one_line(main_pretrain.main, base + ["--queue-size", str(8 * 10 ** 12)], f"--queue-size {8 * 10 ** 12} keys of "
             "--proj-dim 16: the queue and one step's logits against it need 715255.7 GiB alone, more than all of this "
             "machine's memory (")
    # the heads' widths, never a queue of 32 keys blamed for them, nor numpy's "can't allocate memory"
    one_line(main_pretrain.main, base + ["--proj-dim", str(10 ** 12)], "error: the heads of --proj-hidden-dims 32 "
             f"--proj-dim {10 ** 12}: their weights in float32, online and momentum need 238418.6 GiB alone, more than "
             "all of this machine's memory (")
    message = one_line(main_pretrain.main, base + ["--proj-hidden-dims", str(10 ** 11)], f"error: the heads of "
                       f"--proj-hidden-dims {10 ** 11} --proj-dim 16: their weights in float32, online and momentum")
    assert message.endswith("lower --proj-hidden-dims or --proj-dim"), message
    cores = cli.cores_per_rank()
    one_line(main_lincls.main, ["--data", data, "--pretrained", pretrained, "--batch-size", str(10 ** 12), "--workers",
                                str(cores + 1), "--output-dir", str(tmp_path / "l")],
             f"--batch-size {10 ** 12} images of 32 px (--crop-size): their pixels in float32 need 11444091.8 GiB")
    assert f"=> --workers {cores + 1} is more than the {cores} core(s) this process has: using {cores}" \
        in capsys.readouterr().out
