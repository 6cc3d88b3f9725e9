"""``act_hf.estimate`` and ``act-hf estimate``: fits against direct measurements, the table, JSON, and errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import act_hf
from act_hf.checkpoint import enable_hf_checkpointing
from act_hf.cli import main
from act_hf.estimate import Estimate, build_model, checkpointed_layers, estimate, parse_size, saved_with_checkpointing
from act_hf.ops.loss import CHUNK_BYTES

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")

BERT = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 128, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bert")
    transformers.BertConfig(**BERT).save_pretrained(path)  # attention dropout 0.1: estimate() turns it off
    return path


@pytest.fixture(scope="module")
def bert_est(bert_dir) -> Estimate:
    return estimate(bert_dir, batch=8, seq=32, bits=3, gpu_mem="1GiB", device="cpu")


def _tracked(model, forward, batch):
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16), act_hf.track_saved(model) as saved:
        loss = forward(model, batch)
    del loss
    return saved


def _saved(model, forward, batch) -> int:
    return _tracked(model, forward, batch).bytes


def _check_fields(est: Estimate) -> None:
    assert est.act_hf.per_sample < est.baseline.per_sample
    assert est.saved_act_hf < est.saved_baseline
    assert est.peak_act_hf < est.peak_baseline
    assert est.max_batch_act_hf >= est.max_batch_baseline >= 1
    assert est.peak(est.max_batch_act_hf, act_hf=True) <= est.gpu_mem < est.peak(est.max_batch_act_hf + 1, act_hf=True)
    assert est.peak(est.max_batch_baseline, act_hf=False) <= est.gpu_mem
    for fit in (est.baseline, est.act_hf):  # the two-point fit is the direct difference of its two measurements
        a, b = fit.fit_batches
        assert fit.per_sample == (fit.measured[b] - fit.measured[a]) / (b - a)
        assert fit.bytes_at(a) == fit.measured[a] and fit.bytes_at(b) == fit.measured[b]
    assert est.optimizer_bytes == 8 * est.trainable_params
    assert est.grad_bytes == est.param_bytes == 4 * est.num_params
    assert est.ratio == pytest.approx(est.baseline.per_sample / est.act_hf.per_sample)
    # transients: the unpatched margin plus two of an LM loss's fp32 log-probabilities, and with act_hf 2.5x the
    # largest unpatched activation (checkpointed too) plus an LM head's logits
    assert est.largest.fit_batches == est.baseline.fit_batches
    assert est.transient_factor == 2.5
    assert 0 < est.largest.per_sample < est.baseline.per_sample
    loss = 0.0 if est.loss_context is None else 2 * est.loss_context.bytes_at(est.batch)
    assert est.workspace == pytest.approx(est.margin * est.saved_baseline + loss)
    logits = 0.0 if est.logits is None else est.logits.bytes_at(est.batch)
    chunks = 0.0 if est.loss_context is None else 2 * min(est.loss_context.bytes_at(est.batch), CHUNK_BYTES)
    assert est.workspace_act_hf == pytest.approx(est.transient_factor * est.largest.bytes_at(est.batch) + logits
                                                 + chunks)
    assert est.peak_act_hf == pytest.approx(est.state_bytes + est.saved_act_hf + est.workspace_act_hf)
    assert est.peak_baseline == pytest.approx(est.state_bytes + est.saved_baseline + est.workspace)


def test_api_hf_folder_matches_direct_measurement(bert_est):
    est = bert_est
    assert est.model_class == "BertForSequenceClassification" and est.task == "sequence-classification"
    assert est.seq == 32 and est.img_size is None
    _check_fields(est)
    assert any("dropout set to 0" in n for n in est.notes) and any("not a measured peak" in n for n in est.notes)

    batch = 12  # not a calibration point
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT, attention_probs_dropout_prob=0.0))
    ids = torch.randint(1, BERT["vocab_size"], (batch, 32))

    def forward(m, b):
        return m(input_ids=ids, labels=torch.zeros(b, dtype=torch.long)).loss

    direct = _tracked(model, forward, batch)
    direct_act = _saved(act_hf.patch(copy.deepcopy(model), bits=3), forward, batch)
    assert est.baseline.bytes_at(batch) == pytest.approx(direct.bytes, rel=0.05)
    assert est.act_hf.bytes_at(batch) == pytest.approx(direct_act, rel=0.05)
    assert est.largest.bytes_at(batch) == pytest.approx(direct.largest, rel=0.05)
    assert est.logits is None and est.loss_context is None  # no LM head


def test_a_language_model_counts_its_logits_once_not_the_losss_log_probabilities(tmp_path):
    """A causal LM's largest saved tensor is its loss's fp32 log-probabilities, which act_hf's loss never keeps:
    the act_hf column's transients take the largest activation up to the LM head's output, plus those logits (in
    the compute dtype, bf16) once. The unpatched column's take two of those log-probabilities on top of its margin,
    the gradients its loss's backward holds together."""
    vocab, seq = 1000, 32
    config = {"vocab_size": vocab, "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64, "bos_token_id": 0,
              "eos_token_id": 0}
    transformers.GPT2Config(**config).save_pretrained(tmp_path)
    est = estimate(tmp_path, batch=8, seq=seq, bits=3, gpu_mem="1GiB", device="cpu")
    assert est.model_class == "GPT2LMHeadModel"
    _check_fields(est)
    assert est.logits.per_sample == seq * vocab * 2 and est.logits.fixed == 0
    log_probs = seq * vocab * 4  # a sample's fp32 log-probabilities, what the unpatched loss saves
    assert est.loss_context.per_sample == log_probs
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config, attn_pdrop=0.0))
    ids = torch.randint(0, vocab, (8, seq))
    direct = _tracked(model, lambda m, b: m(input_ids=ids, labels=ids).loss, 8)
    assert direct.largest >= 8 * log_probs > est.largest.bytes_at(8)
    assert est.largest.per_sample == seq * 4 * 64 * 2  # the MLP's hidden activation, bf16: the widest before the head


