"""The benchmarks that measure the CIFAR-10 gap (benchmarks/fidelity/: reencode.py, calibrate_jpeg.py, proxies.py), on
files written here: the re-encoded copy's tree, sampling and quality; airbench's data pair from an ImageFolder;
the proxies runner's SMOKE mode, its results read back and its time limit."""
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image, JpegImagePlugin

from conftest import REPO, write_cifar, write_imagefolder
from sce import UserError

CIFAR10 = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def bench(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "benchmarks", "fidelity", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_jpegs(root, classes, per_class, quality=95, subsampling="4:4:4"):
    """root/<class>/<i>.jpg: 32x32 pictures, each a crop of a photo scaled down (CIFAR-like content)."""
    from sklearn.datasets import load_sample_image  # here: importing scikit-learn takes ~2 s of collection
    photo, rng = Image.fromarray(load_sample_image("china.jpg")), np.random.default_rng(0)
    for name in classes:
        os.makedirs(os.path.join(root, name))
        for i in range(per_class):
            x, y = rng.integers(0, 300), rng.integers(0, 200)
            photo.crop((x, y, x + 96, y + 96)).resize((32, 32)).save(os.path.join(root, name, f"{i}.jpg"),
                                                                     quality=quality, subsampling=subsampling)


def pixels(path):
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float64)


def test_reencode_keeps_the_tree_at_the_quality_and_sampling_asked(tmp_path, capsys):
    """Every image of the tree, at the same path and size (a PNG becomes .jpg, other files are left out), 4:2:0
    and libjpeg's tables of the quality asked as PIL reads them back; quality 50 damages more than 75, in the
    PSNR it prints and in the pixels; an existing copy is left as it is; bad input is one UserError."""
    reencode = bench("reencode")
    src = tmp_path / "src"
    write_jpegs(src / "train", ["a", "b"], 2)
    Image.fromarray(np.full((20, 24, 3), 90, np.uint8)).save(src / "train" / "b" / "flat.png")
    (src / "notes.txt").write_text("not an image")
    reencode.main([str(src), str(tmp_path / "q75"), "--quality", "75", "--workers", "1"])
    said = {75: json.loads(capsys.readouterr().out)}
    said[50] = reencode.reencode(str(src), str(tmp_path / "q50"), 50)
    expected = ["train/a/0.jpg", "train/a/1.jpg", "train/b/0.jpg", "train/b/1.jpg", "train/b/flat.jpg"]
    error = {}
    for quality in (75, 50):
        assert said[quality]["images"] == 5 and said[quality]["existed"] is False
        dst = tmp_path / f"q{quality}"
        assert reencode.image_files(str(dst)) == expected and not os.path.exists(str(dst) + ".partial")
        reference = io.BytesIO()
        Image.new("RGB", (32, 32)).save(reference, "JPEG", quality=quality)
        for rel in expected:
            image = Image.open(dst / rel)
            source = src / rel.replace("flat.jpg", "flat.png")
            assert image.format == "JPEG" and image.size == Image.open(source).size, rel
            assert JpegImagePlugin.get_sampling(image) == 2, rel  # 4:2:0
            assert image.quantization == Image.open(reference).quantization, rel
        error[quality] = np.mean([((pixels(dst / r) - pixels(src / r)) ** 2).mean() for r in expected[:4]])
    assert error[50] > error[75] > 0 and said[50]["psnr_db"] < said[75]["psnr_db"]
    again = reencode.reencode(str(src), str(tmp_path / "q50"), 50)
    assert again["existed"] is True and again["images"] == 5
    with pytest.raises(UserError, match="outside PIL's 1-95"):
        reencode.reencode(str(src), str(tmp_path / "q0"), 0)
    with pytest.raises(UserError, match="no image files under"):
        reencode.reencode(str(tmp_path / "q50" / "none"), str(tmp_path / "x"), 50)


