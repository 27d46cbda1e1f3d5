"""Evaluation data, as the protocols read it (main_lincls.py, the kNN monitor of main_pretrain.py, the features of
the logistic regression and of main_lowshot.py): the splits of any --dataset layout with their classes checked,
their input size, and batches by one of three routes chosen once per split (`eval_split`):

    preload  a small-input trunk's split decoded once onto the device (its deterministic resize done then)
    decode   an ImageNet-stem trunk's JPEGs decoded, resized and cropped on the device (--decode device)
    loader   the loader's workers read, resize and crop with PIL

Every route's `batches` yields the same batch: (normalised images (N, 3, size, size) float32, targets), both on
the device. The linear probe's random crops and flips come from sce.data.views.probe_crops, a function of
(seed, epoch, index): the same on every route, for any --workers, after a resume. Every image of a split is
read: an unreadable one stops the evaluation with one line naming it."""
import dataclasses
import os

import torch
import torchvision.transforms as T
import torchvision.transforms.functional as F

from sce import UserError
from sce.data import ops
from sce.data.files import Encoded, UnreadableImage, build_dataset
from sce.data.jpeg import JpegDecoder
from sce.data.preloading import preload, wanted
from sce.data.samplers import Shard
from sce.data.views import box, probe_crops
from sce.preemption import ignore_stop_signals

FOLDERS = ("imagefolder", "imagenet100", "tiny-imagenet")  # DATA/train and DATA/val
NATIVE_SIZE = {"cifar10": 32, "cifar100": 32, "stl10": 96, "tiny-imagenet": 64}  # the paper evaluates them at it
MODES = {"bilinear": F.InterpolationMode.BILINEAR, "bicubic": F.InterpolationMode.BICUBIC}


# ---------------------------------------------------------------- sizes and splits

def eval_crop_size(given, small_input, ckpt_args=None, dataset="imagefolder"):
    """The input size of an evaluation and why: (size, reason, warning or None).

    A small-input trunk (3x3 stride-1 stem) is evaluated at the crop size it was pretrained with, as recorded
    in its checkpoint, else at its dataset's native size; an ImageNet-stem trunk at the native size of a
    built-in dataset, else at the protocol's 224. A --crop-size given for a small-input trunk more than 2x away
    from its pretraining size is allowed, with a warning."""
    recorded = (ckpt_args or {}).get("crop_size") if small_input else None
    if given:
        far = recorded and not recorded / 2 <= given <= recorded * 2
        warning = (f"warning: --crop-size {given} is more than 2x away from the {recorded} px this small-input "
                   f"trunk was pretrained at: its features are those of images of another scale" if far else None)
        return given, "--crop-size", warning
    if recorded:
        return recorded, "the crop size the small-input trunk was pretrained with", None
    if dataset in NATIVE_SIZE:
        return NATIVE_SIZE[dataset], f"the native size of {dataset}", None
    return 224, "the protocol's 224", None


def eval_resize(crop_size, small=False):
    """The short side images are resized to before the centre crop: 256 for 224 (scaled with the crop) on
    large images; the resolution itself on small ones (paper supp.)."""
    return crop_size if small else int(crop_size * 256 / 224)


def num_classes_of(train, val, dataset, root):
    """Number of classes, checking there are two or more and that val has the same ones."""
    classes = getattr(train, "classes", None)
    n = len(classes) if classes else int(max(train.targets)) + 1
    where = os.path.join(root, "train") if dataset in FOLDERS else root
    if n < 2:
        raise UserError(f"{where} holds a single class ({classes[0] if classes else 0}): "
                        "a classifier needs at least 2 classes (one sub-folder per class)")
    val_classes = getattr(val, "classes", None)
    if classes and val_classes and list(val_classes) != list(classes):
        odd = sorted(set(val_classes) ^ set(classes))
        raise UserError(f"{os.path.join(root, 'val')} and {where} have different classes "
                        f"(first difference: {odd[0] if odd else 'order'}): both need the same class folders")
    return n


def read_splits(dataset, root, read="pil", class_list=None):
    """(train, val, number of classes) of `root` in the `dataset` layout (val: the test set of CIFAR / STL10)."""
    missing = [s for s in ("train", "val") if not os.path.isdir(os.path.join(root, s))]
    if dataset in FOLDERS and os.path.isdir(root) and missing:  # else build_dataset names what is wrong
        raise UserError(f"{root} has no {missing[0]}/ folder: an evaluation needs {root}/train and {root}/val")
    train, val = (build_dataset(dataset, root, split, class_list=class_list, read=read) for split in ("train", "val"))
    return train, val, num_classes_of(train, val, dataset, root)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """How an evaluation cuts an image to size x size: a resize of the short side to `resize` (None: none), then a
    centre crop (random None), or the linear probe's random crop and flip: 'padded' (RandomCrop(size, padding)),
    or 'resized' (RandomResizedCrop(size), no resize before). mode: the resize's interpolation."""
    size: int
    resize: int = None
    random: str = None
    mode: str = "bilinear"
    padding: int = 4


