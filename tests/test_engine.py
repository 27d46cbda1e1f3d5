"""The training step: the non-finite guard undoes a step exactly (SGD and LARS, mid-training), compile
keeps the checkpoint keys and the eager step's numbers, the benchmark reports what it promises, and a
resume says when it cannot restore the CUDA random state."""
import functools
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, assert_same_state, fake_compile, write_imagefolder
from sce import UserError, compiling, device_augment, losses
from sce.builder import SCE
from sce.engine import (CompileFallback, Training, check_compile, compile_model, compile_trunk, resolve_compile,
                        train_step)
from sce.optim import LARS, build_optimizer, load_optimizer_state


def make_training(optimizer="sgd", criterion=None):
    torch.manual_seed(0)
    model = SCE(criterion or functools.partial(losses.sce_loss), "resnet18", True, [32], 16, "affine",
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
        loss, finite, _ = train_step(t, views(seed), 0.9)
        assert bool(finite) and torch.isfinite(loss)
    before, buffers = snapshot(t)
    poison[0] = True
    loss, finite, _ = train_step(t, views(3), 0.9)
    assert not bool(finite) and torch.isnan(loss)
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
        loss, _, logged = train_step(t, views(0), 0.9)
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


def test_lars_matches_its_formula_over_two_steps():
    torch.manual_seed(0)
    w = torch.randn(3, 4, requires_grad=True)
    opt = LARS([{"params": [w], "weight_decay": 0.01}], lr=0.5, momentum=0.9, trust_coefficient=1e-3)
    for p in opt.state:
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    expected, buf = w.detach().clone(), torch.zeros(3, 4)
    for _ in range(2):
        grad = torch.randn(3, 4)
        w.grad = grad.clone()
        d = grad + 0.01 * expected
        buf = 0.9 * buf + 1e-3 * expected.norm() / d.norm() * d
        expected = expected - 0.5 * buf
        opt.step()
        assert torch.allclose(w.detach(), expected, atol=1e-6)


def test_old_optimizer_states_load_into_the_fused_step():
    t = make_training("lars")
    train_step(t, views(0), 0.9)
    state = t.optimizer.state_dict()
    # as the previous LARS (a plain Optimizer) saved its groups: its own keys only, weight decay among them
    state["param_groups"] = [{"params": g["params"], "lr": g["lr"], "momentum": g["momentum"],
                              "weight_decay": g["lars_weight_decay"], "trust_coefficient": g["trust_coefficient"],
                              "lars_exclude": g["lars_exclude"]} for g in state["param_groups"]]
    fresh = make_training("lars")
    load_optimizer_state(fresh.optimizer, state)
    assert [g["lars_weight_decay"] for g in fresh.optimizer.param_groups] == [1e-4, 0.0]
    assert all(g["weight_decay"] == 0.0 and g["fused"] for g in fresh.optimizer.param_groups)
    train_step(fresh, views(1), 0.9)


def test_compile_keeps_checkpoint_keys():
    t = make_training()
    keys = list(t.model.state_dict())
    compile_model(t.model)  # compiles lazily: nothing runs here
    assert list(t.model.state_dict()) == keys
    compiled = [t.model.encoder, t.model.projector, t.model.momentum_encoder, t.model.momentum_projector]
    assert all(m._compiled_call_impl is not None for m in compiled)
    assert t.model.predictor._compiled_call_impl is None  # the Identity: no parameters, no graph


def test_compile_without_a_compiler_is_one_line(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(UserError, match="--compile on CPU needs a C\\+\\+ compiler .*drop --compile"):
        check_compile(torch.device("cpu"))


def test_benchmark_reports_every_measurement(tmp_path):
    cmd = [sys.executable, "benchmarks/bench_pretrain.py", "--device", "cpu", "--workers", "0", "--arch", "resnet18",
           "--small-input", "--crop-size", "16", "--batch-size", "4", "--queue-size", "8", "--images", "8",
           "--steps", "2", "--warmup", "1", "--e2e-workers", "1", "--preload", "--image-size", "20", "--shuffle-bn",
           "--bn-splits", "2", "--lincls"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    data = {r["augment"]: r for r in lines if r["what"] == "data"}
    assert set(data) == {"cpu", "gpu", "decode"} and data["cpu"]["device_ms_per_batch"] is None
    assert all(data[a]["device_ms_per_batch"] > 0 and data[a]["device_ms_per_batch_eager"] > 0 for a in ("gpu", "decode"))
    assert all(r["loader_images_per_s"] > 0 and r["workers"] == 0 for r in data.values())
    step = [r for r in lines if r["what"] == "train_step"]
    assert len(step) == 1 and step[0]["images_per_s"] > 0 and step[0]["step_ms_without_guard"] > 0
    assert step[0]["host_step_ms"] > 0 and step[0]["criterion_ms"] > 0 and 0 < step[0]["criterion_share"] < 1
    assert -1 < step[0]["guard_share"] < 1  # the difference of two timings: noise can make it negative
    ends = {(r["augment"], r["workers"]): r for r in lines if r["what"] == "end_to_end"}
    # --e2e-workers 1: gpu and decode again with a worker process; --preload: from images kept on the device
    assert set(ends) == {("cpu", 0), ("gpu", 0), ("decode", 0), ("gpu", 1), ("decode", 1), ("preload", 0)}
    references = {r["what"]: r for r in lines if r["what"] in ("supervised_reference", "ideal_asymmetric")}
    assert len(references) == 2 and all(r["images_per_s"] > 0 for r in references.values())
    assert all(r["of_supervised_reference"] > 0 and r["of_ideal_asymmetric"] > 0 for r in step + list(ends.values()))
    assert step[0]["bn_splits"] == 2 and "x ideal_asymmetric" in proc.stdout
    assert all(r["images_per_s"] > 0 and 0 <= r["data_wait_share"] <= 1 for r in ends.values())
    assert "| end_to_end | gpu | " in proc.stdout and "workers 1, data wait" in proc.stdout
    (cached,) = [r for r in lines if r["what"] == "device_pipeline"]
    assert cached["images_per_s"] > 0 and cached["of_compute_only"] > 0
    lincls = {r["what"]: r for r in lines if r["what"] in ("forward_reference", "lincls_train", "feature_extraction")}
    assert len(lincls) == 3 and all(r["images_per_s"] > 0 for r in lincls.values())
    assert lincls["lincls_train"]["of_forward"] > 0 and lincls["feature_extraction"]["of_forward"] > 0


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
        model = SCE(losses.sce_loss, "resnet18", True, [], 16, "none", queue_size=16)
        model.encoder = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 512))
        model.momentum_encoder = copy.deepcopy(model.encoder).requires_grad_(False)
        return Training(model, model, build_optimizer("sgd", model, 0.5, 1e-4))
    compiled, eager = build(), build()
    start = {k: v.clone() for k, v in eager.model.state_dict().items()}
    compile_model(compiled.model)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed in range(2):
        loss, finite, _ = train_step(compiled, views(seed), 0.9)
        assert bool(finite) and loss.item() == pytest.approx(train_step(eager, views(seed), 0.9)[0].item(), abs=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # the compiled modules ran
    after = eager.model.state_dict()
    for key, value in compiled.model.state_dict().items():
        assert torch.allclose(value.float(), after[key].float(), atol=1e-4), key
    assert not torch.allclose(after["encoder.0.weight"], start["encoder.0.weight"])  # and they did move


@pytest.mark.parametrize("saved,gpus,note", [
    (8, 4, "=> note: checkpoint saved the CUDA random state of 8 GPUs, this run has 4: continuing, but not bit-exact"),
    (8, None, "=> note: checkpoint saved the CUDA random state of 8 GPUs, this run has none: continuing, but not "
              "bit-exact"),
    (2, 2, None), (0, None, None)])
def test_resume_notes_a_cuda_random_state_it_cannot_restore(tmp_path, monkeypatch, capsys, saved, gpus, note):
    """saved: CUDA random states in the checkpoint (one per GPU); gpus: this run's GPUs (None: no CUDA)."""
    import argparse
    from sce import checkpoint
    from sce.resume import resume, run_state
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer("sgd", model, 0.1, 0.0)
    args = argparse.Namespace(resume="auto", output_dir=str(tmp_path), batch_size=4)
    state = run_state(model, optimizer, None, args, 1, 0, 2)
    state["rng"]["cuda"] = [torch.zeros(16, dtype=torch.uint8) for _ in range(saved)]
    checkpoint.save(state, str(tmp_path))
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus is not None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus or 0)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    assert resume(args, model, optimizer, None, 0) == (1, 0, None)
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("=> note")]
    assert notes == ([note] if note else [])
    assert len(restored) == (saved == gpus)


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
    expected = [train_step(eager, views(seed), 0.9)[0] for seed in range(2)]
    rng = torch.get_rng_state()
    monkeypatch.setattr(torch.nn.Module, "compile", failing_compile(where))
    t = make_training()
    compile_model(t.model)
    step = CompileFallback(functools.partial(train_step, t), t)
    with pytest.warns(UserWarning) as caught:
        losses_ = [step(views(seed), 0.9)[0] for seed in range(2)]
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


