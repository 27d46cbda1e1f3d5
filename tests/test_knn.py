"""kNN (sce.knn, main_lincls.py --knn) against brute force, under autocast and a failing compiled trunk, and the kNN
monitor of main_pretrain.py: its data, its bank, its classes, and main_lincls.py's number from it."""
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms as T

from conftest import TINY, fake_compile, no_triton, write_cifar, write_imagefolder, write_tiny_imagenet
import main_lincls
import main_pretrain
from sce import UserError, data as sce_data
from sce.checkpoint import load_trunk
from sce.data import MEAN, STD, build_dataset
from sce.knn import extract_features, knn_scores
from sce.metrics import top1_accuracy
from test_evaluation import CPU, folder, last_log, lincls_here, result  # noqa: F401  (folder: a fixture)

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


def test_knn_stays_fp32_under_autocast():
    # main_lincls.py --knn --amp runs the kNN inside autocast: similarities, votes and features stay fp32
    g = torch.Generator().manual_seed(0)
    bank, queries = (F.normalize(torch.randn(n, 48, generator=g), dim=1) for n in (200, 40))
    labels = torch.arange(200) % 3
    plain = knn_scores(bank, labels, queries, 3, k=20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = knn_scores(bank, labels, queries, 3, k=20)
    assert scores.dtype == torch.float32 and torch.equal(scores, plain)
    trunk = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 16))  # an op autocast runs in bf16
    class Batches(list):  # EvalSplit.batches' face: its batches, and a sampler that says how many images
        sampler = range(30)
    batches = Batches((torch.randn(10, 3, 4, 4, generator=g), torch.arange(10) % 3) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features, _ = extract_features(trunk, batches)
    assert features.dtype == torch.float32 and features.shape == (30, 16)


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
    tf = T.Compose([T.Resize(16), T.CenterCrop(16), T.ToTensor(), T.Normalize(MEAN, STD)])  # the small protocol's val

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


def test_knn_with_a_failing_compiled_trunk_warns_and_equals_eager(pretrained, folder, tmp_path, capsys, monkeypatch):
    """--compile where the compiled trunk fails at its first call: one warning naming the cause, and the
    batch is redone eagerly (a frozen trunk in eval mode has no state to put back)."""
    args = ["--data", folder, "--pretrained", pretrained, "--knn", "--knn-k", "5", "--crop-size", "16"]
    lincls_here(capsys, *args, "--output-dir", tmp_path / "eager")
    fake_compile(monkeypatch, no_triton)
    with pytest.warns(UserWarning) as caught:
        lincls_here(capsys, *args, "--compile", "--output-dir", tmp_path / "compiled")
    assert [str(w.message) for w in caught if "--compile" in str(w.message)] == [
        "--compile: torch.compile of the trunk failed (Cannot find a working triton installation): running it eagerly"]
    results = [json.load(open(tmp_path / out / "results_knn.json")) for out in ("eager", "compiled")]
    assert results[0] == results[1]



# ---------------------------------------------------------------- the kNN monitor

def test_knn_monitor_reads_tiny_imagenet_and_gives_lincls_number(tmp_path):
    root = write_tiny_imagenet(tmp_path / "tiny")
    train, val, classes = sce_data.eval_splits("tiny-imagenet", root, 16, True, CPU)
    assert classes == 3 and len(train) == 24 and sorted(set(train.targets)) == [0, 1, 2]
    assert list(val.targets) == [1, 2, 2, 1, 1, 2]  # from val_annotations.txt, not from the folder

    out = tmp_path / "pre"
    main_pretrain.main(["--data", root, "--dataset", "tiny-imagenet", "--knn-data", root, "--knn-k", "5",
                        "--epochs", "1", "--output-dir", str(out)] + TINY)
    main_lincls.main(["--data", root, "--dataset", "tiny-imagenet", "--pretrained", str(out / "checkpoint_last.pth"),
                      "--knn", "--knn-k", "5", "--workers", "0", "--output-dir", str(tmp_path / "knn")])
    monitor, lincls = last_log(out), result(tmp_path / "knn")
    assert 0 < lincls["acc1"] < 100
    assert (monitor["knn_top1"], monitor["knn_top5"]) == (lincls["acc1"], lincls["acc5"])


def test_the_knn_monitor_takes_the_pretraining_images_where_they_are_its_own(tmp_path, capsys):
    """Pretraining on DATA/train preloaded at the crop size: the monitor's bank is those images on the device (no
    second preload), and its number main_lincls.py --knn's through the loader."""
    root = write_imagefolder(tmp_path / "data", 3, 6, 16)
    main_pretrain.main(["--data", root, "--knn-data", root, "--knn-k", "5", "--preload", "device", "--epochs", "1",
                        "--output-dir", str(tmp_path / "pre")] + TINY)
    said = capsys.readouterr().out
    assert "=> kNN train images: the 18 preloaded for pretraining" in said and "kNN train images (" not in said
    main_lincls.main(["--data", root, "--pretrained", str(tmp_path / "pre" / "checkpoint_last.pth"), "--knn",
                      "--knn-k", "5", "--preload", "off", "--workers", "0", "--output-dir", str(tmp_path / "knn")])
    monitor, lincls = last_log(tmp_path / "pre"), result(tmp_path / "knn")
    assert (monitor["knn_top1"], monitor["knn_top5"]) == pytest.approx((lincls["acc1"], lincls["acc5"]))


def test_knn_max_train_takes_a_seeded_subset_as_the_bank(tmp_path):
    """--knn-max-train N: the monitor's bank is N train images drawn from its seed, the same at every call."""
    from sce.knn import knn_accuracy
    root = write_imagefolder(tmp_path / "knn", 3, 10, 4)
    train, _, classes = sce_data.eval_splits("imagefolder", root, 4, True, CPU)
    seen = []

    class Recording(torch.nn.Flatten):
        def forward(self, x):
            seen.append(x.clone())
            return super().forward(x)
    knn_accuracy(Recording(), train, train, classes, k=1)
    assert [len(x) for x in seen] == [30, 30]  # without it: the whole split
    banks = []
    for seed in (1, 1, 2):
        seen.clear()
        knn_accuracy(Recording(), train, train, classes, k=1, max_train=5, seed=seed)
        assert [len(x) for x in seen] == [5, 30]  # the bank, then the queries
        banks.append(seen[0])
    assert torch.equal(banks[0], banks[1]) and not torch.equal(banks[0], banks[2])  # drawn from the seed


@pytest.mark.parametrize("classes,said", [
    (["class_0", "class_1", "class_2"], None),
    (["class_0", "class_1", "class_x"], "other classes of as many: 'class_2', not 'class_x'"),
    (["class_0", "class_1"], "3 classes, not 2")])
def test_the_monitor_reads_the_probe_only_on_data_of_the_same_classes(tmp_path, capsys, classes, said):
    """The online probe's head learns --data's classes: on --knn-data of other classes, even as many, its top-1 would
    compare other labels; it is left out, said once."""
    from types import SimpleNamespace
    from sce.knn import KnnResult, Monitor
    from sce.step import OnlineProbe
    root = write_imagefolder(tmp_path / "knn", 3, 4, 4)
    monitor = Monitor(sce_data.eval_splits("imagefolder", root, 4, True, CPU), k=1, t=0.07)
    model = SimpleNamespace(encoder=torch.nn.Flatten())  # 3 x 4 x 4 pixels as the features
    probe = OnlineProbe(48, len(classes), "cpu", classes=classes)
    results = [monitor(model, probe) for _ in range(2)]
    assert all(isinstance(r, KnnResult) and 0 <= r.top1 <= r.top5 <= 100 for r in results)
    assert [r.probe_top1 is None for r in results] == [bool(said)] * 2
    out = capsys.readouterr().out
    assert out.count(f"the online probe's val top-1 is not read: the kNN data's classes are not the ones it learns "
                     f"({said})") == bool(said)


def test_knn_monitor_reads_cifar_batches(tmp_path):
    write_cifar(tmp_path)
    train, val, classes = sce_data.eval_splits("cifar10", str(tmp_path), 16, True, CPU)
    assert classes == 10 and len(train) == 20 and len(val) == 4
    assert next(iter(train.batches(4)))[0].shape == (4, 3, 16, 16)  # the size asked (the pretraining crop's)


def test_knn_monitor_refuses_a_val_lacking_a_class(tmp_path):
    root = write_imagefolder(tmp_path / "knn", 3, 4, 16)
    os.rename(os.path.join(root, "val", "class_2"), os.path.join(tmp_path, "away"))
    with pytest.raises(UserError, match=r"different classes \(first difference: class_2\)"):
        main_pretrain.main(["--data", root, "--knn-data", root, "--epochs", "1",
                            "--output-dir", str(tmp_path / "out")] + TINY)
    tiny = write_tiny_imagenet(tmp_path / "tiny", 2, val=((1, "n02"), (2, "n09")))
    with pytest.raises(UserError, match=r"val_annotations.txt names 1 classes that train/ lacks \(first: n09\)"):
        sce_data.eval_splits("tiny-imagenet", tiny, 16, True, CPU)
