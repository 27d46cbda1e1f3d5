"""Process-group helpers: one process per GPU under torchrun, or one plain process."""
import datetime
import inspect
import os

import torch
import torch.distributed as dist


def init(backend=None, timeout_s=600):
    """Join the process group torchrun describes; a plain `python` run stays single-process.

    Returns (rank, world_size, local_rank, device).
    """
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, 0, device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    # a finite timeout turns a dead peer into an error instead of a hang
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), local_rank, device


def device_memory(device):
    """Bytes of memory on `device`: a GPU's own, else this machine's (its physical pages; a container's limit is not
    seen here)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def is_dist():
    return dist.is_available() and dist.is_initialized()


def rank():
    return dist.get_rank() if is_dist() else 0


def world_size():
    return dist.get_world_size() if is_dist() else 1


def is_main():
    return rank() == 0


@torch.no_grad()
def all_gather(x):
    """Concatenate x from every rank along dim 0 (no gradient); identity on one process."""
    if not is_dist():
        return x
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out)


def all_gather_object(obj):
    """[obj of rank 0, obj of rank 1, ...]; [obj] on one process."""
    if not is_dist():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(x, src=0):
    if is_dist():
        dist.broadcast(x, src)
    return x


def all_reduce_sum(x):
    if is_dist():
        dist.all_reduce(x)
    return x


def barrier():
    if is_dist():
        dist.barrier()


def wrap_ddp(model, device):
    """DDP that leaves buffers alone: the queue is identical on all ranks by construction (all_gather)
    and BN running statistics stay rank-local, as in MoCo (rank 0's are saved). torch 2.13 renamed
    the flag."""
    ddp = torch.nn.parallel.DistributedDataParallel
    no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(ddp).parameters
               else {"broadcast_buffers": False})
    return ddp(model, device_ids=[device.index] if device.type == "cuda" else None, **no_sync)


def cleanup():
    if is_dist():
        dist.destroy_process_group()
