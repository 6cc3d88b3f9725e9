"""Train a timm model with or without act_hf's compressed activation memory.

The defaults are the Swin-T recipe of the ActNN/GACT papers (``swin_tiny_patch4_window7_224``, AdamW with
lr 1e-3 at batch 1024 scaled linearly with the batch size, weight decay 0.05, linear warmup then cosine decay,
label smoothing 0.1, gradient clipping 5.0, drop path 0.2, 224x224 input, bf16 autocast). Data is an
ImageFolder directory (``--data-dir`` with ``train/`` and ``val/``) or Fashion-MNIST from the Debian package
``dataset-fashion-mnist`` (``--dataset fashion-mnist``)::

    python vision_scripts/train_timm.py --data-dir /data/imagenet --act-compress --act-bits 3
    python vision_scripts/train_timm.py --dataset fashion-mnist --model resnet18 --epochs 2 --lr 1e-3 \\
        --act-compress --act-bits 2 --output-dir runs/fmnist-2bit

The saved activation memory of one training step is measured with :func:`act_hf.track_saved` on the first
step; with ``--act-compress`` the unpatched model is measured on the same batch too, so one run gives both
numbers. ``--output-dir`` receives ``results.json``.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import logging
import math
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

import act_hf

__all__ = ["build_parser", "find_fashion_mnist", "load_fashion_mnist", "main", "read_idx"]

logger = logging.getLogger("train_timm")

DEFAULT_MODEL = "swin_tiny_patch4_window7_224"
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_DEFAULT_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530
#: The Swin papers' learning rate is 1e-3 at a total batch of 1024, scaled linearly with the batch size.
BASE_LR, BASE_BATCH = 1e-3, 1024

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


# ---------------------------------------------------------------------------------------------------- data


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (the MNIST / Fashion-MNIST format), gzip-compressed or raw.

    The header is two zero bytes, a type code (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32,
    0x0E float64), the number of dimensions, then each dimension as a big-endian uint32; the data follow in
    C order, big-endian.

    Args:
        path: the file; gzip compression is recognised by its magic bytes, not by the name.

    Returns:
        An array of the header's shape, in native byte order.

    Raises:
        ValueError: the file is not an IDX file, or its size does not match its header.
    """
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (header {raw[:4].hex()})")
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(f"{path}: {len(raw)} bytes, but the header {shape} of {dtype} needs {expected}")
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="), copy=True)


def _has_fashion_mnist(folder: Path) -> bool:
    return all(_idx_file(folder, name) is not None for pair in FASHION_MNIST_FILES.values() for name in pair)


def _idx_file(folder: Path, stem: str) -> Path | None:
    for name in (f"{stem}.gz", stem):
        if (folder / name).is_file():
            return folder / name
    return None


