"""A step model compiled without kernels calls each kiln op's reference function directly (bind_references), not
through torch.library's dispatcher, and computes exactly what the dispatched graph computes: the same logits and
the same K/V written, over a prefill step and a decode step."""

from __future__ import annotations

import copy

import torch

from kiln.compile.step import allocate_kv_cache, compile_step
from kiln.ir.frontend import build_graph
from kiln.ir.registry import REFERENCE, op_name
from kiln.spec.loader import load_spec
from tests.support.paged_helper import shuffled_block_tables, step_batch


def test_a_step_without_kernels_calls_the_references_and_computes_the_same():
    spec = load_spec("tiny-llama")
    graph = build_graph(spec.model, seed=0)
    step = compile_step(copy.deepcopy(graph), spec.model, spec.compile, use_kernels=False)
    kiln_nodes = [n for n in step.gm.graph.nodes if op_name(n).startswith("kiln.")]
    assert len(kiln_nodes) > 10
    for n in kiln_nodes:  # bound: the reference function itself, its op named in meta
        assert not isinstance(n.target, torch._ops.OpOverload), n.name
        ns, op, _ = n.meta["kiln_op"].split(".")
        assert n.target is REFERENCE[f"{ns}::{op}"]

    dispatched = compile_step(copy.deepcopy(graph), spec.model, spec.compile, use_kernels=False)
    for n in dispatched.gm.graph.nodes:  # the same graph with the ops put back: the dispatcher's path
        if "kiln_op" in n.meta:
            ns, op, overload = n.meta.pop("kiln_op").split(".")  # e.g. kiln.rms_norm.default
            n.target = getattr(getattr(getattr(torch.ops, ns), op), overload)
    dispatched.gm.recompile()

    seqs = [list(range(3, 14)), list(range(40, 47))]
    tables, num_blocks = shuffled_block_tables([12, 8], block_size=4, seed=0)
    caches = [allocate_kv_cache(s, num_blocks, 4) for s in (step, dispatched)]
    for chunks in ([(0, 11), (0, 7)], [(11, 12), (7, 8)]):  # prefill, then one decode token each
        seqs = [s + [s[-1] + 1] if chunks[0][0] else s for s in seqs]
        batch = step_batch(seqs, chunks, tables, 4)
        got, want = (s(batch, c) for s, c in zip((step, dispatched), caches, strict=True))
        assert torch.equal(got, want)
        assert torch.equal(caches[0].data, caches[1].data)


def test_a_step_graph_compiled_again_runs_the_passes_over_its_ops():
    """A loaded model served twice (two engines over one m.gm, as `kiln run` tests do): the second compile_step
    puts the ops back for the passes' fake propagation, then binds them again."""
    spec = load_spec("tiny-llama")
    graph = build_graph(spec.model, seed=0)
    first = compile_step(graph, spec.model, spec.compile, use_kernels=False)
    names = [(n.name, n.meta.get("kiln_op")) for n in first.gm.graph.nodes]
    again = compile_step(graph, spec.model, spec.compile, use_kernels=False)
    assert [(n.name, n.meta.get("kiln_op")) for n in again.gm.graph.nodes] == names
    assert all(not isinstance(n.target, torch._ops.OpOverload) for n in again.gm.graph.nodes
               if op_name(n).startswith("kiln."))
