#!/usr/bin/env python
"""Exit non-zero unless a main_pretrain.py output dir shows a run that trained (for benchmarks/gpu/check.sh):
every epoch of log.txt has a finite loss and no skipped step (--max-skipped), the online trunk turned
away from the momentum one, and the checkpoint is at the expected position.

    python benchmarks/checks/check_run.py OUTPUT_DIR [--epoch E] [--step S] [--max-skipped N] [--knn RESULTS_JSON]

--knn: the kNN top-1 of main_lincls.py --knn on the checkpoint (its results_knn.json) must be the kNN monitor's
of the last epoch (the same reader and classifier; compiled trunks may differ by a few images).
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
from sce import checkpoint  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("output_dir")
parser.add_argument("--epoch", type=int, help="completed epochs the checkpoint must hold")
parser.add_argument("--step", type=int, help="completed steps the checkpoint must hold")
parser.add_argument("--max-skipped", type=int, default=0, help="skipped steps allowed in an epoch (default: 0)")
parser.add_argument("--knn", metavar="RESULTS_JSON", help="main_lincls.py --knn's results on the checkpoint")
args = parser.parse_args()

with open(os.path.join(args.output_dir, "log.txt")) as f:
    epochs = [json.loads(line) for line in f]
ckpt = checkpoint.load(os.path.join(args.output_dir, "checkpoint_last.pth"))
problems = [f"epoch {e['epoch']}: loss {e['loss']}, {e.get('skipped_steps')} skipped steps" for e in epochs
            if not math.isfinite(e["loss"]) or e.get("skipped_steps", 0) > args.max_skipped]
online, momentum = (checkpoint.trunk_state_dict(ckpt, encoder=e)["conv1.weight"].double().flatten()
                    for e in ("online", "momentum"))
if (online / online.norm() - momentum / momentum.norm()).norm() <= 1e-6:  # weight decay alone only rescales
    problems.append("the online trunk points as the momentum one: it did not learn")
if args.knn:
    with open(args.knn) as f:
        lincls = json.load(f)["acc1"]
    monitor = epochs[-1].get("knn_top1")
    if monitor is None or abs(monitor - lincls) > 0.25:
        problems.append(f"kNN top-1 of the monitor {monitor}, of main_lincls.py --knn {lincls:.2f}")
for key, want in (("epoch", args.epoch), ("step", args.step)):
    if want is not None and ckpt[key] != want:
        problems.append(f"checkpoint {key} {ckpt[key]}, expected {want}")
print(f"{args.output_dir}: epoch {ckpt['epoch']} step {ckpt['step']}, losses "
      + " ".join(f"{e['loss']:.4f}" for e in epochs) + (f"; PROBLEMS: {'; '.join(problems)}" if problems else ": ok"))
sys.exit(1 if problems else 0)
