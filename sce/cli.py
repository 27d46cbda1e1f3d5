"""What the main_*.py scripts share on their command line: the --help formatter, the shared flags and their
checks. (Their entry point is sce.entry's, their TensorBoard writer sce.events'.)"""
import argparse
import math
import os

import torch

from sce import UserError, layouts, losses
from sce import distributed as du
from sce.builder import ARCHS, build_trunk

# ---------------------------------------------------------------- --help


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the module docstring as written and appends each flag's default to its help, 0 and 0.0
    included (lists as typed: `16 32 full`). No default is shown for None / False / empty values, nor
    where the help already speaks of its default. Metavars come from the flag, not the dest
    (the first long one: `--lambda LAMBDA`, not the dest's `LAMBDA_`)."""

    def _get_help_string(self, action):
        text, value = action.help or "", action.default
        # `is`, not `in`: 0 == False, and 0 is a default worth showing
        hidden = (value is None or value is False or value is argparse.SUPPRESS
                  or (isinstance(value, (str, list, tuple)) and not value))
        if hidden or not action.option_strings or "default" in text:
            return text
        shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        return f"{text} (default: {shown.replace('%', '%%')})"  # argparse %-formats the help

    def _get_default_metavar_for_optional(self, action):
        flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
        return flag.lstrip("-").replace("-", "_").upper()


def make_parser(description):
    """An ArgumentParser with HelpFormatter; `description` is the script's __doc__."""
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)


# ---------------------------------------------------------------- shared flags

def add_trunk_args(parser, required=True):
    """--pretrained --encoder -a/--arch --small-input: the frozen trunk the evaluation scripts read."""
    g = parser.add_argument_group("trunk")
    g.add_argument("--pretrained", metavar="CHECKPOINT", required=required,
                   help="main_pretrain.py or main_lincls.py checkpoint, or a torchvision ResNet state dict")
    g.add_argument("--encoder", default="online", choices=["online", "momentum"],
                   help="which trunk of a main_pretrain.py checkpoint")
    g.add_argument("-a", "--arch", metavar="ARCH", choices=ARCHS,
                   help=f"torchvision ResNet: {', '.join(ARCHS)} (default: the checkpoint's)")
    g.add_argument("--small-input", default=None, action=argparse.BooleanOptionalAction,
                   help="3x3 stride-1 stem without max-pool, for 32-96 px images (default: the checkpoint's)")
    return g


def cores_per_rank():
    """This node's cores (those this process may run on) shared among its ranks (torchrun's LOCAL_WORLD_SIZE), at
    least 1. (A container's CPU quota is not seen here.)"""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def default_workers(most=16):
    """Loader processes per rank: the rank's cores (cores_per_rank) minus one for the rank itself; at most `most`,
    which bounds the shared memory of prefetched batches."""
    return max(1, min(most, cores_per_rank() - 1))


def cap_processes(count, flag="--workers"):
    """`count` processes per rank (the flag's), at most the rank's cores: more only contend for them, and each holds
    its own copy of the dataset's state and its prefetched batches (--workers 100000 filled 23 GB with 1,500
    processes before the kernel killed the run). More is capped to the cores, with a line (rank 0's)."""
    most = cores_per_rank()
    if count <= most:
        return count
    if os.environ.get("RANK", "0") == "0":
        print(f"=> {flag} {count} is more than the {most} core(s) this process has"
              + (" (its share of the node's, over its ranks)" if "LOCAL_WORLD_SIZE" in os.environ else "")
              + f": using {most}", flush=True)
    return most


def check_memory(device, needs):
    """A one-line error for the first of `needs` ({what: (bytes, what to do)}) larger by itself than all of the
    device's memory (a GPU's own, else this machine's): a size that cannot fit, however the rest is spent. The
    estimates are rough and low (the tensors named, not the activations), so only the clearly impossible stops."""
    total = du.device_memory(device)
    where = f"the {device} GPU's memory" if device.type == "cuda" else "this machine's memory"
    for what, (need, fix) in needs.items():
        if need > total:
            raise UserError(f"{what} need {need / 2 ** 30:.1f} GiB alone, more than all of {where} "
                            f"({total / 2 ** 30:.1f} GiB): {fix}")


