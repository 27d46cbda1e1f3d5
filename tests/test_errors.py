"""The scripts' one-line errors for odd folders and files, each naming what to do: an ImageFolder without class
folders (loose images, an official download given without --dataset, an empty train/), a malformed or incomplete
Tiny-ImageNet val split, a dataset no image of which reads (in loader workers), a file that is no checkpoint;
and what is not an error: a stray .DS_Store beside Tiny-ImageNet's classes."""
import os

import numpy as np
import pytest
from PIL import Image

from conftest import write_cifar, write_imagefolder, write_tiny_imagenet
import main_lincls
import main_pretrain
from sce import UserError, cli

pytestmark = pytest.mark.usefixtures("in_process")  # conftest: one thread, signal handlers restored

TINY = ["--arch", "resnet18", "--small-input", "--crop-size", "16", "--batch-size", "8", "--queue-size", "32",
        "--proj-hidden-dims", "32", "--proj-dim", "16", "--epochs", "1", "--workers", "0"]


def as_user_runs(main, argv):
    """The script's own entry (cli.run): what it exits with (None: it ran through; an error: its line)."""
    try:
        cli.run(lambda: main(argv))
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
    argv = ["--data", str(data), "--output-dir", str(tmp_path / "out")] + TINY[:-1] + ["2"]  # --workers 2
    one_line(main_pretrain.main, argv, "no image of the dataset is readable (")


def test_a_file_that_is_no_checkpoint(tmp_path):
    data = write_imagefolder(tmp_path / "data", 2, 2, 16)
    (tmp_path / "notes.pth").write_text("hello, these are my notes\n")
    one_line(main_lincls.main, ["--data", data, "--pretrained", str(tmp_path / "notes.pth"), "--knn",
                                "--output-dir", str(tmp_path / "o")],
             "notes.pth is not a PyTorch checkpoint (it begins 'hello, these are my note', not as a file of "
             "torch.save)")
