"""benchmarks/fidelity/reencode.py's copy is whole or refused: every image and folder (linked ones once, a loop
refused), no two images into one file, nothing unreadable skipped, no foreign or other copy overwritten, only a folder
it made ever removed (the source whole after any refusal, failure or stop), a copy cut short by a stop or a kill
finished, one line for every error, and a stop signal at each phase exit 75 with one line, no worker left, the same
command then finishing the copy an uninterrupted run makes. (Its pixels: test_cifar10_gap.py.)"""
import errno
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from conftest import REPO
from sce import UserError, alive
from test_cifar10_gap import bench

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
    reencode.own_partial(str(src), str(partial), 60)
    reencode.start_partial(str(partial), ["train/a", "train/b", "val"])
    reencode.copy_one(str(src), str(partial), 60, "train/a/0.png")
    (partial / "train" / "b" / "1.jpg.tmp").write_bytes(b"\xff\xd8half")
    cut = reencode.reencode(str(src), str(tmp_path / "cut"), 60)
    assert f"=> {partial}: a copy cut short (a stop, a kill); finishing it" in capsys.readouterr().out
    assert cut["psnr_db"] == whole["psnr_db"] and not os.path.exists(partial)
    files = reencode.image_files(str(tmp_path / "whole"))
    assert [(tmp_path / "cut" / f).read_bytes() for f in files] == [(tmp_path / "whole" / f).read_bytes()
                                                                     for f in files]
    assert sorted(os.listdir(tmp_path / "cut" / "train" / "b")) == ["0.jpg", "1.jpg"]




