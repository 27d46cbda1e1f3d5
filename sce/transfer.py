"""Frozen-feature transfer: the many-shot logistic regression (ssl-transfer protocol) and the low-shot LinearSVC
helpers (PCL protocol). Features come from sce.frozen.split_features."""
import warnings

import numpy as np

from sce import UserError
from sce.metrics import (VOC_CLASSES, average_precision, mean_average_precision, mean_per_class_accuracy,
                         top1_accuracy)

LOGREG_WDS = np.logspace(-6, 5, 45)  # ssl-transfer: C = 1 / wd
METRICS = ["top1", "mean-per-class", "map11"]
SVM_MAX_ITER = 2000  # PCL / FAIR; no flag sets it


def _class_name(num_classes, c):
    """VOC07's name of class c of num_classes, else #c."""
    return VOC_CLASSES[c] if num_classes == len(VOC_CLASSES) else f"#{c}"


class FitCount:
    """Which fits stopped at their iteration limit before converging: one flag per fit, summed up
    into one line. scikit-learn would print a ConvergenceWarning per fit; the helpers here silence
    those and fill this instead."""

    def __init__(self):
        self.stalled = []

    def note(self, limit, flag=None, noun="fits"):
        """'46 fits, all converged' or '3 of 46 fits did not converge within --flag 1000: raise it'."""
        n, bad = len(self.stalled), sum(self.stalled)
        if not bad:
            return f"{n} {noun}, all converged"
        return f"{bad} of {n} {noun} did not converge within " + (f"{flag} {limit}: raise it" if flag
                                                                  else f"{limit} iterations")


def _stalled(model):
    """Whether a scikit-learn fit used all of its max_iter (when scikit-learn warns it did not converge)."""
    return bool(np.max(model.n_iter_) >= model.max_iter)


# ---------------------------------------------------------------- features

def l2_normalize_rows(x):
    """f / (||f|| + 1e-5), the PCL / FAIR normalisation (an all-zero row stays zero)."""
    return x / (np.linalg.norm(x, axis=1, keepdims=True) + 1e-5)


# ---------------------------------------------------------------- many-shot logistic regression

def holdout_split(labels, fraction, seed=0):
    """(train indices, val indices): a seeded random `fraction` of the images held out for model
    selection (ssl-transfer: 20% of train when a dataset has no validation split)."""
    n = len(labels)
    n_val = int(np.floor(fraction * n))
    if n_val < 1 or n_val >= n:
        raise UserError(f"--val-fraction {fraction} leaves {n_val} of {n} training images for validation: "
                        "need at least one image on each side")
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


class LogReg:
    """L-BFGS logistic regression: multinomial for single-label data, one binary model per class
    (difficult labels dropped) for a multi-label (N, C) 1 / -1 / 0 matrix. Warm-started across
    calls, as ssl-transfer does while it sweeps C. Each fit adds its flag to `count` (a FitCount)."""

    def __init__(self, multilabel, max_iter=1000, count=None):
        self.multilabel, self.max_iter, self.models = multilabel, max_iter, None
        self.count = count if count is not None else FitCount()

    def _new(self, C):
        from sklearn.linear_model import LogisticRegression
        return LogisticRegression(solver="lbfgs", C=C, max_iter=self.max_iter, warm_start=True)

    def fit(self, x, y, C):
        from sklearn.exceptions import ConvergenceWarning
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            if not self.multilabel:
                self.models = self.models or [self._new(C)]
                self.models[0].set_params(C=C).fit(x, y)
                self.count.stalled.append(_stalled(self.models[0]))
                return self
            self.models = self.models or [self._new(C) for _ in range(y.shape[1])]
            for c, model in enumerate(self.models):
                keep = y[:, c] != 0
                target = y[keep, c] > 0
                if target.all() or not target.any():
                    raise UserError(f"class #{c} has {'no negative' if target.all() else 'no positive'} "
                                    "image in the training split: it cannot be learned")
                model.set_params(C=C).fit(x[keep], target)
                self.count.stalled.append(_stalled(model))
        return self

    def score(self, x, y, metric):
        if metric == "map11":
            scores = np.stack([m.decision_function(x) for m in self.models], axis=1)
            return mean_average_precision(scores, y, eleven_point=True)[0]
        pred = self.models[0].predict(x)
        return mean_per_class_accuracy(pred, y) if metric == "mean-per-class" else top1_accuracy(pred, y)


