"""The datasets, one row each (`DATASETS`: how each is read, its official download, its native size),
and their files listed and checked whole without decoding an image and without torch
(benchmarks/reproduction/reproduce.sh checks its data with them in a second; sce.data.files reads through them): an
ImageFolder's class folders and image files (a folder loop refused), CIFAR's python batches (each batch's images against
its labels), STL-10's binaries (their sizes), Tiny-ImageNet's val annotations (every listed image present)."""
import dataclasses
import io
import os
import numpy as np

from sce import UserError, unpickling
from sce.unpickling import Refused


@dataclasses.dataclass(frozen=True)
class Files:
    """The files of an official download read from its folder (train, test, meta), as torchvision reads them, the
    name torchvision gives the dataset, and its number of classes (labels 0 to classes - 1)."""
    train: tuple
    test: tuple
    meta: tuple
    name: str
    classes: int = 10


@dataclasses.dataclass(frozen=True)
class Download:
    """A dataset's official download: its folder, what that holds (in words), names in it that tell it (the hint
    where an ImageFolder was expected), and its Files (None: it holds train/ and val/ folders)."""
    folder: str
    holds: str
    marks: tuple = ()
    files: Files = None


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A --dataset. reader: its format, a branch of sce.data.files.build_dataset: folders (DATA/train and DATA/val
    class folders), annotated-val (DATA/train's class folders, val/images listed in val/val_annotations.txt, as
    Tiny-ImageNet), cifar-batches, stl10-binaries. native_size: the size the paper pretrains and evaluates it at
    (None: an evaluation's 224). class_list: the classes kept of its folders (a file in sce/data/; --class-list
    replaces it). image_folders: reproduce.sh also takes train/ and val/ class folders of image files for it."""
    reader: str
    download: Download = None
    native_size: int = None
    class_list: str = None
    image_folders: bool = False

    @property
    def folders(self):
        """Read from DATA/train and DATA/val, not from an official download's files."""
        return self.download is None or self.download.files is None


DATASETS = {
    "imagefolder": Dataset("folders"),
    "imagenet100": Dataset("folders", class_list="imagenet100.txt"),
    "cifar10": Dataset(
        "cifar-batches", Download("cifar-10-batches-py", "CIFAR-10's python batches", ("data_batch_1",), Files(
            tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), ("batches.meta",), "CIFAR10")),
        native_size=32, image_folders=True),
    "cifar100": Dataset(
        "cifar-batches", Download("cifar-100-python", "CIFAR-100's python batches",
                                  files=Files(("train",), ("test",), ("meta",), "CIFAR100", 100)),
        native_size=32, image_folders=True),
    "stl10": Dataset(
        "stl10-binaries", Download("stl10_binary", "STL-10's binaries", ("train_X.bin",), Files(
            ("train_X.bin", "train_y.bin", "unlabeled_X.bin"), ("test_X.bin", "test_y.bin"), (), "STL10")),
        native_size=96),
    "tiny-imagenet": Dataset(
        "annotated-val", Download("tiny-imagenet-200", "Tiny-ImageNet's folders (train/<wnid>/images, val/images "
                                  "and val/val_annotations.txt)", ("wnids.txt",)),
        native_size=64)}
META_NAMES = {n for row in DATASETS.values() if row.download and row.download.files for n in row.download.files.meta}
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's
STL_IMAGE = 3 * 96 * 96
CIFAR_IMAGE = 3 * 32 * 32


def official_named(names):
    """The dataset whose official download one of `names` (a folder's entries) tells, or None."""
    return next((name for name, row in DATASETS.items() if row.download
                 for mark in (row.download.folder, *row.download.marks) if mark in names), None)


# ---------------------------------------------------------------- ImageFolder

