"""ModelRunner.prepare on persistent buffers gives the same inputs as the list-building version it replaced.

`legacy_prepare` is that version (before the persistent buffers), kept here as the oracle. Random workloads on
a small pool (preemption), with shared prompt prefixes (prefix-cache hits), chunked prefills, aborts and padded
decode batches compare every step's tensors.
"""

from __future__ import annotations

import random

import pytest
import torch

from kiln.runtime.block_manager import NULL_BLOCK
from kiln.runtime.engine import Engine
from kiln.runtime.input_batch import BlockTableRows
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.sampler import SamplingParams
from kiln.runtime.scheduler import Schedule
from tests.support.fake_step import FakeStepModel, fake_config

V = 97


def legacy_prepare(runner: ModelRunner, sched: Schedule) -> tuple[dict, int]:
    bs = runner.block_size
    tokens, positions, slots, tables, context_lens, qsl, sample_rows = [], [], [], [], [], [0], []
    for s in sched.seqs:
        req, end = s.request, s.start + s.num_new
        table = runner.bm.table(req.request_id)
        tokens += req.token_slice(s.start, end)
        positions += range(s.start, end)
        slots += [table[p // bs] * bs + p % bs for p in range(s.start, end)]
        tables.append(table)
        context_lens.append(end)
        qsl.append(qsl[-1] + s.num_new)
        if s.sample:
            sample_rows.append(qsl[-1] - 1)
    padded = runner._pad_size(sched)
    width = runner.max_blocks_per_seq if padded else max(len(t) for t in tables)
    if padded:
        extra = padded - len(sched.seqs)
        tokens += [0] * extra
        positions += [0] * extra
        slots += [NULL_BLOCK * bs] * extra
        tables += [[]] * extra
        context_lens += [1] * extra
        qsl += range(qsl[-1] + 1, qsl[-1] + 1 + extra)
        sample_rows = list(range(padded))
    block_tables = [t + [NULL_BLOCK] * (width - len(t)) for t in tables]
    out = {"tokens": tokens, "positions": positions, "slot_mapping": slots, "block_tables": block_tables,
           "context_lens": context_lens, "query_start_loc": qsl, "sample_indices": sample_rows,
           "max_query_len": 1 if padded else max(s.num_new for s in sched.seqs),
           "max_context_len": runner.max_model_len if padded else max(context_lens)}  # fmt: skip
    return out, padded


def checked_engine(pad: bool, **kw) -> tuple[Engine, list[int]]:
    """An engine whose runner compares every prepare() with legacy_prepare(); the list counts compared steps."""
    e = Engine(FakeStepModel(V), None, fake_config(64), block_size=4, pad_decode_batches=pad, **kw)
    runner, real, seen = e.runner, e.runner.prepare, []

    def prepare(sched):
        want, want_pad = legacy_prepare(runner, sched)
        batch, padded = real(sched)
        assert padded == want_pad
        for name in ("tokens", "positions", "slot_mapping", "context_lens", "query_start_loc", "sample_indices"):
            assert getattr(batch, name).tolist() == want[name], name
        got = batch.block_tables.tolist()
        width = len(got[0])
        # Only the width the batch needs; the legacy padded tables only added null columns past it.
        assert [row[:width] for row in want["block_tables"]] == got
        assert all(b == NULL_BLOCK for row in want["block_tables"] for b in row[width:])
        assert width == max(len(runner.bm.table(s.request.request_id)) for s in sched.seqs)
        assert batch.max_query_len == want["max_query_len"]
        expect_ctx = max(want["context_lens"]) if padded else want["max_context_len"]
        assert batch.max_context_len == expect_ctx
        assert batch.block_tables.dtype == torch.int32 and batch.tokens.dtype == torch.int64
        seen.append(padded)
        return batch, padded

    runner.prepare = prepare
    return e, seen


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prepare_matches_the_list_version_under_preemption_prefix_hits_and_aborts(pad, seed):
    rng = random.Random(seed)
    e, seen = checked_engine(pad, num_blocks=22, max_num_seqs=8, max_num_batched_tokens=rng.choice([8, 16, 40]))
    shared = [rng.randrange(V) for _ in range(12)]  # three full blocks every "chat" prompt starts with
    live = []
    for _ in range(60):
        if rng.random() < 0.4:
            head = shared if rng.random() < 0.5 else []
            prompt = head + [rng.randrange(V) for _ in range(rng.randint(1, 30))]
            n = rng.randint(1, 60 - len(prompt) if len(prompt) < 60 else 1)
            live.append(e.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=n)))
        elif live and rng.random() < 0.05:
            e.abort(live.pop(rng.randrange(len(live))))
        for out in e.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
    while e.has_unfinished():
        e.step()
    assert len(seen) > 20
    assert e.stats.num_preemptions > 0 and e.stats.prefix_cache_hits > 0
    if pad:
        assert any(seen)
    assert not e.runner.rows.row_of  # every finished request gave its row back


def test_rows_are_written_only_where_a_request_gained_blocks():
    rows = BlockTableRows(max_blocks=8, rows=1)
    table = [5, 6]
    r = rows.row("a", table)
    rows.host[r, 0] = 99  # a stale value in a written column is not rewritten: the row is not rebuilt
    table.append(7)
    assert rows.row("a", table) == r and rows.host[r, :4].tolist() == [99, 6, 7, NULL_BLOCK]
    assert rows.row("b", [3]) != r  # a second request grows the pool
    rows.release("a")
    assert rows.host[r].tolist() == [NULL_BLOCK] * 8
    assert rows.row("c", [4]) == r and rows.host[r, :2].tolist() == [4, NULL_BLOCK]
