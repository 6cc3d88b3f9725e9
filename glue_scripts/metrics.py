"""GLUE metrics: ``evaluate.load("glue", task)`` when it can be loaded, else an equivalent local implementation.

The standard GLUE metric set per task (the keys ``evaluate``'s ``glue`` metric returns):

- ``cola``: ``matthews_correlation``
- ``stsb``: ``pearson``, ``spearmanr``
- ``mrpc``, ``qqp``: ``accuracy``, ``f1`` (binary F1 of the positive class, label 1)
- ``sst2``, ``mnli`` (and ``mnli_matched``/``mnli_mismatched``), ``qnli``, ``rte``, ``wnli``: ``accuracy``

The local functions use numpy only and agree with ``sklearn.metrics`` (``accuracy_score``, ``f1_score``,
``matthews_corrcoef``) and ``scipy.stats`` (``pearsonr``, ``spearmanr``, average ranks for ties); the tests
check that on random predictions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "GLUE_METRIC_TASKS",
    "LocalGlueMetric",
    "accuracy",
    "binary_f1",
    "glue_compute_metrics",
    "load_glue_metric",
    "matthews_corrcoef",
    "pearson",
    "spearman",
]

logger = logging.getLogger(__name__)

#: Config names of ``evaluate``'s ``glue`` metric handled here.
GLUE_METRIC_TASKS = ("cola", "mnli", "mnli_matched", "mnli_mismatched", "mrpc", "qnli", "qqp", "rte", "sst2",
                     "stsb", "wnli")


def _arrays(predictions: Sequence, references: Sequence) -> tuple[np.ndarray, np.ndarray]:
    p, r = np.asarray(predictions), np.asarray(references)
    if p.shape != r.shape or p.ndim != 1:
        raise ValueError(f"predictions and references must be 1-D of the same length, got shapes {p.shape} "
                         f"and {r.shape}")
    return p, r


def accuracy(predictions: Sequence, references: Sequence) -> float:
    """Fraction of exact matches (``sklearn.metrics.accuracy_score``)."""
    p, r = _arrays(predictions, references)
    return float(np.mean(p == r)) if p.size else 0.0


def binary_f1(predictions: Sequence, references: Sequence, *, pos_label: int = 1) -> float:
    """F1 of the positive class (``sklearn.metrics.f1_score``, ``average="binary"``; 0.0 when undefined)."""
    p, r = _arrays(predictions, references)
    tp = float(np.sum((p == pos_label) & (r == pos_label)))
    fp = float(np.sum((p == pos_label) & (r != pos_label)))
    fn = float(np.sum((p != pos_label) & (r == pos_label)))
    denom = 2 * tp + fp + fn
    return 2 * tp / denom if denom else 0.0


def matthews_corrcoef(predictions: Sequence, references: Sequence) -> float:
    """Matthews correlation, multi-class form (``sklearn.metrics.matthews_corrcoef``; 0.0 when undefined)."""
    p, r = _arrays(predictions, references)
    labels = np.unique(np.concatenate([p, r]))
    pi, ri = np.searchsorted(labels, p), np.searchsorted(labels, r)
    conf = np.zeros((labels.size, labels.size), dtype=np.float64)
    np.add.at(conf, (ri, pi), 1.0)
    t_sum, p_sum = conf.sum(axis=1), conf.sum(axis=0)
    n_correct, n = np.trace(conf), conf.sum()
    cov_ypyp = n * n - np.dot(p_sum, p_sum)
    cov_ytyt = n * n - np.dot(t_sum, t_sum)
    if cov_ypyp * cov_ytyt == 0:
        return 0.0
    return float((n_correct * n - np.dot(t_sum, p_sum)) / np.sqrt(cov_ytyt * cov_ypyp))


def pearson(predictions: Sequence, references: Sequence) -> float:
    """Pearson correlation coefficient (``scipy.stats.pearsonr(...)[0]``; NaN for a constant input)."""
    p, r = _arrays(predictions, references)
    p, r = p.astype(np.float64), r.astype(np.float64)
    dp, dr = p - p.mean(), r - r.mean()
    denom = np.sqrt(np.dot(dp, dp) * np.dot(dr, dr))
    return float(np.clip(np.dot(dp, dr) / denom, -1.0, 1.0)) if denom else float("nan")


def _average_ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    starts = np.r_[True, xs[1:] != xs[:-1]]  # first index of each run of ties
    group = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    last = np.r_[first[1:], xs.size] - 1
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = (first[group] + last[group]) / 2.0 + 1.0
    return ranks


def spearman(predictions: Sequence, references: Sequence) -> float:
    """Spearman rank correlation with average ranks for ties (``scipy.stats.spearmanr(...)[0]``)."""
    p, r = _arrays(predictions, references)
    return pearson(_average_ranks(p.astype(np.float64)), _average_ranks(r.astype(np.float64)))


def glue_compute_metrics(task: str, predictions: Sequence, references: Sequence) -> dict[str, float]:
    """The GLUE metric set of ``task`` computed locally (same keys as ``evaluate.load("glue", task)``).

    Args:
        task: a GLUE config name (see ``GLUE_METRIC_TASKS``).
        predictions: class ids (float scores for ``stsb``).
        references: gold class ids (float scores for ``stsb``).

    Returns:
        Metric name -> value.

    Raises:
        ValueError: unknown task or mismatched inputs.
    """
    if task == "cola":
        return {"matthews_correlation": matthews_corrcoef(predictions, references)}
    if task == "stsb":
        return {"pearson": pearson(predictions, references), "spearmanr": spearman(predictions, references)}
    if task in ("mrpc", "qqp"):
        return {"accuracy": accuracy(predictions, references), "f1": binary_f1(predictions, references)}
    if task in ("sst2", "mnli", "mnli_matched", "mnli_mismatched", "qnli", "rte", "wnli"):
        return {"accuracy": accuracy(predictions, references)}
    raise ValueError(f"unknown GLUE metric task {task!r}; choose one of {list(GLUE_METRIC_TASKS)}")


class LocalGlueMetric:
    """Stand-in for ``evaluate``'s ``glue`` metric: ``compute(predictions=..., references=...) -> dict``.

    Args:
        task: a GLUE config name (see ``GLUE_METRIC_TASKS``).
    """

    def __init__(self, task: str) -> None:
        if task not in GLUE_METRIC_TASKS:
            raise ValueError(f"unknown GLUE metric task {task!r}; choose one of {list(GLUE_METRIC_TASKS)}")
        self.task = task

    def compute(self, *, predictions: Sequence, references: Sequence) -> dict[str, float]:
        """Metric name -> value for these predictions."""
        return glue_compute_metrics(self.task, predictions, references)

    def __repr__(self) -> str:
        return f"LocalGlueMetric({self.task!r})"


def load_glue_metric(task: str, *, backend: str = "auto", cache_dir: str | None = None) -> Any:
    """The GLUE metric of ``task``: ``evaluate.load("glue", task)``, or :class:`LocalGlueMetric`.

    Args:
        task: a GLUE config name (see ``GLUE_METRIC_TASKS``).
        backend: ``"auto"`` tries ``evaluate`` and falls back to the local implementation with a logged
            message; ``"evaluate"`` raises if it cannot be loaded; ``"local"`` never touches ``evaluate``.
        cache_dir: passed to ``evaluate.load``.

    Returns:
        An object with ``compute(predictions=..., references=...) -> dict``.

    Raises:
        ValueError: unknown task or backend.
    """
    if backend not in ("auto", "evaluate", "local"):
        raise ValueError(f"metric backend must be 'auto', 'evaluate' or 'local', got {backend!r}")
    if task not in GLUE_METRIC_TASKS:
        raise ValueError(f"unknown GLUE metric task {task!r}; choose one of {list(GLUE_METRIC_TASKS)}")
    if backend == "local":
        return LocalGlueMetric(task)
    try:
        import evaluate

        return evaluate.load("glue", task, cache_dir=cache_dir)
    except Exception as exc:  # offline, no metric script, missing package: anything means "not reachable"
        if backend == "evaluate":
            raise
        logger.warning("evaluate.load('glue', %r) failed (%s: %s); using the local GLUE metrics of "
                       "glue_scripts/metrics.py instead", task, type(exc).__name__, str(exc).splitlines()[0][:200])
        return LocalGlueMetric(task)
