"""torch.compile with one eager fallback for everything a run compiles (the training step, the views, the kNN
monitor's and the evaluations' trunk), and what each compile cost: each call that compiled a new graph is timed
and named in a Log, so a run can say where its start-up went."""
import time
import warnings

import torch


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

    def total(self, since=0):
        return sum(seconds for _, seconds in self.seconds[since:])

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
