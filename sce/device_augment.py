"""Batched photometric augmentation on the training device (`--augment gpu`).

The loader workers crop, flip and draw every random parameter (sce.augment); here the photometric
ops of a whole batch run as whole-batch tensor ops, each sample with its own parameters, in fp32
on [0, 1]: brightness, contrast, saturation and hue in each sample's own order, grayscale,
Gaussian blur, solarize, then normalisation. Each op computes what
torchvision.transforms.v2.functional computes for one image (tests compare them op by op).

Every op runs on every sample and a per-sample `where` keeps its result or not: no data-dependent
shapes and no host sync, so on CUDA torch.compile fuses the chain into ~15 kernels (1.85 ms for
256 images at 224 px on an H200, against ~20 ms eager). Hue, the costly op, runs once per batch
(color_jitter). The ops are compiled with the model (--compile, on by default on CUDA) and run
eagerly otherwise: on a machine without a GPU, on CPU tensors in the training process.
"""
import time
import warnings

import torch
import torch.nn.functional as F

from sce import compiling, device_decode
from sce.augment import BLUR_SIGMA, any_photometric, blur_kernel_size, normalize_stats, unpack_params

BLUR_PAD = blur_kernel_size(BLUR_SIGMA[1]) // 2  # taps each side for the largest sigma


def luma(x):
    """(N, 1, H, W) grayscale with torchvision's weights (ITU-R 601-2)."""
    return (0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)


def _per_sample(v):
    return v.view(-1, 1, 1, 1)


def _blend(x, other, factor):
    factor = _per_sample(factor)
    return (factor * x + (1 - factor) * other).clamp(0, 1)


def brightness(x, factor):
    return (_per_sample(factor) * x).clamp(0, 1)


def contrast(x, factor):
    return _blend(x, luma(x).mean(dim=(1, 2, 3), keepdim=True), factor)


def saturation(x, factor):
    return _blend(x, luma(x), factor)


def hue(x, shift):
    """Rotate the HSV hue by `shift` (a fraction of the circle), keeping saturation and value."""
    value, largest = x.max(dim=1)
    chroma = value - x.amin(dim=1)
    r, g, b = x.unbind(1)
    # hue in sixths of the circle: sector 0, 2 or 4 of the largest channel, plus the offset within it
    offset = torch.where(largest == 0, g - b, torch.where(largest == 1, b - r, r - g))
    h6 = offset / torch.where(chroma > 0, chroma, 1.0) + 2 * largest
    h6 = torch.remainder(h6 + 6 * shift.view(-1, 1, 1), 6)
    # back to RGB: channel n (R 5, G 3, B 1) is value - chroma * clamp(min(k, 4 - k), 0, 1), k = (n + h6) mod 6
    out = []
    for n in (5, 3, 1):
        k = torch.remainder(h6 + n, 6)
        out.append(value - chroma * torch.minimum(k, 4 - k).clamp(0, 1))
    return torch.stack(out, dim=1)


def grayscale(x):
    return luma(x).expand_as(x)


def blur_taps(sigma):
    """(N, 2 BLUR_PAD + 1) Gaussian taps of each sample, normalised over its own +-ceil(3 sigma), the
    taps of its kernel on the CPU (sce.augment.blur_kernel_size); the rest weigh 0. Sigma 0 gives
    [0, ..., 0, 1, 0, ..., 0]: the image unchanged, exactly."""
    taps = torch.arange(-BLUR_PAD, BLUR_PAD + 1, device=sigma.device, dtype=sigma.dtype)
    sigma = sigma.view(-1, 1)
    weights = torch.exp(-0.5 * (taps / sigma.clamp(min=1e-3)) ** 2) * (taps.abs() <= torch.ceil(3 * sigma))
    return weights / weights.sum(dim=1, keepdim=True)


