"""Feature extraction, its cache for the scikit-learn evaluations, and the weighted kNN classifier (Wu et al.
2018, as in the MoCo / SCE monitors), shared by every rank.

Each rank extracts its own shard of the train (bank) and val (query) splits: no image twice, none
dropped. The bank stays sharded; the queries are gathered. For each chunk of queries every rank
takes the top-k of its bank shard on the device, the candidates of all ranks are gathered and
merged, so every rank ends with the scores one process would compute. Peak device memory per rank:
its bank shard (N_train / ranks x D), all queries (N_val x D), one chunk of similarities
(chunk x N_train / ranks) and the gathered candidates (ranks x chunk x k).
"""
import hashlib
import json
import os
import time
import warnings

import torch
import torch.nn.functional as F

from sce import UserError
from sce import distributed as du
from sce.checkpoint import save_atomic
from sce.engine import error_line, revert_to_eager
from sce.progress import Progress


@torch.no_grad()
def extract_features(trunk, batches, channels_last=False, normalize=True, name=None):
    """Trunk features (l2-normalised unless normalize=False) and labels of a split's batches (of
    sce.data.EvalSplit.batches: images and targets on the device), in their order, with the trunk in eval
    mode. `name`: print progress on rank 0."""
    was_training = trunk.training
    trunk.eval()
    feats, labels = [], []
    progress, shown = Progress(len(batches.sampler)), time.time()
    for images, targets in batches:
        if channels_last:
            images = images.to(memory_format=torch.channels_last)
        out = trunk(images).float()
        feats.append(F.normalize(out, dim=1) if normalize else out)
        labels.append(targets)
        progress.update(len(images))
        if name and du.is_main() and (progress.done == progress.total or time.time() - shown > 30):
            shard = f" (this rank's share of {du.world_size()})" if du.world_size() > 1 else ""
            print(f"{name}: {progress.report()}{shard}", flush=True)
            shown = time.time()
    trunk.train(was_training)
    return torch.cat(feats), torch.cat(labels)


def split_features(trunk, split, name, output_dir, /, *, checkpoint, batch_size=256, amp_dtype=None, **key):
    """Global-average-pooled features (float32 numpy, not normalised) of every image of `split` (an
    sce.data.EvalSplit), in order, with the trunk in eval mode, on one process.

    Cached in OUTPUT_DIR/features_<name>_<hash>.pt. The key: the checkpoint file (path, size, mtime), the split's
    name, size and route and geometry, the autocast dtype, the caller's **key (encoder, arch, data path, ...). It
    is stored in the file and compared on reading; a file that does not load is recomputed."""
    st = os.stat(checkpoint)
    key = dict(key, checkpoint=os.path.abspath(checkpoint), mtime_ns=st.st_mtime_ns, size=st.st_size,
               split=name, n=len(split), read=split.describe(), amp=str(amp_dtype))
    key = json.loads(json.dumps(key, sort_keys=True, default=str))  # as it reads back from the file
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(output_dir, f"features_{name}_{digest}.pt")
    if os.path.isfile(path):
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            if blob.get("key") == key:
                print(f"{name}: features read from {path}", flush=True)
                return blob["features"].numpy()
        except Exception as e:  # a truncated or foreign file: compute it again
            print(f"warning: ignoring unreadable feature cache {path} ({type(e).__name__})", flush=True)
    device = next(trunk.parameters()).device
    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        feats, _ = extract_features(trunk, split.batches(batch_size), normalize=False, name=f"{name} features")
    feats = feats.cpu()
    os.makedirs(output_dir, exist_ok=True)
    save_atomic({"key": key, "features": feats}, path)
    return feats.numpy()


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


def knn_accuracy(trunk, train_set, val_set, num_classes, k=200, t=0.07, batch_size=256, max_train=None, seed=0):
    """(top-1, top-5) of the kNN classifier on the train_set bank (a seeded subset of max_train images if given),
    measured on val_set (sce.data.EvalSplits); called by every rank, the same result on each."""
    if max_train and max_train < len(train_set):
        train_set = train_set.subset(torch.randperm(len(train_set),
                                                    generator=torch.Generator().manual_seed(seed))[:max_train])
    if min(len(train_set), len(val_set)) < du.world_size():  # every rank raises: none waits for an empty shard
        raise UserError(f"the kNN splits ({len(train_set)} train, {len(val_set)} val images) need at least one "
                        f"image per rank ({du.world_size()}): use more images or a larger --knn-max-train")
    bank, bank_labels = extract_features(trunk, train_set.batches(batch_size), name="train features")
    queries, labels = (gather_rows(x) for x in extract_features(trunk, val_set.batches(batch_size),
                                                                name="val features"))
    return topk_accuracy(knn_scores(bank, bank_labels, queries, num_classes, k, t), labels)


class Monitor:
    """The kNN monitor of main_pretrain.py: monitor(model) -> the kNN (top-1, top-5) of its online encoder on
    `sets` (train EvalSplit, val EvalSplit, number of classes), every rank its share. BN running statistics are
    rank-local and only serve evaluation: every rank takes rank 0's, the checkpoint's. compiled: the encoder is
    compiled, and compiles again in eval mode: a failure there costs the monitor nothing (it runs eagerly)."""

    def __init__(self, sets, k, t, max_train=None, seed=0, compiled=False, compiles=None):
        self.sets, self.k, self.t, self.max_train, self.seed = sets, k, t, max_train, seed
        self.compiled, self.compiles = compiled, compiles

    def accuracy(self, model):
        before = len(self.compiles.seconds) if self.compiles else 0
        result = knn_accuracy(model.encoder, *self.sets, self.k, self.t, max_train=self.max_train, seed=self.seed)
        if self.compiles and len(self.compiles.seconds) > before and du.is_main():  # eval mode, the last batch
            print(f"=> the kNN monitor compiled the encoder: {self.compiles.summary(before)}", flush=True)
        return result

    def __call__(self, model):
        for buffer in model.encoder.buffers():
            du.broadcast(buffer)
        if not self.compiled:
            return self.accuracy(model)
        try:
            return self.accuracy(model)
        except Exception as e:  # noqa: BLE001: whatever stopped the compiled encoder, the eager one decides
            revert_to_eager(model.encoder)
            self.compiled = False
            result = self.accuracy(model)
            warnings.warn(f"--compile: the kNN monitor's compile failed ({error_line(e)}): the encoder runs eagerly")
            return result
