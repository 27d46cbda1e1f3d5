"""Where a stage's wall time went, from the process's start: start-up (to its first training step), compiling,
training steps, epoch ends, kNN, evaluation and exit. The parts add up to the wall time: `steps` is what the
training loop took besides the other parts. Each part but those two is kept by what spends it: compiling by the
run's sce.compiling.Log, the epoch ends by the checkpoint Writer, the kNN by its Monitor, the probe's evaluation
by its validation, each through a Stopwatch the Split hands it. Each run writes its split to OUTPUT_DIR/timing.txt
(one JSON line an invocation) at each epoch's end, replacing its own line (a kill leaves the split up to its last
epoch), and at its end, where it prints it too. A timing.txt that is not such lines (damaged, crafted) is set aside
as timing.txt.damaged, in one line, and the split starts afresh: a time split never fails a run."""
import json
import os
import time

from sce import UserError, finite, json_lines, write_file

PARTS = ["startup", "compiling", "steps", "epoch_ends", "knn", "evaluation", "exit"]
OWNED = ["epoch_ends", "knn", "evaluation"]  # the parts their owners time (Split.stopwatch)
LINE = "an invocation's JSON line (sce.timing)"
_IMPORTED = time.time()


STARTED = None  # when this process started, once a script's entry point (sce.entry.run) says so


def lines(output_dir, but=None):
    """The lines of OUTPUT_DIR/timing.txt, one an invocation, as dicts, but the line `but` (this invocation's, as it
    wrote it); none where there is no file. A line that is not an invocation's (a damaged or crafted file: not JSON, a
    part's seconds not a finite number) is a UserError naming it."""
    path = os.path.join(output_dir, "timing.txt")
    rows = json_lines(path, LINE) if os.path.lexists(path) else []
    for number, row in rows:
        if not isinstance(row, dict):
            raise UserError(f"line {number} of {path} is not {LINE}")
        for key in [f"{part}_s" for part in ["wall", *PARTS]]:
            seconds = finite(row.get(key, 0.0))
            if seconds is None or seconds < 0:
                raise UserError(f"line {number} of {path} is not {LINE}: its {key} is not a number of seconds")
    mine = json.loads(but) if but else None
    return [row for _, row in rows if row != mine]


def set_aside(path):
    """Rename `path` to a free name beside it, PATH.damaged (then .damaged2, ...); that name."""
    for n in range(1, 1000):
        aside = f"{path}.damaged{n if n > 1 else ''}"
        if not os.path.lexists(aside):
            os.rename(path, aside)
            return aside
    raise OSError(f"no free name for {path}.damaged")


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


class Stopwatch:
    """The seconds its owner spent in the calls it timed, less what compiled in them (noted in `compiles`, a
    sce.compiling.Log: compiling's part)."""

    def __init__(self, compiles=None):
        self.seconds, self.compiles = 0.0, compiles

    def timed(self, fn, *args, **kwargs):
        logged, start = self._compiled(), time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.time() - start - (self._compiled() - logged)

    def _compiled(self):
        return self.compiles.total() if self.compiles is not None else 0.0


