#!/usr/bin/env python
"""Pretraining throughput, side by side in one run: the data loader alone (CPU vs GPU augmentation),
the training step alone (synthetic device tensors), and both together, all through the code
main_pretrain.py runs (sce.data.pretrain_batches; sce.epoch.one_step: the schedules, sce.step.build_step's step
and the device-side sums of each step).

    python benchmarks/speed/bench_pretrain.py --arch resnet50 --batch-size 256 --amp bf16 --channels-last   # one GPU
    # the per-image CPU cost
    python benchmarks/speed/bench_pretrain.py --device cpu --workers 0 --skip-train --images 64 --batch-size 16
    python benchmarks/speed/bench_pretrain.py --recipe cifar10 --amp bf16 --channels-last --preload --cuda-graph \
        --skip-data                                                          # the paper's CIFAR-10 setting

Beside the step it times two plain torchvision models of the same arch (plain BN, the same batch,
precision, memory format and compile): `supervised_reference`, a forward + backward + SGD step on a
cross-entropy, and `ideal_asymmetric`, that plus a no-grad forward of a second model, which an
asymmetric SCE step cannot beat; the step's rows give their ratio to each.

Without --data it writes ImageNet-like photos itself (crops of scikit-learn's two sample photos,
500x375 JPEG, quality 98, ~100 KB). Prints one JSON line per measurement, then a table.
"""
import argparse
import itertools
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "speed"))
from bench_common import count_host_syncs, environment, no_compile_since, sync, time_calls  # noqa: E402
from photos import write_photos  # noqa: E402
import main_pretrain  # noqa: E402
from sce import cli, compiling, data, epoch, losses  # noqa: E402
from sce.builder import build_model, build_trunk  # noqa: E402
from sce.compiling import CompiledStep, compile_model, compile_module  # noqa: E402
from sce.cuda_graph import GRAPH_WARMUP, CudaGraphs, Graphed  # noqa: E402
from sce.optim import build_optimizer  # noqa: E402
from sce.data import Batch  # noqa: E402
from sce.step import OnlineProbe, Schedules, Training, build_step  # noqa: E402
from sce.tally import Tally  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--data", metavar="DIR",
                    help="an ImageFolder to read (default: photos written to a temporary folder)")
parser.add_argument("--images", type=int, default=512, help="photos written when --data is not given (default: 512)")
parser.add_argument("--arch", default="resnet50", help="(default: resnet50)")
parser.add_argument("--small-input", action="store_true", help="3x3 stride-1 conv1, no max-pool")
parser.add_argument("--batch-size", type=int, default=256, help="(default: 256)")
parser.add_argument("--crop-size", type=int, default=224, help="(default: 224)")
parser.add_argument("--queue-size", type=int, default=65536, help="(default: 65536)")
parser.add_argument("--amp", default="none", choices=["none", "fp16", "bf16"], help="(default: none)")
parser.add_argument("--channels-last", action="store_true")
parser.add_argument("--compile", action="store_true",
                    help="torch.compile the encoders, the heads and the device augmentation (main_pretrain.py's "
                         "default on CUDA)")
parser.add_argument("--compile-blocks", action="store_true",
                    help="with --compile: each residual block compiled apart (sce.compiling.compile_model's blocks), "
                         "against main_pretrain.py's whole trunks: the cold compile's first_step_s tells")
parser.add_argument("--symmetric", action="store_true", help="symmetric loss (both global views are targets)")
parser.add_argument("--shuffle-bn", action="store_true", help="shuffle-BN, with split BN of --bn-splits chunks")
parser.add_argument("--bn-splits", type=int, default=8, help="split BN chunks under --shuffle-bn (default: 8)")
parser.add_argument("--split-bn", default="momentum", choices=["momentum", "all"],
                    help="which BN layers --bn-splits splits, as main_pretrain.py's (default: momentum)")
parser.add_argument("--recipe", metavar="NAME",
                    help="the model of sce/recipes.py's row NAME (e.g. cifar10; its arch, stem, crop, batch, "
                         "queue, BN and projector) as the defaults of those flags; flags given still win")
