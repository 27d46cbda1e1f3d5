"""The pretraining data routes (sce.data.pretrain): on the same images and seed, the four routes draw the same crop
boxes, flips and photometric parameters; the tensor routes (gpu, decode, preload) give the same pixels within one
level (the workers' and the CPU's crop of one image is torch's uint8 resize, fixed point, a level off the float
products of the preload route in ~15% of the pixels; a float sum may round a tie the other way), the PIL route
(--augment cpu) within the resampling tolerance below; runs through the tensor routes train alike; a mid-epoch
resume is exact on every route; unreadable images are named once and replaced; files the device's decoder refuses
are read on the host; preloading falls back, stops or fails in one line as it should.

The PIL route's tolerance: PIL resizes in 8-bit fixed point after rounding each input pixel, torch in float,
and PIL rounds after every photometric op (its hue goes through 8-bit HSV): on the weak view (no photometric
op) at most 4 levels apart, 0.5 on average; after the strong view's ops at most 24, 2 on average."""
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REPO, assert_mid_epoch_resume_is_exact, load, write_imagefolder
import main_pretrain
from sce import UserError, data
from sce.data import images as files
from sce.data import jpeg, ops, preloading
from sce.data.pretrain import WORKER_NICENESS, init_worker

pytestmark = pytest.mark.usefixtures("in_process")  # conftest: one thread, signal handlers restored
CPU = torch.device("cpu")
SPECS = [data.ViewSpec("weak", 16, (0.3, 1.0)), data.ViewSpec("strong-gamma", 12, (0.2, 1.0))]
ROUTES = {"cpu": ("cpu", False), "gpu": ("gpu", False), "decode": ("decode", False), "preload": ("gpu", True)}


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """An ImageFolder of 8 photos of one size: six baseline JPEGs, a progressive one and a PNG (the last two
    the decode route's workers crop)."""
    from sklearn.datasets import load_sample_images
    photo = Image.fromarray(load_sample_images().images[0][100:340, 50:370])
    root = tmp_path_factory.mktemp("routes") / "data"
    os.makedirs(root / "photos")
    for i in range(8):
        crop = photo.crop((20 * i, 10 * i, 20 * i + 150, 10 * i + 120)).resize((50, 40))
        crop.save(root / "photos" / (f"{i}.png" if i == 6 else f"{i}.jpg"), quality=90,
                  **({"progressive": True} if i == 7 else {}))
    return str(root)


def batches(root, route, seed=3, epoch=2, max_bad=0):
    loader_route, try_preload = ROUTES[route]
    dataset = data.build_dataset("imagefolder", root, "pretrain", read=data.READ[loader_route])
    sampler = data.ResumableSampler(len(dataset), 8, seed=seed)
    sampler.set_epoch(epoch)
    return data.pretrain_batches(dataset, SPECS, sampler, CPU, loader_route, try_preload=try_preload,
                                 required=try_preload, max_bad=max_bad, budget=data.Budget(CPU))


def test_the_routes_draw_the_same_parameters_and_make_the_same_pixels(photos):
    made = {route: next(iter(batches(photos, route))) for route in ROUTES}
    loader = batches(photos, "gpu").samples
    order = data.ResumableSampler(8, 8, seed=3)
    order.set_epoch(2)
    for key in order:  # every route's rows are the draw of (seed, epoch, index, view)
        rows = [r for r in loader[key][1][1]]
        expected = [data.views.draw(spec, 3, 2, [key[1]], v, height=[40], width=[50])[0]
                    for v, spec in enumerate(SPECS)]
        assert all(torch.equal(a, b) for a, b in zip(rows, expected))
    pixels = {route: [v * torch.tensor(ops.STD).view(1, 3, 1, 1) * 255 for v in views]
              for route, views in made.items()}
    for v in range(2):  # the tensor routes: the same pixels, the uint8 and float resizes a level apart
        diff = (pixels["decode"][v] - pixels["gpu"][v]).abs()
        assert diff.max() <= 1e-3, (v, diff.max())  # on the CPU, the same uint8 resize of one image
        diff = (pixels["preload"][v] - pixels["gpu"][v]).abs()
        if v == 0:  # before the photometric ops
            assert diff.max() <= 1.01 and (diff > 1e-3).float().mean() < 0.3, (v, diff.max())
        else:  # they spread the differences over every pixel, by a few levels (an unrelated batch: ~40 on average)
            assert diff.max() <= 4 and diff.mean() < 1, (v, diff.max(), diff.mean())
    for v, (most, mean) in enumerate(((4, 0.5), (24, 2))):  # the PIL route (module docstring)
        diff = (pixels["cpu"][v] - pixels["gpu"][v]).abs()
        assert diff.max() <= most and diff.mean() <= mean, (v, diff.max(), diff.mean())


