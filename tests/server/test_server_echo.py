"""Completions' echo and vLLM's prompt_logprobs through `kiln serve`, as lm-evaluation-harness and vLLM clients read
them: echo puts the prompt's text (and, with logprobs, its tokens' entries, the first one null) before the output's;
max_tokens 0 returns the prompt alone; the prompt_logprobs field holds vLLM's {id: {logprob, rank, decoded_token}}.
Values are checked against the engine's own prompt_logprobs (tests/runtime/test_prompt_logprobs*.py check those)."""

from __future__ import annotations

import json

import pytest

from kiln.runtime.sampling_params import SamplingParams

httpx = pytest.importorskip("httpx")

GREEDY = {"model": "tiny-llama", "temperature": 0, "ignore_eos": True}


def post(url: str, body: dict, path: str = "/v1/completions") -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def events(url: str, body: dict) -> list[dict]:
    r = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def scored(llm, ids: list[int], k: int, ranks: bool = False) -> list:
    """The engine's prompt_logprobs for these ids: {id: value} (with ranks: {id: rank}) per position."""
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    lps = llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0].prompt_logprobs
    return [None if d is None else {t: v.rank if ranks else v.logprob for t, v in d.items()} for d in lps]


def close(a: float, b: float) -> bool:
    return abs(a - b) < 1e-5


def test_echo_with_max_tokens_0_is_the_prompt_scored_as_lm_eval_reads_it(url, llm):
    """lm-evaluation-harness's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 0; it sums
    token_logprobs[ctxlen:] and calls the continuation greedy when each token's logprob is its top_logprobs' max."""
    ctx, cont = llm.tokenizer.encode("The cat"), llm.tokenizer.encode(" sat")
    prompts = [ctx + cont, llm.tokenizer.encode("Hello there")]
    r = post(url, {**GREEDY, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert r["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 0,
                          "total_tokens": sum(map(len, prompts))}
    for choice, ids in zip(r["choices"], prompts, strict=True):
        ref = scored(llm, ids, 1)
        lp = choice["logprobs"]
        assert choice["text"] == llm.tokenizer.decode(ids) and choice["finish_reason"] == "length"
        assert choice["stop_reason"] is None
        assert lp["tokens"] == [llm.tokenizer.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
        for i in range(1, len(ids)):
            assert close(lp["token_logprobs"][i], ref[i][ids[i]])
            top = lp["top_logprobs"][i]
            best = max(ref[i], key=ref[i].get)
            assert set(top) == {llm.tokenizer.decode([t]) for t in (best, ids[i])}
            assert close(max(top.values()), ref[i][best])
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(choice["text"])
        # vLLM also fills its prompt_logprobs field here (echo makes the engine score the prompt)
        assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(ids)
    lp = r["choices"][0]["logprobs"]
    n = len(ctx)
    want = scored(llm, prompts[0], 1)
    assert close(sum(lp["token_logprobs"][n:]), sum(want[i][prompts[0][i]] for i in range(n, len(prompts[0]))))
    greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][n:], lp["top_logprobs"][n:],
                                                          strict=True))
    assert greedy == all(max(want[i], key=want[i].get) == prompts[0][i] for i in range(n, len(prompts[0])))


def test_echo_with_generation_puts_the_prompt_before_the_output(url, llm):
    body = {**GREEDY, "prompt": "Once upon", "logprobs": 2, "max_tokens": 4}
    plain = post(url, body)["choices"][0]
    echoed = post(url, {**body, "echo": True, "n": 2})
    ids = llm.tokenizer.encode("Once upon")
    ref = scored(llm, ids, 2)
    assert echoed["usage"]["completion_tokens"] == 8
    for choice in echoed["choices"]:
        lp, base = choice["logprobs"], plain["logprobs"]
        assert choice["text"] == "Once upon" + plain["text"]
        assert lp["tokens"] == [llm.tokenizer.decode([t]) for t in ids] + base["tokens"]
        # the same tokens' logprobs (a batch of two rounds differently in the last bits)
        assert all(close(a, b) for a, b in zip(lp["token_logprobs"][len(ids):], base["token_logprobs"], strict=True))
        assert [list(t) for t in lp["top_logprobs"][len(ids):]] == [list(t) for t in base["top_logprobs"]]
        assert [close(a, ref[i][t]) for i, (a, t) in enumerate(zip(lp["token_logprobs"][1:len(ids)], ids[1:],
                                                                    strict=True), 1)] == [True] * (len(ids) - 1)
        assert all(len(top) <= 3 for top in lp["top_logprobs"][1:])  # the top 2 and the token itself
        # offsets run on from the prompt's text into the output's
        assert lp["text_offset"][len(ids):] == [o + len("Once upon") for o in base["text_offset"]]
    without = post(url, {**body, "logprobs": None, "echo": True})["choices"][0]
    assert without["text"] == "Once upon" + plain["text"] and without["logprobs"] is None
    assert "prompt_logprobs" not in without


