"""Batched photometric augmentation on the training device (`--augment gpu`).

The loader workers crop, flip and draw every random parameter (sce.augment); here the photometric
ops of a whole batch run as a few large tensor ops, each sample with its own parameters, in fp32
on [0, 1]: brightness, contrast, saturation and hue in each sample's own order, grayscale,
Gaussian blur, solarize, then normalisation. Each op computes what
torchvision.transforms.v2.functional computes for one image (tests compare them op by op).
On a machine without a GPU the same code runs on CPU tensors in the training process.
"""
import time

import torch

from sce.augment import MEAN, STD, blur_kernel_size, unpack_params


def luma(x):
    """(N, 1, H, W) grayscale with torchvision's weights (ITU-R 601-2)."""
    return (0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)


def _per_sample(v):
    return v.view(-1, 1, 1, 1)


def _blend(x, other, factor):
    factor = _per_sample(factor)
    return (factor * x + (1 - factor) * other).clamp_(0, 1)


def brightness(x, factor):
    return (_per_sample(factor) * x).clamp_(0, 1)


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
        out.append(value - chroma * torch.minimum(k, 4 - k).clamp_(0, 1))
    return torch.stack(out, dim=1)


def grayscale(x):
    return luma(x).repeat(1, 3, 1, 1)  # not expand: a later op may write rows of it in place


def blur_matrix(sigma, size, kernel_size):
    """(N, size, size): row o holds the Gaussian taps of output pixel o, reflect padding folded in.
    Each sample keeps the taps within its own +-ceil(3 sigma), as its kernel on the CPU would."""
    pad = kernel_size // 2
    taps = torch.arange(-pad, pad + 1, device=sigma.device)
    kernel = torch.exp(-0.5 * (taps / sigma.view(-1, 1)) ** 2)
    kernel = kernel * (taps.abs() <= torch.ceil(3 * sigma.view(-1, 1)))
    kernel = kernel / kernel.sum(dim=1, keepdim=True)  # (N, K)
    source = (torch.arange(size, device=sigma.device).view(-1, 1) + taps).abs()  # reflect at 0 ...
    source = torch.where(source > size - 1, 2 * (size - 1) - source, source)  # ... and at size - 1
    n = len(sigma)
    matrix = torch.zeros(n, size, size, device=sigma.device, dtype=kernel.dtype)
    return matrix.scatter_add_(2, source.expand(n, size, kernel_size), kernel.view(n, 1, -1).expand(n, size, -1))


def gaussian_blur(x, sigma, kernel_size):
    """Per-sample sigma, reflect padding, separable: two batched matmuls with banded matrices
    (several times faster on a GPU than a depthwise convolution). kernel_size: that of the
    largest sigma (sce.augment.blur_kernel_size)."""
    rows = blur_matrix(sigma, x.shape[-2], kernel_size).unsqueeze(1)
    cols = blur_matrix(sigma, x.shape[-1], kernel_size).unsqueeze(1)
    return rows @ x @ cols.transpose(-1, -2)


def solarize(x):
    return torch.where(x >= 0.5, 1 - x, x)


JITTER = (brightness, contrast, saturation, hue)  # torchvision's op indices 0-3


def on_rows(x, rows, op, *row_args, **kwargs):
    """x with `op` applied to the rows selected by the CPU bool mask `rows` (no device sync)."""
    index = rows.nonzero().flatten()
    if len(index) == 0:
        return x
    if len(index) == len(x):
        return op(x, *row_args, **kwargs)
    if x.is_cuda:
        index = index.pin_memory().to(x.device, non_blocking=True)  # pinned: a truly asynchronous copy
    picked = op(x.index_select(0, index), *[a.index_select(0, index) for a in row_args], **kwargs)
    return x.index_copy_(0, index, picked.to(x.dtype))


