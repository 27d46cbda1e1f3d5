"""Figures from runs, from the files every run already writes in its output folder.

    python -m sce.plot RUN_DIR [RUN_DIR ...] -o fig.png [--labels A B ...] [--paper 90.34] [--title TEXT]
    python -m sce.plot --time-split RUN_DIR [RUN_DIR ...] -o split.png

The first draws the curves of pretraining runs (log.txt, a line per epoch: sce.epoch.log_epoch), a colour a run:
the loss, the loss terms, the kNN monitor's top-1 and the online linear probe's, lr and EMA momentum; a panel no
run has data for is left out. The second draws where each run's wall time went (timing.txt: sce.timing), a bar a
run. matplotlib is not a requirement: it is imported only to draw, and missing it is one line (exit 2). No torch
here: the figures take a second.
"""
import argparse
import json
import math
import os
import sys

from sce import UserError, temporary, timing

TERMS = ("infonce", "ressl", "ceil")  # eq. 10's terms, logged by all three methods
ACCURACIES = {"knn_top1": "kNN top-1", "online_top1": "online linear top-1 (val)",
              "online_train_top1": "online linear top-1 (train, running)"}
PANELS = {"loss": "loss", "terms": "loss terms", "accuracy": "top-1 (%)", "schedule": "lr / EMA momentum"}
STYLES = ["-", "--", ":", "-."]  # a series kind within a panel; the colour is the run
SIZE, DPI = (10, 6), 100  # 1000 x 600 px: small enough to commit


class NoMatplotlib(UserError):
    """matplotlib is not installed (the command exits 2)."""


# ---------------------------------------------------------------- reading the runs (no matplotlib)


def read_log(run_dir):
    """The epochs of RUN_DIR/log.txt as dicts, in epoch order (an epoch written twice: its last line)."""
    path = os.path.join(run_dir, "log.txt")
    if not os.path.isfile(path):
        raise UserError(f"{run_dir} has no log.txt: sce.plot needs a pretraining run's output folder "
                        "(main_pretrain.py --output-dir), which has a line per finished epoch")
    epochs = {}
    for number, line in enumerate(open(path).read().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            epochs[int(row["epoch"])] = row
        except (ValueError, TypeError, KeyError):
            raise UserError(f"line {number} of {path} is not an epoch's JSON line (main_pretrain.py's log.txt)"
                            ) from None
    if not epochs:
        raise UserError(f"{path} is empty: sce.plot needs at least one finished epoch's line")
    return [epochs[e] for e in sorted(epochs)]


def series(rows, key):
    """(epochs, values) of `key` over the epochs that have it as a finite number."""
    points = [(r["epoch"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
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
    rows = timing.lines(folder) if os.path.isfile(os.path.join(folder, "timing.txt")) else []
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


def check_output(out_png):
    """Before any drawing: the figure's folder exists."""
    folder = os.path.dirname(os.path.abspath(out_png))
    if not os.path.isdir(folder):
        raise UserError(f"cannot write {out_png}: no folder {folder}")


def save(fig, out_png):
    """The figure as a PNG, through a temporary file (a kill never leaves half a figure)."""
    tmp = temporary(out_png)
    try:
        fig.savefig(tmp, format="png", dpi=DPI, metadata={"Software": None})  # no version: same runs, same bytes
        os.replace(tmp, out_png)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(f"could not write {out_png} ({e.strerror})") from None


def plot_runs(run_dirs, out_png, labels=None, paper=None, title=None):
    """One figure of the runs' curves (read_log, curves) into out_png; `paper`: a reference line on the accuracy
    panel (a number), or one a run in its colour (a list, None where a run has none). Returns the panels drawn."""
    names = run_labels(run_dirs, labels)
    check_output(out_png)
    runs = [curves(read_log(d)) for d in run_dirs]
    panels = [p for p in PANELS if any(p in run for run in runs)]
    if not panels:
        raise UserError(f"nothing to draw: no epoch of {', '.join(map(str, run_dirs))} has a loss, a top-1 or an lr")
    plt = pyplot()
    rows, cols = (len(panels) + 1) // 2, min(len(panels), 2)
    fig, axes = plt.subplots(rows, cols, figsize=SIZE, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    for ax, panel in zip(axes.flat, panels):
        draw_panel(ax, panel, runs)
        if panel == "accuracy" and paper is not None:
            lines = [(paper, "gray")] if not isinstance(paper, (list, tuple)) else [
                (value, f"C{i % 10}") for i, value in enumerate(paper) if value is not None]
            for value, color in lines:
                ax.axhline(value, color=color, linewidth=1, linestyle="--")
                ax.annotate(f"paper {value:g}", (0, value), xycoords=("axes fraction", "data"), xytext=(2, 2),
                            textcoords="offset points", va="bottom", fontsize=8, color=color)
    handles = [plt.Line2D([], [], color=f"C{i % 10}") for i in range(len(names))]
    fig.legend(handles, names, loc="upper right", fontsize=8, ncol=min(len(names), 4))
    if title:
        fig.suptitle(title, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97), h_pad=0.5)
    save(fig, out_png)
    plt.close(fig)
    return panels


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


def plot_time_split(rows, out_png, title=None):
    """A horizontal bar a stage, stacked by the parts of its wall time: `rows` are {"stage": name, part: seconds}
    (sce.timing.PARTS first, then any other part; "wall", the sum, is not a part)."""
    if not rows:
        raise UserError("no stage to draw a time split of")
    check_output(out_png)
    parts = list(timing.PARTS) + [k for row in rows for k in row if k not in ("stage", "wall", *timing.PARTS)]
    parts = [p for p in dict.fromkeys(parts) if any(row.get(p, 0) > 0 for row in rows)]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(SIZE[0], 1.2 + 0.45 * len(rows)))
    names = [str(row["stage"]) for row in rows][::-1]  # the first row on top
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
        ax.set_title(title, fontsize=10, pad=22)
    fig.tight_layout()
    save(fig, out_png)
    plt.close(fig)


# ---------------------------------------------------------------- command line


parser = argparse.ArgumentParser(prog="python -m sce.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="output folders of runs (--time-split: or their "
                    "timing.txt)")
parser.add_argument("-o", "--output", required=True, metavar="PNG", help="the figure's file")
parser.add_argument("--labels", nargs="+", help="a legend label a run (default: each folder's name)")
parser.add_argument("--paper", type=float, metavar="TOP1", help="a reference line on the accuracy panel")
parser.add_argument("--title", help="the figure's title")
parser.add_argument("--time-split", action="store_true", help="each run's wall time split (timing.txt) as a bar")


def main(argv=None):
    args = parser.parse_args(argv)
    if args.time_split:
        folders = [timing_folder(p) for p in args.run_dirs]
        rows = [dict(stage=name, **time_split(d)) for name, d in zip(run_labels(folders, args.labels), folders)]
        plot_time_split(rows, args.output, args.title)
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
