"""The dataset readers (sce.data.files) on small files written in the real formats: CIFAR's python batches, STL-10's
binaries, Tiny-ImageNet's folders and ImageNet100's class list, images of every mode as RGB (PIL and the tensor
reader alike), missing and empty data, and a dataset's fingerprint."""
import codecs
import os
import pickle
import re

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from PIL import Image

from conftest import python2_pickle, write_cifar, write_imagefolder
from sce import UserError
from sce.data import build_dataset, fingerprint
from sce.data import images as files
from sce.data.images import load_rgb, load_rgb_tensor


def test_cifar_batches(tmp_path):
    folder = write_cifar(tmp_path)
    train = build_dataset("cifar10", str(tmp_path), "train")
    assert len(train) == 20 and train.targets[:4] == [0, 1, 2, 3] and train.classes[3] == "class3"
    with open(folder / "data_batch_1", "rb") as f:
        raw = pickle.load(f, encoding="latin1")["data"][1]
    img, label = train[1]
    assert label == 1 and np.array_equal(np.asarray(img)[:, :, 0], raw[:1024].reshape(32, 32))
    assert len(build_dataset("cifar10", str(tmp_path), "val")) == 4
    assert len(build_dataset("cifar10", str(folder), "val")) == 4  # --data at the batches folder itself
    tf = T.Compose([T.ToTensor()])
    assert build_dataset("cifar10", str(tmp_path), "train", tf)[0][0].shape == (3, 32, 32)
    with pytest.raises(UserError, match=r"cifar-100-python/train not found: CIFAR100 needs train, test, meta"):
        build_dataset("cifar100", str(tmp_path), "train")
    hundred = write_cifar(tmp_path / "c100", num_classes=100, per_batch=3)
    assert build_dataset("cifar100", str(tmp_path / "c100"), "val").targets == [0, 1, 2]
    (hundred / "test").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match=r"cifar-100-python/test does not unpickle \(.*\): it is cut short or "
                                         r"damaged: download CIFAR100 again") as info:
        build_dataset("cifar100", str(tmp_path / "c100"), "val")
    assert "\n" not in str(info.value)


