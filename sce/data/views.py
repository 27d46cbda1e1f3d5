"""The views of paper Table 2, and the one place their random parameters are drawn.

A view is a random resized crop and a horizontal flip, then photometric ops (colour jitter, grayscale,
Gaussian blur, solarize). Every random number of view v of image i in epoch e of a run seeded s is a
uniform from a counter-based hash of (s, e, i, v, draw): the same numbers whoever draws them (a loader
worker for one image, the main process for a batch, or for a whole epoch of preloaded images), on any
number of workers or ranks, and after a resume. They become parameters by the rules of torchvision's
RandomResizedCrop, ColorJitter, RandomGrayscale, GaussianBlur and RandomSolarize (the same distributions,
not torchvision's random streams). `pil_view` applies a view with PIL for `--augment cpu`; every other
route applies it with the tensor ops of sce/data/ops.py.
"""
import dataclasses
import math

import numpy as np
import torch
import torchvision.transforms.functional as F

from sce import UserError
from sce.data.ops import BLUR_SIGMA, MEAN, STD, blur_kernel_size, box
from sce.losses import GlobalViews

# ImageNet statistics for every dataset (the paper gives no per-dataset ones): any checkpoint can be evaluated
# or transferred without knowing its data. Table 2: p(colour jitter), jitter (brightness, contrast, saturation,
# hue), p(gray), p(blur), p(solarize)
AUGMENTATIONS = {
    "weak":         (0.0, None, 0.0, 0.0, 0.0),
    "strong":       (0.8, (0.4, 0.4, 0.4, 0.1), 0.2, 0.5, 0.0),
    "strong-alpha": (0.8, (0.4, 0.4, 0.2, 0.1), 0.2, 1.0, 0.0),
    "strong-beta":  (0.8, (0.4, 0.4, 0.2, 0.1), 0.2, 0.1, 0.2),
    "strong-gamma": (0.8, (0.4, 0.4, 0.2, 0.1), 0.2, 0.5, 0.2),
    # not a row of Table 2: `strong` without its blur, to measure what blurring 32 px images costs
    "strong-noblur": (0.8, (0.4, 0.4, 0.4, 0.1), 0.2, 0.0, 0.0),
}
RRC_RATIO = (3 / 4, 4 / 3)  # aspect ratios of RandomResizedCrop (torchvision's default)
RRC_ATTEMPTS = 10  # RandomResizedCrop tries 10 (area, ratio) draws, then a central crop
SOLARIZE_THRESHOLD = 128  # on uint8 images; 0.5 on [0, 1] floats picks the same pixels


def columns(*fields):
    """{name: its column, or slice of columns} of (name, width) fields laid side by side, and their total width."""
    out, at = {}, 0
    for name, width in fields:
        out[name] = at if width == 1 else slice(at, at + width)
        at += width
    return out, at


# the uniforms of one view (the crop's (area, ratio) attempts, then one each, or 4 for the jitter's order and
# factors), and the packed row of its parameters: the crop and flip, then the photometric ones
U, DRAWS = columns(("attempts", 2 * RRC_ATTEMPTS), ("top", 1), ("left", 1), ("flip", 1), ("jitter", 1), ("order", 4),
                   ("factors", 4), ("blur", 1), ("gray", 1), ("sigma", 1), ("solarize", 1))
ROW, PACKED = columns(("top", 1), ("left", 1), ("height", 1), ("width", 1), ("flip", 1), ("jitter", 1), ("order", 4),
                      ("factors", 4), ("gray", 1), ("sigma", 1), ("solarize", 1))
# a Table 2 row as _packed draws with it: p(jitter), each factor's range (low 4, high 4), p(gray), p(blur), p(solarize)
TABLE, _ = columns(("p_jitter", 1), ("low", 4), ("high", 4), ("p_gray", 1), ("p_blur", 1), ("p_solarize", 1))


@dataclasses.dataclass(frozen=True)
class ViewSpec:
    """One view: its Table 2 row, its side in pixels and the area share range of its crop."""
    aug: str
    size: int
    scale: tuple = (0.2, 1.0)

    @property
    def photometric(self):
        """Whether the row applies any photometric op (the weak one does not)."""
        return any(AUGMENTATIONS[self.aug][i] for i in (0, 2, 3, 4))


def view_specs(args):
    """The views of a batch, in its order: the global views (GlobalViews.in_batch_order: view 0 the target, view 1
    the online), then the local crops."""
    global_views = GlobalViews(target=args.target_aug, online=args.online_aug).in_batch_order()
    for aug in global_views + [args.local_aug]:
        if aug not in AUGMENTATIONS:
            raise UserError(f"unknown augmentation '{aug}': use one of {', '.join(AUGMENTATIONS)}")
    scale = (args.min_scale, 1.0)
    specs = [ViewSpec(aug, args.crop_size, scale) for aug in global_views]
    scales = args.local_crop_scales
    return specs + [ViewSpec(args.local_aug, size, tuple(scales[2 * i:2 * i + 2]))
                    for i, size in enumerate(args.local_crop_sizes)]


