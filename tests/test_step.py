"""The training step (sce.step.train_step, build_step): the non-finite guard undoes a step exactly (SGD and LARS,
with and without GradScaler), the loss runs in fp32 under autocast, compiling keeps the checkpoint keys and the eager
step's numbers, a compile failing at the first step falls back to the eager step exactly and a later one stops with
one line, the CUDA graph gives the eager steps' numbers (on a CPU stand-in for the capture), and what compiles when:
each module and view once, in the first step."""
import functools
import json
import re

import pytest
import torch

from conftest import Replay, assert_same_state, exit_message, fake_compile, write_imagefolder
from sce import UserError, losses
from sce.builder import MomentumModel
from sce.compiling import Log, check_compile, compile_model, compile_module, resolve_compile
from sce.cuda_graph import lr_as_tensors
from sce.step import Training, build_step, train_step
from sce.optim import build_optimizer, set_lr


def make_training(optimizer="sgd", criterion=None):
    torch.manual_seed(0)
    model = MomentumModel(criterion or functools.partial(losses.sce_loss), "resnet18", True, [32], 16, "affine",
                queue_size=16)
    return Training(model, model, build_optimizer(optimizer, model, 0.5, 1e-4))


def views(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 8, 8, generator=g) for _ in range(2)]


def snapshot(t):
    state = {k: v.clone() for k, v in t.model.state_dict().items()}
    buffers = [v.clone() for s in t.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return state, buffers


@pytest.mark.parametrize("optimizer,scaler", [("sgd", False), ("lars", False), ("sgd", True), ("lars", True)])
def test_guard_undoes_a_nonfinite_step_exactly(optimizer, scaler):
    """scaler: --amp fp16's path, where GradScaler hands its own found_inf to the fused step."""
    poison = [False]

    def criterion(q, k, queue):
        loss = losses.sce_loss(q, k, queue)
        return loss * float("nan") if poison[0] else loss
    t = make_training(optimizer, criterion)
    t.scaler = torch.amp.GradScaler("cpu") if scaler else None
    for seed in range(3):  # momentum buffers, BN statistics and the EMA are all non-trivial by now
        result = train_step(t, views(seed), 0.9)
        assert bool(result.finite) and torch.isfinite(result.loss)
    before, buffers = snapshot(t)
    poison[0] = True
    result = train_step(t, views(3), 0.9)
    assert not bool(result.finite) and torch.isnan(result.loss)
    after, buffers_after = snapshot(t)
    for key in before:  # weights and BN statistics of both branches (the queue took the finite keys)
        if not key.endswith("num_batches_tracked") and key not in ("queue", "queue_ptr"):
            assert torch.equal(before[key], after[key]), key
    assert all(torch.equal(a, b) for a, b in zip(buffers, buffers_after))
    poison[0] = False
    train_step(t, views(4), 0.9)  # and training goes on
    assert not torch.equal(before["encoder.conv1.weight"], t.model.state_dict()["encoder.conv1.weight"])


@pytest.mark.parametrize("method", ["sce", "moco", "ressl"])
def test_loss_and_terms_run_in_fp32_under_amp(method):
    """--amp bf16 covers the trunk and the heads; the criterion and the logged terms of eq. 10 get fp32
    embeddings and run with autocast off: the numbers of sce.losses' fp32 functions on those embeddings
    (under bf16 autocast the similarities would lose ~3 digits)."""
    criterion = {"sce": losses.sce_loss, "moco": losses.infonce_loss, "ressl": losses.ressl_loss}[method]
    seen = []

    def terms(q, k, queue):
        seen.append((q, k, queue, torch.is_autocast_enabled("cpu")))
        return losses.loss_terms(q, k, queue)
    for amp in (None, torch.bfloat16):
        t = make_training(criterion=criterion)
        t.amp_dtype, t.terms = amp, terms
        queue = t.model.queue.clone()
        result = train_step(t, views(0), 0.9)
        loss, logged = result.loss, result.terms
        q, k, queue_seen, autocast = seen.pop()
        assert not autocast and torch.equal(queue_seen, queue)  # the queue before the keys
        assert q.dtype == k.dtype == torch.float32
        # one pair: the loss is its criterion's, the terms those of its own q, k, all in fp32
        assert loss.item() == pytest.approx(criterion(q, k, queue).item(), rel=1e-6, abs=1e-7)
        expected = losses.loss_terms(q, k, queue)
        assert all(logged[n].item() == pytest.approx(expected[n].item(), rel=1e-6, abs=1e-7) for n in expected)


def test_first_step_skipped_leaves_zero_momentum():
    # fused SGD leaves uninitialised buffers when its first step is skipped: ours start at zero
    t = make_training("sgd", lambda q, k, queue: (q * k).sum() * float("inf"))
    train_step(t, views(0), 0.9)
    assert all(not v.any() for s in t.optimizer.state.values() for v in s.values())


def test_compile_keeps_checkpoint_keys():
    t = make_training()
    keys = list(t.model.state_dict())
    compile_model(t.model, Log())  # compiles lazily: nothing runs here
    assert list(t.model.state_dict()) == keys
    compiled = [t.model.encoder, t.model.projector, t.model.momentum_encoder, t.model.momentum_projector]
    assert all(m._compiled_call_impl is not None for m in compiled)
    assert t.model.predictor._compiled_call_impl is None  # the Identity: no parameters, no graph


def test_compile_without_a_compiler_is_one_line(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(UserError, match="--compile on CPU needs a C\\+\\+ compiler .*drop --compile"):
        check_compile(torch.device("cpu"))


def test_compiled_step_equals_the_eager_step():
    """--compile on CPU (Inductor, C++): two train_steps give the eager losses and weights. A tiny conv
    trunk stands in for the ResNet, whose compilation takes ~70 s on 2 cores (this one ~22 s, ~3 s cached)."""
    import copy
    import torch.nn as nn
    try:
        check_compile(torch.device("cpu"))
    except UserError as e:  # no C++ compiler here: what the user sees instead is one line
        assert "\n" not in str(e) and "drop --compile" in str(e)
        pytest.skip("no C++ compiler: nothing compiles here")

    def build():
        torch.manual_seed(0)
        model = MomentumModel(losses.sce_loss, "resnet18", True, [], 16, "none", queue_size=16)
        model.encoder = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 512))
        model.momentum_encoder = copy.deepcopy(model.encoder).requires_grad_(False)
        return Training(model, model, build_optimizer("sgd", model, 0.5, 1e-4))
    compiled, eager = build(), build()
    start = {k: v.clone() for k, v in eager.model.state_dict().items()}
    compile_model(compiled.model, Log())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed in range(2):
        result = train_step(compiled, views(seed), 0.9)
        assert bool(result.finite) and result.loss.item() == pytest.approx(
            train_step(eager, views(seed), 0.9).loss.item(), abs=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # the compiled modules ran
    after = eager.model.state_dict()
    for key, value in compiled.model.state_dict().items():
        assert torch.allclose(value.float(), after[key].float(), atol=1e-4), key
    assert not torch.allclose(after["encoder.0.weight"], start["encoder.0.weight"])  # and they did move


def test_compile_is_on_by_default_only_on_cuda_with_triton(monkeypatch):
    """Resolved from the device; no CUDA call: the device is a torch.device object only."""
    import importlib.util
    import main_pretrain
    cuda, cpu, triton = torch.device("cuda"), torch.device("cpu"), [True]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if triton[0] else None) if name == "triton" else find_spec(name, *a))
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: True)
    assert resolve_compile(None, cuda) and resolve_compile(True, cuda)
    assert not resolve_compile(None, cpu) and not resolve_compile(False, cuda) and not resolve_compile(False, cpu)
    triton[0] = False
    assert not resolve_compile(None, cuda)
    with pytest.raises(UserError, match="^--compile on GPU needs Triton, .*drop --compile$"):
        resolve_compile(True, cuda)
    triton[0] = True
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    assert not resolve_compile(None, cuda)
    assert [main_pretrain.parse_args(["--data", "d"] + flag).compile for flag in ([], ["--compile"], ["--no-compile"])
            ] == [None, True, False]


