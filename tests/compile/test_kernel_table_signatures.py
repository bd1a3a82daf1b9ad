"""Every lowering in KERNEL_TABLE has its op's signature: the lowered graph calls it with the node's arguments as
they are (positional, keywords by schema name), so a wrapper whose parameters drift from the registered op (a
renamed, reordered, missing or extra parameter, or another default) would bind a value to the wrong name. The
attention ops are also checked when defined (kiln.ir.signatures); this covers the whole table."""

from __future__ import annotations

import inspect

import pytest
import torch

from kiln.compile.lowering import KERNEL_TABLE

# Parameters a lowering may take after its op's: set by compile passes on the lowered node, never by the op.
EXTRA = {"kiln::paged_attention": ("tile",)}  # compile_step's pinned flash tile (_pin_paged_tile)


def _op_params(op) -> list[tuple[str, object]]:
    return [(a.name, a.default_value if a.has_default_value() else inspect.Parameter.empty)
            for a in op._schema.arguments]  # fmt: skip


def _fn_params(fn) -> list[tuple[str, object]]:
    params = inspect.signature(fn).parameters.values()
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params), f"{fn.__name__}: plain parameters only"
    return [(p.name, p.default) for p in params]


def _fmt(params: list[tuple[str, object]]) -> str:
    return ", ".join(n if d is inspect.Parameter.empty else f"{n}={d!r}" for n, d in params)


def _mismatch(op, fn) -> str | None:
    want, got = _op_params(op), _fn_params(fn)
    extra = EXTRA.get(op._schema.name, ())
    head, tail = got[: len(want)], got[len(want) :]
    if head != want:
        return f"{fn.__name__}({_fmt(got)}) != {op._schema.name}({_fmt(want)})"
    if [n for n, _ in tail] != list(extra) or any(d is inspect.Parameter.empty for _, d in tail):
        return f"{fn.__name__} takes {tail} after the op's parameters; allowed (with defaults): {list(extra)}"
    return None


@pytest.mark.parametrize("op", KERNEL_TABLE, ids=lambda op: op._schema.name)
def test_the_lowering_has_its_ops_parameters(op):
    assert _mismatch(op, KERNEL_TABLE[op]) is None


def test_the_comparison_catches_drift():
    """The check above can fail: a swapped pair, a new default, a dropped and an unexpected parameter."""
    rms = torch.ops.kiln.rms_norm.default

    def swapped(weight, x, eps):
        return x

    def defaulted(x, weight, eps=1e-5):
        return x

    def short(x, weight):
        return x

    def extra(x, weight, eps, tile=None):
        return x

    for fn in (swapped, defaulted, short, extra):
        assert _mismatch(rms, fn) is not None, fn.__name__
    assert _mismatch(rms, lambda x, weight, eps: x) is None
