"""How a pretraining run continues: the checkpoint it resumes from (the same on every rank), what a checkpoint
holds, and loading it back exactly."""
import json
import os
import random
from typing import NamedTuple

import torch

from sce import UserError, checkpoint
from sce import distributed as du
from sce.losses import METHODS
from sce.recipes import as_typed
from sce.optim import excludes_bias_norm, load_optimizer_state

# settings a resumed run must share with its checkpoint: the model's shape, the method and its own settings (its
# record's `resume`: sce.losses.METHODS), and what the optimizer's saved state would silently override (weight
# decay, momentum); every other setting (--lr, --epochs, the EMA, the views, logging) comes from the new command line
RESUME_MUST_MATCH = ["arch", "small_input", "proj_hidden_dims", "proj_dim", "proj_last_bn", "optimizer",
                     "pred_hidden_dims", "queue_size", "symmetric", "method", "weight_decay", "sgd_momentum",
                     "wd_exclude_bias_norm", "split_bn"]


def find_resume(args):
    last = os.path.join(args.output_dir, "checkpoint_last.pth")
    if args.resume == "none":
        if os.path.exists(last):
            raise UserError(f"{last} exists and --resume none would overwrite it: use --resume auto "
                            "or another --output-dir")
        return None
    if args.resume == "auto":
        return last if os.path.exists(last) else None
    # another run's checkpoint (not one of this folder's): its saves would replace the folder's run
    if os.path.exists(last) and os.path.dirname(os.path.realpath(args.resume)) != os.path.realpath(args.output_dir):
        raise UserError(f"{last} exists and resuming {args.resume} there would overwrite it: use --resume auto "
                        "to continue the run in that folder, or another --output-dir")
    return args.resume


def check_ranks_agree(args):
    """Nodes started with different commands, or seeing different output dirs, stop here: each
    rank would otherwise train its own way or resume from another step."""
    path = find_resume(args)
    stat = os.stat(path) if path and os.path.exists(path) else None
    seen = (f"{path} ({stat.st_size} bytes, mtime {int(stat.st_mtime)})" if stat else
            f"{path} (missing)" if path else "none")
    mine = {"--batch-size": args.batch_size, "the checkpoint to resume": seen}
    everyone = du.all_gather_object(mine)
    for key in mine:
        values = [e[key] for e in everyone]
        if len(set(values)) > 1:
            raise UserError(f"ranks disagree on {key} ({', '.join(f'rank {r}: {v}' for r, v in enumerate(values))}): "
                            "start every node with the same command and an --output-dir they all share")


def run_state(model, optimizer, scaler, args, *, epoch, step_in_epoch, global_step, data=None, epoch_stats=None,
              epoch_sums=None, probe=None):
    """Everything a run needs to continue exactly: weights, queue, optimizer, scaler, RNGs, data position
    (and `data`, the dataset's num_images and data_id (sce.data.fingerprint), which a mid-epoch position
    depends on);
    epoch_stats: the log.txt line of the epoch just ended, written again by a rerun that lacks it;
    epoch_sums: mid-epoch, the sums of the steps done (sce.epoch.Epoch.sums), which its line will average;
    probe: the online probe (sce.step.OnlineProbe), its head and optimizer."""
    return {"kind": "pretrain", "epoch": epoch, "step": global_step, "step_in_epoch": step_in_epoch,
            **(data or {}), "epoch_stats": epoch_stats, "epoch_sums": epoch_sums, "args": vars(args),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict() if scaler else None,
            "online_probe": probe.state_dict() if probe else None,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}}


def effective(settings, key):
    """A saved or parsed setting as the run applies it (--wd-exclude-bias-norm unset: the optimizer's default)."""
    if key == "wd_exclude_bias_norm":
        return excludes_bias_norm(settings.get("optimizer"), settings.get(key))
    return settings.get(key)