def failing_compile(where):
    """nn.Module.compile's stand-in: a compiled call runs the module (BN statistics move, the queue
    takes its keys, a random number is drawn), then fails as Inductor without Triton does, in the
    forward (Dynamo wraps the error: its first line is `backend='inductor' raised:`) or at the first
    backward."""
    error = RuntimeError("Cannot find a working triton installation. Either the package is not installed or ...\n"
                         "more lines")

    def inductor():
        pass

    def fail(grad):
        raise error

    def compile(self, *args, **kwargs):
        def compiled(*a, **k):
            out = self._call_impl(*a, **k)
            torch.rand(1)
            if where == "forward":
                raise torch._dynamo.exc.BackendCompilerFailed(inductor, error, None)
            if out.requires_grad:
                out.register_hook(fail)
            return out
        self._compiled_call_impl = compiled
    return compile


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failed_compile_falls_back_to_the_eager_step_exactly(monkeypatch, where):
    eager = make_training()
    expected = [train_step(eager, views(seed), 0.9).loss for seed in range(2)]
    rng = torch.get_rng_state()
    monkeypatch.setattr(torch.nn.Module, "compile", failing_compile(where))
    t = make_training()
    compile_model(t.model, Log())
    step = build_step(t, compiled=True)  # no Log given: one of its own
    with pytest.warns(UserWarning) as caught:
        losses_ = [step(views(seed), 0.9).loss for seed in range(2)]
    assert [str(w.message) for w in caught if "--compile" in str(w.message)] == [
        "--compile: torch.compile of the training step failed (Cannot find a working triton installation. Either the "
        "package is not installed or ...): running it eagerly"]
    assert step.failed.startswith("Cannot find a working triton installation")
    assert all(torch.equal(a, b) for a, b in zip(losses_, expected))
    assert_same_state(t.model.state_dict(), eager.model.state_dict())  # weights, BN statistics, queue
    assert_same_state(*({str(i): s["momentum_buffer"] for i, s in enumerate(o.state.values())}
                        for o in (t.optimizer, eager.optimizer)))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(m._compiled_call_impl is None for m in t.model.modules())


