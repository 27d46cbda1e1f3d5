"""The linear probe of main_lincls.py, in the shape of pretraining's loop (sce.epoch): its settings in one object
(Probe, with the lr of any step for both schedules), one epoch of the head's steps on the frozen trunk's features,
the validation, and its checkpoint. The trunk runs under no_grad in eval mode (its BN keeps its statistics): only
the head learns, and a compiled trunk compiles once for the training, its last partial batch and the validation. On
one GPU process the head's step replays a CUDA graph (Step)."""
import argparse
import dataclasses
import math
import os

import torch
import torch.nn.functional as F

from sce import UserError
from sce import distributed as du
from sce.checkpoint import Writer, link_atomic
from sce.cuda_graph import GRAPH_WARMUP, CudaGraphs, Graphed, lr_as_tensors, usable
from sce.optim import cosine_lr, set_lr
from sce.outdir import same_path
from sce.preemption import Preemption
from sce.timing import Stopwatch


@dataclasses.dataclass(frozen=True)
class Probe:
    """The probe's settings, read once from the flags."""
    epochs: int
    steps: int  # per epoch
    per_rank: int  # images a step on each rank
    lr: float
    schedule: str  # step or cosine
    milestones: tuple
    warmup_epochs: int
    print_freq: int
    amp: object  # the autocast dtype, or None
    data: dict = None  # the train split's num_images, data_id and data_order: a resume within an epoch needs the same

    @classmethod
    def of(cls, args, num_samples, amp, data):
        per_rank = args.batch_size // du.world_size()
        return cls(epochs=args.epochs, steps=math.ceil(num_samples / per_rank), per_rank=per_rank, lr=args.lr,
                   schedule=args.schedule, milestones=tuple(args.milestones), warmup_epochs=args.warmup_epochs,
                   print_freq=args.print_freq, amp=amp, data=data)

    def lr_at(self, step):
        """The lr of global step `step`: x0.1 at each milestone epoch (step), or a linear warmup then a cosine decay
        over every step (cosine)."""
        if self.schedule == "step":
            return self.lr * 0.1 ** sum(step // self.steps >= m for m in self.milestones)
        return cosine_lr(step, self.epochs * self.steps, self.lr, self.warmup_epochs * self.steps)

    def autocast(self, device):
        """The probe's autocast, the same for its training steps and validation: a compiled trunk's guards compare
        the cache flag, and a CUDA graph's capture must not keep autocast's cast weights (the trunk runs under
        no_grad, where the cache is not used anyway)."""
        return torch.autocast(device.type, dtype=self.amp, enabled=self.amp is not None, cache_enabled=False)


@dataclasses.dataclass
class Head:
    """What the probe trains and with what: the frozen trunk (sce.frozen.Frozen), the linear head, the same wrapped
    in DDP on several ranks, its optimizer and GradScaler."""
    trunk: object
    head: torch.nn.Linear
    ddp: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler

    def logits(self, probe, images, wrapped=True):
        features = self.trunk(images, probe.per_rank)
        return (self.ddp if wrapped else self.head)(features).float()

    def state(self):
        """A torchvision ResNet's state dict: the trunk's, then fc.weight and fc.bias."""
        return dict(self.trunk.trunk.state_dict(), **{f"fc.{k}": v for k, v in self.head.state_dict().items()})


def make_head(feat_dim, num_classes, device):
    """fc: N(0, 0.01) weights and zero bias, as MoCo's."""
    head = torch.nn.Linear(feat_dim, num_classes).to(device)
    torch.nn.init.normal_(head.weight, 0.0, 0.01)
    torch.nn.init.zeros_(head.bias)
    return head


@dataclasses.dataclass(frozen=True)
class ProbeRun:
    """What a probe's epoch needs besides its number: the settings, the collaborators."""
    args: argparse.Namespace
    probe: Probe
    model: Head
    train: object  # the train split's batches (sce.data.EvalSplit.batches), in the sampler's order
    val: object  # the val split's
    device: torch.device
    preemption: Preemption
    tensorboard: object  # TensorBoard SummaryWriter on rank 0, else None
    checkpoints: Writer  # rank 0's background checkpoint writer
    validation: Stopwatch  # the validations' time (the split's evaluation part)
    step: object  # the head's step (Step)


class Step:
    """The head's step on a batch: the cross-entropy of the head on the frozen trunk's features, its backward and the
    optimizer's step, with the bookkeeping on the device (no host sync): `sums`, this rank's (loss sum, images) of
    the epoch, is added to, and `first_bad` keeps (step, loss) of the epoch's first non-finite loss.
    graphs (sce.cuda_graph.CudaGraphs, or the tests' CPU stand-in; one process without GradScaler): replayed from a
    CUDA graph (sce.cuda_graph.Graphed) captured on the first whole batch after `warmup` eager steps: one launch
    where the eager step makes dozens from Python (on an H200 the eager probe waited on the host: ~64,000 images/s
    where the same trunk extracts features at ~145,000). The lr reaches the graph as a device tensor (lr_as_tensors,
    filled by set_lr), the step's index through `index`; a batch of another size (an epoch's last) runs eagerly."""

    def __init__(self, probe, model, sums, graphs=None, warmup=GRAPH_WARMUP):
        self.probe, self.model, self.sums = probe, model, sums
        self.first_bad = torch.full((2,), -1.0, device=sums.device)
        self.index = torch.zeros((), device=sums.device)  # the step's index in its epoch, for first_bad
        self.graph = Graphed(self._step, graphs, "the probe's step", warmup,
                             whole=lambda images, target: len(images) == probe.per_rank) if graphs else None
        if graphs:
            lr_as_tensors(model.optimizer, sums.device)

    @property
    def graphed(self):
        return self.graph is not None and self.graph.graphed

    def __call__(self, images, target, i):
        """The step on (images, target), step `i` of its epoch; returns its loss (a graph's: overwritten by the
        next step)."""
        self.index.fill_(i)
        return self._step(images, target) if self.graph is None else self.graph(images, target)

    def _step(self, images, target):
        probe, model = self.probe, self.model
        with probe.autocast(images.device):
            loss = F.cross_entropy(model.logits(probe, images), target)
        bad_now = torch.stack([self.index, loss.detach()])
        self.first_bad.copy_(torch.where((self.first_bad[0] < 0) & ~torch.isfinite(loss), bad_now, self.first_bad))
        model.optimizer.zero_grad(set_to_none=True)
        model.scaler.scale(loss).backward()
        model.scaler.step(model.optimizer)
        model.scaler.update()
        n = torch.full((), len(images), dtype=torch.float64, device=images.device)
        self.sums += torch.stack([loss.detach().double() * n, n])
        return loss


def graphs_for(args, device, world):
    """The CUDA graphs of the probe's step (sce.cuda_graph.CudaGraphs), or None (sce.cuda_graph.usable)."""
    return CudaGraphs(device) if usable(args.cuda_graph, device, world, args.amp, "the probe's step") else None


def train_probe_epoch(run, epoch, start, progress):
    """The head's steps of epoch `epoch` from step `start` (run.step adds to its sums, this rank's (loss sum, images)
    of the epoch so far). Returns the step to resume from if a stop was requested (its state is the caller's to
    save), else None. A non-finite loss is noted on the device and stops the run at the next progress line."""
    probe, model, step = run.probe, run.model, run.step
    step.first_bad.fill_(-1.0)
    for i, (images, target) in enumerate(run.train, start=start):
        set_lr(model.optimizer, probe.lr_at(epoch * probe.steps + i))
        loss = step(images, target, i)
        progress.update(len(images) * du.world_size())
        if (i + 1) % probe.print_freq == 0 or i + 1 == probe.steps:
            stop_if_nonfinite(step.first_bad, epoch)
            if du.is_main():
                print(f"Epoch [{epoch + 1}/{probe.epochs}][{i + 1}/{probe.steps}] loss {loss.item():.4f} "
                      f"lr {probe.lr_at(epoch * probe.steps + i):.4g} {progress.report()}", flush=True)
        if run.preemption.stop_within_epoch(i + 1, probe.steps, probe.print_freq):
            stop_if_nonfinite(step.first_bad, epoch)
            return i + 1
    return None


def end_probe_epoch(run, epoch, sums, best):
    """After epoch `epoch`: its mean loss over every rank, the validation, its line and TensorBoard, then rank 0's
    checkpoint in the background (model_best.pth a second name of it when the epoch is the best). Returns the best
    Acc@1 and this epoch's (Acc@1, Acc@5)."""
    totals = du.all_reduce_sum(sums.clone())
    train_loss = (totals[0] / totals[1].clamp(min=1)).item()
    sums.zero_()
    acc1, acc5, val_loss = run.validation.timed(validate, run.probe, run.model, run.val, run.device)
    is_best, best = acc1 > best, max(acc1, best)
    if not du.is_main():
        return best, (acc1, acc5)
    print(f"Epoch {epoch + 1}/{run.probe.epochs}: Acc@1 {acc1:.2f} Acc@5 {acc5:.2f} val loss {val_loss:.4f} "
          f"(best Acc@1 {best:.2f})", flush=True)
    if run.tensorboard:
        for tag, value in [("train/loss", train_loss), ("train/lr", float(run.model.optimizer.param_groups[0]["lr"])),
                           ("val/acc1", acc1), ("val/acc5", acc5), ("val/loss", val_loss)]:
            run.tensorboard.add_scalar(tag, value, epoch + 1)
        run.tensorboard.flush()
    output_dir = run.args.output_dir
    last = os.path.join(output_dir, "checkpoint_last.pth")
    run.checkpoints.save(state(run, epoch + 1, 0, None, best, (acc1, acc5)), output_dir)
    if is_best:
        run.checkpoints.then(lambda: link_atomic(last, os.path.join(output_dir, "model_best.pth")))
    return best, (acc1, acc5)


def state(run, epoch, step_in_epoch, epoch_sums, best, acc):
    """A main_lincls.py checkpoint: kind lincls, a torchvision ResNet's weights (the trunk and fc), where the probe
    is, its optimizer, its results so far."""
    args, model = run.args, run.model
    return {"kind": "lincls", "epoch": epoch, "step_in_epoch": step_in_epoch, "epoch_sums": epoch_sums,
            "args": vars(args), "data": os.path.abspath(args.data), **(run.probe.data or {}),
            "model": model.state(),
            "optimizer": model.optimizer.state_dict(), "scaler": model.scaler.state_dict(), "best_acc1": best,
            "acc1": acc[0], "acc5": acc[1]}


def stop_if_nonfinite(first_bad, epoch):
    """Stops the run at the first non-finite loss of any rank, each noted on its device as (step, loss): every rank
    stops here, not only the one whose loss it was (the others would wait in their next collective)."""
    bad = [(step, loss) for step, loss in du.all_gather(first_bad[None]).tolist() if step >= 0]
    if bad:
        step, loss = min(bad)
        raise UserError(f"loss is {loss} at epoch {epoch + 1} step {int(step) + 1}: lower --lr")


@torch.no_grad()
def validate(probe, model, batches, device):
    """(Acc@1, Acc@5, mean loss) over the val images of every rank."""
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1, top-5, images
    for images, target in batches:
        with probe.autocast(device):
            out = model.logits(probe, images, wrapped=False)
        hit = out.topk(min(5, out.shape[1]), dim=1).indices == target[:, None]
        totals += torch.stack([F.cross_entropy(out, target, reduction="sum").double(),
                               hit[:, :1].any(1).sum().double(), hit.any(1).sum().double(),
                               torch.full((), len(target), dtype=torch.float64, device=device)])  # a fill: no copy
    totals = du.all_reduce_sum(totals)
    n = max(totals[3].item(), 1.0)
    return 100.0 * totals[1].item() / n, 100.0 * totals[2].item() / n, totals[0].item() / n


def check_resume(path, ckpt, args):
    """A probe continues only its own run: its data (within an epoch also its batch, seed and number of images: the
    main_lincls.py's resume_probe checks them as pretraining does, sce.resume.check_mid_epoch)."""
    if ckpt.get("data") and (ckpt["args"]["dataset"] != args.dataset or not same_path(ckpt["data"], args.data)):
        raise UserError(f"{path} is a probe on other data (--dataset {ckpt['args'].get('dataset')} --data "
                        f"{ckpt.get('data')}): pass that data to continue it, or another --output-dir")


def check_frozen(trunk, reference):
    """Stop if any trunk tensor (weights and BN buffers) differs from `reference`."""
    for k, v in trunk.state_dict().items():
        if k in reference and not torch.equal(v, reference[k]):
            raise RuntimeError(f"trunk tensor {k} changed during linear training: the trunk must stay "
                               "frozen (requires_grad False, eval mode); this is a bug, please report it")