def photometric(x, params):
    """The photometric ops of one view on a float batch in [0, 1]. params: the view's parameters
    as collated by the loader (CPU tensors: jitter (N,), order (N, 4), factors (N, 4), gray (N,),
    sigma (N,), solarize (N,)); they choose the rows of each op on the CPU."""
    on_device = {k: params[k].to(x.device, non_blocking=True) for k in ("factors", "sigma")}
    for position in range(4):
        for op_index, op in enumerate(JITTER):
            rows = params["jitter"] & (params["order"][:, position] == op_index)
            x = on_rows(x, rows, op, on_device["factors"][:, op_index])
    x = on_rows(x, params["gray"], grayscale)
    blurred = params["sigma"] > 0
    if blurred.any():  # one kernel size for the batch: that of its largest sigma, known on the CPU
        x = on_rows(x, blurred, gaussian_blur, on_device["sigma"],
                    kernel_size=blur_kernel_size(float(params["sigma"].max())))
    return on_rows(x, params["solarize"], solarize)


_STATS = {}  # device -> (1 / std, -mean / std): made once, as a host-to-device copy of a new tensor waits for the GPU


def normalize_into(x, dtype, channels_last, pixel_scale=1.0):
    """(x * pixel_scale - mean) / std as one kernel, written straight in the dtype and memory format asked for."""
    if str(x.device) not in _STATS:
        mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
        _STATS[str(x.device)] = (1 / std).to(x.device), (-mean / std).to(x.device)
    scale, shift = _STATS[str(x.device)]
    out = torch.empty(x.shape, dtype=dtype or torch.float32, device=x.device,
                      memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return torch.addcmul(shift, x, scale * pixel_scale, out=out)


def augment(crops, rows, device, dtype=None, channels_last=False):
    """A view batch ready for the model: uint8 crops (N, 3, H, W) and packed parameter rows
    (N, 12) from the loader -> the device, photometric ops, normalisation, then the dtype and
    memory format asked for."""
    params = unpack_params(rows)
    crops = crops.to(device, non_blocking=True)
    no_op = not (params["jitter"].any() or params["gray"].any() or (params["sigma"] > 0).any()
                 or params["solarize"].any())
    if no_op:  # the weak view: uint8 straight to the normalised view
        return normalize_into(crops, dtype, channels_last, pixel_scale=1 / 255)
    x = photometric(crops / 255, params)  # uint8 / float: one kernel to float32
    return normalize_into(x, dtype, channels_last)


def views_to_device(views, device, dtype=None, channels_last=False):
    """The loader's views, ready on the training device: normalised views (--augment cpu) are
    moved there; (uint8 crops, parameters) pairs (--augment gpu) are augmented there."""
    memory_format = torch.channels_last if channels_last else torch.preserve_format
    out = []
    for view in views:
        if isinstance(view, (list, tuple)):
            crops, params = view
            out.append(augment(crops, params, device, dtype, channels_last))
        else:
            out.append(view.to(device, non_blocking=True).to(dtype=dtype or view.dtype, memory_format=memory_format))
    return out


class DeviceViews:
    """A pretraining loader's batches (views, bad, reasons) with the views ready on the device.

    On CUDA the next batch's images are copied on a side stream while the current step runs (the
    copy engine works beside the compute kernels); the augmentation itself runs on the current
    stream, just before its step. `wait_s` adds up the time spent waiting for the loader.
    """

    def __init__(self, loader, device, dtype=None, channels_last=False):
        self.loader, self.device, self.dtype, self.channels_last = loader, torch.device(device), dtype, channels_last
        self.wait_s = 0.0

    def _fetch(self, batches, stream):
        """The next batch, its images already on their way to the device (None at the end)."""
        start = time.perf_counter()
        batch = next(batches, None)
        self.wait_s += time.perf_counter() - start
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
                for view in views:  # copied on the side stream, used on this one
                    (view[0] if isinstance(view, (list, tuple)) else view).record_stream(current)
            yield (views_to_device(views, self.device, self.dtype, self.channels_last), *rest)
            if not stream:
                ahead = self._fetch(batches, None)