TINY = ["--arch", "resnet18", "--small-input", "--crop-size", "16", "--batch-size", "4", "--queue-size", "16",
        "--workers", "0", "--proj-hidden-dims", "32", "--proj-dim", "16", "--print-freq", "1"]


def test_the_tensor_routes_train_alike(photos, tmp_path, capsys):
    """Same views, same draws of the run's RNG (shuffle-BN), same steps: the gpu and decode routes (one image's
    crop at a time, the same op) end with the same weights, bit for bit; the preload route (a batch's crops as
    products) takes steps on views a level off in some pixels, its first loss near theirs (the tiny batch, whose
    shuffle-BN chunks hold 2 images, makes the later steps drift apart)."""
    states, losses = {}, {}
    for route, flags in (("gpu", ["--augment", "gpu", "--decode", "loader", "--preload", "off"]),
                         ("decode", ["--augment", "gpu", "--decode", "device", "--preload", "off"]),
                         ("preload", ["--augment", "gpu", "--decode", "loader", "--preload", "device"])):
        capsys.readouterr()
        main_pretrain.main(["--data", photos, "--epochs", "1", "--shuffle-bn", "--bn-splits", "2", "--output-dir",
                            str(tmp_path / route)] + TINY + flags)
        states[route] = load(tmp_path / route / "checkpoint_last.pth")["model"]
        losses[route] = [float(x) for x in re.findall(r"\] loss (\S+)", capsys.readouterr().out)]
    assert all(torch.equal(states["decode"][k], states["gpu"][k]) for k in states["gpu"])
    assert losses["preload"][0] == pytest.approx(losses["gpu"][0], rel=0.15)