def test_an_error_of_the_eager_step_too_is_raised_without_the_compile_warning(recwarn, monkeypatch):
    def criterion(q, k, queue):
        raise ValueError("not the compiler's")
    with pytest.raises(ValueError, match="not the compiler's"):
        build_step(make_training(criterion=criterion), compiled=True, compiles=Log())(views(0), 0.9)
    assert not [w for w in recwarn if "--compile" in str(w.message)]


def test_compiled_trunk_keeps_its_keys(monkeypatch):
    """main_lincls.py saves model.state_dict(): no `_orig_mod.` prefix, the keys of an eager run; the
    trunk's calls go through the compiled code (a stand-in: compiling a ResNet on CPU takes minutes)."""
    import torchvision
    trunk, calls = torchvision.models.resnet18().eval(), []
    keys = list(trunk.state_dict())
    compile_module(trunk, "trunk", Log())  # compiles lazily: nothing runs here
    assert list(trunk.state_dict()) == keys

    def counted(module, *args, **kwargs):
        calls.append(module)
        return module._call_impl(*args, **kwargs)
    fake_compile(monkeypatch, counted)
    with torch.no_grad():
        compile_module(trunk, "trunk", Log())(torch.zeros(1, 3, 32, 32))
    assert calls == [trunk]


def training(lam):
    torch.manual_seed(0)  # the same weights, and the same shuffle-BN draws
    model = MomentumModel(functools.partial(losses.sce_loss, lambda_=lam), "resnet18", True, [32], 16, "affine",
                queue_size=16, shuffle_bn=True, bn_splits=2)
    return Training(model, model, build_optimizer("sgd", model, 0.5, 1e-4),
                    terms=functools.partial(losses.loss_terms, tau=0.1, tau_m=0.07))