parser.add_argument("--proj-hidden-dims", type=int, nargs="*", default=[2048, 2048], help="(default: 2048 2048)")
parser.add_argument("--proj-dim", type=int, default=256, help="(default: 256)")
parser.add_argument("--proj-last-bn", default="affine", choices=["none", "affine", "no-affine"],
                    help="(default: affine)")
parser.add_argument("--cuda-graph", action="store_true",
                    help="replay the step from a CUDA graph (sce.cuda_graph.Graphed)")
parser.add_argument("--preload", action="store_true",
                    help="also end to end from images preloaded on the device (sce.data's preload route): --data "
                         "decoded once, else random images of --image-size")
parser.add_argument("--image-size", type=int, help="side of the random preloaded images (default: --crop-size)")
parser.add_argument("--augment", nargs="+", default=["cpu", "gpu", "decode"], choices=["cpu", "gpu", "decode"],
                    help="pipelines to measure: cpu (all in the workers), gpu (photometric ops on the device), decode "
                         "(JPEGs decoded, cropped and resized on the device too: the workers read bytes, header and "
                         "parameters) (default: cpu gpu decode)")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="(default: cuda if present)")
parser.add_argument("--workers", type=int, default=cli.default_workers(),
                    help="loader processes; 0 measures one core in this process (default: main_pretrain.py's, "
                         f"cores - 1 up to 16, here {cli.default_workers()})")
parser.add_argument("--e2e-workers", type=int, nargs="*", default=[], metavar="N",
                    help="end to end with --augment gpu and decode again with N loader processes each: does the loader "
                         "compete with the training process for the cores?")
parser.add_argument("--steps", type=int, default=20, help="timed steps or batches per measurement (default: 20)")
parser.add_argument("--warmup", type=int, default=3,
                    help="untimed steps before each measurement; with --cuda-graph at least the eager steps before "
                         f"the capture + 1 ({GRAPH_WARMUP + 1}), as main_pretrain.py takes them (default: 3)")
parser.add_argument("--skip-train", action="store_true", help="measure the data loader only")
parser.add_argument("--skip-data", action="store_true", help="measure the training step only")
parser.add_argument("--profile", action="store_true", help="print the top kernels of the device-side augmentation")
parser.add_argument("--online-probe", action="store_true",
                    help="also the step with main_pretrain.py's online probe (its default), side by side: the probe's "
                         "cost")
# what a recipe sets here: the model's shape and its BN
RECIPE_KEYS = ("arch", "small_input", "crop_size", "batch_size", "queue_size", "symmetric", "shuffle_bn", "bn_splits",
               "split_bn", "proj_hidden_dims", "proj_dim", "proj_last_bn")
args = parser.parse_args()
if args.recipe:  # main_pretrain.py's settings of the row (sce/recipes.py), then the flags again
    line = main_pretrain.parse_args(["--recipe", args.recipe, "--data", "unread"])
    parser.set_defaults(**{key: getattr(line, key) for key in RECIPE_KEYS})
    args = parser.parse_args()
device = torch.device(args.device)
if args.cuda_graph and device.type != "cuda":
    parser.error("--cuda-graph needs a CUDA device")
if args.cuda_graph:  # the capture happens in the untimed steps, after main_pretrain.py's eager ones
    args.warmup = max(args.warmup, GRAPH_WARMUP + 1)
torch.backends.cudnn.benchmark = True  # as main_pretrain.py
amp_dtype = cli.AMP[args.amp]
ENV = environment(device)
SETTING = dict(arch=args.arch, batch=args.batch_size, crop=args.crop_size, amp=args.amp,
               channels_last=args.channels_last, compile=args.compile and ("blocks" if args.compile_blocks else True),
               symmetric=args.symmetric,
               bn_splits=args.bn_splits if args.shuffle_bn else 1, split_bn=args.split_bn if args.shuffle_bn else None,
               cuda_graph=args.cuda_graph)
