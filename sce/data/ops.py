"""Tensor ops on batches of images, the same on the CPU and on a GPU: the crops and resizes of every route that
crops tensors (resized_crops, window_crop, resize_center_crop, all on resize_weights), the photometric ops of Table 2
with per-image parameters, and the normalisation.

Crop and resize are two matrix products with the weights of an antialiased resize per image and axis
(a triangle filter as wide as the scale when shrinking: torch's `interpolate(mode="bilinear",
antialias=True)`; a cubic one for "bicubic"), so a batch of images with a window each is one batched
product, and a window may reach outside its image (zero padding). A crop is rounded to whole levels, as
a uint8 image would be: every tensor route gives the same pixels within a level (window_crop interpolates
the loader workers' uint8 crops in uint8).

The photometric ops each compute what torchvision.transforms.v2.functional computes for one image, in
fp32 on [0, 1], every op on every image with a per-image `where` keeping it or not: no data-dependent
shape and no host sync, so torch.compile fuses a view's chain into a few kernels."""
import math

import torch
import torch.nn.functional as F

from sce import FED_MEAN as MEAN, FED_STD as STD  # ImageNet's, for every dataset (see views.py)
BLUR_SIGMA = (0.1, 2.0)


def blur_kernel_size(sigma):
    """Taps covering +-3 sigma, whatever the image size, so the blur's effective sigma is the one drawn at
    32 px as at 224 px (the authors blur small images with PIL's radius = sigma; a kernel sized from the
    image, 3 taps at 32 px, acted like sigma 0.8 for sigma 2): 13 taps at sigma 2. At 224 px the authors
    use 23 taps; the taps beyond 3 sigma hold 0.3% of the Gaussian's mass."""
    return 2 * math.ceil(3 * sigma) + 1


BLUR_PAD = blur_kernel_size(BLUR_SIGMA[1]) // 2  # taps each side for the largest sigma
MIN_BLUR_SIZE = BLUR_PAD + 1  # reflect padding needs pad < image size


# ---------------------------------------------------------------- crop and resize

def _cubic(x, a=-0.5):
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x <= 1, near, torch.where(x < 2, far, 0.0))


def resize_weights(start, length, out, size, mode="bilinear"):
    """(N, out, size) float64: row i holds the weights of output pixel i over the `size` input pixels of an
    axis, for a resize of the window [start, start + length) to `out` pixels, per image (start, length:
    (N,)). Pixels outside the axis weigh 0; a row wholly outside is 0."""
    scale = (length / out).view(-1, 1, 1)
    support = scale.clamp(min=1.0)
    center = scale * (torch.arange(out, dtype=torch.float64, device=start.device).view(1, -1, 1) + 0.5)
    x = torch.arange(size, dtype=torch.float64, device=start.device).view(1, 1, -1) - start.view(-1, 1, 1)
    offset = (x + 0.5 - center) / support
    weights = (1 - offset.abs()).clamp(min=0) if mode == "bilinear" else _cubic(offset)
    weights = weights * ((x >= 0) & (x < length.view(-1, 1, 1)))
    total = weights.sum(dim=2, keepdim=True)
    return torch.where(total != 0, weights / torch.where(total != 0, total, 1.0), 0.0)


def resample(images, rows, cols):
    """images (N, C, H, W) float -> (N, C, out_h, out_w): rows (N, out_h, H) and cols (N, out_w, W) weights."""
    rows, cols = rows.to(images.dtype), cols.to(images.dtype)
    return torch.matmul(torch.matmul(rows.unsqueeze(1), images), cols.transpose(1, 2).unsqueeze(1))


def resized_crops(images, rows, size):
    """Each image's window, resized to size x size, flipped where asked, rounded to whole levels: images (N, C, H, W)
    in [0, 255] (uint8 or float) -> float (N, C, size, size); rows (N, >= 5): top, left, height, width, flip (> 0)
    of each window, as a view's packed rows hold them (views.PACKED). A batch is two batched products with
    resize_weights; one image whose window lies inside it, with its row on the host (a loader worker's, the decode
    route's), torch's interpolate of the window, which computes the same weights without the products' zeros (a
    large image's crop costs ~4x less) and, on a uint8 image on the CPU, in torch's uint8 kernel (fixed point: a
    level off the float result in ~15% of the pixels; ~3x faster again on a decoded JPEG, whose channels come last
    in memory)."""
    if len(images) == 1 and rows.device.type == "cpu":
        out = window_crop(images, rows[0], size)
        if out is not None:
            return out.float()
    top, left, height, width, flip = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4] > 0
    rows = resize_weights(top, height, size, images.shape[-2])
    cols = resize_weights(left, width, size, images.shape[-1])
    cols = torch.where(flip.view(-1, 1, 1), cols.flip(1), cols)
    return resample(images.float(), rows, cols).round_().clamp_(0, 255)


def box(row):
    """(top, left, height, width) ints and the flip of one packed row (sce.data.views)."""
    top, left, h, w, flip = (int(v) for v in row[:5].tolist())
    return (top, left, h, w), bool(flip)


def window_crop(images, row, size):
    """resized_crops of one image (1, C, H, W) whose window, in its row on the host, lies inside it (else None):
    torch's interpolate of the window, uint8 in and out for a uint8 image on the CPU, else float rounded."""
    (top, left, height, width), flip = box(row)
    if top < 0 or left < 0 or top + height > images.shape[-2] or left + width > images.shape[-1]:
        return None
    window = images[:, :, top:top + height, left:left + width]
    if window.dtype == torch.uint8 and window.device.type == "cpu":
        out = F.interpolate(window, size=(size, size), mode="bilinear", antialias=True)
    else:
        out = F.interpolate(window.float(), size=(size, size), mode="bilinear", antialias=True,
                            align_corners=False).round_().clamp_(0, 255)
    return out.flip(-1) if flip else out


