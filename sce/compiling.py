"""torch.compile for everything a run compiles (the training step's modules, the views, the kNN monitor's and the
evaluations' trunk), each with its eager fallback, and what each compile cost: each call that compiled a new graph
is timed and named in a Log, so a run can say where its start-up went."""
import importlib.util
import os
import shutil
import time
import warnings

import torch

from sce import UserError
from sce import distributed as du


def error_line(e, most=200):
    """The cause of an error in one line (its first), of at most `most` characters cut after a sentence (else a
    clause, else a word); of a failed compile, the compiler's (BackendCompilerFailed wraps it)."""
    e = getattr(e, "inner_exception", e)
    line = (str(e).strip().splitlines() or [type(e).__name__])[0].strip()
    if len(line) <= most:
        return line
    for end, kept in ((". ", 1), ("; ", 0), (", ", 0), (" ", 0)):
        at = line.rfind(end, 0, most - 3)
        if at > 0:
            return line[:at + kept] + ("" if kept else "...")
    return line[:most - 3] + "..."


def graphs_compiled():
    """Graphs dynamo has compiled in this process so far (any backend)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class Log:
    """(name, seconds) of each call that compiled at least one new graph, in order. One a run: it lives with
    the run, not with the process."""

    def __init__(self):
        self.seconds = []

    def timed(self, name, fn):
        """fn, with each call that compiles a new graph noted here (a compile takes seconds, so the call's wall
        time is the compile's; the GPU work it queues is not waited for)."""
        def call(*args, **kwargs):
            before, start = graphs_compiled(), time.perf_counter()
            out = fn(*args, **kwargs)
            if graphs_compiled() != before:
                self.seconds.append((name, time.perf_counter() - start))
            return out
        return call

    def total(self):
        return sum(seconds for _, seconds in self.seconds)

    def summary(self, since=0):
        """'encoder 9.1 s, projector 0.4 s, ...' of the compiles noted from index `since` on, or ''."""
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds[since:])


class Fallback:
    """fallback(*args) calls `compiled` until a call raises; then undo() (puts back what the failed call changed and
    turns the code eager), `eager` runs the same call, one warning names `what` and the cause (`failed`), and every
    later call is eager. An error of the eager call too is not the compiler's: it propagates, without the warning."""

    def __init__(self, what, compiled, eager, undo=None):
        self.what, self.compiled, self.eager, self.undo = what, compiled, eager, undo
        self.failed = None

    def __call__(self, *args, **kwargs):
        if self.failed is not None:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001: whatever stopped the compiled call, the eager one decides
            self.failed = error_line(e)
            if self.undo:
                self.undo()
            out = self.eager(*args, **kwargs)
            warnings.warn(f"--compile: torch.compile of {self.what} failed ({self.failed}): running it eagerly")
            return out


class CompiledStep:
    """step(*args), a training step whose modules were compiled (compile_model), as main_pretrain.py runs it.
    torch.compile compiles at a module's first call and its backward at the first backward, both before the
    optimizer's step has moved a weight: a compile failing in the first call falls back, the model's buffers (BN
    statistics, the queue and its pointer) and the RNG states kept before it put back, its modules eager, the same
    call run again (one warning; `failed` says why, and a line). A compiler's error in a later call (a recompile)
    stops the run with one line naming --no-compile; an error of the eager call is not the compiler's: it
    propagates. The rest of a call that compiled (the backward's compile, which no module's call sees) is noted
    in `compiles` as "backward"; the first call's line says what each compile cost."""

    def __init__(self, step, model, compiles, what="the training step"):
        self.step, self.model, self.compiles, self.what = step, model, compiles, what
        self.calls, self.failed = 0, None

    def __call__(self, *args):
        self.calls += 1
        graphs, noted, start = graphs_compiled(), self.compiles.total(), time.time()
        try:
            out = self._first(*args) if self.calls == 1 else self.step(*args)
        except Exception as e:
            if self.calls > 1 and self.failed is None and compiler_error(e):
                raise UserError(f"--compile: torch.compile of {self.what} failed after its first step "
                                f"({error_line(e)}): run again with --no-compile (it resumes)") from None
            raise
        took = time.time() - start
        if graphs_compiled() != graphs:
            self.compiles.seconds.append(("backward", took - (self.compiles.total() - noted)))
        if self.calls == 1 and du.is_main():
            print(f"=> compiling failed ({self.failed}): eager steps, the first took {took:.1f} s" if self.failed
                  else f"=> the first step took {took:.1f} s, compiling (each compile: "
                       f"{self.compiles.summary() or 'none'})", flush=True)
        return out

    def _first(self, *args):
        buffers = [b.clone() for b in self.model.buffers()]
        rng = torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

        def undo():
            torch._foreach_copy_(list(self.model.buffers()), buffers)
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state_all(rng[1])
            revert_to_eager(self.model)
        fallback = Fallback(self.what, self.step, self.step, undo)  # modules eager after undo(): the same call
        try:
            return fallback(*args)
        finally:
            self.failed = fallback.failed


