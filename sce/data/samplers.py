"""Which images each rank reads, and in which order: pretraining's resumable sampler, the linear probe's shuffled
shards, and the evaluations' shards (every image on exactly one rank)."""
import itertools

import torch
from torch.utils.data import DistributedSampler, Sampler

from sce import distributed as du


class ResumableSampler(Sampler):
    """Yields (epoch, index) for this rank. Each epoch is a seeded permutation cut into global batches of
    `global_batch`; rank r takes the r-th slice of each, so N ranks see exactly the global batches one process
    would. set_epoch(epoch, start_step) skips the steps already done."""

    def __init__(self, num_samples, global_batch, rank=0, world_size=1, seed=0):
        self.n, self.batch, self.rank, self.world, self.seed = num_samples, global_batch, rank, world_size, seed
        self.steps = num_samples // global_batch
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch, start_step=0):
        self.epoch, self.start_step = epoch, start_step

    def __len__(self):
        return (self.steps - self.start_step) * (self.batch // self.world)

    def indices(self):
        """This rank's image indices of the rest of the epoch, in order (a tensor)."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.n, generator=g)[:self.steps * self.batch]
        return perm.view(self.steps, self.world, -1)[self.start_step:, self.rank].flatten()

    def __iter__(self):
        return iter([(self.epoch, i) for i in self.indices().tolist()])


class ShuffledShards(DistributedSampler):
    """The linear probe's sampler: a DistributedSampler (seeded per epoch, also on one process, so that a resumed
    run sees the same order) yielding (epoch, index), whose epoch may begin after its first `start` indices."""

    def set_epoch(self, epoch, start=0):
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self):
        return iter([(self.epoch, i) for i in itertools.islice(super().__iter__(), getattr(self, "start", 0), None)])

    def __len__(self):
        return self.num_samples - getattr(self, "start", 0)


class Shard(Sampler):
    """(0, index) for indices rank, rank + ranks, ...: every image on exactly one rank, no padding."""

    def __init__(self, length):
        self.indices = range(du.rank(), length, du.world_size())

    def __iter__(self):
        return iter([(0, i) for i in self.indices])

    def __len__(self):
        return len(self.indices)
