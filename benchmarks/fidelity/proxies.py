#!/usr/bin/env python
"""Short proxies of the CIFAR-10 row: the reproduction's SCE pretraining (benchmarks/reproduction/reproduce.sh cifar10,
RECIPES.md's line, with a GPU's flags there) for a short whole schedule, once per variant, one after the other, each
against the default (or MoCo v2's against MoCo v2's): the kNN top-1 after the last epoch (k 200, T 0.07, on val).

    python benchmarks/fidelity/proxies.py --data data/cifar10 [--out runs/proxies] [--epochs 30] [--variants NAME ...]
        [--time-limit SECONDS] [--smoke] [--dry-run]

- The schedule: --epochs E, the warm-up 5 epochs of 200 scaled to E, the kNN monitor after the last epoch (and
  after the first of each invocation, main_pretrain.py's measure for its estimate), a numbered checkpoint at
  the end only.
- Each variant trains in OUT/NAME (its output in OUT/NAME.log), as one main_pretrain.py process started by this
  one, with the compile caches of every variant in OUT/compile_cache. Run again, the same command continues: a
  finished variant is read back, a stopped one resumes (--resume auto), the others start.
- --time-limit: counted from this script's start; a variant is not started when the median of the finished ones'
  wall times would not fit in what is left, and the running one is asked to save and stop (SIGTERM) at the
  limit. Exit 75 when variants are left (run the same command again), 1 when one failed, else 0. A stop (SIGTERM,
  SIGUSR1, Ctrl-C) before the first variant starts (the imports, OUT's lock, reproduce.sh's data check) exits 75 with
  one line, reproduce.sh with it.
- jpeg-qN (any N): the data (train and val) re-encoded once more at quality N (benchmarks/fidelity/reencode.py) into
  OUT/data-qN, once; an ImageFolder's only (official files are refused before anything runs).
- --smoke: reproduce.sh's SMOKE setting (a small ImageFolder written from --data, 16 px crops, a tiny head, on
  CPU), 1 epoch by default: checks the script, not the numbers.
Prints a JSON line a variant (as each ends, or read back), then a table, also in OUT/results.md and results.json.
"""
import os
import sys

BENCH = os.path.dirname(os.path.realpath(__file__))
REPO = os.path.dirname(os.path.dirname(BENCH))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(REPO, "benchmarks", "reproduction"))
sys.path.insert(0, REPO)
import sce  # noqa: E402  (no torch) first: a stop during the imports below is one line and exit 75
sce.stop_while_importing(__name__ == "__main__")

import argparse  # noqa: E402
import fcntl  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from reencode import Stopped, reencode  # noqa: E402
from reproduce_tools import stage_split  # noqa: E402
from sce import PREEMPTED_EXIT_CODE, STOP_SIGNALS, UserError, stopped_during_startup, write_file  # noqa: E402

# name: (method, flags beyond the row's, the variant it is compared with, what it measures)
VARIANTS = {
    "default": ("sce", [], "default", "the row's setting"),
    "seed1": ("sce", ["--seed", "1"], "default", "another seed: the noise"),
    "jpeg-q75": ("sce", [], "default", "the data re-encoded at quality 75 (nearly lossless on a q75 copy)"),
    "jpeg-q50": ("sce", [], "default", "the data re-encoded at quality 50 (about the copy's squared error again)"),
    "released-bn": ("sce", ["--split-bn", "momentum", "--bn-splits", "8"], "default",
                    "the momentum encoder's BN alone split in 8 (the authors' released one-GPU config)"),
    "split-bn-all": ("sce", ["--split-bn", "all", "--bn-splits", "8"], "default",
                     "every BN layer split in 8 (the 2026-11-27 H200 row's)"),
    "noblur": ("sce", ["--online-aug", "strong-noblur"], "default", "the strong view without blur"),
    "fp16": ("sce", ["--amp", "fp16"], "default", "fp16 with GradScaler (the authors'; no CUDA graph)"),
    "moco": ("moco", [], "moco", "MoCo v2 (two strong views)"),
    "moco-noblur": ("moco", ["--online-aug", "strong-noblur", "--target-aug", "strong-noblur"], "moco",
                    "MoCo v2 without blur on either view"),
    "fp32": ("sce", ["--amp", "none"], "default", "fp32 (no autocast)"),
}
JPEG = re.compile(r"jpeg-q(\d+)$")
EPOCHS = 30  # five proxies in one 10-minute command on one H100, the first compiling cold (docs/benchmarks.md)


