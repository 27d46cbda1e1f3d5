#!/usr/bin/env python
"""Evaluate a frozen trunk of main_pretrain.py: linear classifier (default), kNN (--knn) or the many-shot transfer
logistic regression (--classifier logreg).

    python main_lincls.py --data DATA --pretrained OUT/checkpoint_last.pth
    torchrun --nproc_per_node 8 main_lincls.py --data IMAGENET --pretrained ... --schedule cosine
"""
import sce  # first: a stop signal during the imports below (torch's take seconds) is said, exit 75
sce.stop_while_importing(__name__ == "__main__")
import argparse
import os

import numpy as np
import torch

from sce import UserError, cli, data, entry, events, outdir, preemption, timing, transfer
from sce import distributed as du
from sce.checkpoint import Writer, check_trunk, load_trunk, refuse_fewer_epochs, require
from sce.compiling import Log, resolve_compile
from sce.frozen import load_frozen, split_features
from sce.knn import knn_accuracy
from sce.optim import build_optimizer, load_optimizer_state
from sce.preemption import Interrupted, Preemption, stop
from sce.probe import (Head, Probe, ProbeRun, Step, check_frozen, check_resume, end_probe_epoch, graphs_for,
                       make_head, state, train_probe_epoch, validate)
from sce.progress import Progress
from sce.resume import check_mid_epoch

FEATURES_BATCH = 256  # the frozen trunk's batches where it only extracts features (kNN, logistic regression)


def get_parser():
    p = cli.make_parser(__doc__)
    g = p.add_argument_group("data and trunk")
    g.add_argument("--data", metavar="DIR", required=True, help="DIR with train/ and val/ (ImageFolder), the root "
                   "of a built-in dataset, or a VOCdevkit/VOC2007 tree (--dataset voc07)")
    cli.add_data_args(g, "small-input trunks (linear and kNN): auto decodes train and val once onto a GPU when they "
                      "fit in a quarter of its memory, then crops, flips and normalises batches there; device: always "
                      "(on a CPU run, in host memory); off: the loader", [*data.DATASETS, "voc07"])
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
    g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction,
                   help="replay the probe's step from a CUDA graph: one launch instead of dozens (default: on for one "
                        "GPU process without --amp fp16)")
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
    positive = {"--epochs": args.epochs, "--batch-size": args.batch_size, "--lr": args.lr,
                "--crop-size": args.crop_size, "--print-freq": args.print_freq, "--milestones": min(args.milestones),
                "--knn-k": args.knn_k, "--knn-t": args.knn_t, "--logreg-c": args.logreg_c,
                "--logreg-max-iter": args.logreg_max_iter, "--dist-timeout": args.dist_timeout}
    at_least_zero = {"--workers": args.workers, "--weight-decay": args.weight_decay,
                     "--warmup-epochs": args.warmup_epochs}
    # before the defaults fill in: 0 is refused, not taken for "not given"
    cli.check_ranges(positive, at_least_zero, {"--sgd-momentum": args.sgd_momentum})
    if not 0 < args.val_fraction < 1:
        raise UserError(f"--val-fraction must lie between 0 and 1, both excluded (got {args.val_fraction})")
    cosine = args.schedule == "cosine"
    args.epochs = args.epochs if args.epochs is not None else (90 if cosine else 100)
    args.batch_size = args.batch_size if args.batch_size is not None else (1024 if cosine else 256)
    args.lr = args.lr if args.lr is not None else (0.1 * args.batch_size / 256 if cosine else 30.0)
    cli.check_seed(args.seed)
    args.workers = cli.cap_processes(args.workers)
    data.data_folder(args.data, dataset=args.dataset)  # before the output folder is bound to it
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
    if args.pretrained and not args.resume:  # the file and its input size checked before the output folder is made
        _, small_input, recorded = check_trunk(args.pretrained, args.arch, args.small_input, args.encoder)
        data.eval_crop_size(args.crop_size, small_input, recorded, args.dataset)
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
    split = timing.Split(Log())  # where this invocation's wall time goes (the linear probe's)
    split.mark("imports")  # the interpreter, the imports, the flags, the process group
    frozen = load_frozen(source, args.arch, args.small_input, "online" if args.resume else args.encoder, device,
                         compile=args.compile, compiles=split.compiles)
    args.arch, args.small_input = frozen.arch, frozen.small_input
    split.mark("trunk")
    named = frozen.trunk  # the trunk --pretrained names, which a resumed probe must hold
    if args.resume and args.pretrained:
        named = load_trunk(args.pretrained, args.arch, args.small_input, args.encoder, say=False)[0]
        if outdir.trunk_digest(named) != outdir.trunk_digest(frozen.trunk):
            raise UserError(f"{args.resume} is a probe of another trunk than {args.pretrained}'s: pass another "
                            "--output-dir (or --resume none into an empty one) to probe this trunk")
    if args.resume:
        check_resume(args.resume, frozen.ckpt, args)
    if du.is_main():
        outdir.bind_evaluation(args.output_dir, args.pretrained or source, named, args.dataset, args.data)
    args.crop_size, why, warning = data.eval_crop_size(args.crop_size, args.small_input, frozen.ckpt.get("args"),
                                                       args.dataset)
    probe = args.classifier == "linear"
    batch = args.batch_size // du.world_size() if probe else FEATURES_BATCH  # a process's
    what = (f"--batch-size {args.batch_size}" + (f" ({batch} a process)" if batch != args.batch_size else "")
            if probe else f"--classifier {args.classifier}'s batches of {batch}")  # not --batch-size: the probe's
    cli.check_memory(device, {f"{what} images of {args.crop_size} px (--crop-size): their pixels in float32":
                              (batch * 3 * args.crop_size ** 2 * 4,
                               "lower --batch-size or --crop-size" if probe else "lower --crop-size")})
    if du.is_main():
        print(f"=> {frozen.describe()} from {source}; input {args.crop_size} px ({why})", flush=True)
        if warning:
            print(warning, flush=True)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    if args.classifier == "linear":
        linear(args, frozen, source, device, split)
    elif args.classifier == "knn":
        run_knn(args, frozen, device)
    else:
        run_logreg(args, frozen, source, device)


