"""One epoch of pretraining and its end: the schedules of each step, the step itself (sce.engine.Step), the loss
and eq. 10 terms averaged on the device over the finite steps of each window and of the epoch (a window
without one reads NaN, never 0), the progress line, TensorBoard, the stops for non-finite steps and stop
requests; then the epoch's checkpoint, its kNN and its line of log.txt; and the one way out of the loop
(finish). main_pretrain.py builds the Run."""
import argparse
import dataclasses
import json
import os
import time

import torch

from sce import UserError, checkpoint
from sce import distributed as du
from sce.builder import momentum_at
from sce.engine import Step, Training
from sce.optim import cosine_lr, scheduled, set_lr
from sce.preemption import PREEMPTED_EXIT_CODE, Preemption
from sce.progress import format_eta
from sce.resume import run_state

# the loss and the three terms of eq. 10 (of the first (target, query) pair), averaged over finite steps
TERMS = ["loss", "infonce", "ressl", "ceil"]


def lambda_scheduled(args):
    return args.lambda_schedule != "constant" or args.lambda_warmup_steps > 0


def lambda_at(args, step, total_steps):
    return scheduled(step, total_steps, args.lambda_, args.lambda_end, args.lambda_schedule,
                     args.lambda_warmup_steps, args.lambda_warmup_start)


@dataclasses.dataclass(frozen=True)
class Run:
    """What an epoch needs besides its number: the settings, the collaborators, where this invocation began."""
    args: argparse.Namespace
    training: Training
    step: Step
    batches: object  # iterating: the epoch's lists of views on the device (sce.data.PretrainBatches); wait_s
    steps_per_epoch: int
    device: torch.device
    writer: object  # TensorBoard SummaryWriter on rank 0, else None
    preemption: Preemption
    base_lr: float
    first_step: int  # the global step this invocation starts at
    lam: torch.Tensor = None  # lambda of the step on the device, filled each step, when scheduled
    compiles: object = None  # sce.compiling.Log of the run's compiles

    @property
    def total_steps(self):
        return self.steps_per_epoch * self.args.epochs


@dataclasses.dataclass
class Epoch:
    """What train_one_epoch did."""
    stopped_at: int  # the step to resume from, when a stop was requested mid-epoch; else None
    stats: dict  # the epoch's averages (its line of log.txt) when it ended; else None
    nonfinite: torch.Tensor  # consecutive non-finite steps at its end, on the device (the next epoch goes on)
    sums: list = None  # when stopped: the epoch's sums so far (finite steps, TERMS, finite losses), for the resume


def train_one_epoch(run, epoch, start_step, nonfinite, sums=None):
    """One epoch from `start_step`, `nonfinite` consecutive non-finite steps before it (a device tensor); `sums`:
    the epoch's sums before start_step (Epoch.sums of the invocation that stopped), so that its line of log.txt
    averages the whole epoch."""
    args, device = run.args, run.device
    if start_step >= run.steps_per_epoch:  # a mid-epoch checkpoint of more data (older ones do not record its size)
        raise UserError(f"the checkpoint stopped at step {start_step} of epoch {epoch + 1}, which now has "
                        f"{run.steps_per_epoch} step(s): resume on the data it ran on, or from an epoch-end checkpoint")
    run.training.ddp_model.train()
    window = torch.zeros(1 + len(TERMS), device=device)  # finite steps, then the sums of TERMS (no host sync)
    epoch_sums = torch.zeros_like(window)
    finite_losses = torch.zeros((), device=device)  # steps of the epoch whose loss (not only gradients) was finite
    if start_step and sums:
        epoch_sums += torch.tensor(sums[:-1], device=device)
        finite_losses += sums[-1]
    nonfinite = nonfinite.clone()
    window_start, window_steps, epoch_start, batches = time.time(), 0, time.time(), run.batches
    for i, views in enumerate(batches, start=start_step):
        step = epoch * run.steps_per_epoch + i
        lr = cosine_lr(step, run.total_steps, run.base_lr, round(args.warmup_epochs * run.steps_per_epoch))
        set_lr(run.training.optimizer, lr)
        m = momentum_at(step, run.total_steps, args.ema_momentum, args.ema_schedule)
        lam = lambda_at(args, step, run.total_steps)
        if run.lam is not None:
            run.lam.fill_(lam)
        started = time.time()
        loss, finite, terms = run.step(views, m)
        note_first_steps(run, step, started)
        nonfinite = torch.where(finite, torch.zeros_like(nonfinite), nonfinite + 1)  # no sync
        finite_losses += torch.isfinite(loss)
        values = torch.stack([torch.ones_like(loss), loss.float()] + [terms[name] for name in TERMS[1:]])
        values = torch.where(finite, values, torch.zeros_like(values))
        window += values
        epoch_sums += values
        window_steps += 1

        if (i + 1) % args.print_freq == 0 or i + 1 == run.steps_per_epoch:
            if int(nonfinite.item()) > args.max_nonfinite_steps:
                raise UserError(f"{int(nonfinite.item())} consecutive non-finite losses at step {step}: "
                                f"{likely_cause(args, lr)}; the last good checkpoint is kept")
            elapsed = time.time() - window_start
            stats = dict(window_means(window, window_steps), lr=lr, momentum=m, **{"lambda": lam},
                         images_per_s=window_steps * args.batch_size / max(elapsed, 1e-9),
                         data_wait_share=batches.wait_s / max(elapsed, 1e-9))
            if du.is_main():
                log_progress(run, epoch, i, step, stats, elapsed / window_steps)
            window.zero_()
            window_start, window_steps, batches.wait_s = time.time(), 0, 0.0
        if run.preemption.stop_within_epoch(i + 1, run.steps_per_epoch, args.print_freq):
            return Epoch(i + 1, None, nonfinite, epoch_sums.tolist() + [finite_losses.item()])
    steps = run.steps_per_epoch  # the whole epoch's, with those of an invocation that stopped within it
    stats = dict(window_means(epoch_sums, steps), lr=lr, momentum=m, **{"lambda": lam},
                 images_per_s=(steps - start_step) * args.batch_size / max(time.time() - epoch_start, 1e-9))
    # whatever --max-nonfinite-steps says, nothing was learned; but under fp16, steps GradScaler skips (finite
    # losses, overflowing gradients while it lowers its scale) are left to that flag
    if stats["skipped_steps"] == steps and not (run.training.scaler and finite_losses.item()):
        raise UserError(f"every step of epoch {epoch + 1} ({steps} steps) had a non-finite loss and was skipped, so "
                        f"the weights did not move: {likely_cause(args, lr)}; the last good checkpoint is kept")
    return Epoch(None, stats, nonfinite)


