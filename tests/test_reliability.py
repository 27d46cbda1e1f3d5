"""Reliability (issue 5): preemption and exact resume, crash-safe checkpoints, unreadable images,
non-finite losses, failing or hung ranks, untrusted checkpoint files.

Multi-rank cases run torchrun with 2 gloo ranks on CPU; the rest call main_pretrain.main in-process
with faults injected by monkeypatch.
"""
import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from PIL import Image

from conftest import (REPO, assert_same_state, assert_trained, fake_compile, load, nan_losses, no_triton,
                      sends_signal_at, write_imagefolder)
import main_pretrain
from sce import UserError, checkpoint
from sce.builder import SCE
from sce.datasets import build_dataset
from sce.loader import ResumableSampler

TINY = ["--arch", "resnet18", "--small-input", "--crop-size", "16", "--batch-size", "8", "--queue-size", "32",
        "--workers", "0", "--proj-hidden-dims", "32", "--proj-dim", "16", "--print-freq", "1"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
EXIT_LIMIT_S = 60  # the bound on how long stopping may take


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """32 images: 4 steps of batch 8 per epoch (torchrun runs)."""
    return write_imagefolder(tmp_path_factory.mktemp("rel") / "data", num_classes=4, per_class=8, size=20,
                             splits=("",))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """16 images: 2 steps per epoch (in-process runs)."""
    return write_imagefolder(tmp_path_factory.mktemp("rel") / "small", num_classes=2, per_class=8, size=20,
                             splits=("",))


pytestmark = pytest.mark.usefixtures("in_process")  # conftest: one thread, signal handlers restored


def pretrain(data, out, *extra):
    main_pretrain.main(["--data", data, "--output-dir", str(out)] + TINY + [str(e) for e in extra])


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


class Job:
    """A torchrun job (2 gloo ranks) whose output is read on a thread, so a test can wait for a line."""

    def __init__(self, script, args, nproc=2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               script] + [str(a) for a in args]
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

    def start(script, args):
        started.append(Job(script, args))
        return started[-1]
    yield start
    for job in started:
        if job.proc.poll() is None:
            job.kill()


# ---------------------------------------------------------------- 1. preemption and exact resume

def test_preemption_two_ranks_resumes_exactly(data, tmp_path, jobs):
    # device-side augmentation (on CPU tensors here): its parameters come from the same per-sample stream
    common = ["--data", data, "--epochs", "2", "--augment", "gpu"] + TINY
    ref = jobs("main_pretrain.py", common + ["--output-dir", tmp_path / "ref"])
    code, _ = ref.wait()
    assert code == 0, ref.output[-3000:]
    out = tmp_path / "pre"
    last = out / "checkpoint_last.pth"

    # SLURM signals every process of the step: SIGTERM to both ranks in the middle of epoch 1
    job = jobs("main_pretrain.py", common + ["--output-dir", out])
    job.wait_for("Epoch [1/2][1/4]")
    ranks = job.ranks()
    assert sorted(ranks) == [0, 1]
    for pid in ranks.values():
        os.kill(pid, signal.SIGTERM)
    code, took = job.wait()
    assert took < EXIT_LIMIT_S and code != 0
    assert "=> preempted: saved epoch 0 step" in job.output
    # torchrun exits 1; its summary shows both ranks' own code, the distinct PREEMPTED_EXIT_CODE
    codes = re.findall(r"exitcode\s*:\s*(-?\d+) ", job.output)
    assert codes == [str(main_pretrain.PREEMPTED_EXIT_CODE)] * 2, job.output[-3000:]
    ckpt = load(last)
    assert ckpt["epoch"] == 0 and 0 < ckpt["step_in_epoch"] < 4 and ckpt["step"] == ckpt["step_in_epoch"]
    assert {"torch", "python"} <= set(ckpt["rng"]) and "queue" in ckpt["model"] and ckpt["optimizer"]["state"]

    # resume (same command, --resume auto), then SIGTERM to torchrun itself: it forwards it to the ranks
    job = jobs("main_pretrain.py", common + ["--output-dir", out])
    job.wait_for("Epoch [2/2][1/4]")
    assert f"=> resuming from {last}: epoch 0, step {ckpt['step_in_epoch']}" in job.output
    job.proc.send_signal(signal.SIGTERM)
    code, took = job.wait()
    assert took < EXIT_LIMIT_S and code != 0
    assert "=> preempted: saved epoch 1 step" in job.output, job.output[-3000:]
    ckpt = load(last)
    assert ckpt["epoch"] == 1 and 0 < ckpt["step_in_epoch"] < 4

    job = jobs("main_pretrain.py", common + ["--output-dir", out])
    code, _ = job.wait()
    assert code == 0 and "=> resuming from" in job.output, job.output[-3000:]
    a, b = load(tmp_path / "ref" / "checkpoint_last.pth"), load(last)
    assert a["epoch"] == b["epoch"] == 2 and a["step"] == b["step"] == 8
    assert_same_state(a["model"], b["model"])  # weights, BN buffers, queue, queue_ptr: bit for bit
    assert int(b["model"]["queue_ptr"]) == 0 and b["model"]["encoder.bn1.running_mean"].abs().sum() > 0
    assert_trained(tmp_path / "ref")
    assert_trained(out)  # its log.txt: the epochs of three invocations


# shuffle-BN draws from the global RNG; --amp fp16 saves and resumes a GradScaler
@pytest.mark.parametrize("extra", [[], ["--shuffle-bn", "--bn-splits", "2", "--amp", "fp16"]])
def test_sigusr1_saves_mid_epoch_and_resumes_exactly(small, tmp_path, monkeypatch, extra):
    # fp16's GradScaler without its autocast: CPU fp16 convolutions have no fast kernel here (11 s a step, not
    # 0.2) and bf16 ones are ~10x slower than fp32; the scaler's state is what a resume must carry
    monkeypatch.setitem(main_pretrain.cli.AMP, "fp16", None)
    pretrain(small, tmp_path / "ref", "--epochs", 2, *extra)
    with monkeypatch.context() as m:
        m.setattr(main_pretrain, "build_criterion", sends_signal_at(signal.SIGUSR1, 3))  # epoch 1, step 0
        with pytest.raises(SystemExit) as stop:
            pretrain(small, tmp_path / "run", "--epochs", 2, *extra)
    assert stop.value.code == main_pretrain.PREEMPTED_EXIT_CODE
    ckpt = load(tmp_path / "run" / "checkpoint_last.pth")
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["step"]) == (1, 1, 3)
    assert (ckpt["scaler"] is not None) == ("fp16" in extra)
    pretrain(small, tmp_path / "run", "--epochs", 2, *extra)
    a, b = load(tmp_path / "ref" / "checkpoint_last.pth"), load(tmp_path / "run" / "checkpoint_last.pth")
    assert a["step"] == b["step"] == 4 and int(b["model"]["queue_ptr"]) == 0
    assert_same_state(a["model"], b["model"])
    assert_same_state(a["optimizer"]["state"][0], b["optimizer"]["state"][0])
    assert a["scaler"] == b["scaler"]  # scale and growth tracker: the resumed scaler counted every step


