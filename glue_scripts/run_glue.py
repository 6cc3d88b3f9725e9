#!/usr/bin/env python
"""Fine-tune a sequence classifier on GLUE with ``transformers.Trainer``, optionally with act_hf compression.

Modelled on the transformers text-classification example (``run_glue.py``), written for act_hf::

    python glue_scripts/run_glue.py --model_name_or_path bert-large-cased --task_name sst2 \\
        --glue_dir /path/to/glue_data --do_train --do_eval --max_seq_length 128 \\
        --per_device_train_batch_size 32 --learning_rate 2e-5 --num_train_epochs 3 \\
        --output_dir out/sst2-3bit --act_compress --act_bits 3

    python glue_scripts/run_glue.py glue_scripts/recipes/gact_bert_large_sst2.json   # one JSON config

Data come from one of three sources, checked in this order:

1. ``--glue_dir``: a folder in the original GLUE TSV format (``SST-2/``, ``MRPC/``, ``CoLA/``...; see
   ``glue_data.py``), with ``--task_name``;
2. ``--train_file``/``--validation_file``/``--test_file``: csv, tsv or json(l). A ``.tsv`` with ``--task_name``
   is read in that task's GLUE layout; otherwise the columns ``sentence1``/``sentence2`` (or the first one or
   two non-label columns) and ``label`` are used;
3. the Hugging Face hub: ``datasets.load_dataset("glue", task_name)`` (needs network access).

``--act_compress`` adds :class:`act_hf.ActCompressCallback` to the Trainer (it patches the model when the
Trainer is built) with ``ActConfig(bits=--act_bits, group_size=--act_group_size)``; its ``act_hf/*`` log
entries (saved activation MB, compression ratio, average bits) are also written to ``all_results.json``.
``--act_adaptive`` (or a fractional ``--act_bits`` such as 2.5) makes ``--act_bits`` an average budget that
act_hf's allocator distributes over the slots from measured sensitivities every ``--act_adapt_interval``
steps (``act_hf/variance_ratio`` and ``act_hf/adapt_overhead`` join the logs).
Without ``--act_compress`` the run is the uncompressed baseline.
"""

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # glue_data / metrics live beside this script
    sys.path.insert(0, _HERE)

import datasets
import transformers
from glue_data import GLUE_TASKS, TASK_TO_KEYS, load_glue_dir, read_glue_tsv
from metrics import load_glue_metric
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    EvalPrediction,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import act_hf

__all__ = ["ActArguments", "DataTrainingArguments", "ModelArguments", "build_act_config", "main", "parse_args"]

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    """Which model, config and tokenizer to fine-tune from."""

    model_name_or_path: str = field(metadata={"help": "Path to a pretrained model or a model id on the hub."})
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer name or path, if not the model's."}
    )
    cache_dir: str | None = field(
        default=None, metadata={"help": "Where to store models, datasets and metrics downloaded from the hub."}
    )
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "Use a fast (tokenizers-backed) tokenizer."})
    model_revision: str = field(default="main", metadata={"help": "Model version: branch, tag or commit id."})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the hub."})
    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "Load a checkpoint whose head has another number of labels."}
    )


@dataclass
class DataTrainingArguments:
    """Which data to train and evaluate on, and how to tokenize them."""

    task_name: str | None = field(
        default=None, metadata={"help": f"GLUE task, one of {sorted(GLUE_TASKS)}.", "choices": sorted(GLUE_TASKS)}
    )
    glue_dir: str | None = field(
        default=None,
        metadata={"help": "Folder in the original GLUE TSV format (SST-2/, MRPC/, CoLA/, MNLI/...); "
                          "needs --task_name."},
    )
    train_file: str | None = field(default=None, metadata={"help": "csv/tsv/json(l) file of training data."})
    validation_file: str | None = field(default=None, metadata={"help": "csv/tsv/json(l) file of dev data."})
    test_file: str | None = field(default=None, metadata={"help": "csv/tsv/json(l) file to predict on."})
    max_seq_length: int = field(
        default=128, metadata={"help": "Maximum tokens per example after tokenization; longer ones are truncated."}
    )
    pad_to_max_length: bool = field(
        default=True,
        metadata={"help": "Pad every example to max_seq_length; if False, pad each batch to its longest example."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N evaluation rows."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Use only the first N test rows."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the tokenized datasets."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenizing."})
    metric_backend: str = field(
        default="auto",
        metadata={"help": "'auto' (evaluate.load('glue', task), local fallback), 'evaluate' or 'local'.",
                  "choices": ["auto", "evaluate", "local"]},
    )

    def __post_init__(self) -> None:
        if self.task_name is not None:
            self.task_name = self.task_name.lower()
            if self.task_name not in GLUE_TASKS:
                raise ValueError(f"--task_name: unknown GLUE task {self.task_name!r}; choose one of "
                                 f"{sorted(GLUE_TASKS)}")
        if self.glue_dir is not None and self.task_name is None:
            raise ValueError("--glue_dir needs --task_name to know which sub-folder to read")
        if self.task_name is None and self.train_file is None and self.validation_file is None:
            raise ValueError("give --task_name (with --glue_dir, or for the hub) or --train_file/--validation_file")
        for name in ("train_file", "validation_file", "test_file"):
            path = getattr(self, name)
            if path is not None and Path(path).suffix.lower() not in (".csv", ".tsv", ".json", ".jsonl"):
                raise ValueError(f"--{name} must be a .csv, .tsv, .json or .jsonl file, got {path}")
        if self.max_seq_length < 1:
            raise ValueError(f"--max_seq_length must be positive, got {self.max_seq_length}")


