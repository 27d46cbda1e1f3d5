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

import numpy as np
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as F

from sce import UserError
from sce.data import ops
from sce.data.assembly import Preloaded, pack, unpack
from sce.data.files import build_dataset, fingerprint
from sce.data.images import Encoded, UnreadableImage
from sce.data.jpeg import JpegDecoder
from sce.data.preloading import preload, wanted
from sce.data.samplers import Shard, epoch_order
from sce.data.views import probe_crops
from sce.layouts import DATASETS, check_classes
from sce.preemption import ignore_stop_signals

MODES = {"bilinear": F.InterpolationMode.BILINEAR, "bicubic": F.InterpolationMode.BICUBIC}


# ---------------------------------------------------------------- sizes and splits

def eval_crop_size(given, small_input, ckpt_args=None, dataset="imagefolder"):
    """The input size of an evaluation and why: (size, reason, warning or None).

    A small-input trunk (3x3 stride-1 stem) is evaluated at the crop size it was pretrained with, as recorded
    in its checkpoint, else at its dataset's native size, else it is refused (a --crop-size is needed); an
    ImageNet-stem trunk at the native size of a built-in dataset, else at the protocol's 224. A --crop-size given for a small-input trunk more than 2x away
    from its pretraining size is allowed, with a warning."""
    recorded = (ckpt_args or {}).get("crop_size") if small_input else None
    if given:
        far = recorded and not recorded / 2 <= given <= recorded * 2
        warning = (f"warning: --crop-size {given} is more than 2x away from the {recorded} px this small-input "
                   f"trunk was pretrained at: its features are those of images of another scale" if far else None)
        return given, "--crop-size", warning
    if recorded:
        return recorded, "the crop size the small-input trunk was pretrained with", None
    native = DATASETS[dataset].native_size if dataset in DATASETS else None  # the paper evaluates it at it
    if native:
        return native, f"the native size of {dataset}", None
    if small_input:  # 224 px would be another scale than it learned, and 49x slower: never silently
        raise UserError(f"a small-input trunk whose file records no crop size, on --dataset {dataset} (no native "
                        "size): pass --crop-size, the size it was pretrained at (32 CIFAR, 96 STL10, 64 Tiny-ImageNet)")
    return 224, "the protocol's 224", None


def eval_resize(crop_size, small=False):
    """The short side images are resized to before the centre crop: 256 for 224 (scaled with the crop) on
    large images; the resolution itself on small ones (paper supp.)."""
    return crop_size if small else int(crop_size * 256 / 224)


def num_classes_of(train, val, dataset, root):
    """Number of classes, checking there are two or more and that val has the same ones."""
    classes = getattr(train, "classes", None)
    n = len(classes) if classes else int(max(train.targets)) + 1
    where = os.path.join(root, "train") if DATASETS[dataset].folders else root
    return check_classes(n, classes, getattr(val, "classes", None), where, os.path.join(root, "val"))


