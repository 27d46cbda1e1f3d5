"""Data: dataset readers, evaluation transforms, and the resumable pretraining dataset and sampler
(the pretraining views are in sce.augment)."""
import io
import os
import warnings

import numpy as np
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from PIL import Image, JpegImagePlugin
from torch.utils.data import Dataset, Sampler
from torchvision.datasets import CIFAR10, CIFAR100, STL10, ImageFolder

try:  # libjpeg-turbo to a tensor; torchvision 0.29 deprecates it for TorchCodec: PIL decodes once it is gone
    from torchvision.io import ImageReadMode, decode_jpeg
    warnings.filterwarnings("ignore", "The image decoding and encoding capabilities of TorchVision are deprecated",
                            DeprecationWarning)  # once per image otherwise, an error under -W error
except ImportError:
    decode_jpeg = None

from sce import UserError
from sce.augment import MEAN, STD, Encoded, EncodedSample
from sce.preemption import ignore_stop_signals

IMAGENET100 = os.path.join(os.path.dirname(__file__), "imagenet100.txt")
DATASETS = ["imagefolder", "imagenet100", "cifar10", "cifar100", "stl10", "tiny-imagenet"]


WORKER_NICENESS = 5


def init_pretrain_worker(worker_id):
    """A pretraining loader worker leaves SIGTERM / SIGUSR1 to its rank (sce.preemption) and runs at
    a lower priority: where the workers fill every core, the training process, which launches the
    GPU's kernels one by one, still gets its core when it needs it."""
    ignore_stop_signals()
    os.nice(WORKER_NICENESS)


def pretrain_loader(dataset, views, sampler, batch_size, workers, device, seed):
    """The pretraining DataLoader of main_pretrain.py (and of the benchmark, which measures it)."""
    return torch.utils.data.DataLoader(
        PretrainDataset(dataset, views, seed), batch_size=batch_size, sampler=sampler, num_workers=workers,
        pin_memory=device.type == "cuda", drop_last=True, worker_init_fn=init_pretrain_worker,
        persistent_workers=workers > 0, collate_fn=collate_views,
        # a private generator for the loader's per-epoch seed draw: from the global RNG it would shift
        # shuffle-BN's permutations after a mid-epoch resume (the epoch's iterator is made twice)
        generator=torch.Generator().manual_seed(seed))


# native resolution of the built-in small and medium datasets (the paper evaluates them at it)
NATIVE_SIZE = {"cifar10": 32, "cifar100": 32, "stl10": 96, "tiny-imagenet": 64}


def eval_crop_size(given, small_input, ckpt_args=None, dataset="imagefolder"):
    """The input size of an evaluation and why: (size, reason, warning or None).

    A small-input trunk (3x3 stride-1 stem) is evaluated at the crop size it was pretrained with,
    as recorded in its checkpoint, else at its dataset's native size; an ImageNet-stem trunk at
    the native size of a built-in dataset, else at the protocol's 224. A --crop-size given for a
    small-input trunk more than 2x away from its pretraining size is allowed, with a warning."""
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