def test_streamed_echo_adds_up_to_the_whole_body(url):
    for max_tokens in (0, 5):
        body = {**GREEDY, "prompt": "Hi there", "echo": True, "logprobs": 1, "max_tokens": max_tokens}
        whole = post(url, body)["choices"][0]
        chunks = [e["choices"][0] for e in events(url, body) if e["choices"]]
        assert chunks[0]["text"].startswith("Hi there") and chunks[-1]["finish_reason"] == whole["finish_reason"]
        assert "".join(c["text"] for c in chunks) == whole["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]] == whole["logprobs"][key], key
        if max_tokens == 0:
            assert len(chunks) == 1 and whole["text"] == "Hi there" and whole["finish_reason"] == "length"


def test_prompt_logprobs_field_is_vllms(url, llm):
    ids = llm.tokenizer.encode("Hello world")
    r = post(url, {**GREEDY, "prompt": "Hello world", "max_tokens": 2, "prompt_logprobs": 3})
    field = r["choices"][0]["prompt_logprobs"]
    ref = scored(llm, ids, 3)
    ranks = scored(llm, ids, 3, ranks=True)
    assert field[0] is None and len(field) == len(ids)
    for i in range(1, len(ids)):
        entry, tok = field[i], str(ids[i])
        assert tok in entry and len(entry) in (3, 4)
        assert next(iter(entry)) == tok  # the prompt token first, as vLLM v1
        tops = sorted(((t, e) for t, e in entry.items() if e["rank"] <= 3), key=lambda te: te[1]["rank"])
        top3 = sorted((r, t) for t, r in ranks[i].items() if r <= 3)
        assert [e["rank"] for _, e in tops] == [1, 2, 3] and [int(t) for t, _ in tops] == [t for _, t in top3]
        assert all(close(e["logprob"], ref[i][int(t)]) and e["decoded_token"] == llm.tokenizer.decode([int(t)])
                   for t, e in entry.items())
        assert all(e["rank"] == ranks[i][int(t)] for t, e in entry.items()) and entry[tok]["rank"] >= 1
    assert r["choices"][0]["logprobs"] is None and r["usage"]["completion_tokens"] == 2
    # echo's logprobs show logprobs' count even when prompt_logprobs asks the engine for more
    body = {**GREEDY, "prompt": "Hello world", "max_tokens": 0, "echo": True, "logprobs": 1}
    both, echo = post(url, {**body, "prompt_logprobs": 3})["choices"][0], post(url, body)["choices"][0]
    assert [list(t or ()) for t in both["logprobs"]["top_logprobs"]] == \
        [list(t or ()) for t in echo["logprobs"]["top_logprobs"]]
    assert max(len(t) for t in echo["logprobs"]["top_logprobs"][1:]) == 2
    assert [len(e) >= 3 for e in both["prompt_logprobs"][1:]] == [True] * (len(ids) - 1)
    assert [len(e) <= 2 for e in echo["prompt_logprobs"][1:]] == [True] * (len(ids) - 1)
    chat = post(url, {**GREEDY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                      "prompt_logprobs": 0}, "/v1/chat/completions")
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 and e[next(iter(e))]["rank"] >= 1 for e in chat["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in chat["choices"][0]
    assert "prompt_logprobs" not in post(url, {**GREEDY, "prompt": "Hello", "max_tokens": 1})["choices"][0]


def test_echo_with_max_tokens_0_of_a_prompt_that_fills_the_context_names_what_the_client_sent(url, llm):
    """max_tokens 0 still samples one hidden token: a prompt as long as the context is refused for that, not for a
    'max_tokens 1' the client never sent."""
    ctx = llm.loaded.model.context
    r = httpx.post(f"{url}/v1/completions", json={**GREEDY, "prompt": [7] * ctx, "echo": True, "max_tokens": 0},
                   timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "echo with max_tokens 0 still computes one token after the prompt" in err["message"]
    assert "max_tokens 1" not in err["message"]
    assert post(url, {**GREEDY, "prompt": [7] * (ctx - 1), "echo": True, "max_tokens": 0})["choices"][0]["text"]
