"""The pretraining step, shared by main_pretrain.py and benchmarks/bench_pretrain.py.

A step whose gradients are not finite leaves the weights and the optimizer as they were, decided
on the device without a host sync: the fused SGD (or LARS) update is skipped through its
`found_inf` input, the EMA uses momentum 1, and the BN running statistics, which the forward pass
moved, are put back (their num_batches_tracked counters are not). The queue keeps the step's keys
when they are finite, as in MoCo. That costs a few kernel launches, against a copy of both
branches and the optimizer.
"""
import dataclasses
import importlib.util
import os
import shutil
import time
import warnings

import torch

from sce import UserError
from sce.compiling import Fallback, compile_module, error_line, revert_to_eager

GRAPH_WARMUP = 3  # eager steps before a CUDA graph's capture: compiles and cuDNN's autotuning happen there


@dataclasses.dataclass
class Training:
    """What a training step uses and updates."""
    model: torch.nn.Module  # the MomentumModel (sce.builder)
    ddp_model: torch.nn.Module  # the same, wrapped in DDP on several ranks
    optimizer: torch.optim.Optimizer  # fused SGD or LARS (sce.optim)
    scaler: torch.amp.GradScaler = None  # fp16 only
    amp_dtype: torch.dtype = None
    bn_stats: list = None  # running means and variances of every BN layer; filled from the model
    guard: bool = True  # False only to measure what the non-finite guard costs (benchmarks)
    terms: object = None  # f(q, k, queue) -> {name: value}, the method's logged terms (losses.logged_terms)
    autocast_cache: bool = True  # autocast's cache of cast weights; off for a CUDA graph (Step "graphed")

    def __post_init__(self):
        if self.bn_stats is None:
            self.bn_stats = [b for name, b in self.model.named_buffers()
                             if name.endswith(("running_mean", "running_var"))]


def train_step(t, views, momentum):
    """One optimizer step on device views. Returns (loss, finite, terms), device tensors; terms
    (t.terms of the first (target, query) pair, or None) are computed here so benchmarks time them."""
    device = views[0].device
    autocast = torch.autocast(device.type, dtype=t.amp_dtype, enabled=t.amp_dtype is not None,
                              cache_enabled=t.autocast_cache)
    stats = torch.cat([s.flatten() for s in t.bn_stats]) if t.guard and t.bn_stats else None
    with autocast:
        loss, outputs = t.ddp_model(views)
    t.optimizer.zero_grad(set_to_none=True)
    if t.scaler:
        t.scaler.scale(loss).backward()
        t.scaler.unscale_(t.optimizer)
    else:
        loss.backward()
    finite = grads_finite(t.optimizer) if t.guard else torch.ones((), dtype=torch.bool, device=device)
    if t.scaler:
        t.scaler.step(t.optimizer)  # passes its own found_inf (the same verdict) to the fused step
        t.scaler.update()
    elif t.guard:
        step_unless_nonfinite(t.optimizer, finite)
    else:
        t.optimizer.step()
    t.model.update_momentum(momentum, finite)
    if stats is not None:
        restore_unless_finite(t.bn_stats, stats, finite)
    terms = t.terms(*outputs) if t.terms else None  # the method's logged terms, in fp32 as the loss is
    return loss.detach(), finite, terms


def grads_finite(optimizer):
    """Device bool: every gradient is finite. DDP averages gradients over ranks, so a non-finite
    loss on any rank gives every rank the same verdict."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum())


def step_unless_nonfinite(optimizer, finite):
    """optimizer.step(), skipped on the device where `finite` is False: torch's fused SGD reads
    `found_inf` (1.0 = skip) from the optimizer, where GradScaler puts it."""
    optimizer.grad_scale, optimizer.found_inf = None, (~finite).float()
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def restore_unless_finite(tensors, backup, finite):
    """Put `backup` (the tensors flattened and concatenated) back into `tensors` unless `finite`."""
    kept = torch.where(finite, torch.cat([t.flatten() for t in tensors]), backup)
    torch._foreach_copy_(tensors, list(kept.split([t.numel() for t in tensors])))


class Graphed:
    """fn(*inputs) (device tensors) replayed from a CUDA graph: the first `warmup` calls and those `whole(*inputs)`
    refuses run eagerly (on the side stream of `graphs`, as capture requires); the next call captures fn on static
    copies of its inputs (`capture_s` seconds, at call `captured_at`); from then on a call whose inputs have the
    captured shapes, dtypes and strides copies them in and replays: one launch instead of fn's dozens or hundreds,
    what a small model on small images is bound by. Inputs of another layout run eagerly. The outputs are the
    graph's static tensors, overwritten by the next replay. A failed capture warns once (naming `what`;
    `capture_failed` says why) and every later call runs eagerly. graphs: CudaGraphs, or the tests' stand-in."""

    def __init__(self, fn, graphs, what, warmup=GRAPH_WARMUP, whole=None):
        self.fn, self.graphs, self.what, self.warmup, self.whole = fn, graphs, what, warmup, whole
        self.calls, self.replay, self.outputs, self.static = 0, None, None, None
        self.capture_failed = self.capture_s = self.captured_at = None

    @property
    def graphed(self):
        """Whether calls replay a captured graph now."""
        return self.replay is not None

    def __call__(self, *inputs):
        self.calls += 1
        if (self.replay is None and self.capture_failed is None and self.calls > self.warmup
                and (self.whole is None or self.whole(*inputs))):
            self._capture(inputs)
        if self.replay is None or len(inputs) != len(self.static) or any(
                s.shape != x.shape or s.dtype != x.dtype or s.stride() != x.stride()
                for s, x in zip(self.static, inputs)):
            return self.graphs.eager(lambda: self.fn(*inputs))
        for static, x in zip(self.static, inputs):
            static.copy_(x)
        self.replay()
        return self.outputs()

    def _capture(self, inputs):
        start, self.static = time.time(), [x.clone() for x in inputs]
        try:
            self.replay, self.outputs = self.graphs.capture(lambda: self.fn(*self.static))
        except Exception as e:  # noqa: BLE001: whatever stopped the capture, the eager calls still work
            self.replay, self.capture_failed = None, error_line(e)
            warnings.warn(f"CUDA graph capture of {self.what} failed ({self.capture_failed}): running it eagerly")
            return
        self.capture_s, self.captured_at = time.time() - start, self.calls


