"""Dataset readers, their images read by sce.data.images: each --dataset (its row in sce.layouts.DATASETS) by
the branch of build_dataset its format names (ImageFolder with class lists (ImageNet100), Tiny-ImageNet's val
annotations, CIFAR's python batches and STL10's binaries with a partial download named, their files listed and
checked by sce.layouts), VOC2007's image lists, the demo's digits, and a dataset's fingerprint."""
import hashlib
import os

import numpy as np
from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets import STL10, ImageFolder

from sce import UserError
from sce.data.images import READERS, load_rgb
from sce.layouts import (DATASETS, TINY_REMEDY, class_folders, labels, list_images, no_images, official_folder,
                         read_batch, tiny_imagenet_val)
from sce.metrics import VOC_CLASSES


class Folder(ImageFolder):
    """ImageFolder that reads with one of READERS, refuses an empty class folder, skips hidden ones, can keep
    only the classes of a list file (ImageNet100), and refuses a folder loop. torchvision walks the class folders
    following symbolic links (followlinks=True), so a link back up the tree (class_a/loop -> .. or -> DATA/train)
    would read the same images over and over, silently (64 images read as 2,624). A loop is refused with one
    line naming the link, not skipped: the link is a mistake in the data's layout, and dropping it quietly would
    train on other data than the user meant. Links that do not loop (a class folder, a sub-folder or a file that
    is a link elsewhere, one folder linked twice) read as torchvision reads them, the same files in the same
    order (make_dataset)."""

    def __init__(self, root, transform=None, classes=None, read="pil"):
        self.keep = classes
        super().__init__(root, transform=transform, loader=READERS[read], allow_empty=True)
        if not self.samples:
            raise no_images(root, self.classes)

    def find_classes(self, directory):
        classes = class_folders(directory)
        if self.keep is not None:
            missing = sorted(set(self.keep) - set(classes))
            if missing:
                raise UserError(f"{directory} lacks {len(missing)} of the listed classes "
                                f"(first: {missing[0]}): point --data at a full ImageNet split")
            classes = sorted(self.keep)
        return classes, {c: i for i, c in enumerate(classes)}

    @staticmethod
    def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        """torchvision's, refusing a folder loop (sce.layouts.list_images)."""
        return list_images(directory, class_to_idx, is_valid_file)

    def path(self, i):
        return self.samples[i][0]


class TinyImageNetVal(Dataset):
    """Tiny-ImageNet val/: images/ plus val_annotations.txt (file, wnid, box), every listed image checked
    to exist when read."""
    remedy = TINY_REMEDY

    def __init__(self, root, classes, transform=None):
        self.samples = tiny_imagenet_val(root, classes)
        self.targets = [t for _, t in self.samples]
        self.classes, self.transform, self.root = list(classes), transform, root

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        img = load_rgb(self.samples[i][0])
        return (self.transform(img) if self.transform else img), self.samples[i][1]

    def path(self, i):
        return self.samples[i][0]


# torchvision reads STL10. Its classes compare every file with the official release's md5 first: that hashes all of
# STL10 (3 GB) at each start and refuses valid files that are not those exact bytes (a re-export, the small files of
# our tests). An md5 of None makes torchvision's check_integrity test only that the file exists; a malformed file
# still fails when it is read.
def _no_md5(files):
    return [[name, None] for name, _ in files]


