"""What torch.compile cost: each call that compiled a new graph is timed and named in a Log, so a run can say
where its start-up went (the model's forward, the views, the evaluation trunk, ...)."""
import time

import torch


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

    def summary(self, since=0):
        """'encoder 9.1 s, projector 0.4 s, ...' of the compiles noted from index `since` on, or ''."""
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds[since:])
