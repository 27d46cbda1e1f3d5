"""Datasets decoded once onto the training device (`--preload`): one uint8 tensor (N, 3, H, W) the batches are
cut from there, with no loader processes and no per-image host work. The decoded images of a small dataset
fit in a small share of a GPU's memory (CIFAR-10: 50,000 x 3 x 32 x 32 bytes = 150 MB; Tiny-ImageNet 1.2 GB;
STL-10's 105,000 train + unlabeled images 2.9 GB)."""
import functools
import math
import time

import numpy as np
import torch
import torchvision.transforms.functional as TF

from sce import UserError, preemption
from sce.compiling import error_line
from sce.data.images import Encoded, UnreadableImage, decode_rgb_tensor, image_path, skip_unreadable
from sce.distributed import device_memory
from sce.preemption import ignore_stop_signals
from sce.progress import Progress

MEMORY_SHARE = 0.25  # of the device's memory, at most, for every set a run preloads (pretraining, kNN)
BATCH_TIMEOUT_S = 300  # a decoding worker silent this long has failed (its sending thread died): stop, not hang


class Images:
    """A whole dataset as one uint8 tensor (N, 3, H, W) on its device, with its labels (N,) if any; `replaced`:
    how many unreadable images were replaced by readable ones."""

    def __init__(self, images, targets=None, replaced=0):
        self.images, self.targets, self.replaced = images, targets, replaced

    def __len__(self):
        return len(self.images)

    def subset(self, index):
        index = index.to(self.images.device)
        return Images(self.images[index], None if self.targets is None else self.targets[index])


class Budget:
    """The bytes of decoded images a run may keep on `device`: MEMORY_SHARE of a GPU's memory, or of the host's
    on a CPU run, shared by every set it preloads."""

    def __init__(self, device):
        self.device, self.total, self.used = device, int(MEMORY_SHARE * device_memory(device)), 0


def wanted(mode, device):
    """Whether --preload MODE tries to preload on `device`: auto on CUDA, device always, off never."""
    return mode == "device" or (mode == "auto" and device.type == "cuda")


class _Decoded(torch.utils.data.Dataset):
    """(index, uint8 tensor (3, H, W) or None, reason) of each image, after a deterministic PIL transform."""

    def __init__(self, dataset, transform=None):
        self.dataset, self.transform = dataset, transform

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        try:  # decode errors come as many exception types, from the reader or the decoder
            img = self.dataset[i][0]
            if isinstance(img, Encoded):  # a dataset read for the device's decoder: decoded here, once
                img = decode_rgb_tensor(img.data.numpy().tobytes())
            if self.transform:
                img = self.transform(TF.to_pil_image(img) if torch.is_tensor(img) else img)
        except Exception as e:
            return i, None, f"{type(e).__name__}: {e}"[:300]
        return i, img if torch.is_tensor(img) else TF.pil_to_tensor(img), ""


def first_size(dataset, transform=None):
    """(C, H, W) of the first readable image, or None."""
    for i in range(min(len(dataset), 16)):
        _, img, _ = _Decoded(dataset, transform)[i]
        if img is not None:
            return tuple(img.shape)
    return None


def preload(dataset, budget, required=False, workers=0, max_bad=0, transform=None, what="images"):
    """The dataset decoded into an Images on the budget's device (host memory on a CPU run), or None, with one
    line saying why, where the loader must read it: images of several sizes, or more than the budget left.
    required (--preload device): a one-line error instead. transform: a deterministic PIL transform applied
    once (an evaluation's resize). An unreadable image is named, counted against max_bad and replaced by the
    next readable one, as the loader does (max_bad None: an evaluation, none is replaced)."""
    def cannot(reason):
        if required:
            raise UserError(f"--preload device: {reason}: use --preload off (the loader)")
        print(f"=> {reason}: reading them with the loader (--preload off)", flush=True)

    shape = first_size(dataset, transform)
    if shape is None:
        raise UserError(f"none of the first {min(len(dataset), 16)} {what} is readable: check the data")
    need, device = len(dataset) * math.prod(shape), budget.device
    if need + budget.used > budget.total:
        return cannot(f"the {len(dataset)} decoded {what} ({'x'.join(map(str, shape))}) need "
                      f"{need / 2 ** 30:.1f} GiB, more than {MEMORY_SHARE:.0%} of the {device.type} memory "
                      f"({budget.total / MEMORY_SHARE / 2 ** 30:.0f} GiB)"
                      + (f" with the {budget.used / 2 ** 30:.1f} GiB already preloaded" if budget.used else ""))
    start = time.time()
    images, bad = _decode_all(dataset, shape, workers, transform, what)
    if images is None:  # bad is the reason
        return cannot(bad)
    _replace_bad(images, bad, dataset, max_bad)
    targets = getattr(dataset, "targets", None)
    if targets is not None:
        targets = torch.tensor(np.asarray(targets))  # a copy: the dataset's own stay as read
        targets[list(bad)] = -1  # a replaced image holds another's pixels: no label (the online probe skips it)
        targets = targets.to(device)
    images = images.to(device)
    budget.used += need
    print(f"=> preloaded {len(images)} {what} ({'x'.join(map(str, shape))}, {need / 2 ** 20:.0f} MiB) on {device} "
          f"in {time.time() - start:.1f} s: batches are cut from there", flush=True)
    return Images(images, targets, len(bad))


