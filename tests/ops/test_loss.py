"""The causal-LM loss that recomputes its logits: same loss, exact gradients, no V-wide context, fallbacks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

import act_hf
from act_hf.ops import loss as lm_loss
from act_hf.ops.loss import causal_lm_loss, note_head_output
from tests.patches.models import fallback_decoder, gpt2, llama, seq2seq_lm
from tests.utils import assert_grads_match, assert_verbose_allclose

B, S, H, V = 2, 7, 16, 50


def _head_and_labels(bias: bool = True):
    torch.manual_seed(0)
    trunk = nn.Linear(H, H)
    head = nn.Linear(H, V, bias=bias)
    labels = torch.randint(0, V, (B, S))
    labels[0, :3] = -100  # ignored positions
    return trunk, head, labels


def _recomputes(loss: torch.Tensor) -> bool:
    """Whether ``loss`` went through HeadCrossEntropyFunction."""
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if "HeadCrossEntropy" in node.name():
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False


def _loss(trunk, head, labels, x, *, hooked: bool, steps=lambda logits: logits, **kwargs):
    handle = head.register_forward_hook(note_head_output) if hooked else None
    logits = steps(head(trunk(x)))
    loss = causal_lm_loss(ForCausalLMLoss, logits, labels, V, **kwargs)
    if handle is not None:
        handle.remove()
    return loss


@pytest.mark.parametrize("kwargs", [{}, {"num_items_in_batch": torch.tensor(9)}, {"shift_labels": "given"}],
                         ids=["mean", "sum over num_items", "shift_labels"])
@pytest.mark.parametrize("chunk_bytes", [lm_loss.CHUNK_BYTES, 3 * 4 * V], ids=["one chunk", "3-row chunks"])
def test_same_loss_and_gradients_as_for_causal_lm_loss(kwargs, chunk_bytes, monkeypatch):
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", chunk_bytes)
    trunk, head, labels = _head_and_labels()
    if kwargs.get("shift_labels") == "given":
        kwargs = {"shift_labels": torch.roll(labels, -1, dims=1)}
    x = torch.randn(B, S, H)
    ref_trunk, ref_head = copy.deepcopy(trunk), copy.deepcopy(head)
    expected = _loss(ref_trunk, ref_head, labels, x, hooked=False, **kwargs)
    got = _loss(trunk, head, labels, x, hooked=True, **kwargs)
    assert torch.equal(got, expected)
    assert _recomputes(got) and not _recomputes(expected)
    expected.backward()
    got.backward()
    for ref, mod in ((ref_trunk, trunk), (ref_head, head)):
        for (name, p_ref), p in zip(ref.named_parameters(), mod.parameters()):
            assert_verbose_allclose(p.grad, p_ref.grad, atol=1e-6, rtol=1e-5, name=name)


def test_under_bf16_autocast_the_backward_recomputes_the_same_logits():
    trunk, head, labels = _head_and_labels(bias=False)
    x = torch.randn(B, S, H)
    ref_trunk, ref_head = copy.deepcopy(trunk), copy.deepcopy(head)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _loss(ref_trunk, ref_head, labels, x, hooked=False)
        got = _loss(trunk, head, labels, x, hooked=True)
    assert torch.equal(got, expected)
    expected.backward()
    got.backward()
    assert_verbose_allclose(head.weight.grad, ref_head.weight.grad, atol=1e-3, rtol=1e-2, name="head.weight")
    assert_verbose_allclose(trunk.weight.grad, ref_trunk.weight.grad, atol=1e-3, rtol=1e-2, name="trunk.weight")


def _assert_same_grads(refs, mods, autocast: bool) -> None:
    for ref, mod in zip(refs, mods):
        for (name, p_ref), p in zip(ref.named_parameters(), mod.parameters()):
            if autocast:  # the recomputed bf16 logits are the forward's; equal up to summation order
                assert_verbose_allclose(p.grad, p_ref.grad, atol=1e-3, rtol=1e-2, name=name)
            else:
                assert_verbose_allclose(p.grad, p_ref.grad, atol=1e-6, rtol=1e-5, name=name)


#: what models do to their head's output before the loss: Granite, Cohere, Gemma 2's soft cap
SCALED = {"divided": lambda t: t / 8.0, "multiplied": lambda t: t * 0.0625,
          "soft-capped": lambda t: torch.tanh(t / 3.0) * 3.0}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
@pytest.mark.parametrize("chunk_bytes", [lm_loss.CHUNK_BYTES, 3 * 4 * V], ids=["one chunk", "3-row chunks"])
@pytest.mark.parametrize("steps", list(SCALED), ids=list(SCALED))
def test_scaled_head_outputs_recompute_too(steps, chunk_bytes, autocast, monkeypatch):
    """Logits made from the head's output by steps the backward replays: the same loss, bit for bit, and the
    same gradients (the replayed logits are the forward's)."""
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", chunk_bytes)
    trunk, head, labels = _head_and_labels(bias=not autocast)
    x = torch.randn(B, S, H)
    ref_trunk, ref_head = copy.deepcopy(trunk), copy.deepcopy(head)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected = _loss(ref_trunk, ref_head, labels, x, hooked=False, steps=SCALED[steps])
        got = _loss(trunk, head, labels, x, hooked=True, steps=SCALED[steps])
    assert torch.equal(got, expected)
    assert _recomputes(got)
    expected.backward()
    got.backward()
    _assert_same_grads((ref_trunk, ref_head), (trunk, head), autocast)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
def test_a_soft_caps_tanh_output_is_replayed_bit_for_bit(autocast):
    """What the fallback's hooks keep of a soft cap's ``tanh`` after the head: a replay that gives back the
    forward's tensor exactly; a ``tanh`` of anything else, or of a head output edited since, is not replayed."""
    trunk, head, _ = _head_and_labels(bias=not autocast)
    x = torch.randn(B, S, H)
    handle = head.register_forward_hook(note_head_output)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            capped = torch.tanh(head(trunk(x)) / 3.0)
            replay = lm_loss.ReplayedLogits.of(capped)
            assert replay is not None and replay.steps == (("div", 3.0), ("tanh", None))
            assert lm_loss.scaled_head_output(capped * 3.0) is not None  # the loss still finds the head after it
            assert lm_loss.ReplayedLogits.of(torch.tanh(trunk(x) / 3.0)) is None  # not a head's output
            assert lm_loss.ReplayedLogits.of(head(trunk(x)) / 3.0) is None  # not a tanh: the loss replays it
            edited = head(trunk(x))
            with torch.no_grad():
                edited[0, 0, 0] = 0
            assert lm_loss.ReplayedLogits.of(torch.tanh(edited / 3.0)) is None
        assert torch.equal(replay.unpack(), capped)  # outside autocast too: the forward's state is replayed
    finally:
        handle.remove()


def test_logits_not_made_by_a_noted_head_take_the_original_loss():
    trunk, head, labels = _head_and_labels()
    x = torch.randn(B, S, H)
    learned = torch.tensor(2.0, requires_grad=True)
    handle = head.register_forward_hook(note_head_output)
    cases = {
        "shifted": lambda t: t + 1,  # a step the backward does not replay
        "scaled per vocabulary entry": lambda t: t * torch.rand(V),
        "scaled by a learned value": lambda t: t * learned,
        "edited in place": lambda t: t.mul_(2),  # the head's output, modified since
        "scaled, then edited in place": lambda t: (t * 2).add_(1),
    }
    try:
        for name, steps in cases.items():
            logits = steps(head(trunk(x)))
            assert not _recomputes(causal_lm_loss(ForCausalLMLoss, logits, labels, V)), name
        other = head(trunk(x))
        unnoted = nn.Linear(H, V)(trunk(x)) * 2  # scaled, but another Linear's output
        assert not _recomputes(causal_lm_loss(ForCausalLMLoss, unnoted, labels, V))
        del other
    finally:
        handle.remove()


def test_the_loss_keeps_no_logits():
    trunk, head, labels = _head_and_labels()
    x = torch.randn(B, S, H)
    saved = {}
    for hooked in (False, True):
        with act_hf.track_saved() as s:
            _loss(trunk, head, labels, x, hooked=hooked)
        saved[hooked] = s.bytes
    assert saved[False] - saved[True] >= B * S * V * 4  # the fp32 log-probabilities


_BIAS = torch.randn(1, V, generator=torch.Generator().manual_seed(5))


def _noted_add(t, c):
    """``t + c``, noted as the fallback's function mode notes it."""
    out = t + c
    lm_loss.note_head_steps(out, t, ("add", c))
    return out


def _plus_bias(t):
    """BART's ``lm_logits + final_logits_bias``."""
    return _noted_add(t, _BIAS)


#: what seq2seq LMs do to their head's output before ``F.cross_entropy(logits.view(-1, V), labels.view(-1))``
ROWS = {"the head's output": lambda t: t, "plus a bias (BART)": _plus_bias, "cast to fp32": lambda t: t.float(),
        "biased, scaled, cast": lambda t: (_plus_bias(t) * 0.5).float()}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_bytes", [lm_loss.CHUNK_BYTES, 3 * 4 * V], ids=["one chunk", "3-row chunks"])
@pytest.mark.parametrize("rows", list(ROWS), ids=list(ROWS))
def test_cross_entropy_on_the_head_outputs_rows_recomputes_them(rows, chunk_bytes, reduction, autocast, monkeypatch):
    """``F.cross_entropy(logits.view(-1, V), labels.view(-1))`` as BART, Marian, Pegasus compute it: the same loss,
    bit for bit, the same gradients, and no fp32 log-probabilities kept."""
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", chunk_bytes)
    trunk, head, labels = _head_and_labels(bias=not autocast)
    x = torch.randn(B, S, H)
    ref_trunk, ref_head = copy.deepcopy(trunk), copy.deepcopy(head)
    handle = head.register_forward_hook(note_head_output)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ref_rows = ROWS[rows](ref_head(ref_trunk(x))).view(-1, V)
            expected = torch.nn.functional.cross_entropy(ref_rows, labels.view(-1), reduction=reduction)
            with act_hf.track_saved() as saved:
                got = lm_loss.head_cross_entropy(ROWS[rows](head(trunk(x))).view(-1, V), labels.view(-1),
                                                 reduction=reduction)
    finally:
        handle.remove()
    assert got is not None and _recomputes(got) and torch.equal(got, expected)
    assert not any(numel == B * S * V for numel in _saved_numels(got))  # no log-probabilities
    assert saved.bytes < B * S * V * 4
    expected.backward()
    got.backward()
    _assert_same_grads((ref_trunk, ref_head), (trunk, head), autocast)


def _saved_numels(loss: torch.Tensor) -> list[int]:
    """The sizes of the tensors the nodes behind ``loss`` saved (autograd's own nodes)."""
    numels, stack, seen = [], [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        numels += [getattr(node, a).numel() for a in dir(node)
                   if a.startswith("_saved_") and torch.is_tensor(getattr(node, a, None))]
        stack.extend(n for n, _ in node.next_functions)
    return numels


def test_cross_entropy_on_rows_it_cannot_replay_is_left_to_the_original():
    trunk, head, labels = _head_and_labels()
    x = torch.randn(B, S, H)
    target = labels.view(-1)
    per_row = torch.randn(B, S, 1)
    handle = head.register_forward_hook(note_head_output)
    try:
        def rows(steps):
            return steps(head(trunk(x))).reshape(-1, V)

        cases = {
            "bf16 logits, no autocast: the loss runs in bf16": rows(lambda t: t.bfloat16()),
            "a cast before a step: the step ran in fp64": rows(lambda t: t.double().float() * 2.0),
            "a bias per row": rows(lambda t: _noted_add(t, per_row)),
            "a transpose": head(trunk(x)).transpose(0, 1).reshape(-1, V),
            "not a head's output": nn.Linear(H, V)(trunk(x)).view(-1, V),
        }
        for name, logits in cases.items():
            assert lm_loss.head_cross_entropy(logits, target) is None, name
        assert lm_loss.head_cross_entropy(head(trunk(x)), labels) is None  # rows are 2-d
        assert lm_loss.head_cross_entropy(rows(lambda t: t), target.int()) is None  # class indices only
    finally:
        handle.remove()


def phi3():
    return fallback_decoder("phi3")


def mixtral():
    return fallback_decoder("mixtral")


def granite():
    return fallback_decoder("granite")


def cohere():
    return fallback_decoder("cohere")


def gemma2():
    return fallback_decoder("gemma2")


# families, HF models on the generic fallback, and ones that scale or soft-cap the head's output
@pytest.mark.parametrize("build", [gpt2, llama, phi3, mixtral, granite, cohere, gemma2])
def test_causal_lms_recompute_their_logits(build):
    torch.manual_seed(0)
    ref, inputs = build()
    ref.train()
    saved = {}
    for recompute in (False, True):
        model = copy.deepcopy(ref)
        act_hf.patch(model, bits=8, lm_loss_recompute=recompute)
        assert (model.loss_function is not ForCausalLMLoss) is recompute
        with act_hf.track_saved(model) as s:
            out = model(**inputs)
        assert _recomputes(out.loss) is recompute
        saved[recompute] = s.bytes
        twin = copy.deepcopy(ref)
        expected = twin(**inputs).loss
        assert torch.equal(out.loss, expected)
        out.loss.backward()
        expected.backward()
        assert_grads_match(twin, model, name=build.__name__)
    tokens, vocab = inputs["input_ids"].numel(), ref.config.vocab_size
    # the fp32 log-probabilities; Gemma 2 on the fallback also its soft cap's fp32 tanh output (replayed)
    kept = 8 if build is gemma2 else 4
    assert saved[False] - saved[True] >= tokens * vocab * kept * 0.9
    act_hf.unpatch(model)
    assert model.loss_function is ForCausalLMLoss


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
@pytest.mark.parametrize("model_type", ["bart", "m2m100"])
def test_seq2seq_lms_on_the_fallback_recompute_their_logits(model_type, autocast):
    """BART and M2M100 call ``CrossEntropyLoss`` on ``lm_logits.view(-1, V)`` themselves (BART after adding its
    ``final_logits_bias``); the fallback's function mode routes it: the same loss, the gradients of the original,
    and no fp32 log-probabilities kept."""
    from tests.patches.models import seq2seq_lm

    torch.manual_seed(0)
    ref, inputs = seq2seq_lm(model_type)
    ref.train()
    saved = {}
    for recompute in (False, True):
        model = act_hf.patch(copy.deepcopy(ref), bits=8, lm_loss_recompute=recompute)
        twin = copy.deepcopy(ref)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with act_hf.track_saved(model) as s:
                loss = model(**inputs).loss
            expected = twin(**inputs).loss
        assert _recomputes(loss) is recompute
        assert torch.equal(loss, expected)
        saved[recompute] = s.bytes
        loss.backward()
        expected.backward()
        assert_grads_match(twin, model, name=model_type)
    tokens, vocab, hidden = inputs["labels"].numel(), ref.config.vocab_size, ref.config.d_model
    # the fp32 log-probabilities; under autocast the head saved a bf16 copy of its input, the loss keeps the input
    kept = hidden * 4 if autocast else 0
    assert saved[False] - saved[True] >= tokens * (vocab * 4 - kept) * 0.9
    assert not act_hf.unpatch(model).lm_head._forward_hooks


def _masked_lm(model_type):
    from tests.patches.models import bert

    model, inputs = bert(head="MaskedLM", model_type=model_type)
    labels = inputs["input_ids"].clone()
    labels[:, ::2] = -100  # positions not masked
    return model, {**inputs, "labels": labels}


def _t5():
    from tests.patches.models import t5

    return t5()


@pytest.mark.parametrize("build", [_t5, lambda: _masked_lm("bert"), lambda: _masked_lm("roberta")],
                         ids=["t5", "bert-mlm", "roberta-mlm"])
def test_families_computing_their_own_loss_recompute_their_logits(build):
    """T5 and the masked LMs call ``CrossEntropyLoss`` on ``logits.view(-1, V)`` themselves: from their exact output
    embedding's output (T5's ``lm_head``, BERT's ``cls.predictions.decoder``) to the end of the forward a function
    mode routes the call (:class:`act_hf.ops.loss.HeadLossScope`); ``loss_function`` is left alone, and so are
    the calls before the head."""
    torch.manual_seed(0)
    ref, inputs = build()
    ref.train()
    saved = {}
    for recompute in (False, True):
        model = act_hf.patch(copy.deepcopy(ref), bits=8, lm_loss_recompute=recompute)
        head = model.get_output_embeddings()
        assert model.loss_function is ref.loss_function and type(head) is nn.Linear  # the head is exact
        twin = copy.deepcopy(ref)
        with act_hf.track_saved(model) as s:
            loss = model(**inputs).loss
        assert not torch.overrides._get_current_function_mode_stack()  # the mode ended with the forward
        expected = twin(**inputs).loss
        assert _recomputes(loss) is recompute and torch.equal(loss, expected)
        saved[recompute] = s.bytes
        loss.backward()
        expected.backward()
        assert_grads_match(twin, model, name=type(model).__name__)
    assert saved[False] - saved[True] >= inputs["labels"].numel() * ref.config.vocab_size * 4 * 0.9
    with torch.no_grad():
        model(**inputs)  # no mode outside training with autograd on
    assert not torch.overrides._get_current_function_mode_stack()
    head = act_hf.unpatch(model).get_output_embeddings()
    assert not head._forward_hooks and not head._forward_pre_hooks and not model._forward_hooks


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
@pytest.mark.parametrize("build", [gpt2, llama, gemma2, _t5, lambda: seq2seq_lm("bart")],
                         ids=["gpt2", "llama", "gemma2 (fallback, soft cap)", "t5", "bart (fallback)"])
def test_under_autocast_the_head_input_is_kept_once(build):
    """Under bf16 autocast the head reads an fp32 input (the final norm's output); the recomputing loss keeps the
    head's input, and the head's own backward keeps autocast's bf16 cast of it. The head's pre-hook
    (:func:`act_hf.ops.loss.cast_head_input`) makes that cast before the head, so both keep one bf16 tensor:
    ``4 * H`` bytes a token less, the same loss and the same gradients."""
    torch.manual_seed(0)
    ref, inputs = build()
    ref.train()
    runs = {}
    for cast in (False, True):
        model = act_hf.patch(copy.deepcopy(ref), bits=8)
        head = model.get_output_embeddings()
        hooks = [k for k, fn in head._forward_pre_hooks.items() if fn is lm_loss.cast_head_input]
        assert len(hooks) == 1
        if not cast:
            del head._forward_pre_hooks[hooks[0]]
        act_hf.manual_seed(0)  # the same stochastic rounding in both runs
        with torch.autocast("cpu", dtype=torch.bfloat16), act_hf.track_saved(model) as s:
            loss = model(**inputs).loss
        assert _recomputes(loss)
        loss.backward()
        runs[cast] = s.bytes, loss, [p.grad for p in model.parameters()]
    (before, loss_before, grads_before), (after, loss_after, grads_after) = runs[False], runs[True]
    assert torch.equal(loss_before, loss_after)
    assert all(torch.equal(a, b) for a, b in zip(grads_before, grads_after))
    tokens = inputs["labels"].numel()
    assert before - after == tokens * ref.config.get_text_config().hidden_size * 4


def test_lm_loss_recompute_is_validated():
    with pytest.raises(TypeError, match="lm_loss_recompute must be True or False"):
        act_hf.ActConfig(lm_loss_recompute=1)


def test_eval_and_no_grad_use_the_original_loss():
    trunk, head, labels = _head_and_labels()
    head.eval()
    x = torch.randn(B, S, H)
    assert not _recomputes(_loss(trunk, head, labels, x, hooked=True))
    with torch.no_grad():
        head.train()
        assert _loss(trunk, head, labels, x, hooked=True).grad_fn is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("ignore_index", [-100, 0, 7])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_loss_by_rows_is_cross_entropys_bit_for_bit(reduction, ignore_index, device, monkeypatch):
    """The forward's cross-entropy over chunks of rows (the fp32 log-probabilities never whole) gives
    ``F.cross_entropy(logits.float(), ...)`` bit for bit: fp32 and bf16 logits, under autocast too, a vocabulary of
    a real LM's width, ignored targets (also class 0 as the ignored one), chunks that do not divide the rows; an
    invalid target still fails."""
    vocab = 32000
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", 4 * vocab * 7)  # 7 rows a chunk
    generator = torch.Generator().manual_seed(0)
    for dtype, rows, autocast in ((torch.float32, 50, False), (torch.bfloat16, 61, False), (torch.bfloat16, 64, True)):
        logits = (3 * torch.randn(rows, vocab, generator=generator)).to(dtype).to(device)
        targets = torch.randint(0, vocab, (rows,), generator=generator)
        targets[torch.rand(rows, generator=generator) < 0.25] = ignore_index
        targets = targets.to(device)
        with torch.autocast(device, torch.bfloat16, enabled=autocast):
            expected = torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=ignore_index,
                                                         reduction=reduction)
            got = lm_loss._cross_entropy_by_rows(logits, targets, ignore_index, reduction)
        assert torch.equal(got, expected), (dtype, rows, autocast, got.item(), expected.item())
    if device == "cpu":
        targets[3] = -5 if ignore_index != -5 else -6
        with pytest.raises(RuntimeError, match="out of bounds"):
            lm_loss._cross_entropy_by_rows(logits, targets, ignore_index, reduction)


def test_the_loss_by_rows_holds_one_chunk_of_log_probabilities(monkeypatch):
    """Past one chunk, the forward's highest point is one chunk's fp32 copy and log-probabilities (and the picked
    values), where the whole call holds an fp32 copy of all the logits and all their log-probabilities at once."""
    from torch.profiler import ProfilerActivity, profile

    from tests.utils import load_benchmark

    at_peak = load_benchmark("memory_at_peak")

    def peak(fn) -> int:  # the highest point of fn's allocations (it runs without autograd: no backward phase)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
            fn()
        return at_peak.peak_sites(*at_peak._allocations(prof, torch.device("cpu")))["peak"]

    rows, vocab = 64, 32000
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", 4 * vocab * 8)  # 8 rows a chunk
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,))
    fp32_logits = rows * vocab * 4
    chunked = peak(lambda: lm_loss._cross_entropy_by_rows(logits, targets, -100, "mean"))
    whole = peak(lambda: torch.nn.functional.cross_entropy(logits.float(), targets))
    chunk = 8 * vocab * 4
    assert whole >= 2 * fp32_logits and chunked <= 2 * chunk + 2 * rows * 4 + 4096, (chunked, whole, chunk)


def test_the_head_losss_backward_holds_one_chunk_of_probabilities_at_a_time(monkeypatch):
    """Past one chunk, the backward's highest point is the logits' gradient and one chunk's recomputed logits and
    probabilities. The chunk before is gone by then: it used to stay alive beside them, one chunk more, until the
    loop's next assignment."""
    from tests.utils import load_benchmark

    profile_peak = load_benchmark("memory_at_peak").profile_peak
    rows, vocab, width = 64, 32000, 4
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", 4 * vocab * 8)  # 8 rows a chunk
    hidden, weight = torch.randn(rows, width), torch.randn(vocab, width)
    logits = torch.nn.functional.linear(hidden, weight).requires_grad_()  # a leaf: its gradient is kept, not used
    targets = torch.randint(0, vocab, (rows,))
    phases = profile_peak(lambda: lm_loss.HeadCrossEntropyFunction.apply(logits, hidden, weight, None, targets, -100,
                                                                         "mean"), torch.device("cpu"))["phases"]
    chunk, grad = 8 * vocab * 4, rows * vocab * 4
    assert grad + 2 * chunk <= phases["backward"]["peak"] < grad + 2 * chunk + chunk // 2, (phases, chunk)
