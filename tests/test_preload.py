"""Preloaded datasets (sce.preload) and the CUDA-graph step (sce.engine.GraphedStep), on CPU tensors:
the batched crop equals torchvision's, the views equal the loader path's from the same parameters,
they are a function of (seed, epoch, index), bad images are named and replaced, a mid-epoch resume is
exact, and the graph path gives the eager step's numbers or falls back to it."""
import functools
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image

from conftest import REPO, assert_mid_epoch_resume_is_exact, assert_same_state, write_imagefolder
from sce import UserError, losses, preload
from sce.augment import AUGMENTATIONS, MEAN, RRC_RATIO, STD, MultiView, View, normalize_stats, pack_params
from sce.datasets import build_dataset, load_rgb_tensor
from sce.device_augment import augment
from sce.engine import GraphedStep, Training, lr_as_tensors, train_step
from sce.loader import ResumableSampler
from sce.optim import build_optimizer, set_lr


@pytest.fixture(scope="module")
def photos():
    """Six 40x48 crops of scikit-learn's sample photos, uint8 (6, 3, 40, 48)."""
    from sklearn.datasets import load_sample_images
    images = load_sample_images().images
    crops = [np.asarray(Image.fromarray(images[i % 2][60 * i:60 * i + 200, 80 * i:80 * i + 240]).resize((48, 40)))
             for i in range(6)]
    return torch.from_numpy(np.stack(crops)).permute(0, 3, 1, 2).contiguous()


def uniforms(n, width, seed=0):
    return torch.rand(n, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_batched_crop_equals_torchvision_resized_crop(photos):
    x = photos.float() / 255
    boxes = [(0, 0, 40, 48), (3, 5, 20, 30), (10, 2, 12, 9), (0, 40, 40, 8), (20, 10, 7, 33), (1, 1, 39, 47)]
    top, left, h, w = (torch.tensor(c, dtype=torch.float64) for c in zip(*boxes))
    flip = torch.tensor([False, True, False, True, False, True])
    got = preload.crop_resize_flip(x, top, left, h, w, 24, flip)  # shrinking and enlarging windows
    for n, (t, l, hh, ww) in enumerate(boxes):
        expected = TF.resized_crop(x[n], t, l, hh, ww, [24, 24], antialias=True)
        expected = TF.hflip(expected) if flip[n] else expected
        assert torch.allclose(got[n], expected, atol=2e-6), n


def torchvision_get_params(u, height, width, scale, ratio=RRC_RATIO):
    """RandomResizedCrop.get_params transcribed with its draws read from u, one image."""
    area = height * width
    for attempt in range(preload.RRC_ATTEMPTS):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * float(u[2 * attempt]))
        log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * float(u[2 * attempt + 1]))
        w, h = int(round(math.sqrt(target_area * aspect))), int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            i = int(float(u[-2]) * (height - h + 1))
            j = int(float(u[-1]) * (width - w + 1))
            return i, j, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


@pytest.mark.parametrize("height,width,scale", [(40, 48, (0.2, 1.0)), (16, 64, (0.9, 1.0)), (64, 16, (0.95, 1.0))])
def test_crop_parameters_are_torchvisions(height, width, scale):
    u = uniforms(200, 2 * preload.RRC_ATTEMPTS + 2)
    top, left, h, w = preload.random_resized_crops(u, height, width, scale)
    got = list(zip(top.long().tolist(), left.long().tolist(), h.long().tolist(), w.long().tolist()))
    assert got == [torchvision_get_params(row, height, width, scale) for row in u]
    if scale[0] > 0.5:  # a 4:1 image and a large area: many draws fit nowhere, the fallback is taken
        assert (h == height).sum() > 0 or (w == width).sum() > 0


def loader_path_view(photos, u, aug, size, scale):
    """The same view the --augment gpu loader makes from the same parameters: torch's uint8 resized
    crop and flip in the worker (sce.augment.View), packed rows, sce.device_augment.augment."""
    top, left, h, w = preload.random_resized_crops(u, photos.shape[-2], photos.shape[-1], scale)
    flip = u[:, 2 * preload.RRC_ATTEMPTS + 2] < 0.5
    params = preload.photometric_params(u[:, 2 * preload.RRC_ATTEMPTS + 3:], aug, preload.jitter_table(aug, "cpu"))
    crops, rows = [], []
    for n in range(len(photos)):
        crop = TF.resized_crop(photos[n], int(top[n]), int(left[n]), int(h[n]), int(w[n]), [size, size],
                               antialias=True)
        crops.append(TF.hflip(crop) if flip[n] else crop)
        rows.append(pack_params(dict(jitter=bool(params["jitter"][n]), order=params["order"][n].tolist(),
                                     factors=params["factors"][n].tolist(), gray=bool(params["gray"][n]),
                                     sigma=float(params["sigma"][n]), solarize=bool(params["solarize"][n]))))
    return augment(torch.stack(crops), torch.stack(rows), torch.device("cpu"), compile=False)


