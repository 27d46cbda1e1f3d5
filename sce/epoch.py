"""One epoch of pretraining and its end: the epoch's bookkeeping and output. The loop calls one_step (the schedules
of sce.step, the step, its outcome tallied: sce.tally); the loss, the method's logged terms and the online probe's
top-1 are averaged on the device over the finite steps of each window and of the epoch (a window without one reads
NaN, never 0); the progress line, TensorBoard, the stops for non-finite steps and stop requests; then the epoch's
checkpoint (written in the background), its kNN and its line of log.txt (once its checkpoint is on disk), the
estimate after the first whole epoch; and the one way out of the loop (finish). main_pretrain.py builds the Run."""
import argparse
import dataclasses
import json
import os
import time

import torch

from sce import UserError, write_file
from sce import distributed as du
from sce.checkpoint import Writer
from sce.compiling import Log
from sce.losses import Lambda
from sce.optim import set_lr
from sce.preemption import Preemption, stop
from sce.progress import format_eta
from sce.resume import run_state
from sce.step import Schedules, Training
from sce.tally import PROBE_TOP1, Tally, window_means


@dataclasses.dataclass(frozen=True)
class Run:
    """What an epoch needs besides its number: the settings, the collaborators, where this invocation began."""
    args: argparse.Namespace
    training: Training
    step: object  # build_step's: step(views, momentum, labels=None) -> sce.step.StepResult
    schedules: Schedules
    lam: Lambda  # the criterion's lambda, set at each step
    batches: object  # iterating: the epoch's lists of views on the device (sce.data.pretrain_batches); wait_s
    steps_per_epoch: int
    device: torch.device
    tensorboard: object  # TensorBoard SummaryWriter on rank 0, else None
    preemption: Preemption
    first_step: int  # the global step this invocation starts at
    checkpoints: Writer  # rank 0's background checkpoint writer
    compiles: Log  # the run's compiles: an epoch's steps are its wall time less those in it
    monitor: object = None  # the kNN monitor (sce.knn.Monitor), or None
    data: dict = None  # the dataset's identity (sce.resume.run_state)


@dataclasses.dataclass
class Epoch:
    """What train_one_epoch did."""
    stopped_at: int  # the step to resume from, when a stop was requested mid-epoch; else None
    stats: dict  # the epoch's averages (its line of log.txt) when it ended; else None
    nonfinite: torch.Tensor  # consecutive non-finite steps at its end, on the device (the next epoch goes on)
    sums: dict = None  # when stopped: the epoch's sums so far by name (Tally.sums), to resume


def one_step(run, step, views, tally):
    """Global step `step` as main_pretrain.py runs it, and benchmarks/speed/bench_pretrain.py times it: the lr (into the
    optimizer) and lambda (into the criterion's) of the step, the step (run.step) with the step's EMA momentum, its
    outcome added to `tally`."""
    s = run.schedules
    set_lr(run.training.optimizer, s.lr_at(step))
    run.lam.set(s.lambda_at(step))
    if run.training.probe is None:
        tally.add(run.step(views, s.momentum_at(step)))
    else:  # the images' labels too (sce.data's Batch)
        tally.add(run.step(views, s.momentum_at(step), views.labels))