@pytest.mark.parametrize("route", ["cpu", "gpu --decode device", "preload"])
def test_a_mid_epoch_resume_is_exact_on_every_route(photos, tmp_path, monkeypatch, capsys, route):
    flags = {"cpu": ["--augment", "cpu"], "gpu --decode device": ["--augment", "gpu", "--decode", "device"],
             "preload": ["--preload", "device", "--cuda-graph", "--lambda-schedule", "cosine", "--lambda-end",
                         "0.9"]}[route]
    args = ["--data", photos, "--epochs", "2", "--shuffle-bn", "--bn-splits", "2"] + TINY + flags
    assert_mid_epoch_resume_is_exact(args, tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert {"cpu": "views in the loader workers", "gpu --decode device": "JPEGs decoded, cropped and augmented",
            "preload": "=> preloaded 8 images (3x40x50"}[route] in out
    if route == "preload":
        assert "data 0%" in out and "--cuda-graph needs one GPU process" in out  # and the run went on eagerly


def test_views_for_any_number_of_workers(photos):
    a, b = batches(photos, "gpu"), batches(photos, "gpu")
    b.loader = torch.utils.data.DataLoader(b.samples, batch_size=8, sampler=b.sampler, num_workers=2,
                                           collate_fn=b.loader.collate_fn, worker_init_fn=init_worker)
    assert all(torch.equal(x, y) for x, y in zip(next(iter(a)), next(iter(b))))


def test_every_route_gives_each_image_its_label(tmp_path):
    """The labels beside a batch's views (sce.data.Batch, what the online probe learns) are its images' own, in the
    sampler's order, on every route: the preloaded one's from the device, the loaders' from the indices."""
    root = write_imagefolder(tmp_path / "data", num_classes=3, per_class=3, size=20, splits=("",))
    dataset = data.build_dataset("imagefolder", root, "pretrain")
    order = data.ResumableSampler(len(dataset), 8, seed=3)
    order.set_epoch(2)
    want = [dataset.targets[index] for _, index in order][:8]
    assert len(set(want)) == 3
    for route in ROUTES:
        assert next(iter(batches(root, route))).labels.tolist() == want, route


# ---------------------------------------------------------------- unreadable images, refused JPEGs

@pytest.mark.parametrize("augment", ["cpu", "gpu"])
def test_unreadable_image_is_named_once_and_replaced(tmp_path, capsys, augment):
    root = write_imagefolder(tmp_path / "data", num_classes=3, per_class=8, size=20, splits=("",))
    # palette, CMYK and 16-bit images replace three PNGs: every route reads them as RGB
    for name, mode in [("0.png", "P"), ("1.jpg", "CMYK"), ("3.png", "I;16")]:
        img = Image.open(os.path.join(root, "class_0", f"{name[0]}.png"))
        os.remove(os.path.join(root, "class_0", f"{name[0]}.png"))
        img = img.convert("L").point(lambda v: v * 256, "I").convert("I;16") if mode == "I;16" else img.convert(mode)
        img.save(os.path.join(root, "class_0", name))
    bad = os.path.join(root, "class_1", "2.png")
    with open(bad, "rb") as f:
        head = f.read(200)
    with open(bad, "wb") as f:  # a truncated download
        f.write(head)
    with open(os.path.join(root, "class_1", "notes.txt"), "w") as f:
        f.write("not an image")
    args = ["--data", root, "--epochs", "2", "--augment", augment] + [a if a != "4" else "8" for a in TINY]  # batch 8
    main_pretrain.main(args + ["--output-dir", str(tmp_path / "ok")])  # the default budget: 1 image
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: skipping")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: skipping unreadable image {bad} (")
    assert load(tmp_path / "ok" / "checkpoint_last.pth")["step"] == 6  # every batch full: replaced, not dropped
    with pytest.raises(UserError, match=r"1 unreadable images, more than --max-bad-images 0"):
        main_pretrain.main(args + ["--epochs", "1", "--max-bad-images", "0", "--output-dir", str(tmp_path / "strict")])


def test_a_refused_jpeg_is_decoded_on_the_host_and_a_damaged_one_replaced(photos, tmp_path, monkeypatch, capsys):
    import shutil
    root = shutil.copytree(photos, tmp_path / "data")
    reference = next(iter(batches(root, "decode")))
    real = jpeg.decode_jpeg
    refused = open(os.path.join(root, "photos", "1.jpg"), "rb").read()

    def decode(datas, **kwargs):  # the device's decoder refuses one file (a batch holding it fails)
        listed = datas if isinstance(datas, list) else [datas]
        if any(d.numpy().tobytes() == refused for d in listed):
            raise RuntimeError("nvjpeg: unsupported")
        return real(datas, **kwargs)
    monkeypatch.setattr(jpeg, "decode_jpeg", decode)
    with pytest.warns(UserWarning, match="refused a batch"):
        got = next(iter(batches(root, "decode")))
    assert all(torch.equal(a, b) for a, b in zip(got, reference))  # PIL on the host: the same pixels
    damaged = os.path.join(root, "photos", "2.jpg")
    data_bytes = open(damaged, "rb").read()
    with open(damaged, "wb") as f:  # the header whole, the scan cut short: no decoder reads it
        f.write(data_bytes[:data_bytes.index(b"\xff\xda") + 40])
    assert isinstance(files.read_encoded(damaged), files.Encoded)
    with pytest.warns(UserWarning):
        got = next(iter(batches(root, "decode", max_bad=1)))
    assert f"warning: skipping unreadable image {damaged} (" in capsys.readouterr().out
    # replaced as the gpu route's workers replace it: the next readable image, with the draws of its index
    workers = next(iter(batches(root, "gpu", max_bad=1)))
    assert all(torch.equal(a, b) for a, b in zip(got, workers))
    # its place holds another image's pixels: no label for the online probe there, the others' kept
    assert sorted(got.labels.tolist()) == sorted(workers.labels.tolist()) == [-1] + [0] * 7


