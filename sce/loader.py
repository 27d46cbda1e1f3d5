"""Batches: the pretraining loader (per-sample seeds, resumable sampler, unreadable images replaced),
evaluation samples (every image read, a linear probe's crops seeded), the collate of encoded JPEGs, and
the evaluation transforms and input size (the pretraining views are in sce.augment)."""
import os

import numpy as np
import torch
import torchvision.transforms as T
from torch.utils.data import Dataset, Sampler

from sce import UserError
from sce.augment import MEAN, STD, EncodedSample
from sce.datasets import load_rgb_tensor
from sce.preemption import ignore_stop_signals

WORKER_NICENESS = 5


def init_pretrain_worker(worker_id):
    """A pretraining loader worker leaves SIGTERM / SIGUSR1 to its rank (sce.preemption) and runs at
    a lower priority: where the workers fill every core, the training process, which launches the
    GPU's kernels one by one, still gets its core when it needs it."""
    ignore_stop_signals()
    os.nice(WORKER_NICENESS)


def pretrain_loader(dataset, views, sampler, batch_size, workers, device, seed):
    """The pretraining DataLoader of main_pretrain.py (and of the benchmark, which measures it)."""
    return torch.utils.data.DataLoader(
        PretrainDataset(dataset, views, seed), batch_size=batch_size, sampler=sampler, num_workers=workers,
        pin_memory=device.type == "cuda", drop_last=True, worker_init_fn=init_pretrain_worker,
        persistent_workers=workers > 0, collate_fn=collate_views,
        # a private generator for the loader's per-epoch seed draw: from the global RNG it would shift
        # shuffle-BN's permutations after a mid-epoch resume (the epoch's iterator is made twice)
        generator=torch.Generator().manual_seed(seed))


# native resolution of the built-in small and medium datasets (the paper evaluates them at it)
NATIVE_SIZE = {"cifar10": 32, "cifar100": 32, "stl10": 96, "tiny-imagenet": 64}


def eval_crop_size(given, small_input, ckpt_args=None, dataset="imagefolder"):
    """The input size of an evaluation and why: (size, reason, warning or None).

    A small-input trunk (3x3 stride-1 stem) is evaluated at the crop size it was pretrained with,
    as recorded in its checkpoint, else at its dataset's native size; an ImageNet-stem trunk at
    the native size of a built-in dataset, else at the protocol's 224. A --crop-size given for a
    small-input trunk more than 2x away from its pretraining size is allowed, with a warning."""
    recorded = (ckpt_args or {}).get("crop_size") if small_input else None
    if given:
        far = recorded and not recorded / 2 <= given <= recorded * 2
        warning = (f"warning: --crop-size {given} is more than 2x away from the {recorded} px this small-input "
                   f"trunk was pretrained at: its features are those of images of another scale" if far else None)
        return given, "--crop-size", warning
    if recorded:
        return recorded, "the crop size the small-input trunk was pretrained with", None
    if dataset in NATIVE_SIZE:
        return NATIVE_SIZE[dataset], f"the native size of {dataset}", None
    return 224, "the protocol's 224", None


