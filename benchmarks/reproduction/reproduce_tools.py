#!/usr/bin/env python
"""The Python steps of benchmarks/reproduction/reproduce.sh:

    methods [METHODS]                     the methods of the string METHODS (default: all), checked against PAPER
    recipe DATASET                        sce/recipes.py's row of DATASET as shell variables: PRETRAIN (its flags but
                                          the run's own and SCE's temperatures), SCE_TEMPS (SCE's, supp. Table 10)
    flags DATASET                         the row of DATASET as flags but the run's own (--dataset), as
                                          `python -m sce.recipes DATASET --flags` prints them
    check DATASET DATA_DIR ENV_FILE [SMOKE_DIR]
                                          which layout DATA_DIR holds, read whole; writes FORMAT, ROOT and the
                                          split sizes as shell variables to ENV_FILE. With SMOKE_DIR (SMOKE=1): a
                                          small ImageFolder there (the first 10 classes, 16 train and 8 val images
                                          each), which ENV_FILE then names
    show LOG PID START OUT ENV_FILE METHOD LINEAR METHOD...
                                          the lines of a stage's LOG shown while it runs (PID), from line START;
                                          after the pretraining's estimate (OUT/METHOD/estimate.json), each stage's
                                          estimated time
    table DATASET OUT_DIR METHOD...       the results beside the paper's: OUT_DIR/results.md and results.json, with
                                          every method finished in OUT_DIR (METHODS of this run or of an earlier one)
    figure DATASET OUT_DIR METHOD...      OUT_DIR/curves.png and time_split.png of the methods run in OUT_DIR
"""
import json
import os
import re
import shlex
import subprocess
import sys
import time
from importlib.metadata import version

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
sys.path.insert(0, REPO)
import numpy as np  # noqa: E402

from sce import UserError, alive, layouts, recipes, timing  # noqa: E402  (no torch)

# the paper's baselines table (Sec. 4.2), a row per --method in the table's order: its name there and its linear
# top-1 on each dataset (SCE's own; ReSSL's and MoCo v2's the authors' reproductions)
PAPER = {"sce": ("SCE", {"cifar10": 90.34, "cifar100": 65.45, "stl10": 89.94, "tiny-imagenet": 51.90}),
         "ressl": ("ReSSL", {"cifar10": 90.20, "cifar100": 64.01, "stl10": 89.05, "tiny-imagenet": 49.47}),
         "moco": ("MoCo v2", {"cifar10": 87.56, "cifar100": 61.00, "stl10": 86.53, "tiny-imagenet": 45.93})}
LINEAR_SPEEDUP = 3.4  # without a kNN rate: the probe's images/s against pretraining's (one H100, 2026-11-27)


def reproduced(dataset):
    """The row of a dataset of the baselines table (PAPER's), or one line naming them."""
    known = list(PAPER["sce"][1])
    if dataset not in known:
        raise UserError(f"unknown dataset '{dataset}': use {', '.join(known[:-1])} or {known[-1]}")
    return layouts.DATASETS[dataset]


def recipe_flags(dataset):
    """sce/recipes.py's row of `dataset` as main_pretrain.py flags (SCE's), the run's own (--dataset) left out: the
    one copy of each recipe, which reproduce.sh, the GPU scripts and the checks read."""
    reproduced(dataset)
    if dataset not in recipes.ROWS:
        raise UserError(f"sce/recipes.py has no row for {dataset}: add it there")
    return recipes.flags(dataset)


def recipe(dataset):
    """DATASET's row as shell variables for reproduce.sh to eval: PRETRAIN, every method's flags (the row without
    SCE's own values: MoCo v2 and ReSSL take their records', which are the row's for them, Sec. 4.2), and
    SCE_TEMPS, SCE's (supp. Table 10's temperatures)."""
    recipe_flags(dataset)
    row = recipes.ROWS[dataset]
    common = recipes.as_flags({k: v for k, (v, _) in row.values.items() if k not in recipes.OWN})
    sce = recipes.as_flags({k: v for k, (v, _) in row.methods["sce"].items()})
    print(f"PRETRAIN={shlex.quote(shlex.join(common))} SCE_TEMPS={shlex.quote(shlex.join(sce))}")