def test_a_masked_lm_is_a_task_to_ask_for(bert_dir):
    """``task="masked-lm"`` builds the MLM (BERT's pretraining), whose head and loss the LM rule counts; a BERT
    folder alone still builds a sequence classifier."""
    est = estimate(bert_dir, batch=8, seq=32, bits=3, gpu_mem="1GiB", device="cpu", task="masked-lm")
    assert est.model_class == "BertForMaskedLM" and est.task == "masked-lm"
    _check_fields(est)
    tokens = 32 * BERT["vocab_size"]  # a sample's logits
    assert est.logits.per_sample == 2 * tokens and est.loss_context.per_sample == 4 * tokens


def test_a_language_models_projection_grows_with_the_batch_at_least_as_its_measured_peak(tmp_path, monkeypatch):
    """Per sample, each column's projected peak (saved bytes plus transients) grows at least as fast as the step's
    measured highest point on the CPU (the profiler's allocations, between batches 8 and 16, bf16 autocast; act_hf's
    codec stubbed as a GPU's kernels make no temporaries): the loss's fp32 copies of the logits are in both."""
    from tests.utils import load_benchmark, stub_codec

    vocab, seq = 1000, 32
    config = {"vocab_size": vocab, "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64, "bos_token_id": 0,
              "eos_token_id": 0}
    transformers.GPT2Config(**config).save_pretrained(tmp_path)
    est = estimate(tmp_path, batch=8, seq=seq, bits=3, device="cpu")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config, attn_pdrop=0.0)).train()
    stub_codec(monkeypatch)
    patched = act_hf.patch(copy.deepcopy(model), bits=3)
    profile_peak = load_benchmark("memory_at_peak").profile_peak

    def peak(m, batch: int) -> int:
        ids = torch.randint(0, vocab, (batch, seq))

        def loss():
            with torch.autocast("cpu", torch.bfloat16):
                return m(input_ids=ids, labels=ids).loss

        loss().backward()  # parameter gradients exist before the profiled step
        phases = profile_peak(loss, torch.device("cpu"))["phases"]
        return max(phases["forward"]["peak"], phases["backward"]["peak"])

    for m, act in ((model, False), (patched, True)):
        fit = est.act_hf if act else est.baseline
        projected = [fit.bytes_at(b) + est.transients(b, act_hf=act) for b in (8, 16)]
        measured = [peak(m, b) for b in (8, 16)]
        assert projected[1] - projected[0] >= measured[1] - measured[0] > 0, (act, projected, measured)


def _assert_saved_as_measured_directly(est: Estimate, model: torch.nn.Module) -> None:
    """An image model's estimate at batch 12 of 64 px images saves what ``track_saved`` finds on the model itself,
    unpatched and at 3 bits."""
    x = torch.randn(12, 3, 64, 64)

    def forward(m, b):
        return torch.nn.functional.cross_entropy(m(x).float(), torch.zeros(b, dtype=torch.long))

    assert est.saved_baseline == pytest.approx(_saved(model, forward, 12), rel=0.05)
    assert est.saved_act_hf == pytest.approx(_saved(act_hf.patch(copy.deepcopy(model), bits=3), forward, 12), rel=0.05)


def test_api_timm_name_matches_direct_measurement():
    est = estimate("test_resnet", batch=12, bits=3, img_size=64, gpu_mem="256MiB", device="cpu", max_calib_batch=16)
    assert est.task == "timm" and est.img_size == 64 and est.seq is None and est.weight_copy_bytes > 0
    _check_fields(est)
    _assert_saved_as_measured_directly(est, timm.create_model("test_resnet", pretrained=False))