def _dpkg_dir() -> Path | None:
    try:
        listing = subprocess.run(["dpkg", "-L", FASHION_MNIST_PACKAGE], check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in listing.stdout.splitlines():
        if Path(line).name.startswith(FASHION_MNIST_FILES["train"][0]):
            return Path(line).parent
    return None


def find_fashion_mnist(path: str | os.PathLike | None = None) -> Path:
    """Locate the Fashion-MNIST IDX files.

    Looks, in order, at ``path``, ``$ACT_HF_FASHION_MNIST_DIR``, where ``dpkg -L dataset-fashion-mnist`` puts
    them, and ``/usr/share/datasets/fashion-mnist``.

    Args:
        path: a folder holding ``train-images-idx3-ubyte[.gz]`` and the three other files.

    Returns:
        The first folder that holds all four files.

    Raises:
        FileNotFoundError: none does; the message says how to install the Debian package.
    """
    candidates: list[Path] = []
    if path is not None:
        candidates.append(Path(path))
    if os.environ.get("ACT_HF_FASHION_MNIST_DIR"):
        candidates.append(Path(os.environ["ACT_HF_FASHION_MNIST_DIR"]))
    dpkg = _dpkg_dir()
    if dpkg is not None:
        candidates.append(dpkg)
    candidates.append(FASHION_MNIST_DEFAULT_DIR)
    for folder in candidates:
        if _has_fashion_mnist(folder):
            return folder
    raise FileNotFoundError(
        f"Fashion-MNIST IDX files not found in {[str(c) for c in candidates]}; install them with "
        f"`apt-get install -y {FASHION_MNIST_PACKAGE}` or set ACT_HF_FASHION_MNIST_DIR"
    )


def load_fashion_mnist(split: str, path: str | os.PathLike | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST images and labels.

    Args:
        split: ``"train"`` (60000 images) or ``"val"`` (the 10000 test images).
        path: the folder of the IDX files (see :func:`find_fashion_mnist`).

    Returns:
        ``(images, labels)``: uint8 ``[N, 28, 28]`` and int64 ``[N]`` with values 0..9.

    Raises:
        ValueError: an unknown ``split``, or images and labels of different lengths.
        FileNotFoundError: the files are not installed.
    """
    if split not in FASHION_MNIST_FILES:
        raise ValueError(f"split must be one of {list(FASHION_MNIST_FILES)}, got {split!r}")
    folder = find_fashion_mnist(path)
    images_name, labels_name = FASHION_MNIST_FILES[split]
    images = torch.from_numpy(read_idx(_idx_file(folder, images_name)))
    labels = torch.from_numpy(read_idx(_idx_file(folder, labels_name)).astype(np.int64))
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(f"{folder}: {split} images {tuple(images.shape)} do not match labels {tuple(labels.shape)}")
    return images, labels


def _subset(dataset: Dataset, num: int | None, seed: int) -> Dataset:
    if num is None or num >= len(dataset):
        return dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:num]
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(t[order] for t in dataset.tensors))
    return Subset(dataset, order.tolist())


class _FashionMNISTBatch:
    """Turns a uint8 ``[B, 28, 28]`` batch into a normalized float ``[B, C, S, S]`` batch on the device."""

    def __init__(self, img_size: int, in_chans: int, *, train: bool) -> None:
        self.img_size, self.in_chans, self.train = img_size, in_chans, train

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float().div_(255).sub_(FASHION_MNIST_MEAN).div_(FASHION_MNIST_STD).unsqueeze(1)
        if self.train:
            flip = torch.rand(x.shape[0], device=x.device) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        if x.shape[-1] != self.img_size:
            x = F.interpolate(x, size=(self.img_size, self.img_size), mode="bilinear", align_corners=False)
        return x.expand(-1, self.in_chans, -1, -1).contiguous()


def build_data(args: argparse.Namespace, model: nn.Module, in_chans: int, img_size: int | None):
    """The train and val loaders, the per-batch transforms (applied on the device) and the image size."""
    g = torch.Generator().manual_seed(args.seed)
    if args.dataset == "fashion-mnist":
        size = img_size or 28
        train = TensorDataset(*load_fashion_mnist("train", args.fashion_mnist_dir))
        val = TensorDataset(*load_fashion_mnist("val", args.fashion_mnist_dir))
        train, val = _subset(train, args.num_train, args.seed), _subset(val, args.num_val, args.seed + 1)
        kw = {"num_workers": 0}
        batch_tf = (_FashionMNISTBatch(size, in_chans, train=True), _FashionMNISTBatch(size, in_chans, train=False))
    else:
        from timm.data import create_transform, resolve_data_config
        from torchvision.datasets import ImageFolder

        overrides = {"input_size": (in_chans, img_size, img_size)} if img_size else {}
        cfg = resolve_data_config(overrides, model=model)
        size = cfg["input_size"][-1]
        train_tf = create_transform(**cfg, is_training=True, auto_augment=args.aa or None, re_prob=args.reprob)
        val_tf = create_transform(**cfg, is_training=False)
        root = Path(args.data_dir)
        train, val = ImageFolder(root / "train", transform=train_tf), ImageFolder(root / "val", transform=val_tf)
        if train.classes != val.classes:
            raise ValueError(f"{root}: train/ and val/ have different classes ({len(train.classes)} vs "
                             f"{len(val.classes)})")
        train, val = _subset(train, args.num_train, args.seed), _subset(val, args.num_val, args.seed + 1)
        kw = {"num_workers": args.workers, "persistent_workers": False}
        batch_tf = (None, None)
    pin = args.device.startswith("cuda")
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=len(train) > args.batch_size,
                              generator=g, pin_memory=pin, **kw)
    val_loader = DataLoader(val, batch_size=args.eval_batch_size or args.batch_size, shuffle=False, pin_memory=pin,
                            **kw)
    return train_loader, val_loader, batch_tf, size


def _num_classes(args: argparse.Namespace) -> int:
    if args.dataset == "fashion-mnist":
        return 10
    return len([p for p in (Path(args.data_dir) / "train").iterdir() if p.is_dir()])


# ---------------------------------------------------------------------------------------------------- model


def build_model(args: argparse.Namespace, num_classes: int) -> tuple[nn.Module, int | None]:
    """``timm.create_model`` with ``--model-kwargs``; ``img_size`` is passed when the model accepts it.

    Returns:
        The model and the image size asked for (``None``: the model's default).
    """
    import timm

    kwargs = dict(args.model_kwargs)
    kwargs.setdefault("num_classes", num_classes)
    if args.drop_path is not None:
        kwargs.setdefault("drop_path_rate", args.drop_path)
    img_size = args.img_size if args.img_size is not None else (32 if args.dataset == "fashion-mnist" else None)
    if "img_size" in kwargs:
        img_size = kwargs["img_size"]
    if img_size is not None and "img_size" not in kwargs:
        try:  # vit / swin / ... take img_size; convolutional nets take any size and reject the argument
            return timm.create_model(args.model, pretrained=args.pretrained, img_size=img_size, **kwargs), img_size
        except TypeError as exc:
            if "img_size" not in str(exc):
                raise
    return timm.create_model(args.model, pretrained=args.pretrained, **kwargs), img_size


def _in_chans(model: nn.Module, kwargs: dict) -> int:
    if "in_chans" in kwargs:
        return int(kwargs["in_chans"])
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return int(cfg.get("input_size", (3,))[0])


def lr_lambda(total: int, warmup: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup from ~0 over ``warmup`` steps, then cosine decay to ``min_ratio`` of the peak."""

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return fn


# ---------------------------------------------------------------------------------------------------- training


def _autocast(device: torch.device, amp: str):
    if amp == "none":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_saved(model: nn.Module, x: torch.Tensor, y: torch.Tensor, criterion: nn.Module, autocast) -> dict:
    """Saved activation bytes of one training-mode forward and loss on ``model``, leaving every RNG untouched."""
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), autocast, act_hf.track_saved(model) as saved:
        loss = criterion(model(x), y)
    del loss
    return {"mib": saved.bytes / 2**20, "context_ratio": saved.ratio, "num_tensors": saved.num_tensors}


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, batch_tf, device: torch.device, autocast) -> dict:
    """Top-1 accuracy and mean cross-entropy on ``loader``."""
    model.eval()
    correct = total = 0
    loss_sum = 0.0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if batch_tf is not None:
            x = batch_tf(x)
        with autocast:
            logits = model(x)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        total += y.numel()
    model.train()
    return {"val_accuracy": correct / max(1, total), "val_loss": loss_sum / max(1, total), "num_val": total}


def _versions() -> dict:
    import timm

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True,
                                timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"python": platform.python_version(), "torch": torch.__version__, "timm": timm.__version__,
            "act_hf": act_hf.__version__, "numpy": np.__version__, "commit": commit}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _bits(value: str) -> int | float:
    number = float(value)
    return int(number) if number.is_integer() else number


