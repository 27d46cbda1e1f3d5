"""Evaluation under hostile but fair input (issue 25, items 2, 8, 9, 12): the kNN monitor reads --knn-data as
main_lincls.py --knn reads it and gives its number; an unreadable image stops every evaluation path with one
line naming the file; an unwritable --output-dir stops at start; a linear-probe resume through the loader is
exact; a checkpoint path that is a directory says so."""
import builtins
import errno
import io
import json
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import class_image, write_imagefolder, write_tiny_imagenet
import main_lincls
import main_lowshot
import main_pretrain
from sce import UserError
from sce.builder import build_trunk

TINY = ["--arch", "resnet18", "--small-input", "--crop-size", "16", "--batch-size", "8", "--queue-size", "32",
        "--workers", "0", "--proj-hidden-dims", "32", "--proj-dim", "16", "--print-freq", "1"]
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("in_process")  # conftest: one thread, signal handlers restored


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("evalh") / "data", 3, 8, 16)


def knn_args(data, **flags):
    args = main_pretrain.parse_args(["--data", data, "--knn-data", data] + TINY
                                    + [str(a) for kv in flags.items() for a in kv])
    main_pretrain.resolve_device_defaults(args, CPU, 1)
    return args


def last_log(out):
    with open(os.path.join(out, "log.txt")) as f:
        return json.loads(f.read().splitlines()[-1])


def result(out, name="knn"):
    with open(os.path.join(out, f"results_{name}.json")) as f:
        return json.load(f)


# ---------------------------------------------------------------- 2. the kNN monitor reads as main_lincls.py --knn

def test_knn_monitor_reads_tiny_imagenet_and_gives_lincls_number(tmp_path):
    root = write_tiny_imagenet(tmp_path / "tiny")
    train, val, classes = main_pretrain.build_knn_sets(knn_args(root, **{"--dataset": "tiny-imagenet"}), CPU)
    assert classes == 3 and len(train) == 24 and sorted(set(train.targets)) == [0, 1, 2]
    assert list(val.targets) == [1, 2, 2, 1, 1, 2]  # from val_annotations.txt, not from the folder

    out = tmp_path / "pre"
    main_pretrain.main(["--data", root, "--dataset", "tiny-imagenet", "--knn-data", root, "--knn-k", "5",
                        "--epochs", "1", "--output-dir", str(out)] + TINY)
    main_lincls.main(["--data", root, "--dataset", "tiny-imagenet", "--pretrained", str(out / "checkpoint_last.pth"),
                      "--knn", "--knn-k", "5", "--workers", "0", "--output-dir", str(tmp_path / "knn")])
    monitor, lincls = last_log(out), result(tmp_path / "knn")
    assert 0 < lincls["acc1"] < 100
    assert (monitor["knn_top1"], monitor["knn_top5"]) == (lincls["acc1"], lincls["acc5"])


def test_knn_monitor_reads_cifar_batches(tmp_path):
    from test_loader import write_cifar
    write_cifar(tmp_path)
    train, val, classes = main_pretrain.build_knn_sets(knn_args(str(tmp_path), **{"--dataset": "cifar10"}), CPU)
    assert classes == 10 and len(train) == 20 and len(val) == 4
    assert train[0][0].shape == (3, 16, 16)  # the trunk's pretraining crop size, as main_lincls.py


def test_knn_monitor_refuses_a_val_lacking_a_class(tmp_path):
    root = write_imagefolder(tmp_path / "knn", 3, 4, 16)
    os.rename(os.path.join(root, "val", "class_2"), os.path.join(tmp_path, "away"))
    with pytest.raises(UserError, match=r"different classes \(first difference: class_2\)"):
        main_pretrain.main(["--data", root, "--knn-data", root, "--epochs", "1",
                            "--output-dir", str(tmp_path / "out")] + TINY)
    tiny = write_tiny_imagenet(tmp_path / "tiny", 2, val=((1, "n02"), (2, "n09")))
    with pytest.raises(UserError, match=r"val_annotations.txt names 1 classes that train/ lacks \(first: n09\)"):
        main_pretrain.build_knn_sets(knn_args(tiny, **{"--dataset": "tiny-imagenet"}), CPU)


# ---------------------------------------------------------------- 8. unreadable images: one line naming the file

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


# ---------------------------------------------------------------- 9. an unwritable --output-dir stops at start

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
    with pytest.raises(UserError, match="is not writable"):
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--knn", "--workers", "0",
                          "--output-dir", str(under_a_file)])
    with pytest.raises(UserError, match="is not writable"):
        main_lowshot.main(["--data", voc, "--pretrained", pretrained, "--workers", "0", "--shots", "full",
                           "--output-dir", str(under_a_file)])
    capsys.readouterr()
    refuse_writes_under(monkeypatch, tmp_path / "ro")
    os.makedirs(tmp_path / "ro")
    with pytest.raises(UserError, match="is not writable"):
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--knn", "--workers", "0",
                          "--output-dir", str(tmp_path / "ro")])
    assert "features" not in capsys.readouterr().out  # before any work


# ---------------------------------------------------------------- 12. smaller

def test_linear_probe_resume_through_the_loader_is_exact(pretrained, data, tmp_path):
    common = ["--data", data, "--pretrained", pretrained, "--crop-size", "16", "--batch-size", "8", "--preload",
              "off", "--lr", "1"]
    main_lincls.main(common + ["--epochs", "2", "--workers", "1", "--output-dir", str(tmp_path / "ref")])
    main_lincls.main(common + ["--epochs", "1", "--workers", "0", "--output-dir", str(tmp_path / "run")])
    main_lincls.main(common + ["--epochs", "2", "--workers", "2", "--resume", "auto",
                               "--output-dir", str(tmp_path / "run")])
    a, b = (torch.load(tmp_path / run / "checkpoint_last.pth", weights_only=True)["model"] for run in ("ref", "run"))
    assert torch.equal(a["fc.weight"], b["fc.weight"]) and torch.equal(a["fc.bias"], b["fc.bias"])


def test_a_checkpoint_path_that_is_a_directory_says_so(data, tmp_path):
    for flag in ("--pretrained", "--resume"):
        with pytest.raises(UserError, match=f"{re.escape(str(tmp_path))} is a directory.*"
                                            f"{re.escape(os.path.join(str(tmp_path), 'checkpoint_last.pth'))}"):
            main_lincls.main(["--data", data, flag, str(tmp_path), "--workers", "0",
                              "--output-dir", str(tmp_path / "out")])