def select_logreg(train_x, train_y, val_x, val_y, metric, wds=LOGREG_WDS, max_iter=1000, log=print, count=None):
    """Fit on train for each wd (C = 1 / wd) and score on val: returns (best C, [(C, val score)]).
    The first best wins on ties. `count` (a FitCount) gets a flag per fit."""
    clf, history = LogReg(metric == "map11", max_iter, count), []
    for wd in wds:
        C = 1.0 / float(wd)
        history.append((C, clf.fit(train_x, train_y, C).score(val_x, val_y, metric)))
        log(f"  wd {wd:.3g} (C {C:.3g}): val {metric} {history[-1][1]:.2f}")
    best = int(np.argmax([s for _, s in history]))
    return history[best][0], history


def fit_eval_logreg(train_x, train_y, test_x, test_y, metric, C, max_iter=1000, count=None):
    return LogReg(metric == "map11", max_iter, count).fit(train_x, train_y, C).score(test_x, test_y, metric)


# ---------------------------------------------------------------- low-shot LinearSVC (PCL)

def lowshot_draw(labels, k, seed):
    """Training images of one low-shot draw: for each class, k images positive for it, drawn
    without replacement with `seed` (an int or a list of ints). Returned as a (num_classes, k)
    index array; concatenated it is the training set (an image drawn for two classes counts
    twice, as in PCL)."""
    rng = np.random.default_rng(seed)
    draws = []
    for c in range(labels.shape[1]):
        positives = np.flatnonzero(labels[:, c] == 1)
        if len(positives) < k:
            raise UserError(f"class {_class_name(labels.shape[1], c)} has {len(positives)} positive images, fewer "
                            f"than the {k} shots asked for: lower --shots")
        draws.append(np.sort(rng.choice(positives, k, replace=False)))
    return np.stack(draws)


