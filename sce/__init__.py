"""Similarity Contrastive Estimation (SCE) and its baselines MoCo v2 and ReSSL."""
import ctypes
import glob
import json
import math
import os
import signal
import stat

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped by a signal (after saving); run the same command to continue
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # SLURM's and torchrun's, and Ctrl-C
# the normalisation the data path feeds every trunk, whatever the dataset (sce.data.ops): ImageNet's statistics; a
# trunk trained with others is fed those (sce.checkpoint.renormalize)
FED_MEAN, FED_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class UserError(Exception):
    """A mistake the user can fix (path, flag, file): scripts print it as one line, no traceback."""


def stopped_during_startup(name):
    """The line of a stop signal `name` before a run's loop took the signals over (sce.preemption)."""
    return (f"=> stopped by {name} during start-up, before any training: nothing to save; run the same command "
            f"again to start (exiting with code {PREEMPTED_EXIT_CODE})")


def stop_while_importing(script):
    """A script's first call (`script`: run as one, not imported), before its imports, torch's of seconds among them:
    until sce.entry.run takes the stop signals over, one ends the process at once with its line and
    PREEMPTED_EXIT_CODE, as later in the start-up, where it would die silently (SIGTERM, SIGUSR1) or with a
    traceback (Ctrl-C). Nothing has begun: nothing is left to clean up."""
    def stop(signum, frame):
        os.write(1, (stopped_during_startup(signal.Signals(signum).name) + "\n").encode())  # no print: reentrant
        os._exit(PREEMPTED_EXIT_CODE)
    if script:
        for sig in STOP_SIGNALS:
            signal.signal(sig, stop)


def temporary(path):
    """The temporary file a write of `path` goes through before its rename (hidden, beside it, named after this
    process), once those of writers killed mid-write (SIGKILL, the out-of-memory killer) are removed: a checkpoint's
    would fill the disk; so are the second names of checkpoints such a writer was making in the folder (.NAME.linkPID,
    sce.checkpoint.link_atomic). A live process's is its write in progress."""
    folder, name = os.path.split(os.path.abspath(path))
    remove_stale(glob.glob(os.path.join(folder, f".{glob.escape(name)}.tmp*")), ".tmp", mine=True)
    remove_stale(glob.glob(os.path.join(folder, ".*.link[0-9]*")), ".link", mine=False)
    return os.path.join(folder, f".{name}.tmp{os.getpid()}")


def remove_stale(paths, mark, mine):
    """Remove each of `paths` (NAME + mark + PID) of a process gone (or one that started after the file was last
    written: another that got its PID again), or not named after a PID; `mine`: this process's too (a file of its own
    write of the same name, which it is starting again)."""
    for stale in paths:
        pid = stale.rsplit(mark, 1)[1]
        try:
            if not pid.isdigit() or (mine and int(pid) == os.getpid()) or \
                    not alive(int(pid), since=os.lstat(stale).st_mtime):
                os.remove(stale)
        except OSError:  # gone meanwhile
            pass


def write_file(path, text):
    """`text` into a temporary file beside `path` (temporary), renamed over it: a kill never leaves half a file, and
    a failed write (a full disk) leaves the previous one whole, removes its temporary file and raises its OSError."""
    tmp = temporary(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_text(path):
    """The text of a file a run wrote (log.txt, timing.txt), or one line why not: a FIFO, a device or a folder is
    refused, never waited on (opened without blocking), and so is a file that is not UTF-8."""
    try:
        with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK)) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise UserError(f"cannot read {path}: not a regular file (a FIFO, a device, a socket)")
            data = f.read()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"cannot read {path}: line {line} is not UTF-8 text") from None


def json_lines(path, what):
    """(line number, JSON value) of each non-blank line of `path`; a line that is not JSON (a number of more digits
    than Python reads, nesting past its recursion limit) is one line naming it and `what` it should be."""
    rows = []
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if line.strip():
            try:
                rows.append((number, json.loads(line)))
            except (ValueError, RecursionError):
                raise UserError(f"line {number} of {path} is not {what}") from None
    return rows


def finite(value):
    """`value` as a float where it is a finite number (not a bool, nor an integer past a float's range), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # 400 digits
        return None
    return value if math.isfinite(value) else None


def alive(pid, since=None):
    """Whether process `pid` runs on this machine (a zombie its parent has not reaped yet has ended); since: a time
    (a file's mtime) it must have been running at: a process started later got the PID of one gone (Linux). Here,
    without torch: benchmarks/reproduction/reproduce_tools.py asks it too."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return fields[0] != "Z" and (since is None or started(int(fields[19])) <= since + 2)  # btime's 1 s steps
        except FileNotFoundError:
            return False
        except OSError:  # reaped between the open and the read: ask the kernel
            pass
    try:  # no /proc: whether the process exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def started(ticks):
    """The time (epoch seconds) of a process start given in clock ticks since boot (/proc/PID/stat's 22nd field)."""
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


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
