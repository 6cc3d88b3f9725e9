"""Test helpers shared by the suite."""

from __future__ import annotations

import functools
import gc
import importlib.util
import math
import sys
import weakref
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: the benchmark scripts' folder
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: aten ops that make the host wait for the device (on a GPU): a value read back, or an output sized by data
HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "equal",
                           "_unique2", "unique_consecutive", "unique_dim"})


def packed_bytes(numel: int, bits: int, group_size: int = 256) -> int:
    """Bytes of a packed tensor of ``numel`` elements: the bit stream plus a 16-bit zero point and scale per group."""
    return math.ceil(numel * bits / 8) + 4 * math.ceil(numel / group_size)


def dispatched(fn) -> list[tuple[torch._ops.OpOverload, tuple]]:
    """Run ``fn()`` under a dispatch mode and list the ops it dispatched with their outputs (as a tuple). Under a
    mode, act_hf's codec runs as its ``torch.ops.act_hf`` op (one entry), not as the ops inside it."""
    seen: list[tuple[torch._ops.OpOverload, tuple]] = []

    class _Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append((func, tuple(out) if isinstance(out, (tuple, list)) else (out,)))
            return out

    with _Watch():
        fn()
    return seen


def host_syncs(fn) -> Counter:
    """Run ``fn()`` and count the ops of :data:`HOST_SYNC_OPS` it dispatches (on any device: these ops would sync
    a GPU). Host copies such as ``.tolist()`` or ``.cpu()`` are not seen on the CPU."""
    names = (func.overloadpacket.__name__ for func, _ in dispatched(fn))
    return Counter(name for name in names if name in HOST_SYNC_OPS)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``20*log10(|ref| / |ref - approx|)`` (inf when equal)."""
    ref = ref.double()
    err = (ref - approx.double()).norm().item()
    return math.inf if err == 0 else 20 * math.log10(ref.norm().item() / err)


def relative_error(got, exact) -> float:
    """``||got - exact|| / ||exact||`` over tensor lists taken as one vector (a whole gradient), in float64."""
    pairs = [(a.double(), b.double()) for a, b in zip(got, exact)]
    total = math.sqrt(sum(b.norm().item() ** 2 for _, b in pairs)) or 1.0
    return math.sqrt(sum((a - b).norm().item() ** 2 for a, b in pairs)) / total


def assert_verbose_allclose(actual: torch.Tensor, expected: torch.Tensor, *, atol: float = 0, rtol: float = 0,
                            equal_nan: bool = False, name: str = "tensor") -> None:
    """``torch.allclose`` that reports the mismatch count, the first indices and NaN/Inf differences."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    close = torch.isclose(a, e, atol=atol, rtol=rtol, equal_nan=equal_nan)
    if bool(close.all()):
        return
    bad = (~close).nonzero()[:5].tolist()
    diff = (a - e).abs()
    finite = torch.isfinite(diff)
    msg = (
        f"{name}: {int((~close).sum())}/{close.numel()} mismatched; first at {bad}; "
        f"max abs diff {diff[finite].max().item() if finite.any() else 'n/a'}; "
        f"NaN actual/expected {int(a.isnan().sum())}/{int(e.isnan().sum())}, "
        f"Inf actual/expected {int(a.isinf().sum())}/{int(e.isinf().sum())}"
    )
    raise AssertionError(msg)


def assert_grads_match(ref: torch.nn.Module, model: torch.nn.Module, *, cos: float = 0.999, tol: float = 1e-3,
                       name: str = "") -> float:
    """Per-parameter gradient agreement of a patched model with its unpatched twin.

    Each parameter's gradient must have cosine >= ``cos`` with the reference, or differ from it by at most
    ``tol`` times the norm of the whole reference gradient. The second clause covers gradients that are
    (structurally) almost zero, where the direction is rounding noise: a bias in front of a training-mode
    BatchNorm, whose mean subtraction cancels it; an attention output projection of a random-init model,
    whose gradient is a sum of nearly cancelling terms. Returns the worst cosine among the parameters that
    carry at least 1% of the total gradient norm.
    """
    pairs = [(n, pr.grad, pa.grad) for (n, pr), pa in zip(ref.named_parameters(), model.parameters())
             if pr.grad is not None or pa.grad is not None]
    total = math.sqrt(sum(gr.double().norm().item() ** 2 for _, gr, _ in pairs if gr is not None)) or 1.0
    worst = 1.0
    for n, gr, ga in pairs:
        assert gr is not None and ga is not None, f"{name} {n}: gradient present on one side only"
        assert ga.dtype == gr.dtype, f"{name} {n}: gradient dtype {ga.dtype} != {gr.dtype}"
        c = torch.nn.functional.cosine_similarity(gr.flatten().double(), ga.flatten().double(), 0).item()
        err = (gr.double() - ga.double()).norm().item()
        if gr.double().norm().item() >= 0.01 * total:
            worst = min(worst, c)
        assert c >= cos or err <= tol * total, (
            f"{name} {n}: cosine {c:.5f}, error {err:.3g} = {err / total:.2g} of the total gradient norm")
    return worst


