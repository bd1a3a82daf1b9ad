"""The step graph's inputs have one source, kiln.step.StepBatch (its fields and their StepInputs): the kv_cache
pass's placeholders and their example values, the paged op's step arguments (kiln.ir.signatures.PAGED_STEP, which
kiln.ir may not import from kiln.step) and the runtime's staging layout all follow it, so a field added, renamed or
retyped in one place and not the others fails here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.compile.step import allocate_kv_cache, compile_step
from kiln.ir.frontend import build_graph
from kiln.ir.signatures import PAGED_ATTENTION, PAGED_CACHE, PAGED_SCALES, PAGED_STEP
from kiln.runtime.input_batch import Layout
from kiln.spec.loader import load_spec
from kiln.step import STEP_INPUTS, StepBatch, step_input_names
from tests.support.paged_helper import step_batch

CASES = {"dense": ("tiny-llama", "auto"), "int8-cache": ("tiny-llama", "int8"), "routed": ("tiny-llama-mod", "auto")}


def test_every_field_has_its_step_input_and_the_graph_order_follows_the_fields():
    assert list(STEP_INPUTS) == [f.name for f in dataclasses.fields(StepBatch)]
    names = step_input_names(True, routed=True)
    fields = [n for n in names if n in STEP_INPUTS]
    assert fields == [n for n in STEP_INPUTS if STEP_INPUTS[n].dtype is not None] + [
        n for n in STEP_INPUTS if STEP_INPUTS[n].dtype is None]  # fmt: skip
    assert [n for n in names if n not in STEP_INPUTS] == ["kv_cache", "kv_scales", "routed_kv_cache"]
    assert not any(STEP_INPUTS[n].routed for n in step_input_names(True) if n in STEP_INPUTS)


def test_the_paged_ops_step_arguments_are_step_batch_fields_of_the_same_kind():
    """PAGED_STEP is written in kiln.ir (which may not import kiln.step): its names must be StepBatch's, in StepBatch's
    order, a Tensor for a tensor field and a SymInt for a host-side int."""
    assert [p.name for p in PAGED_STEP] == [n for n in STEP_INPUTS if n in {p.name for p in PAGED_STEP}]
    for p in PAGED_STEP:
        assert p.kind == ("SymInt" if STEP_INPUTS[p.name].dtype is None else "Tensor"), p
    caches = [p.name for p in (*PAGED_CACHE, *PAGED_SCALES) if p.kind.startswith("Tensor")]
    assert set(caches) <= set(step_input_names(True)) and set(caches) <= set(PAGED_ATTENTION.names)


def test_the_runtimes_staging_layout_holds_every_tensor_field_in_its_dtype():
    lay = Layout(n=3, r=2, s=2, w=4, nr=2, wr=3)
    want = {dt: {n for n, s in STEP_INPUTS.items() if s.dtype == dt} for dt in (torch.int64, torch.int32)}
    assert {dt: set(names) for dt, names in lay.sections.items()} == {torch.int64: want[torch.int64],
                                                                       torch.int32: want[torch.int32]}
    assert {n for n, s in STEP_INPUTS.items() if s.dtype is not None} == want[torch.int64] | want[torch.int32]


def _routed_batch(batch: StepBatch, layers: int) -> StepBatch:
    s, w = batch.block_tables.shape
    return dataclasses.replace(batch, routed_lens=torch.zeros(layers, s, dtype=torch.int32),
                               routed_block_tables=batch.block_tables.expand(layers, s, w).contiguous())


@pytest.mark.parametrize("case", CASES)
def test_the_step_graphs_example_inputs_are_what_a_batch_gives(case):
    """Every placeholder's meta["val"] (the pass's example inputs) has the dtype, rank and kind of the value a
    StepBatch gives it (graph_inputs), and the StepInput's shape."""
    name, kv_dtype = CASES[case]
    spec = load_spec(name)
    model = compile_step(build_graph(spec.model, seed=0), spec.model, spec.compile, use_kernels=False,
                         kv_cache_dtype=kv_dtype)  # fmt: skip
    batch = step_batch([[1, 2, 3], [4, 5]], [(0, 3), (1, 2)], [[1], [2]], 4)
    if model.num_routed_layers:
        batch = _routed_batch(batch, model.num_routed_layers)
    inputs = batch.graph_inputs(allocate_kv_cache(model, 3, 4, routed_num_blocks=3))
    placeholders = {n.name: n.meta["val"] for n in model.gm.graph.nodes if n.op == "placeholder"}
    assert list(placeholders) == list(inputs)
    for input_name, example in placeholders.items():
        given = inputs[input_name]
        if isinstance(given, torch.Tensor):
            assert (example.dtype, example.dim()) == (given.dtype, given.dim()), input_name
        else:
            assert type(example) is type(given) is int, input_name
        spec_in = STEP_INPUTS.get(input_name)
        if spec_in is not None and spec_in.dtype is not None:
            assert example.dtype == spec_in.dtype and example.dim() == len(spec_in.shape) + spec_in.flat, input_name
