#!/usr/bin/env python
"""Pretrain a ResNet with SCE (or its baselines MoCo v2 and ReSSL).

    torchrun --nproc_per_node=8 main_pretrain.py --data /datasets/imagenet/train --lambda 0.5 --tau-m 0.07
    python main_pretrain.py        # no flags: a few-minute demo on scikit-learn's digits, on CPU

Defaults are the paper's ImageNet recipe against the baselines (Sec. 4.2); RECIPES.md has
the command of every setting of the paper.
"""
import argparse
import functools
import json
import os
import random
import warnings

import torch

from sce import UserError, checkpoint, cli, compiling, evaldata, losses, outdir
from sce import distributed as du
from sce.augment import AUGMENTATIONS, MIN_BLUR_SIZE, pretrain_views
from sce.builder import ARCHS, SCE
from sce.datasets import DATASETS, build_dataset, digits_imagefolder
from sce.device_augment import DeviceViews
from sce.engine import (GRAPH_WARMUP, Training, build_step, compile_model, error_line, resolve_compile,
                        revert_to_eager)
from sce.epoch import Run, lambda_scheduled, train_one_epoch
from sce.knn import knn_accuracy
from sce.loader import ResumableSampler, eval_crop_size, pretrain_loader
from sce.optim import build_optimizer
from sce.preemption import PREEMPTED_EXIT_CODE, Preemption
from sce.preload import PreloadedViews, preload, wanted
from sce.preview import write_preview
from sce.resume import check_ranks_agree, data_identity, resume, run_state


# method -> (loss, tau, tau_m, online aug, target aug); a flag given on the command line wins
METHODS = {
    "sce": ("sce", 0.1, 0.07, "strong", "weak"),
    "moco": ("infonce", 0.2, None, "strong", "strong"),  # MoCo v2: InfoNCE, same strong views
    "ressl": ("ressl", 0.1, 0.04, "strong", "weak"),  # ReSSL's best ImageNet temperatures
}

# `python main_pretrain.py` with no --data: the embedded demo (digits, 16 px, a few minutes on 2 cores).
# Tuned for 16 px digits: milder crops and the less blurry strong-beta view (Table 2's blur sigmas
# are meant for 224 px), small batches for more steps.
DEMO = dict(arch="resnet18", small_input=True, crop_size=16, epochs=20, batch_size=32, queue_size=1024,
            lr=0.25, weight_decay=5e-4, warmup_epochs=1, ema_momentum=0.99, ema_schedule="constant",
            proj_hidden_dims=[512], proj_dim=128, proj_last_bn="none", workers=2, min_scale=0.5,
            online_aug="strong-beta",
            output_dir=os.path.join("runs", "demo"), knn_every=0)

parser = cli.make_parser(__doc__)
g = parser.add_argument_group("data")
g.add_argument("--data", metavar="DIR", help="dataset root; omitted: run the embedded digits demo")
g.add_argument("--dataset", default="imagefolder", choices=DATASETS,
               help="format of --data (an ImageFolder uses DIR/train when present)")
g.add_argument("--class-list", metavar="FILE",
               help="class ids of --dataset imagenet100 (default: the paper's 100 classes)")
g.add_argument("-j", "--workers", type=int, default=cli.default_workers(),
               help="data-loading processes per rank (default: the node's cores / its ranks - 1, at most 16; "
                    f"here {cli.default_workers()})")
g.add_argument("--augment", choices=["cpu", "gpu"],
               help="where the photometric augmentations run: in the loader workers (cpu), or batched on the "
                    "training device (gpu; the workers only decode, crop and flip) (default: gpu on CUDA, else cpu)")
g.add_argument("--decode", choices=["auto", "device", "loader"], default="auto",
               help="where JPEG files are decoded with --augment gpu: device (the GPU's JPEG engines; on a CPU "
                    "run, the training process) after the workers read their bytes, header and random parameters, "
                    "then cropped and resized there; or in the loader workers. Other files (PNG, progressive or "
                    "CMYK JPEG) are decoded by the workers either way. auto: device on a GPU with JPEG engines (A100, "
                    "H100, H200, ...), else loader")
