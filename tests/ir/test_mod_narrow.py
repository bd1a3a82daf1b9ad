"""kiln::mod_narrow (a routed layer's compact batch cut to its routed rows on big steps): the row rule, its reference
(copies) and its lowered form (views), and the fake kernel's static bound."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kiln.ir.ops_mod_step  # noqa: F401  (registers kiln::mod_narrow)
from kiln.compile.lowering import KERNEL_TABLE
from kiln.errors import KilnError
from kiln.ir.ops_mod_step import narrow_rows

kiln_ops = torch.ops.kiln


@pytest.mark.parametrize(("count", "rows", "min_rows", "bucket", "want"), [
    ([5], 20, 1, 4, 8),  # rounded up to the bucket
    ([8], 20, 1, 4, 8),  # already a multiple
    ([0], 20, 1, 4, 4),  # nothing routed: one bucket of padding rows, never 0
    ([19], 20, 1, 4, 20),  # never past C
    ([3, 11], 20, 1, 4, 12),  # several sequences: the largest count
    ([5], 20, 21, 4, 20),  # fewer rows than min_rows: unchanged, no read
    ([5], 20, 20, 64, 20),  # at min_rows: a bucket wider than C gives C
])
def test_rows(count, rows, min_rows, bucket, want):
    assert narrow_rows(torch.tensor(count), rows, min_rows, bucket) == want


def _compact(c: int = 13, d: int = 6):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 50, (1, c), generator=g), torch.randn(1, c, d, generator=g),
            torch.randint(0, 50, (1, c), generator=g), torch.randint(-1, 90, (c,), generator=g)]


def test_reference_cuts_every_tensor_on_its_row_dim_and_copies():
    compact = _compact()
    out = kiln_ops.mod_narrow(torch.tensor([5]), compact, 1, 3)
    assert [tuple(t.shape) for t in out] == [(1, 6), (1, 6, 6), (1, 6), (6,)]
    for got, full in zip(out, compact, strict=True):
        assert torch.equal(got, full[:, :6] if full.dim() > 1 else full[:6])
        assert got.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    same = kiln_ops.mod_narrow(torch.tensor([5]), compact, 14, 3)  # 13 rows < 14: the padded path
    assert all(torch.equal(a, b) for a, b in zip(same, compact, strict=True))


def test_lowered_form_returns_views_and_keeps_the_bound_on_fake_tensors():
    k_narrow = KERNEL_TABLE[kiln_ops.mod_narrow.default]
    compact = _compact()
    out = k_narrow(torch.tensor([7]), compact, 1, 4)
    assert [tuple(t.shape) for t in out] == [(1, 8), (1, 8, 6), (1, 8), (8,)]
    assert all(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for a, b in zip(out, compact,
                                                                                               strict=True))
    assert all(a is b for a, b in zip(k_narrow(torch.tensor([7]), compact, 14, 4), compact, strict=True))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) for t in compact]
        fake_count = mode.from_tensor(torch.tensor([7]))
        assert [tuple(t.shape) for t in k_narrow(fake_count, fake, 1, 4)] == [tuple(t.shape) for t in compact]
        # The op's fake kernel: the static bound C, whatever the count.
        assert [tuple(t.shape) for t in kiln_ops.mod_narrow(fake_count, fake, 1, 4)] == [(1, 13), (1, 13, 6),
                                                                                         (1, 13), (13,)]


def test_tensors_of_different_row_counts_are_refused():
    a, b, *_ = _compact()
    with pytest.raises(KilnError, match="one row count"):
        kiln_ops.mod_narrow(torch.tensor([2]), [a, b[:, :5]], 1, 4)


def test_opcheck_on_the_padded_path():
    # torch's checks of the schema and the fake kernel; on the narrowed path the real rows differ from the fake
    # kernel's bound by design (ops_mod_step's docstring), so it is checked where they agree.
    torch.library.opcheck(kiln_ops.mod_narrow.default, (torch.tensor([5]), _compact(), 14, 4),
                          test_utils=("test_schema", "test_faketensor"))
