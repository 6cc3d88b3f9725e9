"""The context store: one packed copy per distinct tensor, exact identity, lifetime, accounting."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from act_hf.context import store, track_saved
from act_hf.nn.linear import ActLinear


def _three_linears(bits=(3, 3, 3)):
    return [ActLinear(64, 64).act_configure(slot=f"l{i}", bits=b) for i, b in enumerate(bits)]


def test_tensor_read_by_three_linears_is_stored_once():
    q, k, v = _three_linears()
    x = torch.randn(4, 16, 64, requires_grad=True)
    with track_saved() as saved:
        outs = [m(x) for m in (q, k, v)]
    n = x.numel()
    assert saved.bytes == n * 3 // 8 + 4 * (n // 256)
    assert saved.by_slot == {"l0:input": saved.bytes}
    sum(o.sum() for o in outs).backward()


def test_different_bits_are_separate_copies():
    q, k, v = _three_linears((3, 3, 4))
    x = torch.randn(4, 16, 64, requires_grad=True)
    with track_saved() as saved:
        [m(x) for m in (q, k, v)]
    assert set(saved.by_slot) == {"l0:input", "l2:input"}


def test_the_first_packer_decides_the_channel_scaling_of_a_shared_copy():
    """A LayerNorm's channel-scaled output is the copy the linears after it read: packed once."""
    x = torch.randn(4, 16, 64, requires_grad=True)
    n = x.numel()
    first = store.compress(x, slot="norm:output", bits=3, group_size=256, channel_scale=True)
    again = store.compress(x, slot="lin:input", bits=3, group_size=256, channel_scale=False)
    assert again.spec.channel_scaled and all(a is b for a, b in zip(again.tensors, first.tensors))
    assert first.nbytes == n * 3 // 8 + 4 * (n // 256) + 4 * 64  # + four bytes per channel


def test_a_freed_shared_copy_is_packed_again_in_the_first_packers_form():
    """A non-reentrant checkpoint's forward drops the LayerNorm's copy at once; the Linear after it packs its
    own, channel scaled as the LayerNorm's was, so the recomputation (where the copy is shared) saves tensors
    of the same shapes. Changed in place, the tensor is new, and the reader's own form applies."""
    x = torch.randn(4, 16, 64, requires_grad=True)
    first = store.compress(x, slot="norm:output", bits=3, group_size=256, channel_scale=True)
    shapes = [t.shape for t in first.tensors]
    del first
    gc.collect()
    again = store.compress(x, slot="lin:input", bits=3, group_size=256, channel_scale=False)
    assert again.spec.channel_scaled and [t.shape for t in again.tensors] == shapes
    del again
    with torch.no_grad():
        x.mul_(2)
    assert not store.compress(x, slot="lin:input", bits=3, group_size=256, channel_scale=False).spec.channel_scaled


def test_in_place_modification_invalidates_the_entry():
    a, b, _ = _three_linears()
    x = torch.randn(4, 64)
    with track_saved() as saved:
        y1 = a(x.requires_grad_(False).clone().requires_grad_())
        base = torch.randn(4, 64)
        y = a(base)  # weight needs grad: saves quantize(base)
        base.mul_(2)  # new version: a second reader must not get the stale copy
        y2 = b(base)
    assert saved.num_tensors == 3 * 3
    del y1, y, y2


def test_views_with_different_layout_are_not_confused():
    a, b, _ = _three_linears()
    x = torch.randn(8, 64)
    with track_saved() as saved:
        a(x)
        b(x[:4])  # same storage and offset, different shape: a different tensor
    assert saved.num_tensors == 6


def test_entries_hold_no_copy_and_die_with_their_source():
    """The packed copy dies with the graph; the entry (weak references and the copy's form) lives while its
    source does, for a checkpoint's recomputation (tests/test_checkpoint.py), and dies with it."""
    store.clear()  # only this test's entries
    a, b, _ = _three_linears()
    x = torch.randn(8, 64)
    y = a(x) + b(x)
    (entry,) = store._entries.values()
    copy = entry.tensors[0]
    assert copy() is not None
    y.sum().backward()
    del y
    gc.collect()
    assert copy() is None
    assert len(store) == 1
    del x
    gc.collect()
    assert len(store) == 0


def test_a_tracked_forward_never_run_backward_is_freed():
    lin = nn.Linear(8, 8)
    with track_saved(lin):
        y = torch.tanh(lin(torch.randn(4, 8)))  # tanh saves its own output: kept with grad_fn, a C++ cycle
    alive = weakref.ref(y)
    del y
    gc.collect()
    assert alive() is None


def test_track_saved_excludes_parameters_and_counts_plain_ops():
    lin = nn.Linear(32, 32)
    x = torch.randn(10, 32, requires_grad=True)
    with track_saved(lin) as saved:
        torch.relu(lin(x))
    # addmm saves x (10*32 fp32) -> weight excluded; relu saves its output (10*32 fp32)
    assert saved.bytes == 2 * 10 * 32 * 4
    assert saved.by_slot == {"<uncompressed:torch.float32>": saved.bytes}
    assert saved.largest == 10 * 32 * 4
    with track_saved(lin) as saved:
        torch.relu(lin(torch.cat([x, x]))).sum(0).exp()  # the largest: the cat, 20 rows (relu's output too)
    assert saved.largest == 20 * 32 * 4 and saved.bytes == 2 * 20 * 32 * 4 + 32 * 4


def test_track_saved_excludes_autocast_casts_of_weight_views():
    """Falcon's linear computes ``x @ self.weight.T``: under autocast the matmul saves the cast of the weight's
    view, a weight-sized tensor made once a step, not an activation; only the cast of ``x`` counts."""
    weight = nn.Parameter(torch.randn(48, 32))
    x = torch.randn(10, 32, requires_grad=True).exp()  # an activation (a leaf's cast would pass for a weight's)
    for view in (lambda w: w.T, lambda w: w.t(), lambda w: w.transpose(0, 1), lambda w: w.permute(1, 0)):
        with torch.autocast("cpu", torch.bfloat16), track_saved() as saved:
            x @ view(weight)
        assert saved.bytes == 10 * 32 * 2, saved.by_slot
    with torch.autocast("cpu", torch.bfloat16), track_saved() as saved:
        x @ (2 * weight).T  # computed from the weight: not a view of it
    assert saved.bytes == 10 * 32 * 2 + 48 * 32 * 2
