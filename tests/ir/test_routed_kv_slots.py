"""kiln::mod_kv_slots (the routed KV cache's per-layer step inputs) against a plain per-sequence Python loop, at odd
shapes: sequences with no routed row, block sizes 1 / 3 / 16, tables of different widths, every row or none routed."""

from __future__ import annotations

import pytest
import torch

import kiln.ir.ops_mod_step  # noqa: F401  (registers kiln::mod_kv_slots)
from kiln.errors import KilnError
from kiln.ir.ops_mod import mod_gather

kiln_ops = torch.ops.kiln


def _loop(mask: list[bool], qsl: list[int], lens: list[list[int]], tables: list[list[list[int]]], layer: int,
          bs: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(slots, context_lens, query_start_loc, counts) the obvious way: walk each sequence's rows in order."""
    slots, ctx, starts, counts = [], [], [0], []
    for s in range(len(qsl) - 1):
        c = lens[layer][s]
        n = 0
        for row in range(qsl[s], qsl[s + 1]):
            if mask[row]:
                entry = c + n
                slots.append(tables[layer][s][entry // bs] * bs + entry % bs)
                n += 1
        counts.append(n)
        ctx.append(c + n)
        starts.append(starts[-1] + n)
    slots += [-1] * (len(mask) - len(slots))  # the compact batch's padding rows
    return slots, ctx, starts, counts


def _case(seed: int, num_seqs: int, bs: int, routed_layers: int, p: float):
    g = torch.Generator().manual_seed(seed)
    new = torch.randint(0, 7, (num_seqs,), generator=g)
    new[0] = max(int(new[0]), 1)  # a step has at least one token
    qsl = [0, *torch.cumsum(new, 0).tolist()]
    n = qsl[-1]
    lens = torch.randint(0, 11, (routed_layers, num_seqs), generator=g)
    width = int((lens.max() + 7) // bs + 1)
    tables = torch.randint(1, 50, (routed_layers, num_seqs, width), generator=g, dtype=torch.int32)
    mask = torch.rand(1, n, generator=g) < p
    x = torch.randn(1, n, 5, generator=g)
    index, count, _, _ = mod_gather(x, torch.arange(n)[None], mask, 1.0)  # the compact batch, as in the step graph
    cache = torch.empty(routed_layers, 2, 50, bs, 1, 2)
    args = (index, count, torch.tensor(qsl, dtype=torch.int32), lens.to(torch.int32), tables, cache)
    return args, (mask[0].tolist(), qsl, lens.tolist(), tables.tolist())


@pytest.mark.parametrize(("seed", "num_seqs", "bs", "p"), [(0, 1, 16, 0.5), (1, 5, 3, 0.5), (2, 7, 1, 0.3),
                                                           (3, 3, 16, 1.0), (4, 4, 3, 0.0), (5, 9, 3, 0.7)])
def test_mod_kv_slots_equals_a_per_sequence_loop(seed, num_seqs, bs, p):
    args, plain = _case(seed, num_seqs, bs, 3, p)
    for layer in range(3):
        slots, tables, ctx, qsl, routed = kiln_ops.mod_kv_slots(*args, layer)
        want_slots, want_ctx, want_qsl, want_counts = _loop(*plain, layer, bs)
        assert slots.dtype == torch.int64 and slots.tolist() == want_slots
        assert ctx.dtype == qsl.dtype == routed.dtype == tables.dtype == torch.int32
        assert ctx.tolist() == want_ctx and qsl.tolist() == want_qsl
        assert routed.tolist() == [int(m) for m in plain[0]]  # which flat rows were routed
        starts = plain[1]
        assert [int(routed[a:b].sum()) for a, b in zip(starts, starts[1:], strict=False)] == want_counts
        assert torch.equal(tables, args[4][layer]) and tables.data_ptr() != args[4].data_ptr()


def test_fake_kernel_shapes_match():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, _ = _case(7, 4, 3, 2, 0.5)
    real = kiln_ops.mod_kv_slots(*args, 1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = kiln_ops.mod_kv_slots(*args, 1)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


def test_a_batched_compact_batch_is_refused():
    args, _ = _case(8, 2, 3, 1, 0.5)
    index, count = args[0].expand(2, -1), args[1].expand(2)
    with pytest.raises(KilnError, match="one flat step batch"):
        kiln_ops.mod_kv_slots(index, count, *args[2:], 0)