def _data_bits(value: str) -> int | None:
    if value.lower() == "none":
        return None
    if value not in {str(b) for b in range(1, 9)}:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to 8, or 'none', got {value!r}")
    return int(value)


def _json_dict(value: str) -> dict:
    try:
        out = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {value!r}") from None
    if not isinstance(out, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (``--help`` lists them with their defaults)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--dataset", choices=["imagefolder", "fashion-mnist"], default="imagefolder",
                   help="ImageFolder directory (--data-dir) or Fashion-MNIST from the Debian package "
                        f"{FASHION_MNIST_PACKAGE} (default: %(default)s)")
    d.add_argument("--data-dir", help="ImageFolder root with train/ and val/ sub-folders")
    d.add_argument("--fashion-mnist-dir", help="folder of the Fashion-MNIST IDX files (default: "
                   f"$ACT_HF_FASHION_MNIST_DIR, then dpkg -L {FASHION_MNIST_PACKAGE}, then {FASHION_MNIST_DEFAULT_DIR})")
    d.add_argument("--img-size", type=int, help="input resolution (default: the model's; 32 for fashion-mnist, "
                   "passed to timm as img_size for models that take it)")
    d.add_argument("--num-train", type=int, help="train on a random subset of this many images")
    d.add_argument("--num-val", type=int, help="evaluate on a random subset of this many images")
    d.add_argument("--workers", type=int, default=4, help="ImageFolder loader workers (default: %(default)s)")
    d.add_argument("--aa", default="rand-m9-mstd0.5-inc1",
                   help="ImageFolder RandAugment policy, '' for none (default: %(default)s)")
    d.add_argument("--reprob", type=float, default=0.25, help="ImageFolder random-erase probability "
                   "(default: %(default)s)")
    m = p.add_argument_group("model")
    m.add_argument("--model", default=DEFAULT_MODEL, help="timm model name (default: %(default)s)")
    m.add_argument("--pretrained", action="store_true", help="load timm's pretrained weights (needs them cached)")
    m.add_argument("--model-kwargs", type=_json_dict, default={}, metavar="JSON",
                   help='extra timm.create_model arguments, e.g. \'{"img_size": 32, "window_size": 4, '
                        '"embed_dim": 48, "depths": [2, 2], "num_heads": [3, 6]}\'')
    m.add_argument("--drop-path", type=float, default=0.2, help="stochastic depth rate (default: %(default)s)")
    o = p.add_argument_group("optimization")
    o.add_argument("--epochs", type=int, default=300, help="(default: %(default)s)")
    o.add_argument("--steps", type=int, help="stop after this many optimizer steps (the schedule spans them)")
    o.add_argument("--batch-size", type=int, default=128, help="(default: %(default)s)")
    o.add_argument("--eval-batch-size", type=int, help="(default: --batch-size)")
    o.add_argument("--lr", type=float, help=f"peak learning rate (default: {BASE_LR:g} x batch / {BASE_BATCH})")
    o.add_argument("--min-lr-ratio", type=float, default=0.01, help="cosine floor as a fraction of the peak "
                   "(default: %(default)s)")
    o.add_argument("--weight-decay", type=float, default=0.05, help="(default: %(default)s)")
    o.add_argument("--warmup-steps", type=int, help="linear warmup steps (default: 20/300 of the total)")
    o.add_argument("--smoothing", type=float, default=0.1, help="label smoothing (default: %(default)s)")
    o.add_argument("--clip-grad", type=float, default=5.0, help="gradient norm clip, 0 for none "
                   "(default: %(default)s)")
    o.add_argument("--amp", choices=["none", "bf16", "fp16"], default="bf16",
                   help="autocast dtype; fp16 uses a GradScaler on CUDA and falls back to bf16 on CPU "
                        "(default: %(default)s)")
    a = p.add_argument_group("act_hf")
    a.add_argument("--act-compress", action="store_true", help="patch the model with act_hf.patch")
    a.add_argument("--act-bits", type=_bits, default=3, help="bits per activation: an int 1..8 (a fraction such "
                   "as 2.5 asks for adaptive bits) (default: %(default)s)")
    a.add_argument("--act-group-size", type=int, help="quantization group size (default: act_hf's)")
    a.add_argument("--act-adaptive", action="store_true", help="adaptive bits: --act-bits is the average budget "
                   "(a fractional --act-bits such as 2.5 implies it)")
    a.add_argument("--act-adapt-interval", type=int, help="steps between adaptive re-allocations of a fractional "
                   "--act-bits budget (default: act_hf's)")
    a.add_argument("--act-swap", action="store_true", help="keep the packed activations in pinned host memory "
                   "until backward (GPU)")
    a.add_argument("--act-data-bits", type=_data_bits, default=8, help="fewest bits of the image batch a stem conv "
                   "packs, 1..8, or 'none' for --act-bits (ActConfig.data_bits) (default: %(default)s)")
    a.add_argument("--act-no-share-bn-relu", dest="act_share_bn_relu", action="store_false",
                   help="a conv after BatchNorm + ReLU packs its own input instead of reading BatchNorm's")
    a.add_argument("--act-no-share-residual", dest="act_share_residual", action="store_false",
                   help="a conv after a residual block's ReLU(BatchNorm + shortcut) packs its own input")
    r = p.add_argument_group("run")
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(default: %(default)s)")
    r.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    r.add_argument("--log-interval", type=int, default=50, help="steps between log lines (default: %(default)s)")
    r.add_argument("--output-dir", help="write results.json here")
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.dataset == "imagefolder":
        if not args.data_dir:
            p.error("--data-dir is required with --dataset imagefolder (or use --dataset fashion-mnist)")
        for split in ("train", "val"):
            if not (Path(args.data_dir) / split).is_dir():
                p.error(f"--data-dir {args.data_dir} has no {split}/ sub-folder")
    for name in ("epochs", "batch_size", "steps", "log_interval", "num_train", "num_val", "eval_batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        p.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")


