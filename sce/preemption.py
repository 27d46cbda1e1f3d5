"""Preemption: SIGTERM / SIGUSR1 (SLURM, torchrun) or SIGINT (Ctrl-C) make every rank stop at the next
check (every CHECK_STEPS steps at most), save and exit 75. A second Ctrl-C stops at once, unsaved (Interrupted:
exit 130, one line). Before a run's loop takes them over (Preemption), the same signals stop the start-up at once
(Stopped: exit 75, one line, nothing to save)."""
import ctypes
import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist

from sce import PREEMPTED_EXIT_CODE, STOP_SIGNALS
from sce import distributed as du

CHECK_STEPS = 10  # steps between checks for a stop request (fewer with a smaller --print-freq)
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: a second Ctrl-C, the save in progress not waited for


def ignore_stop_signals(worker_id=None):
    """worker_init_fn of every loader: SLURM signals every process of the job, and Ctrl-C every process of
    the terminal's group; a worker that died of it would fail the batch its rank waits for. The workers
    leave the saving to their rank, and end with it (end_with_parent)."""
    end_with_parent()
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_parent(worker_id=None):
    """The kernel kills this process (SIGKILL) once its parent is gone, however it went (kill -9, the out-of-memory
    killer): a loader worker is never left orphaned (torch's own check of the parent, every 5 s between batches,
    never comes in a busy, stopped or swapping worker). Linux; the parent is the thread that started the worker, the
    main one. A parent already gone: leave at once."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # no prctl: not Linux
        return
    if os.getppid() != parent:
        os._exit(1)


class Interrupted(BaseException):
    """A second Ctrl-C after a stop request: the run leaves at once, not waiting for the save in progress (sce.entry.run
    says so in one line). Not an Exception, as KeyboardInterrupt is not: no `except Exception` holds it up."""


class Stopped(BaseException):
    """A stop signal during start-up, before the run's loop took the stop signals over: nothing to save. Not an
    Exception, as Interrupted is not: the handlers of unreadable images, checkpoints and batches let it through."""


def stop_during_startup():
    """Until a Preemption takes them over, each stop signal raises Stopped where the process is (sce.entry.run turns
    it into exit PREEMPTED_EXIT_CODE and one line): preloading or listing a dataset stops at once."""
    def handler(signum, frame):
        raise Stopped(signal.Signals(signum).name)
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


class Preemption:
    """A stop signal asks every rank to save at the end of a step and exit."""

    def __init__(self, world_size, timeout_s):
        self.flag = torch.zeros(1)
        # a CPU (gloo) group agrees on the flag without syncing the GPU stream; new_group
        # does not inherit --dist-timeout (it defaults to 30 min), so a hung peer would hang us here
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)) \
            if world_size > 1 else None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        if signum == signal.SIGINT and self.flag.item():  # Ctrl-C twice: the user will not wait for the save
            for sig in STOP_SIGNALS:  # (SIGTERM twice is one request: torchrun forwards SLURM's to ranks it reached)
                signal.signal(sig, signal.SIG_IGN)
            raise Interrupted
        self.flag.fill_(1)

    def requested(self):
        if self.group is None:
            return bool(self.flag.item())
        flag = self.flag.clone()
        dist.all_reduce(flag, group=self.group)
        return bool(flag.item())

    def stop_within_epoch(self, done, steps, print_freq):
        """After `done` of an epoch's `steps` steps: whether every rank stops here, mid-epoch. A stop request is
        agreed (a gloo all_reduce) every min(print_freq, CHECK_STEPS) steps, not at every step; never at the
        epoch's last step, after which the epoch's end saves and looks again."""
        return done % min(print_freq, CHECK_STEPS) == 0 and done < steps and self.requested()

    def exit(self, writer):
        """Leave with PREEMPTED_EXIT_CODE once saved. Later signals are ignored: torchrun re-sends
        SIGTERM to a rank whose peer exited first, and Python restores the default (fatal) handler
        while shutting down, which turned 75 into death by SIGTERM."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if writer:
            writer.close()  # flush this run's last scalars
        du.cleanup()
        sys.exit(PREEMPTED_EXIT_CODE)


def stop(preemption, tensorboard, said, save=None):
    """The one way a run leaves on a stop request, pretraining's and the linear probe's: on rank 0, save() (the
    state, written and waited for) and a line `=> preempted: saved {said}`; then every rank leaves with
    PREEMPTED_EXIT_CODE."""
    if du.is_main():
        if save:
            save()
        print(f"=> preempted: saved {said}; exiting with code {PREEMPTED_EXIT_CODE}", flush=True)
    du.barrier()
    preemption.exit(tensorboard)
