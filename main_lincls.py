#!/usr/bin/env python
"""Evaluate a frozen trunk of main_pretrain.py: linear classifier (default), kNN (--knn) or the many-shot transfer
logistic regression (--classifier logreg).

    python main_lincls.py --data DATA --pretrained OUT/checkpoint_last.pth
    torchrun --nproc_per_node 8 main_lincls.py --data IMAGENET --pretrained ... --schedule cosine
"""
import json
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from sce import UserError, cli, data, outdir, transfer
from sce import distributed as du
from sce.checkpoint import checkpoint_arch, copy_atomic, load_trunk, refuse_fewer_epochs, save_atomic
from sce.engine import compile_trunk, resolve_compile
from sce.knn import knn_accuracy, split_features
from sce.optim import build_optimizer, cosine_lr, load_optimizer_state, set_lr
from sce.preemption import PREEMPTED_EXIT_CODE, Preemption
from sce.progress import Progress


def get_parser():
    p = cli.make_parser(__doc__)
    g = p.add_argument_group("data and trunk")
    g.add_argument("--data", metavar="DIR", required=True, help="DIR with train/ and val/ (ImageFolder), the root "
                   "of a built-in dataset, or a VOCdevkit/VOC2007 tree (--dataset voc07)")
    cli.add_data_args(g, "small-input trunks (linear and kNN): auto decodes train and val once onto a GPU when they "
                      "fit in a quarter of its memory, then crops, flips and normalises batches there; device: always "
                      "(on a CPU run, in host memory); off: the loader", data.DATASETS + ["voc07"])
    g.add_argument("--crop-size", type=int, default=None,
                   help="input size in pixels (default: a small-input trunk's pretraining crop size from its "
                        "checkpoint, else 32 CIFAR, 96 STL10, 64 Tiny-ImageNet, else 224)")
    cli.add_trunk_args(p, required=False)
    g = p.add_argument_group("runtime")
    cli.add_runtime_args(g, os.path.join("runs", "lincls"), "checkpoints, results_<classifier>.json, TensorBoard "
                         "scalars, feature cache", "seed of the head init, the shuffling, the probe's crops and the "
                         "logreg hold-out", "the trunk",
                         "the linear probe; a finished one reports its result again; --pretrained, if given, must "
                         "hold the probe's trunk", torchrun=True)
    g.add_argument("-p", "--print-freq", type=int, default=10, help="progress line every N steps")
    g.add_argument("--classifier", default="linear", choices=["linear", "knn", "logreg"],
                   help="linear probe (SGD), kNN, or many-shot transfer logistic regression")
    g.add_argument("--knn", action="store_true", help="same as --classifier knn")
    g = p.add_argument_group("linear classifier")
    g.add_argument("--schedule", default="step", choices=["step", "cosine"],
                   help="step: lr 30, 100 epochs, x0.1 at --milestones (small datasets, ImageNet100); "
                   "cosine: lr 0.1 x batch/256, 90 epochs, batch 1024 (ImageNet)")
    g.add_argument("--epochs", type=int, default=None, help="training epochs (default: 100 step, 90 cosine)")
    g.add_argument("-b", "--batch-size", type=int, default=None,
                   help="global batch over all ranks (default: 256 step, 1024 cosine)")
    g.add_argument("--lr", "--learning-rate", type=float, default=None,
                   help="learning rate (default: 30 step, 0.1 x batch/256 cosine)")
    g.add_argument("--milestones", metavar="EPOCH", type=int, nargs="+", default=[60, 80],
                   help="step schedule: lr x0.1 at these epochs")
    g.add_argument("--warmup-epochs", type=int, default=0, help="epochs of linear lr warmup, cosine schedule only")
    g.add_argument("--weight-decay", "--wd", type=float, default=0.0, help="weight decay of fc.weight")
    g.add_argument("--sgd-momentum", "--momentum", type=float, default=0.9, help="momentum of SGD / LARS")
    g.add_argument("--optimizer", default="sgd", choices=["sgd", "lars"], help="optimizer of the head")
    g.add_argument("-e", "--evaluate", action="store_true",
                   help="only measure val Acc@1 / Acc@5 of the head of a main_lincls.py checkpoint "
                   "(--pretrained), into results_evaluate.json")
    g = p.add_argument_group("kNN")
    cli.add_knn_args(g)
    g = p.add_argument_group("many-shot logistic regression")
    g.add_argument("--metric", default="auto", choices=["auto"] + transfer.METRICS,
                   help="auto: map11 for voc07, else top1")
    g.add_argument("--val-fraction", type=float, default=0.2,
                   help="share of train held out to pick C (voc07 uses its val split)")
    g.add_argument("--logreg-c", metavar="C", type=float, default=None, help="skip the C search and use this C")
    g.add_argument("--logreg-max-iter", type=int, default=1000, help="L-BFGS iterations per fit")
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    cli.check_finite(args)
    if args.knn:
        args.classifier = "knn"
    cosine = args.schedule == "cosine"
    args.epochs = args.epochs or (90 if cosine else 100)
    args.batch_size = args.batch_size or (1024 if cosine else 256)
    args.lr = args.lr if args.lr is not None else (0.1 * args.batch_size / 256 if cosine else 30.0)
    positive = {"--epochs": args.epochs, "--batch-size": args.batch_size, "--crop-size": args.crop_size,
                "--print-freq": args.print_freq, "--knn-k": args.knn_k, "--knn-t": args.knn_t,
                "--logreg-c": args.logreg_c, "--logreg-max-iter": args.logreg_max_iter,
                "--dist-timeout": args.dist_timeout}
    at_least_zero = {"--workers": args.workers, "--lr": args.lr, "--weight-decay": args.weight_decay,
                     "--warmup-epochs": args.warmup_epochs, "--seed": args.seed}
    cli.check_ranges(positive, at_least_zero, {"--sgd-momentum": args.sgd_momentum})
    if args.dataset == "voc07" and args.classifier != "logreg":
        raise UserError("--dataset voc07 is multi-label: use --classifier logreg (or main_lowshot.py)")
    last = os.path.join(args.output_dir, "checkpoint_last.pth")
    probe = args.classifier == "linear" and not args.evaluate  # the one mode that writes checkpoints
    if args.resume not in ("auto", "none") and args.classifier != "linear":
        raise UserError(f"--resume continues a linear probe; --classifier {args.classifier} reads --pretrained")
    if args.resume == "none" and probe and os.path.isfile(last):
        raise UserError(f"{last} exists and --resume none would overwrite it: use --resume auto to continue (or "
                        "report) it, or another --output-dir")
    if args.resume == "auto":
        args.resume = last if probe and os.path.isfile(last) else ""
    args.resume = "" if args.resume == "none" else args.resume
    source = args.resume or args.pretrained
    if not source:
        raise UserError("pass --pretrained CHECKPOINT (or --resume a main_lincls.py checkpoint)")
    outdir.prepare(args.output_dir)  # every rank, before any work: none waits for one that stopped

    _, _, _, device = du.init(timeout_s=args.dist_timeout)
    lock = outdir.Lock(args.output_dir) if du.is_main() else None  # one run per folder, for its whole life
    try:
        evaluate(args, source, device)
    finally:
        if lock:
            lock.release()
    du.cleanup()  # not after an error: the failing rank must report first, its peers fail when it is gone


