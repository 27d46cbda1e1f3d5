"""Pretraining batches: each step's views on the training device, by one of four routes chosen once at start
(`choose_route`, from --augment, --decode and --preload), one small class each:

    CpuRoute      loader workers decode (PIL), crop, resize, flip and apply the photometric ops: normalised views
    GpuRoute      workers decode into a tensor and crop (ops.resized_crops): uint8 crops; the device does the rest
    DecodeRoute   workers read a JPEG's bytes and header only; the device decodes (sce.data.jpeg), crops and the rest
                  (other files, PNG or progressive JPEG, are cropped by the workers as on the gpu route)
    PreloadRoute  the images were decoded once onto the device (sce.data.preloading): everything happens there

Every route yields the same batch to the step: the list of views, each (N, 3, size, size) normalised in the
run's dtype and memory format on the device (a Batch: with the images' labels beside, for the online probe). Every
route draws a view's parameters with sce.data.views.draw from (seed, epoch, index, view), the seed the sampler's, so the
routes give the same crops, flips and photometric parameters, and the tensor routes the same pixels within a level (the
workers crop uint8 images in uint8, the device crops decoded ones in float; the PIL resize of --augment cpu differs by a
level or two). An unreadable image is replaced by the next readable one, named once, and counted against max_bad."""
import functools
import os
import time

import torch

from sce import UserError
from sce.compiling import Fallback, allow_recompiles, compile_function
from sce.data import ops
from sce.data.assembly import Preloaded, pack, unpack
from sce.data.images import Encoded, decode_rgb_tensor, image_path, skip_unreadable
from sce.data.jpeg import JpegDecoder
from sce.data.preloading import preload, wanted
from sce.data.samplers import epoch_order
from sce.data.views import Photometric, draw, draw_views, pil_view, view_specs
from sce.preemption import ignore_stop_signals

READ = {"cpu": "pil", "gpu": "tensor", "decode": "encoded"}  # how each loader route's workers read the files


class Batch(list):
    """A step's views (the list every consumer takes) with the images' labels beside (`labels`, (N,) long on the
    device; -1 for an image without one, for every image of a dataset without labels, and for an unreadable image
    replaced by the next readable one)."""

    def __init__(self, views, labels):
        super().__init__(views)
        self.labels = labels


def labels_of(dataset, device):
    """The dataset's labels as a tensor on the device (-1 where there are none)."""
    targets = getattr(dataset, "targets", None)
    return torch.as_tensor(targets if targets is not None else [-1] * len(dataset), dtype=torch.long).to(device)


def choose_route(augment, decode, preload_mode, device):
    """(the loader route: cpu, gpu or decode; whether to preload first), from --augment, --decode (resolved) and
    --preload. Preloading needs --augment gpu; a dataset that cannot be preloaded takes the loader route."""
    loader = "cpu" if augment == "cpu" else "decode" if decode == "device" else "gpu"
    return loader, augment != "cpu" and wanted(preload_mode, device)


