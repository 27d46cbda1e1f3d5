"""main_pretrain.py as users run it: contract commands, exact resume, multi-rank equivalence, bad input."""
import glob
import json
import os
import re

import pytest
import torch
from PIL import Image

from conftest import assert_same_state, assert_trained, load, run_script, write_imagefolder
from sce import UserError

TINY = ["--arch", "resnet18", "--small-input", "--crop-size", "16", "--batch-size", "8", "--queue-size", "32",
        "--workers", "0", "--proj-hidden-dims", "32", "--proj-dim", "16", "--print-freq", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("pretrain") / "data", num_classes=3, per_class=6, size=20)


def test_resume_equals_uninterrupted_run(data, tmp_path):
    # a lambda schedule (warmup then cosine) is a function of the step: it resumes with the run
    lam = ["--lambda-schedule", "cosine", "--lambda-end", "0.9", "--lambda-warmup-steps", "2",
           "--lambda-warmup-start", "0.1"]
    run_script(["main_pretrain.py", "--data", data, "--epochs", "2", "--output-dir", str(tmp_path / "a")] + TINY + lam)
    first = run_script(["main_pretrain.py", "--data", data, "--epochs", "2", "--stop-after-epochs", "1",
                        "--output-dir", str(tmp_path / "b")] + TINY + lam)
    assert "stopping after 1 epoch" in first.stdout
    assert load(tmp_path / "b" / "checkpoint_last.pth")["epoch"] == 1
    second = run_script(["main_pretrain.py", "--data", data, "--epochs", "2", "--output-dir", str(tmp_path / "b")]
                        + TINY + lam)
    assert "resuming from" in second.stdout
    a, b = load(tmp_path / "a" / "checkpoint_last.pth"), load(tmp_path / "b" / "checkpoint_last.pth")
    assert a["epoch"] == b["epoch"] == 2 and a["step"] == b["step"] == 4
    assert_same_state(a["model"], b["model"])
    assert_trained(tmp_path / "a")
    assert int(a["model"]["queue_ptr"]) == 0  # 4 steps x 8 keys wrap a 32-key queue
    assert os.path.exists(tmp_path / "a" / "checkpoint_0002.pth")  # last epoch always numbered
    # progress line and TensorBoard scalars
    assert re.search(r"\] loss \d+\.\d+ lr \S+ m \S+ \d+\.\d img/s data \d+% skipped 0 eta \d+:\d\d:\d\d", first.stdout)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "a")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/momentum", "train/images_per_s", "train/data_wait_share",
            "train/lambda", "train/skipped_steps", "terms/infonce", "terms/ressl", "terms/ceil"} <= tags
    lambdas = [e.value for e in events.Scalars("train/lambda")]  # steps 0-3: warmup 0.1, 0.5, then cosine to 0.9
    assert lambdas == pytest.approx([0.1, 0.3, 0.5, 0.9])
    assert "views" in events.Tags()["images"]  # the augmented views, at the first step of the run
    # the resolved settings and one JSON line per epoch, also across the resume
    assert json.load(open(tmp_path / "b" / "args.json"))["lambda_schedule"] == "cosine"
    for run in "ab":
        epochs = [json.loads(line) for line in open(tmp_path / run / "log.txt")]
        assert [e["epoch"] for e in epochs] == [1, 2]
        assert {"loss", "infonce", "ressl", "ceil", "lr", "momentum", "lambda", "images_per_s",
                "skipped_steps"} <= epochs[0].keys()
    assert open(tmp_path / "a" / "log.txt").read().count("loss") == 2


