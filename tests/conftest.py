"""Shared test helpers: small datasets written in the real formats, script runners, and the check that a
pretraining run learned."""
import contextlib
import fcntl
import json
import math
import multiprocessing
import os
import pathlib
import runpy
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from sce import entry  # noqa: E402

entry.EXIT_AT_ONCE = False  # the scripts run in this process too (exit_message): leave it to pytest
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # a core a worker (pytest.ini: -n auto); two threads on a busy core run ~10x slower


def pytest_xdist_auto_num_workers(config):
    """-n auto: a worker a core, at most 4 (a multi-rank test starts three processes)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


# the tests that take 10 s or more (pytest --durations), slowest first: started first, and their modules before the
# others, no worker is left alone with one of them at the end of the run (a module's tests stay together)
SLOW_FIRST = ["test_smoke_run_stopped_and_continued",
              "test_preempted_node_of_two_ranks_resumes_to_the_run_of_two_nodes",
              "test_two_gloo_ranks_equal_one_process", "test_train_torchvision_under_torchrun_two_processes",
              "test_two_runs_in_one_process_behave_as_two_processes", "test_hung_rank_times_out",
              "test_the_probe_on_two_ranks_stops_mid_epoch_resumes_exactly_and_evaluates",
              "test_preloaded_recipe_compiles_each_graph_once_in_the_first_step",
              "test_proxies_smoke_then_read_back_and_the_time_limit",
              "test_rank_that_raises_stops_the_job_and_is_named",
              "test_killed_rank_stops_the_job", "test_gpu_augment_run_lowers_the_loss", "test_nodes_that_disagree_stop",
              "test_disk_full_keeps_previous_checkpoint", "test_a_crash_with_loader_workers_exits_at_once",
              "test_refuses_bad_checkpoints", "test_the_evaluations_compile_their_trunk_once"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    of_test = {item: rank.get(item.originalname, len(rank)) for item in items}
    of_module = {}
    for item, r in of_test.items():
        of_module[item.module] = min(r, of_module.get(item.module, r))
    items.sort(key=lambda item: (of_module[item.module], of_test[item]))  # stable: the rest keep their order


# main_pretrain.py's smallest useful setting: a ResNet-18 with a 32-wide head on 16 px crops, batches of 8
TINY = ["--arch", "resnet18", "--small-input", "--crop-size", "16", "--batch-size", "8", "--queue-size", "32",
        "--workers", "0", "--proj-hidden-dims", "32", "--proj-dim", "16", "--print-freq", "1"]


def class_image(label, rng, size=32):
    """A noisy image whose colour and stripe orientation depend on the class: linearly separable."""
    base = np.zeros((size, size, 3), np.float32)
    base[..., label % 3] = 180
    if (label // 3) % 2:
        base[::4] += 60
    else:
        base[:, ::4] += 60
    return np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)


def write_imagefolder(root, num_classes=3, per_class=8, size=32, splits=("train", "val"), seed=0):
    """root/<split>/class_<c>/<i>.png with class-dependent pictures; returns root."""
    rng = np.random.default_rng(seed)
    for split in splits:
        for c in range(num_classes):
            folder = os.path.join(root, split, f"class_{c}") if split else os.path.join(root, f"class_{c}")
            os.makedirs(folder, exist_ok=True)
            for i in range(per_class):
                Image.fromarray(class_image(c, rng, size)).save(os.path.join(folder, f"{i}.png"))
    return str(root)


def python2_pickle(obj):
    """`obj` pickled as the CIFAR release's files were (Python 2's cPickle, protocol 2, numpy 1): str as Python 2
    byte strings, uint8 arrays through numpy.core.multiarray._reconstruct; of dicts, lists, ints, str and arrays."""
    out = [b"\x80\x02"]

    def string(text):  # a Python 2 str
        raw = text if isinstance(text, bytes) else text.encode("latin1")
        out.append(b"U" + bytes([len(raw)]) + raw if len(raw) < 256 else b"T" + struct.pack("<i", len(raw)) + raw)

    def save(x):
        if isinstance(x, dict):
            out.append(b"}(")
            for key, value in x.items():
                string(key)
                save(value)
            out.append(b"u")
        elif isinstance(x, list):
            out.append(b"](")
            for value in x:
                save(value)
            out.append(b"e")
        elif isinstance(x, (str, bytes)):
            string(x)
        elif isinstance(x, np.ndarray):
            assert x.dtype == np.uint8
            out.append(b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85")
            string("b")
            out.append(b"\x87R(K\x01(" + b"".join(b"J" + struct.pack("<i", n) for n in x.shape) + b"tcnumpy\ndtype\n")
            string("u1")
            out.append(b"K\x00K\x01\x87R(K\x03")
            string("|")
            out.append(b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89")
            string(np.ascontiguousarray(x).tobytes())
            out.append(b"tb")
        else:
            out.append(b"J" + struct.pack("<i", int(x)))
    save(obj)
    return b"".join(out + [b"."])


def write_cifar(root, num_classes=10, per_batch=4, seed=0):
    """CIFAR python batches in the release's layout and format (cifar-10-batches-py/ or cifar-100-python/ under root,
    python2_pickle), with its meta file, `per_batch` images a batch file; returns the folder."""
    rng = np.random.default_rng(seed)
    folder, names, key, meta = (("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"],
                                 "labels", ("batches.meta", "label_names")) if num_classes == 10 else
                                ("cifar-100-python", ["train", "test"], "fine_labels", ("meta", "fine_label_names")))
    os.makedirs(os.path.join(root, folder))
    for name in names:
        with open(os.path.join(root, folder, name), "wb") as f:
            f.write(python2_pickle({"batch_label": name, key: [i % num_classes for i in range(per_batch)],
                                    "data": rng.integers(0, 255, (per_batch, 3072), dtype=np.uint8)}))
    with open(os.path.join(root, folder, meta[0]), "wb") as f:
        f.write(python2_pickle({meta[1]: [f"class{i}" for i in range(num_classes)]}))
    return pathlib.Path(root, folder)


def write_stl10(root, train=8, test=4, unlabeled=8, seed=0):
    """STL10's binaries (stl10_binary/ under root): 3x96x96 uint8 images stored column-major, labels 1-10."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "stl10_binary")
    os.makedirs(folder)
    for split, n in [("train", train), ("test", test), ("unlabeled", unlabeled)]:
        rng.integers(0, 255, n * 3 * 96 * 96, dtype=np.uint8).tofile(os.path.join(folder, f"{split}_X.bin"))
        if split != "unlabeled":
            (np.arange(n) % 10 + 1).astype(np.uint8).tofile(os.path.join(folder, f"{split}_y.bin"))
    return folder


