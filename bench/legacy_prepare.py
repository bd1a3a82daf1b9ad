"""The list-building ModelRunner.prepare that persistent step buffers replaced (issue 9), kept as a baseline:
bench/prepare.py times it against the current prepare, tests/runtime/test_prepare.py uses it as the oracle.

Importable from bench scripts (bench/ is their sys.path[0]) and loaded by file path from the tests; it imports
only kiln.
"""

from __future__ import annotations

import torch

from kiln.runtime.block_manager import NULL_BLOCK
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.schedule import Schedule

# StepBatch's tensor fields as the old prepare built them (the ints max_query_len / max_context_len stay ints).
DTYPES = {"tokens": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64, "block_tables": torch.int32,
          "context_lens": torch.int32, "query_start_loc": torch.int32, "sample_indices": torch.int64}


def legacy_prepare(runner: ModelRunner, sched: Schedule) -> tuple[dict, int]:
    """(the step inputs as Python lists and ints, the padded batch size or 0): rows padded to the CUDA-graph size
    and block tables to max_model_len / block_size when the runner pads the batch."""
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


def legacy_tensors(values: dict) -> dict[str, torch.Tensor]:
    """The old prepare's last step: every list made a host tensor with torch.tensor."""
    return {name: torch.tensor(values[name], dtype=dtype) for name, dtype in DTYPES.items()}
