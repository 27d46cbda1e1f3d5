"""The training step: the non-finite guard undoes a step exactly (SGD and LARS, mid-training), compile
keeps the checkpoint keys, and the benchmark reports what it promises."""
import functools
import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from sce import UserError, losses
from sce.builder import SCE
from sce.engine import Training, check_compile, compile_model, train_step
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


def test_step_terms_are_those_of_its_pair_in_the_loss_precision():
    seen = []

    def terms(q, k, queue):
        seen.append((q, k, queue, torch.is_autocast_enabled("cpu")))
        return losses.loss_terms(q, k, queue)
    for amp in (None, torch.bfloat16):
        t = make_training()
        t.amp_dtype, t.terms = amp, terms
        queue = t.model.queue.clone()
        loss, _, logged = train_step(t, views(0), 0.9)
        q, k, queue_seen, autocast = seen.pop()
        assert autocast == (amp is not None) and torch.equal(queue_seen, queue)  # the queue before the keys
        if amp is None:  # one pair: the loss is eq. 9, whose terms are those of its own q, k
            expected = losses.loss_terms(q, k, queue)
            assert all(torch.equal(logged[n], expected[n]) for n in expected)
            assert loss.item() == pytest.approx(losses.sce_loss(q, k, queue).item(), rel=1e-6)


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
    compiled = [t.model.encoder, t.model.projector, t.model.predictor, t.model.momentum_encoder,
                t.model.momentum_projector]
    assert all(m._compiled_call_impl is not None for m in compiled)


def test_compile_without_a_compiler_is_one_line(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(UserError, match="--compile on CPU needs a C\\+\\+ compiler .*drop --compile"):
        check_compile(torch.device("cpu"))


def test_benchmark_reports_every_measurement(tmp_path):
    cmd = [sys.executable, "benchmarks/bench_pretrain.py", "--device", "cpu", "--workers", "0", "--arch", "resnet18",
           "--small-input", "--crop-size", "16", "--batch-size", "4", "--queue-size", "8", "--images", "8",
           "--steps", "2", "--warmup", "1", "--e2e-workers", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    data = {r["augment"]: r for r in lines if r["what"] == "data"}
    assert set(data) == {"cpu", "gpu"} and data["gpu"]["device_ms_per_batch"] > 0
    assert data["gpu"]["device_ms_per_batch_eager"] > 0 and data["cpu"]["device_ms_per_batch"] is None
    assert all(r["loader_images_per_s"] > 0 and r["workers"] == 0 for r in data.values())
    step = [r for r in lines if r["what"] == "train_step"]
    assert len(step) == 1 and step[0]["images_per_s"] > 0 and step[0]["step_ms_without_guard"] > 0
    assert step[0]["host_step_ms"] > 0
    assert -1 < step[0]["guard_share"] < 1  # the difference of two timings: noise can make it negative
    ends = {(r["augment"], r["workers"]): r for r in lines if r["what"] == "end_to_end"}
    assert set(ends) == {("cpu", 0), ("gpu", 0), ("gpu", 1)}  # --e2e-workers 1: gpu again with a worker process
    assert all(r["images_per_s"] > 0 and 0 <= r["data_wait_share"] <= 1 for r in ends.values())
    assert "| end_to_end | gpu | " in proc.stdout and "workers 1, data wait" in proc.stdout
    (cached,) = [r for r in lines if r["what"] == "device_pipeline"]
    assert cached["images_per_s"] > 0 and cached["of_compute_only"] > 0
