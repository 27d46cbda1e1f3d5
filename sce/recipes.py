"""The paper's settings as rows: `main_pretrain.py --recipe NAME` (and `--dataset NAME` alone, for a fresh run) takes
its pretraining values, and each value carries its source: the paper's section or table, or the authors' published
config where the paper is silent. A row also holds the linear probe's values (main_lincls.py's flags) and, for an
ablation table, the points it sweeps. RECIPES.md shows the rows as commands (tests/test_recipes.py checks it against
them value by value); scripts read them here, not there:

    python -m sce.recipes                          the rows, one line each
    python -m sce.recipes cifar10 --flags          the row as main_pretrain.py flags (its --dataset left out)
    python -m sce.recipes cifar10 --flags --method moco      the row of a baseline (Sec. 4.2): its temperatures
    python -m sce.recipes imagenet100-lambda --sweep         one line of flags per point of the table
    python -m sce.recipes cifar10 --linear-flags   the linear probe's flags (main_lincls.py)
(No torch here: the shell scripts' start-up stays quick.)"""
import argparse
import dataclasses
import sys

from sce import UserError

# where each value comes from
SMALL_SUPP = 'supp. "Implementation details for pretraining small and medium datasets"'
SMALL_SIZE = 'Sec. 4.2 "Small datasets" / "Medium datasets": the resolution'
TEMPS_SMALL = "supp. Table 10: the best temperatures (Sec. 4.2 uses them)"
IN100 = 'Sec. 4.1 "Implementation details for pretraining"'
IN = 'Sec. 4.2 "Implementation details" (ImageNet: Sec. 4.1\'s with lr 0.5 and a 3-layer 2048 projector)'
SOTA = 'Sec. 4.3 "Implementation details"'
AUTHORS = "the authors' published config (the paper is silent)"
MOCO_TAU = 'Sec. 4.2 "Implementation details": MoCo v2 with tau 0.2'
RESSL_TEMPS = "Sec. 4.2 \"Implementation details\": ReSSL's best reported temperatures (ReSSL's paper)"
LINEAR_STEP = 'Sec. 4.1 "Evaluation protocol"'
LINEAR_COSINE = 'Sec. 4.3 "Evaluation protocol"'
DEMO = "the demo's, tuned for the digits (this repository; no paper setting)"
SPLIT_BN = ('supp.: "2 GPUs for a total batch size of 256": BN over 128 images in every layer, the momentum branch\'s '
            "shuffled across the two (MoCo's shuffle BN, the authors' code); on one process: 2 chunks")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One setting of the paper. values: {args key: (value, source)} in flag order; methods: {method: {key: (value,
    source)}}, the methods the row is run with (Sec. 4.2's baselines) and what each sets on top (its temperatures);
    linear: main_lincls.py's {key: (value, source)}; sweep: the ablation table's points, each {key: value}; gpus: the
    GPUs the paper ran it on."""
    about: str
    values: dict
    methods: dict
    linear: dict = dataclasses.field(default_factory=dict)
    sweep: tuple = ()
    gpus: int = 8


def temps(tau, tau_m, source):
    return {"tau": (tau, source), "tau_m": (tau_m, source)}


BASELINES = {"moco": {"tau": (0.2, MOCO_TAU)}, "ressl": temps(0.1, 0.04, RESSL_TEMPS)}
LINEAR = {"schedule": ("step", LINEAR_STEP), "epochs": (100, LINEAR_STEP), "lr": (30.0, LINEAR_STEP),
          "milestones": ([60, 80], LINEAR_STEP), "weight_decay": (0.0, LINEAR_STEP),
          "sgd_momentum": (0.9, LINEAR_STEP)}


def small(dataset, size, ema, queue, tau, tau_m):
    """A row of the small and medium datasets (Sec. 4.2 with supp.'s details), one GPU in our runs."""
    return Recipe(
        f"SCE on {dataset}, 200 epochs, ResNet-18 (Sec. 4.2; supp.)",
        {"dataset": (dataset, "Sec. 4.2, Table 6's column"), "crop_size": (size, SMALL_SIZE),
         "arch": ("resnet18", SMALL_SUPP), "small_input": (True, SMALL_SUPP + ": 3x3 stride-1 conv, no first pooling"),
         "batch_size": (256, SMALL_SUPP), "epochs": (200, SMALL_SUPP), "lr": (0.06, SMALL_SUPP),
         "weight_decay": (5e-4, SMALL_SUPP), "warmup_epochs": (5, SMALL_SUPP),
         "ema_schedule": ("constant", SMALL_SUPP + ": one momentum value"),
         "proj_hidden_dims": ([512], SMALL_SUPP), "proj_dim": (256, SMALL_SUPP + " (the published configs: 128)"),
         "proj_last_bn": ("none", SMALL_SUPP + ": BN after the hidden layer only"),
         "shuffle_bn": (True, SPLIT_BN), "split_bn": ("all", SPLIT_BN), "bn_splits": (2, SPLIT_BN),
         "ema_momentum": (ema, SMALL_SUPP), "queue_size": (queue, SMALL_SUPP)},
        {"sce": temps(tau, tau_m, TEMPS_SMALL), **BASELINES},
        linear=LINEAR, gpus=1)


def imagenet100(about, methods, sweep=(), **values):
    """A row of the ablations on ImageNet100 (Sec. 4.1)."""
    return Recipe(about, {
        "dataset": ("imagenet100", 'Sec. 4.1 "Dataset": the classes of CMC (supp. Table 9)'),
        "arch": ("resnet50", IN100), "crop_size": (224, "ResNet-50's 224 px (supp.: the evaluation's size)"),
        "batch_size": (512, IN100), "epochs": (200, IN100), "lr": (0.3, IN100), "weight_decay": (1e-4, IN100),
        "warmup_epochs": (5, IN100), "ema_momentum": (0.996, IN100), "ema_schedule": ("cosine", IN100),
        "queue_size": (65536, IN100), "proj_hidden_dims": ([4096], IN100), "proj_dim": (256, IN100),
        "proj_last_bn": ("none", IN100 + ": 2 fully connected layers"), **values}, methods, LINEAR, sweep)


def sota(epochs, lr, wd, ema, **values):
    """A row of the state of the art on ImageNet (Sec. 4.3, Tables 7 and 8): LARS, batch 4096, symmetric."""
    table = "Table 8, multi-crop" if "local_crop_sizes" in values else "Table 7"
    return Recipe(f"SCE on ImageNet, {epochs} epochs, LARS, batch 4096 (Sec. 4.3, {table})", {
        "arch": ("resnet50", SOTA), "batch_size": (4096, SOTA), "optimizer": ("lars", SOTA),
        "warmup_epochs": (10, SOTA), "symmetric": (True, SOTA + ": the loss is symmetrized"),
        "online_aug": ("strong-alpha", SOTA), "target_aug": ("strong-beta", SOTA), "queue_size": (65536, SOTA),
        "tau": (0.1, SOTA), "tau_m": (0.07, SOTA), "lambda_": (0.5, SOTA),
        "proj_hidden_dims": ([2048, 2048], AUTHORS + ": MoCo v3's projector, 3 layers of 2048, BN at each"),
        "proj_dim": (256, SOTA), "proj_last_bn": ("no-affine", AUTHORS + ": MoCo v3's last BN"),
        "pred_hidden_dims": ([4096], SOTA + ": MoCo v3's predictor"),
        "sync_bn": (True, AUTHORS + ": BN statistics over all GPUs"),
        "wd_exclude_bias_norm": (True, SOTA + ": bias and BN parameters excluded"),
        "epochs": (epochs, SOTA), "lr": (lr, SOTA), "weight_decay": (wd, SOTA), "ema_momentum": (ema, SOTA),
        **values}, {"sce": {}}, LINEAR_SOTA, gpus=32)


LINEAR_SOTA = {"schedule": ("cosine", LINEAR_COSINE), "epochs": (90, LINEAR_COSINE),
               "batch_size": (1024, LINEAR_COSINE), "lr": (0.4, LINEAR_COSINE + ": 0.1 linearly scaled, x 1024 / 256"),
               "sgd_momentum": (0.9, LINEAR_COSINE)}
FIVE_COEFFS = [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.5, 0.5, 0.5], [0.0, 1.0, 0.0], [0.0, 1.0, 1.0]]
TEMPS = [0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1]
TABLE4 = [("strong", "weak", False), ("strong-gamma", "weak", False), ("weak", "strong", False),
          ("strong", "strong", False), ("strong-alpha", "strong-beta", False), ("strong", "weak", True),
          ("strong", "strong", True), ("strong-alpha", "strong-beta", True)]
T1 = "Table 1's 82.94 at lambda 0.5 is Table 3's tau 0.1, tau_m 0.05"
T4 = "Table 4's strong / weak 82.94 is Table 3's tau_m 0.05"
IN100_TEMPS = {"sce": temps(0.1, 0.07, "Table 5: the best temperatures"), **BASELINES}
SOTA_MULTICROP = "Sec. 4.3, Table 8: multi-crop (the authors' published config for the crops)"

ROWS = {
    "cifar10": small("cifar10", 32, 0.99, 4096, 0.2, 0.1),
    "cifar100": small("cifar100", 32, 0.99, 4096, 0.1, 0.08),
    "stl10": small("stl10", 96, 0.996, 16384, 0.1, 0.04),
    "tiny-imagenet": small("tiny-imagenet", 64, 0.996, 16384, 0.1, 0.07),
    "imagenet100": imagenet100("SCE on ImageNet100, 200 epochs (Sec. 4.1; Table 6's column)", IN100_TEMPS),
    "imagenet100-lambda": imagenet100(
        "Table 1: lambda swept", {"sce": temps(0.1, 0.05, T1)},
        tuple({"lambda_": x / 10} for x in range(11))),
    "imagenet100-coeffs": imagenet100(
        "Table 3: the coefficients of eq. 10 swept, at tau_m 0.05 and 0.07",
        {"sce": {"tau": (0.1, "Sec. 4.1, Table 3: tau 0.1")}},
        tuple({"loss_coeffs": c, "tau_m": t} for t in (0.05, 0.07) for c in FIVE_COEFFS)),
    "imagenet100-augs": imagenet100(
        "Table 4: the views' augmentations and the symmetry swept", {"sce": {"tau_m": (0.05, T4)}},
        tuple({"online_aug": a, "target_aug": b, "symmetric": s} for a, b, s in TABLE4)),
    "imagenet100-temps": imagenet100(
        "Table 5: the temperatures swept", {"sce": {}},
        tuple({"tau": t, "tau_m": m} for t in (0.1, 0.2) for m in TEMPS)),
    "imagenet": Recipe(
        "SCE and its baselines on ImageNet, 200 epochs (Sec. 4.2, Table 6)", {
            "arch": ("resnet50", IN), "crop_size": (224, "ResNet-50's 224 px (supp.: the evaluation's size)"),
            "batch_size": (512, IN), "epochs": (200, IN), "lr": (0.5, IN), "weight_decay": (1e-4, IN),
            "warmup_epochs": (5, IN), "ema_momentum": (0.996, IN), "ema_schedule": ("cosine", IN),
            "queue_size": (65536, IN), "proj_hidden_dims": ([2048, 2048], IN), "proj_dim": (256, IN),
            "proj_last_bn": ("affine", IN + ": BN at each layer")},
        {"sce": {"lambda_": (0.5, IN + ": the best of the ablations"), **temps(0.1, 0.07, "Table 5: the best "
                                                                                          "temperatures")},
         "moco": {**BASELINES["moco"], "proj_hidden_dims": ([4096], IN + ": MoCo v2 with ImageNet100's projector"),
                  "proj_last_bn": ("none", IN + ": MoCo v2 with ImageNet100's projector")},
         "ressl": BASELINES["ressl"]}, LINEAR),
    "imagenet-100": sota(100, 0.5, 1e-6, 0.99),
    "imagenet-200": sota(200, 0.3, 1e-6, 0.99),
    "imagenet-300": sota(300, 0.3, 1e-6, 0.99),
    "imagenet-1000": sota(1000, 0.3, 1.5e-6, 0.996),
    "imagenet-200-multicrop": sota(
        200, 0.3, 1e-6, 0.99, proj_hidden_dims=([4096, 4096], SOTA_MULTICROP),
        local_crop_sizes=([192, 160, 128, 96], SOTA_MULTICROP),
        local_crop_scales=([0.172, 0.86, 0.143, 0.715, 0.114, 0.571, 0.086, 0.429], SOTA_MULTICROP),
        local_aug=("strong-gamma", SOTA_MULTICROP)),
    # `python main_pretrain.py` without --data: digits placed at random in 16 px canvases, under 3 minutes on 2 cores.
    # Milder crops and the less blurry strong-beta view (Table 2's blur sigmas are meant for 224 px), small batches
    # for more steps, one loader process (16 px images cost it little).
    "demo": Recipe("the embedded demo on scikit-learn's digits (no --data)", {
        key: (value, DEMO) for key, value in dict(
            arch="resnet18", small_input=True, crop_size=16, epochs=3, batch_size=32, lr=0.25, weight_decay=5e-4,
            warmup_epochs=1, ema_momentum=0.99, ema_schedule="constant", proj_hidden_dims=[512], proj_dim=128,
            proj_last_bn="none", workers=1, min_scale=0.5, online_aug="strong-beta", queue_size=1024,
            output_dir="runs/demo", knn_every=0).items()}, {"sce": {}, "moco": {}, "ressl": {}}, gpus=0),
}
# the row `--dataset NAME` selects for a fresh run
OF_DATASET = {name: name for name in ("cifar10", "cifar100", "stl10", "tiny-imagenet", "imagenet100")}
OWN = ("dataset", "output_dir", "data", "workers")  # a run's own: left out of --flags


def row(name, method="sce"):
    """{key: (value, source)} of row `name` run with `method` (its own values on top), or one line naming the rows
    or the row's methods."""
    if name not in ROWS:
        raise UserError(f"unknown recipe '{name}': use one of {', '.join(ROWS)} (or none)")
    recipe = ROWS[name]
    if method not in recipe.methods:
        raise UserError(f"--recipe {name} is run with --method {' / '.join(recipe.methods)} in the paper, not "
                        f"{method}: drop --recipe or change --method")
    return {**recipe.values, **recipe.methods[method]}


def flag_of(key):
    return "--" + key.rstrip("_").replace("_", "-")


def as_typed(value):
    """A setting as it is typed (lists blank-separated, on/off as such)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(typed(v) for v in value) or "(none)"
    return "(not set)" if value is None else typed(value)


def typed(value):
    """A number as it is typed: 5e-4 and 1.5e-6, not 0.0005 and 1.5e-06; 0.1, 30.0 as 0.1 and 30."""
    if isinstance(value, float):
        if 0 < abs(value) < 1e-3:
            mantissa, exponent = f"{value:e}".split("e")
            return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
        return f"{value:g}"
    return str(value)


def as_flags(values):
    """{key: value} as command-line words (on/off flags as --x / --no-x, store_true ones as --x)."""
    words = []
    for key, value in values.items():
        if isinstance(value, bool):
            words.append(flag_of(key) if value else "--no-" + flag_of(key)[2:])
        else:
            words.append(flag_of(key))
            words.extend(typed(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return words


def flags(name, method="sce", own=False):
    """Row `name` (with `method`) as main_pretrain.py flags; own: its --dataset too."""
    return as_flags({k: v for k, (v, _) in row(name, method).items() if own or k not in OWN})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", help="a row (default: list them)")
    p.add_argument("--method", default="sce", help="the method the row is run with (default: sce)")
    p.add_argument("--flags", action="store_true", help="the row as main_pretrain.py flags, --dataset left out")
    p.add_argument("--sweep", action="store_true", help="a line of flags per point the row's table sweeps")
    p.add_argument("--linear-flags", action="store_true", help="the linear probe's flags (main_lincls.py)")
    p.add_argument("--sources", action="store_true", help="each value with its source")
    args = p.parse_args(argv)
    if not args.name:
        for name, recipe in ROWS.items():
            print(f"{name:26} {recipe.about} (methods: {', '.join(recipe.methods)})")
        return
    values = row(args.name, args.method)
    if args.sweep:
        points = ROWS[args.name].sweep or ({},)
        for point in points:
            print(" ".join(flags(args.name, args.method) + as_flags(point)))
    elif args.linear_flags:
        print(" ".join(as_flags({k: v for k, (v, _) in ROWS[args.name].linear.items()})))
    elif args.sources or not args.flags:
        for key, (value, source) in values.items():
            print(f"{' '.join(as_flags({key: value})):40} {source}")
    else:
        print(" ".join(flags(args.name, args.method)))


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
