"""Training health (docs/health.md): a non-finite step changes nothing and is counted, too many stop the run naming
the likely cause, an epoch skipped by fp16's GradScaler goes on; a failed compile trains eagerly with one warning
(the kNN monitor's too); a crash with loader workers exits at once, leaving no process behind; loader workers are at
most the cores and end with their parent, however it dies."""
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
import torchvision

from conftest import (REPO, TINY, assert_same_state, assert_trained, exit_message, fake_compile, load, nan_losses,
                      no_triton, pretrain, write_cifar, write_imagefolder)
import main_pretrain
from sce import UserError, alive, checkpoint
from sce.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.usefixtures("in_process")  # conftest: one thread, signal handlers restored


@pytest.fixture
def models(monkeypatch):
    """The models main_pretrain builds, to inspect them after a run stops."""
    built, real = [], main_pretrain.build_model

    def recorded(*a, **k):
        built.append(real(*a, **k))
        return built[-1]
    monkeypatch.setattr(main_pretrain, "build_model", recorded)
    return built


def all_finite(state):
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_persistent_nan_stops_naming_lr_and_keeps_last_good_checkpoint(small, tmp_path, monkeypatch, models):
    # NaN from step 2 on, 2 steps per epoch: the count of consecutive non-finite steps must carry
    # over epoch boundaries, or a run with --max-nonfinite-steps >= steps per epoch never stops
    monkeypatch.setattr(main_pretrain.losses, "criterion", nan_losses(range(2, 100)))
    with pytest.raises(UserError) as err:
        pretrain(small, tmp_path, "--epochs", 4, "--max-nonfinite-steps", 2)
    message = str(err.value)
    assert "3 consecutive non-finite losses at step 3" in message and "lr (" in message
    assert "likely too high" in message and "last good checkpoint is kept" in message and "\n" not in message
    assert all_finite(models[0].state_dict())  # the skipped steps left the online and momentum weights finite
    ckpt = checkpoint.load(str(tmp_path / "checkpoint_last.pth"))
    assert ckpt["epoch"] == 1 and all_finite(ckpt["model"])


def test_transient_nan_is_skipped_and_counted(small, tmp_path, monkeypatch, models, capsys):
    monkeypatch.setattr(main_pretrain.losses, "criterion", nan_losses({2}))
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
    monkeypatch.setattr(main_pretrain.losses, "criterion", nan_losses(range(1, 100)))
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
    real = main_pretrain.losses.criterion
    monkeypatch.setattr(main_pretrain.losses, "criterion", lambda *a: lambda q, *r, **k: real(*a)(
        OverflowingGradient.apply(q), *r, **k))
    if amp == "none":
        with pytest.raises(UserError, match="every step of epoch 1"):
            pretrain(small, tmp_path, "--epochs", 1, "--max-nonfinite-steps", 100)
    else:
        pretrain(small, tmp_path, "--epochs", 1, "--max-nonfinite-steps", 100, "--amp", "fp16")
        ckpt = load(tmp_path / "checkpoint_last.pth")
        assert ckpt["epoch"] == 1 and ckpt["scaler"]["scale"] < 65536  # the scaler lowered its scale at each skip
        assert json.loads(open(tmp_path / "log.txt").read())["skipped_steps"] == 2  # both steps, as overflows


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
    one warning; the monitor runs eagerly from then on, and the training's encoder stays compiled."""
    calls = []

    def failing_in_eval(module, *args, **kwargs):
        if isinstance(module, torchvision.models.ResNet) and torch.is_grad_enabled() or not module.training:
            calls.append(module.training)  # the online encoder's calls: training, or the monitor's
        if not module.training:
            raise RuntimeError("Triton Error: out of resources")
        return module._call_impl(*args, **kwargs)
    fake_compile(monkeypatch, failing_in_eval)
    knn = write_imagefolder(tmp_path / "knn", num_classes=2, per_class=4, size=20)
    with pytest.warns(UserWarning, match=r"torch.compile of the kNN monitor's encoder failed \(Triton Error: out of "
                                         r"resources\): running it eagerly"):
        pretrain(small, tmp_path / "out", "--epochs", 2, "--compile", "--knn-data", knn, "--knn-k", "3",
                 "--knn-every", "1")
    assert all("knn_top1" in json.loads(line) for line in open(tmp_path / "out" / "log.txt").read().splitlines())
    assert calls.count(False) == 1 and True in calls[calls.index(False):]  # epoch 2 trains the compiled encoder


CRASH = """
import multiprocessing, os, signal, sys, torch
sys.path.insert(0, os.getcwd())
import main_pretrain
from sce import entry
where, sys.argv = sys.argv[1], ["main_pretrain.py"] + sys.argv[2:]

def fail(*args, **kwargs):
    print("FAILING workers", *[p.pid for p in multiprocessing.active_children()], flush=True)
    if where == "preempted":
        os.kill(os.getpid(), signal.SIGUSR1)
        return real_loss(*args, **kwargs)
    raise RuntimeError("unexpected pos") if where == "checkpoint" else RuntimeError("injected failure")

if where in ("training", "preempted"):
    real = main_pretrain.losses.criterion
    def build(*a):
        global real_loss
        real_loss = real(*a)
        return fail
    main_pretrain.losses.criterion = build
elif where == "knn":
    main_pretrain.knn.Monitor.__call__ = lambda self, model, head=None: fail()
elif where == "checkpoint":
    torch.save = fail
entry.run(main_pretrain.main)
"""