def evaluate(args, source, device):
    args.compile = resolve_compile(args.compile, device)
    args.decode = data.resolve_decode(args.decode, device)
    trunk, feat_dim, ckpt = load_trunk(source, args.arch, args.small_input, "online" if args.resume else args.encoder)
    args.arch = args.arch or checkpoint_arch(ckpt)[0] or "resnet50"
    args.small_input = isinstance(trunk.maxpool, nn.Identity)
    named = trunk  # the trunk --pretrained names, which a resumed probe must hold
    if args.resume and args.pretrained:
        named = load_trunk(args.pretrained, args.arch, args.small_input, args.encoder)[0]
        if outdir.trunk_digest(named) != outdir.trunk_digest(trunk):
            raise UserError(f"{args.resume} is a probe of another trunk than {args.pretrained}'s: pass another "
                            "--output-dir (or --resume none into an empty one) to probe this trunk")
    if args.resume and ckpt.get("data") and (ckpt["args"]["dataset"], ckpt["data"]) != (args.dataset,
                                                                                      os.path.abspath(args.data)):
        raise UserError(f"{args.resume} is a probe on other data (--dataset {ckpt['args'].get('dataset')} --data "
                        f"{ckpt.get('data')}): pass that data to continue it, or another --output-dir")
    if du.is_main():
        outdir.bind_evaluation(args.output_dir, args.pretrained or source, named, args.dataset, args.data)
    args.crop_size, why, warning = data.eval_crop_size(args.crop_size, args.small_input, ckpt.get("args"),
                                                       args.dataset)
    if du.is_main():
        print(f"=> {args.arch}{' (small input)' if args.small_input else ''} trunk ({feat_dim}-d) "
              f"from {source}; input {args.crop_size} px ({why})", flush=True)
        if warning:
            print(warning, flush=True)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    trunk.to(device)
    if args.compile:
        compile_trunk(trunk)  # keeps the state-dict keys: the checkpoints stay those of an eager run
    if args.classifier == "linear":
        run_linear(args, trunk, feat_dim, ckpt, source, device)
    elif args.classifier == "knn":
        run_knn(args, trunk, device)
    else:
        run_logreg(args, trunk, source, device)