def train_one_epoch(run, epoch, start_step, nonfinite, sums=None):
    """One epoch from `start_step`, `nonfinite` consecutive non-finite steps before it (a device tensor); `sums`:
    the epoch's sums before start_step (Epoch.sums of the invocation that stopped), so that its line of log.txt
    averages the whole epoch."""
    args, s = run.args, run.schedules
    run.training.ddp_model.train()
    tally = Tally(run.device, nonfinite, sums if start_step else None)
    window_start, window_steps, batches = time.time(), 0, run.batches
    epoch_start, compiled = time.time(), run.compiles.total()  # the epoch's steps: its wall less its compiles
    for i, views in enumerate(batches, start=start_step):
        step = epoch * run.steps_per_epoch + i
        one_step(run, step, views, tally)
        window_steps += 1
        if (i + 1) % args.print_freq == 0 or i + 1 == run.steps_per_epoch:
            if int(tally.nonfinite.item()) > args.max_nonfinite_steps:
                raise UserError(f"{int(tally.nonfinite.item())} consecutive non-finite losses at step {step}: "
                                f"{likely_cause(args, s.lr_at(step))}; the last good checkpoint is kept")
            elapsed = time.time() - window_start
            stats = dict(window_means(tally.read(tally.window), window_steps), **s.at(step),
                         images_per_s=window_steps * args.batch_size / max(elapsed, 1e-9),
                         data_wait_share=batches.wait_s / max(elapsed, 1e-9))
            if du.is_main():
                log_progress(run, step, stats, elapsed / window_steps, tally.terms)
            tally.window.zero_()
            window_start, window_steps, batches.wait_s = time.time(), 0, 0.0
        if run.preemption.stop_within_epoch(i + 1, run.steps_per_epoch, args.print_freq):
            return Epoch(i + 1, None, tally.nonfinite, tally.sums())
    steps = run.steps_per_epoch  # the whole epoch's, with those of an invocation that stopped within it
    steps_s = time.time() - epoch_start - (run.compiles.total() - compiled)
    stats = dict(window_means(tally.read(tally.epoch), steps), **s.at(step),
                 images_per_s=(steps - start_step) * args.batch_size / max(steps_s, 1e-9))
    # whatever --max-nonfinite-steps says, nothing was learned; but under fp16, steps GradScaler skips (finite
    # losses on some rank, overflowing gradients while it lowers its scale) are left to that flag
    all_skipped = stats["skipped_steps"] == steps  # on every rank alike (their averaged gradients decide)
    if all_skipped and not (run.training.scaler and du.all_reduce_sum(tally.finite_losses).item()):
        raise UserError(f"every step of epoch {epoch + 1} ({steps} steps) had a non-finite loss and was skipped, so "
                        f"the weights did not move: {likely_cause(args, stats['lr'])}; the last good checkpoint is "
                        "kept")
    return Epoch(None, stats, tally.nonfinite)


def likely_cause(args, lr):
    fp16 = " or fp16 overflows (try --amp bf16)" if args.amp == "fp16" else ""
    return f"the lr ({lr:.3g}) is likely too high{fp16}, or the data holds non-finite values"


def log_progress(run, step, stats, seconds_per_step, terms):
    """The progress line (loss, lr, momentum, throughput, data wait, peak memory, ETA) and TensorBoard (`terms`: the
    names of the method's logged terms among the stats)."""
    args, (epoch, i) = run.args, divmod(step, run.steps_per_epoch)
    eta = (run.schedules.total_steps - step - 1) * seconds_per_step
    memory = ""
    if run.device.type == "cuda":
        stats["peak_memory_gib"] = torch.cuda.max_memory_allocated(run.device) / 2 ** 30
        memory = f" mem {stats['peak_memory_gib']:.1f}G"
    probe = f" online {stats[PROBE_TOP1]:.1f}%" if PROBE_TOP1 in stats else ""
    print(f"Epoch [{epoch + 1}/{args.epochs}][{i + 1}/{run.steps_per_epoch}] loss {stats['loss']:.4f} "
          f"lr {stats['lr']:.4g} m {stats['momentum']:.5f}{probe} {stats['images_per_s']:.1f} img/s "
          f"data {100 * stats['data_wait_share']:.0f}%{memory} skipped {stats['skipped_steps']} "
          f"eta {format_eta(eta)}", flush=True)
    if run.tensorboard:
        for name, value in stats.items():
            tag = "online/train_top1" if name == PROBE_TOP1 else f"terms/{name}" if name in terms else f"train/{name}"
            run.tensorboard.add_scalar(tag, value, step)


# ---------------------------------------------------------------- the end of an epoch

