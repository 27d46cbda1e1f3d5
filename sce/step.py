"""The training step and its schedules: what one optimizer step of pretraining does (train_step), how the loop
calls it (build_step: eager, compiled, or replayed from a CUDA graph) and the lr, EMA momentum and lambda of each
global step (Schedules). main_pretrain.py, sce.epoch's loop and the benchmarks (benchmarks/speed/bench_pretrain.py,
benchmarks/fidelity/step_equality.py, benchmarks/checks/check_graph.py) all run these.

build_step wraps train_step from the inside out, each wrapper keeping the contract step(views, momentum, labels=None) ->
StepResult (loss, finite, terms, probe_top1), device tensors, no host sync:
  1. train_step bound to a Training (functools.partial): the step itself;
  2. CompiledStep (sce.compiling), when the modules were compile_model'd: the first call runs eagerly through
     compiling.Fallback, whose failure warns once and leaves the step eager for good; it notes each compile in the
     run's Log, so the loop can count its wall time apart;
  3. Graphed (sce.cuda_graph), on one GPU: GRAPH_WARMUP eager calls, then one capture, then replays; what changes
     between steps reaches the graph through device tensors only (the views and momentum copied in, the lr filled in
     place, lambda the criterion's tensor), and its outputs are the graph's, overwritten by the next replay.
"""
import dataclasses
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sce import distributed as du
from sce.builder import momentum_at
from sce.compiling import CompiledStep, Log
from sce.cuda_graph import Graphed, lr_as_tensors
from sce.optim import cosine_lr, grads_finite, restore_unless_finite, scheduled, step_unless_nonfinite


class StepResult(NamedTuple):
    """What a step returns: device tensors (a CUDA graph's, overwritten by its next replay)."""
    loss: torch.Tensor
    finite: torch.Tensor  # bool: the gradients were finite and the step was taken
    terms: dict = None  # {name: value} of the method's logged terms (Training.terms), or None
    probe_top1: torch.Tensor = None  # the online probe's top-1 (%) on the batch's labelled images, or None


@dataclasses.dataclass
class Training:
    """What a training step uses and updates."""
    model: torch.nn.Module  # the MomentumModel (sce.builder)
    ddp_model: torch.nn.Module  # the same, wrapped in DDP on several ranks
    optimizer: torch.optim.Optimizer  # fused SGD or LARS (sce.optim)
    scaler: torch.amp.GradScaler = None  # fp16 only
    amp_dtype: torch.dtype = None
    bn_stats: list = None  # running means and variances of every BN layer; filled from the model
    guard: bool = True  # False only to measure what the non-finite guard costs (benchmarks)
    terms: object = None  # f(q, k, queue) -> {name: value}, the method's logged terms (sce.losses), or None
    autocast_cache: bool = True  # autocast's cache of cast weights; off for a CUDA graph (build_step)
    probe: object = None  # the online linear probe (OnlineProbe), or None

    def __post_init__(self):
        if self.bn_stats is None:
            self.bn_stats = [b for name, b in self.model.named_buffers()
                             if name.endswith(("running_mean", "running_var"))]


