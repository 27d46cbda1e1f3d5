"""Shared test helpers: small datasets written in the real formats, and script runners."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def class_image(label, rng, size=32):
    """A noisy image whose colour and stripe orientation depend on the class: linearly separable."""
    base = np.zeros((size, size, 3), np.float32)
    base[..., label % 3] = 180
    if (label // 3) % 2:
        base[::4] += 60
    else:
        base[:, ::4] += 60
    return np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)


def write_imagefolder(root, num_classes=3, per_class=8, size=32, splits=("train", "val"), seed=0):
    """root/<split>/class_<c>/<i>.png with class-dependent pictures; returns root."""
    rng = np.random.default_rng(seed)
    for split in splits:
        for c in range(num_classes):
            folder = os.path.join(root, split, f"class_{c}") if split else os.path.join(root, f"class_{c}")
            os.makedirs(folder, exist_ok=True)
            for i in range(per_class):
                Image.fromarray(class_image(c, rng, size)).save(os.path.join(folder, f"{i}.png"))
    return str(root)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_state(a, b):
    """Every tensor equal, bit for bit."""
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def run_script(args, cwd=REPO, timeout=300, env=None, check=True):
    """Run `python <args>` (or `torchrun` when args[0] == 'torchrun') from the repo root."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    if args[0] == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run"] + args[1:]
    else:
        cmd = [sys.executable] + args
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture
def imagefolder(tmp_path):
    return write_imagefolder(tmp_path / "data")


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory):
    """OUT/checkpoint_last.pth of one tiny main_pretrain.py run, shared by the evaluation tests."""
    out = tmp_path_factory.getbasetemp() / "pretrain_out"
    ckpt = out / "checkpoint_last.pth"
    if not ckpt.exists():
        data = write_imagefolder(tmp_path_factory.getbasetemp() / "pretrain_data", 3, 8, 32)
        run_script(["main_pretrain.py", "--data", data, "--arch", "resnet18", "--small-input", "--crop-size", "32",
                    "--epochs", "1", "--batch-size", "16", "--queue-size", "64", "--workers", "0",
                    "--output-dir", str(out)])
    return str(ckpt)
