#!/usr/bin/env python
"""Pretrain a ResNet with SCE (or its baselines MoCo v2 and ReSSL).

    python main_pretrain.py --data DIR --recipe cifar10   # the paper's CIFAR-10 setting (--dataset cifar10 alike)
    torchrun --nproc_per_node=8 main_pretrain.py --data /datasets/imagenet/train --recipe imagenet
    python main_pretrain.py        # no flags: a demo on scikit-learn's digits, under 3 minutes on 2 CPU cores

Each setting of the paper is a row of sce/recipes.py (--recipe NAME; RECIPES.md), each value with its source;
the defaults are its ImageNet setting against the baselines (Sec. 4.2). --print-settings shows every value and
the layer it came from (sce/settings.py).
"""
import sce  # first: a stop signal during the imports below (torch's take seconds) is said, exit 75
sce.stop_while_importing(__name__ == "__main__")
import argparse
import os
import random

import numpy as np
import torch

from sce import UserError, cli, compiling, cuda_graph, data, entry, events, knn, losses, outdir, recipes, settings
from sce import timing
from sce import distributed as du
from sce.builder import ARCHS, build_model
from sce.checkpoint import Writer
from sce.epoch import Run, end_epoch, epochs_logged, finish, knn_due, log_epoch, train_one_epoch
from sce.optim import build_optimizer
from sce.preemption import Interrupted, Preemption
from sce.resume import check_ranks_agree, resume
from sce.step import OnlineProbe, Schedules, Training, build_step

parser = cli.make_parser(__doc__)
g = parser.add_argument_group("data")
g.add_argument("--data", metavar="DIR", help="dataset root; omitted: run the embedded digits demo")
g.add_argument("--recipe", metavar="NAME",
               help=f"a setting of the paper, a row of sce/recipes.py ({', '.join(recipes.ROWS)}; RECIPES.md), each "
                    "value with its source (python -m sce.recipes NAME --sources); flags "
                    "given still win (default: a fresh run's --dataset's row if it has one, a resumed run's own, "
                    "the demo's without --data; none: the defaults below)")
g.add_argument("--print-settings", action="store_true",
               help="print every setting with the layer it came from (default, method, recipe, the resumed run, "
                    "this machine's device, flag) and exit")
cli.add_data_args(g, "auto: on a GPU, a dataset whose decoded images are of one size and fit in a quarter of its "
                  "memory (CIFAR, STL-10, Tiny-ImageNet) is decoded once and kept there, and each batch is cut and "
                  "augmented there (no loader processes); device: always (on a CPU run, in host memory); off: the "
                  "loader", data.DATASETS)
g.add_argument("--class-list", metavar="FILE",
               help="class ids of --dataset imagenet100 (default: the paper's 100 classes)")
g.add_argument("--augment", choices=["cpu", "gpu"],
               help="where the photometric augmentations run: in the loader workers (cpu, with PIL), or batched on "
                    "the training device (gpu; the workers only decode and crop) (default: gpu on CUDA, else cpu)")
g.add_argument("--crop-size", type=int,
               help="size of the global views in pixels (default: the recipe's; else --dataset's native size, 32 for "
                    "CIFAR; else 224)")
g.add_argument("--min-scale", type=float, default=0.2, help="smallest area share of a global view's random crop")
g.add_argument("--online-aug", choices=list(data.AUGMENTATIONS),
               help=f"Table 2 row of online view 1 (default: the method's: {cli.per_method(lambda m: m.views.online)})")
g.add_argument("--target-aug", choices=list(data.AUGMENTATIONS),
               help=f"Table 2 row of target view 0 (default: the method's: {cli.per_method(lambda m: m.views.target)})")
g.add_argument("--local-aug", default="strong-gamma", choices=list(data.AUGMENTATIONS),
               help="Table 2 row of local crops")
g.add_argument("--local-crop-sizes", type=int, nargs="*", default=[], metavar="PX",
               help="multi-crop: sizes of the local crops, e.g. 192 160 128 96 (default: none)")