def splits(args, device, augment_train):
    """(train, val, number of classes), sce.data.EvalSplits as the evaluation reads them."""
    return data.eval_splits(args.dataset, args.data, args.crop_size, args.small_input, device, args.preload,
                            args.decode, args.workers, augment_train, seed=args.seed, budget=data.Budget(device))


def write_results(args, results, name=None):
    with open(os.path.join(args.output_dir, f"results_{name or args.classifier}.json"), "w") as f:
        json.dump(results, f, indent=2)


# ---------------------------------------------------------------- linear classifier

def check_frozen(model, reference):
    """Stop if any trunk tensor (weights and BN buffers) differs from `reference`."""
    for k, v in model.state_dict().items():
        if k in reference and not torch.equal(v, reference[k]):
            raise RuntimeError(f"trunk tensor {k} changed during linear training: the trunk must stay "
                               "frozen (requires_grad False, eval mode); this is a bug, please report it")


def check_finite(first_bad, epoch):
    """Stops the run at the first non-finite loss, noted on the device as (step, loss)."""
    step, loss = first_bad.tolist()
    if step >= 0:
        raise UserError(f"loss is {loss} at epoch {epoch + 1} step {int(step) + 1}: lower --lr")


@torch.no_grad()
def validate(model, val_batches, device, amp):
    """(Acc@1, Acc@5, mean loss) over the val images of every rank."""
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1, top-5, images
    for images, target in val_batches:
        with cli.autocast(device, amp):
            out = model(images).float()
        hit = out.topk(min(5, out.shape[1]), dim=1).indices == target[:, None]
        totals += torch.stack([F.cross_entropy(out, target, reduction="sum").double(),
                               hit[:, :1].any(1).sum().double(), hit.any(1).sum().double(),
                               torch.full((), len(target), dtype=torch.float64, device=device)])  # a fill: no copy
    totals = du.all_reduce_sum(totals)
    n = max(totals[3].item(), 1.0)
    return 100.0 * totals[1].item() / n, 100.0 * totals[2].item() / n, totals[0].item() / n


def attach_head(model, feat_dim, num_classes, ckpt, source, args, device):
    """A torchvision ResNet again: the frozen trunk plus a linear fc, N(0, 0.01) weights and zero bias,
    or the trained head of a main_lincls.py checkpoint (--resume, --evaluate)."""
    model.fc = nn.Linear(feat_dim, num_classes).to(device)
    nn.init.normal_(model.fc.weight, 0.0, 0.01)
    nn.init.zeros_(model.fc.bias)
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("fc.")
    if ckpt.get("kind") == "lincls" and (args.resume or args.evaluate):
        head = {k[3:]: v for k, v in ckpt["model"].items() if k.startswith("fc.")}
        if head["weight"].shape != model.fc.weight.shape:
            raise UserError(f"{source} has a {head['weight'].shape[0]}-class head but {args.data} has "
                            f"{num_classes} classes")
        model.fc.load_state_dict(head)
    elif args.resume:
        raise UserError(f"--resume {source} is not a main_lincls.py checkpoint (kind "
                        f"{ckpt.get('kind')!r}): pass it as --pretrained")
    elif args.evaluate:
        raise UserError("--evaluate needs a trained head: pass a main_lincls.py checkpoint as --pretrained")