def to_pixels(view):
    return view * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)


@pytest.mark.parametrize("aug", list(AUGMENTATIONS))
def test_views_equal_the_loader_paths_from_the_same_parameters(photos, aug):
    u = uniforms(len(photos), preload.VIEW_DRAWS, seed=list(AUGMENTATIONS).index(aug))
    stats = normalize_stats(torch.device("cpu"))
    got = preload.pretrain_view(photos, u, aug, preload.jitter_table(aug, "cpu"), 24, (0.2, 1.0), stats, torch.float32,
                                 torch.contiguous_format)
    expected = loader_path_view(photos, u, aug, 24, (0.2, 1.0))
    diff = (to_pixels(got) - to_pixels(expected)).abs()
    # the loader rounds its crop to uint8 (<= 0.5 level, plus its fixed-point weights); the photometric
    # ops can stretch that (contrast, saturation, brightness factors up to 1.4 each)
    assert diff.max() <= 4 / 255 and diff.mean() <= 0.5 / 255, (diff.max() * 255, diff.mean() * 255)


def preloaded_batches(images, seed, rank=0, world=1, epoch=1, start_step=0):
    sampler = ResumableSampler(len(images), 4, rank, world, seed)
    sampler.set_epoch(epoch, start_step)
    views = MultiView([View("weak", 16, (0.3, 1.0), True), View("strong-gamma", 12, (0.2, 1.0), True)])
    return [v for v, _, _ in preload.PreloadedViews(preload.Images(images), views, sampler, seed, compile=False)]


def test_views_are_a_function_of_seed_epoch_and_index(photos):
    images = torch.cat([photos, photos.flip(-1)])  # 12 images: 3 steps of 4
    one = preloaded_batches(images, seed=3)
    two = [preloaded_batches(images, 3, rank, 2) for rank in (0, 1)]
    for step, views in enumerate(one):  # rank r holds the r-th half of each global batch
        for k, view in enumerate(views):
            assert torch.equal(view, torch.cat([two[0][step][k], two[1][step][k]]))
    resumed = preloaded_batches(images, 3, start_step=1)
    assert all(torch.equal(a, b) for x, y in zip(one[1:], resumed) for a, b in zip(x, y))
    assert not torch.equal(one[0][1], preloaded_batches(images, 3, epoch=2)[0][1])  # a new epoch, new views
    assert not torch.equal(one[0][1], preloaded_batches(images, 4)[0][1])  # another seed


