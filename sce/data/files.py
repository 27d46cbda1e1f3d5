"""Dataset readers: image files of any mode as RGB (PIL, or libjpeg-turbo into a tensor, or a plain JPEG's bytes
for the device's decoder), ImageFolder with class lists (ImageNet100), Tiny-ImageNet's val annotations, CIFAR's
python batches and STL10's binaries with a partial download named, VOC2007's image lists, the demo's digits,
and a dataset's fingerprint."""
import hashlib
import io
import os
import warnings

import numpy as np
import torch
import torchvision.transforms.functional as TF
from PIL import Image, JpegImagePlugin
from torch.utils.data import Dataset
from torchvision.datasets import CIFAR10, CIFAR100, STL10, ImageFolder

try:  # libjpeg-turbo to a tensor; torchvision 0.29 deprecates it for TorchCodec: PIL decodes once it is gone
    from torchvision.io import ImageReadMode, decode_jpeg
    warnings.filterwarnings("ignore", "The image decoding and encoding capabilities of TorchVision are deprecated",
                            DeprecationWarning)  # once per image otherwise, an error under -W error
except ImportError:
    decode_jpeg = None

from sce import UserError
from sce.metrics import VOC_CLASSES

IMAGENET100 = os.path.join(os.path.dirname(__file__), "imagenet100.txt")
DATASETS = ["imagefolder", "imagenet100", "cifar10", "cifar100", "stl10", "tiny-imagenet"]


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


class Encoded:
    """A JPEG file's bytes (uint8 tensor) and its (height, width) from the header: decoded later, on the
    training device (sce.data.jpeg)."""

    def __init__(self, data, size):
        self.data, self.size = data, size


def read_encoded(path):
    """A plain JPEG (read_header), which the training device decodes (sce.data.jpeg), as an Encoded:
    its bytes and its size from the header; any other file (PNG, progressive or CMYK JPEG, ...) decoded
    here into a uint8 tensor (3, H, W), as load_rgb_tensor."""
    with open(path, "rb") as f:
        data = f.read()
    _, _, size, plain = read_header(data)
    if decode_jpeg and plain:
        return Encoded(torch.frombuffer(bytearray(data), dtype=torch.uint8), size)
    return decode_rgb_tensor(data)


# an official download given where an ImageFolder is read: its folder (or a file in it) -> its --dataset
OFFICIAL_LAYOUTS = {"cifar-10-batches-py": "cifar10", "data_batch_1": "cifar10", "cifar-100-python": "cifar100",
                    "stl10_binary": "stl10", "train_X.bin": "stl10", "tiny-imagenet-200": "tiny-imagenet",
                    "wnids.txt": "tiny-imagenet"}