MEMORY_FORMAT = torch.channels_last if args.channels_last else torch.contiguous_format
REFERENCE = {}  # images/s of supervised_reference and ideal_asymmetric
SPECS = [data.ViewSpec("weak", args.crop_size), data.ViewSpec("strong", args.crop_size)]  # the defaults' views
COMPILES = compiling.Log()
results = []


def report(**fields):
    results.append(fields)
    print(json.dumps({**fields, **ENV}), flush=True)


class Cycle(torch.utils.data.Dataset):
    """A dataset read round and round, so a few hundred photos feed any number of batches."""

    def __init__(self, dataset, length):
        self.dataset, self.length = dataset, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return self.dataset[i % len(self.dataset)]

    def path(self, i):
        return self.dataset.path(i % len(self.dataset))


def make_batches(dataset, augment, batches, workers=None, compile=None):
    """main_pretrain.py's batches (sce.data.pretrain_batches) over `batches` batches of `dataset` (cycled), by route
    `augment`."""
    cycled = Cycle(dataset, batches * args.batch_size)
    return data.pretrain_batches(cycled, SPECS, data.ResumableSampler(len(cycled), args.batch_size), device, augment,
                                 workers=args.workers if workers is None else workers, dtype=amp_dtype,
                                 channels_last=args.channels_last, compile=args.compile if compile is None else compile,
                                 compiles=COMPILES)


def build_training(online_probe=False):
    """(Training, step function) as main_pretrain.py builds them (sce.builder.build_model, sce.losses.criterion and
    the optimizer of main_pretrain.py's defaults: SCE at its temperatures and lambda, --lr scaled by the batch, its
    warmup and cosine, the EMA's schedule), with this benchmark's model and step flags: step(views, _) runs
    sce.epoch.one_step, what main_pretrain.py runs each step (the schedules, train_step or its CUDA graph, the
    device-side sums)."""
    torch.manual_seed(0)
    queue = args.queue_size - args.queue_size % (args.batch_size * (2 if args.symmetric else 1))
    flags = main_pretrain.parse_args(["--data", "unread"])  # its defaults: the method's, the lr's, the EMA's
    vars(flags).update(vars(args), queue_size=queue)  # the model's shape and the step's settings: this benchmark's
    lam = losses.Lambda(flags, device)
    model = build_model(flags, losses.criterion(flags, lam), args.bn_splits if args.shuffle_bn else 1).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    schedules = Schedules(flags, 100)  # 100 steps an epoch: any number does
    optimizer = build_optimizer(flags.optimizer, model, schedules.base_lr, flags.weight_decay, flags.sgd_momentum,
                                flags.wd_exclude_bias_norm)
    if args.compile:
        compile_model(model, COMPILES, blocks=args.compile_blocks)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    # CIFAR-10's 10 classes, the setting gpu/bench.sh measures it in (ImageNet's 1000: a 100x larger head)
    probe = OnlineProbe(model.projector[0].in_features, 10, device) if online_probe else None
    training = Training(model, model, optimizer, scaler, amp_dtype, terms=losses.logged_terms(flags), probe=probe)
    step = build_step(training, args.compile, CudaGraphs(device) if args.cuda_graph else None, COMPILES)
    return training, Scheduled(epoch.Run(args=flags, training=training, step=step, schedules=schedules, lam=lam,
                                         batches=None, steps_per_epoch=100, device=device, tensorboard=None,
                                         preemption=None, first_step=0, checkpoints=None, compiles=COMPILES))


class Scheduled:
    """step(views, _) as main_pretrain.py's loop runs it, global step after global step: sce.epoch.one_step, that is
    the schedules, build_step's step and the device-side sums."""

    def __init__(self, run):
        self.run, self.steps = run, itertools.count()
        self.tally = Tally(device, torch.zeros((), device=device))

    def __call__(self, views, _momentum):
        epoch.one_step(self.run, next(self.steps), views, self.tally)

    @property
    def graph(self):
        """The step's CUDA graph (sce.cuda_graph.Graphed), or None."""
        return self.run.step if isinstance(self.run.step, Graphed) else None

    @property
    def graphed(self):
        return self.graph is not None and self.graph.graphed

    @property
    def compile_failed(self):
        """Why compiling the step failed (sce.compiling.CompiledStep), or None."""
        inner = self.graph.fn if self.graph else self.run.step
        return inner.failed if isinstance(inner, CompiledStep) else None


