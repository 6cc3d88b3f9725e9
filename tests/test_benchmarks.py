"""The benchmark scripts' own logic: settings, the largest-batch search, trials in subprocesses, the tables.

The measurements themselves are benchmarks (run by hand, results committed); here they run at toy sizes on the
CPU so that a broken script is caught before a GPU session is spent on it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.utils import load_benchmark as _load

gpu_training = _load("benchmark_gpu_training")


def test_settings_parse_and_bad_ones_name_the_allowed_values():
    parse = gpu_training.parse_setting
    Setting = gpu_training.Setting
    assert parse("unpatched") == Setting("unpatched", None)
    assert parse("bits3") == Setting("bits3", 3)
    assert parse("adaptive2.5") == Setting("adaptive2.5", 2.5)
    assert parse("ckpt") == Setting("ckpt", None, checkpointing=True)
    assert parse("ckpt+bits2") == Setting("ckpt+bits2", 2, checkpointing=True)
    assert parse("swap+bits3") == Setting("swap+bits3", 3, swap=True)
    assert parse("ckpt+swap+adaptive2.5") == Setting("ckpt+swap+adaptive2.5", 2.5, checkpointing=True, swap=True)
    assert parse("ckpt4+bits3") == Setting("ckpt4+bits3", 3, checkpointing=True, checkpoint_bits=4)
    assert parse("swap+ckpt2+bits2") == Setting("swap+ckpt2+bits2", 2, checkpointing=True, swap=True, checkpoint_bits=2)
    for bad in ("bits9", "bits", "ckpt+", "adaptive3.0", "adaptive9.5", "int3", "ckptbits3", "swap", "swap+unpatched",
                "ckpt+ckpt+bits3", "ckpt+unpatched", "zip+bits3", "ckpt9+bits3", "ckpt4", "ckpt4+unpatched",
                "ckpt+ckpt4+bits3"):
        with pytest.raises(SystemExit, match="--settings"):
            parse(bad)


@pytest.mark.parametrize("threshold", [1, 2, 7, 91, 100, 233, 374, 1000, 5000])
@pytest.mark.parametrize("start", [1, 32, 150, 4096])
def test_largest_batch_finds_the_threshold(threshold, start):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= threshold

    found, failing = gpu_training.largest_batch(fits, start, resolution=0.0)
    assert (found, failing) == (threshold, threshold + 1)
    assert len(calls) == len(set(calls))  # no batch is tried twice
    assert len(calls) <= 3 * max(start, threshold).bit_length() + 4  # 1.5x growth, then bisection: no scan


def test_largest_batch_within_resolution_and_edge_cases():
    found, failing = gpu_training.largest_batch(lambda b: b <= 1234, 100, resolution=0.02)
    assert found <= 1234 < failing and failing - found <= 0.02 * found
    assert gpu_training.largest_batch(lambda b: False, 64) == (0, 1)  # not even batch 1 fits
    assert gpu_training.largest_batch(lambda b: True, 8, limit=100) == (100, None)  # every batch fits
    with pytest.raises(ValueError, match="start"):
        gpu_training.largest_batch(lambda b: True, 0)


@pytest.mark.parametrize("threshold", [1, 91, 374, 5000])
def test_largest_batch_with_a_close_projection_grows_slowly(threshold):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= threshold

    start = max(1, int(0.97 * threshold))
    found, failing = gpu_training.largest_batch(fits, start, growth=1.1, resolution=0.03)
    assert found <= threshold < failing and failing - found <= max(1, 0.03 * found)
    assert len(calls) <= 5
    with pytest.raises(ValueError, match="growth"):
        gpu_training.largest_batch(fits, 8, growth=1.0)


@pytest.mark.parametrize("threshold", [300, 586, 2300])
def test_a_secant_proposal_lands_near_the_threshold_in_few_trials(threshold):
    """Peaks linear in the batch above a fixed part, as the H100 measured for bert-large (5.44 GB resident,
    20 MB a sample): from the equal batch and one fitting trial the secant jumps next to the cap."""
    cap, resident = 17_179_869_184, 5_440_000_000
    per_sample = (0.99 * cap - resident) / (threshold + 0.5)
    points = {32: int(resident + 1.3e9 + per_sample * 32)}  # the equal batch carries fixed transients too
    calls = []

    def fits(b):
        calls.append(b)
        if b > threshold:
            return False
        points[b] = int(resident + per_sample * b)
        return True

    found, failing = gpu_training.largest_batch(
        fits, 271, growth=1.1, resolution=0.04,
        propose=lambda lo, hi: gpu_training.bracketed_guess(gpu_training.secant_batch(points, cap), lo, hi, 0.04))
    assert found <= threshold < failing and failing - found <= max(1, 0.04 * found)
    assert len(calls) <= 5  # 1.1x growth from 271 took 8-12 trials for bert-large on the H100
    assert len(calls) == len(set(calls))


def test_proposals_outside_the_open_interval_or_already_tried_take_the_step():
    calls = []

    def fits(b):
        calls.append(b)
        return b <= 100

    assert gpu_training.largest_batch(fits, 10, growth=2.0, resolution=0.0, propose=lambda lo, hi: 5) == (100, 101)
    assert calls[:4] == [10, 20, 40, 80]  # 5 is below every fitting batch: growth steps
    calls.clear()
    assert gpu_training.largest_batch(fits, 400, growth=2.0, resolution=0.0,
                                      propose=lambda lo, hi: 400 if hi else None) == (100, 101)
    assert calls[:3] == [400, 200, 100]  # 400 was tried already: shrink steps
    calls.clear()
    assert gpu_training.largest_batch(fits, 400, growth=2.0, resolution=0.0,
                                      propose=lambda lo, hi: 60 if hi else None) == (100, 101)
    assert calls[:2] == [400, 60]


def test_bracketed_guess():
    assert gpu_training.bracketed_guess(None, 100, None, 0.04) is None
    assert gpu_training.bracketed_guess(300, 100, None, 0.04) == 300
    assert gpu_training.bracketed_guess(900, 100, None, 0.04) == 400  # growing: at most 4x
    assert gpu_training.bracketed_guess(900, 100, 1000, 0.04) == 900  # inside a bracket: as projected
    assert gpu_training.bracketed_guess(90, 100, None, 0.04) == 104  # at the cap already: probe just above
    assert gpu_training.bracketed_guess(300, 100, 300, 0.04) is None  # 300 failed: the guess was too high


def test_secant_batch():
    assert gpu_training.secant_batch({}, 1000) is None
    assert gpu_training.secant_batch({10: 300}, 1000) is None
    assert gpu_training.secant_batch({10: 300, 20: 300}, 1000) is None  # a peak that does not grow
    assert gpu_training.secant_batch({5: 900, 10: 200, 20: 300}, 1000) == 89  # 20 + (990 - 300) / 10
    assert gpu_training.secant_batch({10: 300}, 1000, resident=200) == 79  # from (0, 200): 10 + 690 / 10


def test_search_start_projects_from_the_resident_memory():
    gib = 2**30
    equal = {"peak_bytes": 9 * gib, "resident_bytes": 5 * gib}  # 4 GiB for 32 samples above 5 GiB resident
    assert gpu_training._search_start(equal, 32, 16 * gib) == (int(0.97 * 32 * 11 / 4), 1.1)
    assert gpu_training._search_start({"peak_bytes": 8 * gib}, 32, 16 * gib) == (64, 1.5)
    assert gpu_training._search_start({"oom": True}, 32, 16 * gib) == (32, 1.5)


def test_searches_share_the_gpu_up_to_parallel_and_a_crash_stays_in_its_row(monkeypatch, tmp_path):
    """The orchestration alone, with the GPU's answers played by a memory model: a trial fits when resident
    memory plus per-sample memory stays under the cap (the real trials are the GPU tests' and the benchmarks')."""
    import threading
    import time

    per_sample = {"unpatched": 100, "bits3": 20}
    running, most = [0], [0]
    lock = threading.Lock()

    def trial_answer(trial):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        if trial.model == "swin-tiny" and trial.setting == "bits3" and trial.batch != 32:
            return {"error": "RuntimeError: a kernel failed"}
        peak = 1000 + per_sample[trial.setting] * trial.batch
        if peak > trial.cap_bytes:
            return {"oom": True}
        return {"oom": False, "samples_per_s": 10.0 if trial.setting == "unpatched" else 9.5,
                "peak_bytes": peak, "resident_bytes": 1000}

    monkeypatch.setattr(gpu_training, "run_in_subprocess", trial_answer)
    args = gpu_training.argparse.Namespace(seq=128, image_size=224, dtype="bf16", device="cuda", steps=1, warmup=1,
                                           attention_dropout=None, checkpoint_debug=False, batch=32, cap=10_000,
                                           search=True, curve=False,
                                           resolution=0.02, parallel=3)
    reports = []
    rows = gpu_training.measure(["bert-large", "swin-tiny"], ["unpatched", "bits3"], args,
                                report=lambda r: reports.append(len(r)))
    by = {(r["model"], r["setting"]): r for r in rows}
    assert by["bert-large", "unpatched"]["max_batch"] == 90 and by["bert-large", "bits3"]["max_batch"] >= 441
    bits3 = by["bert-large", "bits3"]
    assert bits3["max_batch_vs_unpatched"] == pytest.approx(bits3["max_batch"] / 90)
    assert by["bert-large", "bits3"]["speed_vs_unpatched"] == pytest.approx(0.95)
    assert "a kernel failed" in by["swin-tiny", "bits3"]["search_error"]
    assert by["swin-tiny", "unpatched"]["max_batch"] == 90
    assert 1 < most[0] <= 3
    assert len(reports) == 8  # after each equal-batch trial and each search
    gpu_training.write_results(rows, {**gpu_training._meta(torch.device("cpu")), "dtype": "bf16", "seq": 128,
                                      "image_size": 224, "batch": 32, "steps": 1, "warmup": 1, "cap_bytes": 10_000,
                                      "resolution": 0.02}, tmp_path)
    assert "| swin-tiny | bits3 | 1.60 KiB | 9.5 | 0.950 | error | - |" in (tmp_path / "gpu_training.md").read_text()


def test_speed_trials_report_allocated_memory_growing_over_steps(tmp_path):
    """A speed trial records how much allocated memory its timed steps left beyond the warm-up's, and the table
    names the trials where it grew: a leak shows there even when the peak still fits."""
    meta = {**gpu_training._meta(torch.device("cpu")), "dtype": "bf16", "seq": 128, "image_size": 224, "batch": 32,
            "steps": 10, "warmup": 3, "cap_bytes": None, "resolution": 0.02}
    trial = {"oom": False, "samples_per_s": 100.0, "peak_bytes": 2**30, "resident_bytes": 2**29}
    rows = [{"model": "bert-large", "setting": "unpatched", "equal_batch": trial | {"growth_bytes_per_step": 0.0}},
            {"model": "bert-large", "setting": "bits3", "equal_batch": trial | {"growth_bytes_per_step": 3 * 2**20}}]
    gpu_training.write_results(rows, meta, tmp_path)
    assert "**grew** in bert-large bits3 (3.00 MiB a step)" in (tmp_path / "gpu_training.md").read_text()
    gpu_training.write_results(rows[:1], meta, tmp_path)
    assert "the same in every speed trial" in (tmp_path / "gpu_training.md").read_text()


def test_speed_trials_report_the_allocators_events_a_step(tmp_path):
    """A speed trial's ``cudaMalloc``, ``cudaFree`` and retried allocations a timed step go into the table's notes,
    named by trial: each stalls the host, so a step that makes them is not bound by its launches alone."""
    meta = {**gpu_training._meta(torch.device("cpu")), "dtype": "bf16", "seq": 128, "image_size": 224, "batch": 256,
            "steps": 4, "warmup": 2, "cap_bytes": None, "resolution": 0.02}
    trial = {"oom": False, "samples_per_s": 100.0, "peak_bytes": 2**30, "resident_bytes": 2**29,
             "growth_bytes_per_step": 0.0}
    quiet = {"cudaMalloc": 0.0, "cudaFree": 0.0, "retries": 0.0}
    busy = {"cudaMalloc": 2.5, "cudaFree": 2.0, "retries": 0.25}
    rows = [{"model": "swin-tiny", "setting": name, "equal_batch": trial | {"allocator_events_per_step": events}}
            for name, events in (("unpatched", quiet), ("bits3", busy))]
    gpu_training.write_results(rows, meta, tmp_path)
    text = (tmp_path / "gpu_training.md").read_text()
    assert "swin-tiny bits3 2.5 cudaMalloc, 2 cudaFree, 0.25 retries" in text and "swin-tiny unpatched 0" not in text
    gpu_training.write_results(rows[:1], meta, tmp_path)
    assert "(cudaMalloc, cudaFree, retries): none in any speed trial." in (tmp_path / "gpu_training.md").read_text()


def test_speed_trials_report_the_fused_activations_checks(tmp_path):
    """Which fused activations passed their check in each speed trial goes into the table's notes, a failed one
    marked: it ran unfused, which the trial's speed shows."""
    meta = {**gpu_training._meta(torch.device("cpu")), "dtype": "bf16", "seq": 128, "image_size": 224, "batch": 256,
            "steps": 4, "warmup": 2, "cap_bytes": None, "resolution": 0.02}
    trial = {"oom": False, "samples_per_s": 100.0, "peak_bytes": 2**30, "resident_bytes": 2**29,
             "growth_bytes_per_step": 0.0, "fused_activation_checks": {}}
    rows = [{"model": "swin-tiny", "setting": "unpatched", "equal_batch": trial},
            {"model": "swin-tiny", "setting": "bits3", "equal_batch": trial | {"fused_activation_checks": {
                "gelu bfloat16 on cuda:0": True, "silu bfloat16 on cuda:0": False}}}]
    gpu_training.write_results(rows, meta, tmp_path)
    text = (tmp_path / "gpu_training.md").read_text()
    assert ("swin-tiny bits3: gelu bfloat16 on cuda:0 passed, silu bfloat16 on cuda:0 **failed** (a failed one ran "
            "unfused).") in text and "swin-tiny unpatched:" not in text
    gpu_training.write_results(rows[:1], meta, tmp_path)
    assert "before fusing): none checked in any speed trial." in (tmp_path / "gpu_training.md").read_text()