def collate_views(samples):
    """The collate_fn of every loader that may meet an encoded JPEG (sce.device_decode): samples are
    (views, bad, reason) in pretraining, (image, target) in evaluation. With no EncodedSample among
    them, torch's default_collate. Else a dict: jpeg, lengths (the encoded samples' bytes, end to end), encoded /
    decoded (their places in the batch), geometry (per view, (n_encoded, 9), on the host), images (per
    view, the decoded samples' tensors: uint8 crops in pretraining, normalised images in evaluation),
    keys; pretraining: sizes (of the views), params (per view, (N, 12) in batch order), bad, reasons;
    evaluation: targets."""
    first = [s[0] for s in samples]
    encoded = [i for i, x in enumerate(first) if isinstance(x, EncodedSample)]
    if not encoded:
        return torch.utils.data.default_collate(samples)
    decoded = [i for i, x in enumerate(first) if not isinstance(x, EncodedSample)]
    views = range(len(first[encoded[0]].geometry))
    # the files' bytes as one tensor: one shared-memory segment from a worker, not one per image
    batch = dict(jpeg=torch.cat([first[i].data for i in encoded]), lengths=[len(first[i].data) for i in encoded],
                 encoded=torch.tensor(encoded), decoded=torch.tensor(decoded, dtype=torch.long),
                 keys=[first[i].key for i in encoded],
                 geometry=[torch.stack([first[i].geometry[v] for i in encoded]) for v in views])
    if len(samples[0]) == 3:  # pretraining: a decoded sample's views are (uint8 crop, packed row) pairs
        batch["sizes"] = [int(first[encoded[0]].geometry[v][4]) for v in views]  # a view's side: its resize
        batch["images"] = [torch.stack([first[i][v][0] for i in decoded]) if decoded else None for v in views]
        batch["params"] = [torch.stack([x.params[v] if isinstance(x, EncodedSample) else x[v][1] for x in first])
                           for v in views]
        batch["bad"], batch["reasons"] = torch.tensor([s[1] for s in samples]), [s[2] for s in samples]
    else:  # evaluation: a decoded sample is its normalised image
        batch["images"] = [torch.stack([first[i] for i in decoded]) if decoded else None]
        batch["targets"] = torch.tensor([int(s[1]) for s in samples])
    return batch


def eval_resize(crop_size, small=False):
    """The short side images are resized to before the evaluation's centre crop: 256 for 224 (scaled
    with the crop) on large images; the resolution itself on small ones (paper supp.)."""
    return crop_size if small else int(crop_size * 256 / 224)


def eval_transform(train, crop_size=224, small=False):
    """Linear-evaluation transforms (paper supp.): large images RRC+flip / resize 256 + centre
    crop 224; small images random crop with 4 px padding + flip / resize to the resolution."""
    if small:
        ops = ([T.Resize(crop_size), T.RandomCrop(crop_size, padding=4), T.RandomHorizontalFlip()]
               if train else [T.Resize(crop_size), T.CenterCrop(crop_size)])
    else:
        ops = ([T.RandomResizedCrop(crop_size), T.RandomHorizontalFlip()] if train
               else [T.Resize(eval_resize(crop_size)), T.CenterCrop(crop_size)])
    return T.Compose(ops + [T.ToTensor(), T.Normalize(MEAN, STD)])


def load_rgb(path):
    """Open any image as 8-bit RGB: grayscale, palette, CMYK, alpha and 16-bit inputs included."""
    with open(path, "rb") as f:
        img = Image.open(f)
        img.load()
    return to_rgb(img)


def to_rgb(img):
    """A loaded PIL image of any mode as 8-bit RGB."""
    if img.mode in ("I", "I;16", "I;16B", "I;16L", "F"):
        arr = np.asarray(img, dtype=np.float64)
        arr = arr / 257.0 if arr.max() > 255 else arr  # 16-bit range down to 8 bits
        img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    if img.mode in ("P", "LA", "PA"):
        img = img.convert("RGBA")
    return img if img.mode == "RGB" else img.convert("RGB")


def load_rgb_tensor(path):
    """load_rgb as a uint8 tensor (3, H, W), for the loader of --augment gpu (decode_rgb_tensor)."""
    with open(path, "rb") as f:
        return decode_rgb_tensor(f.read())


def decode_rgb_tensor(data):
    """An image file's bytes as a uint8 RGB tensor (3, H, W). A colour or gray JPEG (most photo
    datasets) decodes straight into the tensor with torchvision's libjpeg-turbo: the same pixels as
    PIL's with the wheels of requirements.txt (tested), for ~8% less loader work per image
    (benchmarks/bench_pretrain.py). Unlike PIL, libjpeg prints its warnings about damaged data
    ("Corrupt JPEG data: ...") on stderr, at each read of such a file."""
    img = Image.open(io.BytesIO(data))  # parses the header only
    if decode_jpeg and img.format == "JPEG" and img.mode in ("RGB", "L"):
        try:
            return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        except RuntimeError:
            pass  # a damaged file: PIL's decoder below names the problem, as with --augment cpu
    img.load()
    return TF.pil_to_tensor(to_rgb(img))


