"""The model of SCE and its baselines: an online and a momentum ResNet with heads, the queue, and the loss
averaged over the (target view, query view) pairs of a step."""
import copy
import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

from sce import distributed as du

ARCHS = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d",
         "resnext101_32x8d", "wide_resnet50_2", "wide_resnet101_2"]


def build_trunk(arch, small_input=False):
    """A torchvision ResNet without its fc layer; returns (trunk, feature dim).

    small_input: conv1 3x3 stride 1 and no max-pool, for 32-96 px images (paper, supp.).
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch '{arch}': use one of {', '.join(ARCHS)}")
    trunk = getattr(torchvision.models, arch)(weights=None)
    feat_dim = trunk.fc.in_features
    trunk.fc = nn.Identity()
    if small_input:
        trunk.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        trunk.maxpool = nn.Identity()
    return trunk, feat_dim


def build_mlp(in_dim, hidden_dims, out_dim, last_bn="none", last_bias=True):
    """Linear-BN-ReLU for each hidden layer, then Linear (+ BN when last_bn is 'affine' or
    'no-affine'; MoCo v3's projector uses an affine-free last BN). The last Linear has a bias only without
    a BN after it, and when last_bias."""
    layers, dim = [], in_dim
    for hidden in hidden_dims:
        layers += [nn.Linear(dim, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True)]
        dim = hidden
    layers.append(nn.Linear(dim, out_dim, bias=last_bias and last_bn == "none"))
    if last_bn != "none":
        layers.append(nn.BatchNorm1d(out_dim, affine=last_bn == "affine"))
    return nn.Sequential(*layers)


class SplitBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm whose training statistics come from `splits` consecutive equal chunks of the batch,
    as if it were spread over that many GPUs: shuffle-BN on one GPU (the SCE authors' small-dataset
    runs use 8). The running statistics move by the mean of the chunks' updates. Parameters and
    buffers are BatchNorm's, so checkpoints and evaluation do not change.

    One batch_norm call: the chunks are laid side by side as `splits` x C channels of a batch of
    N / splits (one copy each way, in the input's memory format), not a loop over the chunks."""

    def __init__(self, bn, splits):
        super().__init__(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
        self.load_state_dict(bn.state_dict())
        self.splits = splits

    def _check_input_dim(self, x):
        if x.dim() not in (2, 4):
            raise ValueError(f"expected 2-D or 4-D input (got {x.dim()}-D)")

    def forward(self, x):
        if not self.training or self.splits == 1:
            return super().forward(x)
        s, (n, c) = self.splits, x.shape[:2]
        if n % s:
            raise ValueError(f"a batch of {n} does not split into {s} equal chunks")
        mean, var = self.running_mean.repeat(s), self.running_var.repeat(s)
        weight, bias = (self.weight.repeat(s), self.bias.repeat(s)) if self.affine else (None, None)
        out = F.batch_norm(chunks_as_channels(x, s), mean, var, weight, bias, training=True, momentum=self.momentum,
                           eps=self.eps)
        with torch.no_grad():
            self.running_mean.copy_(mean.view(s, c).mean(0))
            self.running_var.copy_(var.view(s, c).mean(0))
            self.num_batches_tracked.add_(1)
        return channels_as_chunks(out, s)


def _channels_last(x):
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def chunks_as_channels(x, s):
    """(N, C, ...) -> (N / s, s * C, ...): chunk j of the batch becomes channels j * C ... (j + 1) * C - 1."""
    n, c, *rest = x.shape
    if _channels_last(x):  # keep channels last: (N / s, H, W, s, C) in memory
        return x.reshape(s, n // s, c, *rest).permute(1, 3, 4, 0, 2).reshape(n // s, *rest, s * c).permute(0, 3, 1, 2)
    return x.reshape(s, n // s, c, *rest).transpose(0, 1).reshape(n // s, s * c, *rest)


def channels_as_chunks(y, s):
    """The inverse of chunks_as_channels."""
    m, sc, *rest = y.shape
    c = sc // s
    if _channels_last(y):
        return y.permute(0, 2, 3, 1).reshape(m, *rest, s, c).permute(3, 0, 1, 2, 4).reshape(s * m, *rest, c) \
            .permute(0, 3, 1, 2)
    return y.reshape(m, s, c, *rest).transpose(0, 1).reshape(s * m, c, *rest)


def split_batch_norm(module, splits):
    """`module` with every BatchNorm1d / 2d replaced by a SplitBatchNorm of `splits` chunks."""
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
        return SplitBatchNorm(module, splits)
    for name, child in module.named_children():
        module.add_module(name, split_batch_norm(child, splits))
    return module


def at_least_fp32(x):
    """Embeddings for the criterion: fp16 / bf16 outputs of autocast cast up to fp32 (fp64 stays)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def momentum_at(step, total_steps, m0, schedule="cosine"):
    """EMA momentum: constant m0, or a cosine from m0 at step 0 to 1 at the last step."""
    if schedule == "constant" or total_steps <= 0:
        return m0
    return 1 - (1 - m0) * (math.cos(math.pi * step / total_steps) + 1) / 2


class Outputs(NamedTuple):
    """What the forward returns beside the loss, of its first (target view, query view) pair: what the step logs
    (the method's terms, f(q, k, queue)) and what the online probe reads (h)."""
    q: torch.Tensor  # the l2-normalised query (detached)
    k: torch.Tensor  # the l2-normalised key of the target view
    queue: torch.Tensor  # the queue before this step's keys, or None
    h: torch.Tensor  # the query view's pooled trunk features (detached): the online probe's input


class MomentumModel(nn.Module):
    """The online and momentum branches and the queue shared by SCE, MoCo v2 and ReSSL (they differ by
    `criterion`).

    views[0], views[1] are the global views in the batch's order (sce.losses.GlobalViews: view 0 the target view of
    the asymmetric loss, view 1 the online), views[2:] local crops. Asymmetric: view 0 is the only target, every
    other view a query.
    Symmetric: each global view is a target for every other view; locals are only queries.
    bn_splits > 1 (one process, with shuffle_bn): BN statistics over that many chunks of the batch, in the
    momentum encoder only (split_bn "momentum": the authors' single-GPU small-dataset runs, whose online branch
    and heads normalise over the whole batch; the momentum branch's batch is shuffled), or in every BN layer of
    both branches and heads ("all": what that many GPUs without sync-BN compute, as in MoCo's CIFAR demo).
    """

    def __init__(self, criterion, arch="resnet50", small_input=False, proj_hidden_dims=(2048, 2048),
                 proj_dim=256, proj_last_bn="affine", pred_hidden_dims=(), queue_size=65536,
                 symmetric=False, shuffle_bn=False, bn_splits=1, sync_bn=False, split_bn="momentum"):
        super().__init__()
        self.criterion = criterion
        self.symmetric = symmetric
        self.shuffle_bn = shuffle_bn
        self.encoder, feat_dim = build_trunk(arch, small_input)
        self.projector = build_mlp(feat_dim, proj_hidden_dims, proj_dim, proj_last_bn)
        # MoCo v3's predictor, as the authors': no bias on its last layer
        self.predictor = (build_mlp(proj_dim, pred_hidden_dims, proj_dim, last_bias=False) if pred_hidden_dims
                          else nn.Identity())
        for name in ("encoder", "projector", "predictor"):
            if sync_bn:
                setattr(self, name, nn.SyncBatchNorm.convert_sync_batchnorm(getattr(self, name)))
            elif bn_splits > 1 and split_bn == "all":
                setattr(self, name, split_batch_norm(getattr(self, name), bn_splits))
        # the momentum branch starts as an exact copy and only moves by EMA
        self.momentum_encoder = copy.deepcopy(self.encoder)
        self.momentum_projector = copy.deepcopy(self.projector)
        if bn_splits > 1 and split_bn == "momentum" and not sync_bn:
            self.momentum_encoder = split_batch_norm(self.momentum_encoder, bn_splits)
        for p in self.momentum_parameters():
            p.requires_grad = False
        # queue_size 0: a method without a queue (BYOL's, SimSiam's kind): none is allocated, the loss gets None
        self.register_buffer("queue", F.normalize(torch.randn(queue_size, proj_dim), dim=1) if queue_size else None)
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long) if queue_size else None)

    def online_parameters(self):
        return list(self.encoder.parameters()) + list(self.projector.parameters())

    def momentum_parameters(self):
        return list(self.momentum_encoder.parameters()) + list(self.momentum_projector.parameters())

    @torch.no_grad()
    def update_momentum(self, m, finite=None):
        """EMA of the online trunk + projector into the momentum ones (after each optimizer step).
        `finite`, a device bool, makes a skipped step's EMA a no-op (momentum 1) without a host sync."""
        online, target = self.online_parameters(), self.momentum_parameters()
        if finite is None:
            finite = torch.ones((), dtype=torch.bool, device=target[0].device)
        m = torch.where(finite, m, 1.0)
        torch._foreach_mul_(target, m)
        torch._foreach_add_(target, torch._foreach_mul(online, 1 - m))

    @torch.no_grad()
    def enqueue(self, keys):
        """FIFO update with the keys of every rank; the queue is identical on all ranks. Index
        arithmetic stays on the device (no host sync); non-finite keys leave the queue unchanged."""
        keys = du.all_gather(keys)
        size = self.queue.shape[0]
        if size % keys.shape[0]:
            raise ValueError(f"queue size {size} is not a multiple of the {keys.shape[0]} keys "
                             "enqueued per step")
        idx = self.queue_ptr + torch.arange(keys.shape[0], device=keys.device)
        keys = torch.where(torch.isfinite(keys).all(), keys, self.queue[idx])
        self.queue.index_copy_(0, idx, keys.to(self.queue.dtype))
        self.queue_ptr.add_(keys.shape[0]).remainder_(size)

    def online(self, x):
        """(the l2-normalised query, the trunk's pooled features: what the online probe reads, detached)."""
        h = self.encoder(x)
        return F.normalize(at_least_fp32(self.predictor(self.projector(h))), dim=1), h

    @torch.no_grad()
    def target(self, x):
        if not self.shuffle_bn:
            return self._momentum(x)
        # shuffle-BN (MoCo): BN statistics of the keys come from a random subset of the global
        # batch; on one process the split BN layers make the subsets
        x_all = du.all_gather(x)
        perm = du.broadcast(self.shuffle_order(len(x_all), x.device))
        world, rank = du.world_size(), du.rank()
        out = du.all_gather(self._momentum(x_all[perm].chunk(world)[rank]))
        return out[torch.argsort(perm)].chunk(world)[rank]

    def shuffle_order(self, n, device):
        """The momentum branch's order of a global batch of n (shuffle-BN): rand + argsort, a permutation drawn on the
        device, which a CUDA graph captures (sce.cuda_graph). benchmarks/fidelity/step_equality.py sets the
        authors' here."""
        return torch.rand(n, device=device).argsort()

    def _momentum(self, x):
        return F.normalize(at_least_fp32(self.momentum_projector(self.momentum_encoder(x))), dim=1)

    def pairs(self, num_views):
        """(target view, query view) pairs the loss averages over."""
        targets = [0, 1] if self.symmetric else [0]
        return [(t, v) for t in targets for v in range(num_views) if v != t]

    def forward(self, views):
        pairs = self.pairs(len(views))
        targets = sorted({t for t, _ in pairs})
        keys = {t: self.target(views[t]) for t in targets}
        online = {v: self.online(views[v]) for v in sorted({v for _, v in pairs})}
        queries = {v: q for v, (q, _) in online.items()}
        # every term of the step uses the queue from before this step's keys
        queue = self.queue.clone().detach() if self.queue is not None else None
        # the criterion in fp32 whatever --amp: bf16's 8-bit mantissa puts ~0.01 of error on a cosine, ~0.1 on it
        # over tau_m, before the softmax that builds SCE's target; a few small matrix products beside the trunk
        with torch.autocast(views[0].device.type, enabled=False):
            loss = 0
            for t, v in pairs:  # a loop, not sum() of a generator: the loss one call below the forward
                loss = loss + self.criterion(queries[v], keys[t], queue)
            loss = loss / len(pairs)
        if queue is not None:
            self.enqueue(torch.cat([keys[t] for t in targets]))
        t, v = pairs[0]
        return loss, Outputs(q=queries[v].detach(), k=keys[t], queue=queue, h=online[v][1].detach())


def build_model(args, criterion, bn_splits=1, sync_bn=False):
    """The MomentumModel of main_pretrain.py's flags (arch, heads, queue, symmetric, shuffle-BN) with `criterion`
    (sce.losses.criterion); bn_splits > 1: split BN on one process (--split-bn: the momentum encoder's, or all);
    sync_bn: SyncBatchNorm (several ranks). main_pretrain.py and the benchmark build it here."""
    return MomentumModel(criterion, arch=args.arch, small_input=args.small_input,
                         proj_hidden_dims=args.proj_hidden_dims, proj_dim=args.proj_dim,
                         proj_last_bn=args.proj_last_bn, pred_hidden_dims=args.pred_hidden_dims,
                         queue_size=args.queue_size, symmetric=args.symmetric, shuffle_bn=args.shuffle_bn,
                         bn_splits=bn_splits, sync_bn=sync_bn, split_bn=getattr(args, "split_bn", "momentum"))
