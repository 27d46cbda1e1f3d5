"""Scaling out: two torchrun "nodes" on this machine equal one node of two ranks; the kNN monitor
shared by 2 ranks equals main_lincls.py --knn in one process; nodes that disagree stop; the SLURM
script is valid shell and its command parses."""
import json
import os
import re
import shlex
import socket
import subprocess
import sys

import pytest

from conftest import REPO, assert_same_state, assert_trained, load, run_script, write_imagefolder
import main_pretrain

TINY = ["--arch", "resnet18", "--small-input", "--crop-size", "16", "--batch-size", "8", "--queue-size", "32",
        "--workers", "0", "--proj-hidden-dims", "32", "--proj-dim", "16", "--print-freq", "1"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = write_imagefolder(tmp_path_factory.mktemp("scale") / "data", num_classes=3, per_class=8, size=20)
    for i in range(3):  # a few wrong val labels, so that kNN accuracy is not trivially 100%
        os.replace(os.path.join(root, "val", f"class_{i}", "0.png"),
                   os.path.join(root, "val", f"class_{(i + 1) % 3}", "moved.png"))
    return root


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(args, timeout=240):
    """The same command on two torchrun 'nodes' of one rank each, c10d rendezvous on 127.0.0.1."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               f"127.0.0.1:{port}", "--rdzv-id", "sce-test", "--max-restarts", "0"]
                              + [str(a) for a in node_args], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for node, node_args in enumerate(args)]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [p.returncode for p in procs], outputs


def test_two_nodes_equal_one_node_of_two_ranks(data, tmp_path):
    common = ["main_pretrain.py", "--data", data, "--epochs", "1"] + TINY
    codes, outputs = two_nodes([common + ["--output-dir", tmp_path / "nodes"]] * 2)
    assert codes == [0, 0], "\n".join(o[-2000:] for o in outputs)
    run_script(["torchrun", "--standalone", "--nproc_per_node=2"] + common + ["--output-dir", str(tmp_path / "one")])
    a, b = load(tmp_path / "nodes" / "checkpoint_last.pth"), load(tmp_path / "one" / "checkpoint_last.pth")
    assert a["step"] == b["step"] == 3
    assert_same_state(a["model"], b["model"])
    assert_trained(tmp_path / "nodes")


def test_nodes_that_disagree_stop(data, tmp_path):
    common = ["main_pretrain.py", "--data", data, "--epochs", "1", "--output-dir", tmp_path / "o"] + TINY
    codes, outputs = two_nodes([common, common + ["--batch-size", "4", "--queue-size", "32"]])
    assert codes[0] != 0 and codes[1] != 0
    assert any("ranks disagree on --batch-size (rank 0: " in o for o in outputs), outputs[0][-2000:]
    assert all("Traceback" not in o.split("error: ranks disagree")[0] for o in outputs)


def test_knn_monitor_on_two_ranks_equals_lincls_knn_in_one_process(data, tmp_path):
    out = tmp_path / "pre"
    run_script(["torchrun", "--standalone", "--nproc_per_node=2", "main_pretrain.py", "--data", data, "--epochs", "1",
                "--knn-data", data, "--knn-k", "5", "--output-dir", str(out)] + TINY)
    assert_trained(out)
    monitor = json.loads(open(out / "log.txt").read().splitlines()[-1])
    run_script(["main_lincls.py", "--data", data, "--pretrained", str(out / "checkpoint_last.pth"), "--knn",
                "--knn-k", "5", "--crop-size", "16", "--workers", "0", "--output-dir", str(tmp_path / "knn")])
    with open(tmp_path / "knn" / "results_knn.json") as f:
        single = json.load(f)
    assert 0 < monitor["knn_top1"] < 100
    assert monitor["knn_top1"] == pytest.approx(single["acc1"]) and monitor["knn_top5"] == pytest.approx(single["acc5"])


def test_slurm_script_is_valid_and_its_command_parses():
    path = os.path.join(REPO, "slurm", "pretrain.sbatch")
    subprocess.run(["bash", "-n", path], check=True)
    text = open(path).read()
    assert re.search(r"^#SBATCH --signal=B:USR1@\d+", text, re.M) and "#SBATCH --requeue" in text
    assert "scontrol requeue" in text and "srun" in text and "--rdzv-endpoint" in text
    variables = dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', text, re.M))
    flags = variables["FLAGS"]
    for name, value in variables.items():
        flags = flags.replace(f"${name}", value)
    args = main_pretrain.parse_args(shlex.split(flags))
    assert args.batch_size == 4096 and args.optimizer == "lars" and args.sync_bn and args.symmetric
    assert args.queue_size % (2 * args.batch_size) == 0


def test_knn_scores_stay_fp32_under_autocast():
    # main_lincls.py --knn --amp runs the kNN inside autocast: similarities and votes stay fp32
    import torch
    import torch.nn.functional as F
    from sce.knn import knn_accuracy, knn_scores
    g = torch.Generator().manual_seed(0)
    bank, queries = (F.normalize(torch.randn(n, 48, generator=g), dim=1) for n in (200, 40))
    labels = torch.arange(200) % 3
    plain = knn_scores(bank, labels, queries, 3, k=20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = knn_scores(bank, labels, queries, 3, k=20)
    assert scores.dtype == torch.float32 and torch.equal(scores, plain)
    images = [(torch.randn(3, 4, 4, generator=g), i % 3) for i in range(30)]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # and the whole path, extraction included, runs
        top1, top5 = knn_accuracy(torch.nn.Flatten(), images, images[:12], 3, torch.device("cpu"), k=5, workers=0)
    assert 0 <= top1 <= top5 <= 100
    from sce.knn import extract_features  # a trunk with an autocast op: its features still come out fp32
    trunk = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features, _ = extract_features(trunk, torch.utils.data.DataLoader(images, batch_size=10), torch.device("cpu"))
    assert features.dtype == torch.float32 and features.shape == (30, 16)


def test_knn_max_train_takes_a_seeded_subset_as_the_bank():
    import torch
    from sce.knn import knn_accuracy
    g = torch.Generator().manual_seed(0)
    images = [(torch.randn(3, 4, 4, generator=g), i % 3) for i in range(30)]
    seen = []

    class Recording(torch.nn.Flatten):
        def forward(self, x):
            seen.append(x.clone())
            return super().forward(x)
    # k=1 on val = train: a full bank finds each image itself; a bank of 5 misses most of them
    assert knn_accuracy(Recording(), images, images, 3, torch.device("cpu"), k=1, workers=0)[0] == 100
    banks = []
    for seed in (1, 1, 2):
        seen.clear()
        top1 = knn_accuracy(Recording(), images, images, 3, torch.device("cpu"), k=1, workers=0, max_train=5,
                            seed=seed)[0]
        assert [len(x) for x in seen] == [5, 30] and top1 < 100  # the bank, then the queries
        banks.append(seen[0])
    assert torch.equal(banks[0], banks[1]) and not torch.equal(banks[0], banks[2])  # drawn from the seed