def read_header(data):
    """(format, mode, (height, width), plain) of an image file's bytes, from its header alone. plain: a
    JPEG of the kind GPU decoders take, baseline, gray or YCbCr 4:4:4 / 4:2:2 / 4:2:0 (not progressive,
    not CMYK, not Adobe's RGB-coded kind)."""
    img = Image.open(io.BytesIO(data))
    plain = (img.format == "JPEG" and img.mode in ("RGB", "L") and not img.info.get("progressive")
             and img.info.get("adobe_transform") != 0
             and (img.mode == "L" or JpegImagePlugin.get_sampling(img) in (0, 1, 2)))
    return img.format, img.mode, (img.height, img.width), plain


def read_encoded(path):
    """A plain JPEG (read_header), which the training device decodes (sce.device_decode), as an Encoded:
    its bytes and its size from the header; any other file (PNG, progressive or CMYK JPEG, ...) decoded
    here into a uint8 tensor (3, H, W), as load_rgb_tensor."""
    with open(path, "rb") as f:
        data = f.read()
    _, _, size, plain = read_header(data)
    if decode_jpeg and plain:
        return Encoded(torch.frombuffer(bytearray(data), dtype=torch.uint8), size)
    return decode_rgb_tensor(data)


class Folder(ImageFolder):
    """ImageFolder that reads with load_rgb (load_rgb_tensor: as_tensor; read_encoded: encoded),
    tolerates empty class folders, and can keep only the classes of a list file (ImageNet100)."""

    def __init__(self, root, transform=None, classes=None, as_tensor=False, encoded=False):
        self.keep = classes
        loader = read_encoded if encoded else load_rgb_tensor if as_tensor else load_rgb
        super().__init__(root, transform=transform, loader=loader,
                         allow_empty=True)
        if not self.samples:
            raise UserError(f"no images found under {root}: expected one sub-folder of images "
                            "per class (ImageFolder layout)")

    def find_classes(self, directory):
        classes, _ = super().find_classes(directory)
        if self.keep is not None:
            missing = sorted(set(self.keep) - set(classes))
            if missing:
                raise UserError(f"{directory} lacks {len(missing)} of the listed classes "
                                f"(first: {missing[0]}): point --data at a full ImageNet split")
            classes = sorted(self.keep)
        return classes, {c: i for i, c in enumerate(classes)}

    def path(self, i):
        return self.samples[i][0]


class TinyImageNetVal(Dataset):
    """Tiny-ImageNet val/: images/ plus val_annotations.txt (file, wnid, box)."""

    def __init__(self, root, classes, transform=None):
        index = {c: i for i, c in enumerate(classes)}
        with open(os.path.join(root, "val_annotations.txt")) as f:
            rows = [line.split("\t")[:2] for line in f if line.strip()]
        self.samples = [(os.path.join(root, "images", name), index[wnid]) for name, wnid in rows]
        self.targets = [t for _, t in self.samples]
        self.transform = transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        img = load_rgb(self.samples[i][0])
        return (self.transform(img) if self.transform else img), self.samples[i][1]

    def path(self, i):
        return self.samples[i][0]


# torchvision reads CIFAR and STL10. Its classes compare every file with the official release's md5
# first: that hashes all of STL10 (3 GB) at each start and refuses valid files that are not those
# exact bytes (a re-export, the small files of our tests). An md5 of None makes torchvision's
# check_integrity test only that the file exists; a malformed file still fails when it is read.
def _no_md5(files):
    return [[name, None] for name, _ in files]


class CIFAR10Files(CIFAR10):
    """torchvision's CIFAR10 without the md5 check."""
    train_list, test_list, meta = _no_md5(CIFAR10.train_list), _no_md5(CIFAR10.test_list), dict(CIFAR10.meta, md5=None)


