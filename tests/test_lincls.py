"""main_lincls.py: linear probe, resume / evaluate, DDP, kNN and the many-shot logistic regression."""
import json
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import fake_compile, no_triton, run_script, write_imagefolder
from sce import UserError
from sce.checkpoint import load, load_trunk, trunk_state_dict
from sce.datasets import build_dataset
from sce.knn import knn_scores
from sce.loader import eval_transform
from sce.metrics import average_precision_11point, top1_accuracy
from sce.transfer import select_logreg


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("lincls") / "data", 3, 8, 32)


def lincls(*args):
    return run_script(["main_lincls.py", *map(str, args), "--workers", "0"])


def lincls_here(capsys, *args):
    """main_lincls.main in this process (no interpreter start-up); returns its stdout."""
    import main_lincls
    capsys.readouterr()
    main_lincls.main([*map(str, args), "--workers", "0"])
    return capsys.readouterr().out


def same_trunk(a, b):
    sa, sb = trunk_state_dict(load(a)), trunk_state_dict(load(b))
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def contract_run(pretrained, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("lincls_out")
    proc = lincls("--data", data, "--pretrained", pretrained, "--arch", "resnet18", "--small-input",
                  "--crop-size", "32", "--epochs", "1", "--batch-size", "16", "--output-dir", out)
    return out, proc


def test_step_schedule_decays_at_the_milestones(pretrained, data, tmp_path, capsys):
    out = lincls_here(capsys, "--data", data, "--pretrained", pretrained, "--crop-size", "16", "--epochs", "3",
                      "--batch-size", "12", "--lr", "2", "--milestones", "1", "2", "--output-dir", tmp_path)
    lrs = [float(lr) for lr in re.findall(r"Epoch \[\d/3\]\[2/2\] loss \S+ lr (\S+)", out)]
    assert lrs == pytest.approx([2, 0.2, 0.02])  # x0.1 from epoch 1, again from epoch 2


def test_contract_command_trains_only_the_head(contract_run, pretrained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, proc = contract_run
    assert "Acc@1" in proc.stdout and "Acc@5" in proc.stdout
    assert re.search(r"Epoch \[1/1\]\[2/2\] loss \S+ lr 30 24/24 images, \d+ images/s, ETA 0:00:00", proc.stdout)
    scalars = EventAccumulator(str(out)).Reload().Tags()["scalars"]
    assert {"train/loss", "train/lr", "val/acc1", "val/acc5"} <= set(scalars)
    ckpt = load(str(out / "checkpoint_last.pth"))
    assert ckpt["kind"] == "lincls" and ckpt["epoch"] == 1
    assert ckpt["args"]["arch"] == "resnet18" and ckpt["args"]["small_input"] is True
    assert ckpt["model"]["fc.weight"].shape == (3, 512)
    assert (out / "model_best.pth").exists()
    # every trunk tensor, BN running statistics included, is the pretrained one
    assert same_trunk(pretrained, str(out / "checkpoint_last.pth"))
    load_trunk(str(out / "checkpoint_last.pth"))  # its checkpoints are trunks for the other tools


def test_resume_then_evaluate(contract_run, data, pretrained, tmp_path, capsys):
    import shutil
    out, _ = contract_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(out / "checkpoint_last.pth", resumed / "checkpoint_last.pth")
    # --resume auto finds OUTPUT_DIR/checkpoint_last.pth; no --pretrained needed
    stdout = lincls_here(capsys, "--data", data, "--resume", "auto", "--crop-size", "32",
                         "--epochs", "2", "--batch-size", "16", "--output-dir", resumed)
    assert "resumed from" in stdout and "Epoch [1/2]" not in stdout and "Epoch 2/2:" in stdout
    ckpt = load(str(resumed / "checkpoint_last.pth"))
    assert ckpt["epoch"] == 2
    assert not torch.equal(ckpt["model"]["fc.weight"], load(str(out / "checkpoint_last.pth"))["model"]["fc.weight"])
    assert same_trunk(pretrained, str(resumed / "checkpoint_last.pth"))
    lincls_here(capsys, "--data", data, "--pretrained", resumed / "checkpoint_last.pth", "--crop-size", "32",
                "-e", "--output-dir", tmp_path / "eval")
    with open(tmp_path / "eval" / "results_evaluate.json") as f:
        result = json.load(f)
    assert result["acc1"] == pytest.approx(ckpt["acc1"]) and result["acc5"] == pytest.approx(ckpt["acc5"])


def test_linear_probe_learns(pretrained, data, tmp_path, capsys):
    lincls_here(capsys, "--data", data, "--pretrained", pretrained, "--crop-size", "16", "--schedule", "cosine",
                "--epochs", "4", "--batch-size", "8", "--output-dir", tmp_path)
    with open(tmp_path / "results_linear.json") as f:
        result = json.load(f)
    assert result["acc1"] >= 80.0  # 3 classes: chance is 33%
    assert same_trunk(pretrained, str(tmp_path / "checkpoint_last.pth"))


def test_torchrun_two_processes(pretrained, data, tmp_path):
    proc = run_script(["torchrun", "--standalone", "--nproc_per_node", "2", "main_lincls.py", "--data", data,
                       "--pretrained", pretrained, "--crop-size", "16", "--epochs", "1", "--batch-size", "8",
                       "--workers", "0", "--output-dir", str(tmp_path)])
    assert proc.stdout.count("Epoch 1/1:") == 1  # only rank 0 reports
    assert load(str(tmp_path / "checkpoint_last.pth"))["epoch"] == 1
    assert same_trunk(pretrained, str(tmp_path / "checkpoint_last.pth"))


def test_frozen_check_catches_a_changed_buffer():
    import main_lincls
    model, _ = __import__("sce.builder", fromlist=["build_trunk"]).build_trunk("resnet18", True)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    main_lincls.check_frozen(model, reference)
    model.layer1[0].bn1.running_mean += 1e-3
    with pytest.raises(RuntimeError, match="layer1.0.bn1.running_mean"):
        main_lincls.check_frozen(model, reference)


# ---------------------------------------------------------------- kNN

def brute_force_votes(bank, bank_labels, queries, num_classes, k, t):
    votes = np.zeros((len(queries), num_classes))
    for i, q in enumerate(queries):
        sims = [float(np.dot(q, b)) for b in bank]
        for j in sorted(range(len(bank)), key=lambda j: -sims[j])[:k]:
            votes[i, bank_labels[j]] += np.exp(sims[j] / t)
    return votes


def test_knn_scores_equal_brute_force():
    rng = np.random.default_rng(0)
    bank = rng.normal(size=(60, 8))
    bank /= np.linalg.norm(bank, axis=1, keepdims=True)
    queries = rng.normal(size=(9, 8))
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    labels = rng.integers(0, 4, 60)
    for k in (1, 7, 60, 200):
        got = knn_scores(torch.tensor(bank), torch.tensor(labels), torch.tensor(queries), 4, k=k, t=0.07)
        assert np.allclose(got.numpy(), brute_force_votes(bank, labels, queries, 4, k, 0.07), rtol=1e-9)


def test_knn_script_equals_brute_force(pretrained, tmp_path, capsys):
    data = write_imagefolder(tmp_path / "data", 3, 8, 32)
    for i in range(3):  # mislabel some val images so that the accuracy is not trivially 100%
        os.replace(os.path.join(data, "val", "class_0", f"{i}.png"), os.path.join(data, "val", "class_1", f"m{i}.png"))
    args = ["--data", data, "--pretrained", pretrained, "--knn", "--knn-k", "5", "--knn-t", "0.1",
            "--crop-size", "16", "--output-dir", tmp_path / "out"]
    stdout = lincls_here(capsys, *args)
    assert "train features: 24/24 images" in stdout and "val features: 24/24 images" in stdout
    with open(tmp_path / "out" / "results_knn.json") as f:
        result = json.load(f)

    trunk, _, _ = load_trunk(pretrained)
    trunk.eval()
    tf = eval_transform(False, 16, small=True)

    def feats(split):
        ds = build_dataset("imagefolder", data, split, tf)
        with torch.no_grad():
            x = trunk(torch.stack([ds[i][0] for i in range(len(ds))]))
        return F.normalize(x, dim=1).double().numpy(), np.array(ds.targets)

    bank, bank_labels = feats("train")
    queries, labels = feats("val")
    votes = brute_force_votes(bank, bank_labels, queries, 3, 5, 0.1)
    assert result["acc1"] == pytest.approx(top1_accuracy(votes.argmax(1), labels))
    assert result["acc1"] < 100.0


def test_knn_with_a_failing_compiled_trunk_warns_and_equals_eager(pretrained, data, tmp_path, capsys, monkeypatch):
    """--compile where the compiled trunk fails at its first call: one warning naming the cause, and the
    batch is redone eagerly (a frozen trunk in eval mode has no state to put back)."""
    args = ["--data", data, "--pretrained", pretrained, "--knn", "--knn-k", "5", "--crop-size", "16"]
    lincls_here(capsys, *args, "--output-dir", tmp_path / "eager")
    fake_compile(monkeypatch, no_triton)
    with pytest.warns(UserWarning) as caught:
        lincls_here(capsys, *args, "--compile", "--output-dir", tmp_path / "compiled")
    assert [str(w.message) for w in caught if "--compile" in str(w.message)] == [
        "--compile: torch.compile of the trunk failed (Cannot find a working triton installation): running it eagerly"]
    results = [json.load(open(tmp_path / out / "results_knn.json")) for out in ("eager", "compiled")]
    assert results[0] == results[1]


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


def test_logreg_script_and_feature_cache(pretrained, data, tmp_path, capsys):
    lincls_here(capsys, "--data", data, "--pretrained", pretrained, "--classifier", "logreg", "--crop-size", "16",
                "--output-dir", tmp_path)
    with open(tmp_path / "results_logreg.json") as f:
        result = json.load(f)
    assert result["metric"] == "top1" and len(result["val"]) == 45
    scores = [v["score"] for v in result["val"]]
    assert result["C"] == pytest.approx(result["val"][int(np.argmax(scores))]["C"])
    assert result["test"] >= 80.0
    assert len([f for f in os.listdir(tmp_path) if f.startswith("features_")]) == 2
    stdout = lincls_here(capsys, "--data", data, "--pretrained", pretrained, "--classifier", "logreg",
                         "--crop-size", "16", "--metric", "mean-per-class", "--logreg-c", "1.0", "--output-dir", tmp_path)
    assert stdout.count("features read from") == 2


# ---------------------------------------------------------------- bad input

def test_not_a_checkpoint_is_one_line(data, tmp_path):
    bogus = tmp_path / "notes.pth"
    bogus.write_text("not a checkpoint")
    proc = run_script(["main_lincls.py", "--data", data, "--pretrained", str(bogus), "--workers", "0"], check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and str(bogus) in lines[0]


def test_bad_inputs_name_the_file(pretrained, data, tmp_path):
    import main_lincls
    foreign = tmp_path / "foreign.pth"
    torch.save({"weights": torch.zeros(3)}, foreign)
    with pytest.raises(UserError, match=f"{re.escape(str(foreign))}.*no torchvision-style ResNet trunk"):
        main_lincls.main(["--data", data, "--pretrained", str(foreign), "--workers", "0"])
    with pytest.raises(UserError, match=f"{re.escape(pretrained)}.*resnet18.*--arch resnet50"):
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--arch", "resnet50", "--workers", "0"])
    one = write_imagefolder(tmp_path / "one", 1, 2, 16)
    with pytest.raises(UserError, match=f"{re.escape(os.path.join(one, 'train'))}.*single class"):
        main_lincls.main(["--data", one, "--pretrained", pretrained, "--workers", "0", "--output-dir", str(tmp_path / "1")])
    with pytest.raises(UserError, match="not a main_lincls.py checkpoint"):
        main_lincls.main(["--data", data, "--resume", pretrained, "--workers", "0", "--output-dir", str(tmp_path)])
    with pytest.raises(UserError, match="--evaluate needs a trained head"):
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--evaluate", "--workers", "0",
                          "--output-dir", str(tmp_path)])
    odd = write_imagefolder(tmp_path / "odd", 3, 2, 16)
    os.rename(os.path.join(odd, "val", "class_2"), os.path.join(odd, "val", "class_9"))
    with pytest.raises(UserError, match="different classes .first difference: class_2.: both need the same"):
        main_lincls.main(["--data", odd, "--pretrained", pretrained, "--workers", "0", "--output-dir", str(tmp_path / "2")])
    with pytest.raises(UserError, match="--metric map11 does not fit --dataset imagefolder"):
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--classifier", "logreg", "--metric", "map11",
                          "--workers", "0", "--output-dir", str(tmp_path)])
    for flag, value, match in [("--print-freq", "0", "positive"), ("--knn-t", "0", "positive"), ("--lr", "-1", ">= 0"),
                               ("--logreg-c", "-1", "positive")]:
        with pytest.raises(UserError, match=f"{flag} must be {match}"):
            main_lincls.main(["--data", data, "--pretrained", pretrained, flag, value, "--workers", "0"])
    with pytest.raises(UserError, match="voc07 is multi-label: use --classifier logreg"):
        main_lincls.main(["--data", data, "--dataset", "voc07", "--pretrained", pretrained, "--workers", "0",
                          "--output-dir", str(tmp_path)])
    # the head overflows after the first step; the non-finite loss is noted on the device and
    # reported at the next progress line, before anything is saved
    with pytest.raises(UserError, match=r"loss is (nan|inf) at epoch 1 step [2-6]: lower --lr"):
        main_lincls.main(["--data", data, "--pretrained", pretrained, "--workers", "0", "--lr", "1e38",
                          "--batch-size", "4", "--epochs", "1", "--output-dir", str(tmp_path / "diverged")])
    assert not os.path.exists(tmp_path / "diverged" / "checkpoint_last.pth")


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


def test_logreg_script_says_fits_did_not_converge(pretrained, data, tmp_path, capsys):
    stdout = lincls_here(capsys, "--data", data, "--pretrained", pretrained, "--classifier", "logreg",
                         "--crop-size", "16", "--logreg-c", "1.0", "--logreg-max-iter", "1", "--output-dir", tmp_path)
    assert re.search(r"logistic regression \(C 1, refit on \d+ images\): test top1 \d+\.\d\d "
                     r"\(1 of 1 fits did not converge within --logreg-max-iter 1: raise it\)\n", stdout), stdout
    with open(tmp_path / "results_logreg.json") as f:
        result = json.load(f)
    assert result["fits"] == 1 and result["unconverged_fits"] == 1