def train_one_epoch(args, ddp, train_batches, optimizer, scaler, epoch, start, steps, sums, progress, preemption,
                    device):
    """The head's steps of one epoch from step `start` of its `steps`; sums: this rank's (loss sum, images) of
    the epoch so far, a device tensor added to. Returns the step to resume from if a stop was requested (its
    state is for the caller to save), else None."""
    first_bad = torch.full((2,), -1.0, device=device)  # (step, loss) of the epoch's first non-finite loss
    for i, (images, target) in enumerate(train_batches, start=start):
        if args.schedule == "cosine":
            set_lr(optimizer, cosine_lr(epoch * steps + i, args.epochs * steps, args.lr, args.warmup_epochs * steps))
        with cli.autocast(device, args.amp):
            loss = F.cross_entropy(ddp(images).float(), target)
        # noted on the device, checked at the progress lines: no host sync per step
        bad_now = torch.stack([torch.full_like(loss, i), loss.detach()])
        first_bad = torch.where((first_bad[0] < 0) & ~torch.isfinite(loss), bad_now, first_bad)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        sums += torch.stack([loss.detach().double() * len(images), sums.new_tensor(float(len(images)))])
        progress.update(len(images) * du.world_size())
        if (i + 1) % args.print_freq == 0 or i + 1 == steps:
            check_finite(first_bad, epoch)
            if du.is_main():
                print(f"Epoch [{epoch + 1}/{args.epochs}][{i + 1}/{steps}] loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.4g} {progress.report()}", flush=True)
        if preemption.stop_within_epoch(i + 1, steps, args.print_freq):
            check_finite(first_bad, epoch)
            return i + 1
    return None