def test_api_torchvision_name_matches_direct_measurement():
    est = estimate("torchvision:resnet18", batch=12, bits=3, img_size=64, gpu_mem="512MiB", device="cpu",
                   max_calib_batch=16)
    assert est.model == "torchvision:resnet18" and est.task == "module" and est.img_size == 64
    _check_fields(est)
    _assert_saved_as_measured_directly(est, torchvision.models.resnet18())


def test_torchvision_models_take_their_weights_crop_size_and_unknown_names_say_where_to_look():
    assert build_model("torchvision:inception_v3").img_size == 299  # its weights' crop, not 224
    assert build_model("torchvision:inception_v3", img_size=320).img_size == 320
    with pytest.raises(ValueError, match=r"torchvision has no classification model 'resnet5'.*list_models"):
        build_model("torchvision:resnet5")
    with pytest.raises(ValueError, match="task"):
        build_model("torchvision:resnet18", task="causal-lm")


@pytest.mark.parametrize("checkpoint_bits", [None, 8])
def test_checkpointing_projects_am2_against_the_uncheckpointed_baseline(bert_dir, bert_est, checkpoint_bits):
    """With checkpointing the act_hf column is AM2 (forward + one recomputed layer's context) of the patched,
    checkpointed model, measured directly here at a batch outside the calibration; the baseline is unchanged."""
    est = estimate(bert_dir, batch=8, seq=32, bits=3, gpu_mem="1GiB", device="cpu", checkpointing=True,
                   checkpoint_bits=checkpoint_bits)
    _check_fields(est)
    assert est.checkpointing and est.checkpoint_bits == checkpoint_bits
    assert est.baseline.measured == bert_est.baseline.measured
    if checkpoint_bits:  # exact fp32 layer inputs outweigh what 2 layers save; packed ones do not
        assert est.act_hf.per_sample < bert_est.act_hf.per_sample
    assert "+ ckpt" in est.table() and any("AM2" in n for n in est.notes)

    batch = 12
    config = transformers.BertConfig(**BERT, attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(config).train()
    enable_hf_checkpointing(model)
    act_hf.patch(model, bits=3, checkpoint_bits=checkpoint_bits)
    ids = torch.randint(1, BERT["vocab_size"], (batch, 32))
    am1, am2 = saved_with_checkpointing(
        model, lambda: model(input_ids=ids, labels=torch.zeros(batch, dtype=torch.long)).loss,
        torch.autocast("cpu", dtype=torch.bfloat16))
    assert am1 < am2 and len(checkpointed_layers(model)) == 2
    assert est.act_hf.bytes_at(batch) == pytest.approx(am2, rel=0.05)


def test_cli_checkpoint_bits_implies_checkpointing(bert_dir, capsys):
    assert main(["estimate", str(bert_dir), "--batch", "4", "--seq", "16", "--device", "cpu",
                 "--checkpoint-bits", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpointing"] is True and out["checkpoint_bits"] == 8
    with pytest.raises(SystemExit):
        main(["estimate", str(bert_dir), "--batch", "4", "--checkpoint-bits", "9"])
    assert "--checkpoint-bits" in capsys.readouterr().err


def test_checkpointing_errors(bert_dir):
    with pytest.raises(ValueError, match="checkpoint_bits: .*checkpointing=True"):
        estimate(bert_dir, batch=2, seq=16, device="cpu", checkpoint_bits=4)
    with pytest.raises(ValueError, match="checkpoint_bits: must be an int from 1 to 8"):
        estimate(bert_dir, batch=2, seq=16, device="cpu", checkpointing=True, checkpoint_bits=9)
    with pytest.raises(ValueError, match="checkpointing: ResNet has no Hugging Face gradient checkpointing"):
        estimate("test_resnet", batch=2, img_size=32, device="cpu", checkpointing=True)


def test_transient_factor_sizes_the_act_hf_column_only(bert_dir, bert_est, capsys):
    est = estimate(bert_dir, batch=8, seq=32, bits=3, gpu_mem="1GiB", device="cpu", transient_factor=0.0)
    assert est.workspace_act_hf == 0 and est.workspace == bert_est.workspace
    assert est.max_batch_act_hf > bert_est.max_batch_act_hf and est.max_batch_baseline == bert_est.max_batch_baseline
    assert "act_hf 0x largest activation" in est.table() and "act_hf 2.5x largest activation" in bert_est.table()
    with pytest.raises(ValueError, match="transient_factor: must be a number >= 0 or None, got -1"):
        estimate(bert_dir, batch=2, seq=16, device="cpu", transient_factor=-1)
    assert main(["estimate", str(bert_dir), "--batch", "4", "--seq", "16", "--device", "cpu",
                 "--transient-factor", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["transient_factor"] == 2.0 and set(out["largest"]["measured"]) >= {"1", "2", "4"}


def test_max_batch_none_without_cap_and_sgd_states(bert_dir):
    est = estimate(bert_dir, batch=2, seq=16, bits=2, dtype="fp32", optimizer="sgd", device="cpu")
    assert est.max_batch_baseline is None and est.max_batch_act_hf is None
    assert est.optimizer_bytes == 4 * est.trainable_params and est.weight_copy_bytes == 0
    assert "largest batch" not in est.table()


def test_cli_table_and_json(bert_dir, capsys):
    argv = [str(bert_dir), "--batch", "8", "--seq", "32", "--bits", "3", "--gpu-mem", "1GiB", "--device", "cpu"]
    assert main(["estimate", *argv]) == 0
    out = capsys.readouterr().out
    for text in ("unpatched", "act_hf 3-bit", "ratio", "largest batch in 1.00 GiB", "projected peak @ batch 8",
                 "not a measured peak", "dropout set to 0", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        assert text in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.rstrip().endswith("ratio"))
    assert len({len(line) for line in lines[header:header + 3]}) == 1  # aligned columns

    assert main(["estimate", *argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch"] == 8 and data["bits"] == 3 and data["gpu_mem"] == 2**30
    assert data["max_batch_act_hf"] >= data["max_batch_baseline"] >= 1
    assert data["saved_act_hf"] < data["saved_baseline"]
    assert set(data["baseline"]["measured"]) >= {"1", "2", "4"}


def test_adaptive_budget(bert_dir, bert_est, capsys):
    """A fractional --bits is an adaptive budget: one probe allocates, and the allocation's bytes sit between the
    fixed widths around the budget (same model, same calibration)."""
    argv = [str(bert_dir), "--batch", "8", "--seq", "32", "--bits", "2.5", "--gpu-mem", "1GiB", "--device", "cpu"]
    assert main(["estimate", *argv]) == 0
    out = capsys.readouterr().out
    assert "act_hf adaptive 2.5" in out and "adaptive budget 2.5" in out
    assert main(["estimate", *argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bits"] == 2.5 and 1 <= data["avg_bits"] <= 2.5
    two = estimate(bert_dir, batch=8, seq=32, bits=2, gpu_mem="1GiB", device="cpu")
    assert two.act_hf.per_sample <= data["act_hf"]["per_sample"] <= bert_est.act_hf.per_sample
    with pytest.raises(SystemExit):
        main(["estimate", *argv[:-4], "--bits", "9.5"])
    assert "--bits" in capsys.readouterr().err


def test_cli_bad_gpu_mem(bert_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["estimate", str(bert_dir), "--batch", "8", "--gpu-mem", "16 potatoes"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--gpu-mem" in err and "16 potatoes" in err


def test_cli_unknown_model(capsys):
    code = main(["estimate", "no-such-org/no-such-model-xyz", "--batch", "8", "--offline", "--device", "cpu"])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-org/no-such-model-xyz'" in err and "timm" in err and "config.json" in err
    assert "torchvision:NAME" in err


def test_api_errors(tmp_path, bert_dir):
    with pytest.raises(ValueError, match="config.json"):
        estimate(tmp_path, batch=2)
    with pytest.raises(ValueError, match="bits"):
        estimate(bert_dir, batch=2, bits=9)
    with pytest.raises(ValueError, match="seq: 128 is longer"):
        estimate(bert_dir, batch=2, seq=128, device="cpu")
    with pytest.raises(ValueError, match="task"):
        estimate(bert_dir, batch=2, task="translation")


@pytest.mark.parametrize("text, expected", [
    ("16GiB", 16 * 2**30), ("80GB", 80 * 10**9), ("24000MiB", 24000 * 2**20), ("1.5 TiB", int(1.5 * 2**40)),
    ("16g", 16 * 2**30), ("512kb", 512_000), (1234, 1234),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["16", "16 potatoes", "GiB", "-1GiB", "0GB", ""])
def test_parse_size_errors(text):
    with pytest.raises(ValueError, match="--gpu-mem"):
        parse_size(text)


def test_a_model_whose_output_embeddings_fail_has_no_lm_head():
    """A ``get_output_embeddings`` that raises (as ``PreTrainedModel``'s can for a head-less subclass) means no LM
    head: the estimate then measures the model as one without."""
    from act_hf.estimate import _lm_head

    class Failing(torch.nn.Linear):
        def get_output_embeddings(self):
            raise NotImplementedError

    assert _lm_head(Failing(2, 2)) is None and _lm_head(torch.nn.Linear(2, 2)) is None
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=16))
    assert _lm_head(gpt2) is gpt2.lm_head