def bench_references():
    """supervised_reference: forward + backward + fused SGD step of a plain torchvision model of the
    arch (plain BN, a 1000-way fc) on a cross-entropy; ideal_asymmetric: that plus a no-grad forward
    of a second such model on the other view, the ideal of an asymmetric SCE step."""
    def plain():
        model, feat_dim = build_trunk(args.arch, args.small_input)
        model.fc = torch.nn.Linear(feat_dim, 1000)
        model = model.to(device, memory_format=MEMORY_FORMAT)
        return compile_module(model, "trunk", COMPILES) if args.compile else model
    torch.manual_seed(0)
    online, target = plain(), plain()
    optimizer = torch.optim.SGD(online.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True)
    views = synthetic_views()
    labels = torch.randint(1000, (args.batch_size,), device=device)

    def supervised(_views, _m):
        with cli.autocast(device, args.amp):
            loss = torch.nn.functional.cross_entropy(online(views[1]), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def ideal(_views, _m):
        with torch.no_grad(), cli.autocast(device, args.amp):
            target(views[0])
        supervised(_views, _m)
    for name, step in (("supervised_reference", supervised), ("ideal_asymmetric", ideal)):
        seconds = time_steps(step, views)
        REFERENCE[name] = args.batch_size / seconds
        report(what=name, **SETTING, step_ms=round(1000 * seconds, 2), images_per_s=round(REFERENCE[name], 1))


def of_references(images_per_s):
    """Our images/s as a share of each reference's."""
    return {f"of_{name}": round(images_per_s / rate, 3) for name, rate in REFERENCE.items()}


def synthetic_views():
    shape = (args.batch_size, 3, args.crop_size, args.crop_size)
    return [torch.randn(shape, device=device).to(dtype=amp_dtype or torch.float32, memory_format=MEMORY_FORMAT)
            for _ in range(2)]


def bench_data(dataset, augment):
    """The loader alone; for gpu and decode, then the device side (decoding, augmentation) of its last
    batch, timed apart."""
    batches = make_batches(dataset, augment, args.warmup + args.steps)
    loader = iter(batches.loader)
    for _ in range(args.warmup):
        next(loader)
    start = time.perf_counter()
    for _ in range(args.steps):
        batch = next(loader)
    seconds = time.perf_counter() - start
    device_ms = eager_ms = None
    if augment != "cpu":  # as --compile says (main_pretrain.py's default on CUDA: compiled), then eager
        device_ms = time_device_augment(batches, batch)
        eager_ms = time_device_augment(make_batches(dataset, augment, 1, workers=0, compile=False), batch)
    if args.profile and augment != "cpu":
        with torch.profiler.profile() as prof:
            batches.views_from(batch)
            sync(device)
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)
    report(what="data", augment=augment, workers=args.workers, crop=args.crop_size, batch=args.batch_size,
           loader_images_per_s=round(args.steps * args.batch_size / seconds, 1),
           ms_per_image_per_core=round(1000 * seconds * max(1, args.workers) / (args.steps * args.batch_size), 2),
           device_ms_per_batch=device_ms, device_ms_per_batch_eager=eager_ms)


def time_device_augment(batches, batch):
    """ms per batch of the device's side of a loader batch (decoding, crops, photometric ops, normalisation)."""
    batches.views_from(batch)  # compiles, if asked
    sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        batches.views_from(batch)
    sync(device)
    return round(1000 * (time.perf_counter() - start) / args.steps, 2)


def time_steps(step, views):
    """Seconds per call of step(views, momentum), after args.warmup untimed calls."""
    return time_calls(lambda: step(views, 0.99), device, args.warmup, args.steps, COMPILES)


