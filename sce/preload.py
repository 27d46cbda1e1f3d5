"""Datasets kept on the training device (`--preload`): decoded once, then every batch is cropped, flipped
and augmented by batched device ops, with no loader processes and no per-image host work.

The decoded uint8 images of a small dataset fit in a small share of a GPU's memory (CIFAR-10: 50,000 x
3 x 32 x 32 bytes = 150 MB; Tiny-ImageNet 1.2 GB; STL-10's 105,000 train + unlabeled images 2.9 GB).
Each step gathers its batch from the one (N, 3, H, W) tensor and reads every random parameter from a
table of uniforms drawn once per epoch from (seed, epoch), one row per image: the views are a pure
function of (seed, epoch, index), for any number of ranks and after a resume. A view's random resized
crop and flip are two batched matrix products (the weights of torch's antialiased bilinear resize,
per image), then come the photometric ops of sce.device_augment, from the same Table 2 rows
(sce.augment.AUGMENTATIONS) and in the same order as the loader path. The two paths draw their
parameters from different random streams; given the same parameters they give the same views up to
the loader's uint8 rounding of the crop (tests/test_preload.py).
"""
import functools
import math
import os
import time

import numpy as np
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF

from sce import UserError
from sce.augment import AUGMENTATIONS, BLUR_SIGMA, RRC_RATIO, Encoded, jitter_ranges, normalize_stats
from sce.datasets import decode_rgb_tensor
from sce.device_augment import normalize, photometric, run_compiled
from sce.loader import UnreadableImage, image_path
from sce.preemption import ignore_stop_signals
from sce.progress import Progress

MEMORY_SHARE = 0.25  # of the device's memory, at most, for the decoded images
PRELOADED = {}  # device -> bytes of the images preloaded there by this process
RRC_ATTEMPTS = 10  # torchvision's RandomResizedCrop tries 10 (area, ratio) draws, then a central crop
VIEW_DRAWS = 2 * RRC_ATTEMPTS + 3 + 13  # crop attempts, top, left, flip, then the photometric draws


# ---------------------------------------------------------------- decoding once

class Images:
    """A whole dataset as one uint8 tensor (N, 3, H, W) on its device, with its labels (N,) if any."""

    def __init__(self, images, targets=None):
        self.images, self.targets = images, targets

    def __len__(self):
        return len(self.images)

    def subset(self, index):
        index = index.to(self.images.device)
        return Images(self.images[index], None if self.targets is None else self.targets[index])


class _Decoded(torch.utils.data.Dataset):
    """(index, uint8 tensor (3, H, W) or None, reason) of each image, after a deterministic PIL transform."""

    def __init__(self, dataset, transform=None):
        self.dataset, self.transform = dataset, transform

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        try:  # decode errors come as many exception types, from the reader or the decoder
            img = self.dataset[i][0]
            if isinstance(img, Encoded):  # read for the device's decoder (--decode device): decoded here, once
                img = decode_rgb_tensor(img.data.numpy().tobytes())
            if self.transform:
                img = self.transform(TF.to_pil_image(img) if torch.is_tensor(img) else img)
        except Exception as e:
            return i, None, f"{type(e).__name__}: {e}"[:300]
        return i, img if torch.is_tensor(img) else TF.pil_to_tensor(img), ""


