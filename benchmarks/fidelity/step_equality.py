#!/usr/bin/env python
"""The authors' training step and ours, run from the same state and compared tensor by tensor: whether our step
is theirs, to what precision, and what else differs (structure, schedules, views).

    python benchmarks/fidelity/step_equality.py AUTHORS_DIR [--steps 5] [--batch-size 32] [--out runs/step_equality]

AUTHORS_DIR: a checkout of CEA-LIST/SCE (tried at 07cbe63). Their code runs in its own process (both packages are
named `sce`), with the interpreter and pins of benchmarks/fidelity/authors_reference.sh (PYTHON_AUTHORS,
AUTHORS_WHEELS; the same helps, from authors_reference.py, nothing of theirs edited): their CIFAR-10 config
(resnet18_cifar10.yaml) on one CPU device in fp32, their SCEModel built by Hydra (seed 0), trained by their Lightning
Trainer on given batches (two views of N(0, 1) pixels, 32 px) with their optimizer, scheduler and EMA, the shuffle-BN
order of each step given (their single-device shuffle replaced by one that returns it: the only thing set from outside).
Their scheduler is first moved to step 1000 (past the warm-up, so the lr is not 0). A recorder saves, at each step, the
state before it (weights, momentum weights, BN statistics, queue, SGD buffers), the gradients, the loss and the lr.

Ours then runs each step from their state before it (mapped onto our names; their queue transposed), with their
views, the same BN groups (their split BN groups a shuffled batch by position mod 8, ours by consecutive chunks:
the order is rearranged so the groups hold the same images), their lr and EMA momentum, through sce.step's
train_step, which main_pretrain.py runs. Our flags are their config's (OURS_FLAGS): tau 0.1, tau_m 0.05, projector
512 -> 128, queue 4096, split BN of the momentum encoder in 8, SGD lr 0.06 wd 5e-4, EMA 0.99.

Printed (and in OUT/results.json): the structure mapping (names, shapes, what only one side has), per group the
relative difference (step_differences: the gradients' largest per tensor; for what a step changes, over the
group's change) at the first step and the largest over all, the lr / EMA momentum / lambda of a whole 200-epoch run
(195 steps an epoch) from their scheduler and ours, and the views' random parameters (their transforms' settings;
100,000 draws of each side, compared by Kolmogorov-Smirnov and binomial tests).
"""
import argparse
import copy
import json
import math
import os
import subprocess
import sys

import numpy as np
import torch

BENCH = os.path.dirname(os.path.realpath(__file__))
REPO = os.path.dirname(os.path.dirname(BENCH))
START_STEP = 1000  # their schedule's step the compared steps start at (past the 975 of the warm-up)
STEPS_PER_EPOCH = 195  # CIFAR-10's 50,000 images in batches of 256, their config's
OURS_FLAGS = ("--arch resnet18 --small-input --crop-size 32 --lr 0.06 --weight-decay 5e-4 --warmup-epochs 5 "
              "--epochs 200 --ema-momentum 0.99 --ema-schedule constant --proj-hidden-dims 512 --proj-dim 128 "
              "--proj-last-bn none --shuffle-bn --bn-splits 8 --queue-size 4096 --tau 0.1 --tau-m 0.05 --amp none "
              "--data unused").split()
# their modules -> ours; the queue is theirs transposed
PREFIXES = {"trunk.": "encoder.", "projector.": "projector.", "momentum_trunk.": "momentum_encoder.",
            "momentum_projector.": "momentum_projector."}
DRAWS = 100_000


def inputs(steps, batch, size=32, seed=0):
    """The views (view 0 the target's) and shuffle-BN orders of each step, the same for both sides."""
    g = torch.Generator().manual_seed(seed)
    return [dict(views=[torch.randn(batch, 3, size, size, generator=g) for _ in range(2)],
                 order=torch.randperm(batch, generator=g)) for _ in range(steps)]


# ---------------------------------------------------------------- their side (their environment, their `sce`)

def authors_config(authors_dir, overrides):
    from hydra import compose, initialize_config_dir
    folder = os.path.join(authors_dir, "sce/configs/run/pretrain/sce/resnet18")
    with initialize_config_dir(config_dir=folder, version_base=None):
        return compose("resnet18_cifar10", overrides=["~model.initial_temp_m", "~model.warmup_epoch_temp_m",
                                                      "trainer.gpus=0", *overrides])


