#!/usr/bin/env python
"""The Python steps of benchmarks/reproduce.sh:

    check DATASET DATA_DIR ENV_FILE [SMOKE_DIR]
                                          which layout DATA_DIR holds, read whole; writes FORMAT, ROOT and the
                                          split sizes as shell variables to ENV_FILE. With SMOKE_DIR (SMOKE=1): a
                                          small ImageFolder there (the first 10 classes, 16 train and 8 val images
                                          each), which ENV_FILE then names
    estimate LOG ENV_FILE PRETRAIN LINEAR METHOD...
                                          each stage's estimated time, from the rate of the first epoch's last
                                          progress line in LOG
    table DATASET OUT_DIR METHOD...       the results beside the paper's: OUT_DIR/results.md and results.json, with
                                          every method finished in OUT_DIR (METHODS of this run or of an earlier one)
"""
import json
import os
import re
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sce import UserError  # noqa: E402  (sce.data, with torch, is imported by the steps that read data)

# the paper's baselines table (Sec. 4.2), linear top-1: SCE, and the authors' reproductions of ReSSL and MoCo v2
PAPER = {"cifar10": {"sce": 90.34, "ressl": 90.20, "moco": 87.56},
         "cifar100": {"sce": 65.45, "ressl": 64.01, "moco": 61.00},
         "stl10": {"sce": 89.94, "ressl": 89.05, "moco": 86.53},
         "tiny-imagenet": {"sce": 51.90, "ressl": 49.47, "moco": 45.93}}
NAMES = {"sce": "SCE", "ressl": "ReSSL", "moco": "MoCo v2"}  # in the table's order
# dataset -> the folder of its official download, and what that folder holds
OFFICIAL = {"cifar10": ("cifar-10-batches-py", "CIFAR-10's python batches"),
            "cifar100": ("cifar-100-python", "CIFAR-100's python batches"),
            "stl10": ("stl10_binary", "STL-10's binaries"),
            "tiny-imagenet": ("tiny-imagenet-200", "Tiny-ImageNet's folders (train/<wnid>/images, val/images and "
                                                   "val/val_annotations.txt)")}
LINEAR_SPEEDUP = 4  # the linear probe's images/s against pretraining's: one frozen forward, not 2 + a backward


def layout(dataset, data):
    """(format for --dataset, root for --data, what was found) of DATA_DIR, or a UserError naming what it
    expected."""
    folder, what = OFFICIAL[dataset]
    if os.path.isdir(os.path.join(data, folder)):
        return dataset, os.path.join(data, folder) if dataset == "tiny-imagenet" else data, f"{what} in {folder}/"
    if os.path.basename(os.path.normpath(data)) == folder or (
            dataset == "tiny-imagenet" and os.path.isfile(os.path.join(data, "val", "val_annotations.txt"))):
        return dataset, data, what
    if dataset.startswith("cifar") and all(os.path.isdir(os.path.join(data, s)) for s in ("train", "val")):
        return "imagefolder", data, "image files in train/ and val/ class folders (ImageFolder)"
    other = " or train/ and val/ class folders of image files" if dataset.startswith("cifar") else ""
    raise UserError(f"{data} holds none of {dataset}'s layouts: expected {folder}/ ({what}, as downloaded){other}")


