"""The attention ops' signatures come from one table (kiln.ir.signatures): the registered schemas are made from
it, and every function with an attention op's signature (references, lowering's calls, codegen's wrappers) has
its parameters in the table's order, or fails when defined."""

from __future__ import annotations

import pytest
import torch
from torch.library import infer_schema

import kiln.ir.ops as ops
import kiln.ir.ops_level2 as ops_level2
import kiln.ir.ops_paged as ops_paged
from kiln.codegen import flash_attn, paged
from kiln.compile import lowering
from kiln.errors import InternalError
from kiln.ir.signatures import (
    ATTENTION,
    ATTENTION_PARAMS,
    FLASH_ATTENTION,
    PAGED_ATTENTION,
    QKV,
    OpSignature,
    Param,
    check_params,
)

SIGNATURES = {ATTENTION: ops.attention, FLASH_ATTENTION: ops_level2.flash_attention,
              PAGED_ATTENTION: ops_paged.paged_attention}  # fmt: skip


@pytest.mark.parametrize("sig", SIGNATURES, ids=lambda s: s.op)
def test_the_registered_schema_is_the_tables(sig):
    ns, name = sig.op.split("::")
    assert str(getattr(getattr(torch.ops, ns), name).default._schema) == sig.op + sig.schema()


@pytest.mark.parametrize("sig", SIGNATURES, ids=lambda s: s.op)
def test_the_references_type_hints_infer_the_same_schema(sig):
    """The table's kinds agree with the reference's annotations (what custom_op would have inferred)."""
    assert infer_schema(SIGNATURES[sig]._init_fn, mutates_args=sig.mutated) == sig.schema()


def test_every_function_with_an_attention_signature_follows_the_table():
    for fn in (lowering.k_attention, flash_attn.flash_attention):
        check_params(fn, ATTENTION.names, extra=("tile",), what=ATTENTION.op)
    check_params(lowering.k_flash_attention, FLASH_ATTENTION.names, what=FLASH_ATTENTION.op)
    for fn in (lowering.k_paged_attention, paged.paged_attention):
        check_params(fn, PAGED_ATTENTION.names, extra=("tile",), what=PAGED_ATTENTION.op)
    varlen = (*(p.name for p in QKV), "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
              *(p.name for p in ATTENTION_PARAMS))  # fmt: skip
    check_params(flash_attn.flash_attention_varlen, varlen, extra=("tile",), what="flash_attention_varlen")


def test_the_pieces_compose_the_ops():
    assert ATTENTION.names == ("q", "k", "v", "num_heads", "num_kv_heads", "causal", "window", "scale")
    assert FLASH_ATTENTION.names[: len(ATTENTION.names)] == ATTENTION.names
    assert PAGED_ATTENTION.names[:3] == ATTENTION.names[:3]
    assert PAGED_ATTENTION.names[-6:-1] == ATTENTION.names[3:] and PAGED_ATTENTION.names[-1] == "kv_scales"
    assert PAGED_ATTENTION.mutated == ("kv_cache", "kv_scales")


def test_drift_fails_when_the_function_is_defined():
    with pytest.raises(InternalError, match=r"num_kv_heads.*kiln::attention"):

        @ATTENTION.implements
        def swapped(q, k, v, num_kv_heads, num_heads, causal, window, scale):
            return q

    with pytest.raises(InternalError, match="kiln::attention"):

        @ATTENTION.implements
        def short(q, k, v, num_heads, num_kv_heads, causal, window):
            return q

    with pytest.raises(InternalError, match="optionally"):

        @ATTENTION.implements(extra=("tile",))
        def unknown_extra(q, k, v, num_heads, num_kv_heads, causal, window, scale, block):
            return q


def test_implements_accepts_the_signature_then_optional_extras_and_keyword_only_ones():
    @ATTENTION.implements(extra=("tile",))
    def wrapper(q, k, v, num_heads, num_kv_heads, causal, window, scale, tile=None, *, out=None):
        return q

    assert wrapper(1, *range(7)) == 1


def test_bind_names_a_nodes_arguments():
    args = ("q", "k", "v", 4, 2, True, 0, 0.5)
    assert ATTENTION.bind(args)["num_kv_heads"] == 2
    assert ATTENTION.bind(args[:7], {"scale": 0.25})["scale"] == 0.25
    with pytest.raises(InternalError, match="without"):
        ATTENTION.bind(args[:6])
    with pytest.raises(InternalError, match="takes 8"):
        ATTENTION.bind((*args, 1))


def test_a_mutated_parameter_gets_its_own_alias_set():
    sig = OpSignature("kiln::example", (Param("x", "Tensor"), Param("cache", "Tensor", mutated=True),
                                        Param("scales", "Tensor?", mutated=True)))  # fmt: skip
    assert sig.schema() == "(Tensor x, Tensor(a1!) cache, Tensor(a2!)? scales) -> Tensor"
