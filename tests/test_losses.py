"""The objectives against float64 transcriptions of the paper's equations (loops, no torch ops),
and which branch of the model their gradient reaches."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sce import losses
from sce.builder import MomentumModel


def unit_rows(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)


@pytest.fixture
def qkm():
    return unit_rows(6, 8, 0), unit_rows(6, 8, 1), unit_rows(10, 8, 2)


def candidates(k, queue, i):
    """Candidates of query i: its positive k_i, then the queue (the authors' code)."""
    return [k[i]] + list(queue)


def reference_sce(q, k, queue, lam, tau, tau_m, mask_positive):
    q, k, queue = q.numpy(), k.numpy(), queue.numpy()
    total = 0.0
    for i in range(len(q)):
        cands = candidates(k, queue, i)
        # eq. 3 on the target branch; published code: logit 0 at the positive unless masked
        target_logits = [None if mask_positive else 0.0] + [k[i] @ c / tau_m for c in cands[1:]]
        norm = sum(math.exp(v) for v in target_logits if v is not None)
        s2 = [0.0 if v is None else math.exp(v) / norm for v in target_logits]
        w2 = [lam * (j == 0) + (1 - lam) * s2[j] for j in range(len(cands))]  # eq. 7
        online = [q[i] @ c / tau for c in cands]
        log_z = math.log(sum(math.exp(v) for v in online))
        p1_log = [v - log_z for v in online]  # eq. 8
        total += -sum(w * lp for w, lp in zip(w2, p1_log))  # eq. 9
    return total / len(q)


def reference_ressl(q, k, queue, tau, tau_m):
    q, k, queue = q.numpy(), k.numpy(), queue.numpy()
    total = 0.0
    for i in range(len(q)):
        s2 = np.array([math.exp(k[i] @ c / tau_m) for c in queue])
        s2 /= s2.sum()  # eq. 3 (positive excluded)
        s1 = np.array([math.exp(q[i] @ c / tau) for c in queue])
        s1 /= s1.sum()  # eq. 2
        total += -(s2 * np.log(s1)).sum()  # eq. 4
    return total / len(q)


def reference_infonce(q, k, queue, tau):
    q, k, queue = q.numpy(), k.numpy(), queue.numpy()
    total = 0.0
    for i in range(len(q)):
        logits = [q[i] @ c / tau for c in candidates(k, queue, i)]
        total += -(logits[0] - math.log(sum(math.exp(v) for v in logits)))  # eq. 1
    return total / len(q)


def reference_ceil(q, k, queue, tau):
    q, k, queue = q.numpy(), k.numpy(), queue.numpy()
    total = 0.0
    for i in range(len(q)):
        e = [math.exp(q[i] @ c / tau) for c in candidates(k, queue, i)]
        total += -math.log(sum(e[1:]) / sum(e))  # Proposition 1
    return total / len(q)


@pytest.mark.parametrize("lam,tau,tau_m", [(0.5, 0.1, 0.07), (0.2, 0.2, 0.05), (0.9, 0.1, 0.1)])
@pytest.mark.parametrize("mask_positive", [False, True])
def test_sce_loss_matches_equations_7_to_9(qkm, lam, tau, tau_m, mask_positive):
    q, k, queue = qkm
    got = losses.sce_loss(q, k, queue, lam, tau, tau_m, mask_positive).item()
    assert got == pytest.approx(reference_sce(q, k, queue, lam, tau, tau_m, mask_positive), rel=1e-10)


def test_published_target_differs_from_masked(qkm):
    q, k, queue = qkm
    published = losses.sce_loss(q, k, queue, 0.5, 0.1, 0.07, mask_positive=False).item()
    masked = losses.sce_loss(q, k, queue, 0.5, 0.1, 0.07, mask_positive=True).item()
    assert abs(published - masked) > 1e-6


@pytest.mark.parametrize("lam", [0.0, 0.3, 0.5, 1.0])
def test_eq9_equals_eq10_under_masking(qkm, lam):
    q, k, queue = qkm
    eq9 = losses.sce_loss(q, k, queue, lam, 0.1, 0.05, mask_positive=True)
    eq10 = losses.combined_loss(q, k, queue, lam, 1 - lam, 1 - lam, 0.1, 0.05)
    assert eq9.item() == pytest.approx(eq10.item(), rel=1e-10)


def test_lambda_one_is_infonce(qkm):
    q, k, queue = qkm
    for mask in (False, True):
        assert losses.sce_loss(q, k, queue, 1.0, 0.2, 0.07, mask).item() == pytest.approx(
            losses.infonce_loss(q, k, queue, 0.2).item(), rel=1e-12)


def test_terms_match_equations(qkm):
    q, k, queue = qkm
    assert losses.infonce_loss(q, k, queue, 0.2).item() == pytest.approx(reference_infonce(q, k, queue, 0.2), rel=1e-10)
    expected = reference_ressl(q, k, queue, 0.1, 0.04)
    assert losses.ressl_loss(q, k, queue, 0.1, 0.04).item() == pytest.approx(expected, rel=1e-10)
    assert losses.ceil_loss(q, k, queue, 0.1).item() == pytest.approx(reference_ceil(q, k, queue, 0.1), rel=1e-10)
    terms = losses.loss_terms(q, k, queue, 0.1, 0.07)
    assert terms["ressl"].item() == pytest.approx(reference_ressl(q, k, queue, 0.1, 0.07), rel=1e-10)
    assert terms["infonce"].item() == pytest.approx(reference_infonce(q, k, queue, 0.1), rel=1e-10)
    assert terms["ceil"].item() == pytest.approx(reference_ceil(q, k, queue, 0.1), rel=1e-10)


def test_free_coefficients(qkm):
    q, k, queue = qkm
    got = losses.combined_loss(q, k, queue, 0.5, 0.5, 0.0, 0.1, 0.07).item()  # Table 3, eta = 0
    want = 0.5 * reference_infonce(q, k, queue, 0.1) + 0.5 * reference_ressl(q, k, queue, 0.1, 0.07)
    assert got == pytest.approx(want, rel=1e-10)


def test_each_method_is_its_record(qkm):
    """main_pretrain.py --method NAME optimises its record's loss at its defaults (MoCo v2: InfoNCE at tau 0.2; ReSSL:
    0.1 / 0.04; SCE: eq. 9 at 0.1 / 0.07, eq. 10 with --loss-coeffs), as args.loss records it, and logs eq. 10's terms
    at the same temperatures."""
    import main_pretrain
    q, k, queue = qkm
    for flags, loss, want in [([], "sce", reference_sce(q, k, queue, 0.5, 0.1, 0.07, False)),
                              (["--loss-coeffs", "0.5", "0.5", "0"], "combined",
                               0.5 * reference_infonce(q, k, queue, 0.1)
                               + 0.5 * reference_ressl(q, k, queue, 0.1, 0.07)),
                              (["--method", "moco"], "infonce", reference_infonce(q, k, queue, 0.2)),
                              (["--method", "ressl"], "ressl", reference_ressl(q, k, queue, 0.1, 0.04))]:
        args = main_pretrain.parse_args(["--data", "unread"] + flags)
        assert args.loss == loss and losses.criterion(args)(q, k, queue).item() == pytest.approx(want, rel=1e-10)
        terms = losses.logged_terms(args)(q, k, queue)
        assert list(terms) == ["infonce", "ressl", "ceil"]
        assert terms["ressl"].item() == pytest.approx(reference_ressl(q, k, queue, args.tau, args.tau_m), rel=1e-10)


def test_gradient_reaches_only_the_online_branch():
    """SCE.forward then backward: the momentum branch and the queue get no gradient, even when they
    are set to require one (target() runs under no_grad, the loss uses a detached copy of the queue)."""
    torch.manual_seed(0)
    model = MomentumModel(losses.sce_loss, "resnet18", True, [32], 16, "affine", queue_size=16)
    assert not any(p.requires_grad for p in model.momentum_parameters()) and not model.queue.requires_grad
    for p in model.momentum_parameters():
        p.requires_grad_(True)
    model.queue.requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    loss, _ = model([torch.randn(4, 3, 8, 8, generator=g) for _ in range(2)])
    loss.backward()
    assert all(p.grad is None for p in model.momentum_parameters()) and model.queue.grad is None
    for name, p in list(model.encoder.named_parameters()) + list(model.projector.named_parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_the_equations_table_points_into_the_functions_it_names():
    """docs/EQUATIONS.md's `name`, file:A-B (a file named once for the cells and rows after it): lines A to B lie in the
    function `name` (the code moves, the table must follow)."""
    import ast
    import os
    import re
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spans = {}
    for name in ("losses.py", "builder.py"):
        for node in ast.walk(ast.parse(open(os.path.join(repo, "sce", name)).read())):
            if isinstance(node, ast.FunctionDef):
                spans[name, node.name] = (node.lineno, node.end_lineno)
    checked, file = 0, None
    for row in open(os.path.join(repo, "docs", "EQUATIONS.md")):
        for name, where, first, last in re.findall(r"`([\w.]+)`,? (\w+\.py)?:(\d+)(?:-(\d+))?", row):
            file = where or file
            start, end = spans[file, name.split(".")[-1]]
            assert start <= int(first) <= int(last or first) <= end, (row, name)
            checked += 1
    assert checked >= 15