def check(dataset, data, env_file, smoke_dir=None):
    if not os.path.isdir(data):
        raise UserError(f"DATA_DIR {data} is not a folder: pass the folder of the {dataset} download")
    fmt, root, found = layout(dataset, data)
    import torch  # here: a wrong folder is said without the seconds of importing torch
    from sce.data import build_dataset, read_splits
    train, val, _ = read_splits(fmt, root)  # the evaluations' reader and class checks
    pretrain = build_dataset(fmt, root, "pretrain")
    print(f"=> {dataset}: {found} under {data}: {len(pretrain)} pretraining images, {len(train)} train / {len(val)} "
          "val images for the linear probe and the kNN", flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    write_env(env_file, FORMAT=fmt, ROOT=root, PRETRAIN_IMAGES=len(pretrain), TRAIN_IMAGES=len(train), DEVICE=device,
              TORCH=torch.__version__)
    if smoke_dir:
        smoke(env_file, smoke_dir)  # in this process: torch is imported once


def write_env(env_file, **variables):
    with open(env_file, "w") as f:
        f.write("".join(f"{k}={shlex.quote(str(v))}\n" for k, v in variables.items()))


SMOKE_CLASSES, SMOKE_IMAGES = 10, {"train": 16, "val": 8}


def smoke(env_file, folder):
    """The first SMOKE_CLASSES classes' first images of each split, as PNG files of an ImageFolder (the same
    files at every rerun, so that a stopped SMOKE run resumes); env_file then points at it."""
    env = read_env(env_file)
    from sce.data import read_splits
    if not os.path.isfile(os.path.join(folder, ".complete")):
        for split, ds in zip(("train", "val"), read_splits(env["FORMAT"], env["ROOT"])[:2]):
            taken = {}
            for i, target in enumerate(ds.targets):
                if target < SMOKE_CLASSES and taken.get(target, 0) < SMOKE_IMAGES[split]:
                    taken[target] = taken.get(target, 0) + 1
                    os.makedirs(os.path.join(folder, split, f"class_{target:03d}"), exist_ok=True)
                    ds[i][0].save(os.path.join(folder, split, f"class_{target:03d}", f"{i:06d}.png"))
        classes = set(os.listdir(os.path.join(folder, "train"))) | set(os.listdir(os.path.join(folder, "val")))
        for split in SMOKE_IMAGES:  # the same class folders in both (an empty one where a split has none)
            for name in classes:
                os.makedirs(os.path.join(folder, split, name), exist_ok=True)
        open(os.path.join(folder, ".complete"), "w").close()
    count = {split: sum(len(files) for _, _, files in os.walk(os.path.join(folder, split))) for split in SMOKE_IMAGES}
    print(f"=> SMOKE: {count['train']} train / {count['val']} val images of {env['FORMAT']}'s first {SMOKE_CLASSES} "
          f"classes, as an ImageFolder in {folder}", flush=True)
    write_env(env_file, **dict(env, FORMAT="imagefolder", ROOT=folder, PRETRAIN_IMAGES=count["train"],
                               TRAIN_IMAGES=count["train"]))


def flag(flags, name, default):
    """The last value of --name in a flag string, as main_*.py's argparse reads it."""
    values = re.findall(rf"--{name} (\S+)", flags)
    return type(default)(values[-1]) if values else default


def read_env(env_file):
    """The variables `check` wrote, as the shell reads them."""
    return {k: shlex.split(v)[0] for k, v in (line.split("=", 1) for line in open(env_file).read().splitlines())}


def estimate(log, env_file, pretrain_flags, linear_flags, methods):
    env = read_env(env_file)
    rates = re.findall(r"([\d.]+) img/s", open(log).read())
    if not rates:
        print("=> no progress line in the first epoch: no estimate", flush=True)
        return
    rate = float(rates[-1])
    epochs, linear_epochs = flag(pretrain_flags, "epochs", 200), flag(linear_flags, "epochs", 100)
    print(f"=> the first epoch ran at {rate:.0f} images/s (its last progress line); estimated time of each stage "
          f"here (the linear probe at {LINEAR_SPEEDUP}x that rate: a frozen forward):", flush=True)
    for method in methods:
        for name, images, per_s, n in (("pretrain", int(env["PRETRAIN_IMAGES"]), rate, epochs),
                                       ("linear", int(env["TRAIN_IMAGES"]), LINEAR_SPEEDUP * rate, linear_epochs)):
            print(f"   {method} {name}: {n} epochs x {images} images: {n * images / per_s / 60:.1f} min", flush=True)


def finished(out, method):
    """The results of a method's run in OUT_DIR: (results_linear.json, the last line of log.txt, args.json), or
    None while its linear probe has no result."""
    run = os.path.join(out, method)
    if not os.path.isfile(os.path.join(run, "linear", "results_linear.json")):
        return None
    read = [os.path.join(run, name) for name in ("linear/results_linear.json", "log.txt", "args.json")]
    missing = next((path for path in read if not os.path.isfile(path)), None)
    if missing:
        raise UserError(f"{missing} not found, though the linear probe of {method} finished: run the same command "
                        "again (or remove the folder of that method to train it afresh)")
    linear = json.load(open(read[0]))
    lines = [json.loads(line) for line in open(read[1]) if line.strip()]
    if linear.get("acc1") is None:
        raise UserError(f"{read[0]} holds no top-1 (written by an older version after its probe had finished): remove "
                        "it and run the same command again to report it")
    return linear, lines[-1], json.load(open(read[2]))


def table(dataset, out, methods):
    rows = {}
    for m in NAMES:
        results = finished(out, m)
        if results is None:
            if m in methods:
                raise UserError(f"the linear probe of {m} has no result in {os.path.join(out, m, 'linear')}: run the "
                                "same command again")
            continue
        linear, last, settings = results
        if last["epoch"] != settings["epochs"]:
            raise UserError(f"{os.path.join(out, m, 'log.txt')} ends at epoch {last['epoch']} of {settings['epochs']}: "
                            "run the same command again to complete it")
        rows[m] = dict(linear_top1=linear["acc1"], linear_best_top1=linear["best_acc1"],
                       knn_top1=last.get("knn_top1"),  # the last epoch's, never an earlier one's
                       paper_linear_top1=PAPER[dataset][m], pretrain_s=None, linear_s=None)
    times = {}
    if os.path.isfile(os.path.join(out, "times")):
        for line in open(os.path.join(out, "times")).read().splitlines():
            name, ms = line.rsplit(" ", 1)
            times[name] = times.get(name, 0) + int(ms) / 1000  # a stage run in several invocations adds up
    for m, row in rows.items():
        row.update(pretrain_s=round(times.get(f"{m} pretrain", 0)), linear_s=round(times.get(f"{m} linear", 0)))
    env = read_env(os.path.join(out, "data.env"))
    device, version = env["DEVICE"], env["TORCH"]
    results = dict(dataset=dataset, device=device, torch=version, methods=rows)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [f"{dataset} on {device}, torch {version}", "",
             "| method | linear top-1 (last / best) | kNN top-1 | paper (Sec. 4.2) | pretrain | linear |",
             "|---|---|---|---|---|---|"]
    for m, r in rows.items():
        knn = "-" if r["knn_top1"] is None else f"{r['knn_top1']:.2f}"
        lines.append(f"| {NAMES[m]} | {r['linear_top1']:.2f} / {r['linear_best_top1']:.2f} | {knn} | "
                     f"{r['paper_linear_top1']:.2f} | {r['pretrain_s'] / 60:.1f} min | {r['linear_s'] / 60:.1f} min |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    print("\n" + text + f"\n(results.json and results.md in {out})", flush=True)


def main(argv):
    command, rest = argv[0], argv[1:]
    if command == "check":
        check(*rest)
    elif command == "estimate":
        estimate(*rest[:4], rest[4:])
    else:
        table(rest[0], rest[1], rest[2:])


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")