def test_calibration_writes_airbenchs_pair_from_an_imagefolder(tmp_path, monkeypatch):
    """train.pt / test.pt under OUT/cifar10 as airbench reads them ({images: (N, 32, 32, 3) uint8, labels: int64,
    classes}, loadable with weights_only): every image PIL's pixels of a file with its class's label in CIFAR-10's
    order, the training images out of class order; other classes, or no GPU for the training, are one line."""
    calibrate = bench("calibrate_jpeg")
    assert calibrate.CIFAR10_CLASSES == CIFAR10  # torchvision's CIFAR10.classes, the release's label order
    write_jpegs(tmp_path / "data" / "train", CIFAR10, 2, quality=75, subsampling="4:2:0")
    write_jpegs(tmp_path / "data" / "val", CIFAR10, 1, quality=75, subsampling="4:2:0")
    folder = calibrate.write_pair(str(tmp_path / "data"), str(tmp_path / "out"))
    assert folder == str(tmp_path / "out" / "cifar10")
    for name, split, n in (("train.pt", "train", 20), ("test.pt", "val", 10)):
        pair = torch.load(os.path.join(folder, name), weights_only=True)
        assert pair["classes"] == CIFAR10 and pair["images"].shape == (n, 32, 32, 3)
        assert pair["images"].dtype == torch.uint8 and pair["labels"].dtype == torch.int64
        files = {pixels(tmp_path / "data" / split / c / f).astype(np.uint8).tobytes(): label
                 for label, c in enumerate(CIFAR10) for f in os.listdir(tmp_path / "data" / split / c)}
        written = {image.numpy().tobytes(): int(label) for image, label in zip(pair["images"], pair["labels"])}
        assert written == files, name
    train = torch.load(os.path.join(folder, "train.pt"), weights_only=True)["labels"]
    assert not torch.equal(train, train.sort().values)  # airbench whitens with the first images
    write_jpegs(tmp_path / "other" / "train", ["a", "b"], 1)
    with pytest.raises(UserError, match="has the classes a, b: airbench needs CIFAR-10's ten, named airplane"):
        calibrate.write_pair(str(tmp_path / "other"), str(tmp_path / "out2"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="no CUDA device here: pass --device cpu"):
        calibrate.main(["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--workers", "1",
                        "--device", "cuda"])
    shutil.rmtree(tmp_path / "data" / "val")
    with pytest.raises(UserError, match="has no val/ folder"):
        calibrate.write_pair(str(tmp_path / "data"), str(tmp_path / "out3"))
    write_jpegs(tmp_path / "data" / "val", CIFAR10, 1, quality=75, subsampling="4:2:0")
    Image.new("RGB", (40, 32)).save(tmp_path / "data" / "val" / "cat" / "wide.png")
    with pytest.raises(UserError, match="wide.png is 40x32: airbench needs CIFAR-10's 32x32"):
        calibrate.write_pair(str(tmp_path / "data"), str(tmp_path / "out4"))
    (tmp_path / "data" / "val" / "cat" / "wide.png").write_bytes(b"not an image")
    with pytest.raises(UserError, match="wide.png is not a readable image"):
        calibrate.write_pair(str(tmp_path / "data"), str(tmp_path / "out5"))


# airbench's CUDA calls as its 0.1.8 makes them: .half().cuda() on the model, the data loaded onto device 0 and
# cast with .half(), CUDA events around the steps; evaluate() sees the model and data as they trained
FAKE_AIRBENCH = {
    "__init__.py": "from .lib_airbench94 import train94\nfrom .utils import evaluate, CifarLoader\n",
    "lib_airbench94.py": """import torch
from .utils import CifarLoader
hyp = {"opt": {"batch_size": 4}, "aug": {"flip": True}, "net": {"tta_level": 2}}
def train94(train_loader=None, verbose=True):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3072, 10)).half().cuda()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for epoch in range(2):
        for images, labels in train_loader:
            model(images).sum().backward()
            if epoch == 1:
                break  # a last epoch cut short, as airbench's 9.9
    end.record()
    torch.cuda.synchronize()
    assert start.elapsed_time(end) >= 0
    return model
""",
    "utils.py": """import os
import torch
class CifarLoader:
    def __init__(self, path, train=True, batch_size=500, aug=None, drop_last=None, shuffle=None, altflip=False, gpu=0):
        data = torch.load(os.path.join(path, "train.pt" if train else "test.pt"), map_location=torch.device(gpu))
        self.images = (data["images"].half() / 255).permute(0, 3, 1, 2)
        self.labels, self.batch_size, self.epoch = data["labels"], batch_size, 0
    def __iter__(self):
        self.epoch += 1
        for i in range(0, len(self.images), self.batch_size):
            yield self.images[i:i + self.batch_size], self.labels[i:i + self.batch_size]
def evaluate(model, loader, tta_level=0):
    weight = next(model.parameters())
    assert weight.dtype == loader.images.dtype == torch.float32 and weight.device.type == "cpu", weight.dtype
    return (model(loader.images).argmax(1) == loader.labels).float().mean().item()
""",
}


def test_calibration_runs_airbenchs_files_unchanged_on_the_cpu_in_fp32(tmp_path):
    """--device cpu: the files airbench ships (a stand-in making its CUDA calls) train on the CPU in fp32; a JSON
    line an epoch (the last cut short) and a run, then the summary against the published mean."""
    sdist = tmp_path / "airbench-0.1.8.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in FAKE_AIRBENCH.items():
            info = tarfile.TarInfo(f"airbench-0.1.8/airbench/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    write_jpegs(tmp_path / "data" / "train", CIFAR10, 1)
    write_jpegs(tmp_path / "data" / "val", CIFAR10, 1)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "fidelity", "calibrate_jpeg.py"), "--data",
                           tmp_path / "data", "--out", tmp_path / "out", "--airbench", sdist, "--device", "cpu",
                           "--runs", "2", "--first-run", "3", "--workers", "1"], capture_output=True, text=True,
                          timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    epochs = [(r["run"], r["epoch"], r["steps"]) for r in lines if "epoch" in r]
    assert epochs == [(3, 0, 3), (3, 1, 1), (4, 0, 3), (4, 1, 1)]  # 10 images in batches of 4; runs 3 and 4
    assert [r["run"] for r in lines if "tta_test_acc" in r] == [3, 4]
    summary = lines[-1]
    assert summary["runs"] == 2 and summary["published"] == 94.01 and summary["precision"] == "fp32"
    assert summary["difference"] == round(summary["mean"] - 94.01, 3) and "x" in summary["device"]


