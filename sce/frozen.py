"""The frozen trunk of the evaluation scripts (main_lincls.py, main_lowshot.py): read from any checkpoint we accept,
on the device in eval mode, compiled once where asked (one batch shape: a partial batch is padded, and every pass
runs under no_grad, so nothing compiles again); and the cached features of a split."""
import dataclasses
import hashlib
import json
import os

import torch
import torch.nn as nn

from sce import preemption
from sce.checkpoint import checkpoint_arch, load_trunk, save_atomic
from sce.compiling import Log, compile_module
from sce.foreign import resnet_arch
from sce.knn import extract_features, padded


@dataclasses.dataclass
class Frozen:
    """A frozen trunk and what was read with it: its checkpoint, arch, whether its stem is the small-input one."""
    trunk: nn.Module
    feat_dim: int
    ckpt: dict
    arch: str
    small_input: bool
    compiled: bool = False

    @torch.no_grad()
    def __call__(self, images, batch_size):
        """Features of a batch, under no_grad; compiled, a batch smaller than `batch_size` is padded to it."""
        return padded(self.trunk, images, batch_size if self.compiled else None)

    def describe(self):
        return f"{self.arch}{' (small input)' if self.small_input else ''} trunk ({self.feat_dim}-d)"


def load_frozen(path, arch=None, small_input=None, encoder="online", device=torch.device("cpu"), compile=False,
                compiles=None):
    """The Frozen trunk of checkpoint `path` (arch, small_input: None for the checkpoint's), on `device` in eval mode,
    torch.compile'd when `compile` (a failed compile warns and runs it eagerly)."""
    trunk, feat_dim, ckpt = load_trunk(path, arch, small_input, encoder)
    arch = arch or checkpoint_arch(ckpt)[0] or resnet_arch(trunk.state_dict())[0]  # load_trunk's, from the shapes
    trunk.to(device).eval()
    if compile:
        compile_module(trunk, "trunk", compiles or Log())
    return Frozen(trunk, feat_dim, ckpt, arch, isinstance(trunk.maxpool, nn.Identity), compile)


def split_features(frozen, split, name, output_dir, /, *, checkpoint, batch_size=256, amp_dtype=None, **key):
    """Global-average-pooled features (float32 numpy, not normalised) of every image of `split` (an
    sce.data.EvalSplit), in order, on one process.

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
    device = next(frozen.trunk.parameters()).device
    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None), \
            preemption.safe_points(f"extracting the {name} features"):  # the loader's teardown too
        feats, _ = extract_features(frozen.trunk, split.batches(batch_size), normalize=False, name=f"{name} features",
                                    pad_to=min(batch_size, len(split)) if frozen.compiled else None)
    feats = feats.cpu()
    os.makedirs(output_dir, exist_ok=True)
    save_atomic({"key": key, "features": feats}, path, what="feature cache")
    return feats.numpy()