def test_stop_requests_are_checked_every_print_freq_steps(small, tmp_path, monkeypatch):
    # --print-freq 2 with 2 steps an epoch: no check after step 1 of the epoch, so the run saves at its end
    with monkeypatch.context() as m:
        m.setattr(main_pretrain, "build_criterion", sends_signal_at(signal.SIGUSR1, 3))  # epoch 1, step 0
        with pytest.raises(SystemExit) as stop:
            pretrain(small, tmp_path / "run", "--epochs", 3, "--print-freq", 2)
    assert stop.value.code == main_pretrain.PREEMPTED_EXIT_CODE
    ckpt = load(tmp_path / "run" / "checkpoint_last.pth")
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["step"]) == (2, 0, 4)
    assert_trained(tmp_path / "run")


# ---------------------------------------------------------------- 2. crash safety

def test_sigkill_while_writing_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "checkpoint_last.pth"
    good = {"kind": "pretrain", "epoch": 3, "w": torch.arange(1000.0)}
    checkpoint.save_atomic(good, str(path))
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from sce import checkpoint; "
            "checkpoint.save_atomic({'w': torch.ones(50_000_000)}, sys.argv[2])")  # 200 MB
    proc = subprocess.Popen([sys.executable, "-c", code, REPO, str(path)], env=ENV)
    tmp = tmp_path / f".checkpoint_last.pth.tmp{proc.pid}"
    deadline = time.time() + 120
    while not (tmp.exists() and tmp.stat().st_size > 0):
        assert proc.poll() is None and time.time() < deadline, "the writer never started its temporary file"
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    assert tmp.exists() and tmp.stat().st_size < 200_000_000  # killed in the middle of the write
    ckpt = checkpoint.load(str(path))
    assert ckpt.keys() == good.keys() and ckpt["epoch"] == 3 and torch.equal(ckpt["w"], good["w"])
    checkpoint.save_atomic({"epoch": 4}, str(path))  # the next write also removes the dead writer's leftover
    assert checkpoint.load(str(path)) == {"epoch": 4} and not tmp.exists()