def splits(args, device, augment_train):
    """(train, val, number of classes), sce.data.EvalSplits as the evaluations read them."""
    return data.eval_splits(args.dataset, args.data, args.crop_size, args.small_input, device,
                            preload_mode=args.preload, decode=args.decode, workers=args.workers,
                            augment_train=augment_train, seed=args.seed, budget=data.Budget(device))


def write_results(args, results, name=None):
    """results_<classifier>.json, the last work of every mode: a stop signal after it is said, exit 0."""
    outdir.write_json(os.path.join(args.output_dir, f"results_{name or args.classifier}.json"), results)
    preemption.finished()


# ---------------------------------------------------------------- linear classifier

def linear(args, frozen, source, device, split):
    """The linear probe: epochs of the head's steps on the frozen trunk's features (sce.probe), each validated and
    saved in the background; a stop request saves and leaves as pretraining's does. --evaluate: the val accuracy of
    a trained head."""
    rank, world = du.rank(), du.world_size()
    if args.batch_size % world:
        raise UserError(f"--batch-size {args.batch_size} is not a multiple of the {world} processes")
    train, val, num_classes = splits(args, device, augment_train=True)
    split.mark("data")  # listed, and preloaded where it is
    head = make_head(frozen.feat_dim, num_classes, device)
    load_head(head, frozen.ckpt, source, args, num_classes)
    reference = {k: v.detach().clone() for k, v in frozen.trunk.state_dict().items()}
    sampler = data.ShuffledShards(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    # a mid-epoch resume needs the same: its files and labels (or CIFAR's and STL-10's pixels) too
    train_data = {"num_images": len(train), "data_id": train.data_id, "data_order": data.ORDER_VERSION}
    probe = Probe.of(args, sampler.num_samples, cli.AMP[args.amp], train_data)
    ddp = du.wrap_ddp(head, device) if world > 1 else head  # DDP all-reduces the head's gradients only
    optimizer = build_optimizer(args.optimizer, head, args.lr, args.weight_decay, args.sgd_momentum,
                                exclude_bias_norm=True)
    model = Head(frozen, head, ddp, optimizer, torch.amp.GradScaler(device.type, enabled=args.amp == "fp16"))
    if args.evaluate:
        return evaluate_head(args, probe, model, val, source, device)
    start_epoch, start_step, best, acc, sums = resume_probe(args, model, source, device, train_data)
    tensorboard = events.summary_writer(args.output_dir) if du.is_main() and start_epoch < args.epochs else None
    run = ProbeRun(args=args, probe=probe, model=model, train=train.batches(probe.per_rank, sampler),
                   val=val.batches(probe.per_rank), device=device, preemption=Preemption(world, args.dist_timeout),
                   tensorboard=tensorboard, checkpoints=Writer(split.stopwatch("epoch_ends")),
                   validation=split.stopwatch("evaluation"),
                   step=Step(probe, model, sums, graphs_for(args, device, world)))
    # every remaining step, padded as DistributedSampler pads: the ETA covers the rest of the run
    progress = Progress(((args.epochs - start_epoch) * sampler.num_samples - start_step * probe.per_rank) * world)
    split.loop()
    done = start_epoch  # the epochs this invocation completed end there
    try:
        for epoch in range(start_epoch, args.epochs):
            sampler.set_epoch(epoch, start_step * probe.per_rank)
            stopped_at = train_probe_epoch(run, epoch, start_step, progress)
            if stopped_at is not None:  # a stop request mid-epoch: save the exact position and leave
                stopped = state(run, epoch, stopped_at, du.all_reduce_sum(sums.clone()).tolist(), best, acc)
                stop(run.preemption, tensorboard, f"epoch {epoch} step {stopped_at} to {args.output_dir}",
                     lambda: save_now(run.checkpoints, stopped, args.output_dir))
            start_step = 0
            if epoch == start_epoch:
                check_frozen(frozen.trunk, reference)
            best, acc = end_probe_epoch(run, epoch, sums, best)
            done = epoch + 1
            if du.is_main():  # the split so far: what a kill leaves of this invocation's
                split.save(args.output_dir, epochs=[start_epoch, done])
            if epoch + 1 < args.epochs and run.preemption.requested():
                stop(run.preemption, tensorboard, f"epoch {epoch + 1}", run.checkpoints.wait)
        run.checkpoints.wait()
    except BaseException as e:
        if not isinstance(e, Interrupted):  # a failure waits for the save in flight too; a second Ctrl-C does not
            run.checkpoints.wait(quiet=True)
        raise
    finally:  # however the loop ended: complete, stopped (exit 75) or failed
        split.done()
        if du.is_main():
            timed = split.write(args.output_dir, epochs=[start_epoch, done])
    if tensorboard:
        tensorboard.close()
    if du.is_main():
        report_probe(args, source, start_epoch == args.epochs, best, acc, timed)


def evaluate_head(args, probe, model, val, source, device):
    """--evaluate: the val accuracy of a trained head, said and written."""
    acc1, acc5, loss = validate(probe, model, val.batches(probe.per_rank), device)
    if du.is_main():
        print(f"Acc@1 {acc1:.2f} Acc@5 {acc5:.2f} loss {loss:.4f}", flush=True)
        write_results(args, {"evaluate": os.path.abspath(source), "acc1": acc1, "acc5": acc5}, "evaluate")


def report_probe(args, source, was_complete, best, acc, timed):
    """The probe's last line and results_linear.json (again, when the probe was complete already)."""
    if was_complete:
        print(f"=> the probe in {args.output_dir} is already complete ({args.epochs} epochs): its result is "
              "reported again; raise --epochs to train longer", flush=True)
    print(f"Acc@1 {acc[0]:.2f} (best Acc@1 {best:.2f})", flush=True)
    write_results(args, {"acc1": acc[0], "acc5": acc[1], "best_acc1": best, "epochs": args.epochs,
                         "pretrained": os.path.abspath(args.pretrained or source), "timing": timed})


def load_head(head, ckpt, source, args, num_classes):
    """The trained head of a main_lincls.py checkpoint (--resume, --evaluate) into `head`."""
    if ckpt.get("kind") == "lincls" and (args.resume or args.evaluate):
        weights = {k[3:]: v for k, v in ckpt["model"].items() if k.startswith("fc.")}
        if weights["weight"].shape != head.weight.shape:
            raise UserError(f"{source} has a {weights['weight'].shape[0]}-class head but {args.data} has "
                            f"{num_classes} classes")
        head.load_state_dict(weights)
    elif args.resume:
        raise UserError(f"--resume {source} is not a main_lincls.py checkpoint (kind "
                        f"{ckpt.get('kind')!r}): pass it as --pretrained")
    elif args.evaluate:
        raise UserError("--evaluate needs a trained head: pass a main_lincls.py checkpoint as --pretrained")


def resume_probe(args, model, source, device, train_data):
    """(epoch, step in it, best Acc@1, the last (Acc@1, Acc@5), the epoch's sums so far on this rank) to start
    from: a resumed probe's, else the start's. Within an epoch, the epoch's order and crops are those of (seed,
    batch, train images): another would skip or repeat images."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # this rank's loss sum and images of the epoch
    if not args.resume:
        return 0, 0, -1.0, (None, None), sums  # the first evaluated epoch is always the best so far
    ckpt = model.trunk.ckpt
    require(source, ckpt, ("args", "optimizer", "epoch", "step_in_epoch", "epoch_sums", "best_acc1", "acc1", "acc5"))
    load_optimizer_state(model.optimizer, ckpt["optimizer"])
    if ckpt.get("scaler"):
        model.scaler.load_state_dict(ckpt["scaler"])
    epoch, step, best = ckpt["epoch"], ckpt["step_in_epoch"], ckpt["best_acc1"]
    if step:
        check_mid_epoch(source, ckpt, args, train_data)
    if step and du.is_main():  # the epoch's sums so far, over every rank
        sums += torch.tensor(ckpt["epoch_sums"], dtype=torch.float64, device=device)
    refuse_fewer_epochs(source, epoch, step, args.epochs)
    if du.is_main():
        print(f"=> resumed from {source} at epoch {epoch}" + (f" step {step}" if step else "")
              + f" (best Acc@1 {best:.2f})", flush=True)
    return epoch, step, best, (ckpt["acc1"], ckpt["acc5"]), sums


def save_now(checkpoints, state, output_dir):
    checkpoints.save(state, output_dir)
    checkpoints.wait()


# ---------------------------------------------------------------- features (kNN, logistic regression)

def one_process():
    """True on rank 0, which goes on alone (scikit-learn runs on one process): every rank leaves the
    process group first, so that no rank waits under a collective timeout while rank 0 works."""
    main = du.is_main()
    du.cleanup()
    return main


def features(args, frozen, split, name, source):
    """Cached trunk features of one split (not normalised), and its labels."""
    x = split_features(frozen, split, name, args.output_dir, checkpoint=source, batch_size=FEATURES_BATCH,
                       amp_dtype=cli.AMP[args.amp], encoder=args.encoder, arch=args.arch, small_input=args.small_input,
                       dataset=args.dataset, data=os.path.abspath(args.data))
    return x, np.asarray(split.targets)


# ---------------------------------------------------------------- kNN

def run_knn(args, frozen, device):
    # the memory bank is the train split, the queries the val split, both without augmentation; every
    # rank extracts and scores its share (sce.knn), as the kNN monitor of main_pretrain.py does
    bank, queries, num_classes = splits(args, device, augment_train=False)
    with cli.autocast(device, args.amp):
        knn = knn_accuracy(frozen.trunk, bank, queries, num_classes, args.knn_k, args.knn_t,
                           batch_size=FEATURES_BATCH, pad=frozen.compiled)
    top1, top5 = knn.top1, knn.top5
    if du.is_main():
        print(f"kNN (k {args.knn_k}, t {args.knn_t}, {len(bank)} train / {len(queries)} val images): "
              f"Acc@1 {top1:.2f} Acc@5 {top5:.2f}", flush=True)
        write_results(args, {"acc1": top1, "acc5": top5, "k": args.knn_k, "t": args.knn_t})


# ---------------------------------------------------------------- many-shot logistic regression

def run_logreg(args, frozen, source, device):
    metric = args.metric if args.metric != "auto" else ("map11" if args.dataset == "voc07" else "top1")
    if (metric == "map11") != (args.dataset == "voc07"):
        raise UserError(f"--metric {metric} does not fit --dataset {args.dataset}: map11 is for the "
                        "multi-label voc07, top1 / mean-per-class for the others")
    if not one_process():  # scikit-learn runs on one process
        return
    # ssl-transfer: bicubic resize of the short side + centre crop, no augmentation; an ImageNet-stem trunk's JPEGs
    # decoded, resized and cropped on the device (--decode)
    route = data.eval_route(args.decode, args.small_input)
    geometry = data.Geometry(args.crop_size, args.crop_size, mode="bicubic")

    def read(dataset):
        return data.eval_split(dataset, geometry, device, route, args.workers, args.seed)
    reader = data.READER[route]
    if args.dataset == "voc07":  # its own val split picks C, then train+val is refit
        split_data = {s: data.read_voc07(args.data, s) for s in ("train", "val", "test")}  # all checked first
        feats = {s: features(args, frozen, read(data.ImageList(p, y, read=reader)), s, source)[0]
                 for s, (p, y) in split_data.items()}
        labels = {s: y for s, (_, y) in split_data.items()}
        sel_x, sel_y, val_x, val_y = feats["train"], labels["train"], feats["val"], labels["val"]
        fit_x = np.concatenate([feats["train"], feats["val"]])
        fit_y = np.concatenate([labels["train"], labels["val"]])
        test_x, test_y = feats["test"], labels["test"]
    else:  # a seeded share of train picks C, then all of train is refit; DATA/val is the test set
        train_ds, test_ds, _ = data.read_splits(args.dataset, args.data, reader)
        fit_x, fit_y = features(args, frozen, read(train_ds), "train", source)
        test_x, test_y = features(args, frozen, read(test_ds), "val", source)
        tr, va = transfer.holdout_split(fit_y, args.val_fraction, args.seed)
        sel_x, sel_y, val_x, val_y = fit_x[tr], fit_y[tr], fit_x[va], fit_y[va]

    count = transfer.FitCount()  # fits stopped by --logreg-max-iter, said with the result
    with preemption.safe_points("fitting the logistic regression", record_only=False):  # a fit stops at once
        if args.logreg_c is not None:
            best_c, history = args.logreg_c, []
        else:
            print(f"picking C on {len(val_x)} validation images ({len(transfer.LOGREG_WDS)} wd values)", flush=True)
            best_c, history = transfer.select_logreg(sel_x, sel_y, val_x, val_y, metric, count=count,
                                                     max_iter=args.logreg_max_iter, log=said_then_check)
        preemption.check()  # before the refit
        score = transfer.fit_eval_logreg(fit_x, fit_y, test_x, test_y, metric, C=best_c,
                                         max_iter=args.logreg_max_iter, count=count)
    print(f"logistic regression (C {best_c:.4g}, refit on {len(fit_x)} images): test {metric} {score:.2f} "
          f"({count.note(args.logreg_max_iter, '--logreg-max-iter')})", flush=True)
    write_results(args, {"metric": metric, "test": score, "C": best_c,
                         "val": [{"C": c, "score": s} for c, s in history],
                         "fits": len(count.stalled), "unconverged_fits": sum(count.stalled)})


def said_then_check(line):
    """A value of C's line, then a safe point: a stop whose raise a fit's finalizer dropped stops here."""
    print(line, flush=True)
    preemption.check()


if __name__ == "__main__":
    entry.run(main)
