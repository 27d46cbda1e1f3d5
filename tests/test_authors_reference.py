"""benchmarks/fidelity/authors_reference.sh and .py, without the authors' code: bad input is one line, the commands are
RECIPES.md's CIFAR-10 line and their config's overrides, and their trunk comes out of a Lightning-style checkpoint
as a state dict that our evaluation loads."""
import importlib.util
import os
import shlex
import subprocess
import sys

import pytest
import torch

from conftest import REPO, write_imagefolder
import main_lincls
import main_pretrain
from sce.builder import build_trunk
from sce.checkpoint import load_trunk
from test_recipes import COMMANDS

SCRIPT = os.path.join(REPO, "benchmarks", "fidelity", "authors_reference.sh")
ENV = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")


def fake_checkout(root):
    """The two files the script looks for in AUTHORS_DIR."""
    for path in ("run/pretrain.py", "sce/configs/run/pretrain/sce/resnet18/resnet18_cifar10.yaml"):
        os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
        open(os.path.join(root, path), "w").close()
    return str(root)


def run(*args, **env):
    return subprocess.run(["bash", SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=dict(ENV, **env))


def test_bad_input_is_one_line(tmp_path):
    authors = fake_checkout(tmp_path / "SCE")
    data = write_imagefolder(tmp_path / "data", num_classes=2, per_class=1)

    def error(*args, **env):
        proc = run(*args, **env)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        return lines[0]
    assert "is not a checkout of CEA-LIST/SCE" in error(tmp_path, data, 2)
    assert "has no train/ and val/ class folders" in error(authors, tmp_path / "none", 2)
    assert "EPOCHS must be a whole number from 1 to 999999 (got 'x')" in error(authors, data, "x")
    assert f"(got '{2 ** 64 + 1}')" in error(authors, data, 2 ** 64 + 1)  # not wrapped to 1
    assert "(got '0')" in error(authors, data, 0)
    assert "unknown run 'theirs'" in error(authors, data, 2, ORDER="ours theirs")
    assert "holds no .whl files" in error(authors, data, 2, AUTHORS_WHEELS=str(tmp_path))
    assert "usage:" in run(authors).stderr and run(authors).returncode == 2
    launcher = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "fidelity", "authors_reference.py"),
                               "pretrain", str(tmp_path), data, str(tmp_path / "run")], capture_output=True, text=True)
    assert launcher.returncode == 2 and launcher.stderr.startswith("error: ") and "not a checkout" in launcher.stderr