g.add_argument("--crop-size", type=int, default=224, help="size of the global views in pixels")
g.add_argument("--min-scale", type=float, default=0.2, help="smallest area share of a global view's random crop")
g.add_argument("--online-aug", choices=list(AUGMENTATIONS),
               help="Table 2 row of online view 1 (default: the method's, strong)")
g.add_argument("--target-aug", choices=list(AUGMENTATIONS),
               help="Table 2 row of target view 0 (default: the method's: weak for sce / ressl, strong for moco)")
g.add_argument("--local-aug", default="strong-gamma", choices=list(AUGMENTATIONS), help="Table 2 row of local crops")
g.add_argument("--local-crop-sizes", type=int, nargs="*", default=[], metavar="PX",
               help="multi-crop: sizes of the local crops, e.g. 192 160 128 96 (default: none)")
g.add_argument("--local-crop-scales", type=float, nargs="*", default=[], metavar="SCALE",
               help="min and max area share of each local crop, e.g. 0.172 0.86 0.143 0.715 0.114 0.571 0.086 0.429")
g.add_argument("--preload", default="auto", choices=["auto", "device", "off"],
               help="auto: on a GPU, a dataset whose decoded images are of one size and fit in a quarter of its "
                    "memory (CIFAR, STL-10, Tiny-ImageNet) is decoded once and kept there, and each batch is cropped "
                    "and augmented there (no loader processes); device: always (on a CPU run, in host memory); "
                    "off: the loader")
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
               help="--shuffle-bn on one process: every BN computes its statistics over this many chunks of the "
                    "batch, as on that many GPUs (the authors' single-GPU small-dataset runs)")
g = parser.add_argument_group("objective")
g.add_argument("--method", default="sce", choices=list(METHODS), help="sce, or the baselines moco (v2) / ressl")
g.add_argument("--lambda", dest="lambda_", type=float, default=0.5, metavar="LAMBDA",
               help="weight of the one-hot target, eq. 7")
g.add_argument("--lambda-schedule", default="constant", choices=["constant", "linear", "cosine"],
               help="lambda after its warmup: constant, or linear / cosine from --lambda to --lambda-end at the "
                    "last step (a varying lambda is the paper's future work; the authors' later code has it)")
g.add_argument("--lambda-end", type=float, metavar="LAMBDA", help="lambda at the last step (default: --lambda)")
g.add_argument("--lambda-warmup-steps", type=int, default=0, metavar="STEPS",
               help="steps of a linear rise of lambda from --lambda-warmup-start to --lambda")
g.add_argument("--lambda-warmup-start", type=float, metavar="LAMBDA",
               help="lambda at step 0 of its warmup (default: --lambda)")
g.add_argument("--tau", type=float, help="online temperature (default: 0.1; moco 0.2)")
g.add_argument("--tau-m", type=float, help="target temperature (default: 0.07; ressl 0.04)")
g.add_argument("--mask-positive", action="store_true",
               help="eq. 3 strictly: the positive gets target weight 0 (default: the published constant 0 logit)")
g.add_argument("--loss-coeffs", type=float, nargs=3, metavar=("LAMBDA", "MU", "ETA"),
               help="optimise eq. 10 with free coefficients (Table 3) instead of eq. 9")
g.add_argument("--queue-size", type=int, default=65536, help="memory buffer size M")
g.add_argument("--symmetric", action="store_true", help="symmetrised loss: both global views serve as targets")
g.add_argument("--ema-momentum", type=float, default=0.996, help="momentum-encoder EMA value at the first step, m0")
g.add_argument("--ema-schedule", default="cosine", choices=["cosine", "constant"],
               help="EMA momentum from m0 to 1 along a cosine, or constant m0")
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
g.add_argument("--amp", default="none", choices=["none", "fp16", "bf16"], help="mixed precision (autocast)")
g.add_argument("--channels-last", action="store_true", help="channels-last memory format")
g.add_argument("--compile", action=argparse.BooleanOptionalAction,
               help="torch.compile the encoders and heads; checkpoints stay interchangeable with eager runs, and "
                    "a failed compile warns and runs eagerly (default: on CUDA with Triton; off on CPU, where "
                    "compiling a ResNet takes minutes)")
