#!/usr/bin/env python
"""What the CIFAR-10 JPEG copy costs a recipe whose mean on the official pixels is published: airbench (Jordan,
"94% on CIFAR-10 in 3.29 seconds on a single GPU", 2024; airbench94: 94.01% over 1000 runs, airbench96: 96.05%
over 200, both with its test-time augmentation), trained N times on our copy, against that figure.

    python benchmarks/fidelity/calibrate_jpeg.py --data data/cifar10 [--runs 10] [--bench airbench94|airbench96]
        [--device cuda|cpu] [--airbench .whl/airbench-0.1.8.tar.gz] [--out runs/calibration] [--write-only]

--data: an ImageFolder with train/ and val/ whose class folders are CIFAR-10's ten names. airbench reads a pair
of files, cifar10/train.pt and cifar10/test.pt under its working directory (it downloads the official release
when they are missing, which never happens here: they are written first), each {images: (N, 32, 32, 3) uint8,
labels: (N,) int64, classes}; this script writes them once under --out from --data (decoded by PIL, labels in
CIFAR-10's order, the images in a seeded random order). airbench is not a dependency of the project: its source
distribution (12 kB; `pip download airbench==0.1.8 --no-deps -d .whl/`) is unpacked under --out and imported
from there, unchanged. It is written for CUDA (its model moved with .cuda() and cast with .half(), its data loaded
onto device 0, its time taken with CUDA events); --device cpu runs the same files on the CPU in fp32: this script
replaces those four calls when it imports airbench (Module.cuda/half keep the model where it is in fp32,
Tensor.half gives fp32, the loader's default device is the CPU, CUDA events become wall-clock marks), nothing else.
airbench94 then takes ~5-7 s a step of 1,024 images on 2 cores, about an hour a run: start it niced in the
background. --write-only writes the pair anywhere. Prints a JSON line an epoch and one a run, then one with the
mean, spread and the published mean's difference. A stop (SIGTERM, SIGUSR1, Ctrl-C) exits 75 with one line, its
decoding workers with it; the same command then goes on (a pair file written is kept).
"""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
from sce import PREEMPTED_EXIT_CODE, STOP_SIGNALS, UserError  # noqa: E402  (no torch: before its seconds of import)