@pytest.mark.parametrize("where,code", [("training", 1), ("knn", 1), ("checkpoint", 1), ("preempted", 75)])
def test_a_crash_with_loader_workers_exits_at_once(small, tmp_path, where, code):
    args = ["--data", small, "--output-dir", tmp_path / "out", "--epochs", "2",
            "--knn-data", write_imagefolder(tmp_path / "knn", 2, 2, 20), "--knn-max-train", "4"
            ] + TINY + ["--workers", "2"]
    proc = subprocess.Popen([sys.executable, "-c", CRASH, where] + [str(a) for a in args], cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, failed = [], []
    reader = threading.Thread(target=lambda: [(lines.append(line), line.startswith("FAILING") and failed.append(
        (time.time(), [int(p) for p in line.split()[2:]]))) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        deadline = time.time() + 240
        while not failed and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert failed, "".join(lines)[-3000:]
        failed_at, workers = failed[0]
        assert workers, "the loader had no worker processes"
        returncode = proc.wait(failed_at + 30 - time.time())
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        left = [pid for pid in [proc.pid] + (failed[0][1] if failed else []) if alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    reader.join(10)
    output = "".join(lines)
    assert returncode == code, f"exit {returncode} (None: still running 30 s after the failure)\n{output[-3000:]}"
    assert not left, f"processes left running: {left}"
    if where == "checkpoint":
        assert "error: could not write checkpoint" in output and "Traceback" not in output


def children(pid):
    """The processes whose parent is `pid` (/proc)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):  # ended meanwhile
            pass
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="Linux: /proc and prctl")
def test_workers_are_capped_to_the_cores_and_end_with_their_parent(small, tmp_path):
    """--workers 64 on (at most) two cores: capped to them, with a line. Its parent killed outright (kill -9), each
    worker ends within seconds, even one stopped (SIGSTOP: as busy as can be; torch's own check of the parent, between
    batches, never comes)."""
    pinned = sorted(os.sched_getaffinity(0))[:2]
    args = ["main_pretrain.py", "--data", small, "--output-dir", tmp_path / "out", "--epochs", "1000"] + TINY + [
        "--workers", "64"]
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([sys.executable] + [str(a) for a in args], cwd=REPO, stdout=log, stderr=log,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
                                preexec_fn=lambda: os.sched_setaffinity(0, pinned))
    workers, left = [], None
    try:  # once both workers made a batch (epoch 1's 2 steps): each set itself up, its parent's death included
        deadline = time.time() + 240
        while "][2/2]" not in (tmp_path / "log").read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        workers = children(proc.pid)
        assert workers, (tmp_path / "log").read_text()[-3000:]
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        proc.kill()
        proc.wait()
        deadline = time.time() + 10
        while any(alive(pid) for pid in workers) and time.time() < deadline:
            time.sleep(0.1)
        left = [pid for pid in workers if alive(pid)]
    finally:
        for pid in [pid for pid in workers if alive(pid)]:
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
    assert not left, f"workers left running after their parent died: {left}"
    output = (tmp_path / "log").read_text()
    assert f"=> --workers 64 is more than the {len(pinned)} core(s) this process has: using {len(pinned)}\n" in output
    assert f"=> data: loader, {len(pinned)} worker(s)" in output and len(workers) == len(pinned)


STARTUP = """
import os, sys, time
sys.path.insert(0, os.getcwd())
import main_lincls, main_pretrain
from sce import entry
from sce.data import preloading
script, sys.argv = sys.argv[1], sys.argv[1:]
real = preloading._decode_all

def slow(*args, **kwargs):  # a long preload
    print("PRELOADING", flush=True)
    time.sleep(60)
    return real(*args, **kwargs)
preloading._decode_all = slow
entry.run((main_pretrain if script == "main_pretrain.py" else main_lincls).main)
"""


@pytest.mark.parametrize("script,signum", [("main_pretrain.py", signal.SIGTERM), ("main_lincls.py", signal.SIGUSR1)])
def test_a_stop_during_start_up_exits_75_with_its_line(pretrained, tmp_path, script, signum):
    """A stop signal before the training loop (here while preloading) ends the run at once: exit 75, a line saying
    nothing was saved and how to go on, and nothing half-written in its folder."""
    data = write_imagefolder(tmp_path / "data", 2, 4, 16)
    args = ["--data", data, "--output-dir", tmp_path / "out", "--preload", "device", "--workers", "0"] + (
        TINY + ["--epochs", "1"] if script == "main_pretrain.py" else ["--pretrained", pretrained])
    proc = subprocess.Popen([sys.executable, "-c", STARTUP, script] + [str(a) for a in args], cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said = []
    for line in proc.stdout:
        said.append(line)
        if line.startswith("PRELOADING"):
            proc.send_signal(signum)
            break
    said.append(proc.communicate(timeout=60)[0])
    output = "".join(said)
    assert proc.returncode == PREEMPTED_EXIT_CODE, output[-2000:]
    assert (f"=> stopped by {signal.Signals(signum).name} during start-up, before any training: nothing to save; run "
            "the same command again to start (exiting with code 75)") in output and "Traceback" not in output
    assert set(os.listdir(tmp_path / "out")) <= {".lock", "evaluated.json"}


IMPORTING = """
import os, runpy, signal, sys
signum, script, sys.argv = int(sys.argv[1]), sys.argv[2], sys.argv[2:]


class Signal:  # sends the signal as the script begins to import torch (its seconds of start-up)
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signum)
        return None


sys.meta_path.insert(0, Signal())
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.parametrize("script,signum", [("main_pretrain.py", signal.SIGTERM), ("main_lincls.py", signal.SIGUSR1),
                                           ("main_lowshot.py", signal.SIGINT)])
def test_a_stop_while_the_script_imports_exits_75_with_its_line(tmp_path, script, signum):
    """A stop signal in the first seconds, while torch imports (before sce.entry.run takes the signals over): the same
    line and exit 75, not a silent death by the signal (143, 138) or Ctrl-C's traceback."""
    proc = subprocess.run([sys.executable, "-c", IMPORTING, str(int(signum)), script, "--output-dir", str(tmp_path)],
                          cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stdout == (f"=> stopped by {signal.Signals(signum).name} during start-up, before any training: nothing "
                           "to save; run the same command again to start (exiting with code 75)\n") and not proc.stderr
    assert os.listdir(tmp_path) == []


def sends_stop_in(monkeypatch, owner, name, worker=False):
    """owner.name, the first time it is called (in a loader worker: there), sends SIGTERM to the run and then goes on:
    a stop in the phase that calls it, inside its handlers of broken files."""
    real, sent = getattr(owner, name), []

    def stopping(*args, **kwargs):
        if not sent and (torch.utils.data.get_worker_info() is not None) == worker:
            sent.append(True)
            os.kill(os.getppid() if worker else os.getpid(), signal.SIGTERM)
            time.sleep(1 if worker else 0)  # the worker's parent waits for this batch when the signal comes
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, stopping)


STOPPED = ("=> stopped by SIGTERM during start-up, before any training: nothing to save; run the same command again "
           "to start (exiting with code 75)")


@pytest.mark.parametrize("phase", ["preload0", "preload1", "cifar", "pretrained", "saving"])
def test_a_stop_in_any_phase_exits_75_and_the_rerun_equals_an_uninterrupted_one(phase, small, pretrained, tmp_path,
                                                                               monkeypatch, capsys):
    """SIGTERM while preloading opens an image (in the process or in a loader worker), while the CIFAR files are
    checked, while --pretrained is loaded or the feature cache saved: the stop's line and exit 75, never an
    unreadable image replaced, a damaged file or checkpoint blamed; the same command again runs as if never
    stopped."""
    from PIL import Image
    from sce import layouts
    if phase in ("pretrained", "saving"):
        script, args = "main_lincls.py", ["--data", write_imagefolder(tmp_path / "data", 2, 4, 16), "--pretrained",
                                          pretrained, "--classifier", "logreg", "--logreg-c", "1"]
    else:
        data = write_cifar(tmp_path / "cifar") if phase == "cifar" else small
        script, args = "main_pretrain.py", ["--data", data, "--epochs", "1", "--preload", "device"] + TINY + [
            "--workers", "1" if phase == "preload1" else "0"] + (["--dataset", "cifar10"] if phase == "cifar" else [])
    owner, name = {"preload0": (Image, "open"), "preload1": (Image, "open"), "cifar": (layouts._Batch, "load"),
                   "pretrained": (torch, "load"), "saving": (torch, "save")}[phase]
    with monkeypatch.context() as patch:
        sends_stop_in(patch, owner, name, worker=phase == "preload1")
        assert exit_message(script, *args, "--output-dir", tmp_path / "out") == PREEMPTED_EXIT_CODE
    said = capsys.readouterr()
    assert STOPPED in said.out and "warning" not in said.out and "Traceback" not in said.err, said
    for out in ("out", "whole"):  # the stopped run again, and one never stopped
        assert exit_message(script, *args, "--output-dir", tmp_path / out) is None
    if script == "main_pretrain.py":
        assert_same_state(*(load(tmp_path / out / "checkpoint_last.pth")["model"] for out in ("out", "whole")))
    else:
        rerun, whole = (json.load(open(tmp_path / out / "results_logreg.json")) for out in ("out", "whole"))
        assert rerun["test"] == whole["test"] and rerun["C"] == whole["C"]