class CIFAR100Files(CIFAR100):
    """torchvision's CIFAR100 without the md5 check."""
    train_list, test_list, meta = _no_md5(CIFAR100.train_list), _no_md5(CIFAR100.test_list), dict(CIFAR100.meta, md5=None)


class STL10Files(STL10):
    """torchvision's STL10 without the md5 check, with `targets` as the other datasets (-1: unlabeled)."""
    train_list, test_list = _no_md5(STL10.train_list), _no_md5(STL10.test_list)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.targets = self.labels.astype(int).tolist()


def _torchvision_dataset(cls, root, what, **kwargs):
    """cls(root / the files' folder) with a one-line UserError naming the first missing file, or the
    folder of a file that does not read."""
    folder = os.path.join(root, cls.base_folder)
    if not os.path.isdir(folder) and os.path.basename(os.path.normpath(root)) == cls.base_folder:
        root, folder = os.path.dirname(os.path.normpath(root)), root  # --data pointed at the folder itself
    names = [n for n, _ in cls.train_list + cls.test_list] + ([cls.meta["filename"]] if hasattr(cls, "meta") else [])
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise UserError(f"{os.path.join(folder, missing[0])} not found: {what} needs {', '.join(names)} "
                        f"in {cls.base_folder}/ under --data")
    try:
        return cls(root, **kwargs)
    except Exception as e:  # pickle, reshape and key errors of a malformed file
        raise UserError(f"{folder} does not hold readable {what} files ({type(e).__name__}: {e})") from None


def read_cifar(root, train, num_classes=10, transform=None):
    """CIFAR python batches (cifar-10-batches-py/ or cifar-100-python/ under root), via torchvision."""
    cls = CIFAR10Files if num_classes == 10 else CIFAR100Files
    return _torchvision_dataset(cls, root, f"CIFAR{num_classes}", train=train, transform=transform)


def read_stl10(root, split, transform=None):
    """STL10 binaries (stl10_binary/ under root), via torchvision; split: train, test, unlabeled
    or train+unlabeled (the train images first)."""
    return _torchvision_dataset(STL10Files, root, "STL10", split=split, transform=transform)


def build_dataset(name, root, split="train", transform=None, class_list=None, as_tensor=False, encoded=False):
    """split: 'pretrain' (STL10: train + unlabeled), 'train' or 'val' (the test set of CIFAR/STL10).
    as_tensor: image files come as uint8 tensors (load_rgb_tensor); the others stay PIL images.
    encoded: baseline JPEG files come encoded, for the device's decoder (read_encoded)."""
    if not root or not os.path.exists(root):
        raise UserError(f"data path {root!r} does not exist: pass --data DIR")
    if name not in DATASETS:
        raise UserError(f"unknown dataset '{name}': use one of {', '.join(DATASETS)}")
    train = split in ("pretrain", "train")
    if name in ("cifar10", "cifar100"):
        ds = read_cifar(root, train, 10 if name == "cifar10" else 100, transform)
    elif name == "stl10":
        ds = read_stl10(root, "train+unlabeled" if split == "pretrain" else "train" if train else "test", transform)
    else:
        sub = os.path.join(root, "train" if train else "val")
        if name == "tiny-imagenet" and not train:
            classes = sorted(os.listdir(os.path.join(root, "train")))
            return TinyImageNetVal(sub, classes, transform)
        if not os.path.isdir(sub):
            if not train:
                raise UserError(f"{root} has no val/ folder: evaluation needs DATA/train and DATA/val")
            sub = root
        keep = None
        if name == "imagenet100":
            with open(class_list or IMAGENET100) as f:
                keep = f.read().split()
        return Folder(sub, transform, keep, as_tensor, encoded)
    return ds


