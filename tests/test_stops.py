"""A stop signal is honoured wherever it lands (issue 61, item 2): each phase without a save (kNN and logistic
regression features, the values of C, the demo's untrained kNN) signalled at a named point of the code, the raise
landing in a loader's start or finalizer included: exit 75, one stop line, no traceback, and the same command again
ends as a run never stopped. A stop after the work was done: exit 0 and a line."""
import json
import os
import re
import signal
import sys

import numpy as np
import pytest
from torch.utils.data import dataloader

from conftest import SendsWhenDeleted, exit_message, write_imagefolder
from sce import entry, knn, preemption, transfer
from sce.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.usefixtures("in_process")  # conftest: one thread, signal handlers and workers restored

SIGNALS = [signal.SIGTERM, signal.SIGINT]


def send_at(monkeypatch, owner, name, signum, call=1, dropped=False):
    """owner.name sends `signum` to this process at its `call`-th call, before it runs (dropped: from a finalizer,
    whose raise Python drops); counts its calls."""
    real, calls = getattr(owner, name), []

    def sending(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            if dropped:
                SendsWhenDeleted(signum)  # deleted at once: its finalizer runs here
            else:
                os.kill(os.getpid(), signum)
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, sending)
    return calls


@pytest.fixture
def unraisable(monkeypatch):
    """What reaches Python's 'Exception ignored in' report during the test (sce.entry keeps stops out of it)."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    return seen


def said_once(capsys, unraisable, signum, phase):
    """The run's output has one stop line, of `signum` and `phase`, and no traceback."""
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("=> stopped by")]
    assert lines == [f"=> stopped by {signum.name} {phase}: nothing to save; run the same command again to start"
                     + (" it again" if phase.startswith("while") else "") + " (exiting with code 75)"], out + err
    assert "Traceback" not in out + err and "Exception ignored" not in out + err and not unraisable, (out, err)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("stops") / "data", 2, 4, 16)


