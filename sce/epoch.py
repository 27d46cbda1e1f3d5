"""One epoch of pretraining: the schedules of each step, the step itself (train_step or its CUDA
graph), the loss and eq. 10 terms averaged on the device over the finite steps of each window and of
the epoch (a window without one reads NaN, never 0), the progress line, TensorBoard, and the stops
for non-finite steps and preemption. main_pretrain.py builds the Run and calls train_one_epoch."""
import argparse
import dataclasses
import time

import numpy as np
import torch

from sce import UserError, compiling
from sce import distributed as du
from sce.builder import momentum_at
from sce.engine import Training
from sce.loader import ResumableSampler, note_bad_images
from sce.optim import cosine_lr, scheduled, set_lr
from sce.preemption import CHECK_STEPS, Preemption
from sce.preview import view_labels, views_grid
from sce.progress import format_eta


def lambda_scheduled(args):
    return args.lambda_schedule != "constant" or args.lambda_warmup_steps > 0


def lambda_at(args, step, total_steps):
    return scheduled(step, total_steps, args.lambda_, args.lambda_end, args.lambda_schedule,
                     args.lambda_warmup_steps, args.lambda_warmup_start)


@dataclasses.dataclass
class Run:
    """What train_one_epoch needs besides the epoch."""
    args: argparse.Namespace
    training: Training
    step: object  # f(views, momentum) -> (loss, finite, terms): train_step or its GraphedStep
    loader: torch.utils.data.DataLoader  # None when the data is preloaded on the device
    batches: object  # the epoch's (views, bad, reasons) on the device: DeviceViews or PreloadedViews
    sampler: ResumableSampler
    device: torch.device
    writer: object  # TensorBoard SummaryWriter on rank 0, else None
    preemption: Preemption
    base_lr: float
    max_bad: int  # unreadable images tolerated
    nonfinite: torch.Tensor  # consecutive non-finite steps (device), carried across epochs
    lam: torch.Tensor = None  # lambda of the step (device), when scheduled
    bad_seen: dict = dataclasses.field(default_factory=dict)  # index -> reason of each unreadable image
    views_logged: bool = False  # the TensorBoard grid of views is written at the first step of a run
    first_step: int = None  # global step this invocation starts at
    graph_noted: bool = False
    epoch_stats: dict = dataclasses.field(default_factory=dict)  # averages of the last epoch, for log.txt

    @property
    def steps_per_epoch(self):
        return self.sampler.steps

    @property
    def total_steps(self):
        return self.sampler.steps * self.args.epochs


# the loss and the three terms of eq. 10 (of the first (target, query) pair), averaged over finite steps
TERMS = ["loss", "infonce", "ressl", "ceil"]