g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction,
               help="replay the training step from a CUDA graph after 3 eager steps: one launch instead of hundreds, "
                    "for small models on small images (default: on for one GPU process without --amp fp16)")
g.add_argument("--seed", type=int, default=0, help="seed of the weights, the data order and every view")
g.add_argument("--output-dir", default=os.path.join("runs", "sce"), metavar="DIR",
               help="args.json, log.txt, checkpoints and TensorBoard logs")
g.add_argument("--resume", default="auto", help="auto: continue from OUTPUT_DIR/checkpoint_last.pth if present; "
               "a path; or none to start fresh (default: auto)")
g.add_argument("--save-freq", type=int, default=10, metavar="EPOCHS",
               help="also keep checkpoint_NNNN.pth every this many epochs")
g.add_argument("--keep-checkpoints", type=int, default=0, metavar="K", help="numbered checkpoints kept, 0 = all")
g.add_argument("--stop-after-epochs", type=int, default=0, metavar="N",
               help="end this invocation after N completed epochs, the schedule still follows --epochs (0: off)")
g.add_argument("--print-freq", type=int, default=20, metavar="STEPS", help="progress line every this many steps")
g.add_argument("--max-nonfinite-steps", type=int, default=20, metavar="N",
               help="stop after N consecutive non-finite losses (checked at each progress line)")
g.add_argument("--dist-timeout", type=int, default=1800, metavar="SECONDS", help="timeout of collectives")
g.add_argument("--preview-views", metavar="PNG", help="write a grid of the augmented views of 8 images (rows: images; "
               "columns: the views, labelled) to PNG and exit without training")
g.add_argument("--knn-data", metavar="DIR",
               help="data of the kNN monitor in --dataset's layout (an ImageFolder: DIR/train and DIR/val; a built-in "
                    "dataset: its root), read as main_lincls.py --knn reads it, for the same number; every image "
                    "must be readable (--max-bad-images is for --data): an unreadable one stops the run, naming it")
g.add_argument("--knn-every", type=int, default=1, metavar="EPOCHS", help="kNN monitor every N epochs, and after the last")
g.add_argument("--knn-max-train", type=int, metavar="N",
               help="bank of the kNN monitor: a seeded subset of N train images, for quick monitoring (default: all)")
g.add_argument("--knn-k", type=int, default=200, help="neighbours that vote in the kNN monitor")
g.add_argument("--knn-t", type=float, default=0.07, help="kNN votes weigh exp(cos / t)")


def parse_args(argv=None):
    args = parser.parse_args(argv)
    if args.data is None:  # embedded demo: its own defaults, flags given still win
        defaults = {key: parser.get_default(key) for key in DEMO}
        parser.set_defaults(**DEMO)
        try:
            args = parser.parse_args(argv)
        finally:
            parser.set_defaults(**defaults)  # a later parse in this process gets the usual defaults
        args.demo = True
        args.data = digits_imagefolder(os.path.join(os.path.expanduser("~"), ".cache", "sce", "digits"))
        args.knn_data = args.knn_data or args.data
    else:
        args.demo = False
    loss, tau, tau_m, online_aug, target_aug = METHODS[args.method]
    args.loss = "combined" if args.loss_coeffs else loss
    args.tau = tau if args.tau is None else args.tau
    args.tau_m = (tau_m or 0.07) if args.tau_m is None else args.tau_m
    args.online_aug = args.online_aug or online_aug
    args.target_aug = args.target_aug or target_aug
    check_args(args)
    return args