def test_which_files_the_device_decodes(tmp_path):
    from sklearn.datasets import load_sample_images
    photo = Image.fromarray(load_sample_images().images[0][100:340, 50:370]).resize((61, 47))
    kinds = {"baseline.jpg": ("RGB", {}), "full_chroma.jpg": ("RGB", {"subsampling": 0}), "gray.jpg": ("L", {}),
             "progressive.jpg": ("RGB", {"progressive": True}), "cmyk.jpg": ("CMYK", {}), "photo.png": ("RGB", {}),
             "palette.png": ("P", {})}
    for name, (mode, options) in kinds.items():
        path = str(tmp_path / name)
        photo.convert(mode).save(path, quality=90, **options)
        decoded = files.load_rgb_tensor(path)
        assert files.read_header(open(path, "rb").read())[2] == (47, 61) == tuple(decoded.shape[-2:]), name
        got = files.read_encoded(path)
        if name in ("baseline.jpg", "full_chroma.jpg", "gray.jpg"):  # the device's decoder: the same pixels
            assert isinstance(got, files.Encoded) and got.size == (47, 61), name
            assert torch.equal(jpeg.JpegDecoder(CPU)([got.data])[0], decoded), name
        else:  # decoded by the worker
            assert torch.is_tensor(got) and torch.equal(got, decoded), name


# ---------------------------------------------------------------- preloading

@pytest.mark.parametrize("read", ["tensor", "encoded"])
def test_preload_names_and_replaces_bad_images(tmp_path, capsys, read):
    """encoded: --decode device, whose plain JPEGs come as bytes; the bad file is then a JPEG whose header
    reads and whose data is cut short."""
    root = write_imagefolder(tmp_path / "data", num_classes=2, per_class=3, size=20, splits=("",))
    Image.open(os.path.join(root, "class_0", "1.png")).save(os.path.join(root, "class_0", "1.jpg"), quality=90)
    os.remove(os.path.join(root, "class_0", "1.png"))
    bad = os.path.join(root, "class_1", "0.jpg" if read == "encoded" else "0.png")
    os.remove(os.path.join(root, "class_1", "0.png"))
    with open(os.path.join(root, "class_0", "1.jpg"), "rb") as f, open(bad, "wb") as out:
        out.write(f.read()[:-60] if read == "encoded" else b"\x89PNG\r\n\x1a\n truncated")
    dataset = data.build_dataset("imagefolder", root, "pretrain", read=read)
    images = preloading.preload(dataset, data.Budget(CPU), required=True, max_bad=1)
    out = capsys.readouterr().out
    assert f"warning: skipping unreadable image {bad} (" in out and "=> preloaded 6 images (3x20x20" in out
    index = [p for p, _ in dataset.samples].index(bad)
    for i in range(len(dataset)):  # the bad one holds the next image, as the loader does
        assert torch.equal(images.images[i], files.load_rgb_tensor(dataset.samples[i + (i == index)][0]))
    assert images.targets.tolist() == [-1 if i == index else t for i, t in enumerate(dataset.targets)]  # no label
    assert dataset.targets[index] == 1  # its own left as read
    with pytest.raises(UserError, match="1 unreadable images, more than --max-bad-images 0"):
        preloading.preload(dataset, data.Budget(CPU), required=True, max_bad=0)


