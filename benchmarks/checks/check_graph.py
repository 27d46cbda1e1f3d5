#!/usr/bin/env python
"""The CUDA-graph steps give the eager steps' numbers (for benchmarks/gpu/check.sh): two copies of the CIFAR-10
model of sce/recipes.py's row (main_pretrain.py --recipe cifar10: ResNet-18 small-input, the paper's BN split in 2, batch 256,
queue 4096), the same views and lr, 8 steps each, one through train_step, one through sce.step.build_step's CUDA
graph (captured after its eager steps), with the online probe (main_pretrain.py's default) and its labels; losses,
the logged terms of eq. 10, the probe's top-1 and the final weights (its head's too) must agree. The lr, the EMA
momentum and lambda change at every step (what the graph reads from device tensors). Eager modules and fp32 with
cuDNN's deterministic kernels, so that only the graph differs (the compiled default path is checked end to end by
main_pretrain.py). Shuffle-BN's order is one fixed permutation in both runs (MomentumModel.shuffle_order): the graph
would draw its own from CUDA's generator in another order. Then the linear probe's step (sce.probe.Step) the same way: a
frozen ResNet-18 trunk (eager) and its head, 8 whole batches, a partial one (eager in both runs) and 3 whole ones, the
lr changing at every step; the losses, the head and the epoch's sums must agree, and a non-finite loss at a replayed
step must be recorded at its index; then the same pair with the trunk torch.compile'd (main_lincls.py's default on a
GPU; --no-compiled-probe skips it).

    python benchmarks/checks/check_graph.py [--steps 8] [--no-compiled-probe]
"""
import argparse
import functools
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
sys.path.insert(0, REPO)
import main_pretrain  # noqa: E402
from sce import losses  # noqa: E402
from sce.builder import build_model, build_trunk  # noqa: E402
from sce.compiling import Log, compile_module  # noqa: E402
from sce.cuda_graph import GRAPH_WARMUP, CudaGraphs, lr_as_tensors  # noqa: E402
from sce.step import OnlineProbe, Training, build_step, train_step  # noqa: E402
from sce.frozen import Frozen  # noqa: E402
from sce.optim import build_optimizer, cosine_lr, set_lr  # noqa: E402
from sce.probe import Head, Probe, Step, make_head  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=8, help=f"steps of each run, > {GRAPH_WARMUP} (default: 8)")
parser.add_argument("--compiled-probe", action=argparse.BooleanOptionalAction, default=True,
                    help="the probe's pair also with a torch.compile'd trunk, main_lincls.py's default on a GPU "
                         "(default: on; a cold compile, ~10-20 s)")
args = parser.parse_args()
device = torch.device("cuda")
torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


RECIPE = main_pretrain.parse_args(["--recipe", "cifar10", "--data", "unused"])
BN_SPLITS = main_pretrain.check_args(RECIPE)
ORDER = torch.randperm(RECIPE.batch_size, generator=torch.Generator().manual_seed(0)).to(device)


def training(lam):
    torch.manual_seed(0)
    criterion = functools.partial(losses.sce_loss, lambda_=lam, tau=RECIPE.tau, tau_m=RECIPE.tau_m)
    model = build_model(RECIPE, criterion, BN_SPLITS).to(device)
    model.shuffle_order = lambda n, dev: ORDER
    optimizer = build_optimizer("sgd", model, RECIPE.lr, RECIPE.weight_decay)
    lr_as_tensors(optimizer, device)  # in both runs: the same lr arithmetic
    probe = OnlineProbe(model.projector[0].in_features, 10, device)  # main_pretrain.py's default, in the step
    return Training(model, model, optimizer, terms=losses.logged_terms(RECIPE), probe=probe)


views = [[torch.randn(RECIPE.batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(10 * s + v)).to(device)
          for v in range(2)] for s in range(args.steps)]
labels = [torch.randint(-1, 10, (RECIPE.batch_size,), generator=torch.Generator().manual_seed(s)).to(device)
          for s in range(args.steps)]  # some -1: images without a label
runs = {}
for name in ("eager", "graph"):
    lam = torch.tensor(0.5, device=device)  # filled in place each step, as main_pretrain.py's schedule does
    t = training(lam)
    step = functools.partial(train_step, t) if name == "eager" else build_step(t, graphs=CudaGraphs(device))
    out = []
    for s in range(args.steps):
        set_lr(t.optimizer, cosine_lr(s, args.steps, RECIPE.lr, 2))
        lam.fill_(0.5 + 0.05 * s)
        result = step(views[s], 0.99 + 0.001 * s, labels[s])
        # a graph's outputs are overwritten by its next replay: read them now
        out.append([float(result.loss)] + [float(result.terms[k]) for k in ("infonce", "ressl", "ceil")]
                   + [float(result.probe_top1)])
    runs[name] = (out, {**{k: v.clone() for k, v in t.model.state_dict().items()},
                        **{f"online_probe.{k}": v.clone() for k, v in t.probe.head.state_dict().items()}})
    if name == "graph" and not step.graphed:
        sys.exit("error: the step was not captured as a CUDA graph (see the warning above)")
