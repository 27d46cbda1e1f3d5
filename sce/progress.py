"""Progress lines: images done, images/s since the last report, and the ETA."""
import math
import time


def format_eta(seconds):
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Images done out of `total`, images/s since the previous report and the ETA at the mean rate
    since the start: `update(n)` after each batch, `report()` for the text."""

    def __init__(self, total):
        self.total, self.done = total, 0
        self.start = self.mark = time.time()
        self.mark_done = 0

    def update(self, n):
        self.done += n

    def report(self):
        now = time.time()
        rate = (self.done - self.mark_done) / max(now - self.mark, 1e-9)
        mean = self.done / max(now - self.start, 1e-9)
        self.mark, self.mark_done = now, self.done
        eta = (self.total - self.done) / mean if self.done else math.inf
        return f"{self.done}/{self.total} images, {rate:.0f} images/s, ETA {format_eta(eta)}"