def layout(dataset, data):
    """(format for --dataset, root for --data, what was found) of DATA_DIR, or a UserError naming what it
    expected."""
    row = reproduced(dataset)
    if row.download is None:  # a folders row: train/ and val/ class folders only
        if all(os.path.isdir(os.path.join(data, s)) for s in ("train", "val")):
            return dataset, data, "train/ and val/ class folders"
        raise UserError(f"{data} has no train/ and val/ class folders: pass the folder that holds them")
    folder, what = row.download.folder, row.download.holds
    if os.path.isdir(os.path.join(data, folder)):
        return dataset, os.path.join(data, folder) if row.folders else data, f"{what} in {folder}/"
    if os.path.basename(os.path.normpath(data)) == folder or (
            row.reader == "annotated-val" and os.path.isfile(os.path.join(data, "val", "val_annotations.txt"))):
        return dataset, data, what
    if row.image_folders and all(os.path.isdir(os.path.join(data, s)) for s in ("train", "val")):
        return "imagefolder", data, "image files in train/ and val/ class folders (ImageFolder)"
    other = " or train/ and val/ class folders of image files" if row.image_folders else ""
    raise UserError(f"{data} holds none of {dataset}'s layouts: expected {folder}/ ({what}, as downloaded){other}")


def check(dataset, data, env_file, smoke_dir=None):
    """Which layout DATA_DIR holds, its files listed and checked (sce.layouts: no image decoded, no torch imported),
    and the machine: FORMAT, ROOT, the split sizes, DEVICE (the first visible GPU's name, or cpu) and TORCH to
    ENV_FILE."""
    if not os.path.isdir(data):
        raise UserError(f"DATA_DIR {data} is not a folder: pass the folder of the {dataset} download")
    fmt, root, found = layout(dataset, data)
    sizes = split_sizes(fmt, root)
    print(f"=> {dataset}: {found} under {data}: {sizes['pretrain']} pretraining images, {sizes['train']} train / "
          f"{sizes['val']} val images for the linear probe and the kNN", flush=True)
    write_env(env_file, FORMAT=fmt, ROOT=root, PRETRAIN_IMAGES=sizes["pretrain"], TRAIN_IMAGES=sizes["train"],
              VAL_IMAGES=sizes["val"], DEVICE=gpu_name(), TORCH=version("torch"))
    if smoke_dir:
        smoke(env_file, smoke_dir)


def split_sizes(fmt, root):
    """{pretrain, train, val: images} of a checked layout, as main_pretrain.py and main_lincls.py read it (STL-10
    pretrains on train + unlabeled)."""
    row = layouts.DATASETS[fmt]
    if not row.folders:
        sizes = layouts.official_sizes(fmt, layouts.official_folder(fmt, root)[1])
        return dict(sizes, pretrain=sizes["train"] + sizes.get("unlabeled", 0))
    classes, train = layouts.image_folder(os.path.join(root, "train"))
    if row.reader == "annotated-val":
        val_classes, val = None, layouts.tiny_imagenet_val(os.path.join(root, "val"), classes)
    else:
        val_classes, val = layouts.image_folder(os.path.join(root, "val"))
    layouts.check_classes(len(classes), classes, val_classes, os.path.join(root, "train"), os.path.join(root, "val"))
    return dict(pretrain=len(train), train=len(train), val=len(val))