def contents(root):
    """{path under root: bytes of a file, the target of a link, else None}: everything there, to compare."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, root)] = (os.readlink(path) if os.path.islink(path) else
                                                  open(path, "rb").read() if os.path.isfile(path) else None)
    return found


def foreign_partial(tmp_path, src):
    (tmp_path / "dst.partial").mkdir()
    (tmp_path / "dst.partial" / "mine.txt").write_text("a user's")


def other_marker(tmp_path, src):
    (tmp_path / "dst.partial").mkdir()
    (tmp_path / "dst.partial" / reencode.MARKER).write_text(json.dumps(dict(src=str(tmp_path / "other"), quality=50)))


@pytest.mark.parametrize("src_name, dst_name, make, said", [
    ("imgs.partial", "imgs", None, r"SRC .*imgs.partial and .*imgs.partial are one folder"),
    ("d.partial/in", "d", None, r"SRC .*d.partial/in and .*d.partial are one folder or one holds the other"),
    ("src", "src/train/copy", None, r"SRC .*src and .*src/train/copy are one folder or one holds the other"),
    ("src", "dst", foreign_partial, r"dst.partial exists and reencode.py did not make it \(it has no \.reencode\.json"
                                    r"\): it is left as it is; rename or remove it, or pass another DST"),
    ("src", "dst", other_marker, r"dst.partial is a copy of .*other at quality 50 cut short: finish it with that SRC"),
])
def test_a_refusal_touches_nothing(tmp_path, src_name, dst_name, make, said):
    """A SRC that is, lies in or holds DST.partial or DST, a user's DST.partial, one of another copy: refused before
    anything is written or removed (issue 61: `reencode.py imgs.partial imgs` removed its source)."""
    write_tree(tmp_path / src_name)
    if make:
        make(tmp_path, tmp_path / src_name)
    before = contents(tmp_path)
    with pytest.raises(UserError, match=said):
        reencode.reencode(str(tmp_path / src_name), str(tmp_path / dst_name), 50)
    assert contents(tmp_path) == before


def test_a_failure_removes_only_its_own_partial_copy_and_a_stop_keeps_it_to_finish(tmp_path, monkeypatch):
    src = write_tree(tmp_path / "src", per_class=4)
    whole = reencode.reencode(str(src), str(tmp_path / "whole"), 50)
    source = contents(src)
    (src / "train" / "b" / "bad.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(UserError, match=r"cannot read .*train/b/bad.png \(UnidentifiedImageError: cannot identify"):
        reencode.reencode(str(src), str(tmp_path / "dst"), 50, workers=2)  # a failure mid-copy, in a worker
    assert not os.path.lexists(tmp_path / "dst.partial") and not os.path.lexists(tmp_path / "dst")
    os.remove(src / "train" / "b" / "bad.png")
    real = os.write
    monkeypatch.setattr(reencode, "open", lambda *a, **k: Full(real) if a[1:] == ("wb",) else open(*a, **k),
                        raising=False)
    with pytest.raises(UserError, match=r"cannot write .*dst.partial/train/a/0.jpg \(No space left on device\): free "
                                        r"some space, or pass a DST where this user can write"):
        reencode.reencode(str(src), str(tmp_path / "dst"), 50)
    assert not os.path.lexists(tmp_path / "dst.partial")
    monkeypatch.undo()
    asked = []
    with pytest.raises(reencode.Stopped):  # proxies.py's stop request, after 3 images
        reencode.reencode(str(src), str(tmp_path / "dst"), 50, stopping=lambda: asked.append(1) or len(asked) > 3)
    assert len(reencode.image_files(str(tmp_path / "dst.partial"))) == 3  # kept, ours: the same command finishes it
    again = reencode.reencode(str(src), str(tmp_path / "dst"), 50)
    assert again["psnr_db"] == whole["psnr_db"] and not os.path.lexists(tmp_path / "dst.partial")
    assert contents(tmp_path / "dst") == contents(tmp_path / "whole") and contents(src) == source


class Full:
    """A file on a full disk: its writes fail with ENOSPC."""

    def __init__(self, real):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def unreadable_folder(src, monkeypatch):
    real, denied = os.scandir, str(src / "train" / "b")
    monkeypatch.setattr(os, "scandir", lambda path=".": (_ for _ in ()).throw(PermissionError(
        errno.EACCES, os.strerror(errno.EACCES), path)) if str(path) == denied else real(path))


def read_only_parent(src, monkeypatch):
    real = os.mkdir
    monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: (_ for _ in ()).throw(PermissionError(
        errno.EACCES, os.strerror(errno.EACCES), path)) if str(path).endswith("dst.partial") else real(path, *a, **k))


@pytest.mark.parametrize("make, said", [
    (unreadable_folder, r"cannot read the folder .*src/train/b \(Permission denied\): make it readable, or move it"),
    (lambda src, mp: os.symlink(src / "gone.png", src / "train" / "a" / "x.png"),
     r"cannot read .*src/train/a/x.png \(No such file or directory, a link to nothing\): fix or remove it"),
    (lambda src, mp: os.mkfifo(src / "train" / "a" / "x.png"),
     r"src/train/a/x.png is no image file but a FIFO: remove it, or rename it without an image extension"),
    (lambda src, mp: os.makedirs(src / "train" / "a" / "0.jpg"),
     r"src/train/a/0.jpg/ and .*src/train/a/0.png would both be written as .*dst/train/a/0.jpg: rename one"),
    (read_only_parent, r"cannot write .*dst.partial \(Permission denied\)"),
    (lambda src, mp: (os.makedirs(src.parent / "empty"), os.symlink(src.parent / "empty", src.parent / "dst")),
     r"dst is a link \(to .*empty\): pass the folder itself, or another DST"),
])
def test_a_copy_is_whole_or_refused_in_one_line(tmp_path, monkeypatch, make, said):
    """An unreadable folder (os.walk skips it), a link to nothing or a FIFO named as an image, an image written over a
    folder, a folder where none can be made, DST a link: one line naming it, nothing written."""
    src = write_tree(tmp_path / "src")
    make(src, monkeypatch)
    before = contents(tmp_path)
    with pytest.raises(UserError, match=said):
        reencode.reencode(str(src), str(tmp_path / "dst"), 50)
    assert contents(tmp_path) == before  # (both read as patched)


def test_a_fifo_is_refused_not_waited_on_and_workers_are_capped_or_refused(tmp_path, capsys):
    os.mkfifo(tmp_path / "x.png")  # made after the listing: opened, it would wait for a writer for ever
    with pytest.raises(UserError, match=r"x.png is no image file but a FIFO"):
        reencode.read_image(str(tmp_path / "x.png"))
    src = write_tree(tmp_path / "src", per_class=1)
    with pytest.raises(UserError, match=r"--workers 0: give 1 or more"):
        reencode.main([str(src), str(tmp_path / "dst"), "--quality", "50", "--workers", "0"])
    cores = len(os.sched_getaffinity(0))
    reencode.main([str(src), str(tmp_path / "dst"), "--quality", "50", "--workers", "64"])
    assert capsys.readouterr().out.startswith(f"=> --workers 64 is more than the {cores} core(s) this process has: "
                                              f"using {cores}\n")


CHILDREN = """
import os

def children(pid):  # the processes whose parent is pid (/proc: one may end as it is read)
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1] == str(pid):
                found.append(entry)
        except (OSError, IndexError):
            pass
    return found
"""  # for the scripts the tests signal (here and test_fidelity_stops.py)

# reencode.py run with a stop signal sent at a named point of its work (not after a delay): the phase's call sends it
# to the process group (the script and its workers, as a terminal's Ctrl-C or SLURM's signal), the first time only
AT_PHASE = CHILDREN + """
import builtins, os, runpy, signal, sys
phase, name, script = sys.argv[1:4]
sys.argv = sys.argv[3:]
dst = os.path.abspath(sys.argv[2])
fired = []


def fire():
    if not fired:
        fired.append(1)
        if name == "SIGKILL":  # the parent killed outright, from a worker, once all are started: they must end with it
            workers = []
            while len(workers) < int(sys.argv[sys.argv.index("--workers") + 1]):
                workers = children(os.getppid())
            print("WORKERS", *workers, flush=True)
            os.kill(os.getppid(), signal.SIGKILL)
        else:
            os.killpg(0, signal.Signals[name])

