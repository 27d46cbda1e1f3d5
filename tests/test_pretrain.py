"""main_pretrain.py as users run it: the methods and their options, the device augmentation lowering the loss, the
views' preview, MoCo's spellings, the embedded demo."""
import dataclasses
import glob
import json
import os
import re

import pytest
import torch
from PIL import Image

from conftest import TINY, assert_trained, load, pretrain, run_script, write_imagefolder
import main_pretrain
from sce import UserError, losses
from sce.timing import PARTS

pytestmark = pytest.mark.usefixtures("in_process")  # conftest: one thread, signal handlers restored


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("pretrain") / "data", num_classes=3, per_class=6, size=20)


def test_methods_and_options_run(data, tmp_path, capsys, monkeypatch):
    # baselines, eq. 10, symmetric multi-crop on device, shuffle-BN, LARS, channels-last, a predictor; the kNN monitor
    # (every BN split, --split-bn all: a resumed run keeps it, another one typed is refused)
    flags = ["--method", "ressl", "--symmetric", "--local-crop-sizes", 8, "--local-crop-scales", 0.1, 0.5,
             "--augment", "gpu", "--shuffle-bn", "--bn-splits", 2, "--optimizer", "lars", "--channels-last",
             "--pred-hidden-dims", 32, "--queue-size", 48]
    pretrain(data, tmp_path / "r", *flags, "--split-bn", "all")
    with pytest.raises(UserError, match="was trained with --split-bn all, not momentum: pass the same value"):
        pretrain(data, tmp_path / "r", *flags, "--epochs", 2, "--split-bn", "momentum")
    ckpt = load(tmp_path / "r" / "checkpoint_last.pth")
    assert ckpt["args"]["tau_m"] == 0.04 and ckpt["args"]["target_aug"] == "weak" and ckpt["args"]["split_bn"] == "all"
    assert int(ckpt["model"]["queue_ptr"]) == 32  # symmetric: 2 x 8 keys per step, 2 steps
    assert_trained(tmp_path / "r")
    assert any(k.startswith("predictor.") for k in ckpt["model"])
    capsys.readouterr()
    # a method whose record logs no terms logs its loss alone
    monkeypatch.setitem(losses.METHODS, "moco", dataclasses.replace(losses.METHODS["moco"], terms=None))
    pretrain(data, tmp_path / "m", "--method", "moco", "--knn-data", data, "--knn-every", 1)
    assert re.search(r"=> epoch 1: kNN top-1 \d+\.\d+ top-5 \d+\.\d+", capsys.readouterr().out)  # the kNN monitor
    line = json.loads(open(tmp_path / "m" / "log.txt").read().splitlines()[-1])
    assert line["loss"] > 0 and not {"infonce", "ressl", "ceil"} & set(line)
    args = load(tmp_path / "m" / "checkpoint_last.pth")["args"]
    assert args["tau"] == 0.2 and args["loss"] == "infonce" and args["target_aug"] == "strong"
    assert args["split_bn"] is None  # no split BN: recorded as the run applied it
    assert_trained(tmp_path / "m")
    pretrain(data, tmp_path / "c", "--loss-coeffs", 0.5, 0.5, 0)
    assert load(tmp_path / "c" / "checkpoint_last.pth")["args"]["loss"] == "combined"
    assert_trained(tmp_path / "c")


