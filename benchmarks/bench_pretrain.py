#!/usr/bin/env python
"""Throughput of the SCE training step on synthetic tensors, and of the data pipeline alone.

    python benchmarks/bench_pretrain.py --arch resnet18 --batch-size 32 --crop-size 64
    python benchmarks/bench_pretrain.py --arch resnet50 --batch-size 256 --amp bf16 --channels-last   # one GPU

Prints one JSON line per measurement: {"what": "train_step" | "data", ..., "images_per_s": ...}.
"""
import argparse
import functools
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sce import losses  # noqa: E402
from sce.builder import SCE  # noqa: E402
from sce.loader import MultiView, PretrainDataset, ResumableSampler, build_dataset, view_transform  # noqa: E402
from sce.optim import build_optimizer  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--arch", default="resnet50", help="(default: resnet50)")
parser.add_argument("--small-input", action="store_true")
parser.add_argument("--batch-size", type=int, default=256, help="(default: 256)")
parser.add_argument("--crop-size", type=int, default=224, help="(default: 224)")
parser.add_argument("--amp", default="none", choices=["none", "fp16", "bf16"], help="(default: none)")
parser.add_argument("--channels-last", action="store_true")
parser.add_argument("--queue-size", type=int, default=65536, help="(default: 65536)")
parser.add_argument("--steps", type=int, default=10, help="timed steps after 3 warm-up steps (default: 10)")
parser.add_argument("--skip-data", action="store_true", help="time only the training step")
parser.add_argument("--data-images", type=int, default=256, help="JPEGs written for the data benchmark (default: 256)")
parser.add_argument("--workers", type=int, default=os.cpu_count(), help="data workers (default: all cores)")
args = parser.parse_args()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
env = {"device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu x{torch.get_num_threads()} threads",
       "torch": torch.__version__}


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_train_step():
    model = SCE(functools.partial(losses.sce_loss), args.arch, args.small_input, [2048, 2048], 256,
                "affine", [], args.queue_size - args.queue_size % args.batch_size).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer("sgd", model, 0.1, 1e-4)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
    views = [torch.randn(args.batch_size, 3, args.crop_size, args.crop_size, device=device) for _ in range(2)]
    if args.channels_last:
        views = [v.to(memory_format=torch.channels_last) for v in views]
    for step in range(3 + args.steps):
        if step == 3:
            sync()
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss, _ = model(views)
        optimizer.zero_grad(set_to_none=True)
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        model.update_momentum(0.99)
    sync()
    seconds = time.perf_counter() - start
    result = dict(what="train_step", arch=args.arch, batch=args.batch_size, crop=args.crop_size, amp=args.amp,
                  channels_last=args.channels_last, step_ms=round(1000 * seconds / args.steps, 1),
                  images_per_s=round(args.batch_size * args.steps / seconds, 1), **env)
    if device.type == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
    print(json.dumps(result), flush=True)


def bench_data():
    """Decode + two views (strong online, weak target) of 500x375 JPEGs, as in ImageNet."""
    with tempfile.TemporaryDirectory() as root:
        rng = np.random.default_rng(0)
        os.makedirs(os.path.join(root, "c"))
        for i in range(args.data_images):
            Image.fromarray(rng.integers(0, 255, (375, 500, 3), dtype=np.uint8)).save(os.path.join(root, "c", f"{i}.jpg"))
        dataset = build_dataset("imagefolder", root, "pretrain")
        transform = MultiView([view_transform("weak", args.crop_size), view_transform("strong", args.crop_size)])
        batch = min(64, args.data_images)
        loader = torch.utils.data.DataLoader(PretrainDataset(dataset, transform, 0), batch_size=batch,
                                             sampler=ResumableSampler(len(dataset), batch), num_workers=args.workers)
        start, count = time.perf_counter(), 0
        for views, _, _ in loader:
            count += len(views[0])
        seconds = time.perf_counter() - start
    print(json.dumps(dict(what="data", crop=args.crop_size, workers=args.workers, images=count,
                          images_per_s=round(count / seconds, 1), **env)), flush=True)


bench_train_step()
if not args.skip_data:
    bench_data()