def stopped(signum, frame):
    """A stop signal, at any point: one line and PREEMPTED_EXIT_CODE at once (os._exit: no wait for the decoding
    workers, which end with this process, nor for a training's teardown). A pair file is written whole or not at all
    (its rename), so the same command goes on."""
    os.write(1, f"=> calibrate_jpeg.py stopped by {signal.Signals(signum).name}: run the same command again (exiting "
                f"with code {PREEMPTED_EXIT_CODE})\n".encode())
    os._exit(PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
    for sig in STOP_SIGNALS:
        signal.signal(sig, stopped)

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tarfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from sce.layouts import image_folder  # noqa: E402
from sce.preemption import ignore_stop_signals  # noqa: E402

# the official release's label order (its batches.meta), which torchvision's CIFAR10.classes follows
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
PUBLISHED = {"airbench94": 94.01, "airbench96": 96.05}  # mean test accuracy (%), with test-time augmentation
SPLITS = {"train.pt": "train", "test.pt": "val"}  # airbench's file <- our split


def decode(paths):
    """(len(paths), 32, 32, 3) uint8 pixels, as PIL decodes the files; an unreadable file or another size is one
    line naming it."""
    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                images.append(np.asarray(image.convert("RGB")))
        except (OSError, ValueError, Image.DecompressionBombError) as e:  # PIL's UnidentifiedImageError and truncated
            # files are OSErrors; a header of billions of pixels is a DecompressionBombError
            raise UserError(f"{path} is not a readable image ({e}): replace or remove it") from None
        if images[-1].shape != (32, 32, 3):
            raise UserError(f"{path} is {images[-1].shape[1]}x{images[-1].shape[0]}: airbench needs CIFAR-10's "
                            "32x32 images")
    return np.stack(images)


def write_pair(data, out, workers=1):
    """out/cifar10/train.pt and test.pt from data/train and data/val, as airbench reads them; an existing file is
    kept. Returns the folder."""
    folder = os.path.join(out, "cifar10")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot make {folder} ({e.strerror}): pass an --out folder this user can write") from None
    for name, split in SPLITS.items():
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            continue
        if not os.path.isdir(os.path.join(data, split)):
            raise UserError(f"{data} has no {split}/ folder: pass an ImageFolder with train/ and val/ (airbench tests "
                            "on val/)")
        classes, samples = image_folder(os.path.join(data, split))
        if classes != CIFAR10_CLASSES:
            raise UserError(f"{os.path.join(data, split)} has the classes {', '.join(classes)}: airbench needs "
                            f"CIFAR-10's ten, named {', '.join(CIFAR10_CLASSES)}")
        paths = [p for p, _ in samples]
        chunks = [paths[i:i + 1000] for i in range(0, len(paths), 1000)]
        if workers > 1:
            with ProcessPoolExecutor(workers, initializer=ignore_stop_signals) as pool:  # a stop is this process's
                images = np.concatenate(list(pool.map(decode, chunks)))
        else:
            images = np.concatenate([decode(c) for c in chunks])
        # a seeded random order, as in the official files: airbench whitens its first layer with the first 5000
        # training images, which in the ImageFolder's order would all be airplanes
        order = np.random.default_rng(0).permutation(len(samples))
        labels = np.array([t for _, t in samples], dtype=np.int64)
        pair = dict(images=torch.from_numpy(images[order]), labels=torch.from_numpy(labels[order]),
                    classes=list(classes))
        torch.save(pair, path + ".partial")
        os.replace(path + ".partial", path)  # whole or absent: a rerun writes it again
    return folder


def import_airbench(sdist, out):
    """airbench imported from its source distribution, unpacked under out (once)."""
    if not os.path.isfile(sdist):
        raise UserError(f"{sdist} not found: `pip download airbench==0.1.8 --no-deps -d .whl/` (on a machine with "
                        "a package index), then pass --airbench .whl/airbench-0.1.8.tar.gz")
    try:
        with tarfile.open(sdist) as tar:
            top = tar.getnames()[0].split("/")[0]
            if not os.path.isdir(os.path.join(out, top)):  # unpacked beside, then renamed: a stop leaves no half
                unpacking = os.path.join(out, f".unpacking{os.getpid()}")
                tar.extractall(unpacking, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
                os.rename(os.path.join(unpacking, top), os.path.join(out, top))
                shutil.rmtree(unpacking)
    except (OSError, tarfile.TarError, IndexError) as e:
        why = "no tar archive" if isinstance(e, tarfile.ReadError) else "empty" if isinstance(e, IndexError) else (
            getattr(e, "strerror", None) or str(e).splitlines()[0])
        raise UserError(f"cannot unpack {sdist} ({why}): pass airbench's source distribution, "
                        "airbench-0.1.8.tar.gz") from None
    sys.path.insert(0, os.path.join(out, top))
    import airbench
    return airbench


class WallClockEvent:
    """torch.cuda.Event's timing on the CPU: record() marks the time, elapsed_time() the milliseconds between two."""

    def __init__(self, **_):
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def elapsed_time(self, end):
        return 1e3 * (end.at - self.at)


def run_on_cpu(airbench):
    """airbench's four CUDA calls made CPU ones, in fp32; this process runs nothing else."""
    torch.nn.Module.cuda = lambda self, device=None: self
    torch.nn.Module.half = lambda self: self
    torch.Tensor.half = lambda self, memory_format=torch.preserve_format: self.float()
    torch.cuda.Event = WallClockEvent
    torch.cuda.synchronize = lambda device=None: None
    init = airbench.CifarLoader.__init__
    init.__defaults__ = init.__defaults__[:-1] + ("cpu",)  # gpu=0: where its files are loaded


def train_loader(airbench, bench, run, device):
    """The loader airbench's train94/96 build for themselves, with a JSON line at each epoch's end."""
    hyp = getattr(airbench, f"lib_{bench}").hyp

    class Loader(airbench.CifarLoader):
        def __iter__(self):
            epoch, start, steps = self.epoch, time.time(), 0
            try:
                for batch in super().__iter__():
                    steps += 1
                    yield batch
            finally:  # also when train() breaks off its last, partial epoch
                print(json.dumps(dict(bench=bench, run=run, epoch=epoch, steps=steps,
                                      seconds=round(time.time() - start, 1))), flush=True)

    return Loader("cifar10", train=True, batch_size=hyp["opt"]["batch_size"], aug=hyp["aug"], altflip=True,
                  gpu=device)


def train_runs(airbench, bench, runs, device, first=0):
    """Train `bench` `runs` times, run r seeded r (from `first`: runs split over processes); a JSON line each;
    returns the accuracies (%)."""
    lib = getattr(airbench, f"lib_{bench}")
    train = getattr(airbench, f"train{bench[-2:]}")
    test = airbench.CifarLoader("cifar10", train=False, batch_size=2000, gpu=device)  # as airbench's evaluation
    accs = []
    for run in range(first, first + runs):
        torch.manual_seed(run)
        start = time.time()
        model = train(train_loader=train_loader(airbench, bench, run, device), verbose=False)
        acc = 100 * airbench.evaluate(model, test, tta_level=lib.hyp["net"]["tta_level"])
        accs.append(acc)
        print(json.dumps(dict(bench=bench, run=run, tta_test_acc=round(acc, 2), seconds=round(time.time() - start, 2))),
              flush=True)
    return accs


def cpu_name():
    """The CPU's model name and the cores this process may use, e.g. 'AMD EPYC 7B13 x2'."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = "cpu"
    return f"{name} x{len(os.sched_getaffinity(0))}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the CIFAR-10 ImageFolder (train/ and val/)")
    parser.add_argument("--out", default=os.path.join("runs", "calibration"),
                        help="where the pair and airbench go (default: runs/calibration)")
    parser.add_argument("--airbench", default=os.path.join(".whl", "airbench-0.1.8.tar.gz"),
                        help="airbench's source distribution (default: .whl/airbench-0.1.8.tar.gz)")
    parser.add_argument("--bench", default="airbench94", choices=list(PUBLISHED))
    parser.add_argument("--runs", type=int, default=10, help="trainings (default: 10)")
    parser.add_argument("--first-run", type=int, default=0, metavar="R",
                        help="the first run's number, its seed (default: 0): runs split over processes (one a core on "
                             "a CPU) take R = 0, 1, ...")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: airbench as published (fp16); cpu: the same files in fp32, about an hour a run "
                             "on 2 cores (default: cuda where there is one)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="processes decoding the images (default: one a core)")
    parser.add_argument("--write-only", action="store_true", help="write the pair and stop")
    args = parser.parse_args(argv)
    for flag, value, least in (("--runs", args.runs, 1), ("--first-run", args.first_run, 0),
                               ("--workers", args.workers, 1)):
        if value < least:
            raise UserError(f"{flag} {value}: give {least} or more")
    if args.device == "cuda" and not torch.cuda.is_available() and not args.write_only:  # before the pair is written
        raise UserError("no CUDA device here: pass --device cpu (fp32, about an hour a run on 2 cores), or "
                        "--write-only to write the data only")
    out = os.path.abspath(args.out)
    start = time.time()
    if args.workers > len(os.sched_getaffinity(0)):
        from sce.cli import cap_processes  # here only: it imports torchvision's models
        args.workers = cap_processes(args.workers)
    folder = write_pair(args.data, out, args.workers)
    print(json.dumps(dict(what="pair", folder=folder, seconds=round(time.time() - start, 1))), flush=True)
    if args.write_only:
        return
    airbench = import_airbench(os.path.abspath(args.airbench), out)
    if args.device == "cpu":
        run_on_cpu(airbench)
    os.chdir(out)  # airbench reads cifar10/*.pt under the working directory
    accs = train_runs(airbench, args.bench, args.runs, 0 if args.device == "cuda" else "cpu", args.first_run)
    mean = statistics.mean(accs)
    print(json.dumps(dict(bench=args.bench, runs=len(accs), mean=round(mean, 3),
                          std=round(statistics.stdev(accs), 3) if len(accs) > 1 else None, min=round(min(accs), 2),
                          max=round(max(accs), 2), published=PUBLISHED[args.bench],
                          difference=round(mean - PUBLISHED[args.bench], 3), torch=torch.__version__,
                          device=torch.cuda.get_device_name() if args.device == "cuda" else cpu_name(),
                          precision="fp16" if args.device == "cuda" else "fp32")), flush=True)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
