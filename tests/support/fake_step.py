"""A tiny deterministic StepModel for runtime tests: it really uses the paged KV cache.

Each new token's (token, position + 1) is written to its slot; a sampled row reads its whole context back
through the block table and checks every slot holds the expected position (so a wrong slot mapping, block
table or a block shared when it should not be fails loudly). The next token is a fixed function of the
context, which `fake_generate` computes without any cache: the oracle.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.model_config import ModelConfig
from kiln.step import KVCache, StepBatch


def fake_next(tokens: Sequence[int], vocab: int) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 7 + len(tokens)) % vocab


def fake_logits(tokens: Sequence[int], vocab: int) -> torch.Tensor:
    # A peak at the next token and a smooth tail, so sampling with temperature has something to do.
    target = fake_next(tokens, vocab)
    return -((torch.arange(vocab) - target) % vocab).float() / 4


def fake_generate(prompt: Sequence[int], max_tokens: int, vocab: int, stop_ids: Sequence[int] = ()) -> list[int]:
    toks, out = list(prompt), []
    for _ in range(max_tokens):
        t = fake_next(toks, vocab)
        out.append(t)
        toks.append(t)
        if t in stop_ids:
            break
    return out


class FakeStepModel:
    num_layers = 1
    num_kv_heads = 1
    head_dim = 2
    dtype = torch.float64
    kv_dtype = torch.float64
    device = torch.device("cpu")

    def __init__(self, vocab: int = 97):
        self.vocab = vocab
        self.calls = 0
        self.batch_sizes: list[int] = []  # sequences per call (padding included)

    def __call__(self, batch: StepBatch, kv_cache: KVCache) -> torch.Tensor:
        self.calls += 1
        self.batch_sizes.append(batch.num_seqs)
        bs = kv_cache.block_size
        cache = kv_cache.data[0, 0].view(-1, 2)  # [slots, 2]
        cache[batch.slot_mapping, 0] = batch.tokens.double()
        cache[batch.slot_mapping, 1] = batch.positions.double() + 1
        qsl = batch.query_start_loc.tolist()
        assert qsl[-1] == batch.num_tokens and len(qsl) == batch.num_seqs + 1
        q_lens = [b - a for a, b in zip(qsl, qsl[1:], strict=False)]
        assert max(q_lens) <= batch.max_query_len and max(batch.context_lens.tolist()) <= batch.max_context_len
        rows = []
        for row in batch.sample_indices.tolist():
            seq = max(i for i in range(batch.num_seqs) if qsl[i] <= row)
            pos = int(batch.positions[row])
            # a speculative chunk samples every row; its last row is the end of the context
            behind = qsl[seq + 1] - 1 - row
            assert 0 <= behind and pos + 1 + behind == int(batch.context_lens[seq]), "sampled a row off its context"
            p = torch.arange(pos + 1)
            slots = batch.block_tables[seq, p // bs].long() * bs + p % bs
            stored = cache[slots]
            assert torch.equal(stored[:, 1], (p + 1).double()), f"row {row}: the cache holds the wrong positions"
            rows.append(self.logits(stored[:, 0].long().tolist()))
        return torch.stack(rows) if rows else torch.empty(0, self.vocab)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        return fake_logits(tokens, self.vocab)


class FakeDraftModel(FakeStepModel):
    """A drafter for FakeStepModel that is wrong after every third token (its peak moves one id over), so drafts
    are accepted and rejected; it checks its own cache the same way."""

    def logits(self, tokens: list[int]) -> torch.Tensor:
        return fake_logits(tokens, self.vocab).roll(1 if len(tokens) % 3 == 0 else 0)


def fake_config(context: int = 128, vocab: int = 97) -> ModelConfig:
    from kiln.model_config import NormConfig

    return ModelConfig(name="fake", vocab=vocab, dim=2, layers=1, heads=1, kv_heads=1, head_dim=2, ffn=2,
                       context=context, norm=NormConfig("rms", 1e-5), body=())


class HostOnlyModel:
    """What ModelRunner needs to build batches; prepare() never calls it."""

    num_layers, num_kv_heads, head_dim, vocab = 1, 1, 1, 50
    dtype = kv_dtype = torch.float32
    device = torch.device("cpu")
