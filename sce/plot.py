"""Figures from runs, from the files every run already writes in its output folder.

    python -m sce.plot RUN_DIR [RUN_DIR ...] -o fig.png [--labels A B ...] [--paper 90.34] [--title TEXT]
    python -m sce.plot --time-split RUN_DIR [RUN_DIR ...] -o split.png

The first draws the curves of pretraining runs (log.txt, a line per epoch: sce.epoch.log_epoch), a colour a run:
the loss, the loss terms, the kNN monitor's top-1 and the online linear probe's, lr and EMA momentum; a panel no
run has data for is left out. The second draws where each run's wall time went (timing.txt: sce.timing), a bar a
run. matplotlib is not a requirement: it is imported only to draw, and missing it is one line (exit 2). No torch
here: the figures take a second. A figure never replaces a file it reads, nor a run's file it did not write (its PNGs
carry MARK); a crafted or damaged file is one line, never a traceback.
"""
import argparse
import os
import stat
import sys

from sce import UserError, finite, json_lines, temporary, timing

TERMS = ("infonce", "ressl", "ceil")  # eq. 10's terms, logged by all three methods
ACCURACIES = {"knn_top1": "kNN top-1", "online_top1": "online linear top-1 (val)",
              "online_train_top1": "online linear top-1 (train, running)"}
PANELS = {"loss": "loss", "terms": "loss terms", "accuracy": "top-1 (%)", "schedule": "lr / EMA momentum"}
STYLES = ["-", "--", ":", "-."]  # a series kind within a panel; the colour is the run
SIZE, DPI = (10, 6), 100  # 1000 x 600 px: small enough to commit
MARK = "sce.plot"  # its PNGs' Software text (no version: same runs, same bytes): a figure it may write again
RUN_FILES = ("log.txt", "timing.txt", "args.json", "checkpoint_last.pth")  # what makes a folder a run's
LOG_LINE = "an epoch's JSON line (main_pretrain.py's log.txt)"


class NoMatplotlib(UserError):
    """matplotlib is not installed (the command exits 2)."""


# ---------------------------------------------------------------- reading the runs (no matplotlib)


def read_log(run_dir):
    """The epochs of RUN_DIR/log.txt as dicts, in epoch order (an epoch written twice: its last line)."""
    path = os.path.join(run_dir, "log.txt")
    if not os.path.lexists(path):
        raise UserError(f"{run_dir} has no log.txt: sce.plot needs a pretraining run's output folder "
                        "(main_pretrain.py --output-dir), which has a line per finished epoch")
    epochs = {}
    for number, row in json_lines(path, LOG_LINE):
        epoch = row.get("epoch") if isinstance(row, dict) else None
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= 10**9:
            raise UserError(f"line {number} of {path} is not {LOG_LINE}: no epoch's number")
        epochs[epoch] = row
    if not epochs:
        raise UserError(f"{path} is empty: sce.plot needs at least one finished epoch's line")
    return [epochs[e] for e in sorted(epochs)]


def series(rows, key):
    """(epochs, values) of `key` over the epochs that have it as a finite number (a diverged loss's NaN left out)."""
    points = [(r["epoch"], finite(r.get(key))) for r in rows]
    points = [(e, v) for e, v in points if v is not None]
    return [e for e, _ in points], [v for _, v in points]


def curves(rows):
    """{panel: {series name: (epochs, values)}} of one run's log rows, the series it has data for only."""
    wanted = {"loss": ["loss"], "terms": list(TERMS), "accuracy": list(ACCURACIES), "schedule": ["lr", "momentum"]}
    found = {panel: {key: series(rows, key) for key in keys} for panel, keys in wanted.items()}
    return {panel: {k: s for k, s in named.items() if s[0]} for panel, named in found.items()
            if any(s[0] for s in named.values())}


def run_labels(run_dirs, labels=None):
    """A legend label per run: `labels` as given, or each folder's name (its path where two names are alike)."""
    if labels is not None:
        if len(labels) != len(run_dirs):
            raise UserError(f"--labels has {len(labels)} label(s) for {len(run_dirs)} run folder(s): give one a run")
        return list(labels)
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    return names if len(set(names)) == len(names) else [os.path.normpath(d) for d in run_dirs]


def timing_folder(path):
    """The run folder of `path`: itself, or the folder of a timing.txt."""
    return (os.path.dirname(path) or ".") if os.path.basename(os.path.normpath(path)) == "timing.txt" else path


def time_split(folder):
    """{part: seconds} of a run's invocations, summed (FOLDER/timing.txt: a line an invocation, sce.timing)."""
    rows = timing.lines(folder)
    if not rows:
        raise UserError(f"{folder} has no timing.txt line: --time-split needs the output folder of a "
                        "main_pretrain.py or main_lincls.py run, which writes one at each epoch's end")
    return {part: sum(row.get(f"{part}_s", 0.0) for row in rows) for part in timing.PARTS}