g.add_argument("--local-crop-scales", type=float, nargs="*", default=[], metavar="SCALE",
               help="min and max area share of each local crop, e.g. 0.172 0.86 0.143 0.715 0.114 0.571 0.086 0.429")
g.add_argument("--max-bad-images", type=int, default=-1,
               help="unreadable images tolerated before stopping (default: -1 = 0.1%% of the dataset)")
g = parser.add_argument_group("model")
g.add_argument("-a", "--arch", default="resnet50", help=f"torchvision ResNet: {', '.join(ARCHS)}")
g.add_argument("--small-input", action=argparse.BooleanOptionalAction,
               help="3x3 stride-1 conv1 and no max-pool, for 32-96 px images (default: on where --dataset's native "
                    "size is 96 px or less)")
g.add_argument("--proj-hidden-dims", type=int, nargs="*", metavar="DIM",
               help=f"widths of the projector's hidden layers (default: the method's: "
                    f"{cli.per_method(lambda m: ' '.join(map(str, m.projector[0])))})")
g.add_argument("--proj-dim", type=int,
               help=f"projector output dimension (default: the method's: {cli.per_method(lambda m: m.projector[1])})")
g.add_argument("--proj-last-bn", choices=["none", "affine", "no-affine"],
               help=f"BN after the projector's last layer (MoCo v3 and the authors' LARS runs: no-affine) (default: "
                    f"the method's: {cli.per_method(lambda m: m.projector[2])})")
g.add_argument("--pred-hidden-dims", type=int, nargs="*", metavar="DIM",
               help=f"widths of the predictor's hidden layers, e.g. 4096; none: no predictor (default: the method's: "
                    f"{cli.per_method(lambda m: ' '.join(map(str, m.predictor)) or 'none')})")
g.add_argument("--sync-bn", action=argparse.BooleanOptionalAction, default=False,
               help="synchronise BN statistics across ranks")
g.add_argument("--shuffle-bn", action=argparse.BooleanOptionalAction, default=False,
               help="MoCo shuffle-BN for the momentum branch")
g.add_argument("--bn-splits", type=int, default=8,
               help="--shuffle-bn on one process: BN statistics over this many chunks of the batch, in the layers "
                    "--split-bn names (the authors' single-GPU small-dataset runs: 8)")
g.add_argument("--split-bn", default="momentum", choices=["momentum", "all"],
               help="which BN layers --bn-splits splits: momentum, the momentum encoder's, whose batch is shuffled "
                    "(the authors' single-GPU code: the online branch and the heads normalise over the whole batch); "
                    "all, every BN layer of both branches and heads, as that many GPUs without --sync-bn would "
                    "(MoCo's CIFAR demo)")
g = parser.add_argument_group("objective")
g.add_argument("--method", default="sce", choices=list(losses.METHODS),
               help="; ".join(f"{name}: {m.about}" for name, m in losses.METHODS.items()))
g.add_argument("--tau", type=float,
               help=f"online temperature (default: the method's: {cli.per_method(lambda m: m.tau)})")
g.add_argument("--tau-m", type=float,
               help=f"target temperature (default: the method's: {cli.per_method(lambda m: m.tau_m)})")
g.add_argument("--queue-size", type=int,
               help=f"memory buffer size M (default: {cli.QUEUE_SIZE} for a method with a queue, "
                    f"{cli.per_method(lambda m: cli.QUEUE_SIZE if m.queue else 'none')})")
g.add_argument("--symmetric", action=argparse.BooleanOptionalAction,
               help=f"symmetrised loss: both global views serve as targets (default: the method's: "
                    f"{cli.per_method(lambda m: 'on' if m.symmetric else 'off')})")
g.add_argument("--ema-momentum", type=float, default=0.996, help="momentum-encoder EMA value at the first step, m0")
g.add_argument("--ema-schedule", default="cosine", choices=["cosine", "constant"],
               help="EMA momentum from m0 to 1 along a cosine, or constant m0")