def gaussian_blur(x, sigma):
    """Per-sample sigma (0: no blur), reflect padding as torchvision, separable: a weighted sum of
    shifted copies along each axis (fused into one kernel per axis when compiled)."""
    taps = blur_taps(sigma).view(len(x), 1, 1, 1, -1)
    height, width = x.shape[-2:]
    padded = F.pad(x, (BLUR_PAD, BLUR_PAD, 0, 0), mode="reflect")
    x = sum(taps[..., k] * padded[..., k:k + width] for k in range(taps.shape[-1]))
    padded = F.pad(x, (0, 0, BLUR_PAD, BLUR_PAD), mode="reflect")
    return sum(taps[..., k] * padded[..., k:k + height, :] for k in range(taps.shape[-1]))


def solarize(x):
    return torch.where(x >= 0.5, 1 - x, x)


def jitter_slot(x, op, factors):
    """Per sample: brightness (op 0), contrast (1) or saturation (2) with its own factor, or nothing (-1)."""
    out = x
    for op_index, fn in enumerate((brightness, contrast, saturation)):  # torchvision's op indices
        out = torch.where(_per_sample(op == op_index), fn(x, factors[:, op_index]), out)
    return out


def color_jitter(x, jitter, order, factors):
    """ColorJitter where `jitter`, each sample's four ops in its own `order` (hue: op 3). Hue, the
    costly op, runs once for the batch: each sample's other three ops go to the three slots
    before it or the three after it, keeping their order."""
    hue_at = (order == 3).int().argmax(dim=1)  # hue's position in each sample's order
    for slot in range(6):
        j = slot % 3  # the sample's j-th op other than hue: at position j, or j + 1 once past hue
        op = order.gather(1, (j + (hue_at <= j)).view(-1, 1)).view(-1)
        in_slot = jitter & ((j < hue_at) if slot < 3 else (j >= hue_at))
        x = jitter_slot(x, torch.where(in_slot, op, -1), factors)
        if slot == 2:
            x = torch.where(_per_sample(jitter), hue(x, factors[:, 3]), x)
    return x


def photometric(x, params):
    """The photometric ops of one view on a float batch in [0, 1]. params: the view's parameters by
    name (sce.augment.unpack_params), on x's device: jitter (N,), order (N, 4), factors (N, 4),
    gray (N,), sigma (N,), solarize (N,)."""
    x = color_jitter(x, params["jitter"], params["order"], params["factors"])
    x = torch.where(_per_sample(params["gray"]), grayscale(x), x)
    x = gaussian_blur(x, params["sigma"])
    return torch.where(_per_sample(params["solarize"]), solarize(x), x)


def normalize(x, scale, shift, dtype, memory_format):
    """(x - mean) / std as x * scale + shift, in the dtype and memory format asked for."""
    return torch.addcmul(shift, x, scale).to(dtype=dtype, memory_format=memory_format)


def crop_batch(crops, scale, shift, dtype, memory_format):
    """uint8 crops of a view without photometric ops (weak), on the device -> the normalised view."""
    return normalize(crops / 255, scale, shift, dtype, memory_format)


def augment_batch(crops, rows, scale, shift, dtype, memory_format):
    """uint8 crops and packed parameter rows, both on the device -> the normalised view."""
    return normalize(photometric(crops / 255, unpack_params(rows)), scale, shift, dtype, memory_format)


COMPILED = {}  # function name -> its compiled version
compile_failed = False


def run_compiled(fn, *args, compile=True):
    """fn(*args), compiled if `compile` (static shapes: one compile per view size). If compiling
    fails (no Triton or no C compiler, say), a warning and eager ops from then on."""
    global compile_failed
    if not compile or compile_failed:
        return fn(*args)
    if fn.__name__ not in COMPILED:
        COMPILED[fn.__name__] = compiling.timed(fn.__name__, torch.compile(fn, dynamic=False, fullgraph=True))
        # one compile per view (size, Table 2 row): multi-crop's 6 views and their dtypes pass dynamo's default of 8
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), 64))
    try:
        return COMPILED[fn.__name__](*args)
    except Exception as e:  # noqa: BLE001: whatever stopped the compiled call ...
        out = fn(*args)  # ... unless eager ops fail too (out of memory, say): then that error is the real one
        compile_failed = True
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        warnings.warn(f"--augment gpu: torch.compile of the augmentation failed ({reason}); running it eagerly, "
                      "several times slower")
        return out