def authors_side(authors_dir, out, steps, batch):
    """Their model trained `steps` steps on inputs(steps, batch) by their Trainer; the record saved to `out`."""
    sys.path.insert(0, BENCH)
    from authors_reference import install_helps
    install_helps(os.path.abspath(authors_dir))
    import hydra
    import pytorch_lightning as pl

    cfg = authors_config(authors_dir, [f"datamodule.train.global_batch_size={batch}"])
    torch.manual_seed(0)
    model = hydra.utils.instantiate(cfg.model)
    feed = inputs(steps, batch)
    record = dict(structure=[(k, list(v.shape)) for k, v in model.state_dict().items()], steps=[],
                  settings=dict(temp=model.temp, temp_m=model.temp_m, coeff=model.coeff,
                                momentum=model.current_momentum, splits=model.simulate_n_devices))

    def state(trainer):
        buffers = {name: trainer.optimizers[0].state[p]["momentum_buffer"].clone()
                   for name, p in model.named_parameters() if "momentum_buffer" in trainer.optimizers[0].state[p]}
        return dict(state={k: v.clone() for k, v in model.state_dict().items()}, sgd=buffers)

    class Recorder(pl.Callback):
        def on_train_start(self, trainer, module):
            for _ in range(START_STEP):
                trainer.lr_scheduler_configs[0].scheduler.step()

        def on_train_batch_start(self, trainer, module, batch_, i):
            if i:  # the previous step's after: its EMA ran after the callbacks' batch end
                record["steps"][-1]["after"] = state(trainer)
            order = feed[i]["order"]
            module._batch_shuffle_single_device = lambda x: (x[order], torch.argsort(order))
            record["steps"].append(dict(before=state(trainer), lr=trainer.optimizers[0].param_groups[0]["lr"],
                                        momentum=module.current_momentum))

        def on_after_backward(self, trainer, module):
            record["steps"][-1]["grads"] = {n: p.grad.clone() for n, p in module.named_parameters()
                                            if p.grad is not None}

        def on_train_batch_end(self, trainer, module, outputs, batch_, i):
            record["steps"][-1]["loss"] = float(outputs["loss"])

        def on_train_end(self, trainer, module):
            record["steps"][-1]["after"] = state(trainer)

    class Batches(pl.LightningDataModule):  # their schedule reads these two (training_steps_per_epoch)
        train_num_samples, train_global_batch_size = STEPS_PER_EPOCH * 256, 256

        def train_dataloader(self):
            return torch.utils.data.DataLoader([dict(input=f["views"]) for f in feed], batch_size=None)

    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, precision=32, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[Recorder()])
    trainer.fit(model, datamodule=Batches())
    record["schedules"] = authors_schedules(authors_dir, model)
    record["views"] = authors_views(cfg)
    torch.save(record, out)


def authors_schedules(authors_dir, model):
    """lr, EMA momentum and lambda of each step of their 200-epoch run (batch 256), from their own code."""
    import hydra
    cfg = authors_config(authors_dir, [])
    optimizer, scheduler = hydra.utils.instantiate(cfg.model.optimizer, num_steps_per_epoch=STEPS_PER_EPOCH,
                                                   model=model)
    scheduler = scheduler["scheduler"] if isinstance(scheduler, dict) else scheduler
    lr = []
    for _ in range(cfg.trainer.max_epochs * STEPS_PER_EPOCH):
        lr.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    momentum = [model._update_momentum() for _ in range(len(lr))] if model.scheduler_momentum == "constant" else []
    return dict(lr=lr, momentum=momentum, lambda_=[model.coeff] * len(lr))


