"""Preemption: SIGTERM / SIGUSR1 (SLURM, torchrun) or SIGINT (Ctrl-C) make every rank stop at the next
check (every CHECK_STEPS steps at most), save and exit 75. A second Ctrl-C stops at once, unsaved (Interrupted:
exit 130, one line). Before a run's loop takes them over (Preemption), the same signals stop the start-up at once
(Stopped: exit 75, one line, nothing to save).

Every handler records the stop before anything else (received): a raise the interpreter drops (one landing in a
finalizer, an at-fork hook, a thread's start) still stops the run at its next safe point (check), and sce.entry.run
exits 75 on an error that follows it. Within safe_points (feature extraction, where a raise inside a DataLoader's
start or teardown is lost or breaks the iterator) the start-up handler only records; the phase stops between its
batches."""
import contextlib
import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist

from sce import PREEMPTED_EXIT_CODE, STOP_SIGNALS, end_with_parent, stopped_during_startup
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



class Interrupted(BaseException):
    """A second Ctrl-C after a stop request: the run leaves at once, not waiting for the save in progress (sce.entry.run
    says so in one line). Not an Exception, as KeyboardInterrupt is not: no `except Exception` holds it up."""


class Stopped(BaseException):
    """A stop signal before a run's loop took the stop signals over (or in an evaluation, which has none): nothing to
    save. `phase`: the safe point's phase that stopped it (None: the start-up). Not an Exception, as Interrupted is
    not: the handlers of unreadable images, checkpoints and batches let it through."""

    def __init__(self, name, phase=None):
        super().__init__(name)
        self.name, self.phase = name, phase

    def line(self):
        if self.phase is None:
            return stopped_during_startup(self.name)
        return (f"=> stopped by {self.name} while {self.phase}: nothing to save; run the same command again to start "
                f"it again (exiting with code {PREEMPTED_EXIT_CODE})")


_stop = None  # the name of the first stop signal the start-up handler took, recorded before its raise
_stop_phase = None  # the safe_points' phase it came in (None: none)
_active = None  # the Preemption that took the stop signals over, if any
_phases = []  # (phase, record_only) of the safe_points we are in, innermost last
_owner = None  # the process whose handlers these are: a child forked before it set its own ignores them
_done = False  # the work is done and saved (finished): a later stop is only recorded


def stop_during_startup():
    """Until a Preemption takes them over, each stop signal raises Stopped where the process is (sce.entry.run turns
    it into exit PREEMPTED_EXIT_CODE and one line): preloading or listing a dataset stops at once. The record of
    earlier stops is cleared: a new run begins."""
    global _stop, _active, _owner, _done
    _stop, _active, _owner, _done = None, None, os.getpid(), False
    _phases.clear()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _startup_handler)


def _startup_handler(signum, frame):
    global _stop, _stop_phase
    if os.getpid() != _owner:  # a loader worker before its worker_init_fn: its parent stops
        return
    again = _stop is not None
    if not again:
        _stop, _stop_phase = signal.Signals(signum).name, _phase()
    if _done or (_phases and _phases[-1][1] and not (again and signum == signal.SIGINT)):  # a second Ctrl-C: at once
        return
    raise Stopped(_stop, _phase())


def _phase():
    return _phases[-1][0] if _phases else None


def received():
    """The name of the stop signal this process received since its run began, or None."""
    return _stop or (_active.received if _active else None)


def pending(phase=None):
    """The Stopped of a stop signal that came before and is not yet honoured, whatever swallowed its raise (a
    finalizer, an at-fork hook), or None; None too while a Preemption holds the signals (its loop looks at its own
    points) or once the work is done. `phase`: what it stops (default: the phase the stop came in, else the
    innermost safe_points' phase)."""
    if _stop and not _active and not _done:
        return Stopped(_stop, phase or _stop_phase or _phase())
    return None


def check(phase=None):
    """A safe point: raise the pending Stopped, if any."""
    stop = pending(phase)
    if stop:
        raise stop


@contextlib.contextmanager
def safe_points(phase, record_only=True):
    """A phase that stops at its safe points (check: between its batches, its values of C; and at its end): within,
    the start-up handler records a stop without raising it (a raise inside a DataLoader's start or teardown would be
    dropped or leave a broken iterator); a second Ctrl-C still stops at once. record_only=False: the handler raises
    too (a long fit stops at once), and the safe points stop what a finalizer dropped. `phase`: what the stop line
    says it stopped, e.g. "extracting the train features" (None: the start-up)."""
    _phases.append((phase, record_only))
    try:
        yield
    finally:
        _phases.pop()
    check(phase)


def finished():
    """The run's work is done and saved: a stop signal from now on is recorded, not raised, and sce.entry.run exits 0
    saying it came after the work."""
    global _done
    _done = True


def forget():
    """The end of a run (sce.entry.run): its record of stops is dropped, for the next run in this process."""
    global _stop, _active, _done
    _stop, _active, _done = None, None, False
    _phases.clear()


class Preemption:
    """A stop signal asks every rank to save at the end of a step and exit."""

    def __init__(self, world_size, timeout_s):
        global _active
        check()  # a stop the start-up dropped (its raise landed in a finalizer): nothing trained yet to save
        self.flag, self.received, self.owner = torch.zeros(1), None, os.getpid()
        # a CPU (gloo) group agrees on the flag without syncing the GPU stream; new_group
        # does not inherit --dist-timeout (it defaults to 30 min), so a hung peer would hang us here
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)) \
            if world_size > 1 else None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)
        _active = self

    def _handler(self, signum, frame):
        if os.getpid() != self.owner:  # a loader worker before its worker_init_fn: its parent stops
            return
        self.received = self.received or signal.Signals(signum).name
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