class Split:
    """The parts of this process's wall time. mark(name) ends a part of start-up, loop() starts the training loop (the
    end of start-up), done() ends it; stopwatch(part) is what the owner of an OWNED part times its calls with, of
    which the loop's and what follows it count (before it, start-up's; after it, not exit's: the demo's last kNN).
    Compiling is everything noted in `compiles` (a sce.compiling.Log) during the loop: each compile, the rest of a step
    that compiled (its backward's compile), a CUDA graph's capture; an owner's stopwatch leaves its compiles to it."""

    def __init__(self, compiles):
        self.start, self.compiles = STARTED or time.time(), compiles  # a script's process, or this run (a test's)
        self.owned = {part: Stopwatch(compiles) for part in OWNED}
        self.marks = []  # (name, time) of mark(): the parts of start-up
        self.loop_start = self.loop_end = None
        self.logged_at_loop = 0.0
        self.owned_at_loop = self.owned_at_end = None  # the owned parts' seconds at the loop's start, at its end
        self.written = None  # this invocation's line of timing.txt, once written

    def mark(self, name):
        """The end of a part of start-up: `name` took the time since the previous mark (or the process's start)."""
        self.marks.append((name, time.time()))

    def stopwatch(self, part):
        return self.owned[part]

    def loop(self):
        if self.loop_start is None:
            self.loop_start, self.logged_at_loop, self.owned_at_loop = time.time(), self.compiles.total(), self._owned()

    def done(self):
        if self.loop_start is not None and self.loop_end is None:
            self.loop_end, self.owned_at_end = time.time(), self._owned()

    def _owned(self):
        return {part: watch.seconds for part, watch in self.owned.items()}

    def report(self):
        """({part: seconds}, wall time so far): the parts add up to the wall time."""
        now = time.time()
        parts, wall = dict.fromkeys(PARTS, 0.0), now - self.start
        if self.loop_start is None:  # no training loop: all of it start-up
            return dict(parts, startup=wall), wall
        parts.update({p: seconds - self.owned_at_loop[p] for p, seconds in self._owned().items()})
        end = self.loop_end or now
        after_loop = sum(self.owned[p].seconds - self.owned_at_end[p] for p in OWNED) if self.loop_end else 0.0
        parts["compiling"] = self.compiles.total() - self.logged_at_loop
        parts["startup"] = self.loop_start - self.start
        inside = sum(parts[p] for p in ["compiling", *OWNED]) - after_loop
        parts["steps"] = max(0.0, end - self.loop_start - inside)
        parts["exit"] = now - end - after_loop
        return parts, wall

    def startup_parts(self):
        """{part: seconds} of start-up, from the marks between this process's start and the training loop's; the
        time after the last mark is "rest"."""
        end, parts, last = self.loop_start or time.time(), {}, self.start
        for name, at in self.marks:
            if self.start <= at <= end:
                parts[name], last = parts.get(name, 0.0) + at - last, at
        return dict(parts, rest=end - last) if parts else {}

    def save(self, output_dir, **fields):
        """This invocation's line of OUTPUT_DIR/timing.txt (with `fields`), written anew in place of its previous one;
        a failure (a full disk) is said in one line, never raised: the run's own error, if any, is the one to see.
        Returns the line's dict."""
        parts, wall = self.report()
        line = dict(fields, wall_s=round(wall, 3), **{f"{p}_s": round(parts[p], 3) for p in PARTS},
                    startup_parts={k: round(v, 3) for k, v in self.startup_parts().items()})
        path, text = os.path.join(output_dir, "timing.txt"), json.dumps(line)
        try:
            write_file(path, "".join(f"{json.dumps(row)}\n" for row in self.earlier(output_dir)) + text + "\n")
            self.written = text
        except OSError as e:
            print(f"=> could not write {path} ({e.strerror}): this invocation's time split is not kept", flush=True)
        return line

    def earlier_wall(self, output_dir):
        """The wall time of the stage's earlier invocations, as OUTPUT_DIR/timing.txt has them."""
        return sum(row.get("wall_s", 0.0) for row in self.earlier(output_dir))

    def earlier(self, output_dir):
        """The lines of the stage's earlier invocations (lines). A timing.txt that cannot be read as such is said in
        one line, kept aside (set_aside) and the split starts afresh: a time split never stops a run."""
        try:
            return lines(output_dir, but=self.written)
        except UserError as e:
            path = os.path.join(output_dir, "timing.txt")
            try:
                aside = f"kept as {set_aside(path)}"
            except OSError as why:
                aside = f"not set aside ({getattr(why, 'strerror', None) or why})"
            print(f"=> {e}: {aside}; the time split starts afresh with this invocation", flush=True)
            self.written = None
            return []

    def write(self, output_dir, **fields):
        """Print the split and write it to OUTPUT_DIR/timing.txt (save); returns the line's dict."""
        line = self.save(output_dir, **fields)
        startup = line["startup_parts"]

        def said(name):
            text = f"{name.replace('_', ' ')} {line[f'{name}_s']:.1f} s"
            if name == "startup" and startup:
                text += " (" + ", ".join(f"{k} {v:.1f}" for k, v in startup.items()) + ")"
            return text
        shown = ", ".join(said(name) for name in PARTS if line[f"{name}_s"] >= 0.05)
        print(f"=> wall time {line['wall_s']:.1f} s: {shown or 'nothing measured'}", flush=True)
        return line