def _stack_batch(samples, shape):
    """collate_fn of the decoding loader: (indices, one uint8 tensor of their images, {index: reason} of the
    unreadable ones, the first other shape met or None). One tensor crosses from a worker per batch, one file
    descriptor (a list of 256 images would take 256 and could exhaust `ulimit -n`)."""
    fits = [(i, img) for i, img, _ in samples if img is not None and tuple(img.shape) == shape]
    other = next((tuple(img.shape) for _, img, _ in samples if img is not None and tuple(img.shape) != shape), None)
    images = torch.stack([img for _, img in fits]) if fits else torch.empty((0,) + shape, dtype=torch.uint8)
    return [i for i, _ in fits], images, {i: reason for i, img, reason in samples if img is None}, other


def _decode_all(dataset, shape, workers, transform, what):
    """(uint8 tensor (N, *shape), {index: reason} of unreadable images) decoded by `workers` processes with a
    progress line, or (None, reason) when an image has another size. A failing worker (killed, out of file
    descriptors) ends the run with one line."""
    with preemption.safe_points(None):  # a stop (start-up's) between its batches, not inside its loader's start
        return _decode_batches(dataset, shape, workers, transform, what)


def _decode_batches(dataset, shape, workers, transform, what):
    images = torch.empty((len(dataset),) + shape, dtype=torch.uint8)
    bad, progress, shown = {}, Progress(len(dataset)), time.time()
    loader = torch.utils.data.DataLoader(_Decoded(dataset, transform), batch_size=256, num_workers=workers,
                                         collate_fn=functools.partial(_stack_batch, shape=shape),
                                         timeout=BATCH_TIMEOUT_S if workers else 0, worker_init_fn=ignore_stop_signals,
                                         generator=torch.Generator())  # private: the run's RNG stays as seeded
    batches = iter(loader)
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # noqa: BLE001: a worker died, timed out or could not send its batch
            raise UserError(f"decoding the {what} to preload them failed in a loader worker ({error_line(e)}): retry "
                            f"with fewer --workers (now {workers}), raise the open-file limit (ulimit -n), or use "
                            "--preload off") from None
        preemption.check()
        if batch is None:
            return images, bad
        index, decoded, bad_here, other = batch
        if other:
            return None, (f"{what} of different sizes ({'x'.join(map(str, shape))} and "
                          f"{'x'.join(map(str, other))}) do not stack into one tensor")
        images[index] = decoded
        bad.update(bad_here)
        progress.update(len(index) + len(bad_here))
        if time.time() - shown > 10 or progress.done == len(dataset):
            print(f"preloading {what}: {progress.report()}", flush=True)
            shown = time.time()


def _replace_bad(images, bad, dataset, max_bad):
    if not bad:
        return
    if max_bad is None:  # an evaluation: every image counts, none is replaced
        first = min(bad)
        raise UnreadableImage.of(dataset, first, bad[first], len(bad) - 1)
    skip_unreadable(dataset, bad, len(bad), max_bad)
    if len(bad) == len(images):
        raise UserError(f"no image of the dataset is readable ({image_path(dataset, 0)}: {bad[0]}): check --data")
    for i in bad:  # the next readable image, as the loader does
        j = next(j % len(images) for j in range(i + 1, i + len(images)) if j % len(images) not in bad)
        images[i] = images[j]