cli.add_method_flags(parser)
g = parser.add_argument_group("optimisation")
g.add_argument("--epochs", type=int, default=200, help="length of the schedules, in epochs")
g.add_argument("-b", "--batch-size", type=int, default=512, help="global batch over all ranks")
g.add_argument("--optimizer", default="sgd", choices=["sgd", "lars"], help="SGD with momentum, or LARS")
g.add_argument("--lr", type=float, default=0.5, help="base learning rate, scaled by batch / 256")
g.add_argument("--weight-decay", "--wd", type=float, default=1e-4, help="weight decay")
g.add_argument("--sgd-momentum", type=float, default=0.9, help="momentum of SGD / LARS")
g.add_argument("--wd-exclude-bias-norm", action=argparse.BooleanOptionalAction,
               help="no weight decay on biases and BN parameters (default: on under LARS, off under SGD, as the "
                    "authors' code)")
g.add_argument("--warmup-epochs", type=float, default=5, help="linear warmup of the lr before its cosine decay")
g = parser.add_argument_group("runtime")
cli.add_runtime_args(g, os.path.join("runs", "sce"), "args.json, log.txt, checkpoints and TensorBoard logs",
                     "seed of the weights, the data order and every view",
                     "the encoders, the heads and the views (checkpoints stay interchangeable with eager runs)",
                     "a finished run is said to be so", torchrun=True)
g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=False,
               help="channels-last memory format")
g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction,
               help=f"replay the training step from a CUDA graph after {cuda_graph.GRAPH_WARMUP} eager steps: one "
                    "launch instead of hundreds, for small models on small images (default: on for one GPU process "
                    "without --amp fp16)")
g.add_argument("--save-freq", type=int, default=10, metavar="EPOCHS",
               help="also keep checkpoint_NNNN.pth every this many epochs")
g.add_argument("--keep-checkpoints", type=int, default=0, metavar="K", help="numbered checkpoints kept, 0 = all")
g.add_argument("--stop-after-epochs", type=int, default=0, metavar="N",
               help="end this invocation after N completed epochs, the schedule still follows --epochs (0: off)")
g.add_argument("-p", "--print-freq", type=int, default=20, metavar="STEPS", help="progress line every this many steps")
g.add_argument("--max-nonfinite-steps", type=int, default=20, metavar="N",
               help="stop once more than N consecutive steps were skipped (a non-finite loss or gradients; under "
                    "fp16 also GradScaler's overflow steps), checked at each progress line")
g.add_argument("--preview-views", metavar="PNG", help="write a grid of the augmented views of 8 images (rows: images; "
               "columns: the views, labelled) to PNG and exit without training")
g = parser.add_argument_group("kNN monitor")
g.add_argument("--knn-data", metavar="DIR",
               help="its data, in --dataset's layout (an ImageFolder: DIR/train and DIR/val; a built-in dataset: its "
                    "root), read as main_lincls.py --knn reads it, for the same number; every image must be readable "
                    "(--max-bad-images is for --data): an unreadable one stops the run, naming it")
g.add_argument("--knn-every", type=int, default=1, metavar="EPOCHS", help="every N epochs, and after the last (0: off)")
g.add_argument("--online-probe", action=argparse.BooleanOptionalAction, default=True,
               help="a linear head on the trunk's detached features, trained by Adam at every step beside the method, "
                    "which it never touches: its top-1 in the progress lines and log.txt (sce.step.OnlineProbe)")
g.add_argument("--online-probe-lr", type=float, default=1e-3, help="its Adam lr (the authors' 1e-4 reads 17.8%% on the "
               "demo's 3 epochs, 1e-3 27.2%%; the kNN 49.2%% in both)")
g.add_argument("--knn-max-train", type=int, metavar="N",
               help="its bank: a seeded subset of N train images, for quick monitoring (default: all)")
cli.add_knn_args(g)


