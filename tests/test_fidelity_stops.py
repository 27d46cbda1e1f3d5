"""The fidelity scripts' stops and refusals (issue 61): a stop during proxies.py's jpeg-qN copy ends the run (75),
the variant untrained; calibrate_jpeg.py's decoding stopped exits 75 in one line with its workers; reproduce.sh's
data check signalled as a process group exits 75 in one line; each then finishes as an uninterrupted run. Flags and
files they cannot use are one line, before anything is written. (reencode.py's own: test_reencode.py.)"""
import os
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REPO, write_imagefolder
from sce import UserError, alive
from test_cifar10_gap import CIFAR10, bench
from test_reencode import CHILDREN
from test_reproduce import ENV, SCRIPT

proxies, calibrate = bench("proxies"), bench("calibrate_jpeg")

# a script run with a stop signal sent to its process group (the script and its workers, as Ctrl-C or SLURM send
# it; parent:NAME to the sender's parent alone) by the first call of MODULE.ATTR whose arguments' repr holds MATCH,
# in whichever process makes it; the sender names its parent's children first
AT_CALL = CHILDREN + """
import importlib, os, runpy, signal, sys
module, attr, match, name, script = sys.argv[1:6]
sys.argv = sys.argv[5:]
owner, fired = importlib.import_module(module), []
real = getattr(owner, attr)

def call(*args, **kwargs):
    if not fired and match in repr(args):
        fired.append(1)
        parent = os.getppid()
        print("CHILDREN", *children(parent), flush=True)
        if name.startswith("parent:"):  # to the script alone, as `kill PID` sends it
            os.kill(parent, signal.Signals[name[7:]])
        else:
            os.killpg(0, signal.Signals[name])
    return real(*args, **kwargs)

setattr(owner, attr, call)
runpy.run_path(script, run_name="__main__")
"""