class Step:
    """The training step of main_pretrain.py and the benchmark: step(views, momentum) -> (loss, finite, terms).

    compiled: its modules were torch.compile'd (compile_model). torch.compile compiles at the first call, the
    backward at the first backward, so during the first WATCH calls the model, optimizer, scaler and RNG states
    are copied (to host memory) before each call: if a call raises, they are put back, the modules turn eager and
    the same call runs again (sce.compiling.Fallback: one warning; `compile_failed` says why, `compiled` is False
    from then on). An error of the eager call is not the compiler's: it propagates.
    graphs (the capture mechanism: CudaGraphs; the tests use a CPU stand-in): the step replayed from a CUDA graph
    after `warmup` eager steps (Graphed: `graphed`, `capture_s`, `captured_at`; `graph.capture_failed`). What changes
    from step to step reaches the graph through device tensors: the views and the EMA momentum (a device scalar,
    eager steps too, so that both compute the same EMA) copied in, the lr filled in place (lr_as_tensors then
    set_lr), lambda the criterion's tensor filled by the caller; the outputs are the graph's static tensors,
    overwritten by the next call."""
    WATCH = 3

    def __init__(self, training, compiled=False, graphs=None, warmup=GRAPH_WARMUP):
        self.t, self.calls = training, 0
        self.watch, self.saved = self.WATCH if compiled else 0, None
        self.fallback = Fallback("the training step", self._run, self._run, self._undo) if compiled else None
        self.graph = Graphed(lambda *x: train_step(training, list(x[:-1]), x[-1]), graphs, "the training step",
                             warmup) if graphs else None
        self.momentum = None  # the graph's momentum input, a device scalar
        if graphs:
            training.autocast_cache = False  # a capture must not keep autocast's cast weights (torch.cuda.graphs)

    @property
    def compile_failed(self):
        return self.fallback.failed if self.fallback else None

    @property
    def compiled(self):
        return self.fallback is not None and self.fallback.failed is None

    def describe(self):
        """What the step is, for the start-up line."""
        return (f"CUDA graph after {self.graph.warmup} steps" if self.graph else "compiled" if self.compiled
                else "eager")

    @property
    def graphed(self):
        """Whether the step replays a captured graph now."""
        return self.graph is not None and self.graph.graphed

    @property
    def capture_s(self):
        return self.graph.capture_s if self.graph else None

    @property
    def captured_at(self):
        return self.graph.captured_at if self.graph else None

    def __call__(self, views, momentum):
        self.calls += 1
        if self.watch <= 0 or self.compile_failed:
            return self._run(views, momentum)
        self.watch -= 1
        self.saved = self._save()
        try:
            return self.fallback(views, momentum)
        finally:
            self.saved = None

    def _undo(self):
        self._restore(self.saved)
        revert_to_eager(self.t.model)
        if self.graph:  # the failed call is run again: one step, one call towards the capture's warm-up
            self.graph.calls -= 1

    def _run(self, views, momentum):
        if self.graph is None:
            return train_step(self.t, views, momentum)
        if self.momentum is None:
            self.momentum = torch.zeros((), device=views[0].device)
        self.momentum.fill_(momentum)
        return self.graph(*views, self.momentum)

    def _save(self):
        t, cpu = self.t, lambda v: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
        cuda = next(t.model.parameters()).is_cuda
        return dict(model={k: cpu(v) for k, v in t.model.state_dict().items()},
                    optimizer={p: {k: cpu(v) for k, v in s.items()} for p, s in t.optimizer.state.items()},
                    scaler=t.scaler.state_dict() if t.scaler else None, rng=torch.get_rng_state(),
                    cuda_rng=torch.cuda.get_rng_state_all() if cuda else None)

    def _restore(self, saved):
        t = self.t
        if saved["cuda_rng"] is not None:
            torch.cuda.synchronize()  # the failed step may still run on a side stream (CudaGraphs.eager)
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
        t.model.load_state_dict(saved["model"])  # copied in place: the optimizer keeps its parameters
        for p in list(t.optimizer.state):  # in place too: a CUDA graph captured later reads these buffers
            old, new = t.optimizer.state[p], saved["optimizer"].get(p, {})
            t.optimizer.state[p] = {k: old[k].copy_(v) if torch.is_tensor(v) and torch.is_tensor(old.get(k))
                                    else v for k, v in new.items()}
        if t.scaler:
            t.scaler.load_state_dict(saved["scaler"])
        torch.set_rng_state(saved["rng"])


