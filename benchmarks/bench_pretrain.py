#!/usr/bin/env python
"""Pretraining throughput, side by side in one run: the data loader alone (CPU vs GPU augmentation),
the training step alone (synthetic device tensors), and both together, all through the code
main_pretrain.py runs (sce.augment views, sce.device_augment, sce.engine.train_step).

    python benchmarks/bench_pretrain.py --arch resnet50 --batch-size 256 --amp bf16 --channels-last   # one GPU
    python benchmarks/bench_pretrain.py --device cpu --workers 0 --skip-train --images 64 --batch-size 16   # per-image CPU cost

Without --data it writes ImageNet-like photos itself (crops of scikit-learn's two sample photos,
500x375 JPEG, quality 98, ~100 KB). Prints one JSON line per measurement, then a table.
"""
import argparse
import functools
import itertools
import json
import os
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np
import torch
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from sce import cli, losses  # noqa: E402
from sce.augment import MultiView, View  # noqa: E402
from sce.builder import SCE  # noqa: E402
from sce.device_augment import DeviceViews, views_to_device  # noqa: E402
from sce.engine import Training, compile_model, train_step  # noqa: E402
from sce.loader import ResumableSampler, build_dataset, pretrain_loader  # noqa: E402
from sce.optim import build_optimizer  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--data", metavar="DIR", help="an ImageFolder to read (default: photos written to a temporary folder)")
parser.add_argument("--images", type=int, default=512, help="photos written when --data is not given (default: 512)")
parser.add_argument("--arch", default="resnet50", help="(default: resnet50)")
parser.add_argument("--small-input", action="store_true", help="3x3 stride-1 conv1, no max-pool")
parser.add_argument("--batch-size", type=int, default=256, help="(default: 256)")
parser.add_argument("--crop-size", type=int, default=224, help="(default: 224)")
parser.add_argument("--queue-size", type=int, default=65536, help="(default: 65536)")
parser.add_argument("--amp", default="none", choices=["none", "fp16", "bf16"], help="(default: none)")
parser.add_argument("--channels-last", action="store_true")
parser.add_argument("--compile", action="store_true", help="torch.compile the encoders and heads")
parser.add_argument("--symmetric", action="store_true", help="symmetric loss (both global views are targets)")
parser.add_argument("--augment", nargs="+", default=["cpu", "gpu"], choices=["cpu", "gpu"],
                    help="pipelines to measure (default: cpu gpu)")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(default: cuda if present)")
parser.add_argument("--workers", type=int, default=cli.default_workers(),
                    help="loader processes; 0 measures one core in this process (default: main_pretrain.py's, "
                         f"cores - 1 up to 16, here {cli.default_workers()})")
parser.add_argument("--e2e-workers", type=int, nargs="*", default=[], metavar="N",
                    help="end to end with --augment gpu again with N loader processes each: does the loader compete "
                         "with the training process for the cores?")
parser.add_argument("--steps", type=int, default=20, help="timed steps or batches per measurement (default: 20)")
parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each measurement (default: 3)")
parser.add_argument("--skip-train", action="store_true", help="measure the data loader only")
parser.add_argument("--skip-data", action="store_true", help="measure the training step only")
parser.add_argument("--profile", action="store_true", help="print the top kernels of the device-side augmentation")
args = parser.parse_args()
device = torch.device(args.device)
torch.backends.cudnn.benchmark = True  # as main_pretrain.py
amp_dtype = cli.AMP[args.amp]
ENV = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}",
       "torch": torch.__version__}
SETTING = dict(arch=args.arch, batch=args.batch_size, crop=args.crop_size, amp=args.amp,
               channels_last=args.channels_last, compile=args.compile, symmetric=args.symmetric)
results = []