def gpu_name():
    """The first visible GPU's name (nvidia-smi; CUDA_VISIBLE_DEVICES respected), or cpu."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return "cpu"
    first = (visible or "0").split(",")[0].strip()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", first],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    names = out.stdout.strip().splitlines()
    return names[0].strip() if out.returncode == 0 and names else "cpu"


def write_env(env_file, **variables):
    with open(env_file, "w") as f:
        f.write("".join(f"{k}={shlex.quote(str(v))}\n" for k, v in variables.items()))


SMOKE_CLASSES, SMOKE_IMAGES = 10, {"train": 16, "val": 8}


def smoke(env_file, folder):
    """The first SMOKE_CLASSES classes' first images of each split, as PNG files of an ImageFolder (the same
    files at every rerun, so that a stopped SMOKE run resumes), of the classes both splits hold (a class folder
    without images is refused, as torchvision refuses it); env_file then points at it."""
    env = read_env(env_file)
    if not os.path.isfile(os.path.join(folder, ".complete")):
        taken = {split: {} for split in SMOKE_IMAGES}  # split -> class -> [(index, image)]
        for split, classes in taken.items():
            for i, target, image in split_images(env["FORMAT"], env["ROOT"], split):
                if target < SMOKE_CLASSES and len(classes.setdefault(target, [])) < SMOKE_IMAGES[split]:
                    classes[target].append((i, image))
        both = set(taken["train"]) & set(taken["val"])
        for split, classes in taken.items():
            for target in sorted(both):
                os.makedirs(os.path.join(folder, split, f"class_{target:03d}"), exist_ok=True)
                for i, image in classes[target]:
                    image().save(os.path.join(folder, split, f"class_{target:03d}", f"{i:06d}.png"))
        open(os.path.join(folder, ".complete"), "w").close()
    count = {split: sum(len(files) for _, _, files in os.walk(os.path.join(folder, split))) for split in SMOKE_IMAGES}
    print(f"=> SMOKE: {count['train']} train / {count['val']} val images of {env['FORMAT']}'s first {SMOKE_CLASSES} "
          f"classes, as an ImageFolder in {folder}", flush=True)
    write_env(env_file, **dict(env, FORMAT="imagefolder", ROOT=folder, PRETRAIN_IMAGES=count["train"],
                               TRAIN_IMAGES=count["train"], VAL_IMAGES=count["val"]))


def split_images(fmt, root, split):
    """(index, class, a function returning the PIL image) of a checked layout's train or val split, in order, as
    main_lincls.py reads them; with numpy and PIL (no torch): CIFAR's batches, STL-10's column-major binaries."""
    from PIL import Image
    row = layouts.DATASETS[fmt]
    if row.reader == "cifar-batches":
        files, folder = row.download.files, layouts.official_folder(fmt, root)[1]
        i = 0
        for name in files.train if split == "train" else files.test:
            entry = layouts.read_batch(os.path.join(folder, name))  # no code a pickle carries runs
            pixels = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
            for image, target in zip(pixels, layouts.labels(entry)):
                yield i, int(target), lambda image=image: Image.fromarray(image)
                i += 1
    elif row.reader == "stl10-binaries":
        folder, name = layouts.official_folder(fmt, root)[1], "train" if split == "train" else "test"
        pixels = np.fromfile(os.path.join(folder, f"{name}_X.bin"), dtype=np.uint8).reshape(-1, 3, 96, 96)
        labels = np.fromfile(os.path.join(folder, f"{name}_y.bin"), dtype=np.uint8).astype(int) - 1
        for i, (image, target) in enumerate(zip(pixels, labels)):
            yield i, int(target), lambda image=image: Image.fromarray(image.transpose(2, 1, 0))
    else:
        classes, samples = layouts.image_folder(os.path.join(root, "train"))
        if split == "val":
            samples = (layouts.tiny_imagenet_val(os.path.join(root, "val"), classes) if row.reader == "annotated-val"
                       else layouts.image_folder(os.path.join(root, "val"))[1])
        for i, (path, target) in enumerate(samples):
            yield i, target, lambda path=path: Image.open(path).convert("RGB")


def flag(flags, name, default):
    """The last value of --name in a flag string, as main_*.py's argparse reads it."""
    values = re.findall(rf"--{name} (\S+)", flags)
    return type(default)(values[-1]) if values else default


def read_env(env_file):
    """The variables `check` wrote, as the shell reads them."""
    return {k: shlex.split(v)[0] for k, v in (line.split("=", 1) for line in open(env_file).read().splitlines())}