(eager, eager_state), (graph, graph_state) = runs["eager"], runs["graph"]
worst = max((eager_state[k].float() - graph_state[k].float()).abs().max().item() for k in eager_state)
print("losses eager:", " ".join(f"{x[0]:.5f}" for x in eager))
print("losses graph:", " ".join(f"{x[0]:.5f}" for x in graph))
print(f"largest weight difference {worst:.2e}")
ok = all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for e, g in zip(eager, graph) for a, b in zip(e, g)) and worst <= 1e-4
print("pretraining:", "ok" if ok else "FAILED: the graph's numbers are not the eager step's")


def probe_run(graphed, poison=None, compiled=False):
    """args.steps whole batches, a partial one (eager in both runs), 3 whole ones (replays after an eager step);
    `poison`: the step whose first image is inf (a non-finite loss, which first_bad must record); compiled: the
    trunk torch.compile'd (padded to a whole batch, as main_lincls.py runs it)."""
    torch.manual_seed(0)
    trunk = build_trunk("resnet18", small_input=True)[0].to(device).eval().requires_grad_(False)
    if compiled:
        compile_module(trunk, "trunk", Log(), fallback=False)
    head = make_head(512, 10, device)
    optimizer = build_optimizer("sgd", head, 30.0, 0.0, exclude_bias_norm=True)
    lr_as_tensors(optimizer, device)  # in both runs: the same lr arithmetic
    probe = Probe(epochs=1, steps=args.steps + 4, per_rank=256, lr=30.0, schedule="step", milestones=(60, 80),
                  warmup_epochs=0, print_freq=10, amp=None)
    model = Head(Frozen(trunk, 512, {}, "resnet18", True, compiled), head, head, optimizer,
                 torch.amp.GradScaler("cuda", enabled=False))
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    step = Step(probe, model, sums, CudaGraphs(device) if graphed else None)
    losses_ = []
    for i in range(args.steps + 4):
        g = torch.Generator().manual_seed(100 + i)
        images = torch.randn(80 if i == args.steps else 256, 3, 32, 32, generator=g)
        images[0] = float("inf") if i == poison else images[0]
        target = torch.randint(0, 10, (len(images),), generator=g).to(device)
        set_lr(optimizer, 3.0 / (i + 1))
        losses_.append(float(step(images.to(device), target, i).detach()))
    if graphed and not step.graphed:
        sys.exit("error: the probe's step was not captured as a CUDA graph (see the warning above)")
    return losses_, torch.cat([head.weight.flatten(), head.bias]), sums.clone(), step.first_bad.clone()


(e_loss, e_head, e_sums, e_bad), (g_loss, g_head, g_sums, g_bad) = probe_run(False), probe_run(True)
probe_worst = (e_head - g_head).abs().max().item()
print("probe losses eager:", " ".join(f"{x:.4f}" for x in e_loss))
print("probe losses graph:", " ".join(f"{x:.4f}" for x in g_loss))
print(f"probe: largest head difference {probe_worst:.2e}, sums {e_sums.tolist()} / {g_sums.tolist()}")
probe_ok = (all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(e_loss, g_loss))
            and e_bad.tolist() == g_bad.tolist() == [-1.0, -1.0]
            and probe_worst <= 1e-4 * max(1.0, e_head.abs().max().item())
            and torch.allclose(e_sums, g_sums, rtol=1e-6, atol=0))
# a non-finite loss at a replayed step (after the partial batch) is recorded at its index, as eagerly
poison = args.steps + 2
(_, _, _, e_bad), (_, _, _, g_bad) = probe_run(False, poison), probe_run(True, poison)
print(f"probe: the first non-finite loss recorded at step {e_bad[0].item():.0f} eagerly, {g_bad[0].item():.0f} in "
      f"the graph (poisoned: {poison})")
probe_ok = probe_ok and e_bad[0].item() == g_bad[0].item() == poison
if args.compiled_probe:  # the compiled trunk inside the capture: main_lincls.py's default on a GPU
    (e_loss, e_head, e_sums, _), (g_loss, g_head, g_sums, _) = probe_run(False, compiled=True), \
        probe_run(True, compiled=True)
    worst = (e_head - g_head).abs().max().item()
    print(f"probe, compiled trunk: largest head difference {worst:.2e}")
    probe_ok = probe_ok and all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(e_loss, g_loss)) \
        and worst <= 1e-4 * max(1.0, e_head.abs().max().item()) and torch.allclose(e_sums, g_sums, rtol=1e-6, atol=0)
print("probe:", "ok" if probe_ok else "FAILED: the probe's graph does not give the eager step's numbers")
print("ok" if ok and probe_ok else "FAILED")
sys.exit(0 if ok and probe_ok else 1)