def parse_args(argv=None, device=None, world_size=1):
    """This run's settings, resolved once in layers (sce.settings): the method's record, the recipe's row (the
    demo's without --data), the resumed run's, this machine's `device` (None: left unresolved), the flags given."""
    return settings.resolve(parser, argv, device, world_size, demo_data=lambda: data.digits_imagefolder(
        os.path.join(os.path.expanduser("~"), ".cache", "sce", "digits-placed")), resolve_device=device_values)


def check_args(args, world_size=1, device=torch.device("cpu")):
    """Impossible settings stop before anything is built, with one line (sce.cli.check_pretrain's rules, then a
    flag typed that does nothing here: sce.settings.NO_EFFECT); returns the BN splits."""
    bn_splits = cli.check_pretrain(args, world_size, device, data.MIN_BLUR_SIZE)
    settings.refuse_idle_flags(args, world_size)  # a flag typed that would do nothing
    return bn_splits


def device_values(args, device, world_size):
    """The settings this machine decides where no flag does, resolved so that args.json and the checkpoints record
    them: on a GPU the augmentations run there, JPEGs are decoded there, the model is compiled and, on one GPU process
    without fp16's GradScaler, the step is a CUDA graph; loader processes at most its cores."""
    augment = args.augment or ("gpu" if device.type == "cuda" or args.preload == "device" else "cpu")
    return dict(augment=augment, decode=data.resolve_decode(args.decode, device) if augment == "gpu" else "loader",
                compile=compiling.resolve_compile(args.compile, device), workers=cli.cap_processes(args.workers),
                cuda_graph=cuda_graph.usable(args.cuda_graph, device, world_size, args.amp, "the step"))


def main(argv=None):
    rank, world_size, _, device = du.init(timeout_s=parser.parse_args(argv).dist_timeout)
    args = parse_args(argv, device, world_size)
    if args.print_settings:
        if rank == 0:
            print(settings.show(parser, args), flush=True)
        return
    bn_splits = check_args(args, world_size, device)
    data.data_folder(args.data, dataset=args.dataset)  # official files checked before the output folder is made
    if args.knn_data:
        data.data_folder(args.knn_data, "--knn-data", args.dataset)
    if world_size > 1:
        check_ranks_agree(args)
    lock = None
    if rank == 0 and not args.preview_views:
        outdir.prepare(args.output_dir)
        lock = outdir.Lock(args.output_dir)  # one run per folder, held until this run ends, however it ends
    try:
        pretrain(args, rank, world_size, device, bn_splits)
    finally:
        if lock:
            lock.release()
    du.cleanup()  # not after an error: the failing rank must report first, its peers fail when it is gone