@pytest.mark.parametrize("encoded", [False, True])
def test_preload_decodes_names_and_replaces_bad_images(tmp_path, capsys, encoded):
    """encoded: --decode device, whose plain JPEGs come as bytes; the bad file is then a JPEG whose header
    reads and whose data is cut short (decoded outside the error handling, it was a traceback)."""
    root = write_imagefolder(tmp_path / "data", num_classes=2, per_class=3, size=20, splits=("",))
    Image.open(os.path.join(root, "class_0", "1.png")).save(os.path.join(root, "class_0", "1.jpg"), quality=90)
    os.remove(os.path.join(root, "class_0", "1.png"))
    bad = os.path.join(root, "class_1", "0.jpg" if encoded else "0.png")
    os.remove(os.path.join(root, "class_1", "0.png"))
    with open(os.path.join(root, "class_0", "1.jpg"), "rb") as f, open(bad, "wb") as out:
        out.write(f.read()[:-60] if encoded else b"\x89PNG\r\n\x1a\n truncated")
    dataset = build_dataset("imagefolder", root, "pretrain", as_tensor=True, encoded=encoded)
    images = preload.preload(dataset, torch.device("cpu"), required=True, max_bad=1)
    out = capsys.readouterr().out
    assert f"warning: skipping unreadable image {bad} (" in out and "=> preloaded 6 images (3x20x20" in out
    index = [p for p, _ in dataset.samples].index(bad)
    for i, (path, _) in enumerate(dataset.samples):  # the bad one holds the next image, as the loader does
        assert torch.equal(images.images[i], load_rgb_tensor(dataset.samples[i + 1 if i == index else i][0]))
    assert images.targets.tolist() == dataset.targets
    with pytest.raises(UserError, match="1 unreadable images, more than --max-bad-images 0"):
        preload.preload(dataset, torch.device("cpu"), required=True, max_bad=0)


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
    code = ("import resource, sys, torch; sys.path[:0] = sys.argv[1:3]; from test_preload import Shades; "
            "from sce import preload; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
            "images = preload.preload(Shades(3000), torch.device('cpu'), required=True, workers=4); "
            "assert torch.equal(images.images[:, 0, 0, 0], torch.arange(3000) % 251); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code, REPO, os.path.join(REPO, "tests")], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and proc.stdout.endswith("ok\n"), proc.stderr[-2000:]


@pytest.mark.parametrize("failure", ["exit", "hang"])
def test_a_failing_preloading_worker_ends_the_run_with_one_line(monkeypatch, failure):
    monkeypatch.setattr(preload, "BATCH_TIMEOUT_S", 3)
    with pytest.raises(UserError) as err:
        preload.preload(Shades(600, failure), torch.device("cpu"), required=True, workers=2, what="kNN val images")
    message = str(err.value)
    assert "\n" not in message and "decoding the kNN val images to preload them failed in a loader worker (" in message
    assert "fewer --workers (now 2)" in message


def test_what_cannot_be_preloaded_falls_back_or_stops(tmp_path, monkeypatch, capsys):
    root = write_imagefolder(tmp_path / "data", num_classes=2, per_class=2, size=20, splits=("",))
    Image.new("RGB", (24, 20)).save(os.path.join(root, "class_1", "wide.png"))
    dataset = build_dataset("imagefolder", root, "pretrain", as_tensor=True)
    assert preload.preload(dataset, torch.device("cpu")) is None  # auto: the loader, with a line
    assert "do not stack into one tensor: reading them with the loader" in capsys.readouterr().out
    with pytest.raises(UserError, match="--preload device: images of different sizes"):
        preload.preload(dataset, torch.device("cpu"), required=True)
    monkeypatch.setattr(preload, "memory_budget", lambda device: 1000)
    with pytest.raises(UserError, match=r"the 5 decoded images \(3x20x20\) need 0.0 GiB, more than 25%"):
        preload.preload(dataset, torch.device("cpu"), required=True)
    assert preload.preload(dataset, torch.device("cpu")) is None
    assert preload.wanted("auto", torch.device("cpu")) is False and preload.wanted("device", torch.device("cpu"))


def test_lincls_batches_are_torchvisions_padded_random_crop(photos):
    images = preload.Images(photos[:, :, :32, :32].contiguous(), torch.arange(6))
    batches = preload.PreloadedBatches(images, range(6), 4, size=32, train=True, padding=4, seed=1)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert torch.equal(y, torch.arange(6)) and len(batches) == 2
    u = preload.epoch_uniforms(1, 0, 6, 3, torch.device("cpu"))
    for n in range(6):  # zero padding of 4, a 32 px window, then the flip: exact integer shifts
        top, left = int(u[n, 0] * 9), int(u[n, 1] * 9)  # 40 - 32 + 1 positions in the padded image
        padded = torch.nn.functional.pad(photos[n, :, :32, :32].float() / 255, (4, 4, 4, 4))
        expected = padded[:, top:top + 32, left:left + 32]
        expected = expected.flip(-1) if u[n, 2] < 0.5 else expected
        assert torch.allclose(to_pixels(x[n:n + 1])[0], expected, atol=1e-6)


# ---------------------------------------------------------------- the CUDA-graph step

class Replay:
    """A CPU stand-in for CudaGraphs: 'capture' runs nothing, 'replay' runs the captured function again
    on the same static inputs (what a CUDA graph does with them). Steps must read every value that
    changes through those inputs: a Python number captured in the function would stay stale here."""

    def __init__(self, fail=False):
        self.fail, self.captures = fail, 0

    def eager(self, fn):
        return fn()

    def capture(self, fn):
        self.captures += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        out = []
        return lambda: out.append(fn()), lambda: out[-1]


def training(lam):
    torch.manual_seed(0)  # the same weights, and the same shuffle-BN draws
    from sce.builder import SCE
    model = SCE(functools.partial(losses.sce_loss, lambda_=lam), "resnet18", True, [32], 16, "affine",
                queue_size=16, shuffle_bn=True, bn_splits=2)
    return Training(model, model, build_optimizer("sgd", model, 0.5, 1e-4),
                    terms=functools.partial(losses.loss_terms, tau=0.1, tau_m=0.07))


def run_steps(step, t, lam, steps=4):
    out = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        views = [torch.randn(4, 3, 8, 8, generator=g) for _ in range(2)]
        set_lr(t.optimizer, 0.5 / (i + 1))
        lam.fill_(0.2 * i)
        loss, finite, terms = step(views, 0.9 + 0.02 * i)
        out.append((loss.clone(), finite.clone(), {k: v.clone() for k, v in terms.items()}))
    return out


@pytest.fixture(scope="module")
def eager_steps():
    lam = torch.zeros(())
    t = training(lam)
    return run_steps(functools.partial(train_step, t), t, lam), t.model.state_dict()


@pytest.mark.parametrize("fail", [False, True])
def test_graphed_step_gives_the_eager_steps_numbers(eager_steps, fail):
    lam = torch.zeros(())
    t = training(lam)
    lr_as_tensors(t.optimizer, torch.device("cpu"))
    lrs = [g["lr"] for g in t.optimizer.param_groups]
    graphs = Replay(fail)
    step = GraphedStep(t, graphs, warmup=2)  # steps 1-2 eager, step 3 captured then replayed, step 4 replayed
    if fail:
        with pytest.warns(UserWarning, match="CUDA graph capture of the training step failed .*running it eagerly"):
            graphed = run_steps(step, t, lam)
    else:
        graphed = run_steps(step, t, lam)
    assert graphs.captures == 1 and (step.capture_s is None) == fail
    assert all(g["lr"] is lr for g, lr in zip(t.optimizer.param_groups, lrs))  # filled in place, read by the graph
    eager, state = eager_steps
    for (a, fa, ta), (b, fb, tb) in zip(eager, graphed):
        assert torch.equal(a, b) and torch.equal(fa, fb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert_same_state(state, t.model.state_dict())


# ---------------------------------------------------------------- main_pretrain.py on the preloaded path

def test_preloaded_run_resumes_mid_epoch_exactly(tmp_path, monkeypatch, capsys):
    data = write_imagefolder(tmp_path / "data", num_classes=2, per_class=8, size=20, splits=("",))
    args = ["--data", data, "--arch", "resnet18", "--small-input", "--crop-size", "16", "--batch-size", "8",
            "--queue-size", "32", "--workers", "0", "--proj-hidden-dims", "32", "--proj-dim", "16",
            "--print-freq", "1", "--epochs", "2", "--augment", "gpu", "--preload", "device", "--shuffle-bn",
            "--bn-splits", "2", "--lambda-schedule", "cosine", "--lambda-end", "0.9", "--cuda-graph"]
    torch.set_num_threads(1)
    assert_mid_epoch_resume_is_exact(args, tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert "=> preloaded 16 images (3x20x20" in out and "data 0%" in out
    assert "--cuda-graph needs one GPU process" in out  # and the run went on eagerly


def test_lincls_and_knn_on_preloaded_images(pretrained, tmp_path, capsys):
    import json
    import main_lincls
    data = write_imagefolder(tmp_path / "data", 3, 6, 32)
    for i in range(3):  # a few wrong val labels, so that kNN accuracy is not trivially 100%
        os.replace(os.path.join(data, "val", f"class_{i}", "0.png"),
                   os.path.join(data, "val", f"class_{(i + 1) % 3}", "x.png"))
    common = ["--data", data, "--pretrained", pretrained, "--workers", "0", "--knn-k", "5"]
    results = {}
    for mode in ("off", "device"):
        main_lincls.main(common + ["--knn", "--preload", mode, "--output-dir", str(tmp_path / mode)])
        results[mode] = json.load(open(tmp_path / mode / "results_knn.json"))
    assert "=> preloaded 18 train images (3x32x32" in capsys.readouterr().out
    # the same images, resized and normalised on the device instead of by torchvision: the same neighbours
    assert results["device"] == results["off"] and results["off"]["acc1"] < 100
    main_lincls.main(common + ["--preload", "device", "--epochs", "2", "--batch-size", "6",
                               "--output-dir", str(tmp_path / "linear")])
    out = capsys.readouterr().out
    assert "=> preloaded 18 val images" in out and re.search(r"Epoch 2/2: Acc@1 \d", out)