def check_mid_epoch(path, ckpt, args, data):
    """Steps done in the epoch are skipped from the order of (seed, epoch, dataset, batch): the same order
    is needed, else images repeat or are skipped. data: the dataset's num_images, data_id and data_order."""
    num_images, saved = data["num_images"], ckpt["args"]
    if saved.get("batch_size") != args.batch_size:
        raise UserError(f"{path} stopped mid-epoch with --batch-size {saved.get('batch_size')}: resume it with the "
                        f"same value (not {args.batch_size}), or from an epoch-end checkpoint")
    if saved.get("seed") != args.seed:
        raise UserError(f"{path} stopped mid-epoch with --seed {saved.get('seed')}: resume it with the same value "
                        f"(not {args.seed}), or from an epoch-end checkpoint")
    if ckpt.get("data_order") != data["data_order"]:
        raise UserError(f"{path} stopped mid-epoch under an earlier version, which drew the epoch's order otherwise: "
                        "resume from an epoch-end checkpoint (checkpoint_NNNN.pth), or with the version that wrote it")
    if ckpt["num_images"] != num_images:
        raise UserError(f"{path} stopped mid-epoch on {ckpt['num_images']} images: resume it on the same data "
                        f"(not {num_images} images), or from an epoch-end checkpoint")
    if ckpt["data_id"] != data["data_id"]:
        raise UserError(f"{path} stopped mid-epoch on other data (other files, labels or pixels): resume it on the "
                        "data it ran on, or from an epoch-end checkpoint")


class Resumed(NamedTuple):
    """Where a run continues: what resume read from its checkpoint (a fresh run: epoch 0, step 0, None, None)."""
    epoch: int  # the epochs done
    step_in_epoch: int  # the steps done of the next one
    epoch_stats: dict = None  # the last epoch's line of log.txt (run_state's epoch_stats), at an epoch's end
    epoch_sums: dict = None  # the epoch's sums so far (sce.epoch.Epoch.sums), within an epoch


def resume(args, model, optimizer, scaler, *, rank, data=None, probe=None):
    """Load the checkpoint --resume points at, if any, into the model, optimizer and scaler: a Resumed. An --epochs
    below the checkpoint's is refused. data: the dataset's num_images, data_id and data_order (check_mid_epoch);
    probe: the online probe, restored where the checkpoint holds one that learned this data's classes (else it starts
    afresh, said)."""
    path = find_resume(args)
    if not path:
        return Resumed(0, 0)
    ckpt = checkpoint.load(path)
    if ckpt.get("kind") != "pretrain":
        raise UserError(f"{path} is not a main_pretrain.py checkpoint")
    checkpoint.require(path, ckpt, ("args", "model", "optimizer", "rng", "epoch", "step_in_epoch", "epoch_stats",
                                    "epoch_sums"))
    saved, now = ckpt["args"], vars(args)
    for key in RESUME_MUST_MATCH + list(METHODS[args.method].resume):
        was, is_now = effective(saved, key), effective(now, key)
        if key == "split_bn" and None in (was, is_now):  # split BN on one side only: --shuffle-bn, ranks decide
            continue
        if was != is_now:
            flag = "--" + key.rstrip("_").replace("_", "-")
            raise UserError(f"{path} was trained with {flag} {as_typed(was)}, not {as_typed(is_now)}: pass the same "
                            "value or another --output-dir")
    if ckpt.get("step_in_epoch"):
        check_mid_epoch(path, ckpt, args, data)
    model.load_state_dict(ckpt["model"])
    load_optimizer_state(optimizer, ckpt["optimizer"])
    if scaler and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    resume_online_probe(path, ckpt.get("online_probe"), probe, rank)
    torch.set_rng_state(ckpt["rng"]["torch"])
    random.setstate(ckpt["rng"]["python"])
    epoch, step = ckpt["epoch"], ckpt["step_in_epoch"]
    checkpoint.refuse_fewer_epochs(path, epoch, step, args.epochs)
    if rank == 0:
        print(f"=> resuming from {path}: epoch {epoch}, step {step} of the epoch", flush=True)
    saved_gpus, gpus = len(ckpt["rng"]["cuda"]), torch.cuda.device_count() if torch.cuda.is_available() else 0
    if saved_gpus == gpus > 0:
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    elif saved_gpus != gpus and rank == 0:  # one state per GPU: 8 do not map onto 4
        print(f"=> note: checkpoint saved the CUDA random state of {saved_gpus} GPUs, this run has "
              f"{gpus or 'none'}: continuing, but not bit-exact", flush=True)
    return Resumed(epoch, step, ckpt["epoch_stats"], ckpt["epoch_sums"])


def resume_online_probe(path, saved, probe, rank):
    """The online probe `probe` continues the checkpoint's (`saved`, its state, or None) where that one learned this
    data's classes; else it starts afresh, said."""
    if not probe:
        return
    other = probe.other_classes(saved.get("classes")) if saved else None
    if saved and not other:
        probe.load_state_dict(saved)
    elif rank == 0 and saved:
        print(f"=> {path}'s online probe learned other classes than this data's ({other}): it starts afresh",
              flush=True)
    elif rank == 0:
        print(f"=> {path} holds no online probe: it starts afresh", flush=True)
