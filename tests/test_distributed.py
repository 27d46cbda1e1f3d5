"""Several ranks (torchrun, gloo on CPU): two ranks equal one process, two nodes one node of two ranks, the kNN
monitor shared by ranks equals main_lincls.py --knn in one process; preemption of every rank resumes exactly; a
rank that raises, dies or hangs stops the job (the raising one named); nodes that disagree stop; a UserError is one
line, named in torchrun's summary; sync-BN; the linear probe on two ranks, stopped and resumed; the SLURM script
parses."""
import contextlib
import datetime
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import REPO, TINY, assert_same_state, assert_trained, exit_message, load, write_imagefolder
import main_lincls
import main_pretrain
from sce import data as sce_data
from sce.checkpoint import trunk_state_dict
from sce.preemption import PREEMPTED_EXIT_CODE

ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
EXIT_LIMIT_S = 60  # the bound on how long stopping may take
pytestmark = pytest.mark.usefixtures("in_process")  # conftest: one thread, signal handlers restored


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """32 images: 4 steps of batch 8 per epoch (torchrun runs)."""
    return write_imagefolder(tmp_path_factory.mktemp("rel") / "data", num_classes=4, per_class=8, size=20,
                             splits=("",))


def processes():
    """{pid: (parent pid, command line)} of every process we can see (Linux /proc)."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    found[int(name)] = (ppid, f.read().replace(b"\0", b" ").decode(errors="replace"))
            except (OSError, IndexError, ValueError):
                pass
    return found


def descendants(pid):
    procs, out, todo = processes(), [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, (ppid, _) in procs.items() if ppid == parent]
        out += kids
        todo += kids
    return out


ONE_NODE = ["--standalone", "--nproc_per_node=2"]


def node_of_two(node, port):
    """torchrun's flags for `node` of two 'nodes' of one rank each, c10d rendezvous on 127.0.0.1:`port`."""
    return ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "sce-test", "--max-restarts", "0"]


class Job:
    """A torchrun job (by default one node of 2 gloo ranks) whose output is read on a thread, so a test can wait
    for a line."""

    def __init__(self, script, args, launcher=ONE_NODE):
        cmd = [sys.executable, "-m", "torch.distributed.run"] + launcher + [script] + [str(a) for a in args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def output(self):
        return "".join(self.lines)

    def wait_for(self, text, timeout=180):
        deadline = time.time() + timeout
        while not any(text in line for line in list(self.lines)):
            if self.proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"'{text}' never appeared\n{self.output[-4000:]}")
            time.sleep(0.01)

    def ranks(self):
        """{rank: pid} of the workers torchrun started (each runs in its own session)."""
        found = {}
        for pid, (ppid, _) in processes().items():
            if ppid == self.proc.pid:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                found[int(env[b"RANK"])] = pid
        return found

    def wait(self, timeout=300):
        """Exit code and seconds taken."""
        start = time.time()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not exit within {timeout} s\n{self.output[-4000:]}")
        self.reader.join(10)
        return code, time.time() - start

    def kill(self):
        for pid in [self.proc.pid] + descendants(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture
def jobs():
    """Start torchrun jobs; any left running by a failing test are killed."""
    started = []

    def start(script, args, launcher=ONE_NODE):
        started.append(Job(script, args, launcher))
        return started[-1]
    yield start
    for job in started:
        if job.proc.poll() is None:
            job.kill()


def test_two_gloo_ranks_equal_one_process(small, tmp_path):
    """tests/dist_equivalence.py on two ranks and in one process standing for them; the two ranks then run
    tests/sync_bn_check.py's checks of MomentumModel(sync_bn=True)."""
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                 "tests/dist_equivalence.py", small, str(tmp_path / "two.pth")], cwd=REPO, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:  # the one process (it splits BN in 2 chunks) here, while torchrun starts: a torch import saved
        assert exit_message("tests/dist_equivalence.py", small, tmp_path / "one.pth") is None
    finally:
        torch.set_default_dtype(torch.float32)  # the script trains in float64
    output, _ = torchrun.communicate(timeout=300)
    assert torchrun.returncode == 0 and "sync-bn check ok" in output, output[-3000:]
    two, one = load(tmp_path / "two.pth"), load(tmp_path / "one.pth")
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-6)  # float64 (dist_equivalence.py)
    weights, queue = one["model"], one["model"]["queue"]
    assert torch.equal(two["model"]["queue_ptr"], weights["queue_ptr"])
    assert int(weights["queue_ptr"]) == 16  # 2 steps x 8 keys, M=24
    assert not torch.allclose(queue[:8], queue[8:16])  # steps enqueued different keys
    # BN running statistics are rank-local: rank 0's follow its own chunk, the split BN's the mean of
    # both chunks, so the mean over ranks is what compares
    running = two["bn_mean_over_ranks"]
    assert not torch.allclose(two["model"]["encoder.bn1.running_var"], weights["encoder.bn1.running_var"], atol=1e-4)
    for key in weights:
        assert torch.allclose(running.get(key, two["model"][key]), weights[key], atol=1e-6), key


