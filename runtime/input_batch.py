"""Persistent step-input buffers: the host side of ModelRunner.prepare, O(tokens and blocks in the step).

BlockTableRows keeps one host block-table row per request with blocks, written only where the request gained
blocks since its last step (and cleared when the block manager frees it), so a step never rebuilds tables.
StepBuffers is one flat int64 staging buffer (pinned on CUDA, two of them alternating so the next step can be
written while the last copy is in flight) holding every input of a step back to back; one asynchronous copy
moves the used prefix to a device buffer of the same layout, and the StepBatch tensors are views of it. A routed
(Mixture-of-Depths) model's per-layer routed lengths and block tables ride in the same buffer.

Every input's name, dtype and shape come from its StepInput (kiln.step.STEP_INPUTS); input_shape gives its shape for
the sizes of a step, which the CUDA graphs' static buffers and the warm-up's batches use too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from kiln.runtime.block_manager import NULL_BLOCK
from kiln.step import STEP_INPUTS

# StepBatch's tensor inputs, in field order (the host-side ints are StepBatch's own).
TENSOR_INPUTS = tuple(name for name, spec in STEP_INPUTS.items() if spec.dtype is not None)


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a torch one (the staging buffer's host views are numpy)."""
    return torch.empty(0, dtype=dtype).numpy().dtype


def input_shape(name: str, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """A StepBatch tensor's shape for these sizes of its StepInput's symbols (N, R, S, W, L, WR); a flat input is
    [N] here, the graph's [1, N] being a view the step model takes."""
    spec = STEP_INPUTS[name]
    shape = spec.example(sizes)
    return shape[1:] if spec.flat else shape


_TABLE_DTYPE = numpy_dtype(STEP_INPUTS["block_tables"].dtype)


class BlockTableRows:
    """Host block-table rows, one per request, grown (doubling) as requests arrive."""

    def __init__(self, max_blocks: int, rows: int = 8):
        self.max_blocks = max_blocks
        self.host = np.full((max(rows, 1), max_blocks), NULL_BLOCK, dtype=_TABLE_DTYPE)  # np.take's `out` dtype
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


def _by_dtype() -> tuple[tuple[torch.dtype, tuple[str, ...]], ...]:
    """The tensor inputs grouped by dtype, widest first (int64, then int32)."""
    groups: dict[torch.dtype, list[str]] = {}
    for name in TENSOR_INPUTS:
        groups.setdefault(STEP_INPUTS[name].dtype, []).append(name)
    return tuple(sorted(((dt, tuple(names)) for dt, names in groups.items()), key=lambda g: -g[0].itemsize))


_WORD = torch.int64  # the staging buffer's element; each other dtype's group is a view of its words as that dtype
_ALIGN = 16  # bytes each section starts at a multiple of (see Layout)
_GROUPS = _by_dtype()
_NUMPY = {dt: numpy_dtype(dt) for dt, _ in _GROUPS}
# What Layout reads per group, looked up once: dtype, element size, (name, routed) of each input.
_PLAN = tuple((dt, dt.itemsize, tuple((n, STEP_INPUTS[n].routed) for n in names)) for dt, names in _GROUPS)


@dataclass
class Layout:
    """Where each tensor input sits in the staging buffer: its StepInput's dtype and shape for these sizes, grouped
    by dtype (_GROUPS). Every section starts 16 bytes aligned: Triton specializes a kernel on its pointers' 16-byte
    alignment, so misaligned views would compile other variants than the warm-up's (aligned) tensors."""

    n: int  # tokens (N)
    r: int  # sampled rows (R)
    s: int  # sequences, padding included (S)
    w: int  # block-table width (W)
    nr: int = 0  # routed layers (L, Mixture-of-Depths): none means no routed inputs
    wr: int = 0  # routed block-table width (WR)

    def __post_init__(self) -> None:
        sizes = {"N": self.n, "R": self.r, "S": self.s, "W": self.w, "L": self.nr, "WR": self.wr}
        # Per dtype: its first word and its inputs' (name, start, end, shape; None when 1-D) in its elements from there.
        self.groups: list[tuple[torch.dtype, int, tuple[tuple[str, int, int, tuple[int, ...] | None], ...]]] = []
        at = 0  # bytes
        for dtype, size, names in _PLAN:
            first, entries = at, []
            for name, routed in names:
                if routed and not self.nr:
                    continue
                shape = input_shape(name, sizes)
                a, numel = (at - first) // size, math.prod(shape)
                entries.append((name, a, a + numel, shape if len(shape) > 1 else None))
                at = _up(at + numel * size, _ALIGN)
            if entries:
                self.groups.append((dtype, first // _WORD.itemsize, tuple(entries)))
        self.size = at // _WORD.itemsize  # int64 words used

    @property
    def sections(self) -> dict[torch.dtype, dict[str, tuple[int, int]]]:
        """Each dtype's inputs by name: (start, length) in elements of that dtype from the group's first word."""
        return {dtype: {name: (a, b - a) for name, a, b, _ in entries} for dtype, _, entries in self.groups}


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
        self.host = [torch.zeros(capacity, dtype=_WORD, pin_memory=self.cuda) for _ in range(self.slots)]
        self.dev = torch.zeros(capacity, dtype=_WORD, device=self.device) if self.cuda else None

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
    """The named inputs in a flat int64 buffer (numpy array or tensor) for `lay`, each in its dtype and shape."""
    host = isinstance(buf, np.ndarray)
    views = {}
    for dtype, first, entries in lay.groups:
        part = buf[first:] if first else buf  # the first group starts the buffer: no slice to make
        if dtype != _WORD:
            part = part.view(_NUMPY[dtype] if host else dtype)
        for name, a, b, shape in entries:
            views[name] = part[a:b] if shape is None else part[a:b].reshape(shape)
    return views
