"""Every runtime module that makes step inputs makes them as kiln.step.STEP_INPUTS declares them: the staging
layout and its block-table rows (input_batch), the CUDA graphs' static buffers and views (cuda_graphs), the warm-up's
null batches (warmup), the batches ModelRunner hands the step model (general, numpy-decode, padded and
verification paths) and the routed state's host mirrors of routed_lens and routed_block_tables (routed_state). Each
tensor is checked for its StepInput's dtype and rank, and its sizes for one value per shape symbol. A last test
retypes fields in STEP_INPUTS (in a fresh interpreter) and runs the same checks: the modules follow the declaration
rather than agreeing with it by hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from kiln.runtime.cuda_graphs import StepGraphs
from kiln.runtime.engine import Engine
from kiln.runtime.input_batch import BlockTableRows, StepBuffers, layout
from kiln.runtime.routed_state import RoutedState
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import NgramDrafter
from kiln.runtime.warmup import null_batch, warmup_shapes
from kiln.step import STEP_INPUTS, KVCache, StepBatch
from tests.support.fake_step import fake_config
from tests.support.speculative import reference_verify

CPU = torch.device("cpu")
V = 31


def _numpy(dtype: torch.dtype):
    return torch.empty(0, dtype=dtype).numpy().dtype


def conforming(batch: StepBatch, routed: bool = False) -> dict[str, int]:
    """Assert that every field is what its StepInput says (dtype, rank; the routed ones None unless `routed`) and
    that each shape symbol has one size across the fields; returns those sizes ("S+1" counts as S)."""
    sizes: dict[str, int] = {}
    for name, spec in STEP_INPUTS.items():
        value = getattr(batch, name)
        if spec.dtype is None:
            assert type(value) is int, name
            continue
        if spec.routed and not routed:
            assert value is None, name
            continue
        assert isinstance(value, torch.Tensor), name
        assert value.dtype == spec.dtype, f"{name}: {value.dtype}, declared {spec.dtype}"
        assert value.dim() == len(spec.shape), f"{name}: shape {tuple(value.shape)}, declared {spec.shape}"
        for symbol, size in zip(spec.shape, value.shape, strict=True):
            base, plus = symbol.removesuffix("+1"), int(symbol.endswith("+1"))
            assert sizes.setdefault(base, size - plus) == size - plus, f"{name}: {symbol} = {size - plus} != {sizes}"
    return sizes


def test_the_staging_layout_and_its_views_follow_the_declaration():
    n, r, s, w, nr, wr = 5, 3, 3, 4, 2, 3
    for routed in (False, True):
        lay = layout(n, r, s, w, nr if routed else 0, wr if routed else 0)
        bufs = StepBuffers(CPU)
        staged = bufs.stage(lay)
        views = bufs.upload(lay)
        assert set(views) == {name for name, spec in STEP_INPUTS.items() if spec.dtype is not None
                              and (routed or not spec.routed)}  # fmt: skip
        for name, view in staged.items():
            assert view.dtype == _numpy(STEP_INPUTS[name].dtype), name
            assert view.shape == views[name].shape, name
        sizes = conforming(StepBatch(**views, max_query_len=1, max_context_len=1), routed)
        assert sizes == {"N": n, "R": r, "S": s, "W": w, **({"L": nr, "WR": wr} if routed else {})}


def test_the_block_table_rows_are_in_the_tables_dtype():
    """ModelRunner gathers rows into the staged table with np.take(out=...), which refuses another dtype."""
    assert BlockTableRows(max_blocks=4).host.dtype == _numpy(STEP_INPUTS["block_tables"].dtype)


def test_the_routed_state_mirrors_its_inputs_in_their_dtypes():
    """RoutedState keeps c_j and the routed tables in the dtypes of routed_lens and routed_block_tables, which
    gather() copies them into (widened tables included), values unchanged."""
    state = RoutedState(2, slots=2, width=2)
    a, b = state.add("a"), state.add("b")
    state.write(a, 0, [3, 4, 5])  # wider than 2: the tables grow
    state.write(b, 1, [6])
    state.lens[a], state.lens[b] = (33, 0), (1, 16)
    assert state.lens.dtype == _numpy(STEP_INPUTS["routed_lens"].dtype)
    assert state.tables.dtype == _numpy(STEP_INPUTS["routed_block_tables"].dtype)
    staged = StepBuffers(CPU).stage(layout(2, 2, 2, 1, 2, 3))
    lens, tables = staged["routed_lens"], staged["routed_block_tables"]
    assert (lens.dtype, tables.dtype) == (state.lens.dtype, state.tables.dtype)
    state.gather(state.slots(["b", "a"]), lens, tables)
    assert lens.tolist() == [[1, 33], [16, 0]]
    assert tables.tolist() == [[[0, 0, 0], [3, 4, 5]], [[6, 0, 0], [0, 0, 0]]]


class _Model:
    """A step model that checks every batch it is given and answers with zero logits (greedy token 0)."""

    num_layers, num_kv_heads, head_dim, vocab = 1, 1, 2, V
    dtype = kv_dtype = torch.float32
    device = CPU

    def __init__(self):
        self.verify = reference_verify
        self.seen: list[tuple[int, int]] = []  # (sequences, query rows) of each batch

    def __call__(self, batch: StepBatch, kv_cache: KVCache) -> torch.Tensor:
        conforming(batch)
        self.seen.append((batch.num_seqs, batch.max_query_len))
        return torch.zeros(batch.sample_indices.shape[0], V)


def test_the_cuda_graphs_static_buffers_views_and_fill_follow_the_declaration():
    shapes = [(1, 1), (2, 1), (4, 1), (2, 3)]
    for routed in (0, 2):
        graphs = StepGraphs(_Model(), KVCache(torch.zeros(1, 2, 8, 4, 1, 2)), block_size=4, max_blocks_per_seq=5,
                            max_model_len=20, num_routed=routed, shapes=shapes)  # fmt: skip
        extra = {"L": routed, "WR": 5} if routed else {}
        assert conforming(graphs.static, bool(routed)) == {"N": 6, "R": 6, "S": 4, "W": 5, **extra}
        for b, q in shapes:
            assert conforming(graphs.views(b, q), bool(routed)) == {"N": b * q, "R": b * q, "S": b, "W": 5, **extra}
        static, batch = graphs.views(2, 1), null_batch(CPU, 4, routed, 2, 1, 9)  # tables narrower than the graph's
        graphs.fill(static, batch)
        assert conforming(static, bool(routed))["W"] == 5 and conforming(batch, bool(routed))["W"] == 3
        assert torch.equal(static.block_tables[:, :3], batch.block_tables) and torch.equal(static.tokens, batch.tokens)


def test_the_warmup_batches_follow_the_declaration():
    for routed in (0, 3):
        for s, q, c in warmup_shapes(64, verify_len=4):
            batch = null_batch(CPU, 4, routed, s, q, c)
            extra = {"L": routed, "WR": -(-q // 4)} if routed else {}
            assert conforming(batch, bool(routed)) == {"N": s * q, "R": s, "S": s, "W": -(-c // 4), **extra}


def test_the_runners_batches_follow_the_declaration():
    """Batches of every prepare path: prefill chunks and decodes (general path), decodes staged with numpy, padded
    decodes and padded verification batches (n-gram drafts); the model checks each one."""
    model = _Model()
    eng = Engine(model, None, fake_config(64, V), block_size=4, num_blocks=40, max_num_seqs=4,
                 max_num_batched_tokens=16, drafter=NgramDrafter(n=1, k=2), pad_decode_batches=True)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=6)
    for prompt in ([1, 2, 3, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8], [4, 5], [0, 0, 0]):
        eng.add_request(prompt_token_ids=prompt, params=greedy)
    list(eng.run())
    plain = Engine(model, None, fake_config(64, V), block_size=4, num_blocks=40, max_num_seqs=8)
    plain.runner.decode_numpy_min_seqs = 1  # every pure-decode step through the numpy path
    for i in range(5):
        plain.add_request(prompt_token_ids=[i + 1] * (i + 2), params=greedy)
    list(plain.run())
    stats = eng.runner.graph_stats
    assert stats.padded_decodes and stats.padded_verifications, stats
    assert any(q > 1 for _, q in model.seen) and any(s == 5 and q == 1 for s, q in model.seen)


_RETYPED = """
import dataclasses, sys, torch
import kiln.step as step
for name, dtype in {"tokens": torch.int32, "context_lens": torch.int64, "block_tables": torch.int64,
                    "routed_lens": torch.int64, "routed_block_tables": torch.int64}.items():
    step.STEP_INPUTS[name] = dataclasses.replace(step.STEP_INPUTS[name], dtype=dtype)
import tests.runtime.test_step_input_dtypes as t
for name in dir(t):
    if name.startswith("test_") and name != "test_a_retyped_field_reaches_every_module":
        getattr(t, name)()
        print(name)
"""


def test_a_retyped_field_reaches_every_module():
    """The same checks after changing five declared dtypes before the runtime is imported: every module follows."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _RETYPED], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(done.stdout.split()) == 6, done.stdout
