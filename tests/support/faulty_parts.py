"""Parts that fail on purpose, for the engine's fault-isolation tests: a detokenizer that raises, a model giving NaN."""

from __future__ import annotations

from kiln.runtime.detokenizer import Detokenizer
from tests.support.fake_step import FakeStepModel


class BoomDetokenizer(Detokenizer):
    """Raises on the third token, as a broken tokenizer or stop-string search would."""

    def add(self, token_id: int) -> str | None:
        if len(self.tokens) == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "boom")
        return super().add(token_id)

    def flush(self) -> None:
        raise RuntimeError("flush boom")


class NaNStepModel(FakeStepModel):
    """The fake model, except that rows whose context contains `poison` get NaN logits."""

    def __init__(self, poison: int, vocab: int = 97):
        super().__init__(vocab)
        self.poison = poison

    def __call__(self, batch, kv_cache):
        logits = super().__call__(batch, kv_cache)
        for r, row in enumerate(batch.sample_indices.tolist()):
            if int(batch.tokens[row]) == self.poison:
                logits[r] = float("nan")
        return logits
