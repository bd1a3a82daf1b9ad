"""The kv_cache pass (passes/kv_cache.py): the step graph over a paged cache equals the Level-1 graph.

Two steps on the reference ops: step 1 prefills three sequences' prefixes; step 2 mixes a fresh 7-token
prefill, a 3-token chunk after a cached 5-token prefix and two decodes (contexts 10 and 12, longer than
tiny-mistral's window of 8). Every row's logits must equal the Level-1 graph's on the whole sequence.
"""

import operator

import pytest
import torch

from kiln.compile.pipeline import check_ir, propagate
from kiln.errors import PassError
from kiln.ir.frontend import build_graph
from kiln.ir.text import format_graph
from kiln.passes.kv_cache import PASS
from kiln.spec.loader import load_spec
from kiln.step import KVCache, step_input_names
from tests.support.paged_helper import row_positions, shuffled_block_tables, step_batch

kiln_ops = torch.ops.kiln
SPECS = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gpt2"]
LENS = [7, 8, 10, 12]  # final lengths of the four sequences
STEP1 = [(0, 5), (0, 9), (0, 11)]  # sequences 1..3: their cached prefixes
STEP2 = [(0, 7), (5, 8), (9, 10), (11, 12)]  # prefill, chunk after a prefix, two decodes


def _run_step(gm, batch, cache):
    with torch.no_grad():
        return gm(**batch.graph_inputs(KVCache(cache)))[0]


@pytest.fixture(scope="module", params=SPECS)
def spec(request):
    cfg = load_spec(request.param).model
    ref = build_graph(cfg, seed=3)
    g = torch.Generator().manual_seed(len(request.param))
    seqs = [torch.randint(0, cfg.vocab, (n,), generator=g).tolist() for n in LENS]
    with torch.no_grad():
        full = [ref(torch.tensor(s)[None], torch.arange(len(s))[None])[0] for s in seqs]
    return cfg, seqs, full


def test_pass_rewrites_attention_and_second_run_is_a_no_op(spec):
    cfg = spec[0]
    gm = build_graph(cfg, seed=3)
    before = format_graph(gm)
    result = PASS.run(gm)
    gm.graph.lint()
    gm.recompile()
    propagate(gm)
    check_ir(gm)
    assert result.modified and format_graph(gm) != before
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert kiln_ops.attention.default not in ops
    paged = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == kiln_ops.paged_attention.default]
    assert [n.args[4] for n in paged] == list(range(cfg.layers))
    assert all(n.is_impure() for n in paged)  # mutable schema (writes kv_cache): dead-code elimination keeps it
    assert ops.count(torch.ops.aten.index_select.default) in (1, 2)
    assert tuple(n.name for n in gm.graph.nodes if n.op == "placeholder") == step_input_names(False)
    logits = gm.graph.find_nodes(op="output")[0].args[0]
    assert tuple(logits.meta["val"].shape) == (1, 2, cfg.vocab)  # example R = 2 sampled rows
    text = format_graph(gm)
    again = PASS.run(gm)
    assert not again.modified and format_graph(gm) == text


@pytest.mark.parametrize("block_size", [1, 16])
def test_step_graph_matches_level1_on_mixed_batch(spec, block_size):
    cfg, seqs, full = spec
    gm = build_graph(cfg, seed=3)
    PASS.run(gm)
    gm.recompile()
    layers, kv_heads = cfg.layers, cfg.kv_heads
    tables, num_blocks = shuffled_block_tables(LENS, block_size, seed=block_size + 11)
    cache = torch.zeros(layers, 2, num_blocks, block_size, kv_heads, cfg.head_dim)

    step1 = step_batch(seqs[1:], STEP1, tables[1:], block_size)
    got1 = _run_step(gm, step1, cache)
    want1 = torch.stack([full[i + 1][e - 1] for i, (_, e) in enumerate(STEP1)])
    torch.testing.assert_close(got1, want1, atol=2e-5, rtol=1e-4)

    rows = row_positions(seqs, STEP2)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(block_size)).tolist()
    step2 = step_batch(seqs, STEP2, tables, block_size, sample_indices=order)
    got2 = _run_step(gm, step2, cache)
    want2 = torch.stack([full[rows[r][0]][rows[r][1]] for r in order])
    torch.testing.assert_close(got2, want2, atol=2e-5, rtol=1e-4)


def test_pass_handles_flash_attention_from_flash_tiling():
    from kiln.passes.flash_tiling import PASS as FLASH

    cfg = load_spec("tiny-mistral").model
    gm = build_graph(cfg, seed=3)
    FLASH.run(gm)
    gm.recompile()
    assert PASS.run(gm).modified
    paged = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == kiln_ops.paged_attention.default]
    assert [n.args[14] for n in paged] == [8, 8] and len(paged[0].args) == 17  # window kept, tile dropped, scales None


def test_pass_rejects_a_graph_with_other_inputs():
    cfg = load_spec("tiny-llama").model
    gm = build_graph(cfg, seed=3)
    gm.graph.find_nodes(op="placeholder")[1].name = "pos"
    with pytest.raises(PassError, match="inputs \\(tokens, positions\\)"):
        PASS.run(gm)


def test_gather_falls_back_to_the_lm_head_input_after_norm_fusion():
    from kiln.passes.norm_fusion import PASS as NORM

    cfg = load_spec("tiny-llama").model
    gm = build_graph(cfg, seed=3)
    NORM.run(gm)
    gm.recompile()
    propagate(gm)
    PASS.run(gm)
    gm.recompile()
    propagate(gm)
    check_ir(gm)
    gathers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.index_select.default]
    assert len(gathers) == 1 and gathers[0].args[0].target == operator.getitem
