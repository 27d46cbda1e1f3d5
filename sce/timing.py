"""Where a stage's wall time went, from the process's start: start-up (to its first training step), compiling,
training steps, epoch ends, kNN, evaluation and exit. The parts add up to the wall time: `steps` is what the
training loop took besides the other parts. Each run prints its split at its end and appends it to
OUTPUT_DIR/timing.txt (one JSON line an invocation)."""
import json
import os
import time

PARTS = ["startup", "compiling", "steps", "epoch_ends", "knn", "evaluation", "exit"]
_IMPORTED = time.time()


STARTED = None  # when this process started, once a script's entry point (sce.cli.run) says so
MARKS = []  # (name, time) of mark(): the parts of start-up


def mark(name):
    """The end of a part of start-up: `name` took the time since the previous mark (or the process's start)."""
    MARKS.append((name, time.time()))


def process_start():
    """The wall-clock time this process started at (Linux: from /proc; elsewhere, when this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


class Split:
    """The parts of this process's wall time. loop() marks the start of the training loop (the end of start-up), done()
    its end; timed(name, fn) and add(name, seconds) measure parts inside it. Compiling is every compile noted in
    `compiles` (a sce.compiling.Log) during the loop, plus what add("compiling") says the Log could not see (a
    backward's compile, a CUDA graph's capture); a timed part leaves its compiles to it."""

    def __init__(self, compiles):
        self.start, self.compiles = STARTED or time.time(), compiles  # a script's process, or this run (a test's)
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.loop_start = self.loop_end = None
        self.logged_at_loop = 0.0

    def loop(self):
        if self.loop_start is None:
            self.loop_start, self.logged_at_loop = time.time(), self.compiles.total()

    def add(self, name, seconds):
        self.seconds[name] += seconds

    def timed(self, name, fn, *args, **kwargs):
        """fn(*args, **kwargs), its wall time added to `name`, less what compiled in it."""
        logged, start = self.compiles.total(), time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[name] += time.time() - start - (self.compiles.total() - logged)

    def done(self):
        if self.loop_start is not None and self.loop_end is None:
            self.loop_end = time.time()

    def report(self):
        """({part: seconds}, wall time so far): the parts add up to the wall time."""
        now = time.time()
        parts, wall = dict(self.seconds), now - self.start
        if self.loop_start is None:  # no training loop: all of it start-up
            return dict(parts, startup=wall), wall
        end = self.loop_end or now
        parts["compiling"] += self.compiles.total() - self.logged_at_loop
        parts["startup"] = self.loop_start - self.start
        inside = sum(parts[p] for p in PARTS if p not in ("startup", "steps", "exit"))
        parts["steps"] = max(0.0, end - self.loop_start - inside)
        parts["exit"] = now - end
        return parts, wall

    def startup_parts(self):
        """{part: seconds} of start-up, from the marks between this process's start and the training loop's; the
        time after the last mark is "rest"."""
        end, parts, last = self.loop_start or time.time(), {}, self.start
        for name, at in MARKS:
            if self.start <= at <= end:
                parts[name], last = parts.get(name, 0.0) + at - last, at
        return dict(parts, rest=end - last) if parts else {}

    def write(self, output_dir, **fields):
        """Print the split and append it to OUTPUT_DIR/timing.txt (with `fields`); returns the line's dict."""
        parts, wall = self.report()
        startup = self.startup_parts()

        def said(name):
            text = f"{name.replace('_', ' ')} {parts[name]:.1f} s"
            if name == "startup" and startup:
                text += " (" + ", ".join(f"{k} {v:.1f}" for k, v in startup.items()) + ")"
            return text
        shown = ", ".join(said(name) for name in PARTS if parts[name] >= 0.05)
        print(f"=> wall time {wall:.1f} s: {shown or 'nothing measured'}", flush=True)
        line = dict(fields, wall_s=round(wall, 3), **{f"{p}_s": round(parts[p], 3) for p in PARTS},
                    startup_parts={k: round(v, 3) for k, v in startup.items()})
        with open(os.path.join(output_dir, "timing.txt"), "a") as f:
            f.write(json.dumps(line) + "\n")
        return line