def authors_views(cfg):
    """Their two views' settings and random parameters, DRAWS of each, as their transforms draw them."""
    import random
    import hydra
    import PIL.Image
    from torchvision.transforms import ColorJitter
    image = PIL.Image.new("RGB", (32, 32))
    views = []
    for view in hydra.utils.instantiate(cfg.datamodule.train.transform).transforms:
        ops = {type(t).__name__: t for t in view.transforms}
        crop, flip = ops["RandomResizedCrop"], ops["RandomHorizontalFlip"]
        draws = dict(crop=np.array([crop.get_params(image, crop.scale, crop.ratio) for _ in range(DRAWS)]))
        settings = dict(scale=list(crop.scale), ratio=list(crop.ratio), flip=flip.p)
        if "RandomColorJitter" in ops:
            jitter = ops["RandomColorJitter"]
            cj = jitter.transforms[0]
            params = [ColorJitter.get_params(cj.brightness, cj.contrast, cj.saturation, cj.hue) for _ in range(DRAWS)]
            draws["jitter"] = np.array([[float(v) for v in p[1:]] for p in params])
            draws["first_op"] = np.array([int(p[0][0]) for p in params])
            settings.update(jitter=jitter.p, jitter_ranges=[list(cj.brightness), list(cj.contrast),
                                                             list(cj.saturation), list(cj.hue)])
        if "RandomGrayscale" in ops:
            settings["gray"] = ops["RandomGrayscale"].p
        if "RandomPILGaussianBlur" in ops:
            blur = ops["RandomPILGaussianBlur"]
            settings.update(blur=blur.p, blur_sigma=list(blur.sigma))
            draws["sigma"] = np.array([random.uniform(*blur.sigma) for _ in range(DRAWS)])
        settings["order"] = [type(t).__name__ for t in view.transforms]
        views.append(dict(settings=settings, draws=draws))
    return views


# ---------------------------------------------------------------- our side

def our_training(flags=OURS_FLAGS, batch=32):
    """Our model, optimizer and Training from main_pretrain.py's flags, as it builds them."""
    sys.path.insert(0, REPO)
    import main_pretrain
    from sce import losses
    from sce.builder import build_model
    from sce.step import Schedules, Training
    from sce.optim import build_optimizer
    args = main_pretrain.parse_args([*flags, "--batch-size", str(batch)])
    bn_splits = main_pretrain.check_args(args)
    torch.manual_seed(0)
    model = build_model(args, losses.criterion(args), bn_splits)
    schedules = Schedules(args, STEPS_PER_EPOCH)
    optimizer = build_optimizer(args.optimizer, model, schedules.base_lr, args.weight_decay, args.sgd_momentum,
                                args.wd_exclude_bias_norm)
    return args, Training(model, model, optimizer)


def mapping(structure, ours):
    """{their name: our name} of every tensor both sides hold (by module, in order, shapes checked), and the
    names only one side has."""
    theirs_by, ours_by = {}, {}
    for name, shape in structure:
        prefix = next((p for p in PREFIXES if name.startswith(p)), name)
        theirs_by.setdefault(PREFIXES.get(prefix, prefix), []).append((name, shape))
    for name, tensor in ours.items():
        prefix = next((p for p in PREFIXES.values() if name.startswith(p)), name)
        ours_by.setdefault(prefix, []).append((name, list(tensor.shape)))
    pairs, only_theirs, only_ours = {}, [], []
    for prefix in sorted(set(theirs_by) | set(ours_by)):
        theirs_list = [t for t in theirs_by.get(prefix, []) if not t[0].endswith("num_batches_tracked")]
        ours_list = [t for t in ours_by.get(prefix, []) if not t[0].endswith("num_batches_tracked")]
        if len(theirs_list) != len(ours_list):
            only_theirs += [n for n, _ in theirs_list]
            only_ours += [n for n, _ in ours_list]
            continue
        for (tn, ts), (on, os_) in zip(theirs_list, ours_list):
            if ts != os_ and (ts != os_[::-1] if on == "queue" else math.prod(ts) != math.prod(os_)):
                raise SystemExit(f"error: {tn} {ts} and {on} {os_} do not match: the structures differ")
            pairs[tn] = on
    only_theirs += [n for n, _ in structure if n.endswith("num_batches_tracked")]
    only_ours += [n for n in ours if n.endswith("num_batches_tracked")]
    return pairs, only_theirs, only_ours


def in_our_names(record, ours):
    """Their record with our names and layouts (the queue transposed); SGD buffers and gradients by parameter."""
    pairs, _, _ = mapping(record["structure"], ours)

    def rename(tensors):
        return {pairs[name]: t.t().contiguous() if pairs[name] == "queue" else t.reshape(ours[pairs[name]].shape)
                for name, t in tensors.items() if name in pairs}
    steps = []
    for s in record["steps"]:
        steps.append(dict(s, before=dict(state=rename(s["before"]["state"]), sgd=rename(s["before"]["sgd"])),
                          after=dict(state=rename(s["after"]["state"]), sgd=rename(s["after"]["sgd"])),
                          grads=rename(s["grads"])))
    return dict(record, steps=steps)