def report(**fields):
    results.append(fields)
    print(json.dumps({**fields, **ENV}), flush=True)


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_photos(root, count):
    """ImageNet-like JPEGs: random crops of the two sample photos, 500x375, quality 98 (~100 KB)."""
    from sklearn.datasets import load_sample_images
    photos = load_sample_images().images
    rng = np.random.default_rng(0)
    os.makedirs(os.path.join(root, "photos"))
    for i in range(count):
        photo = photos[i % len(photos)]
        h, w = photo.shape[:2]
        ch, cw = int(h * rng.uniform(0.75, 1.0)), int(w * rng.uniform(0.75, 1.0))
        top, left = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
        img = Image.fromarray(photo[top:top + ch, left:left + cw]).resize((500, 375), Image.BICUBIC)
        img.save(os.path.join(root, "photos", f"{i:05d}.jpg"), quality=98)
    return root


class Cycle(torch.utils.data.Dataset):
    """A dataset read round and round, so a few hundred photos feed any number of batches."""

    def __init__(self, dataset, length):
        self.dataset, self.length = dataset, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return self.dataset[i % len(self.dataset)]


def make_loader(dataset, augment, batches, workers=None):
    views = MultiView([View("weak", args.crop_size, on_device=augment == "gpu"),
                       View("strong", args.crop_size, on_device=augment == "gpu")])
    cycled = Cycle(dataset, batches * args.batch_size)
    return pretrain_loader(cycled, views, ResumableSampler(len(cycled), args.batch_size), args.batch_size,
                           args.workers if workers is None else workers, device, seed=0)


def build_training():
    torch.manual_seed(0)
    queue = args.queue_size - args.queue_size % (args.batch_size * (2 if args.symmetric else 1))
    model = SCE(losses.sce_loss, args.arch, args.small_input, [2048, 2048], 256, "affine", [],
                queue, args.symmetric).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer("sgd", model, 0.1, 1e-4)
    if args.compile:
        compile_model(model)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    terms = functools.partial(losses.loss_terms, tau=0.1, tau_m=0.07)  # logged every step, as main_pretrain.py
    return Training(model, model, optimizer, scaler, amp_dtype, terms=terms)


def bench_data(dataset, augment):
    """The loader alone; for gpu, then the device-side augmentation of its last batch, timed apart."""
    batches = iter(make_loader(dataset, augment, args.warmup + args.steps))
    for _ in range(args.warmup):
        next(batches)
    start = time.perf_counter()
    for _ in range(args.steps):
        views, _, _ = next(batches)
    seconds = time.perf_counter() - start
    device_ms = eager_ms = None
    if augment == "gpu":  # the default (compiled on CUDA), then eager, on the last batch
        device_ms = time_device_augment(views, compile=None)
        eager_ms = time_device_augment(views, compile=False)
    if args.profile and augment == "gpu":
        with torch.profiler.profile() as prof:
            views_to_device(views, device, amp_dtype, args.channels_last)
            sync()
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)
    report(what="data", augment=augment, workers=args.workers, crop=args.crop_size, batch=args.batch_size,
           loader_images_per_s=round(args.steps * args.batch_size / seconds, 1),
           ms_per_image_per_core=round(1000 * seconds * max(1, args.workers) / (args.steps * args.batch_size), 2),
           device_ms_per_batch=device_ms, device_ms_per_batch_eager=eager_ms)


def time_device_augment(views, compile):
    views_to_device(views, device, amp_dtype, args.channels_last, compile)  # compiles, on CUDA by default
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        views_to_device(views, device, amp_dtype, args.channels_last, compile)
    sync()
    return round(1000 * (time.perf_counter() - start) / args.steps, 2)


def time_steps(training, views):
    for _ in range(args.warmup):
        train_step(training, views, 0.99)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step(training, views, 0.99)
    sync()
    return (time.perf_counter() - start) / args.steps