def run_linear(args, model, feat_dim, ckpt, source, device):
    rank, world = du.rank(), du.world_size()
    if args.batch_size % world:
        raise UserError(f"--batch-size {args.batch_size} is not a multiple of the {world} processes")
    train_ds, val_ds, num_classes = splits(args, device, augment_train=True)
    attach_head(model, feat_dim, num_classes, ckpt, source, args, device)
    model.eval()  # BN of the trunk keeps its statistics: only fc learns
    reference = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith("fc.")}

    per_rank = args.batch_size // world
    sampler = data.ShuffledShards(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    steps = math.ceil(sampler.num_samples / per_rank)
    train_batches = train_ds.batches(per_rank, sampler)
    val_batches = val_ds.batches(per_rank)  # every val image on one rank

    if args.evaluate:
        acc1, acc5, loss = validate(model, val_batches, device, args.amp)
        if du.is_main():
            print(f"Acc@1 {acc1:.2f} Acc@5 {acc5:.2f} loss {loss:.4f}", flush=True)
            write_results(args, {"evaluate": os.path.abspath(source), "acc1": acc1, "acc5": acc5}, "evaluate")
        return

    # DDP only all-reduces parameters that require grad: here those of fc
    ddp = (DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
           if world > 1 else model)
    optimizer = build_optimizer(args.optimizer, model, args.lr, args.weight_decay, args.sgd_momentum,
                                exclude_bias_norm=True)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    start_epoch, start_step, best_acc1 = 0, 0, -1.0  # the first evaluated epoch is always the best so far
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # this rank's loss sum and images of the epoch
    acc1 = acc5 = None
    if args.resume:
        load_optimizer_state(optimizer, ckpt["optimizer"])
        if ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch, start_step, best_acc1 = ckpt["epoch"], ckpt.get("step_in_epoch", 0), ckpt.get("best_acc1", 0.0)
        acc1, acc5 = ckpt.get("acc1"), ckpt.get("acc5")
        if start_step and rank == 0:  # the epoch's sums so far, over every rank
            sums += torch.tensor(ckpt["epoch_sums"], dtype=torch.float64, device=device)
        refuse_fewer_epochs(source, start_epoch, start_step, args.epochs)
        if du.is_main():
            print(f"=> resumed from {source} at epoch {start_epoch}" + (f" step {start_step}" if start_step else "")
                  + f" (best Acc@1 {best_acc1:.2f})", flush=True)

    def state(epoch, step_in_epoch=0, epoch_sums=None):
        return {"kind": "lincls", "epoch": epoch, "step_in_epoch": step_in_epoch, "epoch_sums": epoch_sums,
                "args": vars(args), "data": os.path.abspath(args.data), "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "best_acc1": best_acc1,
                "acc1": acc1, "acc5": acc5}

    if start_epoch == args.epochs and acc1 is None:  # a finished probe of an older version: measured again
        acc1, acc5, _ = validate(model, val_batches, device, args.amp)
    writer = cli.summary_writer(args.output_dir) if du.is_main() and start_epoch < args.epochs else None
    preemption = Preemption(world, args.dist_timeout)
    # every remaining step, padded as DistributedSampler pads: the ETA covers the rest of the run
    progress = Progress(((args.epochs - start_epoch) * sampler.num_samples - start_step * per_rank) * world)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch, start_step * per_rank)
        if args.schedule == "step":
            set_lr(optimizer, args.lr * 0.1 ** sum(epoch >= m for m in args.milestones))
        stopped_at = train_one_epoch(args, ddp, train_batches, optimizer, scaler, epoch, start_step, steps, sums,
                                     progress, preemption, device)
        if stopped_at is not None:  # a stop request mid-epoch: save the exact position and leave
            totals = du.all_reduce_sum(sums.clone()).tolist()
            if du.is_main():
                save_atomic(state(epoch, stopped_at, totals), os.path.join(args.output_dir, "checkpoint_last.pth"))
                print(f"=> preempted: saved epoch {epoch} step {stopped_at} to {args.output_dir}; exiting with code "
                      f"{PREEMPTED_EXIT_CODE}", flush=True)
            du.barrier()
            preemption.exit(writer)
        start_step = 0
        if epoch == start_epoch:
            check_frozen(model, reference)
        totals = du.all_reduce_sum(sums.clone())
        train_loss = (totals[0] / totals[1].clamp(min=1)).item()
        sums.zero_()
        acc1, acc5, val_loss = validate(model, val_batches, device, args.amp)
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if du.is_main():
            print(f"Epoch {epoch + 1}/{args.epochs}: Acc@1 {acc1:.2f} Acc@5 {acc5:.2f} val loss {val_loss:.4f} "
                  f"(best Acc@1 {best_acc1:.2f})", flush=True)
            if writer:
                for tag, value in [("train/loss", train_loss), ("train/lr", optimizer.param_groups[0]["lr"]),
                                   ("val/acc1", acc1), ("val/acc5", acc5), ("val/loss", val_loss)]:
                    writer.add_scalar(tag, value, epoch + 1)
                writer.flush()
            last = os.path.join(args.output_dir, "checkpoint_last.pth")
            save_atomic(state(epoch + 1), last)
            if is_best:
                copy_atomic(last, os.path.join(args.output_dir, "model_best.pth"))
        if epoch + 1 < args.epochs and preemption.requested():
            if du.is_main():
                print(f"=> preempted: saved epoch {epoch + 1}; exiting with code {PREEMPTED_EXIT_CODE}", flush=True)
            preemption.exit(writer)
    if writer:
        writer.close()
    if du.is_main():
        if start_epoch == args.epochs:
            print(f"=> the probe in {args.output_dir} is already complete ({args.epochs} epochs): its result is "
                  "reported again; raise --epochs to train longer", flush=True)
        print(f"Acc@1 {acc1:.2f} (best Acc@1 {best_acc1:.2f})", flush=True)
        write_results(args, {"acc1": acc1, "acc5": acc5, "best_acc1": best_acc1, "epochs": args.epochs,
                             "pretrained": os.path.abspath(args.pretrained or source)})


# ---------------------------------------------------------------- features (kNN, logistic regression)

def one_process():
    """True on rank 0, which goes on alone (scikit-learn runs on one process): every rank leaves the
    process group first, so that no rank waits under a collective timeout while rank 0 works."""
    main = du.is_main()
    du.cleanup()
    return main


def features(args, trunk, split, name, source):
    """Cached trunk features of one split (not normalised), and its labels."""
    x = split_features(trunk, split, name, args.output_dir, checkpoint=source, batch_size=256,
                       amp_dtype=cli.AMP[args.amp], encoder=args.encoder, arch=args.arch, small_input=args.small_input,
                       dataset=args.dataset, data=os.path.abspath(args.data))
    return x, np.asarray(split.targets)


