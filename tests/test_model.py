"""Model: exact momentum copy, EMA, schedules, view pairs, queue FIFO, heads, shuffle-BN."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from sce.builder import MomentumModel, SplitBatchNorm, build_mlp, build_trunk, momentum_at, split_batch_norm
from sce.optim import cosine_lr, scheduled


def small_model(criterion=None, **kw):
    torch.manual_seed(0)
    kw = dict(dict(arch="resnet18", small_input=True, proj_hidden_dims=[32], proj_dim=16, queue_size=12), **kw)
    return MomentumModel(criterion, **kw)


def views(n=4, count=2, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, size, size, generator=g) for _ in range(count)]


def test_momentum_branch_starts_as_exact_copy():
    model = small_model()
    for a, b in zip(model.online_parameters(), model.momentum_parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr() and not b.requires_grad


def test_ema_update():
    model = small_model()
    with torch.no_grad():
        for p in model.online_parameters():
            p.add_(1.0)
    before_t = [p.clone() for p in model.momentum_parameters()]
    online = [p.clone() for p in model.online_parameters()]
    model.update_momentum(0.9)
    for t0, o, t1 in zip(before_t, online, model.momentum_parameters()):
        assert torch.allclose(t1, 0.9 * t0 + 0.1 * o, atol=1e-6)


def test_momentum_schedule():
    assert momentum_at(0, 100, 0.99) == pytest.approx(0.99)
    assert momentum_at(100, 100, 0.99) == pytest.approx(1.0)
    assert momentum_at(50, 100, 0.99) == pytest.approx(0.995)
    assert momentum_at(37, 100, 0.99, "constant") == 0.99


def test_lr_schedule_warmup_then_cosine():
    assert cosine_lr(0, 100, 1.0, warmup_steps=10) == pytest.approx(0.1)
    assert cosine_lr(9, 100, 1.0, warmup_steps=10) == pytest.approx(1.0)
    assert cosine_lr(10, 100, 1.0, warmup_steps=10) == pytest.approx(1.0)
    assert cosine_lr(55, 100, 1.0, warmup_steps=10) == pytest.approx(0.5)
    assert cosine_lr(99, 100, 1.0, 10) == pytest.approx(0.5 * (1 + math.cos(math.pi * 89 / 90)))


@pytest.mark.parametrize("symmetric,num_views,expected", [
    (False, 2, 1), (True, 2, 2), (False, 6, 5), (True, 6, 10)])
def test_pair_counts(symmetric, num_views, expected):
    pairs = small_model(symmetric=symmetric).pairs(num_views)
    assert len(pairs) == expected
    assert all(t in (0, 1) and v != t for t, v in pairs)
    if not symmetric:
        assert all(t == 0 for t, _ in pairs)


def test_symmetric_loss_is_mean_over_pairs_and_uses_pre_step_queue():
    calls = []

    def criterion(q, k, queue):
        calls.append(queue.clone())
        return q.sum() * 0 + len(calls)  # 1, 2, ..., one value per pair

    model = small_model(criterion, symmetric=True, queue_size=16)
    queue_before = model.queue.clone()
    loss, _ = model(views(4, 2) + views(4, 4, size=6, seed=1))
    assert len(calls) == 10 and loss.item() == pytest.approx(sum(range(1, 11)) / 10)
    assert all(torch.equal(c, queue_before) for c in calls)
    assert int(model.queue_ptr) == 8  # both global views enqueued: 2 x 4 keys


def test_queue_fifo_and_wraparound():
    model = small_model(queue_size=12)
    k1, k2, k3 = (torch.full((4, 16), float(i)) for i in (1, 2, 3))
    model.enqueue(k1)
    model.enqueue(k2)
    assert torch.equal(model.queue[:4], k1) and torch.equal(model.queue[4:8], k2) and int(model.queue_ptr) == 8
    model.enqueue(k3)
    assert int(model.queue_ptr) == 0
    model.enqueue(k1 * 5)
    assert torch.equal(model.queue[:4], k1 * 5) and torch.equal(model.queue[8:], k3)
    with pytest.raises(ValueError, match="multiple"):
        small_model(queue_size=10).enqueue(k1)


def test_forward_enqueues_target_keys():
    model = small_model(lambda q, k, queue: (q * k).sum())
    model.eval()
    x = views(4, 2)
    expected = model.target(x[0])
    model(x)
    assert torch.allclose(model.queue[:4], expected, atol=1e-6)


def test_heads_and_trunk_options():
    mlp = build_mlp(64, [128, 128], 32, last_bn="no-affine")
    linears = [m for m in mlp if isinstance(m, nn.Linear)]
    bns = [m for m in mlp if isinstance(m, nn.BatchNorm1d)]
    assert [l.out_features for l in linears] == [128, 128, 32] and len(bns) == 3
    assert bns[-1].weight is None and bns[0].weight is not None
    assert build_mlp(64, [], 32)[-1].bias is not None
    trunk, dim = build_trunk("resnet50", small_input=True)
    assert dim == 2048 and trunk.conv1.kernel_size == (3, 3) and trunk.conv1.stride == (1, 1)
    assert isinstance(trunk.maxpool, nn.Identity) and isinstance(trunk.fc, nn.Identity)
    with pytest.raises(ValueError, match="unknown arch"):
        build_trunk("vit_b_16")
    pred = small_model(pred_hidden_dims=[64]).predictor
    assert isinstance(pred, nn.Sequential) and pred[0].in_features == 16 and pred[-1].out_features == 16
    assert pred[-1].bias is None  # MoCo v3's predictor, as the authors'


def test_shuffle_bn_unshuffles_keys():
    model = small_model(shuffle_bn=True, bn_splits=2)
    x = views(8, 1)[0]
    model.eval()  # with frozen BN, shuffling must not change any key: only the order is tested
    shuffled = model.target(x)
    model.shuffle_bn = False
    assert torch.allclose(shuffled, model.target(x), atol=1e-6)
    model.train()
    model.shuffle_bn = True
    keys = model.target(x)  # per-split BN statistics: differs from full-batch BN
    model.shuffle_bn = False
    assert not torch.allclose(keys, model.target(x), atol=1e-4)


def test_non_finite_keys_leave_queue_unchanged():
    model = small_model(queue_size=12)
    before = model.queue.clone()
    bad = torch.full((4, 16), float("nan"))
    model.enqueue(bad)
    assert torch.equal(model.queue, before) and int(model.queue_ptr) == 4  # the slot is skipped, not poisoned


def test_split_batch_norm_is_batch_norm_per_chunk():
    torch.manual_seed(0)
    x = torch.randn(8, 3, 4, 4) * 3 + 1
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2)
        bn.bias.normal_()
    split = split_batch_norm(nn.Sequential(bn), 4)[0]
    assert isinstance(split, SplitBatchNorm) and split.state_dict().keys() == bn.state_dict().keys()
    refs = [nn.BatchNorm2d(3) for _ in range(4)]
    for ref in refs:
        ref.load_state_dict(bn.state_dict())
    expected = torch.cat([ref(chunk) for ref, chunk in zip(refs, x.chunk(4))])
    assert torch.allclose(split(x), expected, atol=1e-5)  # the statistics of each chunk of 2 images
    assert torch.allclose(split.running_mean, torch.stack([r.running_mean for r in refs]).mean(0), atol=1e-6)
    assert torch.allclose(split.running_var, torch.stack([r.running_var for r in refs]).mean(0), atol=1e-6)
    split.eval()
    refs[0].eval()
    refs[0].load_state_dict(split.state_dict())
    assert torch.allclose(split(x), refs[0](x), atol=1e-6)  # evaluation: plain BN with the running statistics
    # the authors' single-GPU runs (split_bn "momentum", the default): the momentum encoder's BN alone; the online
    # branch and both projectors normalise over the whole batch. "all": every BN layer, as that many GPUs would
    model = small_model(shuffle_bn=True, bn_splits=2)
    split = {name for name, m in model.named_modules() if isinstance(m, SplitBatchNorm)}
    bns = {name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    assert split == {name for name in bns if name.startswith("momentum_encoder.")} and split
    model = small_model(shuffle_bn=True, bn_splits=2, split_bn="all")
    assert all(not isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)) or isinstance(m, SplitBatchNorm)
               for m in model.modules())


def per_chunk_loop(bn, x, splits):
    """Split BN as a loop over the chunks (its previous implementation): the reference."""
    means = [bn.running_mean.clone() for _ in range(splits)]
    variances = [bn.running_var.clone() for _ in range(splits)]
    out = torch.cat([F.batch_norm(chunk, mean, var, bn.weight, bn.bias, True, bn.momentum, bn.eps)
                     for chunk, mean, var in zip(x.chunk(splits), means, variances)])
    with torch.no_grad():
        bn.running_mean.copy_(torch.stack(means).mean(0))
        bn.running_var.copy_(torch.stack(variances).mean(0))
    return out


@pytest.mark.parametrize("shape,channels_last", [((16, 5, 6, 7), False), ((16, 5, 6, 7), True), ((16, 5), False)])
def test_batched_split_batch_norm_equals_the_per_chunk_loop(shape, channels_last):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3 + 1
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    bn = (nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d)(shape[1])
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2)
        bn.bias.normal_()
        bn.running_mean.normal_()
    reference = copy.deepcopy(bn)
    split = SplitBatchNorm(bn, 4)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, expected = split(x1), per_chunk_loop(reference, x2, 4)
    upstream = torch.randn(shape)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    assert torch.allclose(out, expected, atol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last  # the layout goes through
    assert torch.allclose(split.running_mean, reference.running_mean, atol=1e-6)
    assert torch.allclose(split.running_var, reference.running_var, atol=1e-6)
    pairs = [(x1.grad, x2.grad), (split.weight.grad, reference.weight.grad), (split.bias.grad, reference.bias.grad)]
    for a, b in pairs:
        assert torch.allclose(a, b, atol=1e-4)


def test_lambda_schedule():
    assert scheduled(5, 10, 0.5) == 0.5  # constant
    assert scheduled(0, 11, 0.5, 1.0, "linear") == 0.5 and scheduled(10, 11, 0.5, 1.0, "linear") == 1.0
    assert scheduled(5, 11, 0.5, 1.0, "linear") == pytest.approx(0.75)
    assert scheduled(5, 11, 0.5, 1.0, "cosine") == pytest.approx(0.75) and scheduled(10, 11, 0.5, 1.0, "cosine") == 1.0
    assert scheduled(0, 11, 0.5, warmup_steps=4, warmup_start=0.0) == 0.0
    assert scheduled(2, 11, 0.5, warmup_steps=4, warmup_start=0.0) == pytest.approx(0.25)
    assert scheduled(4, 11, 0.5, 1.0, "cosine", warmup_steps=4, warmup_start=0.0) == 0.5