# what reproduce.sh shows of a stage: an epoch's last progress line and result, the kNN, the estimate, resumes,
# stops, the time split, warnings and errors
SHOWN = re.compile(r"^(Epoch \[\d+/\d+\]\[(\d+)/\2\]|Epoch \d+/\d+:|=> (epoch|estimate|resum|preempted|the run|"
                   r"the probe|wall time)|warning|error)")


def show(log, pid, start, out, env_file, method, linear_flags, methods):
    """Follow LOG from line START while process PID runs (tail -f's way), printing the lines SHOWN matches,
    indented; after the pretraining's estimate line, the estimate of every stage of the run left to do."""
    with open(log) as f:
        for _ in range(int(start)):
            f.readline()
        pending = ""
        while True:
            line = f.readline()
            if line.endswith("\n"):
                line, pending = pending + line, ""
                if SHOWN.match(line):
                    print("   " + line, end="", flush=True)
                if line.startswith("=> estimate after epoch"):
                    row_estimate(out, env_file, method, linear_flags, methods)
            elif line:
                pending += line  # a line being written
            elif alive(int(pid)):
                time.sleep(0.2)
            else:
                return


def row_estimate(out, env_file, method, linear_flags, methods):
    """Each stage left of METHODS, from the running pretraining's estimate (OUT/METHOD/estimate.json): every
    pretraining as this one, every linear probe at the trunk's forward rate its kNN measured (start-up as the
    pretraining's, one compile as the kNN's, its epochs over train and val)."""
    env = read_env(env_file)
    with open(os.path.join(out, method, "estimate.json")) as f:
        e = json.load(f)
    rate = e.get("forward_images_per_s") or LINEAR_SPEEDUP * e["images_per_s"]
    images = int(env["TRAIN_IMAGES"]) + int(env.get("VAL_IMAGES", 0))
    linear = e["startup_s"] + e["knn_compile_s"] + flag(linear_flags, "epochs", 100) * images / rate
    stages = []
    for m in methods:
        if os.path.isfile(os.path.join(out, m, "linear", "results_linear.json")):
            continue
        # the running stage as its estimate says (it may have resumed); the others whole, at its rates
        stages += [(f"{m} pretrain", e["stage_s"] if m == method else e.get("whole_stage_s", e["stage_s"])),
                   (f"{m} linear", linear)]
    said = ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in stages)
    print(f"=> estimated time of each stage on this machine: {said}; {sum(s for _, s in stages) / 60:.1f} min in "
          f"all (the linear probe at {rate:.0f} images/s, the trunk's rate in the kNN)", flush=True)


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
    return linear, lines[-1], json.load(open(read[2]))


PARTS = timing.PARTS


def stage_split(folder):
    """{part: seconds} of a stage's invocations (FOLDER/timing.txt, sce.timing; a killed one's up to its last
    epoch), summed, or None: none written, or a damaged file (said in one line; the results stand without it)."""
    try:
        rows = timing.lines(folder)
    except UserError as e:
        print(f"=> no time split of {folder}: {e}", flush=True)
        return None
    if not rows:
        return None
    total = dict.fromkeys(PARTS + ["wall"], 0.0)
    for row in rows:
        for part in total:
            total[part] += row.get(f"{part}_s", 0.0)
    return total