def _svm(x, y, cost):
    """The fitted LinearSVC and whether it stalled at SVM_MAX_ITER (the caller counts it)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.svm import LinearSVC
    # the PCL / FAIR settings: positives weigh twice, squared hinge, dual solver
    svm = LinearSVC(C=cost, class_weight={1: 2, -1: 1}, intercept_scaling=1.0, penalty="l2",
                    loss="squared_hinge", tol=1e-4, dual=True, max_iter=SVM_MAX_ITER, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        svm.fit(x, y)
    return svm, _stalled(svm)


DIFFICULT = ("negative", "ignore")  # low-shot handling of difficult labels; PCL's first


def voc_targets(labels, difficult):
    """How low-shot treats difficult (0) labels. 'negative': they become -1, as PCL's
    eval_svm_voc.py (the paper's numbers) does when it trains the SVMs and when it binarises the
    test targets (> 0). 'ignore': left as 0, which the SVM and AP helpers skip (VOC devkit)."""
    if difficult not in DIFFICULT:
        raise ValueError(f"difficult must be one of {DIFFICULT}, got {difficult!r}")
    return np.where(labels == 0, -1, labels).astype(labels.dtype) if difficult == "negative" else labels


def _binary(labels, c):
    """Rows to train class c on (labels still 0, i.e. difficult under 'ignore', dropped) and their
    +1 / -1 targets."""
    keep = np.flatnonzero(labels[:, c] != 0)
    y = np.where(labels[keep, c] > 0, 1, -1)
    if (y > 0).all() or (y < 0).all():
        only = "positive" if (y > 0).all() else "negative"
        raise UserError(f"class {_class_name(labels.shape[1], c)} has only {only} training images in this draw: use "
                        "more shots or more images")
    return keep, y


def _svm_scores(x, labels, test_x, c, cost):
    keep, y = _binary(labels, c)
    svm, stalled = _svm(x[keep], y, cost)
    return svm.decision_function(test_x), stalled


def svm_test_map(x, labels, test_x, test_labels, cost, *, jobs=1, difficult="negative", count=None):
    """One LinearSVC per class trained on (x, labels); mAP (percent) and per-class AP on the test set.
    `difficult` (see voc_targets) applies to both the training and the test labels. `count` (a
    FitCount) gets a flag per SVM."""
    from joblib import Parallel, delayed
    labels, test_labels = voc_targets(labels, difficult), voc_targets(test_labels, difficult)
    cols = Parallel(n_jobs=jobs)(delayed(_svm_scores)(x, labels, test_x, c, cost)
                                 for c in range(labels.shape[1]))
    if count is not None:
        count.stalled += [stalled for _, stalled in cols]
    return mean_average_precision(np.stack([scores for scores, _ in cols], axis=1), test_labels)


def cv_splits(labels, groups, folds=3, seed=0, difficult="negative"):
    """The cross-validation of a training draw, made once for every cost of the grid and for cv_drops: per
    class, its rows, their +1 / -1 targets, the number of folds (below `folds` when the class has fewer
    positives or negatives) and the (train, held-out) splits that can score an AP (those with one class on
    the training side or no positive held out are skipped); `difficult` (see voc_targets) applies to the
    training and the held-out folds alike. groups: the draw's image of each row (a duplicate never sits on
    both sides of a split)."""
    labels = voc_targets(labels, difficult)
    return [_class_splits(labels, c, folds, seed, groups) for c in range(labels.shape[1])], folds


def _class_splits(labels, c, folds, seed, groups):
    from sklearn.model_selection import StratifiedGroupKFold
    keep, y = _binary(labels, c)
    n_splits = min(folds, int((y > 0).sum()), int((y < 0).sum()))
    if n_splits < 2:
        raise UserError("--cost-selection cv needs at least 2 positive and 2 negative training "
                        "images per class: use more shots or --cost-selection test")
    cv = StratifiedGroupKFold(n_splits=n_splits, shuffle=True, random_state=seed)
    splits = [(tr, va) for tr, va in cv.split(keep, y, groups[keep])
              if len(np.unique(y[tr])) == 2 and (y[va] > 0).any()]
    return keep, y, n_splits, splits


def _svm_cv_ap(x, keep, y, splits, cost):
    """Mean held-out AP of a class over its scored splits (nan when none) and a stalled flag per fit."""
    x = x[keep]
    aps, stalled = [], []
    for tr, va in splits:
        svm, bad = _svm(x[tr], y[tr], cost)
        aps.append(average_precision(svm.decision_function(x[va]), y[va]))
        stalled.append(bad)
    return (float(np.mean(aps)) if aps else float("nan")), stalled


def svm_cv_map(x, splits, cost, jobs=1, count=None):
    """Cross-validated mAP (percent) of the per-class LinearSVCs on the training draw alone, over its
    cv_splits. Classes with no scored split are left out of the mean (cv_drops says which). `count` (a
    FitCount) gets a flag per SVM."""
    from joblib import Parallel, delayed
    per_class = Parallel(n_jobs=jobs)(delayed(_svm_cv_ap)(x, keep, y, scored, cost)
                                      for keep, y, _, scored in splits[0])
    if count is not None:
        count.stalled += [bad for _, stalled in per_class for bad in stalled]
    return 100.0 * float(np.nanmean([ap for ap, _ in per_class]))


def cv_drops(splits):
    """One line on what the cross-validation of cv_splits leaves out of the cost choice: classes cut to fewer
    folds, skipped splits, classes with no scored split; '' if nothing. The splits depend on the labels
    alone, so the line holds for every cost."""
    per_class, folds = splits
    fewer = sum(n_splits < folds for _, _, n_splits, _ in per_class)
    skipped = sum(n_splits - len(scored) for _, _, n_splits, scored in per_class)
    unscored = [_class_name(len(per_class), c) for c, (_, _, _, scored) in enumerate(per_class) if not scored]
    parts = ([f"{fewer} classes cut below {folds} folds (too few positives or negatives)"] if fewer else []) \
        + ([f"{skipped} folds skipped (one class to train on or no positive held out)"] if skipped else []) \
        + ([f"class {', '.join(unscored)} out of the mean (no fold scored)"] if unscored else [])
    return "cv: " + "; ".join(parts) if parts else ""
