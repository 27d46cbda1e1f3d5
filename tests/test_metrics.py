"""VOC average precision (area and 11-point) and the accuracies, against hand-computed values."""
import math
import warnings

import numpy as np
import pytest

from sce.metrics import (average_precision, average_precision_11point, mean_average_precision,
                         mean_per_class_accuracy, top1_accuracy)

# ranked: +, -, +, -, +  -> precision 1, 1/2, 2/3, 1/2, 3/5 at recall 1/3, 1/3, 2/3, 2/3, 1
SCORES = [0.9, 0.8, 0.7, 0.6, 0.1]
LABELS = [1, -1, 1, -1, 1]


def test_ap_hand_computed():
    # monotone precision at the recall steps 1/3, 2/3, 1: 1, 2/3, 3/5
    assert average_precision(SCORES, LABELS) == pytest.approx((1 + 2 / 3 + 3 / 5) / 3)
    # input order does not matter, only the ranking
    perm = [4, 2, 0, 3, 1]
    assert average_precision(np.array(SCORES)[perm], np.array(LABELS)[perm]) == pytest.approx(0.755555, abs=1e-6)


def test_ap_interpolates_precision():
    # + - - + : raw precision 1, .5, .33, .5 -> the dip at rank 3 is lifted to 0.5
    assert average_precision([4, 3, 2, 1], [1, -1, -1, 1]) == pytest.approx(0.5 * 1 + 0.5 * 0.5)
    # - + : precision 1/2 over the whole recall range
    assert average_precision([2, 1], [-1, 1]) == pytest.approx(0.5)
    assert average_precision([3, 2, 1], [1, 1, -1]) == pytest.approx(1.0)


def test_11point_ap_hand_computed():
    # thresholds 0..0.3 -> 1, 0.4..0.6 -> 2/3, 0.7..1.0 -> 3/5
    assert average_precision_11point(SCORES, LABELS) == pytest.approx((4 * 1 + 3 * 2 / 3 + 4 * 0.6) / 11)
    # - + : recall 1 reached at precision 1/2 everywhere
    assert average_precision_11point([2, 1], [-1, 1]) == pytest.approx(0.5)
    # + - - + - + (recall 1/3, 2/3, 1 at precision 1, 1/2, 1/2)
    s, y = [6, 5, 4, 3, 2, 1], [1, -1, -1, 1, -1, 1]
    assert average_precision_11point(s, y) == pytest.approx((4 * 1 + 7 * 0.5) / 11)
    assert average_precision(s, y) == pytest.approx((1 + 0.5 + 0.5) / 3)


def test_difficult_entries_are_ignored():
    # a difficult (0) image ranked first changes nothing, wherever it sits
    for pos in range(6):
        s = list(SCORES)
        y = list(LABELS)
        s.insert(pos, 0.95 - 0.2 * pos)
        y.insert(pos, 0)
        assert average_precision(s, y) == pytest.approx(average_precision(SCORES, LABELS))
        assert average_precision_11point(s, y) == pytest.approx(average_precision_11point(SCORES, LABELS))


def test_ap_matches_per_positive_transcription():
    # without ties, the area equals the mean over positives of the best precision at or below
    # their rank (an independent way of writing the same definition)
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = rng.integers(2, 40)
        scores = rng.permutation(n).astype(float)
        labels = rng.choice([-1, 1], n)
        labels[0] = 1
        order = np.argsort(-scores)
        hits = labels[order] > 0
        prec = np.cumsum(hits) / np.arange(1, n + 1)
        expected = np.mean([prec[i:].max() for i in range(n) if hits[i]])
        assert average_precision(scores, labels) == pytest.approx(expected)


def test_no_positive_is_nan_and_skipped_by_map():
    assert math.isnan(average_precision([1, 2], [-1, -1]))
    assert math.isnan(average_precision_11point([1, 2], [-1, 0]))
    scores = np.array([[0.9, 0.1], [0.1, 0.2], [0.5, 0.3]])
    labels = np.array([[1, -1], [-1, -1], [-1, -1]])
    m, aps = mean_average_precision(scores, labels)
    assert m == pytest.approx(100.0) and math.isnan(aps[1])


def test_accuracies():
    labels = [0, 0, 0, 1, 2, 2]
    pred = [0, 0, 1, 1, 0, 2]
    assert top1_accuracy(pred, labels) == pytest.approx(100 * 4 / 6)
    assert mean_per_class_accuracy(pred, labels) == pytest.approx(100 * (2 / 3 + 1 + 1 / 2) / 3)


def test_mean_per_class_ignores_classes_only_predicted():
    # class 3 is predicted but absent from the labels: no recall of its own, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = mean_per_class_accuracy([0, 0, 1, 1, 0, 2, 3], [0, 0, 0, 1, 2, 2, 2])
        assert got == pytest.approx(100 * (2 / 3 + 1 + 1 / 3) / 3)