class RunsCode:
    """Unpickled, calls `call(*args)`: what a crafted CIFAR batch carries."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def shared_lists(levels):
    """A list of two references to one list, `levels` deep: a few hundred bytes of pickle that a walk expands to
    2**levels objects."""
    nested = []
    for _ in range(levels):
        nested = [nested, nested]
    return nested


@pytest.mark.parametrize("batch,line", [
    ({"labels": 3, "data": np.zeros((1, 3072), np.uint8)}, "holds labels that are an int, not a list or a 1-d integer "
                                                             "array"),
    ({"labels": np.array(3), "data": np.zeros((1, 3072), np.uint8)}, "holds labels that are a 0-d array of int64, not "
                                                                       "a list or a 1-d integer array"),
    ({"labels": [[0], [1]], "data": np.zeros((2, 3072), np.uint8)}, "holds a list as label 0, not an integer"),
    ({"data": np.zeros((2, 3072), np.uint8), "batch_label": "x"}, "holds images but no labels (keys: batch_label, "
                                                                   "data)"),
    ({"labels": shared_lists(40), "data": shared_lists(40)}, "holds a list as label 0, not an integer"),
    (shared_lists(40), "holds a list, not a CIFAR batch (a dict of data and labels)"),
    ({"labels": [0, 1], "data": np.zeros((2, 3072), np.uint8), "filenames": shared_lists(40)},
     "holds a list under 'filenames', which CIFAR's files never do"),
    ({"labels": np.arange(2), "data": np.zeros((3, 3072), np.uint8)}, "holds 3 images for 2 labels"),
    ({"label_names": ["a", "b"]}, "holds no labels (keys: label_names)")])
def test_a_batch_not_of_the_release_structure_is_one_line_at_the_check_and_the_reader(tmp_path, batch, line):
    """Labels that are an int, a 0-d array, lists; a dict without labels; 40 levels of shared lists (2**40 objects
    if walked): the layout check (main_pretrain.py's, main_lincls.py's) and the reader reproduce.sh uses both refuse it
    in one line at once, the same line."""
    import time
    from sce.layouts import NotABatch, read_batch
    folder = write_cifar(tmp_path / "data", per_batch=2)
    (folder / "data_batch_2").write_bytes(pickle.dumps(batch, protocol=2))
    start = time.perf_counter()
    with pytest.raises(UserError) as checked:
        build_dataset("cifar10", str(tmp_path / "data"), "train")
    with pytest.raises(NotABatch) as read:
        read_batch(folder / "data_batch_2")
    assert time.perf_counter() - start < 5
    assert str(checked.value) == f"{folder / 'data_batch_2'} {line}: download CIFAR10 again"
    assert str(read.value) == f"{folder / 'data_batch_2'} {line}"


def test_a_pickle_of_more_objects_than_the_bound_is_refused_before_building_them(tmp_path, monkeypatch):
    """Past the bound on objects (sce.unpickling.MAX_OBJECTS, lowered here), a batch is refused before any is built."""
    from sce import unpickling
    folder = write_cifar(tmp_path / "data", per_batch=2)
    (folder / "data_batch_1").write_bytes(pickle.dumps({"labels": [0] * 100, "filenames": ["f"] * 100}, protocol=2))
    monkeypatch.setattr(unpickling, "MAX_OBJECTS", 50)
    with pytest.raises(UserError, match=r"data_batch_1 is no CIFAR batch: it would build more than 50 objects "
                                        r"\(nothing was built\): download CIFAR10 again"):
        build_dataset("cifar10", str(tmp_path / "data"), "train")


class PlainDtype:
    """Unpickled, numpy.dtype('u1') given `state` (numpy's own is a tuple of scalars)."""

    def __init__(self, state):
        self.state = state

    def __reduce__(self):
        return np.dtype, ("u1", False, True), self.state


def shared_tuples(levels, memo=True):
    """A pickle of a dict whose key is a tuple of two references to one tuple, `levels` deep (by the memo or by DUP):
    hashing it walks 2**levels items."""
    ops = b")"
    for k in range(levels):
        ops += b"q" + bytes([k]) + b"h" + bytes([k]) + b"\x86" if memo else b"2\x86"
    return b"\x80\x02}" + ops + b"K\x01s."


@pytest.mark.parametrize("batch,refused", [
    (shared_tuples(60), "its tuples, their shared references expanded, would hold more than 4,000,000 items "
                        "(nothing was built)"),
    (shared_tuples(60, memo=False), "its tuples, their shared references expanded, would hold more than 4,000,000 "
                                    "items (nothing was built)"),
    (pickle.dumps(RunsCode(np._core.numeric._frombuffer, b"\0", PlainDtype(shared_lists(60)), (1,), "C"), 2),
     "its arrays would be of the dtype 'u1' of a state with fields or objects, not of plain numbers (nothing was "
     "built)"),
    (pickle.dumps(RunsCode(codecs.encode, "abc", shared_lists(60)), 2), "it would call _codecs.encode(..., a list)"),
    (b"\x80\x04\x8e" + (2 ** 40).to_bytes(8, "little") + b"abc", None)])
def test_a_batch_whose_shared_references_would_expand_is_refused_at_once(tmp_path, batch, refused):
    """A dict key of 60 tuples each of two references to the one before (2**60 items to hash), 60 such lists as a
    dtype's state or an encoding (2**60 to repr in the refusal), an op declaring 2**40 bytes (an allocation of it): one
    line at once, nothing expanded."""
    import faulthandler
    import time
    from sce.layouts import damaged_batch
    (tmp_path / "data_batch_1").write_bytes(batch)
    start = time.perf_counter()
    faulthandler.dump_traceback_later(60, exit=True)  # a hash inside the C unpickler never returns to Python
    line = damaged_batch(str(tmp_path), ["data_batch_1"])
    faulthandler.cancel_dump_traceback_later()
    assert time.perf_counter() - start < 5
    assert line == (f"{tmp_path / 'data_batch_1'} is no CIFAR batch: {refused}" if refused else
                    f"{tmp_path / 'data_batch_1'} does not unpickle (ValueError: expected 1099511627776 bytes in a "
                    "bytes8, but only 3 remain): it is cut short or damaged"), line


@pytest.mark.parametrize("call", ["system", "open"])
def test_cifar_batches_are_read_without_running_their_code(tmp_path, call):
    """A batch whose pickle would run a command (or write a file) is one line naming the call, nothing run; the
    release's format (python2_pickle: Python 2 strings, numpy 1's module path) and Python 3's protocols read to the
    arrays plain pickle gives."""
    import builtins
    from sce.layouts import read_batch
    folder, marker = write_cifar(tmp_path / "data", per_batch=2), tmp_path / "marker"
    payload = RunsCode(os.system, f"touch {marker}") if call == "system" else RunsCode(builtins.open, str(marker), "w")
    with open(folder / "data_batch_2", "wb") as f:
        pickle.dump({"data": payload, "labels": [0, 1]}, f, protocol=2)
    named = f"{payload.call.__module__}.{call}"  # posix.system, io.open
    with pytest.raises(UserError, match=rf"data_batch_2 is no CIFAR batch: it would call {named} \(a pickle that "
                                        r"runs code; nothing was run\): download CIFAR10 again") as info:
        build_dataset("cifar10", str(tmp_path / "data"), "train")
    assert "\n" not in str(info.value) and not marker.exists()
    arrays = {"data": np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072) % 251, "labels": [3, 7],
              "filenames": ["a.png", "b.png"]}
    written = [python2_pickle(arrays)] + [pickle.dumps(arrays, protocol=p) for p in range(6)]
    for data in written:
        (tmp_path / "batch").write_bytes(data)
        plain, safe = pickle.loads(data, encoding="latin1"), read_batch(tmp_path / "batch")
        assert safe.keys() == plain.keys() and safe["labels"] == plain["labels"] == [3, 7]
        assert safe["data"].dtype == np.uint8 and np.array_equal(safe["data"], plain["data"])