def protocol(size, small_input, train):
    """The Geometry of the linear evaluation protocol (paper supp.): large images random resized crop + flip /
    resize 256 + centre crop 224; small images 4-pixel-padded random crop + flip / resize to the resolution."""
    if train:
        return Geometry(size, size, "padded") if small_input else Geometry(size, random="resized")
    return Geometry(size, eval_resize(size, small_input))


# ---------------------------------------------------------------- the routes

class Samples(torch.utils.data.Dataset):
    """What a loader worker makes of key (epoch, index): (image, target), the image cut by `geometry` with PIL and
    normalised (3, size, size); on the decode route (image or None, a plain JPEG's bytes or nothing, its rows), the
    JPEG for the device. Every image is read: an unreadable one is an UnreadableImage naming it."""

    def __init__(self, dataset, geometry, seed=0, decode=False):
        self.dataset, self.geometry, self.seed, self.decode = dataset, geometry, seed, decode

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        try:
            img, target = self.dataset[index]
            if not self.decode:
                return self.pil(img, epoch, index), int(target)
            if isinstance(img, Encoded):
                row = self.rows(epoch, [index], *img.size)[0] if self.geometry.random else torch.zeros(5)
                return (None, img.data, row), int(target)
            return (self.pil(img, epoch, index), torch.empty(0, dtype=torch.uint8), torch.zeros(5)), int(target)
        except UserError:
            raise
        except Exception as e:  # decode errors come as many exception types
            raise UnreadableImage.of(self.dataset, index, f"{type(e).__name__}: {e}") from None

    def rows(self, epoch, index, height, width):
        g = self.geometry
        return probe_crops(g.padding if g.random == "padded" else 0, g.size, self.seed, epoch, index, [height],
                           [width])

    def pil(self, img, epoch, index):
        g = self.geometry
        if torch.is_tensor(img):
            img = F.to_pil_image(img)
        if g.resize:
            img = F.resize(img, g.resize, MODES[g.mode])
        if g.random is None:
            img = F.center_crop(img, g.size)
        else:
            (top, left, h, w), flip = box(self.rows(epoch, [index], img.height, img.width)[0])
            img = (F.crop(img, top, left, h, w) if g.random == "padded" else
                   F.resized_crop(img, top, left, h, w, [g.size, g.size], MODES[g.mode], antialias=True))
            img = F.hflip(img) if flip else img
        return F.normalize(F.to_tensor(img), ops.MEAN, ops.STD)


def _collate_decode(samples):
    """A decode route's batch: (the JPEGs' bytes end to end, their lengths, places and rows; the other images'
    tensors and places; the targets)."""
    encoded = [i for i, ((image, _, _), _) in enumerate(samples) if image is None]
    decoded = [i for i, ((image, _, _), _) in enumerate(samples) if image is not None]
    return (torch.cat([samples[i][0][1] for i in encoded]) if encoded else torch.empty(0, dtype=torch.uint8),
            [len(samples[i][0][1]) for i in encoded], torch.tensor(encoded, dtype=torch.long),
            torch.stack([samples[i][0][2] for i in encoded]) if encoded else None,
            torch.stack([samples[i][0][0] for i in decoded]) if decoded else None,
            torch.tensor(decoded, dtype=torch.long), torch.tensor([t for _, t in samples]))


class EvalSplit:
    """A split and how it is read: len(), targets, subset(indices), describe(), and batches(batch_size, sampler,
    epoch): (normalised images, targets) on the device, in the order of `sampler` (keys (epoch, index); default:
    this rank's Shard). route: preload (images: an Images), decode or loader (dataset)."""

    def __init__(self, route, geometry, device, dataset=None, images=None, workers=0, seed=0, targets=None):
        self.route, self.geometry, self.device, self.workers, self.seed = route, geometry, device, workers, seed
        self.dataset, self.images = dataset, images
        self.targets = (targets if targets is not None else images.targets.tolist() if images is not None
                        else list(dataset.targets))

    def __len__(self):
        return len(self.images if self.images is not None else self.dataset)

    def subset(self, index):
        """The split reduced to `index` (a tensor of indices), read the same way."""
        if self.images is not None:
            return EvalSplit(self.route, self.geometry, self.device, images=self.images.subset(index), seed=self.seed)
        return EvalSplit(self.route, self.geometry, self.device, torch.utils.data.Subset(self.dataset, index.tolist()),
                         workers=self.workers, seed=self.seed, targets=[self.targets[i] for i in index.tolist()])

    def describe(self):
        """The route and geometry (for a feature cache's key)."""
        return f"{self.route} {self.geometry}"

    def batches(self, batch_size, sampler=None):
        """An iterable of this split's batches, again at each pass (an epoch: the sampler's keys give it)."""
        return _Batches(self, batch_size, sampler if sampler is not None else Shard(len(self)))

    def preloaded_batch(self, keys, scale, shift):
        """The preload route's batch of keys (epoch, index): the images cut there (rows: the probe's crops)."""
        index = torch.tensor([i for _, i in keys], dtype=torch.long, device=self.device)
        x, g = self.images.images[index], self.geometry
        if g.random:  # the window in the padded image: outside the image is zero
            height, width = x.shape[-2:]
            r = probe_crops(g.padding, g.size, self.seed, keys[0][0], [i for _, i in keys], [height] * len(keys),
                            [width] * len(keys)).to(self.device)
            x = ops.resized_crops(x, r, g.size)
        return ops.normalize(x.float() / 255, scale, shift), self.images.targets[index]

    def decode_batch(self, batch, decoder, scale, shift):
        """A decode route's loader batch -> (normalised images, targets) on the device."""
        jpegs, lengths, encoded, rows, others, decoded, targets = batch
        g, n = self.geometry, len(targets)
        out = torch.empty((n, 3, g.size, g.size), device=self.device)
        if others is not None:
            out[decoded.to(self.device)] = others.to(self.device, non_blocking=True)
        images = decoder(list(jpegs.split(lengths))) if lengths else []
        bad = [j for j, image in zip(encoded.tolist(), images) if image is None]
        if bad:  # an evaluation reads every image
            raise UnreadableImage.of(self.dataset, int(bad[0]), "neither the device's JPEG decoder nor PIL reads it",
                                     len(bad) - 1)
        for j, image, row in zip(encoded.tolist(), images, rows if rows is not None else []):
            if g.random:
                # the row on the host: the window's bounds are read without a device sync
                x = ops.resized_crops(image[None], row[None], g.size)[0]
            else:
                x = ops.resize_center_crop(image, g.resize, g.size, g.mode)
            out[j] = ops.normalize(x[None] / 255, scale, shift)[0]
        return out, targets.to(self.device, non_blocking=True)


