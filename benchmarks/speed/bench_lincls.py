#!/usr/bin/env python
"""The evaluations' throughput as users run them: main_lincls.py (a subprocess, its default flags but the epochs)
on photos split into two classes, the linear probe's training (its last progress line) and the kNN's feature
extraction (--knn), each against a no-grad forward of the same trunk on device tensors.

    python benchmarks/speed/bench_lincls.py --arch resnet50 --amp bf16                   # one GPU, ResNet-50 at 224 px
    python benchmarks/speed/bench_lincls.py --arch resnet18 --small-input --crop-size 32 --images 1024   # CIFAR-10 size

It writes its photos itself (benchmarks/speed/photos.py: crops of scikit-learn's two sample photos, 500x375 JPEG) and
a randomly initialised trunk: the rates do not depend on the weights. Prints one JSON line per measurement, then
a table.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "speed"))
from bench_common import environment, time_calls  # noqa: E402
from photos import write_photos  # noqa: E402
from sce import cli, compiling  # noqa: E402
from sce.builder import build_trunk  # noqa: E402
from sce.compiling import compile_module, resolve_compile  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--images", type=int, default=512, help="photos written, half a class (default: 512)")
parser.add_argument("--arch", default="resnet50", help="(default: resnet50)")
parser.add_argument("--small-input", action="store_true", help="3x3 stride-1 conv1, no max-pool")
parser.add_argument("--batch-size", type=int, default=256, help="(default: 256)")
parser.add_argument("--crop-size", type=int, default=224, help="(default: 224)")
parser.add_argument("--amp", default="none", choices=["none", "fp16", "bf16"], help="(default: none)")
parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile the trunk, in main_lincls.py too (default: main_lincls.py's, on with CUDA)")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="(default: cuda when available)")
parser.add_argument("--workers", type=int, default=cli.default_workers(),
                    help=f"main_lincls.py's loader processes (default: its own, here {cli.default_workers()})")
parser.add_argument("--epochs", type=int, default=3, help="the probe's epochs (default: 3)")
parser.add_argument("--steps", type=int, default=20, help="timed forwards of the reference (default: 20)")
parser.add_argument("--warmup", type=int, default=3, help="untimed forwards before them (default: 3)")
args = parser.parse_args()
device = torch.device(args.device)
args.compile = resolve_compile(args.compile, device)
torch.backends.cudnn.benchmark = True  # as main_lincls.py
ENV = environment(device)
SETTING = dict(arch=args.arch, batch=args.batch_size, crop=args.crop_size, amp=args.amp, compile=args.compile)
COMPILES = compiling.Log()


def report(**fields):
    print(json.dumps({**fields, **SETTING, **ENV}), flush=True)
    return fields


def two_classes(photos, root):
    """train/ and val/ of two classes, every other photo in each (links, not copies)."""
    names = sorted(os.listdir(photos))
    for split in ("train", "val"):
        for c in range(2):
            os.makedirs(os.path.join(root, split, f"c{c}"))
            for name in names[c::2]:
                os.symlink(os.path.join(photos, name), os.path.join(root, split, f"c{c}", name))
    return root


def script_rate(data, trunk, output_dir, extra):
    """images/s of main_lincls.py's last progress line."""
    cmd = [sys.executable, os.path.join(ROOT, "main_lincls.py"), "--data", data, "--pretrained", trunk, "--arch",
           args.arch, "--crop-size", str(args.crop_size), "--batch-size", str(args.batch_size), "--workers",
           str(args.workers), "--amp", args.amp, "--output-dir", output_dir,
           "--compile" if args.compile else "--no-compile"] + (["--small-input"] if args.small_input else []) + extra
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    found = re.findall(r"(\d+) images/s", out.stdout)
    if out.returncode or not found:
        raise SystemExit(f"error: {' '.join(cmd)} failed\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return float(found[-1])


def forward_rate(trunk):
    """images/s of a no-grad forward of the trunk as main_lincls.py runs it (eval mode, contiguous, compiled
    as asked) on a batch already on the device."""
    trunk = trunk.to(device).eval()
    if args.compile:
        compile_module(trunk, "trunk", COMPILES)
    batch = torch.randn(args.batch_size, 3, args.crop_size, args.crop_size, device=device)

    def forward():
        with torch.no_grad(), cli.autocast(device, args.amp):
            trunk(batch)
    return args.batch_size / time_calls(forward, device, args.warmup, args.steps, COMPILES)


with tempfile.TemporaryDirectory() as tmp:
    data = two_classes(os.path.join(write_photos(tmp, args.images), "photos"), os.path.join(tmp, "data"))
    trunk, _ = build_trunk(args.arch, args.small_input)
    torch.save(trunk.state_dict(), os.path.join(tmp, "trunk.pth"))
    rates = {"lincls_train": script_rate(data, os.path.join(tmp, "trunk.pth"), os.path.join(tmp, "probe"),
                                         ["--epochs", str(args.epochs), "--print-freq", "5"]),
             "feature_extraction": script_rate(data, os.path.join(tmp, "trunk.pth"), os.path.join(tmp, "knn"),
                                               ["--knn"])}
reference = forward_rate(trunk)
rows = [report(what="forward_reference", images_per_s=round(reference, 1))]
rows += [report(what=what, images_per_s=rate, of_forward=round(rate / reference, 3)) for what, rate in rates.items()]
print("\n| measurement | images/s | other |\n|---|---|---|")
for r in rows:
    other = f"{100 * r['of_forward']:.1f}% of a no-grad forward" if "of_forward" in r else "no-grad trunk"
    print(f"| {r['what']} | {r['images_per_s']} | {other} |")
