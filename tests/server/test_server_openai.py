"""`kiln serve` through the official openai client: completions, chat, streaming, n > 1, stop strings, seeds."""

from __future__ import annotations

import pytest

from tests.support.served_llm import serve_llm

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(llm):
    with serve_llm(llm, engine=llm.engine, api_key="sk-test") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="sk-test", timeout=60, max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]


def test_completion_matches_the_engine_greedy_output(client, llm):
    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling_params import SamplingParams

    r = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    ref = Engine(llm.step_model, llm.tokenizer, llm.loaded.model, num_blocks=64)
    ref.add_request("Hello", SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    want = ref.run()[0].outputs[0]
    choice = r.choices[0]
    assert choice.token_ids == want.token_ids and choice.text == want.text and choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 7, 12)
    assert r.object == "text_completion" and r.model == "tiny-llama"


def test_completion_from_token_ids(client):
    r = client.completions.create(model="tiny-llama", prompt=[72, 105, 33], max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 4


def test_chat_uses_the_template_and_answers_as_assistant(client, llm):
    from kiln.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=5, temperature=0)
    prompt = ChatTemplate(DEFAULT_CHAT_TEMPLATE).render(msgs)
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n"
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 5
    assert r.object == "chat.completion"


def test_streaming_completion_concatenates_to_the_whole_text(client):
    kw = dict(model="tiny-llama", prompt="Once upon", max_tokens=12, temperature=0)
    whole = client.completions.create(**kw, extra_body={"return_token_ids": True})
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in body) == whole.choices[0].text
    assert [t for c in body for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    assert body[-1].choices[0].finish_reason == "length" and len(body) > 1


def test_streaming_chat_starts_with_the_role_and_ends_with_a_reason(client):
    stream = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hey"}],
                                            max_tokens=6, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_n_choices_with_a_seed_are_distinct_and_reproducible(client):
    kw = dict(model="tiny-llama", prompt="abc", max_tokens=10, temperature=1.0, n=3, seed=7,
              extra_body={"return_token_ids": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    ids = [c.token_ids for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and len(set(map(tuple, ids))) == 3
    assert ids == [c.token_ids for c in b.choices]
    assert a.usage.prompt_tokens == 3 and a.usage.completion_tokens == 30


def test_same_seed_same_text_other_seed_other_text(client):
    def run(seed: int) -> str:
        r = client.completions.create(model="tiny-llama", prompt="The", max_tokens=16, temperature=1.0, seed=seed,
                                      extra_body={"return_token_ids": True})
        return r.choices[0].token_ids

    assert run(3) == run(3) and run(3) != run(4)


def test_stop_string_ends_generation_and_is_trimmed(client):
    base = client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=24, temperature=0)
    text = base.choices[0].text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    r = client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.index(stop)]


def _engine_logprobs(llm, prompt: str, max_tokens: int, logprobs: int):
    """Token ids and {token_id: logprob value} per token from a fresh engine, for the same greedy request."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling_params import SamplingParams

    ref = Engine(llm.step_model, llm.tokenizer, llm.loaded.model, num_blocks=64)
    ref.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs))
    out = ref.run()[0].outputs[0]
    return out.token_ids, [{t: v.logprob for t, v in d.items()} for d in out.logprobs]


def test_completion_logprobs_equal_the_engine_streamed_or_not(client, llm):
    ids, want = _engine_logprobs(llm, "Hello", 5, 3)
    kw = dict(model="tiny-llama", prompt="Hello", max_tokens=5, temperature=0, logprobs=3,
              extra_body={"ignore_eos": True})
    lp = client.completions.create(**kw).choices[0].logprobs
    tok = [llm.tokenizer.decode([t]) for t in ids]
    assert lp.tokens == tok
    assert lp.token_logprobs == pytest.approx([d[t] for t, d in zip(ids, want, strict=True)], abs=1e-5)
    assert lp.text_offset == [sum(len(x) for x in tok[:i]) for i in range(len(tok))]
    for got, d in zip(lp.top_logprobs, want, strict=True):
        top = {}
        for t, v in d.items():  # keyed by text, the first (most likely) of tokens that decode alike wins
            top.setdefault(llm.tokenizer.decode([t]), v)
        assert len(d) == 3 and got == pytest.approx(top, abs=1e-5)
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True) if c.choices]
    chunks = [c for c in chunks if c is not None]
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    assert [v for c in chunks for v in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset
    assert [list(d) for c in chunks for d in c.top_logprobs] == [list(d) for d in lp.top_logprobs]


def test_chat_logprobs_equal_the_engine_streamed_or_not(client, llm):
    from kiln.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate

    msgs = [{"role": "user", "content": "Hi!"}]
    ids, want = _engine_logprobs(llm, ChatTemplate(DEFAULT_CHAT_TEMPLATE).render(msgs), 4, 2)
    kw = dict(model="tiny-llama", messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(content) == 4
    for entry, t, d in zip(content, ids, want, strict=True):
        text = llm.tokenizer.decode([t])
        assert (entry.token, entry.bytes) == (text, list(llm.tokenizer.token_bytes(t)))
        assert entry.logprob == pytest.approx(d[t], abs=1e-5)
        assert [(e.token, e.bytes) for e in entry.top_logprobs] == [
            (llm.tokenizer.decode([k]), list(llm.tokenizer.decode([k]).encode())) for k in list(d)[:2]]
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(list(d.values())[:2], abs=1e-5)
    streamed = [e for c in client.chat.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    # the second request reuses the prompt's KV from the prefix cache: equal up to float rounding
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_no_logprobs_unless_asked(client):
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, temperature=0)
    c = client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None and c.choices[0].logprobs is None


def test_wrong_key_is_401(server):
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_penalties_logit_bias_and_min_tokens_reach_the_engine(client, llm):
    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling_params import SamplingParams

    r = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=12, temperature=0,
                                  presence_penalty=1.5, frequency_penalty=0.5, logit_bias={"65": 3, "342": -2},
                                  extra_body={"min_tokens": 3, "return_token_ids": True})
    ref = Engine(llm.step_model, llm.tokenizer, llm.loaded.model, num_blocks=64)
    ref.add_request("Hello", SamplingParams(temperature=0, max_tokens=12, presence_penalty=1.5, frequency_penalty=0.5,
                                            logit_bias={65: 3.0, 342: -2.0}, min_tokens=3))
    want = ref.run()[0].outputs[0]
    assert r.choices[0].token_ids == want.token_ids and r.choices[0].text == want.text
    plain = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert plain.choices[0].token_ids != want.token_ids  # the fields took effect
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0.9, seed=1, logit_bias={"65": 100})
    assert chat.choices[0].message.content == "AAAA"  # id 65 is "A" in the byte-level vocabulary


def test_n_choices_match_the_python_api_with_penalties(client, llm):
    from kiln import SamplingParams
    from kiln.runtime.engine import Engine

    r = client.completions.create(model="tiny-llama", prompt="abc", max_tokens=6, temperature=1.0, n=2, seed=9,
                                  frequency_penalty=1.0, extra_body={"ignore_eos": True, "return_token_ids": True})
    mine = SamplingParams(n=2, seed=9, temperature=1.0, max_tokens=6, ignore_eos=True, frequency_penalty=1.0)
    # SamplingParams.choices() is the server's fan-out too; llm.engine is the server's, so a second engine runs them
    e = Engine(llm.step_model, llm.tokenizer, llm.loaded.model, num_blocks=64)
    rids = [e.add_request("abc", p) for p in mine.choices()]
    done = {o.request_id: o.outputs[0].token_ids for o in e.run()}
    assert [c.token_ids for c in r.choices] == [done[rid] for rid in rids]
