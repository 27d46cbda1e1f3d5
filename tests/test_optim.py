"""LARS (against its formula) and the weight-decay exclusions."""
import torch
import torch.nn as nn

from sce.optim import LARS, build_optimizer, param_groups


def test_bias_and_norm_parameters_are_excluded():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [torch.Size([3, 4])]
    assert no_decay["weight_decay"] == 0.0 and no_decay["lars_exclude"]
    assert len(no_decay["params"]) == 3  # linear bias, BN weight and bias


def test_lars_step_matches_formula():
    torch.manual_seed(0)
    w, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, requires_grad=True)
    w0, b0 = w.detach().clone(), b.detach().clone()
    g_w, g_b = torch.randn(3, 4), torch.randn(3)
    w.grad, b.grad = g_w.clone(), g_b.clone()
    opt = LARS([{"params": [w], "weight_decay": 0.01}, {"params": [b], "weight_decay": 0.0, "lars_exclude": True}],
               lr=0.5, momentum=0.9, trust_coefficient=1e-3)
    opt.step()
    d = g_w + 0.01 * w0
    trust = 1e-3 * w0.norm() / d.norm()
    assert torch.allclose(w.detach(), w0 - 0.5 * trust * d, atol=1e-7)
    assert torch.allclose(b.detach(), b0 - 0.5 * g_b, atol=1e-7)  # excluded: plain SGD step


def test_build_optimizer_kinds():
    model = nn.Linear(3, 2)
    assert isinstance(build_optimizer("lars", model, 0.1, 1e-6), LARS)
    assert isinstance(build_optimizer("sgd", model, 0.1, 1e-6), torch.optim.SGD)


def test_weight_decay_of_biases_and_norms_follows_the_authors():
    # under SGD every parameter decays, under LARS biases and norms do not (the authors' code)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    sgd = build_optimizer("sgd", model, 0.1, 1e-4)
    assert [g["weight_decay"] for g in sgd.param_groups] == [1e-4, 1e-4]
    lars = build_optimizer("lars", model, 0.1, 1e-4)
    assert [g["lars_weight_decay"] for g in lars.param_groups] == [1e-4, 0.0]
    assert [g["lars_exclude"] for g in lars.param_groups] == [False, True]
    assert [g["weight_decay"] for g in build_optimizer("sgd", model, 0.1, 1e-4, exclude_bias_norm=True)
            .param_groups] == [1e-4, 0.0]
    # the decay really reaches a bias under SGD: zero gradient, the bias still shrinks
    torch.nn.init.ones_(model[0].bias)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    sgd.step()
    assert torch.allclose(model[0].bias, torch.full((3,), 1 - 0.1 * 1e-4))


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
