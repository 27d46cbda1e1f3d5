"""Pretraining batches: each step's views on the training device, by one of four routes chosen once at start
(`choose_route`, from --augment, --decode and --preload):

    cpu      loader workers decode (PIL), crop, resize, flip and apply the photometric ops: normalised views
    gpu      workers decode into a tensor and crop (ops.resized_crops): uint8 crops; the device applies the rest
    decode   workers read a JPEG's bytes and header only; the device decodes (sce.data.jpeg), crops and the rest
             (other files, PNG or progressive JPEG, are cropped by the workers as on the gpu route)
    preload  the images were decoded once onto the device (sce.data.preloading): everything happens there

Every route yields the same batch to the step: the list of views, each (N, 3, size, size) normalised in the
run's dtype and memory format on the device. Every route draws a view's parameters with sce.data.views.draw
from (seed, epoch, index, view), so the routes give the same crops, flips and photometric parameters, and
the tensor routes the same pixels (the PIL resize of --augment cpu differs from the tensor one by a level or
two). An unreadable image is replaced by the next readable one, named once, and counted against max_bad."""
import functools
import os
import time
import warnings

import torch

from sce import UserError
from sce.data import ops
from sce.data.files import Encoded, decode_rgb_tensor, image_path, skip_unreadable
from sce.data.jpeg import JpegDecoder
from sce.data.preloading import preload, wanted
from sce.data.views import Photometric, draw, pil_view
from sce.preemption import ignore_stop_signals

READ = {"cpu": "pil", "gpu": "tensor", "decode": "encoded"}  # how each loader route's workers read the files


def choose_route(augment, decode, preload_mode, device):
    """(the loader route: cpu, gpu or decode; whether to preload first), from --augment, --decode (resolved) and
    --preload. Preloading needs --augment gpu; a dataset that cannot be preloaded takes the loader route."""
    loader = "cpu" if augment == "cpu" else "decode" if decode == "device" else "gpu"
    return loader, augment != "cpu" and wanted(preload_mode, device)


# ---------------------------------------------------------------- the workers' side

class Samples(torch.utils.data.Dataset):
    """What a loader worker makes of key (epoch, index): (index, payload, bad index or -1, reason), the payload
    by route: cpu, the normalised views; gpu, (per view a uint8 crop, per view its parameter row, None); decode,
    for a plain JPEG (None, its rows, its bytes), for another file (PNG, progressive JPEG) the gpu route's. An
    unreadable image is replaced by the next readable one, which gets the views of the index asked for."""

    def __init__(self, dataset, specs, seed, route):
        self.dataset, self.specs, self.seed, self.route = dataset, specs, seed, route

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        img, bad, reason = self.read(index)
        return key, self.payload(img, epoch, index), bad, reason

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
        return [draw(spec, self.seed, epoch, [index], v, [height], [width])[0] for v, spec in enumerate(self.specs)]

    def payload(self, img, epoch, index):
        if self.route == "cpu":
            rows = self.rows(epoch, index, img.height, img.width)
            return [pil_view(img, spec, row) for spec, row in zip(self.specs, rows)]
        if isinstance(img, Encoded):  # decode route, a plain JPEG: the device decodes and crops it
            return None, self.rows(epoch, index, *img.size), img.data
        rows = self.rows(epoch, index, *img.shape[-2:])
        return [crop(img, spec.size, row) for spec, row in zip(self.specs, rows)], rows, None

    def decoded(self, epoch, index):
        """The crops of `index` decoded here, whatever the dataset's reader (an image the device's decoder could
        not read), with its unreadable index and reason."""
        img, bad, reason = self.read(index, decode=True)
        rows = self.rows(epoch, index, *img.shape[-2:])
        return [crop(img, spec.size, row) for spec, row in zip(self.specs, rows)], bad, reason


def crop(image, size, row):
    """One view's crop of one uint8 image (3, H, W) with its packed row (ops.resized_crops) -> uint8."""
    return ops.resized_crops(image[None], row[None], size)[0].to(torch.uint8)


def collate(samples, route):
    """A loader batch of route `route`: (epoch, indices, bad (N,), reasons, then by route: the views (cpu); per
    view the crops and rows (gpu); the JPEGs' bytes, lengths and places, per view the other images' crops and
    places, per view the rows (decode))."""
    head = (samples[0][0][0], torch.tensor([s[0][1] for s in samples]), torch.tensor([s[2] for s in samples]),
            [s[3] for s in samples])
    payloads = [s[1] for s in samples]
    if route == "cpu":
        return head + ([torch.stack(v) for v in zip(*payloads)],)
    views = range(len(payloads[0][1]))
    rows = [torch.stack([p[1][v] for p in payloads]) for v in views]
    if route == "gpu":
        return head + ([torch.stack([p[0][v] for p in payloads]) for v in views], rows)
    encoded = [i for i, p in enumerate(payloads) if p[2] is not None]
    cropped = [i for i, p in enumerate(payloads) if p[2] is None]
    jpegs = [payloads[i][2] for i in encoded]
    crops = [torch.stack([payloads[i][0][v] for i in cropped]) if cropped else None for v in views]
    return head + (torch.cat(jpegs) if jpegs else torch.empty(0, dtype=torch.uint8), [len(d) for d in jpegs],
                   torch.tensor(encoded, dtype=torch.long), crops, torch.tensor(cropped, dtype=torch.long), rows)


