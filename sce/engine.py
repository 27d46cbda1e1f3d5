"""The pretraining step, shared by main_pretrain.py and benchmarks/bench_pretrain.py.

A step whose gradients are not finite leaves the weights and the optimizer as they were, decided
on the device without a host sync: the fused SGD (or LARS) update is skipped through its
`found_inf` input, the EMA uses momentum 1, and the BN running statistics, which the forward pass
moved, are put back (their num_batches_tracked counters are not). The queue keeps the step's keys
when they are finite, as in MoCo. That costs a few kernel launches, against a copy of both
branches and the optimizer.
"""
import dataclasses
import importlib.util
import os
import shutil

import torch

from sce import UserError


@dataclasses.dataclass
class Training:
    """What a training step uses and updates."""
    model: torch.nn.Module  # the SCE model
    ddp_model: torch.nn.Module  # the same, wrapped in DDP on several ranks
    optimizer: torch.optim.Optimizer  # fused SGD or LARS (sce.optim)
    scaler: torch.amp.GradScaler = None  # fp16 only
    amp_dtype: torch.dtype = None
    bn_stats: list = None  # running means and variances of every BN layer; filled from the model
    guard: bool = True  # False only to measure what the non-finite guard costs (benchmarks)
    terms: object = None  # f(q, k, queue) -> the logged terms of eq. 10 (losses.loss_terms), or None

    def __post_init__(self):
        if self.bn_stats is None:
            self.bn_stats = [b for name, b in self.model.named_buffers()
                             if name.endswith(("running_mean", "running_var"))]


def train_step(t, views, momentum):
    """One optimizer step on device views. Returns (loss, finite, terms), device tensors; terms
    (t.terms of the first (target, query) pair, or None) are computed here so benchmarks time them."""
    device = views[0].device
    autocast = torch.autocast(device.type, dtype=t.amp_dtype, enabled=t.amp_dtype is not None)
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
    with autocast:  # the similarities of the logged terms in the loss's precision, not in fp32
        terms = t.terms(*outputs) if t.terms else None
    return loss.detach(), finite, terms


def grads_finite(optimizer):
    """Device bool: every gradient is finite. DDP averages gradients over ranks, so a non-finite
    loss on any rank gives every rank the same verdict."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum())


def step_unless_nonfinite(optimizer, finite):
    """optimizer.step(), skipped on the device where `finite` is False: torch's fused SGD reads
    `found_inf` (1.0 = skip) from the optimizer, where GradScaler puts it."""
    optimizer.grad_scale, optimizer.found_inf = None, (~finite).float()
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def restore_unless_finite(tensors, backup, finite):
    """Put `backup` (the tensors flattened and concatenated) back into `tensors` unless `finite`."""
    kept = torch.where(finite, torch.cat([t.flatten() for t in tensors]), backup)
    torch._foreach_copy_(tensors, list(kept.split([t.numel() for t in tensors])))


def check_compile(device):
    """A one-line error, before any work, where torch.compile cannot run."""
    fix = "drop --compile"
    if not torch._dynamo.is_dynamo_supported():
        raise UserError(f"--compile: torch.compile does not support this Python / platform: {fix}")
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise UserError(f"--compile on GPU needs Triton, which is not installed: pip install triton, or {fix}")
    if device.type == "cpu" and not shutil.which(os.environ.get("CXX", "g++")):
        raise UserError(f"--compile on CPU needs a C++ compiler ({os.environ.get('CXX', 'g++')} not found): {fix}")


def compile_model(model):
    """torch.compile the encoders and heads in place; the queue, the all_gather and the loss stay
    eager. nn.Module.compile keeps the state-dict keys, so compiled and eager checkpoints mix."""
    for module in (model.encoder, model.projector, model.predictor, model.momentum_encoder,
                   model.momentum_projector):
        module.compile()