def check_args(args):
    """Impossible settings stop before anything is built."""
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
                "--knn-t": args.knn_t, "--dist-timeout": args.dist_timeout, "--bn-splits": args.bn_splits}
    at_least_zero = {"--seed": args.seed, "--workers": args.workers, "--lr": args.lr, "--weight-decay": args.weight_decay,
                     "--warmup-epochs": args.warmup_epochs, "--keep-checkpoints": args.keep_checkpoints,
                     "--stop-after-epochs": args.stop_after_epochs, "--lambda-warmup-steps": args.lambda_warmup_steps,
                     "--knn-every": args.knn_every, "--max-nonfinite-steps": args.max_nonfinite_steps}
    unit_interval = {"--lambda": args.lambda_, "--lambda-end": args.lambda_end,
                     "--lambda-warmup-start": args.lambda_warmup_start, "--ema-momentum": args.ema_momentum,
                     "--sgd-momentum": args.sgd_momentum}
    cli.check_ranges(positive, at_least_zero, unit_interval)
    scales = [(args.min_scale, 1.0)] + list(zip(args.local_crop_scales[::2], args.local_crop_scales[1::2]))
    if not all(0 < low <= high <= 1 for low, high in scales):
        raise UserError(f"crop scales are area shares: --min-scale and each --local-crop-scales pair (min max) "
                        f"need 0 < min <= max <= 1 (got {scales})")
    if args.max_bad_images < -1:
        raise UserError(f"--max-bad-images must be -1 (0.1% of the dataset) or a number of images >= 0 "
                        f"(got {args.max_bad_images})")
    if args.knn_max_train is not None and args.knn_max_train <= 0:
        raise UserError(f"--knn-max-train must be a positive number of images (got {args.knn_max_train}): "
                        "omit it to use the whole train split")
    if args.decode == "device" and args.augment == "cpu":
        raise UserError("--decode device crops and augments on the device: drop --augment cpu")
    if args.preload == "device" and args.augment == "cpu":
        raise UserError("--preload device augments on the device: drop --augment cpu (or use --preload off)")
    if lambda_scheduled(args) and args.loss != "sce":
        raise UserError(f"--lambda-schedule / --lambda-warmup-steps need the SCE loss (--method sce without "
                        f"--loss-coeffs); this run uses {args.loss}")
    smallest = min([args.crop_size] + args.local_crop_sizes)
    if smallest < MIN_BLUR_SIZE:
        raise UserError(f"crops of {smallest} px are too small to blur (sigma 2 reflects {MIN_BLUR_SIZE - 1} px): "
                        f"use --crop-size / --local-crop-sizes of at least {MIN_BLUR_SIZE}")


def build_criterion(args, lambda_=None):
    """The loss of the run; lambda_ overrides --lambda (its schedule)."""
    if args.loss == "combined":
        lam, mu, eta = args.loss_coeffs
        return functools.partial(losses.combined_loss, lambda_=lam, mu=mu, eta=eta, tau=args.tau, tau_m=args.tau_m)
    if args.loss == "infonce":
        return functools.partial(losses.infonce_loss, tau=args.tau)
    if args.loss == "ressl":
        return functools.partial(losses.ressl_loss, tau=args.tau, tau_m=args.tau_m)
    return functools.partial(losses.sce_loss, lambda_=args.lambda_ if lambda_ is None else lambda_, tau=args.tau,
                             tau_m=args.tau_m, mask_positive=args.mask_positive)


def main(argv=None):
    args = parse_args(argv)
    rank, world_size, _, device = du.init(timeout_s=args.dist_timeout)
    resolve_device_defaults(args, device, world_size)
    if world_size > 1:
        check_ranks_agree(args)
    bn_splits = check_world(args, world_size, device)
    lock = None
    if rank == 0 and not args.preview_views:
        outdir.prepare(args.output_dir)
        lock = outdir.Lock(args.output_dir)  # one run per folder, held until this run ends, however it ends
    try:
        pretrain(args, rank, world_size, device, bn_splits)
    finally:
        if lock:
            lock.release()


