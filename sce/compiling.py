"""What torch.compile cost: each call that compiled a new graph is timed and named, so a run can say where
its start-up went (the model's forward, the views, the evaluation trunk, ...)."""
import time

import torch

SECONDS = []  # (name, seconds) of each call that compiled at least one new graph, in order


def graphs_compiled():
    """Graphs dynamo has compiled in this process so far (any backend)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def timed(name, fn):
    """fn, with each call that compiles a new graph noted in SECONDS (a compile takes seconds, so the
    call's wall time is the compile's; the GPU work it queues is not waited for)."""
    def call(*args, **kwargs):
        before, start = graphs_compiled(), time.perf_counter()
        out = fn(*args, **kwargs)
        if graphs_compiled() != before:
            SECONDS.append((name, time.perf_counter() - start))
        return out
    return call


def summary(since=0):
    """'encoder 9.1 s, projector 0.4 s, ...' of the compiles noted from index `since` on, or ''."""
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in SECONDS[since:])