def hook(module, attr, when, after=True):
    real = getattr(module, attr)
    def call(*args, **kwargs):
        if not after and when(*args):
            fire()
        out = real(*args, **kwargs)
        if after and when(*args):
            fire()
        return out
    setattr(module, attr, call)

if phase == "import":  # the script's own imports, numpy the first
    hook(builtins, "__import__", lambda n, *a: n == "numpy", after=False)
elif phase == "listing":
    hook(os, "walk", lambda *a: True, after=False)
elif phase == "partial":  # DST.partial made, its marker not yet written
    hook(os, "mkdir", lambda path, *a: str(path).endswith(".partial"))
elif phase == "copy":  # the first image written (in a worker, with --workers 2)
    hook(os, "replace", lambda a, b, *r: str(b).endswith(".jpg"))
elif phase == "marker":  # the finished copy's marker written, DST.partial not renamed yet
    marks = []
    hook(os, "replace", lambda a, b, *r: str(b).endswith(".reencode.json") and (marks.append(1) or len(marks) == 2))
elif phase == "rename":  # the rename to DST itself
    hook(os, "replace", lambda a, b, *r: os.path.abspath(b) == dst, after=False)
runpy.run_path(script, run_name="__main__")
"""
STOPPED = "run the same command again to finish the copy (exiting with code 75)\n"


@pytest.mark.parametrize("phase, name, workers, code, said", [
    ("import", "SIGTERM", 1, 75, "=> reencode.py stopped by SIGTERM while starting, before copying anything: run the "
                                 "same command again (exiting with code 75)\n"),
    ("listing", "SIGINT", 2, 75, "=> reencode.py stopped by SIGINT before copying anything: run the same command "
                                 "again (exiting with code 75)\n"),
    ("partial", "SIGUSR1", 2, 75, "=> reencode.py stopped by SIGUSR1: what was copied is kept in {dst}.partial; "
                                  + STOPPED),
    ("copy", "SIGUSR1", 2, 75, "=> reencode.py stopped by SIGUSR1: what was copied is kept in {dst}.partial; "
                               + STOPPED),
    ("copy", "SIGINT", 2, 75, "=> reencode.py stopped by SIGINT: what was copied is kept in {dst}.partial; " + STOPPED),
    ("copy", "SIGKILL", 2, -9, ""),
    ("marker", "SIGTERM", 2, 75, "=> reencode.py stopped by SIGTERM: what was copied is kept in {dst}.partial; "
                                 + STOPPED),
    ("rename", "SIGINT", 2, 0, "=> reencode.py: SIGINT came once the copy was whole: nothing is left to do\n"),
])
def test_a_stop_at_each_phase_exits_75_in_one_line_and_the_same_command_finishes_the_copy(tmp_path, phase, name,
                                                                                          workers, code, said):
    """SIGTERM, SIGINT, SIGUSR1 at each phase (the imports, the listing, DST.partial made, a worker's first image, the
    finished marker): exit 75, one line, nothing on stderr (no worker's traceback), no worker left; at the rename
    itself the copy is whole: exit 0 and a line. A kill -9 of the script ends its workers with it. The same command
    then makes the copy an uninterrupted run makes, byte for byte."""
    src = write_tree(tmp_path / "src", per_class=6)  # 12 images, 6 a worker
    whole, source = reencode.reencode(str(src), str(tmp_path / "whole"), 50), contents(src)
    dst = tmp_path / "dst"
    script = os.path.join(REPO, "benchmarks", "fidelity", "reencode.py")
    proc = subprocess.run([sys.executable, "-c", AT_PHASE, phase, name, script, str(src), str(dst), "--quality", "50",
                           "--workers", str(workers)], capture_output=True, text=True, cwd=REPO, timeout=120,
                          start_new_session=True)  # a group of its own: the signal reaches no other process
    lines = proc.stdout.splitlines(keepends=True)
    assert proc.returncode == code and not proc.stderr, (proc.returncode, proc.stdout, proc.stderr)
    if name != "SIGKILL":
        assert lines[-1] == said.format(dst=dst)
    else:
        workers = [int(p) for p in lines[-1].split()[1:]]
        deadline = time.time() + 10
        while any(alive(pid) for pid in workers) and time.time() < deadline:
            time.sleep(0.05)
        assert len(workers) == 2 and not any(alive(pid) for pid in workers)
    again = reencode.reencode(str(src), str(dst), 50)
    assert again["images"] == 12 and again["psnr_db"] == whole["psnr_db"] and again["existed"] == (code == 0)
    assert contents(dst) == contents(tmp_path / "whole") and not os.path.lexists(str(dst) + ".partial")
    assert contents(src) == source