def pretrain(args, rank, world_size, device, bn_splits):
    settings = dict(vars(args))  # the resolved settings of this run, for args.json once it is accepted
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    compiles, budget = compiling.Log(), data.Budget(device)  # the run's compiles; its share of device memory
    split = timing.Split(compiles)  # where this invocation's wall time goes
    split.mark("imports")  # the interpreter, the imports, the flags, the process group

    dataset, sampler, batches = load_data(args, rank, world_size, device, budget, compiles)
    split.mark("data")  # listed, and preloaded where it is
    preview = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed))[:8].tolist()
    if args.preview_views:  # the views of 8 images of epoch 0, as training makes them
        if rank == 0:
            data.write_preview(args, batches.views_of(preview), args.preview_views)
        return

    lam = losses.Lambda(args, device)  # a device tensor when it moves: a CUDA graph of the step reads it
    model = build_model(args, losses.criterion(args, lam), bn_splits, args.sync_bn and world_size > 1).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    data_id = dict(num_images=len(dataset), data_id=data.fingerprint(dataset), data_order=data.ORDER_VERSION)
    monitor = knn_monitor(args, device, budget, split, batches, data_id["data_id"])
    untrained = monitor(model).top1 if args.demo else None
    split.mark("model and kNN data")
    schedules = Schedules(args, sampler.steps)  # the lr, EMA momentum and lambda of each step
    optimizer = build_optimizer(args.optimizer, model, schedules.base_lr, args.weight_decay, args.sgd_momentum,
                                args.wd_exclude_bias_norm)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    probe = OnlineProbe.of(model, dataset, device, args.online_probe_lr) if args.online_probe else None
    started = resume_run(args, model, optimizer, scaler, rank=rank, data_id=data_id, monitor=monitor, probe=probe)
    if started is None:  # complete
        return
    resumed, tensorboard = started
    start_epoch, start_step = resumed.epoch, resumed.step_in_epoch
    if rank == 0:
        outdir.write_json(os.path.join(args.output_dir, "args.json"), settings)
    if args.compile:
        compiling.compile_model(model, compiles)

    first_step = start_epoch * sampler.steps + start_step
    if tensorboard:  # what the augmentations do, once an invocation: 8 images of epoch 0
        grid = data.views_grid(batches.views_of(preview), data.view_labels(args))
        tensorboard.add_image("views", np.asarray(grid), first_step, dataformats="HWC")
    split.mark("resume and TensorBoard")
    ddp_model = du.wrap_ddp(model, device) if world_size > 1 else model
    training = Training(model, ddp_model, optimizer, scaler, cli.AMP[args.amp], terms=losses.logged_terms(args),
                        probe=probe)
    step = build_step(training, args.compile, cuda_graph.CudaGraphs(device) if args.cuda_graph else None, compiles)
    if rank == 0:
        described = (f"CUDA graph after {cuda_graph.GRAPH_WARMUP} steps" if args.cuda_graph
                     else "compiled" if args.compile else "eager")
        print("".join(f"=> {line}\n" for line in args.notes) +
              f"=> {args.method} on {len(dataset)} images, {sampler.steps} steps/epoch, batch {args.batch_size} "
              f"on {world_size} rank(s), lr {schedules.base_lr:.4g}\n=> data: {batches.describe()}; step: "
              f"{described}; amp {args.amp}", flush=True)
    run = Run(args=args, training=training, step=step, schedules=schedules, lam=lam, batches=batches,
              steps_per_epoch=sampler.steps, device=device, tensorboard=tensorboard,
              preemption=Preemption(world_size, args.dist_timeout), first_step=first_step,
              checkpoints=Writer(split.stopwatch("epoch_ends")), compiles=compiles, monitor=monitor, data=data_id)
    last = train(run, sampler, split, start_epoch, start_step, resumed.epoch_sums)
    if args.demo and rank == 0:
        online = f"; online probe top-1: {last.probe_top1:.1f}%" if last.probe_top1 is not None else ""
        print(f"kNN top-1: {last.top1:.1f}% (untrained: {untrained:.1f}%){online}", flush=True)


def load_data(args, rank, world_size, device, budget, compiles):
    """(dataset, sampler, the batches of views the step takes: sce.data.from_flags)."""
    route, try_preload = data.choose_route(args.augment, args.decode, args.preload, device)
    dataset = data.build_dataset(args.dataset, args.data, "pretrain", class_list=args.class_list,
                                 read=data.READ[route])
    if len(dataset) < args.batch_size and not args.preview_views:
        raise UserError(f"{args.data} has {len(dataset)} images, fewer than one batch of {args.batch_size}: "
                        "lower --batch-size")
    sampler = data.ResumableSampler(len(dataset), args.batch_size, rank, world_size, args.seed)
    return dataset, sampler, data.from_flags(args, dataset, sampler, device, route, try_preload,
                                             dtype=cli.AMP[args.amp], budget=budget, compiles=compiles,
                                             preview=bool(args.preview_views))