def note_first_steps(run, step, started):
    """One line each for what the first steps of this invocation cost: compiling, capturing the graph."""
    if not du.is_main():
        return
    if step == run.first_step and run.args.compile:
        took = f"{time.time() - started:.1f} s"
        failed = run.step.compile_failed
        print(f"=> compiling failed ({failed}): eager steps, the first took {took}" if failed
              else f"=> the first step took {took}, compiling (each compile: {run.compiles.summary() or 'none'}; "
                   "the backward's is inside the step's time)", flush=True)
    if run.step.captured_at is not None and run.step.captured_at == run.step.calls:
        print(f"=> the step runs as a CUDA graph from step {step + 1} on (capture {run.step.capture_s:.2f} s)",
              flush=True)


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


# ---------------------------------------------------------------- the end of an epoch

def end_epoch(run, done, stats, data, monitor):
    """After `done` epochs: save (rank 0; seconds for a ResNet-50 and its queue, while the other ranks wait at the
    kNN monitor or the barrier), then the epoch's line of log.txt with its kNN. The checkpoint holds the line's
    statistics: a run stopped between the two completes the line when rerun (log_epoch). data: the dataset's
    identity (sce.resume.run_state); monitor: the kNN monitor (sce.knn.Monitor) or None."""
    args, t = run.args, run.training
    if du.is_main():
        checkpoint.save(run_state(t.model, t.optimizer, t.scaler, args, done, 0, done * run.steps_per_epoch, data,
                                  stats),
                        args.output_dir, numbered=done % args.save_freq == 0 or done == args.epochs,
                        keep=args.keep_checkpoints)
    log_epoch(args, t.model, done, stats, monitor, run.writer)


def log_epoch(args, model, done, stats, monitor, writer):
    """Epoch `done`'s line of log.txt (one JSON line per epoch, as DINO's): its statistics, and the kNN monitor's
    numbers when due (every rank computes them)."""
    log = dict(epoch=done, **stats)
    if monitor and args.knn_every and (done % args.knn_every == 0 or done == args.epochs):
        log["knn_top1"], log["knn_top5"] = monitor(model)
        if du.is_main():
            print(f"=> epoch {done}: kNN top-1 {log['knn_top1']:.2f} top-5 {log['knn_top5']:.2f}", flush=True)
        if writer:
            writer.add_scalar("knn/top1", log["knn_top1"], done)
            writer.add_scalar("knn/top5", log["knn_top5"], done)
    if du.is_main():
        with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
            f.write(json.dumps(log) + "\n")
    du.barrier()


def finish(run, result, done, data):
    """The one way out of the epoch loop, after `done` epochs and the last epoch's `result`: a mid-epoch stop
    saved, each way of stopping said, and exit PREEMPTED_EXIT_CODE when a stop was requested before the end."""
    args, t, main_rank = run.args, run.training, du.is_main()
    if result.stopped_at is not None:
        if main_rank:
            checkpoint.save(run_state(t.model, t.optimizer, t.scaler, args, done, result.stopped_at,
                                      done * run.steps_per_epoch + result.stopped_at, data, epoch_sums=result.sums),
                            args.output_dir)
            print(f"=> preempted: saved epoch {done} step {result.stopped_at} to {args.output_dir}; exiting with "
                  f"code {PREEMPTED_EXIT_CODE}", flush=True)
        du.barrier()
        run.preemption.exit(run.writer)
    if done < args.epochs and run.preemption.requested():
        if main_rank:
            print(f"=> preempted: saved epoch {done}; exiting with code {PREEMPTED_EXIT_CODE}", flush=True)
        run.preemption.exit(run.writer)
    if done < args.epochs and main_rank:
        print(f"=> stopping after {args.stop_after_epochs} epoch(s) as asked; resume to continue", flush=True)
    if run.writer:
        run.writer.close()


def epochs_logged(output_dir):
    """The last epoch with a line in output_dir/log.txt (0 without one), as rank 0 reads it."""
    last = 0
    if du.is_main() and os.path.isfile(os.path.join(output_dir, "log.txt")):
        with open(os.path.join(output_dir, "log.txt")) as f:
            for line in f:
                try:
                    last = json.loads(line)["epoch"]
                except (ValueError, KeyError, TypeError):  # a line cut short by a kill
                    pass
    return du.all_gather_object(last)[0]