def class_folders(directory):
    """The class folders of `directory`, sorted, hidden ones (.DS_Store's kin) skipped; none is one line naming
    the layout it holds if that is an official download."""
    classes = sorted(e.name for e in os.scandir(directory) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        names = os.listdir(directory)
        official = next((OFFICIAL_LAYOUTS[n] for n in names if n in OFFICIAL_LAYOUTS), None)
        fix = (f"it holds {official}'s official files: pass --dataset {official}" if official else
               "expected one sub-folder of images per class (ImageFolder layout)")
        raise UserError(f"{directory} has no class folders ({len(names)} files or hidden folders): {fix}")
    return classes


READERS = {"pil": load_rgb, "tensor": load_rgb_tensor, "encoded": read_encoded}  # how image files are read


class Folder(ImageFolder):
    """ImageFolder that reads with one of READERS, tolerates empty class folders, skips hidden ones, and can
    keep only the classes of a list file (ImageNet100)."""

    def __init__(self, root, transform=None, classes=None, read="pil"):
        self.keep = classes
        super().__init__(root, transform=transform, loader=READERS[read], allow_empty=True)
        if not self.samples:
            official = next((OFFICIAL_LAYOUTS[c] for c in self.classes if c in OFFICIAL_LAYOUTS), None)
            raise UserError(f"no images found under {root}: " + (
                f"it holds {official}'s official files: pass --dataset {official}" if official else
                "expected one sub-folder of images per class (ImageFolder layout)"))

    def find_classes(self, directory):
        classes = class_folders(directory)
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
    """Tiny-ImageNet val/: images/ plus val_annotations.txt (file, wnid, box), every listed image checked
    to exist when read."""
    remedy = "restore it from the download, or remove its line from val_annotations.txt"

    def __init__(self, root, classes, transform=None):
        index = {c: i for i, c in enumerate(classes)}
        listing = os.path.join(root, "val_annotations.txt")
        if not os.path.isfile(listing):
            raise UserError(f"{listing} not found: Tiny-ImageNet's val/ holds images/ and val_annotations.txt")
        rows = []
        with open(listing) as f:
            for number, line in enumerate(f, 1):
                fields = line.rstrip("\n").split("\t")
                if len(fields) < 2 and line.strip():
                    raise UserError(f"{listing} line {number} is not 'FILE<tab>WNID<tab>box': {line.strip()[:60]!r}; "
                                    "restore the file from the download")
                if line.strip():
                    rows.append((number, fields[0], fields[1]))
        unknown = sorted({wnid for _, _, wnid in rows} - set(index))
        if unknown:
            raise UserError(f"{listing} names {len(unknown)} classes that train/ lacks (first: {unknown[0]}): "
                            "train/ needs one folder per class")
        images = os.path.join(root, "images")
        present = set(os.listdir(images)) if os.path.isdir(images) else set()
        missing = [(number, name) for number, name, _ in rows if name not in present]
        if missing:
            number, name = missing[0]
            raise UserError(f"{os.path.join(images, name)}, listed on line {number} of {listing}, is missing "
                            f"({len(missing)} listed images are): {self.remedy}")
        self.samples = [(os.path.join(images, name), index[wnid]) for _, name, wnid in rows]
        self.targets = [t for _, t in self.samples]
        self.classes, self.transform, self.root = list(classes), transform, root

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
    train_list, test_list = _no_md5(CIFAR100.train_list), _no_md5(CIFAR100.test_list)
    meta = dict(CIFAR100.meta, md5=None)


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
    short = _short_binary(folder, names)  # torchvision would pair shifted labels with the images of a short file
    if short:
        raise UserError(f"{short}: download {what} again")
    try:
        ds = cls(root, **kwargs)
    except Exception as e:  # pickle, reshape and key errors of a malformed file: name it if a batch is cut short
        damaged = _damaged_batch(folder, names)
        raise UserError(f"{damaged}: download {what} again" if damaged else
                        f"{folder} does not hold readable {what} files ({type(e).__name__}: {e})") from None
    if len(ds.data) != len(ds.targets):  # torchvision pairs them in order: every later label would be shifted
        damaged = _damaged_batch(folder, names) or f"{folder} holds {len(ds.data)} images for {len(ds.targets)} labels"
        raise UserError(f"{damaged}: download {what} again")
    return ds


def _short_binary(folder, names):
    """'PATH is ...' for the first STL10 image file that is not whole 3x96x96 images, as many as its labels,
    else None (its size alone: no file is read)."""
    sizes = {n: os.path.getsize(os.path.join(folder, n)) for n in names}
    for name in [n for n in names if n.endswith("_X.bin")]:
        path, labels = os.path.join(folder, name), name.replace("_X.bin", "_y.bin")
        images = sizes[name] // (3 * 96 * 96)
        if sizes[name] % (3 * 96 * 96):
            return f"{path} is cut short ({sizes[name]} bytes, not whole 3x96x96 images)"
        if labels in sizes and images != sizes[labels]:
            return f"{path} holds {images} images for the {sizes[labels]} labels of {labels}"
    return None


def _damaged_batch(folder, names):
    """'PATH ...' for the first CIFAR batch file cut short or damaged, or holding more images than labels or
    fewer, else None."""
    import pickle
    for name in [n for n in names if not n.endswith(".bin")]:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f, encoding="latin1")
        except Exception as e:  # noqa: BLE001: a truncated pickle fails in many ways
            return f"{path} does not unpickle ({type(e).__name__}: {str(e)[:80]}): it is cut short or damaged"
        labels = entry.get("labels", entry.get("fine_labels")) if isinstance(entry, dict) else None
        if labels is not None and len(entry.get("data", ())) != len(labels):
            return f"{path} holds {len(entry['data'])} images for {len(labels)} labels"
    return None


def read_cifar(root, train, num_classes=10, transform=None):
    """CIFAR python batches (cifar-10-batches-py/ or cifar-100-python/ under root), via torchvision."""
    cls = CIFAR10Files if num_classes == 10 else CIFAR100Files
    return _torchvision_dataset(cls, root, f"CIFAR{num_classes}", train=train, transform=transform)


def read_stl10(root, split, transform=None):
    """STL10 binaries (stl10_binary/ under root), via torchvision; split: train, test, unlabeled
    or train+unlabeled (the train images first)."""
    return _torchvision_dataset(STL10Files, root, "STL10", split=split, transform=transform)


def build_dataset(name, root, split="train", transform=None, class_list=None, read="pil"):
    """split: 'pretrain' (STL10: train + unlabeled), 'train' or 'val' (the test set of CIFAR/STL10).
    read: how image files are read (READERS): PIL images, uint8 tensors, or plain JPEGs left encoded for the
    device's decoder; CIFAR and STL10 images are PIL images."""
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
            return TinyImageNetVal(sub, class_folders(os.path.join(root, "train")), transform)
        if not os.path.isdir(sub):
            if not train:
                raise UserError(f"{root} has no val/ folder: evaluation needs DATA/train and DATA/val")
            sub = root
        keep = None
        if name == "imagenet100":
            with open(class_list or IMAGENET100) as f:
                keep = f.read().split()
        return Folder(sub, transform, keep, read)
    return ds


