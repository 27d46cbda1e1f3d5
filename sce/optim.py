"""LARS, weight-decay groups and the learning-rate schedule."""
import math

import torch


def param_groups(model, weight_decay):
    """Biases and normalisation parameters (ndim <= 1) get no weight decay and, under LARS, no
    trust-ratio adaptation (SPEC section 4)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0, "lars_exclude": True}]


class LARS(torch.optim.Optimizer):
    """SGD with momentum whose per-tensor step is scaled by the trust ratio
    eta * ||w|| / ||grad + wd * w|| (You et al.); groups with lars_exclude skip the scaling."""

    def __init__(self, params, lr=0.0, momentum=0.9, weight_decay=0.0, trust_coefficient=1e-3):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, lars_exclude=False))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad.clone()
                if not group["lars_exclude"]:
                    w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(d_p)
                    trust = torch.where((w_norm > 0) & (g_norm > 0),
                                        group["trust_coefficient"] * w_norm / g_norm,
                                        torch.ones_like(w_norm))
                    d_p.mul_(trust)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(d_p)
                p.add_(buf, alpha=-group["lr"])
        return loss


def build_optimizer(name, model, lr, weight_decay, momentum=0.9):
    groups = param_groups(model, weight_decay)
    if name == "lars":
        return LARS(groups, lr=lr, momentum=momentum)
    return torch.optim.SGD(groups, lr=lr, momentum=momentum)


def cosine_lr(step, total_steps, base_lr, warmup_steps=0):
    """Linear warmup from 0 to base_lr, then cosine decay to 0 (no restart)."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return base_lr * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr
