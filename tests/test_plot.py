"""sce.plot: the curves read from a real run's log.txt (always), the figures it draws (where matplotlib is
installed: it is not in requirements.txt) and its one-line errors, matplotlib missing among them."""
import json
import os
import signal
import subprocess
import sys

import pytest
from PIL import Image

from conftest import REPO, pretrain, script_in_process, write_imagefolder
from sce import UserError, plot
from sce.compiling import Log
from sce.timing import PARTS, Split

sys.path.insert(0, os.path.join(REPO, "benchmarks", "reproduction"))
import reproduce_tools  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two run folders: a real tiny run (2 epochs, the kNN monitor at each; ~2 s), and a copy of it made longer, with
    the online probe's keys set by hand (validation top-1 at every tenth epoch, running train top-1 at each)."""
    root = tmp_path_factory.mktemp("plot")
    data = write_imagefolder(root / "data", num_classes=2, per_class=8, size=20, splits=("",))
    knn = write_imagefolder(root / "knn", num_classes=2, per_class=4, size=20)
    with script_in_process():
        pretrain(data, root / "real", "--epochs", 2, "--knn-data", knn, "--knn-every", 1)
    real = [json.loads(line) for line in open(root / "real" / "log.txt")]
    longer = []
    for epoch in range(1, 31):
        row = {k: v for k, v in real[-1].items() if not k.startswith(("knn_", "online_top1"))}
        row.update(epoch=epoch, loss=8 - epoch / 10, online_train_top1=2 * epoch)
        if epoch % 10 == 0:
            row.update(knn_top1=40 + epoch, knn_top5=90.0, online_top1=30 + epoch)
        longer.append(json.dumps(row))
    os.makedirs(root / "longer")
    (root / "longer" / "log.txt").write_text("\n".join(longer) + "\n")
    (root / "longer" / "timing.txt").write_text((root / "real" / "timing.txt").read_text() * 2)  # two invocations
    return root / "real", root / "longer"


def test_curves_read_from_runs(runs, tmp_path):
    real, longer = runs
    curves = plot.curves(plot.read_log(real))
    assert list(curves) == ["loss", "terms", "accuracy", "schedule"]
    assert list(curves["terms"]) == ["infonce", "ressl", "ceil"]  # SCE logs eq. 10's three terms
    # a real run's kNN and its online probe's (the running top-1 every epoch, the val top-1 where the kNN ran)
    assert list(curves["accuracy"]) == ["knn_top1", "online_top1", "online_train_top1"]
    assert curves["accuracy"]["knn_top1"][0] == curves["accuracy"]["online_top1"][0] == [1, 2]
    assert list(curves["schedule"]) == ["lr", "momentum"] and curves["loss"]["loss"][0] == [1, 2]
    accuracy = plot.curves(plot.read_log(longer))["accuracy"]
    assert accuracy["knn_top1"] == ([10, 20, 30], [50, 60, 70]) and accuracy["online_top1"][0] == [10, 20, 30]
    assert accuracy["online_train_top1"][0] == list(range(1, 31))
    # no kNN, no probe: no accuracy panel; an epoch written twice (a completed line): its last
    rows = [{"epoch": 2, "loss": 3.0}, {"epoch": 1, "loss": 5.0}, {"epoch": 2, "loss": 4.0, "lr": float("nan")}]
    (tmp_path / "log.txt").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot.curves(plot.read_log(tmp_path)) == {"loss": {"loss": ([1, 2], [5.0, 4.0])}}
    # the time split: timing.txt's invocations summed, given the folder or the file
    split = plot.time_split(plot.timing_folder(str(longer / "timing.txt")))
    assert split == pytest.approx({p: 2 * plot.time_split(real)[p] for p in PARTS})
    assert plot.run_labels([str(real), str(longer)]) == ["real", "longer"]
    assert plot.run_labels(["a/sce", "b/sce"]) == ["a/sce", "b/sce"]  # alike names: their paths


