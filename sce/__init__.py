"""Similarity Contrastive Estimation (SCE) and its baselines MoCo v2 and ReSSL."""
import os


class UserError(Exception):
    """A mistake the user can fix (path, flag, file): scripts print it as one line, no traceback."""


def alive(pid):
    """Whether process `pid` runs on this machine (a zombie its parent has not reaped yet has ended). Here, without
    torch: benchmarks/reproduce_tools.py asks it too."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
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