def read_splits(dataset, root, read="pil", class_list=None):
    """(train, val, number of classes) of `root` in the `dataset` layout (val: the test set of CIFAR / STL10)."""
    missing = [s for s in ("train", "val") if not os.path.isdir(os.path.join(root, s))]
    folders = dataset in DATASETS and DATASETS[dataset].folders  # DATA/train and DATA/val
    if folders and os.path.isdir(root) and missing:  # else build_dataset names what is wrong
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
    normalised (3, size, size); on the decode route (a plain JPEG's payload for sce.data.assembly.pack: None, its
    rows, its bytes; or another file's: its uint8 image cut with PIL, its rows, None), target, index. Every image is
    read: an unreadable one is an UnreadableImage naming it."""

    def __init__(self, dataset, geometry, seed=0, decode=False):
        self.dataset, self.geometry, self.seed, self.decode = dataset, geometry, seed, decode

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        try:
            img, target = self.dataset[index]
            if not self.decode:
                return F.normalize(F.to_tensor(self.pil(img, epoch, index)), ops.MEAN, ops.STD), int(target)
            if isinstance(img, Encoded):
                row = self.rows(epoch, [index], *img.size)[0] if self.geometry.random else torch.zeros(5)
                return (None, [row], img.data), int(target), index
            return ([F.pil_to_tensor(self.pil(img, epoch, index))], [torch.zeros(5)], None), int(target), index
        except UserError:
            raise
        except Exception as e:  # decode errors come as many exception types
            raise UnreadableImage.of(self.dataset, index, f"{type(e).__name__}: {e}") from None

    def rows(self, epoch, index, height, width):
        g = self.geometry
        return probe_crops(g.padding if g.random == "padded" else 0, g.size, self.seed, epoch, index, height=[height],
                           width=[width])

    def pil(self, img, epoch, index):
        """The PIL image cut by the geometry."""
        g = self.geometry
        if torch.is_tensor(img):
            img = F.to_pil_image(img)
        if g.resize:
            img = F.resize(img, g.resize, MODES[g.mode])
        if g.random is None:
            return F.center_crop(img, g.size)
        (top, left, h, w), flip = ops.box(self.rows(epoch, [index], img.height, img.width)[0])
        img = (F.crop(img, top, left, h, w) if g.random == "padded" else
               F.resized_crop(img, top, left, h, w, [g.size, g.size], interpolation=MODES[g.mode],
                                antialias=True))
        return F.hflip(img) if flip else img


def _collate_decode(samples):
    """A decode route's batch: assembly.pack's tensors, then the targets and the images' indices."""
    return pack([s[0] for s in samples]) + (torch.tensor([s[1] for s in samples]), [s[2] for s in samples])


class EvalSplit:
    """A split and how it is read: len(), targets, subset(indices), describe(), and batches(batch_size, sampler):
    (normalised images, targets) on the device, in the order of `sampler` (keys (epoch, index); default: this
    rank's Shard). route: preload (images: an Images), decode or loader (dataset). data_id: the linear probe's train
    split's fingerprint (sce.data.files.fingerprint), which a mid-epoch resume compares. classes: the names of its
    classes, or None (eval_splits: its dataset's)."""

    def __init__(self, route, geometry, device, dataset=None, images=None, workers=0, seed=0, targets=None,
                 data_id=None, classes=None):
        self.route, self.geometry, self.device, self.workers, self.seed = route, geometry, device, workers, seed
        self.dataset, self.images, self.data_id, self.classes = dataset, images, data_id, classes
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
        sampler = sampler if sampler is not None else Shard(len(self))
        kind = {"preload": PreloadedBatches, "decode": DecodedBatches, "loader": LoaderBatches}[self.route]
        return kind(self, batch_size, sampler)


class PreloadedBatches:
    """A preloaded split's batches, cut on the device: each epoch's order and the probe's crops of every image moved
    there once (sce.data.assembly.Preloaded), no host work nor sync a step."""

    def __init__(self, split, batch_size, sampler):
        self.split, self.batch_size, self.sampler = split, batch_size, sampler
        self.scale, self.shift = ops.normalization(split.device)
        self.epochs = Preloaded(split.images.images, batch_size, self.tables, self.cut,
                                ahead=split.geometry.random is not None)

    def tables(self, epoch):
        """The order of `epoch` and, for the probe's random geometry, every image's crop and flip."""
        images, g = self.split.images.images, self.split.geometry
        if not g.random:
            return epoch_order(self.sampler, epoch), []
        n, (height, width) = len(images), images.shape[-2:]
        return epoch_order(self.sampler, epoch), [probe_crops(g.padding, g.size, self.split.seed, epoch,
                                                                np.arange(n), height=[height] * n, width=[width] * n)]

    def cut(self, index, rows):
        x = self.split.images.images[index]
        if rows:  # the window in the padded image: outside the image is zero
            x = ops.resized_crops(x, rows[0], self.split.geometry.size)
        return ops.normalize(x.float() / 255, self.scale, self.shift), self.split.images.targets[index]

    def __len__(self):
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        self.epochs.set_epoch(getattr(self.sampler, "epoch", 0), getattr(self.sampler, "start", 0))
        return iter(self.epochs)


class LoaderBatches:
    """A split's batches of a DataLoader (its workers kept from pass to pass), read and cut with PIL."""
    decode = False

    def __init__(self, split, batch_size, sampler):
        self.split, self.batch_size, self.sampler = split, batch_size, sampler
        self.loader = torch.utils.data.DataLoader(
            Samples(split.dataset, split.geometry, split.seed, self.decode), batch_size=batch_size, sampler=sampler,
            num_workers=split.workers, pin_memory=split.device.type == "cuda", persistent_workers=split.workers > 0,
            worker_init_fn=ignore_stop_signals, collate_fn=_collate_decode if self.decode else None,
            generator=torch.Generator())  # private: from the global RNG, the training's draws would move

    def __len__(self):
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        device = self.split.device
        for images, targets in self.loader:
            yield images.to(device, non_blocking=True), targets.to(device, non_blocking=True)


class DecodedBatches(LoaderBatches):
    """A split's JPEGs decoded, resized and cropped on the device (sce.data.assembly.unpack); files the device does
    not decode cut by the workers with PIL."""
    decode = True

    def __init__(self, split, batch_size, sampler):
        super().__init__(split, batch_size, sampler)
        self.decoder = JpegDecoder(split.device)
        self.scale, self.shift = ops.normalization(split.device)

    def __iter__(self):
        g = self.split.geometry
        for *packed, targets, index in self.loader:
            rows = packed[-1][0]

            def cut(image, v, j):  # a random window: its row on the host, read without a device sync
                return (ops.resized_crops(image[None], rows[j:j + 1], g.size)[0] if g.random else
                        ops.resize_center_crop(image, g.resize, g.size, g.mode))

            def unreadable(j):  # an evaluation reads every image
                raise UnreadableImage.of(self.split.dataset, index[j], "neither the device's JPEG decoder nor PIL "
                                         "reads it")
            x = unpack(packed, self.decoder, [g.size], cut, unreadable)[0]
            yield ops.normalize(x / 255, self.scale, self.shift), targets.to(self.split.device, non_blocking=True)


def eval_split(dataset, geometry, device, route="loader", workers=0, seed=0):
    """An EvalSplit of `dataset` (read as the route needs: READER[route])."""
    return EvalSplit(route, geometry, device, dataset, workers=workers, seed=seed)


READER = {"loader": "pil", "decode": "encoded"}  # how each route's datasets read image files


def eval_route(decode, small_input):
    """The route of an evaluation's files, for every evaluation (main_lincls.py's splits and logistic regression,
    main_lowshot.py): decode, JPEGs decoded, resized and cropped on the device (--decode device), for an
    ImageNet-stem trunk; else loader. A small-input trunk's splits are preloaded where they can be (eval_splits),
    else read by the loader: the padded random crop of its protocol is PIL's."""
    return "decode" if decode == "device" and not small_input else "loader"


def eval_splits(dataset, root, size, small_input, device, preload_mode="auto", decode="loader", workers=0,
                augment_train=False, class_list=None, what="", seed=0, budget=None, reuse=None):
    """(train, val, number of classes) as the evaluations read them at `size` px, EvalSplits: preloaded on the
    device (a small-input trunk, --preload; the budget's device), decoded there (an ImageNet-stem trunk, --decode
    device) or read by the loader. augment_train: the linear probe's random crops and flips on train, and its
    fingerprint (EvalSplit.data_id). reuse:
    (fingerprint, Images) of a dataset already preloaded whole (pretraining's): the train split takes those images
    where they are its own, at its size (no second copy)."""
    route = eval_route(decode, small_input)
    train, val, classes = read_splits(dataset, root, READER[route], class_list)
    names = getattr(train, "classes", None)  # val's are the same (read_splits)
    geometries = protocol(size, small_input, augment_train), protocol(size, small_input, False)
    ids = fingerprint(train) if augment_train else None, None
    if small_input and budget is not None and wanted(preload_mode, device):
        def load(ds, split, g):
            images = reuse[1] if reuse and split == "train" else None
            if images is not None and not images.replaced and images.images.shape[-2:] == (size, size) \
                    and g.resize == size and reuse[0] == fingerprint(ds):  # Resize(size) of a size x size image: itself
                print(f"=> {what}{split} images: the {len(images)} preloaded for pretraining", flush=True)
                return images
            transform = T.Compose([T.Resize(g.resize)] + ([T.CenterCrop(g.size)] if g.random is None else []))
            return preload(ds, budget, preload_mode == "device", workers, max_bad=None, what=f"{what}{split} images",
                           transform=transform)
        preloaded = [load(train, "train", geometries[0]), load(val, "val", geometries[1])]
        if all(p is not None for p in preloaded):
            return (*(EvalSplit("preload", g, device, images=p, seed=seed, data_id=i, classes=names)
                      for p, g, i in zip(preloaded, geometries, ids)), classes)
    return (*(EvalSplit(route, g, device, ds, workers=workers, seed=seed, data_id=i, classes=names)
              for ds, g, i in zip((train, val), geometries, ids)), classes)