def load_state(training, saved):
    """Weights, buffers, queue and SGD momentum buffers from `saved` (our names)."""
    model, optimizer = training.model, training.optimizer
    model.load_state_dict(saved["state"], strict=False)
    for name, p in model.named_parameters():  # zeros where the saved has none (their first step): SGD's start
        if p in optimizer.state:
            optimizer.state[p]["momentum_buffer"] = saved["sgd"].get(name, torch.zeros_like(p)).clone()


def save_state(training):
    model, optimizer = training.model, training.optimizer
    return dict(state={k: v.clone() for k, v in model.state_dict().items()},
                sgd={n: optimizer.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()
                     if "momentum_buffer" in optimizer.state[p]})


def grouped_order(order, splits):
    """Ours: the chunks of a shuffled batch form the BN groups; theirs: positions mod `splits`. The order whose
    chunk g holds their group g."""
    return order.view(-1, splits).t().reshape(-1)


def our_steps(training, reference, feed, splits, chained=False):
    """Each step of `reference` from its state before (or, chained, from ours after the previous one), through
    train_step with its lr, EMA momentum, views and BN order; our record in the reference's form."""
    from sce.step import train_step
    from sce.optim import set_lr
    model, steps = training.model, []
    for i, (ref, f) in enumerate(zip(reference["steps"], feed)):
        if i == 0 or not chained:
            load_state(training, ref["before"])
        before = save_state(training)
        order = grouped_order(f["order"], splits)
        model.shuffle_order = lambda n, device: order.to(device)
        set_lr(training.optimizer, ref["lr"])
        loss = train_step(training, f["views"], ref["momentum"]).loss
        steps.append(dict(before=before, after=save_state(training), lr=ref["lr"], momentum=ref["momentum"],
                          loss=float(loss), grads={n: p.grad.clone() for n, p in model.named_parameters()
                                                   if p.grad is not None}))
    return dict(reference, steps=steps)


def record_ours(training, feed, lr=0.0075, momentum=0.99, splits=8):
    """A reference made by our own step, chained from our state (the tests' stand-in for theirs)."""
    reference = dict(steps=[dict(lr=lr, momentum=momentum, before=save_state(training))] * len(feed))
    return our_steps(training, reference, feed, splits, chained=True)


# ---------------------------------------------------------------- the comparison

def relative(a, b):
    """max |a - b| / max |b| (0 when both are 0)."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale else (0.0 if diff == 0 else math.inf)


def step_differences(ref, ours):
    """{group: relative difference} of one step: the loss's; the gradients' largest per tensor (relative);
    for what the step changes (weights, EMA, BN statistics, queue), the group's ||ours after - theirs after|| over
    ||theirs after - before|| (L2 over the group: a BN weight near 1 moved by 5e-7 is 4 float32 steps, each
    step 25% of that change, which a per-tensor ratio would report as such)."""
    out = {"loss": abs(ours["loss"] - ref["loss"]) / abs(ref["loss"])}
    out["gradients"] = max(relative(ours["grads"][n], g) for n, g in ref["grads"].items())
    sums = {}  # group: [squared difference, squared change]
    for name, after in ref["after"]["state"].items():
        if name.endswith("num_batches_tracked") or name == "queue_ptr":
            continue
        group = ("BN statistics (their change)" if name.endswith(("running_mean", "running_var")) else
                 "queue (its change)" if name == "queue" else
                 "EMA (its change)" if name.startswith("momentum_") else "weights (SGD's change)")
        total = sums.setdefault(group, [0.0, 0.0])
        total[0] += (ours["after"]["state"][name].double() - after.double()).square().sum().item()
        total[1] += (after.double() - ref["before"]["state"][name].double()).square().sum().item()
    out.update({g: math.sqrt(d / c) if c else (0.0 if d == 0 else math.inf) for g, (d, c) in sums.items()})
    out["SGD buffers"] = max((relative(ours["after"]["sgd"][n], b) for n, b in ref["after"]["sgd"].items()),
                             default=0.0)
    out["queue pointer"] = float(ours["after"]["state"]["queue_ptr"].item() != ref["after"]["state"]["queue_ptr"]
                                 .item())
    return out


def compare(reference, ours):
    """Per group: the first step's largest relative difference and the largest over all steps."""
    per_step = [step_differences(r, o) for r, o in zip(reference["steps"], ours["steps"])]
    return {group: dict(first=per_step[0][group], all=max(s[group] for s in per_step)) for group in per_step[0]}