def pretrain(args, rank, world_size, device, bn_splits):
    settings = dict(vars(args))  # the resolved settings of this run, for args.json once it is accepted
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    dataset = build_dataset(args.dataset, args.data, "pretrain", class_list=args.class_list,
                            as_tensor=args.augment == "gpu", encoded=args.decode == "device")
    if len(dataset) < args.batch_size and not args.preview_views:
        raise UserError(f"{args.data} has {len(dataset)} images, fewer than one batch of {args.batch_size}: "
                        "lower --batch-size")
    sampler = ResumableSampler(len(dataset), args.batch_size, rank, world_size, args.seed)
    views = pretrain_views(args, on_device=args.augment == "gpu")
    if args.preview_views:
        if rank == 0:
            write_preview(args, dataset, views, device)
        du.cleanup()
        return
    max_bad = args.max_bad_images if args.max_bad_images >= 0 else max(1, len(dataset) // 1000)
    loader, batches = build_batches(args, dataset, sampler, views, device, max_bad)

    # lambda as a device tensor when it moves: a CUDA graph of the step reads it
    lam = torch.tensor(args.lambda_, device=device) if lambda_scheduled(args) else None
    model = SCE(build_criterion(args, lam), arch=args.arch, small_input=args.small_input,
                proj_hidden_dims=args.proj_hidden_dims, proj_dim=args.proj_dim, proj_last_bn=args.proj_last_bn,
                pred_hidden_dims=args.pred_hidden_dims, queue_size=args.queue_size, symmetric=args.symmetric,
                shuffle_bn=args.shuffle_bn, bn_splits=bn_splits, sync_bn=args.sync_bn and world_size > 1).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    knn_sets = build_knn_sets(args, device) if args.knn_data else None
    if args.demo:
        args.untrained_knn = knn_monitor(args, model, knn_sets, device)[0]
    base_lr = args.lr * args.batch_size / 256
    optimizer = build_optimizer(args.optimizer, model, base_lr, args.weight_decay, args.sgd_momentum,
                                args.wd_exclude_bias_norm)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    data = data_identity(dataset)
    start_epoch, start_step, last_stats = resume(args, model, optimizer, scaler, rank, data)
    check_epochs(args, start_epoch, start_step)
    # the checkpoint of the last epoch was saved, its line of log.txt (and kNN) not: a failure between the two
    unlogged = start_step == 0 and last_stats is not None and epochs_logged(args.output_dir) < start_epoch
    writer = cli.summary_writer(args.output_dir) if rank == 0 and (unlogged or start_epoch < args.epochs) else None
    if unlogged:
        if rank == 0:
            print(f"=> log.txt lacks epoch {start_epoch}, whose checkpoint was saved: completing its line", flush=True)
        log_epoch(args, model, start_epoch, last_stats, knn_sets, device, writer)
    if start_epoch == args.epochs:
        if rank == 0:
            print(f"=> the run in {args.output_dir} is already complete ({start_epoch} epochs): nothing to do; "
                  "raise --epochs to train longer", flush=True)
        if writer:
            writer.close()
        du.cleanup()
        return
    if rank == 0:
        with open(os.path.join(args.output_dir, "args.json"), "w") as f:
            json.dump(settings, f, indent=1)
    if args.compile:
        compile_model(model)

    ddp_model = du.wrap_ddp(model, device) if world_size > 1 else model
    preemption = Preemption(world_size, args.dist_timeout)
    if rank == 0:
        print(f"=> {args.method} on {len(dataset)} images, {sampler.steps} steps/epoch, batch {args.batch_size} "
              f"on {world_size} rank(s), lr {base_lr:.4g}", flush=True)
        print(chosen_path(args, batches, device), flush=True)

    terms = functools.partial(losses.loss_terms, tau=args.tau, tau_m=args.tau_m)
    training = Training(model, ddp_model, optimizer, scaler, cli.AMP[args.amp], terms=terms)
    step = build_step(training, device, args.cuda_graph, args.compile)
    run = Run(args=args, training=training, step=step, loader=loader, batches=batches, sampler=sampler,
              device=device, writer=writer, preemption=preemption, base_lr=base_lr, max_bad=max_bad,
              nonfinite=torch.zeros((), device=device), lam=lam)
    run.first_step = start_epoch * run.steps_per_epoch + start_step
    epochs_done_here = 0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch, start_step)
        stopped_at = train_one_epoch(run, epoch, start_step)
        if stopped_at is not None:  # preempted mid-epoch: save the exact position and leave
            if rank == 0:
                checkpoint.save(run_state(model, optimizer, scaler, args, epoch, stopped_at,
                                           epoch * run.steps_per_epoch + stopped_at, data), args.output_dir)
                print(f"=> preempted: saved epoch {epoch} step {stopped_at} to {args.output_dir}; "
                      f"exiting with code {PREEMPTED_EXIT_CODE}", flush=True)
            du.barrier()
            preemption.exit(writer)
        start_step = 0
        epochs_done_here += 1
        end_epoch(run, epoch + 1, knn_sets, data)
        if preemption.requested() and epoch + 1 < args.epochs:
            if rank == 0:
                print(f"=> preempted: saved epoch {epoch + 1}; exiting with code {PREEMPTED_EXIT_CODE}", flush=True)
            preemption.exit(writer)
        if args.stop_after_epochs and epochs_done_here >= args.stop_after_epochs and epoch + 1 < args.epochs:
            if rank == 0:
                print(f"=> stopping after {epochs_done_here} epoch(s) as asked; resume to continue", flush=True)
            break
    if args.demo:
        top1 = knn_monitor(args, model, knn_sets, device)[0]
        if rank == 0:
            print(f"kNN top-1: {top1:.1f}% (untrained: {args.untrained_knn:.1f}%)", flush=True)
    if writer:
        writer.close()
    du.cleanup()


