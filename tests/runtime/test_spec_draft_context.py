"""A draft model with a shorter context than the target's: a request is drafted only while its tokens and drafts fit
the draft's context, then decodes without drafts; no error or warning per step (the drafter never runs past its
positions: a learned position table would be indexed past its end, rope would run past what the draft was made for),
the same greedy tokens as without speculation, and the speculative counters count only the drafted rows."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.llm import LLM
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import ModelDrafter
from kiln.spec.loader import load_spec
from tests.support.speculative import other_draft, run_requests, spec_models

DRAFT_CONTEXT = 32
K = 4


class RecordingDrafter(ModelDrafter):
    """A ModelDrafter that records, per proposal, the sequence's last known position, its slots and its draft."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.seen: list[tuple[int, int, int]] = []  # (start, slots reserved, tokens drafted)

    def propose(self, seqs):
        drafts = super().propose(seqs)
        self.seen += [(s.start, s.num_drafts, len(d.tokens)) for s, d in zip(seqs, drafts, strict=True)]
        return drafts


@pytest.fixture(scope="module", params=["tiny-gpt2", "tiny-llama"], ids=["learned positions", "rope"])
def models(request):
    sm = spec_models(request.param)
    return sm, other_draft(sm, 1, layers=1, context=DRAFT_CONTEXT)


def _trace() -> list:
    """Prompts below, across and past the draft's context, greedy, long enough to cross it."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [([(i * 7 + j) % 200 + 1 for i in range(n)], params) for j, n in enumerate((5, 20, DRAFT_CONTEXT + 8))]


def test_requests_past_the_draft_context_decode_without_drafts_and_without_a_word(models, caplog):
    sm, draft = models
    m = sm.loaded
    want = run_requests(Engine(sm.target, m.tokenizer, m.model, max_num_seqs=4), _trace())
    drafter = RecordingDrafter(draft, K, context=DRAFT_CONTEXT)
    engine = Engine(sm.target, m.tokenizer, m.model, max_num_seqs=4, drafter=drafter, speculation_max_batch=4)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kiln"):
        got = run_requests(engine, _trace())
    assert got == want  # greedy: the target's tokens whatever the draft did
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    drafted = [(start, n) for start, _, n in drafter.seen if n]
    assert drafted, "nothing was drafted before the draft's context"
    # the draft model is fed positions start .. start + n - 1: all within its context, up to its last position
    assert all(start + n <= DRAFT_CONTEXT for start, n in drafted)
    assert max(start + n for start, n in drafted) == DRAFT_CONTEXT  # the boundary itself is drafted
    # the scheduler reserves no slot past it either (no budget or block spent on drafts that cannot be made)
    assert all(start + slots <= DRAFT_CONTEXT for start, slots, _ in drafter.seen)
    assert engine.scheduler.spec_context == DRAFT_CONTEXT
    st = engine.stats
    assert st.spec_drafter_failures == 0
    assert st.spec_proposed == sum(n for _, n in drafted)  # the counters count the drafted rows only
    assert st.spec_rows == len(drafted)
    assert st.spec_emitted <= st.num_generated_tokens == sum(len(ids) for ids in got)


def test_the_draft_context_is_checked():
    sm = spec_models("tiny-llama")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(KilnError, match="the draft model's context must be an integer >= 1"):
            ModelDrafter(sm.target, K, context=bad)


def test_llm_with_a_shorter_context_draft_spec_speculates_up_to_it_only(tmp_path, caplog):
    """The audit's case end to end: tiny-gpt2 (context 256) drafted by a context-64 copy of itself."""
    text = Path(load_spec("tiny-gpt2").path).read_text().replace("context = 256", "context = 64")
    (tmp_path / "d.kiln").write_text(text.replace('"tiny-gpt2"', '"d"'))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(i * 7) % 200 + 1 for i in range(n)]} for n in (44, 100)]
    want = [o.outputs[0].token_ids for o in LLM("tiny-gpt2").generate(prompts, params, use_tqdm=False)]
    llm = LLM("tiny-gpt2", speculation={"kind": "draft", "spec": str(tmp_path / "d.kiln"), "k": 4})
    caplog.clear()  # what loading said (no tokenizer.json) is not this test's business
    with caplog.at_level(logging.INFO, logger="kiln"):
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    c = llm.engine.spec_counters
    assert c.drafter_failures == 0
    assert got[0].metrics.num_draft_tokens > 0  # the 44-token prompt drafts until it passes 61 tokens
    assert got[1].metrics.num_draft_tokens == 0  # past the draft's context from its prompt on
