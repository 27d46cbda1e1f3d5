#!/usr/bin/env python
"""Low-shot VOC07 classification with linear SVMs on frozen trunk features (PCL protocol, paper Table 8).

    python main_lowshot.py --data VOCdevkit/VOC2007 --pretrained OUT/checkpoint_last.pth --shots 16 32 64 full --runs 5

For each K, each draw takes K images positive for each class from trainval (an image drawn for
two classes counts twice, as in PCL), trains one LinearSVC per class on the l2-normalised
global-average-pooled features of the draw, and reports the test mAP (area under the interpolated
precision-recall curve); 'full' trains once on all of trainval. Table: mean +- std of the mAP over
the draws.

Difficult labels (0): '--difficult negative' (default) counts them as negatives, in the SVM
training and in the test AP, as PCL's eval_svm_voc.py did for the paper's numbers; '--difficult
ignore' drops them from training and from AP (the VOC devkit convention; reads higher).

Cost selection: the published protocol (PCL, '--cost-selection test') reports, for each K, the
cost of --costs with the best mean test mAP. That picks a hyper-parameter on the test set and is
optimistic. '--cost-selection cv' instead picks, for each draw, the cost with the best
cross-validated mAP on the training draw itself and evaluates only that cost on the test set.
"""
import sce  # first: a stop signal during the imports below (torch's take seconds) is said, exit 75
sce.stop_while_importing(__name__ == "__main__")
import argparse
import os

import numpy as np
import torch

from sce import UserError, cli, data, entry, outdir, preemption, transfer
from sce.checkpoint import check_trunk
from sce.compiling import resolve_compile
from sce.frozen import load_frozen, split_features


def shots_arg(value):
    if value == "full":
        return value
    try:
        k = int(value)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of shots or 'full', got {value!r}")
    return k


def get_parser():
    p = cli.make_parser(__doc__)
    p.add_argument("--data", metavar="DIR", required=True, help="VOCdevkit/VOC2007: JPEGImages/ and "
                   "ImageSets/Main/<class>_{trainval,test}.txt")
    cli.add_trunk_args(p, required=True)
    g = p.add_argument_group("low-shot protocol")
    g.add_argument("--shots", metavar="K", type=shots_arg, nargs="+", default=[16, 32, 64, "full"],
                   help="positives drawn per class, or 'full' for all of trainval")
    g.add_argument("--runs", type=int, default=5, help="draws per K ('full': 1)")
    g.add_argument("--costs", metavar="C", type=float, nargs="+", default=[0.01, 0.1, 0.5, 1.0, 10.0, 100.0],
                   help="LinearSVC cost grid")
    g.add_argument("--cost-selection", default="test", choices=["test", "cv"],
                   help="test: best mean test mAP over the grid (the published protocol; optimistic, "
                   "the cost is tuned on the test set); cv: per draw, best cross-validated mAP on the "
                   "training draw (needs K >= 2)")
    g.add_argument("--cv-folds", type=int, default=3, help="folds of --cost-selection cv")
    g.add_argument("--difficult", default="negative", choices=transfer.DIFFICULT,
                   help="difficult (0) labels: negative = count them as negatives in SVM training and "
                   "test AP (default; PCL's evaluation code that produced the paper's numbers); ignore = "
                   "drop them from training and AP (VOC devkit convention; reads higher)")
    g.add_argument("--jobs", type=int, default=1, help="SVMs trained in parallel (-1: all cores)")
    g = p.add_argument_group("features")
    g.add_argument("--resize", type=int, help="resize of the short side, in pixels (default: 256 for a 224 crop; "
                   "a small-input trunk: the crop size)")
    g.add_argument("--crop-size", type=int, help="centre crop, in pixels (default: 224; a small-input trunk: the "
                   "crop size it was pretrained with, from its checkpoint)")
    g.add_argument("-b", "--batch-size", type=int, default=128, help="images per forward pass")
    g = p.add_argument_group("runtime")
    cli.add_runtime_args(g, os.path.join("runs", "lowshot"), "feature cache and lowshot.json",
                         "seed of the draws: draw r of K uses (SEED, K, r)", "the trunk")
    cli.add_decode_arg(g)
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    cli.check_finite(args)
    cli.check_ranges({"--runs": args.runs, "--costs": min(args.costs), "--resize": args.resize,
                      "--crop-size": args.crop_size, "--batch-size": args.batch_size},
                     {"--workers": args.workers})
    cli.check_seed(args.seed, 2 ** 32 - 1, " (scikit-learn's cross-validation takes 32-bit seeds)")
    if args.jobs == 0 or args.jobs < -1:
        raise UserError(f"--jobs must be positive, or -1 for every core (got {args.jobs})")
    if args.cv_folds < 2:
        raise UserError(f"--cv-folds must be at least 2 (got {args.cv_folds})")
    args.workers, args.jobs = cli.cap_processes(args.workers), cli.cap_processes(args.jobs, "--jobs")
    data.data_folder(args.data)  # before the output folder is bound to it
    if args.cost_selection == "cv" and any(k != "full" and k < 2 for k in args.shots):
        raise UserError("--cost-selection cv cross-validates on the training draw and needs --shots >= 2 "
                        "(or 'full')")
    # the file and its input size checked before the output folder is made
    _, small_input, recorded = check_trunk(args.pretrained, args.arch, args.small_input, args.encoder)
    data.eval_crop_size(args.crop_size, small_input, recorded, "voc07")
    outdir.prepare(args.output_dir)  # an unwritable one stops here, not after the features
    lock = outdir.Lock(args.output_dir)  # one run per folder, for its whole life
    try:
        lowshot(args)
    finally:
        lock.release()