def test_disk_full_keeps_previous_checkpoint(small, tmp_path, monkeypatch):
    out = tmp_path / "out"
    pretrain(small, out, "--epochs", 1)
    assert_trained(out)
    last = out / "checkpoint_last.pth"
    before = last.read_bytes()
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        f.write(b"PK\x03\x04 partial")  # a few bytes land, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(UserError) as err:
        pretrain(small, out, "--epochs", 2)
    message = str(err.value)
    assert "\n" not in message and f"could not write checkpoint {last}" in message
    assert "No space left on device" in message and "the previous checkpoint is kept" in message
    monkeypatch.setattr(torch, "save", real_save)
    assert last.read_bytes() == before and checkpoint.load(str(last))["epoch"] == 1
    assert not [f for f in os.listdir(out) if ".tmp" in f]


def test_keep_last_k_numbered_checkpoints(small, tmp_path):
    out = tmp_path / "out"
    pretrain(small, out, "--epochs", 3, "--save-freq", 1, "--keep-checkpoints", 2)
    assert_trained(out)
    assert sorted(f for f in os.listdir(out) if f.startswith("checkpoint_")) == [
        "checkpoint_0002.pth", "checkpoint_0003.pth", "checkpoint_last.pth"]
    assert load(out / "checkpoint_0002.pth")["epoch"] == 2 and load(out / "checkpoint_0003.pth")["epoch"] == 3


# ---------------------------------------------------------------- 3. unreadable images