def test_a_trial_records_the_fused_activations_checks_it_ran(monkeypatch):
    """A trial in this process returns the fused activations' checks run during it (none on the CPU, where nothing
    fuses; here one stands in), beside its timing."""
    from act_hf.ops import activation as act_ops

    monkeypatch.setattr(act_ops, "_checked", {(torch.device("cuda", 0), torch.bfloat16, "gelu"): True})
    out = gpu_training.run_trial(gpu_training.Trial("resnet50", "unpatched", 2, device="cpu", steps=1, warmup=0,
                                                    image_size=32))
    assert out["fused_activation_checks"] == {"gelu bfloat16 on cuda:0": True} and out["samples_per_s"] > 0


def test_targets_start_the_search_and_are_answered_by_its_first_trial(monkeypatch, tmp_path):
    """``--targets`` with ``--no-speed``: each row's first trial is ratio x the given unpatched largest batch, and
    the row says whether it fit before the search goes on (the GPU played by a memory model, as above)."""
    tried: dict[str, list[int]] = {"bits3": [], "bits2": []}

    def trial_answer(trial):
        tried[trial.setting].append(trial.batch)
        peak = 1000 + 20 * trial.batch  # fits up to batch 450 under the cap of 10,000
        return {"oom": True} if peak > trial.cap_bytes else {"oom": False, "samples_per_s": 1.0,
                                                                "peak_bytes": peak, "resident_bytes": 1000}

    monkeypatch.setattr(gpu_training, "run_in_subprocess", trial_answer)
    args = gpu_training.argparse.Namespace(seq=128, image_size=224, dtype="bf16", device="cuda", steps=1, warmup=1,
                                           attention_dropout=None, checkpoint_debug=False, batch=32, cap=10_000,
                                           search=True, curve=False, resolution=0.02, parallel=2, speed=False,
                                           targets={"bits3": 4.5, "bits2": 6.0}, unpatched_max={"bert-large": 91})
    rows = gpu_training.measure(["bert-large"], ["bits3", "bits2"], args)
    by = {r["setting"]: r for r in rows}
    assert all("equal_batch" not in r for r in rows)
    assert by["bits3"]["target"] == {"ratio": 4.5, "unpatched": 91, "batch": 410, "fits": True}
    assert by["bits2"]["target"] == {"ratio": 6.0, "unpatched": 91, "batch": 546, "fits": False}
    assert tried["bits3"][0] == 410 and tried["bits2"][:2] == [546, 32]  # a failed target: the projection next
    for r in rows:
        assert r["max_batch"] <= 450 < r["first_failing_batch"] and r["first_failing_batch"] - r["max_batch"] <= 9
    assert len(tried["bits3"]) <= 4 and len(tried["bits2"]) <= 5, tried
    gpu_training.write_results(rows, {**gpu_training._meta(torch.device("cpu")), "dtype": "bf16", "seq": 128,
                                      "image_size": 224, "batch": 32, "steps": 1, "warmup": 1, "cap_bytes": 10_000,
                                      "resolution": 0.02, "speed": False}, tmp_path)
    table = (tmp_path / "gpu_training.md").read_text()
    assert "no equal-batch speed trials" in table
    assert "| 4.5x of 91 = 410: fits |" in table and "| 6x of 91 = 546: OOM |" in table
    assert "| bert-large | bits3 | - | - | - |" in table


