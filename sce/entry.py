"""The entry point of every script (`if __name__ == "__main__": entry.run(main)`): one-line UserErrors, torchrun's
error files, the stop signals before the run's loop, no loader worker left behind, a quick exit."""
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from sce import UserError, alive, preemption, timing
from sce.preemption import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, Interrupted, Stopped, stop_during_startup


class _ErrorFile(ErrorHandler):
    """torch's error file, behind torchrun's failure summary ("Root Cause": the rank whose error
    file has the earliest timestamp). A UserError is written as the line the rank printed, in the
    file's documented format, instead of a traceback."""

    def record_exception(self, e):
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torchrun for each worker
        if not isinstance(e, UserError) or not path:
            return super().record_exception(e)
        with open(path, "w") as f:
            json.dump({"message": {"message": f"UserError: {e}", "extraInfo": {
                "py_callstack": f"error: {e}", "timestamp": str(int(time.time()))}}}, f)


def run(main):
    """Entry point of every script: `if __name__ == "__main__": entry.run(main)`.

    main() runs under torch's error recording (torch.distributed.elastic's `record`): under
    torchrun a failing rank writes the error file that torchrun's summary reads, so the summary
    names the first rank that failed and its message, whatever its peers raise next. A UserError
    then ends as one line `error: ...` on stderr, exit status 1, no traceback; any other exception
    keeps its traceback. A stop signal before the run's loop takes the signals over ends it at once with
    PREEMPTED_EXIT_CODE and one line (sce.preemption.Stopped); a second Ctrl-C after a stop request, with
    INTERRUPTED_EXIT_CODE and one line (sce.preemption.Interrupted). A stop whose raise was dropped (in a finalizer,
    an at-fork hook) is still one: an error after it is that stop (exit 75, its line), and a run that ends after it
    says so (exit 0: the work was done). Whatever the exit, its loader workers end with it, and the process leaves at
    once (leave)."""
    timing.STARTED = timing.process_start()  # the split's start-up counts the interpreter's and the imports'
    stop_with_parent()
    stop_during_startup()
    hook, sys.unraisablehook = sys.unraisablehook, quiet_stops(sys.unraisablehook)
    try:
        record(main, _ErrorFile())()
        code = 0
        if preemption.received():
            print(f"=> {preemption.received()} came after the work was done: everything is saved, nothing is left "
                  "to continue (exiting with code 0)", flush=True)
    except Stopped as e:
        print(e.line(), flush=True)
        code = PREEMPTED_EXIT_CODE
    except Exception as e:
        code = stopped_by(e)
        if code is None:
            raise
    except Interrupted:
        print("=> interrupted again: leaving at once, without waiting for the checkpoint being written (it is dropped, "
              "the previous one is kept); run the same command again to continue from that one (exiting with code "
              f"{INTERRUPTED_EXIT_CODE})", flush=True)
        code = INTERRUPTED_EXIT_CODE
    except SystemExit as e:
        code = e.code
    finally:
        end_workers()
        preemption.forget()
        sys.unraisablehook = hook
    leave(code)


def stopped_by(error):
    """The exit of a run that failed with `error`: the stop's (its line said) when a stop signal came before, whose
    raise was dropped (the error may be what it broke), else a UserError's one line, else None (a traceback)."""
    stop = preemption.pending()
    if stop:
        print(stop.line(), flush=True)
        return PREEMPTED_EXIT_CODE
    return f"error: {one_line(error)}" if isinstance(error, UserError) else None


def quiet_stops(hook):
    """sys.unraisablehook that drops a stop raised where the interpreter cannot raise it (a finalizer): it is
    recorded (sce.preemption), and the run stops at its next safe point, without a traceback."""
    def quiet(unraisable):
        if not isinstance(unraisable.exc_value, (Stopped, Interrupted)):
            hook(unraisable)
    return quiet


EXIT_AT_ONCE = True  # False where the scripts run inside another program (the tests)


def leave(code):
    """sys.exit(code), but in a script's own process at once: the interpreter's teardown of torch and torchvision
    takes one or two seconds and does nothing a finished run needs (its files are closed and its checkpoints
    written, its loader workers ended)."""
    if not EXIT_AT_ONCE:
        if code not in (0, None):
            sys.exit(code)
        return
    if isinstance(code, str):  # sys.exit's way with a message
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if code is None else code)


def one_line(error):
    """A UserError's message. Raised in a loader worker, torch raises it again in the main process with the
    worker's traceback as its message: the last line, the error's own, is kept."""
    text = str(error).strip()
    if "Original Traceback" not in text:
        return text
    return re.sub(r"^[\w.]+: ", "", text.splitlines()[-1])  # without the exception's name


PARENT_PID = "SCE_PARENT_PID"  # set by benchmarks/reproduction/reproduce.sh: its stages stop when it dies


def stop_with_parent():
    """With SCE_PARENT_PID set, a thread sends this process SIGTERM once that process has ended (gone, or a
    zombie its own parent has not reaped yet), or once this process's parent changed (it was reparented): a
    stage of a killed reproduce.sh saves and stops (before training, just stops) instead of training on, orphaned."""
    watched = os.environ.pop(PARENT_PID, None)
    if not watched:
        return
    parent = os.getppid()

    def watch():
        while os.getppid() == parent and alive(int(watched)):
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=watch, daemon=True, name="stop-with-parent").start()


def end_workers():
    """Kill the loader workers still running (they hold no state). Pretraining's ignore SIGTERM
    (sce.preemption), and after an error their DataLoader is still referenced by the traceback, so
    multiprocessing's exit hook, which sends SIGTERM and joins, would wait for them forever."""
    children = multiprocessing.active_children()
    if not children:
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would raise "worker killed" over the exit
    for p in children:
        p.kill()
    for p in children:
        p.join(10)