def from_flags(args, dataset, sampler, device, route, try_preload, dtype=None, budget=None, compiles=None,
               preview=False):
    """main_pretrain.py's batches, from its parsed flags (read here, once): the views of view_specs(args), the loader
    route `route` or the dataset preloaded first (try_preload; --preload device: or stop), --workers (none for a
    preview), --channels-last, --compile, --max-bad-images (-1: 0.1% of the dataset)."""
    max_bad = args.max_bad_images if args.max_bad_images >= 0 else max(1, len(dataset) // 1000)
    return pretrain_batches(dataset, view_specs(args), sampler, device, route, try_preload=try_preload,
                            required=args.preload == "device", workers=0 if preview else args.workers, dtype=dtype,
                            channels_last=args.channels_last, compile=args.compile, max_bad=max_bad, budget=budget,
                            compiles=compiles)


def pretrain_batches(dataset, specs, sampler, device, route, *, try_preload=False, required=False, workers=0,
                     dtype=None, channels_last=False, compile=False, max_bad=0, budget=None, compiles=None):
    """The batches of the loader route `route` (the dataset read with READ[route]), or of its images decoded onto
    the device first (try_preload; required: or stop), falling back to the loader where they cannot be."""
    views = Views(specs, device, dtype, channels_last, compile, compiles)
    images = preload(dataset, budget, required, workers, max_bad) if try_preload else None
    if images is not None:
        return PreloadRoute(images, sampler, views)
    samples = Samples(dataset, specs, sampler.seed, route)
    kind = {"cpu": CpuRoute, "gpu": GpuRoute, "decode": DecodeRoute}[route]
    return kind(samples, sampler, views, workers, max_bad)


# ---------------------------------------------------------------- the workers' side

class Samples(torch.utils.data.Dataset):
    """What a loader worker makes of key (epoch, index): (key, payload, bad index or -1, reason), the payload by
    route: cpu, the normalised views; gpu, (per view a uint8 crop, per view its parameter row, None); decode, for a
    plain JPEG (None, its rows, its bytes), for another file (PNG, progressive JPEG) the gpu route's. An unreadable
    image is replaced by the next readable one, which gets the views of the index asked for."""

    def __init__(self, dataset, specs, seed, route):
        self.dataset, self.specs, self.seed, self.route = dataset, specs, seed, route

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        img, bad, reason = self.read(index)
        if self.route == "cpu":
            rows = self.rows(epoch, index, img.height, img.width)
            return key, [pil_view(img, spec, row) for spec, row in zip(self.specs, rows)], bad, reason
        if isinstance(img, Encoded):  # decode route, a plain JPEG: the device decodes and crops it
            return key, (None, self.rows(epoch, index, *img.size), img.data), bad, reason
        return key, self.crops(img, epoch, index) + (None,), bad, reason

    def read(self, index, decode=False):
        """(the first readable image from `index` on, the unreadable index met first or -1, its reason).
        decode: a JPEG read for the device is decoded here (one the device's decoder refused)."""
        bad, reason = -1, ""
        for attempt in range(len(self.dataset)):
            i = (index + attempt) % len(self.dataset)
            try:
                img = self.dataset[i][0]
                if decode and isinstance(img, Encoded):
                    img = decode_rgb_tensor(img.data.numpy().tobytes())
                return img, bad, reason
            except Exception as e:  # decode errors come as many exception types
                if bad < 0:
                    bad, reason = i, f"{type(e).__name__}: {e}"[:300]
        raise UserError(f"no image of the dataset is readable ({image_path(self.dataset, bad)}: {reason}): check "
                        "--data")

    def rows(self, epoch, index, height, width):
        return draw_views(self.specs, self.seed, epoch, index, height, width)

    def crops(self, img, epoch, index):
        """(per view the uint8 crop of a uint8 image (3, H, W), per view its row)."""
        rows = self.rows(epoch, index, *img.shape[-2:])
        return [crop(img, spec.size, row) for spec, row in zip(self.specs, rows)], rows

    def decoded(self, epoch, index):
        """The crops of `index` decoded here, whatever the dataset's reader (an image the device's decoder could
        not read), with its unreadable index and reason."""
        img, bad, reason = self.read(index, decode=True)
        return self.crops(img, epoch, index)[0], bad, reason


def crop(image, size, row):
    """One view's crop of one uint8 image (3, H, W) with its packed row (ops.resized_crops) -> uint8."""
    out = ops.window_crop(image[None], row, size)  # a random resized crop lies inside its image
    return (out if out is not None else ops.resized_crops(image[None], row[None], size))[0].to(torch.uint8)


def collate(samples, route):
    """A loader batch: (epoch, indices, bad (N,), reasons, then the payloads by route: cpu, the views; gpu, per view
    the crops, per view the rows; decode, assembly.pack's tensors)."""
    head = (samples[0][0][0], torch.tensor([s[0][1] for s in samples]), torch.tensor([s[2] for s in samples]),
            [s[3] for s in samples])
    payloads = [s[1] for s in samples]
    if route == "cpu":
        return head + ([torch.stack(v) for v in zip(*payloads)],)
    if route == "decode":
        return head + pack(payloads)
    views = range(len(payloads[0][1]))
    return head + ([torch.stack([p[0][v] for p in payloads]) for v in views],
                   [torch.stack([p[1][v] for p in payloads]) for v in views])


# ---------------------------------------------------------------- the device's side

def finish_view(crops, rows, photometric, *, scale, shift, dtype, memory_format):
    """Crops (N, 3, s, s) in [0, 255] and their packed rows on the device -> the normalised view (the photometric
    ops where the view has any)."""
    x = crops.float() / 255
    if photometric:
        x = ops.photometric(x, *Photometric.of(rows).as_args())
    return ops.normalize(x, scale, shift, dtype, memory_format)


def preloaded_view(images, rows, size, photometric, **output):
    """One view of a batch of preloaded uint8 images (N, 3, H, W) with its packed rows -> the normalised view;
    output: finish_view's (the normalisation's scale and shift, the dtype, the memory format)."""
    return finish_view(ops.resized_crops(images, rows, size), rows, photometric, **output)


class Views:
    """The device's side of the views: finish(crops, rows) and preloaded(images, rows) per view, in the run's
    dtype and memory format, torch.compile'd when `compile` (static shapes: one compile per view size and row; a
    failed compile warns once and runs them eagerly, sce.compiling.Fallback). compiles: a sce.compiling.Log."""

    def __init__(self, specs, device, dtype=None, channels_last=False, compile=False, compiles=None):
        self.specs, self.device = specs, device
        scale, shift = ops.normalization(device)
        self.output = dict(scale=scale, shift=shift, dtype=dtype or torch.float32,  # how every view leaves
                           memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        self.fallback = None
        if compile:
            compiled = {fn: compile_function(fn, compiles) for fn in (finish_view, preloaded_view)}
            self.fallback = Fallback("the views", lambda fn, *a, **k: compiled[fn](*a, **k),
                                     lambda fn, *a, **k: fn(*a, **k))
            # one compile per view (size, Table 2 row): multi-crop's 6 views pass dynamo's default limit of 8
            allow_recompiles(64)

    @property
    def failed(self):
        return self.fallback.failed if self.fallback else None

    def run(self, fn, *args, eager=False):
        return fn(*args, **self.output) if eager or self.fallback is None else self.fallback(fn, *args, **self.output)

    def finish(self, crops, rows, eager=False):
        """Per view its crops and rows, on the device or on their way -> the list of normalised views."""
        return [self.run(finish_view, c.to(self.device, non_blocking=True), r.to(self.device, non_blocking=True),
                         spec.photometric, eager=eager)
                for spec, c, r in zip(self.specs, crops, rows)]

    def preloaded(self, images, rows, eager=False):
        """A batch of preloaded images and per view their rows on the device -> the list of normalised views."""
        return [self.run(preloaded_view, images, r, spec.size, spec.photometric, eager=eager)
                for spec, r in zip(self.specs, rows)]


class PreloadRoute:
    """Batches cut from the whole dataset, decoded onto the device (`preloaded`, an Images): each epoch's order and
    every image's parameters moved there once (sce.data.assembly.Preloaded)."""
    wait_s = 0.0

    def __init__(self, images, sampler, views):
        self.preloaded, self.sampler, self.views = images, sampler, views
        self.images = images.images
        labels = images.targets.long() if images.targets is not None else torch.full(
            (len(self.images),), -1, device=self.images.device)
        self.epochs = Preloaded(self.images, sampler.batch // sampler.world, self.tables,
                                lambda index, rows: Batch(views.preloaded(self.images[index], rows), labels[index]))

    def describe(self):
        return f"preloaded on {self.views.device} ({self.images.nbytes / 2 ** 20:.0f} MiB); views there"

    def tables(self, epoch):
        """The rank's order of `epoch` and every image's rows of each view, on the host."""
        n, (height, width) = len(self.images), self.images.shape[-2:]
        everyone, heights, widths = torch.arange(n), torch.full((n,), height), torch.full((n,), width)
        return epoch_order(self.sampler, epoch), [draw(spec, self.sampler.seed, epoch, everyone, v, height=heights,
                                                       width=widths) for v, spec in enumerate(self.views.specs)]

    def __iter__(self):
        self.epochs.set_epoch(self.sampler.epoch, self.sampler.start_step * (self.sampler.batch // self.sampler.world))
        return iter(self.epochs)

    def views_of(self, indices, epoch=0):
        """The views of images `indices` in `epoch` as this route makes them, eagerly (--preview-views)."""
        images = self.images[torch.as_tensor(indices, device=self.images.device)]
        height, width = images.shape[-2:]
        rows = [draw(spec, self.sampler.seed, epoch, indices, v, height=[height] * len(indices),
                     width=[width] * len(indices))
                .to(self.images.device) for v, spec in enumerate(self.views.specs)]
        return self.views.preloaded(images, rows, eager=True)


class LoaderRoute:
    """Batches of a DataLoader over Samples, the next batch's copy to the device overlapping this step; wait_s adds
    up the time spent waiting for the loader. An unreadable image met is named once and counted against max_bad.
    Subclasses turn a loader batch into views (to_views)."""
    preloaded = None  # the images on the device (PreloadRoute's)

    def __init__(self, samples, sampler, views, workers=0, max_bad=0):
        self.samples, self.sampler, self.views, self.device = samples, sampler, views, views.device
        self.dataset, self.max_bad, self.bad_seen, self.wait_s = samples.dataset, max_bad, {}, 0.0
        self.labels = labels_of(samples.dataset, "cpu")  # indexed by a batch's indices, then copied with it
        # a private generator for the loader's per-epoch seed draw: from the global RNG it would shift
        # shuffle-BN's permutations after a mid-epoch resume (the epoch's iterator is made twice)
        self.loader = torch.utils.data.DataLoader(
            samples, batch_size=sampler.batch // sampler.world, sampler=sampler, num_workers=workers,
            pin_memory=self.device.type == "cuda", drop_last=True, worker_init_fn=init_worker,
            persistent_workers=workers > 0, collate_fn=functools.partial(collate, route=samples.route),  # picklable
            generator=torch.Generator().manual_seed(sampler.seed))

    def describe(self):
        return f"loader, {self.loader.num_workers} worker(s); {self.where}"

    def __iter__(self):
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and self.prefetch else None
        batches = iter(self.loader)
        ahead = self._fetch(batches, stream)
        while ahead is not None:
            batch = ahead
            if stream:
                copied = stream.record_event()
                ahead = self._fetch(batches, stream)  # the next batch's copy overlaps this step
                torch.cuda.current_stream(self.device).wait_event(copied)
            views, labels = self.views_from(batch), self.labels[batch[1]]
            if self.bad_seen:  # an unreadable image's place holds the next readable one: no label (the probe skips it)
                labels[torch.isin(batch[1], torch.tensor(list(self.bad_seen)))] = -1
            yield Batch(views, labels.to(self.device, non_blocking=True))
            if not stream:
                ahead = self._fetch(batches, None)

    prefetch = True  # the batch's images copied to the device ahead, on a side stream

    def _fetch(self, batches, stream):
        """The next loader batch (None at the end), its images already on their way to the device on `stream`."""
        start = time.perf_counter()
        batch = next(batches, None)
        self.wait_s += time.perf_counter() - start
        if batch is None or stream is None:
            return batch
        epoch, index, bad, reasons, images, *rows = batch
        with torch.cuda.stream(stream):
            images = [v.to(self.device, non_blocking=True) for v in images]
        current = torch.cuda.current_stream(self.device)
        for v in images:  # copied on the side stream, used on the current one
            v.record_stream(current)
        return (epoch, index, bad, reasons, images, *rows)

    def views_from(self, batch, note_bad=True, eager=False):
        """A loader batch -> the list of views on the device; note_bad: name its unreadable images and count them
        against max_bad (not for a preview)."""
        epoch, index, bad, reasons, *payload = batch
        if note_bad:
            self.note_bad(bad, reasons)
        return self.to_views(epoch, index, payload, note_bad, eager)

    def note_bad(self, bad, reasons):
        """Name each unreadable image once (it was replaced by a readable one); stop past max_bad."""
        if not bool((bad >= 0).any()):
            return
        new = {i: reason for i, reason in zip(bad.tolist(), reasons) if i >= 0 and i not in self.bad_seen}
        self.bad_seen.update(new)
        skip_unreadable(self.dataset, new, len(self.bad_seen), self.max_bad)

    def views_of(self, indices, epoch=0):
        """The views of images `indices` in `epoch` as this route makes them, eagerly (--preview-views)."""
        return self.views_from(collate([self.samples[(epoch, i)] for i in indices], self.samples.route),
                               note_bad=False, eager=True)


class CpuRoute(LoaderRoute):
    where = "views in the loader workers"

    def to_views(self, epoch, index, payload, note_bad, eager):
        out = self.views.output
        return [v.to(self.device, non_blocking=True).to(out["dtype"], memory_format=out["memory_format"])
                for v in payload[0]]


class GpuRoute(LoaderRoute):
    @property
    def where(self):
        return f"crops in the workers, views on {self.device}"

    def to_views(self, epoch, index, payload, note_bad, eager):
        crops, rows = payload
        return self.views.finish(crops, rows, eager)


class DecodeRoute(LoaderRoute):
    """The JPEGs decoded and cropped on the device (sce.data.assembly.unpack); an image no decoder reads is read
    again the workers' way, named and replaced."""
    prefetch = False  # what crosses is bytes, decoded on the device's decoder stream

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.decoder = JpegDecoder(self.device)

    @property
    def where(self):
        return f"JPEGs decoded, cropped and augmented on {self.device}"

    def to_views(self, epoch, index, payload, note_bad, eager):
        rows = payload[-1]
        sizes = [spec.size for spec in self.views.specs]

        def cut(image, v, j):  # the rows stay on the host: no sync for a window's bounds
            return ops.resized_crops(image[None], rows[v][j:j + 1], sizes[v])[0]

        def unreadable(j):  # read the workers' way, here
            crops, bad, reason = self.samples.decoded(epoch, int(index[j]))
            if note_bad:
                self.note_bad(torch.tensor([bad]), [reason])
            return crops
        return self.views.finish(unpack(payload, self.decoder, sizes, cut, unreadable), rows, eager)


WORKER_NICENESS = 5


def init_worker(worker_id):
    """A pretraining loader worker leaves stop signals to its rank (sce.preemption) and runs at a lower
    priority: where the workers fill every core, the training process, which launches the GPU's kernels
    one by one, still gets its core when it needs it."""
    ignore_stop_signals()
    os.nice(WORKER_NICENESS)
