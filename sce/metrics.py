"""Evaluation metrics on numpy arrays: VOC average precision (area and 11-point), accuracies.

VOC labels are 1 (positive), -1 (negative) or 0 (difficult): difficult entries are ignored, they
count neither as a hit nor as a false alarm. The two APs are written here because they are the
protocol: scikit-learn's average_precision_score is the non-interpolated area, which reads lower.
The accuracies are scikit-learn's.
"""
import warnings

import numpy as np

VOC_CLASSES = ["aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
               "train", "tvmonitor"]


def precision_recall(scores, labels):
    """Precision and recall after each of the ranked (descending score) non-ignored entries."""
    scores, labels = np.asarray(scores, np.float64).ravel(), np.asarray(labels).ravel()
    keep = labels != 0
    scores, labels = scores[keep], labels[keep] > 0
    order = np.argsort(-scores, kind="stable")  # ties keep their input order, as the VOC devkit
    tp = np.cumsum(labels[order])
    fp = np.cumsum(~labels[order])
    npos = labels.sum()
    precision = tp / np.maximum(tp + fp, 1)
    recall = tp / npos if npos else np.full(len(tp), np.nan)
    return precision, recall


def average_precision(scores, labels):
    """Area under the interpolated precision-recall curve (VOC2010+, as PCL / FAIR low-shot):
    precision is made monotone (max over higher recalls), then summed over recall changes.
    NaN when there is no positive."""
    precision, recall = precision_recall(scores, labels)
    if len(recall) == 0 or np.isnan(recall[0]):
        return float("nan")
    mrec = np.concatenate([[0.0], recall, [1.0]])
    mpre = np.concatenate([[0.0], precision, [0.0]])
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]
    changed = np.nonzero(mrec[1:] != mrec[:-1])[0] + 1
    return float(np.sum((mrec[changed] - mrec[changed - 1]) * mpre[changed]))


def average_precision_11point(scores, labels):
    """VOC2007 11-point AP: mean over recall thresholds 0, 0.1, ..., 1 of the best precision at a
    recall >= the threshold (0 when that recall is never reached). NaN when there is no positive."""
    precision, recall = precision_recall(scores, labels)
    if len(recall) == 0 or np.isnan(recall[0]):
        return float("nan")
    points = [precision[recall >= t].max() if (recall >= t).any() else 0.0
              for t in np.linspace(0, 1, 11)]
    return float(np.mean(points))


def mean_average_precision(scores, labels, eleven_point=False):
    """Mean over classes (columns) of the AP, in percent; classes without positives are skipped."""
    ap_fn = average_precision_11point if eleven_point else average_precision
    aps = np.array([ap_fn(scores[:, c], labels[:, c]) for c in range(labels.shape[1])])
    return 100.0 * float(np.nanmean(aps)), aps


def top1_accuracy(pred, labels):
    from sklearn.metrics import accuracy_score
    return 100.0 * float(accuracy_score(labels, pred))


def mean_per_class_accuracy(pred, labels):
    """Mean over the classes present in `labels` of the fraction of their images predicted right,
    in percent (the metric of ssl-transfer for Aircraft, Caltech101, Flowers, Pets)."""
    from sklearn.metrics import balanced_accuracy_score
    with warnings.catch_warnings():
        # a class predicted but absent from `labels` has no recall: sklearn warns, then leaves it out
        warnings.filterwarnings("ignore", message="y_pred contains classes not in y_true")
        return 100.0 * float(balanced_accuracy_score(labels, pred))
