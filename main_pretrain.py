#!/usr/bin/env python
"""Pretrain a ResNet with SCE (or its baselines MoCo v2 and ReSSL).

    torchrun --nproc_per_node=8 main_pretrain.py --data /datasets/imagenet/train --lambda 0.5 --tau-m 0.07
    python main_pretrain.py        # no flags: a demo on scikit-learn's digits, under 3 minutes on 2 CPU cores

Defaults are the paper's ImageNet recipe against the baselines (Sec. 4.2); RECIPES.md has
the command of every setting of the paper.
"""
import sce  # first: a stop signal during the imports below (torch's take seconds) is said, exit 75
sce.stop_while_importing(__name__ == "__main__")
import argparse
import os
import random

import numpy as np
import torch

from sce import UserError, cli, compiling, cuda_graph, data, knn, losses, outdir, timing
from sce import distributed as du
from sce.builder import ARCHS, build_model, build_trunk
from sce.checkpoint import Writer
from sce.cuda_graph import GRAPH_WARMUP, CudaGraphs
from sce.epoch import Run, end_epoch, epochs_logged, finish, knn_due, log_epoch, train_one_epoch
from sce.optim import build_optimizer
from sce.preemption import Interrupted, Preemption
from sce.resume import check_ranks_agree, resume
from sce.step import Schedules, Training, build_step

# `python main_pretrain.py` with no --data: the embedded demo (digits placed at random in 16 px canvases, under 3
# minutes on 2 cores). Tuned for them: milder crops and the less blurry strong-beta view (Table 2's blur sigmas
# are meant for 224 px), small batches for more steps, one loader process (16 px images cost it little).
DEMO = dict(arch="resnet18", small_input=True, crop_size=16, epochs=3, batch_size=32, queue_size=1024,
            lr=0.25, weight_decay=5e-4, warmup_epochs=1, ema_momentum=0.99, ema_schedule="constant",
            proj_hidden_dims=[512], proj_dim=128, proj_last_bn="none", workers=1, min_scale=0.5,
            online_aug="strong-beta",
            output_dir=os.path.join("runs", "demo"), knn_every=0)


def per_method(default):
    """'sce 0.1, moco 0.2, ressl 0.1': default(record) of each method, for --help."""
    return ", ".join(f"{name} {default(m)}" for name, m in losses.METHODS.items())


def add_method_flags(parser):
    """The flags of each method's record, in a group per method; returns {action: the methods that read it}."""
    owners = {}
    for name, m in losses.METHODS.items():
        group = parser.add_argument_group(f"--method {name}") if m.flags else None
        for flag, kwargs in m.flags:
            action = next((a for a in owners if flag in a.option_strings), None) or group.add_argument(flag, **kwargs)
            owners.setdefault(action, []).append(name)
    return owners


parser = cli.make_parser(__doc__)
g = parser.add_argument_group("data")
g.add_argument("--data", metavar="DIR", help="dataset root; omitted: run the embedded digits demo")
cli.add_data_args(g, "auto: on a GPU, a dataset whose decoded images are of one size and fit in a quarter of its "
                  "memory (CIFAR, STL-10, Tiny-ImageNet) is decoded once and kept there, and each batch is cut and "
                  "augmented there (no loader processes); device: always (on a CPU run, in host memory); off: the "
                  "loader", data.DATASETS)
g.add_argument("--class-list", metavar="FILE",
               help="class ids of --dataset imagenet100 (default: the paper's 100 classes)")
g.add_argument("--augment", choices=["cpu", "gpu"],
               help="where the photometric augmentations run: in the loader workers (cpu, with PIL), or batched on "
                    "the training device (gpu; the workers only decode and crop) (default: gpu on CUDA, else cpu)")
g.add_argument("--crop-size", type=int, default=224, help="size of the global views in pixels")
g.add_argument("--min-scale", type=float, default=0.2, help="smallest area share of a global view's random crop")
g.add_argument("--online-aug", choices=list(data.AUGMENTATIONS),
               help=f"Table 2 row of online view 1 (default: the method's: {per_method(lambda m: m.views[0])})")