def test_two_gloo_ranks_equal_one_process(data, tmp_path):
    run_script(["torchrun", "--nproc_per_node=2", "tests/dist_equivalence.py", data, str(tmp_path / "two.pth")])
    run_script(["tests/dist_equivalence.py", data, str(tmp_path / "one.pth")])  # BN split in 2 chunks
    two, one = load(tmp_path / "two.pth"), load(tmp_path / "one.pth")
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-6)  # float64 (dist_equivalence.py)
    weights, queue = one["model"], one["model"]["queue"]
    assert torch.equal(two["model"]["queue_ptr"], weights["queue_ptr"]) and int(weights["queue_ptr"]) == 8  # 4 steps x 8 keys, M=24
    assert not torch.allclose(queue[:8], queue[8:16])  # steps enqueued different keys
    # BN running statistics are rank-local: rank 0's follow its own chunk, the split BN's the mean of
    # both chunks, so the mean over ranks is what compares
    running = two["bn_mean_over_ranks"]
    assert not torch.allclose(two["model"]["encoder.bn1.running_var"], weights["encoder.bn1.running_var"], atol=1e-4)
    for key in weights:
        assert torch.allclose(running.get(key, two["model"][key]), weights[key], atol=1e-6), key


def test_contract_commands_torchrun_then_resume(data, tmp_path):
    out = str(tmp_path / "out")
    common = ["--data", data, "--arch", "resnet18", "--small-input", "--crop-size", "32", "--batch-size", "16",
              "--queue-size", "64", "--workers", "0", "--output-dir", out]
    proc = run_script(["torchrun", "--nproc_per_node=2", "main_pretrain.py"] + common +
                      ["--epochs", "1", "--lambda", "0.5", "--tau-m", "0.07"])
    assert "on 2 rank(s)" in proc.stdout
    ckpt = load(os.path.join(out, "checkpoint_last.pth"))
    assert ckpt["epoch"] == 1 and ckpt["args"]["tau_m"] == 0.07
    run_script(["main_pretrain.py"] + common + ["--epochs", "2", "--resume", os.path.join(out, "checkpoint_last.pth")])
    assert load(os.path.join(out, "checkpoint_last.pth"))["epoch"] == 2
    assert_trained(out)


def test_methods_and_options_run(data, tmp_path):
    # baselines, eq. 10, symmetric multi-crop on device, shuffle-BN, LARS, bf16 autocast, channels-last, predictor
    run_script(["main_pretrain.py", "--data", data, "--epochs", "1", "--output-dir", str(tmp_path / "r"), "--method",
                "ressl", "--symmetric", "--local-crop-sizes", "8", "--local-crop-scales", "0.1", "0.5", "--augment", "gpu",
                "--shuffle-bn", "--bn-splits", "2", "--optimizer", "lars", "--amp", "bf16", "--channels-last",
                "--pred-hidden-dims", "32"] + TINY + ["--queue-size", "48"], threads=2)
    ckpt = load(tmp_path / "r" / "checkpoint_last.pth")
    assert ckpt["args"]["tau_m"] == 0.04 and ckpt["args"]["target_aug"] == "weak"
    assert int(ckpt["model"]["queue_ptr"]) == 32  # symmetric: 2 x 8 keys per step, 2 steps
    assert_trained(tmp_path / "r")
    assert any(k.startswith("predictor.") for k in ckpt["model"])
    proc = run_script(["main_pretrain.py", "--data", data, "--epochs", "1", "--output-dir", str(tmp_path / "m"),
                       "--method", "moco", "--knn-data", data, "--knn-every", "1"] + TINY, threads=2)
    assert re.search(r"=> epoch 1: kNN top-1 \d+\.\d+ top-5 \d+\.\d+", proc.stdout)  # the kNN monitor
    args = load(tmp_path / "m" / "checkpoint_last.pth")["args"]
    assert args["tau"] == 0.2 and args["loss"] == "infonce" and args["target_aug"] == "strong"
    assert_trained(tmp_path / "m")
    run_script(["main_pretrain.py", "--data", data, "--epochs", "1", "--output-dir", str(tmp_path / "c"),
                "--loss-coeffs", "0.5", "0.5", "0"] + TINY, threads=2)
    assert load(tmp_path / "c" / "checkpoint_last.pth")["args"]["loss"] == "combined"
    assert_trained(tmp_path / "c")


