"""Evaluation (main_lincls.py, sce.data.evaluation): the input size, the linear probe (contract, resume, learning,
frozen trunk, the same batches preloaded, read by the loader or decoded on the device), the many-shot logistic
regression and its feature cache. kNN and the kNN monitor: tests/test_knn.py."""
import contextlib
import io
import json
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from conftest import Replay, exit_message, load, script_in_process, write_imagefolder
import main_lincls
from sce import UserError, data as sce_data
from sce.builder import build_trunk
from sce.checkpoint import load_trunk, trunk_state_dict
from sce.data import STD, eval_crop_size
from sce.metrics import average_precision_11point, top1_accuracy
from sce.transfer import select_logreg

CPU = torch.device("cpu")


def lincls_here(capsys, *args):
    """main_lincls.main in this process (no interpreter start-up); returns its stdout."""
    capsys.readouterr()
    main_lincls.main([*map(str, args), "--workers", "0"])
    return capsys.readouterr().out


def same_trunk(a, b):
    sa, sb = trunk_state_dict(load(a)), trunk_state_dict(load(b))
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def last_log(out):
    with open(os.path.join(out, "log.txt")) as f:
        return json.loads(f.read().splitlines()[-1])


def result(out, name="knn"):
    with open(os.path.join(out, f"results_{name}.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("lincls") / "data", 3, 8, 32)


@pytest.fixture(scope="module")
def contract_run(pretrained, folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("lincls_out")
    with script_in_process(), contextlib.redirect_stdout(io.StringIO()) as said:  # its __main__, in this process
        assert exit_message("main_lincls.py", "--data", folder, "--pretrained", pretrained, "--arch", "resnet18",
                            "--small-input", "--crop-size", "32", "--epochs", "1", "--batch-size", "16",
                            "--output-dir", out, "--workers", "0") is None
    return out, said.getvalue()


def test_step_schedule_decays_at_the_milestones(pretrained, folder, tmp_path, capsys):
    out = lincls_here(capsys, "--data", folder, "--pretrained", pretrained, "--crop-size", "16", "--epochs", "3",
                      "--batch-size", "12", "--lr", "2", "--milestones", "1", "2", "--output-dir", tmp_path)
    lrs = [float(lr) for lr in re.findall(r"Epoch \[\d/3\]\[2/2\] loss \S+ lr (\S+)", out)]
    assert lrs == pytest.approx([2, 0.2, 0.02])  # x0.1 from epoch 1, again from epoch 2


def test_contract_command_trains_only_the_head(contract_run, pretrained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, stdout = contract_run
    assert "Acc@1" in stdout and "Acc@5" in stdout
    assert re.search(r"Epoch \[1/1\]\[2/2\] loss \S+ lr 30 24/24 images, \d+ images/s, ETA 0:00:00", stdout)
    scalars = EventAccumulator(str(out)).Reload().Tags()["scalars"]
    assert {"train/loss", "train/lr", "val/acc1", "val/acc5"} <= set(scalars)
    ckpt = load(str(out / "checkpoint_last.pth"))
    assert ckpt["kind"] == "lincls" and ckpt["epoch"] == 1
    assert ckpt["args"]["arch"] == "resnet18" and ckpt["args"]["small_input"] is True
    assert ckpt["model"]["fc.weight"].shape == (3, 512)
    assert (out / "model_best.pth").read_bytes() == (out / "checkpoint_last.pth").read_bytes()  # its 1st epoch
    # every trunk tensor, BN running statistics included, is the pretrained one
    assert same_trunk(pretrained, str(out / "checkpoint_last.pth"))
    load_trunk(str(out / "checkpoint_last.pth"))  # its checkpoints are trunks for the other tools


def test_resume_then_evaluate(contract_run, folder, pretrained, tmp_path, capsys):
    import shutil
    out, _ = contract_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(out / "checkpoint_last.pth", resumed / "checkpoint_last.pth")
    # --resume auto finds OUTPUT_DIR/checkpoint_last.pth; no --pretrained needed
    stdout = lincls_here(capsys, "--data", folder, "--resume", "auto", "--crop-size", "32",
                         "--epochs", "2", "--batch-size", "16", "--output-dir", resumed)
    assert "resumed from" in stdout and "Epoch [1/2]" not in stdout and "Epoch 2/2:" in stdout
    ckpt = load(str(resumed / "checkpoint_last.pth"))
    assert ckpt["epoch"] == 2
    assert not torch.equal(ckpt["model"]["fc.weight"], load(str(out / "checkpoint_last.pth"))["model"]["fc.weight"])
    assert same_trunk(pretrained, str(resumed / "checkpoint_last.pth"))
    lincls_here(capsys, "--data", folder, "--pretrained", resumed / "checkpoint_last.pth", "--crop-size", "32",
                "-e", "--output-dir", tmp_path / "eval")
    with open(tmp_path / "eval" / "results_evaluate.json") as f:
        result = json.load(f)
    assert result["acc1"] == pytest.approx(ckpt["acc1"]) and result["acc5"] == pytest.approx(ckpt["acc5"])


def test_linear_probe_learns(pretrained, folder, tmp_path, capsys):
    lincls_here(capsys, "--data", folder, "--pretrained", pretrained, "--crop-size", "16", "--schedule", "cosine",
                "--epochs", "4", "--batch-size", "8", "--output-dir", tmp_path)
    with open(tmp_path / "results_linear.json") as f:
        result = json.load(f)
    assert result["acc1"] >= 80.0  # 3 classes: chance is 33%
    assert same_trunk(pretrained, str(tmp_path / "checkpoint_last.pth"))


def test_frozen_check_catches_a_changed_buffer():
    from sce.probe import check_frozen
    model, _ = build_trunk("resnet18", True)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    check_frozen(model, reference)
    model.layer1[0].bn1.running_mean += 1e-3
    with pytest.raises(RuntimeError, match="layer1.0.bn1.running_mean"):
        check_frozen(model, reference)


# ---------------------------------------------------------------- logistic regression

def test_logreg_selection_picks_best_val_c():
    from sklearn.linear_model import LogisticRegression
    rng = np.random.default_rng(0)

    def blobs(n, noise):
        y = rng.integers(0, 3, n)
        x = rng.normal(size=(n, 10)) + 1.2 * np.eye(10)[y]
        flip = rng.random(n) < noise
        return x, np.where(flip, rng.integers(0, 3, n), y)

    tx, ty = blobs(60, 0.3)
    vx, vy = blobs(200, 0.0)
    wds = np.logspace(-4, 4, 9)
    best_c, history = select_logreg(tx, ty, vx, vy, "top1", wds=wds, max_iter=5000, log=lambda *a: None)
    fresh = [top1_accuracy(LogisticRegression(C=1 / wd, max_iter=5000).fit(tx, ty).predict(vx), vy) for wd in wds]
    assert len(set(fresh)) > 2  # the choice matters
    assert [s for _, s in history] == pytest.approx(fresh)
    assert best_c == pytest.approx(1 / wds[int(np.argmax(fresh))])


def test_logreg_multilabel_selection_uses_11point_map():
    from sklearn.linear_model import LogisticRegression
    rng = np.random.default_rng(1)
    x = rng.normal(size=(80, 6))
    y = np.where(x[:, :3] + rng.normal(0, 1.0, (80, 3)) > 0, 1, -1)
    y[::7, 0] = 0  # difficult: dropped from training, ignored by the AP
    tx, ty, vx, vy = x[:50], y[:50], x[50:], y[50:]
    wds = np.logspace(-2, 3, 6)
    best_c, history = select_logreg(tx, ty, vx, vy, "map11", wds=wds, max_iter=5000, log=lambda *a: None)
    fresh = []
    for wd in wds:
        aps = []
        for c in range(3):
            keep = ty[:, c] != 0
            m = LogisticRegression(C=1 / wd, max_iter=5000).fit(tx[keep], ty[keep, c] > 0)
            aps.append(average_precision_11point(m.decision_function(vx), vy[:, c]))
        fresh.append(100 * np.mean(aps))
    # one wd at a time (no warm start) the scores are exactly those of fresh per-class fits
    singles = [select_logreg(tx, ty, vx, vy, "map11", wds=[wd], max_iter=5000, log=lambda *a: None)[1][0][1]
               for wd in wds]
    assert singles == pytest.approx(fresh)
    # warm starts across the grid (as in ssl-transfer) land within the solver tolerance
    assert [s for _, s in history] == pytest.approx(fresh, abs=1.0)
    assert best_c == pytest.approx(history[int(np.argmax([s for _, s in history]))][0])


def test_logreg_script_and_feature_cache(pretrained, folder, tmp_path, capsys):
    lincls_here(capsys, "--data", folder, "--pretrained", pretrained, "--classifier", "logreg", "--crop-size", "16",
                "--output-dir", tmp_path)
    with open(tmp_path / "results_logreg.json") as f:
        result = json.load(f)
    assert result["metric"] == "top1" and len(result["val"]) == 45
    scores = [v["score"] for v in result["val"]]
    assert result["C"] == pytest.approx(result["val"][int(np.argmax(scores))]["C"])
    assert result["test"] >= 80.0
    assert len([f for f in os.listdir(tmp_path) if f.startswith("features_")]) == 2
    stdout = lincls_here(capsys, "--data", folder, "--pretrained", pretrained, "--classifier", "logreg",
                         "--crop-size", "16", "--metric", "mean-per-class", "--logreg-c", "1.0",
                         "--output-dir", tmp_path)
    assert stdout.count("features read from") == 2


# ---------------------------------------------------------------- fits that did not converge

def test_logreg_counts_fits_that_did_not_converge():
    from sce.transfer import FitCount, fit_eval_logreg
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 90)
    x = rng.normal(size=(90, 10)) + 1.2 * np.eye(10)[y]
    stopped, converged, multi = FitCount(), FitCount(), FitCount()
    fit_eval_logreg(x, y, x, y, "top1", 1.0, max_iter=1, count=stopped)  # L-BFGS needs ~10 iterations here
    fit_eval_logreg(x, y, x, y, "top1", 1.0, max_iter=1000, count=converged)
    labels = np.where(x[:, :3] > 0.5, 1, -1)
    fit_eval_logreg(x, labels, x, labels, "map11", 1.0, max_iter=1, count=multi)  # one fit per class
    assert stopped.stalled == [True] and converged.stalled == [False] and multi.stalled == [True] * 3
    assert stopped.note(1, "--logreg-max-iter") == "1 of 1 fits did not converge within --logreg-max-iter 1: raise it"
    assert converged.note(1000, "--logreg-max-iter") == "1 fits, all converged"
    wds = [1e-2, 1.0]  # the selection fits once per wd, into the same count
    select_logreg(x, y, x, y, "top1", wds=wds, max_iter=1, log=lambda *a: None, count=stopped)
    assert stopped.stalled == [True] * 3


def test_logreg_script_says_fits_did_not_converge(pretrained, folder, tmp_path, capsys):
    stdout = lincls_here(capsys, "--data", folder, "--pretrained", pretrained, "--classifier", "logreg",
                         "--crop-size", "16", "--logreg-c", "1.0", "--logreg-max-iter", "1", "--output-dir", tmp_path)
    assert re.search(r"logistic regression \(C 1, refit on \d+ images\): test top1 \d+\.\d\d "
                     r"\(1 of 1 fits did not converge within --logreg-max-iter 1: raise it\)\n", stdout), stdout
    with open(tmp_path / "results_logreg.json") as f:
        result = json.load(f)
    assert result["fits"] == 1 and result["unconverged_fits"] == 1


# ---------------------------------------------------------------- the input size

@pytest.mark.parametrize("given,small,recorded,dataset,size", [
    (None, True, 32, "imagefolder", 32),  # small-input trunk: its pretraining size
    (None, True, 16, "cifar10", 16),  # the recorded size wins over the dataset's native one
    (None, True, None, "cifar10", 32),  # nothing recorded (a plain state dict): the native size, as before
    (None, False, 64, "imagefolder", 224),  # ImageNet stem: the protocol's 224
    (None, False, None, "stl10", 96),
    (48, True, 32, "imagefolder", 48),  # given: used
])
def test_the_input_size_rule(given, small, recorded, dataset, size):
    ckpt_args = {"crop_size": recorded} if recorded else None
    got, why, warning = eval_crop_size(given, small, ckpt_args, dataset)
    assert got == size and why and warning is None


def test_a_small_input_trunk_of_no_known_size_is_refused():
    """A small-input trunk whose file records no crop size, on data of no native size: refused naming --crop-size,
    never evaluated at 224 px."""
    with pytest.raises(UserError, match=r"a small-input trunk whose file records no crop size, on --dataset "
                                        r"imagefolder \(no native size\): pass --crop-size"):
        eval_crop_size(None, True, None, "imagefolder")


def test_a_size_far_from_pretraining_warns():
    assert "more than 2x away from the 32 px" in eval_crop_size(96, True, {"crop_size": 32})[2]
    assert eval_crop_size(64, True, {"crop_size": 32})[2] is None  # 2x is still near
    assert eval_crop_size(96, False, {"crop_size": 32})[2] is None  # the ImageNet stem has no such size


@pytest.fixture
def seen_sizes(monkeypatch):
    """The (H, W) of every batch the evaluated trunk receives."""
    import sce.frozen
    sizes, real = [], sce.frozen.load_trunk

    def load_trunk(*a, **k):
        trunk, dim, ckpt = real(*a, **k)
        trunk.register_forward_pre_hook(lambda module, inputs: sizes.append(tuple(inputs[0].shape[-2:])))
        return trunk, dim, ckpt
    monkeypatch.setattr(sce.frozen, "load_trunk", load_trunk)
    return sizes


def test_small_input_checkpoint_is_evaluated_at_its_pretraining_size(pretrained, tmp_path, capsys, seen_sizes):
    import main_lincls
    data = write_imagefolder(tmp_path / "data", 3, 4, 40)  # 40 px images, a trunk pretrained at 32
    for extra in (["--knn"], ["--epochs", "1", "--batch-size", "12"]):
        seen_sizes.clear()
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--workers", "0",
                          "--output-dir", str(tmp_path / "out")] + extra)
        assert seen_sizes and set(seen_sizes) == {(32, 32)}
    first = capsys.readouterr().out.splitlines()[0]
    assert "input 32 px (the crop size the small-input trunk was pretrained with)" in first


def test_imagenet_stem_checkpoint_is_evaluated_at_224(tmp_path, capsys, seen_sizes):
    import main_lincls
    trunk, _ = build_trunk("resnet18")
    ckpt = {"kind": "pretrain", "args": {"arch": "resnet18", "small_input": False, "crop_size": 64},
            "model": {f"encoder.{k}": v for k, v in trunk.state_dict().items()}}
    torch.save(ckpt, tmp_path / "imagenet_stem.pth")
    data = write_imagefolder(tmp_path / "data", 3, 2, 40)
    main_lincls.main(["--data", data, "--pretrained", str(tmp_path / "imagenet_stem.pth"), "--knn", "--knn-k", "2",
                      "--workers", "0", "--output-dir", str(tmp_path / "out")])
    assert seen_sizes and set(seen_sizes) == {(224, 224)}
    assert "input 224 px (the protocol's 224)" in capsys.readouterr().out



def test_linear_probe_resume_through_the_loader_is_exact(pretrained, folder, tmp_path):
    common = ["--data", folder, "--pretrained", pretrained, "--crop-size", "16", "--batch-size", "8", "--preload",
              "off", "--lr", "1"]
    main_lincls.main(common + ["--epochs", "2", "--workers", "1", "--output-dir", str(tmp_path / "ref")])
    main_lincls.main(common + ["--epochs", "1", "--workers", "0", "--output-dir", str(tmp_path / "run")])
    main_lincls.main(common + ["--epochs", "2", "--workers", "2", "--resume", "auto",
                               "--output-dir", str(tmp_path / "run")])
    a, b = (torch.load(tmp_path / run / "checkpoint_last.pth", weights_only=True)["model"] for run in ("ref", "run"))
    assert torch.equal(a["fc.weight"], b["fc.weight"]) and torch.equal(a["fc.bias"], b["fc.bias"])


@pytest.mark.parametrize("fail", [False, True])
def test_the_probes_graphed_step_gives_the_eager_numbers(pretrained, folder, tmp_path, monkeypatch, fail):
    # 24 images in batches of 7 (7, 7, 7, 3): steps 1-3 eager (warm-up), step 4 eager too (a batch of 3: the capture
    # waits for a whole one), step 5 captured and replayed from then on, each epoch's last batch eager; what changes
    # reaches the graph through device tensors (the lr, the step's index)
    common = ["--data", folder, "--pretrained", pretrained, "--crop-size", "16", "--batch-size", "7", "--lr", "1",
              "--epochs", "3", "--milestones", "1", "2", "--workers", "0"]
    main_lincls.main(common + ["--output-dir", str(tmp_path / "eager")])
    graphs = Replay(fail)
    monkeypatch.setattr(main_lincls, "graphs_for", lambda *a: graphs)
    with pytest.warns(UserWarning, match="capture of the probe's step failed") if fail else contextlib.nullcontext():
        main_lincls.main(common + ["--output-dir", str(tmp_path / "graphed")])
    assert (graphs.captures, graphs.replays) == (1, 0 if fail else 6)  # steps 5 (captured), 6, 7, 9, 10 and 11
    a, b = (load(str(tmp_path / run / "checkpoint_last.pth")) for run in ("eager", "graphed"))
    assert torch.equal(a["model"]["fc.weight"], b["model"]["fc.weight"]) and torch.equal(a["model"]["fc.bias"],
                                                                                         b["model"]["fc.bias"])
    assert [a[k] for k in ("acc1", "acc5", "best_acc1")] == [b[k] for k in ("acc1", "acc5", "best_acc1")]
    # the lr reaches a real graph as a device tensor (the stand-in would also see a float: it reruns the Python)
    assert all(torch.is_tensor(g["lr"]) for g in b["optimizer"]["param_groups"])
    assert not any(torch.is_tensor(g["lr"]) for g in a["optimizer"]["param_groups"])  # eager: floats, as before


# ---------------------------------------------------------------- the routes: the same batches

def test_the_probes_batches_are_the_same_on_every_route(folder):
    """Preloaded or read by the loader, the linear probe's batches are the same images in the same order with the
    same padded crops and flips (integer shifts: no resampling) and the same val images; the decode route's
    (an ImageNet-stem trunk's JPEGs, resized and centre-cropped on the device) the loader's within the two
    resize filters (torch's against PIL's, in 8 bits: 3 levels)."""
    made = {}
    for preload in ("device", "off"):
        train, val, _ = sce_data.eval_splits("imagefolder", folder, 16, True, CPU, preload, augment_train=True, seed=2,
                                             budget=sce_data.Budget(CPU))
        assert train.route == ("preload" if preload == "device" else "loader")
        sampler = sce_data.ShuffledShards(train, num_replicas=1, rank=0, shuffle=True, seed=2)
        sampler.set_epoch(3)
        made[preload] = [torch.cat(b) for b in zip(*train.batches(5, sampler))], next(iter(val.batches(24)))
    (x, y), (vx, vy) = made["device"]
    (lx, ly), (lvx, lvy) = made["off"]
    assert torch.equal(y, ly) and torch.equal(vy, lvy) and len(y) == 24
    assert torch.allclose(x, lx, atol=1e-5) and torch.allclose(vx, lvx, atol=1e-5)
    # the preload route's batches of a resumed epoch (its order and crops indexed on the device) are each image's
    # padded crop as the probe draws it, from image 7 of the epoch's order on, whichever epoch was read before
    train, _, _ = sce_data.eval_splits("imagefolder", folder, 16, True, CPU, "device", augment_train=True, seed=2,
                                       budget=sce_data.Budget(CPU))
    sampler = sce_data.ShuffledShards(train, num_replicas=1, rank=0, shuffle=True, seed=2)
    batches = train.batches(5, sampler)
    sampler.set_epoch(3)
    order = [i for _, i in sampler]
    sampler.set_epoch(2)
    list(batches)  # epoch 2 read: epoch 3's order and crops were prepared meanwhile
    sampler.set_epoch(3, 7)
    got = torch.cat([b[0] for b in batches])
    images = train.images.images[torch.tensor(order[7:])]
    ops = sce_data.ops
    rows = sce_data.views.probe_crops(4, 16, 2, 3, order[7:], height=[16] * 17, width=[16] * 17)
    expected = ops.normalize(ops.resized_crops(images, rows, 16) / 255, *ops.normalization(CPU))
    assert torch.equal(got, expected)
    jpegs = write_imagefolder(folder + "_jpeg", 2, 3, 40)
    for split in ("train", "val"):
        for root, _, names in os.walk(os.path.join(jpegs, split)):
            for name in names:
                Image.open(os.path.join(root, name)).save(os.path.join(root, name[:-4] + ".jpg"), quality=90)
                os.remove(os.path.join(root, name))
    decoded, loaded = (sce_data.eval_splits("imagefolder", jpegs, 32, False, CPU, decode=d)[1] for d in ("device",
                                                                                                      "loader"))
    assert (decoded.route, loaded.route) == ("decode", "loader")
    a, b = next(iter(decoded.batches(6))), next(iter(loaded.batches(6)))
    diff = (a[0] - b[0]).abs() * torch.tensor(STD).view(1, 3, 1, 1)
    assert torch.equal(a[1], b[1]) and diff.max() <= 3 / 255 and diff.mean() <= 0.6 / 255, diff.max() * 255


def test_lincls_and_knn_on_preloaded_images_equal_the_loaders(pretrained, tmp_path, capsys):
    root = write_imagefolder(tmp_path / "data", 3, 6, 32)
    for i in range(3):  # a few wrong val labels, so that kNN accuracy is not trivially 100%
        os.replace(os.path.join(root, "val", f"class_{i}", "0.png"),
                   os.path.join(root, "val", f"class_{(i + 1) % 3}", "x.png"))
    common = ["--data", root, "--pretrained", pretrained, "--workers", "0", "--knn-k", "5"]
    results = {}
    for mode in ("off", "device"):
        main_lincls.main(common + ["--knn", "--preload", mode, "--output-dir", str(tmp_path / mode)])
        results[mode] = result(tmp_path / mode)
        main_lincls.main(common + ["--preload", mode, "--epochs", "2", "--batch-size", "6",
                                   "--output-dir", str(tmp_path / f"linear_{mode}")])
    out = capsys.readouterr().out
    assert "=> preloaded 18 train images (3x32x32" in out and "=> preloaded 18 val images" in out
    assert results["device"] == results["off"] and results["off"]["acc1"] < 100
    heads = [load(tmp_path / f"linear_{mode}" / "checkpoint_last.pth")["model"]["fc.weight"] for mode in ("off",
                                                                                                         "device")]
    assert torch.allclose(heads[0], heads[1], rtol=1e-4, atol=1e-3)  # the same batches (float sums: lr 30)


def test_features_and_linear_probe_decoded_on_the_device(tmp_path, capsys):
    """An ImageNet-stem trunk's evaluation with JPEGs decoded in the training process (--decode device): its features
    those of the loader's (cosine > 0.999: torch's resize against PIL's), the cache telling them apart; the linear
    probe and kNN run."""
    from sce.frozen import Frozen, split_features
    torch.manual_seed(0)
    trunk, _ = build_trunk("resnet18")
    root = write_imagefolder(tmp_path / "eval", 2, 3, 80)
    for dirpath, _, names in os.walk(root):
        for name in names:
            Image.open(os.path.join(dirpath, name)).save(os.path.join(dirpath, name[:-4] + ".jpg"), quality=90)
            os.remove(os.path.join(dirpath, name))
    torch.save({"kind": "pretrain", "args": {"arch": "resnet18", "small_input": False},
                "model": {f"encoder.{k}": v for k, v in trunk.state_dict().items()}}, tmp_path / "stem.pth")
    geometry, feats = sce_data.Geometry(64, 73), {}
    for route, read in (("decode", "encoded"), ("loader", "pil")):
        split = sce_data.eval_split(sce_data.build_dataset("imagefolder", root, "val", read=read), geometry, CPU,
                                    route)
        feats[route] = split_features(Frozen(trunk, 512, {}, "resnet18", False), split, "x", tmp_path,
                                      checkpoint=str(tmp_path / "stem.pth"), batch_size=4)
    assert len(list(tmp_path.glob("features_x_*.pt"))) == 2  # two cache entries: the key says where JPEGs decode
    cosine = F.cosine_similarity(torch.from_numpy(feats["decode"]), torch.from_numpy(feats["loader"]))
    assert cosine.min() > 0.999, cosine
    for extra in (["--epochs", "1", "--batch-size", "3"], ["--knn", "--knn-k", "2"]):
        main_lincls.main(["--data", root, "--pretrained", str(tmp_path / "stem.pth"), "--crop-size", "64",
                          "--decode", "device", "--workers", "0", "--output-dir", str(tmp_path / extra[0])] + extra)
    assert "Epoch 1/1: Acc@1" in capsys.readouterr().out
    assert 0 <= result(tmp_path / "--knn")["acc1"] <= 100
