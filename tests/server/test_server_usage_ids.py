"""vLLM's stream_options.continuous_usage_stats (with include_usage, every chunk carries its choice's usage so far)
and return_token_ids' prompt_token_ids (completions: on each choice, streamed on its first chunk; chat: on the
response, streamed on the role chunks)."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")

GREEDY = {"model": "tiny-llama", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
MSGS = [{"role": "user", "content": "Hi"}]


def _events(url: str, path: str, body: dict) -> list[dict]:
    r = httpx.post(f"{url}{path}", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.text.endswith("data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def _tokens(url: str, **body) -> list[int]:
    return httpx.post(f"{url}/tokenize", json=body, timeout=60).json()["tokens"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_counts_each_choice_so_far(url, path):
    chat = path.endswith("chat/completions")
    body = {
        **GREEDY,
        "n": 2,
        "seed": 1,
        "temperature": 1.0,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    body.update({"messages": MSGS} if chat else {"prompt": ["Hi", "Hello there"]})
    events = _events(url, path, body)
    *chunks, last = events
    prompts = [_tokens(url, messages=MSGS)] if chat else [_tokens(url, prompt=p) for p in body["prompt"]]
    so_far: dict[int, int] = {}
    for e in chunks:
        (choice,) = e["choices"]
        i = choice["index"]
        opening = chat and "role" in choice["delta"]
        so_far[i] = so_far.get(i, 0) + len(choice["token_ids"])
        prompt = len(prompts[i // 2])
        done = 0 if opening else so_far[i]
        assert e["usage"] == {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}, e
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == sum(so_far.values())
    assert last["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert len(so_far) == (2 if chat else 4) and set(so_far.values()) == {5}


def test_continuous_usage_stats_needs_include_usage_as_in_vllm(url):
    events = _events(
        url, "/v1/completions", {**GREEDY, "prompt": "Hi", "stream_options": {"continuous_usage_stats": True}}
    )
    assert all("usage" not in e for e in events)
    events = _events(url, "/v1/completions", {**GREEDY, "prompt": "Hi", "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 5


def test_completions_return_prompt_token_ids_per_choice(url):
    prompts = ["Hi", "Hello there"]
    ids = [_tokens(url, prompt=p) for p in prompts]
    r = httpx.post(
        f"{url}/v1/completions", json={**GREEDY, "prompt": prompts, "n": 2, "return_token_ids": True}, timeout=60
    ).json()
    assert [c["prompt_token_ids"] for c in r["choices"]] == [ids[0], ids[0], ids[1], ids[1]]
    assert all(len(c["token_ids"]) == 5 for c in r["choices"])
    events = _events(url, "/v1/completions", {**GREEDY, "prompt": prompts, "return_token_ids": True})
    seen: dict[int, list] = {}
    for e in events:
        (choice,) = e["choices"]
        seen.setdefault(choice["index"], []).append(choice["prompt_token_ids"])
    # vLLM's: the first chunk of each choice carries its prompt's ids, the later ones null
    assert {i: v[0] for i, v in seen.items()} == {0: ids[0], 1: ids[1]}
    assert all(x is None for v in seen.values() for x in v[1:]) and all(len(v) > 1 for v in seen.values())
    by_ids = httpx.post(
        f"{url}/v1/completions", json={**GREEDY, "prompt": [[5, 6, 7]], "return_token_ids": True}, timeout=60
    ).json()
    assert by_ids["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    plain = httpx.post(f"{url}/v1/completions", json={**GREEDY, "prompt": "Hi"}, timeout=60).json()
    assert "prompt_token_ids" not in plain["choices"][0] and "token_ids" not in plain["choices"][0]


def test_chat_returns_prompt_token_ids_on_the_response(url):
    ids = _tokens(url, messages=MSGS)
    r = httpx.post(
        f"{url}/v1/chat/completions", json={**GREEDY, "messages": MSGS, "return_token_ids": True}, timeout=60
    ).json()
    assert r["prompt_token_ids"] == ids and r["usage"]["prompt_tokens"] == len(ids)
    assert "prompt_token_ids" not in r["choices"][0]
    events = _events(
        url,
        "/v1/chat/completions",
        {**GREEDY, "messages": MSGS, "n": 2, "seed": 3, "temperature": 1.0, "return_token_ids": True},
    )
    roles = [e for e in events if "role" in e["choices"][0]["delta"]]
    assert len(roles) == 2 and all(e["prompt_token_ids"] == ids for e in roles)
    assert all("prompt_token_ids" not in e for e in events if e not in roles)
    plain = httpx.post(f"{url}/v1/chat/completions", json={**GREEDY, "messages": MSGS}, timeout=60).json()
    assert "prompt_token_ids" not in plain
