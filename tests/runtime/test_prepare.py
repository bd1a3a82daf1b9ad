"""ModelRunner.prepare on persistent buffers gives the same inputs as the list-building version it replaced.

`legacy_prepare` is that version (before the persistent buffers): bench/legacy_prepare.py, the oracle here and
bench/prepare.py's baseline. Random workloads on a small pool (preemption), with shared prompt prefixes
(prefix-cache hits), chunked prefills, aborts and padded decode batches compare every step's tensors.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from kiln.runtime.block_manager import NULL_BLOCK
from kiln.runtime.engine import Engine
from kiln.runtime.input_batch import BlockTableRows
from kiln.runtime.sampling_params import SamplingParams
from tests.support.fake_step import FakeStepModel, fake_config

V = 97


def _load_legacy():
    # bench/ is a folder of scripts, not a package: load the one module by its path.
    path = Path(__file__).resolve().parents[2] / "bench" / "legacy_prepare.py"
    spec = importlib.util.spec_from_file_location("bench_legacy_prepare", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


legacy_prepare = _load_legacy().legacy_prepare


def checked_engine(pad: bool, **kw) -> tuple[Engine, list[int]]:
    """An engine whose runner compares every prepare() with legacy_prepare(); the list counts compared steps."""
    e = Engine(FakeStepModel(V), None, fake_config(64), block_size=4, pad_decode_batches=pad, **kw)
    runner, real, seen = e.runner, e.runner.prepare, []

    def prepare(sched, tokens=None, prompt=None):
        assert tokens is None  # no async scheduling here: every token is on the host (test_engine_async has it)
        assert prompt is None  # no prompt_logprobs here (tests/runtime/test_prompt_logprobs.py has them)
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


@pytest.mark.parametrize(("n", "r", "s", "w", "nr", "wr"),
                         [(7, 3, 3, 5, 0, 0), (1, 1, 1, 1, 2, 3), (13, 13, 5, 9, 3, 7)])
def test_every_step_input_starts_16_bytes_aligned(n, r, s, w, nr, wr):
    """Triton specializes kernels on 16-byte pointer alignment: the views of the one staging buffer must be aligned
    as the warm-up's own tensors are, or the first real steps compile other variants."""
    from kiln.runtime.input_batch import StepBuffers, layout

    lay = layout(n, r, s, w, nr, wr)
    bufs = StepBuffers(torch.device("cpu"))
    staged = bufs.stage(lay)
    views = bufs.upload(lay)
    assert set(views) == set(staged) and ("routed_lens" in views) == bool(nr)
    for name, t in views.items():
        assert t.data_ptr() % 16 == 0, name
        assert staged[name].ctypes.data % 16 == 0, name
    sizes = {"tokens": n, "positions": n, "slot_mapping": n, "sample_indices": r, "context_lens": s,
             "query_start_loc": s + 1, "block_tables": s * w, "routed_lens": nr * s, "routed_block_tables": nr * s * wr}
    assert {k: v.numel() for k, v in views.items()} == {k: v for k, v in sizes.items() if k in views}
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in views.values() if t.numel())
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:], strict=False)), "sections overlap"
    assert max(e for _, e in ends) <= views["tokens"].data_ptr() + lay.size * 8