def resume_run(args, model, optimizer, scaler, *, rank, data_id, monitor, probe):
    """(where this invocation starts: sce.resume.Resumed, TensorBoard's writer on rank 0), from the checkpoint in
    --output-dir if any (sce.resume), its last epoch's line of log.txt completed if a failure left it out; None when
    the run is complete already."""
    resumed = resume(args, model, optimizer, scaler, rank=rank, data=data_id, probe=probe)
    start_epoch, start_step, last_stats = resumed.epoch, resumed.step_in_epoch, resumed.epoch_stats
    # the checkpoint of the last epoch was saved, its line of log.txt (and kNN) not: a failure between the two
    unlogged = start_step == 0 and last_stats is not None and epochs_logged(args.output_dir) < start_epoch
    writes = rank == 0 and (unlogged or start_epoch < args.epochs)
    tensorboard = events.summary_writer(args.output_dir) if writes else None
    if unlogged:
        if rank == 0:
            print(f"=> log.txt lacks epoch {start_epoch}, whose checkpoint was saved: completing its line", flush=True)
        restored = probe if probe and probe.restored else None  # a fresh head is no score of that run
        knn = monitor(model, restored) if monitor and knn_due(args, start_epoch) else None
        log_epoch(args, start_epoch, last_stats, knn, tensorboard)
    if start_epoch < args.epochs:
        return resumed, tensorboard
    if rank == 0:
        print(f"=> the run in {args.output_dir} is already complete ({start_epoch} epochs): nothing to do; "
              "raise --epochs to train longer", flush=True)
    if tensorboard:
        tensorboard.close()
    return None


def train(run, sampler, split, start_epoch, start_step, epoch_sums):
    """The epochs from (start_epoch, start_step) to --epochs, or to a stop: each epoch's steps, then its end; the
    one way out through sce.epoch.finish (exit 75 after a stop request); the time split written however it ends.
    Returns the demo's kNN after it (else None)."""
    args, nonfinite, result, done = run.args, torch.zeros((), device=run.device), None, start_epoch
    split.loop()
    try:
        for epoch in range(start_epoch, args.epochs):
            sampler.set_epoch(epoch, start_step)
            result = train_one_epoch(run, epoch, start_step, nonfinite, epoch_sums)
            nonfinite, start_step, epoch_sums = result.nonfinite, 0, None
            if result.stopped_at is not None:  # a stop request mid-epoch
                break
            done = epoch + 1
            end_epoch(run, done, result.stats, split)
            stop_after = args.stop_after_epochs and done - start_epoch >= args.stop_after_epochs
            if run.preemption.requested() or stop_after:
                break
        split.done()
        finish(run, result, done)  # exits 75 after a stop request, the run not complete
        return run.monitor(run.training.model, run.training.probe) if args.demo else None  # the demo's, in the split
    except BaseException as e:
        if not isinstance(e, Interrupted):  # a failure waits for the save in flight too; a second Ctrl-C does not
            run.checkpoints.wait(quiet=True)
        raise
    finally:  # however the loop ended: complete, stopped (exit 75) or failed
        if du.is_main():
            split.write(args.output_dir, epochs=[start_epoch, done])


def knn_monitor(args, device, budget, split, batches, data_id):
    """The kNN monitor on --knn-data (the demo's own), read as main_lincls.py --knn reads it, for the same number;
    its train images are the pretraining's where those are preloaded and the same files at its size; its runs are
    `split`'s kNN part."""
    if not args.knn_data or not (args.knn_every or args.demo):
        return None
    size = data.eval_crop_size(None, args.small_input, vars(args), args.dataset)[0]
    reuse = (data_id, batches.preloaded) if batches.preloaded else None
    sets = data.eval_splits(args.dataset, args.knn_data, size, args.small_input, device, preload_mode=args.preload,
                            decode=args.decode, workers=min(args.workers, 4), class_list=args.class_list, what="kNN ",
                            budget=budget, reuse=reuse)
    return knn.Monitor(sets, args.knn_k, args.knn_t, max_train=args.knn_max_train, seed=args.seed,
                       compiled=args.compile, compiles=split.compiles, stopwatch=split.stopwatch("knn"))


if __name__ == "__main__":
    entry.run(main)