def test_figures_of_two_runs_and_the_time_split(runs, tmp_path, capsys):
    pytest.importorskip("matplotlib")  # the one test that draws; the others run without it
    real, longer = runs
    out = tmp_path / "fig.png"
    plot.run([str(real), str(longer), "-o", str(out), "--paper", "90.34", "--title", "two runs"])
    assert "loss, loss terms, top-1 (%), lr / EMA momentum of 2 run(s)" in capsys.readouterr().out
    assert Image.open(out).format == "PNG" and Image.open(out).size == (1000, 600)
    assert out.stat().st_size < 200_000  # committed to the repository
    assert plot.plot_runs([real], tmp_path / "one.png", labels=["sce"]) == ["loss", "terms", "accuracy", "schedule"]
    split = tmp_path / "split.png"
    plot.run(["--time-split", str(real), str(longer / "timing.txt"), "-o", str(split)])
    assert Image.open(split).size[0] == 1000 and split.stat().st_size < 200_000
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary file left


def errors(capsys, *argv):
    """plot.run(argv)'s exit status and its stderr, which must be one line."""
    with pytest.raises(SystemExit) as stop:
        plot.run([str(a) for a in argv])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return stop.value.code, err


def test_one_line_errors(runs, tmp_path, capsys, monkeypatch):
    real, _ = runs
    out = tmp_path / "fig.png"
    code, err = errors(capsys, tmp_path / "none", "-o", out)
    assert code == 1 and f"{tmp_path / 'none'} has no log.txt: sce.plot needs a pretraining run's output folder" in err
    (tmp_path / "log.txt").write_text("")
    assert f"{tmp_path / 'log.txt'} is empty" in errors(capsys, tmp_path, "-o", out)[1]
    (tmp_path / "log.txt").write_text('{"epoch": 1, "loss": 2.0}\n{"loss": 1.0}\n')
    assert "line 2 of" in errors(capsys, tmp_path, "-o", out)[1]
    (tmp_path / "log.txt").write_text('{"epoch": 1}\n\n')
    assert f"nothing to draw: no epoch of {tmp_path} has a loss" in errors(capsys, tmp_path, "-o", out)[1]
    assert "--labels has 1 label(s) for 2 run folder(s)" in errors(capsys, real, real, "--labels", "a", "-o", out)[1]
    assert "no folder" in errors(capsys, real, "-o", tmp_path / "missing" / "fig.png")[1]
    with pytest.raises(SystemExit) as stop:  # a line at inf or nan would not be drawn, without a word
        plot.run([str(real), "-o", str(out), "--paper", "inf"])
    assert stop.value.code == 2 and "--paper: inf is not a finite number" in capsys.readouterr().err
    assert f"{tmp_path} has no timing.txt line" in errors(capsys, "--time-split", tmp_path, "-o", out)[1]
    # matplotlib missing: one line naming the install, exit 2, nothing written
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert errors(capsys, real, "-o", out) == (2, "error: drawing figures needs matplotlib: pip install matplotlib\n")
    with pytest.raises(plot.NoMatplotlib):
        plot.plot_time_split([dict(stage="a", steps=1.0)], out)
    assert not out.exists()
    with pytest.raises(UserError, match="no stage"):
        plot.plot_time_split([], out)


def test_the_command_line(tmp_path):
    # as users run it: its own process, no torch imported, the error on stderr
    proc = subprocess.run([sys.executable, "-m", "sce.plot", str(tmp_path), "-o", str(tmp_path / "f.png")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.startswith(f"error: {tmp_path} has no log.txt") and not proc.stdout
    probe = "import sys, sce.plot; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", probe], cwd=REPO, timeout=60).returncode == 0


def a_run(folder, log='{"epoch": 1, "loss": 2.0}\n', timing='{"startup_s": 1.0, "steps_s": 2.0}\n'):
    """A tiny run folder: log.txt and timing.txt (bytes or text), checkpoint_last.pth and a user's notes."""
    os.makedirs(folder, exist_ok=True)
    for name, content in [("log.txt", log), ("timing.txt", timing), ("checkpoint_last.pth", b"PK\x03\x04"),
                          ("notes.png", b"a user's own file")]:
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


@pytest.mark.parametrize("name, split, said", [
    ("log.txt", False, "a file the figure is drawn from"),
    ("timing.txt", True, "a file the figure is drawn from"),
    ("link.png", False, "a file the figure is drawn from"),  # a link to log.txt, beside the run
    ("checkpoint_last.pth", False, "a file of the run folder"),
    ("notes.png", True, "a file of the run folder"),
    ("other/args.json", False, "a file of the run folder"),  # a run's folder not given: its files are its
    ("fifo.png", False, "not a regular file"),  # never opened: no reader waited for
    (".", False, "not a regular file")])