def resize_center_crop(image, resize, crop, mode="bilinear"):
    """torchvision's Resize(resize) (the short side) then CenterCrop(crop), antialiased, on one image (C, H, W)
    in [0, 255] -> float (C, crop, crop), rounded to whole levels."""
    h, w = image.shape[-2:]
    long = int(resize * max(h, w) / min(h, w))
    rh, rw = (resize, long) if h <= w else (long, resize)
    zero = torch.zeros(1, dtype=torch.float64, device=image.device)
    rows = resize_weights(zero, zero + h, rh, h, mode)[:, int(round((rh - crop) / 2.0)):][:, :crop]
    cols = resize_weights(zero, zero + w, rw, w, mode)[:, int(round((rw - crop) / 2.0)):][:, :crop]
    return resample(image[None].float(), rows, cols)[0].round_().clamp_(0, 255)


# ---------------------------------------------------------------- photometric ops

def luma(x):
    """(N, 1, H, W) grayscale with torchvision's weights (ITU-R 601-2)."""
    return (0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)


def _per_image(v):
    return v.view(-1, 1, 1, 1)


def _blend(x, other, factor):
    factor = _per_image(factor)
    return (factor * x + (1 - factor) * other).clamp(0, 1)


def brightness(x, factor):
    return (_per_image(factor) * x).clamp(0, 1)


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
    """(N, 2 BLUR_PAD + 1) Gaussian taps of each image, normalised over its own +-ceil(3 sigma) (the taps of
    blur_kernel_size); the rest weigh 0. Sigma 0 gives [0, ..., 0, 1, 0, ..., 0]: the image unchanged."""
    taps = torch.arange(-BLUR_PAD, BLUR_PAD + 1, device=sigma.device, dtype=sigma.dtype)
    sigma = sigma.view(-1, 1)
    weights = torch.exp(-0.5 * (taps / sigma.clamp(min=1e-3)) ** 2) * (taps.abs() <= torch.ceil(3 * sigma))
    return weights / weights.sum(dim=1, keepdim=True)


def gaussian_blur(x, sigma):
    """Per-image sigma (0: no blur), reflect padding as torchvision, separable: a weighted sum of shifted
    copies along each axis (one kernel per axis when compiled)."""
    taps = blur_taps(sigma).view(len(x), 1, 1, 1, -1)
    height, width = x.shape[-2:]
    padded = F.pad(x, (BLUR_PAD, BLUR_PAD, 0, 0), mode="reflect")
    x = sum(taps[..., k] * padded[..., k:k + width] for k in range(taps.shape[-1]))
    padded = F.pad(x, (0, 0, BLUR_PAD, BLUR_PAD), mode="reflect")
    return sum(taps[..., k] * padded[..., k:k + height, :] for k in range(taps.shape[-1]))


def solarize(x):
    return torch.where(x >= 0.5, 1 - x, x)


def jitter_slot(x, op, factors):
    """Per image: brightness (op 0), contrast (1) or saturation (2) with its own factor, or nothing (-1)."""
    out = x
    for op_index, fn in enumerate((brightness, contrast, saturation)):  # torchvision's op indices
        out = torch.where(_per_image(op == op_index), fn(x, factors[:, op_index]), out)
    return out


def color_jitter(x, jitter, order, factors):
    """ColorJitter where `jitter`, each image's four ops in its own `order` (hue: op 3). Hue, the costly op,
    runs once for the batch: each image's other three ops go to the three slots before it or the three
    after it, keeping their order."""
    hue_at = (order == 3).int().argmax(dim=1)  # hue's position in each image's order
    for slot in range(6):
        j = slot % 3  # the image's j-th op other than hue: at position j, or j + 1 once past hue
        op = order.gather(1, (j + (hue_at <= j)).view(-1, 1)).view(-1)
        in_slot = jitter & ((j < hue_at) if slot < 3 else (j >= hue_at))
        x = jitter_slot(x, torch.where(in_slot, op, -1), factors)
        if slot == 2:
            x = torch.where(_per_image(jitter), hue(x, factors[:, 3]), x)
    return x


def photometric(x, jitter, order, factors, gray, sigma, solarized):
    """The photometric ops of a view on a float batch in [0, 1], in torchvision's order, with per-image
    parameters (views.Photometric's fields, on x's device)."""
    x = color_jitter(x, jitter, order, factors)
    x = torch.where(_per_image(gray), grayscale(x), x)
    x = gaussian_blur(x, sigma)
    return torch.where(_per_image(solarized), solarize(x), x)


def normalization(device):
    """(1 / std, -mean / std) as (1, 3, 1, 1) tensors on `device`: normalising is x * scale + shift. Made
    once by each user (a host-to-device copy of a new tensor waits for the GPU)."""
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return (1 / std).to(device), (-mean / std).to(device)


def normalize(x, scale, shift, dtype=torch.float32, memory_format=torch.contiguous_format):
    """(x - mean) / std as x * scale + shift, in the dtype and memory format asked for; x in [0, 1]."""
    return torch.addcmul(shift, x, scale).to(dtype=dtype, memory_format=memory_format)
