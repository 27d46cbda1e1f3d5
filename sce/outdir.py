"""An output folder: checked writable before any work, held by one run at a time, and, for the evaluation
scripts, bound to the trunk and data it evaluates.

The hold is an OS lock (flock) on DIR/.lock, kept open for the life of the run: the kernel releases it
however the run ends (an error, kill -9, a lost node), so a stale lock never blocks the next run."""
import fcntl
import glob
import hashlib
import json
import os
import socket
import sys

import torch

from sce import UserError, remove_stale, write_file

LOCK = ".lock"
EVALUATED = "evaluated.json"  # what the evaluation scripts' output folder holds results of


def prepare(path):
    """Create `path` and check that data reaches its disk, else one line naming --output-dir (and what is in the way:
    a file, a link to nothing)."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test{os.getpid()}")
        try:  # data, not an empty file (an inode, which a full disk still has), down to the disk
            with open(probe, "wb") as f:
                f.write(bytes(64 * 1024))
                f.flush()
                os.fsync(f.fileno())
        finally:
            if os.path.exists(probe):
                os.remove(probe)
    except OSError as e:
        blocked = in_the_way(path)
        if blocked:
            raise UserError(f"output dir {path} cannot be made: {blocked} is " + (
                f"a link to {os.readlink(blocked)}, which does not exist: create that folder"
                if os.path.islink(blocked) else "a file, not a folder: remove it") + ", or pass another --output-dir") \
                from None
        raise UserError(f"output dir {path} is not writable ({e.strerror}): pass another --output-dir") from None


def in_the_way(path):
    """The first of `path` and the folders above it that is there but no folder (a file, a link to nothing), or
    None."""
    path = os.path.abspath(path)
    above = [path]
    while os.path.dirname(above[-1]) != above[-1]:
        above.append(os.path.dirname(above[-1]))
    return next((p for p in reversed(above) if os.path.lexists(p) and not os.path.isdir(p)), None)


def same_path(a, b):
    """Whether two paths name one file or folder, through links (data given by another path to it)."""
    return os.path.realpath(a) == os.path.realpath(b)


# what a writer killed mid-write leaves, by the mark before its PID: sce.temporary's, link_atomic's, prepare's
LEFTOVERS = {".tmp": ".*.tmp[0-9]*", ".link": ".*.link[0-9]*", ".write_test": ".write_test[0-9]*"}


class Lock:
    """Holds `path` for this process until release() (or the process's end). A folder another process holds is
    a one-line error naming it; DIR/.lock says who holds it (PID, host, command). Once held, what writers killed
    mid-write left there is removed (a checkpoint's temporary file or second name: its size), whether this run writes
    again or not (a complete one does not)."""

    def __init__(self, path):
        self.fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 4096, 0).decode(errors="replace").strip() or "a process"
            os.close(self.fd)
            raise UserError(f"{path} is in use by another run ({holder}): wait for it to end or stop it, or pass "
                            "another --output-dir") from None
        command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200]
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"PID {os.getpid()} on {socket.gethostname()}: {command}\n".encode(), 0)
        for mark, pattern in LEFTOVERS.items():  # of processes gone, or whose PID another has now (remove_stale)
            remove_stale(glob.glob(os.path.join(glob.escape(path), pattern)), mark, mine=False)

    def release(self):
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor of the open file releases the lock
            self.fd = None


def write_json(path, obj):
    """json.dump to a temporary file beside `path`, renamed over it: a stop, a kill or a full disk never leaves half
    a file; a failure is one line."""
    try:
        write_file(path, json.dumps(obj, indent=1))
    except OSError as e:
        raise UserError(f"could not write {path} ({e.strerror}): free some space and run the same command again") \
            from None


def trunk_digest(trunk):
    """A short hash of a trunk's weights and BN statistics (what an evaluation's numbers depend on)."""
    h = hashlib.blake2b(digest_size=8)
    for key, value in sorted(trunk.state_dict().items()):
        if not key.startswith("fc."):
            h.update(key.encode())
            h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def bind_evaluation(path, pretrained, trunk, dataset, data):
    """Bind the folder to (trunk, data): a folder holding the results of another trunk or other data is a
    one-line error, before any work replaces them. The same trunk and data may be evaluated again there
    (a rerun, another classifier)."""
    mine = dict(trunk=trunk_digest(trunk), pretrained=os.path.abspath(pretrained), dataset=dataset,
                data=os.path.abspath(data))
    file = os.path.join(path, EVALUATED)
    if os.path.isfile(file):
        with open(file) as f:
            theirs = json.load(f)
        if theirs.get("trunk") != mine["trunk"]:
            raise UserError(f"{path} holds the evaluation of another trunk ({theirs.get('pretrained')}; "
                            f"{pretrained} has other weights): pass another --output-dir")
        if theirs.get("dataset") != dataset or not same_path(theirs.get("data", ""), data):
            raise UserError(f"{path} holds an evaluation on other data (--dataset {theirs.get('dataset')} --data "
                            f"{theirs.get('data')}): pass another --output-dir")
        return
    write_json(file, mine)