def table(dataset, out, methods):
    rows, splits = {}, {}
    for m in PAPER:
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
                       paper_linear_top1=PAPER[m][1].get(dataset), pretrain_s=None, linear_s=None)
        run = os.path.join(out, m)
        splits[m] = {"pretrain": stage_split(run), "linear": stage_split(os.path.join(run, "linear"))}
    times = {}
    if os.path.isfile(os.path.join(out, "times")):
        for line in open(os.path.join(out, "times")).read().splitlines():
            name, ms = line.rsplit(" ", 1)
            times[name] = times.get(name, 0) + int(ms) / 1000  # a stage run in several invocations adds up
    for m, row in rows.items():
        row.update(pretrain_s=round(times.get(f"{m} pretrain", 0)), linear_s=round(times.get(f"{m} linear", 0)),
                   split={stage: {k: round(v, 1) for k, v in split.items()} if split else None
                          for stage, split in splits[m].items()})
    env = read_env(os.path.join(out, "data.env"))
    device, version_ = env["DEVICE"], env["TORCH"]
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(dataset=dataset, device=device, torch=version_, methods=rows), f, indent=1)
    lines = [f"{dataset} on {device}, torch {version_}", "",
             "| method | linear top-1 (last / best) | kNN top-1 | paper (Sec. 4.2) | pretrain | linear |",
             "|---|---|---|---|---|---|"]
    for m, r in rows.items():
        knn = "-" if r["knn_top1"] is None else f"{r['knn_top1']:.2f}"
        paper = "-" if r["paper_linear_top1"] is None else f"{r['paper_linear_top1']:.2f}"
        lines.append(f"| {PAPER[m][0]} | {r['linear_top1']:.2f} / {r['linear_best_top1']:.2f} | {knn} | {paper} | "
                     f"{r['pretrain_s'] / 60:.1f} min | {r['linear_s'] / 60:.1f} min |")
    lines += ["", "Where each stage's time went (seconds; the stage's own processes, every invocation):", "",
              "| stage | wall | " + " | ".join(p.replace("_", " ") for p in PARTS) + " |",
              "|---|---|" + "---|" * len(PARTS)]
    for m, r in rows.items():
        for stage, split in r["split"].items():
            if split:
                lines.append(f"| {PAPER[m][0]} {stage} | {split['wall']:.1f} | "
                             + " | ".join(f"{split[p]:.1f}" for p in PARTS) + " |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    print("\n" + text + f"\n(results.json and results.md in {out})", flush=True)


def methods(given=None):
    """The methods reproduce.sh runs, printed: those of the string METHODS `given` (unset: all of PAPER's, in its
    order); one line naming the known ones when one is unknown."""
    chosen = list(PAPER) if given is None else given.split()
    if not chosen:
        raise UserError(f"METHODS is empty: use some of {' '.join(PAPER)} (or leave it unset: all)")
    for m in chosen:
        if m not in PAPER:
            raise UserError(f"unknown method '{m}' in METHODS: use {', '.join(list(PAPER)[:-1])} or {list(PAPER)[-1]}")
    print(" ".join(chosen))


def figure(dataset, out, chosen):
    """OUT/curves.png (each finished method of `chosen`, of all without: its kNN and online probe per epoch against
    its paper number, its loss and schedules: sce.plot) and OUT/time_split.png (each stage's wall time by part), or a
    line saying why not."""
    done = [m for m in PAPER if (m in chosen or not chosen) and os.path.isfile(os.path.join(out, m, "log.txt"))]
    try:
        from sce import plot
        plot.plot_runs([os.path.join(out, m) for m in done], os.path.join(out, "curves.png"),
                       labels=[PAPER[m][0] for m in done], paper=[PAPER[m][1].get(dataset) for m in done],
                       title=f"{dataset}: the reproduction beside the paper's linear top-1")
        rows = [dict(stage=f"{PAPER[m][0]} {stage}", **split) for m in done
                for stage, folder in (("pretrain", os.path.join(out, m)), ("linear", os.path.join(out, m, "linear")))
                for split in [stage_split(folder)] if split]
        plot.plot_time_split(rows, os.path.join(out, "time_split.png"), title=f"{dataset}: each stage's wall time")
        print(f"=> figures: {os.path.join(out, 'curves.png')}, {os.path.join(out, 'time_split.png')}")
    except UserError as e:  # no matplotlib, no run to draw: the table above stands alone
        print(f"=> no figure: {e}")


def main(argv):
    command, rest = argv[0], argv[1:]
    if command == "methods":
        methods(*rest)
    elif command == "recipe":
        recipe(*rest)
    elif command == "flags":
        print(shlex.join(recipe_flags(*rest)))
    elif command == "check":
        check(*rest)
    elif command == "show":
        log, pid, start, out, env_file, method, linear_flags, *run_methods = rest
        show(log, pid, start, out, env_file=env_file, method=method, linear_flags=linear_flags, methods=run_methods)
    elif command == "figure":
        figure(rest[0], rest[1], rest[2:])
    else:
        table(rest[0], rest[1], rest[2:])


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")
