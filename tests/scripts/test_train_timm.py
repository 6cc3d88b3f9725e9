"""vision_scripts/train_timm.py: the IDX reader, short Fashion-MNIST and ImageFolder runs, saved-memory numbers.

The Fashion-MNIST tests need the Debian package ``dataset-fashion-mnist`` (or ``$ACT_HF_FASHION_MNIST_DIR``)
and skip without it.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "vision_scripts" / "train_timm.py"

# Tiny models: a 2-stage Swin at 32x32 (patch 4 -> 8x8 tokens, window 4) and a narrow 4-stage ResNet.
TINY_SWIN = ["--model", "swin_tiny_patch4_window7_224", "--model-kwargs",
             '{"window_size": 4, "embed_dim": 24, "depths": [1, 1], "num_heads": [2, 4]}']
TINY_RESNET = ["--model", "resnet18", "--model-kwargs", '{"layers": [1, 1, 1, 1], "channels": [8, 16, 32, 64]}']


def _load_script():
    spec = importlib.util.spec_from_file_location("train_timm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_timm"] = module
    spec.loader.exec_module(module)
    return module


train_timm = _load_script()


@pytest.fixture(scope="module")
def fmnist_dir() -> Path:
    try:
        return train_timm.find_fashion_mnist()
    except FileNotFoundError as exc:
        pytest.skip(f"Fashion-MNIST not installed ({exc})")


def _run(tmp_path: Path, name: str, *argv: str) -> dict:
    out = tmp_path / name
    returned = train_timm.main([*argv, "--output-dir", str(out), "--device", "cpu", "--seed", "0"])
    results = json.loads((out / "results.json").read_text())
    assert results["val_accuracy"] == pytest.approx(returned["val_accuracy"])
    return results


def _fmnist_args(fmnist_dir: Path, *extra: str) -> list[str]:
    return ["--dataset", "fashion-mnist", "--fashion-mnist-dir", str(fmnist_dir), "--img-size", "32",
            "--num-train", "96", "--num-val", "32", "--batch-size", "16", "--steps", "5", "--lr", "1e-3",
            "--amp", "none", "--log-interval", "5", *extra]


def _check_results(results: dict, *, steps: int) -> None:
    print({k: results[k] for k in ("final_train_loss", "val_accuracy", "saved_mib_per_step",
                                   "saved_mib_per_step_unpatched", "saved_ratio_vs_unpatched", "samples_per_s")})
    assert results["steps"] == steps
    assert math.isfinite(results["final_train_loss"]) and math.isfinite(results["last_step_loss"])
    assert 0.0 <= results["val_accuracy"] <= 1.0
    assert results["saved_mib_per_step"] > 0
    assert results["samples_per_s"] > 0
    assert results["device"].startswith("CPU")
    assert {"torch", "timm", "act_hf"} <= set(results["versions"])


# ------------------------------------------------------------------------------------------------ IDX reader


def test_read_idx_real_files(fmnist_dir):
    images, labels = train_timm.load_fashion_mnist("train", fmnist_dir)
    assert images.shape == (60000, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (60000,) and labels.dtype == torch.int64
    assert sorted(labels.unique().tolist()) == list(range(10))
    assert torch.bincount(labels).tolist() == [6000] * 10
    images, labels = train_timm.load_fashion_mnist("val", fmnist_dir)
    assert images.shape == (10000, 28, 28) and labels.shape == (10000,)
    assert sorted(labels.unique().tolist()) == list(range(10))
    assert 0 < images.float().mean() < 255 and images.max() == 255


@pytest.mark.parametrize("compressed", [False, True])
def test_read_idx_synthetic(tmp_path, compressed):
    data = (np.arange(2 * 3 * 5).reshape(2, 3, 5) - 7).astype(">i4")
    raw = struct.pack(">BBBB", 0, 0, 0x0C, 3) + struct.pack(">III", 2, 3, 5) + data.tobytes()
    path = tmp_path / "x.idx"
    path.write_bytes(gzip.compress(raw) if compressed else raw)
    out = train_timm.read_idx(path)
    assert out.shape == (2, 3, 5) and out.dtype.isnative
    np.testing.assert_array_equal(out, data)


def test_read_idx_rejects_bad_files(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(ValueError, match="not an IDX file"):
        train_timm.read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(struct.pack(">BBBBI", 0, 0, 0x08, 1, 10) + b"\x00" * 3)
    with pytest.raises(ValueError, match="needs"):
        train_timm.read_idx(tmp_path / "short")


def test_act_data_bits_takes_1_to_8_or_none(capsys):
    parser = train_timm.build_parser()
    assert parser.parse_args([]).act_data_bits == 8
    assert parser.parse_args(["--act-data-bits", "4"]).act_data_bits == 4
    assert parser.parse_args(["--act-data-bits", "none"]).act_data_bits is None
    for bad in ("0", "9", "2.5"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--act-data-bits", bad])
        assert "--act-data-bits: must be an integer from 1 to 8, or 'none'" in capsys.readouterr().err


def test_missing_fashion_mnist_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setattr(train_timm, "_dpkg_dir", lambda: None)
    monkeypatch.setattr(train_timm, "FASHION_MNIST_DEFAULT_DIR", tmp_path / "nowhere")
    monkeypatch.delenv("ACT_HF_FASHION_MNIST_DIR", raising=False)
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        train_timm.find_fashion_mnist(tmp_path)


# ------------------------------------------------------------------------------------------------ training runs


def test_fashion_mnist_resnet_with_and_without_compression(tmp_path, fmnist_dir):
    base = _run(tmp_path, "base", *_fmnist_args(fmnist_dir, *TINY_RESNET))
    comp = _run(tmp_path, "act3", *_fmnist_args(fmnist_dir, *TINY_RESNET, "--act-compress", "--act-bits", "3"))
    for results in (base, comp):
        _check_results(results, steps=5)
    assert base["act_compress"] is False and comp["act_compress"] is True and comp["act_bits"] == 3
    # Same seed, same first batch: the compressed run's own measurement of the unpatched copy is the baseline run's.
    assert comp["saved_mib_per_step_unpatched"] == pytest.approx(base["saved_mib_per_step"], rel=1e-6)
    assert base["saved_mib_per_step_unpatched"] == base["saved_mib_per_step"]
    ratio = base["saved_mib_per_step"] / comp["saved_mib_per_step"]
    assert ratio > 2, f"3-bit saved only {ratio:.2f}x less activation memory"
    assert comp["saved_ratio_vs_unpatched"] == pytest.approx(ratio, rel=1e-6)
    own = _run(tmp_path, "own", *_fmnist_args(fmnist_dir, *TINY_RESNET, "--act-compress", "--act-bits", "3",
                                              "--act-no-share-bn-relu"))
    assert comp["act_share_bn_relu"] is True and own["act_share_bn_relu"] is False
    assert comp["act_data_bits"] == 8 and base["act_data_bits"] is None
    assert own["saved_mib_per_step"] > comp["saved_mib_per_step"]  # each conv after BN + ReLU packs its input
    packed = _run(tmp_path, "packed", *_fmnist_args(fmnist_dir, *TINY_RESNET, "--act-compress", "--act-bits", "3",
                                                    "--act-no-share-residual"))
    assert comp["act_share_residual"] is True and packed["act_share_residual"] is False
    assert packed["saved_mib_per_step"] > comp["saved_mib_per_step"]  # each block's input packed again


def test_fashion_mnist_swin_compressed(tmp_path, fmnist_dir):
    comp = _run(tmp_path, "swin", *_fmnist_args(fmnist_dir, *TINY_SWIN, "--act-compress", "--act-bits", "3",
                                                "--act-group-size", "128", "--amp", "bf16"))
    _check_results(comp, steps=5)
    assert comp["img_size"] == 32 and comp["amp"] == "bf16" and comp["act_group_size"] == 128
    assert comp["saved_ratio_vs_unpatched"] > 2


def _image_folder(root: Path, classes=("cat", "dog"), per_split=(4, 2)) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in zip(("train", "val"), per_split):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, size=(40, 48, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / c / f"{i}.png")
    return root


def test_image_folder_run(tmp_path):
    data = _image_folder(tmp_path / "images")
    results = _run(tmp_path, "if", "--data-dir", str(data), *TINY_SWIN, "--img-size", "32", "--batch-size", "4",
                   "--steps", "2", "--workers", "0", "--amp", "none", "--log-interval", "1")
    _check_results(results, steps=2)
    assert results["dataset"] == "imagefolder" and results["img_size"] == 32
    assert results["history"][-1]["num_val"] == 4


def test_adaptive_bits_train_on_an_image_folder(tmp_path):
    """A fractional --act-bits budget trains with the allocator, re-allocating every --act-adapt-interval steps."""
    data = _image_folder(tmp_path / "images")
    results = _run(tmp_path, "adaptive", "--data-dir", str(data), *TINY_SWIN, "--img-size", "32", "--batch-size",
                   "4", "--steps", "3", "--workers", "0", "--amp", "none", "--log-interval", "1", "--act-compress",
                   "--act-bits", "2.5", "--act-adapt-interval", "2")
    _check_results(results, steps=3)
    assert results["act_bits"] == 2.5 and 2.0 <= results["act_avg_bits"] <= 2.5
    assert results["act_variance_ratio"] is not None and results["act_adapt_overhead"] > 0


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        train_timm.main(["--help"])
    assert exc.value.code == 0
    assert "--act-compress" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        train_timm.main(["--dataset", "imagefolder"])
    assert exc.value.code == 2
    assert "--data-dir is required" in capsys.readouterr().err
