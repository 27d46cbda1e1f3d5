"""What the two benchmarks share: the machine's line, timing a call after its warm-up, the check that no graph
compiled while timed, and counting a step's host syncs."""
import os
import time
import traceback
import warnings

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


def count_host_syncs(call, root, steps=2):
    """Host-device synchronisations per call() (a step of the loop), and where: the innermost frame under `root`
    (this project; else the DataLoader's) of the warning torch's sync debug mode raises."""
    sites = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = traceback.extract_stack()[:-1]
            ours = [f for f in frames if root in f.filename and "site-packages" not in f.filename]
            where = ours[-1] if ours else frames[-1]  # none of ours: another thread (the loader's pin-memory one?)
            path = os.path.relpath(where.filename, root) if ours else "/".join(where.filename.split(os.sep)[-3:])
            sites.append(f"{os.path.basename(filename)}:{lineno} <- {path}:{where.lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("warn")  # in torch 2.11 switching it on counted as one sync
        warnings.simplefilter("always")
        warnings.showwarning = record
        try:
            for _ in range(steps):
                call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return len(sites) / steps, sorted(set(sites))