def check_finite(args):
    """A one-line error for the first number of the parsed flags that is NaN or infinite: argparse's
    float() takes `nan` and `inf`, and no range check catches NaN. Run right after parsing."""
    for dest, value in vars(args).items():
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            flag = "--" + dest.rstrip("_").replace("_", "-")
            shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            raise UserError(f"{flag} must be a finite number (got {shown})")


def check_ranges(positive=(), at_least_zero=(), unit_interval=()):
    """A one-line error for the first flag out of its range; each argument: {flag: value}, where a
    value of None (flag not given) is skipped. Written so that NaN fails every range."""
    for flag, value in dict(positive).items():
        if value is not None and not value > 0:
            raise UserError(f"{flag} must be positive (got {value})")
    for flag, value in dict(at_least_zero).items():
        if value is not None and not value >= 0:
            raise UserError(f"{flag} must be >= 0 (got {value})")
    for flag, value in dict(unit_interval).items():
        if value is not None and not 0 <= value <= 1:
            raise UserError(f"{flag} must lie in [0, 1] (got {value})")


# every use of --seed takes it: torch.manual_seed (and seed + epoch), random.seed, numpy's uint64 hashes of
# (seed, epoch, index) and SeedSequence; 2**64 and above would overflow or wrap round to another seed's draws
SEED_MAX = 2 ** 63 - 1


def check_seed(seed, most=SEED_MAX, why=""):
    """A one-line error for a --seed outside [0, most]."""
    if not 0 <= seed <= most:
        raise UserError(f"--seed must lie in [0, {most}]{why} (got {seed})")


AMP = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------- main_pretrain.py's flags and checks

QUEUE_SIZE = 65536  # --queue-size's default for a method with a queue: the paper's ImageNet runs'


def per_method(default):
    """'sce 0.1, moco 0.2, ressl 0.1': default(record) of each method (sce.losses.METHODS), for --help."""
    return ", ".join(f"{name} {default(m)}" for name, m in losses.METHODS.items())


def add_method_flags(parser):
    """The flags of each method's record, in a group per method (a flag two methods read, once);
    check_method_flags refuses one that the run's method does not read."""
    added = set()
    for name, m in losses.METHODS.items():
        group = parser.add_argument_group(f"--method {name}") if m.flags else None
        for flag, kwargs in m.flags:
            if flag not in added:
                group.add_argument(flag, **kwargs)
                added.add(flag)


def refuse(rules, args):
    """The first of `rules`, (when(args), the line(args)) pairs, that holds, as one line."""
    for when, line in rules:
        if when(args):
            raise UserError(line(args))


# what main_pretrain.py refuses beyond the flags' ranges: (when, the line naming the fix)
PRETRAIN_RULES = [
    (lambda a: a.arch not in ARCHS, lambda a: f"unknown arch '{a.arch}': use one of {', '.join(ARCHS)}"),
    (lambda a: not (a.tau > 0 and a.tau_m > 0),
     lambda a: f"temperatures must be positive (got --tau {a.tau}, --tau-m {a.tau_m})"),
    (lambda a: len(a.local_crop_scales) != 2 * len(a.local_crop_sizes),
     lambda a: "--local-crop-scales needs two numbers (min max) per --local-crop-sizes entry"),
    (lambda a: not all(0 < low <= high <= 1 for low, high in crop_scales(a)),
     lambda a: f"crop scales are area shares: --min-scale and each --local-crop-scales pair (min max) need "
               f"0 < min <= max <= 1 (got {crop_scales(a)})"),
    (lambda a: a.max_bad_images < -1, lambda a: f"--max-bad-images must be -1 (0.1% of the dataset) or a number of "
                                                f"images >= 0 (got {a.max_bad_images})"),
    (lambda a: a.decode == "device" and a.augment == "cpu",
     lambda a: "--decode device crops and augments on the device: drop --augment cpu"),
    (lambda a: a.preload == "device" and a.augment == "cpu",
     lambda a: "--preload device augments on the device: drop --augment cpu (or use --preload off)"),
    (lambda a: losses.lambda_scheduled(a) and a.loss != "sce",
     lambda a: f"--lambda-schedule / --lambda-warmup-steps need the SCE loss (--method sce without --loss-coeffs); "
               f"this run uses {a.loss}"),
    (lambda a: not losses.METHODS[a.method].queue and a.queue_size,
     lambda a: f"--queue-size is a setting of a method with a queue; --method {a.method} has none: drop it"),
]