def test_an_error_of_the_eager_step_too_is_raised_without_the_compile_warning(recwarn):
    def step(views, momentum):
        raise ValueError("not the compiler's")
    with pytest.raises(ValueError, match="not the compiler's"):
        CompileFallback(step, make_training())(views(0), 0.9)
    assert not [w for w in recwarn if "--compile" in str(w.message)]


def test_compiled_trunk_keeps_its_keys(monkeypatch):
    """main_lincls.py saves model.state_dict(): no `_orig_mod.` prefix, the keys of an eager run; the
    trunk's calls go through the compiled code (a stand-in: compiling a ResNet on CPU takes minutes)."""
    import torchvision
    trunk, calls = torchvision.models.resnet18().eval(), []
    keys = list(trunk.state_dict())
    compile_trunk(trunk)  # compiles lazily: nothing runs here
    assert list(trunk.state_dict()) == keys

    def counted(module, *args, **kwargs):
        calls.append(module)
        return module._call_impl(*args, **kwargs)
    fake_compile(monkeypatch, counted)
    with torch.no_grad():
        compile_trunk(trunk)(torch.zeros(1, 3, 32, 32))
    assert calls == [trunk]


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
    monkeypatch.setattr(device_augment, "COMPILED", {})
    monkeypatch.setattr(compiling, "SECONDS", [])
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
    names = [name for name, _ in compiling.SECONDS]
    # the Identity predictor has no graph; the weak and the strong view one each; then the monitor's
    assert sorted(names[:6]) == ["encoder", "momentum_encoder", "momentum_projector", "pretrain_view",
                                 "pretrain_view", "projector"]
    assert names[6:] == ["encoder"] and len(graphs) == 7  # nothing compiled outside them
    out = capsys.readouterr().out
    assert re.search(r"=> the kNN monitor compiled the encoder: encoder [\d.]+ s\n", out)
    assert re.search(r"=> the first step took [\d.]+ s, compiling \(each compile: pretrain_view [\d.]+ s, "
                     r"pretrain_view [\d.]+ s, momentum_encoder", out)
    assert "=> data: preloaded on cpu (0 MiB); views: on cpu, compiled; step: compiled; amp none\n" in out
    main_pretrain.main(["--data", data, "--output-dir", str(tmp_path / "off"), "--epochs", "1", "--no-compile"]
                       + CIFAR_RECIPE)
    assert len(graphs) == 7
    assert "=> data: preloaded on cpu (0 MiB); views: on cpu; step: eager; amp none\n" in capsys.readouterr().out


def test_benchmark_times_no_compile_and_reports_its_rows(tmp_path):
    """bench_pretrain.py --compile (dynamo's eager backend) on the CIFAR setting: with 1 warm-up step no graph
    compiles in a timed step (the benchmark stops if one does), and its rows come out."""
    wrapper = ("import runpy, sys, torch; real = torch.compile; "
               "torch.compile = lambda fn=None, *a, **k: real(fn, *a, **dict(k, backend='eager')); "
               "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    cmd = [sys.executable, "-c", wrapper, "benchmarks/bench_pretrain.py", "--device", "cpu", "--workers", "0",
           "--arch", "resnet18", "--small-input", "--crop-size", "16", "--batch-size", "4", "--queue-size", "8",
           "--proj-hidden-dims", "16", "--steps", "1", "--warmup", "1", "--preload", "--shuffle-bn", "--bn-splits", "2",
           "--skip-data", "--compile"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {json.loads(line)["what"] for line in proc.stdout.splitlines() if line.startswith("{")}
    assert {"train_step", "end_to_end"} <= rows