# ---------------------------------------------------------------- the device's side

def finish_view(crops, rows, photometric, scale, shift, dtype, memory_format):
    """Crops (N, 3, s, s) in [0, 255] and their packed rows on the device -> the normalised view (the photometric
    ops where the view has any)."""
    x = crops.float() / 255
    if photometric:
        x = ops.photometric(x, *Photometric.of(rows).as_args())
    return ops.normalize(x, scale, shift, dtype, memory_format)


def preloaded_view(images, rows, size, photometric, scale, shift, dtype, memory_format):
    """One view of a batch of preloaded uint8 images (N, 3, H, W) with its packed rows -> the normalised view."""
    crops = ops.resized_crops(images, rows, size)
    return finish_view(crops, rows, photometric, scale, shift, dtype, memory_format)


class Compiled:
    """fn(*args), torch.compile'd per function when `enabled` (static shapes: one compile per view size); a
    failed compile warns once and runs everything eagerly from then on. compiles: a sce.compiling.Log."""

    def __init__(self, enabled, compiles=None):
        self.enabled, self.compiles, self.fns, self.failed = enabled, compiles, {}, None

    def __call__(self, fn, *args):
        if not self.enabled or self.failed:
            return fn(*args)
        if fn not in self.fns:
            compiled = torch.compile(fn, dynamic=False, fullgraph=True)
            self.fns[fn] = self.compiles.timed(fn.__name__, compiled) if self.compiles else compiled
            # one compile per view (size, Table 2 row): multi-crop's 6 views pass dynamo's default limit of 8
            config = torch._dynamo.config
            limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, limit, max(getattr(config, limit), 64))
        try:
            return self.fns[fn](*args)
        except Exception as e:  # noqa: BLE001: whatever stopped the compiled call ...
            out = fn(*args)  # ... unless eager ops fail too (out of memory, say): then that error is the real one
            self.failed = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            warnings.warn(f"torch.compile of the views failed ({self.failed}); running them eagerly, several "
                          "times slower")
            return out