def check_graph(step, batches=None):
    """A row that asked for a CUDA graph, or for compiled code, and ran eagerly would report the eager step as
    what it asked for: stop."""
    if args.cuda_graph and not step.graphed:
        raise SystemExit("error: --cuda-graph: the step was not captured (see the warning above): its rows would "
                         "time eager steps")
    if args.compile and (step.compile_failed or (batches is not None and batches.views.failed)):
        raise SystemExit("error: --compile: compiling failed and the step or the views ran eagerly (see the warning "
                         "above): its rows would time eager code")


def bench_train_step(training, step):
    """Compute only: synthetic views already on the device, through the step, with and without
    the non-finite guard (its cost is the difference; not measured on a captured graph)."""
    views = synthetic_views()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    step(views, 0.99)  # the first step: with --compile, the cold compile of the forwards and the backward
    sync(device)
    first_step_s = time.perf_counter() - start
    unguarded_s = None
    if not args.cuda_graph:
        training.guard = False
        unguarded_s = time_steps(step, views)
        training.guard = True
    step_s = time_steps(step, views)
    check_graph(step)
    fields = dict(what="train_step", **SETTING, graph_captured=step.graphed, first_step_s=round(first_step_s, 2),
                  step_ms=round(1000 * step_s, 2),
                  images_per_s=round(args.batch_size / step_s, 1), **of_references(args.batch_size / step_s))
    if unguarded_s:
        fields.update(step_ms_without_guard=round(1000 * unguarded_s, 2),
                      guard_share=round((step_s - unguarded_s) / step_s, 4))
    if device.type == "cuda":
        fields["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
    if not args.compile and not args.cuda_graph:  # (a compiled model or a graph would not take the small shape)
        fields["host_step_ms"] = round(1000 * host_step_s(step, training), 2)
    fields.update(criterion_ms(training, step_s))
    if args.online_probe:  # the same step with the probe, built alike: its share of the step
        _, with_probe = build_training(online_probe=True)
        labeled = Batch(views, torch.randint(10, (args.batch_size,), device=device))
        probe_s = time_steps(with_probe, labeled)
        fields.update(step_ms_with_online_probe=round(1000 * probe_s, 2),
                      online_probe_share=round((probe_s - step_s) / step_s, 4))
    report(**fields)
    return args.batch_size / step_s


def criterion_ms(training, step_s):
    """The loss and its logged terms as the step runs them (fp32, autocast off: sce.builder.MomentumModel.forward), and
    the same under autocast in --amp's dtype, on embeddings and a queue of the setting's shapes: ms each
    (eager, kernel launches included) and the fp32 criterion's share of the step (an upper bound beside a
    CUDA graph's step, which launches nothing; one pair of a symmetric step's two)."""
    queue = training.model.queue
    q, k = (torch.nn.functional.normalize(torch.randn(args.batch_size, queue.shape[1], device=device), dim=1)
            for _ in range(2))
    q.requires_grad_(True)

    def criterion(_views, _m):
        loss = losses.sce_loss(q, k, queue)
        loss.backward()
        losses.loss_terms(q.detach(), k, queue)
    fp32 = time_steps(criterion, None)
    out = dict(criterion_ms=round(1000 * fp32, 3), criterion_share=round(fp32 / step_s, 4))
    if amp_dtype is not None:
        with cli.autocast(device, args.amp):
            out["criterion_ms_under_amp"] = round(1000 * time_steps(criterion, None), 3)
    return out


def host_step_s(step, training):
    """The host's own time per step: the same step on up to 8 images of 64 px, whose GPU work is
    tiny, so the host's launches set the pace. Near step_ms, the host cannot keep ahead of the GPU.
    (On a CPU device it includes the small step's compute.)"""
    n = max(d for d in range(1, 9) if args.batch_size % d == 0)  # divides the batch, so the queue too
    size = min(64, args.crop_size)
    views = [torch.randn(n, 3, size, size, device=device).to(amp_dtype or torch.float32, memory_format=MEMORY_FORMAT)
             for _ in range(2)]
    queue_ptr = training.model.queue_ptr.clone()  # n keys a step would misalign the pointer for the batch
    seconds = time_steps(step, views)
    training.model.queue_ptr.copy_(queue_ptr)
    return seconds


def run_pipeline(step, batches):
    """The step over `batches` (each a list of views on the device), as main_pretrain.py runs
    them. Returns images/s, the share of time spent waiting for the loader, and the iterator (4 batches left)."""
    batches_iter = iter(batches)
    for _ in range(args.warmup):
        step(next(batches_iter), 0.99)
    sync(device)
    batches.wait_s, graphs, start = 0.0, compiling.graphs_compiled(), time.perf_counter()
    for _ in range(args.steps):
        step(next(batches_iter), 0.99)
    sync(device)
    seconds = time.perf_counter() - start
    no_compile_since(graphs, COMPILES)
    check_graph(step, batches)
    return args.steps * args.batch_size / seconds, batches.wait_s / seconds, batches_iter


def bench_end_to_end(step, dataset, augment, compute_images_per_s, workers=None, profile=True):
    """Batches by route `augment` (workers: default --workers; 'preload': `dataset` decoded onto the
    device first, no loader), then the step; profiled under --profile unless profile=False."""
    workers = 0 if augment == "preload" else args.workers if workers is None else workers
    steps = args.warmup + args.steps + 4
    if augment == "preload":
        batches = PreloadedEpochs(dataset, steps)
    else:
        batches = make_batches(dataset, augment, steps, workers)
    images_per_s, wait, batches_iter = run_pipeline(step, batches)
    syncs, sites = count_host_syncs(lambda: step(next(batches_iter), 0.99), ROOT) \
        if device.type == "cuda" else (None, None)
    if profile and args.profile and device.type == "cuda":  # where the GPU time of two whole steps goes
        with torch.profiler.profile() as prof:
            for _ in range(2):
                step(next(batches_iter), 0.99)
            sync(device)
        print(f"end to end, augment {augment}, two steps:", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)
    report(what="end_to_end", augment=augment, workers=workers, **SETTING,
           images_per_s=round(images_per_s, 1), data_wait_share=round(wait, 3),
           of_compute_only=round(images_per_s / compute_images_per_s, 3) if compute_images_per_s else None,
           **of_references(images_per_s), host_syncs_per_step=syncs, host_sync_sites=sites)


class PreloadedEpochs:
    """The preload route's batches over as many epochs as `steps` asks (a few hundred images feed any
    number of steps), with the views of main_pretrain.py's defaults (weak target, strong online)."""

    def __init__(self, dataset, steps):
        if len(dataset) < args.batch_size:
            raise SystemExit(f"error: {len(dataset)} images make no batch of {args.batch_size}")
        self.sampler = data.ResumableSampler(len(dataset), args.batch_size)
        self.batches = data.pretrain_batches(dataset, SPECS, self.sampler, device, "gpu", try_preload=True,
                                             required=True, workers=args.workers, dtype=amp_dtype,
                                             channels_last=args.channels_last, compile=args.compile,
                                             budget=data.Budget(device), compiles=COMPILES)
        self.views, self.wait_s = self.batches.views, 0.0

    def __iter__(self):
        for number in itertools.count():
            self.sampler.set_epoch(number)
            yield from self.batches


class RandomImages(torch.utils.data.Dataset):
    """4 batches of random uint8 images of --image-size, for the preload route without --data."""

    def __init__(self):
        size = args.image_size or args.crop_size
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (4 * args.batch_size, 3, size, size), generator=g, dtype=torch.uint8)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], 0