def memory_budget(device):
    """Bytes the decoded images may take: MEMORY_SHARE of the GPU's memory, or of the host's on a CPU run."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(MEMORY_SHARE * total)


def first_size(dataset, transform=None):
    """(C, H, W) of the first readable image, or None."""
    for i in range(min(len(dataset), 16)):
        _, img, _ = _Decoded(dataset, transform)[i]
        if img is not None:
            return tuple(img.shape)
    return None


def preload(dataset, device, required=False, workers=0, max_bad=0, transform=None, what="images"):
    """The dataset decoded into an Images on `device` (host memory on a CPU run), or None, with one line
    saying why, where the loader must read it: images of several sizes, or more than MEMORY_SHARE of the
    device's memory. required (--preload device): a one-line error instead. transform: a deterministic
    PIL transform applied once (main_lincls.py's resize). An unreadable image is named, counted against
    max_bad and replaced by the next readable one, as the loader does (max_bad None: an evaluation, none is)."""
    def cannot(reason):
        if required:
            raise UserError(f"--preload device: {reason}: use --preload off (the loader)")
        print(f"=> {reason}: reading them with the loader (--preload off)", flush=True)

    shape = first_size(dataset, transform)
    if shape is None:
        raise UserError(f"none of the first {min(len(dataset), 16)} {what} is readable: check the data")
    need, budget, before = len(dataset) * math.prod(shape), memory_budget(device), PRELOADED.get(str(device), 0)
    if need + before > budget:  # the share covers every set this process preloads (pretraining, kNN)
        return cannot(f"the {len(dataset)} decoded {what} ({'x'.join(map(str, shape))}) need "
                      f"{need / 2 ** 30:.1f} GiB, more than {MEMORY_SHARE:.0%} of the {device.type} memory "
                      f"({budget / MEMORY_SHARE / 2 ** 30:.0f} GiB)" + (f" with the {before / 2 ** 30:.1f} GiB already "
                                                                       "preloaded" if before else ""))
    start = time.time()
    images, bad = _decode_all(dataset, shape, workers, transform, what)
    if images is None:  # bad is the reason
        return cannot(bad)
    _replace_bad(images, bad, dataset, max_bad)
    targets = getattr(dataset, "targets", None)
    targets = torch.as_tensor(np.asarray(targets), device=device) if targets is not None else None
    images = images.to(device)
    PRELOADED[str(device)] = PRELOADED.get(str(device), 0) + need
    print(f"=> preloaded {len(images)} {what} ({'x'.join(map(str, shape))}, {need / 2 ** 20:.0f} MiB) on {device} "
          f"in {time.time() - start:.1f} s: batches are cropped and augmented there", flush=True)
    return Images(images, targets)


def wanted(mode, device):
    """Whether --preload MODE tries to preload on `device`: auto on CUDA, device always, off never."""
    return mode == "device" or (mode == "auto" and device.type == "cuda")


def preload_eval(dataset, size, mode, device, workers=0, train=False, what="images"):
    """A split of the small-image evaluation protocol (main_lincls.py, the kNN monitor) preloaded with the
    deterministic part of its transform, a resize to `size` (val: and its centre crop), or None: --preload
    off, auto on a CPU, or images that cannot be preloaded (the loader reads them). Every image must be
    readable: an unreadable one is an error naming it, none is replaced (sce.loader.UnreadableImage)."""
    if not wanted(mode, device):
        return None
    prefix = T.Compose([T.Resize(size)] + ([] if train else [T.CenterCrop(size)]))
    return preload(dataset, device, mode == "device", workers, max_bad=None, transform=prefix, what=what)


BATCH_TIMEOUT_S = 300  # a decoding worker silent this long has failed (its sending thread died): stop, not hang


def _stack_batch(samples, shape):
    """collate_fn of the decoding loader: (indices, one uint8 tensor of their images, {index: reason} of
    the unreadable ones, the first other shape met or None). One tensor crosses from a worker per batch,
    one file descriptor (a list of 256 images would take 256 and could exhaust `ulimit -n`)."""
    fits = [(i, img) for i, img, _ in samples if img is not None and tuple(img.shape) == shape]
    other = next((tuple(img.shape) for _, img, _ in samples if img is not None and tuple(img.shape) != shape), None)
    images = torch.stack([img for _, img in fits]) if fits else torch.empty((0,) + shape, dtype=torch.uint8)
    return [i for i, _ in fits], images, {i: reason for i, img, reason in samples if img is None}, other


def _decode_all(dataset, shape, workers, transform, what):
    """(uint8 tensor (N, *shape), {index: reason} of unreadable images) decoded by `workers` processes
    with a progress line, or (None, reason) when an image has another size. A failing worker (killed,
    out of file descriptors) ends the run with one line."""
    images = torch.empty((len(dataset),) + shape, dtype=torch.uint8)
    bad, progress, shown = {}, Progress(len(dataset)), time.time()
    loader = torch.utils.data.DataLoader(_Decoded(dataset, transform), batch_size=256, num_workers=workers,
                                         collate_fn=functools.partial(_stack_batch, shape=shape),
                                         timeout=BATCH_TIMEOUT_S if workers else 0, worker_init_fn=ignore_stop_signals)
    batches = iter(loader)
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # noqa: BLE001: a worker died, timed out or could not send its batch
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise UserError(f"decoding the {what} to preload them failed in a loader worker ({reason}): retry "
                            f"with fewer --workers (now {workers}), raise the open-file limit (ulimit -n), or use "
                            "--preload off") from None
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
    if max_bad is None:  # an evaluation (preload_eval): every image counts, none is replaced
        first = min(bad)
        raise UnreadableImage.of(image_path(dataset, first), bad[first], len(bad) - 1)
    for i, reason in sorted(bad.items()):
        path = dataset.path(i) if hasattr(dataset, "path") else f"#{i}"
        print(f"warning: skipping unreadable image {path} ({reason})", flush=True)
    if len(bad) > max_bad:
        raise UserError(f"{len(bad)} unreadable images, more than --max-bad-images {max_bad}: "
                        "fix or remove them (see the warnings above)")
    if len(bad) == len(images):
        raise UserError("no readable image in the dataset")
    for i in bad:  # the next readable image, as PretrainDataset does
        j = next(j % len(images) for j in range(i + 1, i + len(images)) if j % len(images) not in bad)
        images[i] = images[j]


# ---------------------------------------------------------------- random parameters

def epoch_uniforms(seed, epoch, count, width, device):
    """(count, width) uniforms in [0, 1) for one epoch, row i for image i: a function of (seed, epoch)
    only, drawn on the CPU so every device and rank gets the same table."""
    generator = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0]))
    return torch.rand(count, width, generator=generator, dtype=torch.float64).to(device)


def random_resized_crops(u, height, width, scale, ratio=RRC_RATIO):
    """(top, left, h, w) of a batch as torchvision's RandomResizedCrop.get_params draws them, from
    uniforms u (N, 2 * RRC_ATTEMPTS + 2): RRC_ATTEMPTS (area, log-ratio) pairs, the first that fits
    wins, else the central crop of the closest allowed ratio; then top and left."""
    area = height * width
    target = area * (scale[0] + (scale[1] - scale[0]) * u[:, 0:2 * RRC_ATTEMPTS:2])
    log_ratio = math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u[:, 1:2 * RRC_ATTEMPTS:2]
    w = torch.round(torch.sqrt(target * torch.exp(log_ratio)))
    h = torch.round(torch.sqrt(target / torch.exp(log_ratio)))
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = fits.int().argmax(dim=1, keepdim=True)
    if width / height < ratio[0]:  # torchvision's fallback
        fallback = (round(width / ratio[0]), width)
    elif width / height > ratio[1]:
        fallback = (height, round(height * ratio[1]))
    else:
        fallback = (height, width)
    found = fits.any(dim=1)
    h = torch.where(found, h.gather(1, first).squeeze(1), fallback[0])
    w = torch.where(found, w.gather(1, first).squeeze(1), fallback[1])
    top = torch.where(found, torch.floor(u[:, 2 * RRC_ATTEMPTS] * (height - h + 1)), (height - h) // 2)
    left = torch.where(found, torch.floor(u[:, 2 * RRC_ATTEMPTS + 1] * (width - w + 1)), (width - w) // 2)
    return top, left, h, w


def jitter_table(aug, device):
    """(4, 2) float64 ranges of the jitter factors of Table 2 row `aug`, on `device`. Made before the compiled
    view is called (PreloadedViews): a cache read inside the compiled function would fail its guard and
    compile the view a second time."""
    jitter = AUGMENTATIONS[aug][1]
    table = jitter_ranges(jitter) if jitter else [(1.0, 1.0)] * 3 + [(0.0, 0.0)]
    return torch.tensor(table, dtype=torch.float64, device=device)


def photometric_params(u, aug, ranges):
    """The photometric parameters of Table 2 row `aug` for a batch (sce.augment.draw_photometric's
    meaning, by name as sce.device_augment.photometric reads them), from uniforms u (N, 13) and the
    row's jitter_table."""
    p_jitter, jitter, p_gray, p_blur, p_solarize = AUGMENTATIONS[aug]
    blur = u[:, 9] < p_blur
    return dict(jitter=u[:, 0] < p_jitter, order=u[:, 1:5].argsort(dim=1),
                factors=(ranges[:, 0] + (ranges[:, 1] - ranges[:, 0]) * u[:, 5:9]).float(),
                gray=u[:, 10] < p_gray,
                sigma=torch.where(blur, BLUR_SIGMA[0] + (BLUR_SIGMA[1] - BLUR_SIGMA[0]) * u[:, 11], 0.0).float(),
                solarize=u[:, 12] < p_solarize)


# ---------------------------------------------------------------- batched crop and resize

def resize_weights(start, length, out, size):
    """(N, out, size): row i holds the weights of output pixel i over the `size` input pixels of an axis,
    for a resize of [start, start + length) to `out` pixels as torch's interpolate(mode='bilinear',
    antialias=True) computes them (a triangle filter as wide as the scale when shrinking). Pixels
    outside the axis weigh 0 (zero padding: a row wholly outside is 0)."""
    scale = (length / out).view(-1, 1, 1)
    support = scale.clamp(min=1.0)
    center = scale * (torch.arange(out, device=start.device, dtype=scale.dtype).view(1, -1, 1) + 0.5)
    x = torch.arange(size, device=start.device, dtype=scale.dtype).view(1, 1, -1) - start.view(-1, 1, 1)
    weights = (1 - ((x + 0.5 - center) / support).abs()).clamp(min=0) * ((x >= 0) & (x < length.view(-1, 1, 1)))
    total = weights.sum(dim=2, keepdim=True)
    return torch.where(total > 0, weights / total.clamp(min=1e-12), 0.0)


def crop_resize_flip(images, top, left, height, width, out, flip):
    """Each image's window (top, left, height, width), resized to out x out and flipped where `flip`:
    float (N, 3, H, W) -> (N, 3, out, out), as two batched matrix products."""
    rows = resize_weights(top, height, out, images.shape[-2]).to(images.dtype)
    cols = resize_weights(left, width, out, images.shape[-1]).to(images.dtype)
    cols = torch.where(flip.view(-1, 1, 1), cols.flip(1), cols)
    return torch.matmul(torch.matmul(rows.unsqueeze(1), images), cols.transpose(1, 2).unsqueeze(1))


# ---------------------------------------------------------------- pretraining views

def pretrain_view(images, u, aug, ranges, size, scale, stats, dtype, memory_format):
    """One view of a batch: uint8 images (N, 3, H, W) and their uniforms (N, VIEW_DRAWS) -> the
    normalised view (N, 3, size, size): random resized crop, flip, photometric ops of row `aug`
    (ranges: its jitter_table)."""
    top, left, h, w = random_resized_crops(u, images.shape[-2], images.shape[-1], scale)
    flip = u[:, 2 * RRC_ATTEMPTS + 2] < 0.5
    x = crop_resize_flip(images.float() / 255, top, left, h, w, size, flip)
    if any(AUGMENTATIONS[aug][i] for i in (0, 2, 3, 4)):  # a weak view has no photometric op
        x = photometric(x, photometric_params(u[:, 2 * RRC_ATTEMPTS + 3:], aug, ranges))
    return normalize(x, *stats, dtype, memory_format)


class PreloadedViews:
    """This rank's batches of the sampler's epoch from preloaded images, as DeviceViews yields the
    loader's: (views on the device, no unreadable images, no reasons). `views`: the sce.augment.MultiView
    of the run (each View's row of Table 2, size and scale). compile: each view's ops compiled (--compile)."""

    def __init__(self, images, views, sampler, seed, dtype=None, channels_last=False, compile=False):
        self.images, self.specs, self.sampler, self.seed = images, views.transforms, sampler, seed
        self.dtype = dtype or torch.float32
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.compile = compile
        # each view's jitter ranges, made before the compiled view is called (sce.preload.jitter_table)
        self.ranges = [jitter_table(spec.aug, images.images.device) for spec in self.specs]
        self.wait_s = 0.0  # no loader to wait for
        self.dataset = images

    def __iter__(self):
        device = self.images.images.device
        table = epoch_uniforms(self.seed, self.sampler.epoch, len(self.images), VIEW_DRAWS * len(self.specs), device)
        order = torch.tensor([i for _, i in self.sampler], device=device)
        per_rank = self.sampler.batch // self.sampler.world
        no_bad = torch.full((per_rank,), -1)
        stats = normalize_stats(device)
        for index in order.view(-1, per_rank):
            images, rows = self.images.images[index], table[index]
            views = [run_compiled(pretrain_view, images, rows[:, k * VIEW_DRAWS:(k + 1) * VIEW_DRAWS], spec.aug,
                                  self.ranges[k], spec.size, spec.scale, stats, self.dtype, self.memory_format,
                                  compile=self.compile)
                     for k, spec in enumerate(self.specs)]
            yield views, no_bad, [""] * per_rank


# ---------------------------------------------------------------- evaluation batches

class PreloadedBatches:
    """(normalised images, labels) batches of preloaded evaluation images, in the order of `sampler`
    (any sampler of indices: DistributedSampler, sce.knn.Shard). train: the small-image protocol's
    random crop with `padding` zero pixels and a horizontal flip, drawn per epoch from (seed, epoch)
    (set_epoch), as torchvision's RandomCrop(size, padding) + RandomHorizontalFlip."""

    def __init__(self, images, sampler, batch_size, size=None, train=False, padding=4, seed=0):
        self.images, self.sampler, self.batch_size, self.train = images, sampler, batch_size, train
        self.size, self.padding, self.seed = size, padding, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self):
        data = self.images.images
        device, (height, width) = data.device, data.shape[-2:]
        order = torch.tensor(list(self.sampler), device=device, dtype=torch.long)
        table = epoch_uniforms(self.seed, self.epoch, len(data), 3, device) if self.train else None
        stats = normalize_stats(device)
        for index in order.split(self.batch_size):
            x = data[index].float() / 255
            if self.train:  # top, left in [0, 2 padding + H - size]: the window in the padded image
                u = table[index]
                top = torch.floor(u[:, 0] * (height + 2 * self.padding - self.size + 1)) - self.padding
                left = torch.floor(u[:, 1] * (width + 2 * self.padding - self.size + 1)) - self.padding
                extent = torch.full_like(top, self.size)
                x = crop_resize_flip(x, top, left, extent, extent, self.size, u[:, 2] < 0.5)
            yield normalize(x, *stats, torch.float32, torch.contiguous_format), self.images.targets[index]