def schedule_differences(theirs, args):
    """Their lr / momentum / lambda arrays against ours (sce.step.Schedules at batch 256)."""
    from sce.step import Schedules
    args = copy.copy(args)
    args.batch_size = 256
    s = Schedules(args, STEPS_PER_EPOCH)
    ours = dict(lr=[s.lr_at(i) for i in range(len(theirs["lr"]))], momentum=[s.momentum_at(i) for i in
                                                                              range(len(theirs["lr"]))],
                lambda_=[s.lambda_at(i) for i in range(len(theirs["lr"]))])
    out = {}
    for name, values in theirs.items():
        if not values:
            continue
        diff = np.abs(np.array(ours[name]) - np.array(values))
        warmup = 5 * STEPS_PER_EPOCH
        out[name] = dict(steps=len(values), max_abs_warmup=float(diff[:warmup].max()),
                         max_abs_after_warmup=float(diff[warmup:].max()),
                         first_steps_theirs=[round(v, 8) for v in values[:3]],
                         first_steps_ours=[round(v, 8) for v in ours[name][:3]],
                         at_warmup_end=[values[5 * STEPS_PER_EPOCH - 1], ours[name][5 * STEPS_PER_EPOCH - 1]])
    return out


def view_differences(theirs, args):
    """Each view's settings side by side and the p-values of the draws' distributions (KS; binomial for rates)."""
    from scipy import stats
    sys.path.insert(0, REPO)
    from sce.data import views as V
    out = []
    for v, (spec, their) in enumerate(zip(V.view_specs(args), theirs)):
        rows = V.draw(spec, 0, 0, np.arange(DRAWS), v, height=np.full(DRAWS, 32), width=np.full(DRAWS, 32)).numpy()
        p_jitter, jitter, p_gray, p_blur, _ = V.AUGMENTATIONS[spec.aug]
        ours_settings = dict(aug=spec.aug, scale=list(spec.scale), ratio=list(V.RRC_RATIO), flip=0.5,
                             jitter=p_jitter, jitter_ranges=V.jitter_ranges(jitter) if jitter else None,
                             gray=p_gray, blur=p_blur, blur_sigma=list(V.BLUR_SIGMA))
        crop = their["draws"]["crop"]  # (top, left, h, w)
        tests = {"crop area": stats.ks_2samp(rows[:, 2] * rows[:, 3], crop[:, 2] * crop[:, 3]).pvalue,
                 "crop aspect": stats.ks_2samp(rows[:, 3] / rows[:, 2], crop[:, 3] / crop[:, 2]).pvalue,
                 "crop top": stats.ks_2samp(rows[:, 0], crop[:, 0]).pvalue,
                 "flip rate": stats.binomtest(int(rows[:, 4].sum()), DRAWS, their["settings"]["flip"]).pvalue}
        if "jitter" in their["draws"]:
            applied = rows[:, 5] > 0
            tests["jitter rate"] = stats.binomtest(int(applied.sum()), DRAWS, their["settings"]["jitter"]).pvalue
            for k, name in enumerate(["brightness", "contrast", "saturation", "hue"]):
                tests[f"{name} factor"] = stats.ks_2samp(rows[applied, 10 + k], their["draws"]["jitter"][:, k]).pvalue
            first = np.bincount(rows[applied, 6].astype(int), minlength=4)
            tests["jitter order (first op)"] = stats.chisquare(first, np.bincount(their["draws"]["first_op"],
                                                                                minlength=4) * first.sum() / DRAWS
                                                               ).pvalue
        if "gray" in their["settings"]:
            tests["gray rate"] = stats.binomtest(int(rows[:, 14].sum()), DRAWS, their["settings"]["gray"]).pvalue
        if "sigma" in their["draws"]:
            blurred = rows[:, 15] > 0
            tests["blur rate"] = stats.binomtest(int(blurred.sum()), DRAWS, their["settings"]["blur"]).pvalue
            tests["blur sigma"] = stats.ks_2samp(rows[blurred, 15], their["draws"]["sigma"]).pvalue
        out.append(dict(view=v, ours=ours_settings, theirs=their["settings"],
                        p_values={k: round(float(p), 4) for k, p in tests.items()}))
    return out