@dataclass
class ActArguments:
    """act_hf activation compression (the baseline when --act_compress is not given)."""

    act_compress: bool = field(default=False, metadata={"help": "Compress saved activations with act_hf."})
    act_bits: float = field(
        default=3.0,
        metadata={"help": "Bits per activation: an integer 1..8, or a fractional average budget (e.g. 2.5) for "
                          "adaptive bits."},
    )
    act_adaptive: bool = field(
        default=False, metadata={"help": "Adaptive bit allocation: --act_bits is the average budget (a fractional "
                                         "--act_bits such as 2.5 implies it)."}
    )
    act_adapt_interval: int | None = field(
        default=None, metadata={"help": "Optimizer steps between adaptive re-allocations (default: act_hf's)."}
    )
    act_group_size: int = field(default=256, metadata={"help": "Quantization group size (a multiple of 8)."})
    act_swap: bool = field(
        default=False, metadata={"help": "Keep the packed activations in pinned host memory until backward (GPU)."}
    )
    act_checkpoint_bits: int | None = field(
        default=None, metadata={"help": "With --activation_checkpointing (--gradient_checkpointing before "
                                        "transformers 5.23): keep each layer's checkpointed input packed "
                                        "at this many bits (1..8) instead of exact. Biased: backward recomputes "
                                        "the layer on the rounded input; 8 kept MiniLM's SST-2 accuracy, 4 "
                                        "(GACT's CB1) cost about 3 points with plain groups and 0.9 with "
                                        "channel scaling (README)."}
    )
    act_channel_scale: bool | None = field(
        default=None, metadata={"help": "Equalize the feature channels by powers of two before quantizing (exact; "
                                        "cuts the variance outlier channels add). Default: on. False: plain "
                                        "groups."}
    )
    act_kinds: str | None = field(
        default=None,
        metadata={"help": f"Comma-separated kinds of module to compress, among {','.join(act_hf.config.ACT_KINDS)} "
                          "(default: all). 'activation' alone is the Few-Bit Backward setting."},
    )
    act_measure_every: int = field(
        default=50, metadata={"help": "Measure saved activation memory every N optimizer steps (0: never)."}
    )


def build_act_config(act_args: ActArguments) -> act_hf.ActConfig | None:
    """The :class:`act_hf.ActConfig` the act arguments ask for, or ``None`` without ``--act_compress``.

    Args:
        act_args: the parsed act_hf arguments.

    Returns:
        The config, or ``None`` for the uncompressed baseline.

    Raises:
        ValueError: a value ``ActConfig`` rejects (the message names it).
    """
    bits_value = float(act_args.act_bits)
    fractional = not bits_value.is_integer()
    if not act_args.act_compress:
        if act_args.act_adaptive or fractional:
            logger.warning("--act_adaptive/--act_bits have no effect without --act_compress: training uncompressed")
        return None
    adaptive = act_args.act_adaptive or fractional
    bits: int | float = bits_value if adaptive else int(bits_value)
    if fractional and not act_args.act_adaptive:
        logger.info("--act_bits %g is fractional: act_hf plans it as an adaptive average budget", bits_value)
    overrides: dict[str, Any] = {}
    if act_args.act_adapt_interval is not None:
        overrides["adapt_interval"] = act_args.act_adapt_interval
    if act_args.act_swap:
        overrides["swap"] = True
    if act_args.act_checkpoint_bits is not None:
        overrides["checkpoint_bits"] = act_args.act_checkpoint_bits
    if act_args.act_channel_scale is not None:
        overrides["channel_scale"] = act_args.act_channel_scale
    if act_args.act_kinds:
        kinds = act_args.act_kinds
        overrides["kinds"] = tuple(k.strip() for k in kinds.split(",") if k.strip()) if isinstance(kinds, str) \
            else tuple(kinds)
    return act_hf.ActConfig(bits=bits, group_size=act_args.act_group_size, **overrides)


