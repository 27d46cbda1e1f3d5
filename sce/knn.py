"""Feature extraction and the weighted kNN classifier (Wu et al. 2018, as in the MoCo / SCE monitors), shared by
every rank: main_lincls.py --knn and the kNN monitor of main_pretrain.py.

Each rank extracts its own shard of the train (bank) and val (query) splits: no image twice, none
dropped. The bank stays sharded; the queries are gathered. For each chunk of queries every rank
takes the top-k of its bank shard on the device, the candidates of all ranks are gathered and
merged, so every rank ends with the scores one process would compute. Peak device memory per rank:
its bank shard (N_train / ranks x D), all queries (N_val x D), one chunk of similarities
(chunk x N_train / ranks) and the gathered candidates (ranks x chunk x k).
"""
import functools
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sce import UserError, preemption
from sce import distributed as du
from sce.compiling import Fallback, Log
from sce.timing import Stopwatch
from sce.progress import Progress


def padded(trunk, images, batch_size=None):
    """trunk(images); a batch smaller than `batch_size` padded to it with zeros first, so that a compiled trunk sees
    one shape (the rows of a trunk in eval mode do not depend on each other)."""
    n = len(images)
    if batch_size and n < batch_size:
        images = torch.cat([images, images.new_zeros((batch_size - n,) + images.shape[1:])])
    return trunk(images)[:n]


@torch.no_grad()
def extract_features(trunk, batches, channels_last=False, normalize=True, name=None, pad_to=None, forward=None):
    """Trunk features (l2-normalised unless normalize=False) and labels of a split's batches (of
    sce.data.EvalSplit.batches: images and targets on the device), in their order, with the trunk in eval
    mode. `name`: print progress on rank 0. pad_to: every smaller batch is padded to this many images (a compiled
    trunk sees one shape: no second compile). forward: how to call the trunk (default: trunk(images)). A stop signal
    before a run's loop holds them stops it between two batches (sce.preemption.safe_points)."""
    with preemption.safe_points(f"extracting the {name or 'features'}"):
        return _extract(trunk, batches, channels_last=channels_last, normalize=normalize, name=name, pad_to=pad_to,
                        forward=forward)


def _extract(trunk, batches, *, channels_last, normalize, name, pad_to, forward):
    was_training = trunk.training
    trunk.eval()
    feats, labels = [], []
    progress, shown = Progress(len(batches.sampler)), time.time()
    for images, targets in batches:
        preemption.check()
        if channels_last:
            images = images.to(memory_format=torch.channels_last)
        out = padded(forward or trunk, images, pad_to).float()
        feats.append(F.normalize(out, dim=1) if normalize else out)
        labels.append(targets)
        progress.update(len(images))
        if name and du.is_main() and (progress.done == progress.total or time.time() - shown > 30):
            shard = f" (this rank's share of {du.world_size()})" if du.world_size() > 1 else ""
            print(f"{name}: {progress.report()}{shard}", flush=True)
            shown = time.time()
    trunk.train(was_training)
    return torch.cat(feats), torch.cat(labels)


def gather_rows(x):
    """Concatenate every rank's rows (their counts may differ by one) in rank order."""
    if du.world_size() == 1:
        return x
    counts = du.all_gather(torch.tensor([len(x)], device=x.device))
    padded = torch.zeros((int(counts.max()),) + x.shape[1:], dtype=x.dtype, device=x.device)
    padded[:len(x)] = x
    rows = du.all_gather(padded).view(du.world_size(), -1, *x.shape[1:])
    return torch.cat([rows[r, :n] for r, n in enumerate(counts.tolist())])


@torch.no_grad()
def knn_scores(bank, bank_labels, queries, num_classes, k=200, t=0.07, chunk=1024):
    """Class scores: each of the k nearest bank features (cosine) votes exp(cos / t) for its label.
    Under several ranks `bank` is this rank's shard and the queries are the same on every rank.
    Similarities and votes stay in fp32 inside an autocast region (main_lincls.py --knn --amp)."""
    scores = []
    for q in queries.split(chunk):
        with torch.autocast(q.device.type, enabled=False):
            sim, idx = (q @ bank.T).topk(min(k, len(bank)), dim=1)
        labels = bank_labels[idx]
        if du.world_size() > 1:  # k candidates from every rank (padded with weight-0 ones), best k overall
            pad = k - sim.shape[1]
            sim = F.pad(sim, (0, pad), value=float("-inf"))
            labels = F.pad(labels, (0, pad))
            sim = du.all_gather(sim).view(du.world_size(), len(q), k).permute(1, 0, 2).reshape(len(q), -1)
            labels = du.all_gather(labels).view(du.world_size(), len(q), k).permute(1, 0, 2).reshape(len(q), -1)
            sim, best = sim.topk(k, dim=1)
            labels = labels.gather(1, best)
        sim = sim.to(torch.promote_types(sim.dtype, torch.float32))  # votes in fp32 at least, even under --amp
        votes = torch.zeros(len(q), num_classes, dtype=sim.dtype, device=sim.device)
        scores.append(votes.scatter_add_(1, labels, (sim / t).exp()))
    return torch.cat(scores)


def topk_accuracy(scores, labels, ks=(1, 5)):
    """Percent of rows whose label is among the top-k scores, for each k."""
    top = scores.topk(min(max(ks), scores.shape[1]), dim=1).indices
    hit = top == labels.view(-1, 1).to(top.device)
    return [100.0 * hit[:, :k].any(dim=1).float().mean().item() for k in ks]