def sample_seed(seed, epoch, index):
    """The RNG seed of one sample's views: numpy's SeedSequence hashes the triple, so no two
    (epoch, index) pairs of a run share a stream (a linear mix would: i + 100003 at epoch e
    colliding with i at epoch e + 1)."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1, np.uint64)[0])


class PretrainDataset(Dataset):
    """Multi-view samples whose augmentation is a pure function of (seed, epoch, index): the same
    images and views for any number of workers or ranks, and after a resume.

    An unreadable image is replaced by the next readable one; the sample reports the index and
    the reason so the main process can log it once and count it.
    """

    def __init__(self, dataset, transform, seed):
        self.dataset, self.transform, self.seed = dataset, transform, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        return self.sample(key, lambda i: self.dataset[i][0])

    def decoded(self, key):
        """The sample of `key` with its image decoded here, whatever the dataset's loader (an image the
        device's decoder could not read, sce.device_decode)."""
        return self.sample(key, lambda i: load_rgb_tensor(self.dataset.path(i)))

    def sample(self, key, read):
        epoch, index = key
        bad, reason = -1, ""
        for attempt in range(len(self.dataset)):
            i = (index + attempt) % len(self.dataset)
            try:
                img = read(i)
                break
            except Exception as e:  # decode errors come as many exception types
                if bad < 0:
                    bad, reason = i, f"{type(e).__name__}: {e}"[:300]
        else:
            raise UserError("no readable image in the dataset")
        with torch.random.fork_rng(devices=[]):
            # the CPU generator alone: torch.manual_seed would also queue a CUDA seeding, with a
            # stack trace, in every worker (0.5 ms a sample)
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
            views = self.transform(img)
        if isinstance(views, EncodedSample):
            views.key = key
        return views, bad, reason


class ResumableSampler(Sampler):
    """Yields (epoch, index) for this rank. Each epoch is a seeded permutation cut into global
    batches of `global_batch`; rank r takes the r-th slice of each, so N ranks see exactly the
    global batches one process would. set_epoch(epoch, start_step) skips finished steps."""

    def __init__(self, num_samples, global_batch, rank=0, world_size=1, seed=0):
        self.n, self.batch, self.rank, self.world, self.seed = num_samples, global_batch, rank, world_size, seed
        self.steps = num_samples // global_batch
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch, start_step=0):
        self.epoch, self.start_step = epoch, start_step

    def __len__(self):
        return (self.steps - self.start_step) * (self.batch // self.world)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.n, generator=g)[:self.steps * self.batch]
        mine = perm.view(self.steps, self.world, -1)[self.start_step:, self.rank].flatten()
        return iter([(self.epoch, i) for i in mine.tolist()])


def digits_imagefolder(root):
    """The embedded demo data: scikit-learn's 8x8 handwritten digits written once as 16x16 PNGs in
    ImageFolder layout (root/train, root/val; every 5th image held out), so the demo runs the
    real ImageFolder path."""
    if os.path.isfile(os.path.join(root, ".complete")):
        return root
    from sklearn.datasets import load_digits
    digits = load_digits()
    for i, (img, label) in enumerate(zip(digits.images, digits.target)):
        split = "val" if i % 5 == 0 else "train"
        folder = os.path.join(root, split, str(label))
        os.makedirs(folder, exist_ok=True)
        pixels = (img * (255.0 / 16.0)).astype(np.uint8)
        Image.fromarray(pixels).resize((16, 16), Image.BICUBIC).save(os.path.join(folder, f"{i:04d}.png"))
    open(os.path.join(root, ".complete"), "w").close()
    return root


def note_bad_images(bad, reasons, dataset, bad_seen, max_bad):
    """Log each unreadable image once (it was replaced by a readable one) and stop past max_bad."""
    if bool((bad >= 0).any()):
        for index, reason in zip(bad.tolist(), reasons):
            if index >= 0 and index not in bad_seen:
                bad_seen[index] = reason
                path = dataset.dataset.path(index) if hasattr(dataset.dataset, "path") else f"#{index}"
                print(f"warning: skipping unreadable image {path} ({reason})", flush=True)
        if len(bad_seen) > max_bad:
            raise UserError(f"{len(bad_seen)} unreadable images, more than --max-bad-images {max_bad}: "
                            "fix or remove them (see the warnings above)")
