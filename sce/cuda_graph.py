"""CUDA graphs, for pretraining's step and the linear probe's: when a run may use one (usable), a step replayed from
one after a few eager calls (Graphed), the capture itself (CudaGraphs), and the lr as device tensors a graph reads
(lr_as_tensors). A small model on small images is bound by its kernel launches: one replay instead of hundreds."""
import time
import warnings

import torch

from sce import distributed as du
from sce.compiling import error_line

GRAPH_WARMUP = 3  # eager steps before a CUDA graph's capture: compiles and cuDNN's autotuning happen there


def usable(asked, device, world_size, amp, what):
    """Whether `what` (a step) runs as a CUDA graph: --cuda-graph (True), --no-cuda-graph (False) or auto (None),
    on one GPU process without fp16's GradScaler (whose skipped steps and scale the host decides); asked for where
    it cannot run, one line says so."""
    possible = device.type == "cuda" and world_size == 1 and amp != "fp16"
    if asked and not possible and du.is_main():
        print(f"=> --cuda-graph needs one GPU process without --amp fp16 (GradScaler): {what} runs eagerly", flush=True)
    return possible and asked is not False


def lr_as_tensors(optimizer, device):
    """Each group's lr as a device tensor (kept where it is one), which sce.optim.set_lr fills in place (a CUDA graph
    reads it)."""
    for group in optimizer.param_groups:
        if not torch.is_tensor(group["lr"]):
            group["lr"] = torch.tensor(float(group["lr"]), device=device)


class Graphed:
    """fn(*args) replayed from a CUDA graph. args: device tensors, lists of them, and Python numbers, each number
    handed to fn as a device scalar of its own filled at every call (the eager calls too, so that both compute
    alike). The first `warmup` calls and those `whole(*args)` refuses run eagerly (on the side stream of `graphs`,
    as capture requires); the next call captures fn on static copies of its inputs (its seconds noted in
    `compiles`, a sce.compiling.Log, if given, and said in a line); from then on a call whose tensors have the
    captured shapes, dtypes and strides copies them in and replays: one launch instead of fn's dozens or hundreds.
    Other layouts run eagerly. The outputs are the graph's static tensors, overwritten by the next replay. A failed
    capture warns once (naming `what`; `capture_failed` says why) and every later call runs eagerly.
    graphs: CudaGraphs, or the tests' stand-in. Used on one process only (usable)."""

    def __init__(self, fn, graphs, what, warmup=GRAPH_WARMUP, whole=None, compiles=None):
        self.fn, self.graphs, self.what, self.warmup, self.whole = fn, graphs, what, warmup, whole
        self.compiles, self.calls, self.scalars = compiles, 0, {}
        self.replay = self.outputs = self.static = self.capture_failed = None

    @property
    def graphed(self):
        """Whether calls replay a captured graph now."""
        return self.replay is not None

    def __call__(self, *args):
        self.calls += 1
        device = _tensors([a for a in args if not isinstance(a, (int, float))])[0].device
        args = [self._scalar(i, a, device) if isinstance(a, (int, float)) else a for i, a in enumerate(args)]
        if (self.replay is None and self.capture_failed is None and self.calls > self.warmup
                and (self.whole is None or self.whole(*args))):
            self._capture(args)
        tensors = _tensors(args)
        if self.replay is None or len(tensors) != len(self.static) or any(
                s.shape != x.shape or s.dtype != x.dtype or s.stride() != x.stride()
                for s, x in zip(self.static, tensors)):
            return self.graphs.eager(self.fn, *args)
        torch._foreach_copy_(self.static, tensors)
        self.replay()
        return self.outputs()

    def _scalar(self, i, number, device):
        """The number at args[i] as a device scalar, the same tensor at every call (a graph reads it there)."""
        if i not in self.scalars:
            self.scalars[i] = torch.zeros((), device=device)
        return self.scalars[i].fill_(number)

    def _capture(self, args):
        start, self.static = time.time(), [x.clone() for x in _tensors(args)]
        static_args = _rebuilt(args, self.static)
        try:
            self.replay, self.outputs = self.graphs.capture(lambda: self.fn(*static_args))
        except Exception as e:  # noqa: BLE001: whatever stopped the capture, the eager calls still work
            self.replay, self.capture_failed = None, error_line(e)
            warnings.warn(f"CUDA graph capture of {self.what} failed ({self.capture_failed}): running it eagerly")
            return
        took = time.time() - start
        if self.compiles is not None:
            self.compiles.seconds.append(("CUDA graph capture", took))
        print(f"=> {self.what} runs as a CUDA graph from its call {self.calls} on (capture {took:.2f} s)", flush=True)


def _tensors(args):
    """The tensors of args, those of its lists in order."""
    return [x for a in args for x in (a if isinstance(a, (list, tuple)) else [a])]


def _rebuilt(args, tensors):
    """args with its tensors replaced by `tensors`, in _tensors' order."""
    it = iter(tensors)
    return [[next(it) for _ in a] if isinstance(a, (list, tuple)) else next(it) for a in args]


class CudaGraphs:
    """torch.cuda.graphs for Graphed: eager calls on a side stream, capture into a CUDAGraph."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device)

    def eager(self, fn, *args):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = fn(*args)
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
        except BaseException:  # a failed capture_end leaves the capture's stream current: the eager calls after
            torch.cuda.set_stream(current)  # it would run there, unordered with the rest
            raise
        return graph.replay, lambda: out