# ---------------------------------------------------------------- kNN

def run_knn(args, trunk, device):
    # the memory bank is the train split, the queries the val split, both without augmentation; every
    # rank extracts and scores its share (sce.knn), as the kNN monitor of main_pretrain.py does
    bank, queries, num_classes = splits(args, device, augment_train=False)
    with cli.autocast(device, args.amp):
        top1, top5 = knn_accuracy(trunk, bank, queries, num_classes, args.knn_k, args.knn_t)
    if du.is_main():
        print(f"kNN (k {args.knn_k}, t {args.knn_t}, {len(bank)} train / {len(queries)} val images): "
              f"Acc@1 {top1:.2f} Acc@5 {top5:.2f}", flush=True)
        write_results(args, {"acc1": top1, "acc5": top5, "k": args.knn_k, "t": args.knn_t})


# ---------------------------------------------------------------- many-shot logistic regression

def run_logreg(args, trunk, source, device):
    metric = args.metric if args.metric != "auto" else ("map11" if args.dataset == "voc07" else "top1")
    if (metric == "map11") != (args.dataset == "voc07"):
        raise UserError(f"--metric {metric} does not fit --dataset {args.dataset}: map11 is for the "
                        "multi-label voc07, top1 / mean-per-class for the others")
    if not one_process():  # scikit-learn runs on one process
        return
    # ssl-transfer: bicubic resize of the short side + centre crop, no augmentation; an ImageNet-stem trunk's JPEGs
    # decoded, resized and cropped on the device (--decode)
    route = "decode" if data.decodes_on_device(args.decode, args.small_input) else "loader"
    geometry = data.Geometry(args.crop_size, args.crop_size, mode="bicubic")

    def read(dataset):
        return data.eval_split(dataset, geometry, device, route, args.workers, args.seed)
    reader = "encoded" if route == "decode" else "pil"
    if args.dataset == "voc07":  # its own val split picks C, then train+val is refit
        split_data = {s: data.read_voc07(args.data, s) for s in ("train", "val", "test")}  # all checked first
        feats = {s: features(args, trunk, read(data.ImageList(p, y, read=reader)), s, source)[0]
                 for s, (p, y) in split_data.items()}
        labels = {s: y for s, (_, y) in split_data.items()}
        sel_x, sel_y, val_x, val_y = feats["train"], labels["train"], feats["val"], labels["val"]
        fit_x = np.concatenate([feats["train"], feats["val"]])
        fit_y = np.concatenate([labels["train"], labels["val"]])
        test_x, test_y = feats["test"], labels["test"]
    else:  # a seeded share of train picks C, then all of train is refit; DATA/val is the test set
        train_ds, test_ds, _ = data.read_splits(args.dataset, args.data, reader)
        fit_x, fit_y = features(args, trunk, read(train_ds), "train", source)
        test_x, test_y = features(args, trunk, read(test_ds), "val", source)
        tr, va = transfer.holdout_split(fit_y, args.val_fraction, args.seed)
        sel_x, sel_y, val_x, val_y = fit_x[tr], fit_y[tr], fit_x[va], fit_y[va]

    count = transfer.FitCount()  # fits stopped by --logreg-max-iter, said with the result
    if args.logreg_c is not None:
        best_c, history = args.logreg_c, []
    else:
        print(f"picking C on {len(val_x)} validation images ({len(transfer.LOGREG_WDS)} wd values)", flush=True)
        best_c, history = transfer.select_logreg(sel_x, sel_y, val_x, val_y, metric,
                                                 max_iter=args.logreg_max_iter, count=count)
    score = transfer.fit_eval_logreg(fit_x, fit_y, test_x, test_y, metric, best_c, args.logreg_max_iter, count)
    print(f"logistic regression (C {best_c:.4g}, refit on {len(fit_x)} images): test {metric} {score:.2f} "
          f"({count.note(args.logreg_max_iter, '--logreg-max-iter')})", flush=True)
    write_results(args, {"metric": metric, "test": score, "C": best_c,
                         "val": [{"C": c, "score": s} for c, s in history],
                         "fits": len(count.stalled), "unconverged_fits": sum(count.stalled)})


if __name__ == "__main__":
    cli.run(main)