def results(out, classifier):
    with open(os.path.join(out, f"results_{classifier}.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def reference(data, pretrained, tmp_path_factory):
    """results_<classifier>.json of runs never stopped, by classifier (made on first use)."""
    made = {}

    def of(classifier, *args):
        if classifier not in made:
            out = tmp_path_factory.mktemp(f"whole_{classifier}")
            assert exit_message("main_lincls.py", "--data", data, "--pretrained", pretrained, "--classifier",
                                classifier, *args, "--output-dir", out) is None
            made[classifier] = results(out, classifier)
        return made[classifier]
    return of


KNN = ["--preload", "off", "--workers", "1", "--knn-k", "3"]  # a loader with a worker: its start and teardown
POINTS = {  # where in the kNN the signal comes: (owner, name, its call), the phase said
    "batch": (knn, "padded", 1, "extracting the train features"),  # the trunk's forward of the first batch
    "loader start": (dataloader._MultiProcessingDataLoaderIter, "__init__", 2,  # the val loader's workers starting
                     "extracting the val features"),
    "loader finalizer": (dataloader._MultiProcessingDataLoaderIter, "_shutdown_workers", 1,  # the train loader's
                         "computing the kNN"),  # teardown, once its features are done
}


@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("signum", SIGNALS)
def test_a_stop_in_the_knn_features_exits_75_and_the_rerun_is_whole(point, signum, data, pretrained, reference,
                                                                    tmp_path, monkeypatch, capsys, unraisable):
    owner, name, call, phase = POINTS[point]
    args = ["main_lincls.py", "--data", data, "--pretrained", pretrained, "--classifier", "knn", *KNN,
            "--output-dir", tmp_path]
    with monkeypatch.context() as patch:
        calls = send_at(patch, owner, name, signum, call)
        assert exit_message(*args) == PREEMPTED_EXIT_CODE
    assert len(calls) == call
    said_once(capsys, unraisable, signum, f"while {phase}")
    assert not os.path.exists(tmp_path / "results_knn.json")
    assert exit_message(*args) is None
    assert results(tmp_path, "knn") == reference("knn", *KNN)


LOGREG = ["--preload", "device", "--workers", "0", "--logreg-max-iter", "50"]


@pytest.fixture(autouse=True)
def few_values_of_c(monkeypatch):
    """The C search over 5 of its 45 values (the reference runs' too): a stop between them is what is tested."""
    real = transfer.select_logreg
    monkeypatch.setattr(transfer, "select_logreg", lambda *a, **k: real(*a, wds=transfer.LOGREG_WDS[::10], **k))


@pytest.mark.parametrize("dropped", [False, True], ids=["raised", "dropped"])
@pytest.mark.parametrize("signum", SIGNALS)
def test_a_stop_between_values_of_c_exits_75_and_the_rerun_is_whole(dropped, signum, data, pretrained, reference,
                                                                    tmp_path, monkeypatch, capsys, unraisable):
    """The signal in the second fit of the C search: raised there, or dropped by a finalizer there (then the check
    after that value of C stops it)."""
    args = ["main_lincls.py", "--data", data, "--pretrained", pretrained, "--classifier", "logreg", *LOGREG,
            "--output-dir", tmp_path]
    with monkeypatch.context() as patch:
        calls = send_at(patch, transfer.LogReg, "fit", signum, 2, dropped)
        assert exit_message(*args) == PREEMPTED_EXIT_CODE
    assert len(calls) == 2  # no fit after the stop
    said_once(capsys, unraisable, signum, "while fitting the logistic regression")
    assert exit_message(*args) is None  # the features read back from their cache, C picked again
    assert results(tmp_path, "logreg") == reference("logreg", *LOGREG)


def test_a_stop_dropped_during_the_start_up_stops_the_probe_before_its_loop(data, pretrained, reference, tmp_path,
                                                                           monkeypatch, capsys, unraisable):
    """A raise dropped by a finalizer while the splits are read: the probe's loop stops before its first step
    (sce.preemption.Preemption checks the record), nothing saved; then runs whole."""
    from sce import data as sce_data
    probe = ["--workers", "0", "--epochs", "1", "--batch-size", "4"]
    args = ["main_lincls.py", "--data", data, "--pretrained", pretrained, *probe, "--output-dir", tmp_path]
    with monkeypatch.context() as patch:
        send_at(patch, sce_data, "eval_splits", signal.SIGTERM, dropped=True)
        assert exit_message(*args) == PREEMPTED_EXIT_CODE
    said_once(capsys, unraisable, signal.SIGTERM, "during start-up, before any training")
    assert not os.path.exists(tmp_path / "checkpoint_last.pth")
    assert exit_message(*args) is None
    keys = ("acc1", "acc5", "best_acc1", "epochs")
    assert [results(tmp_path, "linear")[k] for k in keys] == [reference("linear", *probe)[k] for k in keys]


def test_a_stop_after_the_results_are_written_exits_0_saying_so(data, pretrained, tmp_path, monkeypatch, capsys):
    real = preemption.finished

    def done_then_stopped():  # results_logreg.json written, and the work said done
        real()
        os.kill(os.getpid(), signal.SIGUSR1)
    monkeypatch.setattr(preemption, "finished", done_then_stopped)
    args = ["--data", data, "--pretrained", pretrained, "--classifier", "logreg", "--logreg-c", "1", *LOGREG]
    assert exit_message("main_lincls.py", *args, "--output-dir", tmp_path) is None
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == ("=> SIGUSR1 came after the work was done: everything is saved, nothing is "
                                            "left to continue (exiting with code 0)")
    assert "test top1" in out and "stopped by" not in out


def test_an_error_after_a_dropped_stop_is_the_stop(monkeypatch, capsys, unraisable):
    """What a dropped raise leaves broken fails next: the run is the stop's (exit 75, its line), not a traceback."""
    def main():
        SendsWhenDeleted(signal.SIGTERM)
        raise RuntimeError("a loader left half-started by the stop")
    with pytest.raises(SystemExit) as left:
        entry.run(main)
    assert left.value.code == PREEMPTED_EXIT_CODE
    said_once(capsys, unraisable, signal.SIGTERM, "during start-up, before any training")
    assert preemption.received() is None  # forgotten: a next run in this process starts clean


@pytest.mark.parametrize("signum,point", [(signal.SIGTERM, "batch"), (signal.SIGINT, "loader finalizer")])
def test_a_stop_in_the_demos_untrained_knn_exits_75_and_the_rerun_is_whole(signum, point, tmp_path, monkeypatch,
                                                                           capsys, unraisable):
    """SIGTERM, or Ctrl-C in a loader's teardown, while the demo measures its untrained kNN, before any training;
    then the demo runs as one never stopped (on 100 digits, 8 px crops: seconds)."""
    from sklearn import datasets
    from sklearn.utils import Bunch
    digits = datasets.load_digits()
    of_class = [list(np.flatnonzero(digits.target == c)) for c in range(10)]
    pick = [of_class[i // 5 % 10].pop() for i in range(100)]  # every 5th image, val, of each class in turn
    monkeypatch.setattr(datasets, "load_digits", lambda: Bunch(images=digits.images[pick], target=digits.target[pick]))
    monkeypatch.setenv("HOME", str(tmp_path))  # the demo writes its digits under ~/.cache
    flags = ["--epochs", "1", "--crop-size", "8", "--batch-size", "32", "--knn-k", "5", "--queue-size", "64"]
    owner, name, call, phase = POINTS[point]
    with monkeypatch.context() as patch:
        send_at(patch, owner, name, signum, call)
        assert exit_message("main_pretrain.py", *flags, "--output-dir", tmp_path / "demo") == PREEMPTED_EXIT_CODE
    said_once(capsys, unraisable, signum, f"while {phase}")
    assert not os.path.exists(tmp_path / "demo" / "checkpoint_last.pth")
    for out in ("demo", "whole") if "whole" not in DEMO_LAST else ("demo",):  # the whole demo's, once
        assert exit_message("main_pretrain.py", *flags, "--output-dir", tmp_path / out) is None
        DEMO_LAST[out] = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"kNN top-1: \d+\.\d% \(untrained: \d+\.\d%\); online probe top-1: \d+\.\d%", DEMO_LAST["demo"])
    assert DEMO_LAST["demo"] == DEMO_LAST["whole"]


DEMO_LAST = {}  # the last line of the demo run whole ("whole"), and of the stopped one run again ("demo")


def test_within_a_phase_a_stop_waits_for_its_check_and_a_second_ctrl_c_does_not():
    """In safe_points the start-up handler records: the phase goes on to its check (SIGTERM twice is one request);
    a second Ctrl-C raises at once. A child forked before its own handlers (a loader worker before its
    worker_init_fn) ignores the stop: its parent honours it."""
    preemption.stop_during_startup()
    try:
        reached = []
        with pytest.raises(preemption.Stopped) as stopped:
            with preemption.safe_points("extracting the test features"):
                for signum in (signal.SIGTERM, signal.SIGTERM):
                    os.kill(os.getpid(), signum)
                    reached.append(signum)
        assert reached == [signal.SIGTERM] * 2 and stopped.value.line().startswith(
            "=> stopped by SIGTERM while extracting the test features")
        with pytest.raises(preemption.Stopped):
            with preemption.safe_points("extracting the test features"):
                os.kill(os.getpid(), signal.SIGINT)  # after the SIGTERMs: a second stop, Ctrl-C
                reached.append(signal.SIGINT)
        assert reached == [signal.SIGTERM] * 2
        preemption.forget()
        preemption.stop_during_startup()
        child = os.fork()
        if child == 0:  # the child leaves at once, whatever happens: 0 if it ignored the stop
            code = 4  # raised
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                code = 0 if preemption.received() is None else 3
            finally:
                os._exit(code)
        assert os.waitpid(child, 0)[1] == 0 and preemption.received() is None
    finally:
        preemption.forget()