def collate_views(samples):
    """The collate_fn of every loader that may meet an encoded JPEG (sce.device_decode): samples are
    (views, bad, reason) in pretraining, (image, target) in evaluation. With no EncodedSample among
    them, torch's default_collate. Else a dict: jpeg, lengths (the encoded samples' bytes, end to end), encoded /
    decoded (their places in the batch), geometry (per view, (n_encoded, 9), on the host), images (per
    view, the decoded samples' tensors: uint8 crops in pretraining, normalised images in evaluation),
    keys; pretraining: sizes (of the views), params (per view, (N, 12) in batch order), bad, reasons;
    evaluation: targets."""
    first = [s[0] for s in samples]
    encoded = [i for i, x in enumerate(first) if isinstance(x, EncodedSample)]
    if not encoded:
        return torch.utils.data.default_collate(samples)
    decoded = [i for i, x in enumerate(first) if not isinstance(x, EncodedSample)]
    views = range(len(first[encoded[0]].geometry))
    # the files' bytes as one tensor: one shared-memory segment from a worker, not one per image
    batch = dict(jpeg=torch.cat([first[i].data for i in encoded]), lengths=[len(first[i].data) for i in encoded],
                 encoded=torch.tensor(encoded), decoded=torch.tensor(decoded, dtype=torch.long),
                 keys=[first[i].key for i in encoded],
                 geometry=[torch.stack([first[i].geometry[v] for i in encoded]) for v in views])
    if len(samples[0]) == 3:  # pretraining: a decoded sample's views are (uint8 crop, packed row) pairs
        batch["sizes"] = [int(first[encoded[0]].geometry[v][4]) for v in views]  # a view's side: its resize
        batch["images"] = [torch.stack([first[i][v][0] for i in decoded]) if decoded else None for v in views]
        batch["params"] = [torch.stack([x.params[v] if isinstance(x, EncodedSample) else x[v][1] for x in first])
                           for v in views]
        batch["bad"], batch["reasons"] = torch.tensor([s[1] for s in samples]), [s[2] for s in samples]
    else:  # evaluation: a decoded sample is its normalised image
        batch["images"] = [torch.stack([first[i] for i in decoded]) if decoded else None]
        batch["targets"] = torch.tensor([int(s[1]) for s in samples])
    return batch


def eval_resize(crop_size, small=False):
    """The short side images are resized to before the evaluation's centre crop: 256 for 224 (scaled
    with the crop) on large images; the resolution itself on small ones (paper supp.)."""
    return crop_size if small else int(crop_size * 256 / 224)


def eval_transform(train, crop_size=224, small=False):
    """Linear-evaluation transforms (paper supp.): large images RRC+flip / resize 256 + centre
    crop 224; small images random crop with 4 px padding + flip / resize to the resolution."""
    if small:
        ops = ([T.Resize(crop_size), T.RandomCrop(crop_size, padding=4), T.RandomHorizontalFlip()]
               if train else [T.Resize(crop_size), T.CenterCrop(crop_size)])
    else:
        ops = ([T.RandomResizedCrop(crop_size), T.RandomHorizontalFlip()] if train
               else [T.Resize(eval_resize(crop_size)), T.CenterCrop(crop_size)])
    return T.Compose(ops + [T.ToTensor(), T.Normalize(MEAN, STD)])


def sample_seed(seed, epoch, index):
    """The RNG seed of one sample's views: numpy's SeedSequence hashes the triple, so no two
    (epoch, index) pairs of a run share a stream (a linear mix would: i + 100003 at epoch e
    colliding with i at epoch e + 1)."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1, np.uint64)[0])


class UnreadableImage(UserError):
    """An image an evaluation cannot read. Raised in a loader worker, torch raises it again in the main
    process with the worker's traceback as its message: the last line, this error's own, is kept."""

    def __init__(self, message):
        super().__init__(message.strip().splitlines()[-1].split("UnreadableImage: ", 1)[-1])

    @classmethod
    def of(cls, path, reason, others=0):
        more = f"; {others} more unreadable images" if others else ""
        reason = (str(reason).strip().splitlines() or ["?"])[0][:200]
        return cls(f"cannot read {path} ({reason}){more}: fix or remove it (an evaluation reads every image)")


def image_path(dataset, i):
    """The file of image i of a dataset (through Subsets), or its index where it has none (CIFAR, STL10)."""
    while isinstance(dataset, torch.utils.data.Subset):
        dataset, i = dataset.dataset, dataset.indices[i]
    return dataset.path(i) if hasattr(dataset, "path") else f"image #{i}"


class EvalSamples(Dataset):
    """An evaluation split as its loader reads it. Every image must be read (the number would change
    otherwise): an unreadable one is an UnreadableImage naming it. With (epoch, index) keys (EpochKeys)
    a sample's random crop and flip come from (seed, epoch, index), as PretrainDataset's views: the same
    for any number of workers and after a resume."""

    def __init__(self, dataset, seed=0):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (None, key)
        try:
            if epoch is None:
                return self.dataset[index]
            with torch.random.fork_rng(devices=[]):  # the CPU generator alone, as PretrainDataset
                torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
                return self.dataset[index]
        except UserError:
            raise
        except Exception as e:  # decode errors come as many exception types
            raise UnreadableImage.of(image_path(self.dataset, index), f"{type(e).__name__}: {e}") from None


class EpochKeys(Sampler):
    """(epoch, index) keys of a DistributedSampler's indices, its epoch read as each epoch's iterator
    starts (in the main process: persistent workers never see set_epoch)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __iter__(self):
        return iter([(self.sampler.epoch, i) for i in self.sampler])

    def __len__(self):
        return len(self.sampler)