class CIFARFiles(Dataset):
    """CIFAR-10's or CIFAR-100's python batches (the Files of `name`'s row) as torchvision's CIFAR10 / CIFAR100 hold
    them (`data` (N, 32, 32, 3) uint8, `targets`, `classes`; an item is a PIL image and its label), but unpickled by
    sce.layouts.read_batch: torchvision's plain pickle.load would run the code a crafted batch carries."""

    def __init__(self, root, name, train, transform=None):
        download = DATASETS[name].download
        folder, files = os.path.join(root, download.folder), download.files
        entries = [read_batch(os.path.join(folder, n)) for n in (files.train if train else files.test)]
        self.data = np.vstack([e["data"] for e in entries]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        self.targets = [int(t) for e in entries for t in labels(e)]
        names = read_batch(os.path.join(folder, files.meta[0]), meta=True)
        self.classes = names.get("fine_label_names", names.get("label_names"))  # CIFAR-100's, CIFAR-10's
        self.transform = transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        img = Image.fromarray(self.data[i])
        return (self.transform(img) if self.transform else img), self.targets[i]


class STL10Files(STL10):
    """torchvision's STL10 without the md5 check, with `targets` as the other datasets (-1: unlabeled)."""
    train_list, test_list = _no_md5(STL10.train_list), _no_md5(STL10.test_list)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.targets = self.labels.astype(int).tolist()


def _official(cls, dataset, root, **kwargs):
    """cls(root / the files' folder), its files checked first (sce.layouts.official_folder: a missing, short or
    damaged file named in one line)."""
    root, folder = official_folder(dataset, root)
    what = DATASETS[dataset].download.files.name
    try:
        ds = cls(root, **kwargs)
    except Exception as e:  # what the checks do not see: one line, not torchvision's traceback
        raise UserError(f"{folder} does not hold readable {what} files ({type(e).__name__}: {e})") from None
    if len(ds.data) != len(ds.targets):  # torchvision pairs them in order: every later label would be shifted
        raise UserError(f"{folder} holds {len(ds.data)} images for {len(ds.targets)} labels: download {what} again")
    return ds


def read_folders(root, train, transform=None, class_list=None, read="pil"):
    """An ImageFolder's DATA/train, or DATA itself where it has no train/ (pretraining), or DATA/val, keeping the
    classes `class_list` (a file of class ids) names."""
    sub = os.path.join(root, "train" if train else "val")
    if not os.path.isdir(sub):
        if not train:
            raise UserError(f"{root} has no val/ folder: evaluation needs DATA/train and DATA/val")
        sub = root
    keep = None
    if class_list:
        with open(class_list) as f:
            keep = f.read().split()
    return Folder(sub, transform, keep, read)


def data_folder(root, flag="--data", dataset=None):
    """A UserError unless `root` (`flag`) is a folder, and, where `dataset` is read from its official files (CIFAR,
    STL-10), unless they are all there and whole (official_folder, as the reading checks them again: CIFAR-10's read
    in a tenth of a second, STL-10's sizes only). A script asks before it makes its output folder."""
    if not root or not os.path.exists(root):
        raise UserError(f"data path {root!r} does not exist: pass {flag} DIR")
    if not os.path.isdir(root):
        raise UserError(f"data path {root!r} is a file, not a folder: pass the folder that holds the dataset as "
                        f"{flag} DIR")
    if dataset in DATASETS and DATASETS[dataset].reader in ("cifar-batches", "stl10-binaries"):
        official_folder(dataset, root)


def build_dataset(name, root, split="train", transform=None, class_list=None, read="pil"):
    """The dataset `name` under `root`, read as its row of sce.layouts.DATASETS says. split: 'pretrain' (STL10:
    train + unlabeled), 'train' or 'val' (the test set of CIFAR/STL10). read: how image files are read (READERS):
    PIL images, uint8 tensors, or plain JPEGs left encoded for the device's decoder; CIFAR and STL10 images are PIL
    images."""
    data_folder(root)
    if name not in DATASETS:
        raise UserError(f"unknown dataset '{name}': use one of {', '.join(DATASETS)}")
    row, train = DATASETS[name], split in ("pretrain", "train")
    if row.reader == "cifar-batches":
        return _official(CIFARFiles, name, root, name=name, train=train, transform=transform)
    if row.reader == "stl10-binaries":  # torchvision's STL10 reads train+unlabeled with the train images first
        part = "train+unlabeled" if split == "pretrain" else "train" if train else "test"
        return _official(STL10Files, name, root, split=part, transform=transform)
    if row.reader == "annotated-val" and not train:
        return TinyImageNetVal(os.path.join(root, "val"), class_folders(os.path.join(root, "train")), transform)
    # the classes of the row's list, or of --class-list; none kept where the row has no list
    keep = (class_list or os.path.join(os.path.dirname(__file__), row.class_list)) if row.class_list else None
    return read_folders(root, train, transform, keep, read)


def read_voc07(root, split):
    """Image paths and a (N, 20) int8 label matrix (1 / -1 / 0 = difficult) of a VOC2007 split
    (trainval, test, train, val), from ImageSets/Main/<class>_<split>.txt."""
    data_folder(root)
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


def digits_imagefolder(root):
    """The embedded demo data: scikit-learn's 8x8 handwritten digits, each enlarged to 12 px and placed at a random
    spot (seeded, the same at every write) of a 16 px black canvas, written once as PNGs in ImageFolder layout
    (root/train, root/val; every 5th image held out), so the demo runs the real ImageFolder path. Centred, a
    random ResNet's features are as good for a kNN as what a few minutes of training learn (they keep the pixels'
    geometry, and a kNN on the pixels of centred digits is strong); placed anywhere, they are not, and what the
    crops of SCE's views teach (where a digit stands does not change what it is) shows in minutes."""
    if os.path.isfile(os.path.join(root, ".complete")):
        return root
    from sklearn.datasets import load_digits
    digits, spots = load_digits(), np.random.default_rng(0)
    for i, (img, label) in enumerate(zip(digits.images, digits.target)):
        split = "val" if i % 5 == 0 else "train"
        folder = os.path.join(root, split, str(label))
        os.makedirs(folder, exist_ok=True)
        digit = Image.fromarray((img * (255.0 / 16.0)).astype(np.uint8)).resize((12, 12), Image.BICUBIC)
        canvas = Image.new("L", (16, 16))
        canvas.paste(digit, tuple(int(v) for v in spots.integers(0, 5, 2)))
        canvas.save(os.path.join(folder, f"{i:04d}.png"))
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