def train_one_epoch(run, epoch, start_step):
    """One epoch from `start_step`; returns the step to resume from if preempted, else None.
    Leaves the epoch's averages in run.epoch_stats."""
    args, device = run.args, run.device
    if start_step >= run.steps_per_epoch:  # a mid-epoch checkpoint of more data (older ones do not record its size)
        raise UserError(f"the checkpoint stopped at step {start_step} of epoch {epoch + 1}, which now has "
                        f"{run.steps_per_epoch} step(s): resume on the data it ran on, or from an epoch-end checkpoint")
    run.training.ddp_model.train()
    window = torch.zeros(1 + len(TERMS), device=device)  # finite steps, then the sums of TERMS (no host sync)
    epoch_sums = torch.zeros_like(window)
    finite_losses = torch.zeros((), device=device)  # steps of the epoch whose loss (not only gradients) was finite
    window_start, window_steps, epoch_start = time.time(), 0, time.time()
    batches = run.batches
    for i, (views, bad, reasons) in enumerate(batches, start=start_step):
        step = epoch * run.steps_per_epoch + i
        lr = cosine_lr(step, run.total_steps, run.base_lr, round(args.warmup_epochs * run.steps_per_epoch))
        set_lr(run.training.optimizer, lr)
        m = momentum_at(step, run.total_steps, args.ema_momentum, args.ema_schedule)
        lam = lambda_at(args, step, run.total_steps)
        if run.lam is not None:
            run.lam.fill_(lam)
        if run.loader:
            note_bad_images(bad, reasons, run.loader.dataset, run.bad_seen, run.max_bad)
        if run.writer and not run.views_logged:  # what the augmentations did, once a run
            grid = views_grid(views, view_labels(args))
            run.writer.add_image("views", np.asarray(grid), step, dataformats="HWC")
            run.views_logged = True
        started = time.time()
        loss, finite, terms = run.step(views, m)
        note_first_steps(run, step, started)
        run.nonfinite.copy_(torch.where(finite, torch.zeros_like(run.nonfinite), run.nonfinite + 1))  # no sync
        finite_losses += torch.isfinite(loss)
        values = torch.stack([torch.ones_like(loss), loss.float()] + [terms[name] for name in TERMS[1:]])
        values = torch.where(finite, values, torch.zeros_like(values))
        window += values
        epoch_sums += values
        window_steps += 1

        if (i + 1) % args.print_freq == 0 or i + 1 == run.steps_per_epoch:
            nonfinite = int(run.nonfinite.item())
            if nonfinite > args.max_nonfinite_steps:
                raise UserError(f"{nonfinite} consecutive non-finite losses at step {step}: "
                                f"{likely_cause(args, lr)}; the last good checkpoint is kept")
            elapsed = time.time() - window_start
            stats = dict(window_means(window, window_steps), lr=lr, momentum=m, **{"lambda": lam},
                         images_per_s=window_steps * args.batch_size / max(elapsed, 1e-9),
                         data_wait_share=batches.wait_s / max(elapsed, 1e-9))
            if du.is_main():
                log_progress(run, epoch, i, step, stats, elapsed / window_steps)
            window.zero_()
            window_start, window_steps, batches.wait_s = time.time(), 0, 0.0
        # a stop request is agreed through a gloo all_reduce over the ranks: at most every 10 steps, not every one
        if (i + 1) % min(args.print_freq, CHECK_STEPS) == 0 and run.preemption.requested() \
                and i + 1 < run.steps_per_epoch:
            return i + 1
    steps = run.steps_per_epoch - start_step
    run.epoch_stats = dict(window_means(epoch_sums, steps), lr=lr, momentum=m, **{"lambda": lam},
                           images_per_s=steps * args.batch_size / max(time.time() - epoch_start, 1e-9))
    # whatever --max-nonfinite-steps says, nothing was learned; but under fp16, steps GradScaler skips (finite
    # losses, overflowing gradients while it lowers its scale) are left to that flag
    if run.epoch_stats["skipped_steps"] == steps and not (run.training.scaler and finite_losses.item()):
        raise UserError(f"every step of epoch {epoch + 1} ({steps} steps) had a non-finite loss and was skipped, so "
                        f"the weights did not move: {likely_cause(args, lr)}; the last good checkpoint is kept")
    return None


def note_first_steps(run, step, started):
    """One line each for what the first steps of this invocation cost: compiling, capturing the graph."""
    if step == run.first_step and run.args.compile and du.is_main():
        took = f"{time.time() - started:.1f} s"
        failed = getattr(run.step, "failed", None)  # CompileFallback's cause, when the step went eager
        print(f"=> compiling failed ({failed}): eager steps, the first took {took}" if failed
              else f"=> the first step took {took}, compiling (each compile: {compiling.summary() or 'none'}; "
                   "the backward's is inside the step's time)", flush=True)
    capture_s = getattr(run.step, "capture_s", None)
    if capture_s is not None and not run.graph_noted:
        run.graph_noted = True
        if du.is_main():
            print(f"=> the step runs as a CUDA graph from step {step + 1} on (capture {capture_s:.2f} s)", flush=True)


def window_means(sums, steps):
    """TERMS averaged over the finite steps of a window (NaN when none was finite, never 0), and the
    number of steps skipped as non-finite."""
    finite, *totals = sums.tolist()  # one copy to the host
    means = (total / finite if finite else float("nan") for total in totals)
    return dict(zip(TERMS, means), skipped_steps=steps - round(finite))


def likely_cause(args, lr):
    fp16 = " or fp16 overflows (try --amp bf16)" if args.amp == "fp16" else ""
    return f"the lr ({lr:.3g}) is likely too high{fp16}, or the data holds non-finite values"


def log_progress(run, epoch, i, step, stats, seconds_per_step):
    """The progress line (loss, lr, momentum, throughput, data wait, peak memory, ETA) and TensorBoard."""
    args = run.args
    eta = (run.total_steps - step - 1) * seconds_per_step
    memory = ""
    if run.device.type == "cuda":
        stats["peak_memory_gib"] = torch.cuda.max_memory_allocated(run.device) / 2 ** 30
        memory = f" mem {stats['peak_memory_gib']:.1f}G"
    print(f"Epoch [{epoch + 1}/{args.epochs}][{i + 1}/{run.steps_per_epoch}] loss {stats['loss']:.4f} "
          f"lr {stats['lr']:.4g} m {stats['momentum']:.5f} {stats['images_per_s']:.1f} img/s "
          f"data {100 * stats['data_wait_share']:.0f}%{memory} skipped {stats['skipped_steps']} "
          f"eta {format_eta(eta)}", flush=True)
    if run.writer:
        for name, value in stats.items():
            run.writer.add_scalar(f"terms/{name}" if name in TERMS[1:] else f"train/{name}", value, step)
