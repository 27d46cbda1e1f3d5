"""What the main_*.py scripts share: the --help formatter, the shared flags and their checks, the entry-point
wrapper (one-line UserErrors, torchrun error files, no loader worker left behind) and TensorBoard's writer."""
import argparse
import json
import math
import multiprocessing
import os
import re
import signal
import sys
import threading
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from sce import UserError, alive, stopped_during_startup, timing
from sce import distributed as du
from sce.builder import ARCHS
from sce.preemption import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, Interrupted, Stopped, stop_during_startup

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
    keeps its traceback. A stop signal before the run's loop takes the signals over ends it at once with
    PREEMPTED_EXIT_CODE and one line (sce.preemption.Stopped); a second Ctrl-C after a stop request, with
    INTERRUPTED_EXIT_CODE and one line (sce.preemption.Interrupted). Whatever the exit, its loader workers end with it,
    and the process leaves at once (leave)."""
    timing.STARTED = timing.process_start()  # the split's start-up counts the interpreter's and the imports'
    stop_with_parent()
    stop_during_startup()
    try:
        record(main, _ErrorFile())()
        code = 0
    except UserError as e:
        code = f"error: {one_line(e)}"
    except Stopped as e:
        print(stopped_during_startup(e), flush=True)
        code = PREEMPTED_EXIT_CODE
    except Interrupted:
        print("=> interrupted again: leaving at once, without waiting for the checkpoint being written (it is dropped, "
              "the previous one is kept); run the same command again to continue from that one (exiting with code "
              f"{INTERRUPTED_EXIT_CODE})", flush=True)
        code = INTERRUPTED_EXIT_CODE
    except SystemExit as e:
        code = e.code
    finally:
        end_workers()
    leave(code)


EXIT_AT_ONCE = True  # False where the scripts run inside another program (the tests)


def leave(code):
    """sys.exit(code), but in a script's own process at once: the interpreter's teardown of torch and torchvision
    takes one or two seconds and does nothing a finished run needs (its files are closed and its checkpoints
    written, its loader workers ended)."""
    if not EXIT_AT_ONCE:
        if code not in (0, None):
            sys.exit(code)
        return
    if isinstance(code, str):  # sys.exit's way with a message
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if code is None else code)


def one_line(error):
    """A UserError's message. Raised in a loader worker, torch raises it again in the main process with the
    worker's traceback as its message: the last line, the error's own, is kept."""
    text = str(error).strip()
    if "Original Traceback" not in text:
        return text
    return re.sub(r"^[\w.]+: ", "", text.splitlines()[-1])  # without the exception's name


PARENT_PID = "SCE_PARENT_PID"  # set by benchmarks/reproduction/reproduce.sh: its stages stop when it dies


def stop_with_parent():
    """With SCE_PARENT_PID set, a thread sends this process SIGTERM once that process has ended (gone, or a
    zombie its own parent has not reaped yet), or once this process's parent changed (it was reparented): a
    stage of a killed reproduce.sh saves and stops (before training, just stops) instead of training on, orphaned."""
    watched = os.environ.pop(PARENT_PID, None)
    if not watched:
        return
    parent = os.getppid()

    def watch():
        while os.getppid() == parent and alive(int(watched)):
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=watch, daemon=True, name="stop-with-parent").start()


def end_workers():
    """Kill the loader workers still running (they hold no state). Pretraining's ignore SIGTERM
    (sce.preemption), and after an error their DataLoader is still referenced by the traceback, so
    multiprocessing's exit hook, which sends SIGTERM and joins, would wait for them forever."""
    children = multiprocessing.active_children()
    if not children:
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would raise "worker killed" over the exit
    for p in children:
        p.kill()
    for p in children:
        p.join(10)


def summary_writer(output_dir):
    """A TensorBoard SummaryWriter on output_dir (Events), or None (with a line saying so) without tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("tensorboard is not installed: no TensorBoard scalars", flush=True)
        return None
    events = Events(None, output_dir)  # first: the writer's thread writes (and may fail) in its constructor
    try:
        events.writer = SummaryWriter(output_dir)
    except OSError as e:  # a full disk
        return events.failed(e)
    return events


class Events:
    """A SummaryWriter whose failure to write (a full disk) ends its events with one line, never the run: its writer
    thread's error, raised again by its next call, is caught here; that thread's own report of it (a traceback) is
    not printed (threading.excepthook, for TensorBoard's writer threads only)."""

    def __init__(self, writer, output_dir):
        self.writer, self.output_dir = writer, output_dir
        if not getattr(threading.excepthook, "quiet_tensorboard", False):
            threading.excepthook = _quiet_tensorboard(threading.excepthook)

    def __getattr__(self, name):  # add_scalar, add_image, flush, close
        def call(*args, **kwargs):
            try:
                return getattr(self.writer, name)(*args, **kwargs) if self.writer else None
            except OSError as e:
                return self.failed(e)
        return call

    def failed(self, error):
        print(f"=> TensorBoard could not write to {self.output_dir} ({error.strerror}): no more of its events in "
              "this run", flush=True)
        self.writer = None


def _quiet_tensorboard(hook):
    def quiet(args):
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            hook(args)
    quiet.quiet_tensorboard = True
    return quiet
