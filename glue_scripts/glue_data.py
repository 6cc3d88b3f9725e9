"""Read GLUE tasks from a folder in the original GLUE TSV format (``glue_data/<TASK>/{train,dev,test}.tsv``).

The folder is what GLUE's ``download_glue_data.py`` writes, e.g. ``/work/shared/data/glue``::

    SST-2/  MRPC/  RTE/  CoLA/  QNLI/  MNLI/  QQP/  STS-B/  WNLI/

Each task is returned as a :class:`datasets.DatasetDict` with the same column names, label order and
``ClassLabel`` names as the Hugging Face hub dataset ``load_dataset("glue", task)``, so ``run_glue.py`` treats
both sources alike:

====== ============================ ======================================= ===============================
task   text columns                 labels (id order)                       TSV columns used (by header)
====== ============================ ======================================= ===============================
cola   sentence                     unacceptable, acceptable                no header: source, label, mark,
                                                                            sentence (test: index, sentence)
sst2   sentence                     negative, positive                      sentence, label
mrpc   sentence1, sentence2         not_equivalent, equivalent              Quality, #1 String, #2 String
qqp    question1, question2         not_duplicate, duplicate                question1, question2, is_duplicate
stsb   sentence1, sentence2         float score 0..5                        sentence1, sentence2, score
mnli   premise, hypothesis          entailment, neutral, contradiction      sentence1, sentence2, gold_label
qnli   question, sentence           entailment, not_entailment              question, sentence, label
rte    sentence1, sentence2         entailment, not_entailment              sentence1, sentence2, label
wnli   sentence1, sentence2         not_entailment, entailment              sentence1, sentence2, label
====== ============================ ======================================= ===============================

Files are read with ``csv`` and ``quoting=csv.QUOTE_NONE`` (MRPC and RTE text holds stray ``"``) and
``utf-8-sig`` (MRPC's header starts with a BOM); text is kept byte for byte (SST-2's trailing spaces too).
Test splits have no labels: their ``label`` is ``-1``, as on the hub.
"""

from __future__ import annotations

import csv
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GLUE_TASKS", "TASK_TO_FOLDER", "TASK_TO_KEYS", "GlueTask", "load_glue_dir", "read_glue_tsv"]

logger = logging.getLogger(__name__)

csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


@dataclass(frozen=True)
class GlueTask:
    """How one GLUE task is laid out on disk and on the hub.

    Args:
        name: the hub config name (``sst2``, ``mnli``...).
        folder: the sub-folder of the GLUE directory (``SST-2``, ``MNLI``...).
        keys: the hub's text column names (second is ``None`` for single-sentence tasks).
        label_names: ``ClassLabel`` names in id order; ``None`` for the regression task (STS-B).
        tsv_text: the TSV header names of the text columns (or positions for header-less files).
        tsv_label: the TSV header name (or position) of the label column.
        raw_labels: how the TSV writes each label, in the order of ``label_names``.
        splits: hub split name -> TSV file stem.
        has_header: whether train/dev files start with a header line.
    """

    name: str
    folder: str
    keys: tuple[str, str | None]
    label_names: tuple[str, ...] | None
    tsv_text: tuple[str | int, ...]
    tsv_label: str | int
    raw_labels: tuple[str, ...] | None
    splits: tuple[tuple[str, str], ...] = (("train", "train"), ("validation", "dev"), ("test", "test"))
    has_header: bool = True

    @property
    def is_regression(self) -> bool:
        """True for STS-B (a float score rather than a class)."""
        return self.label_names is None


_NLI2 = ("entailment", "not_entailment")

GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in (
        GlueTask("cola", "CoLA", ("sentence", None), ("unacceptable", "acceptable"), (3,), 1, ("0", "1"),
                 has_header=False),
        GlueTask("sst2", "SST-2", ("sentence", None), ("negative", "positive"), ("sentence",), "label", ("0", "1")),
        GlueTask("mrpc", "MRPC", ("sentence1", "sentence2"), ("not_equivalent", "equivalent"),
                 ("#1 String", "#2 String"), "Quality", ("0", "1")),
        GlueTask("qqp", "QQP", ("question1", "question2"), ("not_duplicate", "duplicate"),
                 ("question1", "question2"), "is_duplicate", ("0", "1")),
        GlueTask("stsb", "STS-B", ("sentence1", "sentence2"), None, ("sentence1", "sentence2"), "score", None),
        GlueTask("mnli", "MNLI", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"),
                 ("sentence1", "sentence2"), "gold_label", ("entailment", "neutral", "contradiction"),
                 splits=(("train", "train"), ("validation_matched", "dev_matched"),
                         ("validation_mismatched", "dev_mismatched"), ("test_matched", "test_matched"),
                         ("test_mismatched", "test_mismatched"))),
        GlueTask("qnli", "QNLI", ("question", "sentence"), _NLI2, ("question", "sentence"), "label", _NLI2),
        GlueTask("rte", "RTE", ("sentence1", "sentence2"), _NLI2, ("sentence1", "sentence2"), "label", _NLI2),
        GlueTask("wnli", "WNLI", ("sentence1", "sentence2"), ("not_entailment", "entailment"),
                 ("sentence1", "sentence2"), "label", ("0", "1")),
    )
}
#: hub task name -> sub-folder of a GLUE directory.
TASK_TO_FOLDER = {name: t.folder for name, t in GLUE_TASKS.items()}
#: hub task name -> (first text column, second text column or None).
TASK_TO_KEYS = {name: t.keys for name, t in GLUE_TASKS.items()}