def class_folders(directory):
    """The class folders of `directory`, sorted, hidden ones (.DS_Store's kin) skipped; none is one line naming
    the layout it holds if that is an official download."""
    classes = sorted(e.name for e in os.scandir(directory) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        names = os.listdir(directory)
        official = official_named(names)
        fix = (f"it holds {official}'s official files: pass --dataset {official}" if official else
               "expected one sub-folder of images per class (ImageFolder layout)")
        raise UserError(f"{directory} has no class folders ({len(names)} files or hidden folders): {fix}")
    return classes


def list_images(directory, class_to_idx, is_valid=None):
    """torchvision's make_dataset: (path, class index) of every image file under each class folder, sorted folders
    then sorted files, links followed; raising a UserError at a folder loop, which torchvision would read over and
    over (64 images read as 2,624). A folder loops when its real path is that of a folder on the way in to it, or
    holds one (a link to DATA or / above it): the walk keeps the real paths of its way alone, one realpath a
    folder, so a folder of 1.28M files costs no more than its listing. The files of other kinds (a GIF, which PIL
    reads and torchvision's ImageFolder does not) are said, a line a kind; a class folder without an image is
    refused as torchvision refuses it (none at all: the caller's no_images)."""
    is_valid = is_valid or (lambda path: path.lower().endswith(IMAGE_EXTENSIONS))
    top, samples, skipped, empty = os.path.realpath(directory), [], {}, []
    for name in sorted(class_to_idx):
        target, found = os.path.join(directory, name), len(samples)
        if not os.path.isdir(target):
            continue
        walked = [(root, names) for root, _, names in walk(target, directory, (top,))]
        for root, names in sorted(walked):
            for path in (os.path.join(root, n) for n in sorted(names)):
                if is_valid(path):
                    samples.append((path, class_to_idx[name]))
                elif not os.path.basename(path).startswith("."):
                    kind = os.path.splitext(path)[1].lower() or "(no extension)"
                    skipped[kind] = skipped.get(kind, 0) + 1
        if len(samples) == found:
            empty.append(target)
    for kind, count in sorted(skipped.items()):
        print(f"=> {directory}: {count} {kind} file(s) skipped, not of the kinds ImageFolder reads "
              f"({' '.join(IMAGE_EXTENSIONS)})", flush=True)
    if empty and samples:
        raise UserError(f"the class folder {empty[0]} holds no image ({len(empty)} of the {len(class_to_idx)} hold "
                        f"none; ImageFolder reads {' '.join(IMAGE_EXTENSIONS)}): add images or remove the folder")
    return samples


def walk(folder, directory, way=()):
    """os.walk(folder, followlinks=True), a UserError at a folder loop (_walk_step); `way`: the real paths on the way
    in to `folder` from `directory`, (its real path,) where `folder` lies below it."""
    ways = {folder: _walk_step(folder, way, directory)}  # folder -> the real paths on the way in to it
    for root, folders, names in os.walk(folder, followlinks=True):
        way = ways.pop(root)
        for name in folders:
            ways[os.path.join(root, name)] = _walk_step(os.path.join(root, name), way, directory)
        yield root, folders, names


def _walk_step(folder, way, directory):
    """The real paths on the way in to `folder` and through it (`way` + its own; way[0]: the top's), or a UserError
    naming the link if following it loops: its real path is one on the way in, or one above such a folder."""
    real = os.path.realpath(folder)
    inside = os.path.join(real, "")
    if any(seen == real or seen.startswith(inside) for seen in way):
        link = os.path.join(way[-1], os.path.basename(folder))  # where the link lies, if the way in took another
        walked = os.path.relpath(folder, directory) == os.path.relpath(link, way[0])
        raise UserError(f"{folder}{'' if walked else f' (the link {link})'} links back to {real} (a folder loop): "
                        "remove the link, as ImageFolder would read the images under it again and again")
    return way + (real,)


def image_folder(directory):
    """(classes, [(path, class index)]) of an ImageFolder, as sce.data.files.Folder lists it; no image at all is
    one line."""
    classes = class_folders(directory)
    samples = list_images(directory, {c: i for i, c in enumerate(classes)})
    if not samples:
        raise no_images(directory, classes)
    return classes, samples


def no_images(directory, classes):
    """The error of an ImageFolder without images, naming the official download it holds if it is one."""
    official = official_named(classes)
    return UserError(f"no images found under {directory}: " + (
        f"it holds {official}'s official files: pass --dataset {official}" if official else
        "expected one sub-folder of images per class (ImageFolder layout)"))


def check_classes(n, classes, val_classes, where, val_where):
    """An evaluation's `n` classes: two or more, and val's (if named) the same as train's, else one line."""
    if n < 2:
        raise UserError(f"{where} holds a single class ({classes[0] if classes else 0}): "
                        "a classifier needs at least 2 classes (one sub-folder per class)")
    if classes and val_classes and list(val_classes) != list(classes):
        odd = sorted(set(val_classes) ^ set(classes))
        raise UserError(f"{val_where} and {where} have different classes "
                        f"(first difference: {odd[0] if odd else 'order'}): both need the same class folders")
    return n


# ---------------------------------------------------------------- CIFAR and STL-10

def official_folder(dataset, root):
    """(the root torchvision reads, the folder of the files) of CIFAR or STL-10 under --data `root` (or `root`
    itself being that folder), every file present, each CIFAR batch's images as many as its labels, each STL-10
    binary whole images as many as its labels; else one line naming the first file at fault."""
    row = DATASETS[dataset]
    base, files = row.download.folder, row.download.files
    folder, what = os.path.join(root, base), files.name
    if not os.path.isdir(folder) and os.path.basename(os.path.normpath(root)) == base:
        root, folder = os.path.dirname(os.path.normpath(root)), root  # --data pointed at the folder itself
    names = files.train + files.test + files.meta
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise UserError(f"{os.path.join(folder, missing[0])} not found: {what} needs {', '.join(names)} "
                        f"in {base}/ under --data")
    damaged = (short_binary(folder, names) if row.reader == "stl10-binaries" else
               damaged_batch(folder, names, files.classes))
    if damaged:
        raise UserError(f"{damaged}: download {what} again")
    return root, folder


def official_sizes(dataset, folder):
    """{split: images} of checked official files (official_folder): train, val (the test set), and STL-10's
    unlabeled."""
    if DATASETS[dataset].reader == "stl10-binaries":
        return {"train": os.path.getsize(os.path.join(folder, "train_y.bin")),
                "val": os.path.getsize(os.path.join(folder, "test_y.bin")),
                "unlabeled": os.path.getsize(os.path.join(folder, "unlabeled_X.bin")) // STL_IMAGE}
    files = DATASETS[dataset].download.files
    return {"train": sum(len(labels(read_batch(os.path.join(folder, n)))) for n in files.train),
            "val": sum(len(labels(read_batch(os.path.join(folder, n)))) for n in files.test)}


def labels(entry):
    """A CIFAR batch's labels (CIFAR-100: its fine labels), or None (the meta file)."""
    return entry.get("labels", entry.get("fine_labels")) if isinstance(entry, dict) else None


class NotABatch(Refused):
    """A CIFAR file whose content is not the release's structure (its line names the file)."""


MAX_BATCH_BYTES = 512 * 2 ** 20
LABEL_KEYS = ("labels", "fine_labels")  # CIFAR-10's, CIFAR-100's
NAME_KEYS = ("label_names", "fine_label_names")  # their meta files'


class _Batch(unpickling.Reader):
    """The unpickler of CIFAR's files: numpy's arrays of plain numbers and Python's plain values, nothing else."""

    def __init__(self, f):
        super().__init__(f, unpickling.NUMPY_BUILT, encoding="latin1")


def read_batch(path, classes=None, meta=False):
    """A CIFAR python batch or meta file unpickled as the release's Python 2 files need (latin-1), without running
    code and within a bound on the objects it builds (sce.unpickling: a pickle that would call anything but numpy's
    array rebuilding, or build an array of another dtype than plain numbers, or more objects than the bound, is
    Refused), then checked to be exactly the release's structure before anything walks it (batch_structure). A batch
    is returned with its labels a list of ints (`classes`: each below it) and `data` a plain (N, 3072) uint8 array;
    `meta`: the file is the meta file (its class names), else a batch."""
    size = os.path.getsize(path)
    if size > MAX_BATCH_BYTES:  # a single op of its pickle could hold all of it in memory
        raise NotABatch(f"{path} is {size / 2 ** 20:.0f} MiB, more than any CIFAR file (CIFAR-100's train: 155 MiB)")
    with open(path, "rb") as file:  # in memory: an op's declared length (2**40 bytes) is then no allocation's
        f = io.BytesIO(file.read())
    unpickling.scan(f)
    entry = _Batch(f).load()
    return batch_structure(entry, path, classes, meta)


def _a(obj):
    """'a list', 'an int': the name of `obj`'s type with its article."""
    name = type(obj).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _strings(value):
    return isinstance(value, list) and all(isinstance(v, (str, bytes)) for v in value)


def batch_structure(entry, path, classes=None, meta=False):
    """`entry` if it is the release's structure, NotABatch naming the first difference: a dict of str keys; a batch's
    labels (LABEL_KEYS) a list of ints or a 1-d integer array, each of `classes`, its `data` a uint8 array of N rows
    of 3072 bytes, N its labels; a meta file's class names (NAME_KEYS) a list of strings; any other value a string, an
    int, or a list of strings or ints (filenames, CIFAR-100's coarse labels). Each check looks at each value once:
    shared references (a list of itself, 40 deep) are refused, never expanded."""
    if not isinstance(entry, dict) or not all(isinstance(k, str) for k in entry):
        raise NotABatch(f"{path} holds {_a(entry)}, not a CIFAR batch (a dict of data and labels)")
    key, keys = next((k for k in LABEL_KEYS if k in entry), None), ", ".join(sorted(entry))[:80]
    if meta:
        if not any(_strings(entry.get(k)) for k in NAME_KEYS):
            raise NotABatch(f"{path} holds no class names ({' or '.join(NAME_KEYS)}; keys: {keys}): it is no CIFAR "
                            "meta file")
    elif key is None:
        raise NotABatch(f"{path} holds {'images but ' if 'data' in entry else ''}no labels (keys: {keys})")
    else:
        entry = dict(entry, **{key: _labels(entry[key], path, classes), "data": _images(entry.get("data"), path)})
        if len(entry["data"]) != len(entry[key]):
            raise NotABatch(f"{path} holds {len(entry['data'])} images for {len(entry[key])} labels")
    for k, v in entry.items():
        if k not in ("data", key) and not (isinstance(v, (str, bytes, int)) or _strings(v)
                                            or (isinstance(v, list) and all(type(x) is int for x in v))):
            raise NotABatch(f"{path} holds {_a(v)} under {k!r}, which CIFAR's files never do")
    return entry


def _labels(found, path, classes):
    """The labels of a batch as a list of ints: a list of ints or a 1-d integer array, each of `classes`."""
    if isinstance(found, np.ndarray) and found.ndim == 1 and found.dtype.kind in "iu":
        found = found.tolist()
    if not isinstance(found, list):
        what = f"a {found.ndim}-d array of {found.dtype}" if isinstance(found, np.ndarray) else _a(found)
        raise NotABatch(f"{path} holds labels that are {what}, not a list or a 1-d integer array")
    odd = next((i for i, t in enumerate(found) if type(t) is not int), None)
    if odd is not None:
        raise NotABatch(f"{path} holds {_a(found[odd])} as label {odd}, not an integer")
    if classes:
        odd = next((t for t in found if not 0 <= t < classes), None)
        if odd is not None:
            raise NotABatch(f"{path} holds the label {odd!r}, not one of its {classes} classes (0 to {classes - 1})")
    return found


def _images(data, path):
    shape, dtype = getattr(data, "shape", None), getattr(data, "dtype", type(data).__name__)
    if not isinstance(data, np.ndarray) or len(shape) != 2 or shape[1] != CIFAR_IMAGE or dtype != np.uint8:
        raise NotABatch(f"{path} holds images of shape {shape} and type {dtype}, not CIFAR's rows of {CIFAR_IMAGE} "
                        f"bytes (N, {CIFAR_IMAGE}) uint8")
    return data.view(np.ndarray)


def short_binary(folder, names):
    """'PATH is ...' for the first STL-10 image file that is not whole 3x96x96 images, as many as its labels,
    else None (its size alone: no file is read)."""
    sizes = {n: os.path.getsize(os.path.join(folder, n)) for n in names}
    for name in [n for n in names if n.endswith("_X.bin")]:
        path, labels_file = os.path.join(folder, name), name.replace("_X.bin", "_y.bin")
        images = sizes[name] // STL_IMAGE
        if sizes[name] % STL_IMAGE:
            return f"{path} is cut short ({sizes[name]} bytes, not whole 3x96x96 images)"
        if labels_file in sizes and images != sizes[labels_file]:
            return f"{path} holds {images} images for the {sizes[labels_file]} labels of {labels_file}"
    return None


def damaged_batch(folder, names, classes=10):
    """'PATH ...' for the first CIFAR file cut short or damaged, calling what a batch does not (a pickle that would
    run code), building more objects than the bound, or not of the release's structure (read_batch), else None: the
    same check as the readers' (sce.data.files, reproduce.sh), so that nothing it passes fails there."""
    for name in [n for n in names if not n.endswith(".bin")]:
        path = os.path.join(folder, name)
        try:
            read_batch(path, classes, meta=name in META_NAMES)
        except NotABatch as e:
            return str(e)
        except unpickling.Refused as e:
            return f"{path} is no CIFAR batch: {e}"
        except Exception as e:  # noqa: BLE001: a truncated pickle fails in many ways
            return f"{path} does not unpickle ({type(e).__name__}: {str(e)[:80]}): it is cut short or damaged"
    return None


# ---------------------------------------------------------------- Tiny-ImageNet

TINY_REMEDY = "restore it from the download, or remove its line from val_annotations.txt"


def tiny_imagenet_val(root, classes):
    """[(path, class index)] of Tiny-ImageNet's val/ (`root`): images/ and val_annotations.txt (file, wnid, box),
    every listed image present and of a class of train/ (`classes`), else one line naming it."""
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
                        f"({len(missing)} listed images are): {TINY_REMEDY}")
    return [(os.path.join(images, name), index[wnid]) for _, name, wnid in rows]