FORGED = """
import os, pickle, sys
import numpy as np
from numpy._core import multiarray, numeric
sys.path.insert(0, os.getcwd())
from sce.layouts import damaged_batch


class Forged:  # a void dtype holding an object field, its flags saying so: numpy reads garbage as references
    def __reduce__(self):
        return np.dtype, ("V8", False, True), (3, "|", None, ("f",), {"f": (np.dtype("O"), 0)}, 8, 1, 1)


class Array:  # an array of it, by _reconstruct (protocols 0-5) or by _frombuffer (protocol 5's)
    def __init__(self, route):
        self.route = route

    def __reduce__(self):
        if self.route == "frombuffer":
            return numeric._frombuffer, (b"\\x01" * 16, Forged(), (2,), "C")
        return multiarray._reconstruct, (np.ndarray, (0,), b"b"), (1, (2,), Forged(), False, b"\\x01" * 16)


folder = sys.argv[1]
for protocol in range(6):
    for route in ("reconstruct", "frombuffer"):
        name = f"{route}{protocol}"
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump({"data": Array(route), "labels": [0, 1]}, f, protocol=protocol)
        print(damaged_batch(folder, [name]), flush=True)
"""


def test_a_forged_dtype_in_any_protocol_is_refused_before_an_array_is_built(tmp_path):
    """An object field inside a void dtype, by numpy's two routes to an array, in pickles of protocols 0-5: each one
    line naming the file and the dtype, the process alive (numpy would read the bytes as references: exit 139)."""
    import subprocess
    import sys
    from conftest import REPO
    proc = subprocess.run([sys.executable, "-c", FORGED, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 12 and not proc.stderr, (proc.returncode, proc.stdout, proc.stderr)
    for line, name in zip(lines, [f"{r}{p}" for p in range(6) for r in ("reconstruct", "frombuffer")]):
        assert line == (f"{tmp_path / name} is no CIFAR batch: its arrays would be of the dtype 'V8' of a state with "
                        "fields or objects, not of plain numbers (nothing was built)"), line


def test_stl10_binaries(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "stl10_binary"
    root.mkdir()
    for split, n in [("train", 3), ("test", 2), ("unlabeled", 5)]:
        rng.integers(0, 255, n * 3 * 96 * 96, dtype=np.uint8).tofile(root / f"{split}_X.bin")
        if split != "unlabeled":
            np.arange(1, n + 1, dtype=np.uint8).tofile(root / f"{split}_y.bin")
    pre = build_dataset("stl10", str(tmp_path), "pretrain")
    assert len(pre) == 8 and pre.targets[:3] == [0, 1, 2] and pre.targets[3:] == [-1] * 5  # train, then unlabeled
    raw = np.fromfile(root / "train_X.bin", dtype=np.uint8)[:3 * 96 * 96].reshape(3, 96, 96)
    img, _ = build_dataset("stl10", str(tmp_path), "train")[0]
    assert np.array_equal(np.asarray(img)[:, :, 2], raw[2].T)  # stored column-major
    assert len(build_dataset("stl10", str(tmp_path), "val")) == 2
    with open(root / "unlabeled_X.bin", "ab") as f:  # a partial download: half an image more
        f.write(bytes(3 * 96 * 48))
    with pytest.raises(UserError, match=r"unlabeled_X.bin is cut short \(\d+ bytes, not whole 3x96x96 images\): "
                                         "download STL10 again"):
        build_dataset("stl10", str(tmp_path), "pretrain")
    rng.integers(0, 255, 5 * 3 * 96 * 96, dtype=np.uint8).tofile(root / "unlabeled_X.bin")
    rng.integers(0, 255, 1 * 3 * 96 * 96, dtype=np.uint8).tofile(root / "test_X.bin")  # 1 image, 2 labels
    with pytest.raises(UserError, match=r"test_X.bin holds 1 images for the 2 labels of test_y.bin"):
        build_dataset("stl10", str(tmp_path), "val")
    (root / "test_y.bin").unlink()
    with pytest.raises(UserError, match=r"stl10_binary/test_y.bin not found: STL10 needs"):
        build_dataset("stl10", str(tmp_path), "train")


def test_tiny_imagenet_and_imagenet100(tmp_path):
    root = tmp_path / "tiny"
    for wnid in ("n01", "n02"):
        os.makedirs(root / "train" / wnid / "images")
        Image.new("RGB", (64, 64)).save(root / "train" / wnid / "images" / f"{wnid}_0.JPEG")
    os.makedirs(root / "val" / "images")
    Image.new("RGB", (64, 64)).save(root / "val" / "images" / "val_0.JPEG")
    (root / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn02\t0\t0\t10\t10\n")
    assert len(build_dataset("tiny-imagenet", str(root), "train")) == 2
    val = build_dataset("tiny-imagenet", str(root), "val")
    assert len(val) == 1 and val[0][1] == 1

    listed = tmp_path / "classes.txt"
    listed.write_text("class_2\nclass_0\n")
    data = write_imagefolder(tmp_path / "in", num_classes=3, per_class=2)
    subset = build_dataset("imagenet100", data, "train", class_list=str(listed))
    assert subset.classes == ["class_0", "class_2"] and len(subset) == 4
    listed.write_text("class_0\nclass_9\n")
    with pytest.raises(UserError, match="class_9"):
        build_dataset("imagenet100", data, "train", class_list=str(listed))


def test_image_modes_become_rgb(tmp_path):
    rng = np.random.default_rng(0)
    gray = Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8))
    paths = {"gray.png": gray, "palette.png": gray.convert("P"), "cmyk.jpg": gray.convert("CMYK"),
             "rgba.png": gray.convert("RGBA")}
    for name, img in paths.items():
        img.save(tmp_path / name)
    Image.fromarray(np.full((8, 8), 65535, np.uint16)).save(tmp_path / "deep.png")
    for name in list(paths) + ["deep.png"]:
        img = load_rgb(str(tmp_path / name))
        assert img.mode == "RGB" and img.size == (8, 8), name
    assert np.asarray(load_rgb(str(tmp_path / "deep.png"))).min() == 255  # 16-bit white stays white


def test_tensor_loader_reads_every_mode_as_pil_does(tmp_path, monkeypatch):
    # --augment gpu decodes colour and gray JPEGs with torchvision; every file must give load_rgb's pixels
    from sklearn.datasets import load_sample_images
    photo = Image.fromarray(load_sample_images().images[0][100:160, 200:280])  # real content, 80x60
    deep = Image.fromarray(np.asarray(photo.convert("L")).astype(np.uint16) * 257)  # 16-bit
    kinds = {"420.jpg": (photo, {}), "444.jpg": (photo, dict(subsampling=0)),
             "progressive.jpg": (photo, dict(progressive=True)), "gray.jpg": (photo.convert("L"), {}),
             "cmyk.jpg": (photo.convert("CMYK"), {}), "palette.png": (photo.convert("P"), {}),
             "rgba.png": (photo.convert("RGBA"), {}), "deep.png": (deep, {})}
    for name, (img, options) in kinds.items():
        img.save(tmp_path / name, **options)
    decoded, decode_jpeg = [], files.decode_jpeg
    if decode_jpeg is None:
        pytest.skip("this torchvision has no JPEG decoder: load_rgb_tensor reads with PIL")
    monkeypatch.setattr(files, "decode_jpeg", lambda *a, **k: decoded.append(1) or decode_jpeg(*a, **k))
    for name in kinds:
        before = len(decoded)
        tensor = load_rgb_tensor(str(tmp_path / name))
        expected = TF.pil_to_tensor(load_rgb(str(tmp_path / name)))
        assert tensor.dtype == torch.uint8 and torch.equal(tensor, expected), name
        assert len(decoded) - before == (name in ("420.jpg", "444.jpg", "progressive.jpg", "gray.jpg")), name
    data = (tmp_path / "420.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[:len(data) // 2])
    with pytest.raises(OSError, match="truncated"):  # PIL's own error, as load_rgb raises it
        load_rgb_tensor(str(tmp_path / "cut.jpg"))
    (tmp_path / "text.jpg").write_text("not an image")
    with pytest.raises(OSError):
        load_rgb_tensor(str(tmp_path / "text.jpg"))


def test_missing_and_empty_data(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        build_dataset("imagefolder", str(tmp_path / "nope"), "pretrain")
    os.makedirs(tmp_path / "empty" / "class_a")
    (tmp_path / "empty" / "class_a" / "notes.txt").write_text("not an image")
    with pytest.raises(UserError, match="no images found"):
        build_dataset("imagefolder", str(tmp_path / "empty"), "pretrain")


def test_files_of_other_kinds_are_said_and_an_empty_class_folder_is_refused(tmp_path, capsys):
    """A palette GIF (PIL reads it, torchvision's ImageFolder does not) and a text file are skipped as torchvision
    skips them, a line a kind with its count; a class folder without an image is one line, as torchvision's
    ImageFolder refuses it."""
    from torchvision.datasets import ImageFolder
    data = write_imagefolder(tmp_path / "data", 2, 3, 16, splits=("",))
    Image.new("P", (16, 16)).save(os.path.join(data, "class_0", "palette.gif"))
    Image.new("P", (16, 16)).save(os.path.join(data, "class_1", "other.GIF"))
    (tmp_path / "data" / "class_1" / "notes.txt").write_text("not an image")
    ds = build_dataset("imagefolder", data, "pretrain")
    assert ds.samples == ImageFolder(data).samples and len(ds) == 6
    out = capsys.readouterr().out
    kinds = ".jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp"
    assert f"=> {data}: 2 .gif file(s) skipped, not of the kinds ImageFolder reads ({kinds})" in out
    assert f"=> {data}: 1 .txt file(s) skipped" in out
    os.makedirs(os.path.join(data, "class_2"))
    with pytest.raises(FileNotFoundError):  # torchvision's
        ImageFolder(data)
    with pytest.raises(UserError, match=re.escape(f"the class folder {os.path.join(data, 'class_2')} holds no image "
                                                  f"(1 of the 3 hold none; ImageFolder reads {kinds}): add images "
                                                  "or remove the folder")):
        build_dataset("imagefolder", data, "pretrain")


def test_the_fingerprint_tells_datasets_of_one_size_apart(tmp_path):
    """A mid-epoch resume compares it: the file names and labels of a folder, the labels and pixels of CIFAR's
    arrays; the folder's place on disk does not count."""
    a = write_imagefolder(tmp_path / "a", 2, 4, 16, splits=("",))
    b = write_imagefolder(tmp_path / "b", 2, 4, 16, splits=("",))
    assert fingerprint(build_dataset("imagefolder", a, "pretrain")) == fingerprint(build_dataset("imagefolder", b,
                                                                                                 "pretrain"))
    os.rename(os.path.join(b, "class_1", "3.png"), os.path.join(b, "class_1", "9.png"))
    assert fingerprint(build_dataset("imagefolder", a, "pretrain")) != fingerprint(build_dataset("imagefolder", b,
                                                                                                 "pretrain"))
    write_cifar(tmp_path / "c1", 10, seed=0)
    write_cifar(tmp_path / "c2", 10, seed=1)  # the same labels, other pixels
    one, two = (build_dataset("cifar10", str(tmp_path / c), "pretrain") for c in ("c1", "c2"))
    assert len(one) == len(two) and one.targets == two.targets and fingerprint(one) != fingerprint(two)


def test_a_folder_loop_is_refused_and_other_links_are_read(tmp_path):
    """torchvision walks an ImageFolder with followlinks=True: a link back up the tree would read its images again
    and again. Such a loop is one error naming the link; links that do not loop read as torchvision reads them."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset
    data = write_imagefolder(tmp_path / "data", num_classes=2, per_class=3, size=8, splits=("train",))
    train = os.path.join(data, "train")
    elsewhere = write_imagefolder(tmp_path / "elsewhere", num_classes=2, per_class=2, size=8, splits=("",))
    os.symlink(os.path.join(elsewhere, "class_0"), os.path.join(train, "class_2"))  # a class folder elsewhere
    os.symlink(os.path.join(elsewhere, "class_1"), os.path.join(train, "class_0", "more"))  # a sub-folder elsewhere
    os.symlink(os.path.join(elsewhere, "class_1"), os.path.join(train, "class_1", "again"))  # the same one twice
    os.symlink(os.path.join(elsewhere, "class_0", "0.png"), os.path.join(train, "class_1", "linked.png"))
    ds = build_dataset("imagefolder", data, "train")
    assert len(ds) == 6 + 2 + 2 + 2 + 1
    assert ds.samples == make_dataset(train, ds.class_to_idx, IMG_EXTENSIONS)  # torchvision's files, in its order
    loop = os.path.join(train, "class_0", "loop")
    for target in (".", "..", data, os.path.join(elsewhere, "class_1")):  # the last: through `more`
        link = os.path.join(elsewhere, "class_1", "up") if target.endswith("class_1") else loop
        os.symlink(target if link == loop else train, link)
        named = loop if link == loop else f"{train}/class_0/more/up (the link {link})"  # the link where it lies
        with pytest.raises(UserError, match=rf"^{re.escape(named)} links back to .* \(a folder loop\): remove the "
                                            "link") as info:
            build_dataset("imagefolder", data, "train")
        assert "\n" not in str(info.value)
        os.remove(link)
    os.symlink(".", os.path.join(train, "class_3"))  # a class folder that is --data itself
    with pytest.raises(UserError, match=r"train/class_3 links back to .*\(a folder loop\)"):
        build_dataset("imagefolder", data, "train")


def test_16_bit_images_scale_by_the_range_of_their_mode_not_their_content(tmp_path):
    """A stored value is one 8-bit level in every image of its mode: 16-bit ones (65535 -> 255, v -> round(v / 257)),
    whatever an image's maximum; float ones as PIL converts them (levels 0..255, clipped)."""
    dim = np.array([[200, 100], [0, 200]], np.uint16)
    bright = np.array([[200, 60000], [65535, 0]], np.uint16)
    for name, pixels in (("dim.png", dim), ("bright.png", bright)):
        Image.fromarray(pixels).save(tmp_path / name)
        with Image.open(tmp_path / name) as img:
            assert img.mode in ("I", "I;16"), img.mode  # PIL's 16-bit gray PNG, by version
        expected = np.floor(pixels / 257 + 0.5).astype(np.uint8)
        rgb = np.asarray(load_rgb(str(tmp_path / name)))
        assert np.array_equal(rgb, np.repeat(expected[:, :, None], 3, axis=2)), (name, rgb[:, :, 0])
        assert torch.equal(load_rgb_tensor(str(tmp_path / name)), TF.pil_to_tensor(load_rgb(str(tmp_path / name))))
        as_i = files.to_rgb(Image.open(tmp_path / name).convert("I"))  # mode I, as older PIL opens it
        assert np.array_equal(np.asarray(as_i), rgb), name
    assert np.asarray(load_rgb(str(tmp_path / "dim.png")))[0, 0, 0] == 1 == np.asarray(
        load_rgb(str(tmp_path / "bright.png")))[0, 0, 0]
    assert np.asarray(load_rgb(str(tmp_path / "bright.png")))[1, 0, 0] == 255
    floats = Image.fromarray(np.array([[0.4, 1.6, 200.0, 300.0, -3.0]], np.float32))
    assert np.array_equal(np.asarray(files.to_rgb(floats))[:, :, 0], np.asarray(floats.convert("L")))


def test_the_data_order_of_a_seed_is_not_the_next_epoch_of_the_seed_before():
    """Both samplers draw each epoch's order from (seed, epoch) mixed, not seed + epoch: --seed 1's epoch e is not
    --seed 0's epoch e + 1. The order is the same for the same (seed, epoch); the probe's sampler keeps
    DistributedSampler's padding, rank slices and drop_last, and both their skipping of a resumed epoch's start."""
    from sce.data import ResumableSampler, ShuffledShards

    def resumable(seed, epoch, start=0):
        sampler = ResumableSampler(64, 8, seed=seed)
        sampler.set_epoch(epoch, start)
        return [i for _, i in sampler]

    def shards(seed, epoch, start=0, replicas=1, rank=0, drop_last=False):
        sampler = ShuffledShards(range(64), num_replicas=replicas, rank=rank, shuffle=True, seed=seed,
                                 drop_last=drop_last)
        sampler.set_epoch(epoch, start)
        assert len(sampler) == len(list(sampler))
        return [i for e, i in sampler if e == epoch]

    for order in (resumable, shards):
        for e in range(4):
            assert order(1, e) != order(0, e + 1) and order(2, e) != order(0, e + 2), (order.__name__, e)
            assert order(0, e) == order(0, e) and sorted(order(0, e)) == list(range(64))
            assert order(0, e, start=5) == order(0, e)[5 * (8 if order is resumable else 1):]
        assert order(0, 0) != order(0, 1) and order(0, 0) != list(range(64))
    full = shards(3, 2)
    assert [shards(3, 2, replicas=3, rank=r) for r in range(3)] == [(full + full[:2])[r::3] for r in range(3)]
    assert [shards(3, 2, replicas=3, rank=r, drop_last=True) for r in range(3)] == [full[:63][r::3] for r in range(3)]
    assert [i for _, i in ShuffledShards(range(10), num_replicas=1, rank=0, shuffle=False)] == list(range(10))