def test_target_arguments_name_the_bad_word():
    for argv, message in ((["--targets", "bits3"], "--targets: expected KEY=FLOAT"),
                          (["--targets", "bitsx=2"], "--targets: unknown setting 'bitsx'"),
                          (["--unpatched-max", "bert-largo=91"], "--unpatched-max: unknown model 'bert-largo'"),
                          (["--targets", "bits3=4.5"], "--targets needs --cap")):
        with pytest.raises(SystemExit) as raised:
            gpu_training.main([*argv, "--device", "cpu"])
        assert raised.value.code == 2 or message in str(raised.value)


def test_settings_can_name_their_model(capsys):
    words = ["unpatched", "bits3", "bert-large:ckpt+bits3"]
    assert gpu_training._settings_of("bert-large", words) == ["unpatched", "bits3", "ckpt+bits3"]
    assert gpu_training._settings_of("resnet50", words) == ["unpatched", "bits3"]
    with pytest.raises(SystemExit):
        gpu_training.main(["--settings", "bert-largo:bits3", "--device", "cpu"])
    assert "unknown model 'bert-largo'; allowed: " in capsys.readouterr().err


def test_profile_step_writes_the_hot_ops_on_cpu(tmp_path):
    profile_step = _load("profile_step")
    assert profile_step.main(["--model", "resnet50", "--settings", "unpatched", "bits3", "--batch", "2",
                              "--image-size", "32", "--steps", "1", "--warmup", "0", "--dtype", "fp32", "--rows", "4",
                              "--device", "cpu", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "profile_resnet50.json").read_text())["results"]
    assert [r["setting"] for r in results] == ["unpatched", "bits3"]
    assert all(len(r["top"]) == 4 and r["top"][0]["self_us_per_step"] > 0 for r in results)
    text = (tmp_path / "profile_resnet50.md").read_text()
    assert "## bits3:" in text and "## bits3 against unpatched, by op family" in text
    assert (tmp_path / "profile_resnet50.png").stat().st_size > 0
    diff = {d["family"]: d for d in results[1]["family_differences"]}
    assert diff["ActConvFunction"]["base_us"] == 0 and diff["ActConvFunction"]["delta_us"] > 0
    assert diff["ActConvFunction"]["calls"] == 53  # resnet50's convolutions, all patched