def variant(name):
    """(method, flags, against, what) of a variant name; jpeg-qN for any quality N (its data OUT/data-qN)."""
    match = JPEG.match(name)
    if name not in VARIANTS and not match:
        raise UserError(f"unknown variant '{name}': use some of {', '.join(VARIANTS)}, or jpeg-qN for a quality N")
    method, flags, against, what = VARIANTS.get(name) or ("sce", [], "default", f"the data re-encoded at quality "
                                                                                  f"{match.group(1)}")
    if match:
        if not 1 <= int(match.group(1)) <= 95:
            raise UserError(f"{name}: JPEG quality {int(match.group(1))} is outside PIL's 1-95: pick one in that range")
        flags = ["--data", f"data-q{match.group(1)}", "--knn-data", f"data-q{match.group(1)}"]
    return method, flags, against, what


def row_commands(data, out, smoke):
    """{method: argv} of the reproduction's pretraining for SCE and MoCo v2 (reproduce.sh's DRY_RUN), and the data
    folder they read."""
    env = dict(os.environ, DRY_RUN="1", METHODS="sce moco", PYTHON=sys.executable, SMOKE="1" if smoke else "0")
    script = os.path.join(REPO, "benchmarks", "reproduction", "reproduce.sh")
    said = subprocess.Popen(["bash", script, "cifar10", data, os.path.join(out, "row")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = said.communicate()
    except BaseException:  # a stop (Stopped): reproduce.sh ends its data check on SIGTERM and exits 75
        said.terminate()
        said.communicate()
        raise
    if said.returncode:
        raise UserError(stderr.strip().splitlines()[-1].removeprefix("error: ") if stderr.strip()
                        else f"reproduce.sh exited {said.returncode}")
    commands = {m: shlex.split(cmd) for m, cmd in re.findall(r"^=== (\w+) pretrain: (.*)$", stdout, re.M)}
    argv = commands["sce"]
    return commands, argv[argv.index("--data") + 1]


def command(name, commands, out, epochs):
    """The argv of a variant: the row's command, its schedule shortened, the variant's flags and folder."""
    method, flags, _, _ = variant(name)
    flags = [os.path.join(out, f) if f.startswith("data-q") else f for f in flags]
    return merged(commands[method], ["--epochs", str(epochs), "--warmup-epochs", f"{5 * epochs / 200:g}",
                                     "--knn-every", str(epochs), "--save-freq", str(epochs), *flags,
                                     "--output-dir", os.path.join(out, name)])


def merged(argv, extra):
    """argv then extra, each flag (with its values) kept at its last occurrence only, as argparse would read it."""
    words = argv + extra
    starts = [i for i, w in enumerate(words) if w.startswith("--")] + [len(words)]
    groups = [words[a:b] for a, b in zip(starts, starts[1:])]
    last = {g[0]: i for i, g in enumerate(groups)}
    return words[:starts[0]] + [w for i, g in enumerate(groups) if last[g[0]] == i for w in g]


def reencoded(name, root, out, runner):
    """OUT/data-qN for a jpeg-qN variant: the data re-encoded at quality N, made once (reencode reads a copy it
    finished, and refuses a folder it did not make or made from other data). False where a stop came before the copy
    was whole (it stops at once, the part copied kept for the next invocation) or as it ended: the variant is not
    trained."""
    match = JPEG.match(name)
    if match:
        try:
            said = reencode(root, os.path.join(out, f"data-q{match.group(1)}"), int(match.group(1)),
                            len(os.sched_getaffinity(0)), stopping=lambda: runner.stopping)
        except Stopped:
            return False
        if not said.get("existed"):
            print(json.dumps(dict(what="reencode", quality=int(match.group(1)), **said)), flush=True)
    return not runner.stopping


LOG_LINE = "an epoch's JSON line (main_pretrain.py's log.txt)"


def result(name, out, epochs):
    """A variant's row from its folder: kNN top-1 of its last epoch (None until it is finished), wall time."""
    folder, row = os.path.join(out, name), dict(variant=name, knn_top1=None, epochs_done=0)
    log = os.path.join(folder, "log.txt")
    rows = sce.json_lines(log, LOG_LINE) if os.path.lexists(log) else []  # one line for what is not JSON
    for number, line in rows:
        if not isinstance(line, dict) or isinstance(line.get("epoch"), bool) or not isinstance(line.get("epoch"), int):
            raise UserError(f"line {number} of {log} is not {LOG_LINE}: remove {folder} to run {name} again")
    lines = [line for _, line in rows]
    if lines:
        row.update(epochs_done=lines[-1]["epoch"], images_per_s=round(statistics.median(
            sce.finite(line.get("images_per_s")) or 0 for line in lines)))
        if lines[-1]["epoch"] == epochs:
            knn = sce.finite(lines[-1].get("knn_top1"))
            row["knn_top1"] = None if knn is None else round(knn, 2)
    split = stage_split(folder)
    if split:
        row.update({f"{k}_s": round(split[k], 1) for k in ("wall", "compiling", "steps")})
    return row


class Runner:
    """Runs the variants' processes, one at a time, under the time limit; a stop signal goes to the running one."""

    def __init__(self, limit, start):
        self.limit, self.start, self.child, self.stopping = limit, start, None, False
        for s in STOP_SIGNALS:
            signal.signal(s, self.stop)

    def stop(self, *_):
        self.stopping = True
        if self.child and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)  # it saves and stops

    def left(self):
        return self.limit - (time.time() - self.start) if self.limit else float("inf")

    def run(self, argv, log, env):
        """The process's exit code; SIGTERM at the limit, SIGKILL 30 s later."""
        with open(log, "a") as f:
            self.child = subprocess.Popen(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            return self.child.wait(timeout=max(1.0, self.left()) if self.limit else None)
        except subprocess.TimeoutExpired:
            print(f"=> the time limit of {self.limit} s: stopping {os.path.basename(log)[:-4]}", flush=True)
            self.stop()
            try:
                return self.child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.child.kill()
                return self.child.wait()
        finally:
            while self.child.poll() is None:  # a signal interrupted the wait: let it save
                time.sleep(0.2)


def table(rows, out):
    """The results beside each variant's reference, to OUT/results.md and results.json; printed."""
    lines = ["| variant | what | kNN top-1 | against | difference | wall | status |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        top1 = "-" if r["knn_top1"] is None else f"{r['knn_top1']:.2f}"
        diff = "-" if r.get("difference") is None else f"{r['difference']:+.2f}"
        wall = f"{r['wall_s'] / 60:.1f} min" if r.get("wall_s") else "-"
        lines.append(f"| {r['variant']} | {r['what']} | {top1} | {r['against']} | {diff} | {wall} | {r['status']} |")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    print("\n" + text + f"\n(results.md and results.json in {out})", flush=True)


def hold(out, settings):
    """OUT, held by this invocation (the lock file's descriptor, returned), if it holds no proxies of other
    settings."""
    try:
        os.makedirs(out, exist_ok=True)
        lock = open(os.path.join(out, ".lock"), "w")
    except OSError as e:
        raise UserError(f"cannot use {out} as --out ({e.strerror}): pass a folder") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(f"{out} is in use by another proxies.py: wait for it to end, or pass another --out")
    held = read_settings(os.path.join(out, "proxies.json"))
    if held is not None and held != settings:
        raise UserError(f"{out} holds the proxies of {held}, not of {settings}: pass those --data, --epochs and "
                        "--smoke to continue them, or another --out")
    return lock


def read_settings(path):
    """The settings an OUT's proxies were made with (proxies.json), None where there are none yet; a file that
    cannot be read as such is one line."""
    if not os.path.lexists(path):
        return None
    try:
        with open(path) as f:
            held = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path} ({e}): restore it, or remove it if the proxies there are of this "
                        "command's --data, --epochs and --smoke") from None
    if not isinstance(held, dict):
        raise UserError(f"{path} holds no settings (a JSON object): restore it, or remove it if the proxies there are "
                        "of this command's --data, --epochs and --smoke")
    return held


def variant_row(name, runner, rows, commands, root, out, epochs, env):
    """A variant's row, printed as a JSON line: read back when finished, else run unless the time left is less
    than the median wall time of the rows so far."""
    method, flags, against, what = variant(name)
    row = result(name, out, epochs)
    status = "earlier" if row["epochs_done"] == epochs else None
    walls = [r["wall_s"] for r in rows if r["status"] in ("ran", "earlier") and r.get("wall_s")]
    if status:
        pass
    elif runner.stopping or runner.left() <= 0 or (walls and runner.left() < statistics.median(walls)):
        status = "not run"
    elif not reencoded(name, root, out, runner):
        status = "stopped"
    else:
        argv = command(name, commands, out, epochs)
        print(f"=== {name}: {shlex.join(argv)}", flush=True)
        code = runner.run(argv, os.path.join(out, f"{name}.log"), env)
        row = result(name, out, epochs)
        if row["epochs_done"] == epochs:
            status = "ran"
        elif runner.stopping or code in (PREEMPTED_EXIT_CODE, -signal.SIGTERM):
            status = "stopped"
        else:
            status = f"failed (exit {code}, see {name}.log)"
    reference = row if against == name else result(against, out, epochs)
    difference = (None if row["knn_top1"] is None or reference["knn_top1"] is None
                  else round(row["knn_top1"] - reference["knn_top1"], 2))
    row.update(what=what, method=method, flags=" ".join(flags), against=against, difference=difference,
               status=status, epochs=epochs)
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="CIFAR-10: an ImageFolder (train/, val/) or its official files")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "proxies"), help="default: runs/proxies")
    parser.add_argument("--epochs", type=int, help=f"the schedule of each proxy (default: {EPOCHS}; --smoke: 1)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), metavar="NAME",
                        help=f"in this order (default: {' '.join(VARIANTS)}); also jpeg-qN for a quality N")
    parser.add_argument("--time-limit", type=float, default=0, metavar="SECONDS",
                        help="seconds, finite and positive; 0: none (default)")
    parser.add_argument("--smoke", action="store_true", help="reproduce.sh's SMOKE setting, on CPU")
    parser.add_argument("--dry-run", action="store_true", help="print each variant's command, run none")
    args = parser.parse_args(argv)
    start, epochs = time.time(), args.epochs if args.epochs is not None else 1 if args.smoke else EPOCHS
    if not (args.time_limit == 0 or 0 < args.time_limit < float("inf")):  # nan and -1 would stop every variant
        raise UserError(f"--time-limit {args.time_limit} is not a number of seconds: give a positive one, "
                        "or 0 for none")
    if epochs < 1:
        raise UserError(f"--epochs {epochs} trains nothing: give 1 or more")
    for name in args.variants:
        variant(name)  # an unknown name stops before anything runs
    out, settings = os.path.abspath(args.out), dict(data=os.path.realpath(args.data), epochs=epochs, smoke=args.smoke)
    lock = hold(out, settings)  # noqa: F841  (held until this process ends)
    commands, root = row_commands(args.data, out, args.smoke)
    fmt = commands["sce"][commands["sce"].index("--dataset") + 1]
    jpeg = [name for name in args.variants if JPEG.match(name)]
    if jpeg and fmt != "imagefolder":  # here, not after the variants before it have run
        raise UserError(f"{jpeg[0]} re-encodes image files, and {args.data} holds {fmt}'s official files: pass "
                        "train/ and val/ class folders of images (an ImageFolder), or leave the jpeg-qN variants out")
    if args.dry_run:
        for name in args.variants:
            print(f"=== {name}: {shlex.join(command(name, commands, out, epochs))}", flush=True)
        return
    write_file(os.path.join(out, "proxies.json"), json.dumps(settings))
    env = dict(os.environ, SCE_PARENT_PID=str(os.getpid()), PYTHONUNBUFFERED="1")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(out, "compile_cache", "inductor"))
    env.setdefault("TRITON_CACHE_DIR", os.path.join(out, "compile_cache", "triton"))
    runner, rows = Runner(args.time_limit, start), []
    for name in args.variants:
        rows.append(variant_row(name, runner, rows, commands, root, out, epochs=epochs, env=env))
    table(rows, out)
    left = [r["variant"] for r in rows if r["status"] in ("not run", "stopped")]
    if left:
        print(f"=> left: {' '.join(left)}: run the same command again to continue", flush=True)
    failed = any(r["status"].startswith("failed") for r in rows)
    sys.exit(1 if failed else PREEMPTED_EXIT_CODE if left else 0)


def stop_starting(signum, frame):
    """A stop signal before the Runner takes the signals over (the lock, reproduce.sh's data check, proxies.json):
    Stopped where main() is, which ends reproduce.sh on its way out; later ones are ignored, so that runs once."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(signal.Signals(signum).name)


if __name__ == "__main__":
    for s in STOP_SIGNALS:
        signal.signal(s, stop_starting)
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
    except Stopped as e:  # nothing trained yet: the same command starts it
        print(stopped_during_startup(str(e)), flush=True)
        sys.exit(PREEMPTED_EXIT_CODE)