def summary(names):
    """'42 num_batches_tracked, projector.0.bias': names counted by their last part where several share it."""
    counts = {}
    for name in names:
        counts.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    return ", ".join(f"{len(v)} {k}" if len(v) > 1 else v[0] for k, v in counts.items()) or "none"


def report(results):
    """The table, then one JSON line."""
    m = results["mapping"]
    print(f"\nstructure: {m['pairs']} tensors paired by module and order, shapes equal (the queue transposed); "
          f"only theirs: {summary(m['only_theirs'])}; only ours: {summary(m['only_ours'])}")
    print(f"\n| group | step 1 | largest over {results['steps']} steps (each from their state) |\n|---|---|---|")
    for group, d in results["steps_compared"].items():
        print(f"| {group} | {d['first']:.2g} | {d['all']:.2g} |")
    for name, d in results.get("schedules", {}).items():
        print(f"{name}: {d['steps']} steps, largest difference {d['max_abs_warmup']:.3g} in the warm-up, "
              f"{d['max_abs_after_warmup']:.3g} after it; first steps theirs {d['first_steps_theirs']} ours "
              f"{d['first_steps_ours']}")
    for v in results.get("views", []):
        low = min(v["p_values"].items(), key=lambda kv: kv[1])
        print(f"view {v['view']} ({v['ours']['aug']}): {len(v['p_values'])} distributions, lowest p {low[1]} "
              f"({low[0]})")
    print(json.dumps(results))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("authors_dir", help="a checkout of CEA-LIST/SCE")
    parser.add_argument("--steps", type=int, default=5, help="steps compared, each from their state (default: 5)")
    parser.add_argument("--batch-size", type=int, default=32, help="images a step, a multiple of 8 (default: 32)")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "step_equality"), help="where the records go")
    parser.add_argument("--side", choices=["authors"], help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 16 or args.batch_size % 8 or 4096 % args.batch_size:
        raise SystemExit("error: --steps must be at least 1 and --batch-size a multiple of 8 from 16 that divides "
                         "the queue of 4096")
    os.makedirs(args.out, exist_ok=True)
    record_path = os.path.join(args.out, "authors.pt")
    if args.side == "authors":
        return authors_side(args.authors_dir, record_path, args.steps, args.batch_size)
    env = dict(os.environ)
    wheels = env.get("AUTHORS_WHEELS")
    if wheels:  # their pins unpacked beside, on their process's path only (authors_reference.sh's way)
        site = os.path.join(args.out, "authors_site")
        subprocess.run([sys.executable, os.path.join(BENCH, "authors_reference.py"), "unpack", wheels, site],
                       check=True)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    python = env.get("PYTHON_AUTHORS", sys.executable)
    child = subprocess.run([python, os.path.abspath(__file__), args.authors_dir, "--side", "authors", "--steps",
                            str(args.steps), "--batch-size", str(args.batch_size), "--out", args.out], env=env)
    if child.returncode:
        raise SystemExit(f"error: their side failed (exit {child.returncode}): see its output above")
    record = torch.load(record_path, weights_only=False)  # written by the child above
    our_args, training = our_training(batch=args.batch_size)
    pairs, only_theirs, only_ours = mapping(record["structure"], training.model.state_dict())
    reference = in_our_names(record, training.model.state_dict())
    ours = our_steps(training, reference, inputs(args.steps, args.batch_size), record["settings"]["splits"])
    results = dict(steps=args.steps, batch_size=args.batch_size, settings=record["settings"],
                   mapping=dict(pairs=len(pairs), only_theirs=only_theirs, only_ours=only_ours),
                   losses=dict(theirs=[s["loss"] for s in reference["steps"]], ours=[s["loss"] for s in ours["steps"]]),
                   steps_compared=compare(reference, ours),
                   schedules=schedule_differences(record["schedules"], our_args),
                   views=view_differences(record["views"], our_args), torch=torch.__version__)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    report(results)


if __name__ == "__main__":
    main()