def at_call(module, attr, match, name, script, *args):
    return subprocess.run([sys.executable, "-c", AT_CALL, module, attr, match, name, script, *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=180, start_new_session=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


def ended(pids):
    deadline = time.time() + 10
    while any(alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.05)
    return not any(alive(pid) for pid in pids)


def test_a_stop_during_a_jpeg_copy_stops_proxies_untrained_and_the_copy_finishes_after(tmp_path):
    """SIGTERM to proxies.py and its copying processes as the first image of jpeg-q50's copy is written: the copy
    stops (its part kept), the variant is not trained (no command line, no folder), exit 75 with its row "stopped";
    the copy the same command then finishes is the one an uninterrupted copy makes."""
    data, out = write_imagefolder(tmp_path / "data", num_classes=2, per_class=4, size=16), tmp_path / "out"
    proc = at_call("os", "replace", ".jpg'", "SIGTERM", os.path.join(REPO, "benchmarks", "fidelity", "proxies.py"),
                   "--data", data, "--out", out, "--variants", "jpeg-q50")
    assert proc.returncode == 75 and not proc.stderr, (proc.stdout, proc.stderr)
    assert '"status": "stopped"' in proc.stdout and "=> left: jpeg-q50: run the same command again" in proc.stdout
    assert "=== jpeg-q50" not in proc.stdout and not (out / "jpeg-q50").exists()
    assert os.path.isdir(out / "data-q50.partial") and not (out / "data-q50").exists()
    reencode = sys.modules["reencode"]  # proxies.py's
    whole = reencode.reencode(str(data), str(tmp_path / "whole"), 50)
    again = reencode.reencode(str(data), str(out / "data-q50"), 50)
    assert again["psnr_db"] == whole["psnr_db"] and again["images"] == whole["images"] == 16
    files = reencode.image_files(str(tmp_path / "whole"))
    assert [(out / "data-q50" / f).read_bytes() for f in files] == [(tmp_path / "whole" / f).read_bytes()
                                                                     for f in files]


# proxies.py run with sys.executable a wrapper (reproduce.sh's PYTHON): the wrapper of the data check sends a stop
# signal, to the process group (Ctrl-C, SLURM) or to proxies.py alone (kill PID), and writes its PID and reproduce.sh's
STOP_AT_CHECK = """#!/bin/bash
[ "$2" = check ] && exec {python} -c "import os, signal, sys
open('{pids}', 'w').write(f'{{os.getpid()}} {{os.getppid()}}')
if '{name}'.startswith('parent:'):
    os.kill(int(os.environ['PROXIES_PID']), signal.{signal})
else:
    os.killpg(0, signal.{signal})
sys.argv = sys.argv[1:]
exec(open(sys.argv[0]).read(), dict(__name__='__main__', __file__=sys.argv[0]))" "$@"
exec {python} "$@"
"""
AS_PROXIES = ("import os, runpy, sys; os.environ['PROXIES_PID'] = str(os.getpid()); sys.executable = sys.argv[1]; "
              "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("point, name", [("lock", "SIGUSR1"), ("check", "SIGINT"), ("check", "parent:SIGTERM")])
def test_proxies_stopped_before_a_variant_runs_exits_75_in_one_line(tmp_path, point, name):
    """A stop as proxies.py takes OUT's lock, or during reproduce.sh's data check it runs for the row's commands
    (DRY_RUN): one line and 75 (issue 61: 143, 138 or 130 without a word, a traceback after Ctrl-C), reproduce.sh and
    its check ended with it; after the check, the same command then goes on as an uninterrupted one."""
    data = write_imagefolder(tmp_path / "data", num_classes=2, per_class=2, size=16)
    script = os.path.join(REPO, "benchmarks", "fidelity", "proxies.py")
    args = ["--data", data, "--out", tmp_path / "out", "--variants", "default", "--dry-run"]
    signame = name.removeprefix("parent:")
    if point == "lock":
        proc = at_call("fcntl", "flock", "", signame, script, *args)
    else:
        python, pids = tmp_path / "python", tmp_path / "pids"
        python.write_text(STOP_AT_CHECK.format(python=sys.executable, pids=pids, name=name, signal=signame))
        os.chmod(python, 0o755)
        proc = subprocess.run([sys.executable, "-c", AS_PROXIES, python, script, *map(str, args)], cwd=REPO,
                              capture_output=True, text=True, timeout=120, start_new_session=True)
        assert ended([int(pid) for pid in pids.read_text().split()])  # the check and reproduce.sh
    assert (proc.returncode, proc.stderr) == (75, ""), (proc.stdout, proc.stderr)
    assert proc.stdout.splitlines()[-1] == f"=> stopped by {signame} during start-up, before any training: nothing " \
                                           "to save; run the same command again to start (exiting with code 75)"
    if point == "check":  # cut short there
        again = subprocess.run([sys.executable, script, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                               timeout=120)
        assert again.returncode == 0 and again.stdout.startswith("=== default: ") and not again.stderr, again


def damaged(out):
    os.makedirs(out)
    (out / "proxies.json").write_text('{"data": "/x", "epo')


def not_settings(out):
    os.makedirs(out)
    (out / "proxies.json").write_text("[1, 2]")


@pytest.mark.parametrize("flags, make, said", [
    (["--epochs", "0"], None, "--epochs 0 trains nothing: give 1 or more"),
    ([], lambda out: out.write_text("a file"), r"cannot use .*out as --out \(File exists\): pass a folder"),
    ([], damaged, r"cannot read .*out/proxies.json \(Unterminated string .*\): restore it, or remove it if the "
                  r"proxies there are of this command's --data, --epochs and --smoke"),
    ([], not_settings, r"out/proxies.json holds no settings \(a JSON object\): restore it"),
])
def test_proxies_refuse_a_flag_or_a_folder_they_cannot_use_in_one_line(tmp_path, flags, make, said):
    if make:
        make(tmp_path / "out")
    with pytest.raises(UserError, match=said):
        proxies.main(["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--dry-run", *flags])


def bomb(path):
    """A PNG whose header says 60,000 x 60,000 pixels (3.6 billion; PIL refuses past 179 million), 50 bytes."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 60000, 60000, 1, 0, 0, 0, 0))
                     + chunk(b"IEND", b""))


def cifar_folder(root, per_class=1):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in CIFAR10:
            os.makedirs(root / split / name)
            for i in range(per_class):
                pixels = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


@pytest.mark.parametrize("flags, make, said", [
    (["--out", "{tmp}/file"], lambda tmp: (tmp / "file").write_text("x"),
     r"cannot make .*file/cifar10 \(Not a directory\): pass an --out folder this user can write"),
    (["--device", "cpu", "--airbench", "{tmp}/notes.txt"], lambda tmp: (tmp / "notes.txt").write_text("x"),
     r"cannot unpack .*notes.txt \(no tar archive\): pass airbench's source distribution, airbench-0.1.8.tar.gz"),
    (["--runs", "0"], None, "--runs 0: give 1 or more"),
    (["--workers", "0"], None, "--workers 0: give 1 or more"),
    (["--write-only"], lambda tmp: bomb(tmp / "data" / "val" / "cat" / "bomb.png"),
     r"bomb.png is not a readable image \(Image size \(3600000000 pixels\) exceeds limit"),
    (["--device", "cuda"], None, "no CUDA device here: pass --device cpu"),
])
def test_calibration_refuses_in_one_line_before_writing(tmp_path, monkeypatch, flags, make, said):
    """--out a file, --airbench no tar, --runs 0, a decompression bomb, --device cuda without one: one line; the last
    before the pair is written."""
    cifar_folder(tmp_path / "data")
    if make:
        make(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=said):
        calibrate.main(["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--workers", "1",
                        *[f.format(tmp=tmp_path) for f in flags]])
    if "--device" in flags and "cuda" in flags:
        assert not (tmp_path / "out").exists()


def test_calibration_stopped_while_decoding_exits_75_with_its_workers(tmp_path):
    """SIGTERM to calibrate_jpeg.py alone as a worker opens its first image: one line, 75, its two decoding workers
    gone with it (issue 61: two ~300 MB workers asleep for ever); the same command then writes the pair an
    uninterrupted one writes."""
    data = cifar_folder(tmp_path / "data", per_class=2)
    script = os.path.join(REPO, "benchmarks", "fidelity", "calibrate_jpeg.py")
    args = ["--data", data, "--out", tmp_path / "out", "--workers", "2", "--write-only"]
    proc = at_call("PIL.Image", "open", ".png'", "parent:SIGTERM", script, *args)
    assert proc.returncode == 75 and not proc.stderr, (proc.stdout, proc.stderr)
    assert proc.stdout.splitlines()[-1] == "=> calibrate_jpeg.py stopped by SIGTERM: run the same command again " \
                                           "(exiting with code 75)"
    workers = [int(p) for line in proc.stdout.splitlines() if line.startswith("CHILDREN") for p in line.split()[1:]]
    assert len(workers) >= 2 and ended(workers)
    assert not os.path.exists(tmp_path / "out" / "cifar10" / "train.pt")
    for out in ("out", "whole"):
        calibrate.write_pair(str(data), str(tmp_path / out))
    for name in ("train.pt", "test.pt"):
        again, whole = (torch.load(tmp_path / out / "cifar10" / name, weights_only=True) for out in ("out", "whole"))
        assert torch.equal(again["images"], whole["images"]) and torch.equal(again["labels"], whole["labels"])


def test_reproduce_data_check_signalled_as_a_group_exits_75_in_one_line(tmp_path):
    """SIGTERM, then Ctrl-C (SIGINT), sent to reproduce.sh's process group as its data check starts: 75 and one line
    each (issue 61: "Terminated" and exit 1, a traceback and exit 1); the same command then prints the commands an
    uninterrupted run prints (DRY_RUN)."""
    data = write_imagefolder(tmp_path / "data", num_classes=2, per_class=2, size=16)
    for name in ("SIGTERM", "SIGINT"):
        python = tmp_path / "python"  # the interpreter, whose check signals the group as it starts
        python.write_text(f'#!/bin/bash\n[ "$2" = check ] && exec {sys.executable} -c "import os, runpy, signal, sys; '
                          f"os.killpg(0, signal.{name}); sys.argv = sys.argv[1:]; "
                          f"runpy.run_path(sys.argv[0], run_name='__main__')\" \"$@\"\nexec {sys.executable} \"$@\"\n")
        os.chmod(python, 0o755)
        proc = subprocess.run(["bash", SCRIPT, "cifar10", str(data), str(tmp_path / "out")], capture_output=True,
                              text=True, timeout=120, start_new_session=True,
                              env=dict(ENV, METHODS="sce", DRY_RUN="1", PYTHON=str(python)))
        assert (proc.returncode, proc.stdout, proc.stderr) == (
            75, "", "=> interrupted: run the same command again to continue\n"), name
    runs = [subprocess.run(["bash", SCRIPT, "cifar10", str(data), str(tmp_path / out)], capture_output=True, text=True,
                           timeout=120, env=dict(ENV, METHODS="sce", DRY_RUN="1")) for out in ("out", "whole")]
    assert runs[0].returncode == runs[1].returncode == 0 and "=== sce pretrain" in runs[0].stdout
    assert runs[0].stdout == runs[1].stdout.replace(str(tmp_path / "whole"), str(tmp_path / "out"))


@pytest.mark.parametrize("log, said", [
    ('{"epoch": 1, "loss"', r"line 1 of .*log.txt is not an epoch's JSON line"),
    ('[1, 2]\n', r"line 1 of .*log.txt is not an epoch's JSON line .*: remove .*default to run default again"),
    ('{"epoch": 1, "knn_top1": Infinity}\n{"loss": 1}\n', r"line 2 of .*log.txt is not an epoch's JSON line"),
])
def test_a_variants_damaged_log_is_one_line(tmp_path, log, said):
    """proxies.py reads each variant's log.txt back: a damaged one is a line naming it, not a traceback."""
    os.makedirs(tmp_path / "default")
    (tmp_path / "default" / "log.txt").write_text(log)
    with pytest.raises(UserError, match=said):
        proxies.result("default", str(tmp_path), 1)


def test_a_variants_log_with_a_non_finite_knn_reads_as_none(tmp_path):
    os.makedirs(tmp_path / "default")
    (tmp_path / "default" / "log.txt").write_text('{"epoch": 1, "knn_top1": Infinity, "images_per_s": 10}\n')
    row = proxies.result("default", str(tmp_path), 1)
    assert row["epochs_done"] == 1 and row["knn_top1"] is None and row["images_per_s"] == 10