def bench_train_step(training):
    """Compute only: synthetic views already on the device, through train_step, with and without
    the non-finite guard (its cost is the difference)."""
    shape = (args.batch_size, 3, args.crop_size, args.crop_size)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    views = [torch.randn(shape, device=device).to(dtype=amp_dtype or torch.float32, memory_format=memory_format)
             for _ in range(2)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    training.guard = False
    unguarded_s = time_steps(training, views)
    training.guard = True
    step_s = time_steps(training, views)
    fields = dict(what="train_step", **SETTING, step_ms=round(1000 * step_s, 2),
                  images_per_s=round(args.batch_size / step_s, 1), step_ms_without_guard=round(1000 * unguarded_s, 2),
                  guard_share=round((step_s - unguarded_s) / step_s, 4))
    if device.type == "cuda":
        fields["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
    if not args.compile:  # (a compiled model would recompile for the small shape)
        fields["host_step_ms"] = round(1000 * host_step_s(training, memory_format), 2)
    report(**fields)
    return args.batch_size / step_s


def host_step_s(training, memory_format):
    """The host's own time per step: the same step on up to 8 images of 64 px, whose GPU work is
    tiny, so the host's launches set the pace. Near step_ms, the host cannot keep ahead of the GPU.
    (On a CPU device it includes the small step's compute.)"""
    n = max(d for d in range(1, 9) if args.batch_size % d == 0)  # divides the batch, so the queue too
    size = min(64, args.crop_size)
    views = [torch.randn(n, 3, size, size, device=device).to(amp_dtype or torch.float32, memory_format=memory_format)
             for _ in range(2)]
    queue_ptr = training.model.queue_ptr.clone()  # n keys a step would misalign the pointer for the batch
    seconds = time_steps(training, views)
    training.model.queue_ptr.copy_(queue_ptr)
    return seconds


def run_pipeline(training, source):
    """Views on the device (DeviceViews) then train_step, over the batches of `source`, as
    main_pretrain.py runs them. Returns images/s, the share of time spent waiting for `source`,
    and the iterator (4 batches left)."""
    batches = DeviceViews(source, device, amp_dtype, args.channels_last)
    batches_iter = iter(batches)
    for _ in range(args.warmup):
        views, _, _ = next(batches_iter)
        train_step(training, views, 0.99)
    sync()
    batches.wait_s, start = 0.0, time.perf_counter()
    for _ in range(args.steps):
        views, _, _ = next(batches_iter)
        train_step(training, views, 0.99)
    sync()
    seconds = time.perf_counter() - start
    return args.steps * args.batch_size / seconds, batches.wait_s / seconds, batches_iter


def bench_end_to_end(training, dataset, augment, compute_images_per_s, workers=None, profile=True):
    """The loader (workers: default --workers), DeviceViews, then train_step; profiled under --profile
    unless profile=False."""
    workers = args.workers if workers is None else workers
    loader = make_loader(dataset, augment, args.warmup + args.steps + 4, workers)
    images_per_s, wait, batches_iter = run_pipeline(training, loader)
    syncs, sites = count_host_syncs(training, batches_iter) if device.type == "cuda" else (None, None)
    if profile and args.profile and device.type == "cuda":  # where the GPU time of two whole steps goes
        with torch.profiler.profile() as prof:
            for _ in range(2):
                views, _, _ = next(batches_iter)
                train_step(training, views, 0.99)
            sync()
        print(f"end to end, augment {augment}, two steps:", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)
    report(what="end_to_end", augment=augment, workers=workers, **SETTING,
           images_per_s=round(images_per_s, 1), data_wait_share=round(wait, 3),
           of_compute_only=round(images_per_s / compute_images_per_s, 3) if compute_images_per_s else None,
           host_syncs_per_step=syncs, host_sync_sites=sites)


def bench_device_pipeline(training, dataset, compute_images_per_s):
    """End to end without the loader's CPU load: 4 of its batches (pinned), read once and cycled,
    through DeviceViews (device augmentation) and train_step. Against end_to_end, it tells the
    device side's cost from the host's (loader workers competing with the training process)."""
    cached = list(itertools.islice(iter(make_loader(dataset, "gpu", 4)), 4))
    images_per_s, _, _ = run_pipeline(training, (cached[i % 4] for i in range(args.warmup + args.steps + 4)))
    report(what="device_pipeline", augment="gpu", **SETTING, images_per_s=round(images_per_s, 1),
           of_compute_only=round(images_per_s / compute_images_per_s, 3) if compute_images_per_s else None)


def count_host_syncs(training, batches_iter, steps=2):
    """Host-device synchronisations per step of the loop, and where: the innermost frame of this
    project (or of the DataLoader) under the warning torch's sync debug mode raises."""
    sites = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = traceback.extract_stack()[:-1]
            ours = [f for f in frames if ROOT in f.filename and "site-packages" not in f.filename]
            where = ours[-1] if ours else frames[-1]  # none of ours: another thread (the loader's pin-memory one?)
            path = os.path.relpath(where.filename, ROOT) if ours else "/".join(where.filename.split(os.sep)[-3:])
            sites.append(f"{os.path.basename(filename)}:{lineno} <- {path}:{where.lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("warn")  # in torch 2.11 switching it on counted as one sync
        warnings.simplefilter("always")
        warnings.showwarning = record
        try:
            for _ in range(steps):
                views, _, _ = next(batches_iter)
                train_step(training, views, 0.99)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return len(sites) / steps, sorted(set(sites))


def table():
    print("\n| measurement | augment | images/s | other |\n|---|---|---|---|")
    for r in results:
        if r["what"] == "data":
            other = f"{r['ms_per_image_per_core']} ms/image/core, workers {r['workers']}"
            if r["device_ms_per_batch"] is not None:
                other += f", device {r['device_ms_per_batch']} ms/batch ({r['device_ms_per_batch_eager']} eager)"
            print(f"| data | {r['augment']} | {r['loader_images_per_s']} | {other} |")
        elif r["what"] == "train_step":
            print(f"| train_step | - | {r['images_per_s']} | {r['step_ms']} ms/step, guard {100 * r['guard_share']:.2f}%"
                  f"{', peak ' + str(r['peak_mem_gib']) + ' GiB' if 'peak_mem_gib' in r else ''}"
                  f"{', host ' + str(r['host_step_ms']) + ' ms/step' if 'host_step_ms' in r else ''} |")
        elif r["what"] == "device_pipeline":
            print(f"| device_pipeline | gpu | {r['images_per_s']} | cached batches, "
                  f"{100 * (r['of_compute_only'] or 0):.1f}% of compute-only |")
        else:
            syncs = "" if r["host_syncs_per_step"] is None else f", {r['host_syncs_per_step']} host syncs/step"
            print(f"| end_to_end | {r['augment']} | {r['images_per_s']} | workers {r['workers']}, "
                  f"data wait {100 * r['data_wait_share']:.1f}%, "
                  f"{100 * (r['of_compute_only'] or 0):.1f}% of compute-only{syncs} |")


if args.workers == 0:  # the loader's work in this process: one core, as in a worker
    torch.set_num_threads(1)
with tempfile.TemporaryDirectory() as tmp:
    root = args.data or write_photos(tmp, args.images)
    datasets = {a: build_dataset("imagefolder", root, "pretrain", as_tensor=a == "gpu") for a in ("cpu", "gpu")}
    if not args.skip_data:
        for augment in args.augment:
            bench_data(datasets[augment], augment)
    if not args.skip_train:
        training = build_training()
        compute = bench_train_step(training)
        if not args.skip_data:
            for augment in args.augment:
                bench_end_to_end(training, datasets[augment], augment, compute)
            for workers in args.e2e_workers:
                bench_end_to_end(training, datasets["gpu"], "gpu", compute, workers, profile=False)
            if "gpu" in args.augment:
                bench_device_pipeline(training, datasets["gpu"], compute)
table()