def check_epochs(args, start_epoch, start_step):
    """--epochs below the checkpoint resumed is an error."""
    begun = start_epoch + (start_step > 0)
    if begun > args.epochs:
        raise UserError(f"the checkpoint is at epoch {begun}, --epochs {args.epochs} is below it: pass --epochs "
                        f"{begun} or more to continue it, or another --output-dir to start afresh")


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


def resolve_device_defaults(args, device, world_size):
    """The defaults that depend on the device, resolved so that args.json and the checkpoints record
    them: on a GPU the augmentations run there, JPEGs are decoded there, the model is compiled and,
    on one GPU process without fp16's GradScaler, the step is a CUDA graph."""
    args.augment = args.augment or ("gpu" if device.type == "cuda" or args.preload == "device" else "cpu")
    args.decode = cli.resolve_decode(args.decode, device) if args.augment == "gpu" else "loader"
    args.compile = resolve_compile(args.compile, device)
    graph_possible = device.type == "cuda" and world_size == 1 and args.amp != "fp16"
    if args.cuda_graph and not graph_possible:
        print("=> --cuda-graph needs one GPU process without --amp fp16 (GradScaler): the step runs eagerly",
              flush=True)
    args.cuda_graph = graph_possible and args.cuda_graph is not False


def build_batches(args, dataset, sampler, views, device, max_bad):
    """(loader or None, the epoch's batches of views on the device): the dataset preloaded on the
    device (--preload), else the loader's batches (DeviceViews)."""
    amp_dtype = cli.AMP[args.amp]
    images = None
    if wanted(args.preload, device) and args.augment == "gpu":
        images = preload(dataset, device, args.preload == "device", args.workers, max_bad)
    if images is not None:
        return None, PreloadedViews(images, views, sampler, args.seed, dtype=amp_dtype,
                                    channels_last=args.channels_last, compile=args.compile)
    loader = pretrain_loader(dataset, views, sampler, args.batch_size // du.world_size(), args.workers, device,
                             args.seed)
    return loader, DeviceViews(loader, device, dtype=amp_dtype, channels_last=args.channels_last, compile=args.compile)


def chosen_path(args, batches, device):
    """One line of what the run chose, so that --augment / --decode / --preload / --compile / --cuda-graph need
    reading only to choose otherwise: where the images come from, where the views are made, the step, --amp."""
    if isinstance(batches, PreloadedViews):
        data = f"preloaded on {device} ({batches.images.images.nbytes / 2 ** 20:.0f} MiB)"
    else:
        data = f"loader, {args.workers} worker(s)" + (", JPEGs decoded on the device" * (args.decode == "device"))
    views = "in the loader workers" if args.augment == "cpu" else f"on {device}" + (", compiled" * args.compile)
    step = f"CUDA graph after {GRAPH_WARMUP} steps" if args.cuda_graph else "compiled" if args.compile else "eager"
    return f"=> data: {data}; views: {views}; step: {step}; amp {args.amp}"