class OnlineProbe:
    """A linear head on the online trunk's pooled features of the first query view, detached, trained at every step with
    its own optimizer (Adam, as the authors' online evaluator; its gradient the mean over the labelled images of every
    rank): a running top-1 of the training batches beside the method, which it never touches (its loss has no path to
    the trunk, its step no part in the method's guard). Its top-1 on the validation split is the kNN monitor's (sce.knn:
    the same features), where that data's classes are the ones it learns. Labels below 0 (images without one) count
    for nothing. classes: the names of its classes (default: their numbers), kept in its state: a resume on data of
    other classes starts it afresh (sce.resume)."""

    def __init__(self, feat_dim, num_classes, device, lr=1e-3, classes=None):
        with torch.random.fork_rng(devices=[]):  # its own draws (the CPU's generator, put back; no GPU's touched)
            torch.random.default_generator.manual_seed(0)
            self.head = torch.nn.Linear(feat_dim, num_classes).to(device)
        self.classes = [str(c) for c in classes] if classes is not None else [str(i) for i in range(num_classes)]
        if len(self.classes) != num_classes:
            raise ValueError(f"{len(self.classes)} class names for {num_classes} classes")
        self.restored = False  # from a checkpoint (sce.resume)
        # capturable: its step inside the step's CUDA graph (its step count kept on the GPU)
        self.optimizer = torch.optim.Adam(self.head.parameters(), lr=lr, fused=True,
                                          capturable=torch.device(device).type == "cuda")

    @classmethod
    def of(cls, model, dataset, device, lr):
        """The probe of a MomentumModel on a dataset's labels and classes (its class names where it has them), or None
        where it holds fewer than 2 classes."""
        targets, names = getattr(dataset, "targets", None), getattr(dataset, "classes", None)
        if targets is None or not len(targets):
            return None
        classes = list(names) if names else range(int(max(targets)) + 1)
        return cls(model.projector[0].in_features, len(classes), device, lr, classes) if len(classes) >= 2 else None

    def other_classes(self, classes):
        """Why `classes` (names; None: not recorded) are not the ones this probe learns, in a few words; or None."""
        if classes is None:
            return "its classes are not recorded (an earlier version)"
        classes = [str(c) for c in classes]
        if len(classes) != len(self.classes):
            return f"{len(classes)} classes, not {len(self.classes)}"
        differ = [(a, b) for a, b in zip(classes, self.classes) if a != b]
        return f"other classes of as many: {differ[0][0]!r}, not {differ[0][1]!r}" if differ else None

    def state_dict(self):
        return {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(), "classes": self.classes}

    def load_state_dict(self, state):
        """The saved head and Adam's state; its lr and capturable stay this run's (--online-probe-lr, the device)."""
        settings = [(g["lr"], g["capturable"]) for g in self.optimizer.param_groups]
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        for group, (lr, capturable) in zip(self.optimizer.param_groups, settings):
            group["lr"], group["capturable"] = lr, capturable
        self.restored = True

    def step(self, features, labels):
        """One step of the head on (features, labels); returns its top-1 (%) on them, a device scalar."""
        labeled = labels >= 0
        with torch.autocast(features.device.type, enabled=False):
            logits = self.head(features.float())
            losses = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
        count = labeled.sum()
        self.optimizer.zero_grad(set_to_none=True)
        torch.where(labeled, losses, 0.0).sum().backward()
        grads = [p.grad for p in self.head.parameters()]
        # the mean over the whole batch's labelled images, whichever ranks hold them (one head on every rank)
        flat = torch.cat([g.flatten() for g in grads] + [count.float().view(1)])
        if du.world_size() > 1:
            flat = du.all_reduce_sum(flat)
        flat = flat[:-1] / flat[-1].clamp(min=1)
        torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])
        step_unless_nonfinite(self.optimizer, grads_finite(self.optimizer))
        hits = (logits.detach().argmax(dim=1) == labels) & labeled
        return 100 * hits.sum() / count.clamp(min=1)