def read_voc07(root, split):
    """Image paths and a (N, 20) int8 label matrix (1 / -1 / 0 = difficult) of a VOC2007 split
    (trainval, test, train, val), from ImageSets/Main/<class>_<split>.txt."""
    main = os.path.join(root, "ImageSets", "Main")
    names, columns = None, []
    for cls in VOC_CLASSES:
        path = os.path.join(main, f"{cls}_{split}.txt")
        if not os.path.isfile(path):
            raise UserError(f"{path} not found: a VOC2007 tree needs JPEGImages/ and "
                            f"ImageSets/Main/<class>_{split}.txt for each of the 20 classes")
        rows = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                parts = line.split()
                if not parts:
                    continue
                if len(parts) != 2 or parts[1] not in ("1", "-1", "0"):
                    raise UserError(f"{path} line {n}: expected '<image id> <1|-1|0>', got {line.strip()!r}")
                rows.append(parts)
        ids = [r[0] for r in rows]
        if names is None:
            names = ids
        elif ids != names:
            raise UserError(f"{path} lists other images than {VOC_CLASSES[0]}_{split}.txt: "
                            "every class file of a split must list the same images in the same order")
        columns.append([int(r[1]) for r in rows])
    if not names:
        raise UserError(f"{main}/*_{split}.txt list no image")
    paths = [os.path.join(root, "JPEGImages", f"{n}.jpg") for n in names]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise UserError(f"{missing[0]} not found ({len(missing)} images of the {split} split missing): "
                        "expected JPEGImages/<image id>.jpg")
    return paths, np.array(columns, dtype=np.int8).T


class ImageList(Dataset):
    """Images from a list of paths with their targets (any array indexed by image), read as READERS[read];
    an image's target is its index (VOC07's label rows stay with the caller)."""

    def __init__(self, paths, targets, transform=None, read="pil"):
        self.paths, self.targets, self.transform, self.read = paths, targets, transform, READERS[read]

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = self.read(self.paths[i])
        return (self.transform(img) if self.transform else img), i

    def path(self, i):
        return self.paths[i]


class UnreadableImage(UserError):
    """An image an evaluation cannot read. Raised in a loader worker, torch raises it again in the main
    process with the worker's traceback as its message: the last line, this error's own, is kept."""

    def __init__(self, message):
        super().__init__(message.strip().splitlines()[-1].split("UnreadableImage: ", 1)[-1])

    @classmethod
    def of(cls, dataset, index, reason, others=0):
        more = f"; {others} more unreadable images" if others else ""
        reason = (str(reason).strip().splitlines() or ["?"])[0][:200]
        remedy = getattr(unwrap(dataset, index)[0], "remedy", "fix or remove it")
        return cls(f"cannot read {image_path(dataset, index)} ({reason}){more}: {remedy} (an evaluation reads every "
                   "image)")


def skip_unreadable(dataset, new, total, max_bad):
    """Pretraining replaces an unreadable image by the next readable one: name each one newly met ({index: reason})
    in a warning, and stop once there are more than --max-bad-images in all (`total`)."""
    for i, reason in sorted(new.items()):
        print(f"warning: skipping unreadable image {image_path(dataset, i)} ({reason})", flush=True)
    if total > max_bad:
        raise UserError(f"{total} unreadable images, more than --max-bad-images {max_bad}: fix or remove them (see "
                        "the warnings above)")


def unwrap(dataset, i):
    """(the dataset under any Subsets, and image i's index there)."""
    while isinstance(dataset, torch.utils.data.Subset):
        dataset, i = dataset.dataset, dataset.indices[i]
    return dataset, i


def image_path(dataset, i):
    """The file of image i of a dataset (through Subsets), or its index where it has none (CIFAR, STL10)."""
    dataset, i = unwrap(dataset, i)
    return dataset.path(i) if hasattr(dataset, "path") else f"image #{i}"


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


def fingerprint(dataset):
    """A short hash of what a dataset holds, in order: its files (paths under its root) and labels, or for
    CIFAR and STL10 their labels and every n-th image (2,048 of them). A mid-epoch resume compares it: the
    epoch's order, half done, is that of the data it began on."""
    h = hashlib.blake2b(str(len(dataset)).encode(), digest_size=8)
    if hasattr(dataset, "samples"):
        skip = len(os.path.join(getattr(dataset, "root", ""), ""))
        h.update("\n".join(f"{path[skip:]}\t{target}" for path, target in dataset.samples).encode())
    else:
        h.update(np.asarray(dataset.targets, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(dataset.data[::max(1, len(dataset.data) // 2048)]).tobytes())
    return h.hexdigest()
