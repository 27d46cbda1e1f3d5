"""Train a few steps as main_pretrain.py does (sampler, batches of views, DDP, shuffle-BN, the queue,
and sce.step.train_step with its non-finite guard, an lr and EMA schedule, BN in train mode) and save
the result.

Run under torchrun with 2 ranks, or as one process standing for them: the one process splits every
BN into 2 chunks of the batch (bn_splits=2, split_bn="all"), the chunks the ranks hold (ResumableSampler gives rank r
the r-th consecutive slice of each global batch), so its BN statistics are theirs. Weights, the
queue and the mean over ranks of the BN running statistics must agree (rank 0's own statistics
follow its chunk alone, so they do not).
Usage: python tests/dist_equivalence.py DATA OUT.pth
"""
import functools
import sys

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
from sce import data as sce_data, distributed as du, losses  # noqa: E402
from sce.builder import MomentumModel, momentum_at  # noqa: E402
from sce.step import Training, train_step  # noqa: E402
from sce.optim import build_optimizer, cosine_lr, set_lr  # noqa: E402
import sync_bn_check  # noqa: E402  (beside this file)

data, out = sys.argv[1], sys.argv[2]
rank, world, _, device = du.init()
torch.manual_seed(0)
global_batch, epochs = 8, 1
base_lr = 0.5 * global_batch / 256  # as main_pretrain.py scales --lr
dataset = sce_data.build_dataset("imagefolder", data, "pretrain", read="tensor")
sampler = sce_data.ResumableSampler(len(dataset), global_batch, rank, world, seed=0)
specs = [sce_data.ViewSpec("weak", 16), sce_data.ViewSpec("strong", 16)]
batches = sce_data.pretrain_batches(dataset, specs, sampler, device, "gpu", dtype=torch.float64)
bn_splits = 2 if world == 1 else 1  # as main_pretrain.py's check_world: several ranks shuffle for real
# a projector without BN: a BN over a chunk's 4 feature vectors has so small a variance that float
# rounding grows into gradients 10% apart within 3 steps, between any two runs; the trunk's BN remain. In
# float64: the two runs sum in different orders, and fp32's rounding (1e-7) grows to ~1e-4 by the 4th step
torch.set_default_dtype(torch.float64)
model = MomentumModel(functools.partial(losses.sce_loss, tau=0.1, tau_m=0.07), "resnet18", True, [], 16, "none",
            queue_size=24, shuffle_bn=True, bn_splits=bn_splits, split_bn="all")
ddp = du.wrap_ddp(model, device) if world > 1 else model
t = Training(model, ddp, build_optimizer("sgd", model, base_lr, 1e-4))
ddp.train()
total, step, step_losses = epochs * sampler.steps, 0, []
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for x in batches:
        set_lr(t.optimizer, cosine_lr(step, total, base_lr, warmup_steps=1))
        result = train_step(t, x, momentum_at(step, total, 0.9))
        loss = result.loss
        assert bool(result.finite)
        step_losses.append(float(du.all_reduce_sum(loss.clone())) / world)  # each rank's loss is over its slice
        step += 1
state = {k: v.clone() for k, v in model.state_dict().items()}
# BN running statistics are rank-local (DDP leaves buffers alone), while a split BN moves them by the
# mean of its chunks' updates; the update is linear, so the mean over ranks is what the one process holds
running = {k: du.all_reduce_sum(v.clone()) / world for k, v in state.items()
           if k.endswith(("running_mean", "running_var"))}
if rank == 0:
    torch.save({"model": state, "bn_mean_over_ranks": running, "losses": step_losses}, out)
if world == 2:  # the same ranks check sync-BN: one torchrun job for both
    torch.set_default_dtype(torch.float32)
    sync_bn_check.check(rank, world)
du.cleanup()