def write_tiny_imagenet(root, per_class=8,
                        val=((1, "n02"), (2, "n03"), (2, "n03"), (1, "n02"), (2, "n02"), (1, "n03"))):
    """Tiny-ImageNet's layout: train/<wnid>/images/*.JPEG, val/images/*.JPEG and val/val_annotations.txt
    (file, wnid, box); val: (class pictured, wnid annotated), the last two wrong, so that kNN is not 100%.
    No val image of the first class: a reader that labels val by folder gets 0s."""
    rng = np.random.default_rng(0)
    for c, wnid in enumerate(["n01", "n02", "n03"]):
        os.makedirs(os.path.join(root, "train", wnid, "images"))
        for i in range(per_class):
            Image.fromarray(class_image(c, rng, 16)).save(os.path.join(root, "train", wnid, "images",
                                                                         f"{wnid}_{i}.JPEG"), quality=95)
    os.makedirs(os.path.join(root, "val", "images"))
    with open(os.path.join(root, "val", "val_annotations.txt"), "w") as f:
        for i, (pictured, wnid) in enumerate(val):
            Image.fromarray(class_image(pictured, rng, 16)).save(
                os.path.join(root, "val", "images", f"val_{i}.JPEG"), quality=95)
            f.write(f"val_{i}.JPEG\t{wnid}\t0\t0\t10\t10\n")
    return str(root)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_state(a, b):
    """Every tensor equal, bit for bit."""
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def assert_trained(output_dir):
    """A main_pretrain.py run in output_dir learned: no epoch of log.txt skipped a step as non-finite
    and every epoch's loss is finite; the online trunk turned away from the momentum one (equal at the
    start; a run whose every step was skipped leaves them equal, and one whose gradients are zero only
    shrinks both by weight decay: the same direction); over several epochs the mean loss moved. A loss
    broken to NaN, to a constant or to zero gradients fails here."""
    with open(os.path.join(output_dir, "log.txt")) as f:
        epochs = [json.loads(line) for line in f]
    assert epochs and all(e["skipped_steps"] == 0 and math.isfinite(e["loss"]) for e in epochs), epochs
    state = load(os.path.join(output_dir, "checkpoint_last.pth"))["model"]
    online, momentum = (state[f"{branch}.conv1.weight"].double().flatten() for branch in ("encoder",
                                                                                         "momentum_encoder"))
    assert (online / online.norm() - momentum / momentum.norm()).norm() > 1e-6, "the trunk did not turn"
    if len(epochs) > 1:
        assert epochs[0]["loss"] != epochs[-1]["loss"], epochs


def loss_hook(hook):
    """A sce.losses.criterion whose loss goes through hook(call, loss), call counting the criterion's
    calls from 1 (one a step in an asymmetric run): a fault injected at a known step."""
    import main_pretrain
    real, calls = main_pretrain.losses.criterion, [0]

    def build(args, *rest):
        criterion = real(args, *rest)

        def loss(*a, **k):
            calls[0] += 1
            return hook(calls[0], criterion(*a, **k))
        return loss
    return build


def sends_signal_at(signum, step):
    """The loss sends `signum` to this process during step `step`: a preemption, for in-process resume tests."""
    return loss_hook(lambda call, loss: os.kill(os.getpid(), signum) or loss if call == step else loss)


class SendsWhenDeleted:
    """An object whose finalizer sends `signum` to this process: the handler's raise lands there and Python drops
    it (what a DataLoader iterator's teardown, an at-fork hook, did to the stops of issue 61)."""

    def __init__(self, signum):
        self.signum = signum

    def __del__(self):
        os.kill(os.getpid(), self.signum)


def nan_losses(steps):
    """The loss is NaN at the given steps."""
    return loss_hook(lambda call, loss: loss * float("nan") if call in steps else loss)


def assert_mid_epoch_resume_is_exact(args, tmp_path, monkeypatch, signal_step=3):
    """main_pretrain.main(args) run through, and again stopped by SIGUSR1 during step `signal_step`
    (1-based; with 2 steps an epoch, 3 is epoch 1's first) then resumed: both end with the same
    model, bit for bit, and the reference learned. Returns the reference run's folder."""
    import signal
    import main_pretrain
    main_pretrain.main(args + ["--output-dir", str(tmp_path / "ref")])
    with monkeypatch.context() as m:
        m.setattr(main_pretrain.losses, "criterion", sends_signal_at(signal.SIGUSR1, signal_step))
        with pytest.raises(SystemExit):
            main_pretrain.main(args + ["--output-dir", str(tmp_path / "run")])
    stopped = load(tmp_path / "run" / "checkpoint_last.pth")
    assert stopped["step"] == signal_step and stopped["step_in_epoch"] > 0  # saved within the epoch
    main_pretrain.main(args + ["--output-dir", str(tmp_path / "run")])
    a, b = load(tmp_path / "ref" / "checkpoint_last.pth"), load(tmp_path / "run" / "checkpoint_last.pth")
    assert a["step"] == b["step"] > signal_step
    assert_same_state(a["model"], b["model"])
    assert_trained(tmp_path / "ref")
    return tmp_path / "ref"


class Replay:
    """A CPU stand-in for CudaGraphs: 'capture' runs nothing, 'replay' runs the captured function again
    on the same static inputs (what a CUDA graph does with them). It re-runs the function's Python, so a value
    read in Python at each call (a param group's float lr) is fresh here but would be frozen in a real graph:
    the tests check that such values are device tensors; benchmarks/checks/check_graph.py checks the real graph."""

    def __init__(self, fail=False):
        self.fail, self.captures, self.replays = fail, 0, 0

    def eager(self, fn, *args):
        return fn(*args)

    def capture(self, fn):
        self.captures += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        out = []

        def replay():
            self.replays += 1
            out.append(fn())
        return replay, lambda: out[-1]