def test_a_figure_never_replaces_what_it_reads_nor_a_runs_file(tmp_path, capsys, name, split, said):
    run = a_run(tmp_path / "run")
    a_run(tmp_path / "other")
    (tmp_path / "other" / "args.json").write_text("{}")
    os.symlink(run / "log.txt", tmp_path / "link.png")
    os.mkfifo(tmp_path / "fifo.png")
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()}
    out = tmp_path / name if "/" in name or name in ("link.png", "fifo.png", ".") else run / name
    code, err = errors(capsys, *(["--time-split"] if split else []), run, "-o", out)
    assert code == 1 and err.startswith(f"error: cannot write {out}: ") and said in err
    assert files == {p: p.read_bytes() for p in files}  # nothing replaced, no temporary file left
    assert sorted(tmp_path.rglob("*")) == sorted([*files, tmp_path / "link.png", tmp_path / "fifo.png", run,
                                                  tmp_path / "other"])


def test_a_figure_it_wrote_is_written_again(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = a_run(tmp_path / "run")
    out = run / "curves.png"
    for _ in range(2):  # its own figure, in a run folder: replaced
        plot.run([str(run), "-o", str(out)])
        assert plot.marked(out) and Image.open(out).info["Software"] == plot.MARK
    Image.new("RGB", (4, 4)).save(run / "other.png")  # a PNG sce.plot did not write
    assert "a file of the run folder" in errors(capsys, run, "-o", run / "other.png")[1]
    # outside runs' folders a figure's name is the user's to reuse; a link is followed, and stays a link
    Image.new("RGB", (4, 4)).save(tmp_path / "old.png")
    os.symlink(tmp_path / "old.png", tmp_path / "fig.png")
    plot.run(["--time-split", str(run), "-o", str(tmp_path / "fig.png")])
    assert os.path.islink(tmp_path / "fig.png") and plot.marked(tmp_path / "old.png")
    assert not plot.marked(run / "other.png") and not plot.marked(run / "log.txt")


BIG = "9" * 400
BAD_LOGS = [  # (log.txt's bytes, what the line says)
    ('{"epoch": Infinity, "loss": 1.0}\n', "line 1 of {log} is not an epoch's JSON line"),
    ('{"epoch": NaN, "loss": 1.0}\n', "line 1 of {log} is not an epoch's JSON line"),
    (f'{{"epoch": {BIG}, "loss": 1.0}}\n', "line 1 of {log} is not an epoch's JSON line"),
    (f'{{"epoch": {"9" * 5000}, "loss": 1.0}}\n', "line 1 of {log} is not an epoch's JSON line"),
    ('{"epoch": true, "loss": 1.0}\n', "line 1 of {log} is not an epoch's JSON line"),
    ('{"epoch": 1, "loss": 1.0}\n' + "[" * 100_000 + "\n", "line 2 of {log} is not an epoch's JSON line"),
    (b'{"epoch": 1, "loss": 1.0}\n\xff\xfe\n', "cannot read {log}: line 2 is not UTF-8 text"),
    (f'{{"epoch": 1, "loss": {BIG}, "lr": Infinity, "knn_top1": NaN}}\n', "nothing to draw"),  # no number to draw
]
BAD_TIMINGS = [  # (timing.txt's bytes, what the line says)
    ("not json\n", "line 1 of {timing} is not an invocation's JSON line (sce.timing)"),
    ("[1]\n", "line 1 of {timing} is not an invocation's JSON line (sce.timing)"),
    ('{"steps_s": "x"}\n', "its steps_s is not a number of seconds"),
    ('{"steps_s": Infinity}\n', "its steps_s is not a number of seconds"),
    (f'{{"startup_s": {BIG}}}\n', "its startup_s is not a number of seconds"),
    ('{"exit_s": -1}\n', "its exit_s is not a number of seconds"),
    ("[" * 100_000 + "\n", "line 1 of {timing} is not an invocation's JSON line"),
    (b"\xff\n", "cannot read {timing}: line 1 is not UTF-8 text"),
]


@pytest.mark.parametrize("log, timing, said", [(log, "", said) for log, said in BAD_LOGS] +
                         [("", timing, said) for timing, said in BAD_TIMINGS],
                         ids=[f"log{i}" for i in range(len(BAD_LOGS))] +
                         [f"timing{i}" for i in range(len(BAD_TIMINGS))])
def test_a_damaged_or_crafted_file_is_one_line(tmp_path, capsys, log, timing, said):
    run = a_run(tmp_path, log=log or '{"epoch": 1, "loss": 2.0}\n', timing=timing)
    code, err = errors(capsys, *(["--time-split"] if timing else []), run, "-o", tmp_path / "fig.png")
    assert code == 1 and said.format(log=run / "log.txt", timing=run / "timing.txt") in err


@pytest.mark.parametrize("timing, said", BAD_TIMINGS, ids=[f"timing{i}" for i in range(len(BAD_TIMINGS))])
def test_a_damaged_timing_txt_is_one_line_to_the_run_and_the_reproduction(tmp_path, capsys, timing, said):
    """The run's own split (sce.timing.Split: the estimate, each epoch's line) and the reproduction's table
    (reproduce_tools.stage_split) read timing.txt as sce.plot does: a damaged one is one line each (issue 61: a
    traceback, the run failing once its epoch was trained); the run keeps it aside, byte for byte (a second one
    beside the first), and starts its split afresh; the table goes on without that stage's split."""
    content = timing.encode() if isinstance(timing, str) else timing
    said = said.format(timing=tmp_path / "timing.txt")
    (tmp_path / "timing.txt").write_bytes(content)
    assert reproduce_tools.stage_split(str(tmp_path)) is None
    out = capsys.readouterr().out
    assert out.startswith(f"=> no time split of {tmp_path}: ") and said in out and out.count("\n") == 1
    for aside in ("timing.txt.damaged", "timing.txt.damaged2"):
        split = Split(Log())
        assert split.earlier_wall(str(tmp_path)) == 0.0  # the estimate, after an invocation's first epoch
        line = split.save(str(tmp_path), epochs=[0, 1])
        out = capsys.readouterr().out
        assert out == f"=> {out[3:].split(': kept as')[0]}: kept as {tmp_path / aside}; the time split starts " \
                      "afresh with this invocation\n" and said in out
        assert (tmp_path / aside).read_bytes() == content
        assert [json.loads(row) for row in open(tmp_path / "timing.txt")] == [line]
        split.save(str(tmp_path), epochs=[0, 2])  # its own line replaced, silently
        assert len(open(tmp_path / "timing.txt").readlines()) == 1 and not capsys.readouterr().out
        (tmp_path / "timing.txt").write_bytes(content)


@pytest.mark.parametrize("name", ["log.txt", "timing.txt"])
def test_a_file_that_cannot_be_read_is_one_line(tmp_path, capsys, monkeypatch, name):
    split = ["--time-split"] if name == "timing.txt" else []
    os.remove(a_run(tmp_path) / name)
    os.mkdir(tmp_path / name)  # a folder named like the file
    assert errors(capsys, *split, tmp_path, "-o", tmp_path / "f.png")[1] == (
        f"error: cannot read {tmp_path / name}: Is a directory\n")
    os.rmdir(tmp_path / name)
    os.mkfifo(tmp_path / name)  # a FIFO: refused, not waited on (a writer never comes)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("sce.plot waited on a FIFO"))
    signal.alarm(10)
    try:
        assert "not a regular file" in errors(capsys, *split, tmp_path, "-o", tmp_path / "f.png")[1]
    finally:
        signal.alarm(0)
    os.remove(tmp_path / name)
    (tmp_path / name).write_text('{"epoch": 1, "loss": 2.0}\n')
    opened = open

    def denied(path, *args, **kwargs):  # as chmod 000 for a user who is not root
        if str(path).endswith(name):
            raise PermissionError(13, "Permission denied", str(path))
        return opened(path, *args, **kwargs)
    monkeypatch.setattr("builtins.open", denied)
    assert errors(capsys, *split, tmp_path, "-o", tmp_path / "f.png")[1] == (
        f"error: cannot read {tmp_path / name}: Permission denied\n")


@pytest.mark.parametrize("folder, argv", [
    ("run", ["--title", r"cost $\frac{a$ 50%"]),
    ("a$^$b_%", []),
    ("run", ["--labels", "$_$"]),
    ("x$\\frac$", ["--time-split", "--title", "$x^$"])])
def test_text_with_dollars_is_drawn_as_written(tmp_path, folder, argv):
    pytest.importorskip("matplotlib")
    run = a_run(tmp_path / folder)
    plot.run([str(run), "-o", str(tmp_path / "fig.png"), *argv])  # mathtext would raise ParseSyntaxException
    assert Image.open(tmp_path / "fig.png").format == "PNG"
    assert plot.literal("a $x^$ b") == r"a \$x^\$ b"
