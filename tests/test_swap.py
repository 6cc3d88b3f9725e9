"""``ActConfig(swap=True)``: packed contexts in pinned host memory, fetched back exactly, memory actually freed.

The swap itself needs a CUDA device (streams, pinned memory); on a CPU the option must be accepted and change
nothing, since the context already lives in host memory.
"""

from __future__ import annotations

import copy

import pytest
import torch

import act_hf
import act_hf.compress
from act_hf.context import store
from tests.patches.models import bert, timm_model


def _grads(model, inputs, seed=0):
    act_hf.compress.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    with act_hf.track_saved(model) as saved:
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, saved


def test_swap_is_validated_and_saved_with_the_config(tmp_path):
    with pytest.raises(TypeError, match="swap must be True or False"):
        act_hf.ActConfig(swap="yes")
    config = act_hf.ActConfig(bits=3, swap=True)
    config.save_pretrained(tmp_path)
    assert act_hf.ActConfig.from_pretrained(tmp_path).swap is True


def test_swap_changes_nothing_on_a_cpu():
    torch.manual_seed(0)
    base, inputs = bert()
    base.train()
    plain = act_hf.patch(copy.deepcopy(base), bits=3)
    swapped = act_hf.patch(copy.deepcopy(base), bits=3, swap=True)
    assert all(m.act_swap for m in swapped.modules() if hasattr(m, "act_kind"))
    loss0, grads0, saved0 = _grads(plain, inputs)
    loss1, grads1, saved1 = _grads(swapped, inputs)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and all(torch.equal(grads0[n], grads1[n]) for n in grads0)
    assert saved1.bytes == saved0.bytes and saved1.host_bytes == 0


def _cuda_pair(builder, **patch_kwargs):
    torch.manual_seed(0)
    base, inputs = builder()
    base.cuda().train()
    inputs = {k: v.cuda() for k, v in inputs.items()}
    plain = act_hf.patch(copy.deepcopy(base), bits=3, **patch_kwargs)
    swapped = act_hf.patch(copy.deepcopy(base), bits=3, swap=True, **patch_kwargs)
    return plain, swapped, inputs


@pytest.mark.cuda
@pytest.mark.parametrize("prefetch", [0, 2])
def test_swapped_gradients_are_bit_identical_on_cuda(prefetch):
    """Same random draws, same gradients: the fetched context is the packed one, byte for byte."""
    plain, swapped, inputs = _cuda_pair(bert)
    old = store.swap.prefetch
    store.swap.prefetch = prefetch
    try:
        loss0, grads0, saved0 = _grads(plain, inputs)
        loss1, grads1, saved1 = _grads(swapped, inputs)
    finally:
        store.swap.prefetch = old
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)
    # every packed byte moved to the host, once (Q, K and V share their input's copy)
    packed = sum(b for slot, b in saved0.by_slot.items() if not slot.startswith("<uncompressed"))
    assert saved1.host_bytes > 0 and saved1.bytes < saved0.bytes
    assert saved0.bytes - saved1.bytes <= packed
    assert "swapped to pinned host memory" in act_hf.report(swapped, saved1, file=False)
    torch.cuda.synchronize()
    assert len(store.swap) == 0  # the graph is freed: nothing stays registered


@pytest.mark.cuda
def test_swap_with_checkpointing_and_a_conv_net_on_cuda():
    plain, swapped, inputs = _cuda_pair(bert)
    for m in (plain, swapped):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, grads0, _ = _grads(plain, inputs)
    _, grads1, _ = _grads(swapped, inputs)
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)

    torch.manual_seed(0)
    net, inputs = timm_model("resnet18", size=64)()
    net.cuda().train()
    x = inputs["x"].cuda()
    results = []
    for swap in (False, True):
        model = act_hf.patch(copy.deepcopy(net), bits=2, swap=swap)
        act_hf.compress.manual_seed(0)
        torch.manual_seed(0)
        model(x).float().pow(2).mean().backward()
        results.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.cuda
def test_swap_lowers_peak_device_memory_on_cuda():
    """A wide layer stack at batch 64: the packed contexts leave the GPU, so the peak of forward + backward drops
    by about their size."""
    import transformers as tf

    cfg = tf.BertConfig(vocab_size=1000, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                        intermediate_size=2048, attention_probs_dropout_prob=0.0, num_labels=2)
    torch.manual_seed(0)
    base = tf.BertForSequenceClassification(cfg).cuda().train()
    inputs = {"input_ids": torch.randint(0, 1000, (64, 128), device="cuda"),
              "labels": torch.zeros(64, dtype=torch.long, device="cuda")}
    peaks, host = {}, {}
    for swap in (False, True):
        model = act_hf.patch(copy.deepcopy(base), bits=3, swap=swap)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16), act_hf.track_saved(model) as saved:
            loss = model(**inputs).loss
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # lets the allocator release blocks whose side-stream copies have run
        after_forward = torch.cuda.memory_allocated() - start
        loss.backward()
        torch.cuda.synchronize()
        peaks[swap] = after_forward
        host[swap] = saved.host_bytes
        del model, loss
    assert host[False] == 0 and host[True] > 0
    assert peaks[False] - peaks[True] >= 0.9 * host[True]


@pytest.mark.cuda
def test_a_channel_scaled_context_swaps_with_its_shifts_on_cuda():
    """The shift vector is one more packed tensor: it goes to the host and comes back with the payload."""
    from act_hf.compress import dequantize

    x = torch.randn(128, 64, device="cuda")
    x[:, 3] *= 40
    act_hf.compress.manual_seed(0)
    kept = store.compress(x, slot="s", bits=3, group_size=256, channel_scale=True)
    act_hf.compress.manual_seed(0)
    host = store.compress(x.clone(), slot="s", bits=3, group_size=256, swap=True, channel_scale=True)
    assert host.spec.channel_scaled and all(not t.is_cuda for t in host.tensors)
    fetched = store.resolve(host)
    assert fetched.channel.is_cuda and torch.equal(fetched.channel, kept.channel)
    assert torch.equal(dequantize(fetched), dequantize(kept))