def test_gpu_augment_run_lowers_the_loss(tmp_path, capsys):
    # --augment gpu on a machine without one: the batched ops run on CPU tensors in this process, and
    # --decode device decodes the JPEG half of each batch there (torchvision's CPU decoder standing in)
    data = write_imagefolder(tmp_path / "data", num_classes=4, per_class=16, size=24, splits=("",))
    for png in glob.glob(os.path.join(data, "class_[01]", "*.png")):  # half JPEG: torchvision's decoder path
        Image.open(png).save(png[:-4] + ".jpg", quality=95)
        os.remove(png)
    capsys.readouterr()
    main_pretrain.main(["--data", data, "--augment", "gpu", "--decode", "device", "--arch", "resnet18",
                        "--small-input", "--crop-size", "8", "--min-scale", "0.5", "--batch-size", "16",
                        "--queue-size", "32", "--workers", "0", "--proj-hidden-dims", "64", "--proj-dim", "32",
                        "--epochs", "8", "--lr", "1.0", "--warmup-epochs", "0", "--print-freq", "2", "--save-freq",
                        "100", "--seed", "1", "--output-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "=> data: loader, 0 worker(s); JPEGs decoded, cropped and augmented on cpu; step: eager; amp none" in out
    losses = [float(x) for x in re.findall(r"\] loss (\d+\.\d+)", out)]  # 8 epochs of 4 steps, every 2nd
    assert len(losses) == 16  # 16 images a batch: noisy; down by 1.19 with seed 1 (0.27 to 1.19 over seeds 0-3)
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses
    assert_trained(tmp_path / "out")


@pytest.mark.parametrize("augment", ["cpu", "gpu"])
def test_preview_views_of_the_demo(tmp_path, monkeypatch, augment):
    monkeypatch.setenv("HOME", str(tmp_path))  # the demo writes its digits under ~/.cache
    monkeypatch.chdir(tmp_path)  # and would write its run under ./runs
    out = tmp_path / "views.png"
    main_pretrain.main(["--preview-views", str(out), "--local-crop-sizes", "8", "--local-crop-scales", "0.1", "0.4",
                        "--augment", augment])
    # 8 images x (target, online, one local crop), 112 px cells under a 16 px header
    assert Image.open(out).size == (3 * 112, 16 + 8 * 112)
    assert not (tmp_path / "runs").exists()  # nothing trained, nothing saved


def test_moco_spellings():
    import main_pretrain
    ours = main_pretrain.parser.parse_args(["--data", "d", "--arch", "resnet18", "--batch-size", "64", "--workers", "2",
                                            "--weight-decay", "1e-5"])
    moco = main_pretrain.parser.parse_args(["--data", "d", "-a", "resnet18", "-b", "64", "-j", "2", "--wd", "1e-5"])
    assert vars(ours) == vars(moco)


def test_demo_trains_and_prints_knn_line(tmp_path, monkeypatch, capsys):
    # the bar of a short demo: finite steps, a trunk that moved and the closing kNN line. Beating the untrained kNN
    # takes the demo's 3 epochs (2 to 3 min, README's figures); this test's 4 steps cannot. One epoch on 8 px crops
    # (a quarter of the compute) of the first 450 digits, in this process, a bank of 200
    from sklearn import datasets
    from sklearn.utils import Bunch
    digits = datasets.load_digits()
    monkeypatch.setattr(datasets, "load_digits", lambda: Bunch(images=digits.images[:450], target=digits.target[:450]))
    monkeypatch.setenv("HOME", str(tmp_path))  # the demo writes its digits under ~/.cache
    main_pretrain.main(["--epochs", "1", "--crop-size", "8", "--batch-size", "128", "--workers", "0",
                        "--knn-max-train", "200", "--knn-k", "20", "--output-dir", str(tmp_path / "demo")])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"kNN top-1: \d+\.\d% \(untrained: \d+\.\d%\); online probe top-1: \d+\.\d%", last), last
    assert_trained(tmp_path / "demo")
    # its one kNN after training (none at the epochs' ends: --knn-every 0) is the split's kNN part, not its exit
    timed = json.loads(open(tmp_path / "demo" / "timing.txt").read())
    assert timed["knn_s"] > 0
    assert sum(timed[f"{part}_s"] for part in PARTS) == pytest.approx(timed["wall_s"], abs=0.01)


def test_two_runs_in_one_process_behave_as_two_processes(small, tmp_path, monkeypatch, capsys):
    """Nothing of a run outlives it: after a run whose compiles failed (views and step), another with other flags
    compiles its own views and modules and trains to the weights a fresh process gives."""
    real = torch.compile

    def failing(fn=None, *a, **k):
        def fail(*args, **kwargs):
            raise RuntimeError("Cannot find a working triton installation")
        return fail
    args = ["--data", small, "--epochs", "1", "--preload", "device"] + TINY
    with monkeypatch.context() as m, pytest.warns(UserWarning) as warned:
        m.setattr(torch, "compile", failing)  # nn.Module.compile calls it too
        main_pretrain.main(args + ["--compile", "--output-dir", str(tmp_path / "first")])
    said = " ".join(str(w.message) for w in warned)
    assert "compile of the views failed" in said and "compile of the training step failed" in said
    monkeypatch.setattr(torch, "compile", lambda fn=None, *a, **k: real(fn, *a, **dict(k, backend="eager")))
    capsys.readouterr()
    second = args + ["--compile", "--seed", "1", "--lambda", "0.4", "--output-dir", str(tmp_path / "second")]
    main_pretrain.main(second)
    out = capsys.readouterr().out
    assert re.search(r"each compile: .*preloaded_view [\d.]+ s, preloaded_view [\d.]+ s", out), out  # its own
    assert "step: compiled" in out and "failed" not in out
    run_script(["main_pretrain.py"] + second[:-1] + [str(tmp_path / "fresh"), "--no-compile"])
    main_pretrain.main(second[:-1] + [str(tmp_path / "again"), "--no-compile"])
    fresh, again = (load(tmp_path / d / "checkpoint_last.pth")["model"] for d in ("fresh", "again"))
    assert all(torch.equal(fresh[k], again[k]) for k in fresh)