g.add_argument("--target-aug", choices=list(data.AUGMENTATIONS),
               help=f"Table 2 row of target view 0 (default: the method's: {per_method(lambda m: m.views[1])})")
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
g.add_argument("--small-input", action="store_true", help="3x3 stride-1 conv1 and no max-pool, for 32-96 px images")
g.add_argument("--proj-hidden-dims", type=int, nargs="*", default=[2048, 2048], metavar="DIM",
               help="widths of the projector's hidden layers")
g.add_argument("--proj-dim", type=int, default=256, help="projector output dimension")
g.add_argument("--proj-last-bn", default="affine", choices=["none", "affine", "no-affine"],
               help="BN after the projector's last layer (MoCo v3 and the authors' LARS runs: no-affine)")
g.add_argument("--pred-hidden-dims", type=int, nargs="*", default=[], metavar="DIM",
               help="widths of the predictor's hidden layers, e.g. 4096 (default: none = no predictor)")
g.add_argument("--sync-bn", action="store_true", help="synchronise BN statistics across ranks")
g.add_argument("--shuffle-bn", action="store_true", help="MoCo shuffle-BN for the momentum branch")
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
g.add_argument("--tau", type=float, help=f"online temperature (default: the method's: {per_method(lambda m: m.tau)})")
g.add_argument("--tau-m", type=float,
               help=f"target temperature (default: the method's: {per_method(lambda m: m.tau_m)})")
g.add_argument("--queue-size", type=int, default=65536, help="memory buffer size M")
g.add_argument("--symmetric", action="store_true", help="symmetrised loss: both global views serve as targets")
g.add_argument("--ema-momentum", type=float, default=0.996, help="momentum-encoder EMA value at the first step, m0")
g.add_argument("--ema-schedule", default="cosine", choices=["cosine", "constant"],
               help="EMA momentum from m0 to 1 along a cosine, or constant m0")
METHOD_FLAGS = add_method_flags(parser)
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
g.add_argument("--channels-last", action="store_true", help="channels-last memory format")
g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction,
               help=f"replay the training step from a CUDA graph after {GRAPH_WARMUP} eager steps: one launch instead "
                    "of hundreds, for small models on small images (default: on for one GPU process without --amp "
                    "fp16)")
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
g.add_argument("--knn-max-train", type=int, metavar="N",
               help="its bank: a seeded subset of N train images, for quick monitoring (default: all)")
cli.add_knn_args(g)


def parse_args(argv=None):
    """The flags, the demo's defaults without --data, the method's defaults where a flag is not given."""
    args = parser.parse_args(argv)
    if args.data is None:  # embedded demo: its own defaults, flags given still win
        defaults = {key: parser.get_default(key) for key in DEMO}
        parser.set_defaults(**DEMO)
        try:
            args = parser.parse_args(argv)
        finally:
            parser.set_defaults(**defaults)  # a later parse in this process gets the usual defaults
        args.demo = True
        args.data = data.digits_imagefolder(os.path.join(os.path.expanduser("~"), ".cache", "sce", "digits-placed"))
        args.knn_data = args.knn_data or args.data
    else:
        args.demo = False
    method = losses.METHODS[args.method]
    args.tau = method.tau if args.tau is None else args.tau
    args.tau_m = method.tau_m if args.tau_m is None else args.tau_m
    args.online_aug = args.online_aug or method.views[0]
    args.target_aug = args.target_aug or method.views[1]
    args.loss = losses.loss_name(args)
    return args