def lowshot(args):
    # the VOC tree first: a broken one fails before any feature is computed
    trainval_paths, trainval_y = data.read_voc07(args.data, "trainval")
    test_paths, test_y = data.read_voc07(args.data, "test")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    frozen = load_frozen(args.pretrained, args.arch, args.small_input, args.encoder, device,
                         resolve_compile(args.compile, device))
    outdir.bind_evaluation(args.output_dir, args.pretrained, frozen.trunk, "voc07", args.data)
    crop, why, warning = data.eval_crop_size(args.crop_size, frozen.small_input, frozen.ckpt.get("args"), "voc07")
    resize = args.resize or data.eval_resize(crop, frozen.small_input)
    if resize < crop:
        raise UserError(f"--resize {resize} is smaller than the {crop} px centre crop: pass --resize >= {crop}")
    cli.check_memory(device, {f"--batch-size {args.batch_size} images of {crop} px (--crop-size): their pixels in "
                              "float32": (args.batch_size * 3 * crop ** 2 * 4, "lower --batch-size or --crop-size")})
    readers = max(1, args.workers)  # each resizes an image at a time, its short side to --resize
    cli.check_memory(torch.device("cpu"), {f"--resize {resize}: the resized images of {readers} reading process(es)":
                                           (readers * 3 * resize ** 2, "lower --resize")})
    print(f"=> {frozen.describe()} from {args.pretrained}; input {crop} px ({why}), resized to {resize}; "
          f"VOC07 {len(trainval_paths)} trainval / {len(test_paths)} test images", flush=True)
    if warning:
        print(warning, flush=True)
    route = data.eval_route(data.resolve_decode(args.decode, device), frozen.small_input)  # JPEGs: there

    def features(split, paths, labels):
        images = data.ImageList(paths, labels, read=data.READER[route])
        read = data.eval_split(images, data.Geometry(crop, resize), device, route, args.workers)
        feats = split_features(frozen, read, split, args.output_dir, checkpoint=args.pretrained,
                               batch_size=args.batch_size, amp_dtype=cli.AMP[args.amp], encoder=args.encoder,
                               arch=frozen.arch, small_input=frozen.small_input, dataset="voc07",
                               data=os.path.abspath(args.data))
        return transfer.l2_normalize_rows(feats)

    train_x = features("trainval", trainval_paths, trainval_y)
    test_x = features("test", test_paths, test_y)

    with preemption.safe_points("fitting the SVMs", record_only=False):  # a fit stops at once
        results, all_fits = shots(args, train_x, trainval_y, test_x, test_y)
    report(args, results, all_fits, frozen.arch)