def test_dry_run_commands(tmp_path):
    """Ours: RECIPES.md's CIFAR-10 line with the data, epochs, seed and folder replaced, the kNN monitor after the
    last epoch; theirs: their config with the epochs, the checkpoints and the seed, its trunk read by main_lincls.py
    --knn; both kNN at k 200, T 0.07, 32 px."""
    authors = fake_checkout(tmp_path / "SCE")
    data = write_imagefolder(tmp_path / "data", num_classes=2, per_class=1)
    proc = run(authors, data, 3, tmp_path / "out", DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    found = {}
    for line in proc.stdout.splitlines():
        name, cmd = line.removeprefix("=== ").split(": ", 1)
        found[name] = shlex.split(cmd)
    assert list(found) == ["ours_pretrain", "authors_pretrain", "authors_trunk", "authors_knn"]
    ours = main_pretrain.parse_args(found["ours_pretrain"][2:])
    recipe = main_pretrain.parse_args(next(c for c in COMMANDS if "--dataset cifar10" in " ".join(c)))
    for key, value in vars(recipe).items():
        if key not in ("data", "dataset", "epochs", "output_dir", "knn_data", "knn_every", "knn_k", "knn_t",
                       "knn_max_train", "seed", "recipe", "sources"):  # ours has a kNN monitor, the line none
            assert getattr(ours, key) == value, key
    assert (ours.dataset, ours.data, ours.knn_data, ours.epochs, ours.knn_every, ours.seed) == (
        "imagefolder", data, data, 3, 3, 42)
    assert (ours.tau, ours.tau_m, ours.queue_size) == (0.2, 0.1, 4096)  # RECIPES.md's, not a copy's
    theirs = found["authors_pretrain"]
    assert theirs[1:5] == ["benchmarks/fidelity/authors_reference.py", "pretrain", authors, data]
    for override in ("trainer.max_epochs=3", "callbacks.model_checkpoint.every_n_epochs=3", "seed.seed=42",
                     "~trainer.strategy", "+datamodule.train.transform._convert_=all",
                     "+datamodule.train.loader.shuffle=True"):  # one device has no DDP sampler to shuffle
        assert override in theirs
    cpu = not torch.cuda.is_available()  # fp32 there, else their fp16 and our bf16
    assert ("trainer.precision=32" in theirs) == cpu and (ours.amp == "none") == cpu
    assert found["authors_trunk"][-2:] == [f"{tmp_path}/out/authors/pretrain_checkpoints/epoch=2.ckpt",
                                           f"{tmp_path}/out/authors/trunk.pth"]
    args = main_lincls.get_parser().parse_args(found["authors_knn"][2:])
    assert (args.knn, args.knn_k, args.knn_t, args.crop_size, args.pretrained) == (
        True, 200, 0.07, 32, f"{tmp_path}/out/authors/trunk.pth")
    assert (ours.knn_k, ours.knn_t) == (200, 0.07)
    assert not os.path.exists(tmp_path / "out" / "ours")  # nothing ran


def load_launcher():
    spec = importlib.util.spec_from_file_location("authors_reference",
                                                  os.path.join(REPO, "benchmarks", "fidelity", "authors_reference.py"))
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    return launcher


def test_their_run_stops_when_its_first_batches_hold_one_class_each(capsys):
    """Their loader without a shuffle reads a class-sorted folder in order: the run stops in one line; mixed
    batches are said and go on."""
    launcher = load_launcher()
    with pytest.raises(SystemExit) as stop:
        launcher.mixed_or_fail([1, 1, 1])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "does not shuffle" in err[0]
    launcher.mixed_or_fail([1, 7, 10])
    assert "hold 1, 7, 10 classes" in capsys.readouterr().out


def test_their_pins_are_unpacked_without_pip(tmp_path):
    """A wheel is unpacked as the zip it is (pip 24.1+ refuses pytorch-lightning 1.7.7's metadata), once."""
    import zipfile
    with zipfile.ZipFile(tmp_path / "pkg-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("pkg/__init__.py", "VALUE = 7\n")
    launcher = load_launcher()
    launcher.unpack(str(tmp_path), str(tmp_path / "site"))
    assert (tmp_path / "site" / "pkg" / "__init__.py").read_text() == "VALUE = 7\n"
    assert (tmp_path / "site" / ".installed").exists()
    with pytest.raises(SystemExit):
        launcher.unpack(str(tmp_path / "site"), str(tmp_path / "other"))  # no wheels: one line


def test_their_trunk_loads_into_our_evaluation(tmp_path):
    """The online trunk (trunk.*) of a Lightning checkpoint, not the momentum one, loads strictly into our
    resnet18 with the small-input stem; a checkpoint with no trunk is one line."""
    launcher = load_launcher()
    torch.manual_seed(0)
    online, _ = build_trunk("resnet18", small_input=True)
    momentum, _ = build_trunk("resnet18", small_input=True)
    state = {f"trunk.{k}": v for k, v in online.state_dict().items()}
    state.update({f"momentum_trunk.{k}": v for k, v in momentum.state_dict().items()})
    state.update({"trunk.fc.weight": torch.zeros(1), "projector.layer.weight": torch.zeros(2), "queue": torch.zeros(3)})
    torch.save({"epoch": 4, "state_dict": state, "hyper_parameters": {"temp": 0.1}}, tmp_path / "epoch=4.ckpt")
    launcher.extract_trunk(str(tmp_path / "epoch=4.ckpt"), str(tmp_path / "trunk.pth"))
    trunk, dim, _ = load_trunk(str(tmp_path / "trunk.pth"), "resnet18", True)
    assert dim == 512
    for key, value in trunk.state_dict().items():
        assert torch.equal(value, online.state_dict()[key]), key
    torch.save({"state_dict": {"model.conv1.weight": torch.zeros(1)}}, tmp_path / "other.ckpt")
    with pytest.raises(SystemExit) as stop:
        launcher.extract_trunk(str(tmp_path / "other.ckpt"), str(tmp_path / "t.pth"))
    assert stop.value.code == 2
