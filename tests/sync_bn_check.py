"""MomentumModel(sync_bn=True) on 2 gloo ranks (CPU): what can be checked without a GPU.

torch's SyncBatchNorm synchronises train-mode statistics only for GPU (and XPU / HPU / privateuse1)
tensors: on CPU tensors its train-mode forward raises, so main_pretrain.py's check_args keeps
refusing --sync-bn on several CPU ranks; the last check here fails the day torch lifts that.
Usage: torchrun --nproc_per_node=2 tests/sync_bn_check.py (tests/dist_equivalence.py's two ranks run it too)
"""
import functools
import sys

import torch
import torch.nn as nn

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
from sce import distributed as du, losses  # noqa: E402
from sce.builder import MomentumModel  # noqa: E402


def build(sync_bn):
    torch.manual_seed(0)
    return MomentumModel(functools.partial(losses.sce_loss), "resnet18", True, [32], 16, "affine", queue_size=16,
                         sync_bn=sync_bn)


def check(rank, world):
    """The checks, on 2 ranks of an initialised process group."""
    assert world == 2, "run under torchrun --nproc_per_node=2"
    model, plain = build(True), build(False)
    for branch in ("encoder", "projector", "momentum_encoder", "momentum_projector"):
        norms = [m for m in getattr(model, branch).modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        assert norms and all(isinstance(m, nn.SyncBatchNorm) for m in norms), branch
    assert model.state_dict().keys() == plain.state_dict().keys()  # checkpoints load with or without --sync-bn

    # eval mode: running statistics, nothing to synchronise; each rank holds its half of the global batch
    g = torch.Generator().manual_seed(0)
    batch = [torch.randn(8, 3, 8, 8, generator=g) for _ in range(2)]
    model.eval()
    plain.eval()
    with torch.no_grad():
        _, (q, k, *_) = model([v.chunk(world)[rank] for v in batch])
        assert torch.allclose(q, plain.online(batch[1].chunk(world)[rank])[0], atol=1e-5)
        assert torch.allclose(k, plain._momentum(batch[0].chunk(world)[rank]), atol=1e-5)
        assert torch.allclose(model.queue[:8], plain._momentum(batch[0]), atol=1e-5)  # every rank's keys, in order
        queues = du.all_gather(model.queue[None])
        assert torch.equal(queues[0], queues[1])

    model.train()
    try:
        model([v.chunk(world)[rank] for v in batch])
        raise AssertionError("SyncBatchNorm ran in train mode on CPU: main_pretrain.py's check_world may allow "
                             "--sync-bn")
    except ValueError as e:
        assert "expected input tensor to be on GPU" in str(e), e
    du.barrier()
    if rank == 0:
        print("sync-bn check ok", flush=True)


if __name__ == "__main__":
    rank, world, _, _ = du.init()
    check(rank, world)
    du.cleanup()