def run_steps(step, t, lam, steps=5):
    out = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        views = [torch.randn(4, 3, 8, 8, generator=g) for _ in range(2)]
        set_lr(t.optimizer, 0.5 / (i + 1))
        lam.fill_(0.2 * i)
        result = step(views, 0.9 + 0.02 * i)
        out.append((result.loss.clone(), result.finite.clone(), {k: v.clone() for k, v in result.terms.items()}))
    return out


@pytest.fixture(scope="module")
def eager_steps():
    lam = torch.zeros(())
    t = training(lam)
    return run_steps(functools.partial(train_step, t), t, lam), t.model.state_dict()


@pytest.mark.parametrize("fail", [False, True])
def test_graphed_step_gives_the_eager_steps_numbers(eager_steps, fail):
    lam = torch.zeros(())
    t = training(lam)
    lr_as_tensors(t.optimizer, torch.device("cpu"))
    lrs = [g["lr"] for g in t.optimizer.param_groups]
    graphs = Replay(fail)
    step = build_step(t, graphs=graphs)  # steps 1-3 eager, step 4 captured then replayed, step 5 replayed
    if fail:
        with pytest.warns(UserWarning, match="CUDA graph capture of the training step failed .*running it eagerly"):
            graphed = run_steps(step, t, lam)
    else:
        graphed = run_steps(step, t, lam)
    assert graphs.captures == 1 and graphs.replays == (0 if fail else 2) and step.graphed != fail
    assert all(g["lr"] is lr for g, lr in zip(t.optimizer.param_groups, lrs))  # filled in place, read by the graph
    eager, state = eager_steps
    for (a, fa, ta), (b, fb, tb) in zip(eager, graphed):
        assert torch.equal(a, b) and torch.equal(fa, fb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert_same_state(state, t.model.state_dict())


# ---------------------------------------------------------------- what compiles, and when

def count_compiles(monkeypatch):
    """Every torch.compile routed to dynamo's eager backend (no code generation: seconds, not minutes, on a
    CPU), each graph it compiles counted; returns the list of their sizes."""
    graphs, real = [], torch.compile

    def backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    def compile(fn=None, *args, **kwargs):
        return real(fn, *args, **dict(kwargs, backend=backend))
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", compile)
    return graphs


CIFAR_RECIPE = ["--arch", "resnet18", "--small-input", "--crop-size", "16", "--batch-size", "8", "--queue-size", "32",
                "--shuffle-bn", "--bn-splits", "2", "--proj-hidden-dims", "32", "--proj-dim", "16", "--proj-last-bn",
                "none", "--preload", "device", "--workers", "0", "--knn-every", "0", "--print-freq", "1"]


def test_preloaded_recipe_compiles_each_graph_once_in_the_first_step(tmp_path, monkeypatch, capsys):
    """RECIPES.md's CIFAR-10 setting, preloaded, --compile: over 2 epochs every module and each view compile
    once, all in the first step (a graph compiled later is a recompile, which inside a CUDA graph's capture
    fails); the kNN monitor after the last epoch compiles the encoder in eval mode, and says so; --no-compile
    compiles nothing at all, the views included."""
    import main_pretrain
    data = write_imagefolder(tmp_path / "data", num_classes=2, per_class=8, size=20, splits=("",))
    knn = write_imagefolder(tmp_path / "knn", num_classes=2, per_class=3, size=20)
    graphs = count_compiles(monkeypatch)
    torch.set_num_threads(1)
    main_pretrain.main(["--data", data, "--output-dir", str(tmp_path / "on"), "--epochs", "2", "--compile"]
                       + CIFAR_RECIPE + ["--knn-data", knn, "--knn-every", "2"])
    out = capsys.readouterr().out
    # the Identity predictor has no graph; the weak and the strong view one each; "backward" the rest of the step
    # (the backward's compile, with a real backend); then the monitor's
    first = re.search(r"=> the first step took [\d.]+ s, compiling \(each compile: (.*)\)\n", out)[1]
    assert sorted(re.findall(r"(\w+) [\d.]+ s", first)) == ["backward", "encoder", "momentum_encoder",
                                                             "momentum_projector", "preloaded_view", "preloaded_view",
                                                             "projector"]
    assert re.search(r"=> the kNN monitor compiled the encoder: encoder [\d.]+ s\n", out)
    assert len(graphs) == 7  # nothing compiled outside them
    assert "=> data: preloaded on cpu (0 MiB); views there; step: compiled; amp none\n" in out
    main_pretrain.main(["--data", data, "--output-dir", str(tmp_path / "off"), "--epochs", "1", "--no-compile"]
                       + CIFAR_RECIPE)
    assert len(graphs) == 7
    assert "=> data: preloaded on cpu (0 MiB); views there; step: eager; amp none\n" in capsys.readouterr().out


def test_the_evaluations_compile_their_trunk_once(pretrained, tmp_path, monkeypatch, capsys, in_process):
    """main_lincls.py --compile: the probe's trunk compiles one graph for its epochs, the last partial batch (padded)
    and the validation (under no_grad, as the training's features); --knn one graph for the bank and the queries.
    Their numbers are the eager run's."""
    import main_lincls
    data = write_imagefolder(tmp_path / "data", num_classes=3, per_class=4, size=16)  # 12 images: batches 8 + 4
    common = ["--data", data, "--pretrained", pretrained, "--workers", "0", "--crop-size", "16", "--batch-size", "8"]
    graphs = count_compiles(monkeypatch)
    for extra in (["--epochs", "2", "--lr", "1"], ["--knn", "--knn-k", "3"]):
        before = len(graphs)
        for compile in ("--compile", "--no-compile"):
            main_lincls.main(common + extra + [compile, "--output-dir", str(tmp_path / (extra[0] + compile))])
        assert len(graphs) - before == 1, extra
        name = "linear" if extra[0] == "--epochs" else "knn"
        results = [json.load(open(tmp_path / (extra[0] + c) / f"results_{name}.json")) for c in ("--compile",
                                                                                                 "--no-compile")]
        assert results[0]["acc1"] == pytest.approx(results[1]["acc1"])
    # the probe's step as a CUDA graph (the CPU stand-in; captured at step 5, the first whole batch after 3 eager
    # ones) compiles no more: the steps and the validation run the trunk under one autocast state (a compiled
    # trunk's guards compare autocast's cache flag, which a capture must have off)
    torch._dynamo.reset()  # not the graph the runs above compiled
    before = len(graphs)
    monkeypatch.setattr(main_lincls, "graphs_for", lambda *a: Replay())
    main_lincls.main(common + ["--epochs", "3", "--lr", "1", "--compile", "--output-dir", str(tmp_path / "graphed")])
    assert len(graphs) - before == 1


def test_the_benchmark_runs_the_step_and_reports_its_rows(in_process, capsys, monkeypatch):
    """benchmarks/speed/bench_pretrain.py times what main_pretrain.py's loop runs each step (sce.epoch.one_step: the
    schedules, sce.step.build_step's step, the sums), global step after global step, and prints a JSON row a
    measurement: on CPU, preloaded, the step and end to end beside its two reference models."""
    from sce import epoch
    steps, one_step = [], epoch.one_step
    monkeypatch.setattr(epoch, "one_step", lambda run, step, *a: steps.append(step) or one_step(run, step, *a))
    assert exit_message("benchmarks/speed/bench_pretrain.py", "--device", "cpu", "--workers", "0", "--arch", "resnet18",
                        "--small-input", "--crop-size", "16", "--batch-size", "4", "--queue-size", "8",
                        "--proj-hidden-dims", "16", "--steps", "1", "--warmup", "1", "--preload", "--shuffle-bn",
                        "--bn-splits", "2", "--skip-data") is None
    out = capsys.readouterr().out
    rows = {json.loads(line)["what"] for line in out.splitlines() if line.startswith("{")}
    assert rows == {"train_step", "end_to_end", "supervised_reference", "ideal_asymmetric"}, out[-2000:]
    assert len(steps) >= 6 and steps == list(range(len(steps)))  # train_step's, the host's, end to end's


def test_blocks_compile_once_a_shape_and_give_the_eager_step(monkeypatch):
    """compile_model(blocks=True) (the benchmark's --compile-blocks): each residual block compiled apart with static
    shapes, one graph a block shape and branch (layer1's two blocks share theirs); dynamo's automatic dynamic shapes
    made the third block's graph symbolic, which Inductor failed to lower through split BN. The eager step's numbers
    (each pair of steps draws the same shuffle)."""
    def build():  # split BN, as RECIPES.md's small-dataset runs
        torch.manual_seed(0)
        model = MomentumModel(losses.sce_loss, "resnet18", True, [32], 16, "none", queue_size=16, shuffle_bn=True,
                              bn_splits=2)
        return Training(model, model, build_optimizer("sgd", model, 0.5, 1e-4))
    graphs, symbolic, real = [], [], torch.compile

    def backend(gm, example_inputs):  # dynamo's eager backend, each graph counted; a symbolic size noted
        graphs.append(gm)
        symbolic.extend(x for x in example_inputs if isinstance(x, torch.SymInt) or torch.is_tensor(x) and any(
            isinstance(d, torch.SymInt) for d in x.shape))
        return gm.forward
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", lambda fn=None, *a, **k: real(fn, *a, **dict(k, backend=backend)))
    compiled, eager = build(), build()
    compile_model(compiled.model, Log(), blocks=True)
    for seed in range(2):
        a, b = [(torch.manual_seed(seed), train_step(t, views(seed), 0.9))[1] for t in (compiled, eager)]
        assert torch.allclose(a.loss, b.loss, rtol=1e-5), seed
    # 7 block shapes x 2 branches (the momentum one under no_grad) and the 2 projectors; no more in the second step
    assert len(graphs) == 16 and not symbolic
    after = eager.model.state_dict()
    assert all(torch.allclose(v, after[k], atol=1e-5) for k, v in compiled.model.state_dict().items())


@pytest.mark.parametrize("failing", [1, 3])
def test_a_compile_failing_at_the_first_step_falls_back_and_later_stops_in_one_line(failing):
    """The online encoder's compile fails at training step `failing`. At the first, before any weight has moved, the
    step runs again eagerly: one step, counted once towards the CUDA graph's warm-up, so the capture still follows
    GRAPH_WARMUP steps (not the failed call's eager retry, whose cuDNN autotuning a capture would refuse). Later (a
    recompile): one line naming --no-compile."""
    import torchvision
    calls, t = [], make_training()

    def compile(self, *args, **kwargs):
        def compiled(*a, **k):
            calls.append(isinstance(self, torchvision.models.ResNet) and torch.is_grad_enabled())
            if calls[-1] and sum(calls) == failing:
                raise torch._dynamo.exc.BackendCompilerFailed(compile, RuntimeError("Triton Error: out of resources"),
                                                              None)
            return self._call_impl(*a, **k)
        self._compiled_call_impl = compiled
    real = torch.nn.Module.compile
    torch.nn.Module.compile = compile
    try:
        compile_model(t.model, Log())
    finally:
        torch.nn.Module.compile = real
    graphs, captures = Replay(), []
    step = build_step(t, compiled=True, graphs=graphs, compiles=Log())
    if failing == 1:
        with pytest.warns(UserWarning, match=r"torch.compile of the training step failed \(Triton Error: out of "):
            for seed in range(5):
                step(views(seed), 0.9)
                captures.append(graphs.captures)
        assert step.fn.failed == "Triton Error: out of resources" and captures == [0, 0, 0, 1, 1]  # after 3 eager
        return
    with pytest.raises(UserError) as err:
        for seed in range(5):
            step(views(seed), 0.9)
    assert str(err.value) == ("--compile: torch.compile of the training step failed after its first step (Triton "
                              "Error: out of resources): run again with --no-compile (it resumes)")
    assert sum(calls) == 3 and graphs.captures == 0
