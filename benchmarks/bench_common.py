"""What the two benchmarks share: the machine's line, timing a call after its warm-up, and the check that no
graph compiled while timed."""
import time

import torch

from sce import compiling


def environment(device):
    """The fields every JSON row carries: the device's name (or the CPU threads) and torch's version."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}"
    return {"device": name, "torch": torch.__version__}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def no_compile_since(graphs_before, compiles):
    """A row that timed a compile (a graph compiled after the warm-up) would report the compiler: stop."""
    new = compiling.graphs_compiled() - graphs_before
    if new:
        raise SystemExit(f"error: {new} graph(s) compiled during the timed steps ({compiles.summary()}): the "
                         "warm-up did not cover every compile (a recompile?)")


def time_calls(call, device, warmup, steps, compiles):
    """Seconds per call of call(), after `warmup` untimed calls."""
    for _ in range(warmup):
        call()
    sync(device)
    graphs, start = compiling.graphs_compiled(), time.perf_counter()
    for _ in range(steps):
        call()
    sync(device)
    no_compile_since(graphs, compiles)
    return (time.perf_counter() - start) / steps
