"""What the main_*.py scripts share: the --help formatter, the trunk and --amp flags, the entry-point
wrapper (one-line UserErrors, torchrun error files), progress lines and cached trunk features."""
import argparse
import hashlib
import json
import math
import os
import sys
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record
from torch.utils.data import DataLoader

from sce import UserError

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
    from sce.builder import ARCHS
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


def default_workers(most=16):
    """Loader processes per rank: this node's cores (those this process may run on) shared among its
    ranks (torchrun's LOCAL_WORLD_SIZE), minus one core for the rank itself; at most `most`, which
    bounds the shared memory of prefetched batches. (A container's CPU quota is not seen here.)"""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(most, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)) - 1))


def check_ranges(positive=(), at_least_zero=(), unit_interval=()):
    """A one-line error for the first flag out of its range; each argument: {flag: value}, where a
    value of None (flag not given) is skipped."""
    for flag, value in dict(positive).items():
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be positive (got {value})")
    for flag, value in dict(at_least_zero).items():
        if value is not None and value < 0:
            raise UserError(f"{flag} must be >= 0 (got {value})")
    for flag, value in dict(unit_interval).items():
        if value is not None and not 0 <= value <= 1:
            raise UserError(f"{flag} must lie in [0, 1] (got {value})")


AMP = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def add_amp_arg(parser):
    """--amp none|fp16|bf16; a bare --amp is the former on/off switch: torch.autocast's own dtype,
    fp16 on a GPU and bf16 on a CPU."""
    const = "fp16" if torch.cuda.is_available() else "bf16"
    parser.add_argument("--amp", default="none", choices=list(AMP), nargs="?", const=const,
                        help="mixed precision (autocast) in fp16 or bf16; a bare --amp is the former "
                        f"switch: fp16 on GPU, bf16 on CPU (here {const})")


def add_compile_arg(parser):
    """--compile / --no-compile of the frozen trunk; None (auto) is resolved by sce.engine.resolve_compile."""
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="torch.compile the trunk; a failed compile warns and runs eagerly (default: on CUDA "
                             "with Triton; off on CPU, where compiling a ResNet takes minutes)")


def add_decode_arg(parser):
    """--decode auto|device|loader of the evaluation scripts; auto is resolved by resolve_decode."""
    parser.add_argument("--decode", default="auto", choices=["auto", "device", "loader"],
                        help="device: JPEG files decoded, resized and cropped on the device (the GPU's JPEG "
                             "engines; other files by the workers); loader: all by the loader's workers; auto: device "
                             "on a GPU with JPEG engines (A100, H100, H200, ...)")


def resolve_decode(decode, device):
    """--decode auto: device where torchvision decodes JPEGs on it (a GPU), else loader."""
    from sce.device_decode import available
    return ("device" if available(device) else "loader") if decode == "auto" else decode


def autocast(device, amp):
    """torch.autocast for an --amp value ('none' turns it off)."""
    return torch.autocast(device.type, dtype=AMP[amp], enabled=AMP[amp] is not None)


# ---------------------------------------------------------------- entry point

class _ErrorFile(ErrorHandler):
    """torch's error file, behind torchrun's failure summary ("Root Cause": the rank whose error
    file has the earliest timestamp). A UserError is written as the line the rank printed, in the
    file's documented format, instead of a traceback."""

    def record_exception(self, e):
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torchrun for each worker
        if not isinstance(e, UserError) or not path:
            return super().record_exception(e)
        with open(path, "w") as f:
            json.dump({"message": {"message": f"UserError: {e}", "extraInfo": {
                "py_callstack": f"error: {e}", "timestamp": str(int(time.time()))}}}, f)


def run(main):
    """Entry point of every script: `if __name__ == "__main__": cli.run(main)`.

    main() runs under torch's error recording (torch.distributed.elastic's `record`): under
    torchrun a failing rank writes the error file that torchrun's summary reads, so the summary
    names the first rank that failed and its message, whatever its peers raise next. A UserError
    then ends as one line `error: ...` on stderr, exit status 1, no traceback; any other exception
    keeps its traceback."""
    try:
        record(main, _ErrorFile())()
    except UserError as e:
        sys.exit(f"error: {e}")


def summary_writer(output_dir):
    """A TensorBoard SummaryWriter on output_dir, or None (with a line saying so) without tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("tensorboard is not installed: no TensorBoard scalars", flush=True)
        return None
    return SummaryWriter(output_dir)


# ---------------------------------------------------------------- progress

def format_eta(seconds):
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Images done out of `total`, images/s since the previous report and the ETA at the mean rate
    since the start: `update(n)` after each batch, `report()` for the text."""

    def __init__(self, total):
        self.total, self.done = total, 0
        self.start = self.mark = time.time()
        self.mark_done = 0

    def update(self, n):
        self.done += n

    def report(self):
        now = time.time()
        rate = (self.done - self.mark_done) / max(now - self.mark, 1e-9)
        mean = self.done / max(now - self.start, 1e-9)
        self.mark, self.mark_done = now, self.done
        eta = (self.total - self.done) / mean if self.done else math.inf
        return f"{self.done}/{self.total} images, {rate:.0f} images/s, ETA {format_eta(eta)}"


# ---------------------------------------------------------------- cached features

def split_features(trunk, dataset, split, output_dir, device, /, *, checkpoint, batch_size=256, workers=0,
                   amp="none", **key):
    """Global-average-pooled features (float32 numpy, not normalised) of every image of `dataset`,
    in order, with the trunk in eval mode.

    Cached in OUTPUT_DIR/features_<split>_<hash>.pt. The key: the checkpoint file (path, size,
    mtime), the split, the dataset's size and transform, where its JPEGs are decoded, --amp, and the
    caller's **key (encoder, arch, data path, ...). It is stored in the file and compared on reading;
    a file that does not load is recomputed."""
    from sce.checkpoint import save_atomic
    from sce.device_decode import DecodedEval, decoded_loader
    from sce.loader import collate_views
    st = os.stat(checkpoint)
    key = dict(key, checkpoint=os.path.abspath(checkpoint), mtime_ns=st.st_mtime_ns, size=st.st_size,
               split=split, n=len(dataset), transform=repr(getattr(dataset, "transform", None)), amp=amp,
               decoded_on_device=isinstance(dataset, DecodedEval))
    key = json.loads(json.dumps(key, sort_keys=True, default=str))  # as it reads back from the file
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(output_dir, f"features_{split}_{digest}.pt")
    if os.path.isfile(path):
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            if blob.get("key") == key:
                print(f"{split}: features read from {path}", flush=True)
                return blob["features"].numpy()
        except Exception as e:  # a truncated or foreign file: compute it again
            print(f"warning: ignoring unreadable feature cache {path} ({type(e).__name__})", flush=True)
    from sce.knn import extract_features  # here: sce.knn uses this module's progress lines
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers,
                        pin_memory=device.type == "cuda", collate_fn=collate_views)
    with autocast(device, amp):
        feats, _ = extract_features(trunk, decoded_loader(loader, device), device, normalize=False,
                                    name=f"{split} features")
    feats = feats.cpu()
    os.makedirs(output_dir, exist_ok=True)
    save_atomic({"key": key, "features": feats}, path)
    return feats.numpy()