def _task(task: str) -> GlueTask:
    try:
        return GLUE_TASKS[task]
    except KeyError:
        raise ValueError(f"task_name: unknown GLUE task {task!r}; choose one of {sorted(GLUE_TASKS)}") from None


def read_glue_tsv(path: str | Path, task: str, *, labeled: bool = True) -> list[dict[str, Any]]:
    """Parse one GLUE TSV file into hub-style rows.

    Args:
        path: the ``.tsv`` file.
        task: the hub task name (``sst2``, ``mrpc``, ``cola``...).
        labeled: False for test files (no label column; ``label`` becomes ``-1``).

    Returns:
        One dict per row with the task's text columns, ``label`` (class id, float score, or -1) and ``idx``.

    Raises:
        ValueError: unknown task, a header without the expected columns, or a label the task does not have.
    """
    spec = _task(task)
    path = Path(path)
    with path.open(encoding="utf-8-sig", newline="") as handle:
        lines = list(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not lines:
        return []
    header_less = not spec.has_header and labeled  # CoLA train/dev; CoLA test has an "index\tsentence" header
    if header_less:
        header, body = None, lines
        text_cols = [int(c) for c in spec.tsv_text]
        label_col = int(spec.tsv_label)
    else:
        header, body = [h.strip() for h in lines[0]], lines[1:]
        if not labeled:
            # Test files: CoLA/SST-2 have (index, sentence); MRPC has (index, #1 ID, #2 ID, #1 String, #2 String).
            names = ["sentence"] if spec.name in ("cola", "sst2") else list(spec.tsv_text)
        else:
            names = [*spec.tsv_text, spec.tsv_label]
        missing = [n for n in names if n not in header]
        if missing:
            raise ValueError(f"{path}: header {header} lacks the column(s) {missing} expected for GLUE task {task!r}")
        text_cols = [header.index(n) for n in names[: len(spec.tsv_text) if labeled else len(names)]]
        # MNLI's label is the last column (gold_label); label1..label5 come before it.
        label_col = (len(header) - 1 if spec.tsv_label == "gold_label" else header.index(spec.tsv_label)) \
            if labeled else -1
    label_ids = {raw: i for i, raw in enumerate(spec.raw_labels)} if spec.raw_labels else None
    width = max([*text_cols, label_col]) + 1
    rows: list[dict[str, Any]] = []
    skipped = 0
    for line in body:
        if len(line) < width:  # a few QQP rows are truncated in the original release
            skipped += 1
            continue
        row: dict[str, Any] = {}
        for key, col in zip((k for k in spec.keys if k is not None), text_cols):
            row[key] = line[col]
        if not labeled:
            row["label"] = -1
        elif label_ids is None:
            row["label"] = float(line[label_col])
        else:
            raw = line[label_col].strip()
            if raw not in label_ids:
                raise ValueError(f"{path}: label {raw!r} in row {len(rows) + skipped + 1} is not one of "
                                 f"{list(label_ids)} (GLUE task {task!r})")
            row["label"] = label_ids[raw]
        row["idx"] = len(rows)
        rows.append(row)
    if skipped:
        logger.warning("%s: skipped %d malformed row(s) with fewer than %d columns", path, skipped, width)
    return rows


def load_glue_dir(glue_dir: str | Path, task: str, *, splits: tuple[str, ...] | None = None):
    """Load one task from a GLUE directory as a ``datasets.DatasetDict`` shaped like the hub's.

    Args:
        glue_dir: the directory holding the task sub-folders (``SST-2``, ``MRPC``...).
        task: the hub task name.
        splits: hub split names to load (default: every split whose TSV exists).

    Returns:
        ``DatasetDict`` with ``train``, ``validation`` (MNLI: ``validation_matched``/``validation_mismatched``)
        and ``test*`` splits where the files exist; ``label`` is a ``ClassLabel`` (``Value("float32")`` for STS-B).

    Raises:
        FileNotFoundError: the task folder or a requested split's file is missing.
        ValueError: unknown task or malformed file.
    """
    import datasets

    spec = _task(task)
    folder = Path(glue_dir) / spec.folder
    if not folder.is_dir():
        raise FileNotFoundError(f"glue_dir: no folder {spec.folder!r} for task {task!r} in {glue_dir}")
    label = datasets.Value("float32") if spec.is_regression else datasets.ClassLabel(names=list(spec.label_names))
    features = datasets.Features({
        **{k: datasets.Value("string") for k in spec.keys if k is not None},
        "label": label,
        "idx": datasets.Value("int32"),
    })
    out = {}
    for split, stem in spec.splits:
        path = folder / f"{stem}.tsv"
        if splits is not None and split not in splits:
            continue
        if not path.exists():
            if splits is not None:
                raise FileNotFoundError(f"glue_dir: split {split!r} of task {task!r} needs {path}")
            continue
        rows = read_glue_tsv(path, task, labeled=not split.startswith("test"))
        cols = {name: [r[name] for r in rows] for name in features}
        out[split] = datasets.Dataset.from_dict(cols, features=features)
        logger.info("GLUE %s %s: %d rows from %s", task, split, len(rows), path)
    if not out:
        raise FileNotFoundError(f"glue_dir: no train/dev/test TSV for task {task!r} in {folder}")
    return datasets.DatasetDict(out)