class KnnResult(NamedTuple):
    """What knn_accuracy measured, in %."""
    top1: float
    top5: float
    probe_top1: float = None  # a linear head's (the online probe's) top-1 on the same val features, or None


def knn_accuracy(trunk, train_set, val_set, num_classes, k=200, t=0.07, batch_size=256, max_train=None, seed=0,
                 pad=False, forward=None, head=None):
    """The KnnResult of the kNN classifier on the train_set bank (a seeded subset of max_train images if given),
    measured on val_set (sce.data.EvalSplits); called by every rank, the same result on each. pad: every batch of
    both splits padded to one size (extract_features), for a compiled trunk; forward: extract_features'. head: a
    linear head on the trunk's features (the online probe's), whose top-1 on the same val features it adds."""
    if max_train and max_train < len(train_set):
        train_set = train_set.subset(torch.randperm(len(train_set),
                                                    generator=torch.Generator().manual_seed(seed))[:max_train])
    if min(len(train_set), len(val_set)) < du.world_size():  # every rank raises: none waits for an empty shard
        raise UserError(f"the kNN splits ({len(train_set)} train, {len(val_set)} val images) need at least one "
                        f"image per rank ({du.world_size()}): use more images or a larger --knn-max-train")
    pad_to = min(batch_size, max(len(train_set), len(val_set))) if pad else None
    with preemption.safe_points("computing the kNN"):  # the loaders' teardown too
        return _knn(trunk, train_set, val_set, num_classes, k=k, t=t, batch_size=batch_size, pad_to=pad_to,
                    forward=forward, head=head)


def _knn(trunk, train_set, val_set, num_classes, *, k, t, batch_size, pad_to, forward, head):
    bank, bank_labels = extract_features(trunk, train_set.batches(batch_size), name="train features", pad_to=pad_to,
                                         forward=forward)
    features, labels = (gather_rows(x) for x in extract_features(trunk, val_set.batches(batch_size), normalize=False,
                                                                 name="val features", pad_to=pad_to, forward=forward))
    top1, top5 = topk_accuracy(knn_scores(bank, bank_labels, F.normalize(features, dim=1), num_classes, k, t), labels)
    if head is None:
        return KnnResult(top1, top5)
    with torch.no_grad(), torch.autocast(features.device.type, enabled=False):
        return KnnResult(top1, top5, topk_accuracy(head(features), labels, ks=(1,))[0])


class Monitor:
    """The kNN monitor of main_pretrain.py: monitor(model) -> the KnnResult of its online encoder on `sets` (train
    EvalSplit, val EvalSplit, number of classes), every rank its share. BN running statistics are
    rank-local and only serve evaluation: every rank takes rank 0's, the checkpoint's. compiled: the encoder is
    compiled, and compiles once more, in eval mode, at the first call (the last batch padded: no other shape); a
    failure there costs the monitor nothing: its calls of the encoder run eagerly from then on (sce.compiling.Fallback
    around each call, not around the collectives; the training's compiled encoder stays). Of the last call:
    `compile_s`, `images` (how many it read). stopwatch: the Stopwatch of its runs (the kNN's part of the time split,
    sce.timing.Split.stopwatch), its compiles left to compiling's."""

    def __init__(self, sets, k, t, max_train=None, seed=0, compiled=False, compiles=None, stopwatch=None):
        self.sets, self.k, self.t, self.max_train, self.seed, self.compiled = sets, k, t, max_train, seed, compiled
        self.compiles = compiles or Log()
        self.stopwatch = stopwatch or Stopwatch(self.compiles)
        self.images = self.compile_s = None
        # the kNN data's classes by name (sce.data.EvalSplit.classes; unnamed: their numbers)
        self.classes = getattr(sets[0], "classes", None) or [str(i) for i in range(sets[2])]
        self.said_classes = False  # that the probe's classes are not the kNN data's
        self.fallback = Fallback("the kNN monitor's encoder", lambda encoder, x: encoder(x),
                                 lambda encoder, x: encoder._call_impl(x)) if compiled else None

    def __call__(self, model, probe=None):
        """The KnnResult, with the online probe's top-1 where `probe` (sce.step.OnlineProbe, trained on --data's
        labels) is given and learns the kNN data's classes (the same names in the same order), else said once."""
        return self.stopwatch.timed(self._run, model, probe)

    def _run(self, model, probe):
        other = probe.other_classes(self.classes) if probe is not None else None
        if other and du.is_main() and not self.said_classes:
            print(f"=> the online probe's val top-1 is not read: the kNN data's classes are not the ones it learns "
                  f"({other})", flush=True)
        self.said_classes = self.said_classes or bool(other)
        head = probe.head if probe is not None and not other else None
        logged, before = self.compiles.total(), len(self.compiles.seconds)
        for buffer in model.encoder.buffers():
            du.broadcast(buffer)
        forward = functools.partial(self.fallback, model.encoder) if self.fallback else None
        result = knn_accuracy(model.encoder, *self.sets, self.k, self.t, max_train=self.max_train, seed=self.seed,
                              pad=self.compiled, forward=forward, head=head)
        if len(self.compiles.seconds) > before and du.is_main():  # the encoder in eval mode
            print(f"=> the kNN monitor compiled the encoder: {self.compiles.summary(before)}", flush=True)
        train = min(len(self.sets[0]), self.max_train or len(self.sets[0]))
        self.images, self.compile_s = train + len(self.sets[1]), self.compiles.total() - logged
        return result