def augment(crops, rows, device, dtype=None, channels_last=False, compile=False):
    """A view batch ready for the model: crops (N, 3, H, W) in [0, 255] (uint8, or float from
    sce.device_decode) and packed parameter rows
    (N, 12) from the loader -> the device, photometric ops, normalisation, then the dtype and
    memory format asked for. compile: run the ops compiled (--compile; never behind the user's back)."""
    crops = crops.to(device, non_blocking=True)
    scale, shift = normalize_stats(crops.device)
    settings = (dtype or torch.float32, torch.channels_last if channels_last else torch.contiguous_format)
    if not any_photometric(rows):  # the weak view (rows are on the CPU: no sync)
        return run_compiled(crop_batch, crops, scale, shift, *settings, compile=compile)
    rows = rows.to(device, non_blocking=True)
    return run_compiled(augment_batch, crops, rows, scale, shift, *settings, compile=compile)


def views_to_device(views, device, dtype=None, channels_last=False, compile=False, refetch=None):
    """The loader's views, ready on the training device: normalised views (--augment cpu) are
    moved there; (uint8 crops, parameters) pairs (--augment gpu) are augmented there (compile: see
    augment); a batch of encoded JPEGs (--decode device, a dict) is decoded, cropped and augmented there
    (refetch: sce.device_decode.pretrain_views)."""
    if isinstance(views, dict):
        crops, params = device_decode.pretrain_views(views, torch.device(device), refetch)
        return [augment(x, p, device, dtype, channels_last, compile) for x, p in zip(crops, params)]
    memory_format = torch.channels_last if channels_last else torch.preserve_format
    out = []
    for view in views:
        if isinstance(view, (list, tuple)):
            crops, params = view
            out.append(augment(crops, params, device, dtype, channels_last, compile))
        else:
            out.append(view.to(device, non_blocking=True).to(dtype=dtype or view.dtype, memory_format=memory_format))
    return out


class DeviceViews:
    """A pretraining loader's batches (views, bad, reasons) with the views ready on the device.

    On CUDA the next batch's images are copied on a side stream while the current step runs (the
    copy engine works beside the compute kernels); the augmentation itself runs on the current
    stream, just before its step. `wait_s` adds up the time spent waiting for the loader.
    """

    def __init__(self, loader, device, dtype=None, channels_last=False, compile=False):
        self.loader, self.device, self.dtype, self.channels_last = loader, torch.device(device), dtype, channels_last
        self.compile = compile  # the augmentation's ops compiled (--compile)
        self.wait_s = 0.0
        # an image no decoder reads (--decode device) is read again the workers' way: named and replaced
        self.refetch = getattr(getattr(loader, "dataset", None), "decoded", None)

    def _fetch(self, batches, stream):
        """The next batch, its images already on their way to the device (None at the end)."""
        start = time.perf_counter()
        batch = next(batches, None)
        self.wait_s += time.perf_counter() - start
        if isinstance(batch, dict):  # encoded JPEGs: decoded on the current stream, in views_to_device
            return batch, batch["bad"], batch["reasons"]
        if batch is None or stream is None:
            return batch
        views, *rest = batch
        with torch.cuda.stream(stream):
            views = [(v[0].to(self.device, non_blocking=True), v[1]) if isinstance(v, (list, tuple))
                     else v.to(self.device, non_blocking=True) for v in views]
        return (views, *rest)

    def __iter__(self):
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        batches = iter(self.loader)
        ahead = self._fetch(batches, stream)
        while ahead is not None:
            views, *rest = ahead
            if stream:
                copied = stream.record_event()
                ahead = self._fetch(batches, stream)  # the next batch's copy overlaps this step
                current = torch.cuda.current_stream(self.device)
                current.wait_event(copied)
                for view in views if not isinstance(views, dict) else []:  # copied on the side stream, used here
                    (view[0] if isinstance(view, (list, tuple)) else view).record_stream(current)
            yield (views_to_device(views, self.device, self.dtype, self.channels_last, self.compile, self.refetch),
                   *rest)
            if not stream:
                ahead = self._fetch(batches, None)
