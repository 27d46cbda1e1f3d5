"""benchmarks/fidelity/reencode.py's copy is whole or absent: every image and folder (linked ones once, a loop
refused), no two images into one file, no foreign or other copy overwritten, a copy cut short by kill -9 finished, and a
failure or a stop leaving neither its partial copy nor its workers. (Its pixels: test_cifar10_gap.py.)"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from conftest import REPO
from sce import UserError, alive
from test_cifar10_gap import bench
from test_health import children

reencode = bench("reencode")


def write_tree(root, classes=("a", "b"), per_class=2):
    """root/train/<class>/<i>.png, 8x8, and an empty root/val/."""
    rng = np.random.default_rng(0)
    for name in classes:
        os.makedirs(root / "train" / name)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(root / "train" / name / f"{i}.png")
    os.makedirs(root / "val")
    return root


def test_every_image_and_folder_is_copied_links_once_and_a_loop_or_a_clash_is_refused(tmp_path):
    src = write_tree(tmp_path / "src")
    write_tree(tmp_path / "elsewhere", ["cat"])
    os.symlink(tmp_path / "elsewhere" / "train" / "cat", src / "train" / "cat")  # a linked class folder
    said = reencode.reencode(str(src), str(tmp_path / "dst"), 75)
    assert said["images"] == 6 and reencode.image_files(str(tmp_path / "dst")) == [
        f"train/{c}/{i}.jpg" for c in ("a", "b", "cat") for i in range(2)]
    assert os.path.isdir(tmp_path / "dst" / "val") and not os.listdir(tmp_path / "dst" / "val")
    os.symlink(src / "train", src / "train" / "a" / "loop")
    with pytest.raises(UserError, match=r"train/a/loop links back to .* \(a folder loop\)"):
        reencode.reencode(str(src), str(tmp_path / "looped"), 75)
    os.remove(src / "train" / "a" / "loop")
    Image.new("RGB", (8, 8)).save(src / "train" / "a" / "0.jpg")
    with pytest.raises(UserError, match=r"train/a/0.jpg and .*train/a/0.png would both be written as .*/0.jpg"):
        reencode.reencode(str(src), str(tmp_path / "clash"), 75)
    assert not os.path.exists(tmp_path / "looped") and not os.path.exists(tmp_path / "clash.partial")


def test_a_destination_is_written_only_empty_and_a_finished_copy_only_read(tmp_path):
    src = write_tree(tmp_path / "src")
    os.makedirs(tmp_path / "empty")
    assert reencode.reencode(str(src), str(tmp_path / "empty"), 50)["images"] == 4  # an empty one: written
    again = reencode.reencode(str(src), str(tmp_path / "empty"), 50)
    assert again["existed"] and again["images"] == 4
    with pytest.raises(UserError, match=r"empty is a copy of .*src at quality 50, not of .*src at 75"):
        reencode.reencode(str(src), str(tmp_path / "empty"), 75)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("not a copy")
    with pytest.raises(UserError, match=r"other exists and is no copy made by reencode.py \(it has no "
                                        r"\.reencode\.json\): pass another DST, or remove it"):
        reencode.reencode(str(src), str(tmp_path / "other"), 50)
    assert os.listdir(tmp_path / "other") == ["mine.txt"]


def test_a_copy_cut_short_by_a_kill_is_finished_as_a_whole_one(tmp_path, capsys):
    src = write_tree(tmp_path / "src")
    whole = reencode.reencode(str(src), str(tmp_path / "whole"), 60)
    partial = tmp_path / "cut.partial"  # what a kill -9 left: the marker, one image, another half-written
    reencode.start_partial(str(src), str(partial), 60, ["train/a", "train/b", "val"])
    reencode.copy_one(str(src), str(partial), 60, "train/a/0.png")
    (partial / "train" / "b" / "1.jpg.tmp").write_bytes(b"\xff\xd8half")
    cut = reencode.reencode(str(src), str(tmp_path / "cut"), 60)
    assert f"=> {partial}: a copy cut short (kill -9); finishing it" in capsys.readouterr().out
    assert cut["psnr_db"] == whole["psnr_db"] and not os.path.exists(partial)
    files = reencode.image_files(str(tmp_path / "whole"))
    assert [(tmp_path / "cut" / f).read_bytes() for f in files] == [(tmp_path / "whole" / f).read_bytes()
                                                                     for f in files]
    assert sorted(os.listdir(tmp_path / "cut" / "train" / "b")) == ["0.jpg", "1.jpg"]


SLOW = """
import os, runpy, sys, time
from PIL import Image
real = Image.open
def slow(*args, **kwargs):  # each image a while: the pool is at work when the signal comes
    print("OPENING", os.getpid(), flush=True)
    time.sleep(0.2)
    return real(*args, **kwargs)
Image.open = slow
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_reencode(args, until=None):
    """benchmarks/fidelity/reencode.py ARGS with each image opened slowly; SIGTERM once a worker opens one (`until`)."""
    script = os.path.join(REPO, "benchmarks", "fidelity", "reencode.py")
    proc = subprocess.Popen([sys.executable, "-c", SLOW, script] + args,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    workers = []
    for line in proc.stdout if until else ():
        if line.startswith("OPENING") and int(line.split()[1]) != proc.pid:
            workers = children(proc.pid)
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err, workers


def test_an_unreadable_image_or_a_stop_leaves_one_line_no_partial_copy_and_no_worker(tmp_path):
    src = write_tree(tmp_path / "src", per_class=8)
    (src / "train" / "b" / "bad.png").write_bytes(b"\x89PNG not really")
    code, out, err, _ = run_reencode([str(src), str(tmp_path / "dst"), "--quality", "50", "--workers", "2"])
    assert code == 1 and err == (f"error: cannot read {src / 'train' / 'b' / 'bad.png'} (UnidentifiedImageError: "
                                 f"cannot identify image file '{src / 'train' / 'b' / 'bad.png'}'): fix or remove it\n")
    assert not os.path.exists(tmp_path / "dst.partial")
    os.remove(src / "train" / "b" / "bad.png")
    code, out, err, workers = run_reencode([str(src), str(tmp_path / "dst"), "--quality", "50", "--workers", "2"],
                                           until=True)
    assert code == 75 and out.endswith("=> reencode.py stopped by SIGTERM: nothing kept; run the same command again "
                                       "(exiting with code 75)\n") and not err, (code, out, err)
    deadline = time.time() + 10
    while any(alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert len(workers) == 2 and not any(alive(pid) for pid in workers)
    assert not os.path.exists(tmp_path / "dst.partial") and not os.path.exists(tmp_path / "dst")
    assert reencode.reencode(str(src), str(tmp_path / "dst"), 50)["images"] == 16  # the same command again