def fake_compile(monkeypatch, compiled_call):
    """nn.Module.compile replaced by a stand-in whose compiled call of a module is compiled_call(module,
    *args, **kwargs): raise there to play a compiler's failure; module._call_impl runs the module eagerly."""
    def compile(module, *args, **kwargs):
        module._compiled_call_impl = lambda *a, **k: compiled_call(module, *a, **k)
    monkeypatch.setattr(torch.nn.Module, "compile", compile)


def no_triton(module, *args, **kwargs):
    """A compiled call failing as Inductor does without Triton (for fake_compile)."""
    raise RuntimeError("Cannot find a working triton installation")


def run_script(args, cwd=REPO, timeout=300, env=None, check=True, threads=1):
    """Run `python <args>` (or `torchrun` when args[0] == 'torchrun') from the repo root, with `threads` intra-op
    threads a process (2: a lone process takes both cores)."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), **(env or {}))
    if args[0] == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run"] + args[1:]
    else:
        cmd = [sys.executable] + args
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def exit_message(script, *args):
    """Run a script's __main__ in this process (saves a torch import) and return what it passed to sys.exit (None
    when it ended normally): the scripts turn a UserError into sys.exit("error: ..."), a one-line message and exit
    status 1 with no traceback."""
    argv, path = sys.argv, list(sys.path)
    sys.argv = [script] + [str(a) for a in args]
    try:
        runpy.run_path(os.path.join(REPO, script), run_name="__main__")
    except SystemExit as e:
        return e.code
    finally:
        sys.argv, sys.path[:] = argv, path
    return None


@contextlib.contextmanager
def script_in_process():
    """For running the scripts in this process: one intra-op thread like the subprocesses (two on 2 busy cores run
    ~10x slower), pytest's signal handlers back after a pretraining run installed the preemption ones, and the
    workers of a loader stopped by an error ended (its iterator waits for the garbage collector, whose shutdown
    then joins each worker for 5 s)."""
    stops = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    threads, saved = torch.get_num_threads(), {s: signal.getsignal(s) for s in stops}
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        for s, handler in saved.items():
            signal.signal(s, handler)
        workers = multiprocessing.active_children()
        torch_handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # it would raise "worker killed" in a later test
        for p in workers:
            p.kill()
        for p in workers:
            p.join(10)
        signal.signal(signal.SIGCHLD, torch_handler)


@pytest.fixture
def in_process():
    """A test that runs the scripts in this process (script_in_process)."""
    with script_in_process():
        yield


@pytest.fixture
def imagefolder(tmp_path):
    return write_imagefolder(tmp_path / "data")


@pytest.fixture(scope="session")
def small(tmp_path_factory):
    """16 images of 2 classes, 20 px, no splits: 2 steps of TINY's batch an epoch."""
    return write_imagefolder(tmp_path_factory.mktemp("small") / "small", num_classes=2, per_class=8, size=20,
                             splits=("",))


def pretrain(data, out, *extra):
    """main_pretrain.main in this process: TINY on `data` into `out`, 1 epoch unless `extra` says otherwise."""
    import main_pretrain
    main_pretrain.main(["--data", data, "--output-dir", str(out), "--epochs", "1"] + TINY + [str(e) for e in extra])


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory):
    """OUT/checkpoint_last.pth of one tiny main_pretrain.py run, shared by the evaluation tests (made once for all
    pytest-xdist workers: the first to take the lock runs it)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the folder above each worker's own
    out, ckpt = shared / "pretrain_out", shared / "pretrain_out" / "checkpoint_last.pth"
    with open(shared / "pretrain.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ckpt.exists():
            data = write_imagefolder(shared / "pretrain_data", 3, 8, 32)
            import main_pretrain
            with script_in_process():
                main_pretrain.main(["--data", data, "--arch", "resnet18", "--small-input", "--crop-size", "32",
                                    "--epochs", "1", "--batch-size", "16", "--queue-size", "64", "--workers", "0",
                                    "--output-dir", str(out)])
    return str(ckpt)