def bench_device_pipeline(step, dataset, compute_images_per_s):
    """End to end without the loader's CPU load: 4 of its batches (pinned), read once and cycled,
    through the device's side of the gpu route and the step. Against end_to_end, it tells the
    device side's cost from the host's (loader workers competing with the training process)."""
    batches = make_batches(dataset, "gpu", 4)
    cached = list(itertools.islice(iter(batches.loader), 4))

    class Cached:
        wait_s, views = 0.0, batches.views

        def __iter__(self):
            for i in range(args.warmup + args.steps + 4):
                yield batches.views_from(cached[i % 4])
    images_per_s, _, _ = run_pipeline(step, Cached())
    report(what="device_pipeline", augment="gpu", **SETTING, images_per_s=round(images_per_s, 1),
           of_compute_only=round(images_per_s / compute_images_per_s, 3) if compute_images_per_s else None)


def table():
    print("\n| measurement | augment | images/s | other |\n|---|---|---|---|")
    for r in results:
        if r["what"] == "data":
            other = f"{r['ms_per_image_per_core']} ms/image/core, workers {r['workers']}"
            if r["device_ms_per_batch"] is not None:
                other += f", device {r['device_ms_per_batch']} ms/batch ({r['device_ms_per_batch_eager']} eager)"
            print(f"| data | {r['augment']} | {r['loader_images_per_s']} | {other} |")
        elif r["what"] in REFERENCE:
            print(f"| {r['what']} | - | {r['images_per_s']} | {r['step_ms']} ms/step |")
        elif r["what"] == "train_step":
            print(f"| train_step | - | {r['images_per_s']} | {r['step_ms']} ms/step, first step {r['first_step_s']} s, "
                  f"loss {r['criterion_ms']} ms "
                  f"({100 * r['criterion_share']:.1f}%)"
                  f"{', guard ' + format(100 * r['guard_share'], '.2f') + '%' if 'guard_share' in r else ''}"
                  f"{online_probe(r)}"
                  f"{', peak ' + str(r['peak_mem_gib']) + ' GiB' if 'peak_mem_gib' in r else ''}"
                  f"{', host ' + str(r['host_step_ms']) + ' ms/step' if 'host_step_ms' in r else ''}{ratios(r)} |")
        elif r["what"] == "device_pipeline":
            print(f"| device_pipeline | gpu | {r['images_per_s']} | cached batches, "
                  f"{100 * (r['of_compute_only'] or 0):.1f}% of compute-only |")
        else:
            syncs = "" if r["host_syncs_per_step"] is None else f", {r['host_syncs_per_step']} host syncs/step"
            print(f"| end_to_end | {r['augment']} | {r['images_per_s']} | workers {r['workers']}, "
                  f"data wait {100 * r['data_wait_share']:.1f}%, "
                  f"{100 * (r['of_compute_only'] or 0):.1f}% of compute-only{ratios(r)}{syncs} |")