def test_gpu_augment_run_lowers_the_loss(tmp_path):
    # --augment gpu on a machine without one: the batched ops run on CPU tensors in this process, and
    # --decode device decodes the JPEG half of each batch there (torchvision's CPU decoder standing in)
    data = write_imagefolder(tmp_path / "data", num_classes=4, per_class=8, size=24, splits=("",))
    for png in glob.glob(os.path.join(data, "class_[01]", "*.png")):  # half JPEG: torchvision's decoder path
        Image.open(png).save(png[:-4] + ".jpg", quality=95)
        os.remove(png)
    proc = run_script(["main_pretrain.py", "--data", data, "--augment", "gpu", "--decode", "device", "--arch",
                       "resnet18", "--small-input", "--crop-size", "16", "--min-scale", "0.5", "--batch-size", "16",
                       "--queue-size", "32",
                       "--workers", "0", "--proj-hidden-dims", "64", "--proj-dim", "32", "--epochs", "16", "--lr", "1.0",
                       "--warmup-epochs", "0", "--print-freq", "2", "--save-freq", "100",
                       "--output-dir", str(tmp_path / "out")], threads=2)
    assert "=> data: loader, 0 worker(s), JPEGs decoded on the device; views: on cpu; step: eager; amp none" \
        in proc.stdout
    epoch_losses = [float(x) for x in re.findall(r"\] loss (\d+\.\d+)", proc.stdout)]  # 16 epochs of 2 steps
    assert len(epoch_losses) == 16
    assert sum(epoch_losses[-4:]) / 4 < sum(epoch_losses[:4]) / 4 - 0.5, epoch_losses
    assert_trained(tmp_path / "out")


@pytest.mark.parametrize("augment", ["cpu", "gpu"])
def test_preview_views_of_the_demo(tmp_path, monkeypatch, augment):
    monkeypatch.setenv("HOME", str(tmp_path))  # the demo writes its digits under ~/.cache
    monkeypatch.chdir(tmp_path)  # and would write its run under ./runs
    import main_pretrain
    from PIL import Image
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


def test_demo_trains_and_prints_knn_line(tmp_path):
    # the bar of a 1-epoch demo: finite steps, a trunk that moved and the closing kNN line. Beating the
    # untrained kNN takes the demo's 20 epochs (5 min, README: 90.0% against 82.8%); after 1 epoch the
    # learned kNN is below it (70.8% measured), so this test cannot ask for it
    proc = run_script(["main_pretrain.py", "--epochs", "1", "--knn-max-train", "400",
                       "--output-dir", str(tmp_path / "demo")], env={"HOME": str(tmp_path)}, threads=2)
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"kNN top-1: \d+\.\d% \(untrained: \d+\.\d%\)", last), last
    assert_trained(tmp_path / "demo")


def one_line_error(args, match):
    """The script as users run it: non-zero exit, one line on stderr, no traceback."""
    proc = run_script(args, check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines and "error" in lines[-1] and match in lines[-1], proc.stderr[-2000:]


def user_error(argv, match):
    """Same checks in-process (no interpreter start): main() raises the UserError the script prints."""
    import main_pretrain
    with pytest.raises(UserError, match=match):
        main_pretrain.main(argv)


def test_bad_input_is_one_line(data, tmp_path):
    one_line_error(["main_pretrain.py", "--data", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "o")],
                   "does not exist")
    one_line_error(["main_pretrain.py", "--data", data, "--online-aug", "extreme"], "invalid choice")