class PretrainBatches:
    """Iterating yields this rank's batches of the sampler's epoch: each a list of views on `device` (module
    docstring). route: cpu, gpu or decode (the dataset read with READ[route]); try_preload: decode the dataset
    onto the device first (required: or stop), falling back to the loader route where it cannot be.
    wait_s adds up the time spent waiting for the loader. specs: the views' sce.data.views.ViewSpec."""

    def __init__(self, dataset, specs, sampler, seed, device, route, try_preload=False, required=False, workers=0,
                 dtype=None, channels_last=False, compile=False, max_bad=0, budget=None, compiles=None):
        self.dataset, self.specs, self.sampler, self.seed, self.device = dataset, specs, sampler, seed, device
        self.dtype = dtype or torch.float32
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.max_bad, self.bad_seen, self.wait_s = max_bad, {}, 0.0
        self.compiled = Compiled(compile, compiles)
        self.scale, self.shift = ops.normalization(device)
        self.samples = Samples(dataset, specs, seed, route)
        self.images = preload(dataset, budget, required, workers, max_bad) if try_preload else None
        self.route = "preload" if self.images is not None else route
        self.loader = None
        if self.route != "preload":
            # a private generator for the loader's per-epoch seed draw: from the global RNG it would shift
            # shuffle-BN's permutations after a mid-epoch resume (the epoch's iterator is made twice)
            self.loader = torch.utils.data.DataLoader(
                self.samples, batch_size=sampler.batch // sampler.world, sampler=sampler, num_workers=workers,
                pin_memory=device.type == "cuda", drop_last=True, worker_init_fn=init_worker,
                persistent_workers=workers > 0, collate_fn=functools.partial(collate, route=route),  # picklable
                generator=torch.Generator().manual_seed(seed))
        self.decoder = JpegDecoder(device) if self.route == "decode" else None

    def describe(self):
        """Where the images come from and where the views are made, for the run's start line."""
        if self.route == "preload":
            return f"preloaded on {self.device} ({self.images.images.nbytes / 2 ** 20:.0f} MiB); views there"
        where = {"cpu": "views in the loader workers", "gpu": f"crops in the workers, views on {self.device}",
                 "decode": f"JPEGs decoded, cropped and augmented on {self.device}"}[self.route]
        return f"loader, {self.loader.num_workers} worker(s); {where}"

    def __iter__(self):
        if self.route == "preload":
            yield from self._preloaded()
            return
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and self.route != "decode" else None
        batches = iter(self.loader)
        ahead = self._fetch(batches, stream)
        while ahead is not None:
            batch = ahead
            if stream:
                copied = stream.record_event()
                ahead = self._fetch(batches, stream)  # the next batch's copy overlaps this step
                torch.cuda.current_stream(self.device).wait_event(copied)
            yield self.views(batch)
            if not stream:
                ahead = self._fetch(batches, None)

    def _fetch(self, batches, stream):
        """The next loader batch (None at the end), its images already on their way to the device on `stream`."""
        start = time.perf_counter()
        batch = next(batches, None)
        self.wait_s += time.perf_counter() - start
        if batch is None or stream is None:
            return batch
        epoch, index, bad, reasons, views, *rows = batch
        with torch.cuda.stream(stream):
            views = [v.to(self.device, non_blocking=True) for v in views]
        current = torch.cuda.current_stream(self.device)
        for v in views:  # copied on the side stream, used on the current one
            v.record_stream(current)
        return (epoch, index, bad, reasons, views, *rows)

    def views(self, batch, note_bad=True):
        """A loader batch of this route (collate) -> the list of views on the device; note_bad: name its unreadable
        images and count them against max_bad (not for a preview)."""
        epoch, index, bad, reasons, *rest = batch
        if note_bad:
            self.note_bad(bad, reasons)
        if self.route == "cpu":
            return [v.to(self.device, non_blocking=True).to(self.dtype, memory_format=self.memory_format)
                    for v in rest[0]]
        if self.route == "gpu":
            crops, rows = rest
        else:
            crops, rows = self._decode(epoch, index, *rest, note_bad)
        settings = (self.scale, self.shift, self.dtype, self.memory_format)
        return [self.compiled(finish_view, c.to(self.device, non_blocking=True), r.to(self.device, non_blocking=True),
                              spec.photometric, *settings) for spec, c, r in zip(self.specs, crops, rows)]

    def _decode(self, epoch, index, jpegs, lengths, encoded, crops, cropped, rows, note_bad=True):
        """The decode route's crops on the device: the JPEGs decoded and cropped there, the other images' crops
        placed beside them; an image no decoder reads is read again the workers' way, named and replaced."""
        images = self.decoder(list(jpegs.split(lengths))) if lengths else []
        out = [torch.empty((len(index), 3, spec.size, spec.size), device=self.device) for spec in self.specs]
        cropped = cropped.to(self.device, non_blocking=True)  # once, not once a view
        for v in range(len(self.specs)):
            if crops[v] is not None:
                out[v][cropped] = crops[v].to(self.device, non_blocking=True).float()
        for j, image in zip(encoded.tolist(), images):
            if image is None:  # read the workers' way, here
                views, bad, reason = self.samples.decoded(epoch, int(index[j]))
                if note_bad:
                    self.note_bad(torch.tensor([bad]), [reason])
                for v in range(len(self.specs)):
                    out[v][j] = views[v].to(self.device).float()
                continue
            for v, spec in enumerate(self.specs):  # the rows stay on the host: no sync for a window's bounds
                out[v][j] = ops.resized_crops(image[None], rows[v][j:j + 1], spec.size)[0]
        return out, rows

    def _preloaded(self):
        images = self.images.images
        order = self.sampler.indices()
        height, width = images.shape[-2:]
        everyone = torch.arange(len(images))
        # every image's parameters of the epoch, drawn on the host, moved once; a step indexes them
        tables = [draw(spec, self.seed, self.sampler.epoch, everyone, v, torch.full((len(images),), height),
                       torch.full((len(images),), width)).to(self.device) for v, spec in enumerate(self.specs)]
        settings = (self.scale, self.shift, self.dtype, self.memory_format)
        per_rank = self.sampler.batch // self.sampler.world
        for index in order.to(self.device).view(-1, per_rank):
            batch = images[index]
            yield [self.compiled(preloaded_view, batch, table[index], spec.size, spec.photometric, *settings)
                   for spec, table in zip(self.specs, tables)]

    def note_bad(self, bad, reasons):
        """Name each unreadable image once (it was replaced by a readable one); stop past max_bad."""
        if not bool((bad >= 0).any()):
            return
        new = {i: reason for i, reason in zip(bad.tolist(), reasons) if i >= 0 and i not in self.bad_seen}
        self.bad_seen.update(new)
        skip_unreadable(self.dataset, new, len(self.bad_seen), self.max_bad)

    def views_of(self, indices, epoch=0):
        """The views of images `indices` in `epoch` as this route makes them, eagerly (--preview-views)."""
        if self.route == "preload":
            images = self.images.images[torch.as_tensor(indices, device=self.device)]
            height, width = images.shape[-2:]
            settings = (self.scale, self.shift, self.dtype, self.memory_format)
            return [preloaded_view(images, draw(spec, self.seed, epoch, indices, v, [height] * len(indices),
                                                [width] * len(indices)).to(self.device), spec.size,
                                   spec.photometric, *settings) for v, spec in enumerate(self.specs)]
        compiled, self.compiled = self.compiled, Compiled(False)
        try:
            return self.views(collate([self.samples[(epoch, i)] for i in indices], self.samples.route), note_bad=False)
        finally:
            self.compiled = compiled


WORKER_NICENESS = 5


def init_worker(worker_id):
    """A pretraining loader worker leaves stop signals to its rank (sce.preemption) and runs at a lower
    priority: where the workers fill every core, the training process, which launches the GPU's kernels
    one by one, still gets its core when it needs it."""
    ignore_stop_signals()
    os.nice(WORKER_NICENESS)