def tensors_with_history() -> set[int]:
    """The ids of the tensors Python can reach that carry an autograd node, after a collection: a graph that
    outlives what made it shows here (a tensor saved with its own ``grad_fn`` holds its node through C++, a cycle
    gc cannot free)."""
    gc.collect()
    return {id(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.grad_fn is not None}


def output_alive_at(producer: torch.nn.Module, consumer: torch.nn.Module, run) -> bool:
    """Whether the output of ``producer`` (of its last call before) is still alive when ``consumer``'s forward
    starts, in ``run()``: a weak reference taken by a forward hook, read by a forward pre-hook."""
    seen: dict[str, object] = {}
    handles = [producer.register_forward_hook(lambda m, args, out: seen.__setitem__("ref", weakref.ref(out))),
               consumer.register_forward_pre_hook(lambda m, args: seen.__setitem__("alive", seen["ref"]() is not None))]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return seen["alive"]


def alive_unhooked_and_hooked(producer: torch.nn.Module, consumer: torch.nn.Module, hooked: torch.nn.Module,
                              run) -> tuple[bool, bool]:
    """:func:`output_alive_at` in ``run()``, then again with a no-op forward hook on ``hooked``: a caller that hands
    ``hooked`` its input to own calls it as usual once a hook could see the call."""
    unhooked = output_alive_at(producer, consumer, run)
    handle = hooked.register_forward_hook(lambda m, args, out: None)
    try:
        return unhooked, output_alive_at(producer, consumer, run)
    finally:
        handle.remove()


def assert_same_steps(module: torch.nn.Module, x: torch.Tensor, forwards, *, autocast: bool) -> None:
    """Each of ``forwards`` (callables of ``x``, computing ``module``'s forward some way) gives the same output,
    input gradient and parameter gradients as the first, bit for bit, from the same draws (act_hf's and torch's
    seeds pinned before each), in fp32 or under bf16 autocast."""
    import act_hf

    results = []
    for forward in forwards:
        act_hf.manual_seed(0)
        torch.manual_seed(0)  # stochastic depth
        module.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y = forward(x)
        y.float().square().sum().backward()
        results.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in module.parameters()]))
    (y_ref, gx_ref, gp_ref), *others = results
    for y, gx, gp in others:
        assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
        assert all(torch.equal(a, b) for a, b in zip(gp, gp_ref))


@functools.cache
def load_benchmark(name: str):
    """The benchmark script ``benchmarks/<name>.py`` as a module (its folder on the path while it loads), loaded
    once per test session."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def stub_codec(monkeypatch) -> None:
    """Replace the codec's CPU reference (quantize, pack, few-bit codes) with ``benchmark_host_overhead``'s
    stand-ins, which allocate the outputs and nothing else, as a GPU's kernels do: a memory test then sees the
    working set of the ops around the codec rather than the reference's chunked temporaries. Values meaningless."""
    from act_hf.compress import reference

    for name, stub in load_benchmark("benchmark_host_overhead").STUBS.items():
        monkeypatch.setattr(reference, name, stub)


def forward_peak(forward, x: torch.Tensor) -> int:
    """Bytes at the highest point of ``forward(x)`` above those allocated before: on a GPU from the allocator's
    statistics, under bf16 autocast, after one untimed call (a process's first matrix product allocates cuBLAS's
    workspace, 32 MiB on an H100, kept for the process: it made the first of two compared calls the higher); on
    the CPU from the profiler's allocations (``memory_at_peak.profile_peak``, the forward of
    ``forward(x).square().sum()``)."""
    if x.is_cuda:
        with torch.autocast("cuda", torch.bfloat16):
            forward(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with torch.autocast("cuda", torch.bfloat16):
            out = forward(x)
        torch.cuda.synchronize()
        del out
        return torch.cuda.max_memory_allocated() - start
    profile_peak = load_benchmark("memory_at_peak").profile_peak
    return profile_peak(lambda: forward(x).square().sum(), x.device)["phases"]["forward"]["peak"]
