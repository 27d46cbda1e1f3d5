"""Train a few steps with the library's pieces (sampler, views, DDP, queue, EMA) and save the result.

Run under torchrun with N ranks or as one process: with BN frozen (eval mode) every sample's
output is independent of how the global batch is split, so the weights and the queue must agree.
Usage: python tests/dist_equivalence.py DATA OUT.pth
"""
import functools
import sys

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
from sce import distributed as du, losses  # noqa: E402
from sce.builder import SCE  # noqa: E402
from sce.augment import MultiView, View  # noqa: E402
from sce.loader import PretrainDataset, ResumableSampler, build_dataset  # noqa: E402
from sce.optim import build_optimizer  # noqa: E402

data, out = sys.argv[1], sys.argv[2]
rank, world, _, device = du.init()
torch.manual_seed(0)
global_batch, steps = 8, 4
dataset = build_dataset("imagefolder", data, "pretrain")
sampler = ResumableSampler(len(dataset), global_batch, rank, world, seed=0)
views = PretrainDataset(dataset, MultiView([View("weak", 16), View("strong", 16)]), seed=0)
loader = torch.utils.data.DataLoader(views, batch_size=global_batch // world, sampler=sampler)
model = SCE(functools.partial(losses.sce_loss, tau=0.1, tau_m=0.07), "resnet18", True, [32], 16, "none",
            queue_size=24)
model.eval()  # frozen BN statistics: the split of the batch over ranks cannot matter
ddp = du.wrap_ddp(model, device) if world > 1 else model
optimizer = build_optimizer("sgd", model, 0.5, 1e-4)
for step, (x, _, _) in zip(range(steps), loader):
    loss, _ = ddp(x)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    model.update_momentum(0.9)
if rank == 0:
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out)
du.cleanup()
