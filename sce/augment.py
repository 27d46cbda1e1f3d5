"""The augmentations of paper Table 2: one table, one way to draw a view's random parameters, and
the loader-side half of each view.

Every view is a random resized crop + horizontal flip followed by photometric ops (colour jitter,
grayscale, Gaussian blur, solarize). The loader worker always crops, flips and draws all the
random parameters, from torch's RNG in the order torchvision's transforms draw them, so a seed
gives the same views whichever pipeline applies the photometric ops:
- `--augment cpu`: the worker applies them too (torchvision on the PIL image) and returns a
  normalised float tensor, exactly what torchvision's Compose of the same transforms returns;
- `--augment gpu`: the worker returns the uint8 crop and the parameters, and
  `sce.device_augment` applies the ops batched on the training device.
"""
import math

import torch
import torchvision.transforms as T
import torchvision.transforms.functional as F
import torchvision.transforms.v2.functional as TF

from sce import UserError

# ImageNet statistics for every dataset (the paper does not give per-dataset ones); keeping one
# normalisation lets any checkpoint be evaluated or transferred without knowing its data
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

# Table 2: p(color jitter), jitter (brightness, contrast, saturation, hue), p(gray), p(blur), p(solarize)
AUGMENTATIONS = {
    "weak":         (0.0, None, 0.0, 0.0, 0.0),
    "strong":       (0.8, (0.4, 0.4, 0.4, 0.1), 0.2, 0.5, 0.0),
    "strong-alpha": (0.8, (0.4, 0.4, 0.2, 0.1), 0.2, 1.0, 0.0),
    "strong-beta":  (0.8, (0.4, 0.4, 0.2, 0.1), 0.2, 0.1, 0.2),
    "strong-gamma": (0.8, (0.4, 0.4, 0.2, 0.1), 0.2, 0.5, 0.2),
}
BLUR_SIGMA = (0.1, 2.0)
RRC_RATIO = (3 / 4, 4 / 3)  # aspect ratios of RandomResizedCrop (torchvision's default)
SOLARIZE_THRESHOLD = 128  # on uint8 images; 0.5 on [0, 1] floats picks the same pixels


def blur_kernel_size(sigma):
    """Taps covering +-3 sigma, whatever the image size, so the blur's effective sigma is the one
    drawn at 32 px as at 224 px (the authors blur small images with PIL's radius = sigma; a kernel
    sized from the image, 3 taps at 32 px, acted like sigma 0.8 for sigma 2). One rule for both
    pipelines: 13 taps at sigma 2. At 224 px the authors use 23 taps; the taps beyond 3 sigma hold
    0.3% of the Gaussian's mass, so the blur there is the same up to rounding."""
    return 2 * math.ceil(3 * sigma) + 1


MIN_BLUR_SIZE = blur_kernel_size(BLUR_SIGMA[1]) // 2 + 1  # reflect padding needs pad < image size


def jitter_ranges(jitter):
    """torchvision's ColorJitter ranges: factors in [max(0, 1 - s), 1 + s], hue shift in [-h, h]."""
    b, c, s, h = jitter
    return [(max(0.0, 1 - v), 1 + v) for v in (b, c, s)] + [(-h, h)]


def draw_photometric(aug):
    """The random parameters of the photometric ops of row `aug`, drawn from torch's global RNG as
    RandomApply(ColorJitter), RandomGrayscale, RandomApply(GaussianBlur), RandomSolarize draw them.

    Returns {"jitter": applied, "order": the 4 op indices in the order they apply, "factors":
    brightness, contrast, saturation, hue shift, "gray", "sigma" (0: no blur), "solarize"}.
    """
    p_jitter, jitter, p_gray, p_blur, p_solarize = AUGMENTATIONS[aug]
    params = dict(jitter=False, order=[0, 1, 2, 3], factors=[1.0, 1.0, 1.0, 0.0], gray=False, sigma=0.0,
                  solarize=False)
    if p_jitter and not p_jitter < torch.rand(1):  # RandomApply: skipped when p < u
        params["jitter"] = True
        params["order"] = torch.randperm(4).tolist()
        params["factors"] = [float(torch.empty(1).uniform_(lo, hi)) for lo, hi in jitter_ranges(jitter)]
    if p_gray:
        params["gray"] = bool(torch.rand(1) < p_gray)
    if p_blur and not p_blur < torch.rand(1):
        params["sigma"] = float(torch.empty(1).uniform_(*BLUR_SIGMA))
    if p_solarize:
        params["solarize"] = bool(torch.rand(1) < p_solarize)
    return params


def pack_params(params):
    """One view's parameters as one float row (one tensor per view crosses the loader):
    jitter, order (4), factors (4), gray, sigma, solarize."""
    return torch.tensor([params["jitter"], *params["order"], *params["factors"], params["gray"], params["sigma"],
                         params["solarize"]], dtype=torch.float32)


_STATS = {}  # device -> (1 / std, -mean / std): made once, as a host-to-device copy of a new tensor waits for the GPU


def normalize_stats(device):
    """(1 / std, -mean / std) as (1, 3, 1, 1) tensors on `device`: normalising is x * scale + shift."""
    if str(device) not in _STATS:
        mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
        _STATS[str(device)] = (1 / std).to(device), (-mean / std).to(device)
    return _STATS[str(device)]


