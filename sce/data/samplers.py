"""Which images each rank reads, and in which order: pretraining's resumable sampler, the linear probe's shuffled
shards, and the evaluations' shards (every image on exactly one rank)."""
import copy
import itertools
import math

import numpy as np
import torch
from torch.utils.data import DistributedSampler, Sampler

from sce import distributed as du


# how epoch orders are drawn (order_seed), saved with a checkpoint: one stopped within an epoch resumes only under
# the same (before it, seed + epoch seeded them: the rest of that epoch would be another permutation's)
ORDER_VERSION = "seed-epoch-hash"


def order_seed(seed, epoch):
    """The seed of epoch `epoch`'s data order in a run seeded `seed`: a 64-bit hash of the pair (numpy's
    SeedSequence), not seed + epoch, with which --seed 1 would read --seed 0's orders one epoch early."""
    return int(np.random.SeedSequence([seed % 2 ** 64, epoch % 2 ** 64]).generate_state(1, np.uint64)[0])


def order_generator(seed, epoch):
    """A torch.Generator seeded with order_seed(seed, epoch)."""
    return torch.Generator().manual_seed(order_seed(seed, epoch))


class ResumableSampler(Sampler):
    """Yields (epoch, index) for this rank. Each epoch is a seeded permutation cut into global batches of
    `global_batch`; rank r takes the r-th slice of each, so N ranks see exactly the global batches one process
    would. set_epoch(epoch, start_step) skips the steps already done. The permutation is seeded with
    order_seed(seed, epoch)."""

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
        perm = torch.randperm(self.n, generator=order_generator(self.seed, self.epoch))[:self.steps * self.batch]
        return perm.view(self.steps, self.world, -1)[self.start_step:, self.rank].flatten()

    def __iter__(self):
        return iter([(self.epoch, i) for i in self.indices().tolist()])


class ShuffledShards(DistributedSampler):
    """The linear probe's sampler: a DistributedSampler (seeded per epoch, also on one process, so that a resumed
    run sees the same order) yielding (epoch, index), whose epoch may begin after its first `start` indices. Its
    shuffle is seeded with order_seed(seed, epoch), not DistributedSampler's seed + epoch; its padding, drop_last
    and rank slices are DistributedSampler's."""

    def set_epoch(self, epoch, start=0):
        super().set_epoch(epoch)
        self.start = start

    def shard(self):
        """This rank's indices of the epoch: DistributedSampler.__iter__'s, shuffled by order_generator."""
        if self.shuffle:
            indices = torch.randperm(len(self.dataset), generator=order_generator(self.seed, self.epoch)).tolist()
        else:
            indices = list(range(len(self.dataset)))
        if not self.drop_last:  # repeat the first indices up to a multiple of the ranks
            padding = self.total_size - len(indices)
            indices += indices[:padding] if padding <= len(indices) else (
                indices * math.ceil(padding / len(indices)))[:padding]
        else:
            indices = indices[:self.total_size]
        assert len(indices) == self.total_size
        indices = indices[self.rank:self.total_size:self.num_replicas]
        assert len(indices) == self.num_samples
        return indices

    def __iter__(self):
        return iter([(self.epoch, i) for i in itertools.islice(self.shard(), getattr(self, "start", 0), None)])

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


def epoch_order(sampler, epoch):
    """This rank's image indices of `epoch` from its first step (a tensor), without changing `sampler`, which may
    be in another epoch."""
    sampler = copy.copy(sampler)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    if isinstance(sampler, ResumableSampler):  # its tensor as it is (its iterator makes a Python pair an image)
        return sampler.indices()
    if isinstance(sampler, ShuffledShards):
        return torch.tensor(sampler.shard(), dtype=torch.long)
    return torch.tensor([i for _, i in sampler], dtype=torch.long)