@pytest.mark.parametrize("extra,match", [
    (["--arch", "resnet7"], "unknown arch"),
    (["--queue-size", "36"], "not a multiple"),
    (["--lambda", "1.5"], "--lambda"),
    (["--tau", "0"], "temperatures must be positive"),
    (["--tau-m", "-0.1"], "temperatures must be positive"),
    (["--batch-size", "100", "--queue-size", "100"], "fewer than one batch"),
    (["--shuffle-bn", "--bn-splits", "3"], "--bn-splits 3 must divide the batch of 8"),
    (["--shuffle-bn"], "--bn-splits 8 must divide the batch of 8 into chunks of at least 2"),
    (["--lambda-end", "1.5"], "must lie in \\[0, 1\\]"),
    (["--lambda-schedule", "cosine", "--method", "moco"], "need the SCE loss"),
    (["--crop-size", "6"], "too small to blur"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--print-freq", "0"], "--print-freq must be positive"),
    (["--workers", "-1"], "--workers must be >= 0"),
    (["--save-freq", "0"], "--save-freq must be positive"),
    (["--proj-hidden-dims", "32", "0"], "--proj-hidden-dims must be positive"),
    (["--ema-momentum", "1.5"], "--ema-momentum must lie in \\[0, 1\\]"),
    (["--min-scale", "1.5"], "need 0 < min <= max <= 1"),
    (["--local-crop-sizes", "8", "--local-crop-scales", "0.5", "0.1"], "need 0 < min <= max <= 1"),
    (["--knn-max-train", "0"], "--knn-max-train must be a positive number"),
])
def test_bad_flags(data, tmp_path, extra, match):
    user_error(["--data", data, "--epochs", "1", "--output-dir", str(tmp_path / "o")] + TINY + extra, match)


def test_bad_files(data, tmp_path):
    base = ["--epochs", "1"] + TINY
    os.makedirs(tmp_path / "empty" / "class_a")
    user_error(["--data", str(tmp_path / "empty"), "--output-dir", str(tmp_path / "o")] + base, "no images found")
    user_error(["--data", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o")] + base, "does not exist")
    os.makedirs(tmp_path / "knn" / "train" / "a")
    user_error(["--data", data, "--knn-data", str(tmp_path / "knn"), "--output-dir", str(tmp_path / "o")] + base,
               "has no val/ folder")
    blocker = tmp_path / "file"
    blocker.write_text("")
    user_error(["--data", data, "--output-dir", str(blocker / "sub")] + base, "not writable")
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    user_error(["--data", data, "--output-dir", str(tmp_path / "j"), "--resume", str(junk)] + base,
               "is not a PyTorch checkpoint .it begins")
    run_script(["main_pretrain.py", "--data", data, "--output-dir", str(tmp_path / "r18")] + base)
    other = [a if a != "resnet18" else "resnet34" for a in base]
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + other, "--arch resnet18")
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--queue-size", "64"], "--queue-size")
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--optimizer", "lars"],
               "--optimizer sgd")
    # the optimizer's saved state would silently keep the old weight decay; the objective may not change mid-run
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--wd", "1e-3"],
               "--weight-decay 0.0001, not 0.001")
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--method", "moco"], "--method sce")
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--tau-m", "0.05"], "--tau-m 0.07")
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18")] + base + ["--wd-exclude-bias-norm"],
               "--wd-exclude-bias-norm \\(off\\), not \\(on\\)")
    mid = load(tmp_path / "r18" / "checkpoint_last.pth")
    mid["step_in_epoch"] = 1  # as a preempted run leaves it
    torch.save(mid, tmp_path / "mid.pth")
    user_error(["--data", data, "--output-dir", str(tmp_path / "m"), "--resume", str(tmp_path / "mid.pth")]
               + base + ["--batch-size", "4", "--queue-size", "32"], "stopped mid-epoch with --batch-size 8")
    # spelling out what the run applied (SGD: no exclusion) is the same setting
    run_script(["main_pretrain.py", "--data", data, "--output-dir", str(tmp_path / "r18")] + base
               + ["--no-wd-exclude-bias-norm"])
    user_error(["--data", data, "--output-dir", str(tmp_path / "r18"), "--resume", "none"] + base, "would overwrite")


def test_batch_not_divisible_by_ranks(data, tmp_path):
    args = ["torchrun", "--nproc_per_node=2", "main_pretrain.py", "--data", data, "--epochs", "1",
            "--output-dir", str(tmp_path / "o")] + TINY + ["--batch-size", "9", "--queue-size", "36"]
    proc = run_script(args, check=False)
    assert proc.returncode != 0 and "not divisible by the 2 ranks" in proc.stderr
    assert "Traceback" not in proc.stderr.split("error:")[0]