def compiler_error(e):
    """Whether `e` is torch.compile's (dynamo's, Inductor's, Triton's), not the model's own."""
    return (isinstance(e, torch._dynamo.exc.TorchDynamoException)
            or type(e).__module__.startswith(("torch._dynamo", "torch._inductor", "triton")))


def compile_model(model, compiles, blocks=False):
    """torch.compile the encoders and heads in place, each compile timed in `compiles` (a Log); the queue, the
    all_gather and the loss stay eager. nn.Module.compile keeps the state-dict keys, so compiled and eager checkpoints
    mix. A module without parameters (the default Identity predictor) stays eager: its empty graph on the shared
    compiled wrapper left the heads running uncompiled from the second call, and split BN recompiling. A failed
    compile is CompiledStep's to undo (its backward's fails outside the modules' calls).
    blocks: each residual block of the encoders compiled apart instead of the whole trunk (blocks of one shape share
    their code: a shorter cold compile?), the stem eager; the benchmark's --compile-blocks measures it."""
    if blocks:  # every block's forward is one function to dynamo: a shape of it, a graph (16 in a ResNet-50 step)
        allow_recompiles(64)
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


def allow_recompiles(at_least):
    """Dynamo's limit on the graphs of one function (8 by default) raised to `at_least`."""
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), at_least))


def check_compile(device):
    """A one-line error, before any work, where torch.compile cannot run."""
    fix = "drop --compile"
    if not torch._dynamo.is_dynamo_supported():
        raise UserError(f"--compile: torch.compile does not support this Python / platform: {fix}")
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise UserError(f"--compile on GPU needs Triton, which is not installed: pip install triton, or {fix}")
    if device.type == "cpu" and not shutil.which(os.environ.get("CXX", "g++")):
        raise UserError(f"--compile on CPU needs a C++ compiler ({os.environ.get('CXX', 'g++')} not found): {fix}")


def resolve_compile(flag, device):
    """--compile (True), --no-compile (False) or auto (None) -> whether to compile: auto is on where
    it pays, CUDA with Triton, and off on CPU (Inductor's C++ build of a ResNet takes minutes there)."""
    if flag:
        check_compile(device)  # asked for where it cannot run: one line
        return True
    return (flag is None and device.type == "cuda" and torch._dynamo.is_dynamo_supported()
            and importlib.util.find_spec("triton") is not None)


def compile_module(module, name, compiles, fallback=True, **options):
    """nn.Module.compile in place (the state-dict keys stay an eager run's), each compile timed in `compiles` (a Log)
    as `name`; fallback: a failing compiled call is redone eagerly and the module stays eager (Fallback), for a
    module whose call changes no state (a frozen trunk in eval mode); options: torch.compile's. Returns the module."""
    module.compile(**options)
    compiled = compiles.timed(name, module._compiled_call_impl)
    if fallback:
        compiled = Fallback(f"the {name}", compiled, module._call_impl, lambda: revert_to_eager(module))
    module._compiled_call_impl = compiled
    return module


def compile_function(fn, compiles, name=None):
    """torch.compile of a function of tensors, static shapes and one graph (no break), timed in `compiles`."""
    return compiles.timed(name or fn.__name__, torch.compile(fn, dynamic=False, fullgraph=True))


def revert_to_eager(model):
    """Undo nn.Module.compile on `model` and its submodules."""
    for module in model.modules():
        module._compiled_call_impl = None
