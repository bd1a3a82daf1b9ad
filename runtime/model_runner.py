"""From a Schedule to a StepBatch, and the call into the step model (eager, or a CUDA-graph replay).

Padded steps and their CUDA graphs, and everything else set up when a runner is made: runtime/runner_setup.py
(ModelRunner is a RunnerSetup).

A Mixture-of-Depths model (block manager: runtime.routed_blocks.RoutedBlockManager) also gets, per routed layer, its
routed lengths and block tables (gathered by request slot from the block manager's numpy mirror of them,
runtime/routed_state.py, on the decode fast path too), and its step returns which rows each routed layer routed:
copied to the host behind the step and recorded for the whole batch when the block manager is next used
(RoutedBlockManager.record_step), which gives back the blocks reserved for tokens that were not routed. Its decodes
are padded and replayed from graphs like a dense model's: a padding row is a sequence of routed length 0 whose
routed tables are the null block, so if its router (which sees a dummy token) routes it, kiln::mod_kv_slots sends
its K/V to entry 0 of that routed pool's null block, and the host reads only the real rows' routed flags. The graphs
hold the routed lengths and full-width routed tables in static buffers (a replay copies the batch's real columns, as
for the dense tables); the routing is data, and everything after it (compaction, slots, attention, scatter) is
table-driven on the device, so one capture serves every routing. The routed flags are a graph output, read back
after the replay.
A routed model gets no verification graphs (speculation is refused for it).

A draft model's runner (runtime/speculative.py) shares the block manager, pads and replays its decode steps the
same way when the target's runner does, and may be given an existing cache (the target's first layers, as a
view) instead of allocating its own.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.runtime.block_manager import NULL_BLOCK
from kiln.runtime.decode_batches import DecodeInputs, gather_decodes, write_verify_batch
from kiln.runtime.input_batch import Layout, layout
from kiln.runtime.prompt_logprobs import PromptRows
from kiln.runtime.routed_state import RoutedState
from kiln.runtime.runner_setup import RunnerSetup
from kiln.runtime.sampler import to_device
from kiln.runtime.schedule import Schedule, ScheduledSeq
from kiln.step import StepBatch


class ModelRunner(RunnerSetup):
    # Decode batches from this many sequences on are staged with numpy (gather_decodes); below it the per-element
    # writes of the general path cost less than numpy's fixed overhead (bench/prepare.py: ~10 us at 1..8).
    decode_numpy_min_seqs = 16

    # ---- batch building -----------------------------------------------------------------------------------

    def prepare(self, sched: Schedule, tokens: torch.Tensor | None = None,
                prompt: PromptRows | None = None) -> tuple[StepBatch, int]:
        """The StepBatch for a schedule, and the batch size (sequences) it was padded to for a graph (0: none).

        Costs O(tokens + blocks in the step): tables come from the persistent rows (written when a request
        gains blocks), everything is staged in one buffer and copied to the device once. The batch's tensors
        are views of the runner's buffers, valid until the next prepare().

        tokens: the input tokens of the schedule's first len(tokens) chunks, decodes whose tokens are still on the
        device (int64, the last step's sampled ids; the engine's async scheduling): copied into the batch there,
        after its upload, in stream order, so the host never reads them. A routed model's lengths c_j are then
        gathered as recorded, before the step in flight, whose routed counts are added on the device too.

        prompt: rows that score prompt tokens (runtime/prompt_logprobs.py), put in sample_indices after the sampled
        rows; such a step is built by the general path, never padded.
        """
        if tokens is None:
            return self._stage(sched, prompt=prompt)
        k = tokens.shape[0]
        if tokens.dim() != 1 or k > len(sched.seqs):
            raise AssertionError(f"device tokens {tuple(tokens.shape)} for a schedule of {len(sched.seqs)} chunks")
        batch, padded = self._stage(sched, k, prompt)
        batch.tokens[:k].copy_(tokens, non_blocking=True)
        if self.num_routed:
            self._add_pending_routing(batch, sched.seqs)
        return batch, padded

    def _stage(self, sched: Schedule, on_device: int = 0, prompt: PromptRows | None = None) -> tuple[StepBatch, int]:
        """prepare() but the device tokens: the first on_device chunks' tokens are left for the caller to write."""
        bs, seqs = self.block_size, sched.seqs
        if prompt is not None:
            assert not on_device and not sched.plain_decodes, "prompt rows come with a step scheduled from the host"
        elif on_device and sched.plain_decodes and on_device == len(seqs):
            dec = gather_decodes(seqs, self.bm.tables, self.rows, bs, True, with_tokens=False)
            return self._prepare_decodes(dec, settle=False)
        if len(seqs) >= self.decode_numpy_min_seqs and not on_device and prompt is None:
            dec = gather_decodes(seqs, self.bm.tables, self.rows, bs, sched.plain_decodes)
            if dec is not None:
                return self._prepare_decodes(dec)
        padded = self._verify_pad_size(sched) if self.verify_len and prompt is None else 0
        if padded:
            return self._prepare_verify(seqs, padded), padded
        tables, rows, width = self._tables(seqs)
        padded = self._pad_size(sched)
        assert not (padded and prompt), "a step with prompt rows is never a padded decode batch"
        extra = padded - len(seqs) if padded else 0
        n = sum(s.num_new for s in seqs)
        routed, routed_slots, routed_width = self._routed_slots([s.request.request_id for s in seqs], not on_device)
        num_prompt = len(prompt.rows) if prompt is not None else 0
        lay = layout(n + extra, (padded or sum(s.num_rows for s in seqs)) + num_prompt, len(seqs) + extra, width,
                     self.num_routed, routed_width)
        v = self.buffers.stage(lay)
        tok, pos, slot, ctx, qsl, samp = (v[k] for k in ("tokens", "positions", "slot_mapping", "context_lens",
                                                         "query_start_loc", "sample_indices"))
        host_rows = self.rows.host
        q = k = max_ctx = max_new = 0
        qsl[0] = 0
        for i, s in enumerate(seqs):
            a, m = s.start, s.num_new
            end = a + m
            assert len(tables[i]) * bs >= end, f"{s.request.request_id}: {end} tokens but {len(tables[i])} blocks"
            if m == 1:  # decode: scalar writes, no temporaries
                tok[q] = s.request.token_slice(a, end)[0] if i >= on_device else 0
                pos[q] = a
                slot[q] = tables[i][a // bs] * bs + a % bs
            else:
                p = np.arange(a, end)
                tok[q : q + m] = s.request.token_slice(a, end)
                pos[q : q + m] = p
                slot[q : q + m] = host_rows[rows[i], p // bs].astype(np.int64) * bs + p % bs
            q += m
            ctx[i] = end
            qsl[i + 1] = q
            max_ctx, max_new = max(max_ctx, end), max(max_new, m)
            if s.sample and not padded:
                r = s.num_rows
                samp[k : k + r] = np.arange(q - r, q) if r > 1 else q - 1
                k += r
        if num_prompt:
            samp[k : k + num_prompt] = prompt.rows
        bt = v["block_tables"]
        np.take(host_rows[:, :width], rows, axis=0, out=bt[: len(seqs)])
        if self.num_routed:  # padding columns are written by _pad
            routed.gather(routed_slots, v["routed_lens"][:, : len(seqs)], v["routed_block_tables"][:, : len(seqs)])
        if padded:
            self._pad(v, n, len(seqs), padded)
        return self._upload(lay, 1 if padded else max_new, max_ctx), padded

    def _add_pending_routing(self, batch: StepBatch, seqs: list[ScheduledSeq]) -> None:
        """c_j of a step scheduled ahead: the batch holds them as recorded, before the step in flight (if its
        routing is still pending: RoutedBlockManager.pending_step); add, on the device, how many of each
        sequence's tokens in that step each routed layer routed."""
        p = self.bm.pending_step()
        if p is None:
            return
        cols, src = [], []
        for i, s in enumerate(seqs):
            j = p.index(s.request.request_id)
            if j is not None:
                cols.append(i)
                src.append(j)
        if not cols:
            return
        lens = batch.routed_lens
        flags = torch.as_tensor(p.flags).to(lens.device)
        if p.num_new is None:  # decodes: sequence j's token is row j
            counts = flags[:, : len(p.ids)].to(lens.dtype)
        else:  # per sequence, the sum of its rows' flags: differences of a running sum at the row boundaries
            ends = np.cumsum(p.num_new)
            run = torch.zeros((flags.shape[0], int(ends[-1]) + 1), dtype=torch.int64, device=lens.device)
            run[:, 1:] = flags[:, : int(ends[-1])].to(torch.int64).cumsum(1)
            bounds = to_device(torch.from_numpy(np.stack([ends - np.asarray(p.num_new), ends])), lens.device)
            counts = (run[:, bounds[1]] - run[:, bounds[0]]).to(lens.dtype)
        n = len(cols)
        if cols == list(range(n)) and src == list(range(n)):  # the same sequences in the same order: no gather
            lens[:, :n] += counts[:, :n]
        else:
            idx = to_device(torch.tensor([cols, src]), lens.device)
            lens[:, idx[0]] += counts[:, idx[1]]
        self.num_routing_ahead += 1

    def _tables(self, seqs: list[ScheduledSeq]) -> tuple[list[list[int]], list[int], int]:
        """The sequences' block tables, their persistent host rows and the widest table."""
        tables = [self.bm.table(s.request.request_id) for s in seqs]
        rows = [self.rows.row(s.request.request_id, t) for s, t in zip(seqs, tables, strict=True)]
        return tables, rows, max(len(t) for t in tables)

    def _routed_slots(self, request_ids: list[str], settle: bool = True
                      ) -> tuple[RoutedState | None, np.ndarray | None, int]:
        """A routed model's state (runtime/routed_state.py), the requests' slots in it and their widest routed
        table, which the step's routed lengths and tables are gathered from; (None, None, 0) for a dense model.
        settle False: the state as recorded, without the step in flight (see prepare)."""
        if not self.num_routed:
            return None, None, 0
        routed = self.bm.routed_state(settle)
        slots = routed.slots(request_ids)
        return routed, slots, routed.width(slots)

    def _prepare_decodes(self, dec: DecodeInputs, settle: bool = True) -> tuple[StepBatch, int]:
        """prepare() for plain decodes: the same inputs, written with numpy from the gathered lists."""
        bs, st, rows = self.block_size, dec.starts, dec.rows
        n = len(st)
        padded = self._decode_pad_size(n)
        routed, routed_slots, routed_width = self._routed_slots(dec.ids, settle)
        lay = layout(padded or n, padded or n, padded or n, dec.width, self.num_routed, routed_width)
        v = self.buffers.stage(lay)
        host_rows = self.rows.host
        if dec.tokens is not None:  # else the caller writes them on the device
            v["tokens"][:n] = dec.tokens
        v["positions"][:n] = st
        v["slot_mapping"][:n] = host_rows[rows, st // bs].astype(np.int64) * bs + st % bs
        v["context_lens"][:n] = st + 1
        v["query_start_loc"][: n + 1] = np.arange(n + 1)
        np.take(host_rows[:, : dec.width], rows, axis=0, out=v["block_tables"][:n])
        if self.num_routed:
            routed.gather(routed_slots, v["routed_lens"][:, :n], v["routed_block_tables"][:, :n])
        if padded:
            self._pad(v, n, n, padded)
        else:
            v["sample_indices"][:] = np.arange(n)
        return self._upload(lay, 1, int(st.max()) + 1), padded
    def _prepare_verify(self, seqs: list[ScheduledSeq], padded: int) -> StepBatch:
        """prepare() for a verification batch padded to (padded, k + 1): see decode_batches.write_verify_batch."""
        q, bs = self.verify_len, self.block_size
        tables, rows, width = self._tables(seqs)
        for s, t in zip(seqs, tables, strict=True):
            end = s.start + s.num_new
            assert len(t) * bs >= end, f"{s.request.request_id}: {end} tokens but {len(t)} blocks"
        lay = layout(padded * q, padded * q, padded, width)
        v = self.buffers.stage(lay)
        max_ctx = write_verify_batch(v, seqs, rows, self.rows.host, q, bs)
        bt = v["block_tables"]
        np.take(self.rows.host[:, :width], rows, axis=0, out=bt[: len(seqs)])
        bt[len(seqs) :] = NULL_BLOCK
        return self._upload(lay, q, max_ctx)

    def _pad(self, v: dict[str, np.ndarray], n: int, num_seqs: int, padded: int) -> None:
        """Padding rows after n tokens of num_seqs decodes: one token each, written to and read from the null
        block, every row sampled. In each routed layer a padding sequence has routed length 0 and the null block
        for a table, so a padding row its router routes writes and reads entry 0 of that pool's null block."""
        v["tokens"][n:], v["positions"][n:], v["slot_mapping"][n:] = 0, 0, NULL_BLOCK * self.block_size
        v["context_lens"][num_seqs:] = 1
        v["query_start_loc"][num_seqs + 1 :] = np.arange(n + 1, n + 1 + padded - num_seqs)
        v["block_tables"][num_seqs:] = NULL_BLOCK
        v["sample_indices"][:] = np.arange(padded)
        if "routed_lens" in v:
            v["routed_lens"][:, num_seqs:] = 0
            v["routed_block_tables"][:, num_seqs:] = NULL_BLOCK

    def _upload(self, lay: Layout, max_query_len: int, max_context_len: int) -> StepBatch:
        """The staged inputs on the device, by name (a dense model's layout has no routed ones: they stay None)."""
        return StepBatch(**self.buffers.upload(lay), max_query_len=max_query_len, max_context_len=max_context_len)
    # ---- execution ----------------------------------------------------------------------------------------

    def execute(self, sched: Schedule, tokens: torch.Tensor | None = None,
                prompt: PromptRows | None = None) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """fp32 logits [R, vocab] and the sampled sequences in row order: one row per sequence, 1 + n rows for a
        speculative decode with n drafts. tokens: plain decodes' input tokens on the device (see prepare). prompt:
        rows that score prompt tokens; their logits go to prompt.logits, in the model's dtype (their fp32 copy is
        made a block of rows at a time, runtime/prompt_logprobs.py)."""
        sampled = sched.seqs if sched.plain_decodes else [s for s in sched.seqs if s.sample]
        num_rows = len(sampled) if sched.plain_decodes else sum(s.num_rows for s in sampled)
        batch, padded = self.prepare(sched, tokens, prompt)
        with torch.inference_mode():
            if self.num_routed:  # a one-token prefill after a prefix hit can be a graph's decode batch too
                self._copy_routed_blocks()
            logits = self._replay(batch) if padded else None
            if logits is None:
                logits = self.model(batch, self.kv_cache)
        if self.num_routed:  # [routed layers, N]: real rows in schedule order, then padding (never recorded)
            logits, routed = logits
            self.bm.record_step(sched.seqs, routed, sched.plain_decodes)  # copied behind the step, recorded later
        if prompt is not None:
            prompt.logits = logits[num_rows : num_rows + len(prompt.rows)]
        return logits[:num_rows].float(), sampled

    def _replay(self, batch: StepBatch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """Count a padded step; its graph's output after a replay, or None (no graph: run it eagerly)."""
        st = self.graph_stats
        if batch.max_query_len == 1:
            st.padded_decodes += 1
        else:
            st.padded_verifications += 1
        return self.cuda_graphs.replay(batch) if self.cuda_graphs is not None else None

    def _copy_routed_blocks(self) -> None:
        """Copy-on-write of routed blocks that prefix hits share partially filled (RoutedBlockManager.match_prefix),
        before the step writes anything."""
        routed = self.kv_cache.routed
        for layer, src, dst in self.bm.take_copies():
            routed[layer, :, dst].copy_(routed[layer, :, src])