class PretrainDataset(Dataset):
    """Multi-view samples whose augmentation is a pure function of (seed, epoch, index): the same
    images and views for any number of workers or ranks, and after a resume.

    An unreadable image is replaced by the next readable one; the sample reports the index and
    the reason so the main process can log it once and count it.
    """

    def __init__(self, dataset, transform, seed):
        self.dataset, self.transform, self.seed = dataset, transform, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        return self.sample(key, lambda i: self.dataset[i][0])

    def decoded(self, key):
        """The sample of `key` with its image decoded here, whatever the dataset's loader (an image the
        device's decoder could not read, sce.device_decode)."""
        return self.sample(key, lambda i: load_rgb_tensor(self.dataset.path(i)))

    def sample(self, key, read):
        epoch, index = key
        bad, reason = -1, ""
        for attempt in range(len(self.dataset)):
            i = (index + attempt) % len(self.dataset)
            try:
                img = read(i)
                break
            except Exception as e:  # decode errors come as many exception types
                if bad < 0:
                    bad, reason = i, f"{type(e).__name__}: {e}"[:300]
        else:
            raise UserError(f"no image of the dataset is readable ({image_path(self.dataset, bad)}: {reason}): check "
                            "--data")
        with torch.random.fork_rng(devices=[]):
            # the CPU generator alone: torch.manual_seed would also queue a CUDA seeding, with a
            # stack trace, in every worker (0.5 ms a sample)
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
            views = self.transform(img)
        if isinstance(views, EncodedSample):
            views.key = key
        return views, bad, reason


class ResumableSampler(Sampler):
    """Yields (epoch, index) for this rank. Each epoch is a seeded permutation cut into global
    batches of `global_batch`; rank r takes the r-th slice of each, so N ranks see exactly the
    global batches one process would. set_epoch(epoch, start_step) skips finished steps."""

    def __init__(self, num_samples, global_batch, rank=0, world_size=1, seed=0):
        self.n, self.batch, self.rank, self.world, self.seed = num_samples, global_batch, rank, world_size, seed
        self.steps = num_samples // global_batch
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch, start_step=0):
        self.epoch, self.start_step = epoch, start_step

    def __len__(self):
        return (self.steps - self.start_step) * (self.batch // self.world)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.n, generator=g)[:self.steps * self.batch]
        mine = perm.view(self.steps, self.world, -1)[self.start_step:, self.rank].flatten()
        return iter([(self.epoch, i) for i in mine.tolist()])


def note_bad_images(bad, reasons, dataset, bad_seen, max_bad):
    """Log each unreadable image once (it was replaced by a readable one) and stop past max_bad."""
    if bool((bad >= 0).any()):
        for index, reason in zip(bad.tolist(), reasons):
            if index >= 0 and index not in bad_seen:
                bad_seen[index] = reason
                path = dataset.dataset.path(index) if hasattr(dataset.dataset, "path") else f"#{index}"
                print(f"warning: skipping unreadable image {path} ({reason})", flush=True)
        if len(bad_seen) > max_bad:
            raise UserError(f"{len(bad_seen)} unreadable images, more than --max-bad-images {max_bad}: "
                            "fix or remove them (see the warnings above)")
