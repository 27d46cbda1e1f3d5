"""LARS, weight-decay groups, the non-finite guard's optimizer step and the schedules' shapes."""
import math

import torch


def param_groups(model, weight_decay, exclude_bias_norm=True):
    """Weights (ndim > 1) and biases / normalisation parameters (ndim <= 1), as two groups. The
    second never gets LARS's trust ratio, and gets weight decay only if not exclude_bias_norm."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0 if exclude_bias_norm else weight_decay, "lars_exclude": True}]


class LARS(torch.optim.SGD):
    """SGD with momentum whose per-tensor step is scaled by the trust ratio
    eta * ||w|| / ||grad + wd * w|| (You et al.); groups with lars_exclude skip the scaling.

    Hand-written because torch has no LARS. Weight decay and the trust ratio are folded into the
    gradient, then torch's fused SGD (weight decay 0) applies the momentum update, so a non-finite
    step is skipped on the device like any fused SGD step (found_inf).
    """

    def __init__(self, params, lr=0.0, momentum=0.9, weight_decay=0.0, trust_coefficient=1e-3):
        params = list(params)
        groups = [dict(g) for g in params] if isinstance(params[0], dict) else [{"params": params}]
        for group in groups:
            group["lars_weight_decay"] = group.pop("weight_decay", weight_decay)
            group.setdefault("lars_exclude", False)
            group.setdefault("trust_coefficient", trust_coefficient)
        super().__init__(groups, lr=lr, momentum=momentum, weight_decay=0.0, fused=True)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None or getattr(self, "grad_scale", None) is not None:
            raise RuntimeError("LARS takes no closure and needs unscaled gradients (GradScaler.unscale_ first)")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            if not params:
                continue
            if group["lars_weight_decay"]:
                torch._foreach_add_(grads, params, alpha=group["lars_weight_decay"])
            if not group["lars_exclude"]:
                w_norm = torch.stack(torch._foreach_norm(params))
                g_norm = torch.stack(torch._foreach_norm(grads))
                trust = torch.where((w_norm > 0) & (g_norm > 0), group["trust_coefficient"] * w_norm / g_norm,
                                    torch.ones_like(w_norm))
                torch._foreach_mul_(grads, list(trust.unbind()))
        return super().step()


def excludes_bias_norm(name, exclude_bias_norm=None):
    """Whether biases and normalisation parameters skip weight decay: the flag, or by default what the
    SCE authors' code does: yes under LARS, no under SGD (every parameter decays)."""
    return name == "lars" if exclude_bias_norm is None else exclude_bias_norm


def build_optimizer(name, model, lr, weight_decay, momentum=0.9, exclude_bias_norm=None):
    """Fused SGD or LARS, with zero momentum buffers from the start: fused SGD's first step would
    otherwise leave them uninitialised when it is skipped (non-finite).

    exclude_bias_norm: see excludes_bias_norm."""
    groups = param_groups(model, weight_decay, excludes_bias_norm(name, exclude_bias_norm))
    if name == "lars":
        optimizer = LARS(groups, lr=lr, momentum=momentum)
    else:
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=momentum, fused=True)
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


def load_optimizer_state(optimizer, state):
    """optimizer.load_state_dict, each group's lr a number again: a CUDA-graph run saves the device tensors it
    filled (sce.cuda_graph.lr_as_tensors), and set_lr decides anew."""
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        group["lr"] = float(group["lr"])


# ---------------------------------------------------------------- the non-finite guard (sce.step.train_step)

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


# ---------------------------------------------------------------- schedules

def cosine_lr(step, total_steps, base_lr, warmup_steps=0):
    """Linear warmup from 0 to base_lr, then cosine decay to 0 (no restart)."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return base_lr * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):  # in place: a CUDA graph of the step reads this tensor
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def scheduled(step, total_steps, value, end=None, kind="constant", warmup_steps=0, warmup_start=None):
    """A coefficient's value at `step`: a linear warmup from warmup_start to `value` over
    warmup_steps, then constant, or a linear or cosine path from `value` to `end` at the last step."""
    if step < warmup_steps:
        start = value if warmup_start is None else warmup_start
        return start + (value - start) * step / warmup_steps
    end = value if end is None else end
    progress = (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps)
    if kind == "linear":
        return value + (end - value) * progress
    if kind == "cosine":
        return end + (value - end) * 0.5 * (1 + math.cos(math.pi * progress))
    return value