def shots(args, train_x, train_y, test_x, test_y):
    """Each K of --shots: its draws (one for full), each an SVM fit per cost; the mAP and cost of each K, and the
    fits' count (how many did not converge)."""
    results, all_fits = [], transfer.FitCount()
    for k in args.shots:
        runs = 1 if k == "full" else args.runs
        per_run = []
        for r in range(runs):
            preemption.check()  # between draws: a stop whose raise a fit's finalizer dropped
            idx = (np.arange(len(train_x)) if k == "full"
                   else transfer.lowshot_draw(train_y, k, [args.seed, k, r]).ravel())
            fits = transfer.FitCount()
            name = f"K {k} draw {r + 1}/{runs}"
            per_run.append(fit_draw(args, train_x[idx], train_y[idx], idx, test_x=test_x, test_y=test_y, fits=fits,
                                    name=name))
            all_fits.stalled += fits.stalled
        if args.cost_selection == "test":  # PCL: the cost with the best mean over the draws
            means = {c: float(np.mean([run["test_map"][c] for run in per_run])) for c in args.costs}
            cost = max(means, key=means.get)
            maps = [run["test_map"][cost] for run in per_run]
        else:
            cost, maps = [run["cost"] for run in per_run], [run["map"] for run in per_run]
        results.append({"shots": k, "runs": runs, "mean": float(np.mean(maps)), "std": float(np.std(maps)),
                        "cost": cost, "maps": maps, "draws": per_run})
    return results, all_fits


def fit_draw(args, x, y, idx, *, test_x, test_y, fits, name):
    """One draw's fits: every cost against the test set (--cost-selection test), or the cost cross-validation picks
    and its test mAP; its line said."""
    if args.cost_selection == "test":
        test = dict(jobs=args.jobs, difficult=args.difficult, count=fits)
        per_cost = {c: transfer.svm_test_map(x, y, test_x, test_y, c, **test)[0] for c in args.costs}
        run = {"images": len(idx), "test_map": per_cost}
    else:
        splits = transfer.cv_splits(y, idx, args.cv_folds, args.seed, args.difficult)
        drops = transfer.cv_drops(splits)
        if drops:  # the same for every cost: said once per draw
            print(f"{name}: {drops}", flush=True)
        cv = {c: transfer.svm_cv_map(x, splits, c, args.jobs, fits) for c in args.costs}
        cost = max(cv, key=cv.get)  # first best on ties
        mean_ap = transfer.svm_test_map(x, y, test_x, test_y, cost, jobs=args.jobs, difficult=args.difficult,
                                         count=fits)[0]
        run = {"images": len(idx), "cv_map": cv, "cost": cost, "map": mean_ap, "cv_drops": drops}
    run.update(fits=len(fits.stalled), unconverged_fits=sum(fits.stalled))
    detail = run["test_map" if args.cost_selection == "test" else "cv_map"]
    print(f"{name} ({len(idx)} images): {args.cost_selection} mAP per cost "
          + " ".join(f"{c:g}:{m:.2f}" for c, m in detail.items())
          + (f" -> cost {run['cost']:g} test mAP {run['map']:.2f}" if args.cost_selection == "cv" else "")
          + f" ({fits.note(transfer.SVM_MAX_ITER, noun='SVM fits')})", flush=True)
    return run


def report(args, results, all_fits, arch):
    """The table of mAP per K, then lowshot.json."""
    print(f"\nVOC07 low-shot linear SVM, cost selection '{args.cost_selection}'"
          + (" (tuned on the test set: optimistic)" if args.cost_selection == "test" else "")
          + f", difficult labels: {args.difficult}")
    print(f"{'K':>6}  {'runs':>4}  {'mAP':>15}  cost")
    for res in results:
        cost = "/".join(f"{c:g}" for c in (res["cost"] if isinstance(res["cost"], list) else [res["cost"]]))
        print(f"{res['shots']:>6}  {res['runs']:>4}  {res['mean']:6.2f} ± {res['std']:5.2f}  {cost}")
    print(all_fits.note(transfer.SVM_MAX_ITER, noun="SVM fits"))
    out = os.path.join(args.output_dir, "lowshot.json")
    outdir.write_json(out, {"checkpoint": os.path.abspath(args.pretrained), "encoder": args.encoder,
                            "arch": arch, "cost_selection": args.cost_selection, "costs": args.costs,
                            "seed": args.seed, "difficult": args.difficult, "std": "population (ddof 0) over draws",
                            "results": results})
    preemption.finished()  # a stop signal from now on is said, exit 0
    print(f"=> {out}")


if __name__ == "__main__":
    entry.run(main)