# ---------------------------------------------------------------- the draws

def _mix(z):
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seed, epoch, index, view, count=DRAWS):
    """(len(index), count) float64 uniforms in [0, 1) (numpy): the hash of (seed, epoch, index, view, k), k < count;
    view: one, or one a row of index."""
    key = _mix(np.array([seed], dtype=np.uint64))
    key = _mix(key ^ np.array([epoch], dtype=np.uint64))
    key = _mix(key ^ np.asarray(view, dtype=np.uint64).reshape(-1, 1))
    rows = _mix(key ^ np.asarray(index, dtype=np.uint64).reshape(-1, 1))
    bits = _mix(rows ^ np.arange(count, dtype=np.uint64).reshape(1, -1))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def random_resized_crops(u, height, width, scale, ratio=RRC_RATIO):
    """(top, left, h, w) float64 arrays, as torchvision's RandomResizedCrop.get_params draws them, from uniforms u
    (N, 2 RRC_ATTEMPTS + 2), each image's height and width (N,) and the area share range scale (a pair, of numbers
    or of (N, 1) arrays): RRC_ATTEMPTS (area, log-ratio) pairs, the first that fits wins, else the central crop of
    the closest allowed ratio; then top and left."""
    height, width = np.asarray(height, np.float64).reshape(-1, 1), np.asarray(width, np.float64).reshape(-1, 1)
    attempts = u[:, U["attempts"]]
    target = height * width * (scale[0] + (scale[1] - scale[0]) * attempts[:, 0::2])
    log_ratio = math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * attempts[:, 1::2]
    w = np.round(np.sqrt(target * np.exp(log_ratio)))
    h = np.round(np.sqrt(target / np.exp(log_ratio)))
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = fits.argmax(axis=1)[:, None]
    height, width = height[:, 0], width[:, 0]
    aspect = width / height  # torchvision's fallback: the whole image, cut to the closest allowed ratio
    fallback_h = np.where(aspect < ratio[0], np.round(width / ratio[0]), height)
    fallback_w = np.where(aspect > ratio[1], np.round(height * ratio[1]), width)
    found = fits.any(axis=1)
    h = np.where(found, np.take_along_axis(h, first, 1)[:, 0], fallback_h)
    w = np.where(found, np.take_along_axis(w, first, 1)[:, 0], fallback_w)
    top = np.where(found, np.floor(u[:, U["top"]] * (height - h + 1)), (height - h) // 2)
    left = np.where(found, np.floor(u[:, U["left"]] * (width - w + 1)), (width - w) // 2)
    return top, left, h, w


def jitter_ranges(jitter):
    """torchvision's ColorJitter ranges: factors in [max(0, 1 - s), 1 + s], hue shift in [-h, h]."""
    b, c, s, h = jitter
    return [(max(0.0, 1 - v), 1 + v) for v in (b, c, s)] + [(-h, h)]


def draw(spec, seed, epoch, index, view, *, height, width):
    """The parameters of view `view` (its ViewSpec `spec`) of images `index` (N,) of sizes (height, width),
    packed in rows (N, PACKED) float64: top, left, height, width, flip, then the photometric ones (jitter,
    order (4), factors (4), gray, sigma, solarize). A function of (seed, epoch, index, view) alone."""
    return _packed(uniforms(seed, epoch, index, view), height, width, [spec])


def draw_views(specs, seed, epoch, index, height, width):
    """draw of every view of one image (a loader worker's), in one pass: [its row (PACKED,) of each view]."""
    rows = _packed(uniforms(seed, epoch, [index] * len(specs), range(len(specs))), [height], [width], specs)
    return list(rows)


def _packed(u, height, width, specs):
    """Packed rows from the uniforms u (R, DRAWS) of images of sizes (height, width), row r drawn for specs[r] (or
    every row for specs[0]), by the rules of torchvision's transforms (module docstring)."""
    scale = np.array([spec.scale for spec in specs], dtype=np.float64)
    top, left, h, w = random_resized_crops(u, height, width, (scale[:, :1], scale[:, 1:]))
    # per spec: p(jitter), each factor's range (low 4, high 4), p(gray), p(blur), p(solarize)
    t = np.array([_photometric_row(spec.aug) for spec in specs])
    low, high = t[:, TABLE["low"]], t[:, TABLE["high"]]
    sigma = BLUR_SIGMA[0] + (BLUR_SIGMA[1] - BLUR_SIGMA[0]) * u[:, U["sigma"]]
    row = np.empty((len(u), PACKED))
    row[:, ROW["top"]], row[:, ROW["left"]], row[:, ROW["height"]], row[:, ROW["width"]] = top, left, h, w
    row[:, ROW["flip"]] = u[:, U["flip"]] < 0.5
    row[:, ROW["jitter"]] = u[:, U["jitter"]] < t[:, TABLE["p_jitter"]]
    row[:, ROW["order"]] = u[:, U["order"]].argsort(axis=1, kind="stable")
    row[:, ROW["factors"]] = low + (high - low) * u[:, U["factors"]]
    row[:, ROW["gray"]] = u[:, U["gray"]] < t[:, TABLE["p_gray"]]
    row[:, ROW["sigma"]] = np.where(u[:, U["blur"]] < t[:, TABLE["p_blur"]], sigma, 0.0)
    row[:, ROW["solarize"]] = u[:, U["solarize"]] < t[:, TABLE["p_solarize"]]
    return torch.from_numpy(row)


def _photometric_row(aug):
    """Table 2's row `aug` as the numbers _packed draws with."""
    p_jitter, jitter, p_gray, p_blur, p_solarize = AUGMENTATIONS[aug]
    ranges = np.array(jitter_ranges(jitter) if jitter else [(1.0, 1.0)] * 3 + [(0.0, 0.0)])
    return [p_jitter, *ranges[:, 0], *ranges[:, 1], p_gray, p_blur, p_solarize]


PROBE_SCALE = (0.08, 1.0)  # the linear probe's RandomResizedCrop on large images (torchvision's default)


def probe_crops(padding, size, seed, epoch, index, *, height, width):
    """The linear probe's random crops and flips of images `index` (N,) of sizes (height, width), packed rows
    (N, 5) float64: top, left, height, width, flip. padding > 0: the small-image protocol's crop of `size` with
    `padding` zero pixels around (RandomCrop(size, padding)); 0: the large-image RandomResizedCrop(size)."""
    u = uniforms(seed, epoch, index, 0, U["flip"] + 1)
    height, width = np.asarray(height, np.float64), np.asarray(width, np.float64)
    if padding:
        top = np.floor(u[:, 0] * (height + 2 * padding - size + 1)) - padding
        left = np.floor(u[:, 1] * (width + 2 * padding - size + 1)) - padding
        h = w = np.full_like(top, size)
    else:
        top, left, h, w = random_resized_crops(u, height, width, PROBE_SCALE)
    return torch.from_numpy(np.stack([top, left, h, w, u[:, U["flip"]] < 0.5], axis=1).astype(np.float64))


@dataclasses.dataclass
class Photometric:
    """The photometric parameters of a batch of one view, by name, as sce.data.ops.photometric takes them."""
    jitter: torch.Tensor  # (N,) bool: colour jitter applied
    order: torch.Tensor  # (N, 4) long: the jitter's ops in the order they apply (0 brightness ... 3 hue)
    factors: torch.Tensor  # (N, 4) float: brightness, contrast, saturation factors and the hue shift
    gray: torch.Tensor  # (N,) bool
    sigma: torch.Tensor  # (N,) float: the blur's sigma, 0 for no blur
    solarize: torch.Tensor  # (N,) bool

    @classmethod
    def of(cls, rows):
        """From packed rows (N, PACKED)."""
        return cls(rows[:, ROW["jitter"]] > 0, rows[:, ROW["order"]].long(), rows[:, ROW["factors"]].float(),
                   rows[:, ROW["gray"]] > 0, rows[:, ROW["sigma"]].float(), rows[:, ROW["solarize"]] > 0)

    def as_args(self):
        return self.jitter, self.order, self.factors, self.gray, self.sigma, self.solarize


# ---------------------------------------------------------------- --augment cpu: PIL

def pil_view(img, spec, row):
    """View `spec` of a PIL image with the parameters of its packed row: torchvision's functional ops on PIL
    (crop, antialiased bilinear resize, flip, then the photometric ops in torchvision's order) -> the
    normalised float tensor (3, size, size)."""
    (top, left, h, w), flip = box(row)
    img = F.resized_crop(img, top, left, h, w, [spec.size, spec.size], interpolation=F.InterpolationMode.BILINEAR,
                         antialias=True)
    if flip:
        img = F.hflip(img)
    p = Photometric.of(row[None])
    if p.jitter[0]:
        b, c, s, hue = p.factors[0].tolist()
        ops = (lambda x: F.adjust_brightness(x, b), lambda x: F.adjust_contrast(x, c),
               lambda x: F.adjust_saturation(x, s), lambda x: F.adjust_hue(x, hue))
        for i in p.order[0].tolist():
            img = ops[i](img)
    if p.gray[0]:
        img = F.rgb_to_grayscale(img, num_output_channels=3)
    sigma = float(p.sigma[0])
    if sigma:
        size = blur_kernel_size(sigma)
        img = F.gaussian_blur(img, [size, size], [sigma, sigma])
    if p.solarize[0]:
        img = F.solarize(img, SOLARIZE_THRESHOLD)
    return F.normalize(F.to_tensor(img), MEAN, STD)