def check_world(args, world_size, device):
    """Settings impossible with this many ranks or this device stop here; returns the BN splits."""
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
    return bn_splits


def end_epoch(run, done, knn_sets, data):
    """After `done` epochs: save (rank 0; seconds for a ResNet-50 and its queue, while the other ranks
    wait at the kNN monitor or the barrier), then the epoch's line of log.txt with its kNN. The checkpoint
    holds the line's statistics: a run stopped between the two completes the line when rerun."""
    args, t = run.args, run.training
    if du.is_main():
        checkpoint.save(run_state(t.model, t.optimizer, t.scaler, args, done, 0, done * run.steps_per_epoch, data,
                                  run.epoch_stats),
                        args.output_dir, numbered=done % args.save_freq == 0 or done == args.epochs,
                        keep=args.keep_checkpoints)
    log_epoch(args, t.model, done, run.epoch_stats, knn_sets, run.device, run.writer)


def log_epoch(args, model, done, stats, knn_sets, device, writer):
    """Epoch `done`'s line of log.txt (one JSON line per epoch, as DINO's): its statistics, and the kNN
    monitor's numbers when due (every rank computes them)."""
    log = dict(epoch=done, **stats)
    if knn_sets and args.knn_every and (done % args.knn_every == 0 or done == args.epochs):
        log["knn_top1"], log["knn_top5"] = knn_monitor(args, model, knn_sets, device)
        if du.is_main():
            print(f"=> epoch {done}: kNN top-1 {log['knn_top1']:.2f} top-5 {log['knn_top5']:.2f}", flush=True)
        if writer:
            writer.add_scalar("knn/top1", log["knn_top1"], done)
            writer.add_scalar("knn/top5", log["knn_top5"], done)
    if du.is_main():
        with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
            f.write(json.dumps(log) + "\n")
    du.barrier()


def build_knn_sets(args, device):
    """(train set, val set, number of classes) of the kNN monitor: --knn-data in --dataset's layout, read
    as main_lincls.py --knn reads it (sce.evaldata: the same reader, class checks, preloading, and input
    size for this trunk), so that the monitor's number is the one main_lincls.py gives on the checkpoint."""
    size = eval_crop_size(None, args.small_input, vars(args), args.dataset)[0]
    return evaldata.splits(args.dataset, args.knn_data, size, args.small_input, device, args.preload, args.decode,
                           args.workers, class_list=args.class_list, what="kNN ")


def knn_monitor(args, model, knn_sets, device):
    """kNN (top-1, top-5) of the online encoder; every rank extracts and scores its share. BN running
    statistics are rank-local and only serve evaluation: every rank takes rank 0's, the checkpoint's."""
    for buffer in model.encoder.buffers():
        du.broadcast(buffer)

    def accuracy():
        compiles = len(compiling.SECONDS)
        result = knn_accuracy(model.encoder, *knn_sets, device, args.knn_k, args.knn_t, workers=min(args.workers, 4),
                              max_train=args.knn_max_train, seed=args.seed)
        if len(compiling.SECONDS) > compiles and du.is_main():  # eval mode, and the last partial batch
            print(f"=> the kNN monitor compiled the encoder: {compiling.summary(compiles)}", flush=True)
        return result
    if not args.compile:
        return accuracy()
    try:  # the compiled encoder compiles again in eval mode: a failure there costs the monitor nothing
        return accuracy()
    except Exception as e:  # noqa: BLE001: whatever stopped the compiled encoder, the eager one decides
        revert_to_eager(model.encoder)
        result = accuracy()
        warnings.warn(f"--compile: the kNN monitor's compile failed ({error_line(e)}): the encoder runs eagerly")
        return result


if __name__ == "__main__":
    cli.run(main)