def first_image_of(rank, root, world=2, batch=8):
    """An image that only `rank` reads in the first step."""
    ds = sce_data.build_dataset("imagefolder", root, "pretrain")
    slices = []
    for r in range(world):
        sampler = sce_data.ResumableSampler(len(ds), batch, r, world, seed=0)
        slices.append([i for _, i in list(sampler)[:batch // world]])
    return ds.path(slices[rank][0])


def test_rank_that_raises_stops_the_job_and_is_named(tmp_path, jobs):
    root = write_imagefolder(tmp_path / "data", num_classes=3, per_class=8, size=20, splits=("",))
    with open(first_image_of(1, root), "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n garbage")
    job = jobs("main_pretrain.py", ["--data", root, "--epochs", 1, "--output-dir", tmp_path / "o",
                                    "--max-bad-images", 0] + TINY)
    code, took = job.wait()
    assert code != 0 and took < EXIT_LIMIT_S
    # torchrun's summary names the rank that failed first and its one-line reason (torch's error file)
    root = job.output.split("Root Cause")[-1]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root), job.output[-3000:]
    assert re.search(r"traceback\s*:\s*error: 1 unreadable images, more than --max-bad-images 0", root)
    assert "raise UserError" not in job.output  # one line, no traceback of the UserError anywhere
    said = job.output.split("Root Cause")[0].splitlines()  # and the rank printed that line itself
    assert any(line.startswith("error: 1 unreadable images, more than --max-bad-images 0") for line in said), \
        job.output[-5000:]


def test_killed_rank_stops_the_job(data, tmp_path, jobs):
    job = jobs("main_pretrain.py", ["--data", data, "--epochs", 2, "--output-dir", tmp_path] + TINY)
    job.wait_for("Epoch [1/2][2/4]")
    os.kill(job.ranks()[1], signal.SIGKILL)
    code, took = job.wait()
    assert code != 0 and took < EXIT_LIMIT_S
    # torchrun's summary names the killed rank
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*-9", job.output), job.output[-3000:]


HANG = '''import os, runpy, signal, sys, time
sys.path.insert(0, {repo!r})
from sce.builder import MomentumModel
update, calls = MomentumModel.update_momentum, [0]
def hang(self, *args):  # rank 1 stops responding after its step-2 gradients were averaged
    calls[0] += 1
    if os.environ["RANK"] == "1" and calls[0] == 2:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's SIGTERM ends it: no 30 s wait for its SIGKILL
        time.sleep(3600)
    return update(self, *args)
MomentumModel.update_momentum = hang
sys.argv[0] = os.path.join({repo!r}, "main_pretrain.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def test_hung_rank_times_out(data, tmp_path, jobs):
    # rank 0 next waits in the preemption all-reduce: its group must honour --dist-timeout too
    driver = tmp_path / "hang.py"
    driver.write_text(HANG.format(repo=REPO))
    job = jobs(str(driver), ["--data", data, "--epochs", 1, "--output-dir", tmp_path / "o",
                             "--dist-timeout", 5] + TINY)
    code, took = job.wait(timeout=150)
    # 5 s timeout on rank 0, then torchrun stops the hung rank
    assert code != 0 and took < EXIT_LIMIT_S, (took, job.output[-3000:])
    root = job.output.split("Root Cause")[-1]  # the first failure: rank 0, its collective timed out after 5 s
    assert re.search(r"rank\s*:\s*0 ", root) and "Timed out waiting 5000ms" in root, job.output[-3000:]


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
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
    """The same command on two torchrun 'nodes' of one rank each (node i runs args[i])."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run"] + node_of_two(node, port)
                              + [str(a) for a in node_args], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for node, node_args in enumerate(args)]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [p.returncode for p in procs], outputs


def test_preempted_node_of_two_ranks_resumes_to_the_run_of_two_nodes(labelled, tmp_path, jobs):
    """A run on one node of two ranks, preempted mid-epoch (SLURM signals every process of the step) and resumed by
    the same command, ends with the weights of an uninterrupted run on two 'nodes' of one rank, bit for bit; its
    kNN monitor (every rank its share) gives main_lincls.py --knn's number in one process; one process resumes it.
    Device-side augmentation (on CPU tensors here): its parameters come from the same per-sample stream. (The
    nodes are not the ones preempted: an agent whose rank failed, as a preempted one does, leaves without waiting
    for the other's, whose agent may then lose the rendezvous store before its summary.)"""
    common = ["--data", labelled, "--epochs", 2, "--augment", "gpu", "--knn-data", labelled, "--knn-k", 5] + TINY
    port = free_port()  # the reference, alongside
    nodes = [jobs("main_pretrain.py", common + ["--output-dir", tmp_path / "nodes"], node_of_two(node, port))
             for node in (0, 1)]
    out = tmp_path / "one"
    last = out / "checkpoint_last.pth"
    job = jobs("main_pretrain.py", common + ["--output-dir", out])
    job.wait_for("Epoch [1/2][1/3]")
    ranks = job.ranks()
    assert sorted(ranks) == [0, 1]
    for pid in ranks.values():
        os.kill(pid, signal.SIGTERM)
    code, took = job.wait()
    assert took < EXIT_LIMIT_S and code != 0
    assert "=> preempted: saved epoch 0 step" in job.output
    # torchrun exits 1; its summary shows both ranks' own code, the distinct PREEMPTED_EXIT_CODE
    codes = re.findall(r"exitcode\s*:\s*(-?\d+) ", job.output)
    assert codes == [str(PREEMPTED_EXIT_CODE)] * 2, job.output[-3000:]
    ckpt = load(last)
    assert ckpt["epoch"] == 0 and 0 < ckpt["step_in_epoch"] < 3 and ckpt["step"] == ckpt["step_in_epoch"]
    assert {"torch", "python"} <= set(ckpt["rng"]) and "queue" in ckpt["model"] and ckpt["optimizer"]["state"]

    # the same command (--resume auto) continues from that step to the end
    job = jobs("main_pretrain.py", common + ["--output-dir", out])
    code, _ = job.wait()
    assert code == 0 and "on 2 rank(s)" in job.output, job.output[-3000:]
    assert f"=> resuming from {last}: epoch 0, step {ckpt['step_in_epoch']}" in job.output
    for node in nodes:
        code, _ = node.wait()
        assert code == 0, node.output[-3000:]
    a, b = load(tmp_path / "nodes" / "checkpoint_last.pth"), load(last)
    assert a["epoch"] == b["epoch"] == 2 and a["step"] == b["step"] == 6
    assert_same_state(a["model"], b["model"])  # weights, BN buffers, queue, queue_ptr: bit for bit
    assert b["model"]["encoder.bn1.running_mean"].abs().sum() > 0
    assert_trained(tmp_path / "nodes")
    assert_trained(out)  # its log.txt: the epochs of two invocations
    monitor = json.loads(open(out / "log.txt").read().splitlines()[-1])
    main_lincls.main(["--data", labelled, "--pretrained", str(last), "--knn", "--knn-k", "5", "--crop-size", "16",
                      "--workers", "0", "--output-dir", str(tmp_path / "knn")])
    single = json.load(open(tmp_path / "knn" / "results_knn.json"))
    assert 0 < monitor["knn_top1"] < 100
    assert monitor["knn_top1"] == pytest.approx(single["acc1"]) and monitor["knn_top5"] == pytest.approx(single["acc5"])
    main_pretrain.main([str(a) for a in common] + ["--epochs", "3", "--output-dir", str(out)])  # one process resumes it
    assert load(last)["epoch"] == 3


def test_nodes_that_disagree_stop(labelled, tmp_path):
    common = ["main_pretrain.py", "--data", labelled, "--epochs", "1", "--output-dir", tmp_path / "o"] + TINY
    codes, outputs = two_nodes([common, common + ["--batch-size", "4", "--queue-size", "32"]])
    assert codes[0] != 0 and codes[1] != 0
    assert any("ranks disagree on --batch-size (rank 0: " in o for o in outputs), outputs[0][-2000:]
    assert all("Traceback" not in o.split("error: ranks disagree")[0] for o in outputs)


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


def same_trunk(a, b):
    sa, sb = trunk_state_dict(load(a)), trunk_state_dict(load(b))
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _probe_of_two_ranks(rank, ports, common, out, said):
    """Rank `rank` of two (gloo, env:// as torchrun sets it) running main_lincls.py in this process: the probe
    through (the reference), again stopped by SIGTERM on every rank during epoch 2's second step (SLURM signals each)
    and continued by the same command, then --evaluate of its checkpoint; then the probe's check of non-finite
    losses, this rank alone having noted one (rank 1, at step 4). said gets (rank, the reference's epoch lines, exit
    codes, (epoch, step) of the stopped run's checkpoint, the check's error), or (rank, the traceback) of a failure."""
    try:
        said.put((rank,) + _probe_runs(rank, ports, common, out))
    except BaseException:  # noqa: BLE001: the parent says what failed, and ends the other rank
        import traceback
        said.put((rank, traceback.format_exc()))


def _probe_runs(rank, ports, common, out):
    import torch.distributed as dist
    import torch.nn.functional as F
    from sce import UserError
    from sce.probe import stop_if_nonfinite
    torch.set_num_threads(1)
    real, calls, codes = F.cross_entropy, [0], []

    def signalling(*a, **k):  # the training loss only (validation sums)
        calls[0] += "reduction" not in k
        if calls[0] == 5 and "reduction" not in k:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)
    last = out / "run" / "checkpoint_last.pth"
    runs = [common + ["--output-dir", out / "ref"]] + [common + ["--output-dir", out / "run"]] * 2 + [
        common[:2] + common[-2:] + ["--evaluate", "--pretrained", last, "--crop-size", "16", "--workers", "0",
                                    "--output-dir", out / "evaluate"]]
    for port, argv in zip(ports, runs):
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        F.cross_entropy = signalling if len(codes) == 1 else real
        try:
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                main_lincls.main([str(a) for a in argv])
            codes.append(0)
        except SystemExit as e:
            codes.append(e.code)
        if dist.is_initialized():  # a stopped run leaves its group without the cleanup
            dist.destroy_process_group()
        if len(codes) == 1:
            reported = printed.getvalue().count("Epoch 2/2:")
        elif len(codes) == 2:
            stopped = load(str(last))
            stopped = (stopped["epoch"], stopped["step_in_epoch"])
    os.environ["MASTER_PORT"] = str(ports[4])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:  # alone, the rank of the loss would stop and the others wait in their next collective (--dist-timeout)
        stop_if_nonfinite(torch.tensor([3.0, float("nan")] if rank else [-1.0, -1.0]), 0)
        error = None
    except UserError as e:
        error = str(e)
    dist.destroy_process_group()
    return reported, codes, stopped, error


def test_the_probe_on_two_ranks_stops_mid_epoch_resumes_exactly_and_evaluates(pretrained, labelled, tmp_path):
    """Two ranks (only rank 0 reports) through, and stopped mid-epoch and continued by the same command: the same
    head and accuracy, bit for bit; --evaluate of it on two ranks reads its accuracy. A non-finite loss noted on one
    rank stops every rank. (Each rank's environment as torchrun sets it; torchrun's launch itself, and entry.run's
    error file under it, are the pretraining's tests above: the scripts share them.)"""
    import multiprocessing
    common = ["--data", labelled, "--pretrained", pretrained, "--crop-size", "16", "--epochs", "2", "--batch-size",
              "8", "--workers", "0", "--print-freq", "1", "--schedule", "cosine", "--lr", "0.5", "--warmup-epochs",
              "1", "--dist-timeout", "60"]  # 24 images: 3 steps an epoch; the lr moves each step
    context = multiprocessing.get_context("spawn")
    said, ports = context.Queue(), [free_port() for _ in range(5)]
    ranks = [context.Process(target=_probe_of_two_ranks, args=(r, ports, common, tmp_path, said)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        got = {rank: rest for rank, *rest in (said.get(timeout=240) for _ in ranks)}
    finally:  # a rank that failed leaves its peer in a collective: no test waits for it
        for p in ranks:
            p.join(10)
            if p.is_alive():
                p.kill()
    # rank 0 alone printed the epoch's line; saved after epoch 2's second step; the non-finite loss named on both
    error = "loss is nan at epoch 1 step 4: lower --lr"
    assert got == {0: [1, [0, 75, 0, 0], (1, 2), error], 1: [0, [0, 75, 0, 0], (1, 2), error]}
    a, b = (load(str(tmp_path / run / "checkpoint_last.pth")) for run in ("ref", "run"))
    assert a["epoch"] == b["epoch"] == 2 and same_trunk(pretrained, str(tmp_path / "ref" / "checkpoint_last.pth"))
    assert torch.equal(a["model"]["fc.weight"], b["model"]["fc.weight"]) and a["acc1"] == b["acc1"]
    evaluated = json.load(open(tmp_path / "evaluate" / "results_evaluate.json"))
    assert evaluated["acc1"] == pytest.approx(b["acc1"])
