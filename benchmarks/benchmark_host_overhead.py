"""Host (Python and dispatch) overhead of a patched training step, measurable without a GPU.

On the H200 a patched bert-large step at batch 32 was bound by host work, not by the GPU (measurement log,
``benchmarks/results/README.md``, "First GPU run").
This benchmark isolates that work on any machine: a tiny BERT (hidden 32, batch 8 x seq 16, one thread), so that
the arithmetic is negligible, trained under bf16 autocast unpatched and patched. With ``--stub-codec`` the codec's
CPU implementations (quantize+pack, also of a BatchNorm's normalized input, unpack+dequantize, its affine form and its
per-channel form into a tensor (of one packed tensor or a chain of them), the bit packers of masks, few-bit codes'
encode+pack and their decode times the gradient, channel scaling's shifts) are replaced by stand-ins that return
tensors of the right shapes and dtypes without computing anything, as a GPU kernel launch would cost next to
nothing on the host; what remains is act_hf's own work per op. The stand-ins make the gradients meaningless: this
measures time only. The time spent inside each act_hf op (its autograd Function's forward and backward, aten
calls included) is listed per call, from one more timed run with each Function wrapped.

It also counts the device ops of one step, the number a GPU would launch: every aten op that is not a view or an
allocation (``empty`` and its kin launch nothing; counted apart, as allocations), and each codec call once
(counted under a dispatch mode, where the codec runs as its ``torch.ops.act_hf`` op), and among them the host
syncs (``.item()``-like reads), and the bytes those ops read and write (their tensor inputs and outputs; by op
too): the GPU time of memory-bound ops, most of what act_hf adds, follows that traffic. CPU paths differ from CUDA
ones in places (CPU dropout is composite; CPU autocast leaves LayerNorm in its input dtype), so the counts are a
proxy for the GPU's launches and traffic. The default batch of 8 x 16 tokens gives the 64 rows from
which hidden states are channel scaled, as in every real model.

    python benchmarks/benchmark_host_overhead.py --stub-codec            # ms per step, best of 3 x 40 steps
    python benchmarks/benchmark_host_overhead.py --stub-codec --fp32     # the same in fp32: no CPU bf16 matmuls
    python benchmarks/benchmark_host_overhead.py --device cuda           # on a GPU: the host work there, per op
    python benchmarks/benchmark_host_overhead.py --stub-codec --hidden 256 --seq 128 --layers 2 --steps 3
                                                                         # traffic at wider, longer shapes
    python benchmarks/benchmark_host_overhead.py --stub-codec --timm resnet50 --batch 4 --steps 1
                                                                         # a timm model instead (96 px images)
    python benchmarks/benchmark_host_overhead.py --stub-codec --timm swin_tiny_patch4_window7_224 --image-size 224 \
        --batch 8 --steps 1 --attention-chunk-elements 524288     # swin-tiny's attention chunks of batch 256
    python benchmarks/benchmark_host_overhead.py --stub-codec --settings unpatched bits3 bits3:linear \
        bits3:attention bits3:norm bits3:dropout bits3:activation      # what each kind of module adds alone
    python benchmarks/benchmark_host_overhead.py --timm resnet50 --image-size 224 --batch 8 --steps 1 \
        --slice-elements 2097152 --slicing never     # batch 256's slices on a GPU (always) or the whole batch

A setting ``bitsN:KIND[+KIND...]`` patches only those kinds (``ActConfig.kinds``, of ``act_hf.config.ACT_KINDS``).

Writes ``host_overhead.json`` and ``host_overhead.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

import act_hf
from act_hf._chunks import SLICING_MODES
from act_hf.compress import reference
from act_hf.config import ACT_KINDS
from act_hf.ops import attention
from act_hf.ops import linear as linear_ops
from act_hf.ops import norm as norm_ops

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_saved_memory import _meta, pyplot


def _stub_quantize_pack(x, bits, group_size, seed, chunk=None, shifts=None):
    n, groups = x.numel(), -(-x.numel() // group_size)
    return (torch.zeros(-(-n * bits // 8), dtype=torch.uint8), torch.zeros(groups, dtype=torch.int16),
            torch.zeros(groups, dtype=torch.int16))


def _stub_quantize_pack_normalized(x, mean, invstd, inner, bits, group_size, seed, chunk=None):
    return _stub_quantize_pack(x, bits, group_size, seed)


def _stub_unpack_dequantize(payload, lo, scale, bits, group_size, numel, dtype, chunk=None):
    return torch.zeros(numel, dtype=dtype)


def _stub_unpack_dequantize_affine(payload, lo, scale, bits, group_size, numel, mult, shift, divisor=None,
                                   chunk=None):
    return torch.zeros(numel, dtype=torch.float32)


def _stub_unpack_dequantize_chain(out, payloads, los, scales, weights, biases, masks, bits, group_size, numel, start,
                                  inner, accumulate, chunk=None):
    return None


def _stub_pack_bits(codes, bits, chunk=None):
    return torch.zeros(-(-codes.numel() * bits // 8), dtype=torch.uint8)


def _stub_unpack_bits(payload, bits, numel, chunk=None):
    return torch.zeros(numel, dtype=torch.uint8)


def _stub_fewbit_encode_pack(x, bounds, bits, chunk=None):
    return torch.zeros(-(-x.numel() * bits // 8), dtype=torch.uint8)


def _stub_fewbit_grad(grad, payload, values, bits, chunk=None):
    return torch.zeros_like(grad)


def _stub_channel_shifts(x, max_shift):
    return torch.zeros(x.shape[-1], dtype=torch.int32)


#: the CPU kernels ``--stub-codec`` replaces (``act_hf.compress.reference`` attributes) and their stand-ins
STUBS = {"quantize_pack_chunked": _stub_quantize_pack, "quantize_pack_normalized": _stub_quantize_pack_normalized,
         "unpack_dequantize_chunked": _stub_unpack_dequantize,
         "unpack_dequantize_affine": _stub_unpack_dequantize_affine,
         "unpack_dequantize_chain": _stub_unpack_dequantize_chain,
         "pack_bits_chunked": _stub_pack_bits, "unpack_bits_chunked": _stub_unpack_bits,
         "fewbit_encode_pack_chunked": _stub_fewbit_encode_pack, "fewbit_grad_chunked": _stub_fewbit_grad,
         "channel_shifts": _stub_channel_shifts}


def parse_setting(name: str) -> tuple[int, tuple[str, ...] | None]:
    """``bitsN`` -> ``(N, None)``; ``bitsN:KIND+KIND`` -> ``(N, (KIND, KIND))``, those kinds alone patched.

    Raises:
        ValueError: ``name`` is neither, N is outside 1..8, or a kind is not one of ``act_hf.config.ACT_KINDS``.
    """
    width, colon, kinds = name.partition(":")
    digits = width.removeprefix("bits")
    if not width.startswith("bits") or not digits.isdigit() or not 1 <= int(digits) <= 8 or (colon and not kinds):
        raise ValueError(f"--settings: unknown setting {name!r}; allowed: unpatched, bitsN (N 1..8), "
                         f"bitsN:KIND[+KIND...] (KIND one of {', '.join(ACT_KINDS)})")
    if not kinds:
        return int(digits), None
    unknown = [k for k in kinds.split("+") if k not in ACT_KINDS]
    if unknown:
        raise ValueError(f"--settings: {name!r} names unknown kinds {unknown}; allowed: "
                         f"{', '.join(ACT_KINDS)}")
    return int(digits), tuple(kinds.split("+"))


def act_functions() -> list[type]:
    """act_hf's autograd Functions (those defined in ``act_hf.ops``)."""
    import act_hf.ops  # noqa: F401  (imports every op module)

    found, todo = [], list(torch.autograd.Function.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("act_hf.ops.") and "forward" in cls.__dict__ and "backward" in cls.__dict__:
            found.append(cls)
    return sorted(found, key=lambda c: c.__name__)


def time_functions(run, steps: int) -> list[dict]:
    """Run ``run()`` (``steps`` training steps) with the forward and backward of each of :func:`act_functions`
    timed: ``[{"op", "calls_per_step", "us_per_call", "ms_per_step"}]``, the most time first. Each Function is
    put back as it was."""
    totals: dict[str, list] = {}
    saved = []

    def timed(fn, name):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = totals.setdefault(name, [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - start
        return wrapper

    for cls in act_functions():
        for kind in ("forward", "backward"):
            raw = cls.__dict__[kind]
            saved.append((cls, kind, raw))
            setattr(cls, kind, staticmethod(timed(raw.__func__ if isinstance(raw, staticmethod) else raw,
                                                  f"{cls.__name__}.{kind}")))
    try:
        run()
    finally:
        for cls, kind, raw in saved:
            setattr(cls, kind, raw)
    rows = [{"op": name, "calls_per_step": calls / steps, "us_per_call": total / calls * 1e6,
             "ms_per_step": total / steps * 1e3} for name, (calls, total) in totals.items()]
    return sorted(rows, key=lambda r: -r["ms_per_step"])


_VIEWS = frozenset({"view", "_unsafe_view", "as_strided", "reshape", "expand", "t", "transpose", "permute", "slice",
                    "select", "unsqueeze", "squeeze", "detach", "alias", "split", "unbind", "lift_fresh"})
_SYNCS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "equal"})
#: ops that only allocate (the caching allocator on a GPU): no kernel, nothing read or written
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"})


def count_ops(step) -> tuple[int, int, int, int, dict[str, int], dict[str, int]]:
    """``(device ops, allocations, host syncs, bytes moved, device ops by name, bytes moved by name)`` that one
    call of ``step`` dispatches: aten ops other than views and allocations (``empty`` and its kin, which launch
    nothing and move nothing: counted apart), the codec's ``act_hf`` ops once each, and the bytes of those ops'
    tensor inputs and outputs (what a GPU reads and writes for them: the time of the memory-bound ones, most of
    act_hf's, follows it). A zero-stride input (an expanded stand-in whose values are never read) counts its
    elements all the same."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    counts = [0, 0, 0]  # host syncs, bytes moved, allocations
    by_name: Counter[str] = Counter()
    bytes_by_name: Counter[str] = Counter()

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in _ALLOCATIONS:
                counts[2] += 1
            elif name not in _VIEWS:
                counts[0] += name in _SYNCS
                by_name[name] += 1
                tensors = {id(t): t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)}
                moved = sum(t.numel() * t.element_size() for t in tensors.values())  # an out= tensor once
                counts[1] += moved
                bytes_by_name[name] += moved
            return out

    with _Count():
        step()
    return sum(by_name.values()), counts[2], counts[0], counts[1], dict(by_name), dict(bytes_by_name)


def added_ops(rows: list[dict], top: int = 15, key: str = "ops_by_name") -> list[dict]:
    """What each patched row's ops make beyond the unpatched one's, by op name, most added first: ``[{"op",
    "unpatched", <setting>..., }]`` of ``key`` (``"ops_by_name"``: device ops; ``"mb_by_name"``: MB moved) for the
    ``top`` ops whose figure changed most in any patched row (an op a patched step runs less shows a negative
    difference)."""
    base = next((r[key] for r in rows if r["setting"] == "unpatched"), None)
    patched = [r for r in rows if r["setting"] != "unpatched"]
    if base is None or not patched:
        return []
    names = set(base).union(*(r[key] for r in patched))
    change = {n: max(abs(r[key].get(n, 0) - base.get(n, 0)) for r in patched) for n in names}
    chosen = sorted((n for n in names if change[n]), key=lambda n: (-change[n], n))[:top]
    return [{"op": n, "unpatched": base.get(n, 0)} | {r["setting"]: r[key].get(n, 0) for r in patched}
            for n in chosen]


def _fallback_model(name: str, layers: int, hidden: int, seq: int):
    """A tiny HF seq2seq model act_hf has no family for (patched through its fallback: hooks and function mode):
    ``layers // 2`` encoder and decoder layers (at least one), ``hidden`` wide, 2 heads, MLPs 2x wider."""
    import transformers as tf

    common = {"vocab_size": 100, "d_model": hidden, "encoder_layers": max(1, layers // 2),
              "decoder_layers": max(1, layers // 2), "encoder_attention_heads": 2, "decoder_attention_heads": 2,
              "encoder_ffn_dim": 2 * hidden, "decoder_ffn_dim": 2 * hidden, "dropout": 0.0, "attention_dropout": 0.0}
    if name == "bart":
        return tf.BartForConditionalGeneration(tf.BartConfig(max_position_embeddings=max(64, seq), **common))
    return tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        num_mel_bins=16, max_source_positions=seq, max_target_positions=max(64, seq), pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, **common))


#: ``--hf-fallback`` choices
FALLBACK_MODELS = ("bart", "whisper")


def measure(setting: str, layers: int, steps: int, batch: int, seq: int, repeats: int = 3, hidden: int = 32,
            timm_model: str | None = None, image_size: int = 96, autocast: bool = True,
            device: str = "cpu", fallback_model: str | None = None) -> dict:
    """Best over ``repeats`` of the mean time of ``steps`` training steps (forward and backward) of a tiny BERT (or
    of ``timm_model`` with 10 classes on ``image_size`` images, or of a tiny ``fallback_model``, one of
    :data:`FALLBACK_MODELS`, on ``seq`` tokens or Whisper's ``2 x seq`` frames) on ``device``, and the ops of one
    step (:func:`count_ops`). On a GPU the step is timed to its end on the device; the ops' times are the host's
    (the kernels they launch run on)."""
    torch.manual_seed(0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if timm_model is not None:
        import timm

        model = timm.create_model(timm_model, num_classes=10).train().to(device)
        x = torch.randn(batch, 3, image_size, image_size, device=device)
        labels = torch.zeros(batch, dtype=torch.long, device=device)

        def loss_of() -> torch.Tensor:
            return torch.nn.functional.cross_entropy(model(x).float(), labels)
    elif fallback_model is not None:
        model = _fallback_model(fallback_model, layers, hidden, seq).train().to(device)
        ids = torch.randint(3, 100, (batch, seq), device=device)
        inputs = {"input_features": torch.randn(batch, 16, 2 * seq, device=device)} \
            if fallback_model == "whisper" else {"input_ids": ids}

        def loss_of() -> torch.Tensor:
            return model(**inputs, labels=ids).loss
    else:
        import transformers as tf

        config = tf.BertConfig(vocab_size=100, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                               intermediate_size=2 * hidden, attention_probs_dropout_prob=0.0, num_labels=2)
        model = tf.BertForSequenceClassification(config).train().to(device)
        ids = torch.randint(0, 100, (batch, seq), device=device)
        labels = torch.zeros(batch, dtype=torch.long, device=device)

        def loss_of() -> torch.Tensor:
            return model(input_ids=ids, labels=labels).loss
    if setting != "unpatched":
        with warnings.catch_warnings():  # the fallback models': "act_hf has no family for ..."
            warnings.simplefilter("ignore", act_hf.ActHFWarning)
            bits, kinds = parse_setting(setting)
            act_hf.patch(model, bits=bits, **({} if kinds is None else {"kinds": kinds}))

    def step() -> None:
        with torch.autocast(device, torch.bfloat16, enabled=autocast):
            loss = loss_of()
        loss.backward()

    for _ in range(1 if timm_model else 5):
        step()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        best = min(best, (time.perf_counter() - start) / steps * 1000)
    ops, allocations, syncs, moved, ops_by_name, bytes_by_name = count_ops(step)

    def run() -> None:
        for _ in range(steps):
            step()

    fastest: dict[str, dict] = {}  # each op's best of the repeats, as for the step time
    for _ in range(repeats if setting != "unpatched" else 0):
        for row in time_functions(run, steps):
            if row["ms_per_step"] < fastest.get(row["op"], {"ms_per_step": float("inf")})["ms_per_step"]:
                fastest[row["op"]] = row
    by_op = sorted(fastest.values(), key=lambda o: -o["ms_per_step"])
    return {"setting": setting, "ms_per_step": best, "ops_per_step": ops, "allocations_per_step": allocations,
            "syncs_per_step": syncs, "by_op": by_op,
            "mb_moved_per_step": moved / 1e6, "ops_by_name": ops_by_name,
            "mb_by_name": {name: n / 1e6 for name, n in bytes_by_name.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["unpatched", "bits3"],
                        help="unpatched and/or bitsN (N 1..8), or bitsN:KIND[+KIND...] to patch those kinds alone")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32, help="hidden size (2 heads, MLP 2x wider; default 32)")
    parser.add_argument("--timm", metavar="NAME", help="a timm model (10 classes) instead of the tiny BERT")
    parser.add_argument("--image-size", type=int, default=96, help="images of --timm (default 96)")
    parser.add_argument("--hf-fallback", choices=FALLBACK_MODELS, metavar="NAME",
                        help=f"a tiny HF model act_hf has no family for ({', '.join(FALLBACK_MODELS)}; "
                             "--layers split between encoder and decoder) instead of the tiny BERT")
    parser.add_argument("--fp32", action="store_true",
                        help="train in fp32 instead of under bf16 autocast (the CPU's bf16 matmuls, slow without "
                             "AMX, then stop hiding the host work)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: on the GPU, with the CUDA kernels (host-bound at these sizes: the ops' times are "
                             "their host work on that machine)")
    parser.add_argument("--stub-codec", action="store_true",
                        help="replace the codec's CPU implementations by shape-only stand-ins (host work only)")
    parser.add_argument("--attention-chunk-elements", type=int, metavar="N",
                        help="act_hf.ops.attention.RECOMPUTE_CHUNK_ELEMENTS for the run: a small batch then runs "
                             "the attention chunks a large one does on a GPU (swin-tiny at batch 8 with 524288: "
                             "batch 256's 38 chunks a way)")
    parser.add_argument("--slice-elements", type=int, metavar="N",
                        help="act_hf's CONV_CHUNK_ELEMENTS and BATCH_NORM_CHUNK_ELEMENTS for the run, the forward "
                             "convolutions sliced on the CPU too: a small batch then runs the slices a large one does "
                             "on a GPU (resnet50 at batch 8 with 2097152: batch 256's)")
    parser.add_argument("--slicing", choices=SLICING_MODES,
                        help="ACT_HF_SLICING for the run (default: always with --slice-elements or "
                             "--attention-chunk-elements, else as set)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    for name in args.settings:
        if name != "unpatched":
            try:
                parse_setting(name)
            except ValueError as e:
                parser.error(str(e))
    if min(args.layers, args.steps, args.batch, args.seq, args.image_size) < 1 or args.hidden < 2 or args.hidden % 2:
        parser.error("--layers, --steps, --batch, --seq and --image-size must be >= 1, --hidden even and >= 2")
    if args.timm and args.hf_fallback:
        parser.error("--timm and --hf-fallback: one model at a time")
    if args.device == "cuda" and (args.stub_codec or not torch.cuda.is_available()):
        parser.error("--device cuda: needs a GPU, and runs the CUDA kernels (no --stub-codec)")
    for name in ("attention_chunk_elements", "slice_elements"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(1)
    chunk_elements, slicing = attention.RECOMPUTE_CHUNK_ELEMENTS, os.environ.get("ACT_HF_SLICING")
    slices = (linear_ops.CONV_CHUNK_ELEMENTS, norm_ops.BATCH_NORM_CHUNK_ELEMENTS, linear_ops.WHOLE_FORWARD_DEVICES)
    if args.attention_chunk_elements is not None:
        attention.RECOMPUTE_CHUNK_ELEMENTS = args.attention_chunk_elements
    if args.slice_elements is not None:
        linear_ops.CONV_CHUNK_ELEMENTS = norm_ops.BATCH_NORM_CHUNK_ELEMENTS = args.slice_elements
        linear_ops.WHOLE_FORWARD_DEVICES = ()
    if args.slicing is None and (args.attention_chunk_elements or args.slice_elements):
        args.slicing = "always"  # the slices, whatever room a GPU has
    if args.slicing is not None:
        os.environ["ACT_HF_SLICING"] = args.slicing
    saved = {name: getattr(reference, name) for name in STUBS}
    if args.stub_codec:
        for name, stub in STUBS.items():
            setattr(reference, name, stub)
    try:
        rows = [measure(name, args.layers, args.steps, args.batch, args.seq, hidden=args.hidden,
                        autocast=not args.fp32, device=args.device,
                        timm_model=args.timm, image_size=args.image_size, fallback_model=args.hf_fallback)
                for name in args.settings]
    finally:
        for name, kernel in saved.items():
            setattr(reference, name, kernel)
        attention.RECOMPUTE_CHUNK_ELEMENTS = chunk_elements
        linear_ops.CONV_CHUNK_ELEMENTS, norm_ops.BATCH_NORM_CHUNK_ELEMENTS, linear_ops.WHOLE_FORWARD_DEVICES = slices
        if slicing is None:
            os.environ.pop("ACT_HF_SLICING", None)
        else:
            os.environ["ACT_HF_SLICING"] = slicing
    base = next((r["ms_per_step"] for r in rows if r["setting"] == "unpatched"), None)
    for r in rows:
        r["vs_unpatched"] = None if base is None else r["ms_per_step"] / base
    meta = _meta(torch.device(args.device)) | {"layers": args.layers, "steps": args.steps, "batch": args.batch,
                                         "seq": args.seq, "hidden": args.hidden, "timm": args.timm,
                                         "hf_fallback": args.hf_fallback,
                                         "image_size": args.image_size, "stub_codec": args.stub_codec,
                                         "autocast": not args.fp32,
                                         "attention_chunk_elements": args.attention_chunk_elements or chunk_elements,
                                         "slice_elements": args.slice_elements or slices[0],
                                         "act_hf_slicing": args.slicing or slicing or "auto"}  # the run's
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_overhead.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    model = (f"timm {args.timm} ({args.image_size} px images, batch {args.batch})" if args.timm else
             f"Tiny {args.hf_fallback} through the fallback ({max(1, args.layers // 2)} encoder and decoder layers, "
             f"hidden {args.hidden}, batch {args.batch} x seq {args.seq})" if args.hf_fallback else
             f"Tiny BERT ({args.layers} layers, hidden {args.hidden}, batch {args.batch} x seq {args.seq})")
    if args.attention_chunk_elements is not None:
        model += f", attention recomputed in chunks of {args.attention_chunk_elements} matrix elements"
    if args.slice_elements is not None:
        model += f", convolutions and BatchNorm's backward sliced past {args.slice_elements} elements"
    if args.slicing is not None:
        model += f", ACT_HF_SLICING={args.slicing}"
    codec = ("stubbed (host work only)" if args.stub_codec else "CUDA kernels" if args.device == "cuda"
             else "real (CPU reference)")
    lines = [(f"{model}, {'fp32' if args.fp32 else 'bf16 autocast'}, one thread, best of 3 x {args.steps} steps; "
              f"codec {codec}; {meta['device']}, torch "
              f"{meta['torch']}, act_hf @ {meta['commit']}. Device ops, allocations, host syncs and MB moved (the "
              "ops' tensor inputs and outputs): one step's, counted as dispatched (views excluded, each codec call "
              "one op; `empty` and its kin, which launch nothing, are the allocations)."), "",
             ("| setting | ms per step | vs unpatched | device ops per step | allocations per step | "
              "host syncs per step | MB moved per step |"),
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['setting']} | {r['ms_per_step']:.2f} | "
              f"{'-' if r['vs_unpatched'] is None else format(r['vs_unpatched'], '.2f')} | {r['ops_per_step']} | "
              f"{r['allocations_per_step']} | {r['syncs_per_step']} | {r['mb_moved_per_step']:.2f} |" for r in rows]
    added = added_ops(rows)
    if added:
        patched = [r["setting"] for r in rows if r["setting"] != "unpatched"]
        lines += ["", ("Device ops of one step by aten op (act_hf's codec ops by their own names), where a patched "
                       "step's count differs most from the unpatched one's:"), "",
                  "| op | unpatched | " + " | ".join(patched) + " |", "|---|---|" + "---|" * len(patched)]
        lines += [f"| {a['op']} | {a['unpatched']} | " + " | ".join(f"{a[p]} ({a[p] - a['unpatched']:+d})"
                                                                   for p in patched) + " |" for a in added]
        lines += ["", ("MB moved in one step by aten op (the same ops; a zero-stride stand-in input counted in "
                       "full), where a patched step's differs most from the unpatched one's:"), "",
                  "| op | unpatched | " + " | ".join(patched) + " |", "|---|---|" + "---|" * len(patched)]
        lines += [f"| {a['op']} | {a['unpatched']:.1f} | " + " | ".join(
            f"{a[p]:.1f} ({a[p] - a['unpatched']:+.1f})" for p in patched) + " |"
            for a in added_ops(rows, key="mb_by_name")]
    for r in rows:
        if r["by_op"]:
            lines += ["", (f"Time inside act_hf's ops at {r['setting']} (forward and backward of each autograd "
                           "Function, aten calls included; 3 more runs with each wrapped in a timer, each op's "
                           "best):"), "",
                      "| op | calls per step | us per call | ms per step |", "|---|---|---|---|"]
            lines += [f"| {o['op']} | {o['calls_per_step']:g} | {o['us_per_call']:.1f} | {o['ms_per_step']:.2f} |"
                      for o in r["by_op"]]
            lines.append(f"| all | | | {sum(o['ms_per_step'] for o in r['by_op']):.2f} |")
    (args.out / "host_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, args.out / "host_overhead.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    """Milliseconds a step of each setting, and where a patched one's act_hf ops spend theirs."""
    plt = pyplot()
    if plt is None:
        return
    patched = next((r for r in rows if r["by_op"]), None)
    fig, axes = plt.subplots(1, 2 if patched else 1, figsize=(11 if patched else 5, 4), squeeze=False)
    ax = axes[0][0]
    ax.bar([r["setting"] for r in rows], [r["ms_per_step"] for r in rows], color="tab:blue")
    ax.set_ylabel("ms per training step (host)")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['ops_per_step']} ops", (i, r["ms_per_step"]), ha="center", va="bottom", fontsize=8)
    if patched:
        ops = patched["by_op"][::-1]
        axes[0][1].barh([o["op"] for o in ops], [o["ms_per_step"] for o in ops], color="tab:orange")
        axes[0][1].set_xlabel(f"ms per step inside act_hf's ops ({patched['setting']})")
        axes[0][1].tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
