"""The authors' SCE code (CEA-LIST/SCE, unedited, from a checkout the user names) on an ImageFolder, and their
trunk out of its checkpoint as a torchvision state dict that main_lincls.py loads. Run with the interpreter of
their environment (benchmarks/fidelity/authors_reference.sh says which pins):

    python benchmarks/fidelity/authors_reference.py pretrain AUTHORS_DIR DATA_DIR RUN_DIR [HYDRA_OVERRIDE ...]
    python benchmarks/fidelity/authors_reference.py trunk CHECKPOINT OUT_PTH
    python benchmarks/fidelity/authors_reference.py unpack WHEELS_DIR SITE_DIR

`pretrain` runs their run/pretrain.py with its CIFAR-10 configuration (resnet18_cifar10.yaml) on DATA_DIR/train
(DATA_DIR/val must exist: their folder datamodule checks both), writing into RUN_DIR; a rerun resumes from the
last checkpoint there. Four things their code needs today are done here, none by editing their files:
  - sce.transforms imports a module their repository never had: a stand-in is registered before;
  - numpy 2 has no np.Inf, which Lightning 1.7's checkpoint callback reads: aliased to np.inf;
  - their CIFAR-10 config passes initial_temp_m / warmup_epoch_temp_m, which their SCEModel does not take:
    removed from the config (tau_m stays at its temp_m, 0.05);
  - their CIFAR-10 datamodule downloads the official files and their folder datamodule leaves num_classes
    abstract: a 10-class folder datamodule (ImageFolder10 below) replaces it.
Their run stops with one line when each of its first 3 batches holds one class (MixedBatches): their loader
shuffles only when Lightning's DDP adds a sampler or the caller asks (authors_reference.sh does).
`unpack` puts their pins (pure-Python wheels) into SITE_DIR, once, for their runs' PYTHONPATH: a wheel is a zip
archive, unpacked as it is, because pip 24.1 and later refuse pytorch-lightning 1.7.7's metadata ("torch
(>=1.9.*)") even with --no-deps. Lightning 1.7 loads its own checkpoints with torch.load's old default
(weights_only=False), which torch 2.6 and later no longer assume: resuming sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
(their own files, trusted). With AUTHORS_DEADLINE (a Unix time) set, the run ends at the end of the last epoch that fits
before it (StopAtDeadline).
"""
import os
import runpy
import sys
import time
import types

# Hydra overrides that fit their CIFAR-10 config to our data and today's packages (the checkpoint cadence, the
# epochs, precision and the seed come from the caller)
MIXED_BATCHES = 3  # their first batches whose classes are counted (MixedBatches)
FIT_OVERRIDES = ["~model.initial_temp_m", "~model.warmup_epoch_temp_m", "datamodule._target_=__main__.ImageFolder10"]


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def install_helps(authors_dir):
    """Their package importable from AUTHORS_DIR, with the missing module and np.Inf in place."""
    if not os.path.isfile(os.path.join(authors_dir, "run", "pretrain.py")) or not os.path.isfile(
            os.path.join(authors_dir, "sce/configs/run/pretrain/sce/resnet18/resnet18_cifar10.yaml")):
        fail(f"{authors_dir} is not a checkout of CEA-LIST/SCE (no run/pretrain.py and resnet18_cifar10.yaml): "
             "pass the folder their repository was cloned into")
    sys.path.insert(0, authors_dir)
    try:
        import hydra, kornia, omegaconf, pkg_resources, pytorch_lightning, torchmetrics  # noqa: F401
    except ImportError as e:
        fail(f"{e.name} does not import in {sys.executable} ({e}): install the pins of docs/benchmarks.md "
             "(\"The authors' code on our data\") or pass AUTHORS_WHEELS")
    if not pytorch_lightning.__version__.startswith("1.7.") or not torchmetrics.__version__.startswith("0.10."):
        fail(f"their code needs pytorch-lightning 1.7 and torchmetrics 0.10, {sys.executable} has "
             f"{pytorch_lightning.__version__} and {torchmetrics.__version__}: install the pins of docs/benchmarks.md")
    import numpy as np
    if not hasattr(np, "Inf"):
        np.Inf = np.inf

    class LogisticRegressionClassifierTransform:  # their logistic-regression evaluation only, not pretraining
        def __init__(self, *args, **kwargs):
            raise RuntimeError("sce.transforms.logistic_regression_transform is missing from the authors' code")

    name = "sce.transforms.logistic_regression_transform"
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].LogisticRegressionClassifierTransform = LogisticRegressionClassifierTransform
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")


def mixed_or_fail(mixes):
    """Given the classes in each of their first batches: a line saying so, or, when each held one class, the error
    that stops their run (their loader is not shuffling: its kNN would read low and clear our code wrongly)."""
    if max(mixes) == 1:
        fail(f"each of their first {len(mixes)} batches holds one class: their loader does not shuffle (pass "
             "+datamodule.train.loader.shuffle=True, as authors_reference.sh does)")
    print(f"=> their first {len(mixes)} batches hold {', '.join(map(str, mixes))} classes", flush=True)