def main(argv: list[str] | None = None) -> dict:
    """Train and evaluate; the command-line entry point.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The results also written to ``--output-dir/results.json``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    device = torch.device(args.device)
    amp = args.amp
    if amp == "fp16" and device.type != "cuda":
        logger.warning("--amp fp16 on %s: using bf16 instead (fp16 autocast needs a GPU)", device.type)
        amp = "bf16"

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    act_hf.manual_seed(args.seed)

    model, img_size = build_model(args, _num_classes(args))
    model.to(device).train()
    base_model = copy.deepcopy(model) if args.act_compress else None  # measured once, on the first batch
    if args.act_compress:
        overrides = {} if args.act_group_size is None else {"group_size": args.act_group_size}
        if args.act_adapt_interval is not None:
            overrides["adapt_interval"] = args.act_adapt_interval
        if args.act_swap:
            overrides["swap"] = True
        if not args.act_share_bn_relu:
            overrides["share_bn_relu"] = False
        if not args.act_share_residual:
            overrides["share_residual"] = False
        overrides["data_bits"] = args.act_data_bits
        bits = float(args.act_bits) if args.act_adaptive else args.act_bits  # a float is an adaptive budget
        act_hf.patch(model, bits=bits, **overrides)
    allocator = getattr(model, "act_hf_allocator", None)  # adaptive bits: a fractional --act-bits budget
    if allocator is not None:
        allocator.automatic = False  # the loop below updates it with the labels the model's output lacks
    in_chans = _in_chans(model, args.model_kwargs)
    train_loader, val_loader, (train_tf, val_tf), img_size = build_data(args, model, in_chans, img_size)

    steps_per_epoch = len(train_loader)
    total = steps_per_epoch * args.epochs if args.steps is None else min(args.steps, steps_per_epoch * args.epochs)
    lr = args.lr if args.lr is not None else BASE_LR * args.batch_size / BASE_BATCH
    warmup = args.warmup_steps if args.warmup_steps is not None else round(total * 20 / 300)
    from timm.optim import create_optimizer_v2

    optimizer = create_optimizer_v2(model, "adamw", lr=lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total, warmup, args.min_lr_ratio))
    criterion = nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == "fp16")
    autocast = _autocast(device, amp)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model %s (%.2fM params, %s), %s %dx%d, %d train / %d val images, %d steps (%d per epoch), "
                "lr %.3g, warmup %d, amp %s, act_hf %s", args.model, n_params / 1e6, device, args.dataset, img_size,
                img_size, len(train_loader.dataset), len(val_loader.dataset), total, steps_per_epoch, lr, warmup, amp,
                f"{args.act_bits}-bit" if args.act_compress else "off")

    saved: dict[str, Any] = {}
    losses: list[float] = []
    history: list[dict] = []
    step, timed_samples, timed_s = 0, 0, 0.0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    val: dict = {}
    epoch = 0
    t_run = time.perf_counter()
    while step < total:
        epoch += 1
        epoch_losses: list[float] = []
        t_log, log_losses = time.perf_counter(), []
        for x, y in train_loader:
            if step >= total:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if train_tf is not None:
                x = train_tf(x)
            if allocator is not None and step % allocator.config.adapt_interval == 0:
                with autocast:  # re-allocate the adaptive bits budget from this batch (timed apart from steps)
                    allocator.update_batch((x, y), lambda b: criterion(model(b[0]), b[1]))
            _sync(device)
            t0 = time.perf_counter()
            if step == 0:
                if base_model is not None:
                    saved["unpatched"] = measure_saved(base_model, x, y, criterion, autocast)
                    del base_model
                    base_model = None
                with autocast, act_hf.track_saved(model) as tracker:
                    loss = criterion(model(x), y)
                saved["model"] = {"mib": tracker.bytes / 2**20, "context_ratio": tracker.ratio,
                                  "num_tensors": tracker.num_tensors}
                saved.setdefault("unpatched", saved["model"])
            else:
                with autocast:
                    loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if args.clip_grad:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_value = loss.item()  # synchronises
            if step > 0 or total == 1:
                timed_s += time.perf_counter() - t0
                timed_samples += x.shape[0]
            step += 1
            losses.append(loss_value)
            epoch_losses.append(loss_value)
            log_losses.append(loss_value)
            if step % args.log_interval == 0 or step == total:
                dt = time.perf_counter() - t_log
                logger.info("epoch %d step %d/%d  loss %.4f  lr %.3g  %.1f samples/s", epoch, step, total,
                            sum(log_losses) / len(log_losses), scheduler.get_last_lr()[0],
                            len(log_losses) * x.shape[0] / max(dt, 1e-9))
                t_log, log_losses = time.perf_counter(), []
        val = evaluate(model, val_loader, val_tf, device, autocast)
        history.append({"epoch": epoch, "step": step, "train_loss": sum(epoch_losses) / max(1, len(epoch_losses)),
                        **val})
        logger.info("epoch %d done: train loss %.4f  val acc %.2f%%  val loss %.4f  (%.0fs)", epoch,
                    history[-1]["train_loss"], 100 * val["val_accuracy"], val["val_loss"],
                    time.perf_counter() - t_run)

    batch = train_loader.batch_size
    tail = losses[-min(len(losses), args.log_interval):]
    results = {
        "model": args.model,
        "model_kwargs": args.model_kwargs,
        "dataset": args.dataset,
        "img_size": img_size,
        "num_params": n_params,
        "act_compress": args.act_compress,
        "act_bits": args.act_bits if args.act_compress else None,
        "act_group_size": (getattr(model, "act_hf_config", None).group_size if args.act_compress else None),
        "act_share_bn_relu": model.act_hf_config.share_bn_relu if args.act_compress else None,
        "act_share_residual": model.act_hf_config.share_residual if args.act_compress else None,
        "act_data_bits": model.act_hf_config.data_bits if args.act_compress else None,
        "act_avg_bits": allocator.average_bits() if allocator is not None else None,
        "act_variance_ratio": allocator.variance_ratio if allocator is not None else None,
        "act_adapt_overhead": allocator.overhead if allocator is not None else None,
        "amp": amp,
        "batch_size": batch,
        "lr": lr,
        "steps": step,
        "epochs": epoch,
        "final_train_loss": sum(tail) / len(tail),
        "last_step_loss": losses[-1],
        "val_accuracy": val["val_accuracy"],
        "val_loss": val["val_loss"],
        "saved_mib_per_step": saved["model"]["mib"],
        "saved_mib_per_sample": saved["model"]["mib"] / batch,
        "saved_mib_per_step_unpatched": saved["unpatched"]["mib"],
        "saved_ratio_vs_unpatched": saved["unpatched"]["mib"] / saved["model"]["mib"] if saved["model"]["mib"]
        else 1.0,
        "saved_context_ratio": saved["model"]["context_ratio"],
        "samples_per_s": timed_samples / timed_s if timed_s else None,
        "peak_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "wall_s": time.perf_counter() - t_run,
        "device": _device_name(device),
        "versions": _versions(),
        "history": history,
        "args": dict(vars(args)),
    }
    logger.info("saved activations %.2f MiB/step (unpatched %.2f MiB, %.1fx); val acc %.2f%%; %.1f samples/s",
                results["saved_mib_per_step"], results["saved_mib_per_step_unpatched"],
                results["saved_ratio_vs_unpatched"], 100 * results["val_accuracy"], results["samples_per_s"] or 0.0)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        logger.info("wrote %s", out / "results.json")
    return results


if __name__ == "__main__":
    main()