def test_profile_step_names_the_act_hf_function_that_called_each_op(tmp_path):
    """``--stacks``: a patched step's convolutions are attributed to act_hf's conv Function, the unpatched step's to
    timm or to no act_hf or model code (autograd's own backward nodes)."""
    profile_step = _load("profile_step")
    assert profile_step.main(["--model", "resnet50", "--settings", "unpatched", "bits3", "--batch", "2",
                              "--image-size", "32", "--steps", "1", "--warmup", "0", "--dtype", "fp32", "--rows",
                              "400", "--device", "cpu", "--stacks", "--out", str(tmp_path)]) == 0
    unpatched, patched = json.loads((tmp_path / "profile_resnet50.json").read_text())["results"]
    assert not any(r["function"].startswith("act_hf/") for r in unpatched["functions"])
    convs = [r for r in patched["functions"] if r["op"] == "aten::convolution_backward"]
    assert convs and all(r["function"].startswith("act_hf/ops/linear.py(") for r in convs)
    assert sum(r["calls"] for r in convs) == 53
    assert "### bits3: own CPU time by op and the function that called it" in (
        tmp_path / "profile_resnet50.md").read_text()
    assert profile_step.calling_function(["torch/nn/modules/module.py(1): _call_impl",
                                          "timm/models/resnet.py(9): forward", "/x/act_hf/ops/norm.py(5): backward"]
                                         ) == "act_hf/ops/norm.py(5): backward"


def test_profile_step_sorts_kernels_into_families():
    """Kernel names as torch.profiler reports them on an H200 (torch 2.11) go to the families the differences
    between settings are summed by."""
    family = _load("profile_step").kernel_family
    assert family("void act_hf::(anonymous namespace)::quantize_pack_kernel<c10::BFloat16, 3>(c10::BFloat16 "
                  "const*, long)") == "act_hf quantize_pack_kernel<c10::BFloat16, 3>"
    assert family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert family("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64") == "attention"
    assert family("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
                  "BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > >"
                  ) == "elementwise MulFunctor"
    assert family("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda("
                  "at::TensorIteratorBase&)::{lambda(float)#1}>") == "elementwise bfloat16_copy_kernel_cuda"
    assert family("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16, at::native::"
                  "func_wrapper_t<c10::BFloat16, at::native::sum_functor<c10::BFloat16, float> > >") == (
        "reduce sum_functor")
    assert family("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
                  "namespace)::TensorListMetadata<1>>") == "optimizer (foreach)"
    assert family("aten::mm") == "aten::mm"