def pretrain(authors_dir, data_dir, run_dir, overrides):
    authors_dir, data_dir, run_dir = (os.path.abspath(p) for p in (authors_dir, data_dir, run_dir))
    for split in ("train", "val"):
        if not os.path.isdir(os.path.join(data_dir, split)):
            fail(f"{data_dir} has no {split}/ folder: pass an ImageFolder with train/ and val/ class folders")
    install_helps(authors_dir)
    from pytorch_lightning import Callback
    from sce.datamodule import FolderDataModule  # theirs

    class ImageFolder10(FolderDataModule):
        """Their folder datamodule with CIFAR-10's class count (train/ and val/ of DATA_DIR)."""
        num_classes = 10

    class StopAtDeadline(Callback):
        """Ends fit at an epoch's end when one more epoch would pass `deadline` (a Unix time): the checkpoint
        callback has saved that epoch, and a rerun resumes at the next."""
        def __init__(self, deadline):
            self.deadline, self.epoch_started = float(deadline), time.time()

        def on_train_epoch_start(self, trainer, pl_module):
            self.epoch_started = time.time()

        def on_train_epoch_end(self, trainer, pl_module):
            if 2 * time.time() - self.epoch_started > self.deadline:
                print(f"=> StopAtDeadline: epoch {trainer.current_epoch} ended; one more would pass the deadline",
                      flush=True)
                trainer.should_stop = True

    class MixedBatches(Callback):
        """Says how many classes each of their first batches holds, and stops the run when every one of the first
        MIXED_BATCHES holds one: an unshuffled loader over a folder sorted by class (mixed_or_fail)."""
        def __init__(self):
            self.mixes = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if len(self.mixes) < MIXED_BATCHES:
                self.mixes.append(len(set(batch["label"].tolist())))
                if len(self.mixes) == MIXED_BATCHES:
                    mixed_or_fail(self.mixes)

    overrides = [*overrides, "+callbacks.mixed_batches._target_=__main__.MixedBatches"]
    deadline = os.environ.get("AUTHORS_DEADLINE")
    if deadline:
        overrides = [*overrides, "+callbacks.deadline._target_=__main__.StopAtDeadline",
                     f"+callbacks.deadline.deadline={deadline}"]
    script = os.path.join(authors_dir, "run", "pretrain.py")
    sys.argv = [script, f"datamodule.datadir={data_dir}", f"dir.run={run_dir}", *FIT_OVERRIDES, *overrides]
    # their script runs as __main__ (Hydra finds its config beside the file), our two classes in its namespace
    runpy.run_path(script, init_globals={"ImageFolder10": ImageFolder10, "StopAtDeadline": StopAtDeadline,
                                         "MixedBatches": MixedBatches},
                   run_name="__main__")

def unpack(wheels_dir, site):
    """Every wheel of wheels_dir unpacked into site (skipped when site/.installed exists)."""
    import glob
    import zipfile
    wheels = sorted(glob.glob(os.path.join(wheels_dir, "*.whl")))
    if not wheels:
        fail(f"{wheels_dir} holds no .whl files: pass the bundle's wheels folder (authors_reference.sh bundle)")
    if os.path.isfile(os.path.join(site, ".installed")):
        return
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    open(os.path.join(site, ".installed"), "w").close()
    print(f"=> {len(wheels)} wheels unpacked into {site}")


def extract_trunk(checkpoint, out):
    """Their online trunk (state_dict's trunk.*: torchvision's resnet18 with a 3x3 stride-1 conv1, no max-pool,
    fc an Identity) as a plain torchvision state dict."""
    import torch
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=False)  # their Lightning file: trusted
    state = {k[len("trunk."):]: v for k, v in ckpt.get("state_dict", {}).items() if k.startswith("trunk.")}
    if "conv1.weight" not in state:
        fail(f"{checkpoint} holds no trunk.* weights: pass a checkpoint of the authors' pretraining")
    torch.save(state, out)
    print(f"=> {len(state)} tensors of their trunk (epoch {ckpt.get('epoch')}) saved to {out}")


if __name__ == "__main__":
    usage = ("usage: authors_reference.py pretrain AUTHORS_DIR DATA_DIR RUN_DIR [HYDRA_OVERRIDE ...] | "
             "trunk CHECKPOINT OUT_PTH | unpack WHEELS_DIR SITE_DIR")
    if len(sys.argv) >= 5 and sys.argv[1] == "pretrain":
        pretrain(*sys.argv[2:5], sys.argv[5:])
    elif len(sys.argv) == 4 and sys.argv[1] == "trunk":
        extract_trunk(*sys.argv[2:4])
    elif len(sys.argv) == 4 and sys.argv[1] == "unpack":
        unpack(*sys.argv[2:4])
    else:
        fail(usage)