def online_probe(r):
    return f", online probe {100 * r['online_probe_share']:.2f}%" if "online_probe_share" in r else ""


def ratios(r):
    return "".join(f", {r['of_' + name]:.2f}x {name}" for name in REFERENCE if "of_" + name in r)


if args.workers == 0:  # the loader's work in this process: one core, as in a worker
    torch.set_num_threads(1)
with tempfile.TemporaryDirectory() as tmp:
    root = args.data or write_photos(tmp, args.images)
    pipelines = [] if args.skip_data else args.augment
    datasets = {a: data.build_dataset("imagefolder", root, "pretrain", read=data.READ[a])
                for a in set(pipelines) | ({"gpu"} if args.preload and args.data else set())}
    if not args.skip_data:
        for augment in args.augment:
            bench_data(datasets[augment], augment)
    if not args.skip_train:
        bench_references()
        training, step = build_training()
        compute = bench_train_step(training, step)
        if args.preload:
            bench_end_to_end(step, datasets["gpu"] if args.data else RandomImages(), "preload", compute)
        if not args.skip_data:
            for augment in args.augment:
                bench_end_to_end(step, datasets[augment], augment, compute)
            for workers in args.e2e_workers:
                for augment in [a for a in args.augment if a != "cpu"]:
                    bench_end_to_end(step, datasets[augment], augment, compute, workers, profile=False)
            if "gpu" in args.augment:
                bench_device_pipeline(step, datasets["gpu"], compute)
table()