def parse_args(args_list: list[str] | None = None):
    """Parse command-line arguments (or a single ``.json`` config file) into the four dataclasses.

    Args:
        args_list: arguments without the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        ``(ModelArguments, DataTrainingArguments, TrainingArguments, ActArguments)``.
    """
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments, ActArguments),
                              description=__doc__.split("\n\n")[0])
    args_list = sys.argv[1:] if args_list is None else list(args_list)
    if len(args_list) == 1 and args_list[0].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(args_list[0]))
    if args_list and args_list[0].endswith(".json") and not args_list[0].startswith("-"):
        # a JSON recipe followed by overrides: `run_glue.py recipe.json --output_dir x --act_bits 2`
        data = json.loads(Path(args_list[0]).read_text())
        base = []
        for key, value in data.items():
            if isinstance(value, bool):
                base += [f"--{key}", str(value)]
            elif isinstance(value, list):
                base += [f"--{key}", *map(str, value)]
            elif isinstance(value, dict):
                base += [f"--{key}", json.dumps(value)]
            elif value is not None:
                base += [f"--{key}", str(value)]
        args_list = base + args_list[1:]
    return parser.parse_args_into_dataclasses(args=args_list)


def _load_raw_datasets(data_args: DataTrainingArguments, model_args: ModelArguments,
                       training_args: TrainingArguments) -> datasets.DatasetDict:
    task = data_args.task_name
    if data_args.glue_dir is not None:
        splits = ["train"] if training_args.do_train else []
        if training_args.do_eval:
            splits += ["validation_matched", "validation_mismatched"] if task == "mnli" else ["validation"]
        raw = load_glue_dir(data_args.glue_dir, task)
        missing = [s for s in splits if s not in raw and s != "validation_mismatched"]
        if missing:
            raise FileNotFoundError(f"--glue_dir {data_args.glue_dir}: task {task!r} has no {missing} split file")
        return raw
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    files = {k: v for k, v in files.items() if v is not None}
    if files:
        if task is not None and all(Path(v).suffix.lower() == ".tsv" for v in files.values()):
            spec = GLUE_TASKS[task]
            out = {}
            for split, path in files.items():
                rows = read_glue_tsv(path, task, labeled=split != "test")
                out[split] = datasets.Dataset.from_list(rows)
                if not spec.is_regression:
                    out[split] = out[split].cast_column("label", datasets.ClassLabel(names=list(spec.label_names)))
            return datasets.DatasetDict(out)
        suffixes = {Path(v).suffix.lower() for v in files.values()}
        if len(suffixes) > 1:
            raise ValueError(f"--train_file/--validation_file/--test_file must share one format, got {suffixes}")
        suffix = suffixes.pop()
        if suffix in (".csv", ".tsv"):
            kwargs = {"delimiter": "\t", "quoting": 3} if suffix == ".tsv" else {}
            return datasets.load_dataset("csv", data_files=files, cache_dir=model_args.cache_dir, **kwargs)
        return datasets.load_dataset("json", data_files=files, cache_dir=model_args.cache_dir)
    try:
        return datasets.load_dataset("glue", task, cache_dir=model_args.cache_dir, token=model_args.token)
    except Exception:
        logger.error("could not load GLUE %r from the Hugging Face hub; offline, pass --glue_dir with the GLUE "
                     "TSV folder (or --train_file/--validation_file)", task)
        raise


def _act_metrics(log_history: list[dict[str, Any]], act_config: act_hf.ActConfig | None) -> dict[str, Any]:
    """The last value of each ``act_hf/*`` log entry, plus the requested bits."""
    out: dict[str, Any] = {}
    for entry in log_history:
        for key, value in entry.items():
            if key.startswith("act_hf/"):
                out[key] = value
    if act_config is not None:
        out["act_hf/bits"] = act_config.bits
        out["act_hf/group_size"] = act_config.group_size
    return out