# ---------------------------------------------------------------- drawing


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    try:
        import matplotlib
    except ImportError:
        raise NoMatplotlib("drawing figures needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def check_output(out_png, reads=(), run_dirs=()):
    """Before any drawing, the path the figure is written at (out_png's real path: a link's target, whose folder must
    exist): none of the files read (`reads`); where a file is there already, a regular file, and inside a run's
    folder (one of `run_dirs` at any depth, or a folder with a run's files) only a figure sce.plot wrote (MARK)."""
    target = os.path.realpath(out_png)
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise UserError(f"cannot write {out_png}: no folder {folder}")
    if any(target == os.path.realpath(path) for path in reads):
        raise UserError(f"cannot write {out_png}: it is {target}, a file the figure is drawn from; give the "
                        "figure another name (-o)")
    try:
        if not os.path.lexists(target):
            return target
        if not stat.S_ISREG(os.stat(target).st_mode):
            raise UserError(f"cannot write {out_png}: it is not a regular file (a folder, a FIFO, a device); give "
                            "the figure a file's name (-o)")
    except OSError as e:  # a loop of links
        raise UserError(f"cannot write {out_png}: {e.strerror}") from None
    run = run_folder(target, run_dirs)
    if run is not None and not marked(target):
        raise UserError(f"cannot write {out_png}: it is a file of the run folder {run} that sce.plot did not write; "
                        "give the figure another name (-o)")
    return target


def run_folder(path, run_dirs):
    """The run folder `path` lies in: one of `run_dirs` (at any depth), or its own folder where that holds a run's
    files (RUN_FILES); None if neither."""
    for run_dir in run_dirs:
        real = os.path.realpath(run_dir)
        if os.path.commonpath([real, path]) == real:
            return run_dir
    folder = os.path.dirname(path)
    return folder if any(os.path.lexists(os.path.join(folder, name)) for name in RUN_FILES) else None


def marked(path):
    """Whether `path` is a PNG sce.plot wrote: a Software text chunk saying MARK before the image data."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    text = b"Software\0" + MARK.encode()
    chunk = len(text).to_bytes(4, "big") + b"tEXt" + text  # the chunk's length, its type, its text
    return head.startswith(b"\x89PNG\r\n\x1a\n") and chunk in head.split(b"IDAT", 1)[0]


def literal(text):
    """`text` drawn as written: a `$` is not mathtext's (a folder named `a$^$b` is no formula to parse)."""
    return text.replace("$", r"\$")


def save(fig, target, out_png):
    """The figure as a PNG at `target` (check_output's), through a temporary file (a kill never leaves half a
    figure)."""
    tmp = temporary(target)
    try:
        fig.savefig(tmp, format="png", dpi=DPI, metadata={"Software": MARK})
        os.replace(tmp, target)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(f"could not write {out_png} ({e.strerror})") from None


def plot_runs(run_dirs, out_png, labels=None, paper=None, title=None):
    """One figure of the runs' curves (read_log, curves) into out_png; `paper`: a reference line on the accuracy
    panel (a number), or one a run in its colour (a list, None where a run has none). Returns the panels drawn."""
    names = run_labels(run_dirs, labels)
    target = check_output(out_png, [os.path.join(d, "log.txt") for d in run_dirs], run_dirs)
    runs = [curves(read_log(d)) for d in run_dirs]
    panels = [p for p in PANELS if any(p in run for run in runs)]
    if not panels:
        raise UserError(f"nothing to draw: no epoch of {', '.join(map(str, run_dirs))} has a loss, a top-1 or an lr")
    plt = pyplot()
    with plt.rc_context({"text.usetex": False}):  # names drawn as written (LaTeX would read `_`, `%`)
        fig = draw_runs(plt, panels, runs, names, paper, title)
        try:
            save(fig, target, out_png)
        finally:
            plt.close(fig)
    return panels


def draw_runs(plt, panels, runs, names, paper, title):
    """plot_runs's figure: a panel each of `panels`, a colour a run."""
    rows, cols = (len(panels) + 1) // 2, min(len(panels), 2)
    fig, axes = plt.subplots(rows, cols, figsize=SIZE, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    for ax, panel in zip(axes.flat, panels):
        draw_panel(ax, panel, runs)
        if panel == "accuracy" and paper is not None:
            lines = [(paper, "gray")] if not isinstance(paper, (list, tuple)) else [
                (value, f"C{i % 10}") for i, value in enumerate(paper) if finite(value) is not None]
            for value, color in lines:
                ax.axhline(value, color=color, linewidth=1, linestyle="--")
                ax.annotate(f"paper {value:g}", (0, value), xycoords=("axes fraction", "data"), xytext=(2, 2),
                            textcoords="offset points", va="bottom", fontsize=8, color=color)
    handles = [plt.Line2D([], [], color=f"C{i % 10}") for i in range(len(names))]
    fig.legend(handles, [literal(name) for name in names], loc="upper right", fontsize=8, ncol=min(len(names), 4))
    if title:
        fig.suptitle(literal(title), x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97), h_pad=0.5)
    return fig


def draw_panel(ax, panel, runs):
    """One panel: a colour a run, a line style a series (named in the panel's legend where it has several)."""
    keys = list(dict.fromkeys(k for run in runs for k in run.get(panel, {})))
    twin = ax.twinx() if panel == "schedule" and "momentum" in keys else None
    for i, run in enumerate(runs):
        for key, (epochs, values) in run.get(panel, {}).items():
            on = twin if key == "momentum" and twin else ax
            on.plot(epochs, values, color=f"C{i % 10}", linestyle=STYLES[keys.index(key) % len(STYLES)],
                    marker="o" if len(epochs) <= 20 else None, markersize=3, linewidth=1.2)
    ax.set_title(PANELS[panel], fontsize=10)
    ax.set_xlabel("epoch", fontsize=8)
    ax.xaxis.get_major_locator().set_params(integer=True)  # epochs: no 1.25
    ax.tick_params(labelsize=8)
    if panel == "terms" and all(v > 0 for run in runs for _, vs in run.get(panel, {}).values() for v in vs):
        ax.set_yscale("log")  # Ceil's term is a hundredth of the others'
    if twin:
        ax.set_ylabel("lr", fontsize=8)
        twin.tick_params(labelsize=8)
        twin.set_ylabel("momentum", fontsize=8)
    if len(keys) > 1:
        styles = [ax.plot([], [], color="black", linestyle=STYLES[i % len(STYLES)])[0] for i in range(len(keys))]
        ax.legend(styles, [ACCURACIES.get(k, k) for k in keys], fontsize=7, loc="best")


def plot_time_split(rows, out_png, title=None, reads=(), run_dirs=()):
    """A horizontal bar a stage, stacked by the parts of its wall time: `rows` are {"stage": name, part: seconds}
    (sce.timing.PARTS first, then any other part; "wall", the sum, is not a part), read from the files `reads` of the
    folders `run_dirs` (check_output)."""
    if not rows:
        raise UserError("no stage to draw a time split of")
    target = check_output(out_png, reads, run_dirs)
    parts = list(timing.PARTS) + [k for row in rows for k in row if k not in ("stage", "wall", *timing.PARTS)]
    parts = [p for p in dict.fromkeys(parts) if any(row.get(p, 0) > 0 for row in rows)]
    plt = pyplot()
    with plt.rc_context({"text.usetex": False}):  # names drawn as written (LaTeX would read `_`, `%`)
        fig = draw_time_split(plt, rows, parts, title)
        try:
            save(fig, target, out_png)
        finally:
            plt.close(fig)


def draw_time_split(plt, rows, parts, title):
    """plot_time_split's figure: a bar a row, a colour a part."""
    fig, ax = plt.subplots(figsize=(SIZE[0], 1.2 + 0.45 * len(rows)))
    names = [literal(str(row["stage"])) for row in rows][::-1]  # the first row on top
    left = [0.0] * len(rows)
    for i, part in enumerate(parts):
        widths = [float(row.get(part, 0.0)) for row in rows][::-1]
        ax.barh(names, widths, left=left, color=f"C{i % 10}", label=part.replace("_", " "), height=0.6)
        left = [a + b for a, b in zip(left, widths)]
    for y, total in enumerate(left):
        ax.annotate(f"{total:.1f} s", (total, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_xlabel("seconds", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_xlim(0, max(left) * 1.12 or 1)
    ax.legend(fontsize=7, ncol=min(len(parts), 7), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    if title:
        ax.set_title(literal(title), fontsize=10, pad=22)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- command line


def finite_number(text):
    """--paper's number (inf or nan would draw no line, without a word)."""
    value = finite(float(text))  # not a number: argparse's own line
    if value is None:
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


parser = argparse.ArgumentParser(prog="python -m sce.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="output folders of runs (--time-split: or their "
                    "timing.txt)")
parser.add_argument("-o", "--output", required=True, metavar="PNG", help="the figure's file")
parser.add_argument("--labels", nargs="+", help="a legend label a run (default: each folder's name)")
parser.add_argument("--paper", type=finite_number, metavar="TOP1", help="a reference line on the accuracy panel")
parser.add_argument("--title", help="the figure's title")
parser.add_argument("--time-split", action="store_true", help="each run's wall time split (timing.txt) as a bar")


def main(argv=None):
    args = parser.parse_args(argv)
    if args.time_split:
        folders = [timing_folder(p) for p in args.run_dirs]
        rows = [dict(stage=name, **time_split(d)) for name, d in zip(run_labels(folders, args.labels), folders)]
        plot_time_split(rows, args.output, args.title, [os.path.join(d, "timing.txt") for d in folders], folders)
        print(f"=> {args.output}: the time split of {len(rows)} run(s)")
    else:
        panels = plot_runs(args.run_dirs, args.output, args.labels, args.paper, args.title)
        print(f"=> {args.output}: {', '.join(PANELS[p] for p in panels)} of {len(args.run_dirs)} run(s)")


def run(argv=None):
    """As sce.entry.run (without its torch): a UserError is one line `error: ...` on stderr, exit 1; no matplotlib,
    exit 2."""
    try:
        main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, NoMatplotlib) else 1)


if __name__ == "__main__":
    run()