class CudaGraphs:
    """torch.cuda.graphs for Step: eager steps on a side stream, capture into a CUDAGraph."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device)

    def eager(self, fn):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def capture(self, fn):
        """(replay, outputs): replay() runs the captured work; outputs() its static output tensors."""
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:  # thread_local: the loader's pin-memory thread may call CUDA (cudaHostAlloc) during the capture
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                out = fn()
        except BaseException:  # a failed capture_end leaves the capture's stream current: the eager steps after
            torch.cuda.set_stream(current)  # it would run there, unordered with the rest
            raise
        return graph.replay, lambda: out


def build_step(training, device, cuda_graph=False, compile=False, graphs=None):
    """The Step of main_pretrain.py and of the benchmark: replayed from a CUDA graph (cuda_graph; `graphs` the
    capture mechanism, CudaGraphs on the device by default), of compiled modules (compile: they were
    compile_model'd) or eager."""
    if cuda_graph:
        lr_as_tensors(training.optimizer, device)
    return Step(training, compile, (graphs or CudaGraphs(device)) if cuda_graph else None)


def lr_as_tensors(optimizer, device):
    """Each group's lr as a device tensor, which sce.optim.set_lr fills in place (a CUDA graph reads it)."""
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), device=device)


def check_compile(device):
    """A one-line error, before any work, where torch.compile cannot run."""
    fix = "drop --compile"
    if not torch._dynamo.is_dynamo_supported():
        raise UserError(f"--compile: torch.compile does not support this Python / platform: {fix}")
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise UserError(f"--compile on GPU needs Triton, which is not installed: pip install triton, or {fix}")
    if device.type == "cpu" and not shutil.which(os.environ.get("CXX", "g++")):
        raise UserError(f"--compile on CPU needs a C++ compiler ({os.environ.get('CXX', 'g++')} not found): {fix}")


def compile_model(model, compiles, blocks=False):
    """torch.compile the encoders and heads in place, each compile timed in `compiles` (a compiling.Log); the
    queue, the all_gather and the loss stay eager. nn.Module.compile keeps the state-dict keys, so compiled and
    eager checkpoints mix. A module without parameters (the default Identity predictor) stays eager: its empty
    graph on the shared compiled wrapper left the heads running uncompiled from the second call, and split BN
    recompiling. A failed compile is the Step's to undo (its backward's fails outside the modules' calls).
    blocks: each residual block of the encoders compiled apart instead of the whole trunk (blocks of one shape
    share their code: a shorter cold compile?), the stem eager; the benchmark's --compile-blocks measures it."""
    if blocks:  # every block's forward is one function to dynamo: a shape of it, a graph (16 in a ResNet-50 step)
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), 64))
    for name in ("encoder", "projector", "predictor", "momentum_encoder", "momentum_projector"):
        module = getattr(model, name)
        if blocks and name.endswith("encoder"):
            for layer in ("layer1", "layer2", "layer3", "layer4"):
                for i, block in enumerate(getattr(module, layer)):
                    # static: blocks of another shape are other graphs (dynamo's automatic dynamic shapes would
                    # make the second shape's graph symbolic, which split BN's batch arithmetic cannot trace)
                    compile_module(block, f"{name}.{layer}.{i}", compiles, fallback=False, dynamic=False)
        elif any(True for _ in module.parameters()):
            compile_module(module, name, compiles, fallback=False)


def resolve_compile(flag, device):
    """--compile (True), --no-compile (False) or auto (None) -> whether to compile: auto is on where
    it pays, CUDA with Triton, and off on CPU (Inductor's C++ build of a ResNet takes minutes there)."""
    if flag:
        check_compile(device)  # asked for where it cannot run: one line
        return True
    return (flag is None and device.type == "cuda" and torch._dynamo.is_dynamo_supported()
            and importlib.util.find_spec("triton") is not None)