def train_step(t, views, momentum, labels=None):
    """One optimizer step on device views: the forward of both branches and the loss (t.ddp_model, the
    MomentumModel's forward), the backward, the optimizer's step, the EMA; returns a StepResult of device tensors
    (terms: t.terms of the first (target, query) pair, computed here so that the benchmark times them).
    A step whose gradients are not finite leaves the weights and the optimizer as they were, decided on the device
    without a host sync: the fused SGD (or LARS) update is skipped through its `found_inf` input, the EMA uses
    momentum 1, and the BN running statistics, which the forward moved, are put back (their num_batches_tracked
    counters are not). The queue keeps the step's keys when they are finite, as in MoCo. With t.probe and the
    images' labels, the online probe's step follows (its top-1: probe_top1)."""
    device = views[0].device
    autocast = torch.autocast(device.type, dtype=t.amp_dtype, enabled=t.amp_dtype is not None,
                              cache_enabled=t.autocast_cache)
    stats = torch.cat([s.flatten() for s in t.bn_stats]) if t.guard and t.bn_stats else None
    with autocast:
        loss, outputs = t.ddp_model(views)
    t.optimizer.zero_grad(set_to_none=True)
    if t.scaler:
        t.scaler.scale(loss).backward()
        t.scaler.unscale_(t.optimizer)
    else:
        loss.backward()
    finite = grads_finite(t.optimizer) if t.guard else torch.ones((), dtype=torch.bool, device=device)
    if t.scaler:
        t.scaler.step(t.optimizer)  # passes its own found_inf (the same verdict) to the fused step
        t.scaler.update()
    elif t.guard:
        step_unless_nonfinite(t.optimizer, finite)
    else:
        t.optimizer.step()
    t.model.update_momentum(momentum, finite)
    if stats is not None:
        restore_unless_finite(t.bn_stats, stats, finite)
    terms = t.terms(outputs.q, outputs.k, outputs.queue) if t.terms else None  # in fp32, as the loss is
    probe_top1 = t.probe.step(outputs.h, labels) if t.probe is not None and labels is not None else None
    return StepResult(loss.detach(), finite, terms, probe_top1)


def build_step(training, compiled=False, graphs=None, compiles=None):
    """What the loop calls each step, step(views, momentum, labels=None) -> StepResult: train_step on
    `training`, eager; compiled (its modules were compiling.compile_model'd): through compiling.CompiledStep, which
    falls back to eager at the first step; graphs (sce.cuda_graph.CudaGraphs, or the tests' stand-in): replayed from a
    CUDA graph after GRAPH_WARMUP eager steps (sce.cuda_graph.Graphed; the outputs are the graph's tensors, overwritten
    by the next step). What changes from step to step reaches a graph through device tensors: the views and the EMA
    momentum copied in, the lr filled in place (lr_as_tensors, then set_lr), lambda the criterion's tensor
    (sce.losses.Lambda). compiles: the run's compiling.Log, where compiles and a capture are noted."""
    step = functools.partial(train_step, training)
    if compiled:
        step = CompiledStep(step, training.model, compiles if compiles is not None else Log())
    if graphs:
        lr_as_tensors(training.optimizer, next(training.model.parameters()).device)
        training.autocast_cache = False  # a capture must not keep autocast's cast weights (torch.cuda.graphs)
        step = Graphed(step, graphs, "the training step", compiles=compiles)
    return step


class Schedules:
    """The lr, EMA momentum and lambda of any global step, from the flags (as the probe's Probe.lr_at): the lr a
    linear warmup then a cosine decay of --lr scaled by the batch, the momentum --ema-momentum's schedule, lambda
    --lambda's."""

    def __init__(self, args, steps_per_epoch):
        self.args, self.total_steps = args, steps_per_epoch * args.epochs
        self.base_lr = args.lr * args.batch_size / 256
        self.warmup_steps = round(args.warmup_epochs * steps_per_epoch)

    def lr_at(self, step):
        return cosine_lr(step, self.total_steps, self.base_lr, self.warmup_steps)

    def momentum_at(self, step):
        return momentum_at(step, self.total_steps, self.args.ema_momentum, self.args.ema_schedule)

    def lambda_at(self, step):
        a = self.args
        return scheduled(step, self.total_steps, a.lambda_, end=a.lambda_end, kind=a.lambda_schedule,
                         warmup_steps=a.lambda_warmup_steps, warmup_start=a.lambda_warmup_start)

    def at(self, step):
        """The three at `step`, named as the progress lines and log.txt name them."""
        return {"lr": self.lr_at(step), "momentum": self.momentum_at(step), "lambda": self.lambda_at(step)}