def test_host_overhead_patches_one_kind_alone_when_a_setting_names_it(tmp_path):
    host_overhead = _load("benchmark_host_overhead")
    assert host_overhead.parse_setting("bits3") == (3, None)
    assert host_overhead.parse_setting("bits2:linear+dropout") == (2, ("linear", "dropout"))
    for bad in ("bits9", "bits3:", "bits3:linears", "int3"):
        with pytest.raises(ValueError, match="--settings"):
            host_overhead.parse_setting(bad)
    assert host_overhead.main(["--stub-codec", "--layers", "1", "--steps", "1", "--settings", "bits3:linear",
                               "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "host_overhead.json").read_text())["rows"]
    assert row["setting"] == "bits3:linear" and {o["op"].split(".")[0] for o in row["by_op"]} == {"ActLinearFunction"}
    with pytest.raises(SystemExit):
        host_overhead.main(["--settings", "bits3:convs", "--out", str(tmp_path)])


def test_host_overhead_times_both_settings_and_puts_the_codec_back(tmp_path):
    from act_hf.compress import reference

    host_overhead = _load("benchmark_host_overhead")
    before = {name: getattr(reference, name) for name in host_overhead.STUBS}
    functions = {cls: (cls.__dict__["forward"], cls.__dict__["backward"]) for cls in host_overhead.act_functions()}
    assert host_overhead.main(["--stub-codec", "--layers", "1", "--steps", "2", "--out", str(tmp_path)]) == 0
    assert {name: getattr(reference, name) for name in host_overhead.STUBS} == before
    assert {cls: (cls.__dict__["forward"], cls.__dict__["backward"]) for cls in functions} == functions
    rows = json.loads((tmp_path / "host_overhead.json").read_text())["rows"]
    assert rows[0]["by_op"] == []  # nothing of act_hf's runs unpatched
    ops = {o["op"]: o for o in rows[1]["by_op"]}
    assert ops["ActLinearFunction.forward"]["calls_per_step"] == 6  # Q, K, V, attention output, MLP x 2 (heads stay)
    assert ops["ActLinearFunction.backward"]["calls_per_step"] == 6
    assert ops["ActSDPAFunction.forward"]["us_per_call"] > 0
    assert "| ActLinearFunction.forward | 6 |" in (tmp_path / "host_overhead.md").read_text()
    assert (tmp_path / "host_overhead.png").stat().st_size > 0
    assert [r["setting"] for r in rows] == ["unpatched", "bits3"] and all(r["ms_per_step"] > 0 for r in rows)
    assert rows[0]["vs_unpatched"] == 1.0
    assert 0 < rows[0]["ops_per_step"] < rows[1]["ops_per_step"]  # act_hf's ops come on top of the model's
    assert all(sum(r["ops_by_name"].values()) == r["ops_per_step"] for r in rows)
    added = {a["op"]: a for a in host_overhead.added_ops(rows)}
    assert added["unpack_dequantize"] == {"op": "unpack_dequantize", "unpatched": 0,
                                          "bits3": rows[1]["ops_by_name"]["unpack_dequantize"]}
    assert f"| unpack_dequantize | 0 | {added['unpack_dequantize']['bits3']} (+" in \
        (tmp_path / "host_overhead.md").read_text()
    assert rows[1]["syncs_per_step"] == 0
    assert "empty" not in rows[1]["ops_by_name"] and rows[1]["allocations_per_step"] > 0  # launch nothing
    assert 0 < rows[0]["mb_moved_per_step"] < rows[1]["mb_moved_per_step"]
    for r in rows:  # the bytes by op add up to the step's, over the same ops
        assert sum(r["mb_by_name"].values()) == pytest.approx(r["mb_moved_per_step"])
        assert set(r["mb_by_name"]) == set(r["ops_by_name"])
    moved = {a["op"]: a for a in host_overhead.added_ops(rows, key="mb_by_name")}
    quantized = moved["quantize_pack"]
    assert quantized["unpatched"] == 0 and quantized["bits3"] == rows[1]["mb_by_name"]["quantize_pack"] > 0
    assert f"| quantize_pack | 0.0 | {quantized['bits3']:.1f} (+" in (tmp_path / "host_overhead.md").read_text()
    with pytest.raises(SystemExit):
        host_overhead.main(["--settings", "bits9"])
    with pytest.raises(SystemExit):  # the GPU runs the CUDA kernels, never the stand-ins
        host_overhead.main(["--device", "cuda", "--stub-codec"])
    assert host_overhead.main(["--stub-codec", "--timm", "resnet18", "--image-size", "32", "--batch", "2",
                               "--steps", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "host_overhead.json").read_text())["rows"]
    assert 0 < rows[0]["mb_moved_per_step"] < rows[1]["mb_moved_per_step"]
    assert (tmp_path / "host_overhead.md").read_text().startswith("timm resnet18 (32 px images, batch 2)")


def test_host_overhead_slices_a_small_batch_as_a_large_one_and_runs_it_whole_with_room(tmp_path, monkeypatch):
    """``--slice-elements``: convolutions (forward too) and BatchNorm's backward run in the slices a large batch gets
    on a GPU, more device ops than the whole batch's, which ``--slicing never`` (room for it) runs instead; the
    modules' constants and ``ACT_HF_SLICING`` are put back after, and both are recorded."""
    from act_hf.ops import linear as linear_ops
    from act_hf.ops import norm as norm_ops

    host_overhead = _load("benchmark_host_overhead")
    monkeypatch.setenv("ACT_HF_SLICING", "auto")
    before = (linear_ops.CONV_CHUNK_ELEMENTS, norm_ops.BATCH_NORM_CHUNK_ELEMENTS, linear_ops.WHOLE_FORWARD_DEVICES)
    ops = {}
    for mode in ("always", "never"):
        out = tmp_path / mode
        assert host_overhead.main(["--stub-codec", "--timm", "resnet18", "--image-size", "32", "--batch", "2",
                                   "--steps", "1", "--settings", "bits3", "--slice-elements", "20000", "--slicing",
                                   mode, "--out", str(out)]) == 0
        result = json.loads((out / "host_overhead.json").read_text())
        assert result["meta"]["slice_elements"] == 20000 and result["meta"]["act_hf_slicing"] == mode
        assert f"sliced past 20000 elements, ACT_HF_SLICING={mode}" in (out / "host_overhead.md").read_text()
        ops[mode] = result["rows"][0]["ops_by_name"]
    # resnet18's 20 convolutions once each, and the input gradients of 19 (the stem's input wants none)
    assert ops["always"]["convolution"] > ops["never"]["convolution"] == 20 + 19
    assert ops["always"]["convolution_backward"] > ops["never"]["convolution_backward"]
    assert before == (linear_ops.CONV_CHUNK_ELEMENTS, norm_ops.BATCH_NORM_CHUNK_ELEMENTS,
                      linear_ops.WHOLE_FORWARD_DEVICES) and os.environ["ACT_HF_SLICING"] == "auto"
    with pytest.raises(SystemExit):
        host_overhead.main(["--slice-elements", "0"])


def test_host_overhead_runs_attention_in_the_chunks_asked_for(tmp_path, monkeypatch):
    """``--attention-chunk-elements``: the steps measured recompute attention in chunks of that many matrix
    elements (a small batch runs the chunks a large one does), recorded in the results; the module's constant is
    put back after, and a size below 1 is refused."""
    from act_hf.ops import attention

    host_overhead = _load("benchmark_host_overhead")
    default, seen = attention.RECOMPUTE_CHUNK_ELEMENTS, []
    monkeypatch.setenv("ACT_HF_SLICING", "auto")
    measure = host_overhead.measure
    monkeypatch.setattr(host_overhead, "measure", lambda *a, **k: seen.append(
        (attention.RECOMPUTE_CHUNK_ELEMENTS, os.environ["ACT_HF_SLICING"])) or measure(*a, **k))
    assert host_overhead.main(["--stub-codec", "--layers", "1", "--steps", "1", "--attention-chunk-elements",
                               "4096", "--out", str(tmp_path)]) == 0
    assert seen == [(4096, "always")] * 2  # the chunks whatever room a GPU would have
    assert attention.RECOMPUTE_CHUNK_ELEMENTS == default and os.environ["ACT_HF_SLICING"] == "auto"
    assert json.loads((tmp_path / "host_overhead.json").read_text())["meta"]["attention_chunk_elements"] == 4096
    assert "attention recomputed in chunks of 4096 matrix elements" in (tmp_path / "host_overhead.md").read_text()
    with pytest.raises(SystemExit):
        host_overhead.main(["--attention-chunk-elements", "0"])


@pytest.mark.parametrize("name", ["bart", "whisper"])
def test_host_overhead_of_a_fallback_model(tmp_path, name):
    """``--hf-fallback``: a tiny HF model act_hf has no family for, patched through the fallback, trains; its
    act_hf modules' ops are timed; the table names the model."""
    host_overhead = _load("benchmark_host_overhead")
    assert host_overhead.main(["--stub-codec", "--hf-fallback", name, "--layers", "2", "--steps", "1",
                               "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "host_overhead.json").read_text())["rows"]
    assert all(r["ms_per_step"] > 0 for r in rows) and rows[1]["by_op"]
    assert (tmp_path / "host_overhead.md").read_text().startswith(f"Tiny {name} through the fallback (1 encoder")
    with pytest.raises(SystemExit):
        host_overhead.main(["--hf-fallback", name, "--timm", "resnet18"])


def test_curve_batches():
    assert gpu_training._curve_batches(91, 32) == [8, 16, 32, 64, 91]
    assert gpu_training._curve_batches(20, 32) == [8, 16, 20]


def test_trial_trains_in_process_and_in_a_subprocess():
    """A trial takes real optimizer steps (the weights move) and reports samples/s; the subprocess path parses
    its JSON. resnet50 at 32 px and fp32 keeps it cheap on a CPU."""
    trial = gpu_training.Trial("resnet50", "bits3", batch=2, steps=1, warmup=1, image_size=32, dtype="fp32",
                               device="cpu")
    result = gpu_training.run_trial(trial)
    assert result["oom"] is False and result["samples_per_s"] > 0 and "peak_bytes" not in result
    result = gpu_training.run_in_subprocess(gpu_training.Trial(**{**trial.__dict__, "setting": "ckpt+adaptive2.5"}))
    assert result["oom"] is False and result["samples_per_s"] > 0, result
    assert 1 <= result["avg_bits"] <= 2.5


def test_a_trial_sweeps_batches_in_its_process_until_one_runs_out_of_memory(monkeypatch):
    """``Trial.sweep`` times more batches on the model built once, each with a batch of its own size; the first
    out-of-memory ends the sweep."""
    trial = gpu_training.Trial("resnet50", "bits3", batch=2, steps=1, warmup=1, image_size=32, dtype="fp32",
                               device="cpu", sweep=(3, 4))
    result = gpu_training.run_trial(trial)
    assert result["samples_per_s"] > 0 and set(result["sweep"]) == {3, 4}
    assert all(point["oom"] is False and point["samples_per_s"] > 0 for point in result["sweep"].values())

    timed = gpu_training._timed_steps
    sizes = []

    def out_of_memory_at_3(step, trial, batch):
        sizes.append(batch)
        if batch == 3:
            raise torch.OutOfMemoryError("at 3")
        return timed(step, trial, batch)

    monkeypatch.setattr(gpu_training, "_timed_steps", out_of_memory_at_3)
    result = gpu_training.run_trial(trial)
    assert sizes == [2, 3] and result["sweep"] == {3: {"oom": True}}


def test_curve_batches_are_timed_in_the_speed_trials(tmp_path):
    """``--curve-batches``: each row's speed trial times the equal batch and then the curve's, in one
    subprocess; the table lists samples/s by batch."""
    assert gpu_training.main(["--models", "resnet50", "--settings", "bits3", "--device", "cpu", "--image-size", "32",
                              "--dtype", "fp32", "--batch", "2", "--curve-batches", "1", "2", "3", "--steps", "1",
                              "--warmup", "0", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "gpu_training.json").read_text())["rows"][0]
    assert set(row["curve"]) == {"1", "2", "3"} and all(sps > 0 for sps in row["curve"].values())
    assert row["curve"]["2"] == row["equal_batch"]["samples_per_s"]
    assert "| resnet50 | bits3 | " in (tmp_path / "gpu_training.md").read_text().split("| 1 | 2 | 3 |")[1]
    with pytest.raises(SystemExit):
        gpu_training.main(["--curve-batches", "0", "--device", "cpu"])


def test_attention_dropout_reaches_the_hf_configs():
    """``--attention-dropout`` sets each HF family's own keyword; the default builds keep dropout off."""
    overrides = dict.fromkeys(gpu_training._ATTENTION_DROPOUT_KEYS, 0.1)
    for name, key in (("bert-base", "attention_probs_dropout_prob"), ("gpt2", "attn_pdrop")):
        assert getattr(gpu_training.MODELS[name]()[0].config, key) == 0.0
        assert getattr(gpu_training.MODELS[name](**overrides)[0].config, key) == 0.1


def test_a_failing_trial_is_reported_not_raised():
    result = gpu_training.run_in_subprocess(gpu_training.Trial("resnet50", "bits3", batch=1, device="nodevice"))
    assert "error" in result and "RuntimeError" in result["error"]


def test_a_multi_line_exception_is_kept_whole():
    stderr = """Traceback (most recent call last):
  File "x.py", line 3, in <module>
    loss.backward()
torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed values for the following tensors
have different metadata than during the forward pass.
tensor at position 12:
saved metadata: {'shape': torch.Size([8, 128]), 'dtype': torch.bfloat16}
recomputed metadata: {'shape': torch.Size([8, 128]), 'dtype': torch.float32}
"""
    text = gpu_training._exception_text(stderr)
    assert text.startswith("torch.utils.checkpoint.CheckpointError: ")
    assert "tensor at position 12: | saved metadata" in text and "torch.float32}" in text
    assert gpu_training._exception_text("just | one line") == "just | one line"


def test_main_writes_json_and_table_on_cpu(tmp_path, capsys):
    rc = gpu_training.main(["--models", "resnet50", "--settings", "unpatched", "bits2", "--batch", "2", "--steps", "1",
                            "--warmup", "0", "--image-size", "32", "--dtype", "fp32", "--device", "cpu",
                            "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "gpu_training.json").read_text())
    assert [r["setting"] for r in data["rows"]] == ["unpatched", "bits2"]
    assert data["rows"][1]["speed_vs_unpatched"] > 0
    assert data["meta"]["device"].startswith("CPU") and data["meta"]["torch"] == torch.__version__
    table = (tmp_path / "gpu_training.md").read_text()
    assert "| resnet50 | bits2 |" in table
    assert (tmp_path / "gpu_training.png").stat().st_size > 0  # without curves: the ratios' bars
    with pytest.raises(SystemExit):
        gpu_training.main(["--device", "cpu", "--cap", "16GiB", "--out", str(tmp_path)])
    assert "--cap needs a CUDA device" in capsys.readouterr().err


@pytest.mark.cuda
def test_host_overhead_on_the_gpu(tmp_path):
    host_overhead = _load("benchmark_host_overhead")
    assert host_overhead.main(["--device", "cuda", "--layers", "1", "--steps", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "host_overhead.json").read_text())["rows"]
    assert all(r["ms_per_step"] > 0 and r["syncs_per_step"] == 0 for r in rows)
    assert {o["op"] for o in rows[1]["by_op"]} >= {"ActLinearFunction.forward", "ActLayerNormFunction.backward"}
    assert "codec CUDA kernels" in (tmp_path / "host_overhead.md").read_text()


@pytest.mark.cuda
def test_search_under_a_cap_on_the_gpu(tmp_path):
    """A tiny cap: the search must find a batch that fits and one that fails, and act_hf must fit more. The equal
    batch is 64, where activations outweigh the gradients: at 8 both peaks were the optimizer step's (586.4 MB
    unpatched, 587.3 MB at 2 bits on the H100)."""
    rc = gpu_training.main(["--models", "resnet50", "--settings", "unpatched", "bits2", "--batch", "64",
                            "--steps", "1", "--warmup", "1", "--image-size", "64", "--cap", "1GiB",
                            "--resolution", "0.1", "--no-curve", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "gpu_training.json").read_text())["rows"]
    assert all(r["max_batch"] > 0 and r["first_failing_batch"] for r in rows)
    assert rows[1]["max_batch"] > rows[0]["max_batch"]
    assert rows[0]["equal_batch"]["peak_bytes"] > rows[1]["equal_batch"]["peak_bytes"]


checkpoint_memory = _load("benchmark_checkpoint_memory")


def test_checkpoint_memory_settings_and_measurement():
    """AM1/AM2 on a tiny BERT: checkpointing keeps less than no checkpointing, packed layer inputs less than
    exact ones, and re-forwarding a layer adds its context (AM2 > AM1) only under checkpointing."""
    from tests.patches.models import bert

    parse = checkpoint_memory.parse_setting
    assert parse("unpatched") == (False, None, None) and parse("ckpt") == (True, None, None)
    assert parse("bits3") == (False, None, 3) and parse("ckpt+bits3") == (True, None, 3)
    assert parse("ckpt4+bits2") == (True, 4, 2)
    for bad in ("ckpt4", "ckpt9+bits3", "bits0", "swap+bits3"):
        with pytest.raises(SystemExit, match="--settings"):
            parse(bad)
    torch.manual_seed(0)
    model, inputs = bert()
    inputs = {**inputs, "input_ids": inputs["input_ids"].repeat(4, 4), "attention_mask": None,
              "labels": inputs["labels"].repeat(4)}
    got = {s: checkpoint_memory.measure(model, inputs, s, None)
           for s in ("unpatched", "ckpt", "bits3", "ckpt+bits3", "ckpt4+bits3")}
    assert got["unpatched"]["am2"] == got["unpatched"]["am1"] and got["bits3"]["am2"] == got["bits3"]["am1"]
    assert got["ckpt"]["am2"] > got["ckpt"]["am1"] and got["ckpt4+bits3"]["am2"] > got["ckpt4+bits3"]["am1"]
    assert got["ckpt4+bits3"]["am1"] < got["ckpt+bits3"]["am1"] < got["unpatched"]["am1"]
    assert got["ckpt4+bits3"]["am2"] < got["ckpt"]["am2"] < got["unpatched"]["am2"]


cpu_peak = _load("benchmark_cpu_peak")


def test_cpu_peak_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cpu_peak.main(["--batches", "1", "4"])  # the warm-up step runs at batch 1
    with pytest.raises(SystemExit):
        cpu_peak.main(["--batches", "4", "4"])
    with pytest.raises(SystemExit, match="--settings"):
        cpu_peak.main(["--settings", "bits3", "zip"])
    with pytest.raises(SystemExit):
        cpu_peak.main(["--models", "resnet50", "--settings", "ckpt"])
    assert "--settings ckpt: HF gradient checkpointing does not apply" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cpu_peak.main(["--act-config", '{"share_residul": false}'])
    assert "--act-config" in capsys.readouterr().err
    assert cpu_peak._rss() > 0


def test_cpu_peak_measures_a_vision_step_with_act_config():
    """One step of resnet50 (224 x 224, batch 2) in this process (the peak needs the subprocess's malloc
    settings, so only the saved bytes are checked): the ActConfig fields reach the patch."""
    shared = cpu_peak.measure_step("resnet50", "bits2", 2, 128, "fp32", {})
    own = cpu_peak.measure_step("resnet50", "bits2", 2, 128, "fp32", {"share_residual": False})
    assert own["saved"] > shared["saved"] > 0


model_sweep = _load("benchmark_model_sweep")


def test_model_sweep_checks_a_text_and_an_image_model(tmp_path):
    rows = model_sweep.main(["--models", "electra", "regnety_002", "--out", str(tmp_path), "--name", "sweep"])
    assert [r["model"] for r in rows] == ["electra", "regnety_002"]
    assert all(r["loss_equal"] and r["verdict"] == "pass" and r["relative_error"] < 0.05 for r in rows), rows
    assert all(r["buffers_equal"] for r in rows), rows  # RegNet's BatchNorm statistics, bit for bit
    assert [r["family"] for r in rows] == [True, False]  # ELECTRA: the BERT family; RegNet: the fallback
    assert not any(r["adaptive"] for r in rows)  # --bits 8 is a fixed width, not an adaptive budget of 8
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["meta"]["bits"] == 8 and len(saved["rows"]) == 2
    assert "| regnety_002 | no (fallback) | True |" in (tmp_path / "sweep.md").read_text()
    assert (tmp_path / "sweep.png").stat().st_size > 0 and saved["meta"]["timm"] and saved["meta"]["commit"]
    with pytest.raises(SystemExit):
        model_sweep.main(["--models", "no-such-model"])


def test_model_sweep_under_autocast_sets_bf16s_own_error_beside_act_hfs(tmp_path):
    """Under bf16 autocast both steps run in bf16, and the errors of both against an fp32 step are of one size:
    what the unpatched bf16 step itself differs by (torchvision's ResNet: its blocks write BatchNorm in place)."""
    (row,) = model_sweep.main(["--models", "tv_resnet18", "--autocast", "--out", str(tmp_path), "--name", "bf16"])
    assert row["loss_equal"] and row["buffers_equal"] and row["verdict"] == "pass", row
    floor, ours = row["unpatched_bf16_vs_fp32"], row["patched_bf16_vs_fp32"]
    assert 0 < floor and 0.5 * floor < ours < 2 * floor, row
    assert "| act_hf bf16 vs fp32 |" in (tmp_path / "bf16.md").read_text()


memory_at_peak = _load("memory_at_peak")


def test_peak_sites_replays_allocations_in_order():
    """Two blocks alive together at the peak, one freed before a smaller later one; a free of a block from
    before the step lowers the total; the phase is the peak's; each phase's own highest point is there too."""
    a, b, c = ("x.py", "/act_hf/ops/norm.py(1): f", "op:aten::empty"), ("/timm/m.py(2): g", "op:aten::mm"), ()
    events = [(0, 0, 100, 1, a), (1, 1, 50, 2, b), (2, 2, -100, 1, a), (3, 3, 30, 3, c), (4, 4, -40, 9, c)]
    out = memory_at_peak.peak_sites(events, backward_from_ns=2)
    forward = {"norm.py(1): f | aten::empty": 100, "m.py(2): g | aten::mm": 50}
    assert out == {"peak": 150, "phase": "forward", "sites": forward,
                   "phases": {"forward": {"peak": 150, "sites": forward},
                              "backward": {"peak": 80, "sites": {"m.py(2): g | aten::mm": 50, "- | -": 30}}}}
    assert memory_at_peak.peak_sites(events + [(5, 5, 200, 4, c)], backward_from_ns=2)["phase"] == "backward"


def test_peak_sites_names_the_innermost_module_of_each_highest_point():
    """Ranges nest (a block and its conv) or follow each other; each event falls in the innermost one open then,
    and each phase's highest point is named by it, with the highest total reached inside each module."""
    c = ()
    events = [(1, 0, 10, 1, c), (3, 1, 20, 2, c), (5, 2, -20, 2, c), (7, 3, 5, 3, c), (9, 4, 40, 4, c)]
    ranges = [(0, 6, "block"), (2, 4, "block.conv"), (6, 8, "head")]
    assert memory_at_peak._innermost([1, 3, 5, 7, 9], ranges) == ["block", "block.conv", "block", "head", None]
    out = memory_at_peak.peak_sites(events, backward_from_ns=9, ranges=ranges)
    assert out["phases"]["forward"]["module"] == "block.conv" and out["phases"]["backward"]["module"] is None
    assert out["module_highs"] == {"block": 10, "block.conv": 30, "head": 15}  # each as the innermost one


def test_profile_peak_labels_the_modules_and_takes_the_labels_off():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    x = torch.randn(32, 64)
    out = memory_at_peak.profile_peak(lambda: model(x).square().sum(), torch.device("cpu"), model)
    assert set(out["module_highs"]) <= {"0", "1", "2"} and out["phases"]["forward"]["module"] in {"0", "1", "2"}
    assert all("forward" not in m.__dict__ for m in model.modules())


class _SavesABuffer(torch.autograd.Function):
    """Saves a 4 MiB buffer made in forward; backward makes a 2 MiB temporary while it lives."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(torch.ones(1 << 20))
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (buffer,) = ctx.saved_tensors
        temporary = torch.ones(1 << 19)
        return grad * 2 + (buffer.sum() + temporary.sum()) * 0


def test_memory_at_peak_names_the_saved_buffer_and_the_backward_temporary():
    x = torch.randn(8, requires_grad=True)
    out = memory_at_peak.profile_peak(lambda: _SavesABuffer.apply(x).sum(), torch.device("cpu"))
    assert out["phase"] == "backward" and out["peak"] >= 6 << 20
    assert out["sites"]["_SavesABuffer | aten::empty"] == 4 << 20
    assert out["sites"]["autograd::engine::evaluate_function: _SavesABufferBackward | aten::empty"] == 2 << 20


def test_memory_at_peak_sites_and_arguments():
    frame = ("op:ActConvFunction", "/x/site-packages/timm/models/resnet.py(9): forward",
             "act_hf/ops/linear.py(135): forward", "op:aten::conv2d", "op:aten::empty")
    assert memory_at_peak._site(frame) == "linear.py(135): forward | aten::empty"  # relative paths count too
    assert memory_at_peak._site(("benchmarks/x.py(1): f", "op:Fn", "op:aten::mm")) == "Fn | aten::mm"
    with pytest.raises(SystemExit):
        memory_at_peak.main(["--batches", "4", "2"])
    with pytest.raises(SystemExit, match="--settings"):
        memory_at_peak.main(["--setting", "bits9"])
    with pytest.raises(SystemExit):  # ACT_HF_SLICING's values alone
        memory_at_peak.main(["--slicing", "sometimes"])


def test_memory_at_peak_measures_a_checkpointed_step(monkeypatch):
    """``ckptK+bitsN``: HF checkpointing on, the layer inputs packed at K bits; the packed checkpoint's backward (the
    layers' recomputation) is among the sites alive at backward's highest point."""
    import transformers as tf

    config = tf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, attention_probs_dropout_prob=0.0)
    monkeypatch.setitem(memory_at_peak.MODELS, "tiny-bert",
                        lambda: (tf.BertForSequenceClassification(config), "text"))
    out = memory_at_peak.measure("tiny-bert", "ckpt4+bits3", 4, torch.device("cpu"), "bf16", 16)
    backward = out["phases"]["backward"]
    assert out["batch"] == 4 and backward["peak"] > 0
    assert any("_CompressedCheckpointBackward" in site for site in backward["sites"]), sorted(backward["sites"])


probe_extension_errors = _load("probe_extension_errors")


def test_probe_of_extension_errors_reports_how_each_case_ended(tmp_path, capsys):
    """Built here (CPU only), every error raises into Python and the caught one comes back as a value; the probe
    tells that apart from a crash in a subprocess (how it runs on a GPU machine where errors crashed)."""
    assert probe_extension_errors.main(["--build-dir", str(tmp_path / "build")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["std_error: raised: RuntimeError std_error raised",
                     "torch_check: raised: RuntimeError torch_check raised",
                     "value_error: raised: ValueError value_error raised",
                     "caught: returned: caught raised"]
    assert probe_extension_errors.run_case("no_such_case", tmp_path / "build").startswith("raised: AttributeError")


def test_the_kernel_throughput_benchmark_calls_each_kernel_as_the_extension_takes_it():
    """Each op ``benchmark_quantize.py`` times on a GPU, called once with the extension's CUDA sources built for
    the CPU (``tests/compress/emulated_kernels.py``) on a tensor of the shapes it uses (a residual sum of one
    resnet50 item): every call runs, with arguments the bindings take, and gives a tensor."""
    from tests.compress import emulated_kernels

    ext = emulated_kernels.build()
    if ext is None:
        pytest.skip("no CUDA toolkit headers (cuda_runtime.h) to build the emulated kernels with")
    bench = _load("benchmark_quantize")
    x = torch.randn(802816, dtype=torch.bfloat16)  # 784 rows of 1024 channels, one resnet50 item
    ops = bench.size_ops(ext, x) + [op for bits in (1, 3) for op in bench.bits_ops(ext, x, bits, 256)]
    assert [(op, bits) for op, bits, _, _ in ops] == [
        ("relu_inplace_code", 1), ("relu_ (aten)", 1), ("gelu_ (aten)", 0),
        *[(op, bits) for bits in (1, 3) for op in ("quantize_pack", "unpack_dequantize", "unpack_dequantize_affine",
                                                    "unpack_dequantize_into", "unpack_dequantize_chain",
                                                    *(("masked_scale",) if bits == 1 else ()), "fewbit_encode_pack",
                                                    "activation_inplace_code")]]
    for op, _, call, nbytes in ops:
        out = call()
        assert nbytes > 0 and (out is None or isinstance(out, torch.Tensor | list | tuple)), op


class _Parsed(Exception):
    """Raised by a patched ``parse_args`` once a benchmark's options parsed: the script is not run further."""


def _gpu_call_commands() -> list[tuple[str, list[str]]]:
    """``(script, argv)`` of each benchmark ``gpu_one_call.sh`` runs: its lines joined at ``\\``, each call from
    ``"$PY" <script>`` to its first redirection, ``$GT`` and ``speed256``'s model (``"$2"``) filled in, every
    ``"$W/..."`` path a name under the run's folder."""
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_one_call.sh").read_text().replace("\\\n", " ")
    text = text.replace("$GT", "benchmarks/benchmark_gpu_training.py").replace('"$2"', "resnet50")
    calls = []
    for line in text.splitlines():
        if '"$PY" benchmarks/' not in line:
            continue
        words = shlex.split(line.split('"$PY" ', 1)[1].split(" >", 1)[0].replace('"$W', '"/tmp/w'))
        calls.append((Path(words[0]).stem, words[1:]))
    return calls


def test_the_gpu_call_gives_each_benchmark_options_it_takes(monkeypatch):
    """A GPU's time is short and lent to few sessions: every benchmark ``gpu_one_call.sh`` runs parses the options
    it is given (an unknown or malformed one would end that part at once, on the GPU)."""
    import argparse

    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        raise _Parsed(original(parser, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    calls = _gpu_call_commands()
    assert {script for script, _ in calls} == {"benchmark_gpu_training", "benchmark_quantize", "profile_step",
                                               "memory_at_peak"}
    for script, argv in calls:
        with pytest.raises(_Parsed):
            _load(script).main(argv)


def test_the_gpu_and_long_benchmarks_plot_their_results(tmp_path):
    """The plots of the benchmarks the suite does not run (a GPU's kernel throughput, the adaptive probe's cost,
    GLUE training) from results shaped as theirs: each writes its PNG beside the JSON and table."""
    _load("benchmark_quantize").plot(
        [{"op": op, "size_mib": 256, "bits": bits, "fraction_of_copy": f} for op, f in
         (("quantize_pack", 0.17), ("unpack_dequantize", 0.55)) for bits in (2, 3)], tmp_path / "quantize.png")
    _load("benchmark_adapt_cost").plot(
        [{"model": "minilm", "probe_in_steps": 2.5, "variance_ratio": {"bits3": 0.2, "adaptive": 0.1}}],
        tmp_path / "adapt.png")
    _load("benchmark_glue_accuracy").plot({"rte": {"unpatched": 0.6, "bits3": 0.59}}, ["unpatched", "bits3"],
                                          tmp_path / "glue.png")
    assert all((tmp_path / f"{name}.png").stat().st_size > 0 for name in ("quantize", "adapt", "glue"))
