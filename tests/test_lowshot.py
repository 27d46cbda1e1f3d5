"""main_lowshot.py and the VOC07 helpers: reader, draws, SVM mAP, difficult labels, contract command, bad input."""
import contextlib
import io
import json
import os
import re
import shutil

import numpy as np
import pytest
from PIL import Image

from conftest import SendsWhenDeleted, exit_message, script_in_process
from sce import UserError, cli
from sce.data import read_voc07
from sce.metrics import VOC_CLASSES, average_precision
from sce.transfer import FitCount, cv_drops, cv_splits, lowshot_draw, svm_cv_map, svm_test_map


def class_colour(c):
    return np.random.default_rng(100 + c).integers(30, 226, 3)


def write_voc(root, n_trainval=24, n_test=16, size=32, seed=0):
    """A VOC2007-layout tree: JPEGImages/ and ImageSets/Main/<class>_{trainval,train,val,test}.txt.
    Image i shows classes i % 20 and (i + 7) % 20 (left / right half); every 5th image also has a
    difficult (0) class. Returns (root, {split: label matrix})."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, "JPEGImages"), exist_ok=True)
    os.makedirs(os.path.join(root, "ImageSets", "Main"), exist_ok=True)
    ids = {"trainval": list(range(n_trainval)), "test": list(range(n_trainval, n_trainval + n_test))}
    ids["train"], ids["val"] = ids["trainval"][0::2], ids["trainval"][1::2]
    labels = {}
    for i in ids["trainval"] + ids["test"]:
        img = np.zeros((size, size, 3), np.float32)
        img[:, : size // 2] = class_colour(i % 20)
        img[:, size // 2:] = class_colour((i + 7) % 20)
        img = np.clip(img + rng.normal(0, 20, img.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(os.path.join(root, "JPEGImages", f"{i:06d}.jpg"))
    for split, members in ids.items():
        y = -np.ones((len(members), 20), np.int8)
        for row, i in enumerate(members):
            y[row, [i % 20, (i + 7) % 20]] = 1
            if i % 5 == 0:
                y[row, (i + 3) % 20] = 0
        labels[split] = y
        for c, cls in enumerate(VOC_CLASSES):
            with open(os.path.join(root, "ImageSets", "Main", f"{cls}_{split}.txt"), "w") as f:
                f.writelines(f"{i:06d} {y[row, c]:2d}\n" for row, i in enumerate(members))
    return str(root), labels


@pytest.fixture(scope="module")
def voc(tmp_path_factory):
    return write_voc(tmp_path_factory.mktemp("voc") / "VOC2007")


@pytest.fixture(scope="module")
def contract_run(pretrained, voc, tmp_path_factory):
    out = tmp_path_factory.mktemp("lowshot_out")
    # the contract command; the checkpoint's 32 px small-input trunk gets the input size it was pretrained at
    with script_in_process(), contextlib.redirect_stdout(io.StringIO()) as said:  # its __main__, in this process
        assert exit_message("main_lowshot.py", "--data", voc[0], "--pretrained", pretrained, "--arch", "resnet18",
                            "--shots", "1", "2", "full", "--runs", "2", "--output-dir", out, "--workers", "0") is None
    return out, said.getvalue()


def test_read_voc07(voc):
    root, labels = voc
    for split in ("trainval", "test", "train", "val"):
        paths, y = read_voc07(root, split)
        assert np.array_equal(y, labels[split]) and all(os.path.isfile(p) for p in paths)
    assert (labels["trainval"] == 0).any()


def test_contract_command(contract_run):
    out, stdout = contract_run
    with open(out / "lowshot.json") as f:
        report = json.load(f)
    assert [r["shots"] for r in report["results"]] == [1, 2, "full"]
    assert [r["runs"] for r in report["results"]] == [2, 2, 1]
    for r in report["results"]:
        assert 0 <= r["mean"] <= 100 and r["std"] >= 0 and r["cost"] in report["costs"]
        assert r["mean"] == pytest.approx(np.mean(r["maps"])) and r["std"] == pytest.approx(np.std(r["maps"]))
        # the reported cost is the one with the best mean test mAP over the draws (PCL)
        means = {c: np.mean([d["test_map"][str(c)] for d in r["draws"]]) for c in report["costs"]}
        assert r["mean"] == pytest.approx(max(means.values()))
    assert report["results"][0]["draws"][0]["images"] == 20 and report["results"][2]["draws"][0]["images"] == 24
    assert report["difficult"] == "negative"  # PCL's handling by default
    assert "±" in stdout and "optimistic" in stdout
    assert "trainval features: 24/24 images" in stdout and "images/s, ETA" in stdout
    assert "input 32 px (the crop size the small-input trunk was pretrained with), resized to 32" in stdout
    assert len([f for f in os.listdir(out) if f.startswith("features_")]) == 2


def copy_feature_cache(source, folder):
    """The contract run's cached features in a folder of the test's own (its lowshot.json stays untouched)."""
    for name in os.listdir(source):
        if name.startswith("features_"):
            shutil.copy(source / name, folder / name)


def test_cv_selection_reuses_cached_features(contract_run, pretrained, voc, tmp_path, capsys):
    import main_lowshot
    out = tmp_path
    copy_feature_cache(contract_run[0], out)
    capsys.readouterr()
    main_lowshot.main(["--data", voc[0], "--pretrained", pretrained, "--shots", "2", "--runs", "1", "--costs", "0.1",
                       "10", "--cost-selection", "cv", "--cv-folds", "2", "--output-dir", str(out), "--resize", "32",
                       "--crop-size", "32", "-j", "0"])
    assert capsys.readouterr().out.count("features read from") == 2
    with open(out / "lowshot.json") as f:
        report = json.load(f)
    (res,) = report["results"]
    assert report["cost_selection"] == "cv"
    draw = res["draws"][0]
    assert draw["cost"] == float(max(draw["cv_map"], key=draw["cv_map"].get))  # best cross-validated cost
    assert res["maps"] == [draw["map"]]
    # 2 cv fits per class and cost, then one test fit per class
    assert draw["fits"] == 20 * (2 * 2 + 1) and draw["unconverged_fits"] == 0


def test_draw_is_seeded_and_has_k_positives_per_class():
    rng = np.random.default_rng(0)
    labels = rng.choice([1, -1, -1, 0], size=(60, 20)).astype(np.int8)
    a = lowshot_draw(labels, 4, [0, 4, 0])
    assert np.array_equal(a, lowshot_draw(labels, 4, [0, 4, 0]))
    assert not np.array_equal(a, lowshot_draw(labels, 4, [0, 4, 1]))
    assert a.shape == (20, 4)
    for c in range(20):
        assert len(set(a[c])) == 4 and (labels[a[c], c] == 1).all()
        assert (labels[a.ravel(), c] == 1).sum() >= 4
    with pytest.raises(UserError, match="fewer than the 61 shots"):
        lowshot_draw(labels, 61, 0)


@pytest.mark.parametrize("difficult", ["negative", "ignore"])
def test_svm_map_matches_manual_fit(difficult):
    from sklearn.svm import LinearSVC
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5))
    y = np.where(x[:, :2] > 0, 1, -1).astype(np.int8)
    y[:6, 0] = 0
    y[30:33, 1] = 0
    tx, ty, vx, vy = x[:25], y[:25], x[25:], y[25:]
    got, aps = svm_test_map(tx, ty, vx, vy, cost=0.5, difficult=difficult)
    if difficult == "negative":  # PCL: 0 -> -1 in training and test targets
        ty, vy = np.where(ty == 0, -1, ty), np.where(vy == 0, -1, vy)
    expected = []
    for c in range(2):
        keep = ty[:, c] != 0
        svm = LinearSVC(C=0.5, class_weight={1: 2, -1: 1}, loss="squared_hinge", dual=True, max_iter=2000,
                        random_state=0).fit(tx[keep], ty[keep, c])
        expected.append(average_precision(svm.decision_function(vx), vy[:, c]))
    assert aps == pytest.approx(expected) and got == pytest.approx(100 * np.mean(expected))


def one_feature_case():
    """1-d features: the SVM learns w > 0, so the test images rank in the order of their feature
    (4, 3, 2, 1); the second test image is difficult."""
    tx = np.array([[1.0], [1.2], [0.8], [-1.0], [-1.2], [-0.8]])
    ty = np.array([[1], [1], [1], [-1], [-1], [-1]], np.int8)
    vx = np.array([[4.0], [3.0], [2.0], [1.0]])
    vy = np.array([[1], [0], [-1], [1]], np.int8)
    return tx, ty, vx, vy


def test_difficult_test_image_is_negative_by_default():
    tx, ty, vx, vy = one_feature_case()
    got, aps = svm_test_map(tx, ty, vx, vy, cost=1.0)
    # ranked: pos, difficult = false alarm, neg, pos -> recall 0.5 at precision 1, 1.0 at 0.5
    assert got == pytest.approx(100 * (0.5 * 1 + 0.5 * 0.5))
    assert aps[0] == pytest.approx(average_precision(vx[:, 0], [1, -1, -1, 1]))


def test_difficult_test_image_is_excluded_with_ignore():
    tx, ty, vx, vy = one_feature_case()
    got, _ = svm_test_map(tx, ty, vx, vy, cost=1.0, difficult="ignore")
    # ranked without it: pos, neg, pos -> recall 0.5 at precision 1, 1.0 at 2/3
    assert got == pytest.approx(100 * (0.5 * 1 + 0.5 * 2 / 3))


@pytest.mark.parametrize("difficult", ["negative", "ignore"])
def test_training_labels_of_difficult_images(monkeypatch, difficult):
    from sklearn.svm import LinearSVC
    seen, fit = [], LinearSVC.fit

    def recording_fit(self, x, y, *args, **kwargs):
        seen.append((np.array(x), np.array(y)))
        return fit(self, x, y, *args, **kwargs)

    monkeypatch.setattr(LinearSVC, "fit", recording_fit)
    x = np.arange(6, dtype=np.float64)[:, None]
    labels = np.array([[1], [0], [-1], [1], [0], [-1]], np.int8)
    svm_test_map(x, labels, x, labels, cost=1.0, difficult=difficult)
    (fx, fy), = seen
    if difficult == "negative":  # every image trains, difficult ones as negatives
        assert fx[:, 0].tolist() == [0, 1, 2, 3, 4, 5] and fy.tolist() == [1, -1, -1, 1, -1, -1]
    else:  # the difficult ones are left out
        assert fx[:, 0].tolist() == [0, 2, 3, 5] and fy.tolist() == [1, -1, 1, -1]


def test_difficult_ignore_reuses_features_and_is_recorded(contract_run, pretrained, voc, tmp_path, capsys):
    import main_lowshot
    copy_feature_cache(contract_run[0], tmp_path)  # the handling must not change the features' key
    main_lowshot.main(["--data", voc[0], "--pretrained", pretrained, "--shots", "full", "--costs", "1",
                       "--difficult", "ignore", "--output-dir", str(tmp_path), "--resize", "32",
                       "--crop-size", "32", "--workers", "0"])
    stdout = capsys.readouterr().out
    assert stdout.count("features read from") == 2 and "difficult labels: ignore" in stdout
    with open(tmp_path / "lowshot.json") as f:
        report = json.load(f)
    assert report["difficult"] == "ignore" and 0 <= report["results"][0]["mean"] <= 100


def test_bad_inputs(pretrained, voc, tmp_path, capsys):
    import main_lowshot
    root, _ = write_voc(tmp_path / "VOC2007", n_trainval=20, n_test=4)
    missing = os.path.join(root, "ImageSets", "Main", "sheep_test.txt")
    os.remove(missing)
    with pytest.raises(UserError, match=f"{re.escape(missing)} not found"):
        main_lowshot.main(["--data", root, "--pretrained", pretrained, "--output-dir", str(tmp_path)])
    with pytest.raises(UserError, match="needs --shots >= 2"):
        main_lowshot.main(["--data", voc[0], "--pretrained", pretrained, "--shots", "1", "--cost-selection", "cv"])
    with pytest.raises(UserError, match="--costs must be positive .got -1.0."):
        main_lowshot.main(["--data", voc[0], "--pretrained", pretrained, "--costs", "1", "-1"])
    with pytest.raises(UserError, match="--resize 16 is smaller than the 32 px centre crop"):
        main_lowshot.main(["--data", voc[0], "--pretrained", pretrained, "--resize", "16",
                           "--output-dir", str(tmp_path / "resize")])
    with pytest.raises(UserError, match="--cv-folds must be at least 2"):
        main_lowshot.main(["--data", voc[0], "--pretrained", pretrained, "--cost-selection", "cv", "--cv-folds", "1"])
    with pytest.raises(UserError, match=r"--jobs must be positive, or -1 for every core \(got 0\)"):
        main_lowshot.main(["--data", voc[0], "--pretrained", pretrained, "--jobs", "0"])
    capsys.readouterr()
    with pytest.raises(UserError, match=r"--resize 10000000: the resized images of 1 reading process\(es\) need "
                                        r"279396.8 GiB alone, more than all of this machine's memory .*: "
                                        r"lower --resize"):
        main_lowshot.main(["--data", voc[0], "--pretrained", pretrained, "--resize", str(10 ** 7), "--workers", "1",
                           "--jobs", "100000", "--output-dir", str(tmp_path / "huge")])
    cores = cli.cores_per_rank()
    assert f"=> --jobs 100000 is more than the {cores} core(s) this process has: using {cores}" \
        in capsys.readouterr().out
    help_text = main_lowshot.get_parser().format_help()
    assert "optimistic" in help_text and "--cost-selection" in help_text
    assert "--difficult {negative,ignore}" in help_text and "reads higher" in help_text
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # argparse: usage, then one error line
        main_lowshot.main(["--data", root, "--pretrained", pretrained, "--difficult", "hard"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and re.search(r"error: argument --difficult: invalid choice: 'hard' "
                                          r"\(choose from '?negative'?, '?ignore'?\)", errors[0])


def test_voc07_logreg_uses_11point_map(pretrained, voc, tmp_path):
    import main_lincls
    main_lincls.main(["--data", voc[0], "--dataset", "voc07", "--classifier", "logreg", "--pretrained", pretrained,
                      "--crop-size", "16", "--workers", "0", "--logreg-c", "1",  # the C search: test_evaluation
                      "--output-dir", str(tmp_path)])
    with open(tmp_path / "results_logreg.json") as f:
        result = json.load(f)
    assert result["metric"] == "map11" and result["C"] == 1 and 0 <= result["test"] <= 100


def test_svm_fits_that_did_not_converge_are_counted(monkeypatch):
    import sce.transfer
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5))
    y = np.where(x[:, :3] > 0, 1, -1).astype(np.int8)
    converged, stopped = FitCount(), FitCount()
    svm_test_map(x, y, x, y, cost=1.0, count=converged)
    monkeypatch.setattr(sce.transfer, "SVM_MAX_ITER", 1)  # liblinear needs more than one pass here
    svm_test_map(x, y, x, y, cost=1.0, count=stopped)
    svm_cv_map(x, cv_splits(y, np.arange(40), folds=2), 1.0, count=stopped)  # 2 folds x 3 classes
    assert converged.stalled == [False] * 3 and stopped.stalled == [True] * 9
    assert stopped.note(1, noun="SVM fits") == "9 of 9 SVM fits did not converge within 1 iterations"


def test_cv_says_which_folds_and_classes_it_drops():
    groups = np.arange(12)
    groups[1] = 0  # rows 0 and 1 are one image drawn twice: always in the same fold
    labels = -np.ones((12, 3), np.int8)
    labels[[0, 1], 0] = 1  # 2 folds; the positives of one image train or are held out, never both: no AP
    labels[[0, 1, 5], 1] = 1  # 3 folds, one without a held-out positive
    labels[[3, 4, 6, 7, 8, 9], 2] = 1  # 3 folds, all scored
    assert cv_drops(cv_splits(labels, groups, folds=3)) == (
        "cv: 1 classes cut below 3 folds (too few positives or negatives); 3 folds skipped (one class to train on "
        "or no positive held out); class #0 out of the mean (no fold scored)")
    assert cv_drops(cv_splits(labels[:, 2:], groups, folds=3)) == ""
    x = np.random.default_rng(0).normal(size=(12, 4))
    count = FitCount()
    both = svm_cv_map(x, cv_splits(labels, groups, folds=3), 1.0, count=count)
    assert len(count.stalled) == 2 + 3  # the fits of the scored folds only
    # class #0 is out of the mean: it is that of the other two
    assert both == pytest.approx(np.mean([svm_cv_map(x, cv_splits(labels[:, [c]], groups, folds=3), 1.0)
                                          for c in (1, 2)]))


def test_cv_script_says_what_it_drops(contract_run, pretrained, voc, tmp_path, capsys, monkeypatch):
    import main_lowshot
    import sce.transfer
    copy_feature_cache(contract_run[0], tmp_path)
    monkeypatch.setattr(sce.transfer, "SVM_MAX_ITER", 1)  # every SVM stops at its limit
    main_lowshot.main(["--data", voc[0], "--pretrained", pretrained, "--shots", "2", "--runs", "1", "--costs", "1",
                       "--cost-selection", "cv", "--cv-folds", "3", "--output-dir", str(tmp_path), "--resize", "32",
                       "--crop-size", "32", "-j", "0"])
    stdout = capsys.readouterr().out
    # the draw: one class has 2 positives (2 folds), 11 of the 19 * 3 + 2 folds cannot score
    drops = ("cv: 1 classes cut below 3 folds (too few positives or negatives); "
             "11 folds skipped (one class to train on or no positive held out)")
    idx = lowshot_draw(voc[1]["trainval"], 2, [0, 2, 0]).ravel()
    assert cv_drops(cv_splits(voc[1]["trainval"][idx], idx, folds=3)) == drops
    assert f"\nK 2 draw 1/1: {drops}\n" in stdout, stdout
    # 59 - 11 cv fits, then 20 test fits
    assert re.search(r"test mAP \d+\.\d\d \(68 of 68 SVM fits did not converge within 1 iterations\)$", stdout, re.M)
    with open(tmp_path / "lowshot.json") as f:
        draw = json.load(f)["results"][0]["draws"][0]
    assert draw["cv_drops"] == drops and draw["fits"] == draw["unconverged_fits"] == 68


def test_compiled_trunk_gives_the_eager_features_compiled_once(contract_run, pretrained, voc, tmp_path, monkeypatch):
    """--compile (dynamo's eager backend here, each graph counted): one graph for both splits' batches, the last
    partial one padded, and the features of the contract run's eager trunk."""
    import torch
    import main_lowshot
    from test_step import count_compiles
    graphs = count_compiles(monkeypatch)
    main_lowshot.main(["--data", voc[0], "--pretrained", pretrained, "--arch", "resnet18", "--shots", "full",
                       "--costs", "1", "--batch-size", "10", "--output-dir", str(tmp_path), "--workers", "0",
                       "--compile"])
    assert len(graphs) == 1  # 24 trainval and 16 test images: batches of 10, the 4s and 6 padded to 10
    names = sorted(f for f in os.listdir(tmp_path) if f.startswith("features_"))
    assert len(names) == 2
    for name in names:  # the cache's key holds no batch size: the contract run's file of the same split
        (eager,) = [f for f in os.listdir(contract_run[0]) if f.startswith(name.rsplit("_", 1)[0] + "_")]
        pairs = ((tmp_path, name), (contract_run[0], eager))
        a, b = (torch.load(folder / f, weights_only=True)["features"] for folder, f in pairs)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_stop_dropped_in_an_svm_fit_stops_before_the_next_draw(contract_run, pretrained, voc, tmp_path, capsys,
                                                                  monkeypatch):
    """SIGTERM sent from a finalizer during the first draw's SVM fits (Python drops its raise there): the run stops
    before the next draw, exit 75 and one line; the same command again gives the uninterrupted result."""
    import signal
    import sce.transfer
    args = ["--data", voc[0], "--pretrained", pretrained, "--shots", "1", "--runs", "2", "--costs", "1",
            "--workers", "0"]
    for out in ("stopped", "whole"):
        os.makedirs(tmp_path / out)
        copy_feature_cache(contract_run[0], tmp_path / out)
    real, fits = sce.transfer._svm, []

    def stopped_once(*a):
        fits.append(1)
        if len(fits) == 1:
            SendsWhenDeleted(signal.SIGTERM)
        return real(*a)
    with script_in_process():
        with monkeypatch.context() as patch:
            patch.setattr(sce.transfer, "_svm", stopped_once)
            assert exit_message("main_lowshot.py", *args, "--output-dir", tmp_path / "stopped") == 75
        said = capsys.readouterr().out
        assert len(fits) == 20  # the first draw's 20 classes, not the second's
        assert [line for line in said.splitlines() if "stopped by" in line] == [
            "=> stopped by SIGTERM while fitting the SVMs: nothing to save; run the same command again to start it "
            "again (exiting with code 75)"] and "Traceback" not in said
        assert not os.path.exists(tmp_path / "stopped" / "lowshot.json")
        for out in ("stopped", "whole"):
            assert exit_message("main_lowshot.py", *args, "--output-dir", tmp_path / out) is None
    rerun, whole = (json.load(open(tmp_path / out / "lowshot.json"))["results"] for out in ("stopped", "whole"))
    assert rerun == whole