def end_epoch(run, done, stats, split):
    """After `done` epochs: rank 0 saves in the background (a snapshot of the state now; the next epoch trains while
    it is written), the kNN monitor runs when due, then the epoch's line of log.txt, written once the checkpoint is
    on disk. The checkpoint holds the line's statistics: a run stopped between the two completes the line when
    rerun. Then the estimate, when due (estimate_due), and the time split so far (`split`'s line of timing.txt)."""
    args, t = run.args, run.training
    if du.is_main():
        run.checkpoints.save(run_state(t.model, t.optimizer, t.scaler, args, probe=t.probe, epoch=done, step_in_epoch=0,
                                       global_step=done * run.steps_per_epoch, data=run.data, epoch_stats=stats),
                             args.output_dir, numbered=done % args.save_freq == 0 or done == args.epochs,
                             keep=args.keep_checkpoints)
    first = done - 1 == run.first_step // run.steps_per_epoch
    knn = run.monitor(t.model, t.probe) if run.monitor and knn_due(args, done, first) else None
    log_epoch(args, done, stats, knn, tensorboard=run.tensorboard, checkpoints=run.checkpoints)
    if du.is_main():
        if estimate_due(done, run.first_step, run.steps_per_epoch, args.epochs):
            estimate(run, done, stats, split)
        split.save(args.output_dir, epochs=[run.first_step // run.steps_per_epoch, done])  # what a kill leaves


def estimate_due(done, first_step, steps_per_epoch, epochs):
    """Whether the estimate comes after epoch `done`, in an invocation that began at global step first_step: after
    its first whole epoch (after a resume within an epoch, the next one: a few steps and a CUDA graph's warm-up
    would read as an epoch), or after the resumed epoch when it is the run's last (no other comes)."""
    resumed_epoch, first_whole = first_step // steps_per_epoch, -(-first_step // steps_per_epoch)
    return done - 1 == first_whole or (done - 1 == resumed_epoch and done == epochs)


def knn_due(args, done, first=False):
    """Whether the kNN monitor runs after epoch `done`: every --knn-every epochs, after the last, and after the first
    epoch of each invocation (its time and the trunk's rate go into the estimate)."""
    return bool(args.knn_every) and (first or done % args.knn_every == 0 or done == args.epochs)


def log_epoch(args, done, stats, knn, tensorboard, checkpoints=None):
    """Epoch `done`'s line of log.txt (one JSON line per epoch, as DINO's): its statistics and the kNN monitor's
    KnnResult `knn` if it ran (its top-1, top-5, and the online probe's top-1 on the same val features, when read);
    written by rank 0 once what `checkpoints` (a Writer) has in hand is on disk."""
    log = dict(epoch=done, **stats)
    if knn:
        log.update(knn_top1=knn.top1, knn_top5=knn.top5)
        if knn.probe_top1 is not None:
            log.update(online_top1=knn.probe_top1)
        if du.is_main():
            online = f"; online probe top-1 {knn.probe_top1:.2f}" if knn.probe_top1 is not None else ""
            print(f"=> epoch {done}: kNN top-1 {knn.top1:.2f} top-5 {knn.top5:.2f}{online}", flush=True)
        if tensorboard:
            for name, tag in (("knn_top1", "knn/top1"), ("knn_top5", "knn/top5"), ("online_top1", "online/val_top1")):
                if name in log:
                    tensorboard.add_scalar(tag, log[name], done)
    if du.is_main():
        def write():  # the file anew: a kill or a full disk never leaves half a line
            path = os.path.join(args.output_dir, "log.txt")
            rows = open(path).read().splitlines() if os.path.isfile(path) else []
            try:
                write_file(path, "".join(f"{row}\n" for row in rows + [json.dumps(log)]))
            except OSError as e:
                raise UserError(f"could not write {path} ({e.strerror}): free some space and run the same command "
                                "again, which completes its line") from None
        checkpoints.then(write) if checkpoints else write()
    du.barrier()


def estimate(run, done, stats, split):
    """After the first whole epoch of this invocation (`stats` its line): what it measured, the stage's time at those
    rates (its remaining epochs, their ends and kNN runs), printed and written to OUTPUT_DIR/estimate.json
    (benchmarks/reproduction/reproduce.sh adds the linear probe at the trunk's forward rate the kNN measured). The
    rest of an epoch resumed within is not enough: a few steps and the warm-up of a CUDA graph would read as an
    epoch."""
    args, (parts, wall), earlier = run.args, split.report(), split.earlier_wall(run.args.output_dir)
    epoch_s = run.steps_per_epoch * args.batch_size / max(stats["images_per_s"], 1e-9)
    knn_s = parts["knn"]  # one run so far (after the invocation's first epoch; its compile included)
    end_s = parts["epoch_ends"] / max(1, done - run.first_step // run.steps_per_epoch)  # an epoch's end
    knn_left = sum(knn_due(args, e) for e in range(done + 1, args.epochs + 1)) if run.monitor else 0
    left = (args.epochs - done) * (epoch_s + end_s) + knn_left * knn_s
    # the whole stage afresh at these rates (another method's, in benchmarks/reproduction/reproduce.sh's row estimate)
    knn_runs = sum(knn_due(args, e, e == 1) for e in range(1, args.epochs + 1)) if run.monitor else 0
    whole = parts["startup"] + parts["compiling"] + args.epochs * (epoch_s + end_s) + knn_runs * knn_s
    forward = run.monitor.images / knn_s if run.monitor and run.monitor.images and knn_s > 0 else None
    fields = dict(epoch=done, epochs=args.epochs, wall_s=wall, earlier_s=earlier, left_s=left,
                  stage_s=earlier + wall + left, whole_stage_s=whole, epoch_s=epoch_s,
                  images_per_s=run.steps_per_epoch * args.batch_size / max(epoch_s, 1e-9),
                  epoch_end_s=end_s, knn_s=knn_s, knn_runs_left=knn_left,
                  knn_compile_s=run.monitor.compile_s if run.monitor else 0.0, forward_images_per_s=forward,
                  startup_s=parts["startup"], compiling_s=parts["compiling"])
    try:
        write_file(os.path.join(args.output_dir, "estimate.json"), json.dumps(fields, indent=1))
    except OSError as e:
        print(f"=> could not write estimate.json ({e.strerror}): the estimate is only this line", flush=True)
    knn = f", a kNN {knn_s:.1f} s ({forward:.0f} images/s)" if forward else ""
    print(f"=> estimate after epoch {done}: an epoch {epoch_s:.2f} s of steps ({fields['images_per_s']:.0f} img/s) "
          f"and {end_s:.2f} s at its end{knn}; start-up {parts['startup']:.1f} s, compiling "
          f"{parts['compiling']:.1f} s: this stage {fields['stage_s'] / 60:.1f} min in all, {left / 60:.1f} min left",
          flush=True)


def finish(run, result, done):
    """The one way out of the epoch loop, after `done` epochs and the last epoch's `result`: a mid-epoch stop
    saved, each way of stopping said, every checkpoint on disk, and exit PREEMPTED_EXIT_CODE when a stop was
    requested before the end."""
    args, t, main_rank = run.args, run.training, du.is_main()
    if result.stopped_at is not None:
        def save():
            run.checkpoints.save(run_state(t.model, t.optimizer, t.scaler, args, probe=t.probe, epoch=done,
                                           step_in_epoch=result.stopped_at,
                                           global_step=done * run.steps_per_epoch + result.stopped_at, data=run.data,
                                           epoch_sums=result.sums), args.output_dir)
            run.checkpoints.wait()
        stop(run.preemption, run.tensorboard, f"epoch {done} step {result.stopped_at} to {args.output_dir}", save)
    if main_rank:
        run.checkpoints.wait()
    if done < args.epochs and run.preemption.requested():
        stop(run.preemption, run.tensorboard, f"epoch {done}")
    if done < args.epochs and main_rank:
        print(f"=> stopping after {args.stop_after_epochs} epoch(s) as asked; resume to continue", flush=True)
    if run.tensorboard:
        run.tensorboard.close()


def epochs_logged(output_dir):
    """The last epoch with a line in output_dir/log.txt (0 without one), as rank 0 reads it."""
    path, last = os.path.join(output_dir, "log.txt"), 0
    rows = open(path).read().splitlines() if du.is_main() and os.path.isfile(path) else []
    if rows:  # written whole (log_epoch): a kill leaves no line cut short
        last = json.loads(rows[-1])["epoch"]
    return du.all_gather_object(last)[0]