def crop_scales(args):
    return [(args.min_scale, 1.0)] + list(zip(args.local_crop_scales[::2], args.local_crop_scales[1::2]))


def check_pretrain(args, world_size, device, min_crop):
    """main_pretrain.py's settings checked before anything is built: one line for the first impossible one (sizes
    that cannot fit the device's memory included; crops under `min_crop` px, which the blur cannot reflect);
    Returns the BN splits."""
    check_finite(args)
    check_ranges({"--batch-size": args.batch_size, "--epochs": args.epochs, "--print-freq": args.print_freq,
                  "--save-freq": args.save_freq, "--proj-dim": args.proj_dim, "--knn-k": args.knn_k,
                  "--proj-hidden-dims": min(args.proj_hidden_dims, default=1), "--knn-t": args.knn_t,
                  "--pred-hidden-dims": min(args.pred_hidden_dims, default=1), "--dist-timeout": args.dist_timeout,
                  "--bn-splits": args.bn_splits, "--knn-max-train": args.knn_max_train,
                  "--queue-size": args.queue_size if losses.METHODS[args.method].queue else None,
                  "--online-probe-lr": args.online_probe_lr},
                 {"--workers": args.workers, "--lr": args.lr, "--weight-decay": args.weight_decay,
                  "--warmup-epochs": args.warmup_epochs, "--keep-checkpoints": args.keep_checkpoints,
                  "--stop-after-epochs": args.stop_after_epochs, "--lambda-warmup-steps": args.lambda_warmup_steps,
                  "--knn-every": args.knn_every, "--max-nonfinite-steps": args.max_nonfinite_steps},
                 {"--lambda": args.lambda_, "--lambda-end": args.lambda_end, "--sgd-momentum": args.sgd_momentum,
                  "--lambda-warmup-start": args.lambda_warmup_start, "--ema-momentum": args.ema_momentum})
    check_seed(args.seed)
    refuse(PRETRAIN_RULES, args)
    check_method_flags(args)
    smallest = min([args.crop_size] + args.local_crop_sizes)
    if smallest < min_crop:
        raise UserError(f"crops of {smallest} px are too small to blur (sigma 2 reflects {min_crop - 1} px): use "
                        f"--crop-size / --local-crop-sizes of at least {min_crop}")
    if args.batch_size % world_size:
        raise UserError(f"--batch-size {args.batch_size} is not divisible by the {world_size} ranks: use a multiple "
                        f"of {world_size}")
    keys_per_step = args.batch_size * (2 if args.symmetric else 1)
    if args.queue_size % keys_per_step:
        raise UserError(f"--queue-size {args.queue_size} is not a multiple of the {keys_per_step} keys enqueued per "
                        f"step: use e.g. {max(1, args.queue_size // keys_per_step) * keys_per_step}")
    if args.sync_bn and world_size > 1 and device.type != "cuda":
        raise UserError("--sync-bn needs GPUs (torch's SyncBatchNorm has no CPU kernel): drop it on CPU")
    bn_splits = args.bn_splits if args.shuffle_bn and world_size == 1 else 1  # several ranks shuffle for real
    if bn_splits > 1 and (args.batch_size % bn_splits or args.batch_size // bn_splits < 2):
        raise UserError(f"--bn-splits {bn_splits} must divide the batch of {args.batch_size} into chunks of at "
                        f"least 2 images: use a divisor of {args.batch_size} up to {args.batch_size // 2}")
    check_sizes(args, args.batch_size // world_size, device)
    return bn_splits


def check_method_flags(args):
    """A flag that only another method reads (its record's `flags`) would be silently ignored: one line."""
    owners = {}
    for name, method in losses.METHODS.items():
        for flag, kwargs in method.flags:
            dest = kwargs.get("dest", flag.lstrip("-").replace("-", "_"))
            default = kwargs.get("default", {"store_true": False, "store_false": True}.get(kwargs.get("action")))
            owners.setdefault((flag, dest, default), []).append(name)
    for (flag, dest, default), methods in owners.items():
        if args.method not in methods and getattr(args, dest) != default:
            raise UserError(f"{flag} is a setting of --method {' / '.join(methods)}, not of {args.method}: drop it "
                            "or change --method")


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
    check_memory(device, {
        f"--batch-size {args.batch_size} with --crop-size {args.crop_size}: one step's views in float32":
            (per_rank * sum(3 * s * s for s in sizes) * 4, "lower --batch-size or --crop-size"),
        f"the heads of {' '.join(f'{k} {v}' for k, v in widths.items())}: their weights in float32, online and "
        "momentum": (heads * 4, f"lower {' or '.join(widths)}"),
        f"--queue-size {args.queue_size} keys of --proj-dim {args.proj_dim}: the queue and one step's logits against "
        "it": (keys, "lower --queue-size or --proj-dim")})


def add_runtime_args(g, output_dir, output_help, seed_help, compile_help, resume_help=None, torchrun=False):
    """The flags every script shares, one spelling and one behaviour: -j/--workers, --amp, --compile, --seed,
    --output-dir, --resume where a script continues runs, --dist-timeout where it runs under torchrun. A bare
    --amp is the former on/off switch: torch.autocast's own dtype, fp16 on a GPU and bf16 on a CPU."""
    g.add_argument("-j", "--workers", type=int, default=default_workers(),
                   help="data-loading processes per rank (default: the node's cores / its ranks - 1, at most 16; "
                        f"here {default_workers()})")
    const = "fp16" if torch.cuda.is_available() else "bf16"
    g.add_argument("--amp", default="none", choices=list(AMP), nargs="?", const=const,
                   help=f"mixed precision (autocast) in fp16 or bf16; a bare --amp: fp16 on GPU, bf16 on CPU (here "
                        f"{const})")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help=f"torch.compile {compile_help}; a failed compile warns and runs eagerly (default: on CUDA "
                        "with Triton; off on CPU, where compiling a ResNet takes minutes)")
    g.add_argument("--seed", type=int, default=0, help=seed_help)
    g.add_argument("--output-dir", default=output_dir, metavar="DIR",
                   help=f"{output_help} (one run at a time holds the folder)")
    if resume_help:
        g.add_argument("--resume", default="auto", metavar="PATH",
                       help=f"auto: continue from OUTPUT_DIR/checkpoint_last.pth if there is one ({resume_help}); a "
                            "checkpoint path: continue that one; none: start fresh (an OUTPUT_DIR holding a "
                            "checkpoint is refused) (default: auto)")
    if torchrun:
        g.add_argument("--dist-timeout", type=int, default=1800, metavar="SECONDS",
                       help="timeout of the ranks' collectives, the agreement on a stop request included (default: "
                            "1800)")


def add_data_args(g, preload_help, datasets):
    """--dataset, --preload and --decode, for the scripts that read a --dataset layout."""
    g.add_argument("--dataset", default="imagefolder", choices=datasets,
                   help="layout of --data (an ImageFolder: DIR/train and DIR/val, pretraining DIR/train if present)")
    g.add_argument("--preload", default="auto", choices=["auto", "device", "off"], help=preload_help)
    add_decode_arg(g)


def add_knn_args(g):
    """--knn-k and --knn-t of the weighted kNN vote (sce.knn), the kNN monitor's and main_lincls.py --knn's."""
    g.add_argument("--knn-k", type=int, default=200, help="neighbours that vote")
    g.add_argument("--knn-t", type=float, default=0.07, help="temperature: votes weigh exp(cos / t)")


def add_decode_arg(g):
    """--decode auto|device|loader (sce.data.resolve_decode)."""
    g.add_argument("--decode", default="auto", choices=["auto", "device", "loader"],
                   help="device: JPEG files decoded, cropped and resized on the device (the GPU's JPEG engines; "
                        "other files, PNG or progressive JPEG, by the workers); loader: all by the loader's "
                        "workers; auto: device on a GPU with JPEG engines (A100, H100, H200, ...), else loader")


def autocast(device, amp):
    """torch.autocast for an --amp value ('none' turns it off)."""
    return torch.autocast(device.type, dtype=AMP[amp], enabled=AMP[amp] is not None)
