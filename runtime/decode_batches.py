"""The two step shapes ModelRunner.prepare stages without its general walk over the chunks: a batch of plain decodes
gathered in one pass for vectorized staging (gather_decodes -> DecodeInputs) and a speculative verification batch
written in the graph shape (b, k + 1) of the padded verification steps (write_verify_batch). Both write into
input_batch.py's host block-table rows and staging views."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.runtime.block_manager import NULL_BLOCK
from kiln.runtime.input_batch import BlockTableRows


@dataclass
class DecodeInputs:
    """A batch of plain decodes (one token each, sampled), gathered for vectorized staging."""

    starts: np.ndarray  # int64 [S]: each sequence's position (tokens already in the cache)
    tokens: list[int] | None  # the token at that position (None: not gathered, the caller has them on the device)
    rows: np.ndarray  # intp [S]: each sequence's BlockTableRows row
    width: int  # the widest block table
    ids: list[str]  # each sequence's request id (a routed model's routed state is found by it)


def gather_decodes(seqs: list, tables: dict[str, list[int]], rows: BlockTableRows, block_size: int,
                   known: bool = False, with_tokens: bool = True) -> DecodeInputs | None:
    """The inputs of a pure-decode batch (ScheduledSeqs with num_new 1 and sample), rows brought up to date; None
    when any sequence is something else (or has no table), for the general path to build. known: the schedule
    says they all are (Schedule.plain_decodes). with_tokens=False: leave the tokens out (they are not on the host
    yet: a step scheduled ahead of its predecessor's sampled ids)."""
    row_of, written = rows.row_of, rows.written
    starts, toks, row_ids, lens, ids = [], [], [], [], []
    for s in seqs:
        if not known and (s.num_new != 1 or not s.sample):
            return None
        req = s.request
        rid = req.request_id
        table = tables.get(rid)
        if table is None:
            return None
        nb = len(table)
        r = row_of.get(rid)
        row_ids.append(r if r is not None and written[rid] == nb else rows.row(rid, table))
        lens.append(nb)
        a = s.start
        if a >= nb * block_size:
            raise AssertionError(f"{rid}: {a + 1} tokens but {nb} blocks")
        starts.append(a)
        ids.append(rid)
        if not with_tokens:
            continue
        prompt = req.prompt_token_ids
        if a < len(prompt):
            toks.append(prompt[a])
        else:  # a draft model's decodes run past the known tokens (Request.token_slice has the drafts)
            out, i = req.output_token_ids, a - len(prompt)
            toks.append(out[i] if i < len(out) else req.token_slice(a, a + 1)[0])
    if not starts:
        return None
    return DecodeInputs(np.array(starts, dtype=np.int64), toks if with_tokens else None,
                        np.array(row_ids, dtype=np.intp), max(lens), ids)


def write_verify_batch(v: dict[str, np.ndarray], seqs: list, rows: list[int], host_rows: np.ndarray, q: int,
                       block_size: int) -> int:
    """Stage a verification batch in the graph shape (b, q), b = len(v["context_lens"]): sequence i's chunk is rows
    [i * q, (i + 1) * q), its 1 + n real tokens at the end and q - 1 - n padding tokens before them; the sequences
    after len(seqs) are all padding. The block tables are the caller's. Returns the longest real context.

    Real tokens end the chunk because attention aligns a chunk's queries to the end of its keys (context_lens =
    the real end): the real rows then see exactly their unpadded keys, and a padding row sees a prefix of the same
    sequence's context (nothing past it, no table column the sequence lacks; none at all when the context is
    shorter than q: the kernels give such a row 0, the reference NaN, neither read). Padding tokens write their
    K/V to the null block (slot NULL_BLOCK * block_size) and a padding sequence has context 1 on the null block,
    like a padded decode's. sample_indices lists the real rows first, in chunk order, so the step's first
    sum(1 + n) logit rows are the real ones (the rest: the padding rows, never read).
    """
    tok, pos, slot, ctx, qsl, samp = (v[k] for k in ("tokens", "positions", "slot_mapping", "context_lens",
                                                     "query_start_loc", "sample_indices"))
    n = tok.shape[0]
    tok[:], pos[:], slot[:] = 0, 0, NULL_BLOCK * block_size
    real = np.zeros(n, dtype=bool)
    k = max_ctx = 0
    for i, s in enumerate(seqs):
        a, m = s.start, s.num_new
        end, lo = a + m, (i + 1) * q - m
        p = np.arange(a, end)
        tok[lo : lo + m] = s.request.token_slice(a, end)
        pos[i * q : lo] = a  # a padding token's own position: any in range (its attention is fixed by the chunk's)
        pos[lo : lo + m] = p
        slot[lo : lo + m] = host_rows[rows[i], p // block_size].astype(np.int64) * block_size + p % block_size
        ctx[i] = end
        samp[k : k + m] = np.arange(lo, lo + m)
        real[lo : lo + m] = True
        k += m
        max_ctx = max(max_ctx, end)
    ctx[len(seqs) :] = 1
    qsl[:] = np.arange(0, n + 1, q)
    samp[k:] = np.flatnonzero(~real)
    return max_ctx