@pytest.mark.parametrize("augment", ["cpu", "gpu"])
def test_unreadable_image_is_logged_once_and_replaced(tmp_path, capsys, augment):
    root = write_imagefolder(tmp_path / "data", num_classes=3, per_class=8, size=20, splits=("",))
    # palette, CMYK and 16-bit images replace three PNGs: both pipelines read them as RGB
    for name, mode in [("0.png", "P"), ("1.jpg", "CMYK"), ("3.png", "I;16")]:
        img = Image.open(os.path.join(root, "class_0", f"{name[0]}.png"))
        os.remove(os.path.join(root, "class_0", f"{name[0]}.png"))
        img = img.convert("L").point(lambda v: v * 256, "I").convert("I;16") if mode == "I;16" else img.convert(mode)
        img.save(os.path.join(root, "class_0", name))
    bad = os.path.join(root, "class_1", "2.png")
    with open(bad, "rb") as f:
        head = f.read(200)
    with open(bad, "wb") as f:  # a truncated download
        f.write(head)
    with open(os.path.join(root, "class_1", "notes.txt"), "w") as f:
        f.write("not an image")
    os.makedirs(os.path.join(root, "class_empty"))
    pretrain(root, tmp_path / "ok", "--epochs", 2, "--augment", augment)  # default budget: 0.1% of 24 images, at least 1
    stdout = capsys.readouterr().out
    warnings = [line for line in stdout.splitlines() if line.startswith("warning: skipping unreadable image")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: skipping unreadable image {bad} (")
    assert load(tmp_path / "ok" / "checkpoint_last.pth")["step"] == 6  # every batch full: replaced, not dropped
    assert_trained(tmp_path / "ok")
    with pytest.raises(UserError, match=r"1 unreadable images, more than --max-bad-images 0"):
        pretrain(root, tmp_path / "strict", "--epochs", 1, "--max-bad-images", 0)


# ---------------------------------------------------------------- 4. non-finite losses

@pytest.fixture
def models(monkeypatch):
    """The SCE models main_pretrain builds, to inspect them after a run stops."""
    built = []

    class Recorded(SCE):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            built.append(self)
    monkeypatch.setattr(main_pretrain, "SCE", Recorded)
    return built


def all_finite(state):
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_persistent_nan_stops_naming_lr_and_keeps_last_good_checkpoint(small, tmp_path, monkeypatch, models):
    # NaN from step 2 on, 2 steps per epoch: the count of consecutive non-finite steps must carry
    # over epoch boundaries, or a run with --max-nonfinite-steps >= steps per epoch never stops
    monkeypatch.setattr(main_pretrain, "build_criterion", nan_losses(range(2, 100)))
    with pytest.raises(UserError) as err:
        pretrain(small, tmp_path, "--epochs", 4, "--max-nonfinite-steps", 2)
    message = str(err.value)
    assert "3 consecutive non-finite losses at step 3" in message and "lr (" in message
    assert "likely too high" in message and "last good checkpoint is kept" in message and "\n" not in message
    assert all_finite(models[0].state_dict())  # the skipped steps left the online and momentum weights finite
    ckpt = checkpoint.load(str(tmp_path / "checkpoint_last.pth"))
    assert ckpt["epoch"] == 1 and all_finite(ckpt["model"])


def test_transient_nan_is_skipped_and_counted(small, tmp_path, monkeypatch, models, capsys):
    monkeypatch.setattr(main_pretrain, "build_criterion", nan_losses({2}))
    pretrain(small, tmp_path, "--epochs", 2, "--max-nonfinite-steps", 1)
    ckpt = load(tmp_path / "checkpoint_last.pth")
    assert ckpt["epoch"] == 2 and all_finite(ckpt["model"]) and all_finite(models[0].state_dict())
    lines = re.findall(r"\] loss (\S+) .* skipped (\d+) eta", capsys.readouterr().out)  # --print-freq 1
    assert [skipped for _, skipped in lines] == ["0", "1", "0", "0"]
    assert lines[1][0] == "nan" and all(float(loss) > 0 for loss, _ in lines[::2])  # no finite step: NaN, not 0
    epochs = [json.loads(line) for line in open(tmp_path / "log.txt")]
    assert [e["skipped_steps"] for e in epochs] == [1, 0] and all(e["loss"] > 0 for e in epochs)


def test_an_epoch_of_non_finite_steps_changes_nothing_and_stops(small, tmp_path, monkeypatch, models, capsys):
    # every loss NaN: the steps are undone exactly, so weights and BN statistics of both branches
    # stay those of initialisation and the optimizer's buffers stay zero; the run stops after the
    # epoch, whatever --max-nonfinite-steps says, and writes no checkpoint of it
    monkeypatch.setattr(main_pretrain, "build_criterion", nan_losses(range(1, 100)))
    initial, optimizers = {}, []
    real_init = main_pretrain.build_optimizer

    def record(name, model, *a, **k):
        initial.update({n: t.detach().clone() for n, t in model.state_dict().items()})
        optimizers.append(real_init(name, model, *a, **k))
        return optimizers[-1]
    monkeypatch.setattr(main_pretrain, "build_optimizer", record)
    with pytest.raises(UserError) as err:
        pretrain(small, tmp_path, "--epochs", 2, "--max-nonfinite-steps", 100)
    message = str(err.value)
    assert "every step of epoch 1 (2 steps) had a non-finite loss and was skipped" in message and "\n" not in message
    assert "likely too high" in message and "last good checkpoint is kept" in message
    assert not (tmp_path / "checkpoint_last.pth").exists()
    assert re.findall(r"\] loss (\S+) .* skipped (\d+) eta", capsys.readouterr().out) == [("nan", "1")] * 2
    for name, value in models[0].state_dict().items():
        if name not in ("queue", "queue_ptr") and not name.endswith("num_batches_tracked"):
            assert torch.equal(value, initial[name]), name
    buffers = [v for state in optimizers[0].state.values() for v in state.values() if torch.is_tensor(v)]
    assert buffers and all(not b.any() for b in buffers)


class OverflowingGradient(torch.autograd.Function):
    """Identity forward, infinite gradient: a finite loss whose gradients overflow, as fp16's can."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


@pytest.mark.parametrize("amp", ["none", "fp16"])
def test_an_epoch_skipped_by_gradscaler_goes_on(small, tmp_path, monkeypatch, amp):
    # every step's gradients overflow while its loss is finite: with fp16's GradScaler that is the scaler
    # lowering its scale, left to --max-nonfinite-steps; without one, the epoch stops the run
    monkeypatch.setitem(main_pretrain.cli.AMP, "fp16", None)  # the scaler, without CPU fp16 / bf16 slowness
    real = main_pretrain.build_criterion
    monkeypatch.setattr(main_pretrain, "build_criterion", lambda *a: lambda q, *r, **k: real(*a)(
        OverflowingGradient.apply(q), *r, **k))
    if amp == "none":
        with pytest.raises(UserError, match="every step of epoch 1"):
            pretrain(small, tmp_path, "--epochs", 1, "--max-nonfinite-steps", 100)
    else:
        pretrain(small, tmp_path, "--epochs", 1, "--max-nonfinite-steps", 100, "--amp", "fp16")
        ckpt = load(tmp_path / "checkpoint_last.pth")
        assert ckpt["epoch"] == 1 and ckpt["scaler"]["scale"] < 65536  # the scaler lowered its scale at each skip
        assert json.loads(open(tmp_path / "log.txt").read())["skipped_steps"] == 2  # both steps, as overflows


# ---------------------------------------------------------------- 5. a failing or hung rank

def first_image_of(rank, root, world=2, batch=8):
    """An image that only `rank` reads in the first step."""
    ds = build_dataset("imagefolder", root, "pretrain")
    slices = []
    for r in range(world):
        sampler = ResumableSampler(len(ds), batch, r, world, seed=0)
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
from sce.builder import SCE
update, calls = SCE.update_momentum, [0]
def hang(self, *args):  # rank 1 stops responding after its step-2 gradients were averaged
    calls[0] += 1
    if os.environ["RANK"] == "1" and calls[0] == 2:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's SIGTERM ends it: no 30 s wait for its SIGKILL
        time.sleep(3600)
    return update(self, *args)
SCE.update_momentum = hang
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
    assert "Timed out" in job.output or "timeout" in job.output.lower()


# ---------------------------------------------------------------- 6. untrusted files

class Payload:
    """Unpickling this runs open(marker, 'w'): what a malicious checkpoint could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_checkpoint_load_runs_no_code(small, tmp_path):
    marker, evil = tmp_path / "pwned", tmp_path / "checkpoint_last.pth"
    torch.save({"kind": "pretrain", "epoch": 1, "payload": Payload(str(marker))}, evil)
    with pytest.raises(UserError, match="is not a readable PyTorch checkpoint") as err:
        checkpoint.load(str(evil))
    assert "\n" not in str(err.value) and not marker.exists()
    with pytest.raises(UserError, match="is not a readable PyTorch checkpoint"):
        pretrain(small, tmp_path, "--epochs", 1)  # --resume auto picks it up
    assert not marker.exists()
    torch.load(evil, weights_only=False)  # the payload is live: full unpickling would run it
    assert marker.exists()


# ---------------------------------------------------------------- 7. a failed compile

def test_a_failed_compile_trains_eagerly_with_one_warning(small, tmp_path, monkeypatch, capsys):
    """--compile where the compiler fails at the first call (Inductor without Triton, say): one warning
    naming the cause, the progress says so, and the run trains and saves its usual checkpoint."""
    fake_compile(monkeypatch, no_triton)
    with pytest.warns(UserWarning) as caught:
        pretrain(small, tmp_path, "--epochs", 1, "--compile")
    assert [str(w.message) for w in caught if "--compile" in str(w.message)] == [
        "--compile: torch.compile of the training step failed (Cannot find a working triton installation): "
        "running it eagerly"]
    assert "=> compiling failed (Cannot find a working triton installation): eager steps" in capsys.readouterr().out
    assert_trained(tmp_path)
    ckpt = load(tmp_path / "checkpoint_last.pth")
    assert ckpt["args"]["compile"] is True and not [k for k in ckpt["model"] if "_orig_mod" in k]


def test_a_failed_compile_of_the_knn_monitor_runs_it_eagerly(small, tmp_path, monkeypatch):
    """The compiled encoder compiles again for the kNN monitor (eval mode): a failure there only costs
    one warning; the monitor runs eagerly and the run goes on."""
    def failing_in_eval(module, *args, **kwargs):
        if not module.training:
            raise RuntimeError("Triton Error: out of resources")
        return module._call_impl(*args, **kwargs)
    fake_compile(monkeypatch, failing_in_eval)
    knn = write_imagefolder(tmp_path / "knn", num_classes=2, per_class=4, size=20)
    with pytest.warns(UserWarning, match=r"the kNN monitor's compile failed \(Triton Error: out of resources\)"):
        pretrain(small, tmp_path / "out", "--epochs", 1, "--compile", "--knn-data", knn, "--knn-k", "3")
    assert "knn_top1" in json.loads(open(tmp_path / "out" / "log.txt").read().splitlines()[-1])
