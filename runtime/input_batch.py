"""Persistent step-input buffers: the host side of ModelRunner.prepare, O(tokens and blocks in the step).

BlockTableRows keeps one host block-table row per request with blocks, written only where the request gained
blocks since its last step (and cleared when the block manager frees it), so a step never rebuilds tables.
StepBuffers is one flat int64 staging buffer (pinned on CUDA, two of them alternating so the next step can be
written while the last copy is in flight) holding every input of a step back to back; one asynchronous copy
moves the used prefix to a device buffer of the same layout, and the StepBatch tensors are views of it. A routed
(Mixture-of-Depths) model's per-layer routed lengths and block tables ride in the same buffer, after the dense
block table.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kiln.runtime.block_manager import NULL_BLOCK


class BlockTableRows:
    """Host block-table rows, one per request, grown (doubling) as requests arrive."""

    def __init__(self, max_blocks: int, rows: int = 8):
        self.max_blocks = max_blocks
        self.host = np.full((max(rows, 1), max_blocks), NULL_BLOCK, dtype=np.int32)
        self.row_of: dict[str, int] = {}
        self.written: dict[str, int] = {}  # blocks of the request's table already in its row
        self.free_rows = list(range(self.host.shape[0] - 1, -1, -1))

    def row(self, request_id: str, table: list[int]) -> int:
        """The request's row, with any blocks appended to its table since the last call written into it."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self.free_rows:
                self._grow()
            row = self.row_of[request_id] = self.free_rows.pop()
            self.written[request_id] = 0
        done = self.written[request_id]
        if len(table) > done:
            self.host[row, done : len(table)] = table[done:]
            self.written[request_id] = len(table)
        return row

    def release(self, request_id: str) -> None:
        """Forget the request's row (the block manager freed its blocks); the row is reset to the null block."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.host[row, : self.written.pop(request_id)] = NULL_BLOCK
            self.free_rows.append(row)

    def truncate(self, request_id: str, keep: int) -> None:
        """The request's table was cut to `keep` blocks: reset the rest of its row, rewrite it when it regrows."""
        row = self.row_of.get(request_id)
        if row is not None and self.written[request_id] > keep:
            self.host[row, keep : self.written[request_id]] = NULL_BLOCK
            self.written[request_id] = keep

    def _grow(self) -> None:
        old = self.host.shape[0]
        self.host = np.concatenate([self.host, np.full_like(self.host, NULL_BLOCK)])
        self.free_rows.extend(range(2 * old - 1, old - 1, -1))


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass
class Layout:
    """Where each input sits in the staging buffer: int64 sections, then int32 sections in the int32 tail. Every
    section starts 16 bytes aligned (2 int64 / 4 int32 words): Triton specializes a kernel on its pointers'
    16-byte alignment, so misaligned views would compile other variants than the warm-up's (aligned) tensors."""

    n: int  # tokens
    r: int  # sampled rows
    s: int  # sequences (padding included)
    w: int  # block-table width
    nr: int = 0  # routed layers (Mixture-of-Depths): their lengths and block tables follow the dense table
    wr: int = 0  # routed block-table width

    def __post_init__(self) -> None:
        n, r, s, w, nr, wr = self.n, self.r, self.s, self.w, self.nr, self.wr
        # int64 sections (start, length) in words, then int32 ones relative to the int32 tail
        self.i64 = {}
        at = 0
        for name, size in (("tokens", n), ("positions", n), ("slot_mapping", n), ("sample_indices", r)):
            self.i64[name] = (at, size)
            at = _up(at + size, 2)
        self.i32_start = at
        self.i32 = {}
        at = 0
        for name, size in (("context_lens", s), ("query_start_loc", s + 1), ("block_tables", s * w),
                           ("routed_lens", nr * s), ("routed_block_tables", nr * s * wr)):
            if name.startswith("routed") and not nr:
                continue
            self.i32[name] = (at, size)
            at = _up(at + size, 4)
        self.i32_words = at

    @property
    def size(self) -> int:  # int64 words used
        return self.i32_start + self.i32_words // 2


@functools.lru_cache(maxsize=256)
def layout(n: int, r: int, s: int, w: int, nr: int = 0, wr: int = 0) -> Layout:
    """The layout for these sizes; shared (never mutated), since a decode batch's sizes repeat step after step."""
    return Layout(n, r, s, w, nr, wr)


class StepBuffers:
    """The staging (host) and device buffers; views() gives numpy views to fill, tensors() the device views."""

    def __init__(self, device: torch.device, capacity: int = 4096):
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots = 2 if self.cuda else 1
        self.turn = 0
        self.events: list[torch.cuda.Event | None] = [None] * self.slots
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        for ev in self.events:  # no copy may still read a buffer that is dropped
            if ev is not None:
                ev.synchronize()
        self.capacity = capacity
        self.host = [torch.zeros(capacity, dtype=torch.int64, pin_memory=self.cuda) for _ in range(self.slots)]
        self.dev = torch.zeros(capacity, dtype=torch.int64, device=self.device) if self.cuda else None

    def stage(self, lay: Layout) -> dict[str, np.ndarray]:
        """Numpy views of the next staging buffer for `lay`, once the copy that last read it has finished."""
        if lay.size > self.capacity:
            self._alloc(max(lay.size, 2 * self.capacity))
        self.turn = (self.turn + 1) % self.slots
        ev = self.events[self.turn]
        if ev is not None:
            ev.synchronize()
        return _views(self.host[self.turn].numpy(), lay)

    def upload(self, lay: Layout) -> dict[str, torch.Tensor]:
        """One copy of the staged prefix to the device (asynchronous on CUDA); the step's tensors as its views."""
        host = self.host[self.turn]
        if not self.cuda:
            return _views(host, lay)
        self.dev[: lay.size].copy_(host[: lay.size], non_blocking=True)
        ev = self.events[self.turn] = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return _views(self.dev, lay)


def _views(buf, lay: Layout) -> dict:
    """The named slices of a flat int64 buffer (numpy array or tensor) for `lay`."""
    i32 = buf[lay.i32_start : lay.size]
    i32 = i32.view(np.int32) if isinstance(buf, np.ndarray) else i32.view(torch.int32)
    views = {name: buf[a : a + m] for name, (a, m) in lay.i64.items()}
    views |= {name: i32[a : a + m] for name, (a, m) in lay.i32.items()}
    s, w, nr, wr = lay.s, lay.w, lay.nr, lay.wr
    views["block_tables"] = views["block_tables"].reshape(s, w)
    if nr:
        views["routed_lens"] = views["routed_lens"].reshape(nr, s)
        views["routed_block_tables"] = views["routed_block_tables"].reshape(nr, s, wr)
    return views


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
