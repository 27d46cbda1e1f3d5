#!/usr/bin/env python
"""Chaos run of preemption and crash safety: a 2-rank torchrun pretraining on generated images is
killed at random moments (SIGTERM to torchrun or, as SLURM does, to every process; SIGKILL to every
process, sometimes while a checkpoint is being written), resumed with --resume auto after each kill
until it completes, and its final model (weights, BN buffers, queue) compared with an uninterrupted run.

    python benchmarks/checks/chaos_resume.py --kills 6 --seed 0

Prints one JSON line: kills by signal and mode, launches, checkpoints checked loadable after each
kill, completed, max_abs_diff and equal against the uninterrupted run.
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
sys.path.insert(0, REPO)
from sce import UserError, alive, checkpoint  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--kills", type=int, default=6, help="interruptions before the run may finish (default: 6)")
parser.add_argument("--seed", type=int, default=0, help="seeds the kill moments and signals (default: 0)")
parser.add_argument("--epochs", type=int, default=4, help="(default: 4)")
parser.add_argument("--images", type=int, default=32, help="generated images, batch 8 (default: 32: 4 steps/epoch)")
parser.add_argument("--workers", type=int, default=0, help="data workers per rank (default: 0)")
parser.add_argument("--work-dir", help="keep data and runs here (default: a temporary folder, removed)")
args = parser.parse_args()

MODES = ["SIGTERM torchrun", "SIGTERM all", "SIGKILL all", "SIGKILL all mid-write"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def write_images(root, n, size=20):
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = os.path.join(root, f"class_{i % 4}")
        os.makedirs(folder, exist_ok=True)
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        pixels[::4, :, i % 3] = 255  # some class structure
        Image.fromarray(pixels).save(os.path.join(folder, f"{i}.png"))


def launch(data, out, log):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "main_pretrain.py",
           "--data", data, "--output-dir", out, "--epochs", str(args.epochs), "--arch", "resnet18",
           "--small-input", "--crop-size", "16", "--batch-size", "8", "--queue-size", "32", "--workers",
           str(args.workers), "--proj-hidden-dims", "32", "--proj-dim", "16", "--print-freq", "1",
           "--save-freq", "1", "--keep-checkpoints", "2", "--dist-timeout", "60"]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def descendants(pid):
    """Every live process below `pid` (/proc), so a kill reaches the ranks and their data workers."""
    parent_of = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parent_of[int(name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, ppid in parent_of.items() if ppid == parent]
        out += kids
        todo += kids
    return out


def temp_files(out):
    return {f for f in os.listdir(out) if ".tmp" in f} if os.path.isdir(out) else set()


def final_state(out):
    ckpt = checkpoint.load(os.path.join(out, "checkpoint_last.pth"))
    return ckpt["step"], ckpt["model"]


def steps_done(out):
    last = os.path.join(out, "checkpoint_last.pth")
    return checkpoint.load(last)["step"] if os.path.exists(last) else 0


def progress_lines(log_path):
    with open(log_path) as f:
        return f.read().count("Epoch [")


def main():
    rng = random.Random(args.seed)
    work = args.work_dir or tempfile.mkdtemp(prefix="chaos_")
    os.makedirs(work, exist_ok=True)
    data, ref_out, out = (os.path.join(work, d) for d in ("data", "reference", "chaos"))
    for d in (data, ref_out, out):
        shutil.rmtree(d, ignore_errors=True)
    write_images(data, args.images)
    total_steps = args.epochs * (args.images // 8)
    started = time.time()

    # the uninterrupted run, timed: start-up and seconds per step place the kills
    log_path = os.path.join(work, "reference.log")
    with open(log_path, "w") as log:
        t0, first, last_line = time.time(), None, None
        proc = launch(data, ref_out, log)
        while proc.poll() is None:
            n = progress_lines(log_path)
            if n and first is None:
                first = time.time()
            if n == total_steps and last_line is None:
                last_line = time.time()
            time.sleep(0.01)
        if proc.returncode != 0 or first is None:
            sys.exit(f"error: the uninterrupted run failed: see {log_path}")
        startup_s, step_s = first - t0, ((last_line or time.time()) - first) / max(1, total_steps - 1)
    ref_step, ref_model = final_state(ref_out)

    kills, modes = {"SIGTERM": 0, "SIGKILL": 0}, {m: 0 for m in MODES}
    launches, preempted, loadable_checks, stop_seconds, trace, completed = 0, 0, 0, [], [], False
    while not completed:
        launches += 1
        done = steps_done(out)
        log_path = os.path.join(work, f"chaos_{launches:02d}.log")
        with open(log_path, "w") as log:
            proc = launch(data, out, log)
            if kills["SIGTERM"] + kills["SIGKILL"] >= args.kills:  # enough chaos: let it finish
                completed = proc.wait() == 0
                break
            # the moment: while a checkpoint is written, during start-up, or inside one of the next
            # few steps (before the last, so that every kill interrupts some work)
            mode, stale, remaining = rng.choice(MODES), temp_files(out), total_steps - done
            after = 0 if remaining <= 1 or rng.random() < 0.2 else rng.randint(1, min(4, remaining - 1))
            deadline = time.time() + (rng.uniform(0, startup_s) if after == 0 else 1e9)
            where = "start-up"
            while proc.poll() is None:
                if mode.endswith("mid-write"):
                    if temp_files(out) - stale:
                        where = "checkpoint write"
                        break
                elif after == 0 and time.time() > deadline:
                    break
                elif after and progress_lines(log_path) >= after:
                    time.sleep(rng.uniform(0, step_s))
                    where = f"step {done + after + 1}"
                    break
                time.sleep(0.002)
            if proc.poll() is not None:  # finished (or failed) before its kill
                completed = proc.returncode == 0
                if not completed:
                    sys.exit(f"error: a chaos run failed by itself: see {log_path}")
                break
            pids = [proc.pid] + descendants(proc.pid)
            t0 = time.time()
            if mode == "SIGTERM torchrun":
                proc.send_signal(signal.SIGTERM)  # torchrun forwards it to the ranks
            else:  # SLURM signals every process of the job step
                sig = signal.SIGTERM if mode.startswith("SIGTERM") else signal.SIGKILL
                for pid in reversed(pids):
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
            kills[mode.split()[0]] += 1
            modes[mode] += 1
            try:
                code = proc.wait(120)
            except subprocess.TimeoutExpired:
                sys.exit(f"error: the run did not stop within 120 s after {mode}: see {log_path}")
            while any(alive(p) for p in pids):
                if time.time() - t0 > 120:
                    sys.exit(f"error: ranks still alive 120 s after {mode}: see {log_path}")
                time.sleep(0.05)
            if mode.startswith("SIGTERM"):
                stop_seconds.append(time.time() - t0)
        with open(log_path) as f:
            saved = "=> preempted: saved" in f.read()
        preempted += saved
        last = os.path.join(out, "checkpoint_last.pth")
        if os.path.exists(last):  # whatever the moment of the kill, the last checkpoint must load
            try:
                checkpoint.load(last)
                loadable_checks += 1
            except UserError as e:
                sys.exit(f"error: checkpoint unreadable after a kill: {e}")
        trace.append(f"{mode} at {where}: exit {code}, resume from step {steps_done(out)}"
                     + (" (preempted: saved)" if saved else ""))

    step, model = final_state(out)
    diff = max((model[k].double() - ref_model[k].double()).abs().max().item() for k in ref_model)
    print(json.dumps({
        "kills": kills, "modes": modes, "launches": launches, "completed": completed,
        "preempted_saves": preempted, "checkpoints_loadable_after_kill": loadable_checks,
        "max_stop_s_after_sigterm": round(max(stop_seconds), 1) if stop_seconds else None,
        "final_step": step, "reference_step": ref_step, "same_keys": model.keys() == ref_model.keys(),
        "max_abs_diff": diff,
        "equal": model.keys() == ref_model.keys() and all(torch.equal(model[k], ref_model[k]) for k in ref_model),
        "stale_temp_files": len(temp_files(out)), "seconds": round(time.time() - started, 1), "trace": trace}))
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