def check_args(args, world_size=1, device=torch.device("cpu")):
    """Impossible settings stop before anything is built, with one line (sizes that cannot fit the device's memory
    included); --workers above the cores is capped to them. Returns the BN splits."""
    cli.check_finite(args)
    if args.arch not in ARCHS:
        raise UserError(f"unknown arch '{args.arch}': use one of {', '.join(ARCHS)}")
    if args.tau <= 0 or args.tau_m <= 0:
        raise UserError(f"temperatures must be positive (got --tau {args.tau}, --tau-m {args.tau_m})")
    if len(args.local_crop_scales) != 2 * len(args.local_crop_sizes):
        raise UserError("--local-crop-scales needs two numbers (min max) per --local-crop-sizes entry")
    positive = {"--batch-size": args.batch_size, "--epochs": args.epochs, "--queue-size": args.queue_size,
                "--print-freq": args.print_freq, "--save-freq": args.save_freq, "--proj-dim": args.proj_dim,
                "--proj-hidden-dims": min(args.proj_hidden_dims, default=1),
                "--pred-hidden-dims": min(args.pred_hidden_dims, default=1), "--knn-k": args.knn_k,
                "--knn-t": args.knn_t, "--dist-timeout": args.dist_timeout, "--bn-splits": args.bn_splits,
                "--knn-max-train": args.knn_max_train}
    at_least_zero = {"--workers": args.workers, "--lr": args.lr,
                     "--weight-decay": args.weight_decay,
                     "--warmup-epochs": args.warmup_epochs, "--keep-checkpoints": args.keep_checkpoints,
                     "--stop-after-epochs": args.stop_after_epochs, "--lambda-warmup-steps": args.lambda_warmup_steps,
                     "--knn-every": args.knn_every, "--max-nonfinite-steps": args.max_nonfinite_steps}
    unit_interval = {"--lambda": args.lambda_, "--lambda-end": args.lambda_end,
                     "--lambda-warmup-start": args.lambda_warmup_start, "--ema-momentum": args.ema_momentum,
                     "--sgd-momentum": args.sgd_momentum}
    cli.check_ranges(positive, at_least_zero, unit_interval)
    cli.check_seed(args.seed)
    args.workers = cli.cap_processes(args.workers)
    scales = [(args.min_scale, 1.0)] + list(zip(args.local_crop_scales[::2], args.local_crop_scales[1::2]))
    if not all(0 < low <= high <= 1 for low, high in scales):
        raise UserError(f"crop scales are area shares: --min-scale and each --local-crop-scales pair (min max) "
                        f"need 0 < min <= max <= 1 (got {scales})")
    if args.max_bad_images < -1:
        raise UserError(f"--max-bad-images must be -1 (0.1% of the dataset) or a number of images >= 0 "
                        f"(got {args.max_bad_images})")
    if args.decode == "device" and args.augment == "cpu":
        raise UserError("--decode device crops and augments on the device: drop --augment cpu")
    if args.preload == "device" and args.augment == "cpu":
        raise UserError("--preload device augments on the device: drop --augment cpu (or use --preload off)")
    if losses.lambda_scheduled(args) and args.loss != "sce":
        raise UserError(f"--lambda-schedule / --lambda-warmup-steps need the SCE loss (--method sce without "
                        f"--loss-coeffs); this run uses {args.loss}")
    for action, methods in METHOD_FLAGS.items():  # another method's flag would be silently ignored
        if args.method not in methods and getattr(args, action.dest) != action.default:
            raise UserError(f"{action.option_strings[0]} is a setting of --method {' / '.join(methods)}, not of "
                            f"{args.method}: drop it or change --method")
    smallest = min([args.crop_size] + args.local_crop_sizes)
    if smallest < data.MIN_BLUR_SIZE:
        raise UserError(f"crops of {smallest} px are too small to blur (sigma 2 reflects {data.MIN_BLUR_SIZE - 1} "
                        f"px): use --crop-size / --local-crop-sizes of at least {data.MIN_BLUR_SIZE}")
    if args.batch_size % world_size:
        raise UserError(f"--batch-size {args.batch_size} is not divisible by the {world_size} ranks: "
                        f"use a multiple of {world_size}")
    keys_per_step = args.batch_size * (2 if args.symmetric else 1)
    if args.queue_size % keys_per_step:
        raise UserError(f"--queue-size {args.queue_size} is not a multiple of the {keys_per_step} keys "
                        f"enqueued per step: use e.g. {max(1, args.queue_size // keys_per_step) * keys_per_step}")
    if args.sync_bn and world_size > 1 and device.type != "cuda":
        raise UserError("--sync-bn needs GPUs (torch's SyncBatchNorm has no CPU kernel): drop it on CPU")
    bn_splits = args.bn_splits if args.shuffle_bn and world_size == 1 else 1  # several ranks shuffle for real
    if bn_splits > 1 and (args.batch_size % bn_splits or args.batch_size // bn_splits < 2):
        raise UserError(f"--bn-splits {bn_splits} must divide the batch of {args.batch_size} into chunks of at "
                        f"least 2 images: use a divisor of {args.batch_size} up to {args.batch_size // 2}")
    check_sizes(args, args.batch_size // world_size, device)
    return bn_splits


def check_sizes(args, per_rank, device):
    """One line for a step's views, the heads or the queue larger by itself than all of the device's memory, naming
    the flags that size it (the heads' sizes are Python ints: no tensor is made)."""
    sizes = [args.crop_size] * 2 + args.local_crop_sizes
    with torch.device("meta"):  # the trunk's feature size, nothing allocated
        feat_dim = build_trunk(args.arch, args.small_input)[1]
    dims = [feat_dim] + args.proj_hidden_dims + [args.proj_dim]
    pred = [args.proj_dim] + args.pred_hidden_dims + [args.proj_dim] if args.pred_hidden_dims else []
    heads = 2 * sum(a * b for a, b in zip(dims, dims[1:])) + sum(a * b for a, b in zip(pred, pred[1:]))
    keys = args.queue_size * (args.proj_dim + per_rank * (2 if args.symmetric else 1)) * 4  # and their logits
    widths = {f"--{name.replace('_', '-')}": " ".join(map(str, getattr(args, name))) for name in
              ("proj_hidden_dims", "pred_hidden_dims") if getattr(args, name)} | {"--proj-dim": args.proj_dim}
    cli.check_memory(device, {
        f"--batch-size {args.batch_size} with --crop-size {args.crop_size}: one step's views in float32":
            (per_rank * sum(3 * s * s for s in sizes) * 4, "lower --batch-size or --crop-size"),
        f"the heads of {' '.join(f'{k} {v}' for k, v in widths.items())}: their weights in float32, online and "
        "momentum": (heads * 4, f"lower {' or '.join(widths)}"),
        f"--queue-size {args.queue_size} keys of --proj-dim {args.proj_dim}: the queue and one step's logits against "
        "it": (keys, "lower --queue-size or --proj-dim")})


def resolve_device_defaults(args, device, world_size):
    """The defaults that depend on the device, resolved so that args.json and the checkpoints record them: on a
    GPU the augmentations run there, JPEGs are decoded there, the model is compiled and, on one GPU process
    without fp16's GradScaler, the step is a CUDA graph."""
    args.augment = args.augment or ("gpu" if device.type == "cuda" or args.preload == "device" else "cpu")
    args.decode = data.resolve_decode(args.decode, device) if args.augment == "gpu" else "loader"
    args.compile = compiling.resolve_compile(args.compile, device)
    args.cuda_graph = cuda_graph.usable(args.cuda_graph, device, world_size, args.amp, "the step")


def main(argv=None):
    args = parse_args(argv)
    rank, world_size, _, device = du.init(timeout_s=args.dist_timeout)
    resolve_device_defaults(args, device, world_size)
    bn_splits = check_args(args, world_size, device)
    data.data_folder(args.data)
    if args.knn_data:
        data.data_folder(args.knn_data, "--knn-data")
    args.split_bn = args.split_bn if bn_splits > 1 else None  # recorded as the run applies it: None, no split BN
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

    route, try_preload = data.choose_route(args.augment, args.decode, args.preload, device)
    dataset = data.build_dataset(args.dataset, args.data, "pretrain", class_list=args.class_list,
                                 read=data.READ[route])
    if len(dataset) < args.batch_size and not args.preview_views:
        raise UserError(f"{args.data} has {len(dataset)} images, fewer than one batch of {args.batch_size}: "
                        "lower --batch-size")
    sampler = data.ResumableSampler(len(dataset), args.batch_size, rank, world_size, args.seed)
    batches = data.from_flags(args, dataset, sampler, device, route, try_preload, dtype=cli.AMP[args.amp],
                              budget=budget, compiles=compiles, preview=bool(args.preview_views))
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
    untrained = monitor(model)[0] if args.demo else None
    split.mark("model and kNN data")
    schedules = Schedules(args, sampler.steps)  # the lr, EMA momentum and lambda of each step
    optimizer = build_optimizer(args.optimizer, model, schedules.base_lr, args.weight_decay, args.sgd_momentum,
                                args.wd_exclude_bias_norm)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    start_epoch, start_step, last_stats, epoch_sums = resume(args, model, optimizer, scaler, rank, data_id)
    # the checkpoint of the last epoch was saved, its line of log.txt (and kNN) not: a failure between the two
    unlogged = start_step == 0 and last_stats is not None and epochs_logged(args.output_dir) < start_epoch
    tensorboard = cli.summary_writer(args.output_dir) if rank == 0 and (unlogged or start_epoch < args.epochs) else None
    if unlogged:
        if rank == 0:
            print(f"=> log.txt lacks epoch {start_epoch}, whose checkpoint was saved: completing its line", flush=True)
        knn = monitor(model) if monitor and knn_due(args, start_epoch) else None
        log_epoch(args, start_epoch, last_stats, knn, tensorboard)
    if start_epoch == args.epochs:
        if rank == 0:
            print(f"=> the run in {args.output_dir} is already complete ({start_epoch} epochs): nothing to do; "
                  "raise --epochs to train longer", flush=True)
        if tensorboard:
            tensorboard.close()
        return
    if rank == 0:
        outdir.write_json(os.path.join(args.output_dir, "args.json"), settings)
    if args.compile:
        compiling.compile_model(model, compiles)

    ddp_model = du.wrap_ddp(model, device) if world_size > 1 else model
    preemption = Preemption(world_size, args.dist_timeout)
    first_step = start_epoch * sampler.steps + start_step
    if tensorboard:  # what the augmentations do, once an invocation: 8 images of epoch 0
        grid = data.views_grid(batches.views_of(preview), data.view_labels(args))
        tensorboard.add_image("views", np.asarray(grid), first_step, dataformats="HWC")
    split.mark("resume and TensorBoard")
    training = Training(model, ddp_model, optimizer, scaler, cli.AMP[args.amp], terms=losses.logged_terms(args))
    step = build_step(training, args.compile, CudaGraphs(device) if args.cuda_graph else None, compiles)
    if rank == 0:
        print(f"=> {args.method} on {len(dataset)} images, {sampler.steps} steps/epoch, batch {args.batch_size} "
              f"on {world_size} rank(s), lr {schedules.base_lr:.4g}", flush=True)
        described = (f"CUDA graph after {GRAPH_WARMUP} steps" if args.cuda_graph else "compiled" if args.compile
                     else "eager")
        print(f"=> data: {batches.describe()}; step: {described}; amp {args.amp}", flush=True)

    run = Run(args=args, training=training, step=step, schedules=schedules, lam=lam, batches=batches,
              steps_per_epoch=sampler.steps, device=device, tensorboard=tensorboard, preemption=preemption,
              first_step=first_step, checkpoints=Writer(split.stopwatch("epoch_ends")), compiles=compiles,
              monitor=monitor, data=data_id)
    nonfinite, result, done = torch.zeros((), device=device), None, start_epoch
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
            if preemption.requested() or (args.stop_after_epochs and done - start_epoch >= args.stop_after_epochs):
                break
        split.done()
        finish(run, result, done)  # exits 75 after a stop request, the run not complete
        top1 = monitor(model)[0] if args.demo else None
    except BaseException as e:
        if not isinstance(e, Interrupted):  # a failure waits for the save in flight too; a second Ctrl-C does not
            run.checkpoints.wait(quiet=True)
        raise
    finally:  # however the loop ended: complete, stopped (exit 75) or failed
        if rank == 0:
            split.write(args.output_dir, epochs=[start_epoch, done])
    if args.demo and rank == 0:
        print(f"kNN top-1: {top1:.1f}% (untrained: {untrained:.1f}%)", flush=True)


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
    cli.run(main)