def any_photometric(rows):
    """Whether any of the packed rows applies a photometric op (jitter, gray, blur or solarize)."""
    return bool(rows[:, [0, 9, 10, 11]].any())


def unpack_params(rows):
    """(N, 12) packed rows -> the batch's parameters by name, as sce.device_augment reads them."""
    return dict(jitter=rows[:, 0] > 0, order=rows[:, 1:5].long(), factors=rows[:, 5:9], gray=rows[:, 9] > 0,
                sigma=rows[:, 10], solarize=rows[:, 11] > 0)


def apply_photometric_pil(img, params):
    """The photometric ops on a PIL image with torchvision, in torchvision's order."""
    if params["jitter"]:
        b, c, s, h = params["factors"]
        ops = (lambda x: F.adjust_brightness(x, b), lambda x: F.adjust_contrast(x, c),
               lambda x: F.adjust_saturation(x, s), lambda x: F.adjust_hue(x, h))
        for i in params["order"]:
            img = ops[i](img)
    if params["gray"]:
        img = F.rgb_to_grayscale(img, num_output_channels=3)
    if params["sigma"]:
        size = blur_kernel_size(params["sigma"])
        img = F.gaussian_blur(img, [size, size], [params["sigma"], params["sigma"]])
    if params["solarize"]:
        img = F.solarize(img, SOLARIZE_THRESHOLD)
    return img


class Encoded:
    """A JPEG file's bytes (uint8 tensor) and its (height, width) from the header: decoded later, on the
    training device (sce.device_decode)."""

    def __init__(self, data, size):
        self.data, self.size = data, size


class EncodedSample:
    """The views of an Encoded image: its bytes, and per view a geometry row (crop_geometry) and the
    packed photometric row; key: the sample's (epoch, index)."""

    def __init__(self, data, geometry, params, key=None):
        self.data, self.geometry, self.params, self.key = data, geometry, params, key


def stand_in(img):
    """A tensor of an Encoded image's size that allocates nothing, for torchvision's get_params."""
    return torch.zeros(()).expand(3, *img.size)


def crop_geometry(top, left, height, width, size, flip):
    """A view's geometry as sce.device_decode applies it: the window (top, left, height, width)
    resized to (size, size), all of it kept (window 0, 0), flipped or not."""
    return torch.tensor([top, left, height, width, size, size, 0, 0, float(flip)])


class View:
    """One view: random resized crop + flip, then the photometric ops of row `aug` of Table 2.

    on_device=False: returns the normalised float tensor (3, size, size).
    on_device=True: returns (uint8 crop (3, size, size), packed parameters) for sce.device_augment.
    """

    def __init__(self, aug, size, scale=(0.2, 1.0), on_device=False):
        if aug not in AUGMENTATIONS:
            raise UserError(f"unknown augmentation '{aug}': use one of {', '.join(AUGMENTATIONS)}")
        self.aug, self.size, self.scale, self.on_device = aug, size, tuple(scale), on_device

    def __call__(self, img):
        """img: a PIL image, or for on_device views its uint8 tensor (3, H, W) or an Encoded JPEG (then the
        crop is the device's: its geometry row comes back instead, from the same draws)."""
        encoded = isinstance(img, Encoded)
        top, left, height, width = T.RandomResizedCrop.get_params(stand_in(img) if encoded else img, self.scale,
                                                                  RRC_RATIO)
        if encoded:
            flip = bool(torch.rand(1) < 0.5)
            return crop_geometry(top, left, height, width, self.size, flip), pack_params(draw_photometric(self.aug))
        if self.on_device:  # torch's uint8 antialiased resize: ~3x faster than PIL's, within 1 level of it
            crop = TF.resized_crop(img, top, left, height, width, [self.size, self.size], antialias=True)
            if torch.rand(1) < 0.5:
                crop = TF.hflip(crop)
            return crop, pack_params(draw_photometric(self.aug))
        img = F.resized_crop(img, top, left, height, width, [self.size, self.size],
                             T.InterpolationMode.BILINEAR, antialias=True)
        if torch.rand(1) < 0.5:
            img = F.hflip(img)
        img = apply_photometric_pil(img, draw_photometric(self.aug))
        return F.normalize(F.to_tensor(img), MEAN, STD)


class MultiView:
    """Applies one transform per view and returns the list of views."""

    def __init__(self, transforms):
        self.transforms = transforms
        self.on_device = any(getattr(t, "on_device", False) for t in transforms)

    def __call__(self, img):
        if isinstance(img, Encoded):
            geometry, params = zip(*[t(img) for t in self.transforms])
            return EncodedSample(img.data, list(geometry), list(params))
        if self.on_device and not torch.is_tensor(img):  # one uint8 tensor for every view to crop from
            img = F.pil_to_tensor(img)
        elif torch.is_tensor(img) and not self.on_device:
            raise TypeError("--augment cpu views take PIL images: build the dataset without as_tensor")
        return [t(img) for t in self.transforms]


def pretrain_views(args, on_device=False):
    """View 0: target (weak by default) global view; view 1: online global view; then local crops."""
    scale = (args.min_scale, 1.0)
    views = [View(args.target_aug, args.crop_size, scale, on_device),
             View(args.online_aug, args.crop_size, scale, on_device)]
    scales = args.local_crop_scales
    for i, size in enumerate(args.local_crop_sizes):
        views.append(View(args.local_aug, size, scales[2 * i:2 * i + 2], on_device))
    return MultiView(views)