def proxies(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "fidelity", "proxies.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


def rows(stdout):
    return {r["variant"]: r for r in map(json.loads, (line for line in stdout.splitlines() if line.startswith("{")))
            if "variant" in r}


def test_proxies_smoke_then_read_back_and_the_time_limit(tmp_path):
    """--smoke: the row's SCE command (reproduce.sh's SMOKE setting) for each variant, each in its own folder with
    its kNN after the last epoch; jpeg-q50 trains on a re-encoded copy of the data and is compared with the default;
    a JSON line each and a table. Run again with a variant more and a limit already spent: the finished ones are
    read back (nothing trains), the new one is left for the next invocation (exit 75). Another --epochs for the
    same folder, or an unknown variant, is one line."""
    data, out = write_imagefolder(tmp_path / "data", num_classes=2, per_class=4, size=16), tmp_path / "out"
    first = proxies("--data", data, "--out", out, "--smoke", "--variants", "default", "jpeg-q50")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    ran = rows(first.stdout)
    assert [r["status"] for r in ran.values()] == ["ran", "ran"] and ran["default"]["difference"] == 0.0
    assert ran["jpeg-q50"]["against"] == "default" and 0 <= ran["jpeg-q50"]["knn_top1"] <= 100
    assert ran["jpeg-q50"]["difference"] == round(ran["jpeg-q50"]["knn_top1"] - ran["default"]["knn_top1"], 2)
    args = json.load(open(out / "jpeg-q50" / "args.json"))
    assert args["data"] == args["knn_data"] == str(out / "data-q50") and args["epochs"] == 1
    assert args["tau"] == 0.2 and args["tau_m"] == 0.1 and args["split_bn"] == "all"
    assert sorted(os.listdir(out / "data-q50" / "train")) == ["class_000", "class_001"]  # SMOKE's copy, re-encoded
    assert "| jpeg-q50 | the data re-encoded at quality 50" in (out / "results.md").read_text()
    logs = {name: (out / f"{name}.log").read_text() for name in ran}
    second = proxies("--data", data, "--out", out, "--smoke", "--variants", "default", "jpeg-q50", "split-bn-all",
                     "--time-limit", 1)
    assert second.returncode == 75, second.stdout[-3000:] + second.stderr[-3000:]
    again = rows(second.stdout)
    assert [r["status"] for r in again.values()] == ["earlier", "earlier", "not run"] and "=== " not in second.stdout
    assert again["jpeg-q50"]["knn_top1"] == ran["jpeg-q50"]["knn_top1"] and not (out / "split-bn-all").exists()
    assert {name: (out / f"{name}.log").read_text() for name in ran} == logs
    assert "=> left: split-bn-all: run the same command again to continue" in second.stdout
    for bad, message in ((["--epochs", "2"], "holds the proxies of"), (["--variants", "blur"], "unknown variant")):
        said = proxies("--data", data, "--out", out, "--smoke", *bad)
        assert said.returncode == 1 and said.stderr.startswith("error: ") and message in said.stderr
        assert len(said.stderr.strip().splitlines()) == 1


def test_proxies_refuse_jpeg_variants_of_official_files_before_running(tmp_path):
    """jpeg-qN re-encodes image files: on CIFAR-10's official batches it is one line before any variant runs
    (--dry-run as well); without it, the same data's commands read the batches. (--smoke trains on an ImageFolder
    written from them, where jpeg-qN works.)"""
    write_cifar(str(tmp_path / "data"))
    said = proxies("--data", tmp_path / "data", "--out", tmp_path / "out", "--dry-run", "--variants", "default",
                   "jpeg-q50")
    assert said.returncode == 1 and said.stderr.startswith("error: jpeg-q50 re-encodes image files"), said.stderr
    assert len(said.stderr.strip().splitlines()) == 1 and "=== " not in said.stdout
    said = proxies("--data", tmp_path / "data", "--out", tmp_path / "out2", "--dry-run", "--variants", "default")
    assert said.returncode == 0 and "--dataset cifar10" in said.stdout, said.stderr


@pytest.mark.parametrize("flags, said", [
    (["--time-limit", "nan"], "--time-limit nan is not a number of seconds"),
    (["--time-limit", "-1"], "--time-limit -1.0 is not a number of seconds"),
    (["--time-limit", "inf"], "--time-limit inf is not a number of seconds"),
    (["--variants", "default", "jpeg-q999"], "jpeg-q999: JPEG quality 999 is outside PIL's 1-95"),
])
def test_proxies_refuse_limits_and_qualities_that_cannot_run_before_anything_runs(tmp_path, flags, said):
    """A limit that is no number of seconds would stop each variant at once and exit 75 ("run the same command
    again": a loop for a wrapper that reruns on 75); a quality PIL refuses would fail after earlier variants."""
    data = write_imagefolder(tmp_path / "data", num_classes=2, per_class=1, size=16)
    proc = proxies("--data", data, "--out", tmp_path / "out", "--dry-run", *flags)
    assert proc.returncode == 1 and proc.stderr.startswith(f"error: {said}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "=== " not in proc.stdout


def test_proxies_refuse_a_foreign_reencoded_folder(tmp_path):
    """OUT/data-qN that reencode.py did not make (or made from other data) is not trained on as if it were the
    re-encoded copy: one line before the variant runs."""
    data = write_imagefolder(tmp_path / "data", num_classes=2, per_class=2, size=16)
    foreign = write_imagefolder(tmp_path / "out" / "data-q50", num_classes=2, per_class=1, size=16)
    proc = proxies("--data", data, "--out", tmp_path / "out", "--smoke", "--variants", "jpeg-q50")
    assert proc.returncode == 1 and "is no copy made by reencode.py" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out" / "jpeg-q50").exists() and os.listdir(foreign)
