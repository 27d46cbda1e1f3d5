#!/usr/bin/env python
"""What the CIFAR-10 JPEG copy costs a recipe whose mean on the official pixels is published: airbench (Jordan,
"94% on CIFAR-10 in 3.29 seconds on a single GPU", 2024; airbench94: 94.01% over 1000 runs, airbench96: 96.05%
over 200, both with its test-time augmentation), trained N times on our copy, against that figure.

    python benchmarks/calibrate_jpeg.py --data data/cifar10 [--runs 10] [--bench airbench94|airbench96]
        [--airbench .whl/airbench-0.1.8.tar.gz] [--out runs/calibration] [--write-only]

--data: an ImageFolder with train/ and val/ whose class folders are CIFAR-10's ten names. airbench reads a pair
of files, cifar10/train.pt and cifar10/test.pt under its working directory (it downloads the official release
when they are missing, which never happens here: they are written first), each {images: (N, 32, 32, 3) uint8,
labels: (N,) int64, classes}; this script writes them once under --out from --data (decoded by PIL, labels in
CIFAR-10's order, the images in a seeded random order). airbench is not a dependency of the project: its source
distribution (12 kB; `pip download airbench==0.1.8 --no-deps -d .whl/`) is unpacked under --out and imported
from there, unchanged. It trains on CUDA only (its model is moved with .cuda(), its time taken with CUDA events):
--write-only writes the pair anywhere. Prints a JSON line a run, then one with the mean, spread and the published
mean's difference.
"""
import argparse
import json
import os
import statistics
import sys
import tarfile
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sce import UserError  # noqa: E402
from sce.layouts import image_folder  # noqa: E402

# the official release's label order (its batches.meta), which torchvision's CIFAR10.classes follows
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
PUBLISHED = {"airbench94": 94.01, "airbench96": 96.05}  # mean test accuracy (%), with test-time augmentation
SPLITS = {"train.pt": "train", "test.pt": "val"}  # airbench's file <- our split


def decode(paths):
    """(len(paths), H, W, 3) uint8 pixels, as PIL decodes the files."""
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths])


def write_pair(data, out, workers=1):
    """out/cifar10/train.pt and test.pt from data/train and data/val, as airbench reads them; an existing file is
    kept. Returns the folder."""
    folder = os.path.join(out, "cifar10")
    os.makedirs(folder, exist_ok=True)
    for name, split in SPLITS.items():
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            continue
        classes, samples = image_folder(os.path.join(data, split))
        if classes != CIFAR10_CLASSES:
            raise UserError(f"{os.path.join(data, split)} has the classes {', '.join(classes)}: airbench needs "
                            f"CIFAR-10's ten, named {', '.join(CIFAR10_CLASSES)}")
        paths = [p for p, _ in samples]
        chunks = [paths[i:i + 1000] for i in range(0, len(paths), 1000)]
        if workers > 1:
            with ProcessPoolExecutor(workers) as pool:
                images = np.concatenate(list(pool.map(decode, chunks)))
        else:
            images = np.concatenate([decode(c) for c in chunks])
        if images.shape[1:] != (32, 32, 3):
            raise UserError(f"{os.path.join(data, split)} holds {images.shape[2]}x{images.shape[1]} images: airbench "
                            "needs CIFAR-10's 32x32")
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
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        if not os.path.isdir(os.path.join(out, top)):
            tar.extractall(out, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    sys.path.insert(0, os.path.join(out, top))
    import airbench
    return airbench


def train_runs(airbench, bench, runs):
    """Train `bench` `runs` times; a JSON line each; returns the accuracies (%)."""
    lib = getattr(airbench, f"lib_{bench}")
    train = getattr(airbench, f"train{bench[-2:]}")
    test = airbench.CifarLoader("cifar10", train=False, batch_size=2000)  # as airbench's own evaluation
    accs = []
    for run in range(runs):
        torch.manual_seed(run)
        start = time.time()
        model = train(verbose=False)
        acc = 100 * airbench.evaluate(model, test, tta_level=lib.hyp["net"]["tta_level"])
        accs.append(acc)
        print(json.dumps(dict(bench=bench, run=run, tta_test_acc=round(acc, 2), seconds=round(time.time() - start, 2))),
              flush=True)
    return accs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the CIFAR-10 ImageFolder (train/ and val/)")
    parser.add_argument("--out", default=os.path.join("runs", "calibration"),
                        help="where the pair and airbench go (default: runs/calibration)")
    parser.add_argument("--airbench", default=os.path.join(".whl", "airbench-0.1.8.tar.gz"),
                        help="airbench's source distribution (default: .whl/airbench-0.1.8.tar.gz)")
    parser.add_argument("--bench", default="airbench94", choices=list(PUBLISHED))
    parser.add_argument("--runs", type=int, default=10, help="trainings (default: 10)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="processes decoding the images (default: one a core)")
    parser.add_argument("--write-only", action="store_true", help="write the pair and stop")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    start = time.time()
    folder = write_pair(args.data, out, args.workers)
    print(json.dumps(dict(what="pair", folder=folder, seconds=round(time.time() - start, 1))), flush=True)
    if args.write_only:
        return
    if not torch.cuda.is_available():
        raise UserError("airbench trains on CUDA only (its model is moved with .cuda()): run this on a GPU, or pass "
                        "--write-only to write its data")
    airbench = import_airbench(os.path.abspath(args.airbench), out)
    os.chdir(out)  # airbench reads cifar10/*.pt under the working directory
    accs = train_runs(airbench, args.bench, args.runs)
    mean = statistics.mean(accs)
    print(json.dumps(dict(bench=args.bench, runs=len(accs), mean=round(mean, 3),
                          std=round(statistics.stdev(accs), 3) if len(accs) > 1 else None, min=round(min(accs), 2),
                          max=round(max(accs), 2), published=PUBLISHED[args.bench],
                          difference=round(mean - PUBLISHED[args.bench], 3), device=torch.cuda.get_device_name(),
                          torch=torch.__version__)), flush=True)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