class _Batches:
    """An EvalSplit's batches, on the device: of a DataLoader (its workers kept from pass to pass), or of the
    preloaded images."""

    def __init__(self, split, batch_size, sampler):
        self.split, self.batch_size, self.sampler = split, batch_size, sampler
        self.decoder = JpegDecoder(split.device) if split.route == "decode" else None
        self.loader = None
        if split.route != "preload":
            self.loader = torch.utils.data.DataLoader(
                Samples(split.dataset, split.geometry, split.seed, split.route == "decode"), batch_size=batch_size,
                sampler=sampler, num_workers=split.workers, pin_memory=split.device.type == "cuda",
                persistent_workers=split.workers > 0, worker_init_fn=ignore_stop_signals,
                collate_fn=_collate_decode if split.route == "decode" else None,
                generator=torch.Generator())  # private: from the global RNG, the training's draws would move

    def __len__(self):
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        device = self.split.device
        scale, shift = ops.normalization(device)
        if self.loader is None:
            keys = list(self.sampler)
            for start in range(0, len(keys), self.batch_size):
                yield self.split.preloaded_batch(keys[start:start + self.batch_size], scale, shift)
            return
        for batch in self.loader:
            if self.decoder:
                yield self.split.decode_batch(batch, self.decoder, scale, shift)
            else:
                images, targets = batch
                yield images.to(device, non_blocking=True), targets.to(device, non_blocking=True)


def eval_split(dataset, geometry, device, route="loader", workers=0, seed=0):
    """An EvalSplit of `dataset` (read as the route needs: PIL images for loader, encoded JPEGs for decode)."""
    return EvalSplit(route, geometry, device, dataset, workers=workers, seed=seed)


def decodes_on_device(decode, small_input):
    """JPEGs decoded, resized and cropped on the device (--decode device), for an ImageNet-stem trunk: a
    small-input one is preloaded instead, its protocol's padded random crop is not a device geometry."""
    return decode == "device" and not small_input


def eval_splits(dataset, root, size, small_input, device, preload_mode="auto", decode="loader", workers=0,
                augment_train=False, class_list=None, what="", seed=0, budget=None):
    """(train, val, number of classes) as the evaluations read them at `size` px, EvalSplits: preloaded on the
    device (a small-input trunk, --preload; the budget's device), decoded there (an ImageNet-stem trunk, --decode
    device) or read by the loader. augment_train: the linear probe's random crops and flips on train."""
    route = "decode" if decodes_on_device(decode, small_input) else "loader"
    train, val, classes = read_splits(dataset, root, "encoded" if route == "decode" else "pil", class_list)
    geometries = protocol(size, small_input, augment_train), protocol(size, small_input, False)
    if small_input and budget is not None and wanted(preload_mode, device):
        preloaded = [preload(ds, budget, preload_mode == "device", workers, max_bad=None, what=f"{what}{split} images",
                             transform=T.Compose([T.Resize(g.resize)] + ([T.CenterCrop(g.size)] if g.random is None
                                                                          else [])))
                     for ds, split, g in ((train, "train", geometries[0]), (val, "val", geometries[1]))]
        if all(p is not None for p in preloaded):
            return (*(EvalSplit("preload", g, device, images=p, seed=seed) for p, g in zip(preloaded, geometries)),
                    classes)
    return (*(EvalSplit(route, g, device, ds, workers=workers, seed=seed) for ds, g in zip((train, val), geometries)),
            classes)