def main(args_list: list[str] | None = None) -> dict[str, Any]:
    """Run fine-tuning and/or evaluation; returns the metrics written to ``output_dir/all_results.json``.

    Args:
        args_list: command-line arguments without the program name (``None``: ``sys.argv[1:]``), or a single
            ``.json`` config path.

    Returns:
        All metrics of the run (``train_*``, ``eval_*``, ``act_hf/*``).

    Raises:
        ValueError: an invalid act_hf argument (the message names it).
    """
    model_args, data_args, training_args, act_args = parse_args(args_list)
    act_config = build_act_config(act_args)

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.info("act_hf %s: %s", act_hf.__version__, act_config if act_config is not None else "off (baseline)")
    set_seed(training_args.seed)

    # ---- data -----------------------------------------------------------------------------------------------
    raw = _load_raw_datasets(data_args, model_args, training_args)
    task = data_args.task_name
    any_split = next(iter(raw.values()))
    if task is not None:
        is_regression = task == "stsb"
        label_feature = any_split.features.get("label")
        if is_regression:
            label_list = None
        elif isinstance(label_feature, datasets.ClassLabel):
            label_list = label_feature.names
        else:
            label_list = list(GLUE_TASKS[task].label_names)
        sentence1_key, sentence2_key = TASK_TO_KEYS[task]
    else:
        is_regression = any_split.features["label"].dtype in ("float32", "float64")
        if is_regression:
            label_list = None
        elif isinstance(any_split.features["label"], datasets.ClassLabel):
            label_list = any_split.features["label"].names
        else:
            label_list = sorted({lab for split in raw.values() for lab in split.unique("label") if lab != -1})
        text_cols = [c for c in any_split.column_names if c not in ("label", "idx")]
        if "sentence1" in text_cols and "sentence2" in text_cols:
            sentence1_key, sentence2_key = "sentence1", "sentence2"
        elif "sentence" in text_cols:
            sentence1_key, sentence2_key = "sentence", None
        else:
            sentence1_key, sentence2_key = text_cols[0], (text_cols[1] if len(text_cols) > 1 else None)
    num_labels = 1 if is_regression else len(label_list)

    # ---- model ----------------------------------------------------------------------------------------------
    hub_kwargs = {"cache_dir": model_args.cache_dir, "revision": model_args.model_revision, "token": model_args.token,
                  "trust_remote_code": model_args.trust_remote_code}
    config = AutoConfig.from_pretrained(model_args.config_name or model_args.model_name_or_path, num_labels=num_labels,
                                        finetuning_task=task, **hub_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path,
                                              use_fast=model_args.use_fast_tokenizer, **hub_kwargs)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path, config=config, ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
        **hub_kwargs,
    )
    label_to_id = None
    if label_list is not None:
        model.config.label2id = {str(label): i for i, label in enumerate(label_list)}
        model.config.id2label = dict(enumerate(map(str, label_list)))
        if not isinstance(any_split.features.get("label"), datasets.ClassLabel):
            label_to_id = {label: i for i, label in enumerate(label_list)}  # raw string/int labels of local files

    if data_args.max_seq_length > tokenizer.model_max_length:
        logger.warning("--max_seq_length %d exceeds the tokenizer's maximum %d; using %d", data_args.max_seq_length,
                       tokenizer.model_max_length, tokenizer.model_max_length)
    max_seq_length = min(data_args.max_seq_length, tokenizer.model_max_length)
    padding = "max_length" if data_args.pad_to_max_length else False

    def preprocess(examples: dict[str, list]) -> dict[str, list]:
        texts = (examples[sentence1_key],) if sentence2_key is None else (examples[sentence1_key],
                                                                         examples[sentence2_key])
        result = tokenizer(*texts, padding=padding, max_length=max_seq_length, truncation=True)
        if label_to_id is not None and "label" in examples:
            result["label"] = [label_to_id[lab] if lab != -1 else -1 for lab in examples["label"]]
        return result

    def take(split: str, limit: int | None) -> datasets.Dataset:
        if split not in raw:
            raise ValueError(f"this run needs a {split!r} split; the data have {list(raw)}")
        data = raw[split]
        if limit is not None:
            data = data.select(range(min(limit, len(data))))
        with training_args.main_process_first(desc=f"tokenizing {split}"):
            return data.map(preprocess, batched=True, num_proc=data_args.preprocessing_num_workers,
                            load_from_cache_file=not data_args.overwrite_cache, desc=f"Tokenizing {split}")

    train_dataset = take("train", data_args.max_train_samples) if training_args.do_train else None
    eval_splits: dict[str, datasets.Dataset] = {}
    if training_args.do_eval:
        if task == "mnli":
            eval_splits["eval"] = take("validation_matched", data_args.max_eval_samples)
            if "validation_mismatched" in raw:
                eval_splits["eval_mm"] = take("validation_mismatched", data_args.max_eval_samples)
        else:
            eval_splits["eval"] = take("validation", data_args.max_eval_samples)
    predict_splits: dict[str, datasets.Dataset] = {}
    if training_args.do_predict:
        for split in (("test_matched", "test_mismatched") if task == "mnli" else ("test",)):
            if split in raw:
                predict_splits[split] = take(split, data_args.max_predict_samples)
        if not predict_splits:
            raise ValueError(f"--do_predict needs a test split; the data have {list(raw)}")

    # ---- metrics --------------------------------------------------------------------------------------------
    metric = load_glue_metric(task, backend=data_args.metric_backend, cache_dir=model_args.cache_dir) \
        if task is not None else None

    def compute_metrics(p: EvalPrediction) -> dict[str, float]:
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        preds = np.squeeze(preds) if is_regression else np.argmax(preds, axis=1)
        if metric is not None:
            result = metric.compute(predictions=preds, references=p.label_ids)
            if len(result) > 1:
                result["combined_score"] = float(np.mean(list(result.values())))
            return result
        if is_regression:
            return {"mse": float(((preds - p.label_ids) ** 2).mean())}
        return {"accuracy": float((preds == p.label_ids).mean())}

    if data_args.pad_to_max_length:
        data_collator = default_data_collator
    else:
        data_collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if (training_args.fp16 or
                                                                                   training_args.bf16) else None)

    # ---- trainer --------------------------------------------------------------------------------------------
    callbacks = []
    if act_config is not None:
        callbacks.append(act_hf.ActCompressCallback(config=act_config, measure_every=act_args.act_measure_every))
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_splits.get("eval"),
        compute_metrics=compute_metrics,
        processing_class=tokenizer,
        data_collator=data_collator,
        callbacks=callbacks,
    )

    all_metrics: dict[str, Any] = {}
    if training_args.do_train:
        resume = training_args.resume_from_checkpoint
        if isinstance(resume, str) and resume.lower() in ("true", "last"):
            resume = True
        train_result = trainer.train(resume_from_checkpoint=resume)
        metrics = dict(train_result.metrics)
        metrics["train_samples"] = len(train_dataset)
        trainer.save_model()
        if act_config is not None and trainer.is_world_process_zero():
            act_config.save_pretrained(training_args.output_dir)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        all_metrics.update(metrics)

    for prefix, dataset in eval_splits.items():
        logger.info("*** Evaluate (%s) ***", prefix)
        metrics = trainer.evaluate(eval_dataset=dataset, metric_key_prefix=prefix)
        metrics[f"{prefix}_samples"] = len(dataset)
        trainer.log_metrics(prefix, metrics)
        trainer.save_metrics(prefix, metrics)
        all_metrics.update(metrics)

    for split, dataset in predict_splits.items():
        logger.info("*** Predict (%s) ***", split)
        output = trainer.predict(dataset.remove_columns("label"), metric_key_prefix="predict")
        preds = np.squeeze(output.predictions) if is_regression else np.argmax(output.predictions, axis=1)
        if trainer.is_world_process_zero():
            path = Path(training_args.output_dir) / f"predict_results_{task or 'custom'}_{split}.txt"
            with path.open("w") as handle:
                handle.write("index\tprediction\n")
                for i, pred in enumerate(preds):
                    handle.write(f"{i}\t{pred:3.3f}\n" if is_regression else f"{i}\t{label_list[int(pred)]}\n")
            logger.info("predictions written to %s", path)

    act_metrics = _act_metrics(trainer.state.log_history, act_config)
    if act_metrics:
        trainer.log_metrics("act_hf", act_metrics)
        trainer.save_metrics("act_hf", act_metrics)
        all_metrics.update(act_metrics)
    return all_metrics


if __name__ == "__main__":
    main()