class Shades(torch.utils.data.Dataset):
    """Tiny uint8 images of one shade each (i mod 251); `failure` in a worker at image 300: 'exit' (a killed
    worker) or 'hang' (a worker that never sends its batch, as when its sending thread dies)."""

    def __init__(self, n, failure=None):
        self.n, self.failure = n, failure

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 300 and self.failure and torch.utils.data.get_worker_info():
            if self.failure == "exit":
                os._exit(3)
            time.sleep(60)
        return torch.full((3, 8, 8), i % 251, dtype=torch.uint8), 0


def test_preloading_workers_send_one_descriptor_a_batch():
    """3000 images decoded by 4 workers under `ulimit -n 128`: each batch crosses from a worker as one tensor
    (as 256 tensors it took 256 file descriptors: 'Too many open files', or a hang)."""
    code = ("import resource, sys, torch; sys.path[:0] = sys.argv[1:3]; from test_data_routes import Shades; "
            "from sce.data import Budget, preload; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
            "images = preload(Shades(3000), Budget(torch.device('cpu')), required=True, workers=4); "
            "assert torch.equal(images.images[:, 0, 0, 0], torch.arange(3000) % 251); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code, REPO, os.path.join(REPO, "tests")], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and proc.stdout.endswith("ok\n"), proc.stderr[-2000:]


@pytest.mark.parametrize("failure", ["exit", "hang"])
def test_a_failing_preloading_worker_ends_the_run_with_one_line(monkeypatch, failure):
    monkeypatch.setattr(preloading, "BATCH_TIMEOUT_S", 3)
    with pytest.raises(UserError) as err:
        preloading.preload(Shades(600, failure), data.Budget(CPU), required=True, workers=2, what="kNN val images")
    message = str(err.value)
    assert "\n" not in message and "decoding the kNN val images to preload them failed in a loader worker (" in message
    assert "fewer --workers (now 2)" in message


def test_what_cannot_be_preloaded_falls_back_or_stops(tmp_path, capsys):
    root = write_imagefolder(tmp_path / "data", num_classes=2, per_class=2, size=20, splits=("",))
    Image.new("RGB", (24, 20)).save(os.path.join(root, "class_1", "wide.png"))
    dataset = data.build_dataset("imagefolder", root, "pretrain", read="tensor")
    assert preloading.preload(dataset, data.Budget(CPU)) is None  # auto: the loader, with a line
    assert "do not stack into one tensor: reading them with the loader" in capsys.readouterr().out
    with pytest.raises(UserError, match="--preload device: images of different sizes"):
        preloading.preload(dataset, data.Budget(CPU), required=True)
    small = data.Budget(CPU)
    small.total = 1000
    with pytest.raises(UserError, match=r"the 5 decoded images \(3x20x20\) need 0.0 GiB, more than 25%"):
        preloading.preload(dataset, small, required=True)
    assert preloading.preload(dataset, small) is None
    assert preloading.wanted("auto", CPU) is False and preloading.wanted("device", CPU)


# ---------------------------------------------------------------- samplers and workers

def test_sampler_ranks_partition_the_global_batches():
    one = list(data.ResumableSampler(20, 8, seed=5))
    ranks = [list(data.ResumableSampler(20, 8, rank=r, world_size=2, seed=5)) for r in range(2)]
    assert len(one) == 16 and [k for step in range(2) for r in range(2) for k in ranks[r][4 * step:4 * step + 4]] == one
    resumed = data.ResumableSampler(20, 8, seed=5)
    resumed.set_epoch(0, 1)
    assert list(resumed) == one[8:]


class Niceness(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return os.nice(0)


def test_pretrain_workers_yield_the_cpu_to_training():
    """Workers run at a lower priority than the training process (which launches the GPU kernels)."""
    loader = torch.utils.data.DataLoader(Niceness(), batch_size=2, num_workers=1, worker_init_fn=init_worker)
    (niceness,) = list(loader)
    assert WORKER_NICENESS > 0 and niceness.tolist() == [min(19, os.nice(0) + WORKER_NICENESS)] * 2
    assert np.all(niceness.numpy() >= os.nice(0))
